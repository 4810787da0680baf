"""OpenAI's `n` (orchestrator.choices): n choices of one request over the HTTP API, through the three
services with the tiny models.

- a seed gives the same n texts again, choice 0 is the request with n = 1, and the choices differ
  (each its own randomness); usage counts the prompt once and every choice's tokens;
- the n choices share one prefill: the target's prefix cache serves the other n - 1 prompts;
- streamed, each choice's chunks carry its index and join to the text the unary answer gives;
- n out of 1..16 is a 400 naming it;
- the n choices are admitted as one (orchestrator.admission): without room for all n the request is a
  429 before any output, streamed or not, and leaves nothing held; with room (slots and queue), all n
  come back, the places held for choices 1..n-1 kept from other requests until they come.
"""

from __future__ import annotations

import time

import openai
import pytest

from orchestrator import admission as group_admission
from orchestrator.admission import GroupAdmission, group_metadata
from specdec.errors import Cancelled, ResourceExhausted
from specdec.limits import AdmissionLimits
from specdec.v1 import model_pb2
from tests.harness import slow_pipeline
from tests.test_openai_api import MODEL, client_for, http_json, http_pipeline, long_stream, start_http

PROMPT = "the cat sat on the mat and the dog sat on the log; " * 2  # 104 tokens: 6 blocks of the prefix cache


@pytest.fixture(scope="module")
def stack(tiny_backends):
    with http_pipeline(tiny_backends["draft"], tiny_backends["target"]) as both:
        yield both


def hits(p) -> int:
    return p.target.Describe(model_pb2.DescribeRequest()).prefix_cache.hits


def test_n_choices_of_a_seed_are_its_texts_again_and_share_one_prefill(stack):
    p, http = stack
    client = client_for(http)
    ask = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 21}
    before = hits(p)
    four = client.completions.create(n=4, **ask)
    assert hits(p) - before >= 3  # the other three prompts came from the first one's cache
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    texts = [c.text for c in four.choices]
    assert len(set(texts)) > 1  # each choice its own draws
    assert [c.text for c in client.completions.create(n=4, **ask).choices] == texts
    assert client.completions.create(**ask).choices[0].text == texts[0]
    one = client.completions.create(**{**ask, "seed": 23})
    assert one.choices[0].text == texts[2]  # choice i is seed + i
    assert four.usage.completion_tokens == sum(
        client.completions.create(**{**ask, "seed": 21 + i}).usage.completion_tokens for i in range(4)
    )
    assert four.usage.prompt_tokens == one.usage.prompt_tokens


def test_streamed_choices_carry_their_index_and_join_to_the_unary_texts(stack):
    _, http = stack
    client = client_for(http)
    messages = [{"role": "user", "content": "hello there"}]
    ask = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 3}
    whole = client.chat.completions.create(**ask)
    parts, finished, usage = ["", "", ""], set(), None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert parts == [c.message.content for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("n", [0, 17, "two"])
def test_n_out_of_range_is_a_400_naming_it(stack, n):
    _, http = stack
    status, reply = http_json(f"{http.url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "n": n})
    assert (status, reply["error"]["param"]) == (400, "n")


# -- admitted as one -----------------------------------------------------------------------
def opened_prompt_tokens(p) -> int:
    """Prompt tokens of the sessions the target opened: what a generation admitted costs first."""
    return p.target.Describe(model_pb2.DescribeRequest()).prefix_cache.prompt_tokens


def finished_choices(client, stream: bool, **ask) -> list[int]:
    """The indices of the choices that came back whole (finish_reason), streamed or not."""
    if not stream:
        return sorted(c.index for c in client.completions.create(**ask).choices if c.finish_reason)
    return sorted(
        c.index for chunk in client.completions.create(stream=True, **ask) for c in chunk.choices if c.finish_reason
    )


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_n_choices_are_admitted_whole_or_refused_before_any_output(tiny_backends, stream):
    """Choice 0 was admitted alone and a later choice refused for room: a 429 once choice 0 had
    generated, or, streamed, a 200 whose choice-0 chunks ended in an error event. Now choice 0's call
    asks room for all n: 3 places (2 slots, 1 queued), one taken by a long stream, refuse n = 3 before
    anything is generated and hold nothing; n = 2 comes back whole (one choice queued), and n = 3
    once the stream is closed."""
    with slow_pipeline(tiny_backends, admission=AdmissionLimits(max_concurrent=2, max_queue=1)) as p:
        http = start_http(p)
        client, admission = client_for(http), p.servers["orchestrator"].gate.admission
        ask = {"model": MODEL, "prompt": "hello there", "max_tokens": 6, "temperature": 1.0, "seed": 3}
        try:
            running = long_stream(client)
            next(iter(running))
            opened = opened_prompt_tokens(p)
            with pytest.raises(openai.RateLimitError) as err:
                finished_choices(client, stream, n=3, **ask)
            assert opened_prompt_tokens(p) == opened  # no choice was started
            assert "3 choices need 3 places and 2 are free" in err.value.message
            assert (admission.running, admission.waiting, admission.reserved) == (1, 0, 0)
            assert finished_choices(client, stream, n=2, **ask) == [0, 1]
            running.close()
            assert p.sessions_freed_within(10)
            assert finished_choices(client, stream, n=3, **ask) == [0, 1, 2]
            assert (admission.running, admission.waiting, admission.reserved) == (0, 0, 0)
        finally:
            http.stop()


class Call:
    """A call's context as admission sees it: its metadata, and whether it is still wanted."""

    def __init__(self, metadata=()):
        self.metadata, self.active = tuple(metadata), True

    def invocation_metadata(self):
        return self.metadata

    def add_callback(self, callback) -> None:
        pass

    def is_active(self) -> bool:
        return self.active


def test_a_groups_places_are_held_for_its_choices_and_freed_when_its_first_fails():
    """Choice 0 of 3 holds two places: another request is refused while they are held, the other
    choices take them without a check of room; choice 0 failing frees what is left."""
    admission = GroupAdmission(AdmissionLimits(max_concurrent=3, max_queue=0))
    first, others = group_metadata(3)
    with pytest.raises(RuntimeError), admission.slot(Call(first)):
        assert (admission.running, admission.reserved) == (1, 2)
        with pytest.raises(ResourceExhausted, match="2 places held for the choices of requests admitted"):
            admission.slot(Call()).__enter__()
        with admission.slot(Call(others)):
            assert (admission.running, admission.reserved) == (2, 1)
        raise RuntimeError("choice 0 failed")
    assert (admission.running, admission.reserved, admission.refused) == (0, 0, 1)
    with admission.slot(Call()), admission.slot(Call()), admission.slot(Call()):
        assert admission.running == 3


def test_a_groups_places_outlive_its_first_for_a_while_and_a_refusal_holds_none(monkeypatch):
    """Choice 0 may end before the others' calls come (a short answer): its places stay held for
    them, until HOLD_SECONDS pass. A group larger than the room is refused and holds nothing, and one
    that leaves the queue (cancelled) frees its places."""
    admission = GroupAdmission(AdmissionLimits(max_concurrent=2, max_queue=0))
    first, others = group_metadata(2)
    with admission.slot(Call(first)):
        pass
    assert admission.reserved == 1
    with admission.slot(Call()):
        with pytest.raises(ResourceExhausted):
            admission.slot(Call()).__enter__()
        with admission.slot(Call(others)):
            assert (admission.running, admission.reserved) == (2, 0)
    with pytest.raises(ResourceExhausted, match="3 choices are more than this server admits at once"):
        admission.slot(Call(group_metadata(3)[0])).__enter__()
    monkeypatch.setattr(group_admission, "HOLD_SECONDS", 0.01)
    with admission.slot(Call(group_metadata(2)[0])):
        pass
    time.sleep(0.05)
    with admission.slot(Call()), admission.slot(Call()):  # the place not taken went back
        assert admission.reserved == 0
    queue = GroupAdmission(AdmissionLimits(max_concurrent=1, max_queue=2))
    with queue.slot(Call()):
        waiting = Call(group_metadata(2)[0])
        waiting.active = False  # its client went away while it waited for a slot
        with pytest.raises(Cancelled):
            queue.slot(waiting).__enter__()
        assert (queue.running, queue.waiting, queue.reserved) == (1, 0, 0)
