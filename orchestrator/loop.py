"""The speculative decoding loop across the draft and target services, token ids only.

One round: DraftService.Propose (k tokens) then TargetService.Score (k + 1 positions in one
forward), then the pure rule (specdec.decoding.rule) decides what is committed. The commit rides on
each service's next request (`append_tokens`), so a round is two RPCs; a third, ProposalRow,
happens only in sampling mode on a rejection, to fetch the one draft row the residual needs.

Two sampling rules (specdec.decoding.rule), both exact. Leviathan: all randomness is drawn here from one
seeded generator, a fixed number of draws per round, so a seed reproduces a generation for a
fixed lookahead and overlap setting, whatever the load or faults (no draw depends on timing).
Invariant: nothing is drawn here; the services compute each position's noise from the seed,
and a draft is accepted iff it equals the target's token, as in greedy decoding: a seed then
gives the target's own sample, whatever the lookahead, drafter, overlap or schedule.

First token, and a service lost mid-generation: orchestrator.sessions. The other kinds of
round and the continuation's branches are bases of SpeculativeLoop, each in its own module:
orchestrator.plain_rounds (several target steps in one Score), orchestrator.tree_round (a
draft tree), orchestrator.cache_branches (the speculation cache); this module chooses a round's
kind and runs a chain's.

Threads. Where the two services share one machine's cores (PairCosts.sharing,
specdec.runtime.placement), every request names the threads its forwards may use: the services' shares
while both compute for this generation at once (an overlapped round's continuation beside its
verify, both prefills) or, under load, in any round that drafts (one generation's draft steps
fall between another's verify steps); every core otherwise (the core lock makes the services
take turns): a plain round's verify, and alone, a sequential round's. The adaptive policy chooses the kind of round by
its price at each placement; so does a fixed k where its text does not depend on the schedule
(greedy, the invariant rule), while a Leviathan sample at a fixed k keeps the request's overlap
setting, so that its seed replays.

The loop knows nothing of text: the caller (orchestrator.generation) detokenises and
handles stop strings, and may stop consuming at any round; the sessions are closed then.
`draft` and `target` are anything with the stubs' methods (gRPC stubs, or in-process
adapters in tests).
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np

from orchestrator import logprobs as token_logprobs
from orchestrator import speculation_cache
from orchestrator.availability import Availability
from orchestrator.cache_branches import CacheBranches
from orchestrator.lookahead import AdaptiveLookahead
from orchestrator.pair_costs import DraftCost, PairCosts, RoundReport
from orchestrator.plain_rounds import PlainRounds
from orchestrator.rounds import Draws, LoopConfig, LoopStats, Proposal, Round, SessionLost
from orchestrator.sessions import CONTINUATIONS, GenerationSessions, Side, new_session_id, wait_quietly
from orchestrator.tree_round import TreeRound
from orchestrator.trees import PairTrees, TreeAcceptance
from specdec.decoding import rule
from specdec.errors import SpecdecError, Unavailable
from specdec.serving import wire
from specdec.v1 import model_pb2
from specdec.validation import MAX_LOOKAHEAD

# A round whose service keeps losing the session gives up after this many re-opens.
MAX_REOPENS_PER_ROUND = 8
# Generations running here past which a fixed k's greedy or invariant rounds no longer overlap.
OVERLAP_LOAD = 4
# An index's chain sized by its own score (free_lookahead) holds at most FREE_START tokens, and up
# to the request's free_lookahead (MAX_LOOKAHEAD) after a chain accepted whole: text being copied.
# On a CPU a 17-token verify costs the F32 target 3.4 ms a token, a 33-token one 2.7: a 201-token
# verbatim copy ran 14 rounds with chains of 16, 9 with up to 32. After a miss the next chain is
# FREE_START again: a long one that misses early costs a wider verify for nothing (docs/models.md,
# "How long a chain the index proposes").
FREE_START = 16


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


class SpeculativeLoop(CacheBranches, PlainRounds, TreeRound, GenerationSessions):
    def __init__(
        self,
        draft,
        target,
        prompt: list[int],
        config: LoopConfig,
        timeout=None,
        costs: PairCosts | None = None,
        trees: PairTrees | None = None,
        health: tuple[Availability, Availability] | None = None,
        draft_timeout: float | None = None,
        cache_rates: speculation_cache.CacheRates | None = None,
    ):
        """`costs`: what the adaptive policy has measured of this draft/target pair, shared by
        the generations on it (orchestrator.pair_costs.PairCosts); None: this generation's own.
        `trees`: what the pair's generations learn of its draft trees (orchestrator.trees), likewise.
        `health`: the draft's and the target's availability, shared by the pair's generations
        (orchestrator.availability); None: this generation's own, up. `draft_timeout`: seconds a draft
        call may take before the round goes on without it (None: the deadline). `cache_rates`: what
        the pair's generations measured for the speculation cache; None: this generation's own."""
        self.trees = trees or PairTrees()
        # Under the Leviathan rule a tree's shape decides which uniform meets which token, so it
        # learns from this generation's rounds alone (a seed then replays it); greedy and
        # invariant outputs do not depend on the shape, and learn from the whole pair's.
        self._tree_acceptance = self.trees.acceptance if config.coupled else TreeAcceptance()
        self.config = config
        self.prompt = list(prompt)
        self.session_id = new_session_id()
        self.stats = LoopStats()
        # The caller's deadline bounds the whole generation; each RPC gets what is left of it.
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.draft = Side(draft, self.session_id) if config.speculate else None
        self.target = Side(target, self.session_id)
        self.generated: list[int] = []
        # A tree round is sequential (a continuation assumes one path accepted, a tree has many);
        # an adaptive generation with trees chooses between them and overlapped chains.
        self.overlap = config.overlap and self.draft is not None and (config.adaptive or not config.tree_nodes)
        self.costs = costs or PairCosts()
        self.policy = None
        if config.adaptive and self.draft is not None:  # target-only: nothing to choose, steps in one Score
            self.policy = AdaptiveLookahead(
                config.lookahead, overlap=self.overlap, load=RUNNING.count, costs=self.costs
            )
        elif config.coupled and (config.measured or self.overlap and self.costs.sharing is not None):
            # the kind of round only, and what the pair measures for a measured lookahead
            self.policy = AdaptiveLookahead(
                config.lookahead,
                overlap=self.overlap,
                fixed=True,
                measured=config.measured,
                load=RUNNING.count,
                costs=self.costs,
            )
        self._sampling = config.sampling.to_proto()  # what every Propose and Score carries
        self._carried: Proposal | None = None  # the next round's drafts, from a continuation
        self._copying = False  # the last index chain was accepted whole: the next may run past FREE_START
        self._stats_lock = threading.Lock()
        self._draft_opening = None  # the draft's OpenSession while it runs (adaptive: _draft_ready)
        self._draft_opened = False  # its OpenSession was sent (adaptive: once the policy speculates)
        self._draft_open_call = None  # that OpenSession's gRPC call, cancelled if the generation ends first
        self._ended = False
        self._committed: tuple[float, int | None] = (0.0, None)  # adaptive: its last commit (time, quiet mark)
        self._round_speculates = False  # this round drafts (see Threads)
        self._policy_plain = False  # under load, the adaptive policy chose this round plain (_plain_steps)
        self.draft_health, self.target_health = health or (Availability("draft"), Availability("target"))
        self.cache_rates = cache_rates or speculation_cache.CacheRates()
        self._spare = speculation_cache.Spare()  # the draft's time to spare in overlapped rounds
        self.draft_timeout = draft_timeout
        self._draft_lost = False  # this generation's draft session is gone: re-opened once the draft is up
        self._plain_costs: tuple[float, float] | None = None  # (overhead, step) of its decode rounds (_decode_round)
        self._without_draft = False  # from a loss until the re-opened session is ready
        self._draft_incarnation = 0  # the draft's sessions after losses take ids of their own
        self._draft_refused = False  # the draft refused this generation: no re-open
        self._draft_was_lost = False  # ... and once lost, its rounds no longer wait for it (see First token)
        # Structured output: what opens each service's session besides its tokens (its grammar, which
        # the tokens after the prompt advance when a session is re-opened mid-generation).
        # what each side's OpenSession carries: where the prompt ends (the penalties count past it), the
        # length it may reach (held in the service's KV budget from the open: refused there, not mid-way), its grammar
        reach = len(self.prompt) + config.max_new_tokens + 1
        self._session_fields = {"prompt_length": len(self.prompt), "reserve_tokens": reach}
        if config.constraint is not None:
            self._session_fields["constraint"] = config.constraint
        if config.history_scope:
            self._session_fields["history_scope"] = config.history_scope
        if config.reproducible:
            self._session_fields["reproducible"] = True
        if config.prediction:
            self._session_fields["prediction_token_ids"] = config.prediction

    @functools.cached_property
    def rng(self) -> np.random.Generator:
        """The generation's draws, from its seed: made at the first draw (a greedy generation draws
        none; making one took ~9 µs alone and ~30 µs a request under load, by py-spy at 64 clients)."""
        return np.random.default_rng(self.config.seed)

    @property
    def _overlapping(self) -> bool:
        """Whether the rounds overlap where allowed: the policy's choice; else always, but under load
        where the text does not depend on the schedule (greedy, the invariant rule): past
        OVERLAP_LOAD generations the services are kept busy by the other generations' rounds, and a
        continuation (with the speculation cache's branches) is draft work that a rejection throws
        away, on a draft every session shares."""
        if self.policy is not None:
            return self.policy.overlapping
        return not (self.config.coupled and RUNNING.count() > OVERLAP_LOAD)

    def _timeout(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    # -- lifecycle -------------------------------------------------------------------------
    def rounds(self) -> Iterator[Round]:
        """Open both sessions, yield each round's commit, close the sessions however it ends."""
        if not self.target_health.up:  # a new request fails at once while the target is down
            raise Unavailable(f"the target service is unavailable: {self.target_health.state().reason}; retry later")
        RUNNING.add(1)
        try:
            # The first token is the target's alone (see First token). A draft that is down:
            # target-only rounds until it is back.
            if self.draft is not None and not self.draft_health.up:
                self._lose_draft()
            elif self.draft is not None and self.costs.sharing is None and self._drafts_wanted():
                self._open_draft()  # on its own host or device: both prefills at once
            try:
                self._open(self.target, self.prompt, concurrent=False, new=True)
            except BaseException:
                wait_quietly(self._draft_opening, self._timeout())
                raise
            if self.policy:
                self._committed = (time.perf_counter(), self.policy.costs.quiet_since())
            while True:
                step = self._round()
                yield step
                if step.finish_reason:
                    return
        finally:
            RUNNING.add(-1)
            self._ended = True
            # Closed whatever happened: an open that failed or timed out may still complete on the service.
            opening, self._draft_opening, closing = self._draft_opening, None, None
            if opening is not None:  # the draft's open still runs: stopped, and closed once it is done
                self._cancel_draft_open()
                opening.add_done_callback(lambda _: self._close(self.draft))
            elif self._draft_opened and self.draft_health.up:
                closing = CONTINUATIONS.submit(self._close, self.draft)  # beside the target's, waited for
            elif self._draft_opened:  # a draft that may not answer: not waited for
                CONTINUATIONS.submit(self._close, self.draft)
            self._close(self.target)
            wait_quietly(closing, None)

    def _threads(self, side: Side, concurrent: bool) -> int | None:
        """The threads a request of `side` may use (see Threads): its share of the cores if the
        other service computes meanwhile, for this generation or, in overlapped rounds, for others;
        every core if not; None where the services do not share cores (their own)."""
        overlapped = concurrent or (self._round_speculates and RUNNING.count() > 1)
        draft, target = self.costs.threads(overlapped)
        return draft if side is self.draft else target

    # -- one round -------------------------------------------------------------------------
    def _call(self, method, request, budget: float | None = None):
        """One RPC with what is left of the deadline (and at most `budget` seconds): (response,
        seconds), bytes counted."""
        timeout = self._timeout()
        if budget is not None:
            timeout = budget if timeout is None else min(timeout, budget)
        t0 = time.perf_counter()
        response = method(request, timeout=timeout)
        with self._stats_lock:  # a continuation calls from another thread
            self.stats.wire_bytes += request.ByteSize() + response.ByteSize()
        return response, time.perf_counter() - t0

    def _round(self) -> Round:
        start = time.perf_counter()
        cfg = self.config
        remaining = cfg.max_new_tokens - len(self.generated)
        # Leave room for the recovered/bonus token: proposing `remaining` drafts would waste
        # the bonus position, and with one token left plain target decoding is cheapest.
        wanted = self._wanted_k() if self.draft is not None else 0  # asked once a round: the policy counts them
        # The first round is the target's alone (see First token).
        ready = self.draft is not None and bool(self.generated) and self._draft_ready(wanted, self._waits_for_draft)
        # under load, the policy chose a plain round: its rounds take several steps (_plain_steps)
        self._policy_plain = wanted == 0 and self.policy is not None and self.policy.may_stop and RUNNING.count() > 1
        if wanted and not ready and self.policy is not None:
            self.policy.unexplored()  # an exploration waits for the draft's session
        wanted = wanted if ready else 0
        self._round_speculates = wanted > 0  # under load, its requests run beside others' (see Threads)
        if not ready:
            k = 0
        elif self._carried is not None:
            k = len(self._carried.tokens)  # proposed last round, as its continuation
        else:
            k = min(wanted, remaining - 1)
        # A tree (tree_nodes), or under adaptive lookahead the kind whose rounds measured faster.
        tree = bool(cfg.tree_nodes) and k > 0 and self._carried is None
        if tree and self.policy is not None:
            tree = self.trees.choice.tree(cfg.sampling.greedy)
        # Fixed draws per round (whatever the outcome) keep a seed's stream aligned. A coupled rule
        # draws none: its generator is never made (rng).
        if cfg.coupled:
            draws = Draws.none()
        elif tree:
            draws = Draws.draw_tree(self.rng, cfg.lookahead, cfg.tree_nodes)
        else:
            draws = Draws.draw(self.rng, cfg.lookahead, overlap=self.overlap)
        steps = self._plain_steps(k)  # none with drafts (a tree has them)
        if steps and not cfg.coupled:
            draws = draws.stepped(self.rng, cfg.lookahead, self.overlap, steps)
        for reopens in itertools.count():
            try:
                if steps:
                    step = self._decode_round(steps, draws, start)
                elif tree:
                    step = self._tree_round(k, draws, start)
                else:
                    step = self._speculate(k, wanted, draws, start, measure=bool(cfg.tree_nodes))
                break
            except SessionLost as lost:
                if reopens == MAX_REOPENS_PER_ROUND:
                    raise
                self._reopen(lost)
        if tree and self.policy is not None:  # the chains' round times count from its commit
            self.trees.choice.update(cfg.sampling.greedy, True, step.committed, time.perf_counter() - start)
            self._committed = (time.perf_counter(), self.policy.costs.quiet_since())
        if self._without_draft:
            self.stats.rounds_without_draft += 1
            step.without_draft = True
        return step

    def _draft_behind(self) -> bool:
        """Whether the draft's next call carries a prefill: more pending commits than a round makes."""
        return len(self.draft.pending) > max(self.config.lookahead, self.config.free_lookahead) + 2

    def _free_lookahead(self) -> int:
        """The most tokens the next index chain may hold (FREE_START until one is accepted whole)."""
        free = self.config.free_lookahead
        return free if self._copying else min(free, FREE_START)

    def _wanted_k(self) -> int:
        return self.policy.next_k() if self.policy else self.config.lookahead

    def _propose(self, k: int, uniforms, assumed=(), concurrent: bool = False, room: int = 0) -> tuple[Proposal, float]:
        """Propose k drafts after the committed tokens (and `assumed`), or up to the config's
        free_lookahead where the drafter sizes its chain, `room` at most: (proposal, seconds). More
        pending commits than a round makes (the draft's session opened or idle while rounds went
        without it) is a prefill for the pair (see lookahead's Calibration). `concurrent`: beside
        the round's verify (a continuation)."""
        prefill = self._draft_behind()
        with self._prefilling(prefill):
            proposal, seconds = self._draft_call(
                self.draft.stub.Propose,
                model_pb2.ProposeRequest(
                    session=self.draft.ref(),
                    append_tokens=self.draft.pending,
                    k=k,
                    sampling=self._sampling,
                    uniforms=uniforms[:k],
                    assumed_tokens=assumed,
                    noise_seed=self.config.noise_seed,
                    threads=self._threads(self.draft, concurrent),
                    alternatives=self._caching,
                    free_lookahead=min(self._free_lookahead(), room) if room > k else 0,
                ),
                prefill=prefill,
            )
        with self._stats_lock:
            self.stats.add_proposal(proposal)
        self.draft.length, self.draft.pending = proposal.length, []
        return Proposal.of(proposal, uniforms[:k]), seconds

    def _speculate(self, k: int, wanted: int, draws: Draws, start: float, measure: bool = False) -> Round:
        cfg = self.config
        # 1. This round's drafts: last round's continuation, or proposed now.
        drafts = Proposal([], [], [])
        draft_time = fresh = continued = 0.0
        carried, next_carried = self._carried, None  # kept until the round succeeds: a retry reuses it
        drafted = 0  # tokens the draft proposed in this round (for the policy's cost per token)
        if carried is not None and not carried.lost:
            drafts = carried
            self.stats.overlapped_rounds += 1
        elif k > 0:
            asked = time.perf_counter()
            try:
                room = cfg.max_new_tokens - len(self.generated) - 1
                drafts, fresh = self._propose(k, carried.uniforms if carried is not None else draws.draft, room=room)
                draft_time, drafted = fresh, k
            except (SessionLost, grpc.RpcError) as err:  # a lost draft: a plain round
                if not self._draft_failed(err):
                    raise
                draft_time = time.perf_counter() - asked
        # A model-free drafter may propose fewer than k (none when it finds no match).
        k = len(drafts.tokens)
        accept_u = draws.accept[:k]

        # 2. Overlapped: the draft continues past these drafts while the target scores them.
        room = cfg.max_new_tokens - len(self.generated) - (k + 1)
        # A chain proposed without a forward (an index's: the hybrid's, the suffix drafter's) has no
        # continuation: the next one costs nothing either, and the verify takes every core.
        # (free_lookahead: a request whose index chains are sized by the index)
        indexed = (
            cfg.free_lookahead > 0 and drafts.report is not None and drafts.report.steps == 0 and bool(drafts.tokens)
        )
        overlapping = self.overlap and self._overlapping and not self._draft_lost and not indexed
        k_next = min(wanted, room - 1, MAX_LOOKAHEAD - 1) if overlapping else 0
        continuation = None
        if k_next > 0:
            ctx = contextvars.copy_context()  # the request's trace goes along to the other thread
            continuation = CONTINUATIONS.submit(ctx.run, self._continue, k_next + 1, draws.continuation, drafts, room)
        beside = continuation is not None or self._draft_opening is not None  # a continuation, the draft's prefill
        try:
            scores, target_time = self._call(
                self.target.stub.Score,
                model_pb2.ScoreRequest(
                    session=self.target.ref(),
                    append_tokens=self.target.pending,
                    draft_token_ids=drafts.tokens,
                    sampling=self._sampling,
                    draft_token_probs=drafts.probs,
                    accept_uniforms=accept_u,
                    noise_seed=cfg.noise_seed,
                    threads=self._threads(self.target, concurrent=beside),
                    logprobs=cfg.logprobs,
                ),
            )
        except BaseException:
            wait_quietly(continuation, self._timeout())
            if continuation is not None and continuation.done() and continuation.exception() is None:
                for _, future in continuation.result()[2]:  # the cache's branches: this round is re-run
                    future.cancel()
            raise
        self.stats.add_scores(scores)
        self.target.length, self.target.pending = scores.length, []  # applied, whatever the draft does
        after, issued = None, []
        if continuation is not None:  # a lost draft's: the round goes on without it
            waited = time.perf_counter()
            try:
                after, continued, issued = continuation.result(timeout=self._timeout())
                self._spare.update(target_time, continued, k_next + 1)
            except (SessionLost, grpc.RpcError) as err:
                if not self._draft_failed(err):
                    raise
            draft_time += time.perf_counter() - waited  # only the part the Score did not hide

        # 3. The rule. All drafts accepted and a continuation: its first token is tested at the
        # bonus position like any draft; accepted, the rest are the next round's drafts.
        if cfg.coupled:  # the target's own token at each position: a draft passes iff it equals it
            accepted = rule.greedy_accepted_length(drafts.tokens, scores.argmax_token_ids)
            target_token = scores.argmax_token_ids[accepted]
        else:
            accepted = rule.accepted_length(drafts.probs, scores.draft_token_target_probs, accept_u)
            if accepted != scores.row_position:
                raise SpecdecError(f"target returned row {scores.row_position}, the rule needs {accepted}")
            target_row = wire.decode_row(scores.row)
        proposed = k
        committed = drafts.tokens[:accepted]
        if indexed:
            self._copying = accepted == k
        passed = tested = False
        if accepted == k and after is not None and after.tokens:
            first = after.tokens[0]
            proposed += 1
            tested = True
            if cfg.coupled:
                passed = first == target_token
            else:
                passed = rule.accepted_length(after.probs[:1], [target_row[first]], draws.accept[k : k + 1]) == 1
            if passed:
                accepted += 1
                committed.append(first)
                if len(after.tokens) > 1:
                    next_carried = after.after(1)
        if not passed:
            if cfg.coupled:
                last = target_token
            else:

                def draft_row():  # on a rejection: the draft's row at that position, for the residual
                    nonlocal draft_time
                    if self._draft_lost:  # with the lost draft: wait for it and re-run (module doc)
                        raise SessionLost(self.draft.stub, "the draft's row at a rejection went with it", gone=False)
                    try:
                        row, row_time = self._draft_call(
                            self.draft.stub.ProposalRow,
                            # Positions count from the draft's committed length; commits it has not
                            # been sent yet (carried drafts, no continuation this round) come first.
                            model_pb2.ProposalRowRequest(
                                session=self.draft.ref(),
                                position=len(self.draft.pending) + accepted,
                                token_id=(drafts.tokens + after.tokens[:1] if after else drafts.tokens)[accepted],
                            ),
                        )
                    except grpc.RpcError as err:  # past its budget: waited for, as if lost
                        raise self._as_lost(err) or err from err
                    draft_time += row_time
                    return wire.decode_row(row)

                last = rule.final_token(accepted, proposed, target_row, draft_row, draws.final)
            committed.append(last)
        if after is not None and self._caching:  # the speculation cache: this round's outcome, measured
            rejection = accepted if not passed and (accepted < k or tested) else None
            token = last if not passed else -1  # the target's token at the rejection
            alts = drafts.alts + (after.alts[:1] if tested else [])
            if len(drafts.alts) == k and len(alts) == k + tested:
                self.cache_rates.update([a[1] for a in alts], [a[0] for a in alts], accepted, token)
            if issued:
                next_carried = self._take_branch(issued, rejection, token) or next_carried
        self._carried = next_carried
        self.stats.draft_seconds += draft_time
        self.stats.target_seconds += target_time
        if self.policy:  # k = 0 rounds too: they measure the one-token step
            drafted += k_next + 1 if continuation is not None else 0
            spent = fresh + continued if self.overlap else draft_time  # overlapped: the draft's own time
            reports = [p.report for p in (drafts, after) if p is not None and p.report is not None]
            now = time.perf_counter()
            self.policy.update(
                RoundReport(
                    k,
                    min(accepted, k),
                    DraftCost(
                        spent,
                        drafted,
                        sum(r.compute_seconds for r in reports),
                        sum(r.steps for r in reports),
                        sum(r.step_tokens for r in reports),
                        min((r.threads for r in reports), default=0),
                    ),
                    target_time,
                    step_tokens=scores.step_tokens or None,
                    target_compute=scores.compute_seconds or None,  # a service that does not report it: all the wait
                    step_sessions=scores.step_sessions or None,
                    round_seconds=now - self._committed[0],
                    quiet=self.policy.costs.quiet(self._committed[1]),
                    target_threads=scores.threads,
                    committed=len(committed),
                    at=now,
                    indexed=drafts.report is not None and drafts.report.steps == 0,  # proposed now, no forward
                )
            )
            self._committed = (time.perf_counter(), self.policy.costs.quiet_since())
        self.stats.round_seconds += time.perf_counter() - start
        if measure and self.policy is not None:  # a chain's round, for an adaptive choice of trees
            self.trees.choice.update(cfg.sampling.greedy, False, len(committed), time.perf_counter() - start)
        logprobs = None
        if cfg.logprobs is not None:
            logprobs = token_logprobs.chain(scores, committed, min(accepted, k), None if cfg.coupled else target_row)
        return self._commit(committed, proposed=proposed, accepted=accepted, logprobs=logprobs)

    def _commit(self, committed: list[int], proposed: int, accepted: int, logprobs=None) -> Round:
        cfg = self.config
        ruled = len(committed)
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
        s.committed_tokens += ruled
        s.generated_tokens = len(self.generated)
        return Round(committed, proposed, accepted, finish, ruled, logprobs=(logprobs or [])[: len(committed)])

    def truncate(self, keep: int) -> None:
        """End the generation at its first `keep` tokens (a stop string found in the text):
        the tokens past them are no longer generated, counted or pending for a service. A
        service that was already sent them holds more than the output; its session is closed
        when the rounds end."""
        dropped = len(self.generated) - keep
        assert 0 <= dropped, (keep, len(self.generated))
        del self.generated[keep:]
        for side in (self.draft, self.target):
            if side is not None:
                del side.pending[max(0, len(side.pending) - dropped) :]
        self.stats.generated_tokens = len(self.generated)
