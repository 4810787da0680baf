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

One log line at the loss and one at the return, whatever the number of generations that saw it.
This module knows nothing of rounds or sessions; the loop reports losses and reads `up`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from specdec.limits import RecoveryConfig

log = logging.getLogger("specdec.availability")


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
