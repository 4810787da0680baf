"""Proposing: k autoregressive draft steps with the request's sampling transform.

Randomness comes in as uniforms (one per token) so the service is deterministic and a
seeded request reproducible. In sampling mode the k distributions stay in the session
for ProposalRow: the rule needs one of them only when it rejects.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np
import torch

from specdec import rule
from specdec.engine import Forward, Session, SessionEngine
from specdec.errors import FailedPrecondition, OutOfRange
from specdec.sampling import SamplingParams, probs_from_logits


def propose(
    engine: SessionEngine,
    session: Session,
    k: int,
    params: SamplingParams,
    uniforms: list[float],
    assumed: list[int] = (),
    noise_seed: int | None = None,
) -> Generator[Forward, torch.Tensor, tuple[list[int], list[float]]]:
    """Propose k tokens after the committed sequence and `assumed` (tokens taken as given, not
    committed: an overlapped round's continuation): (token ids, draft probs of them).
    `noise_seed` (sampling): the invariant rule, each token the Gumbel-max sample of its row
    with the noise of its position (specdec.rule.coupled_tokens); no probs, no rows kept.

    A request for the engine's worker: each draft step is one forward, batched with the
    steps of the other sessions proposing at the same time."""
    coupled = noise_seed is not None and not params.greedy
    assert k >= 1 and (params.greedy or coupled or len(uniforms) == k), (k, len(uniforms))  # checked at the edge
    assumed = list(assumed)
    drafts: list[int] = []
    token_probs: list[float] = []
    rows = []
    for i in range(k):
        logits = (yield engine.forward(session, assumed + drafts, 1))[0]
        if params.greedy:
            token = int(torch.argmax(logits))
        elif coupled:
            position = len(session.tokens) + len(assumed) + i
            [token] = rule.coupled_tokens(probs_from_logits(logits[None], params), noise_seed, [position])
        else:
            row = probs_from_logits(logits[None], params)[0]
            token = rule.sample(row.cpu().numpy(), uniforms[i])
            token_probs.append(float(row[token]))
            rows.append(row)
        drafts.append(token)
    if not coupled:
        keep_rows(session, len(assumed), torch.stack(rows) if rows else None, drafts)
    return drafts, token_probs


def keep_rows(session: Session, offset: int, rows: torch.Tensor | None, tokens: list[int]) -> None:
    """Hold a proposal's rows (and the tokens they drew), which start `offset` positions after
    the committed tokens, and those the session already holds for the positions before them
    (the proposal this one continues), so ProposalRow can read either."""
    start = len(session.tokens)
    held = session.proposal_rows
    if rows is not None and offset and held is not None:
        first = start - session.proposal_start
        if first >= 0 and first + offset <= held.shape[0]:
            rows = torch.cat([held[first : first + offset], rows])
            tokens = session.proposal_tokens[first : first + offset] + tokens
            offset = 0
    session.proposal_rows, session.proposal_start, session.proposal_tokens = rows, start + offset, list(tokens)


def proposal_row(session: Session, position: int, token_id: int | None = None) -> np.ndarray:
    """The draft distribution at `position` after the committed tokens (sampling mode); with
    `token_id`, only if that is the token it drew there."""
    rows = session.proposal_rows
    if rows is None:
        raise FailedPrecondition("the session has no sampling-mode proposal to read")
    index = len(session.tokens) + position - session.proposal_start
    if not 0 <= index < rows.shape[0]:
        first = session.proposal_start - len(session.tokens)
        raise OutOfRange(f"position {position} is outside {first}..{first + rows.shape[0] - 1}")
    if token_id is not None and session.proposal_tokens[index] != token_id:
        raise FailedPrecondition(
            f"position {position}: the draft proposed token {session.proposal_tokens[index]} there, not {token_id}"
        )
    return rows[index].float().cpu().numpy()
