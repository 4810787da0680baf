"""Log probabilities of a round's committed tokens, from the target's own rows (ScoreResponse).

The target service scores every row of a verify anyway; asked (ScoreRequest.logprobs), it returns
each draft token's log probability in the row that scores it, each row's own token (its argmax, or
under the invariant rule its sample) with its log probability, and the row's most likely tokens,
all under the law the output is drawn from (specdec.decoding.sampling.logprobs_from_logits: the row masked
by the constraint, then temperature, top-k and top-p). Here they are matched to what the rule
committed. The loop calls these; they know nothing of RPC.
"""

from __future__ import annotations

import math

from specdec.v1 import model_pb2

# A token's (log probability, [(token, log probability)] of the most likely at its position)
Entry = tuple[float, list[tuple[int, float]]]


def top(scores: model_pb2.ScoreResponse, row: int) -> list[tuple[int, float]]:
    """The most likely tokens of a scored row."""
    entry = scores.row_logprobs[row]
    return list(zip(entry.top_ids, entry.top_logprobs, strict=True))


def chain(scores: model_pb2.ScoreResponse, committed: list[int], drafted: int, target_row=None) -> list[Entry]:
    """A chain's round: committed[j] sits at row j; the first `drafted` are this round's drafts,
    scored there; the others are the target's own token at their row (greedy, the invariant rule:
    `target_row` None) or, under the Leviathan rule, drawn from `target_row` (the row the Score
    returned, already the output's law: a continuation's first token or the recovered or bonus one)."""
    out = []
    for j, token in enumerate(committed):
        if j < drafted:
            value = scores.draft_token_logprobs[j]
        elif target_row is None:
            value = scores.row_logprobs[j].own_logprob
        else:
            value = math.log(float(target_row[token])) if target_row[token] > 0 else -math.inf
        out.append((value, top(scores, j)))
    return out


def tree(scores: model_pb2.ScoreResponse, path: list[int], parents: list[int], coupled: bool) -> list[Entry]:
    """A tree's round: each accepted node scored in its parent's row, then the last token after the
    path (the target's own token there, or under the Leviathan rule the one its walk drew)."""
    out = [(scores.draft_token_logprobs[node], top(scores, parents[node] + 1)) for node in path]
    last = path[-1] + 1 if path else 0
    value = scores.row_logprobs[last].own_logprob if coupled else scores.final_token_logprob
    return [*out, (value, top(scores, last))]
