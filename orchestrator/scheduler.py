"""The orchestrator's scheduler: every generation a task on one thread, and a step of all of them
one message on each service's step stream.

A request's loop (orchestrator.loop) is written as one generation's rounds that wait for each call.
Run on a thread of its own per request, 64 requests were 64 threads that woke once a call each and
contended for the interpreter's lock: the orchestrator, not the models, was the ceiling under load
(docs/architecture.md, "The scheduler"). Here each generation is a task (a greenlet) on one
scheduler thread. A task runs until it waits (a step call's result, a continuation, a reconnect); the
scheduler then runs the next task that is ready, and once none is, flushes every step link
(orchestrator.step_link): the calls the tasks made meanwhile leave together as one message a service
runs as one batched step. A step's results come back as one message; the tasks they wake run, and
their next calls leave together again. The rounds keep each request's own policy (its k, rule, seed,
constraint, deadline, cancellation, trees): the code that decides them is the loop's, unchanged.

What waits in a task must wait here, not block the thread (every task would stop with it):
`result(future)` for any future with add_done_callback, `call` for a unary gRPC call, and `offload`
for blocking work (a reconnect) that runs on a thread meanwhile. Outside a task (tests driving a loop, the pricing run,
Ray Serve replicas) each of them blocks as usual, so the same code runs both ways.

Owns the scheduler thread, its tasks and their timers; knows nothing of rounds or the rule.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import greenlet

log = logging.getLogger("specdec")


class _Task(greenlet.greenlet):
    """A greenlet the scheduler runs: `wait` is the id of what it waits for (None: runnable)."""

    wait: int | None = None


def in_task() -> bool:
    """Whether the caller is a scheduler task (its waits must go through the scheduler)."""
    return type(greenlet.getcurrent()) is _Task


class TaskFuture(concurrent.futures.Future):
    """A future whose result() a task may wait on without blocking the scheduler's thread."""

    def result(self, timeout: float | None = None):
        self._wait_here(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None):
        self._wait_here(timeout)
        return super().exception(timeout)

    def _wait_here(self, timeout: float | None) -> None:
        """In a task: wait through the scheduler; TimeoutError when not done by then."""
        if in_task() and not self.done():
            SCHEDULER.suspend(self, timeout)
            if not self.done():
                raise concurrent.futures.TimeoutError()


def _complete(future: TaskFuture, fn: Callable, args, kwargs) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        value = fn(*args, **kwargs)
    except BaseException as err:  # noqa: BLE001 - the future carries it to whoever waits
        future.set_exception(err)
    else:
        future.set_result(value)


class Scheduler:
    """One thread running every task; started on first use."""

    def __init__(self):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # from any thread: what the thread must do
        self._ready: collections.deque = collections.deque()  # (task, value): the thread's own
        self._timers: dict[_Task, tuple[float, int]] = {}  # a waiting task's deadline (monotonic), wait id
        self._links: set = set()  # step links with calls queued since the last flush
        self._link_timers: dict = {}  # a step link holding calls -> when to flush it again (monotonic)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._held = threading.local()  # a thread's wakes held back (together)
        self._thread: threading.Thread | None = None
        self._hub: greenlet.greenlet | None = None

    # -- from any thread ---------------------------------------------------------------------
    def spawn(self, fn: Callable, *args, **kwargs) -> TaskFuture:
        """Run fn(*args, **kwargs) as a task, in a copy of the caller's context (its trace); the
        future holds its result."""
        future = TaskFuture()
        ctx = contextvars.copy_context()
        if in_task():
            self._start(future, ctx, fn, args, kwargs)
        else:
            self._ensure_started()
            self._inbox.put((self._start, (future, ctx, fn, args, kwargs)))
        return future

    def run(self, fn: Callable, *args, **kwargs):
        """fn's result, run as a task; the calling thread (not a task) waits for it."""
        return self.spawn(fn, *args, **kwargs).result()

    def iterate(self, make: Callable[[], Iterator]) -> Iterator:
        """The items of the iterator make() returns, produced by a task and handed to the calling
        thread one by one (a stream's chunks). As a generator: the task computes the next item only
        once the caller asks for it, and closing this generator closes the task's iterator there."""
        items: queue.SimpleQueue = queue.SimpleQueue()
        end = object()

        def produce() -> None:
            source = make()
            try:
                while True:
                    try:
                        item = next(source)
                    except StopIteration:
                        items.put((end, None))
                        return
                    except BaseException as err:  # noqa: BLE001 - raised again on the caller's thread
                        items.put((end, err))
                        return
                    wanted = TaskFuture()  # True: the caller asks for the next; False: it closed
                    items.put((item, wanted))
                    if not wanted.result():
                        return
            finally:
                close = getattr(source, "close", None)
                if close is not None:
                    close()

        self.spawn(produce)
        wanted = None
        try:
            while True:
                item, wanted = items.get()
                if item is end:
                    if wanted is not None:
                        raise wanted
                    return
                yield item
                wanted.set_result(True)
        finally:
            if isinstance(wanted, TaskFuture) and not wanted.done():
                wanted.set_result(False)

    def wake(self, task: _Task, wait: int, value) -> None:
        """Resume `task` with `value` if it still waits for `wait` (any thread)."""
        held = getattr(self._held, "wakes", None)
        if held is not None:
            held.append((task, wait, value))
        else:
            self._inbox.put((self._resume, (task, wait, value)))

    @contextlib.contextmanager
    def together(self):
        """The tasks this thread wakes meanwhile wake at once (a step's results, one message):
        none runs before the others are ready."""
        self._held.wakes = wakes = []
        try:
            yield
        finally:
            self._held.wakes = None
            if wakes:
                self._inbox.put((self._resume_all, (wakes,)))

    def _resume_all(self, wakes: list) -> None:
        for task, wait, value in wakes:
            self._resume(task, wait, value)

    def flush_later(self, link) -> None:
        """A task queued a call on `link`: send it with the step's others (the scheduler's thread)."""
        self._links.add(link)

    def flush_at(self, link, when: float) -> None:
        """`link` holds calls: flush it again at `when` (monotonic) at the latest (any thread)."""
        self._inbox.put((self._link_timers.__setitem__, (link, when)))

    # -- in a task -----------------------------------------------------------------------------
    def suspend(self, future, timeout: float | None) -> bool:
        """Wait (in a task) until `future` is done, at most `timeout` seconds: whether it is done."""
        if future.done():
            return True
        task = greenlet.getcurrent()
        wait = next(self._ids)
        task.wait = wait
        future.add_done_callback(lambda _f: self.wake(task, wait, True))
        if timeout is not None:
            self._timers[task] = (time.monotonic() + max(0.0, timeout), wait)
        done = self._hub.switch()
        return bool(done) or future.done()

    # -- the scheduler's thread ----------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    started = threading.Event()
                    self._thread = threading.Thread(
                        target=self._main, args=(started,), name="specdec-scheduler", daemon=True
                    )
                    self._thread.start()
                    started.wait()

    def _start(self, future: TaskFuture, ctx: contextvars.Context, fn, args, kwargs) -> None:
        def body(_value=None) -> None:
            ctx.run(_complete, future, fn, args, kwargs)

        self._ready.append((_Task(body, parent=self._hub), None))

    def _resume(self, task: _Task, wait: int, value) -> None:
        if task.wait != wait:  # woken already (its timer, or the future, came first)
            return
        task.wait = None
        self._timers.pop(task, None)
        self._ready.append((task, value))

    def _drain(self) -> None:
        """Do what the inbox holds now, without waiting."""
        try:
            while True:
                action, args = self._inbox.get_nowait()
                action(*args)
        except queue.Empty:
            pass

    def _main(self, started: threading.Event) -> None:
        self._hub = greenlet.getcurrent()
        started.set()
        inbox, ready = self._inbox, self._ready
        while True:
            timeout = None
            if self._timers or self._link_timers:
                soonest = min([d for d, _ in self._timers.values()] + list(self._link_timers.values()))
                timeout = max(0.0, soonest - time.monotonic())
            try:
                action, args = inbox.get(timeout=timeout)
            except queue.Empty:
                pass
            else:
                action(*args)
                self._drain()  # all that arrived meanwhile: a step's results wake together
            if self._timers:
                now = time.monotonic()
                for task, (deadline, wait) in list(self._timers.items()):
                    if deadline <= now:
                        self._resume(task, wait, False)
            while ready:
                task, value = ready.popleft()
                try:
                    task.switch(value)
                except BaseException:  # noqa: BLE001 - a task's own errors reach its future; this thread must go on
                    log.exception("a scheduler task failed outside its future")
                if not ready:  # results that came while these ran join this step
                    self._drain()
            if self._link_timers:
                now = time.monotonic()
                for link, when in list(self._link_timers.items()):
                    if when <= now:
                        del self._link_timers[link]
                        self._links.add(link)
            links, self._links = self._links, set()
            for link in links:
                link.flush()


SCHEDULER = Scheduler()


def result(future, timeout: float | None = None):
    """future.result(timeout), waiting in a task without blocking the scheduler (any future with
    add_done_callback: a gRPC call's, a continuation's)."""
    if in_task() and not future.done():
        SCHEDULER.suspend(future, timeout)
        if not future.done():
            return future.result(timeout=0)  # raises the future's own timeout error
    return future.result(timeout)


def call(method, request, **kwargs):
    """A unary gRPC call; in a task, its reply waited for without blocking the other tasks."""
    if in_task():
        return result(method.future(request, **kwargs))
    return method(request, **kwargs)


_OFFLOAD = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="specdec-offload")


def offload(fn: Callable, *args, **kwargs):
    """fn's result; in a task, fn runs on a thread (blocking work: a reconnect, a probe) while the
    other tasks run."""
    if not in_task():
        return fn(*args, **kwargs)
    ctx = contextvars.copy_context()
    return result(_OFFLOAD.submit(ctx.run, fn, *args, **kwargs))


class Continuations:
    """Where a generation runs work beside its own (a continuation, a draft's OpenSession, a close):
    a task of its own when called from a task, else a thread of the pool. Its futures' result() may
    be waited on from a task."""

    def __init__(self, max_workers: int):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="specdec-continuation")

    def submit(self, fn: Callable, *args, **kwargs) -> TaskFuture:
        if in_task():
            return SCHEDULER.spawn(fn, *args, **kwargs)
        future = TaskFuture()
        self._pool.submit(_complete, future, fn, args, kwargs)
        return future
