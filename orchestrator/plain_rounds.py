"""A round of several target steps in one Score, as a part of the loop.

PlainRounds is a base of orchestrator.loop.SpeculativeLoop (its `self`): where no draft is
waited for (orchestrator.loop's `_plain_steps` says when, and how many steps: PLAIN_STEPS to
MAX_PLAIN_STEPS), the target runs several one-token steps in one ScoreRequest (decode_steps),
choosing each token as a plain round's last one is chosen (greedy, the invariant rule, or the
draws' step uniforms), so a seed's output is a plain round's. Under load, when the adaptive
policy chose the plain round, each step is measured to it as the plain round it replaces.
"""

from __future__ import annotations

import time

from orchestrator.pair_costs import DraftCost, RoundReport
from orchestrator.rounds import Draws, Round
from specdec.v1 import model_pb2


class PlainRounds:
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
        return self._commit(list(scores.argmax_token_ids), proposed=0, accepted=0)

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
            )
        )
        self._committed = (now, self.policy.costs.quiet_since())
