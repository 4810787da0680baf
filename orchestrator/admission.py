"""The orchestrator's admission, with a request's n choices (OpenAI's `n`, orchestrator.choices) admitted as one.

Owns: the gRPC metadata that makes calls the choices of one request, and GroupAdmission, the
admission (specdec.serving.lifecycle.Admission: slots, then a bounded queue) that reads it. The call
of a request's first choice carries the request's id and its n (GROUP_KEY, CHOICES_KEY): it is
admitted only where n places are free (a slot or a place in the queue, beside those held for other
requests' choices), else refused whole with RESOURCE_EXHAUSTED before it generates anything, and the
other n - 1 places are held for the calls that carry its id alone. Those may wait in the queue for a
slot; none is refused for room. Places not taken go back when the first call fails or is cancelled
(its client starts no more), or HOLD_SECONDS after it ended.
"""

from __future__ import annotations

import secrets
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from specdec.errors import InvalidArgument, ResourceExhausted
from specdec.limits import AdmissionLimits
from specdec.serving import lifecycle

GROUP_KEY, CHOICES_KEY = "specdec-choice-group", "specdec-choices"
HOLD_SECONDS = 10.0  # how long a group's places not taken stay held after its first call ended


def group_metadata(n: int) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """The metadata of a request's first choice and of its others (a fresh id; n on the first); none for one choice."""
    if n < 2:
        return (), ()
    group = secrets.token_hex(8)
    return ((GROUP_KEY, group), (CHOICES_KEY, str(n))), ((GROUP_KEY, group),)


@dataclass
class _Group:
    places: int  # held for the calls of the group's other choices
    ended: float | None = None  # when its first call ended (time.monotonic); None while it runs


class GroupAdmission(lifecycle.Admission):
    """Admission that counts a group's n places at its first call and holds the others' for them."""

    def __init__(self, limits: AdmissionLimits, held: int = 0):
        super().__init__(limits, held)
        self.groups: dict[str, _Group] = {}

    @property
    def reserved(self) -> int:
        """Places held for the choices of requests admitted, not yet taken."""
        return sum(g.places for g in self.groups.values())

    @contextmanager
    def slot(self, context):
        group, n = _group(context)
        with ExitStack() as stack:
            # The base's lock is threading.Condition's own RLock: its slot, entered under it, takes it
            # again, and its wait for a slot releases it whole. Nothing comes between the count and the entry.
            with self._cond:
                first = self._claim(group, n)
                try:
                    stack.enter_context(super().slot(context))
                except BaseException:  # left the queue (cancelled, deadline)
                    if first:
                        self.groups.pop(group, None)
                    raise
            ended = False
            try:
                yield
                ended = True
            finally:
                if first:
                    with self._cond:
                        if ended and group in self.groups:  # the others are on their way
                            self.groups[group].ended = time.monotonic()
                        else:  # failed or cancelled: its client starts no more
                            self.groups.pop(group, None)

    def _claim(self, group: str, n: int) -> bool:
        """Take a place held for `group`; else count n places free (or refuse) and hold n - 1 of them
        for the group's other calls. True where this call is a group's first."""
        now = time.monotonic()
        for key in [k for k, g in self.groups.items() if g.ended is not None and now - g.ended > HOLD_SECONDS]:
            del self.groups[key]
        held = self.groups.get(group) if group and n == 1 else None
        if held is not None:
            held.places -= 1
            if not held.places:
                del self.groups[group]
            return False
        free = self.max_concurrent + self.limits.max_queue - self.running - self.waiting - self.reserved
        if n > free:
            self.refused += 1
            raise ResourceExhausted(self._full(n, free))
        if n > 1:
            if group in self.groups:
                raise InvalidArgument(f"{GROUP_KEY} {group!r} is a request admitted already: give each request its own")
            self.groups[group] = _Group(n - 1)
        return n > 1

    def _full(self, n: int, free: int) -> str:
        """Why a call of n places is refused: the base's words, and the places held for choices."""
        queue = f"max_queue {self.limits.max_queue}"
        load = f"{self.running} requests running ({self.bound()}), {self.waiting} queued ({queue})"
        if self.reserved:
            load += f", {self.reserved} places held for the choices of requests admitted"
        if n == 1:
            return f"overloaded: {load}; retry later"
        if n > self.max_concurrent + self.limits.max_queue:
            return f"{n} choices are more than this server admits at once ({self.bound()}, {queue}): ask for fewer"
        return f"overloaded: the request's {n} choices need {n} places and {max(free, 0)} are free: {load}; retry later"


def _group(context) -> tuple[str, int]:
    """The call's group id ("" for none) and the choices it stands for (1 but for a group's first)."""
    metadata = dict(context.invocation_metadata() or ())
    group, n = metadata.get(GROUP_KEY, ""), metadata.get(CHOICES_KEY, "1")
    if not (n.isdigit() and int(n) >= 1):
        raise InvalidArgument(f"{CHOICES_KEY} metadata must be a whole number >= 1, got {n!r}")
    if int(n) > 1 and not group:
        raise InvalidArgument(f"{CHOICES_KEY} metadata needs {GROUP_KEY} (the id its other choices' calls carry)")
    return group, int(n)
