"""The messages between the controller and its trainer ranks: length-prefixed msgpack
frames over a socket pair (no pickle), tensors and rows as raw little-endian bytes.

A request is `{"op": str, ...}`; a reply `{"ok": true, ...}` or `{"ok": false, "error":
"<type>: <text>", "traceback": str}`. The controller sends every rank the same ops in the
same order (their collectives pair up) and waits for every reply before the next op.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import Any

import msgspec
import numpy as np
import torch
from torch import Tensor

from ..core.rollout.rows import Row

__all__ = ["Closed", "Overdue", "pack_row", "pack_tensor", "recv", "send", "unpack_row", "unpack_tensor"]

_LEN = struct.Struct(">Q")
MAX_FRAME = 1 << 40  # a frame longer than this is garbage, not a model
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


class Closed(Exception):
    """The other end closed the socket (its process ended)."""


class Overdue(Exception):
    """No whole frame arrived before the deadline."""


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = _encode(msg)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv(sock: socket.socket, deadline: float | None = None) -> dict[str, Any]:
    """One frame; `deadline` (time.monotonic()) bounds the wait (None: forever)."""
    (n,) = _LEN.unpack(_read(sock, _LEN.size, deadline))
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes")
    msg = _decode(_read(sock, n, deadline))
    if not isinstance(msg, dict):
        raise ValueError(f"a frame holding {type(msg).__name__}, not a message")
    return msg


def _read(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([sock], [], [], left)[0]:
                raise Overdue()
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 22))
        except ConnectionResetError:  # the other end died with data unread
            raise Closed() from None
        if not chunk:
            raise Closed()
        buf += chunk
    return bytes(buf)


def pack_tensor(t: Tensor) -> dict[str, Any]:
    t = t.detach().cpu().contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": t.reshape(-1).view(torch.uint8).numpy().tobytes()}


def unpack_tensor(d: dict[str, Any]) -> Tensor:
    dtype = getattr(torch, d["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {d['dtype']!r}")
    raw = torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8) if d["data"] else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(d["shape"])


def pack_row(row: Row) -> list[Any]:
    return [row.prompt_ids.tobytes(), row.completion_ids.tobytes(), row.logprobs.tobytes(),
            row.versions.tobytes(), row.reward, row.finish_reason]


def unpack_row(d: list[Any]) -> Row:
    p, c, lp, v, reward, finish = d
    return Row(np.frombuffer(p, np.int32), np.frombuffer(c, np.int32), np.frombuffer(lp, np.float32),
               np.frombuffer(v, np.int32), float(reward), finish)
