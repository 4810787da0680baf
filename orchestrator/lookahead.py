"""Adaptive lookahead: choose k per round from the session's recent acceptance and costs.

Policy. Under the i.i.d. model of Leviathan et al. (2023), with per-token acceptance alpha and
draft/target cost ratio c, a round of lookahead k commits (1 - alpha^(k+1)) / (1 - alpha)
tokens for a cost of (k c + 1) target forwards, so the speedup over target-only decoding is
    S(k) = (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1)).
The formula assumes a round costs one target step whatever k; on a CPU verifying k + 1 tokens
costs more than one (an fp32 135M target: 5 tokens 1.7x one token). With the target's round
time T(k) = T1 + b k (b: seconds per extra token scored), a round costs k (c + s) + 1 target
steps, s = b / T1, so the same S applies with c + s in place of c.
Each round picks the k in 1..k_max that maximises S with these estimated from the session:
- alpha: accepted / (accepted + rejections), the maximum-likelihood estimate for the
  geometric accept-until-first-reject process (a round that accepted everything contributes
  no rejection), over an exponentially weighted window (~5 rounds);
- c: draft seconds per proposed token / T1, likewise weighted;
- T1 and b: a weighted least-squares line through (tokens scored, target seconds) of the
  rounds so far (a slow window, ~30 rounds: the cost curve is the hardware's). While every
  round in it scored the same number of tokens the slope is unknown; then one round explores
  another k (half the usual one) and the fit has its two points.
Before any evidence it uses k_max. The choice of k never changes the output law (the rule is
exact for every k), only the speed. Pure: no clock, no RPC; the loop feeds it measurements.

Load. The model services batch the forwards of concurrent sessions (specdec.worker), so with
N generations running a target step costs about a + beta N n when each scores n tokens: the
slope b a session fits is beta, but when every session lengthens its rounds by one token
every step grows by N b. The policy is given N (`load`, the generations running in this
process) and prices speculation against everyone decoding without it: s = N b / T0 and
c = draft seconds per token / T0, with T0 = T1 - (N - 1) b (n_mean - 1) the step of N
one-token rounds. k = 0 (no speculation: the round is one target step) is a choice too,
S(0) = 1, taken when no k pays; rounds at k = 0 keep the fit fresh, and after EXPLORE_EVERY
rounds off one round explores k = 2, so acceptance and costs are measured again when the
load falls. An exploration that finds speculation still does not pay doubles the wait before
the next (up to EXPLORE_MAX rounds): under a steady high load the explorations' cost falls
towards nothing, so adaptive k stays as fast as speculation off.

Overlapped rounds (orchestrator.loop) change the cost: the draft proposes round r + 1 (k + 1
tokens, d seconds each) while the target verifies round r (T1 + b k seconds); a round whose
drafts were proposed that way starts at once, which happens when all k drafts and the
continuation's first token are accepted (alpha^(k+1)); otherwise it first waits for k fresh
drafts. Tokens per second in steady state:
    R(k) = E[tokens] / (max(T1 + b k, (k + 1) d) + (1 - alpha^(k+1)) k d),
with E[tokens] = (1 - alpha^(k+1)) / (1 - alpha) as before. Its best k makes the draft's
continuation end about when the verify does, less where rejections waste the drafting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

DECAY = 0.8  # weight of the past per round: an effective window of ~5 rounds
FIT_DECAY = 0.97  # the same for the verify-cost line: ~30 rounds
MIN_SPREAD = 0.1  # weighted variance of tokens scored below which the slope is unknown
EXPLORE_EVERY = 8  # rounds without speculation before one round tries it again
EXPLORE_MAX = 128  # the longest wait, after explorations that found speculation does not pay


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """S(k) above; alpha in [0, 1]; S(0) = 1."""
    tokens = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * cost_ratio + 1)


def best_lookahead(alpha: float, cost_ratio: float, k_max: int) -> int:
    """The k in 0..k_max with the highest S (0: no speculation pays)."""
    return max(range(0, k_max + 1), key=lambda k: expected_speedup(alpha, k, cost_ratio))


def overlapped_rate(alpha: float, k: int, draft: float, t1: float, slope: float) -> float:
    """R(k) above: tokens per second of overlapped rounds; draft, t1, slope in seconds."""
    tokens = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    carried = alpha ** (k + 1)
    return tokens / (max(t1 + slope * k, (k + 1) * draft) + (1 - carried) * k * draft)


def best_overlapped_lookahead(alpha: float, draft: float, t1: float, slope: float, k_max: int) -> int:
    return max(range(1, k_max + 1), key=lambda k: overlapped_rate(alpha, k, draft, t1, slope))


@dataclass
class AdaptiveLookahead:
    k_max: int
    overlap: bool = False  # rounds are overlapped: maximise R(k) instead of S(k) (one generation)
    load: Callable[[], int] = lambda: 1  # generations sharing the services' forwards
    accepted: float = 0.0
    rejections: float = 0.0
    draft_seconds: float = 0.0
    draft_tokens: float = 0.0
    # weighted sums for the line target_seconds = T1 + b * (tokens scored - 1)
    fit_w: float = 0.0
    fit_n: float = 0.0
    fit_t: float = 0.0
    fit_nn: float = 0.0
    fit_nt: float = 0.0
    off_rounds: int = 0  # rounds in a row chosen without speculation
    explore_after: int = EXPLORE_EVERY  # rounds off before the next exploration

    def next_k(self) -> int:
        """The k for the next round (called once a round: it counts the rounds off)."""
        k = self._best_k()
        if k > 0:
            self.off_rounds, self.explore_after = 0, EXPLORE_EVERY
            return k
        self.off_rounds += 1
        if self.off_rounds < self.explore_after:
            return 0
        self.off_rounds, self.explore_after = 0, min(2 * self.explore_after, EXPLORE_MAX)
        return min(2, self.k_max)

    def _best_k(self) -> int:
        if self.fit_w == 0 or self.accepted + self.rejections == 0 or self.draft_tokens == 0:
            return self.k_max
        line = self.verify_cost()
        if line is None:  # every recent round scored the same number of tokens: try another k
            usual = round(self.fit_n / self.fit_w) - 1
            if usual == 0:  # rounds have been off: next_k's explorations (backing off) probe k = 2
                return 0
            return usual // 2 if usual >= 2 else min(self.k_max, usual + 2)
        t1, slope = line
        alpha = self.accepted / (self.accepted + self.rejections)
        draft_per_token = self.draft_seconds / self.draft_tokens
        n = max(1, self.load())
        if self.overlap and n == 1:
            return best_overlapped_lookahead(alpha, draft_per_token, t1, slope, self.k_max)
        t0 = max(t1 - (n - 1) * slope * (self.fit_n / self.fit_w - 1), t1 / n)  # all at one token
        return best_lookahead(alpha, (draft_per_token + n * slope) / t0, self.k_max)

    def verify_cost(self) -> tuple[float, float] | None:
        """(T1, b): target seconds for a round scoring one token and per extra token scored;
        None while the rounds do not spread over enough sizes to fit a slope."""
        mean_n, mean_t = self.fit_n / self.fit_w, self.fit_t / self.fit_w
        spread = self.fit_nn / self.fit_w - mean_n**2
        if spread < MIN_SPREAD:
            return None if self.k_max > 1 else (mean_t, 0.0)
        slope = max(0.0, (self.fit_nt / self.fit_w - mean_n * mean_t) / spread)
        t1 = mean_t - slope * (mean_n - 1)
        return (t1, slope) if t1 > 0 else (mean_t, 0.0)

    def update(
        self, proposed: int, accepted: int, draft_seconds: float, target_seconds: float, drafted: int | None = None
    ) -> None:
        """One round: drafts verified and accepted, the draft's seconds for `drafted` tokens
        (default: the proposed ones; overlapped, also the continuation's), the target's seconds."""
        d = DECAY
        self.accepted = d * self.accepted + accepted
        self.rejections = d * self.rejections + (1 if accepted < proposed else 0)
        self.draft_seconds = d * self.draft_seconds + draft_seconds
        self.draft_tokens = d * self.draft_tokens + (proposed if drafted is None else drafted)
        f, n = FIT_DECAY, proposed + 1  # tokens the target scored
        self.fit_w = f * self.fit_w + 1
        self.fit_n = f * self.fit_n + n
        self.fit_t = f * self.fit_t + target_seconds
        self.fit_nn = f * self.fit_nn + n * n
        self.fit_nt = f * self.fit_nt + n * target_seconds
