"""The cluster's config: what start-up refuses before anything runs (exit 2)."""

from __future__ import annotations

import builtins

import pytest
from run_harness import DEFAULTS, FAST

from rollkeep.cli import main
from rollkeep.config import load_config, semantic


def test_more_than_one_replica_on_the_local_backend_names_cluster_backend_ray(tmp_path, capsys) -> None:
    code = main(["train", DEFAULTS, *FAST, f"run_dir={tmp_path / 'run'}", "engine.replicas=2"])
    err = capsys.readouterr().err
    assert code == 2 and "cluster.backend=ray" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_ray_not_installed_is_exit_2_with_the_install_command(tmp_path, capsys, monkeypatch) -> None:
    real = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    code = main(["train", DEFAULTS, *FAST, f"run_dir={tmp_path / 'run'}", "cluster.backend=ray"])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'rollkeep[ray]'" in err and "Traceback" not in err


@pytest.mark.parametrize("bad", ["engine.replicas=0", "engine.replicas=-1", "cluster.backend=slurm",
                                 "cluster.replica_timeout_s=0", "cluster.max_restarts=-1",
                                 "cluster.replica_cpus=-0.5", "cluster.num_cpus=0", "cluster.address=7"])
def test_hostile_cluster_values_are_exit_2(tmp_path, capsys, bad) -> None:
    code = main(["train", DEFAULTS, *FAST, f"run_dir={tmp_path / 'run'}", bad])
    err = capsys.readouterr().err
    assert code == 2 and bad.split("=")[0] in err and "Traceback" not in err


def test_replicas_and_the_cluster_are_not_semantic(tmp_path) -> None:
    """A run resumes on any number of replicas, local or on Ray (elastic restore)."""
    one = load_config(None, [*FAST, f"run_dir={tmp_path}"])
    many = load_config(None, [*FAST, f"run_dir={tmp_path}", "cluster.backend=ray", "engine.replicas=4",
                              "cluster.address=127.0.0.1:6379", "cluster.max_restarts=9"])
    assert semantic(one) == semantic(many)


def test_a_cluster_address_nothing_answers_at_is_exit_2_at_once(tmp_path, capsys) -> None:
    import socket

    pytest.importorskip("ray")
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        code = main(["train", DEFAULTS, *FAST, f"run_dir={tmp_path / 'run'}", "cluster.backend=ray",
                     f"cluster.address=127.0.0.1:{port}"])
    err = capsys.readouterr().err
    assert code == 2 and "nothing answers at cluster.address" in err and "Traceback" not in err
