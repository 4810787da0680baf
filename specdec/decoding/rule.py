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
import torch

from specdec.greedy import argmax


def accepted_length(draft_token_probs, target_token_probs, accept_uniforms) -> int:
    """Number of leading draft tokens the rule accepts.

    draft_token_probs: [k] draft_probs[i][x_i]; target_token_probs: [k] target_probs[i][x_i];
    accept_uniforms: [k] in [0, 1). Accept x_i iff u_i * draft <= target (u_i <= ratio).
    """
    draft = np.asarray(draft_token_probs, dtype=np.float64)
    target = np.asarray(target_token_probs, dtype=np.float64)
    u = np.asarray(accept_uniforms, dtype=np.float64)
    assert draft.shape == target.shape == u.shape and draft.ndim == 1, (draft.shape, target.shape, u.shape)
    # A token with no target mass is rejected even at u = 0 (a grammar forbids it: never output).
    rejected = np.flatnonzero((u * draft > target) | (target <= 0))
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


# -- the drafter-invariant rule (Gumbel-max coupling; Daliri et al. 2024) ------------------------
# At each position of the sequence, Gumbel noise g over the vocabulary comes from a counter-based
# generator keyed by (seed, position, token). The target's token there is argmax(log target_probs
# + g); the draft proposes argmax(log draft_probs + g) with the same noise, and a draft token is
# accepted iff it equals the target's token at its position. Gumbel-max makes the target's token
# a sample of target_probs, so the output is the target's own seeded sample: a function of the
# seed and the target alone, whatever drafted it, with how many drafts, in which rounds, batches
# or schedule (the noise of a position is never drawn twice differently). Acceptance is at least
# (1 - TV) / (1 + TV) for the total variation TV between the two rows, against 1 - TV for the
# Leviathan rule above. Nothing vocabulary-sized crosses the wire: the services compute the noise.

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (the golden ratio)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(x: int) -> int:
    """SplitMix64's finaliser on a Python int (a bijection of 64-bit words)."""
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    """A 64-bit word as the int64 that holds the same bits."""
    return x - (1 << 64) if x >> 63 else x


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical shift right of int64 words (>> on int64 shifts the sign in)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix_words(x: torch.Tensor) -> torch.Tensor:
    """_mix on int64 tensors: products wrap modulo 2^64 on every device, as the words need."""
    x = (x ^ _lsr(x, 30)) * _signed(_MIX1)
    x = (x ^ _lsr(x, 27)) * _signed(_MIX2)
    return x ^ _lsr(x, 31)


def noise_key(seed: int, position: int) -> int:
    """The generator's key of one position of a seeded sequence (a 64-bit word)."""
    return _mix((_mix(seed & _MASK64) + position * _GAMMA) & _MASK64)


def exponentials(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise (float64) of each (key, token id) pair, keys as noise_key gives them (as
    int64 words): counter-based, so the noise of a token at a position is the same whichever
    tokens are asked for, on any device. keys and token_ids broadcast together.

    -log of it is standard Gumbel noise: argmax(probs / E) is argmax(log probs + Gumbel), the
    Gumbel-max sample of probs, with one logarithm a token instead of three."""
    x = _mix_words(token_ids.to(torch.int64) * _signed(_GAMMA) + keys.to(torch.int64))
    uniform = (_lsr(x, 11).to(torch.float64) + 0.5) * 2.0**-53  # in (0, 1), 53 random bits
    return -torch.log(uniform)


def coupled_tokens(probs: torch.Tensor, seed: int, positions: list[int]) -> list[int]:
    """The invariant rule's token of each row: the Gumbel-max sample of the row with the noise
    of (seed, that row's position), argmax(probs / E). probs: [n, vocab] after the sampling
    transform (temperature, top-k, top-p), unnormalised is fine (zero mass never wins);
    positions: [n], each row's index in the sequence."""
    assert probs.ndim == 2 and probs.shape[0] == len(positions), (probs.shape, len(positions))
    keys = torch.tensor([_signed(noise_key(seed, p)) for p in positions], dtype=torch.int64, device=probs.device)
    tokens = torch.arange(probs.shape[1], device=probs.device)
    if probs.device.type == "cpu":  # row by row, its intermediates stay in cache: 5 rows 2.2 ms, not 4.7
        rows = zip(probs, keys, strict=True)
        return [argmax((row.double() / exponentials(key, tokens))[None])[0] for row, key in rows]
    return argmax(probs.double() / exponentials(keys[:, None], tokens[None]))


def coupled_ranking(probs: torch.Tensor, seed: int, position: int, k: int) -> list[int]:
    """A row's k best tokens under the noise of (seed, position), best first (those with mass):
    the first is coupled_tokens' sample, the others the invariant rule's runners-up, which a
    draft tree offers as siblings. probs: [vocab]."""
    key = torch.tensor(_signed(noise_key(seed, position)), device=probs.device)
    scores = probs.double() / exponentials(key, torch.arange(probs.shape[-1], device=probs.device))
    top = torch.topk(scores, min(k, probs.shape[-1]))
    return [int(t) for t, s in zip(top.indices.tolist(), top.values.tolist(), strict=True) if s > 0]


# -- draft trees ---------------------------------------------------------------------------------
# A tree of n draft nodes: tokens[i] and parents[i] (-1: the node follows the committed tokens,
# else an earlier node's index). Rows of the target (and of the draft) are indexed by node + 1:
# row 0 is the root (the law of the token after the committed ones), row i + 1 the law after node
# i. A node's children are the nodes whose parent it is, in index order: the order the draft drew
# them in. A chain is a tree of one branch, and these reduce to the chain rule above on it.


def tree_children(parents) -> dict[int, list[int]]:
    """Each node's children in index order; key -1 is the root."""
    out: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        assert -1 <= parent < i, (i, parent)  # parents come before their children
        out.setdefault(int(parent), []).append(i)
    return out


def tree_greedy_path(parents, tokens, target_tokens) -> list[int]:
    """The accepted nodes: from the root, the child whose token is the target's token at its
    parent, while there is one. target_tokens: [n + 1] the target's token at the root and after
    each node (its argmax, or under the invariant rule its Gumbel-max sample). The round commits
    those nodes' tokens, then target_tokens[1 + path[-1]] (target_tokens[0] for an empty path)."""
    kids, path, node = tree_children(parents), [], -1
    while True:
        match = [c for c in kids.get(node, ()) if tokens[c] == target_tokens[node + 1]]
        if not match:
            return path
        node = match[0]  # a node's children are distinct tokens
        path.append(node)


def tree_walk(parents, tokens, target_rows, draft_rows, accept_uniforms, final_uniform: float) -> tuple[list[int], int]:
    """Recursive rejection sampling down a draft tree (SpecInfer; Sequoia): (accepted nodes, the
    round's last token). At a node, its children are tried in order: child x is accepted with
    min(1, target(x) / draft(x)); on a rejection the target's row becomes the residual
    norm(max(0, target - draft)) and x leaves the draft's row (the children were drawn from it
    without replacement), then the next child is tried; past the last, the token is sampled from
    the residual. An accepted child becomes the node; a node without children ends the path with
    a bonus token from its target row. The output law is the target's.

    target_rows: [n + 1, vocab] (row 0 the root's); draft_rows: {node: [vocab]} for the root (-1)
    and every node with children, the row its children were drawn from; accept_uniforms: [n], the
    uniform that tests node i; final_uniform: the last token's."""
    kids, path, node = tree_children(parents), [], -1
    while True:
        target = np.asarray(target_rows[node + 1], dtype=np.float64)
        target = target / target.sum()
        children = kids.get(node, [])
        if children:
            draft = np.asarray(draft_rows[node], dtype=np.float64)
            draft = draft / draft.sum()
        accepted = None
        for child in children:
            x = tokens[child]
            if target[x] > 0 and accept_uniforms[child] * draft[x] <= target[x]:
                accepted = child
                break
            target = residual(target, draft)
            draft = draft.copy()
            draft[x] = 0.0
            if not draft.sum() > 0:
                break
            draft /= draft.sum()
        if accepted is None:
            return path, sample(target, final_uniform)
        path.append(accepted)
        node = accepted


def draw_without_replacement(probs, uniforms) -> list[int]:
    """Tokens drawn one by one from `probs` without replacement (each with its uniform), until the
    uniforms or the mass run out: the order a draft tree's children are tried in (tree_walk)."""
    row = np.array(probs, dtype=np.float64)
    out = []
    for u in uniforms:
        if not row.sum() > 0:
            break
        token = sample(row, u)
        out.append(token)
        row[token] = 0.0
    return out
