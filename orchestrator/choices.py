"""A request's n choices (OpenAI's `n`) on the orchestrator's gRPC API, for the HTTP front door.

Owns: starting the n generations so that they share one prefill, cancelling them together, and
gathering their answers (whole, or as one stream of (choice, chunk) in arrival order). Choice 0
starts alone; the others start once its first chunk is in (its prompt prefilled), so the services'
prefix caches (specdec.runtime.prefix) give them the prompt's keys and values instead of n prefills. Each
choice is a generation of its own (its seed: openai_json.choice_requests), and the n are admitted as
one (orchestrator.admission): choice 0's call asks room for all n, so a full server refuses the
request before any chunk, and the others' calls take the places it holds. Knows nothing of HTTP or
of OpenAI's JSON.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc

from orchestrator.admission import group_metadata
from orchestrator.openai_json import assemble
from specdec.v1 import orchestrator_pb2


class Choices:
    """The n generation streams of one request (blocking calls: run them off the event loop)."""

    def __init__(self, stub, requests: list[orchestrator_pb2.GenerateRequest], metadata=()):
        self.stub, self.requests, self.metadata = stub, requests, metadata
        self._group = group_metadata(len(requests))  # choice 0's, the others'
        self.streams: list = []
        self._lock = threading.Lock()
        self._cancelled = False

    def _start(self, i: int):
        with self._lock:
            metadata = (*self.metadata, *self._group[i > 0])
            call = self.stub.GenerateStream(self.requests[i], metadata=metadata)
            self.streams.append(call)
            if self._cancelled:  # cancelled while this one was being started
                call.cancel()
        return call

    def cancel(self) -> None:
        """Cancel every choice's call (the orchestrator closes their sessions at their next round)."""
        with self._lock:
            self._cancelled = True
            calls = list(self.streams)
        for call in calls:
            call.cancel()

    def first(self) -> orchestrator_pb2.GenerateChunk | None:
        """Choice 0's first chunk, then the other choices started; a refusal of choice 0 (for room:
        the whole request's) raises here (grpc.RpcError), before any other starts."""
        chunk = next(self._start(0), None)
        for i in range(1, len(self.requests)):
            self._start(i)
        return chunk

    def answers(self, first: orchestrator_pb2.GenerateChunk | None) -> list[orchestrator_pb2.GenerateResponse]:
        """Every choice's whole answer, in order (after first()); a choice's error raises."""
        out = []
        for i, stream in enumerate(list(self.streams)):
            chunks = [first] if i == 0 and first is not None else []
            out.append(assemble(chunks + list(stream)))
        return out

    def merged(self) -> Iterator[tuple[int, orchestrator_pb2.GenerateChunk | grpc.RpcError | None]]:
        """The chunks of every choice after choice 0's first (after first()), as they arrive:
        (choice, chunk), (choice, None) at a choice's end, (choice, the error) where one fails."""
        arrived: queue.Queue = queue.Queue()

        def pump(i: int, stream) -> None:
            try:
                for chunk in stream:
                    arrived.put((i, chunk))
                arrived.put((i, None))
            except grpc.RpcError as err:
                arrived.put((i, err))

        for i, stream in enumerate(list(self.streams)):
            threading.Thread(target=pump, args=(i, stream), daemon=True, name=f"choice-{i}").start()
        for _ in range(len(self.streams)):
            while True:
                i, item = arrived.get()
                yield i, item
                if item is None or isinstance(item, grpc.RpcError):
                    break
