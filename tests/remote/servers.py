"""`rollkeep serve` processes for the server-mode tests: started on a free loopback port,
waited for on their port file (never a fixed sleep), killed at teardown, and exiting by
themselves if the test process dies (`--exit-with-parent`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Server:
    def __init__(self, model_dir: Path, workdir: Path, *, flavor: str = "vllm", port: int = 0) -> None:
        self.model_dir, self.flavor = model_dir, flavor
        self.port_file = workdir / f"port-{time.monotonic_ns()}"
        self.log = open(workdir / f"serve-{self.port_file.name}.log", "wb")  # noqa: SIM115 (closed by stop)
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollkeep", "serve", str(model_dir), "--flavor", flavor, "--host", "127.0.0.1",
             "--port", str(port), "--port-file", str(self.port_file), "--exit-with-parent"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 120
        while not self.port_file.exists():  # written atomically once it listens
            if self.proc.poll() is not None:
                raise RuntimeError(f"rollkeep serve exited {self.proc.returncode}: {self.output()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"rollkeep serve did not listen within 120 s: {self.output()}")
            time.sleep(0.05)
        self.port = int(self.port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-2000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        try:
            self.kill()
        finally:
            self.log.close()
