"""The `rollkeep serve` process: load the model, bind, serve with uvicorn until a signal
(or the parent's death with `exit_with_parent`), then stop cleanly (docs/server-mode.md).

Start-up, in order (every refusal happens before anything listens): check the options,
load the model into an HFEngine, bind and listen on HOST:PORT (port 0: a free one),
start uvicorn on that socket; then announce — one line on stdout and the port written to
`port_file` (atomically: a reader sees no file or the whole port). Stop: SIGINT, SIGTERM
or the parent gone makes uvicorn stop accepting, every live request is aborted (streams
end with "abort"), connections close, the engine's worker is joined, the port file is removed, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from ..core.errors import UserInputError


@dataclass(frozen=True)
class Options:
    model_dir: str
    flavor: str  # "vllm" | "sglang"
    host: str
    port: int  # 0: a free one
    served_model_name: str | None
    max_batch_size: int
    port_file: str | None
    exit_with_parent: bool


def check(o: Options) -> None:
    """Refuse bad options before any work (UserInputError: exit 2)."""
    from .app import FLAVORS

    if o.flavor not in FLAVORS:
        raise UserInputError(f"unknown flavor {o.flavor!r}", field="--flavor", expected=" or ".join(FLAVORS),
                             found=o.flavor, remedy="pass --flavor vllm or --flavor sglang")
    if not 0 <= o.port <= 65535:
        raise UserInputError("the port is out of range", field="--port", expected="0 to 65535 (0: a free port)",
                             found=str(o.port), remedy="pass a port such as 8101, or 0")
    if o.max_batch_size < 1:
        raise UserInputError("the batch size must be at least 1", field="--max-batch-size",
                             expected="an integer >= 1", found=str(o.max_batch_size), remedy="pass e.g. 32")
    if o.port_file is not None and not Path(o.port_file).expanduser().resolve().parent.is_dir():
        raise UserInputError("the port file's directory does not exist", field="--port-file",
                             path=o.port_file, expected="a path in an existing directory", found="no such directory",
                             remedy="create the directory first, or pass another path")


def serve(o: Options) -> int:
    check(o)
    parent = os.getppid()
    from ..engines.hf import HFEngine
    from .app import build_app
    from .body import Limits
    from .http import Served
    from .service import Service

    engine = HFEngine(model_path=o.model_dir, temperature=1.0, top_p=1.0, max_new_tokens=1 << 30,
                      chat_template=False, max_batch_size=o.max_batch_size, field="MODEL_DIR")
    try:
        sock = _listen(o.host, o.port)
    except BaseException:
        asyncio.run(engine.close())
        raise
    port = sock.getsockname()[1]
    served = Served(
        name=o.served_model_name or o.model_dir, model_dir=o.model_dir, tokenizer=engine.tokenizer,
        limits=Limits(vocab=engine.model.get_input_embeddings().num_embeddings, context=engine.completion_limit.context),
        eos=engine.tokenizer.eos_token_id, max_batch_size=o.max_batch_size,
    )
    host = f"[{o.host}]" if ":" in o.host else o.host

    def announce() -> None:
        print(f"rollkeep serve: listening on http://{host}:{port} (flavor {o.flavor}, model {o.model_dir})",
              flush=True)
        if o.port_file is not None:
            _write_atomically(Path(o.port_file).expanduser(), f"{port}\n")

    async def main() -> str:
        service = Service(engine)
        server = _Server(build_app(service, o.flavor, served), announce=announce, stopping=service.abort_where,
                         parent=parent if o.exit_with_parent else None)
        try:
            await server.serve(sockets=[sock])
        finally:
            await service.close_engine()
        return server.stopped_by

    why = asyncio.run(main())
    if o.port_file is not None:  # a stopped server leaves no port to connect to
        with contextlib.suppress(OSError):
            if Path(o.port_file).expanduser().read_text() == f"{port}\n":
                Path(o.port_file).expanduser().unlink()
    print(f"rollkeep serve: stopped ({why})", file=sys.stderr, flush=True)
    return 0


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise UserInputError(f"cannot listen on {host}:{port}", field="--host", expected="an address of this machine",
                             found=str(e), remedy="pass --host 127.0.0.1 (the default) or another local address") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise UserInputError(f"cannot listen on {host}:{port}", field="--port", expected="a free port on a local address",
                             found=str(e), remedy="pick another --port, or --port 0 for a free one") from e
    sock.set_inheritable(False)
    return sock


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Server(uvicorn.Server):
    """uvicorn, announcing once it serves, aborting live requests when it stops, and
    stopping on SIGINT/SIGTERM (a second one: at once) or when the parent is gone, with
    exit status 0 rather than re-raising the signal."""

    def __init__(self, app, *, announce: Callable[[], None], stopping: Callable[[None], int],
                 parent: int | None) -> None:
        super().__init__(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=5))
        self._announce, self._stopping, self._parent = announce, stopping, parent
        self.stopped_by = "?"

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            self._announce()

    async def on_tick(self, counter: int) -> bool:
        if self._parent is not None and os.getppid() != self._parent and not self.should_exit:
            self.stopped_by, self.should_exit = "the parent process exited", True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        self._stopping(None)  # every live request ends now, with "abort"
        await super().shutdown(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame) -> None:
        if self.should_exit:
            self.force_exit = True
        else:
            self.stopped_by, self.should_exit = signal.Signals(sig).name, True
