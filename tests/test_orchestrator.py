"""The client API over real gRPC: orchestrator, draft and target servers on loopback,
hosting tiny random models; and the CLI starting the three as separate processes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import grpc
import pytest

from draft_service.server import serve as serve_draft
from orchestrator.generation import RequestDefaults
from orchestrator.server import check_pair, connect
from orchestrator.server import serve as serve_orchestrator
from specdec.errors import FailedPrecondition
from specdec.runtime.backend import HFBackend
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights.models import ModelSpec
from target_service.server import serve as serve_target
from tests.conftest import make_tokenizer


@pytest.fixture(scope="module")
def pipeline(tiny_backends):
    draft_server, draft_port = serve_draft(tiny_backends["draft"])
    target_server, target_port = serve_target(tiny_backends["target"])
    pair = connect(f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}")
    # a fixed default k: a stream and a unary request run at the same k (the measured one may move between them)
    orch_server, orch_port = serve_orchestrator(pair, defaults=RequestDefaults(lookahead=4))
    stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{orch_port}"))
    yield stub, pair
    for server in (orch_server, draft_server, target_server):
        server.stop(None)


def request(**kw):
    kw.setdefault("prompt", "hello world")
    kw.setdefault("max_new_tokens", 40)
    return orchestrator_pb2.GenerateRequest(**kw)


@pytest.mark.usefixtures("draft_awaited")
def test_stream_equals_unary(pipeline):
    stub, _ = pipeline
    for sampling in (model_pb2.SamplingParams(), model_pb2.SamplingParams(temperature=0.9, top_p=0.95)):
        req = request(sampling=sampling, seed=3)
        unary = stub.Generate(req)
        chunks = list(stub.GenerateStream(req))
        assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
        assert "".join(c.text for c in chunks) == unary.text
        assert chunks[-1].finish_reason == unary.finish_reason
        assert len(chunks) > 2  # streamed as rounds committed
        s = unary.stats
        assert s.generated_tokens == len(unary.token_ids) == chunks[-1].stats.generated_tokens
        assert unary.finish_reason == "stop" or s.generated_tokens == 40
        assert s.draft_tokens > 0 and 0 <= s.acceptance_rate <= 1
        assert s.accepted_tokens <= s.mean_accepted_length * s.rounds
        if sampling.temperature > 0:  # a seeded Leviathan sample replays its rounds; greedy rounds do not
            assert s.rounds == chunks[-1].stats.rounds  # wait for the draft's session: their count is timing
            # Overlapped rounds (the default): a round commits its accepted drafts and one target token,
            # or, when the next round's first draft took the bonus position, its accepted drafts alone.
            # (Greedy rounds go on while the draft's session opens: plain rounds of several target
            # steps a Score, as many as the opening takes on a loaded machine.)
            assert s.mean_accepted_length * s.rounds <= s.accepted_tokens + s.rounds


@pytest.mark.usefixtures("draft_awaited")
def test_chunks_split_their_text_by_origin_and_count_their_rounds(pipeline):
    """TextSpan and RoundCounts: the spans cover each chunk's text; the counts add up to the stats."""
    stub, _ = pipeline
    for speculation in (orchestrator_pb2.SpeculationParams(), orchestrator_pb2.SpeculationParams(disabled=True)):
        chunks = list(stub.GenerateStream(request(max_new_tokens=60, stop_strings=["zz"], speculation=speculation)))
        for c in chunks:
            assert sum(s.length for s in c.spans) == len(c.text)
        s = chunks[-1].stats
        counts = [(c.rounds.rounds, c.rounds.draft_tokens, c.rounds.accepted_tokens) for c in chunks]
        assert tuple(map(sum, zip(*counts, strict=True))) == (s.rounds, s.draft_tokens, s.accepted_tokens)
        drafted = sum(span.length for c in chunks for span in c.spans if span.drafted)
        if speculation.disabled:
            assert drafted == 0 and s.draft_tokens == 0
        else:
            assert 0 < drafted < sum(len(c.text) for c in chunks)


def test_inputs_agree(pipeline):
    stub, pair = pipeline
    text = stub.Generate(request(prompt="abc", chat_template=True))
    ids = pair.tokenizer.apply_chat_template([{"role": "user", "content": "abc"}], add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    by_ids = stub.Generate(request(prompt=None, token_ids=orchestrator_pb2.TokenIds(ids=ids)))
    msgs = orchestrator_pb2.ChatMessages(messages=[orchestrator_pb2.ChatMessage(role="user", content="abc")])
    by_msgs = stub.Generate(request(prompt=None, messages=msgs))
    assert text.token_ids == by_ids.token_ids == by_msgs.token_ids
    assert text.stats.prompt_tokens == len(ids)


def test_a_developer_turn_is_a_system_turn(pipeline):
    """OpenAI's "developer" role, which the proto lists, reaches the template as a system turn
    (before: INVALID_ARGUMENT "unknown role 'developer'" over gRPC, accepted over HTTP)."""
    stub, _ = pipeline

    def chat(role):
        turns = [
            orchestrator_pb2.ChatMessage(role=role, content="be brief"),
            orchestrator_pb2.ChatMessage(role="user", content="abc"),
        ]
        return stub.Generate(request(prompt=None, messages=orchestrator_pb2.ChatMessages(messages=turns)))

    developer, system = chat("developer"), chat("system")
    assert developer.token_ids == system.token_ids and developer.stats.prompt_tokens == system.stats.prompt_tokens


def test_speculation_off_gives_the_same_greedy_output(pipeline):
    stub, _ = pipeline
    on = stub.Generate(request(speculation=orchestrator_pb2.SpeculationParams(lookahead=3)))
    off = stub.Generate(request(speculation=orchestrator_pb2.SpeculationParams(disabled=True)))
    assert on.token_ids == off.token_ids and off.stats.draft_tokens == 0


def test_stop_token_and_stop_string(pipeline):
    stub, pair = pipeline
    full = stub.Generate(request())
    ids = list(full.token_ids)
    stop_at = 10
    by_token = stub.Generate(request(stop_token_ids=[ids[stop_at]]))
    first = ids.index(ids[stop_at])
    assert list(by_token.token_ids) == ids[:first] and by_token.finish_reason == "stop"
    stop = full.text[12:15]
    by_string = stub.Generate(request(stop_strings=[stop]))
    cut = full.text.index(stop)
    assert by_string.text == full.text[:cut] and by_string.finish_reason == "stop"
    kept = list(by_string.token_ids)
    assert kept == ids[: len(kept)] and stop in pair.tokenizer.decode(kept)  # through the completing token
    assert stop not in pair.tokenizer.decode(kept[:-1])
    streamed = list(stub.GenerateStream(request(stop_strings=[stop])))
    assert "".join(c.text for c in streamed) == by_string.text  # nothing past it was streamed


def test_seeded_sampling_is_reproducible(pipeline):
    stub, _ = pipeline
    sampling = model_pb2.SamplingParams(temperature=1.0)
    a, b = (stub.Generate(request(sampling=sampling, seed=11)) for _ in range(2))
    c = stub.Generate(request(sampling=sampling, seed=12))
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert a.stats.seed == 11


@pytest.mark.usefixtures("draft_awaited")
def test_a_temperature_near_zero_samples_greedys_text(pipeline):
    """A temperature of 1e-40 (inside the HTTP range [0, 2]) took a positive logit over it to inf and
    the row to NaN: a 500 ("row must have positive mass"), and under the invariant rule token 0
    with a NaN logprob. Its law is greedy's limit: the greedy text, under both rules and without
    speculation, with finite logprobs."""
    stub, _ = pipeline
    greedy = list(stub.Generate(request()).token_ids)
    cold = model_pb2.SamplingParams(temperature=1e-40)
    for rule in (orchestrator_pb2.RULE_LEVIATHAN, orchestrator_pb2.RULE_INVARIANT):
        out = stub.Generate(
            request(sampling=cold, seed=5, logprobs=0, speculation=orchestrator_pb2.SpeculationParams(rule=rule))
        )
        assert list(out.token_ids) == greedy
        assert all(math.isfinite(p.logprob) for p in out.logprobs)
    alone = stub.Generate(request(sampling=cold, speculation=orchestrator_pb2.SpeculationParams(disabled=True)))
    assert list(alone.token_ids) == greedy


def test_mismatched_pair_is_refused(tiny_models, tiny_backends):
    other = HFBackend(ModelSpec(tiny_models["other_vocab"], "cpu", "float32"))
    draft_server, draft_port = serve_draft(other)
    target_server, target_port = serve_target(tiny_backends["target"])
    try:
        with pytest.raises(FailedPrecondition) as err:
            connect(f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}")
        assert tiny_models["other_vocab"] in err.value.message and tiny_models["target"] in err.value.message
        # which tokens differ: the draft's five extra ones (conftest.make_tokenizer), the first named
        assert "5 tokens differ: '<x0>' (draft 45, target none)" in err.value.message
    finally:
        draft_server.stop(None)
        target_server.stop(None)
    same_size = model_pb2.ModelInfo(model_name="a", vocab_size=5, tokenizer_digest="x")
    tokenizer = make_tokenizer()
    with pytest.raises(FailedPrecondition):
        check_pair(
            same_size,
            model_pb2.ModelInfo(model_name="b", vocab_size=5, tokenizer_digest="y"),
            tokenizer,
            make_tokenizer,
        )


@pytest.mark.slow
def test_cli_generate_json_starts_three_processes(tiny_models):
    # a lookahead named: the start-up timing may find the tiny pair's drafts slower than plain rounds
    cmd = [
        sys.executable,
        "-m",
        "cli",
        "generate",
        "hello",
        "--json",
        "--max-tokens",
        "24",
        "--raw",
        "--lookahead",
        "4",
    ]
    cmd += ["--target-model", tiny_models["target"], "--draft-model", tiny_models["draft"], "--draft-dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == {"text", "token_ids", "finish_reason", "stats"}
    assert len(result["token_ids"]) == 24 and result["finish_reason"] == "length"
    assert set(result["stats"]) == {
        "rounds", "draft_tokens", "accepted_tokens", "acceptance_rate",
        "mean_accepted_length", "tokens_per_second", "wall_seconds", "rounds_without_draft",
    }  # fmt: skip
    assert result["stats"]["draft_tokens"] > 0


def test_cli_reports_errors_in_one_line(tiny_models):
    cmd = [sys.executable, "-m", "cli", "generate", "hello", "--address", "127.0.0.1:1", "--timeout", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.startswith("specdec: error: ") and "Traceback" not in out.stderr


def test_a_connection_that_never_comes_up_leaves_no_thread_behind():
    """A lost service's prober connects once a probe: a channel left watching its connectivity
    would keep a polling thread (and wake it) for the life of the process."""
    import socket
    import threading

    from orchestrator.server import _channel
    from specdec.serving.security import ClientSecurity
    from tests.harness import wait_until

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    before = threading.active_count()
    for _ in range(5):
        with pytest.raises(ConnectionError, match="no service answered"):
            _channel(address, 0.2, ClientSecurity())
    assert wait_until(lambda: threading.active_count() <= before, 5)


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_prompts_tokenise_as_the_tokenizer_does(which):
    """prompts.encode (the backend's own encode, which keeps the interpreter's lock; encode_batch for
    a long text) gives transformers' ids, for prompts and chat templates, special tokens' text included."""
    from transformers import AutoTokenizer

    from orchestrator import prompts
    from specdec.weights import models

    tok = make_tokenizer() if which == "tiny" else AutoTokenizer.from_pretrained(models.resolve(models.DEFAULT_ALIAS))
    long = "the <s> quick café " * (prompts.OFFLOADED_CHARS // 10)  # encoded off the scheduler's thread
    texts = ["the quick brown fox", "<s> a special token's text </s>", "<|im_start|>user\nhi", "café 日本", " a\n\nb "]
    texts.append(long)
    for text in texts:
        for special in (True, False):
            assert prompts.encode(tok, text, special) == tok.encode(text, add_special_tokens=special), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<|im_end|> <s> hi"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert prompts._chat_ids(tok, messages) == expected
    tok.backend_tokenizer.enable_truncation(3)  # set on the backend: transformers' own encode is asked
    assert prompts.encode(tok, texts[0]) == tok.encode(texts[0], add_special_tokens=True)


def test_a_huge_prompt_stops_no_other_generation(pipeline):
    """A 3.9 MB prompt takes seconds to tokenise (~6 s with the tests' tokenizer): on the scheduler's
    thread, every generation in flight stopped until it was done (a stream's chunks 7-9 s apart).
    Now a generation sent after it finishes while it is still being tokenised."""
    stub, _ = pipeline
    huge = stub.Generate.future(request(prompt="ab " * 1_300_000, max_new_tokens=2))
    time.sleep(0.5)  # its tokenising under way
    small = stub.Generate(request(max_new_tokens=16))
    assert len(small.token_ids) == 16 and not huge.done()
    assert huge.exception(timeout=120).code() == grpc.StatusCode.OUT_OF_RANGE  # past the model's context
