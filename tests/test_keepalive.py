"""Keepalive: a model service that goes silent without closing its connection (a host powered
off, a network partition) is noticed within seconds, not at the request's deadline.

A TCP proxy in this test sits between the orchestrator and the target service; on command it
stops forwarding on the connections open then, without closing them, as a vanished peer does.
Connections made afterwards are forwarded, as to a peer reachable again on a new path. A
generation in flight then fails over (keepalive drops the silent connection, UNAVAILABLE, the
orchestrator's recovery re-opens the session on a new connection and re-runs the round) and
completes with the uninterrupted output, well before its 60 s deadline. Without keepalive it
would wait for that deadline and end with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from target_service.server import serve as serve_target
from tests.harness import SlowBackend, long_request, pipeline

pytestmark = pytest.mark.slow

DEADLINE = 60.0
NOTICED_WITHIN = 10.0  # a bound on a state change (the stream ends), not a speed measurement


class SilencingProxy:
    """Forwards 127.0.0.1:port to `upstream`, one pair of threads a connection; silence()
    stops forwarding on the connections open now but keeps their sockets open."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.links: list[tuple[threading.Event, list[socket.socket]]] = []
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            silent = threading.Event()
            self.links.append((silent, [client, server]))
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst, silent), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, silent: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                if silent.is_set():
                    self.closed.wait()  # read nothing more, send nothing, close nothing
                    return
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def silence(self) -> None:
        for silent, _ in self.links:
            silent.set()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        for _, sockets in self.links:
            for sock in sockets:
                sock.close()


@contextlib.contextmanager
def target_behind_proxy(tiny_backends, delay: float = 0.01):
    target, port = serve_target(SlowBackend(tiny_backends["target"], delay))
    proxy = SilencingProxy(("127.0.0.1", port))
    try:
        with pipeline(SlowBackend(tiny_backends["draft"], delay), None, target_address=proxy.address) as p:
            yield p, proxy
    finally:
        proxy.close()
        target.stop(None)


def test_silent_target_is_noticed_and_the_generation_recovers(tiny_backends):
    with target_behind_proxy(tiny_backends) as (p, proxy):
        request = long_request(160)
        expected = list(p.orchestrator.Generate(request, timeout=DEADLINE).token_ids)
        stream = p.orchestrator.GenerateStream(request, timeout=DEADLINE)
        tokens = list(next(stream).token_ids)
        proxy.silence()
        silenced = time.monotonic()
        chunks = [next(stream)]  # the next round, after the silent connection was dropped
        resumed = time.monotonic() - silenced
        print(f"silenced target: the stream resumed after {resumed:.2f} s")
        assert resumed < NOTICED_WITHIN
        chunks += list(stream)
        tokens += [t for chunk in chunks for t in chunk.token_ids]
        assert tokens == expected and chunks[-1].finish_reason == "length"
        assert p.orchestrator.Generate(long_request(8)).finish_reason == "length"
