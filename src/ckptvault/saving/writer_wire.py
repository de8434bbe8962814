"""Messages between a training process and its writer process: framed JSON.

Each message is an 8-byte big-endian length and that many bytes of UTF-8 JSON,
parsed with the bounded loader. Nothing is pickled: the writer process runs no code
that a message names, and a process on the other end of the socket can only send
values that are checked like any other input.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from ckptvault.errors import FormatError
from ckptvault.format.bounded_json import MAX_DOCUMENT_DEPTH, loads_bounded

MAX_MESSAGE = 1 << 30  # a state tree of a very large model stays far below this
_HEADER = struct.Struct(">Q")


class PeerGone(EOFError):
    """The other process closed its end (it exited or died)."""


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive(sock: socket.socket, what: str) -> dict[str, Any]:
    """The next message; :class:`PeerGone` when the other end closed."""
    (size,) = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
    if size > MAX_MESSAGE:
        raise FormatError(f"{what}: a {size}-byte message, more than the {MAX_MESSAGE} allowed")
    value = loads_bounded(_read_exactly(sock, size), what, max_depth=MAX_DOCUMENT_DEPTH + 8)
    if not isinstance(value, dict):
        raise FormatError(f"{what}: a message must be a JSON object")
    return value


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 24))
        if not chunk:
            raise PeerGone("the other process closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
