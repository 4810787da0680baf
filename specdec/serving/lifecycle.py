"""How a server lets requests in and how it stops: the gate, admission, graceful drain.

- The gate (a server interceptor) watches a service's *entry* methods, the ones that start
  new work (Generate and GenerateStream on the orchestrator, OpenSession on a model
  service). It counts them while in flight and, once the server drains, refuses them with
  UNAVAILABLE. Methods on work already under way (a session's Propose, Score, Close) pass,
  so in-flight generations can finish.
- Admission (the orchestrator): at most `max_concurrent` entries run at once, at most
  `max_queue` wait for a slot; beyond that RESOURCE_EXHAUSTED at once. A queued request
  leaves the queue when its client cancels or its deadline passes.
- Drain: health turns NOT_SERVING, entries are refused, and the server waits until nothing
  is in flight (and, on a model service, no session is open), bounded by a timeout.

The gate sits outside the error interceptor (inside auth and telemetry, so those see its
refusals) and answers its own refusals. This module owns no model or generation logic; the
serve() functions of the three services assemble a server from it.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Collection
from contextlib import ExitStack, contextmanager, nullcontext

import grpc

from specdec.errors import Cancelled, ResourceExhausted, SpecdecError, Unavailable
from specdec.limits import DRAIN_TIMEOUT, AdmissionLimits, Reaper, SessionLimits
from specdec.runtime.engine import SessionEngine
from specdec.runtime.startup import PROFILE_SESSIONS, PROFILE_TOKENS, profile_steps, warm_up
from specdec.serving.security import ServerSecurity
from specdec.serving.service import add_health, make_server, wrap_handler
from specdec.serving.telemetry import Telemetry, disabled

SPARE_THREADS = 16  # a model service's gRPC threads beyond one per session (its streams, Describe, probes)


class Admission:
    """A counting semaphore with a bounded queue that gives up on requests that ended. It runs
    limits.max_concurrent entries at once, or `held` where that is fewer (the sessions the
    orchestrator's target service holds: each generation holds one; 0: no such bound)."""

    def __init__(self, limits: AdmissionLimits, held: int = 0):
        self.limits = limits
        self.max_concurrent = min(limits.max_concurrent, held) if held > 0 else limits.max_concurrent
        self.running = 0
        self.waiting = 0
        self.refused = 0  # since it started: both full
        self._cond = threading.Condition()

    @contextmanager
    def slot(self, context):
        with self._cond:
            if self.running >= self.max_concurrent:
                if self.waiting >= self.limits.max_queue:
                    self.refused += 1
                    raise ResourceExhausted(
                        f"overloaded: {self.running} requests running ({self.bound()}) and {self.waiting} "
                        f"queued (max_queue {self.limits.max_queue}); retry later"
                    )
                self.waiting += 1
                context.add_callback(self._wake)  # a cancel or an expired deadline ends the wait
                try:
                    while self.running >= self.max_concurrent:
                        if not context.is_active():
                            raise Cancelled("the request ended while queued for admission")
                        self._cond.wait(timeout=1.0)
                finally:
                    self.waiting -= 1
            self.running += 1
        try:
            yield
        finally:
            with self._cond:
                self.running -= 1
                self._cond.notify_all()

    def bound(self) -> str:
        """What sets max_concurrent: the flag, or the sessions the target holds."""
        if self.max_concurrent < self.limits.max_concurrent:
            held = f"the target service holds {self.max_concurrent} sessions"
            return f"{held}; max_concurrent {self.limits.max_concurrent}"
        return f"max_concurrent {self.max_concurrent}"

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class Gate(grpc.ServerInterceptor):
    """Counts and admits calls to the entry methods; refuses them once draining."""

    def __init__(self, entry_methods: Collection[str], admission: Admission | None = None):
        self.entry_methods = frozenset(entry_methods)
        self.admission = admission
        self.draining = False
        self.in_flight = 0
        self._cond = threading.Condition()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.entry_methods:
            return handler
        return wrap_handler(handler, self._enter)

    @contextmanager
    def _enter(self, context):
        with ExitStack() as stack:
            try:
                stack.enter_context(self._counted())
                if self.admission:
                    stack.enter_context(self.admission.slot(context))
            except SpecdecError as err:
                context.abort(err.code, err.message)
            yield

    @contextmanager
    def _counted(self):
        with self._cond:
            if self.draining:
                raise Unavailable("the server is shutting down (draining); retry on another instance")
            self.in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self.in_flight -= 1
                self._cond.notify_all()

    def drain(self, timeout: float, busy: Callable[[], int] = lambda: 0) -> bool:
        """Refuse entries from now on; wait until none is in flight and busy() is 0.

        Returns False if the timeout came first.
        """
        end = time.monotonic() + timeout
        with self._cond:
            self.draining = True
            while self.in_flight or busy():
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))  # busy() changes without telling the gate
        return True


class Served:
    """A started server with its gate, health and background threads.

    Behaves as the grpc.Server it wraps, plus drain(). `stopping`: what stop() calls first, before
    the server cancels the calls still in flight (an orchestrator ends its generations with a
    status of its own: gRPC's would be "Cancelling all calls").
    """

    def __init__(self, server: grpc.Server, gate: Gate, health, busy: Callable[[], int] = lambda: 0, background=()):
        self.server = server
        self.gate = gate
        self.health = health
        self.busy = busy
        self.background = list(background)
        self.stopping: list[Callable[[], None]] = []

    def drain(self, timeout: float = DRAIN_TIMEOUT) -> bool:
        """Health NOT_SERVING, new work refused (UNAVAILABLE), in-flight work finished."""
        self.health.enter_graceful_shutdown()
        return self.gate.drain(timeout, self.busy)

    def stop(self, grace: float | None):
        for hook in self.stopping:
            hook()
        for thread in self.background:
            thread.stop()
        return self.server.stop(grace)

    def __getattr__(self, name):
        return getattr(self.server, name)


def start(
    register: Callable[[grpc.Server], None],
    service_name: str,
    entry_methods: Collection[str],
    host: str,
    port: int,
    *,
    admission: Admission | None = None,
    interceptors=(),
    **server_options,
) -> tuple[Served, int]:
    """Build a gated server (make_server's options), register(server) its servicers, start it;
    `admission` bounds its entries."""
    gate = Gate(entry_methods, admission)
    server, bound = make_server(host, port, interceptors=[*interceptors, gate], **server_options)
    register(server)
    return _launch(server, gate, service_name), bound


def serve_model(
    backend,
    role: str,
    service_name: str,
    add_servicer: Callable,
    host: str,
    port: int,
    *,
    limits: SessionLimits | None = None,
    telemetry: Telemetry | None = None,
    security: ServerSecurity | None = None,
    cores=None,
) -> tuple[Served, int]:
    """Start a model service over a SessionEngine on `backend` (add_servicer(engine, server)
    adds its servicer): OpenSession is its entry, open sessions keep a drain waiting, idle
    sessions are reaped. `telemetry` observes the engine and the calls; `security` adds TLS
    and the token; `limits` caps sessions and KV tokens (and size a GraphBackend's cache);
    `cores` (specdec.runtime.placement.Cores) runs each step with the threads its requests ask for.
    The backend's start-up runs on the engine's model worker before the server starts, so the
    thread that captures its CUDA graphs is the one that replays them (_get_ready)."""
    telemetry = telemetry or disabled(role)
    engine = SessionEngine(telemetry.backend(backend), role, limits, cores=cores)
    try:  # on the model worker, the thread that will run every forward (specdec.runtime.worker)
        engine.worker.run(lambda: _get_ready(engine, backend))
    except BaseException:
        engine.stop()
        raise
    telemetry.watch(engine)
    gate = Gate([f"/{service_name}/OpenSession"])
    interceptors = [*telemetry.server_interceptors(), gate]
    # A thread a call in flight: every session's OpenSession at once (each waits for its prefill),
    # beside the step streams and the odd unary call; the steps' calls take no thread of their own.
    workers = engine.limits.max_sessions + SPARE_THREADS
    server, bound = make_server(host, port, workers, security=security, interceptors=interceptors)
    add_servicer(engine, server, telemetry)
    reaper = Reaper(engine, engine.limits.idle_ttl, engine.limits.unclaimed_ttl)
    return _launch(server, gate, service_name, lambda: engine.open_sessions, [reaper, engine]), bound


def _get_ready(engine: SessionEngine, backend) -> None:
    """What a model service does before it serves, on its model worker: the backend's start-up
    and warm-up, and its step profile (Describe's step_costs, for the orchestrator's adaptive
    lookahead): a draft's batched steps at every thread count a request may ask for, and a
    target's verify forwards where it has more than one (its cores shared with the draft's), with
    no other service's start-up computing beside them (specdec.runtime.placement: Start-up).
    On the bare backend: no request pays for it, no span records it."""
    loaded, t0 = process_age(), time.perf_counter()
    backend.tokenizer_digest()  # Describe's: a GGUF's tokenizer is converted here (once), not under a caller's Describe
    warm_up(backend, engine.limits)
    warm = time.perf_counter() - t0
    cores = engine.cores
    shapes = []
    if engine.role == "draft":
        shapes = [(n, 1) for n in PROFILE_SESSIONS if n <= engine.limits.max_sessions]
    elif cores is not None and len(cores.counts()) > 1:
        shapes = [(1, w) for w in PROFILE_TOKENS]
    if cores is not None:
        cores.started()  # loaded and warm: the other service may time its forwards
    if shapes:
        # ... and this one times its own with no other start-up beside it
        with cores.timing() if cores is not None else nullcontext():
            engine.step_profile = profile_steps(backend, shapes, cores)
    if loaded is not None:  # where a start-up goes (docs/gpu.md: ready time)
        print(
            f"specdec: {engine.role} service: {process_age():.1f} s after its process started: the model loaded "
            f"at {loaded:.1f} s, warm-up {warm:.1f} s, step profile {time.perf_counter() - t0 - warm:.1f} s",
            file=sys.stderr,
            flush=True,
        )


def freeze_heap() -> None:
    """Once a service process is ready: what it holds then (its modules, model, tokenizer: ~400k
    objects) leaves the cyclic collector's reach, so a full collection walks only what serving
    allocated since (Python's gc.freeze, as servers that fork or run long do). Without it each full
    collection stopped a service for 0.1-0.3 s. For a process's own start (the command line's
    services, a Ray actor), not a process that starts servers again and again: a test's would keep
    every object of the servers it froze."""
    gc.collect()
    gc.freeze()


def process_age() -> float | None:
    """Seconds since this process started (Linux's /proc), None where unknown."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
            return float(uptime.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _launch(server: grpc.Server, gate: Gate, service_name: str, busy=lambda: 0, background=()) -> Served:
    health = add_health(server, service_name)
    server.start()
    for thread in background:
        thread.start()
    return Served(server, gate, health, busy, background)
