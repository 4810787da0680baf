"""Proposing: k autoregressive draft steps with the request's sampling transform.

Randomness comes in as uniforms (one per token) so the service is deterministic and a
seeded request reproducible. In sampling mode the k distributions stay in the session
for ProposalRow: the rule needs one of them only when it rejects.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec import rule
from specdec.engine import Forward, Session, SessionEngine
from specdec.errors import FailedPrecondition, OutOfRange
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.validation import TREE_BRANCHES, TREE_BUCKETS


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


@dataclass
class TreeProposal:
    """A draft tree (ProposeResponse): tokens with their parents (-1: after the committed tokens;
    parents first, a node's children in the order they were drawn), the draft probability of
    each token in its parent's row, and (Leviathan sampling) the rows its nodes were drawn from."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # node (-1: the root) -> [vocab]


def propose_tree(
    engine: SessionEngine,
    session: Session,
    depth: int,
    nodes: int,
    params: SamplingParams,
    uniforms: list[float],
    noise_seed: int | None = None,
    acceptance: list[float] = (),
) -> Generator[Forward, torch.Tensor, TreeProposal]:
    """A draft tree of at most `nodes` tokens and `depth` levels after the committed tokens.

    The draft drafts a spine, one step a depth as a chain (so any backend drafts trees: only the
    target's verify attends a tree), and at each spine node draws TREE_BRANCHES children from
    its row: the most probable tokens (greedy), draws without replacement with the caller's
    uniforms (sampling), or the most probable under the position's noise (the invariant rule).
    The first child continues the spine. The tree keeps the `nodes` children most likely to be
    reached and accepted (EAGLE-2's dynamic tree, restricted to one expanded node a depth): a
    child's chance is its parent's times the chance its earlier siblings are all rejected times
    its own, taken from `acceptance` (ProposeRequest.tree_acceptance: measured by rank and draft
    probability) or else its draft probability. A child's score is the least chance among it and
    the siblings before it, so a parent outranks its children and a node's kept children are the
    first ones drawn (the rule tries them in that order). The spine stops once no deeper node
    could make the cut."""
    coupled = noise_seed is not None and not params.greedy
    spine: list[int] = []
    rows: list[torch.Tensor] = []  # the spine's rows: rows[d] the row at depth d (rows[0] the root's)
    candidates: list[tuple[float, int, int, int, float]] = []  # (score, depth, rank, token, prob)
    reach = 1.0  # the chance the spine so far is accepted

    def chance(rank: int, prob: float) -> float:  # of a child being accepted once tried
        if not acceptance:
            return prob
        return acceptance[min(rank, TREE_BRANCHES - 1) * TREE_BUCKETS + min(int(prob * TREE_BUCKETS), TREE_BUCKETS - 1)]

    for d in range(depth):
        logits = (yield engine.forward(session, spine, 1))[0]
        probs = torch.softmax(logits.float(), dim=-1) if params.greedy else probs_from_logits(logits[None], params)[0]
        if params.greedy:
            top = torch.topk(probs, min(TREE_BRANCHES, probs.shape[-1]))
            drawn = [t for t, p in zip(top.indices.tolist(), top.values.tolist(), strict=True) if p > 0]
        elif coupled:
            drawn = rule.coupled_ranking(probs, noise_seed, len(session.tokens) + d, TREE_BRANCHES)
        else:
            drawn = rule.draw_without_replacement(
                probs.cpu().numpy(), uniforms[d * TREE_BRANCHES : (d + 1) * TREE_BRANCHES]
            )
        rows.append(probs)
        least, missed = 1.0, 1.0  # the least chance so far; the chance the earlier siblings all failed
        for rank, (token, p) in enumerate(zip(drawn, probs[drawn].tolist(), strict=True)):
            least = min(least, reach * missed * chance(rank, p))
            missed *= 1.0 - chance(rank, p)
            candidates.append((least, d, rank, token, p))
        reach *= chance(0, candidates[-len(drawn)][4])
        spine.append(drawn[0])
        best = sorted(c[0] for c in candidates)[-nodes:]
        if len(best) == nodes and best[0] >= reach:  # every deeper node scores reach at most
            break
    kept = sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))[:nodes]
    kept.sort(key=lambda c: (c[1], c[2]))  # by depth, then draw order: parents before children
    index = {(d, rank): i for i, (_, d, rank, _, _) in enumerate(kept)}
    parents = [-1 if d == 0 else index[(d - 1, 0)] for _, d, _, _, _ in kept]
    proposal = TreeProposal([c[3] for c in kept], parents, [c[4] for c in kept])
    if not params.greedy and not coupled:  # the rows the target's rule reads (ScoreRequest.draft_rows)
        proposal.rows = {parent: rows[0 if parent < 0 else kept[parent][1] + 1] for parent in set(parents)}
    return proposal
