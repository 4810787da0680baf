"""The speculative sampling rule (Leviathan et al. 2023; Chen et al. 2023), as pure functions.

Words, defined once:
- a draft token is *accepted* when it passes the test u <= target_probs[x] / draft_probs[x];
- at the first rejected position a *recovered* token is sampled from the residual
  norm(max(0, target_probs - draft_probs));
- when all k drafts are accepted, a *bonus* token is sampled from the target's distribution
  at the position after the last draft.
Greedy decoding (temperature 0) is the limit: accept while the draft token equals the target
argmax; the recovered or bonus token is the target argmax.

This module owns the math only: no RPC, no cache, no clock. Randomness comes in as uniforms
in [0, 1) drawn by the caller, so a seeded caller is reproducible. A model-free drafter
proposes deterministically: pass draft_token_probs of 1.0.
Distributions are numpy arrays; they need not be normalised (sampling normalises).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def accepted_length(draft_token_probs, target_token_probs, accept_uniforms) -> int:
    """Number of leading draft tokens the rule accepts.

    draft_token_probs: [k] draft_probs[i][x_i]; target_token_probs: [k] target_probs[i][x_i];
    accept_uniforms: [k] in [0, 1). Accept x_i iff u_i * draft <= target (u_i <= ratio).
    """
    draft = np.asarray(draft_token_probs, dtype=np.float64)
    target = np.asarray(target_token_probs, dtype=np.float64)
    u = np.asarray(accept_uniforms, dtype=np.float64)
    assert draft.shape == target.shape == u.shape and draft.ndim == 1, (draft.shape, target.shape, u.shape)
    rejected = np.flatnonzero(u * draft > target)
    return int(rejected[0]) if rejected.size else len(draft)


def greedy_accepted_length(draft_token_ids, target_argmax_ids) -> int:
    """Number of leading draft tokens equal to the target argmax at their position."""
    n = 0
    for draft, target in zip(draft_token_ids, target_argmax_ids, strict=False):
        if draft != target:
            break
        n += 1
    return n


def residual(target_probs, draft_probs) -> np.ndarray:
    """norm(max(0, target_probs - draft_probs)), both [vocab]; the recovered token's law."""
    target = np.asarray(target_probs, dtype=np.float64)
    draft = np.asarray(draft_probs, dtype=np.float64)
    assert target.shape == draft.shape and target.ndim == 1, (target.shape, draft.shape)
    res = np.maximum(target / target.sum() - draft / draft.sum(), 0.0)
    total = res.sum()
    if not total > 0.0:
        # Only reachable if the caller rejected a token the rule would have accepted.
        raise ValueError("residual distribution has no mass: target and draft rows are equal")
    return res / total


def sample(probs, uniform: float) -> int:
    """Inverse-CDF sample from an unnormalised [vocab] row; never picks a zero-mass token."""
    cdf = np.cumsum(np.asarray(probs, dtype=np.float64))
    assert cdf.ndim == 1 and cdf[-1] > 0, "row must have positive mass"
    assert 0.0 <= uniform < 1.0, uniform
    idx = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    # Rounding can land on the end or on a trailing zero-mass entry: take the last positive one.
    if idx >= len(cdf) or probs[idx] <= 0:
        idx = int(np.flatnonzero(np.asarray(probs) > 0)[-1])
    return idx


def final_token(accepted: int, k: int, target_row, draft_row: Callable[[], np.ndarray], final_uniform: float) -> int:
    """The round's last committed token: the bonus token when all k drafts were accepted, else
    the recovered token from the residual at the first rejected position.

    target_row: [vocab] target_probs at position `accepted`; draft_row(): [vocab] draft_probs
    at that position, asked for only on a rejection (the orchestrator fetches it over the wire).
    """
    if accepted == k:
        return sample(target_row, final_uniform)
    return sample(residual(target_row, draft_row()), final_uniform)


def speculative_step(
    draft_token_ids, draft_probs, target_probs, accept_uniforms, final_uniform: float
) -> tuple[int, int]:
    """One round of the rule over full rows, composed of the calls the distributed round makes:
    accepted_length (the target service's scorer, and the orchestrator) then final_token (the
    orchestrator). The statistical tests drive this composition.

    draft_token_ids: [k]; draft_probs: [k, vocab]; target_probs: [k + 1, vocab];
    accept_uniforms: [k]; final_uniform: the uniform of the recovered or bonus sample.
    Returns (number accepted, recovered-or-bonus token id). The committed tokens of the round
    are draft_token_ids[:accepted] + [that token].
    """
    draft_probs = np.asarray(draft_probs, dtype=np.float64)
    target_probs = np.asarray(target_probs, dtype=np.float64)
    k = len(draft_token_ids)
    assert draft_probs.shape[0] == k and target_probs.shape[0] == k + 1
    idx = np.arange(k)
    draft_at = draft_probs[idx, draft_token_ids] / draft_probs.sum(axis=1)
    target_at = target_probs[idx, draft_token_ids] / target_probs[:k].sum(axis=1)
    n = accepted_length(draft_at, target_at, accept_uniforms)
    return n, final_token(n, k, target_probs[n], lambda: draft_probs[n], final_uniform)
