"""Engine replicas as Ray actors (`cluster.backend: ray`, docs/design.md §10).

Each replica is one actor in its own process, holding one engine of any backend built
there from the run's `EngineRecipe`. The actor is async. For a run that records partial
generations, `generate` is a streaming generator: it yields the engine's chunks, joined
over `recovery.progress_ms` (the scheduler records them no more often; one Ray object per
token would cost more than the token), and then the completion, so partial generations
stay durable across processes as in one. Otherwise `generate_once` returns the result alone. Engine
failures travel as values (`("infra" | "data", message)`), not as exceptions, so nothing
of Ray's exception wrapping decides what kind a failure is.

Ray restarts a dead actor (`max_restarts`); Ray's own task retries are off
(`max_task_retries=0`): a retry outside custody could run an attempt twice. A call on an
actor that died raises `RayActorError`, which the handle turns into `ReplicaLost`; the
pool fails the attempt as infra and refits the restarted actor before it gets work.

Ray is imported only here, only when the config selects it.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from ..core.errors import ConfigError
from ..core.rollout.generation import Chunk, Completion, DataError, GenRequest, InfraError
from ..engines import EngineRecipe
from ..engines.base import capabilities_of
from ..engines.dtypes import cast_weights, transfer_dtype
from .local_ray import LocalRay
from .pool import EnginePool
from .replicas import ReplicaGone, ReplicaInfo, ReplicaLost

INSTALL = "pip install 'rollkeep[ray]'"


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ConfigError(
            "cluster.backend is ray but Ray is not installed", field="cluster.backend", expected="the ray extra",
            found=f"import ray failed: {e}", remedy=f"{INSTALL} (or set cluster.backend=local)") from None
    return ray


def ray_pool(cluster: Any, recipe: EngineRecipe, *, replicas: int, flush_s: float) -> EnginePool:
    """Connect to Ray (start a local one, loopback only, when `cluster.address` is unset:
    `local_ray.LocalRay`, which the pool's close stops) and make the pool of `replicas`
    actors; they start in `EnginePool.open`."""
    ray = import_ray()
    on_close = None  # a Ray this run did not start or connect to is not its to stop
    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
        if cluster.address is None:
            on_close = LocalRay(ray, num_cpus=cluster.num_cpus, include_dashboard=False,
                                _node_ip_address="127.0.0.1", log_to_driver=True, configure_logging=False).stop
        else:
            _check_reachable(cluster.address)
            try:
                ray.init(address=cluster.address, log_to_driver=True, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ConfigError(
                    f"cannot connect to the Ray cluster at {cluster.address}", field="cluster.address",
                    expected="the address of a running cluster (`ray start --head` prints it)",
                    found=f"{type(e).__name__}: {e}"[:500],
                    remedy="start the cluster first, fix cluster.address, or unset it to start a local Ray") from None
            on_close = ray.shutdown  # (it disconnects: the cluster goes on)
    gpus = cluster.replica_gpus
    if gpus is None:
        gpus = float(getattr(recipe.section, "tensor_parallel_size", 0)) if recipe.section.name == "vllm" else 0.0
    actor_cls = ray.remote(num_cpus=cluster.replica_cpus, num_gpus=gpus, max_restarts=cluster.max_restarts,
                           max_task_retries=0, max_concurrency=1000)(ReplicaActor)
    handles = [RayReplica(ray, actor_cls, recipe, i, flush_s) for i in range(replicas)]
    # Published in the replicas' dtype when it is a 16-bit one known now (`engines.dtypes`):
    # half the bytes through the object store, the same values once loaded.
    dtype = transfer_dtype(recipe.section, recipe.context)
    return EnginePool(handles, publish=lambda weights, version: ray.put(cast_weights(weights, dtype)),
                      max_restarts=cluster.max_restarts,
                      replica_timeout_s=cluster.replica_timeout_s, on_close=on_close)


def _check_reachable(address: str) -> None:
    """Refuse a `host:port` nothing listens on at once: Ray itself retries it for minutes."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or address.startswith(("ray://", "auto")):
        return  # `auto` or a client address: Ray resolves and reports it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise ConfigError(
            f"nothing answers at cluster.address {address}", field="cluster.address",
            expected="the address of a running Ray cluster's head (`ray start --head` prints it, e.g. 127.0.0.1:6379)",
            found=f"{type(e).__name__}: {e}", remedy="start the cluster first, fix cluster.address, or unset it to "
            "start a local Ray") from None


class RayReplica:
    """The pool's handle of one actor (`replicas.ReplicaHandle`)."""

    def __init__(self, ray: Any, actor_cls: Any, recipe: EngineRecipe, index: int, flush_s: float) -> None:
        self._ray, self._cls, self._recipe, self.index, self._flush_s = ray, actor_cls, recipe, index, flush_s
        self._actor: Any = None

    async def start(self) -> ReplicaInfo:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        if self._actor is None:
            self._actor = self._cls.options(name=None).remote(self._recipe, self.index)
        while True:
            try:
                # Ray holds a call to a restarting actor until it is back up.
                return await self._actor.describe.remote()
            except ActorUnavailableError:
                await asyncio.sleep(0.05)  # (a transient: the connection to a restarting actor)
            except (ActorDiedError, RayActorError) as e:
                raise ReplicaGone(_reason(e)) from None

    async def generate(self, request: GenRequest, progress: Any) -> Completion:
        from ray.exceptions import RayActorError

        if progress is None:
            call = self._actor.generate_once.remote(request)
            items = _one(call)
        else:
            call = self._actor.generate.options(num_returns="streaming").remote(request, self._flush_s)
            items = call
        try:
            async for ref in items:
                kind, value = await ref
                if kind == "chunk":
                    progress(value)
                elif kind == "done":
                    return value
                else:
                    raise (InfraError if kind == "infra" else DataError)(value)
        except asyncio.CancelledError:
            self._ray.cancel(call)
            raise
        except RayActorError as e:
            raise ReplicaLost(_reason(e)) from None
        raise InfraError(f"engine replica {self.index}: the stream ended without a result")

    async def refit(self, weights: Any, version: int) -> None:
        from ray.exceptions import RayActorError

        try:
            await self._actor.update_weights.remote(weights, version)
        except RayActorError as e:
            raise ReplicaLost(_reason(e)) from None

    async def close(self) -> None:
        if self._actor is not None:
            self._ray.kill(self._actor, no_restart=True)


async def _one(ref: Any):
    yield ref


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class ReplicaActor:
    """The actor: one engine in this process. Async, so one replica runs many attempts at
    once and its engine batches them as it would in the controller."""

    def __init__(self, recipe: EngineRecipe, index: int) -> None:
        import sys

        self.index = index
        self.engine = recipe.make()
        if "torch" in sys.modules:  # one intra-op thread: replicas share the machine's cores
            import torch

            if not torch.cuda.is_available():
                torch.set_num_threads(1)

    async def describe(self) -> ReplicaInfo:
        import ray

        caps = capabilities_of(self.engine)
        return ReplicaInfo(pid=os.getpid(), node=f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:8]}",
                           streams=caps.streams, continues=caps.continues,
                           episode_tokenizer=caps.episode_tokenizer, completion_limit=caps.completion_limit)

    async def generate_once(self, request: GenRequest) -> tuple[str, Any]:
        try:
            return "done", await self.engine.generate(request)
        except InfraError as e:
            return "infra", str(e)
        except DataError as e:
            return "data", str(e)

    async def generate(self, request: GenRequest, flush_s: float):
        chunks: list[Chunk] = []
        wake = asyncio.Event()

        def progress(chunk: Chunk) -> None:
            chunks.append(chunk)
            wake.set()

        task = asyncio.ensure_future(self.engine.generate(request, progress))
        try:
            while not task.done():
                waiter = asyncio.ensure_future(wake.wait())
                await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if chunks and not task.done():  # what else comes within flush_s joins them
                    await asyncio.wait((task,), timeout=flush_s)
                wake.clear()
                if chunks:
                    yield "chunk", Chunk.joined(chunks)
                    chunks.clear()
            if chunks:
                yield "chunk", Chunk.joined(chunks)
            try:
                yield "done", task.result()
            except InfraError as e:
                yield "infra", str(e)
            except DataError as e:
                yield "data", str(e)
        finally:
            if not task.done():
                task.cancel()  # the controller cancelled the attempt (ray.cancel)

    async def update_weights(self, weights: Any, version: int) -> None:
        await self.engine.update_weights(weights, version)

    async def close(self) -> None:
        await self.engine.close()


