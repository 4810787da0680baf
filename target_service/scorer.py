"""Scoring: [last committed token, drafts...] in one forward pass, k + 1 positions.

Scoring runs on the engine's model worker, batched with other sessions' forwards.
Greedy: the argmax at each position, nothing vocabulary-sized. Sampling: the target
probability of each draft token, and the one row the rule needs: with the caller's
acceptance uniforms the service evaluates the same pure rule the orchestrator runs and
returns the row at the first rejected position (or the bonus row).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import numpy as np
import torch

from specdec import rule
from specdec.engine import Forward, Session, SessionEngine
from specdec.sampling import SamplingParams, probs_from_logits


@dataclass
class Scores:
    argmax: list[int]  # greedy: [k + 1]
    draft_token_probs: list[float]  # sampling: [k] target_probs[i][x_i]
    row_position: int  # sampling: which row `row` is
    row: np.ndarray | None  # sampling: [vocab] float32
    step_tokens: int = 0  # tokens of the batched forward that scored them, all sessions'
    step_sessions: int = 0  # sessions that batched forward ran
    step_threads: int = 0  # the threads it ran with (0: the process's)
    waited: float = 0.0  # seconds it waited for the machine's core lock
    forward_seconds: float = 0.0  # seconds of the batched forward


def score(
    engine: SessionEngine,
    session: Session,
    draft_ids: list[int],
    params: SamplingParams,
    draft_token_probs: list[float],
    accept_uniforms: list[float],
    noise_seed: int | None = None,
) -> Generator[Forward, torch.Tensor, Scores]:
    """A request for the engine's worker (yields its one forward). `noise_seed` (sampling): the
    invariant rule, `argmax` then holds the target's Gumbel-max sample at each position."""
    k = len(draft_ids)
    coupled = noise_seed is not None and not params.greedy
    # checked at the edge (specdec.validation)
    assert params.greedy or coupled or len(draft_token_probs) == len(accept_uniforms) == k, (k, len(accept_uniforms))
    forward = engine.forward(session, draft_ids, k + 1)
    logits = yield forward  # [k + 1, vocab]
    step = forward.step_tokens, forward.step_sessions, forward.step_threads, forward.waited, forward.seconds
    if params.greedy:
        return Scores(torch.argmax(logits, dim=-1).tolist(), [], 0, None, *step)
    probs = probs_from_logits(logits, params)
    if coupled:
        positions = range(len(session.tokens), len(session.tokens) + k + 1)
        return Scores(rule.coupled_tokens(probs, noise_seed, list(positions)), [], 0, None, *step)
    rows = torch.arange(k, device=probs.device)
    at = probs[rows, torch.tensor(draft_ids, dtype=torch.long, device=probs.device)].tolist()
    n = rule.accepted_length(draft_token_probs, at, accept_uniforms)
    return Scores([], at, n, probs[n].cpu().numpy(), *step)
