"""Where generation runs (docs/design.md §10): `cluster.backend: local`, one engine inside
the controller's process; `ray`, `engine.replicas` engine replicas as Ray actors behind
one `EnginePool` the runner drives like any engine (server mode, `engine.name: remote`, puts
its HTTP servers behind the same pool: `rollkeep.remote`).

  replicas.py    each replica's state machine and the routing rule (sans-IO)
  pool.py        the pool: routes attempts, publishes weights, survives replica deaths
  ray_actors.py  the Ray actor holding one engine, and the pool's handle of it
  local_ray.py   the run's own local Ray: started by the run, never outliving it
  reaper.py      its watchdog, a process of its own (standard library only)
  weightdirs.py  RUN_DIR/weights/v<N>/: weights published atomically in the source model's
                 layout, for servers to load (server mode); verify, load, retain
"""

from __future__ import annotations

from typing import Any

from ..engines import Engine, EngineRecipe
from .pool import EnginePool
from .replicas import ReplicaGone

__all__ = ["EnginePool", "ReplicaGone", "open_engine"]


def open_engine(cfg: Any, recipe: EngineRecipe) -> Engine:
    """The run's engine: built here (`local`), or a pool of Ray actors that start when the
    runner opens it (`ray`; Ray is connected to, or started, now)."""
    if cfg.engine.name == "remote":  # server mode: the servers run elsewhere
        from pathlib import Path

        from ..remote import remote_pool

        return remote_pool(cfg.engine, run_dir=Path(cfg.run_dir), source_dir=cfg.trainer.model_path)
    if cfg.cluster.backend == "local":
        return recipe.make()
    from .ray_actors import ray_pool

    return ray_pool(cfg.cluster, recipe, replicas=cfg.engine.replicas, flush_s=cfg.recovery.progress_ms / 1000)
