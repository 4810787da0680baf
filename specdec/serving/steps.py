"""The step stream, service side: many sessions' calls on one long-lived stream (`Steps`).

A caller with many sessions on a model service (the orchestrator) keeps one `Steps` stream to it.
Each message it sends carries every call its sessions made since its last one (StepCalls); each
call is validated here as its unary RPC is, then queued on the model worker (specdec.runtime.worker),
which batches its forwards with every other session's, as it would the unary call's. Each result
goes back as soon as its call is done, those done together in one message (StepResults): a step of
the worker ends many calls at once, and they leave in one message.

Per call, as a unary call has them: its status (one session's error fails that call only, never
the stream), its deadline (StepCall.timeout, from when it is read), its cancellation (a StepCall
with `cancel`), and, with telemetry, a server span in the caller's trace and the server duration.
A stream that ends (the caller gone, the connection lost) cancels its calls still in flight, and
the sessions it opened or used and did not close count as unclaimed: closed after the unclaimed TTL unless
a request uses them again (a caller that reconnected), not after the idle TTL (a caller that died,
an orchestrator killed, would have held their slots and KV budget for minutes).

Owns the stream's bookkeeping; what a call does is the servicer's (`calls`: StepCall's oneof field
-> a StepMethod).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from specdec.errors import SpecdecError
from specdec.runtime.engine import SessionEngine
from specdec.runtime.worker import Item
from specdec.v1 import model_pb2

log = logging.getLogger("specdec")

_END = object()  # the reader's last word: no more calls will come


@dataclass(frozen=True)
class StepMethod:
    """What a step stream's call of one kind is: its unary method's name (telemetry), its request
    (checked, as the unary RPC checks it) as a worker item given its deadline, and the item's
    result as the response message (as it is, where the item returns one)."""

    name: str
    item: Callable[[object, float | None], Item]
    respond: Callable[[object], object] = lambda result: result


class StepStream:
    """One Steps stream: a reader thread that starts the calls, and the handler's generator
    (`serve`) that sends what finished."""

    def __init__(self, engine: SessionEngine, calls: dict[str, StepMethod], service: str, telemetry=None):
        self.engine = engine
        self.calls = calls
        self.service = service  # "specdec.v1.DraftService": the methods' full names, for telemetry
        self.telemetry = telemetry if telemetry is not None and telemetry.enabled else None
        self._ready: list[model_pb2.StepResult] = []  # finished, not yet handed to the sender
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # lists of StepResult, or _END
        self._live: dict[int, object] = {}  # id -> worker item, while in flight
        self._owed = 0  # calls read whose result is not sent yet
        self._ended = False  # the stream ended: calls read after its end are cancelled as they start
        self._opened: set[str] = set()  # sessions opened or used here, not closed here (disowned at the end)
        self._lock = threading.Lock()

    def serve(self, request_iterator, context) -> Iterator[model_pb2.StepResults]:
        """The handler: read calls on a thread of the stream's own, yield results as they finish."""
        context.add_callback(self._cancel_all)  # the stream ended, however: nothing left runs for it
        self.engine.worker.listen(self._flush)  # a step's results leave together
        reader = threading.Thread(target=self._read, args=(request_iterator,), name="specdec-steps", daemon=True)
        reader.start()
        ended = False
        try:
            while True:
                batch = [self._done.get()]
                while True:  # whatever else finished meanwhile goes in the same message
                    try:
                        batch.append(self._done.get_nowait())
                    except queue.Empty:
                        break
                ended = ended or any(r is _END for r in batch)
                results = [r for part in batch if part is not _END for r in part]
                if results:
                    yield model_pb2.StepResults(results=results)
                with self._lock:
                    self._owed -= len(results)
                    # the caller sends no more: done once what it is owed is sent, or at once if it is gone
                    if ended and (not self._owed or not context.is_active()):
                        return
        finally:
            self.engine.worker.listen(self._flush, on=False)

    def _flush(self) -> None:
        """Hand what finished to the sender, in one piece (on the worker thread after each step)."""
        with self._lock:
            ready, self._ready = self._ready, []
        if ready:
            self._done.put(ready)

    # -- calls ---------------------------------------------------------------------------
    def _read(self, request_iterator) -> None:
        try:
            for message in request_iterator:
                self._start([call for call in message.calls if not call.cancel])
                for call in message.calls:
                    if call.cancel:
                        self._cancel(call.id)
                self._flush()  # the calls refused at once
        except Exception:  # noqa: BLE001 - the stream broke: its end is handled by _cancel_all
            pass
        finally:
            self._done.put(_END)

    def _start(self, calls: list[model_pb2.StepCall]) -> None:
        """Validate a message's calls and queue them on the worker together (its next step takes
        them all); a call refused here gets its error at once."""
        queued = []
        for call in calls:
            started = time.perf_counter()
            kind = call.WhichOneof("call")
            method = self.calls.get(kind)
            request = getattr(call, kind) if kind else None
            span = None
            if self.telemetry is not None:
                name = method.name if method else kind or "unset"
                span = self.telemetry.step_server(f"/{self.service}/{name}", dict(call.trace), request)
            try:
                if method is None:
                    raise _Unimplemented(f"{self.service} takes no {kind or 'empty'} call on its step stream")
                deadline = time.monotonic() + call.timeout if call.timeout > 0 else None
                with span.current() if span is not None else contextlib.nullcontext():
                    item = method.item(request, deadline)  # in the span: its forwards join it
            except Exception as err:  # noqa: BLE001 - the call's own error, as its unary RPC returns it
                with self._lock:
                    self._owed += 1
                self._finish(call.id, kind, started, span, None, err)
                continue
            queued.append((call.id, kind, started, span, item))
        with self._lock:
            self._owed += len(queued)
            for call_id, *_, item in queued:
                self._live[call_id] = item
        try:
            self.engine.worker.submit_all([item for *_, item in queued])
        except Exception as err:  # noqa: BLE001 - the worker stopped: every call gets its error
            for call_id, kind, started, span, _ in queued:
                self._finish(call_id, kind, started, span, None, err)
            return
        for call_id, kind, started, span, item in queued:
            item.future.add_done_callback(lambda _, a=(call_id, kind, started, span, item): self._finish(*a, None))
        with self._lock:
            ended = self._ended
        if ended:  # read from the socket before the end was known (a process stopped, then woken)
            self._cancel_items([item for *_, item in queued])

    def _finish(self, call_id: int, kind: str, started: float, span, item, error) -> None:
        """Send a call's outcome: `error`, or its item's. A call cancelled or past its deadline
        while its forward ran ends as its unary call would have (CANCELLED, DEADLINE_EXCEEDED),
        whatever the forward did to its session."""
        with self._lock:
            self._live.pop(call_id, None)
        if error is None:
            error = item.future.exception() or item.dropped(time.monotonic())
        seconds = time.perf_counter() - started
        result = model_pb2.StepResult(id=call_id, server_seconds=seconds)
        code = grpc.StatusCode.OK
        if error is None:
            getattr(result, kind).CopyFrom(self.calls[kind].respond(item.future.result()))
        else:
            code, details = _status(error)
            result.code, result.details = code.value[0], details
        if span is not None:
            span.end(seconds, code)
        with self._lock:
            self._ready.append(result)
            if item is not None and kind == "close_session":
                self._opened.discard(item.key)
            elif item is not None and code is grpc.StatusCode.OK:  # opened or used here (a unary open too:
                self._opened.add(item.key)  # a constrained session's), by the session's id

    def _cancel(self, call_id: int) -> None:
        with self._lock:
            item = self._live.get(call_id)
        if item is not None:
            self.engine.worker.cancel(item)

    def _cancel_all(self) -> None:
        with self._lock:
            self._ended = True
            items = list(self._live.values())
            opened = list(self._opened)
        self._cancel_items(items)
        with contextlib.suppress(Exception):  # a worker already stopped: nothing left to reap
            self.engine.disown(opened)

    def _cancel_items(self, items) -> None:
        """Cancel calls whose caller is gone; not a close, which still frees its session (as
        specdec.serving.service's CloseSession, whose caller may have stopped waiting)."""
        for item in items:
            if not item.final:
                self.engine.worker.cancel(item)


class _Unimplemented(SpecdecError):
    code = grpc.StatusCode.UNIMPLEMENTED


def _status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """A call's error as the status its unary RPC would end with (specdec.serving.service's interceptor)."""
    if isinstance(error, SpecdecError):
        return error.code, error.message
    log.error("a step stream's call failed", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"
