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

And a turn of most of the pair's sessions is split in two. Where a session's drafts and handling
outlast a target step, one turn of all leaves the target idle between its steps, and a turn of 60
beside one of 4 waits for its 60 sessions' handling, one after another, each round: at 64 clients the
turns sat at 61 / 3, 45 / 19 or 64 for seconds. So Scores after drafts leaving together, from
SPLIT_LEAST of them where a draft takes half a target step or more, go as at most half the sessions of
the last two turns and these (and TURN_SLACK more); the rest are held for the next turn, decided again
when this step ends. Two turns of about half stay whole. Plain rounds are never split: every session
has a step each step.

`Flights` times a link's messages; `Turns` is the pair's policy, shared by its two links
(orchestrator.step_link). Pure bookkeeping: knows nothing of rounds, the rule or gRPC.
"""

from __future__ import annotations

import math
import threading
from collections import deque

SMOOTHING = 0.2  # the weight of a message's latency in its link's running mean
HOLD_SHARE = 0.5  # Scores wait for drafts due back within this share of a target step ...
SLACK_SHARE = 0.25  # ... and past the drafts' due time this share more, for their Scores to be made
MOST_STEPS = 2.0  # a Score waits at most this many target steps
SPLIT_LEAST = 16  # Scores after drafts leaving together are split into two turns from this many ...
SPLIT_SHARE = 0.5  # ... where a draft takes at least this share of a target step
TURN_SLACK = 2  # a turn so split takes half the pair's sessions and this many more


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
        self._turns: deque[frozenset[str]] = deque(maxlen=2)  # the sessions of the last two turns sent

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

    def leaving(self, sessions: list[str], drafted: bool) -> int:
        """How many of the Scores leaving now (their sessions, oldest first) go in this turn; the
        rest are held for the next. With `lock` held."""
        n = len(sessions)
        step, draft = self.target.latency, self.draft.latency
        if drafted and n >= SPLIT_LEAST and step is not None and draft is not None and draft >= SPLIT_SHARE * step:
            pair = set(sessions).union(*self._turns)
            n = min(n, math.ceil(len(pair) / 2) + TURN_SLACK)
        self._turns.append(frozenset(sessions[:n]))
        return n
