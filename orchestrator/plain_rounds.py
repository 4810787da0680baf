"""A round of several target steps in one Score, as a part of the loop.

PlainRounds is a base of orchestrator.loop.SpeculativeLoop (its `self`): where no draft is
waited for (`_plain_steps` says when, and how many steps: PLAIN_STEPS to MAX_PLAIN_STEPS, or
MAX_UNARY_STEPS), the target runs several one-token steps in one ScoreRequest (decode_steps),
choosing each token as a plain round's last one is chosen (greedy, the invariant rule, or the
draws' step uniforms), so a seed's output is a plain round's. Under load, when the adaptive
policy chose the plain round, each step is measured to it as the plain round it replaces.
"""

from __future__ import annotations

import math
import time

from orchestrator import logprobs as token_logprobs
from orchestrator.pair_costs import DraftCost, RoundReport
from orchestrator.rounds import Draws, Round
from specdec.v1 import model_pb2

# Target-only rounds without a draft to wait for (speculation off, or a lost draft) run several
# one-token steps of the target in one Score (ScoreRequest.decode_steps): a round's RPC and the
# orchestrator's work (~2 ms, docs/performance.md) paid once for them all. PLAIN_STEPS at first; then
# as many as keep what the generation's last such rounds measured beyond the target's compute within
# ROUND_OVERHEAD_SHARE of it (decode_steps), up to MAX_PLAIN_STEPS: 4 on a CPU's 25 ms step, 12 on a
# GPU's 4 ms one. The stream gets a round's tokens together (4 steps: ~0.1 s on a CPU; 16: ~0.06 s on a GPU).
PLAIN_STEPS = 4
MAX_PLAIN_STEPS = 16
# The steps a Score for a client that reads nothing before the answer ends (a unary call without stop
# strings, LoopConfig.streamed), speculation off or its draft lost: each return of a session to the
# orchestrator costs it a batched step of the target under load (the others' next step has started
# when it comes back), and a 64-token answer returned 7 times (its open, then rounds of 1, 4, 16,
# 16, 16 and 11 steps) where it now returns twice. Bounded, so that a client gone is noticed within
# that many steps.
MAX_UNARY_STEPS = 64
ROUND_OVERHEAD_SHARE = 0.05


def decode_steps(overhead: float, step: float) -> int:
    """The steps a Score that keep a round's `overhead` seconds beyond the target's compute within
    ROUND_OVERHEAD_SHARE of the steps' (`step` seconds each): PLAIN_STEPS to MAX_PLAIN_STEPS."""
    wanted = math.ceil(overhead / (ROUND_OVERHEAD_SHARE * step)) if step > 0 else MAX_PLAIN_STEPS
    return max(PLAIN_STEPS, min(MAX_PLAIN_STEPS, wanted))


class PlainRounds:
    def _plain_steps(self, k: int) -> int | None:
        """The target's one-token steps a round of `k` drafts asks for in one Score (PLAIN_STEPS),
        where no draft is waited for: speculation off; the draft lost (a policy has nothing to
        choose then: a draft known lost ran a round a token under the measured default); no
        policy measuring the round; or the draft's session still opening (its prefill beside these
        rounds: a short answer, under a grammar say, ran 1-token rounds to its end, 0.7x speculation
        off); or, under load, the adaptive policy chose a plain round (one-token rounds ran 0.87x
        speculation off at 16 clients; the policy measures the steps as plain rounds,
        _measure_steps); and not the first round (the first token streams alone). None: one. An
        answer read at its end (LoopConfig.streamed False) with no draft to open or policy to
        measure, or the policy's plain choice, runs MAX_UNARY_STEPS a round, the first included.
        Under the Leviathan rule each step's token takes the draws of a plain round (Draws.stepped),
        so the text does not depend on how the steps are grouped; logprobs come with each step's."""
        cfg = self.config
        remaining = cfg.max_new_tokens - len(self.generated)
        opening = self._draft_opening is not None and not self._draft_opening.done()
        waiting = self.draft is not None and not self._draft_lost and not opening
        measuring = self.policy is not None and not opening and not self._draft_lost  # lost: nothing to choose
        if k:
            return None
        if not self._policy_plain and (waiting or measuring):
            return None
        if remaining <= 1:
            return None
        if not (cfg.streamed or opening):  # nothing reads or waits before the end
            return min(MAX_UNARY_STEPS, remaining)
        if not self.generated:
            return None
        return min(PLAIN_STEPS if self._plain_costs is None else decode_steps(*self._plain_costs), remaining)

    def _decode_round(self, steps: int, draws: Draws, start: float) -> Round:
        """Several plain rounds in one Score (_plain_steps): the target chooses each token as a
        plain round's last one is chosen (greedy, the invariant rule, or the draws' step uniforms)."""
        cfg = self.config
        # Every token left: the generation ends with this round (its length, or a stop token), and
        # the target closes the session with it, without a CloseSession's step after it.
        last = steps >= cfg.max_new_tokens - len(self.generated)
        scores, target_time = self._call(
            self.target.stub.Score,
            model_pb2.ScoreRequest(
                session=self.target.ref(),
                append_tokens=self.target.pending,
                sampling=self._sampling,
                noise_seed=cfg.noise_seed,
                # on its share while the draft's prefill runs beside (see Threads)
                threads=self._threads(self.target, concurrent=self._draft_opening is not None),
                decode_steps=steps,
                stop_token_ids=sorted(cfg.stop_token_ids),
                step_uniforms=draws.steps,
                close_session=last,
                logprobs=cfg.logprobs,
            ),
        )
        self.stats.add_scores(scores)
        self.target.length, self.target.pending, self.target.closed = scores.length, [], last
        self.stats.target_seconds += target_time
        seconds = time.perf_counter() - start
        self.stats.round_seconds += seconds
        measured = (seconds - scores.compute_seconds, scores.compute_seconds / max(1, len(scores.argmax_token_ids)))
        # (overhead a round, compute a step): each decode round weighs half, the ones before it the other half
        last = self._plain_costs or measured
        self._plain_costs = ((last[0] + measured[0]) / 2, (last[1] + measured[1]) / 2)
        if self._policy_plain:
            self._measure_steps(scores, target_time)
        tokens = list(scores.argmax_token_ids)
        # the target chose each step's token, under every rule, and reports it as a row's own token
        logprobs = None if cfg.logprobs is None else token_logprobs.chain(scores, tokens, 0)
        return self._commit(tokens, proposed=0, accepted=0, logprobs=logprobs)

    def _measure_steps(self, scores, target_time: float) -> None:
        """A decode round's steps, to the policy, as the plain rounds they replace: each step's
        share of its wait, compute and round time (the prices are a plain round's), all its tokens
        committed now (the rates)."""
        steps = max(1, len(scores.argmax_token_ids))
        now = time.perf_counter()
        self.policy.update(
            RoundReport(
                0,
                0,
                DraftCost(0.0, 0),
                target_time / steps,
                step_tokens=scores.step_tokens or None,
                target_compute=scores.compute_seconds / steps or None,
                round_seconds=(now - self._committed[0]) / steps,
                quiet=self.policy.costs.quiet(self._committed[1]),
                target_threads=scores.threads,
                committed=steps,
                at=now,
                steps=steps,
            )
        )
        self._committed = (now, self.policy.costs.quiet_since())
