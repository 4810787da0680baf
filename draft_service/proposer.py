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
) -> Generator[Forward, torch.Tensor, tuple[list[int], list[float]]]:
    """Propose k tokens after the committed sequence: (token ids, draft probs of them).

    A request for the engine's worker: each draft step is one forward, batched with the
    steps of the other sessions proposing at the same time."""
    assert k >= 1 and (params.greedy or len(uniforms) == k), (k, len(uniforms))  # checked at the edge
    drafts: list[int] = []
    token_probs: list[float] = []
    rows = []
    for i in range(k):
        logits = (yield engine.forward(session, drafts, 1))[0]
        if params.greedy:
            token = int(torch.argmax(logits))
        else:
            row = probs_from_logits(logits[None], params)[0]
            token = rule.sample(row.cpu().numpy(), uniforms[i])
            token_probs.append(float(row[token]))
            rows.append(row)
        drafts.append(token)
    session.proposal_rows = torch.stack(rows) if rows else None
    return drafts, token_probs


def proposal_row(session: Session, position: int) -> np.ndarray:
    """The draft distribution at a position of the last (sampling-mode) proposal."""
    rows = session.proposal_rows
    if rows is None:
        raise FailedPrecondition("the session has no sampling-mode proposal to read")
    if not 0 <= position < rows.shape[0]:
        raise OutOfRange(f"position {position} is outside 0..{rows.shape[0] - 1}")
    return rows[position].float().cpu().numpy()
