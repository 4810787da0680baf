"""Surviving the loss of a model service mid-generation: a stub that finds the service again.

A ResilientStub stands in for a DraftService or TargetService stub. When a call fails
because the service went away (UNAVAILABLE: connection refused or reset, the process died)
or lost the session (NOT_FOUND: it restarted with empty caches), the call raises
`orchestrator.loop.SessionLost` and the loop asks the stub to `reopen` the session: the
stub waits for the service to come back, re-resolving its address each time (a standalone
service comes back at the same address; a Ray actor may come back on another port or node,
and its handle says where), then opens the session again by prefilling the committed prefix.
The loop re-runs the failed round from that state with the same random draws, so nothing
is lost, duplicated or redrawn.

The stub also carries what every session opened through it holds: the vocabulary the pair
shares (`vocab_size`, OpenSessionRequest.vocab_size, set where the pair's output layers differ
in size), on its first open and on every re-open.

Waiting is bounded by the request's deadline (less a margin to answer in), or by
`RecoveryConfig.wait_seconds` when the request has none, with exponential backoff between
attempts; a service that does not come back in time is a clear UNAVAILABLE naming it and its
address. A restart refuses connections until the new process listens; a service that accepts
them (or lets them time out) but does not answer is stopped, hung or cut off, and is given up
after `RecoveryConfig.hang_seconds`: a peer that hangs costs no more than one that dies.

This module knows nothing of rounds or of the rule; the loop knows nothing of channels.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import grpc

from orchestrator import scheduler
from orchestrator.loop import SessionLost
from specdec.errors import Unavailable
from specdec.limits import RecoveryConfig
from specdec.v1 import model_pb2

log = logging.getLogger("specdec.recovery")

# HOST:PORT, or a function of a timeout in seconds that returns the service's current HOST:PORT.
Address = str | Callable[[float], str]
# (address, seconds to wait for it) -> a connected channel; raises ConnectionError.
ChannelFactory = Callable[[str, float], grpc.Channel]

LOST = SessionLost.CODES  # a call failing with one of these: the service, or its copy of the session, is gone
RETRIED = (*LOST, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ALREADY_EXISTS)  # a re-open tries again


class ResilientStub:
    """A model-service stub that re-finds its service after a restart (see the module doc).

    Safe to share between requests: reconnecting is serialised, and a request that finds
    the connection already replaced by another uses the new one.
    """

    def __init__(
        self,
        stub_class,
        address: Address,
        channel_factory: ChannelFactory,
        name: str,
        config: RecoveryConfig | None = None,
        wait_seconds: float = 60.0,
        optional: bool = False,
    ):
        """Connects at once, waiting up to `wait_seconds`; `optional`: a service that does not
        answer by then is left unconnected (its calls raise SessionLost until a probe or a re-open
        connects it) instead of raising ConnectionError."""
        self.name = name
        self.config = config or RecoveryConfig()
        self.reopens = 0  # sessions re-opened after a loss, for status and tests
        self.vocab_size = 0  # the pair's shared vocabulary, where smaller than the service's (0: its own)
        self._stub_class = stub_class
        self._resolve = address if callable(address) else (lambda _timeout: address)
        self._channel_factory = channel_factory
        self._lock = threading.Lock()
        self.address = address if isinstance(address, str) else ""
        self._stub = None
        # Since when the address has accepted connections (or let them time out) without answering;
        # None while it answers or refuses (RecoveryConfig.hang_seconds).
        self._silent_since: float | None = None
        try:
            self._connect(wait_seconds, wait_seconds)
        except ConnectionError:
            if not optional:
                raise

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        def prepared(request):  # the stub to call it on, and the request as the pair sends it
            stub = self._stub
            if stub is None:
                raise SessionLost(self, f"{self.name} service at {self.address}: not connected yet")
            if method == "OpenSession" and self.vocab_size:  # over the pair's shared rows, however sent
                request = _with_vocab(request, self.vocab_size)
            return stub, request

        def call(request, **kwargs):
            stub, request = prepared(request)
            fn = getattr(stub, method)
            try:
                if getattr(fn, "waits_in_tasks", False):  # a step method: waits in a task itself
                    return fn(request, **kwargs)
                return scheduler.call(fn, request, **kwargs)
            except grpc.RpcError as err:
                lost = SessionLost.of(self, f"{self.name} service at {self.address}", err)
                if lost is None:
                    raise
                raise lost from err

        def future(request, **kwargs):  # a call that can be cancelled: a grpc.Future (its errors as they are)
            stub, request = prepared(request)
            return getattr(stub, method).future(request, **kwargs)

        call.future = future
        self.__dict__[method] = call  # found here from now on (it reads the stub in use at each call)
        return call

    def probe(self, timeout: float) -> model_pb2.ModelInfo:
        """What the service describes itself as, on a live connection (a fresh one where the current
        one does not answer); raises when it does not answer within `timeout` seconds."""
        if scheduler.in_task():  # a reconnect blocks: on a thread, the other tasks running meanwhile
            return scheduler.offload(self.probe, timeout)
        deadline = time.monotonic() + timeout
        stub = self._live_stub(deadline)
        return stub.Describe(model_pb2.DescribeRequest(), timeout=max(_left(deadline), 0.1))

    def reopen(self, session_id: str, token_ids: list[int], timeout: float | None = None, **fields) -> None:
        """Wait for the service, then open `session_id` afresh holding `token_ids` (`fields`: more of
        OpenSessionRequest's, as the session was opened with: its constraint)."""
        if scheduler.in_task():  # waits and reconnects: on a thread, the other tasks running meanwhile
            return scheduler.offload(self.reopen, session_id, token_ids, timeout, **fields)
        wait = self.config.wait_seconds
        if timeout is not None:
            wait = min(timeout - min(self.config.answer_margin, timeout / 10), wait)
        start = time.monotonic()
        deadline = start + wait
        backoff = self.config.first_backoff
        while True:
            try:
                stub = self._live_stub(deadline)
                # A service that survived (only the connection broke) may still hold the session,
                # perhaps with part of a request applied: drop it and prefill again.
                try:
                    stub.CloseSession(model_pb2.CloseSessionRequest(session_id=session_id), timeout=_left(deadline))
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                request = model_pb2.OpenSessionRequest(session_id=session_id, prompt_token_ids=token_ids, **fields)
                stub.OpenSession(_with_vocab(request, self.vocab_size), timeout=_left(deadline))
                self.reopens += 1
                log.warning(
                    "%s service at %s: session %s re-opened at length %d after %.2f s",
                    self.name, self.address, session_id, len(token_ids), time.monotonic() - start,
                )  # fmt: skip
                return
            except (grpc.RpcError, ConnectionError) as err:
                # ALREADY_EXISTS: an open sent earlier on a held link arrived after this attempt's
                # close (the next attempt closes it again).
                if isinstance(err, grpc.RpcError) and err.code() not in RETRIED:
                    raise
                last = err.details() if isinstance(err, grpc.RpcError) else str(err)
            now, silent = time.monotonic(), self._silent_since
            if silent is not None and now - silent >= self.config.hang_seconds:
                raise Unavailable(
                    f"the {self.name} service at {self.address} has not answered for {now - silent:.1f} s "
                    f"and does not refuse connections: stopped, hung or unreachable (last error: {last})"
                )
            if now + backoff >= deadline:
                raise Unavailable(
                    f"the {self.name} service at {self.address} did not come back within {wait:.1f} s "
                    f"(last error: {last})"
                )
            time.sleep(backoff)
            backoff = min(2 * backoff, self.config.max_backoff)

    # -- connection --------------------------------------------------------------------
    def _live_stub(self, deadline: float):
        """The current stub if the service answers on it, else a stub on a fresh connection."""
        if not self._lock.acquire(timeout=_left(deadline)):
            raise ConnectionError(f"timed out waiting to reconnect to the {self.name} service")
        try:
            if self._stub is not None:
                try:
                    probe = min(self.config.probe_seconds, _left(deadline))
                    self._stub.Describe(model_pb2.DescribeRequest(), timeout=probe)
                    self._silent_since = None
                    return self._stub
                except grpc.RpcError:
                    pass
            # Resolving may block until the service is back (a Ray actor restarting); then a fresh
            # channel, since an old one to a dead address sits in reconnect backoff for seconds.
            self._connect(_left(deadline), min(self.config.connect_seconds, _left(deadline)))
            return self._stub
        finally:
            self._lock.release()

    def _connect(self, resolve_seconds: float, wait_seconds: float) -> None:
        try:
            address = self._resolve(resolve_seconds)
        except Exception as err:  # noqa: BLE001 - the resolver is pluggable (e.g. a Ray actor call)
            raise ConnectionError(f"cannot find the {self.name} service: {type(err).__name__}: {err}") from err
        attempt = time.monotonic()
        try:
            channel = self._channel_factory(address, wait_seconds)
        except ConnectionError:
            # Silent since this attempt began, unless nothing listens there (a restart under way).
            self._silent_since = None if refuses(address) else self._silent_since or attempt
            raise
        self.address, self._stub, self._silent_since = address, self._stub_class(channel), None


def refuses(address: str, timeout: float = 0.5) -> bool:
    """Whether HOST:PORT refuses a connection (nothing listens: a process gone, perhaps restarting),
    or closes it at once (a proxy in front of such a service), rather than holding it open without
    answering (stopped, hung) or not answering at all (unreachable, its packets dropped)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return True  # not a TCP address (a unix socket, an address yet unknown): as a restart
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    with sock:
        try:
            return sock.recv(1) == b""  # closed at once; a live server sends its settings, a stopped one nothing
        except TimeoutError:
            return False
        except OSError:  # reset
            return True


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _with_vocab(request: model_pb2.OpenSessionRequest, vocab_size: int) -> model_pb2.OpenSessionRequest:
    """The request over the pair's shared vocabulary (a copy; 0: as it is)."""
    if not vocab_size:
        return request
    out = model_pb2.OpenSessionRequest()
    out.CopyFrom(request)
    out.vocab_size = vocab_size
    return out
