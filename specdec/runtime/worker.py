"""The model worker: the one thread that touches a service's model, and its scheduler loop.

gRPC handlers validate at the edge, then submit an *item* (a generator of forward requests,
see specdec.runtime.engine) and wait for its result. Each step the worker
- admits queued items, at most one per key (a session's requests run in arrival order),
- drops items whose call was cancelled or ran past its deadline (a queued one changes
  nothing; a running one stops between forwards),
- runs the pending forward of every active item as one batched forward (`run_batch`), and
  feeds each item its logits; an item that returns resolves its future;
- holds back prefill: the forwards that count against the step's budget (`budgeted`, a
  prompt's chunks) join a step, oldest first, while their tokens fit in `budget`, at least one
  a step; the others (decodes, verifies) join every step. A wave of new prompts then prefills
  over several steps while the sessions already running go on decoding in each: without it,
  16 clients arriving at once made one draft step of 15 prompts' chunks (1005 tokens, 5.6 s
  on one core) and one target step of them (2.6 s), and every running session waited for
  them (vLLM's chunked-prefill token budget, with decodes first).
A step waits, briefly, for callers it has just served: a session's next request usually
follows its answer within a round trip (the orchestrator's rule, the wire), and a step that
starts without it splits the sessions into cohorts that take turns, each step half full. So
before a step the worker waits up to GATHER_MAX seconds (and GATHER_SHARE of the last step's
time) for the keys served in recent steps whose callers came back that quickly last time;
callers that come back later (a session drafting between its verifications) are not waited for,
nor is a key whose last item ended it (a session's close: waited for, every step of the next
second lost up to GATHER_MAX, 10 ms a round of a generation that followed another).
An error raised by an item fails that item only; when a batched forward fails, its items
run again one by one, so only those that fail alone get the error. Continuous batching:
items join and leave between any two steps, so a session's k-step proposal or a chunked
prefill never waits for the others to finish. A forward that `run_batch` answers with AGAIN
runs again in the next step without its item being woken (a greedy chain: the engine feeds each
step's token itself, specdec.runtime.session.Forward.chain).

The worker's thread is the one thread that does a service's device work: its forwards, and
before it serves, the backend's start-up (`run`: the KV cache's allocation, CUDA graph capture,
the warm-up and the draft's step profile, specdec.serving.lifecycle); CUDA graphs are captured and
replayed on one thread (torch keeps their state per thread, pytorch issue #123177).

This module knows nothing of models or sessions: the engine gives it `run_batch`.
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Generator

from specdec.errors import Cancelled, DeadlineExceeded, Unavailable

log = logging.getLogger("specdec")

GATHER_MAX = 0.010  # seconds a step waits, at most, for callers it has just served
GATHER_SHARE = 0.25  # ... and at most this share of the last step's time
FORGET = 1.0  # seconds after which a served key that did not come back is no longer expected
AGAIN = object()  # run_batch's result for a forward that runs again next step, its item not woken


_CALLBACKS = threading.Lock()  # an Outcome's callbacks and its setting (held for microseconds)


class Outcome:
    """An item's result or error, set once by the worker (a concurrent.futures.Future without its
    Condition: a lock held until it is set; a step stream makes one a call)."""

    __slots__ = ("_unset", "_value", "_error", "_callbacks")

    def __init__(self):
        self._unset = threading.Lock()
        self._unset.acquire()
        self._value = self._error = None
        self._callbacks: list | None = []  # None once set

    def done(self) -> bool:
        return self._callbacks is None

    def set_result(self, value) -> None:
        self._set(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._set(None, error)

    def _set(self, value, error) -> None:
        with _CALLBACKS:
            callbacks, self._callbacks = self._callbacks, None
            if callbacks is None:
                return  # set already
            self._value, self._error = value, error
        self._unset.release()
        for fn in callbacks:
            fn(self)

    def result(self):
        """Wait for it; its value, or raise its error."""
        if self._callbacks is not None:
            with self._unset:
                pass
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self) -> BaseException | None:
        """Its error (once set), or None."""
        return self._error

    def add_done_callback(self, fn) -> None:
        """fn(self) once it is set: at once if it is, else on the thread that sets it."""
        with _CALLBACKS:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)


class Item:
    """A unit of work: start() returns a generator that yields forward requests."""

    def __init__(
        self, key: str | None, start: Callable[[], Generator], final: bool = False, deadline: float | None = None
    ):
        self.key = key
        self.start = start
        self.final = final  # the key's last item: no caller comes back for it
        # time.monotonic() past which it is dropped with DeadlineExceeded (a step stream's call); None: never
        self.deadline = deadline
        self.context = contextvars.copy_context()  # the caller's (its trace span, for telemetry)
        self.future = Outcome()
        self.gen: Generator | None = None
        self.pending = None  # the forward request it waits on
        self.cancelled = False

    def dropped(self, now: float) -> BaseException | None:
        """Why the item goes no further (cancelled, or past its deadline), or None."""
        if self.cancelled:
            return Cancelled("the call was cancelled or its deadline passed")
        if self.deadline is not None and now > self.deadline:
            return DeadlineExceeded("the call's deadline passed before it was done")
        return None


class Worker:
    def __init__(
        self,
        run_batch: Callable[[list], list],
        name: str,
        budgeted: Callable[[object], int],
        budget: int,
    ):
        self.run_batch = run_batch
        self.name = name
        self.budgeted = budgeted  # a request's tokens that count against a step's budget (0: none)
        self.budget = budget  # those tokens a step takes, at least one such request
        self._queue: deque[Item] = deque()
        self._active: list[Item] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._served: dict = {}  # key -> when its last item finished, until its next one comes
        self._gaps: dict = {}  # key -> (seconds its caller took to come back last time, when)
        self._last_step = 0.0  # seconds the last batched forward took
        self._listeners: set[Callable[[], None]] = set()  # called after each pass of the loop (its step)

    # -- callers' side -----------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def submit_all(self, items: list[Item]) -> list[Item]:
        """Queue items and return at once (each item's `future` resolves with its result): the next
        step admits them all together."""
        self.start()
        with self._cond:
            if self._stopped:
                raise Unavailable("the model worker has stopped")
            now = time.monotonic()
            for item in items:
                self._queue.append(item)
                served = self._served.pop(item.key, None)
                if served is not None:
                    self._gaps[item.key] = (now - served, now)
            self._cond.notify_all()
        return items

    def call(self, key: str | None, start: Callable[[], Generator], context=None, final: bool = False):
        """Run an item on the worker and wait for its result; `context` (a gRPC call's) cancels it;
        `final`: as submit's."""
        return self.wait(Item(key, start, final), context)

    def wait(self, item: Item, context=None):
        """Submit `item`, wait for its result; `context` (a gRPC call's) cancels it."""
        self.submit_all([item])
        if context is not None and not context.add_callback(lambda: self.cancel(item)):
            self.cancel(item)  # the call had already ended
        return item.future.result()

    def listen(self, listener: Callable[[], None], on: bool = True) -> None:
        """Call `listener()` on the worker thread after each step (and each pass that finished
        items without one), and before a step when items it admitted ended without a forward (a
        close need not wait for the step): a step stream sends what finished in one message
        (on=False: no more)."""
        with self._cond:
            (self._listeners.add if on else self._listeners.discard)(listener)

    def run(self, fn: Callable[[], object]):
        """fn() on the worker thread, between steps; its result. What must run on the thread that
        runs the forwards (a backend's graph capture, its warm-up) goes here."""

        def item():
            return fn()
            yield  # a generator that feeds nothing

        return self.call(None, item)

    def cancel(self, item: Item) -> None:
        """Drop the item: queued, it never runs; running, it stops between forwards (CANCELLED)."""
        with self._cond:
            item.cancelled = True
            self._cond.notify_all()

    def busy(self) -> set:
        """Keys with an item queued or running (read on the worker thread)."""
        with self._cond:
            return {i.key for i in (*self._queue, *self._active)}

    # -- the worker thread -------------------------------------------------------------------
    def _gather(self) -> bool:
        """Wait for the callers served in recent steps that come back within the window;
        True if any came (the caller admits them into this step)."""
        window = min(GATHER_MAX, GATHER_SHARE * self._last_step)
        now = time.monotonic()
        deadline = now + window
        with self._cond:
            for key in [k for k, at in self._served.items() if now - at > FORGET]:
                del self._served[key]
            for key in [k for k, (_, at) in self._gaps.items() if now - at > 10 * FORGET]:
                del self._gaps[key]
            expected = {k for k in self._served if self._gaps.get(k, (math.inf,))[0] <= window}
            if not expected:
                return False
            while not self._stopped and expected & self._served.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return bool(self._queue)

    def _run(self) -> None:
        gathered = False
        while True:
            self._notify()  # what the last pass finished, handed on at once
            with self._cond:
                while not self._stopped and not self._queue and not self._active:
                    self._cond.wait()
                if self._stopped:
                    for item in (*self._queue, *self._active):
                        self._fail(item, Unavailable("the model worker has stopped"))
                    return
                admitted = self._admit()
            for item in admitted:
                self._advance(item, None)
            if any(item.pending is None for item in admitted):
                self._notify()  # what ended without a forward (a close, a rollback) leaves before the step
            now = time.monotonic()
            for item in self._active[:]:
                why = item.dropped(now)
                if why is not None:
                    self._fail(item, why)
            batch = self._step([i for i in self._active if i.pending is not None])
            if not batch:
                continue
            if not gathered and self._gather():
                gathered = True
                continue  # admit those who came, then run the step with them
            gathered = False
            started = time.perf_counter()
            try:
                # In the first item's context: a batched forward's span joins that request's trace.
                results = batch[0].context.run(self.run_batch, [i.pending for i in batch])
            except Exception:  # noqa: BLE001 - find the items that fail on their own
                log.warning("a batched forward of %d items failed; running them one by one", len(batch))
                for item in batch:
                    self._run_alone(item)
                continue
            for item, result in zip(batch, results, strict=True):
                if result is not AGAIN:
                    self._advance(item, result)
            # After the items took their results: on a GPU the forward only launches its kernels,
            # and the step's time is spent at the items' first read of the logits.
            self._last_step = time.perf_counter() - started

    def _notify(self) -> None:
        for listener in list(self._listeners):
            listener()

    def _step(self, ready: list[Item]) -> list[Item]:
        """The items of the next step: every unbudgeted one, and the budgeted ones in the
        order they became active while their tokens fit in the budget, at least one."""
        step, used = [], 0
        for item in ready:
            tokens = self.budgeted(item.pending)
            if tokens and used and used + tokens > self.budget:
                continue
            step.append(item)
            used += tokens
        return step

    def _run_alone(self, item: Item) -> None:
        try:
            [result] = item.context.run(self.run_batch, [item.pending])
        except Exception as err:  # noqa: BLE001 - the item's caller gets it
            log.exception("a forward failed")
            self._fail(item, err)
            return
        if result is not AGAIN:
            self._advance(item, result)

    def _admit(self) -> list[Item]:
        """Move queued items whose key is free to the active set (caller holds the lock)."""
        taken = {i.key for i in self._active if i.key is not None}
        admitted, waiting = [], deque()
        now = time.monotonic()
        for item in self._queue:
            why = item.dropped(now)
            if why is not None:
                item.future.set_exception(why)
            elif item.key is not None and item.key in taken:
                waiting.append(item)
            else:
                admitted.append(item)
                if item.key is not None:
                    taken.add(item.key)
        self._queue = waiting
        self._active.extend(admitted)
        return admitted

    def _advance(self, item: Item, result) -> None:
        """Start the item or feed it the result of its forward; finish it when it returns."""
        try:
            if item.gen is None:
                item.gen = item.start()
                item.pending = next(item.gen)
            else:
                item.pending = item.gen.send(result)
        except StopIteration as stop:
            self._finish(item)
            item.future.set_result(stop.value)
        except BaseException as err:  # noqa: BLE001 - the item's caller gets it
            self._finish(item)
            item.future.set_exception(err)

    def _fail(self, item: Item, err: BaseException) -> None:
        if item.gen is not None:
            item.gen.close()  # runs the item's cleanup (finally blocks)
        self._finish(item)
        if not item.future.done():
            item.future.set_exception(err)

    def _finish(self, item: Item) -> None:
        item.pending = None
        with self._cond:
            if item in self._active:
                self._active.remove(item)
            if item.key is not None and item.final:
                self._gaps.pop(item.key, None)
            elif item.key is not None:
                self._served[item.key] = time.monotonic()
