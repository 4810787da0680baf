"""The OpenAI-compatible HTTP API (orchestrator.openai_api) against the three services on
loopback, driven by the real `openai` package: the same text as the gRPC API, seeds, stop
strings, usage, streaming, every refused parameter, tokens, TLS, admission, drain, a body over
the limit, and clients that go away mid-stream or while a non-streaming request runs."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPConnection, HTTPResponse
from urllib.parse import urlsplit

import grpc
import openai
import pytest

from deploy.local import LocalPipeline, PipelineConfig
from orchestrator.openai_api import MAX_BODY_BYTES, serve_http
from orchestrator.openai_json import APIError, generate_request
from orchestrator.server import MAX_REQUEST_BYTES
from specdec.limits import AdmissionLimits
from specdec.runtime.standin import StandinBackend
from specdec.serving.security import ClientSecurity, SecurityError, ServerSecurity, ServerTLSFiles
from specdec.v1 import model_pb2, orchestrator_pb2
from specdec.weights.models import ModelSpec
from tests.certs import make_pki
from tests.harness import NO_EOS_PROMPT, pipeline, slow_pipeline, wait_until
from tests.otlp import OtlpReceiver

MODEL = "tiny-target"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
SERVICES = ("orchestrator", "draft", "target")


def start_http(p, **kw):
    kw.setdefault("server_security", ServerSecurity())
    return serve_http(p.addresses["orchestrator"], "127.0.0.1", 0, ClientSecurity(), model=MODEL, **kw)


@contextlib.contextmanager
def http_pipeline(draft_backend, target_backend):
    """The three services and the HTTP front door: (pipeline, HTTP server)."""
    with pipeline(draft_backend, target_backend) as p:
        http = start_http(p)
        try:
            yield p, http
        finally:
            http.stop()


@pytest.fixture(scope="module")
def stack(tiny_backends):
    with http_pipeline(tiny_backends["draft"], tiny_backends["target"]) as both:
        yield both


def client_for(http, api_key: str = "unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http.url}/v1", api_key=api_key, max_retries=0, **kw)


@pytest.fixture(scope="module")
def client(stack):
    return client_for(stack[1])


def grpc_messages() -> orchestrator_pb2.ChatMessages:
    return orchestrator_pb2.ChatMessages(messages=[orchestrator_pb2.ChatMessage(**m) for m in MESSAGES])


def http_json(url: str, body=None, token: str | None = None, context=None, timeout: float = 30) -> tuple[int, dict]:
    """(status, JSON body) of a GET (no body) or POST (a dict, or the bytes to send)."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# -- the same generation as the gRPC API -------------------------------------------------
@pytest.mark.usefixtures("draft_awaited")
def test_chat_greedy_text_equals_grpc(stack, client):
    p, _ = stack
    ref = p.orchestrator.Generate(orchestrator_pb2.GenerateRequest(messages=grpc_messages(), max_new_tokens=40))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.stats.prompt_tokens, len(ref.token_ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # its own rounds: how many ran before the draft's session was open is timing (greedy rounds do
    # not wait for it), so another request's count may differ
    assert r.specdec["rounds"] > 0 and 0 < r.specdec["accepted_tokens"] <= r.specdec["draft_tokens"]

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [ref.finish_reason]
    # One chunk per committed round; the spans cover each chunk's text and show accepted drafts.
    final = chunks[-1].specdec  # the stream's own statistics
    assert 1 < len(chunks) <= final["rounds"]
    spans = [s for c in chunks for s in c.specdec["spans"]]
    for c in chunks:
        assert sum(n for n, _ in c.specdec["spans"]) == len(c.choices[0].delta.content or "")
    assert any(drafted for _, drafted in spans) and not all(drafted for _, drafted in spans)
    assert sum(c.specdec["round_counts"]["rounds"] for c in chunks) == final["rounds"]
    assert sum(c.specdec["round_counts"]["accepted_tokens"] for c in chunks) == final["accepted_tokens"]


def test_completions_text_and_token_ids_equal_grpc(stack, client):
    p, _ = stack
    ref = p.orchestrator.Generate(orchestrator_pb2.GenerateRequest(prompt="hello", max_new_tokens=30))
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=30)
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids)

    ids = orchestrator_pb2.TokenIds(ids=NO_EOS_PROMPT)
    ref = p.orchestrator.Generate(orchestrator_pb2.GenerateRequest(token_ids=ids, max_new_tokens=50))
    r = client.completions.create(model=MODEL, prompt=NO_EOS_PROMPT, max_tokens=50, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(NO_EOS_PROMPT), 50)
    chunks = list(client.completions.create(model=MODEL, prompt=[NO_EOS_PROMPT], max_tokens=50, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text


def test_seed_reproduces_the_grpc_sample(stack, client):
    p, _ = stack
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=1.0, top_p=0.95)
    first = client.chat.completions.create(seed=1234, **kw)
    again = client.chat.completions.create(seed=1234, **kw)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.specdec["seed"] == 1234
    request = orchestrator_pb2.GenerateRequest(messages=grpc_messages(), max_new_tokens=40, seed=1234)
    request.sampling.temperature, request.sampling.top_p = 1.0, 0.95
    assert p.orchestrator.Generate(request).text == first.choices[0].message.content
    others = {client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert len(others) > 1  # the seed is used, not ignored


def test_the_invariant_rule_over_http_gives_the_target_alones_sample(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0.7, seed=99)

    def text(**speculation):
        reply = client.chat.completions.create(extra_body={"speculation": {"rule": "invariant", **speculation}}, **kw)
        return reply.choices[0].message.content

    alone = text(disabled=True)
    assert text(lookahead=3) == text(lookahead=8) == text(lookahead=6, adaptive=True) == alone


def test_stop_ends_the_text_before_the_stop_string(stack, client):
    p, _ = stack
    ids = orchestrator_pb2.TokenIds(ids=NO_EOS_PROMPT)
    full = p.orchestrator.Generate(orchestrator_pb2.GenerateRequest(token_ids=ids, max_new_tokens=60)).text
    stop = full[25:28]
    expected = full[: full.find(stop)]
    request = orchestrator_pb2.GenerateRequest(token_ids=ids, max_new_tokens=60, stop_strings=[stop, "@@"])
    ref = p.orchestrator.Generate(request)
    assert ref.text == expected
    r = client.completions.create(model=MODEL, prompt=NO_EOS_PROMPT, max_tokens=60, stop=[stop, "@@"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    assert r.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=NO_EOS_PROMPT, max_tokens=60, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # the logprobs cover the text, not the stop string's tokens past it (a character a token here)
    r = client.completions.create(model=MODEL, prompt=NO_EOS_PROMPT, max_tokens=60, stop=stop, logprobs=0)
    assert "".join(r.choices[0].logprobs.tokens) == expected
    assert r.choices[0].logprobs.text_offset == list(range(len(expected)))
    chunks = list(
        client.completions.create(model=MODEL, prompt=NO_EOS_PROMPT, max_tokens=60, stop=stop, logprobs=0, stream=True)
    )
    assert "".join(t for c in chunks for t in c.choices[0].logprobs.tokens) == expected


def test_include_usage_sends_the_usage_chunk(stack, client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=30)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.usage is None for c in client.chat.completions.create(stream=True, **kw))


def test_models_and_health(stack, client):
    _, http = stack
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    status, body = http_json(f"{http.url}/health")
    assert status == 200
    assert body == {"status": "ok", "services": dict.fromkeys(SERVICES, "SERVING")}


# -- refusals ----------------------------------------------------------------------------
BAD = [  # (endpoint, parameters, status, param)
    ("chat", {"n": 17}, 400, "n"),
    ("chat", {"presence_penalty": 2.5}, 400, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, 400, "frequency_penalty"),
    ("chat", {"frequency_penalty": "x"}, 400, "frequency_penalty"),
    ("chat", {"min_p": 1.5}, 400, "min_p"),
    ("chat", {"logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("chat", {"logit_bias": {"1": 101}}, 400, "logit_bias"),
    ("chat", {"logit_bias": {"999999": 1}}, 400, "logit_bias"),  # outside the vocabulary
    ("chat", {"logit_bias": [1]}, 400, "logit_bias"),
    ("chat", {"logprobs": "yes"}, 400, "logprobs"),
    ("completions", {"logprobs": 21}, 400, "logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools"),
    ("completions", {"tools": []}, 400, "tools"),  # chat only
    ("completions", {"best_of": 2}, 400, "best_of"),
    ("chat", {"repetition_penalty": 0}, 400, "repetition_penalty"),
    ("chat", {"temperature": -1}, 400, "temperature"),
    ("chat", {"temperature": 2.5}, 400, "temperature"),  # OpenAI's range is 0..2; gRPC takes more
    ("completions", {"temperature": float("nan")}, 400, "temperature"),
    ("chat", {"temperature": "hot"}, 400, "temperature"),
    ("chat", {"top_p": 1.5}, 400, "top_p"),
    ("chat", {"top_k": -1}, 400, "top_k"),
    ("chat", {"max_tokens": "ten"}, 400, "max_tokens"),
    ("chat", {"max_tokens": 10**9}, 400, "max_tokens"),  # the prompt fits, the prompt + max_tokens do not
    ("completions", {"max_tokens": 100000}, 400, "max_tokens"),
    ("chat", {"max_completion_tokens": 10**9}, 400, "max_completion_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "a" * 600}]}, 400, "messages"),  # itself beyond the context
    ("completions", {"prompt": "a" * 600}, 400, "prompt"),
    ("chat", {"seed": -1}, 400, "seed"),
    ("chat", {"stop": 5}, 400, "stop"),
    ("chat", {"stop": ["", "x"]}, 400, "stop"),  # refused by the orchestrator as stop_strings: named as sent
    ("chat", {"max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat", {"speculation": {"lookahead": 99}}, 400, "speculation.lookahead"),
    ("chat", {"speculation": {"depth": 2}}, 400, "speculation"),
    ("chat", {"speculation": {"rule": "gumbel"}}, 400, "speculation.rule"),
    ("chat", {"speculation": {"history": "no"}}, 400, "speculation.history"),
    ("chat", {"speculation": {"history_salt": 7}}, 400, "speculation.history_salt"),
    ("chat", {"speculation": {"history_salt": "x" * 300}}, 400, "speculation.history_salt"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("completions", {"prompt": [999999]}, 400, "prompt"),  # outside the vocabulary
    ("completions", {"prompt": ["one", "two"]}, 400, "prompt"),
    ("chat", {"prediction": "def f(): ..."}, 400, "prediction"),
    ("chat", {"prediction": {"type": "content", "content": 5}}, 400, "prediction.content"),
    ("chat", {"prediction": {"type": "content", "content": "zebra " * 1000}}, 400, "prediction"),  # past the context
    ("completions", {"prediction": {"type": "content", "content": "x"}}, 400, "prediction"),  # chat only
    ("chat", {"user": 5}, 400, "user"),
    ("chat", {"user": "u" * 300}, 400, "user"),  # it named speculation.history_salt, which the client never sent
    ("chat", {"model": "gpt-4o"}, 404, "model"),
]


@pytest.mark.parametrize("endpoint, params, status, param", BAD, ids=[f"{e}-{list(p)[0]}" for e, p, _, _ in BAD])
def test_bad_parameter_gets_its_status_and_names_it(stack, endpoint, params, status, param):
    _, http = stack
    body = {"model": MODEL, "max_tokens": 8}
    body.update({"messages": MESSAGES} if endpoint == "chat" else {"prompt": "hello"})
    body.update(params)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    got, reply = http_json(http.url + path, body)
    assert (got, reply["error"]["param"]) == (status, param), reply
    assert reply["error"]["message"] and reply["error"]["type"]
    assert set(reply["error"]) == {"message", "type", "param", "code"}


def test_a_path_or_method_the_api_does_not_serve_is_refused_in_openais_shape(stack):
    """Starlette's own 404 and 405 came as text/plain; a 404 of a path said model_not_found."""
    _, http = stack
    got, reply = http_json(http.url + "/v1/embeddings", {"model": MODEL, "input": "hi"})
    assert got == 404 and reply["error"] == {
        "message": "no such path: /v1/embeddings",
        "type": "not_found_error",
        "param": None,
        "code": None,
    }
    assert http_json(http.url + "/nope")[1]["error"]["code"] is None  # a page, not a model
    try:
        urllib.request.urlopen(http.url + "/v1/chat/completions", timeout=30)  # a GET
    except urllib.error.HTTPError as err:
        got, reply, allow = err.code, json.loads(err.read()), err.headers["Allow"]
    assert got == 405 and "GET is not allowed on /v1/chat/completions" in reply["error"]["message"]
    assert allow == "POST" and reply["error"]["type"] == "invalid_request_error"


def test_a_body_nested_too_deeply_is_a_400_in_openais_shape(stack):
    """JSON nested past the decoder's recursion limit, the whole body or a schema within it, was a
    plain-text 500 (RecursionError); the server serves on."""
    _, http = stack
    schema = b"[" * 100_000 + b"]" * 100_000
    deep = b'{"model": "%s", "messages": [], "response_format": {"type": "json_schema", "json_schema": {"schema": %s}}}'
    for body in (schema, deep % (MODEL.encode(), schema)):
        got, reply = http_json(http.url + "/v1/chat/completions", body)
        assert got == 400 and reply["error"]["message"] == "the request body is JSON nested too deeply", reply
        assert reply["error"]["type"] == "invalid_request_error"
    assert (
        http_json(http.url + "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": MESSAGES})[0] == 200
    )


def test_a_refused_value_is_shown_as_the_client_sent_it(stack):
    """The sampling fields are float32 on the wire: -0.1 comes back as -0.1, not -0.10000000149011612."""
    _, http = stack
    body = {"model": MODEL, "max_tokens": 8, "messages": MESSAGES, "min_p": -0.1}
    got, reply = http_json(http.url + "/v1/chat/completions", body)
    assert got == 400 and reply["error"]["message"] == "min_p must be in [0, 1] (0: off), got -0.1", reply


def test_a_model_services_refusal_names_the_parameter_not_the_rpc():
    """The target service refuses a grammar it cannot build (a stand-in model has no tokenizer); the
    orchestrator passes it on as "/specdec.v1.Orchestrator/Generate: downstream FAILED_PRECONDITION:
    constraint: ...", which came back over HTTP as is, with param null."""
    with http_pipeline(StandinBackend("standin:0:0.8"), StandinBackend("standin:0")) as (p, http):
        body = {"model": MODEL, "max_tokens": 8, "messages": MESSAGES, "response_format": {"type": "json_object"}}
        got, reply = http_json(http.url + "/v1/chat/completions", body)
        assert got == 400 and reply["error"]["param"] == "response_format", reply
        assert reply["error"]["message"].startswith("response_format: the model 'standin:0' has no tokenizer"), reply
        assert p.sessions_freed_within(10)


def test_user_salts_the_history_and_speculation_turns_it_off():
    """OpenAI's `user` (an end user's id) is the request's history salt: end users of one key never
    draft from each other's answers; speculation.history false opts a request out."""
    body = {"model": MODEL, "messages": MESSAGES, "user": "u-17"}
    request, _ = generate_request(body, "chat", MODEL)
    assert request.speculation.history_salt == "u-17" and not request.speculation.HasField("history")
    body["speculation"] = {"history": False, "history_salt": "mine"}
    request, _ = generate_request(body, "chat", MODEL)
    assert request.speculation.history_salt == "mine" and request.speculation.history is False


@pytest.mark.usefixtures("draft_awaited")
def test_a_prediction_is_taken_and_changes_no_token(stack, client):
    """OpenAI's predicted outputs: `prediction` (a string or text parts) is the request's
    SpeculationParams.prediction, which the draft's index searches; the text is the one without."""
    p, _ = stack
    ref = p.orchestrator.Generate(orchestrator_pb2.GenerateRequest(messages=grpc_messages(), max_new_tokens=40))
    for content in (ref.text, [{"type": "text", "text": ref.text}]):
        r = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=40,
            temperature=0,
            prediction={"type": "content", "content": content},
        )
        assert r.choices[0].message.content == ref.text
    parts = [{"type": "text", "text": "def f():"}, {"type": "text", "text": " pass"}]
    body = {"model": MODEL, "messages": MESSAGES, "prediction": {"type": "content", "content": parts}}
    request, _ = generate_request(body, "chat", MODEL)
    assert request.speculation.prediction == "def f(): pass"


def test_temperature_2_is_the_http_limit_and_grpc_keeps_its_own_range(stack, client):
    p, _ = stack
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=2)
    assert r.choices[0].finish_reason in ("length", "stop")  # accepted (a first EOS, unseeded, may end it at 0 tokens)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=2.5)
    assert err.value.param == "temperature" and "[0, 2]" in err.value.body["message"]
    request = orchestrator_pb2.GenerateRequest(prompt="hello", max_new_tokens=4)
    request.sampling.temperature = 2.5
    assert p.orchestrator.Generate(request).finish_reason in ("length", "stop")  # not refused (a first EOS may end it)


def test_max_tokens_beyond_the_context_names_max_tokens_and_says_what_fits(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=10**9)
    assert err.value.param == "max_tokens"
    assert err.value.body["message"].startswith("max_tokens 1000000000 + a prompt of")
    assert "at most" in err.value.body["message"]


def test_max_tokens_unset_takes_the_room_the_context_leaves(stack, client):
    """Unset, max_tokens is 128 or the room past the prompt where that is less: a prompt 10 tokens
    short of the context was refused ("max_tokens 128 + a prompt of ..."), naming a value the
    client never sent."""
    p, _ = stack
    context = p.target.Describe(model_pb2.DescribeRequest(), timeout=10).max_context
    prompt = [(7 + i) % 30 + 10 for i in range(context - 10)]
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0)
    assert r.usage.completion_tokens <= 10 and (r.usage.completion_tokens == 10 or r.choices[0].finish_reason == "stop")


def test_the_sdk_raises_the_matching_errors(client):
    with pytest.raises(openai.BadRequestError) as err:  # refused by the gRPC API, named as OpenAI names it
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_p=1.5)
    assert err.value.param == "top_p" and err.value.message.startswith("Error code: 400")
    assert err.value.body["message"].startswith("top_p must be in (0, 1]")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")


def test_token_is_required_on_every_route_but_health(stack):
    p, _ = stack
    http = start_http(p, server_security=ServerSecurity(token="s3cret"))
    try:
        routes = [
            ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}),
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}),
            ("/v1/models", None),
            ("/v1/no-such-route", None),
            ("/no-such-page", None),
        ]
        for path, body in routes:
            for token in (None, "wrong", "s3cre"):
                status, reply = http_json(http.url + path, body, token)
                assert (status, reply["error"]["type"]) == (401, "authentication_error"), (path, token)
        assert http_json(http.url + "/health")[0] == 200
        for page in ("/", "/playground.js"):  # static; the page sends the token it is given
            with urllib.request.urlopen(http.url + page, timeout=10) as response:
                assert response.status == 200 and response.read()
        for path, body in routes[:3]:
            assert http_json(http.url + path, body, "s3cret")[0] == 200
        with pytest.raises(openai.AuthenticationError):
            client_for(http, "wrong").models.list()
        assert client_for(http, "s3cret").completions.create(model=MODEL, prompt="hi", max_tokens=4).choices
    finally:
        http.stop()


def test_tls_with_the_same_certificate_files_and_plaintext_only_on_loopback(stack, tmp_path):
    p, _ = stack
    pki = make_pki(tmp_path, "http")
    tls = ServerSecurity(cert_chain=pki.read("server_cert"), private_key=pki.read("server_key"), token="t0k")
    http = start_http(p, server_security=tls)
    try:
        assert http.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(pki.ca))
        assert http_json(http.url + "/v1/models", token="t0k", context=context)[0] == 200
        with pytest.raises(urllib.error.URLError):  # a client that does not trust the CA
            http_json(http.url + "/health", context=ssl.create_default_context())
    finally:
        http.stop()
    with pytest.raises(SecurityError, match="plaintext HTTP on non-loopback"):
        serve_http(p.addresses["orchestrator"], "0.0.0.0", 0, ClientSecurity(), ServerSecurity())


# -- a body over the limit ---------------------------------------------------------------
def test_a_body_over_the_limit_is_413_in_openais_shape_and_the_server_serves_on(stack, client):
    """Issue 30: an 8 MB body got 429 rate_limit_error from the gRPC hop (which OpenAI's clients
    retry). Now 413 before the hop, for the SDK and for a plain request; then the next request."""
    p, http = stack
    assert MAX_BODY_BYTES < MAX_REQUEST_BYTES
    prompt = "a" * 8_000_000
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert err.value.status_code == 413 and not isinstance(err.value, openai.RateLimitError)
    assert set(err.value.body) == {"message", "type", "param", "code"}  # the SDK's view of {"error": {...}}
    assert err.value.body["type"] == "invalid_request_error" and str(MAX_BODY_BYTES) in err.value.body["message"]
    # A body of exactly the limit reaches the gRPC API, which refuses this one for its length.
    head, tail = f'{{"model": "{MODEL}", "prompt": ['.encode(), b"1]}"
    body = head + b"1," * ((MAX_BODY_BYTES - len(head) - len(tail)) // 2) + tail
    body = body[: len(head)] + b" " * (MAX_BODY_BYTES - len(body)) + body[len(head) :]
    assert len(body) == MAX_BODY_BYTES
    status, reply = http_json(f"{http.url}/v1/completions", body)
    assert (status, reply["error"]["param"]) == (400, "prompt") and "no room" in reply["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=4).choices
    assert p.open_sessions() == (0, 0)


def test_a_body_without_length_is_refused_once_it_passes_the_limit(stack):
    """A chunked body that never ends: the server stops reading at the limit and answers 413."""
    _, http = stack
    url = urlsplit(http.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nTransfer-Encoding: chunked\r\n"
        sock.sendall(f"{head}Content-Type: application/json\r\n\r\n".encode())

        def send_forever():
            part = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
            try:
                while True:
                    sock.sendall(part)
            except OSError:  # the server answered and closed the connection
                pass

        sender = threading.Thread(target=send_forever, daemon=True)
        sender.start()
        response = HTTPResponse(sock)
        response.begin()
        assert response.status == 413
        assert json.loads(response.read())["error"]["message"].startswith("the request body is larger than")
    sender.join(30)
    assert not sender.is_alive()


def test_a_grpc_message_too_large_is_413_not_429(stack):
    """gRPC's own size refusal is RESOURCE_EXHAUSTED, like admission; over HTTP it is 413."""
    p, _ = stack
    with pytest.raises(grpc.RpcError) as err:
        p.orchestrator.Generate(orchestrator_pb2.GenerateRequest(prompt="a" * (MAX_REQUEST_BYTES + 1)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    error = APIError.from_rpc(err.value, "completions")
    assert error.status == 413 and "larger than max" in error.message


# -- admission, drain, clients that go away ----------------------------------------------
def long_stream(client):
    return client.completions.create(model=MODEL, prompt=NO_EOS_PROMPT, max_tokens=400, stream=True)


def test_closing_a_stream_after_the_first_chunk_frees_both_sessions(tiny_backends):
    # 0.2 s a forward: the 400 tokens would take over a minute, freeing takes about a round (~1 s),
    # so sessions freed within the 20 s bound (a hang guard only) were freed by the close.
    with slow_pipeline(tiny_backends, delay=0.2) as p:
        http = start_http(p)
        try:
            stream = long_stream(client_for(http))
            next(iter(stream))
            assert p.open_sessions() == (1, 1)
            stream.close()
            assert p.sessions_freed_within(20), p.open_sessions()
        finally:
            http.stop()


def test_abandoned_non_streaming_requests_stop_at_the_next_round(tiny_backends):
    """Issue 30: 12 non-streaming 400-token requests whose clients left after 0.5 s kept the
    server busy (the next request waited 47 s). Each one's gRPC call is cancelled when its
    client goes away: the next request answers within 3 s, and no session is left open."""
    with slow_pipeline(tiny_backends, delay=0.02) as p:
        http = start_http(p)
        try:
            url = urlsplit(http.url)
            body = json.dumps({"model": MODEL, "prompt": NO_EOS_PROMPT, "max_tokens": 400})
            conns = [HTTPConnection(url.hostname, url.port, timeout=30) for _ in range(12)]
            for conn in conns:
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            # Admission runs all 12 at once (its default, 64): all generating before the clients leave.
            assert wait_until(lambda: p.open_sessions() == (12, 12), 10)
            time.sleep(0.5)
            for conn in conns:
                conn.close()
            ordinary = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
            status, reply = http_json(f"{http.url}/v1/completions", ordinary, timeout=3)
            assert status == 200 and reply["usage"]["completion_tokens"] == 4
            assert p.sessions_freed_within(3)
        finally:
            http.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_requests_abandoned_in_the_admission_queue_leave_it(tiny_backends, stream):
    """A request queued for admission whose client goes away leaves the queue at once (a
    stream too, before its first chunk), not when a slot frees: the queue has room again while
    the one running request still runs."""
    limits = AdmissionLimits(max_concurrent=1, max_queue=2)
    with slow_pipeline(tiny_backends, admission=limits) as p:
        http = start_http(p)
        try:
            running = long_stream(client_for(http))
            next(iter(running))
            url = urlsplit(http.url)
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": stream})
            conns = [HTTPConnection(url.hostname, url.port, timeout=30) for _ in range(2)]
            for conn in conns:
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            admission = p.servers["orchestrator"].gate.admission
            assert wait_until(lambda: admission.waiting == 2, 10)
            for conn in conns:
                conn.close()
            assert wait_until(lambda: admission.waiting == 0, 3)
            assert admission.running == 1  # the running request holds both sessions (its draft may still open)
            assert wait_until(lambda: p.open_sessions() == (1, 1), 30)
            running.close()
            assert p.sessions_freed_within(3)
        finally:
            http.stop()


def test_admission_full_is_429_and_draining_is_503(tiny_backends):
    admission = AdmissionLimits(max_concurrent=1, max_queue=0)
    with slow_pipeline(tiny_backends, admission=admission) as p:
        http = start_http(p)
        client = client_for(http)
        try:
            stream = long_stream(client)
            next(iter(stream))
            with pytest.raises(openai.RateLimitError) as err:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
            assert err.value.status_code == 429 and err.value.response.headers["Retry-After"] == "1"
            drain = threading.Thread(target=p.servers["orchestrator"].drain, args=(30,))
            drain.start()
            assert wait_until(lambda: http_json(http.url + "/health")[0] == 503, 5)
            assert http_json(http.url + "/health")[1]["services"]["orchestrator"] == "NOT_SERVING"
            assert http_json(http.url + "/health")[1]["reason"] == "orchestrator NOT_SERVING"
            with pytest.raises(openai.InternalServerError) as err:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
            assert err.value.status_code == 503 and err.value.response.headers["Retry-After"] == "1"
            stream.close()
            drain.join(30)
            assert not drain.is_alive()
        finally:
            http.stop()


# -- the command line, telemetry ---------------------------------------------------------
@pytest.mark.slow
def test_serve_http_port_with_tls_and_a_token_one_trace_across_the_three_processes(tiny_models, monkeypatch, tmp_path):
    """`--http-port` through deploy.local (what `specdec serve --http-port` runs), with TLS and a
    token: HTTPS with the orchestrator's certificate, the token required, /health over all three;
    the HTTP request's server span is the trace's root, the gRPC stream, the rounds and the
    services' calls are in its trace."""
    pki = make_pki(tmp_path, "serve")
    with OtlpReceiver() as receiver:
        for key, value in {
            "OTEL_SERVICE_NAME": "",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "600000",
        }.items():
            monkeypatch.setenv(key, value)
        config = PipelineConfig(
            target=ModelSpec(tiny_models["target"], "cpu", "float32"),
            draft=ModelSpec(tiny_models["draft"], "cpu", "float32"),
            http_port=0,
            tls=ServerTLSFiles(pki.server_cert, pki.server_key),
            auth_token="t0ken",
            start_timeout=180,
            calibration_tokens=0,  # the draft's calls in the trace: no start-up timing that may choose plain rounds
        )
        pipeline = LocalPipeline(config, log=lambda *_: None)
        try:
            pipeline.start()
            url = pipeline.http_url
            assert url.startswith("https://127.0.0.1:")
            context = ssl.create_default_context(cafile=str(pki.ca))
            status, health = http_json(url + "/health", context=context)
            assert status == 200 and health == {"status": "ok", "services": dict.fromkeys(SERVICES, "SERVING")}
            assert http_json(url + "/v1/models", context=context)[0] == 401
            http_client = openai.DefaultHttpxClient(verify=context)
            client = openai.OpenAI(base_url=url + "/v1", api_key="t0ken", max_retries=0, http_client=http_client)
            (model,) = [m.id for m in client.models.list()]
            chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, stream=True))
            rounds = chunks[-1].specdec["rounds"]
            for proc in pipeline.procs.values():  # SIGTERM flushes the spans
                proc.send_signal(signal.SIGTERM)
            assert {name: proc.wait(timeout=120) for name, proc in pipeline.procs.items()} == dict.fromkeys(
                ("draft", "target", "orchestrator"), 0
            )
        finally:
            pipeline.stop()
        spans = receiver.spans
    (root,) = [s for s in spans if s.name.startswith("POST /v1/chat/completions")]
    assert root.service == "specdec-orchestrator" and root.parent_id == "" and root.kind == 2  # SERVER
    trace = [s for s in spans if s.trace_id == root.trace_id]
    (stream,) = [s for s in trace if s.name == "/specdec.v1.Orchestrator/GenerateStream"]
    assert stream.parent_id == root.span_id and stream.kind == 2
    assert len([s for s in trace if s.name == "specdec.round"]) == rounds
    assert {s.service for s in trace} == {"specdec-orchestrator", "specdec-draft", "specdec-target"}
