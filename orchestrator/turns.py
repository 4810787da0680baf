"""Turns at the target: when a pair's Scores leave for the target service.

Under load a pair's sessions fall into turns: while the target scores one turn, the others draft. A
device's step costs about the same for 4 sessions as for 60 (a batch of decodes is bound by reading
the weights), so a turn of a few is a whole step spent on them. At 64 clients and k = 4 (stand-ins
10 ms / 2 ms) the sessions went round as one turn of about 60 and one of a few: the few's Scores left
while the big turn drafted, and took a step of their own.

So the target link holds its Scores while more of the pair's sessions are drafting (a Propose that
its session waits for, not a continuation proposed beside a verify) than Scores are held:
- while a step of the target's own is in flight (they would queue behind it there anyway), decided
  again when it ends;
- past it, while those drafts are due back within half a target step: at most until they are due
  and a quarter step more, so the few go with the Scores the drafts make.
A Score is never held longer than two target steps, whatever drafts; with nothing drafting
(speculation off, one session alone) it leaves at once.

`Flights` times a link's messages; `Turns` is the pair's policy, shared by its two links
(orchestrator.step_link). Pure bookkeeping: knows nothing of rounds, the rule or gRPC.
"""

from __future__ import annotations

import threading

SMOOTHING = 0.2  # the weight of a message's latency in its link's running mean
HOLD_SHARE = 0.5  # Scores wait for drafts due back within this share of a target step ...
SLACK_SHARE = 0.25  # ... and past the drafts' due time this share more, for their Scores to be made
MOST_STEPS = 2.0  # a Score waits at most this many target steps


class Flights:
    """A link's messages in flight: when each left, how many of its calls are not back yet, and the
    running mean of a message's latency (sent to its first result)."""

    def __init__(self):
        self._of: dict[int, list] = {}  # call id -> its message's [sent, calls not back, answered]
        self._flights: dict[int, list] = {}  # id() of a message in flight -> the message's list
        self.latency: float | None = None

    def sent(self, ids: list[int], now: float) -> None:
        if ids:
            flight = [now, len(ids), False]
            self._flights[id(flight)] = flight
            for call_id in ids:
                self._of[call_id] = flight

    def back(self, ids, now: float) -> None:
        """The results of calls `ids` came (ids not in flight are passed over)."""
        for call_id in ids:
            flight = self._forget(call_id)
            if flight is not None and not flight[2]:
                flight[2] = True
                took = now - flight[0]
                self.latency = took if self.latency is None else (1 - SMOOTHING) * self.latency + SMOOTHING * took

    def drop(self, ids) -> None:
        """Calls that will not come back (cancelled, past their deadline, failed with their stream)."""
        for call_id in ids:
            self._forget(call_id)

    def _forget(self, call_id: int) -> list | None:
        """The call's message, the call counted off it (the message forgotten once none is left)."""
        flight = self._of.pop(call_id, None)
        if flight is not None:
            flight[1] -= 1
            if not flight[1]:
                del self._flights[id(flight)]
        return flight

    def in_flight(self) -> int:
        return len(self._of)

    def due(self, now: float, overdue: float, within: float) -> tuple[int, float]:
        """The calls whose messages are due back within `within` seconds of `now` (or overdue by less
        than `overdue`), and when the last of them is due."""
        if self.latency is None:
            return 0, now
        calls, last = 0, now
        for flight in self._flights.values():
            due = flight[0] + self.latency
            if now - overdue <= due <= now + within:
                calls += flight[1]
                last = max(last, due)
        return calls, last


class Turns:
    """The pair's turn policy (the module docstring): its draft link's and target link's flights, and
    whether the target link's held Scores leave now."""

    def __init__(self):
        self.lock = threading.Lock()  # the flights: both links' readers and the scheduler's thread
        self.draft = Flights()
        self.target = Flights()

    def hold_until(self, held: int, waited: float, now: float) -> float | None:
        """None: the `held` Scores (the oldest held `waited` seconds) leave now; else when to decide
        again at the latest (the target's step ending decides sooner). With `lock` held."""
        step = self.target.latency
        if not held or step is None or waited >= MOST_STEPS * step or self.draft.in_flight() < held:
            return None
        if self.target.in_flight():
            return now + step
        coming, last = self.draft.due(now, SLACK_SHARE * step, HOLD_SHARE * step)
        return last + SLACK_SHARE * step if coming >= held else None
