"""The orchestrator's scheduler (orchestrator.scheduler): generations as tasks on one thread, and the
calls its tasks make while others run leave as one message on a step stream.

Tasks take turns where they wait (a future, work offloaded to a thread), not in any
order of threads; a future's result, error and timeout reach the task that waits; a stream of
items reaches the calling thread in order, with its error; and a step's calls from 32 tasks reach
a real gRPC Steps handler on loopback as one message.
"""

from __future__ import annotations

import concurrent.futures
import threading
from concurrent import futures

import grpc
import pytest

from orchestrator import scheduler
from orchestrator.scheduler import SCHEDULER, Continuations
from orchestrator.step_link import StepLink
from specdec.v1 import model_pb2


def later(seconds: float, value=None) -> concurrent.futures.Future:
    """A future another thread sets after `seconds`."""
    future = concurrent.futures.Future()
    threading.Timer(seconds, future.set_result, args=(value,)).start()
    return future


def test_tasks_take_turns_where_they_wait():
    events: list[str] = []

    def task(name: str) -> str:
        events.append(f"{name} starts")
        scheduler.result(later(0.05))
        events.append(f"{name} ends")
        return name

    def both() -> list[str]:
        a, b = SCHEDULER.spawn(task, "a"), SCHEDULER.spawn(task, "b")
        return [a.result(), b.result()]

    assert SCHEDULER.run(both) == ["a", "b"]
    # b started while a paused: one thread, and neither blocked it
    assert events.index("b starts") < events.index("a ends")
    assert not scheduler.in_task()


def test_a_task_waits_for_a_future_set_on_another_thread_and_sees_its_error_and_timeout():
    def wait_for(future, timeout=None):
        return scheduler.result(future, timeout)

    assert SCHEDULER.run(wait_for, later(0.05, 42)) == 42

    failed = concurrent.futures.Future()
    threading.Timer(0.05, failed.set_exception, args=(ValueError("no"),)).start()
    with pytest.raises(ValueError, match="no"):
        SCHEDULER.run(wait_for, failed)

    with pytest.raises(concurrent.futures.TimeoutError):
        SCHEDULER.run(wait_for, concurrent.futures.Future(), 0.05)


def test_continuations_are_tasks_in_a_task_and_threads_outside():
    pool = Continuations(max_workers=2)

    def where() -> str:
        return "task" if scheduler.in_task() else threading.current_thread().name

    assert SCHEDULER.run(lambda: pool.submit(where).result()) == "task"
    assert pool.submit(where).result().startswith("specdec-continuation")


def test_offloaded_work_runs_on_a_thread_while_the_tasks_run():
    release = threading.Event()
    seen: list[str] = []

    def blocking() -> str:
        assert release.wait(5)  # a task would block every task here
        return threading.current_thread().name

    def other() -> None:
        seen.append("other ran")
        release.set()

    def main() -> str:
        SCHEDULER.spawn(other)
        return scheduler.offload(blocking)

    assert SCHEDULER.run(main).startswith("specdec-offload")
    assert seen == ["other ran"]


def test_a_stream_reaches_the_caller_in_order_with_its_error():
    assert list(SCHEDULER.iterate(lambda: iter(range(5)))) == [0, 1, 2, 3, 4]

    def failing():
        yield 1
        raise RuntimeError("mid-stream")

    got = []
    with pytest.raises(RuntimeError, match="mid-stream"):
        for item in SCHEDULER.iterate(failing):
            got.append(item)
    assert got == [1]


def test_closing_a_stream_early_closes_the_tasks_source():
    closed = threading.Event()

    def source():
        try:
            for i in range(1000):
                scheduler.result(later(0.001))
                yield i
        finally:
            closed.set()

    stream = SCHEDULER.iterate(source)
    assert next(stream) == 0
    stream.close()
    assert closed.wait(5)


class _Steps:
    """A Steps handler on loopback that answers every call at once and records each message's size."""

    def __init__(self):
        self.sizes: list[int] = []

    def steps(self, messages, context):
        for message in messages:
            self.sizes.append(len(message.calls))
            results = [
                model_pb2.StepResult(id=c.id, score=model_pb2.ScoreResponse(length=c.score.session.expected_length))
                for c in message.calls
            ]
            yield model_pb2.StepResults(results=results)


def serve_steps(handler: _Steps) -> tuple[grpc.Server, int]:
    """`handler` as the Steps method of service "test.Steps", on loopback: (server, port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    method = grpc.stream_stream_rpc_method_handler(
        handler.steps,
        request_deserializer=model_pb2.StepCalls.FromString,
        response_serializer=model_pb2.StepResults.SerializeToString,
    )
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Steps", {"Steps": method})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_the_calls_of_a_step_leave_as_one_message():
    handler = _Steps()
    server, port = serve_steps(handler)
    link = StepLink(grpc.insecure_channel(f"127.0.0.1:{port}"), "test.Steps")
    try:

        def session(i: int) -> list[int]:
            lengths = []
            for step in range(3):
                ref = model_pb2.SessionRef(session_id=f"s{i}", expected_length=100 * step + i)
                request = model_pb2.ScoreRequest(session=ref)
                lengths.append(link.future("Score", "score", request, timeout=10).result().length)
            return lengths

        def sessions() -> list[list[int]]:
            tasks = [SCHEDULER.spawn(session, i) for i in range(32)]
            return [t.result() for t in tasks]

        assert SCHEDULER.run(sessions) == [[i, 100 + i, 200 + i] for i in range(32)]
        assert handler.sizes == [32, 32, 32]  # each step: every session's call in one message
    finally:
        link.close()
        server.stop(None)
