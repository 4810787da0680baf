"""A generation lost mid-stream and finished on another orchestrator (orchestrator.continuation),
in process: the tiny models' services on loopback, two orchestrator views of them (ModelPairs
connected separately), and a door (ResumingServicer) whose first stream breaks after a given
number of chunks:
- greedy: the tokens, the text and the token counts are those of an uninterrupted run, through
  Generate and GenerateStream, and a stream repeats no token;
- a stop string that straddles the break still stops the text where it would have;
- sampled under the invariant rule with a seed: the same sample;
- a loss that never ends is UNAVAILABLE once the policy's wait is over; an error of the request
  itself (a bad argument) is not retried.
"""

from __future__ import annotations

import grpc
import pytest

from orchestrator import continuation
from orchestrator.server import connect
from specdec.errors import InvalidArgument, Unavailable
from specdec.limits import ResumePolicy
from specdec.v1 import model_pb2, orchestrator_pb2
from tests.harness import NO_EOS_PROMPT, pipeline


class Lost(Exception):
    """The orchestrator running a stream went away."""


@pytest.fixture(scope="module")
def pairs(tiny_backends):
    with pipeline(tiny_backends["draft"], tiny_backends["target"]) as p:
        yield [connect(p.addresses["draft"], p.addresses["target"]) for _ in range(2)]


class Door:
    """A ResumingServicer over `pairs`: the first stream breaks after `break_after` chunks (None: never)."""

    def __init__(self, pairs, break_after: int | None, losses: int = 1):
        self.pairs = pairs
        self.break_after = break_after
        self.losses = losses  # streams that break
        self.opened: list[continuation.Resume | None] = []
        self.servicer = continuation.ResumingServicer(
            self.open, lambda err: isinstance(err, Lost), ResumePolicy(0.35, first_backoff=0.1)
        )

    def open(self, request, resume, timeout):
        self.opened.append(resume)
        n = len(self.opened)
        chunks = continuation.stream(self.pairs[n % 2], request, resume, continuation.CallContext(timeout))
        for i, chunk in enumerate(chunks):
            if n <= self.losses and self.break_after is not None and i == self.break_after:
                chunks.close()
                raise Lost(f"stream {n} lost after {i} chunks")
            yield chunk

    def stream(self, request) -> list[orchestrator_pb2.GenerateChunk]:
        return list(self.servicer.GenerateStream(request, continuation.CallContext()))

    def generate(self, request) -> orchestrator_pb2.GenerateResponse:
        return self.servicer.Generate(request, continuation.CallContext())


def request(**kw) -> orchestrator_pb2.GenerateRequest:
    kw.setdefault("max_new_tokens", 60)
    kw.setdefault("speculation", orchestrator_pb2.SpeculationParams(lookahead=2))
    if "prompt" not in kw:
        kw["token_ids"] = orchestrator_pb2.TokenIds(ids=NO_EOS_PROMPT)
    return orchestrator_pb2.GenerateRequest(**kw)


def assert_same(resumed: orchestrator_pb2.GenerateResponse, whole: orchestrator_pb2.GenerateResponse):
    assert list(resumed.token_ids) == list(whole.token_ids)
    assert resumed.text == whole.text and resumed.finish_reason == whole.finish_reason
    assert resumed.stats.generated_tokens == whole.stats.generated_tokens == len(whole.token_ids)
    assert resumed.stats.prompt_tokens == whole.stats.prompt_tokens


def breaks(chunks: list) -> list[int]:
    """Where a test breaks a stream of these chunks: before the first, early, midway (a loss after
    the last chunk loses nothing: it ends the request). Rounds, and so chunks, follow the draft's
    timing (its session opens beside the first rounds): a break point must exist in every run."""
    return sorted({0, 1, 2, len(chunks) // 2})


def test_greedy_generation_resumed_after_a_break_is_the_uninterrupted_one(pairs):
    req = request()
    whole = Door(pairs, None).stream(req)
    expected = [t for c in whole for t in c.token_ids]
    assert len(whole) > 5
    for n in breaks(whole):
        door = Door(pairs, n)
        chunks = door.stream(req)
        assert [t for c in chunks for t in c.token_ids] == expected, f"broken after {n} chunks"
        assert "".join(c.text for c in chunks) == "".join(c.text for c in whole)
        assert door.servicer.resumed == 1
        sent = sum(len(c.token_ids) for c in chunks[:n])  # those of the lost stream; none: afresh
        assert (door.opened[1] is None) if n == 0 else len(door.opened[1].token_ids) == sent
        assert chunks[-1].stats.generated_tokens == len(expected) and chunks[-1].stats.rounds > 0
    assert_same(Door(pairs, 2).generate(req), Door(pairs, None).generate(req))


def test_a_stop_string_that_straddles_the_break_still_stops_there(pairs):
    text = Door(pairs, None).generate(request(prompt="hello world", max_new_tokens=48)).text
    stop = text[20:24]  # four characters: the door has held some back when the stream breaks
    req = request(prompt="hello world", max_new_tokens=48, stop_strings=[stop])
    req.speculation.lookahead = 1  # many small chunks: many break points
    whole = Door(pairs, None).generate(req)
    assert whole.finish_reason == "stop" and stop not in whole.text and len(whole.text) <= 20
    chunks = Door(pairs, None).stream(req)
    for n in range(len(chunks) - 1):  # every break: some fall inside the stop string
        assert_same(Door(pairs, n).generate(req), whole)


def test_a_seeded_sample_under_the_invariant_rule_is_the_same(pairs):
    req = request(
        sampling=model_pb2.SamplingParams(temperature=1.0),
        seed=7,
        speculation=orchestrator_pb2.SpeculationParams(lookahead=3, rule=orchestrator_pb2.RULE_INVARIANT),
    )
    whole = Door(pairs, None).generate(req)
    for n in (1, 4):
        assert_same(Door(pairs, n).generate(req), whole)


def test_losses_past_the_policy_are_unavailable_and_bad_requests_are_not_retried(pairs):
    door = Door(pairs, 1, losses=10)
    with pytest.raises(Unavailable, match="the generation was lost") as err:
        door.generate(request())
    # Tried again, each time continuing the lost stream, then gave up (the policy's 0.35 s) while the
    # door still broke streams; how many tries fit in 0.35 s is the clock's, not asserted.
    tries = len(door.opened)
    assert 2 <= tries <= door.losses and f"lost {tries} times" in err.value.message
    assert door.opened[0] is None and all(resume is not None for resume in door.opened[1:])
    assert door.servicer.resumed == tries - 1
    door = Door(pairs, 1)
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        door.generate(request(max_new_tokens=0))
    assert len(door.opened) == 1
    assert Unavailable.code == grpc.StatusCode.UNAVAILABLE
