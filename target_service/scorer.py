"""Scoring: [last committed token, drafts...] in one forward pass, k + 1 positions; or the
last committed token and a draft tree, each node attending to its ancestors (score_tree: in one
forward with tree attention, else chain by chain).

Scoring runs on the engine's model worker, batched with other sessions' forwards.
Greedy: the argmax at each position, nothing vocabulary-sized. Sampling: the target
probability of each draft token, and the one row the rule needs: with the caller's
acceptance uniforms the service evaluates the same pure rule the orchestrator runs and
returns the row at the first rejected position (or the bonus row). Structured output: the rows
are masked by the session's grammar first (specdec.decoding.grammar), so the rule sees masked rows.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.decoding import penalties, rule
from specdec.decoding.grammar import apply
from specdec.decoding.sampling import SamplingParams, logprobs_from_logits, probs_from_logits
from specdec.errors import InvalidArgument
from specdec.greedy import argmax
from specdec.runtime.engine import SessionEngine
from specdec.runtime.session import Forward, Session


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
    accepted_nodes: list[int] = field(default_factory=list)  # a tree, Leviathan: the accepted path
    final_token: int = 0  # ... and the round's last token
    mask_seconds: float = 0.0  # structured output: computing and applying the grammar's masks
    logprobs: Logprobs | None = None  # asked for (ScoreRequest.logprobs)


@dataclass
class Logprobs:
    """Log probabilities of a Score (ScoreResponse's fields), as sampling.logprobs_from_logits gives them."""

    draft_tokens: list[float]  # [n] each draft token's, in the row that scores it
    own: list[tuple[int, float]]  # [rows] the target's own token of each row and its log probability
    top: list[tuple[list[int], list[float]]]  # [rows] the row's most likely tokens, most likely first
    final_token: float = 0.0  # a tree, Leviathan: the last token's


def logprobs_of(logits, params: SamplingParams, draft_ids, draft_rows, own, top: int) -> Logprobs:
    """logits [rows, vocab] (masked); draft token i is scored in row draft_rows[i]; own: [rows] the
    target's own tokens (None: the argmax of each row)."""
    logp = logprobs_from_logits(logits, params)
    own = argmax(logp) if own is None else own
    rows = torch.arange(logp.shape[0], device=logp.device)
    own_lp = logp[rows, torch.tensor(own, device=logp.device)].tolist()
    ids = torch.tensor(draft_ids, dtype=torch.long, device=logp.device)
    drafted = logp[torch.tensor(draft_rows, dtype=torch.long, device=logp.device), ids].tolist() if draft_ids else []
    best = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
    tops = list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    return Logprobs(drafted, list(zip(own, own_lp, strict=True)), tops)


def score(
    engine: SessionEngine,
    session: Session,
    draft_ids: list[int],
    params: SamplingParams,
    draft_token_probs: list[float],
    accept_uniforms: list[float],
    noise_seed: int | None = None,
    logprobs: int | None = None,
) -> Generator[Forward, torch.Tensor, Scores]:
    """A request for the engine's worker (yields its one forward). `noise_seed` (sampling): the
    invariant rule, `argmax` then holds the target's Gumbel-max sample at each position.
    Structured output: the k + 1 rows are masked by the session's grammar (its masks computed in
    one pass); `logprobs`: report log probabilities with that many top tokens a row."""
    k = len(draft_ids)
    coupled = noise_seed is not None and not params.greedy
    # checked at the edge (specdec.validation)
    assert params.greedy or coupled or len(draft_token_probs) == len(accept_uniforms) == k, (k, len(accept_uniforms))
    grammar = session.constraint
    spent = grammar.seconds if grammar is not None else 0.0
    masks = grammar.masks(draft_ids) if grammar is not None else None  # [k + 1, words]
    plain = params.raw_greedy and grammar is None  # the rows as they come
    forward = engine.forward(session, draft_ids, k + 1, greedy=plain)
    logits = yield forward  # [k + 1, vocab]
    logits = apply(grammar, logits, masks)
    if params.penalized:
        logits = penalties.session_rows(session, logits, params, penalties.chain(draft_ids, k + 1))
    step = forward.step_tokens, forward.step_sessions, forward.step_threads, forward.waited, forward.seconds
    if params.greedy:
        scores = Scores(forward.argmax if plain else argmax(logits), [], 0, None, *step)
        own = scores.argmax
    else:
        probs = probs_from_logits(logits, params)
        if coupled:
            positions = range(len(session.tokens), len(session.tokens) + k + 1)
            scores = Scores(rule.coupled_tokens(probs, noise_seed, list(positions)), [], 0, None, *step)
            own = scores.argmax
        else:
            rows = torch.arange(k, device=probs.device)
            at = probs[rows, torch.tensor(draft_ids, dtype=torch.long, device=probs.device)].tolist()
            n = rule.accepted_length(draft_token_probs, at, accept_uniforms)
            scores, own = Scores([], at, n, probs[n].cpu().numpy(), *step), None
    if logprobs is not None:
        scores.logprobs = logprobs_of(logits, params, draft_ids, list(range(k)), own, logprobs)
    scores.mask_seconds = grammar.seconds - spent if grammar is not None else 0.0
    return scores


def decode(
    engine: SessionEngine,
    session: Session,
    steps: int,
    params: SamplingParams,
    noise_seed: int | None,
    stop_token_ids: frozenset[int],
    uniforms: list[float] = (),
    logprobs: int | None = None,
) -> Generator[Forward, torch.Tensor, Scores]:
    """Plain decoding, `steps` one-token forwards in one request (ScoreRequest.decode_steps): each
    feeds the token the one before chose (greedy: the argmax; the invariant rule: the Gumbel-max
    sample at its position, as `score` chooses the target's own token; the Leviathan rule: the
    sample of its row with its one of `uniforms`, as the orchestrator samples a plain round's
    row, rule.final_token), stopping after a stop token. `argmax` holds the tokens; the session
    keeps all but the last as a speculative tail (accepted drafts, for the next commit). The
    steps' figures are summed (step_tokens and step_sessions: the largest; a chain's tokens: its
    steps' mean). `logprobs`: each step's token's log probability and its row's most likely
    tokens, as `score` reports a row's own token."""
    assert params.greedy or noise_seed is not None or len(uniforms) == steps, (steps, len(uniforms))
    grammar = session.constraint
    spent = grammar.seconds if grammar is not None else 0.0
    # each row as it comes: the step's argmax is the token (and no row is read)
    plain = params.raw_greedy and grammar is None and logprobs is None
    scores = Scores([], [], 0, None, logprobs=None if logprobs is None else Logprobs([], [], []))
    chosen = scores.argmax
    while len(chosen) < steps and not (chosen and chosen[-1] in stop_token_ids):
        # plain: one greedy chain of them all, on the worker (session.Forward.chain)
        forward = engine.forward(session, chosen, 1, greedy=plain, chain=steps if plain else 1, stop=stop_token_ids)
        if plain:
            yield forward
            chosen += forward.argmax
        else:
            mask = grammar.masks(chosen)[-1:] if grammar is not None else None
            logits = apply(grammar, (yield forward), mask)  # [1, vocab]
            if params.penalized:
                logits = penalties.session_rows(session, logits, params, [chosen])
            if params.greedy:
                [token] = argmax(logits)
            elif noise_seed is not None:
                position = len(session.tokens) + len(chosen)
                token = rule.coupled_tokens(probs_from_logits(logits, params), noise_seed, [position])[0]
            else:
                token = rule.sample(probs_from_logits(logits, params)[0].cpu().numpy(), uniforms[len(chosen)])
            chosen.append(token)
            if logprobs is not None:
                row = logprobs_of(logits, params, [], [], [token], logprobs)
                scores.logprobs.own += row.own
                scores.logprobs.top += row.top
        scores.step_tokens = max(scores.step_tokens, -(-forward.step_tokens // forward.steps))
        scores.step_sessions = max(scores.step_sessions, forward.step_sessions)
        scores.step_threads = forward.step_threads
        scores.waited += forward.waited
        scores.forward_seconds += forward.seconds
    scores.mask_seconds = grammar.seconds - spent if grammar is not None else 0.0
    return scores


@dataclass(frozen=True)
class TreeRule:
    """What the Leviathan rule needs to walk a tree on the target: the draft's rows at the root
    (-1) and at each node with children, the uniforms testing each node, the last token's."""

    draft_rows: dict[int, np.ndarray]
    accept_uniforms: list[float]
    final_uniform: float


def draft_rows(rows, nodes, vocab_size: int) -> dict[int, np.ndarray]:
    """ScoreRequest.draft_rows (decoded, wire.decode_row) by node, each a distribution over the
    session's `vocab_size` rows."""
    out = {}
    for node, row in zip(nodes, rows, strict=True):
        if row.shape != (vocab_size,):
            raise InvalidArgument(
                f"draft_rows: the row of node {node} is over {row.size} tokens, the session's {vocab_size}"
            )
        if not (np.isfinite(row).all() and (row >= 0).all() and row.sum() > 0):
            raise InvalidArgument(f"draft_rows: the row of node {node} is not a distribution")
        out[int(node)] = row
    return out


def score_tree(
    engine: SessionEngine,
    session: Session,
    draft_ids: list[int],
    parents: list[int],
    params: SamplingParams,
    noise_seed: int | None = None,
    walk: TreeRule | None = None,
    logprobs: int | None = None,
) -> Generator[Forward, torch.Tensor, Scores]:
    """Verify a draft tree. Greedy: `argmax` holds the target's argmax at the root and after each
    node (n + 1); the invariant rule (`noise_seed`): its Gumbel-max sample there, each keyed by the
    position it is at in the sequence (the node's depth); the Leviathan rule (`walk`): the target
    walks the tree (rule.tree_walk) and returns the path and last token. Structured output: each
    row masked by the session's grammar at its path.

    A backend with tree attention (`trees`) scores every node in one forward. Any other (llama.cpp:
    one KV stream a session, a token in one sequence) scores the tree chain by chain in the
    session's own stream, only the chains the rule walks into (tree_rows): the rows off the
    walked path are never read, by the rule here nor by the orchestrator's (the same walk over
    the same rows), and are zeros."""
    grammar = session.constraint
    spent = grammar.seconds if grammar is not None else 0.0
    masks = grammar.tree_masks(draft_ids, parents) if grammar is not None else None  # [n + 1, words]
    coupled = noise_seed is not None and not params.greedy
    if coupled:
        depth = [0] * len(parents)
        for i, parent in enumerate(parents):
            depth[i] = 1 if parent < 0 else depth[parent] + 1
        positions = [len(session.tokens) + d for d in (0, *depth)]

    def token(i: int, row: torch.Tensor) -> int:  # the target's token in row i (greedy, invariant)
        if params.greedy:
            return argmax(row[None])[0]
        return rule.coupled_tokens(probs_from_logits(row[None], params), noise_seed, [positions[i]])[0]

    def decide(rows: LazyRows):
        """The rule's walk over the rows (raises Missing for a row not scored yet)."""
        if walk is None:
            targets = rows.map(token)
            path = rule.tree_greedy_path(parents, draft_ids, targets)
            targets[path[-1] + 1 if path else 0]  # the round's last token: its row too
            return None
        probs = rows.map(lambda _, row: probs_from_logits(row[None], params)[0].cpu().numpy())
        return rule.tree_walk(parents, draft_ids, probs, walk.draft_rows, walk.accept_uniforms, walk.final_uniform)

    before = penalties.paths(draft_ids, parents) if params.penalized else None

    def shaped(out: torch.Tensor, wanted: list[int]) -> torch.Tensor:  # rows `wanted` masked, penalised
        out = apply(grammar, out, masks[wanted] if masks is not None else None)
        return out if before is None else penalties.session_rows(session, out, params, [before[i] for i in wanted])

    logits, scored, walked, forwards = yield from tree_rows(engine, session, draft_ids, parents, shaped, decide)
    step = (
        forwards[0].step_tokens,
        forwards[0].step_sessions,
        forwards[0].step_threads,
        sum(f.waited for f in forwards),
        sum(f.seconds for f in forwards),
    )
    own = None
    if walk is None:
        tokens = [token(i, row) if i in scored else 0 for i, row in enumerate(logits)]  # 0: a row not scored
        scores = Scores(tokens, [], 0, None, *step)
        own = scores.argmax
    else:
        path, last = walked
        scores = Scores([], [], 0, None, *step, accepted_nodes=path, final_token=last)
    if logprobs is not None:
        scores.logprobs = logprobs_of(logits, params, draft_ids, [p + 1 for p in parents], own, logprobs)
        if walk is not None:  # the Leviathan rule drew the last token here
            row = scores.accepted_nodes[-1] + 1 if scores.accepted_nodes else 0
            scores.logprobs.final_token = float(logprobs_from_logits(logits[row : row + 1], params)[0, last])
    scores.mask_seconds = grammar.seconds - spent if grammar is not None else 0.0
    return scores


class Missing(Exception):  # noqa: N818 - a signal, not an error
    """A walk down a tree read the row after a node that no forward has scored yet."""

    def __init__(self, row: int):
        super().__init__(row)
        self.row = row


class LazyRows:
    """A tree's verify rows by index (0: the root's, i + 1: after node i), each read through
    `fn(i, row)` once; reading a row not scored yet raises Missing."""

    def __init__(self, rows: dict[int, torch.Tensor], fn=None):
        self.rows, self.fn, self._seen = rows, fn, {}

    def map(self, fn) -> LazyRows:
        return LazyRows(self.rows, fn)

    def __getitem__(self, i: int):
        if i not in self.rows:
            raise Missing(i)
        if i not in self._seen:
            self._seen[i] = self.fn(i, self.rows[i]) if self.fn is not None else self.rows[i]
        return self._seen[i]


def tree_rows(engine: SessionEngine, session: Session, draft_ids, parents, shaped, decide):
    """The verify rows of a tree ([n + 1, vocab], `shaped(logits, rows)`: masked and penalised; zeros
    where not scored), the rows scored,
    what `decide(LazyRows)` returned over them, and the forwards that scored them.

    With tree attention, one forward. Otherwise chain by chain in the session's own cache, each a
    plain forward (engine.forward: its rows are exactly those of that path fed as a chain): first
    the spine (the root's first child, its first child, ...) after the last committed token; then,
    while `decide` reads a row not scored yet (the row after node x, x accepted on the walked
    path), x and its own first-child chain, after x's ancestors, which the cache holds (the walk
    came down through them, in the last chain scored: engine.forward keeps them and drops the
    rest). A round scores one chain unless its walk leaves the spine; the cache then holds the
    walked path, which the next commit keeps."""
    if getattr(engine.backend, "trees", False):
        forward = engine.forward_tree(session, draft_ids, parents)
        logits = shaped((yield forward), list(range(len(draft_ids) + 1)))
        return logits, set(range(len(logits))), decide(LazyRows(dict(enumerate(logits)))), [forward]
    kids = rule.tree_children(parents)
    rows: dict[int, torch.Tensor] = {}
    forwards: list[Forward] = []
    missing = 0
    while True:
        node = missing - 1  # the chain starts at it (-1: the spine, after the last committed token)
        above, at = [], parents[node] if node >= 0 else -1
        while at >= 0:
            above.insert(0, at)
            at = parents[at]
        chain = [node] if node >= 0 else []
        while kids.get(chain[-1] if chain else -1):
            chain.append(kids[chain[-1] if chain else -1][0])
        wanted = ([0] if node < 0 else []) + [c + 1 for c in chain]
        forward = engine.forward(session, [draft_ids[i] for i in above + chain], len(wanted))
        out = yield forward
        forwards.append(forward)
        rows.update(zip(wanted, shaped(out, wanted), strict=True))
        try:
            walked = decide(LazyRows(rows))
            break
        except Missing as gap:
            assert gap.row not in rows, gap.row
            missing = gap.row
            # a backend's rows may be views of its output buffer, valid until its next forward
            rows = {i: row.clone() for i, row in rows.items()}
    first = next(iter(rows.values()))
    logits = first.new_zeros(len(draft_ids) + 1, first.shape[-1], dtype=torch.float32)
    for i, row in rows.items():
        logits[i] = row
    return logits, set(rows), walked, forwards
