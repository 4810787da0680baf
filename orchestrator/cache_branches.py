"""An overlapped round's continuation and the speculation cache's branches, as a part of the loop.

CacheBranches is a base of orchestrator.loop.SpeculativeLoop (its `self`): while the target
verifies a round, the draft continues past the round's drafts taken as accepted (`_continue`)
and, with the speculation cache (orchestrator.speculation_cache), proposes the next round for
the likeliest rejections the draft has time for (`_branch`). After the rule, `_take_branch`
takes the branch of the round's outcome, if one was prepared, and cancels the others. A branch
commits nothing on the draft, so a branch no longer wanted is simply cancelled; the output never
depends on which branches ran (the cache serves only greedy and the invariant rule).
It neither decides a round's kind nor applies the rule: orchestrator.loop does.
"""

from __future__ import annotations

import math

from orchestrator import speculation_cache
from orchestrator.rounds import Proposal
from orchestrator.sessions import CONTINUATIONS
from specdec.v1 import model_pb2


class CacheBranches:
    @property
    def _caching(self) -> bool:
        """Whether the speculation cache serves this generation: overlapped chains whose output does
        not depend on their drafts (greedy, the invariant rule): see orchestrator.speculation_cache."""
        cfg = self.config
        return cfg.cache and cfg.coupled and self.overlap and self._overlapping and not cfg.tree_nodes

    def _continue(self, k: int, uniforms, drafts: Proposal, room: int = 0):
        """An overlapped round's continuation: k drafts past `drafts` (taken as accepted; `room` at
        most, where its drafter sizes the chain), then, with
        the speculation cache, the proposals for the likeliest rejections that the draft has time for
        while the target verifies: (continuation, its seconds, [(Branch, a call future)])."""
        after, seconds = self._propose(k, uniforms, drafts.tokens, concurrent=True, room=room)
        return after, seconds, self._branch(drafts, after) if self._caching else []

    def _branch(self, drafts: Proposal, after: Proposal) -> list:
        """Issue the cache's proposals for this round's likeliest rejections (at a draft, or at the
        continuation's first token, tested at the bonus position): they commit nothing on the draft
        (its cache keeps a tail of each), so one no longer wanted is simply cancelled. None after a
        round without drafts (an index that found nothing): a branch proposes the next round's k,
        and that round's k is its own, 0."""
        k = len(drafts.tokens)
        if not k or len(drafts.alts) != k or not after.alts or not after.tokens:
            return []
        alts = drafts.alts + after.alts[:1]
        chosen = speculation_cache.branches(
            [a[1] for a in alts], [a[0] for a in alts], self.cache_rates, self._spare.fanout(k), k
        )
        issued = []
        for branch in chosen:
            # the next round's k, as a fresh proposal's: what fits before the bonus position
            n = min(k, self.config.max_new_tokens - len(self.generated) - (branch.accepted + 1) - 1)
            if n < 1:
                continue
            request = model_pb2.ProposeRequest(
                session=self.draft.ref(),
                k=n,
                sampling=self._sampling,
                assumed_tokens=drafts.tokens[: branch.accepted] + [branch.token],
                noise_seed=self.config.noise_seed,
                threads=self._threads(self.draft, concurrent=True),
                alternatives=True,
            )
            issued.append((branch, self._draft_future(request)))
        return issued

    def _draft_future(self, request):
        """A draft call that can be cancelled (a gRPC stub's future; an in-process stub's on the pool)."""
        method = self.draft.stub.Propose
        timeout = min(t for t in (self._timeout(), self._draft_budget(), math.inf) if t is not None)
        timeout = None if math.isinf(timeout) else timeout
        if hasattr(method, "future"):
            return method.future(request, timeout=timeout)
        return CONTINUATIONS.submit(method, request, timeout=timeout)

    def _take_branch(self, issued: list, rejection: int | None, token: int) -> Proposal | None:
        """The next round's drafts, if the cache prepared this round's outcome (a rejection after
        `rejection` accepted tokens, `token` the target's there); the other proposals cancelled."""
        hit = None
        if rejection is not None:
            hit = next((f for b, f in issued if b.accepted == rejection and b.token == token), None)
        for _, future in issued:
            if future is not hit:
                future.cancel()
        self.stats.cache_branches += len(issued)
        if hit is None:
            return None
        try:
            response = hit.result(timeout=self._timeout())
        except Exception:  # noqa: BLE001 - a branch that failed (a lost draft) is a miss
            return None
        with self._stats_lock:
            self.stats.add_proposal(response)
        self.stats.cache_hits += 1
        return Proposal.of(response, [])
