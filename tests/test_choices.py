"""OpenAI's `n` (orchestrator.choices): n choices of one request over the HTTP API, through the three
services with the tiny models.

- a seed gives the same n texts again, choice 0 is the request with n = 1, and the choices differ
  (each its own randomness); usage counts the prompt once and every choice's tokens;
- the n choices share one prefill: the target's prefix cache serves the other n - 1 prompts;
- streamed, each choice's chunks carry its index and join to the text the unary answer gives;
- n out of 1..16 is a 400 naming it.
"""

from __future__ import annotations

import pytest

from specdec.v1 import model_pb2
from tests.test_openai_api import MODEL, client_for, http_json, http_pipeline

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
