"""Those who ask whether a model service is up (the orchestrator's Describe: `specdec status`, GET
/health) get an answer the service confirmed (orchestrator.availability.confirm), not the last one a
generation happened to see: a service up and not heard from within a second is asked; a failed call
(refused, lost: UNAVAILABLE) is a loss at once, reported as a generation reports one (the probe
starts); a late answer is a loss only after `hang_seconds` of silence; nothing is asked while it was
heard from just now, or while it is lost (its probe asks it then).

Fakes for the service's answers, no server: tests/test_degraded.py kills real service processes.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import grpc
import pytest

from orchestrator import availability
from orchestrator.availability import Availability, confirm
from specdec.limits import RecoveryConfig


class Failed(grpc.RpcError, grpc.Call):
    def __init__(self, code: grpc.StatusCode, details: str = "failed"):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class Service:
    """A service's side of the checks: each call answers with `answer` (an RpcError to raise), after `delay`."""

    def __init__(self, answer=None, delay: float = 0.0):
        self.answer, self.delay, self.calls = answer, delay, 0

    def send(self, timeout: float) -> Future:
        self.calls += 1
        future = Future()

        def reply():
            time.sleep(self.delay)
            if self.answer is None:
                future.set_result("info")
            else:
                future.set_exception(self.answer)

        threading.Thread(target=reply, daemon=True).start()
        return future


@pytest.fixture
def health():
    """A service's availability whose probe never reaches it (a loss lasts), closed at the end."""

    def probe(_timeout):
        raise ConnectionError("still down")

    made = []

    def make(**config) -> Availability:
        h = Availability("target", lambda: "127.0.0.1:1", probe, RecoveryConfig(**config))
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def test_an_answer_keeps_it_up_and_stands_for_a_second(health, monkeypatch):
    h, service = health(), Service()
    confirm((h, service.send))
    assert h.up and service.calls == 1
    confirm((h, service.send))  # heard just now: not asked again
    assert service.calls == 1
    monkeypatch.setattr(availability, "FRESH_SECONDS", 0.0)
    confirm((h, service.send))
    assert h.up and service.calls == 2


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_failed_check_is_a_loss_at_once(health, code):
    h = health()
    confirm((h, Service(Failed(code, "Connection refused")).send))
    state = h.state()
    assert not state.up and state.losses == 1
    assert state.reason == f"target service at 127.0.0.1:1: a status check failed: {code.name}: Connection refused"
    assert h._prober is not None and h._prober.is_alive()  # probed as after a generation's loss
    service = Service()
    confirm((h, service.send))  # lost: its probe asks it, confirm does not
    assert service.calls == 0 and not h.up


def test_a_check_that_cannot_be_sent_is_a_loss(health):
    h = health()

    def send(_timeout):
        raise ValueError("Cannot invoke RPC on closed channel!")

    confirm((h, send))
    assert not h.up and "closed channel" in h.state().reason


def test_an_error_status_is_an_answer(health):
    h = health()
    confirm((h, Service(Failed(grpc.StatusCode.UNIMPLEMENTED)).send))
    assert h.up


def test_silence_is_a_loss_only_after_hang_seconds(health, monkeypatch):
    """A busy service answers late: one check past its deadline loses nothing; silence for
    hang_seconds (a stopped process, a host cut off) does."""
    monkeypatch.setattr(availability, "FRESH_SECONDS", 0.0)
    h = health(hang_seconds=0.3)
    late = Service(Failed(grpc.StatusCode.DEADLINE_EXCEEDED))
    confirm((h, late.send))
    assert h.up
    confirm((h, Service().send))  # it answered: its silence starts again
    confirm((h, late.send))
    assert h.up
    time.sleep(0.35)
    confirm((h, late.send))
    assert not h.up and h.state().reason.startswith("target service at 127.0.0.1:1: answered no status check for 0.")


def test_checks_go_out_together_and_callers_share_one(health):
    """Both services asked at once (a Describe waits for the slower, not the sum); a caller that asks
    while a check is in flight waits for its answer instead of sending another."""
    target, draft = health(), health()
    slow_target, slow_draft = Service(delay=0.4), Service(delay=0.4)
    started = time.monotonic()
    other = threading.Thread(target=lambda: confirm((target, slow_target.send)))
    other.start()
    time.sleep(0.1)
    confirm((target, slow_target.send), (draft, slow_draft.send))
    other.join()
    assert time.monotonic() - started < 0.75
    assert (slow_target.calls, slow_draft.calls) == (1, 1) and target.up and draft.up


def test_an_availability_without_a_probe_is_not_checked():
    """Nothing could find it again: only a generation's call says it is lost."""
    h, service = Availability("draft"), Service(Failed(grpc.StatusCode.UNAVAILABLE))
    confirm((h, service.send))
    assert h.up and service.calls == 0


def test_found_counts_as_heard(health):
    h = health()
    h.lost("gone")
    h.found()
    service = Service(Failed(grpc.StatusCode.UNAVAILABLE))
    confirm((h, service.send))
    assert h.up and service.calls == 0
