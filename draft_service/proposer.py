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

from specdec.decoding import penalties, rule
from specdec.decoding.sampling import SamplingParams, probs_from_logits
from specdec.errors import FailedPrecondition, OutOfRange
from specdec.greedy import argmax
from specdec.runtime.engine import SessionEngine
from specdec.runtime.session import Forward, Session
from specdec.validation import TREE_BRANCHES, TREE_BUCKETS, TREE_EXPAND


def propose(
    engine: SessionEngine,
    session: Session,
    k: int,
    params: SamplingParams,
    uniforms: list[float],
    assumed: list[int] = (),
    noise_seed: int | None = None,
    alternatives: list | None = None,
) -> Generator[Forward, torch.Tensor, tuple[list[int], list[float]]]:
    """Propose k tokens after the committed sequence and `assumed` (tokens taken as given, not
    committed: an overlapped round's continuation): (token ids, draft probs of them).
    `noise_seed` (sampling): the invariant rule, each token the Gumbel-max sample of its row
    with the noise of its position (specdec.decoding.rule.coupled_tokens); no probs, no rows kept.
    `alternatives` (greedy or the invariant rule): a list that gets, for each token, (the runner-up
    at its position, the token's probability, the runner-up's): the orchestrator's speculation cache.

    A request for the engine's worker: each draft step is one forward, batched with the
    steps of the other sessions proposing at the same time."""
    coupled = noise_seed is not None and not params.greedy
    assert k >= 1 and (params.greedy or coupled or len(uniforms) == k), (k, len(uniforms))  # checked at the edge
    assumed = list(assumed)
    drafts: list[int] = []
    token_probs: list[float] = []
    rows = []
    grammar = session.constraint  # structured output: each row masked, each drafted token advancing it
    try:
        plain = params.raw_greedy and grammar is None  # the rows as they come
        if plain and alternatives is None:  # a greedy chain, on the worker (session.Forward.chain)
            forward = engine.forward(session, assumed, 1, greedy=True, chain=k)
            yield forward
            drafts = list(forward.argmax)
        elif grammar is None or grammar.push(assumed) == len(assumed):  # else: nothing the grammar allows
            for i in range(k):
                forward = engine.forward(session, assumed + drafts, 1, greedy=plain)
                logits = (yield forward)[0]
                if grammar is not None:
                    logits = grammar.apply(logits[None], grammar.masks())[0]
                if params.penalized:
                    logits = penalties.session_rows(session, logits[None], params, [assumed + drafts])[0]
                if plain:
                    [token] = forward.argmax
                elif params.greedy:
                    [token] = argmax(logits[None])
                elif coupled:
                    position = len(session.tokens) + len(assumed) + i
                    [token] = rule.coupled_tokens(probs_from_logits(logits[None], params), noise_seed, [position])
                else:
                    row = probs_from_logits(logits[None], params)[0]
                    token = rule.sample(row.cpu().numpy(), uniforms[i])
                    token_probs.append(float(row[token]))
                    rows.append(row)
                if alternatives is not None and (params.greedy or coupled):
                    alternatives.append(runner_up(logits, params, token))
                drafts.append(token)
                if grammar is not None and (not grammar.push([token]) or grammar.stopped()):
                    break  # the grammar ended (EOS drawn): nothing follows it
    finally:
        if grammar is not None:
            grammar.pop()
    if not coupled:
        keep_rows(session, len(assumed), torch.stack(rows) if rows else None, drafts)
    return drafts, token_probs


def runner_up(logits: torch.Tensor, params: SamplingParams, token: int) -> tuple[int, float, float]:
    """(the most probable token but `token`, `token`'s probability, its): the draft's second guess at
    a position (greedy: at temperature 1; sampling: after the request's transform)."""
    probs = torch.softmax(logits.float(), -1) if params.greedy else probs_from_logits(logits[None], params)[0]
    top = torch.topk(probs, 2)
    second = int(top.indices[1]) if int(top.indices[0]) == token else int(top.indices[0])
    return second, float(probs[token]), float(probs[second])


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

    EAGLE-2's dynamic tree. Each node drawn gets a chance of being reached and accepted: its
    parent's, times the chance its earlier siblings are all rejected, times its own (from
    `acceptance`, ProposeRequest.tree_acceptance: measured by rank and draft probability; else
    its draft probability); a node's score is the least chance among it and the siblings before
    it, so a parent outranks its children and a node's kept children are the first ones drawn
    (the rule tries them in that order). A depth at a time, the TREE_EXPAND best-scoring nodes of
    the last depth that could still make the cut run as one forward (the draft's own tree
    attention, engine.extend_tree), and each draws TREE_BRANCHES children from its row: its most
    probable tokens (greedy), draws without replacement with the caller's uniforms (sampling,
    TREE_BRANCHES for each of TREE_EXPAND slots a depth), or the most probable under the
    position's noise (the invariant rule). It stops once no deeper node could make the cut, and
    keeps the `nodes` best. A backend that attends chains only (llama.cpp), or a session without
    room for the expanded nodes, expands one node a depth, its best: a spine with runners-up."""
    coupled = noise_seed is not None and not params.greedy
    floor = len(session.tokens)
    grammar = session.constraint  # structured output: each expanded node's row masked at its path
    logits = yield engine.forward(session, [], 1)  # the root's row: after the committed tokens
    branch = getattr(engine.backend, "trees", False) and engine.fits(session, floor + depth * TREE_EXPAND)
    expand = TREE_EXPAND if branch else 1
    drawn: list[_Drawn] = []  # every child drawn: parents before children, siblings in draw order
    rows: dict[int, torch.Tensor] = {}  # an expanded node (an index into drawn; -1: the root) -> its row
    cached: dict[int, int] = {-1: -1}  # an expanded node -> its index in the draft's cached tree
    frontier = [-1]

    def chance(rank: int, prob: float) -> float:  # of a child being accepted once tried
        if not acceptance:
            return prob
        return acceptance[min(rank, TREE_BRANCHES - 1) * TREE_BUCKETS + min(int(prob * TREE_BUCKETS), TREE_BUCKETS - 1)]

    for d in range(depth):
        level = len(drawn)
        for slot, (node, row) in enumerate(zip(frontier, logits, strict=True)):
            if grammar is not None:
                row = grammar.apply(row[None], grammar.mask_after(_path(drawn, node)))[0]
            if params.penalized:
                row = penalties.session_rows(session, row[None], params, [_path(drawn, node)])[0]
            probs = torch.softmax(row.float(), dim=-1) if params.greedy else probs_from_logits(row[None], params)[0]
            if params.greedy:
                top = torch.topk(probs, min(TREE_BRANCHES, probs.shape[-1]))
                tokens = [t for t, p in zip(top.indices.tolist(), top.values.tolist(), strict=True) if p > 0]
            elif coupled:
                tokens = rule.coupled_ranking(probs, noise_seed, floor + d, TREE_BRANCHES)
            else:
                at = (d * TREE_EXPAND + slot) * TREE_BRANCHES
                tokens = rule.draw_without_replacement(probs.cpu().numpy(), uniforms[at : at + TREE_BRANCHES])
            rows[node] = probs
            reach = 1.0 if node < 0 else drawn[node].score  # its score: so no child outscores it
            own = probs[tokens].tolist()
            # Under the Leviathan rule whether a child is tried must not depend on which token it
            # is (else the walk's law is not the target's): its chance is read at the row's
            # rank-th probability, not its own. Greedy draws those; the invariant rule's law holds
            # whatever the shape.
            valued = own if params.greedy or coupled else torch.topk(probs, len(tokens)).values.tolist()
            least, missed = 1.0, 1.0  # the least score so far; the chance the earlier siblings all failed
            for rank, (token, p, v) in enumerate(zip(tokens, own, valued, strict=True)):
                least = min(least, reach * missed * chance(rank, v))
                missed *= 1.0 - chance(rank, v)
                drawn.append(_Drawn(least, d, token, p, node))
        scores = sorted(n.score for n in drawn)
        cut = scores[-nodes] if len(scores) >= nodes else 0.0  # a deeper node must score above it
        frontier = sorted((i for i in range(level, len(drawn)) if drawn[i].score > cut), key=lambda i: -drawn[i].score)
        frontier = sorted(frontier[:expand])  # parents before children
        if d + 1 == depth or not frontier:
            break
        if branch:
            for i in frontier:
                cached[i] = len(cached) - 1
            logits = yield engine.extend_tree(
                session, [drawn[i].token for i in frontier], [cached[drawn[i].parent] for i in frontier]
            )
        else:
            [node] = frontier
            logits = yield engine.forward(session, _path(drawn, node), 1)
    kept = sorted(sorted(range(len(drawn)), key=lambda i: (-drawn[i].score, drawn[i].depth, i))[:nodes])
    index = {-1: -1} | {n: i for i, n in enumerate(kept)}
    parents = [index[drawn[n].parent] for n in kept]
    proposal = TreeProposal([drawn[n].token for n in kept], parents, [drawn[n].prob for n in kept])
    if not params.greedy and not coupled:  # the rows the target's rule reads (ScoreRequest.draft_rows)
        proposal.rows = {index[drawn[n].parent]: rows[drawn[n].parent] for n in kept}
    return proposal


@dataclass
class _Drawn:
    """A child drawn for a draft tree (propose_tree)."""

    score: float  # the least chance of being reached and accepted among it and its earlier siblings
    depth: int
    token: int
    prob: float  # its draft probability in its parent's row
    parent: int  # an index into the drawn children; -1: the root


def _path(drawn: list[_Drawn], node: int) -> list[int]:
    """The tokens from the root to `node`, it included."""
    tokens = []
    while node >= 0:
        tokens.append(drawn[node].token)
        node = drawn[node].parent
    return tokens[::-1]
