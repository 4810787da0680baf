"""The speculative decoding loop across the draft and target services, token ids only.

One round: DraftService.Propose (k tokens) then TargetService.Score (k + 1 positions in one
forward), then the pure rule (specdec.rule) decides what is committed. The commit rides on
each service's next request (`append_tokens`), so a round is two RPCs; a third, ProposalRow,
happens only in sampling mode on a rejection, to fetch the one draft row the residual needs.

All randomness is drawn here from one seeded generator, a fixed number of draws per round,
so a seed reproduces a generation whatever the services' hardware.

The loop knows nothing of text: the caller (orchestrator.generation) detokenises and
handles stop strings, and may stop consuming at any round; the sessions are closed then.
`draft` and `target` are anything with the stubs' methods (gRPC stubs, or in-process
adapters in tests).

A stub may raise SessionLost when its service lost the session (it died or restarted):
the loop has it re-open the session at the committed prefix and re-runs the round from the
same committed state with the same random draws (orchestrator.recovery provides such stubs).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from orchestrator.lookahead import AdaptiveLookahead
from specdec import rule, wire
from specdec.errors import SpecdecError, Unavailable
from specdec.v1 import model_pb2

# A round whose service keeps losing the session gives up after this many re-opens.
MAX_REOPENS_PER_ROUND = 8


class _Running:
    """How many loops are generating in this process: the load the adaptive policy prices."""

    def __init__(self):
        self._n = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self._n += n

    def count(self) -> int:
        return self._n


RUNNING = _Running()


class SessionLost(Unavailable):
    """A side's service lost the session: it went away, or came back with empty caches.

    Raised by stubs that can recover; they also have `reopen(session_id, token_ids, timeout)`,
    which waits for the service and opens the session again holding `token_ids`.
    """

    def __init__(self, stub, message: str):
        super().__init__(message)
        self.stub = stub


@dataclass(frozen=True)
class LoopConfig:
    sampling: model_pb2.SamplingParams
    max_new_tokens: int
    lookahead: int = 4  # k, or the largest k when adaptive
    speculate: bool = True
    adaptive: bool = False  # choose k per round (orchestrator.lookahead)
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()

    @property
    def greedy(self) -> bool:
        return self.sampling.temperature == 0.0


@dataclass
class LoopStats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    draft_seconds: float = 0.0  # waiting on the draft service
    target_seconds: float = 0.0  # waiting on the target service
    draft_compute_seconds: float = 0.0  # of which the draft service reported computing
    target_compute_seconds: float = 0.0  # of which the target service reported computing
    round_seconds: float = 0.0  # in rounds, prefill excluded
    wire_bytes: int = 0  # serialized round messages, both directions
    recoveries: int = 0  # sessions re-opened after a service lost them


@dataclass
class Round:
    """What one round committed (after stop handling) and how."""

    token_ids: list[int]
    proposed: int
    accepted: int
    finish_reason: str = ""  # "", "length" or "stop"


@dataclass
class _Side:
    """The orchestrator's view of one service's session."""

    stub: object
    length: int = 0  # committed length the service has applied
    pending: list[int] = field(default_factory=list)  # committed here, not yet sent

    def ref(self, session_id: str) -> model_pb2.SessionRef:
        return model_pb2.SessionRef(session_id=session_id, expected_length=self.length)


class SpeculativeLoop:
    def __init__(self, draft, target, prompt: list[int], config: LoopConfig, timeout=None):
        self.config = config
        self.prompt = list(prompt)
        self.session_id = uuid.uuid4().hex
        self.stats = LoopStats()
        # The caller's deadline bounds the whole generation; each RPC gets what is left of it.
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.draft = _Side(draft) if config.speculate else None
        self.target = _Side(target)
        self.generated: list[int] = []
        self.rng = np.random.default_rng(config.seed)
        self.policy = AdaptiveLookahead(config.lookahead, RUNNING.count) if config.adaptive else None

    def _timeout(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    # -- lifecycle -------------------------------------------------------------------------
    def rounds(self) -> Iterator[Round]:
        """Open both sessions, yield each round's commit, close the sessions however it ends."""
        sides = [s for s in (self.draft, self.target) if s is not None]
        opened = []
        RUNNING.add(1)
        try:
            for side in sides:
                try:
                    side.stub.OpenSession(
                        model_pb2.OpenSessionRequest(session_id=self.session_id, prompt_token_ids=self.prompt),
                        timeout=self._timeout(),
                    )
                except SessionLost:  # the service is down or restarting: wait for it
                    side.stub.reopen(self.session_id, self.prompt, timeout=self._timeout())
                opened.append(side)
                side.length = len(self.prompt)
            while True:
                step = self._round()
                yield step
                if step.finish_reason:
                    return
        finally:
            RUNNING.add(-1)
            for side in opened:
                try:
                    side.stub.CloseSession(model_pb2.CloseSessionRequest(session_id=self.session_id), timeout=5)
                except Exception:  # noqa: BLE001 - best effort; the service may be gone
                    pass

    # -- one round -------------------------------------------------------------------------
    def _call(self, method, request):
        """One RPC with what is left of the deadline: (response, seconds), bytes counted."""
        t0 = time.perf_counter()
        response = method(request, timeout=self._timeout())
        self.stats.wire_bytes += request.ByteSize() + response.ByteSize()
        return response, time.perf_counter() - t0

    def _round(self) -> Round:
        start = time.perf_counter()
        cfg = self.config
        remaining = cfg.max_new_tokens - len(self.generated)
        # Leave room for the recovered/bonus token: proposing `remaining` drafts would waste
        # the bonus position, and with one token left plain target decoding is cheapest.
        wanted = self.policy.next_k() if self.policy else cfg.lookahead
        k = min(wanted, remaining - 1) if self.draft is not None else 0
        # Fixed draws per round (whatever the outcome) keep a seed's stream aligned.
        if cfg.greedy:
            draft_u = accept_u = []
            final_u = 0.0
        else:
            draws = self.rng.random(2 * cfg.lookahead + 1)
            draft_u, accept_u, final_u = draws[:k], draws[cfg.lookahead : cfg.lookahead + k], draws[-1]
        for reopens in itertools.count():
            try:
                return self._speculate(k, draft_u, accept_u, final_u, start)
            except SessionLost as lost:
                if reopens == MAX_REOPENS_PER_ROUND:
                    raise
                self._reopen(lost.stub)

    def _reopen(self, stub) -> None:
        """Re-open the session on the side whose service lost it, holding the committed prefix."""
        side = self.draft if self.draft is not None and stub is self.draft.stub else self.target
        committed = self.prompt + self.generated
        side.stub.reopen(self.session_id, committed, timeout=self._timeout())
        side.length, side.pending = len(committed), []
        self.stats.recoveries += 1

    def _speculate(self, k: int, draft_u, accept_u, final_u: float, start: float) -> Round:
        cfg = self.config
        drafts: list[int] = []
        draft_probs: list[float] = []
        draft_time = 0.0
        if k > 0:
            proposal, draft_time = self._call(
                self.draft.stub.Propose,
                model_pb2.ProposeRequest(
                    session=self.draft.ref(self.session_id),
                    append_tokens=self.draft.pending,
                    k=k,
                    sampling=cfg.sampling,
                    uniforms=draft_u,
                ),
            )
            self.stats.draft_compute_seconds += proposal.compute_seconds
            self.draft.length, self.draft.pending = proposal.length, []
            drafts, draft_probs = list(proposal.token_ids), list(proposal.token_probs)
            # A model-free drafter may propose fewer than k (none when it finds no match).
            k, accept_u = len(drafts), accept_u[: len(drafts)]

        scores, target_time = self._call(
            self.target.stub.Score,
            model_pb2.ScoreRequest(
                session=self.target.ref(self.session_id),
                append_tokens=self.target.pending,
                draft_token_ids=drafts,
                sampling=cfg.sampling,
                draft_token_probs=draft_probs,
                accept_uniforms=accept_u,
            ),
        )
        self.stats.target_compute_seconds += scores.compute_seconds
        self.target.length, self.target.pending = scores.length, []

        if cfg.greedy:
            accepted = rule.greedy_accepted_length(drafts, scores.argmax_token_ids)
            last = scores.argmax_token_ids[accepted]
        else:
            accepted = rule.accepted_length(draft_probs, scores.draft_token_target_probs, accept_u)
            if accepted != scores.row_position:
                raise SpecdecError(f"target returned row {scores.row_position}, the rule needs {accepted}")
            target_row = wire.decode_row(scores.row)
            if accepted == k:  # every draft passed: the bonus token
                last = rule.sample(target_row, final_u)
            else:  # first rejection: the recovered token, from the residual
                row, row_time = self._call(
                    self.draft.stub.ProposalRow,
                    model_pb2.ProposalRowRequest(session=self.draft.ref(self.session_id), position=accepted),
                )
                draft_time += row_time
                last = rule.sample(rule.residual(target_row, wire.decode_row(row)), final_u)
        committed = drafts[:accepted] + [last]
        self.stats.draft_seconds += draft_time
        self.stats.target_seconds += target_time
        if self.policy:  # k = 0 rounds too: they measure the one-token step
            self.policy.update(k, accepted, draft_time, target_time)
        self.stats.round_seconds += time.perf_counter() - start
        return self._commit(committed, proposed=k, accepted=accepted)

    def _commit(self, committed: list[int], proposed: int, accepted: int) -> Round:
        cfg = self.config
        stops = cfg.stop_token_ids
        finish = ""
        for i, token in enumerate(committed):
            if token in stops:  # the stop token ends generation and is not emitted
                committed, finish = committed[:i], "stop"
                break
        room = cfg.max_new_tokens - len(self.generated)
        if not finish and len(committed) >= room:
            committed, finish = committed[:room], "length"
        self.generated.extend(committed)
        for side in (self.draft, self.target):
            if side is not None:
                side.pending.extend(committed)
        s = self.stats
        s.rounds += 1
        s.draft_tokens += proposed
        s.accepted_tokens += accepted
        s.generated_tokens = len(self.generated)
        return Round(committed, proposed, accepted, finish)

    def flush(self) -> None:
        """Send pending commits now (Append), so both caches hold exactly the committed prefix."""
        for side in (self.draft, self.target):
            if side is not None and side.pending:
                side.stub.Append(
                    model_pb2.AppendRequest(session=side.ref(self.session_id), token_ids=side.pending),
                    timeout=self._timeout(),
                )
                side.length += len(side.pending)
                side.pending = []
