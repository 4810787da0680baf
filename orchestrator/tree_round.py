"""A round over a draft tree, as a part of the loop.

TreeRound is a base of orchestrator.loop.SpeculativeLoop (its `self`): with tree_nodes > 0 the
draft proposes a tree of `depth` levels (ProposeRequest.tree_nodes), the target verifies it in
one forward, and the round commits the accepted path plus one token of the target's. Greedy and
the invariant rule walk the tree here (specdec.decoding.rule.tree_greedy_path), the Leviathan rule on the
target (rule.tree_walk), which returns the path and its final token; a path that is not one of
the draft's tree is an error. A lost draft or an empty tree makes the round a plain one. A tree
round is sequential (no continuation). Trees and their shapes: orchestrator.trees, and
docs/architecture.md#draft-trees.
"""

from __future__ import annotations

import time

import grpc

from orchestrator import logprobs as token_logprobs
from orchestrator.rounds import Draws, Round, SessionLost
from specdec.decoding import rule
from specdec.errors import SpecdecError
from specdec.v1 import model_pb2
from specdec.validation import TREE_DRAWS


class TreeRound:
    def _tree_round(self, depth: int, draws: Draws, start: float) -> Round:
        """A round over a draft tree (tree_nodes > 0): the draft proposes a tree of depth
        `depth`, the target verifies it in one forward; greedy and the invariant rule walk it
        here (rule.tree_greedy_path), the Leviathan rule on the target (rule.tree_walk)."""
        cfg = self.config
        asked = time.perf_counter()
        try:
            prefill = self._draft_behind()
            proposal, draft_time = self._draft_call(self.draft.stub.Propose, self._tree_request(depth, draws), prefill)
        except (SessionLost, grpc.RpcError) as err:  # a lost draft: a plain round
            if not self._draft_failed(err):
                raise
            self.stats.draft_seconds += time.perf_counter() - asked
            return self._speculate(0, 0, draws, start)
        self.draft.length, self.draft.pending = proposal.length, []
        tokens, parents = list(proposal.token_ids), list(proposal.parent_ids)
        if not tokens:  # a model-free drafter found nothing: a plain target step
            self.stats.draft_seconds += draft_time
            return self._speculate(0, 0, draws, start)
        request = model_pb2.ScoreRequest(
            session=self.target.ref(),
            append_tokens=self.target.pending,
            draft_token_ids=tokens,
            draft_parent_ids=parents,
            sampling=self._sampling,
            noise_seed=cfg.noise_seed,
            threads=self._threads(self.target, concurrent=False),
            logprobs=cfg.logprobs,
        )
        if not cfg.coupled:  # the Leviathan rule: the target walks the tree with the draft's rows
            request.draft_rows.extend(proposal.node_rows)
            request.draft_row_nodes[:] = proposal.row_nodes
            request.accept_uniforms[:] = draws.accept[: len(tokens)]
            request.final_uniform = draws.final
        scores, target_time = self._call(self.target.stub.Score, request)
        self.target.length, self.target.pending = scores.length, []
        if cfg.coupled:
            path = rule.tree_greedy_path(parents, tokens, scores.argmax_token_ids)
            last = scores.argmax_token_ids[path[-1] + 1 if path else 0]
        else:
            path, last = list(scores.accepted_nodes), scores.final_token
            if any(parents[node] != (path[i - 1] if i else -1) for i, node in enumerate(path)):
                raise SpecdecError(f"target returned {path}, not a path of the draft tree")
        self._tree_acceptance.update(cfg.sampling.greedy, parents, list(proposal.token_probs), path)
        with self._stats_lock:
            self.stats.draft_seconds += draft_time
            self.stats.target_seconds += target_time
            self.stats.add_proposal(proposal)
            self.stats.add_scores(scores)
        self.stats.round_seconds += time.perf_counter() - start
        logprobs = token_logprobs.tree(scores, path, parents, cfg.coupled) if cfg.logprobs is not None else None
        committed = [tokens[i] for i in path] + [last]
        return self._commit(committed, proposed=len(tokens), accepted=len(path), logprobs=logprobs)

    def _tree_request(self, depth: int, draws: Draws) -> model_pb2.ProposeRequest:
        cfg = self.config
        return model_pb2.ProposeRequest(
            session=self.draft.ref(),
            append_tokens=self.draft.pending,
            k=depth,
            sampling=self._sampling,
            uniforms=draws.draft[: depth * TREE_DRAWS],
            noise_seed=cfg.noise_seed,
            tree_nodes=cfg.tree_nodes,
            tree_acceptance=self._tree_acceptance.table(cfg.sampling.greedy),
            threads=self._threads(self.draft, concurrent=False),  # a tree's round is sequential
        )
