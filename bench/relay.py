"""A TCP relay that delays each direction by half a round-trip time: a network link in user space.

These machines' kernels have no netem, so a link with a round trip is made here: the relay
accepts connections on its own address and opens one to the upstream service for each; every
chunk of bytes read in either direction is written on the other side `rtt / 2` seconds after it
was read, in order (a writer per direction sleeps until a chunk is due), with TCP_NODELAY on
both sockets so that no Nagle wait adds to it. A gRPC channel through it sees each message cross
in rtt / 2 and each call take at least one rtt, as over a real link of that latency and ample
bandwidth (bandwidth is not limited). It runs its own asyncio loop on a daemon thread.

What crosses it is not read: TLS or plaintext, gRPC or anything else. `one_way` can change while
it runs (a link that slows), and `hold` stops delivery on every connection (its packets dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time


class DelayRelay:
    """Relay 127.0.0.1:PORT -> `upstream` (HOST:PORT) with `rtt_ms` of round trip; a context manager."""

    def __init__(self, upstream: str, rtt_ms: float, host: str = "127.0.0.1"):
        if rtt_ms < 0:
            raise ValueError(f"a round-trip time must be >= 0 ms, got {rtt_ms}")
        self.upstream_host, port = upstream.rsplit(":", 1)
        self.upstream_port = int(port)
        self.one_way = rtt_ms / 2000.0  # may change while it runs: chunks read from then on
        # While set, nothing is delivered, either way, on any connection (a link whose packets are
        # dropped: TCP delivers what was held once it passes again, unless an end gave up first).
        self.hold = False
        self.host = host
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-relay", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> DelayRelay:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, self.host, 0), self._loop
        ).result(10)
        self.address = f"{self.host}:{self._server.sockets[0].getsockname()[1]}"
        return self

    def stop(self) -> None:
        async def close():
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        if self._server is not None:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> DelayRelay:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            writer.close()
            self._tasks.discard(task)
            return
        for w in (writer, up_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (asyncio.CancelledError, OSError):  # a connection reset, or shut while half-closed
            pass
        finally:
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: read as it comes, write each chunk one_way after it was read, in order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    writer.write_eof() if writer.can_write_eof() else writer.close()
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                while self.hold:
                    await asyncio.sleep(0.01)
                writer.write(data)
                await writer.drain()

        delivering = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(1 << 16):
                queue.put_nowait((time.monotonic() + self.one_way, data))
            queue.put_nowait((time.monotonic() + self.one_way, None))
            await delivering
        finally:
            delivering.cancel()
