"""One local Ray for the whole test session (a start costs seconds): a head process that
every run connects to with `cluster.address`. It runs in a child of its own, not in the
test process, because the runs are forked from the test process and a forked Ray driver
is broken. The Ray tests share an xdist group (`make test` runs `--dist loadgroup`), so one
worker starts it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HEAD = """
import sys, ray
ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the session closes our stdin
ray.shutdown()
"""


@pytest.fixture(scope="session")
def ray_address():
    pytest.importorskip("ray")
    # The head and the runs share this machine and nothing else: no token to hand around.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    head = subprocess.Popen([sys.executable, "-c", HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        address = head.stdout.readline().strip()
        assert address, "the Ray head did not start"
        yield address
    finally:
        head.stdin.close()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
