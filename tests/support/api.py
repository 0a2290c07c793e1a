"""A client connection to gpud's API server for tests that speak the wire protocol themselves."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import ClassVar

import msgpack

from gpud.wire import protocol as wire

GUARD = 10.0  # seconds: only a bound on a hung test, never a timing assertion


class Conn:
    """A client connection speaking the wire protocol. Every one opened is closed by the fixture
    that started the server (close_all), also when the test failed half-way."""

    opened: ClassVar[list[Conn]] = []

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames = wire.FrameReader()
        self.next_id = 1
        Conn.opened.append(self)

    @classmethod
    async def close_all(cls) -> None:
        conns, cls.opened[:] = list(cls.opened), []
        for c in conns:
            c.writer.close()
        for c in conns:
            with contextlib.suppress(OSError):
                await c.writer.wait_closed()

    @classmethod
    async def open(cls, path: str) -> Conn:
        return cls(*await asyncio.open_unix_connection(path))

    async def send(self, op: str, args: dict | None = None) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1
        self.writer.write(wire.encode_frame(wire.Request(id=rid, op=op, args=args or {})))
        await self.writer.drain()
        return rid

    async def recv(self):
        payload = await asyncio.wait_for(self.frames.read_async(self.reader), GUARD)
        return None if payload is None else wire.decode_message(payload)

    async def call(self, op: str, args: dict | None = None) -> wire.Response:
        rid = await self.send(op, args)
        resp = await self.recv()
        assert isinstance(resp, wire.Response) and resp.id == rid
        return resp

    async def closed_by_server(self) -> bool:
        return await asyncio.wait_for(self.reader.read(), GUARD) == b""

    def close(self) -> None:
        self.writer.close()


def exchange(path: str, request: dict, timeout: float = GUARD) -> bytes:
    """One request on a new blocking connection; the whole frame that answers it, as sent."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(wire.frame(msgpack.packb(request)))
        head = _exactly(s, 4)
        return head + _exactly(s, int.from_bytes(head, "big"))


def _exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "the connection closed inside a frame"
        buf += chunk
    return buf
