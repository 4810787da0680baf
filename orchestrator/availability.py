"""Whether each model service answers, as the orchestrator sees it, and the probe that notices a
lost one come back.

The two services are not alike. The draft is an accelerator: the target alone serves every
request exactly, so a lost draft costs speed, never availability. When a generation finds it
gone (UNAVAILABLE, a call past its budget: CallBudget, a few times its recent calls), it reports
the loss here and goes on with target-only rounds; new requests are served target-only; a background thread probes the
service's address with backoff (Describe, on a fresh connection each time) and, when it
answers, generations re-open their sessions on it and speculate again. The target is not
optional: while it is down, new requests fail at once with UNAVAILABLE (orchestrator.server), and
generations in flight wait for it up to their deadline, or fail after `hang_seconds` of silence
where its address does not refuse connections (stopped, hung, unreachable: orchestrator.recovery).

Nothing else calls a service while no request runs, so a service that died then would be taken as
up until a request found it gone. Those who ask whether it is up (the orchestrator's Describe:
`specdec status`, GET /health) confirm it first (`confirm`): a service up that has not answered in
the last FRESH_SECONDS is asked a Describe on the pair's own link, at most CHECK_SECONDS; a call that
fails (a connection refused or lost: UNAVAILABLE) is a loss, reported as a generation reports one
(the probe, target-only rounds, the metrics follow); one that goes unanswered is a loss only once the
service has answered none for `hang_seconds` (a busy service answers late, a stopped one never).
No thread and no call while nobody asks, or while a service is lost (its probe asks it then).

One log line at the loss and one at the return, whatever the number of generations that saw it.
This module knows nothing of rounds or sessions; the loop reports losses and reads `up`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from specdec.limits import RecoveryConfig

log = logging.getLogger("specdec.availability")

FRESH_SECONDS = 1.0  # an answer this recent stands for the service's state: it is not asked again
CHECK_SECONDS = 1.0  # how long confirm() waits for a service's answer
# A check failing so: the service is gone (its connection refused or lost, the server stopping).
GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class CallBudget:
    """How long one call to a service may take before its caller stops waiting: `times` the
    decayed longest of its recent calls (each call decays it by DECAY), at least `floor`, at most
    `ceiling` (RecoveryConfig's draft_budget_*, draft_timeout). Before any call: the ceiling."""

    DECAY = 0.98  # per call: a slow call (a wait behind a prefill) weighs for ~50 calls

    def __init__(self, floor: float, ceiling: float, times: float):
        self.floor, self.ceiling, self.times = floor, max(floor, ceiling), times
        self._longest: float | None = None

    def record(self, seconds: float) -> None:
        longest = self._longest  # a benign race: calls from many generations, one float each
        self._longest = seconds if longest is None else max(seconds, longest * self.DECAY)

    def seconds(self) -> float:
        if self._longest is None:
            return self.ceiling
        return min(self.ceiling, max(self.floor, self.times * self._longest))


@dataclass(frozen=True)
class State:
    """A snapshot: up or not, why not, for how long, and how many losses so far."""

    up: bool
    reason: str  # why it is down ("" when up)
    seconds: float  # in this state
    losses: int


class Availability:
    """One model service's availability: up until a loss is reported, then down until the probe
    reaches it again (see the module doc).

    `probe(timeout)` must raise when the service does not answer within `timeout` seconds (it
    reconnects: orchestrator.recovery.ResilientStub.probe); `check(answer)` may refuse what answered
    (a service of another model on the address): it returns why, or "" to accept it.
    """

    def __init__(
        self,
        name: str,
        address: Callable[[], str] = lambda: "",
        probe: Callable[[float], object] | None = None,
        config: RecoveryConfig | None = None,
        check: Callable[[object], str] = lambda _answer: "",
    ):
        self.name = name
        self._address = address
        self._probe = probe
        self._check = check
        self.config = config or RecoveryConfig()
        self._up = True
        self._reason = ""
        self._since = time.monotonic()
        self._losses = 0
        self._cond = threading.Condition()
        self._closed = False
        self._prober: threading.Thread | None = None
        self._heard = float("-inf")  # when it last answered a check (confirm) or was found again
        self._silent_since: float | None = None  # when the first check it left unanswered since was sent
        self._checking = False  # a check of confirm's is in flight
        c = self.config
        self.budget = CallBudget(c.draft_budget_floor, c.draft_timeout, c.draft_budget_times)  # a call's

    @property
    def up(self) -> bool:
        return self._up

    @property
    def losses(self) -> int:
        """Losses reported so far: a session opened before the latest one may be gone."""
        return self._losses

    def state(self) -> State:
        with self._cond:
            return State(self._up, self._reason, time.monotonic() - self._since, self._losses)

    def lost(self, reason: str) -> None:
        """The service did not answer (or failed): down until the probe reaches it again."""
        with self._cond:
            if not self._up or self._closed:
                return
            self._up, self._reason, self._since = False, reason, time.monotonic()
            self._losses += 1
            self._cond.notify_all()
            if self._probe is not None:
                self._prober = threading.Thread(
                    target=self._probing, args=(self._losses,), name=f"{self.name}-probe", daemon=True
                )
                self._prober.start()
        then = "; serving target-only until it is back" if self.name == "draft" else ""
        log.warning("%s service at %s unavailable: %s%s", self.name, self._address(), reason, then)

    def found(self) -> None:
        """A caller reached the service (a session re-opened on it): up, without waiting for the probe."""
        with self._cond:
            if self._up:
                return
            down = time.monotonic() - self._since
            self._up, self._reason, self._since = True, "", time.monotonic()
            self._heard, self._silent_since = self._since, None
            self._cond.notify_all()
        self._log_back(down)

    def _log_back(self, down: float) -> None:
        then = "; speculation resumes" if self.name == "draft" else ""
        log.warning("%s service at %s is back after %.1f s%s", self.name, self._address(), down, then)

    def wait(self, up: bool, timeout: float) -> bool:
        """Wait until the service is `up` (or not), at most `timeout` seconds; whether it is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._up == up or self._closed, timeout) and self._up == up

    def close(self) -> None:
        """Stop probing (the orchestrator is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- confirm: a check for those who ask ------------------------------------------------------
    def _ask(self, send: Callable[[float], Any]):
        """Send a check if one is due (up, probed when lost, not heard within FRESH_SECONDS):
        its call; _IN_FLIGHT where another caller's check is on its way; None where none is due."""
        with self._cond:
            now = time.monotonic()
            if not self._up or self._closed or self._probe is None or now - self._heard < FRESH_SECONDS:
                return None
            if self._checking:
                return _IN_FLIGHT
            self._checking = True
        try:
            return _Sent(send(CHECK_SECONDS), now)
        except Exception as err:  # noqa: BLE001 - not sent (not connected): as a call that failed
            return _Sent(_Failed(err), now)

    def _answered(self, call) -> None:
        """Wait for a check sent by _ask, and take its answer (or its silence) into account."""
        if call is None:
            return
        if call is _IN_FLIGHT:  # the other caller's answer, so that both report the same
            with self._cond:
                self._cond.wait_for(lambda: not self._checking or self._closed, CHECK_SECONDS + 0.5)
            return
        try:
            call.future.result()
            failure = None
        except Exception as err:  # noqa: BLE001 - whatever kept it from answering
            failure = err
        code = failure.code() if isinstance(failure, grpc.RpcError) else None
        now, reason = time.monotonic(), ""
        with self._cond:
            self._checking = False
            self._cond.notify_all()
            if failure is None or (code is not None and code not in (*GONE, grpc.StatusCode.DEADLINE_EXCEEDED)):
                self._heard, self._silent_since = now, None  # an answer, an error status too
                return
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # silent: busy, or stopped, or cut off
                if self._silent_since is None:
                    self._silent_since = call.sent
                silent = now - self._silent_since
                if silent < self.config.hang_seconds:
                    return
                reason = f"answered no status check for {silent:.1f} s"
            else:
                details = (failure.details() or "") if isinstance(failure, grpc.RpcError) else str(failure)
                reason = f"a status check failed: {code.name + ': ' if code else ''}{details}"
        self.lost(f"{self.name} service at {self._address()}: {reason}")

    def _probing(self, loss: int) -> None:
        """Probe until the service answers (or another caller found it first: this loss is over)."""
        backoff = self.config.first_backoff
        while True:
            with self._cond:
                over = lambda: self._closed or self._up or self._losses != loss  # noqa: E731
                if over() or self._cond.wait_for(over, backoff):
                    return
            try:
                answer = self._probe(self.config.connect_seconds)
                refused = self._check(answer)
            except Exception as err:  # noqa: BLE001 - any failure to answer is "still down"
                refused = ""
                reason = f"{type(err).__name__}: {err}"
                answer = None
            if answer is not None and not refused:
                self.found()
                return
            if refused:
                with self._cond:
                    self._reason = f"refused: {refused}"
            elif answer is None:
                log.debug("%s service still unavailable: %s", self.name, reason)
            backoff = min(2 * backoff, self.config.probe_backoff)


def confirm(*checks: tuple[Availability, Callable[[float], Any]]) -> None:
    """Confirm each service up is still there before saying so (see the module doc): `checks`,
    (availability, send) pairs, where send(timeout) starts a call to the service (a grpc.Future,
    whose result() raises where it did not answer). The calls due go out at once and are waited for
    together: at most ~CHECK_SECONDS, ~1 ms each on a link that answers."""
    sent = [(health, health._ask(send)) for health, send in checks]
    for health, call in sent:
        health._answered(call)


_IN_FLIGHT = object()  # _ask's answer where another caller's check is on its way


@dataclass(frozen=True)
class _Sent:
    future: Any  # result() returns the answer, or raises
    sent: float  # time.monotonic() when sent


@dataclass(frozen=True)
class _Failed:
    """A call that could not be sent: its result() raises why."""

    error: Exception

    def result(self):
        raise self.error
