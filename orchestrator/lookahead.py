"""Adaptive lookahead: choose k per round from the session's recent acceptance and costs.

Policy. Under the i.i.d. model of Leviathan et al. (2023), with per-token acceptance alpha and
draft/target cost ratio c, a round of lookahead k commits (1 - alpha^(k+1)) / (1 - alpha)
tokens for a cost of (k c + 1) target forwards, so the speedup over target-only decoding is
    S(k) = (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1)).
Each round picks the k in 1..k_max that maximises S with alpha and c estimated from the
session so far:
- alpha: accepted / (accepted + rejections), the maximum-likelihood estimate for the
  geometric accept-until-first-reject process (a round that accepted everything contributes
  no rejection), over an exponentially weighted window;
- c: draft seconds per proposed token / target seconds per round, likewise weighted.
Before any evidence it uses k_max. The choice of k never changes the output law (the rule is
exact for every k), only the speed. Pure: no clock, no RPC; the loop feeds it measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8  # weight of the past per round: an effective window of ~5 rounds


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """S(k) above; alpha in [0, 1]."""
    tokens = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * cost_ratio + 1)


def best_lookahead(alpha: float, cost_ratio: float, k_max: int) -> int:
    return max(range(1, k_max + 1), key=lambda k: expected_speedup(alpha, k, cost_ratio))


@dataclass
class AdaptiveLookahead:
    k_max: int
    accepted: float = 0.0
    rejections: float = 0.0
    draft_seconds: float = 0.0
    draft_tokens: float = 0.0
    target_seconds: float = 0.0
    rounds: float = 0.0

    def next_k(self) -> int:
        if self.rounds == 0 or self.accepted + self.rejections == 0 or self.draft_tokens == 0:
            return self.k_max
        alpha = self.accepted / (self.accepted + self.rejections)
        cost_ratio = (self.draft_seconds / self.draft_tokens) / (self.target_seconds / self.rounds)
        return best_lookahead(alpha, cost_ratio, self.k_max)

    def update(self, proposed: int, accepted: int, draft_seconds: float, target_seconds: float) -> None:
        d = DECAY
        self.accepted = d * self.accepted + accepted
        self.rejections = d * self.rejections + (1 if accepted < proposed else 0)
        self.draft_seconds = d * self.draft_seconds + draft_seconds
        self.draft_tokens = d * self.draft_tokens + proposed
        self.target_seconds = d * self.target_seconds + target_seconds
        self.rounds = d * self.rounds + 1
