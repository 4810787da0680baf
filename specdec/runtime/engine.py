"""Per-session KV caches over a backend: open, commit, feed, roll back, close, on one worker.

A session holds its committed tokens and a cache of keys/values for a prefix of
(committed tokens + a speculative tail). Invariants, restored after every change:
- `cached` (the tokens whose keys/values the cache holds) agrees with the committed tokens
  wherever both are defined;
- a forward feeds again every position whose logits it wants, so a verify of k drafts feeds
  the last committed token with them (k + 1 positions): its keys and values are then computed
  in the same multi-token forward as the drafts after it, whose numerics differ in the last
  bits from a one-token forward, and acceptance stays high;
- a commit keeps whatever the cache holds that the committed tokens match, and a speculative
  tail past them: an overlapped round's continuation, proposed past drafts that the commit
  then accepts, goes on from its cached tail (docs/architecture.md#overlapped-rounds).
Rollback and discarding a rejected speculative tail are truncations (O(1)): no copies, no
re-prefill.

Every change to a session runs on the engine's model worker (specdec.runtime.worker), the one thread
that touches the model: a request is a generator over the session that yields `Forward`s (feed
these tokens, return these logits) and returns its result; the worker runs the forwards of
different sessions' requests as one batched forward when the backend has `forward_batch`
(specdec.runtime.backend, over a slot cache: specdec.runtime.kvcache), one by one otherwise. A prompt is
prefilled in chunks of the backend's prefill_chunk tokens (PREFILL_CHUNK unless it says), and a
step takes prompts' chunks up to PREFILL_BUDGET tokens (at least one chunk) beside every decode
and verify. `call` submits a request and waits for it. Threads: a request may name the threads
its forwards use (specdec.runtime.placement); a step runs with the fewest any of its forwards allows,
under the machine's core lock (`placement.Cores`; none given: the process's threads, no lock).

Limits (specdec.limits) are checked where they bind: the session count at open, the KV
budget before a cache grows; sessions idle past the TTL are closed by `close_idle`.

Prefix cache (specdec.runtime.prefix; SessionLimits.prefix_cache, on a backend with `copy_prefix`): a
session opens from the longest prefix of its prompt that another cache holds (an open session's
committed positions, or a closed session's cache kept for it) and prefills only the rest, in the
chunks a whole prefill would feed it in (ending at multiples of the chunk). What it indexes is
what `cached` holds of the committed tokens, cut wherever the cache is cut (`_crop`); a
speculative tail or a draft tree never is. A closed session's cache is kept (`close`), within the
KV budget, until a reservation or a new session needs its room.

The engine knows nothing of RPC or of the accept/resample rule; draft_service and target_service
build propose and score on it. Why: docs/architecture.md#one-model-worker-batched-forwards.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import replace

import torch

from specdec import validation
from specdec.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
)
from specdec.greedy import step_argmax
from specdec.limits import KVBudget, SessionLimits
from specdec.runtime import placement
from specdec.runtime.kvcache import Tree
from specdec.runtime.prefix import PrefixCache, common_prefix
from specdec.runtime.session import Forward, Session, SessionCall
from specdec.runtime.worker import AGAIN, Item, Worker

# Prompt tokens a session feeds per worker step, where its backend does not say (`prefill_chunk`: the
# torch backend feeds PREFILL_BUDGET, one forward costing less than the same tokens in four; a llama.cpp
# backend one ubatch).
PREFILL_CHUNK = 128
# Prompt tokens a worker step takes, all sessions' (vLLM's chunked-prefill token budget). Not
# smaller: a wave of c 67-token prompts prefilled one prompt a step (a budget of 128) started its
# sessions' decodes one step apart, and they no longer shared their steps to the end: speculation
# off at 8 clients 44.6 tok/s against 57.3 with every prompt in one step (specdec bench concurrency).
# 512 takes a wave of 7 such prompts in one step, bounds a step's prefill at ~1.3 s for the fp32
# target on one core (~1.6 s for the default Q8_0 draft, ~2.6 s for the Q4_1 file), and is a
# llama_batch's size (llamacpp.BATCH_TOKENS).
PREFILL_BUDGET = 512


class SessionEngine:
    def __init__(self, backend, role: str, limits: SessionLimits | None = None, step_profile=None, cores=None):
        self.backend = backend
        self.role = role
        # startup.profile_steps, for Describe: {(threads, sessions, tokens): seconds}
        self.step_profile: dict[tuple[int, int, int], float] = dict(step_profile or {})
        self.cores: placement.Cores | None = cores  # threads per step and the core lock; None: neither
        self.limits = limits or SessionLimits()
        held = getattr(backend, "max_sessions", None)  # a backend whose KV holds fewer (llama.cpp's streams)
        if held is not None and held < self.limits.max_sessions:
            self.limits = replace(self.limits, max_sessions=held)
        # The longest prompt OpenSession prefills (None: any); a longer one it registers and feeds
        # none of, `catch_up` feeding it before a forward needs it (the hybrid's index rounds need none)
        self.prefill_at_open: int | None = None
        self.prefill_chunk = min(getattr(backend, "prefill_chunk", PREFILL_CHUNK), PREFILL_BUDGET)
        self.kv = KVBudget(self.limits.max_kv_tokens)
        # One per engine: one model in one process (keys and values never cross models).
        prefix = self.limits.prefix_cache and hasattr(backend, "copy_prefix")
        self.prefix: PrefixCache | None = PrefixCache(backend, self.kv) if prefix else None
        self._sessions: dict[str, Session] = {}
        self.worker = Worker(
            self._run_batch, f"{role}-model-worker", lambda f: len(f.tokens) if f.prefill else 0, PREFILL_BUDGET
        )

    # -- requests ----------------------------------------------------------------------
    def call(
        self,
        session_id: str,
        expected_length: int | None,
        request: Callable,
        context=None,
        threads: int | None = None,
    ):
        """Run request(session) on the worker and return its result. `request` is a plain
        function or a generator function yielding Forwards; the session is checked first
        against the caller's view of its committed length. `context` (gRPC) cancels it;
        `threads`: the most its forwards may use (None: the service's)."""
        return self.run_call(SessionCall(session_id, expected_length, request, threads), context)

    def run_call(self, call: SessionCall, context=None):
        """Run `call` on the worker and return its result; `context` (gRPC) cancels it."""
        return self.worker.wait(self.item(call), context)

    def item(self, call: SessionCall, deadline: float | None = None) -> Item:
        """`call` as a worker item, for worker.submit_all (which queues several at once and returns;
        each item's `future` resolves with its result, `worker.cancel(item)` drops it); `deadline`
        (time.monotonic()) drops it past it. It runs in the context it is made in (its trace span)."""
        start = lambda: self._on_session(call.session_id, call.expected_length, call.run, call.threads, call.final)  # noqa: E731
        return Item(call.session_id, start, call.final, deadline=deadline)

    def _on_session(
        self, session_id: str, expected_length: int | None, request: Callable, threads=None, final: bool = False
    ) -> Generator:
        """request(session) on the worker; `final`: the session is closed once it returns."""
        began = time.monotonic()
        session = self._get(session_id)
        if expected_length is not None and expected_length != len(session.tokens):
            raise FailedPrecondition(f"expected_length {expected_length} != session length {len(session.tokens)}")
        session.threads = threads
        try:
            result = request(session)
            if inspect.isgenerator(result):
                result = yield from result
            if final:
                self._retire(session_id, session)
            return result
        finally:
            session.last_used = time.monotonic()
            # a call of a caller found gone while it ran (cancelled, its stream ended) claims it no more
            session.claimed = session.claimed or began > session.disowned
            if not session.closed:
                self.kv.settle(session, max(len(session.cached), session.kv_floor))
                if self.prefix is not None:
                    self.prefix.note(session)

    def _get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"session_id: no open session {session_id!r}")
        return session

    def _run_batch(self, forwards: list[Forward]) -> list[torch.Tensor]:
        batch = getattr(self.backend, "forward_batch", None)
        items = [(f.session.cache, f.tokens, f.n_logits) for f in forwards]
        trees = [f.tree for f in forwards]
        threads, waited = 0, 0.0
        with contextlib.ExitStack() as stack:
            if self.cores is not None:
                threads = self.cores.of(f.threads for f in forwards)
                waited = stack.enter_context(self.cores.step(threads, self.backend))
            t0 = time.perf_counter()
            if batch is None:
                logits = [self.backend.forward(*item) for item in items]
            elif any(trees):  # forward_tree sends trees only to a backend that verifies them
                logits = batch(items, trees=trees)
            else:
                logits = batch(items)
            seconds = time.perf_counter() - t0
        # A session over a shared vocabulary smaller than the model's never sees the rows past it.
        logits = [
            rows[..., : f.session.vocab_size] if f.session.vocab_size else rows
            for f, rows in zip(forwards, logits, strict=True)
        ]
        greedy = [i for i, f in enumerate(forwards) if f.greedy]
        if greedy:
            for i, tokens in zip(greedy, step_argmax([logits[i] for i in greedy]), strict=True):
                f = forwards[i]
                if f.chain == 1 or f.argmax is None:
                    f.argmax = tokens
                else:
                    f.argmax += tokens
        step, results = sum(len(f.tokens) for f in forwards), []
        for f, rows in zip(forwards, logits, strict=True):
            if f.steps and f.chain > 1:  # a chain's next step: its cache now holds the token it fed
                f.cached.append(f.tokens[0])
            f.session.cached, f.session.tree = f.cached, f.tree
            f.steps, f.step_tokens, f.step_threads = f.steps + 1, f.step_tokens + step, threads
            f.step_sessions = max(f.step_sessions, len(forwards))
            f.waited, f.seconds = f.waited + waited, f.seconds + seconds
            if f.steps < f.chain and f.argmax[-1] not in f.stop:
                f.tokens = f.argmax[-1:]  # the next step feeds this one's token
                rows = AGAIN
            results.append(rows)
        return results

    # -- lifecycle ---------------------------------------------------------------------
    def open(
        self,
        session_id: str,
        prompt: list[int],
        context=None,
        threads: int | None = None,
        constraint=None,
        vocab_size: int = 0,
        prompt_length: int | None = None,
        history_scope: str = "",
        reproducible: bool = False,
        prediction: Sequence[int] = (),
        reserve: int = 0,
    ) -> int:
        """Open a session holding `prompt` (prefilled by threads of at most `threads`), its logits
        over the first `vocab_size` rows (0: all); `constraint`: its grammar's matcher, at the end of
        `prompt` (specdec.decoding.grammar.Matcher); `prompt_length`: how many of its tokens the request's
        prompt is (None: all; a session re-opened mid-generation holds generated ones too);
        `history_scope`, `reproducible`, `prediction`: OpenSessionRequest's, for a drafter that keeps
        state or searches text (prediction_token_ids); `reserve`: the KV budget held (open_item)."""
        item = self.open_item(
            session_id,
            prompt,
            threads,
            constraint,
            vocab_size,
            prompt_length=prompt_length,
            history_scope=history_scope,
            reproducible=reproducible,
            prediction=prediction,
            reserve=reserve,
        )
        return self.worker.wait(item, context)

    def open_item(
        self,
        session_id: str,
        prompt: list[int],
        threads: int | None = None,
        constraint=None,
        vocab_size: int = 0,
        deadline: float | None = None,
        prompt_length: int | None = None,
        history_scope: str = "",
        reproducible: bool = False,
        prediction: Sequence[int] = (),
        reserve: int = 0,
    ) -> Item:
        """open()'s request, checked, as a worker item (see `item`); its result: the session's length.
        `reserve`: the length the session may reach, held in the KV budget from the open on (capped at
        the context; else the budget grows with the session and may refuse it mid-generation)."""
        if not session_id:
            raise InvalidArgument("session_id must not be empty")
        if not prompt:
            raise InvalidArgument("prompt_token_ids must not be empty")
        if not 0 <= vocab_size <= self.backend.vocab_size:
            raise InvalidArgument(f"vocab_size {vocab_size} is outside 1..{self.backend.vocab_size} (the model's rows)")
        self.check_tokens(prompt, "prompt_token_ids")
        self.check_room(len(prompt), "prompt_token_ids")
        prompt = list(prompt)
        if prompt_length is not None and not 0 <= prompt_length <= len(prompt):
            raise InvalidArgument(f"prompt_length must be in 0..{len(prompt)}, got {prompt_length}")
        validation.at_most_chars(history_scope, validation.MAX_SCOPE_CHARS, "history_scope")
        self.check_tokens(prediction, "prediction_token_ids")
        self.check_room(len(prediction), "prediction_token_ids")
        session = Session(
            tokens=prompt,
            cache=None,
            threads=threads,
            constraint=constraint,
            vocab_size=vocab_size,
            prompt_length=len(prompt) if prompt_length is None else prompt_length,
            history_scope=history_scope,
            reproducible=reproducible,
            prediction=tuple(prediction),
            kv_floor=max(0, min(reserve, self.backend.max_context)),
        )
        return Item(session_id, lambda: self._open(session_id, session), deadline=deadline)

    def _open(self, session_id: str, session: Session) -> Generator:
        """Register the session (open_item's) and prefill its prompt."""
        if session_id in self._sessions:
            raise AlreadyExists(f"session_id {session_id!r} is already open")
        if len(self._sessions) >= self.limits.max_sessions:
            raise ResourceExhausted(f"max_sessions {self.limits.max_sessions} sessions are open; retry when one closes")
        prompt, threads = session.tokens, session.threads
        session.last_used = time.monotonic()
        prefill = self.prefill_at_open is None or len(prompt) <= self.prefill_at_open
        # A session opened without its prefill starts from no other cache's positions either: what its
        # cache holds is then a function of its own calls (a hybrid's rounds depend on it: a seed's text).
        if self.prefix is not None:
            self.prefix.start(session, prompt, reuse=prefill)  # reserves; may start from another cache's positions
        else:
            self.kv.reserve(session, len(prompt))
        self._sessions[session_id] = session
        try:
            self.kv.reserve(session, session.kv_floor)  # the whole answer's room: refused now, not mid-way
            if session.cache is None:
                session.cache = self.backend.new_cache()
            if prefill:
                yield from self._prefill(session, prompt[:-1], threads)  # the last token: the next block's
        except BaseException:  # an error, or the call cancelled mid-prefill
            self._retire(session_id, session)
            raise
        self.kv.settle(session, max(len(session.cached), session.kv_floor))
        if self.prefix is not None:
            self.prefix.note(session)
        return len(prompt)

    def _prefill(self, session: Session, prefix: list[int], threads: int | None) -> Generator:
        """Feed `prefix` past what the cache holds of it (after a prefix hit: in the chunks a whole
        prefill feeds it in, ending at multiples of prefill_chunk)."""
        start, chunk = len(session.cached), self.prefill_chunk
        while start < len(prefix):
            end = min(start - start % chunk + chunk, len(prefix))
            yield Forward(session, prefix[start:end], 1, prefix[:end], prefill=True, threads=threads)
            start = end

    def catch_up(self, session: Session, window: int | None = None) -> Generator:
        """Feed the cache the committed tokens it lacks but the last (the next forward feeds it),
        as a prompt is prefilled: a session opened without its prefill (`prefill_at_open`), or one
        whose drafts came from elsewhere for a while, before a forward on the model. `window`: where
        the backend can start a cache anywhere (`restart`), the prompt's tokens before its last
        `window` are not fed, the cache starting afresh there (a draft's: it drafts from the
        prompt's last `window` tokens and what followed, and a long prompt's catch-up costs a short
        one's; docs/models.md)."""
        self._settle_tree(session)
        fed = len(session.tokens) - 1
        agreed = common_prefix(session.cached, session.tokens, min(_agreed(session), fed), fed)
        if fed - agreed > self.prefill_chunk:  # less: the next forward feeds it (a continuation's drafts stay)
            start = catch_up_from(session, window) if hasattr(self.backend, "restart") else 0
            self._crop(session, 0 if start > agreed else agreed)
            self.reserve(session, len(session.tokens))
            if start > agreed:
                self.backend.restart(session.cache, start)
                session.cached, session.window_start = session.tokens[:start], start
            yield from self._prefill(session, session.tokens[:fed], session.threads)

    def close(self, session_id: str, context=None) -> None:
        self.worker.wait(self.close_item(session_id), context)

    def close_item(self, session_id: str, unknown: Callable[[str], None] = lambda _: None) -> Item:
        """close()'s request as a worker item (the session's last); `unknown(session_id)` where it
        finds no such session (then NotFound)."""

        def start():
            try:
                yield from self._on_session(session_id, None, lambda _: None, final=True)  # a call that only ends it
            except NotFound:
                unknown(session_id)
                raise

        return Item(session_id, start, final=True)

    def close_idle(self, ttl: float, unclaimed: bool = False) -> list[str]:
        """Close sessions unused for more than `ttl` seconds (with `unclaimed`: only those no
        request used since they opened); skip any in use. Returns their ids."""

        def reap():
            now, busy = time.monotonic(), self.worker.busy()
            idle = [
                sid
                for sid, s in self._sessions.items()
                if now - s.last_used > ttl and sid not in busy and not (unclaimed and s.claimed)
            ]
            for sid in idle:
                self._retire(sid, self._sessions[sid])
            return idle
            yield  # a generator that feeds nothing

        return self.worker.call(None, reap)

    def disown(self, session_ids) -> None:
        """The caller that opened these sessions is gone (its step stream ended): each still open
        counts as unclaimed from now, closed after the unclaimed TTL unless a request uses it
        again (its caller reconnected), not after the idle TTL. Queued; returns at once."""

        def unclaim():
            now = time.monotonic()
            for sid in session_ids:
                session = self._sessions.get(sid)
                if session is not None:
                    session.last_used, session.claimed, session.disowned = now, False, now
            return
            yield  # a generator that feeds nothing

        self.worker.submit_all([Item(None, unclaim)])

    def _retire(self, session_id: str, session: Session) -> None:
        """Forget a session and free its cache (or keep it for the prefix cache)."""
        if self._sessions.get(session_id) is session:
            del self._sessions[session_id]
        release = getattr(self.backend, "release", None)
        kept = self.prefix is not None and self.prefix.keep(session)
        if release is not None and session.cache is not None and not kept:
            release(session.cache)
        session.closed = True
        session.cache = None
        session.proposal_rows = None
        self.kv.settle(session, 0)

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        """Free the kept caches (a backend may serve another engine next: tests do), then stop the worker."""
        if self.prefix is not None:
            with contextlib.suppress(Unavailable):
                self.worker.run(self.prefix.clear)
        self.worker.stop()

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    @property
    def session_kv_tokens(self) -> int:
        """Tokens reserved in the KV budget by open sessions (the rest: kept caches)."""
        return max(0, self.kv.held - (self.prefix.retained_tokens if self.prefix is not None else 0))

    @property
    def cached_tokens(self) -> int:
        """Tokens whose keys and values the caches of all open sessions hold."""
        return sum(len(s.cached) - s.window_start for s in list(self._sessions.values()))

    def reserve(self, session: Session, length: int, what: str = "sequence") -> None:
        """Check that the session may grow to `length` tokens (context, KV budget), before changing it."""
        self.check_room(length, what)
        self.kv.reserve(session, length)

    # -- changes (on the worker) -----------------------------------------------------------
    def open_round(self, session: Session, append_tokens: list[int], extra: int, what: str) -> None:
        """A round's opening: reserve room for the committed tokens plus `extra` to be fed,
        then commit. Checked before the change, so a refused request changes nothing."""
        self.reserve(session, len(session.tokens) + len(append_tokens) + extra, what)
        self.commit(session, list(append_tokens))

    def commit(self, session: Session, token_ids: list[int]) -> None:
        """Append committed tokens; keep whatever cached speculative tail they match."""
        if not token_ids:
            return
        self.check_tokens(token_ids, "append_tokens")
        self.check_room(len(session.tokens) + len(token_ids), "append_tokens")
        if session.constraint is not None:  # refused before any change if the grammar forbids one
            session.constraint.commit(token_ids, "append_tokens")
        agreed = _agreed(session)
        session.tokens.extend(token_ids)
        if session.tree is not None:
            self._settle_tree(session, keep_path=True)
            agreed = len(session.cached)  # the path it kept is the committed tokens'
        keep = common_prefix(session.cached, session.tokens, agreed)
        if keep < len(session.tokens):  # else the cache holds them all: its tail past them stays
            self._crop(session, keep)

    def rollback(self, session: Session, to_length: int) -> None:
        if not 1 <= to_length <= len(session.tokens):
            raise OutOfRange(f"to_length {to_length} is outside 1..{len(session.tokens)} (the session length)")
        del session.tokens[to_length:]
        if session.constraint is not None:
            session.constraint.rollback(to_length)
        self._settle_tree(session)
        self._crop(session, to_length - 1)  # the last one is fed again

    def forward(
        self,
        session: Session,
        speculative: list[int],
        n_logits: int,
        greedy: bool = False,
        chain: int = 1,
        stop: frozenset[int] = frozenset(),
    ) -> Forward:
        """What to feed so the cache holds tokens + speculative, wanting the logits of the last
        n_logits positions: yield it from a request to get them ([n_logits, vocab]). `greedy`:
        the Forward's `argmax` then holds each of those rows' argmax (found with the step's others).
        `chain` > 1 (greedy, one row): a greedy chain of that many tokens, ending after one in
        `stop` (Forward.chain); the cache then holds tokens + speculative + all its tokens but the last.

        Afterwards the cache holds tokens + speculative (a speculative tail that a later
        commit keeps where it matches and truncates where it does not).
        """
        self._settle_tree(session)
        assert chain == 1 or (greedy and n_logits == 1), (chain, greedy, n_logits)
        sequence = session.tokens + speculative
        self.reserve(session, len(sequence) + chain - 1)
        # Keep what the cache holds of this sequence, short of the positions whose logits are
        # wanted: a draft step feeds only its newest token, not the tail proposed before it.
        fed = len(sequence) - n_logits
        self._crop(session, common_prefix(session.cached, sequence, min(_agreed(session), fed), fed))
        pending = sequence[len(session.cached) :]
        assert len(pending) >= n_logits, (len(pending), n_logits)
        return Forward(
            session, pending, n_logits, sequence, threads=session.threads, greedy=greedy, chain=chain, stop=stop
        )

    def forward_tree(self, session: Session, tokens: list[int], parents: list[int]) -> Forward:
        """What to feed so the cache holds the committed tokens and then a draft tree (tokens[i]
        with parent parents[i], an index into tokens or -1), wanting the logits after the last
        committed token and after each node ([n + 1, vocab]): a verify of a tree. The next
        commit keeps the nodes of the path it commits (kvcache.compact)."""
        if not getattr(self.backend, "trees", False):
            raise FailedPrecondition("draft_parent_ids: this service's backend verifies chains only")
        chain = self.forward(session, [], 1)  # the committed tokens not cached yet, the last one at least
        floor = len(session.tokens)
        self.reserve(session, floor + len(tokens), "append_tokens + draft_token_ids")
        tree = Tree(floor, tuple(floor - 1 if parent < 0 else floor + parent for parent in parents))
        return Forward(session, chain.tokens + list(tokens), len(tokens) + 1, session.tokens + list(tokens), tree=tree)

    def extend_tree(self, session: Session, tokens: list[int], parents: list[int]) -> Forward:
        """What to feed so the draft tree the cache holds after the committed tokens (none yet:
        they must all be cached, a forward of them first) gains the nodes `tokens` (parents[i]: an
        index into the tree's nodes so far and then these, or -1: after the committed tokens),
        wanting the logits after each of them ([n, vocab]): a draft growing its tree a depth at a
        time. The next commit keeps the nodes of the path it commits, as after forward_tree."""
        if not getattr(self.backend, "trees", False):
            raise FailedPrecondition("a draft tree: this service's backend attends chains only")
        floor, old = len(session.tokens), session.tree.parents if session.tree is not None else ()
        assert len(session.cached) == floor + len(old), (len(session.cached), floor, len(old))
        self.reserve(session, floor + len(old) + len(tokens), "a draft tree")
        tree = Tree(floor, old + tuple(floor - 1 if parent < 0 else floor + parent for parent in parents))
        return Forward(session, list(tokens), len(tokens), session.cached + list(tokens), tree=tree)

    def fits(self, session: Session, length: int) -> bool:
        """Whether the session may grow to `length` tokens (reserving them if so): reserve, as a test."""
        try:
            self.reserve(session, length)
        except (OutOfRange, ResourceExhausted):
            return False
        return True

    def _settle_tree(self, session: Session, keep_path: bool = False) -> None:
        """A cached draft tree becomes a chain again: with `keep_path`, its nodes along the
        committed tokens past its floor move to the positions after the floor (the rest go);
        otherwise it is dropped."""
        tree, session.tree = session.tree, None
        if tree is None:
            return
        path, node = [], tree.floor - 1
        for token in session.tokens[tree.floor :] if keep_path else ():
            children = [tree.floor + i for i, parent in enumerate(tree.parents) if parent == node]
            match = [c for c in children if session.cached[c] == token]
            if not match:
                break
            node = match[0]
            path.append(node)
        self.backend.compact(session.cache, tree.floor, path)
        session.cached = session.cached[: tree.floor] + [session.cached[c] for c in path]

    def _crop(self, session: Session, keep: int) -> None:
        if keep < len(session.cached):
            self.backend.crop(session.cache, keep)
            del session.cached[keep:]
            session.window_start = min(session.window_start, keep)  # cut below its window: it holds nothing
            if self.prefix is not None:
                self.prefix.cut(session, keep)

    # -- checks ------------------------------------------------------------------------
    def check_tokens(self, token_ids: list[int], field_name: str) -> None:
        validation.token_ids(token_ids, self.backend.vocab_size, field_name)

    def check_room(self, length: int, what: str = "sequence") -> None:
        if length > self.backend.max_context:
            raise OutOfRange(
                f"{what}: a sequence of {length} tokens exceeds the model context of {self.backend.max_context}"
            )


def catch_up_from(session: Session, window: int | None) -> int:
    """Where a catch-up on `window` starts: before the prompt's last `window` tokens (0: at the
    start; window None: no window)."""
    return 0 if window is None else max(0, min(len(session.tokens) - 1, session.prompt_length) - window)


def _agreed(session: Session) -> int:
    """How far the cache and the committed tokens are known to agree (the invariant above)."""
    return min(len(session.cached), len(session.tokens))
