"""Caps on what a service holds and admits: a model service's open sessions, KV-cache
tokens and idle time; the orchestrator's concurrent and queued requests; the drain bound;
how long the orchestrator waits for a lost service (orchestrator.recovery applies it).

A request that would go past a cap is refused with RESOURCE_EXHAUSTED before anything is
allocated or changed, so overload never becomes an out-of-memory crash. The KV budget is
kept by reservation: a session reserves the length its cache is about to reach before it
grows, and settles back to what the cache holds when the request ends.

This module owns the configuration, the KV accounting and the idle-session reaper; the
engine calls it where a cache grows or a session ends, specdec.serving.lifecycle admits requests.
It imports nothing heavy: the CLI reads its defaults.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from specdec.errors import ResourceExhausted


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 64  # sessions open at once
    max_kv_tokens: int = 65536  # tokens of keys/values held across all sessions; 0: no cap
    idle_ttl: float = 300.0  # seconds without a request before a session is closed; 0: never
    # Seconds a session may wait for its first request after OpenSession; 0: no such limit. A caller
    # that gave up on its OpenSession after the service answered never uses nor closes it
    # (reaping a session that was wanted costs its caller a re-open, orchestrator.recovery).
    unclaimed_ttl: float = 30.0
    # Keep what sessions computed for later sessions opening with the same tokens (specdec.runtime.prefix):
    # closed sessions' caches stay in the KV budget and the slots until a session needs the room.
    prefix_cache: bool = True

    def __post_init__(self):
        _at_least(self, max_sessions=1, max_kv_tokens=0, idle_ttl=0, unclaimed_ttl=0)


@dataclass(frozen=True)
class AdmissionLimits:
    # Requests generating at once: each holds a session on each model service, whose default
    # max_sessions this matches (`serve` and `ray up` follow --max-sessions); the step stream carries
    # them all, so it is the services' sessions, not a thread count, that bounds a step.
    max_concurrent: int = 64
    max_queue: int = 256  # requests waiting for a slot; beyond: RESOURCE_EXHAUSTED

    def __post_init__(self):
        _at_least(self, max_concurrent=1, max_queue=0)


def _at_least(config, **minimum) -> None:
    for name, low in minimum.items():
        if not getattr(config, name) >= low:  # NaN fails too
            raise ValueError(f"{name} must be >= {low}, got {getattr(config, name)}")


DRAIN_TIMEOUT = 20.0  # seconds a draining server waits for in-flight work (CLI default)


@dataclass(frozen=True)
class RecoveryConfig:
    """How long and how often the orchestrator tries to reach a lost model service again, and how
    long it gives the draft (an accelerator: past that, a round goes without it)."""

    wait_seconds: float = 180.0  # longest wait for a lost target when the request sets no deadline
    first_backoff: float = 0.05  # seconds between the first attempts; doubles each time
    max_backoff: float = 0.5
    probe_seconds: float = 0.5  # a liveness probe (Describe) on the current channel; failing it costs a new one
    connect_seconds: float = 2.0  # how long one attempt waits for a fresh channel to connect
    # Of a request's deadline, what is left (at most a tenth) for the UNAVAILABLE to reach the
    # client: a wait to the very end would reach it as DEADLINE_EXCEEDED.
    answer_margin: float = 1.0
    # Seconds a draft call (Propose, ProposalRow) may take before the round goes on without it and
    # the draft counts as lost: `draft_budget_times` its recent calls' decayed longest, at least
    # `draft_budget_floor`, at most `draft_timeout` (orchestrator.availability.CallBudget). The floor
    # is generous: a loaded machine's Propose waits behind prefills and other sessions' steps, and
    # a budget cut short drops a live draft (and changes a Leviathan seed's text) for nothing. A
    # Propose that carries a prefill (the draft's session behind by many tokens) gets the ceiling.
    draft_timeout: float = 30.0
    draft_budget_floor: float = 2.0
    draft_budget_times: float = 8.0
    probe_backoff: float = 1.0  # longest pause between two probes of a lost service
    # A lost service whose address does not refuse connections (a process stopped or hung, a host
    # unreachable, its packets dropped) and does not answer for this long is given up: its
    # generations fail with UNAVAILABLE (a refused connection is a restart under way: waited for
    # up to `wait_seconds` or the deadline).
    hang_seconds: float = 6.0

    def __post_init__(self):
        _at_least(
            self, wait_seconds=0, first_backoff=0, max_backoff=0, draft_timeout=0.001, probe_backoff=0.001,
            draft_budget_floor=0.001, draft_budget_times=1, hang_seconds=0.001,
        )  # fmt: skip


@dataclass(frozen=True)
class ResumePolicy:
    """How long a front door over several orchestrators keeps opening fresh streams for a
    request whose streams are lost (orchestrator.continuation): long enough for a lost
    orchestrator to be replaced, its models loaded again, when it was the only one."""

    wait_seconds: float = 180.0  # from the first loss, when the request sets no earlier deadline
    first_backoff: float = 0.1  # seconds before the first retry; doubles each time
    max_backoff: float = 2.0


class KVBudget:
    """Tokens of keys/values reserved across sessions, against a cap (0: none).

    Each session object carries its own reservation in `kv_tokens`. `reclaim()`, where given,
    frees what it can of what nobody needs (a prefix cache's kept caches, specdec.runtime.prefix), one
    entry a call, True while it freed any: a reservation past the cap calls it before it refuses.
    """

    def __init__(self, max_tokens: int, reclaim: Callable[[], bool] | None = None):
        self.max_tokens = max_tokens
        self.held = 0
        self.reclaim = reclaim
        self._lock = threading.Lock()

    def reserve(self, session, tokens: int) -> None:
        """Let `session` hold up to `tokens`, or refuse (and change nothing but what reclaim freed)."""
        if tokens <= session.kv_tokens:  # held already (a session's step: most of them)
            return
        while True:
            with self._lock:
                grow = tokens - session.kv_tokens
                if grow <= 0:
                    return
                if not self.max_tokens or self.held + grow <= self.max_tokens:
                    self.held += grow
                    session.kv_tokens = tokens
                    return
                held = self.held
            if self.reclaim is None or not self.reclaim():  # outside the lock: it settles what it frees
                raise ResourceExhausted(
                    f"KV cache budget: {held} of max_kv_tokens {self.max_tokens} are held and "
                    f"this request needs {grow} more; retry later"
                )

    def settle(self, session, tokens: int) -> None:
        """Set the session's reservation to what it holds now (0 when it ends)."""
        with self._lock:
            self.held += tokens - session.kv_tokens
            session.kv_tokens = tokens


class Reaper:
    """A daemon thread that closes sessions idle longer than the TTL, and sessions never used
    since they opened after the (shorter) unclaimed TTL."""

    def __init__(self, engine, ttl: float, unclaimed_ttl: float = 0.0):
        self.engine = engine
        self.ttl = ttl
        self.unclaimed_ttl = unclaimed_ttl
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="session-reaper", daemon=True)

    def start(self) -> None:
        if self.ttl > 0 or self.unclaimed_ttl > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        shortest = min(t for t in (self.ttl, self.unclaimed_ttl) if t > 0)
        interval = min(max(shortest / 4, 0.05), 10.0)
        while not self._stop.wait(interval):
            if self.unclaimed_ttl > 0:
                self.engine.close_idle(self.unclaimed_ttl, unclaimed=True)
            if self.ttl > 0:
                self.engine.close_idle(self.ttl)
