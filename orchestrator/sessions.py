"""A generation's two sessions, one on each service: when each opens, and what happens when
a service loses its session (orchestrator.loop runs the rounds between them).

First token. The first round is a plain round of the target, right after its prefill on every
core: a request's first token waits for the target's prefill alone, as with the target alone,
never for the draft's. The draft's session opens after it where the services share one machine's
cores (its prefill on its share, beside the target's next rounds), at once where they do not (on
its own host or device, beside the target's prefill). Rounds go without drafts until it is open
(exact: a round with no draft is a plain round), then speculate, in the same generation. One
exception keeps a seed's promise: a Leviathan sample at a fixed k waits, at its second round, for
the draft's session, so that its text does not depend on when the draft was ready.
A generation that ends before the draft's session is open cancels its OpenSession: the draft
stops between two prefill chunks (what it computed stays in its prefix cache) rather than take
the cores from the next request's prefill.

A stub may raise SessionLost when its service lost the session (it died or restarted). The two
sides are not alike (orchestrator.availability). The target's: the loop has it re-open the session
at the committed prefix and re-runs the round from the same committed state with the same random
draws (orchestrator.recovery provides such stubs), waiting for it up to the deadline. The draft's:
the round goes on without it (a plain round, exact), the draft counts as lost when it did not
answer (or answered past its budget: a few times its recent calls), and rounds go without
speculation until it answers again; then its session re-opens at the committed prefix, in the
background, and speculation resumes. The one wait for a draft: under the Leviathan rule, a round
that rejected a draft needs the draft's row there for the residual, and a draft lost between its
proposal and that row is waited for (up to the deadline, or RecoveryConfig.hang_seconds where it
hangs) and the round re-run, since no other choice of the round's last token keeps the law exact.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

import grpc

from orchestrator import scheduler
from orchestrator.rounds import SessionLost
from orchestrator.scheduler import Continuations
from specdec.errors import Unavailable
from specdec.v1 import model_pb2

# Seconds a CloseSession may take; a service also reaps what it opened for a caller who left.
CLOSE_TIMEOUT = 2.0
# Seconds a new request gives a target that did not answer to answer again before it fails.
FAIL_FAST = 1.0
# A draft answering one of these refuses the generation (full, or its context too short for it):
# the generation goes on without drafts.
DRAFT_REFUSALS = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE)


def wait_quietly(future, timeout: float | None) -> None:
    """Let a continuation finish before the round's own error goes up (no request of the
    session is left in flight); its result and its error no longer matter."""
    if future is not None:
        try:
            future.result(timeout=timeout)
        except BaseException:  # noqa: BLE001, S110 - the round already failed with another error
            pass


# Continuations run here, beside the round's Score call: a task of the scheduler's beside a
# generation that is one (orchestrator.scheduler), else a thread, idle while its round waits.
CONTINUATIONS = Continuations(max_workers=64)


def close_once(side: Side) -> bool:
    """Close the side's session; False where its service did not answer (UNAVAILABLE, past
    CLOSE_TIMEOUT: stopped, cut off, restarting), True otherwise (closed, or nothing to close)."""
    try:  # its own timeout: the request's deadline may have passed
        side.stub.CloseSession(model_pb2.CloseSessionRequest(session_id=side.session_id), timeout=CLOSE_TIMEOUT)
    except Exception as err:  # noqa: BLE001 - best effort: NOT_FOUND (never opened, or gone) and the rest
        cause = err.__cause__ if isinstance(err, SessionLost) else err
        code = cause.code() if isinstance(cause, grpc.RpcError) else None
        return code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return True


class Closer:
    """Closes again, each RETRY seconds for PERSIST seconds, the sessions whose close found their
    service not answering: a service woken after a stop (or a link back) frees them then, not at its
    idle reaper's 300 s. One thread, started with the first."""

    RETRY, PERSIST = 1.0, 60.0

    def __init__(self):
        self._pending: list[tuple[float, Side]] = []  # (given up at, side)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, side: Side) -> None:
        with self._cond:
            self._pending.append((time.monotonic() + self.PERSIST, side))
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="specdec-closer", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending)
                pending, self._pending = self._pending, []
            now = time.monotonic()
            left = [(end, side) for end, side in pending if now < end and not close_once(side)]
            with self._cond:
                self._pending += left
            time.sleep(self.RETRY)


CLOSER = Closer()


# Session ids: this process's 64 random bits and a counter (drawn again in a forked child), unique
# across the orchestrators that share the services. A uuid4 a generation read os.urandom, which lets
# go of the interpreter's lock: on the scheduler's thread under load, taking it back could wait out
# another thread's switch interval (5 ms) with every generation's rounds behind it (as encode did).
def _fresh_session_ids() -> None:
    global _session_ids
    _session_ids = (secrets.token_hex(8), itertools.count())


_fresh_session_ids()
os.register_at_fork(after_in_child=_fresh_session_ids)


def new_session_id() -> str:
    prefix, counter = _session_ids
    return f"{prefix}{next(counter):x}"


@dataclass
class Side:
    """The orchestrator's view of one service's session."""

    stub: object
    session_id: str
    length: int = 0  # committed length the service has applied
    pending: list[int] = field(default_factory=list)  # committed here, not yet sent
    closed: bool = False  # its service closed it (a Score that ended the generation: close_session)

    def ref(self) -> model_pb2.SessionRef:
        return model_pb2.SessionRef(session_id=self.session_id, expected_length=self.length)


class GenerationSessions:
    """The two sessions of one generation (mixed into orchestrator.loop.SpeculativeLoop): opened,
    re-opened, flushed and closed; the draft's opened once it is wanted, and gone on without when
    it is lost. It reads the loop's config, prompt, generated tokens, policy, stats and the two
    services' health, and calls its _call, _threads and _timeout."""

    def _close(self, side: Side) -> None:
        if side.closed:
            return
        if not close_once(side):
            CLOSER.add(side)

    def _open(self, side: Side, tokens: list[int], concurrent: bool = True, new: bool = False) -> None:
        """Open the side's session holding `tokens`. `new`: a new request's target, which fails at
        once (UNAVAILABLE) if the target does not answer within FAIL_FAST seconds; else a lost
        service is waited for."""
        request = model_pb2.OpenSessionRequest(
            session_id=side.session_id,
            prompt_token_ids=tokens,
            threads=self._threads(side, concurrent),
            **self._session_fields,
        )
        with self._prefilling():
            try:
                if side is self.draft and hasattr(side.stub.OpenSession, "future"):
                    self._draft_open_call = side.stub.OpenSession.future(request, timeout=self._timeout())
                    if self._ended:  # the generation ended while this was being sent
                        self._cancel_draft_open()
                    try:
                        scheduler.result(self._draft_open_call)
                    except grpc.RpcError as err:  # as the stub's own calls raise it
                        where = f"{getattr(side.stub, 'name', 'draft')} service at {getattr(side.stub, 'address', '')}"
                        lost = SessionLost.of(side.stub, where, err)
                        if lost is None:
                            raise
                        raise lost from err
                else:
                    side.stub.OpenSession(request, timeout=self._timeout())
            except SessionLost as lost:
                if side is self.draft:  # rounds go without it (_draft_ready)
                    raise
                if not (new and lost.gone):
                    side.stub.reopen(side.session_id, tokens, timeout=self._timeout(), **self._session_fields)
                    self.target_health.found()
                else:  # a connection gone stale, a service moved (a Ray actor): found again at once, or failed
                    try:
                        side.stub.probe(FAIL_FAST)
                    except Exception as err:  # noqa: BLE001 - whatever keeps it from answering
                        self.target_health.lost(str(lost))
                        raise Unavailable(f"the target service is unavailable: {lost}; retry later") from err
                    side.stub.OpenSession(request, timeout=self._timeout())
        side.length = len(tokens)

    def _cancel_draft_open(self) -> None:
        """Stop the draft's prefill of a generation that ended before it: the service drops it
        between two chunks (what it computed stays in its prefix cache), so that it does not take
        the cores from the next request's prefill (a 1,300-token prompt: ~16 s of the draft's core)."""
        call = self._draft_open_call
        if call is not None:
            call.cancel()

    @contextlib.contextmanager
    def _prefilling(self, prefills: bool = True):
        """Tell the pair's adaptive costs a prefill runs meanwhile: rounds of any generation on it
        wait behind it, and are not calibrated by (see lookahead's Calibration)."""
        counted = prefills and self.policy is not None
        if counted:
            self.policy.costs.prefill(started=True)
        try:
            yield
        finally:
            if counted:
                self.policy.costs.prefill(started=False)

    def _open_draft(self, concurrent: bool = True) -> None:
        """Send the draft's OpenSession (on the continuation pool) holding the tokens committed so
        far; those committed from now on reach it with its first Propose. `concurrent`: the target
        decodes meanwhile (else the rounds wait for it: it may take every core)."""
        tokens, self.draft.pending = self.prompt + self.generated, []
        self._draft_opened = True
        self._draft_opening = CONTINUATIONS.submit(
            contextvars.copy_context().run, self._open, self.draft, tokens, concurrent
        )

    def _drafts_wanted(self) -> bool:
        """Whether to open the draft's session now: at once, or under a policy that may stop (adaptive
        lookahead, the measured default under load) once it speculates (under a load where speculation
        does not pay, the draft prefills nothing)."""
        return self.policy is None or self.policy.would_speculate()

    @property
    def _waits_for_draft(self) -> bool:
        """Whether rounds wait for the draft's session to open rather than go without it: a
        Leviathan sample at a fixed k, whose text would otherwise depend on when the draft is
        ready (see First token)."""
        return not self.config.adaptive and not self.config.coupled and not self._draft_was_lost

    def _draft_ready(self, wanted: int = 0, wait: bool = False) -> bool:
        """Whether the draft's session is open; its open's error goes up here, but a lost draft's,
        which rounds go without. An adaptive generation opens it when its policy first wants drafts
        (`wanted`) and does not wait for it: under load the draft prefills many prompts (the Q8_0
        draft on one core: ~0.2 s each), so its rounds go without speculation until it is open
        (k = 0; the tokens they commit reach the draft with its first Propose). After a loss it
        re-opens, likewise without waiting, once the draft answers again."""
        if self._draft_lost:
            if self._draft_refused or not self.draft_health.up:
                return False
            self._draft_lost = False  # the draft is back: re-open, and speculate once it is open
            self._open_draft()
            return False
        if not self._draft_opened:
            if wanted <= 0:
                return False
            self._open_draft(concurrent=not wait)
        if not self.draft_health.up:  # lost meanwhile (another generation saw it): do not call it
            self._lose_draft()
            return False
        opening = self._draft_opening
        if opening is None:
            return True
        if not wait and not opening.done():
            return False
        self._draft_opening = None
        try:
            opening.result(timeout=self._timeout())
        except (SessionLost, grpc.RpcError) as err:
            if not self._draft_failed(err):
                raise
            return False
        self._without_draft = False
        return True

    def _draft_failed(self, err: BaseException) -> bool:
        """Whether `err`, from a draft call, is the draft's loss (then handled: rounds go without
        it) rather than an error to raise. A draft that refuses this generation (its sessions or KV
        budget full, its context shorter than the target's) is gone for the rest of it."""
        lost = self._as_lost(err)
        if lost is None and isinstance(err, grpc.RpcError) and err.code() in DRAFT_REFUSALS:
            self._draft_refused = True
            lost = SessionLost(self.draft.stub, err.details(), gone=False)
        if lost is not None:
            self._lose_draft(lost)
        return lost is not None

    def _as_lost(self, err: BaseException) -> SessionLost | None:
        """A draft call's error as the draft's loss: the service gone or restarted (SessionLost),
        past its budget (a deadline that was not the request's), or holding the session already (a
        late open); None for any other error."""
        if isinstance(err, SessionLost):
            return err
        if isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.ALREADY_EXISTS:
            # An open of this session sent before (a link held, then let go) reached the draft late:
            # a new incarnation opens under an id of its own, and the late one is closed.
            reason = f"the draft service already holds the session ({err.details()})"
            return SessionLost(self.draft.stub, reason, gone=False)
        if isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            left = self._timeout()
            if left is None or left > 0:  # not the request's own deadline
                reason = f"the draft service did not answer within its budget ({err.details()})"
                return SessionLost(self.draft.stub, reason)
        return None

    def _lose_draft(self, lost: SessionLost | None = None) -> None:
        """This generation's draft session is gone: rounds go without drafts, and it re-opens
        once the draft answers (at once when the service answered without the session)."""
        if lost is not None and lost.gone:
            self.draft_health.lost(str(lost))
        self._draft_lost = self._without_draft = self._draft_was_lost = True
        if self._carried is not None:
            self._carried.lost = True  # a continuation's rows went with it (a re-run proposes it again)
        # The service may still hold the session (a connection lost, an answer late): closed in the
        # background, and the next one has an id of its own, which a late close cannot reach.
        old, opening, self._draft_opening = Side(self.draft.stub, self.draft.session_id), self._draft_opening, None
        if self._draft_opened:
            if opening is not None:
                opening.add_done_callback(lambda _: CONTINUATIONS.submit(self._close, old))
            else:
                CONTINUATIONS.submit(self._close, old)
        self._draft_opened = False
        self._draft_incarnation += 1
        self.draft.session_id = f"{self.session_id}.{self._draft_incarnation}"

    def _draft_budget(self) -> float:
        """Seconds a draft call may take now (orchestrator.availability.CallBudget; at most `draft_timeout`)."""
        budget = self.draft_health.budget.seconds()
        return budget if self.draft_timeout is None else min(budget, self.draft_timeout)

    def _draft_call(self, method, request, prefill: bool = False):
        """A draft RPC within the draft's budget (`prefill`: one carrying a prefill, within the
        ceiling, `draft_timeout`, and not counted): (response, seconds)."""
        response, seconds = self._call(method, request, self.draft_timeout if prefill else self._draft_budget())
        if not prefill:
            self.draft_health.budget.record(seconds)
        return response, seconds

    def _reopen(self, lost: SessionLost) -> None:
        """Wait for the service that lost the session (up to the deadline) and re-open it there,
        holding the committed prefix: the target's, or the draft's when a round needs its row."""
        draft = self.draft is not None and lost.stub is self.draft.stub
        side, health = (self.draft, self.draft_health) if draft else (self.target, self.target_health)
        if lost.gone:
            health.lost(str(lost))
        committed = self.prompt + self.generated
        side.stub.reopen(side.session_id, committed, timeout=self._timeout(), **self._session_fields)
        health.found()
        side.length, side.pending = len(committed), []
        if draft:
            self._draft_lost = self._without_draft = False
            self._draft_opened, self._draft_opening = True, None
            if self._carried is not None:
                self._carried.lost = True  # its rows went with the service: propose it again
        self.stats.recoveries += 1

    def flush(self) -> None:
        """Send pending commits now (Append), so both caches hold exactly the committed prefix."""
        drafting = self._draft_ready(wait=True)  # False: no draft, its session never opened, or lost
        for side in (self.draft if drafting else None, self.target):
            if side is not None and side.pending:
                try:
                    side.stub.Append(
                        model_pb2.AppendRequest(session=side.ref(), token_ids=side.pending),
                        timeout=self._timeout(),
                    )
                except (SessionLost, grpc.RpcError) as err:
                    if side is self.target or not self._draft_failed(err):
                        raise
                    continue
                side.length += len(side.pending)
                side.pending = []
