"""Penalties and biases: a row's logits as a function of the sequence before it.

Owns the request's frequency, presence and repetition penalties and its logit bias
(SamplingParams), applied to the logits of a row given the tokens before its position: the
session's committed tokens and, for a drafted position, the drafts before it as if they were
committed (a chain's prefix, a tree's path). The draft's rows and the target's take the same
transform, so the rule (specdec.decoding.rule, unchanged) compares transformed rows and its output follows
the transformed law exactly; greedy is the transformed argmax. Temperature, top-k, min-p and top-p
come after (specdec.decoding.sampling), the grammar's mask before (specdec.decoding.grammar); a token at -inf stays
there.

- frequency_penalty, presence_penalty (OpenAI's, as vLLM applies them): minus f x the times the
  token was generated, minus p if it was at all; the prompt is not counted.
- repetition_penalty (HF's): a token in the prompt or generated has its logit divided by r where
  positive, multiplied by r where negative.
- logit_bias: added to the token's logit.

Pure torch functions; rows stay on the model's device. Does not own when rows are computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.decoding.sampling import SamplingParams


def penalize(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: Sequence[int],
    generated: Sequence[int],
    before: Sequence[Sequence[int]],
) -> torch.Tensor:
    """logits [n, vocab] -> float32 logits [n, vocab] under the request's penalties and biases, row i
    after `generated` (past the `prompt`) then the speculative tokens `before[i]`; the logits
    themselves where the request has none."""
    if not params.penalized:
        return logits
    n, vocab = logits.shape
    device = logits.device
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
    seen = [t for t in generated if 0 <= t < vocab]
    if seen:
        counts += torch.bincount(torch.tensor(seen, device=device), minlength=vocab)[:vocab].float()
    for row, tokens in enumerate(before):
        ids = [t for t in tokens if 0 <= t < vocab]
        if ids:
            counts[row].index_add_(0, torch.tensor(ids, device=device), torch.ones(len(ids), device=device))
    out = logits.float().clone()
    if params.repetition_penalty != 1.0:
        present = counts > 0
        in_prompt = [t for t in prompt if 0 <= t < vocab]
        if in_prompt:
            present[:, torch.tensor(in_prompt, device=device)] = True
        r = params.repetition_penalty
        out = torch.where(present, torch.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty:
        out -= params.frequency_penalty * counts
    if params.presence_penalty:
        out -= params.presence_penalty * (counts > 0).float()
    if params.logit_bias:
        bias = [(t, b) for t, b in params.logit_bias if t < vocab]
        if bias:
            ids = torch.tensor([t for t, _ in bias], device=device)
            out[:, ids] += torch.tensor([b for _, b in bias], dtype=torch.float32, device=device)
    return out


def session_rows(
    session, logits: torch.Tensor, params: SamplingParams, before: Sequence[Sequence[int]]
) -> torch.Tensor:
    """penalize() for rows after a session's committed tokens (its `tokens`, the first
    `prompt_length` of them the prompt) and each row's speculative tokens `before[i]`."""
    if not params.penalized:
        return logits
    cut = session.prompt_length
    return penalize(logits, params, session.tokens[:cut], session.tokens[cut:], before)


def chain(tokens: Sequence[int], rows: int) -> list[list[int]]:
    """The speculative tokens before each of `rows` rows of a chain: none, then each prefix of `tokens`."""
    return [list(tokens[:i]) for i in range(rows)]


def paths(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """The speculative tokens before a draft tree's rows: the root's (none), then each node's path
    from the root through it (parents[i]: an earlier index or -1)."""
    out: list[list[int]] = [[]]
    for node in range(len(tokens)):
        parent = parents[node]
        out.append((out[parent + 1] if parent >= 0 else []) + [tokens[node]])
    return out
