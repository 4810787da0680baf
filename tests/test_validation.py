"""Bad input at every edge gets its status code and a message naming the field; a refused
request changes nothing, and the services keep serving. Real servers on loopback with the
tiny models; the CLI as a separate process."""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import socket
import subprocess
import sys

import grpc
import pytest

from specdec import validation
from specdec.decoding.sampling import SamplingParams
from specdec.errors import InvalidArgument
from specdec.v1 import model_pb2, orchestrator_pb2
from specdec.weights import hub, models
from tests.conftest import make_tokenizer
from tests.harness import NO_EOS_PROMPT, pipeline, status_of

Code = grpc.StatusCode
CONTEXT = 512  # max_position_embeddings of the tiny models
VOCAB = 45


@pytest.fixture(scope="module")
def services(tiny_backends):
    with pipeline(tiny_backends["draft"], tiny_backends["target"]) as p:
        yield p


def gen(**kw) -> orchestrator_pb2.GenerateRequest:
    kw.setdefault("max_new_tokens", 8)
    if not {"prompt", "token_ids", "messages"} & kw.keys():
        kw["prompt"] = "hello"
    return orchestrator_pb2.GenerateRequest(**{k: v for k, v in kw.items() if v is not None})


def no_input():
    return orchestrator_pb2.GenerateRequest(max_new_tokens=8)


def empty(field: str):
    request = orchestrator_pb2.GenerateRequest(max_new_tokens=8)
    getattr(request, field).SetInParent()
    return request


def sampling(**kw):
    return model_pb2.SamplingParams(**kw)


def lookahead(k):
    return orchestrator_pb2.SpeculationParams(lookahead=k)


def chat(*turns):
    return orchestrator_pb2.ChatMessages(messages=[orchestrator_pb2.ChatMessage(role=r, content=c) for r, c in turns])


def ids(n):
    return orchestrator_pb2.TokenIds(ids=[5] * n)


NAN, INF = float("nan"), float("inf")
ORCHESTRATOR_CASES = [
    ("empty prompt", gen(prompt=""), Code.INVALID_ARGUMENT, ["prompt"]),
    ("no input", no_input(), Code.INVALID_ARGUMENT, ["prompt, messages or token_ids"]),
    ("empty token_ids", empty("token_ids"), Code.INVALID_ARGUMENT, ["token_ids"]),
    ("empty messages", empty("messages"), Code.INVALID_ARGUMENT, ["messages"]),
    ("token id beyond vocab", gen(token_ids=orchestrator_pb2.TokenIds(ids=[3, VOCAB])), Code.INVALID_ARGUMENT,
     ["token_ids", str(VOCAB)]),
    ("negative token id", gen(token_ids=orchestrator_pb2.TokenIds(ids=[-1])), Code.INVALID_ARGUMENT, ["token_ids"]),
    # A prompt that fits with room for a token: the message names max_new_tokens first; else the prompt.
    ("prompt + max_new_tokens beyond context", gen(token_ids=ids(500), max_new_tokens=100), Code.OUT_OF_RANGE,
     ["max_new_tokens 100 + a prompt of 500", str(CONTEXT), "at most 12"]),
    ("room for one token, two asked", gen(token_ids=ids(CONTEXT - 1), max_new_tokens=2), Code.OUT_OF_RANGE,
     ["max_new_tokens 2 +", "at most 1 "]),
    ("prompt fills the context", gen(token_ids=ids(CONTEXT), max_new_tokens=1), Code.OUT_OF_RANGE,
     [f"prompt of {CONTEXT} tokens leaves no room"]),
    ("prompt alone beyond context", gen(token_ids=ids(CONTEXT + 1), max_new_tokens=1), Code.OUT_OF_RANGE,
     [f"prompt of {CONTEXT + 1} tokens", "max_new_tokens 1"]),
    ("max_new_tokens < 1", gen(max_new_tokens=-1), Code.INVALID_ARGUMENT, ["max_new_tokens"]),
    ("max_new_tokens = 0", gen(max_new_tokens=0), Code.INVALID_ARGUMENT, ["max_new_tokens", "got 0"]),
    ("temperature < 0", gen(sampling=sampling(temperature=-0.5)), Code.INVALID_ARGUMENT, ["sampling.temperature"]),
    ("temperature NaN", gen(sampling=sampling(temperature=NAN)), Code.INVALID_ARGUMENT, ["sampling.temperature"]),
    ("temperature inf", gen(sampling=sampling(temperature=INF)), Code.INVALID_ARGUMENT, ["sampling.temperature"]),
    ("top_p > 1", gen(sampling=sampling(temperature=1, top_p=1.5)), Code.INVALID_ARGUMENT, ["sampling.top_p"]),
    ("top_p < 0", gen(sampling=sampling(temperature=1, top_p=-0.1)), Code.INVALID_ARGUMENT, ["sampling.top_p"]),
    ("top_p NaN", gen(sampling=sampling(temperature=1, top_p=NAN)), Code.INVALID_ARGUMENT, ["sampling.top_p"]),
    ("top_p = 0", gen(sampling=sampling(temperature=1, top_p=0)), Code.INVALID_ARGUMENT, ["sampling.top_p"]),
    ("top_p = 0, greedy", gen(sampling=sampling(top_p=0)), Code.INVALID_ARGUMENT, ["sampling.top_p"]),
    ("top_k < 0", gen(sampling=sampling(temperature=1, top_k=-1)), Code.INVALID_ARGUMENT, ["sampling.top_k"]),
    ("top_k = 0", gen(sampling=sampling(temperature=1, top_k=0)), Code.INVALID_ARGUMENT, ["sampling.top_k"]),
    ("lookahead > 32", gen(speculation=lookahead(33)), Code.INVALID_ARGUMENT, ["speculation.lookahead", "33"]),
    ("lookahead < 1", gen(speculation=lookahead(-2)), Code.INVALID_ARGUMENT, ["speculation.lookahead"]),
    ("lookahead = 0", gen(speculation=lookahead(0)), Code.INVALID_ARGUMENT, ["speculation.lookahead", "got 0"]),
    ("stop token beyond vocab", gen(stop_token_ids=[VOCAB + 7]), Code.INVALID_ARGUMENT, ["stop_token_ids"]),
    ("empty stop string", gen(stop_strings=["x", ""]), Code.INVALID_ARGUMENT, ["stop_strings"]),
    ("unknown chat role", gen(messages=chat(("user", "hi"), ("robot", "beep"))), Code.INVALID_ARGUMENT,
     ["messages", "robot"]),
    ("oversized message", gen(prompt="a" * (5 << 20)), Code.RESOURCE_EXHAUSTED, ["larger than max"]),
]  # fmt: skip


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
@pytest.mark.parametrize(("request_", "code", "words"), [c[1:] for c in ORCHESTRATOR_CASES],
                         ids=[c[0] for c in ORCHESTRATOR_CASES])  # fmt: skip
def test_orchestrator_refuses_bad_input(services, method, request_, code, words):
    call = getattr(services.orchestrator, method)
    err = status_of(lambda: list(call(request_, timeout=60)) if method == "GenerateStream" else call(request_))
    assert err.code() == code, err.details()
    for word in words:
        assert word in err.details(), err.details()
    assert services.open_sessions() == (0, 0)


def test_services_keep_serving_after_bad_input(services):
    for _, request, _, _ in ORCHESTRATOR_CASES:
        with pytest.raises(grpc.RpcError):
            services.orchestrator.Generate(request)
    reply = services.orchestrator.Generate(gen(max_new_tokens=16))
    assert len(reply.token_ids) == 16 and reply.finish_reason == "length"
    assert services.open_sessions() == (0, 0)


# -- the model services' own edge: every refused request leaves the session as it was ----------
SID = "valid"
PROMPT = [3, 10, 7, 14, 14, 17]  # length 6
GREEDY = model_pb2.SamplingParams()
SAMPLE = model_pb2.SamplingParams(temperature=1.0)


def ref(sid=SID, length=6):
    return model_pb2.SessionRef(session_id=sid, expected_length=length)


def propose(**kw):
    """A Propose that would commit a token and be valid but for the fields in kw."""
    kw.setdefault("session", ref())
    kw.setdefault("append_tokens", [1])
    kw.setdefault("k", 2)
    kw.setdefault("sampling", GREEDY)
    return ("draft", "Propose", model_pb2.ProposeRequest(**kw))


def score(**kw):
    """A Score that would commit a token and be valid but for the fields in kw."""
    kw.setdefault("session", ref())
    kw.setdefault("append_tokens", [1])
    kw.setdefault("draft_token_ids", [5, 6])
    kw.setdefault("sampling", GREEDY)
    return ("target", "Score", model_pb2.ScoreRequest(**kw))


VALID_SCORE = model_pb2.ScoreRequest(session=ref(), draft_token_ids=[5, 6], sampling=GREEDY)


def both(method, request):
    return [("draft", method, request), ("target", method, request)]


INVALID = Code.INVALID_ARGUMENT
LONG = [5] * (CONTEXT - len(PROMPT) - 1)  # fits alone; one more token does not
SERVICE_CASES = [
    ("k = 0", propose(k=0), INVALID, "k"),
    ("k = 33", propose(k=33), INVALID, "k"),
    ("draft temperature < 0", propose(sampling=sampling(temperature=-1)), INVALID, "sampling.temperature"),
    ("draft temperature NaN", propose(sampling=sampling(temperature=NAN)), INVALID, "sampling.temperature"),
    ("draft top_p > 1", propose(sampling=sampling(temperature=1, top_p=2)), INVALID, "sampling.top_p"),
    ("draft top_k < 0", propose(sampling=sampling(temperature=1, top_k=-3)), INVALID, "sampling.top_k"),
    ("draft top_k = 0", propose(sampling=sampling(temperature=1, top_k=0)), INVALID, "sampling.top_k"),
    ("draft top_p = 0", propose(sampling=sampling(temperature=1, top_p=0)), INVALID, "sampling.top_p"),
    ("free_lookahead = 33", propose(free_lookahead=33), INVALID, "free_lookahead"),
    ("free_lookahead, Leviathan sampling", propose(sampling=SAMPLE, uniforms=[0.5, 0.5], free_lookahead=8), INVALID,
     "free_lookahead"),
    ("uniforms missing", propose(sampling=SAMPLE, uniforms=[0.5]), INVALID, "uniforms"),
    ("uniform = 1", propose(sampling=SAMPLE, uniforms=[0.5, 1.0]), INVALID, "uniforms"),
    ("uniform NaN", propose(sampling=SAMPLE, uniforms=[NAN, 0.5]), INVALID, "uniforms"),
    ("append beyond vocab, then propose", propose(append_tokens=[1, VOCAB]), INVALID, "append_tokens"),
    ("propose on an unknown session", propose(session=ref("nope")), Code.NOT_FOUND, "session_id"),
    ("propose with a stale length", propose(session=ref(length=5), append_tokens=[1]), Code.FAILED_PRECONDITION,
     "expected_length"),
    ("append + k beyond context", propose(append_tokens=LONG, k=2), Code.OUT_OF_RANGE, "append_tokens + k"),
    ("append + free_lookahead beyond context", propose(append_tokens=LONG[:-3], k=1, free_lookahead=8),
     Code.OUT_OF_RANGE, "append_tokens + k"),
    ("draft ids beyond vocab", score(draft_token_ids=[4, VOCAB], append_tokens=[1]), INVALID,
     "draft_token_ids"),
    ("target temperature inf", score(sampling=sampling(temperature=INF)), INVALID, "sampling.temperature"),
    ("target top_p = 0", score(sampling=sampling(top_p=0)), INVALID, "sampling.top_p"),
    ("draft probs missing", score(sampling=SAMPLE, draft_token_probs=[0.5], accept_uniforms=[0.1, 0.2]),
     INVALID, "draft_token_probs"),
    ("draft prob NaN", score(sampling=SAMPLE, draft_token_probs=[NAN, 0.5], accept_uniforms=[0.1, 0.2]),
     INVALID, "draft_token_probs"),
    ("accept uniform > 1", score(sampling=SAMPLE, draft_token_probs=[0.5, 0.5], accept_uniforms=[0.1, 2.0]),
     INVALID, "accept_uniforms"),
    ("decode_steps with drafts", score(decode_steps=4), INVALID, "decode_steps"),
    ("decode_steps = 0", score(draft_token_ids=[], decode_steps=0), INVALID, "decode_steps"),
    ("decode_steps = 65", score(draft_token_ids=[], decode_steps=65), INVALID, "decode_steps"),
    ("decode_steps, Leviathan sampling, a uniform short", score(draft_token_ids=[], decode_steps=2, sampling=SAMPLE,
     step_uniforms=[0.5]), INVALID, "step_uniforms"),
    ("decode_steps, a step uniform = 1", score(draft_token_ids=[], decode_steps=2, sampling=SAMPLE,
     step_uniforms=[0.5, 1.0]), INVALID, "step_uniforms"),
    ("decode_steps, stop beyond vocab", score(draft_token_ids=[], decode_steps=2, stop_token_ids=[VOCAB]), INVALID,
     "stop_token_ids"),
    ("score on an unknown session", score(session=ref("nope")), Code.NOT_FOUND, "session_id"),
    ("score with a stale length", score(session=ref(length=7), append_tokens=[1]), Code.FAILED_PRECONDITION,
     "expected_length"),
    ("append + drafts beyond context", score(append_tokens=LONG, draft_token_ids=[1, 2]), Code.OUT_OF_RANGE,
     "append_tokens + draft_token_ids"),
    ("no sampling proposal to read", ("draft", "ProposalRow", model_pb2.ProposalRowRequest(session=ref())),
     Code.FAILED_PRECONDITION, "proposal"),
    *[(f"{s} append beyond vocab", (s, m, r), INVALID, "token_ids") for s, m, r in
      both("Append", model_pb2.AppendRequest(session=ref(), token_ids=[2, -4]))],
    *[(f"{s} append beyond context", (s, m, r), Code.OUT_OF_RANGE, "token_ids") for s, m, r in
      both("Append", model_pb2.AppendRequest(session=ref(), token_ids=LONG + [1, 2]))],
    *[(f"{s} append with a stale length", (s, m, r), Code.FAILED_PRECONDITION, "expected_length") for s, m, r in
      both("Append", model_pb2.AppendRequest(session=ref(length=0), token_ids=[1]))],
    *[(f"{s} rollback to 0", (s, m, r), Code.OUT_OF_RANGE, "to_length") for s, m, r in
      both("Rollback", model_pb2.RollbackRequest(session_id=SID, to_length=0))],
    *[(f"{s} rollback beyond the length", (s, m, r), Code.OUT_OF_RANGE, "to_length") for s, m, r in
      both("Rollback", model_pb2.RollbackRequest(session_id=SID, to_length=len(PROMPT) + 1))],
    *[(f"{s} rollback of an unknown session", (s, m, r), Code.NOT_FOUND, "session_id") for s, m, r in
      both("Rollback", model_pb2.RollbackRequest(session_id="nope", to_length=1))],
    *[(f"{s} open without an id", (s, m, r), INVALID, "session_id") for s, m, r in
      both("OpenSession", model_pb2.OpenSessionRequest(prompt_token_ids=[1]))],
    *[(f"{s} open an empty prompt", (s, m, r), INVALID, "prompt_token_ids") for s, m, r in
      both("OpenSession", model_pb2.OpenSessionRequest(session_id="x"))],
    *[(f"{s} open beyond vocab", (s, m, r), INVALID, "prompt_token_ids") for s, m, r in
      both("OpenSession", model_pb2.OpenSessionRequest(session_id="x", prompt_token_ids=[VOCAB]))],
    *[(f"{s} open beyond context", (s, m, r), Code.OUT_OF_RANGE, "prompt_token_ids") for s, m, r in
      both("OpenSession", model_pb2.OpenSessionRequest(session_id="x", prompt_token_ids=[1] * (CONTEXT + 1)))],
    *[(f"{s} open a duplicate", (s, m, r), Code.ALREADY_EXISTS, "session_id") for s, m, r in
      both("OpenSession", model_pb2.OpenSessionRequest(session_id=SID, prompt_token_ids=[1]))],
    *[(f"{s} close an unknown session", (s, m, r), Code.NOT_FOUND, "session_id") for s, m, r in
      both("CloseSession", model_pb2.CloseSessionRequest(session_id="nope"))],
    *[(f"{s} get an unknown session", (s, m, r), Code.NOT_FOUND, "session_id") for s, m, r in
      both("GetSession", model_pb2.GetSessionRequest(session_id="nope"))],
]  # fmt: skip


@pytest.fixture
def session(services):
    """An open session on both services, with a cached speculative tail; closed afterwards."""
    for stub in (services.draft, services.target):
        stub.OpenSession(model_pb2.OpenSessionRequest(session_id=SID, prompt_token_ids=PROMPT))
    services.target.Score(VALID_SCORE)  # leaves a speculative tail in the target's cache
    services.draft.Propose(model_pb2.ProposeRequest(session=ref(), k=2, sampling=GREEDY))
    before = [
        stub.GetSession(model_pb2.GetSessionRequest(session_id=SID)) for stub in (services.draft, services.target)
    ]
    yield before
    for stub in (services.draft, services.target):
        stub.CloseSession(model_pb2.CloseSessionRequest(session_id=SID))
    assert services.open_sessions() == (0, 0)


@pytest.mark.parametrize(("call", "code", "field"), [c[1:] for c in SERVICE_CASES], ids=[c[0] for c in SERVICE_CASES])
def test_model_service_refuses_bad_input_and_changes_nothing(services, session, call, code, field):
    side, method, request = call
    stub = getattr(services, side)
    err = status_of(lambda: getattr(stub, method)(request))
    assert err.code() == code, err.details()
    assert field in err.details(), err.details()
    after = [stub.GetSession(model_pb2.GetSessionRequest(session_id=SID)) for stub in (services.draft, services.target)]
    assert after == session
    # ... and the session still works
    services.target.Score(VALID_SCORE)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["", "--raw"], "INVALID_ARGUMENT: prompt must not be empty"),
        ([""], "INVALID_ARGUMENT: prompt must not be empty"),  # in the chat template: refused after start-up
        (["hi", "--stream", "--json"], "--stream prints the text as it comes"),  # --stream was dropped
        (["hi", "--temperature", "nan"], "INVALID_ARGUMENT: sampling.temperature (--temperature) must"),
        (["hi", "--stream", "--lookahead", "40"], "INVALID_ARGUMENT: speculation.lookahead (--lookahead) must"),
        (["hi", "--max-tokens", "100000"], "OUT_OF_RANGE: max_new_tokens (--max-tokens) 100000"),
        (["hi", "--top-p", "0"], "INVALID_ARGUMENT: sampling.top_p (--top-p) must"),
        (["hi", "--top-k", "0", "--temperature", "1"], "INVALID_ARGUMENT: sampling.top_k (--top-k) must"),
        (["hi", "--max-tokens", "0"], "INVALID_ARGUMENT: max_new_tokens (--max-tokens) must"),
        (["hi", "--lookahead", "0", "--stream"], "INVALID_ARGUMENT: speculation.lookahead (--lookahead) must"),
        (["hi", "--stop", ""], "INVALID_ARGUMENT: stop_strings (--stop) must"),
    ],
)
def test_cli_reports_bad_input_in_one_line(services, args, expected):
    assert_one_line_error(run_cli("generate", *args, "--address", services.addresses["orchestrator"]), expected)


def test_cli_stream_with_compare_prints_the_speedup(services):
    """`generate --stream --compare`: the streamed answer, then the speedup over the target alone
    (before: the stream returned before the comparison, which was skipped without a word)."""
    args = ["hello there", "--raw", "--stream", "--compare", "--max-tokens", "8"]
    out = run_cli("generate", *args, "--address", services.addresses["orchestrator"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "x speedup; the same text]" in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--max-tokens", "0"], "INVALID_ARGUMENT: max_new_tokens (--max-tokens) must be >= 1, got 0"),
        (["--lookahead", "99"], "INVALID_ARGUMENT: speculation.lookahead (--lookahead) must"),
        (["--min-p", "-0.1"], "INVALID_ARGUMENT: sampling.min_p (--min-p) must be in [0, 1] (0: off), got -0.1"),
        (["--stop", ""], "INVALID_ARGUMENT: stop_strings (--stop) must"),
    ],
)
def test_cli_refuses_bad_input_before_it_starts_services(args, expected):
    """Without --address, `specdec generate` checks what needs no model before it starts three
    processes: one line, the orchestrator's message, and no start-up line before it."""
    assert_one_line_error(run_cli("generate", "hi", *args), expected)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["serve", "--port", "70000"], "argument --port: a port is 0..65535"),  # it bound 70000 % 65536 = 4464
        (["ray", "up", "--http-port", "-1"], "argument --http-port: a port is 0..65535"),
        (["serve", "--drain-timeout", "-1"], "argument --drain-timeout: seconds >= 0, not -1"),  # it served
        (["serve", "--metrics-port", "65534"], "argument --metrics-port: the draft's metrics take this port + 2"),
        (["generate", "hi", "--address", "127.0.0.1"], "argument --address: an address is HOST:PORT"),  # it dialed 443
        (["generate", "hi", "--address", "127.0.0.1:99999"], "argument --address: a port is 1..65535"),  # refused
        (["bench", "compare", "--max-tokens", "0"], "argument --max-tokens: must be >= 1"),  # every request refused
        (["bench", "ttft", "--repeats", "0"], "argument --repeats: must be >= 1"),  # started the pipeline, ran nothing
        (["bench", "concurrency", "--prompts", "0"], "argument --prompts: must be >= 1"),  # IndexError, once loaded
        (["bench", "concurrency", "--repeats", "3"], "unrecognized arguments: --repeats 3"),  # taken and not run
        (["bench", "ttft", "--system-chars", "-5"], "argument --system-chars: must be >= 0"),  # cut the last 5
        # The limits' own checks named their fields (max_sessions, idle_ttl, max_queue), not the flags.
        (["target-service", "--max-sessions", "0"], "argument --max-sessions: must be >= 1, not 0"),
        (["draft-service", "--session-ttl", "nan"], "argument --session-ttl: seconds >= 0, not nan"),
        (["serve", "--health-timeout", "-1"], "argument --health-timeout: seconds >= 0, not -1"),
        (["orchestrator", "--target-address", "127.0.0.1:1", "--max-queue", "-1"], "argument --max-queue: must be"),
        (["ray", "bench", "--clients-per-replica", "0"], "argument --clients-per-replica: must be >= 1"),  # Ray's trace
        # loadtest's and chaos's counts and seconds were exit 1, chaos's in one message for four flags
        (["loadtest", "--requests", "0"], "argument --requests: must be >= 1, not 0"),
        (["loadtest", "--requests", "-1"], "argument --requests: must be >= 1, not -1"),
        (["loadtest", "--concurrency", "0"], "argument --concurrency: must be >= 1, not 0"),
        (["loadtest", "--time-limit", "0"], "argument --time-limit: seconds > 0, not 0"),
        (["loadtest", "--time-limit", "-5"], "argument --time-limit: seconds > 0, not -5"),
        (["loadtest", "--time-limit", "nan"], "argument --time-limit: seconds > 0, not nan"),
        (["loadtest", "--time-limit", "inf"], "argument --time-limit: seconds > 0, not inf"),
        (["chaos", "--streams", "0"], "argument --streams: must be >= 1, not 0"),
        (["chaos", "--requests-per-stream", "0"], "argument --requests-per-stream: must be >= 1, not 0"),
        (["chaos", "--max-tokens", "0"], "argument --max-tokens: must be >= 4, not 0"),
        (["chaos", "--kills", "-1"], "argument --kills: must be >= 0, not -1"),
        (["chaos", "--duration", "0"], "argument --duration: seconds > 0, not 0"),
        (["chaos", "--duration", "nan"], "argument --duration: seconds > 0, not nan"),
        (["chaos", "--rss-slack-mb", "-1"], "argument --rss-slack-mb: megabytes >= 0, not -1"),
        (["chaos", "--rss-slack-mb", "nan"], "argument --rss-slack-mb: megabytes >= 0, not nan"),  # it ran 3 min once
    ],
)
def test_a_flag_out_of_form_is_a_usage_error(args, expected):
    out = run_cli(*args)
    assert out.returncode == 2 and expected in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("flags", "refused"),
    [
        (["--target-model", "standin:1", "--draft-model", "standin:0.2:0.8"], "--target-model, --draft-model apply"),
        (["--no-prefix-cache"], "--no-prefix-cache applies"),
        (
            ["--draft-cpus", "0", "--drafter", "ngram", "--no-target-compile"],
            "--draft-cpus, --drafter, --no-target-compile",
        ),
        (["--max-tokens", "4", "--compare"], None),  # the local pipeline's flags at their defaults; a request's
    ],
)
def test_local_pipeline_flags_with_an_address_are_a_usage_error(flags, refused):
    """`generate --address` took the flags of the local pipeline it does not start (models, cores,
    drafter, prefix cache) and ignored them: the user believed they applied. Now a usage error naming
    those given, before any call; those left at their defaults are not refused."""
    out = run_cli("generate", "hi", "--address", "127.0.0.1:1", *flags)  # nothing answers there
    if refused is None:
        assert out.returncode == 1 and "no orchestrator answers at 127.0.0.1:1" in out.stderr, out.stderr
        return
    assert out.returncode == 2, out.stderr
    assert f"specdec generate: error: {refused}" in out.stderr, out.stderr
    assert "to a local pipeline only, not with --address" in out.stderr, out.stderr


def test_loadtests_local_pipeline_flags_with_an_address_are_a_usage_error():
    """`loadtest --address` ignored them too (it ran its requests against the server's own models)."""
    out = run_cli("loadtest", "--address", "127.0.0.1:1", "--target-model", "standin:1", "--draft-cpus", "0")
    assert out.returncode == 2, out.stderr
    assert "specdec loadtest: error: --target-model, --draft-cpus apply to a local pipeline only" in out.stderr


@pytest.mark.parametrize(
    "command", [["serve"], ["target-service"], ["orchestrator", "--target-address", "127.0.0.1:9"]]
)
def test_a_port_another_process_listens_on_is_refused_before_anything_loads(command):
    """A second `specdec serve` on the same --port loaded both models (a minute on the default pair)
    before its orchestrator failed to bind, with gRPC's C++ log line."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = run_cli(*command, "--port", str(port))
    assert_one_line_error(out, f"--port {port}: another process listens on 127.0.0.1:{port}")


def test_two_servers_of_one_command_on_one_port_are_refused():
    """`serve --port 50561 --metrics-port 50560` started the target's metrics on 50561, then the
    orchestrator failed: "another process" was its own."""
    out = run_cli("serve", "--port", "50561", "--metrics-port", "50560")
    assert_one_line_error(out, "--port 50561 and --metrics-port 50560 + 1 (the target's) are one port")


def test_a_host_that_is_no_address_here_is_refused_before_anything_loads():
    out = run_cli("target-service", "--host", "192.0.2.1", "--allow-insecure")  # TEST-NET-1: no host's
    assert_one_line_error(out, "--host 192.0.2.1: not an address of this machine")


def test_a_device_torch_cannot_run_is_named():
    """Before a model loads: torch's own error was an AssertionError deep in the model's .to()."""
    import torch

    count = torch.cuda.device_count() if torch.backends.cuda.is_built() else 0
    want = "built without CUDA" if not torch.backends.cuda.is_built() else "CUDA device"
    with pytest.raises(ValueError, match=want):
        models.check_device(f"cuda:{count}")  # one past the last GPU, or any where there is none
    with pytest.raises(ValueError, match="not a torch device"):
        models.check_device("gpu0")
    models.check_device("cpu")


def test_a_local_path_that_is_not_there_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    for model in (missing, missing + ".gguf"):
        with pytest.raises(FileNotFoundError, match="no such file or directory on this host"):
            models.resolve(model)
    assert models.resolve(str(tmp_path)) == str(tmp_path)


def hub_cache(root, repo: str, model_dir: str):
    """A hub cache (huggingface_hub's layout) at `root` holding `repo`'s snapshot, a copy of `model_dir`."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, snapshot)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(snapshot.name)
    return snapshot


def test_a_hub_id_passes_through_where_the_hub_answers(monkeypatch):
    monkeypatch.setattr(hub, "reachable", lambda: True)
    assert models.resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_hub_id_without_the_hub_is_its_cached_snapshot_or_refused_at_once(tmp_path, tiny_models, monkeypatch):
    """Offline, transformers asked the hub first and huggingface_hub retried for ~45 s ("Retrying in
    8s [Retry 5/5]") before a cached model loaded or an uncached one failed."""
    probe = hub.reachable
    monkeypatch.setattr(hub, "reachable", lambda: False)
    snapshot = hub_cache(tmp_path, "tests/tiny", tiny_models["target"])
    monkeypatch.setattr(hub, "local", functools.partial(hub.local, cache_dir=str(tmp_path)))
    assert models.resolve("tests/tiny") == str(snapshot)
    with pytest.raises(FileNotFoundError, match=r"'tests/absent': the hub .* does not answer .* not in its cache"):
        models.resolve("tests/absent")
    assert not probe("http://127.0.0.1:9", timeout=5)  # nothing listens on port 9


def test_a_cached_hub_id_loads_without_retrying_the_hub(tmp_path, tiny_models):
    """A service's load of a cached hub id on a host whose hub does not answer (here: an endpoint
    where nothing listens): at once, without huggingface_hub's retries."""
    hub_cache(tmp_path, "tests/tiny", tiny_models["target"])
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"}
    env.pop("HF_HUB_OFFLINE", None)
    code = "from specdec.weights import models; print(models.load(models.ModelSpec('tests/tiny'))[0].config.vocab_size)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(len(make_tokenizer())) and "Retrying" not in out.stderr, out.stderr


@pytest.mark.parametrize("unbuffered", ["1", ""], ids=["unbuffered", "buffered"])
def test_a_reader_that_stops_reading_ends_the_cli_quietly(services, unbuffered, monkeypatch):
    """`specdec status | head -1` printed "specdec: error: [Errno 32] Broken pipe" (stdout unbuffered),
    or Python's "Exception ignored ... BrokenPipeError" at exit (buffered: a pipe's default)."""
    monkeypatch.setenv("PYTHONUNBUFFERED", unbuffered)  # empty: unset, as Python reads it
    cmd = [sys.executable, "-m", "cli", "status", "--address", services.addresses["orchestrator"]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # gone before the child's first line (it starts Python and asks the server first)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 141 and not stderr, stderr


@pytest.mark.usefixtures("draft_awaited")
def test_unset_fields_take_their_defaults(services):
    """No max_new_tokens: 128; no lookahead: the server's (this pipeline's 4, reported in the stats;
    tests/test_default_lookahead.py has the measured one); no sampling: greedy; an explicit seed 0
    is a seed."""
    reply = services.orchestrator.Generate(orchestrator_pb2.GenerateRequest(token_ids=ids_of(NO_EOS_PROMPT)))
    assert len(reply.token_ids) == 128 and reply.finish_reason == "length"
    greedy = gen(token_ids=ids_of(NO_EOS_PROMPT), sampling=sampling(temperature=0), speculation=lookahead(4))
    assert services.orchestrator.Generate(greedy).token_ids == reply.token_ids[:8]
    rounds = reply.stats.rounds  # k = 4 in every round but the last few (k < the tokens left)
    assert reply.stats.lookahead == 4 and 4 * (rounds - 4) <= reply.stats.draft_tokens <= 4 * rounds
    seeded = gen(token_ids=ids_of(NO_EOS_PROMPT), sampling=sampling(temperature=1.0), seed=0, max_new_tokens=24)
    first, second = (services.orchestrator.Generate(seeded) for _ in range(2))
    assert first.stats.seed == 0 and first.token_ids == second.token_ids
    seeded.ClearField("seed")  # unset: a seed picked at random (reported), so runs differ
    assert len({services.orchestrator.Generate(seeded).stats.seed for _ in range(3)}) == 3


def ids_of(tokens):
    return orchestrator_pb2.TokenIds(ids=tokens)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["ray", "bench", "--draft-ms", "-1"], "--draft-ms -1 --agreement 0.8: a stand-in"),  # in an actor
        (["status", "--address", "127.0.0.1:1"], "UNAVAILABLE: no orchestrator answers at 127.0.0.1:1 ("),
        (["serve", "--target-threads", "0"], "--target-threads must be >= 1, got 0"),  # 0 was no flag at all
        (["generate", "hi", "--draft-threads", "-2"], "--draft-threads must be >= 1, got -2"),
        (["ray", "up", "--target-threads", "0"], "--target-threads must be >= 1, got 0"),
        # Each of these started a Ray cluster, placed the pair (and for the last two started its
        # services) before Ray's words or a wait of 0 s ended it
        (["ray", "up", "--max-restarts", "-5"], "--max-restarts is a count >= 0, or -1 for no limit, got -5"),
        (["ray", "up", "--orchestrator-cpus", "-2"], "--orchestrator-cpus must be >= 0, got -2"),
        (["ray", "up", "--timeout", "0"], "--timeout must be > 0 seconds, got 0"),
        (["ray", "up", "--target-cpus", "nan"], "the target service needs some CPUs or GPUs (--target-cpus,"),
        (["generate", "hi", "--seed", "-1"], "--seed must be in 0..18446744073709551615, got -1"),  # protobuf's words
        (["generate", "hi", "--timeout", "0"], "--timeout is seconds > 0, not 0"),  # DEADLINE_EXCEEDED at once
        (["bench", "compare", "--kinds", "chat,nope"], "--kinds: no prompt is of kind nope"),  # ran no prompt
        (["chaos", "--seed", "-1"], "--seed must be in 0..4294967295, not -1"),  # protobuf's "Value out of range"
        (
            ["loadtest", "--max-tokens", "0"],
            "INVALID_ARGUMENT: max_new_tokens (--max-tokens) must be >= 1",
        ),  # every call refused
    ],
)
def test_cli_refuses_bad_limits_before_starting(args, expected):
    assert_one_line_error(run_cli(*args), expected)


def assert_one_line_error(out: subprocess.CompletedProcess, expected: str) -> None:
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"specdec: error: {expected}"), out.stderr


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.75, top_k=5, top_p=0.875, min_p=0.0625, frequency_penalty=0.5),  # float32's
        SamplingParams(temperature=1.0, presence_penalty=-0.5, repetition_penalty=1.25, logit_bias=((3, -2.0),)),
        SamplingParams(logit_bias=((7, 5.0),)),  # greedy with a bias: not the empty message
    ],
    ids=["greedy", "filters", "penalties", "greedy-biased"],
)
def test_sampling_params_cross_the_wire_unchanged(params):
    """What a service reads is what the orchestrator sent; greedy's message is empty (its checks and
    its reading skipped on every call), and an empty message reads as greedy."""
    proto = model_pb2.SamplingParams.FromString(params.to_proto().SerializeToString())
    validation.sampling(proto)
    assert SamplingParams.from_proto(proto) == params
    assert (proto.ByteSize() == 0) == (params == SamplingParams())


@pytest.mark.parametrize("ids, bad", [([0, 5, 44], None), ([], None), ([3, 45, -1], 45), ([-2, 7], -2)])
def test_token_ids_outside_the_vocabulary_are_named(ids, bad):
    if bad is None:
        validation.token_ids(ids, VOCAB, "append_tokens")
        return
    with pytest.raises(InvalidArgument, match=rf"append_tokens: token id {bad} is outside the vocabulary 0\.\.44"):
        validation.token_ids(ids, VOCAB, "append_tokens")


def test_a_ready_file_is_there_only_while_the_command_serves(tmp_path, monkeypatch):
    """--ready-file: one a stopped `serve` left (its dead address) stayed until the next start
    wrote its own, so a reader that waited for the file connected to the dead one. It is removed
    before the command runs and once it ends."""
    from cli import main

    ready = tmp_path / "ready.json"
    ready.write_text('{"address": "127.0.0.1:1"}')
    seen = []

    def command(args) -> int:
        seen.append(args.ready_file.exists())
        args.ready_file.write_text('{"address": "127.0.0.1:50051"}')
        return 0

    monkeypatch.setitem(main.COMMANDS, "serving", command)
    assert main._run(argparse.Namespace(command="serving", ready_file=ready)) == 0
    assert seen == [False] and not ready.exists()


def test_a_tls_handshake_that_fails_is_named():
    """`--tls` against a server without TLS: gRPC's details end in "OK", which the message showed
    as the cause ("no orchestrator answers at ... (OK)")."""
    from cli import main

    args = argparse.Namespace(address="127.0.0.1:50343")
    details = (
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50343: Ssl handshake failed "
        "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: OK"
    )
    assert main._reached(args, details).startswith("the TLS handshake with 127.0.0.1:50343 failed")
    refused = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Connection refused"
    assert main._reached(args, refused) == "no orchestrator answers at 127.0.0.1:50343 (Connection refused)"
