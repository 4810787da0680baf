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
The pair's generations share one, except under the Leviathan rule: there the tree's shape decides
which uniform meets which token, so a generation keeps its own table (orchestrator.loop), learnt
from its rounds alone, and a seed replays its text whatever ran beside it.

Under adaptive lookahead, TreeChoice picks a tree or a chain each round by what each kind's
rounds measured (committed tokens a second).

This module owns that counting only; the loop feeds it, the draft reads its table.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from specdec.decoding import rule
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


EXPLORE_ROUNDS = 8  # rounds of each kind measured before the faster one is chosen
REVISIT = 16  # then one round in REVISIT tries the other kind, should the load or the text change
DECAY = 0.8  # weight of the past in a kind's measured rate


class TreeChoice:
    """Whether an adaptive generation's next round drafts a tree or a chain (of the k and the
    overlap its lookahead policy chose): the kind whose rounds measured more committed tokens a
    second, after EXPLORE_ROUNDS of each; the other is tried again one round in REVISIT. A tree
    that loses is chosen only for those measuring rounds. Shared by the generations on a pair."""

    def __init__(self):
        self._rate: dict[tuple[bool, bool], float] = {}  # (greedy, tree) -> tokens a second
        self._rounds: dict[tuple[bool, bool], int] = {}
        self._lock = threading.Lock()

    def tree(self, greedy: bool) -> bool:
        with self._lock:
            seen = {kind: self._rounds.get((greedy, kind), 0) for kind in (True, False)}
            if min(seen.values()) < EXPLORE_ROUNDS:
                return seen[True] <= seen[False]
            best = self._rate[(greedy, True)] > self._rate[(greedy, False)]
            return best != ((seen[True] + seen[False]) % REVISIT == 0)

    def update(self, greedy: bool, tree: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        with self._lock:
            key = (greedy, tree)
            rate = tokens / seconds
            old = self._rate.get(key)
            self._rate[key] = rate if old is None else DECAY * old + (1 - DECAY) * rate
            self._rounds[key] = self._rounds.get(key, 0) + 1


@dataclass
class PairTrees:
    """What a pair's generations learn of its trees together."""

    acceptance: TreeAcceptance = field(default_factory=TreeAcceptance)
    choice: TreeChoice = field(default_factory=TreeChoice)
