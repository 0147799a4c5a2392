"""A TCP proxy in front of the Temporal frontend that counts the gRPC calls passing through it.

Every byte is passed on unchanged in both directions; the client's side is read as HTTP/2
frames (RFC 9113 section 4.1), and each stream a client opens (its first HEADERS frame) is one
call: what the process behind the proxy asked the server, connection setup and the SDK's own
calls included, with nothing answered by the proxy itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS = 0x1


class CallCounter:
    def __init__(self) -> None:
        self.calls = 0
        self.connections = 0

    def reader(self) -> "_Frames":
        self.connections += 1
        return _Frames(self)


class _Frames:
    """One connection's client-to-server bytes, as frames: counts the streams it opens."""

    def __init__(self, counter: CallCounter) -> None:
        self.counter, self.buffer, self.preface, self.streams = counter, b"", False, set[int]()

    def feed(self, data: bytes) -> None:
        self.buffer += data
        if not self.preface:
            if len(self.buffer) < len(PREFACE):
                return
            assert self.buffer.startswith(PREFACE), "not an HTTP/2 client (plain-text gRPC expected)"
            self.buffer, self.preface = self.buffer[len(PREFACE):], True
        while len(self.buffer) >= 9:
            length = int.from_bytes(self.buffer[:3], "big")
            if len(self.buffer) < 9 + length:
                return
            kind, stream = self.buffer[3], int.from_bytes(self.buffer[5:9], "big") & 0x7FFFFFFF
            if kind == HEADERS and stream not in self.streams:
                self.streams.add(stream)
                self.counter.calls += 1
            self.buffer = self.buffer[9 + length:]


@asynccontextmanager
async def counting_proxy(upstream: str) -> AsyncIterator[tuple[str, CallCounter]]:
    """``host:port`` of a proxy to ``upstream`` (``host:port``), and its counter."""
    host, _, port = upstream.rpartition(":")
    counter = CallCounter()
    pumps: set[asyncio.Task] = set()

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frames: _Frames | None) -> None:
        try:
            while data := await reader.read(65536):
                if frames is not None:
                    frames.feed(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        for task in (pump(reader, up_writer, counter.reader()), pump(up_reader, writer, None)):
            pumps.add(t := asyncio.create_task(task))
            t.add_done_callback(pumps.discard)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", counter
    finally:
        server.close()
        for task in list(pumps):
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await server.wait_closed()
