"""What the orchestrator learns of a pair's draft trees: how likely a child is to be accepted
once the rule tries it, by its rank among its siblings and its draft probability.

A draft tree keeps the nodes most likely to be reached and accepted (draft_service.proposer.
propose_tree). The draft's own probability is a poor estimate of that: the default pair's draft
gives its greedy token 0.5 where the target agrees 93% of the time, and a tree built on the
draft's probabilities spent its budget on runners-up (8 nodes: 5.45 tokens a round against 7.64
for a chain of 8). So each round's outcome is counted here, per (rank, probability bucket):
which children were tried (those before the accepted one on each node of the accepted path,
and every child of its last node) and whether each was accepted, starting from a prior of two
tries at the bucket's middle probability. The table rides on each tree's Propose
(ProposeRequest.tree_acceptance). Greedy and sampled rounds accept differently: a table each.

This module owns that counting only; the loop feeds it, the draft reads its table.
"""

from __future__ import annotations

import threading

import numpy as np

from specdec import rule
from specdec.validation import TREE_BRANCHES, TREE_BUCKETS

PRIOR_TRIES = 2.0  # pseudo-tries at the bucket's middle probability


class TreeAcceptance:
    """Counts of tried and accepted tree children, by (greedy or not, rank, probability bucket)."""

    def __init__(self):
        middle = (np.arange(TREE_BUCKETS) + 0.5) / TREE_BUCKETS
        prior = np.broadcast_to(middle, (TREE_BRANCHES, TREE_BUCKETS))
        self._tried = {greedy: np.full((TREE_BRANCHES, TREE_BUCKETS), PRIOR_TRIES) for greedy in (True, False)}
        self._accepted = {greedy: PRIOR_TRIES * prior.copy() for greedy in (True, False)}
        self._lock = threading.Lock()  # the generations on a pair share it

    def table(self, greedy: bool) -> list[float]:
        """ProposeRequest.tree_acceptance: accepted / tried, rank-major."""
        with self._lock:
            return (self._accepted[greedy] / self._tried[greedy]).ravel().tolist()

    def update(self, greedy: bool, parents: list[int], probs: list[float], path: list[int]) -> None:
        """Count a round: the tree (parents, each token's draft probability) and its accepted path."""
        kids = rule.tree_children(parents)
        with self._lock:
            tried, accepted = self._tried[greedy], self._accepted[greedy]
            for node, chosen in zip([-1, *path], [*path, None], strict=True):
                for rank, child in enumerate(kids.get(node, ())):
                    at = (min(rank, TREE_BRANCHES - 1), min(int(probs[child] * TREE_BUCKETS), TREE_BUCKETS - 1))
                    tried[at] += 1
                    if child == chosen:
                        accepted[at] += 1
                        break
