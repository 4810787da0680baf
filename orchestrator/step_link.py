"""The step stream, orchestrator side: every generation's Propose, ProposalRow and Score calls to a
model service on one long-lived stream (`Steps`, served by specdec.serving.steps).

A generation still makes its calls one at a time and waits for each (orchestrator.loop), but none
of its Propose, ProposalRow, Score, OpenSession (but one with a grammar, compiled off the stream)
and CloseSession is an RPC of its own: calls queue in the link's outbox, and the stream's sender takes all that
queued since it last sent as one message (StepCalls). Under load the sender is busy while a step's
results fan out to their generations and their next calls come back, so the calls of a step leave
together; alone, a call leaves at once. A Python unary call costs 0.2-0.4 ms of CPU on each side
(docs/architecture.md, "A step on the wire"); here one message and one result message a step carry
every session's, and the service needs no thread a call.

Each call keeps what its unary RPC had: a deadline (sent with it, and kept here: past it the call
raises DEADLINE_EXCEEDED and is cancelled on the service), cancellation (a StepFuture's cancel), its
own status (StepError, a grpc.RpcError with code() and details(), as a failed unary call raises), a
client span and the time on the wire (specdec.serving.telemetry). A stream that breaks (the service died,
the connection dropped) fails its calls in flight with the stream's status (UNAVAILABLE), as the
unary calls would have failed; the next call opens a new stream.

On the target's link, with the pair's turns (orchestrator.turns), a Score may wait for the drafts due
back soon and leave with their Scores; the link times its messages for them.

`StepStub` is a stub class (for orchestrator.recovery.ResilientStub) whose step methods go over the
link and whose other methods stay unary. Owns the stream; knows nothing of rounds or the rule.
"""

from __future__ import annotations

import itertools
import threading
import time

import grpc

from orchestrator import scheduler
from orchestrator.turns import Turns
from specdec.v1 import model_pb2

# The calls each service takes on its step stream: stub method -> StepCall's oneof field. An
# OpenSession with a constraint stays unary: its grammar compiles off the stream.
SESSIONS = {"OpenSession": "open_session", "CloseSession": "close_session"}
TIMED = ("propose", "proposal_row", "score")  # the calls a pair's turns time (orchestrator.turns)
DRAFT_STEPS = {"Propose": "propose", "ProposalRow": "proposal_row", **SESSIONS}
TARGET_STEPS = {"Score": "score", **SESSIONS}


class StepError(grpc.RpcError, grpc.Call):
    """A step call's failure, as a failed unary call raises it (code(), details())."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self):
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback) -> bool:
        return False


_CODES = {code.value[0]: code for code in grpc.StatusCode}
_IDS = itertools.count(1)  # call ids, unique across links: a pair's turns key its flights by them


class StepFuture:
    """One call in flight: result(timeout) as a unary call's future gives it, cancel(), done()."""

    def __init__(self, link: StepLink, stream: _Stream, call_id: int, field: str, deadline: float | None, span=None):
        self._link, self.stream, self.id, self.field, self.deadline = link, stream, call_id, field, deadline
        self._span = span  # telemetry's StepCallSpan, or None
        self._started = time.perf_counter()
        # Held until the call is settled: waiting is acquiring it (a lock, not an Event: no
        # Condition to build a call, and one wake-up)
        self._unsettled = threading.Lock()
        self._unsettled.acquire()
        self._settled = False
        self._response = None
        self._error: StepError | None = None
        self._callbacks: list = []
        self._lock = threading.Lock()

    def result(self, timeout: float | None = None):
        """The response; raises StepError (DEADLINE_EXCEEDED past the call's deadline or `timeout`)."""
        if not self._settled:
            wait = self._left(timeout)
            if scheduler.in_task():  # a generation on the scheduler: the other tasks run meanwhile
                settled = scheduler.SCHEDULER.suspend(self, wait)
            elif self._unsettled.acquire(timeout=-1 if wait is None else wait):
                self._unsettled.release()  # for any other waiter
                settled = True
            else:
                settled = False
            if not settled:
                self._settle(None, StepError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), 0.0)
                self._link.cancel(self)
        if self._error is not None:
            raise self._error
        return self._response

    def exception(self, timeout: float | None = None):
        try:
            self.result(timeout)
        except StepError as err:
            return err
        return None

    def done(self) -> bool:
        return self._settled

    def cancelled(self) -> bool:
        return self._error is not None and self._error.code() == grpc.StatusCode.CANCELLED

    def running(self) -> bool:
        return not self.done()

    def cancel(self) -> bool:
        """Stop waiting and drop the call on the service (between its forwards); False once done."""
        if not self._settle(None, StepError(grpc.StatusCode.CANCELLED, "Locally cancelled"), 0.0):
            return False
        self._link.cancel(self)
        return True

    def add_done_callback(self, fn) -> None:
        with self._lock:
            if not self._settled:
                self._callbacks.append(fn)
                return
        fn(self)

    def _left(self, timeout: float | None) -> float | None:
        left = None if self.deadline is None else self.deadline - time.monotonic()
        waits = [t for t in (timeout, left) if t is not None]
        return max(0.0, min(waits)) if waits else None

    def _settle(self, response, error: StepError | None, server_seconds: float) -> bool:
        """Resolve once (the first of: the result, a stream's end, the deadline, cancel); True if this did."""
        with self._lock:
            if self._settled:
                return False
            self._response, self._error, self._settled = response, error, True
            self._unsettled.release()
            callbacks, self._callbacks = self._callbacks, []
        if self._span is not None:
            code = grpc.StatusCode.OK if error is None else error.code()
            self._span.end(time.perf_counter() - self._started, code, server_seconds)
        for fn in callbacks:
            fn(self)
        return True


class _Stream:
    """One Steps call: its outbox (sent by gRPC's thread through `_messages`), its calls in flight,
    and the thread that reads its results."""

    def __init__(self, link: StepLink):
        self.link = link
        self.outbox: list[model_pb2.StepCall] = []
        self.pending: dict[int, StepFuture] = {}
        self.closed = False
        self.call = link._open(self._messages())
        threading.Thread(target=self._read, name="specdec-step-link", daemon=True).start()

    def _messages(self):
        cond = self.link._cond
        while True:
            with cond:
                while not self.outbox and not self.closed:
                    cond.wait()
                if self.closed:
                    return
                calls, self.outbox = self.outbox, []
            yield model_pb2.StepCalls(calls=calls)

    def _read(self) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the step stream ended"
        try:
            for message in self.call:
                self.link.back([result.id for result in message.results])
                with scheduler.SCHEDULER.together():  # the tasks of a step wake together
                    for result in message.results:
                        self._resolve(result)
                self.link.step_ended()
        except grpc.RpcError as err:
            code, details = err.code(), err.details()
        with self.link._cond:
            self.closed = True
            if self.link._stream is self:
                self.link._stream = None
            pending, self.pending = self.pending, {}
            self.link._cond.notify_all()
            self.link.dropped(pending.values())
        if code == grpc.StatusCode.OK:  # the service ended it (it stopped): as a connection lost
            code = grpc.StatusCode.UNAVAILABLE
        for future in pending.values():
            future._settle(None, StepError(code, f"{details} ({self.link.service})"), 0.0)

    def _resolve(self, result: model_pb2.StepResult) -> None:
        with self.link._cond:
            future = self.pending.pop(result.id, None)
        if future is None:  # cancelled, or past its deadline, here first
            return
        if result.code:
            code = _CODES.get(result.code, grpc.StatusCode.UNKNOWN)
            future._settle(None, StepError(code, result.details), result.server_seconds)
        else:
            future._settle(getattr(result, future.field), None, result.server_seconds)


class StepLink:
    """The step stream to one model service (`service`: its full name), opened on first use and
    again after it breaks; shared by every generation on the pair."""

    def __init__(self, channel: grpc.Channel, service: str, telemetry=None, turns: Turns | None = None, side: str = ""):
        """`turns`: the pair's turn policy, this link its `side` ("draft" or "target": the target's
        Scores wait for their turn)."""
        self.service = service
        self._open = channel.stream_stream(
            f"/{service}/Steps",
            request_serializer=model_pb2.StepCalls.SerializeToString,
            response_deserializer=model_pb2.StepResults.FromString,
        )
        self.telemetry = telemetry if telemetry is not None and telemetry.enabled else None
        self._cond = threading.Condition()
        self._stream: _Stream | None = None
        # The tasks' calls until a flush sends them: (stream, call, its field, when it was made)
        self._held: list[tuple[_Stream, model_pb2.StepCall, str, float]] = []
        self._turns = turns
        self._flights = getattr(turns, side, None)  # this link's, when it has turns
        self._gated = side == "target" and turns is not None

    def future(self, method: str, field: str, request, timeout: float | None = None) -> StepFuture:
        span, carrier = None, None
        if self.telemetry is not None:
            span, carrier = self.telemetry.step_client(f"/{self.service}/{method}")
        call = model_pb2.StepCall(timeout=timeout or 0.0)
        if carrier:
            call.trace.update(carrier)
        getattr(call, field).CopyFrom(request)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._stream is None:
                self._stream = _Stream(self)
            stream = self._stream
            call.id = next(_IDS)
            future = StepFuture(self, stream, call.id, field, deadline, span)
            stream.pending[call.id] = future
            if scheduler.in_task():  # held, then sent with the step's other calls once no task is ready
                self._held.append((stream, call, field, time.monotonic()))
                scheduler.SCHEDULER.flush_later(self)
            else:
                stream.outbox.append(call)
                self._cond.notify_all()
        return future

    def flush(self) -> None:
        """Send what the scheduler's tasks queued, as one message (the scheduler's thread, or the
        reader's once the target's step ended); the target's Scores may wait for their turn."""
        until = None
        with self._cond:
            now = time.monotonic()
            held, self._held = self._held, []
            if self._gated:
                scores = [item for item in held if item[2] == "score"]
                if scores:
                    with self._turns.lock:
                        until = self._turns.hold_until(len(scores), now - scores[0][3], now)
                if until is not None and until > now:
                    self._held = scores
                    held = [item for item in held if item[2] != "score"]
                else:
                    until = None
                    if scores:
                        held, until = self._turn(held, scores, now)
            timed = []  # the calls the turns time: a continuation's Propose is not waited for
            for stream, call, field, _ in held:
                if not stream.closed:  # else its calls failed with it
                    stream.outbox.append(call)
                    if field in TIMED and not (field == "propose" and call.propose.assumed_tokens):
                        timed.append(call.id)
            if self._flights is not None and timed:
                with self._turns.lock:
                    self._flights.sent(timed, now)
            if held:
                self._cond.notify_all()
        if until is not None:
            scheduler.SCHEDULER.flush_at(self, until)

    def _turn(self, held: list, scores: list, now: float) -> tuple[list, float | None]:
        """The calls to send now: all but the Scores the pair's turns hold for the next turn (they
        wait in `_held`, decided again when this step ends, or a step from now at the latest); and
        when to decide again (None: nothing held)."""
        drafted = any(item[1].score.draft_token_ids for item in scores)
        with self._turns.lock:
            n = self._turns.leaving([item[1].score.session.session_id for item in scores], drafted)
            step = self._turns.target.latency
        if n == len(scores):
            return held, None
        self._held = scores[n:]
        later = {id(item) for item in self._held}
        return [item for item in held if id(item) not in later], now + step

    def back(self, ids: list[int]) -> None:
        """A message of results came for calls `ids` (its stream's reader, before they wake their tasks)."""
        if self._flights is not None:
            with self._turns.lock:
                self._flights.back(ids, time.monotonic())

    def dropped(self, futures) -> None:
        """Calls that will not come back (cancelled, or failed with their stream)."""
        if self._flights is not None:
            with self._turns.lock:
                self._flights.drop(future.id for future in futures)

    def step_ended(self) -> None:
        """A message of results came: Scores held for a turn leave, or wait on (its reader)."""
        if self._gated and self._held:
            self.flush()

    def cancel(self, future: StepFuture) -> None:
        """Forget `future` here and drop its call on the service; a call still held for the flush is
        never sent (its cancel would leave first, find nothing to cancel, and the call would run)."""
        with self._cond:
            stream = future.stream
            if stream.closed or stream.pending.pop(future.id, None) is None:
                return
            self.dropped([future])
            for i, (_, call, *_) in enumerate(self._held):
                if call.id == future.id:
                    del self._held[i]
                    return
            stream.outbox.append(model_pb2.StepCall(id=future.id, cancel=True))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            stream, self._stream = self._stream, None
            if stream is not None:
                stream.closed = True
                self._cond.notify_all()
        if stream is not None:
            stream.call.cancel()


class _StepMethod:
    """A stub method that goes over the link: called as a unary method, or .future() as its future;
    `unary`: the unary method, for the requests `stays_unary` names."""

    waits_in_tasks = True  # called in a scheduler task, it waits there (orchestrator.scheduler)

    def __init__(self, link: StepLink, method: str, field: str, unary=None, stays_unary=lambda request: False):
        self._link, self._method, self._field = link, method, field
        self._unary, self._stays_unary = unary, stays_unary

    def __call__(self, request, timeout: float | None = None, **kwargs):
        if self._stays_unary(request):
            return scheduler.call(self._unary, request, timeout=timeout, **kwargs)
        return self._link.future(self._method, self._field, request, timeout).result()

    def future(self, request, timeout: float | None = None, **kwargs):
        if self._stays_unary(request):
            return self._unary.future(request, timeout=timeout, **kwargs)
        return self._link.future(self._method, self._field, request, timeout)


def _constrained(request) -> bool:
    return isinstance(request, model_pb2.OpenSessionRequest) and request.HasField("constraint")


def step_stub(
    stub_class, service: str, steps: dict[str, str], telemetry=None, turns: Turns | None = None, side: str = ""
):
    """A stub class over a channel: the methods in `steps` (DRAFT_STEPS, TARGET_STEPS) go over the
    service's step stream, the others are `stub_class`'s unary ones; `turns` and `side` as StepLink's."""

    class StepStub:
        def __init__(self, channel: grpc.Channel):
            self._unary = stub_class(channel)
            self.link = StepLink(channel, service, telemetry, turns, side)
            for method, field in steps.items():
                unary = getattr(self._unary, method)
                setattr(self, method, _StepMethod(self.link, method, field, unary, _constrained))

        def __getattr__(self, name: str):
            return getattr(self._unary, name)

        def __del__(self):  # a stub replaced after a reconnect: its stream goes with it
            try:
                self.link.close()
            except Exception:  # noqa: BLE001, S110 - at interpreter exit, gRPC may be gone first
                pass

    return StepStub
