"""The prefix cache of a model service: a session opens from the keys and values another cache holds.

A session whose prompt begins with tokens another cache already holds starts from those positions
and prefills only the rest. The source is an open session's committed positions, copied into the
new session's own slot (`copy_prefix`: one copy a layer, a memcpy where a prefill is a forward
through every weight), or a closed session's cache kept for this (`Retained`): taken over whole,
no copy, where the prompt extends all it holds (the next turn of a conversation, an agent's next
step), else copied, so that it stays for the conversation it came from.

- Keyed by the tokens: each cache is indexed by a chain of hashes of its BLOCK_TOKENS-token
  blocks, block i's hash covering blocks 0..i, so the caches holding a prompt's first i blocks are
  those indexed under its i-th hash. A lookup walks the prompt's blocks to the deepest one some
  cache holds, then compares each such cache with the prompt token by token: a hit is exact to the
  token (a hash collision serves nothing wrong, and no partial last block is dropped, so the draft
  and the target hit alike on the same tokens and speculation keeps the whole hit).
- What is indexed is what a session's cache holds of its committed tokens, never a speculative
  tail past them nor a draft tree: the engine indexes a session after each request and cuts its
  chain wherever it cuts the cache (a rollback, a rejected tail below an indexed block).
- Kept caches count in the KV budget (specdec.limits.KVBudget) and hold their slots: the least
  recently used goes when a reservation would pass the budget or a new session finds no free
  slot (`free_caches`). A growing cache (specdec.runtime.kvcache) therefore grows for open sessions only.

One cache per engine, and an engine serves one model in one process: keys and values are never
served across models or weights.

Backend interface it needs (specdec.runtime.backend): copy_prefix(src, dst, n) (dst holds src's first n
positions and nothing else); optionally free_caches() (caches new_cache gives without growing
or refusing; absent: unbounded). The session fields it reads are specdec.runtime.session.Session's.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import ResourceExhausted
from specdec.limits import KVBudget

BLOCK_TOKENS = 16  # tokens a hash covers (vLLM's block): a prompt's lookup hashes len // 16 blocks
# Holders a lookup compares token by token, the most recently indexed first: those past the blocks
# all of them share can add less than a block to the hit, and a service that kept every closed
# session's cache held ~1,000 of them on one system prompt (~0.1 ms of CPU a session's open, on the
# model's thread).
LOOKUP_CANDIDATES = 32
_ROOT = hash("specdec.prefix")


@dataclass(eq=False)
class Retained:
    """A closed session's cache kept for later sessions: the tokens its positions hold."""

    cache: Any
    tokens: list[int]
    kv_tokens: int = 0  # reserved in the engine's KV budget
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class PrefixStats:
    """Since the service started: Describe's PrefixCache and the metrics."""

    prompt_tokens: int = 0  # prompt tokens of the sessions opened
    hit_tokens: int = 0  # ... of them whose keys and values were reused, not prefilled
    hits: int = 0  # sessions that reused any
    copied_tokens: int = 0  # positions copied from another cache (the rest: kept caches taken over)
    evictions: int = 0  # kept caches dropped for room


class PrefixIndex:
    """Caches (any object: sessions, Retained entries) by the hash chain of the tokens they hold."""

    def __init__(self, block: int = BLOCK_TOKENS):
        self.block = block
        self._chains: dict[int, tuple[Any, list[int]]] = {}  # id(holder) -> (holder, its block hashes)
        self._by_hash: dict[int, dict[int, Any]] = {}  # block hash -> {id(holder): holder}

    def index(self, holder, tokens: list[int], length: int) -> None:
        """Index `holder` as holding tokens[:length] (its whole blocks): its chain extended from
        where it stopped, or cut where it holds less now."""
        entry = self._chains.get(id(holder))
        if entry is not None and len(entry[1]) == length // self.block:  # the same whole blocks (most steps)
            return
        self.truncate(holder, length)
        _, chain = self._chains.setdefault(id(holder), (holder, []))
        h = chain[-1] if chain else _ROOT
        for start in range(len(chain) * self.block, length - self.block + 1, self.block):
            h = hash((h, *tokens[start : start + self.block]))
            chain.append(h)
            self._by_hash.setdefault(h, {})[id(holder)] = holder

    def truncate(self, holder, length: int) -> None:
        """`holder` holds its first `length` positions at most: its blocks past them go."""
        entry = self._chains.get(id(holder))
        chain = entry[1] if entry is not None else []
        while len(chain) * self.block > length:
            h = chain.pop()
            holders = self._by_hash[h]
            del holders[id(holder)]
            if not holders:
                del self._by_hash[h]

    def forget(self, holder) -> None:
        self.truncate(holder, 0)
        self._chains.pop(id(holder), None)

    def move(self, old, new) -> None:
        """`new` holds what `old` held (a cache changing hands): the chain, under the new holder."""
        entry = self._chains.pop(id(old), None)
        if entry is None:
            return
        self._chains[id(new)] = (new, entry[1])
        for h in entry[1]:
            holders = self._by_hash[h]
            del holders[id(old)]
            holders[id(new)] = new

    def blocks(self, holder) -> int:
        """The whole blocks `holder` is indexed for."""
        entry = self._chains.get(id(holder))
        return len(entry[1]) if entry is not None else 0

    def candidates(self, tokens: list[int], most: int | None = None) -> tuple[list, int]:
        """The holders indexed for the most leading blocks of `tokens`, the most recently indexed
        first (`most` of them at most: a system prompt's block may have thousands of holders, kept
        caches included), and how many blocks: a match of hashes, for the caller to check token by
        token."""
        deepest: dict = {}
        depth = 0
        h = _ROOT
        for start in range(0, len(tokens) - self.block + 1, self.block):
            h = hash((h, *tokens[start : start + self.block]))
            holders = self._by_hash.get(h)
            if not holders:
                break
            deepest, depth = holders, depth + 1
        return list(itertools.islice(reversed(deepest.values()), most)), depth


class PrefixCache:
    """An engine's prefix cache: the index of its caches, the kept ones, and a session's start
    from them, over the engine's backend and KV budget (whose reclaim evicts kept caches).
    Runs on the engine's model worker, as every change to a cache does."""

    def __init__(self, backend, budget: KVBudget, block: int = BLOCK_TOKENS):
        self.backend = backend
        self.budget = budget
        self.index = PrefixIndex(block)
        self.block = block
        self.retained: OrderedDict[int, Retained] = OrderedDict()  # id -> entry, least recently used first
        self.stats = PrefixStats()
        self._pinned: Retained | None = None  # the kept cache a session is opening from: never evicted meanwhile
        budget.reclaim = lambda: self.evict(self._pinned)

    @property
    def retained_tokens(self) -> int:
        return sum(e.kv_tokens for e in list(self.retained.values()))

    # -- a session's start -------------------------------------------------------------------
    def start(self, session, prompt: list[int], reuse: bool = True) -> None:
        """Reserve the prompt's room in the budget and give the session a cache: one that holds the
        longest prefix of the prompt another cache holds (`session.cached`), where there is one
        (`reuse`; else an empty one). Refused (ResourceExhausted), it holds nothing and no kept
        cache is lost but to eviction."""
        source, hit = self.lookup(prompt) if reuse else (None, 0)
        if isinstance(source, Retained) and hit == len(source.tokens):
            self._take_over(session, source, hit, len(prompt))
            return
        self._pinned = source if isinstance(source, Retained) else None
        try:
            self.budget.reserve(session, len(prompt))
            session.cache = self._new_cache()
            if hit:
                self.backend.copy_prefix(source.cache, session.cache, hit)
        except ResourceExhausted:
            self._undo_start(session)
            if not isinstance(source, Retained):
                raise
            self._take_over(session, source, hit, len(prompt))  # no room beside it: its cache, then
            return
        except BaseException:
            self._undo_start(session)
            raise
        finally:
            self._pinned = None
        if hit:
            session.cached = prompt[:hit]
            self.stats.copied_tokens += hit
            if isinstance(source, Retained):
                source.last_used = time.monotonic()
                self.retained.move_to_end(id(source))
        if reuse:  # a lookup made
            self._count(len(prompt), hit)

    def lookup(self, prompt: list[int]) -> tuple[Any, int]:
        """The cache holding the longest prefix of the prompt (short of its last token, which a
        session's first forward feeds again for its logits), and how long: exact to the token,
        among the LOOKUP_CANDIDATES most recent holders of the most leading blocks. Between two as
        long, a kept cache the prompt extends whole (taken over, no copy)."""
        wanted = prompt[:-1]
        holders, depth = self.index.candidates(wanted, LOOKUP_CANDIDATES)
        known = depth * self.block  # what the hashes say they share
        best, hit, whole = None, 0, False
        for holder in holders:
            kept = isinstance(holder, Retained)
            if hit == len(wanted) and (whole or not kept or len(holder.tokens) > hit):
                continue  # it cannot do better (many sessions on one system prompt: one compare, not one each)
            tokens, length = (holder.tokens, len(holder.tokens)) if kept else (holder.cached, reusable(holder))
            if tokens[:known] != wanted[:known]:  # a hash collision
                continue
            n = common_prefix(tokens, wanted, known, min(length, len(wanted)))
            takes = kept and n == len(holder.tokens)
            if (n, takes) > (hit, whole):
                best, hit, whole = holder, n, takes
        return best, hit

    def _undo_start(self, session) -> None:
        """Undo a start that failed: its reservation, and its cache if it got one."""
        release = getattr(self.backend, "release", None)
        if session.cache is not None and release is not None:
            release(session.cache)
        session.cache = None
        self.budget.settle(session, 0)

    def _take_over(self, session, entry: Retained, hit: int, length: int) -> None:
        """The session's cache is a kept one, cut to its first `hit` positions; its reservation
        becomes the session's (grown to `length`). Refused, the kept cache stays kept."""
        held = entry.kv_tokens
        self.retained.pop(id(entry))
        self.budget.settle(entry, 0)
        try:
            self.budget.reserve(session, length)
        except ResourceExhausted:
            self.budget.settle(entry, held)
            self.retained[id(entry)] = entry
            raise
        session.cache = entry.cache
        self.backend.crop(session.cache, hit)
        session.cached = entry.tokens[:hit]
        self.index.move(entry, session)
        self.index.truncate(session, hit)
        self._count(length, hit)

    def _count(self, prompt_tokens: int, hit: int) -> None:
        self.stats.prompt_tokens += prompt_tokens
        self.stats.hit_tokens += hit
        self.stats.hits += hit > 0

    def _new_cache(self):
        """A cache for a new session: a free one, else a kept cache's (the least recently used,
        not the one being opened from), else the backend's (a growing cache grows, a full one refuses)."""
        free = getattr(self.backend, "free_caches", None)
        if free is not None and free() == 0:
            self.evict(self._pinned)
        return self.backend.new_cache()

    # -- a session's life and end ------------------------------------------------------------------
    def note(self, session) -> None:
        """Index what the session's cache holds of its committed tokens (after each request)."""
        self.index.index(session, session.cached, reusable(session))

    def cut(self, session, keep: int) -> None:
        """The session's cache was cut to `keep` positions: its blocks past them hold other tokens now."""
        self.index.truncate(session, keep)

    def keep(self, session) -> bool:
        """Keep a closing session's cache for later sessions, cut to what it holds of its committed
        tokens (its reservation then the entry's); False where there is not a block's worth."""
        length = reusable(session)
        if session.cache is None or length < self.block:
            self.index.forget(session)
            return False
        self.note(session)
        self.backend.crop(session.cache, length)
        entry = Retained(session.cache, session.cached[:length])
        self.index.move(session, entry)
        self.retained[id(entry)] = entry
        self.budget.settle(entry, length)
        return True

    def evict(self, keep: Retained | None = None) -> bool:
        """Drop the least recently used kept cache but `keep`; False where there is none."""
        entry = next((e for e in self.retained.values() if e is not keep), None)
        if entry is None:
            return False
        del self.retained[id(entry)]
        self.index.forget(entry)
        release = getattr(self.backend, "release", None)
        if release is not None:
            release(entry.cache)
        self.budget.settle(entry, 0)
        self.stats.evictions += 1
        return True

    def clear(self) -> None:
        """Drop every kept cache."""
        while self.evict():
            pass


def reusable(session) -> int:
    """The positions of a session's cache another session may start from: what it holds of the
    committed tokens (the engine's invariant), below any draft tree; none of a draft's window's,
    which lacks the positions before it."""
    if session.window_start:
        return 0
    agreed = min(len(session.cached), len(session.tokens))
    return min(agreed, session.tree.floor) if session.tree is not None else agreed


def common_prefix(a: list[int], b: list[int], start: int = 0, end: int | None = None) -> int:
    """How many leading items a and b[:end] share, given that they share the first `start`
    (compared from there on: a session's committed prefix is not walked on every step, which
    made a step O(session length) and a long generation quadratic)."""
    n = min(len(a), len(b) if end is None else min(end, len(b)))
    if a[start:n] == b[start:n]:  # the usual case (a decode's tail, a chain the cache holds), compared in C
        return n
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n
