"""A model-free drafter over a suffix index: the session's own tokens and a store of recent sessions'.

`suffix` (SuffixDrafter) proposes what followed the longest suffix of the current sequence (up to
MAX_MATCH tokens) where it occurred before: earlier in the session (prompt and committed output), in
the text the request predicted its answer repeats (OpenSessionRequest.prediction_token_ids, after
the prompt's end: predicted_source), or in the token sequences of the service's recent sessions of
the same history scope (the store: the last STORE_SESSIONS closed sessions, at most STORE_TOKENS
tokens in all, the oldest evicted first; one store per scope, OpenSessionRequest.history_scope,
which the orchestrator makes a digest of the client's credential: Stores; a session without a
scope neither searches nor enters one).
`hybrid` (HybridDrafter) puts the index beside a model drafter and lets each round's proposal come
from one of them.

The index: numpy int32 arrays (the session's tokens, kept per session and extended by what it
committed, rebuilt after a rollback; the store's sequences concatenated with -1 between them,
rebuilt when a session enters it), scanned for the last token and narrowed one token further back
at a time while occurrences still match. A match of one token counts in the session but not in
the store (MIN_STORE_MATCH = 2).

Scoring: the longest match wins, occurrences of both sources pooled at equal length; the
continuation is the most frequent next token among the occurrences still matching, a token at a
time, until that token's share falls under MIN_SHARE, none goes on, or min(k, max(1, 2 * match
length)) tokens. Hybrid (HybridDrafter.choose): a round whose match is at least HYBRID_MATCH
tokens, its first token agreed by most occurrences, proposes the index's continuation while the
index's strong proposals in the session have lately matched at least HYBRID_RATE of their first
HOLD drafts to what was committed (an exponential average, scored whether used or not); other
rounds are the model's, but while the model's cache lacks more than CATCH_UP tokens for each round
since the last strong match, the index keeps them (its weak matches, or no drafts; with the model on
an accelerator it never does: draft_service.drafters). On a CPU, the hybrid's
sessions open without the model's prefill past PREFILL_AT_OPEN prompt tokens
(SessionEngine.prefill_at_open): an index round needs none, and a copy's first rounds went without
drafts while the model prefilled the prompt on the cores the target decodes on; a chat's short
prompt is the model's to draft after, prefilled beside the target's as the model draft's is. A
model round first feeds the model's cache what it lacks (SessionEngine.catch_up: the prompt, the
index rounds' commits), in prefill chunks; on llama.cpp (which starts a cache at any position) of
the prompt no more than its last WINDOW tokens, the model then drafting from them and what followed.
A reproducible session (OpenSessionRequest.reproducible: a seeded Leviathan sample, whose text
depends on its drafts) keeps none of that state: its rounds are the index's where the match is
strong, else the model's, caught up whole, a function of its tokens that the session re-opened
after a fault computes alike.

Exact as the ngram drafter: proposals are deterministic functions of the sequence, point masses
(draft prob 1, one-hot rows in sampling mode), under a constraint only the grammar-allowed prefix
(ngram.allowed); a tree is the chain it finds. A hybrid round's law is its proposer's.

The store fills without a hook in the engine: a session that proposes is remembered, and at each
proposal the sessions the engine has closed since enter the store with their tokens (the last
round's accepted tokens, never sent to the draft, are not in it). Open sessions are not searched
by others. `store_tokens()` reports what the stores of this process hold. The design, and why not
arctic-inference's suffix tree: docs/models.md, "Suffix and hybrid drafters".
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from draft_service import ngram, proposer
from draft_service.proposer import TreeProposal
from specdec.decoding.sampling import SamplingParams
from specdec.runtime.engine import SessionEngine, catch_up_from
from specdec.runtime.session import Session

MAX_MATCH = 32  # the longest suffix looked for
MIN_STORE_MATCH = 2  # a store match shorter than this is ignored
MIN_SHARE = 0.5  # the continuation stops where its next token's share of the occurrences is less
BLOCK = 64  # occurrences few enough to match the rest of their suffix in one gather
MAX_OCCURRENCES = 4096  # of the last token, the most recent looked at, per source (a worst-case bound)
STORE_TOKENS = 262_144  # the store's budget
STORE_SESSIONS = 1024  # ... and its sessions at most
HYBRID_MATCH = 4  # hybrid: the match length from which the index proposes instead of the model
HYBRID_RATE = 0.5  # hybrid: ... and from which share of its drafts (the first HOLD) the committed tokens lately matched
PREFILL_AT_OPEN = 64  # hybrid: the longest prompt its model prefills at the session's open (a chat's)
CATCH_UP = 8  # hybrid: the model's backlog (tokens) worth one round of the index's weak matches (see choose)
# hybrid on llama.cpp: the most prompt tokens a catch-up feeds, the prompt's last (SessionEngine.catch_up). The
# Q8_0 draft's greedy token was the F32 target's at 0.91-1.00 of an answer's positions given the last 64
# to 512 prompt tokens, 0.96-0.98 given all 1,000-2,000 (one of four prompts: 0.67 at every window);
# 128 tokens cost ~0.45 s to feed here, 1,000 ~3.4 s (docs/models.md#suffix-and-hybrid-drafters).
WINDOW = 128
RATE_WEIGHT = 0.3  # the weight of a proposal's score in that share (an exponential average)
HOLD = 4  # hybrid: a proposal whose first HOLD drafts (or all, if fewer) the committed tokens matched scores 1
PENDING = 4  # proposals awaiting their score, per session, at most
SEPARATOR = -1

_STORES: weakref.WeakSet = weakref.WeakSet()


def store_tokens() -> int:
    """The tokens the stores of this process hold (a draft service has one)."""
    return sum(store.tokens for store in list(_STORES))


class Store:
    """Recent sessions' token sequences, the oldest evicted past `budget` tokens or `sessions`
    sequences; safe to share across threads."""

    def __init__(self, budget: int = STORE_TOKENS, sessions: int = STORE_SESSIONS):
        self.budget, self.sessions = budget, sessions
        self._lock = threading.Lock()
        self._docs: deque[np.ndarray] = deque()
        self._tokens = 0
        self._buffer: np.ndarray | None = np.full(1, SEPARATOR, np.int32)
        _STORES.add(self)

    @property
    def tokens(self) -> int:
        return self._tokens

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, tokens) -> None:
        doc = np.asarray(tokens, dtype=np.int32)[-self.budget :]
        if doc.size < 2:
            return
        with self._lock:
            self._docs.append(doc.copy())
            self._tokens += doc.size
            while self._tokens > self.budget or len(self._docs) > self.sessions:
                self._tokens -= self._docs.popleft().size
            self._buffer = None

    def pop(self) -> bool:
        """Drop the oldest sequence; False where there is none."""
        with self._lock:
            if not self._docs:
                return False
            self._tokens -= self._docs.popleft().size
            self._buffer = None
            return True

    def buffer(self) -> np.ndarray:
        """The sequences, oldest first, each followed by SEPARATOR (a leading one too); never
        changed in place, so a caller reads it outside the lock."""
        with self._lock:
            if self._buffer is None:
                parts = [np.full(1, SEPARATOR, np.int32)]
                for doc in self._docs:
                    parts += [doc, parts[0]]
                self._buffer = np.concatenate(parts)
            return self._buffer


class Stores:
    """A store per history scope (Session.history_scope, from OpenSessionRequest): a session drafts
    from its own scope's store only, and one without a scope from none and enters none. All scopes'
    sequences together are bounded as one store's are (`budget` tokens, `sessions` sequences), the
    least recently used scope's oldest sequences evicted first; safe to share across threads."""

    def __init__(self, budget: int = STORE_TOKENS, sessions: int = STORE_SESSIONS):
        self.budget, self.sessions = budget, sessions
        self._lock = threading.Lock()
        self._scopes: OrderedDict[str, Store] = OrderedDict()  # least recently used first

    @property
    def tokens(self) -> int:
        return sum(store.tokens for store in list(self._scopes.values()))

    def __len__(self) -> int:
        return sum(len(store) for store in list(self._scopes.values()))

    def scopes(self) -> int:
        return len(self._scopes)

    def get(self, scope: str) -> Store | None:
        """The scope's store (None: none yet, or no scope)."""
        with self._lock:
            store = self._scopes.get(scope) if scope else None
            if store is not None:
                self._scopes.move_to_end(scope)
            return store

    def add(self, scope: str, tokens) -> None:
        """A closed session's tokens into its scope's store (none without a scope)."""
        if not scope:
            return
        with self._lock:
            store = self._scopes.get(scope)
            if store is None:
                store = self._scopes[scope] = Store(self.budget, self.sessions)
            self._scopes.move_to_end(scope)
        store.add(tokens)
        with self._lock:
            while self._scopes and (self.tokens > self.budget or len(self) > self.sessions):
                oldest, store = next(iter(self._scopes.items()))
                if not store.pop():
                    del self._scopes[oldest]


def occurrences(source: np.ndarray, end: int, context: np.ndarray, max_match: int = MAX_MATCH):
    """(m, positions): m the length of the longest suffix of `context` that occurs in
    source[:end] (up to max_match; 0: not even its last token), and the positions right after
    each of its occurrences there (ascending)."""
    if not context.size or end <= 0:
        return 0, np.empty(0, np.int64)
    hits = np.flatnonzero(source[:end] == context[-1])[-MAX_OCCURRENCES:]
    if not hits.size:
        return 0, hits
    after, m = hits + 1, 1
    limit = min(max_match, context.size)
    while m < limit and after.size > BLOCK:  # many: narrowed a token at a time
        before = after - 1 - m
        before = before[before >= 0]
        keep = source[before] == context[-1 - m]
        if not keep.any():
            return m, after
        after = before[keep] + 1 + m
        m += 1
    if m < limit:  # few: the rest of each one's match at once
        back = np.arange(m + 1, limit + 1)
        at = after[:, None] - back[None, :]
        equal = (source[np.maximum(at, 0)] == context[-back][None, :]) & (at >= 0)
        lengths = m + np.cumprod(equal, axis=1).sum(axis=1)
        m = int(lengths.max())
        after = after[lengths == m]
    return m, after


@dataclass
class Suggestion:
    """A proposal of the index: its tokens, the length of the match it continues, and the
    occurrences that agreed on each token (`support`) out of those that went on (`seen`)."""

    tokens: list[int] = field(default_factory=list)
    match: int = 0
    support: list[int] = field(default_factory=list)
    seen: list[int] = field(default_factory=list)

    def strong(self, match: int = HYBRID_MATCH) -> bool:
        """A copy in progress: a match of at least `match` tokens whose first token more than
        half of its occurrences agree on."""
        return self.match >= match and bool(self.tokens) and 2 * self.support[0] > self.seen[0]


def suggest(
    sequence: np.ndarray,
    store: np.ndarray | None,
    k: int,
    max_match: int = MAX_MATCH,
    prediction: np.ndarray | None = None,
) -> Suggestion:
    """The index's proposal of at most k tokens after `sequence`, from its own earlier tokens, the
    session's prediction (predicted_source) and the store's buffer (Store.buffer)."""
    sequence = np.asarray(sequence, dtype=np.int32)
    context = sequence[-max_match:]
    # the session: occurrences ending before its last token (which the suffix itself ends at)
    sources = [(sequence, *occurrences(sequence, sequence.size - 1, context, max_match))]
    if prediction is not None:  # searched as the session's own tokens are, ranking after them at a tie
        sources.append((prediction, *occurrences(prediction, prediction.size, context, max_match)))
    if store is not None and store.size > 1:
        m, after = occurrences(store, store.size, context, max_match)
        sources.append((store, m if m >= MIN_STORE_MATCH else 0, after))
    match = max(m for _, m, _ in sources)
    if k < 1 or match == 0:
        return Suggestion(match=match)
    found = [(src, after) for src, m, after in sources if m == match][::-1]  # the store's (older) first
    out = Suggestion(match=match)
    cap = min(k, max(1, 2 * match))
    for i in range(cap):
        if sum(after.size for _, after in found) == 1:  # one occurrence left: the rest of it, as it is
            [(src, after)] = [(src, after) for src, after in found if after.size]
            rest = src[int(after[0]) + i : int(after[0]) + cap]
            ended = np.flatnonzero(rest == SEPARATOR)
            rest = rest[: ended[0]] if ended.size else rest
            out.tokens += rest.tolist()
            out.support += [1] * rest.size
            out.seen += [1] * rest.size
            break
        nexts = [np.where(at < src.size, src[np.minimum(at, src.size - 1)], SEPARATOR) for src, at in ahead(found, i)]
        pooled = np.concatenate(nexts)
        going = pooled[pooled != SEPARATOR]
        if not going.size:
            break
        if (going == going[0]).all():  # one occurrence left, or all agree: the usual case
            token, agreed = int(going[0]), int(going.size)
        else:
            values, counts = np.unique(going, return_counts=True)
            tied = values[counts == counts.max()]
            token = int(tied[0]) if tied.size == 1 else int(pooled[np.flatnonzero(np.isin(pooled, tied))[-1]])
            agreed = int(counts.max())
        if agreed < MIN_SHARE * going.size:
            break
        out.tokens.append(token)
        out.support.append(agreed)
        out.seen.append(int(going.size))
        found = [(src, after[nxt == token]) for (src, after), nxt in zip(found, nexts, strict=True)]
    return out


def predicted_source(session: Session) -> np.ndarray | None:
    """What the index searches of the session's prediction (Session.prediction; None: none): its
    tokens after the prompt's last MAX_MATCH, so that the answer's first round, whose suffix is
    the prompt's end, matches there and proposes the prediction's start."""
    if not session.prediction:
        return None
    prompt = session.tokens[: session.prompt_length][-MAX_MATCH:]
    return np.asarray([*prompt, *session.prediction], dtype=np.int32)


def ahead(found, i: int):
    """(source, the positions i tokens past each occurrence's end) for each source."""
    return [(src, after + i) for src, after in found]


class _Tokens:
    """A session's tokens as a numpy array, extended by what it committed since (a rollback: rebuilt)."""

    def __init__(self, session: Session):
        self.session = session
        self.array = np.empty(0, np.int32)
        self.length = 0
        self.prediction = predicted_source(session)
        # hybrid: the index's recent proposals, used or not, not yet settled: (committed length,
        # assumed tokens, drafts); and the share of their drafts the committed tokens matched
        self.pending: list[tuple[int, list[int], list[int]]] = []
        self.rate = 1.0
        self.gap = 0  # rounds since the index's last strong proposal (or the session's start)
        # hybrid: the last choice, (call key: committed length, last tokens, assumed, k; its answer),
        # for a call made again
        self.last: tuple | None = None

    def settle(self) -> None:
        """Score the pending proposals the committed tokens now settle: a proposal scores the
        share of its first HOLD drafts (all, if fewer) they match up to the first they do not
        (what the rule would have accepted of it: under greedy and the invariant rule exactly,
        under the Leviathan rule in expectation, a point mass x being accepted as often as the
        target commits x). A long chain that held through HOLD drafts paid its verify: a copy of
        renamed code misses at each renamed name, and scored by its whole length it handed a
        copy to the model."""
        tokens, waiting = self.session.tokens, []
        for base, assumed, drafts in self.pending:
            start = base + len(assumed)
            seen = tokens[base : start + len(drafts)]
            if seen[: len(assumed)] != assumed[: len(seen)]:
                continue  # its assumed tokens were rejected (or rolled back): never verified
            got = seen[len(assumed) :]
            matched = next((i for i, (a, b) in enumerate(zip(drafts, got, strict=False)) if a != b), len(got))
            if matched < len(got) or len(got) == len(drafts):
                self.rate = (1 - RATE_WEIGHT) * self.rate + RATE_WEIGHT * min(1.0, matched / min(len(drafts), HOLD))
            elif len(waiting) < PENDING:
                waiting.append((base, assumed, drafts))
        self.pending = waiting

    def update(self) -> np.ndarray:
        tokens = self.session.tokens
        n, have = len(tokens), self.length
        window = min(have, 16)
        if have > n or (window and not np.array_equal(self.array[have - window : have], tokens[have - window : have])):
            have = 0  # rolled back (and maybe grown again): rebuilt
        if n > self.array.size:
            grown = np.empty(max(n, 2 * self.array.size, 256), np.int32)
            grown[:have] = self.array[:have]
            self.array = grown
        if n > have:
            self.array[have:n] = tokens[have:n]
        self.length = n
        return self.array[:n]


class SuffixDrafter:
    """The suffix index of one draft service: its sessions' tokens and the store (Drafter's
    propose and propose_tree as bound methods; ProposalRow is proposer.proposal_row)."""

    def __init__(self, stores: Stores | None = None):
        self.stores = stores if stores is not None else Stores()
        self._lock = threading.Lock()
        self._live: dict[int, _Tokens] = {}  # id(session) -> its tokens; holds the session, so the id stays its

    def suggest(self, session: Session, assumed: list[int], k: int) -> Suggestion:
        """The index's proposal after the session's committed tokens and `assumed`."""
        return self._suggest(session, assumed, k)[0]

    def _suggest(self, session: Session, assumed: list[int], k: int) -> tuple[Suggestion, _Tokens]:
        self._sweep()
        with self._lock:
            tokens = self._live.get(id(session))
            if tokens is None:
                tokens = self._live[id(session)] = _Tokens(session)
        sequence = tokens.update()
        if assumed:
            sequence = np.concatenate([sequence, np.asarray(assumed, np.int32)])
        store = self.stores.get(session.history_scope)
        return suggest(sequence, None if store is None else store.buffer(), k, prediction=tokens.prediction), tokens

    def _sweep(self) -> None:
        """Sessions closed since the last proposal enter the store."""
        with self._lock:
            closed = [key for key, tokens in self._live.items() if tokens.session.closed]
            done = [self._live.pop(key) for key in closed]
        for tokens in done:
            self.stores.add(tokens.session.history_scope, tokens.update())

    def propose(
        self,
        engine: SessionEngine,
        session: Session,
        k: int,
        params: SamplingParams,
        uniforms: list[float],
        assumed: list[int] = (),
        noise_seed: int | None = None,
        alternatives: list | None = None,
        free: int = 0,
    ) -> tuple[list[int], list[float]]:
        """At most max(k, free) tokens after the committed ones and `assumed`, as ngram.propose:
        point masses."""
        assumed = list(assumed)
        found = ngram.allowed(session, assumed, self.suggest(session, assumed, max(k, free)).tokens)
        return ngram.point_masses(engine, session, params, noise_seed, assumed, found)

    def propose_tree(
        self,
        engine: SessionEngine,
        session: Session,
        depth: int,
        nodes: int,
        params: SamplingParams,
        uniforms,
        noise_seed=None,
        _=(),
    ) -> TreeProposal:
        """The chain the index finds (at most min(depth, nodes) tokens), as ngram.propose_tree."""
        drafts = ngram.allowed(session, [], self.suggest(session, [], min(depth, nodes)).tokens)
        return chain(engine, session, drafts, params, noise_seed)


def chain(engine: SessionEngine, session: Session, drafts: list[int], params, noise_seed) -> TreeProposal:
    """A tree that is a chain of point masses (rows one-hot in Leviathan sampling mode)."""
    proposal = TreeProposal(drafts, list(range(-1, len(drafts) - 1)), [1.0] * len(drafts))
    if drafts and not params.greedy and noise_seed is None:
        rows = ngram.one_hot(drafts, session.vocab_size or engine.backend.vocab_size)
        proposal.rows = dict(zip(range(-1, len(drafts) - 1), rows, strict=True))
    return proposal


class HybridDrafter(SuffixDrafter):
    """A model drafter (draft_service.proposer) with the suffix index beside it: a round whose
    match is strong (Suggestion.strong) proposes the index's continuation, point masses, and no
    model forward runs for its tokens; any other round is the model's, or the index's while the
    model's catch-up would cost more (choose). The law of a round's drafts is that of whichever
    proposed them: ProposalRow reads the rows of the round that did (the index's one-hot rows, or
    the model's; none in a round without drafts)."""

    def __init__(
        self,
        stores: Stores | None = None,
        match: int = HYBRID_MATCH,
        rate: float = HYBRID_RATE,
        catch_up: int = CATCH_UP,
        window: int | None = None,
    ):
        super().__init__(stores)
        self.match, self.rate, self.catch_up = match, rate, catch_up
        self.window = window  # a catch-up's most prompt tokens (WINDOW where its engine's backend restarts; None: all)

    def choose(self, session: Session, assumed: list[int], k: int) -> list[int] | None:
        """This round's proposer: the index's drafts, [] (a round without drafts) or None (the
        model's round). The index proposes where its match is strong (`match` tokens or more)
        while its strong proposals of the session have lately matched what was committed (`rate`
        of their first HOLD drafts at least; scored whether used or not, so it takes over again
        when the text turns to a copy). A model round first catches up on the tokens its cache
        lacks (the prompt its session opened without, what the index's rounds committed), which
        costs more the more it lacks: while it lacks more than `catch_up` tokens for each round
        since the last strong match (at least one), the index keeps the rounds between, its weak
        matches or none, and its share need only hold at half `rate`: the rule of renting before
        buying (a copy's changed line is a few rounds; novel text past that many rounds pays the
        catch-up; with a `window`, of the prompt no more than its last `window`). CATCH_UP is this
        CPU's balance: the Q8_0 draft prefills ~3.4 ms a token, a round costs ~25 ms, so ~200 tokens
        are worth ~25 rounds (at 32, a HumanEval copy's model rounds cost 0.6-0.9 s of its 1.2-2.8 s
        for no more accepted tokens). With its model on an accelerator, whose prefill costs far
        less than a round, the draft service makes it infinite (draft_service.drafters: it never
        rents, and prefills every prompt at open).

        A call made again (the same committed tokens, assumed tokens and k: a round re-run after a
        lost or late reply) gets the answer the first got and changes nothing: the session's
        rounds, so a Leviathan seed's text, do not depend on how often a call was sent. A
        reproducible session (Session.reproducible: a seeded Leviathan sample) keeps no state at
        all: the index proposes where its match is strong, the model, caught up, elsewhere, so a
        session re-opened after a fault (a restarted draft service, its cache empty) drafts as the
        first would have."""
        if session.reproducible:
            found = self.suggest(session, assumed, k)
            return (ngram.allowed(session, assumed, found.tokens) or None) if found.strong(self.match) else None
        key = (len(session.tokens), tuple(session.tokens[-8:]), tuple(assumed), k)
        state = self._live.get(id(session))
        if state is not None and state.last is not None and state.last[0] == key:  # before the index's scan
            return None if state.last[1] is None else list(state.last[1])
        found, state = self._suggest(session, assumed, k)
        state.settle()
        strong = found.strong(self.match)
        if strong:
            state.pending.append((len(session.tokens), assumed, found.tokens))
        state.gap = 0 if strong else state.gap + 1
        # what the model's catch-up feeds: what its cache lacks, of the prompt its last `window` at most
        backlog = max(0, len(session.tokens) - max(len(session.cached), catch_up_from(session, self.window)))
        renting = max(state.gap, 1) * self.catch_up < backlog
        if state.rate < (self.rate / 2 if renting else self.rate):
            drafts = None
        elif strong:
            drafts = ngram.allowed(session, assumed, found.tokens) or None
        else:
            drafts = ngram.allowed(session, assumed, found.tokens) if renting else None
        state.last = (key, drafts)
        return None if drafts is None else list(drafts)

    def _catch_up(self, engine: SessionEngine, session: Session):
        """Feed the model what its cache lacks before its round: of the prompt its last `window`
        tokens at most, all of it for a reproducible session (its drafts may not depend on this
        service's history)."""
        return engine.catch_up(session, None if session.reproducible else self.window)

    def propose(
        self,
        engine: SessionEngine,
        session: Session,
        k: int,
        params: SamplingParams,
        uniforms: list[float],
        assumed: list[int] = (),
        noise_seed: int | None = None,
        alternatives: list | None = None,
        free: int = 0,
    ):
        """The index's chain (at most max(k, free) tokens) where it proposes, else k of the model's."""
        assumed = list(assumed)
        drafts = self.choose(session, assumed, max(k, free))
        if drafts is None:
            yield from self._catch_up(engine, session)
            model = proposer.propose(engine, session, k, params, uniforms, assumed, noise_seed, alternatives)
            return (yield from model)
        return ngram.point_masses(engine, session, params, noise_seed, assumed, drafts)

    def propose_tree(
        self,
        engine: SessionEngine,
        session: Session,
        depth: int,
        nodes: int,
        params: SamplingParams,
        uniforms,
        noise_seed=None,
        acceptance=(),
    ):
        drafts = self.choose(session, [], min(depth, nodes))
        if drafts is None:
            yield from self._catch_up(engine, session)
            model = proposer.propose_tree(engine, session, depth, nodes, params, uniforms, noise_seed, acceptance)
            return (yield from model)
        return chain(engine, session, drafts, params, noise_seed)
