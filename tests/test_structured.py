"""Structured output under speculation (specdec.decoding.grammar): the output is the target's law masked to
what the grammar allows at each position, exactly, with the draft held to the same grammar.

- a constraint that is not valid is refused naming its field, at the orchestrator and over HTTP;
- a matcher's k + 1 masks in one pass equal the masks taken a token at a time; a committed token
  the grammar forbids is refused and changes nothing;
- greedy: token for token a reference masked-argmax decode of the target alone, with chains, trees,
  overlapped rounds, adaptive lookahead, under both rules, for the model and n-gram drafters
  (stand-ins whose grammar changes the allowed set every position), and for the tiny models over
  gRPC with a JSON schema; the invariant rule's seeded sample is the target alone's;
- sampling: the law through the three services is the masked target's, top-k applied after the
  mask (chi-square), and a draft that tells the rule its unmasked rows while sampling from its
  masked ones fails the same test;
- 100 sampled outputs for a JSON schema all parse and validate, ending with the grammar ("stop");
  the openai client's response_format with a Pydantic model round-trips;
- log probabilities: each output token's equals the target alone's masked log-softmax at its
  position (1e-4), with and without speculation, over gRPC and through the openai client.
"""

from __future__ import annotations

import json
import math

import jsonschema
import numpy as np
import openai
import pydantic
import pytest
import torch

from draft_service import drafters, proposer
from draft_service.drafters import MODEL, NGRAM
from orchestrator.loop import LoopConfig, SpeculativeLoop
from specdec.decoding import grammar
from specdec.decoding.sampling import SamplingParams, probs_from_logits
from specdec.errors import InvalidArgument
from specdec.runtime.backend import HFBackend
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights.models import ModelSpec
from tests.conftest import JSON_CHARS, make_tiny_model
from tests.harness import pipeline
from tests.standins import Direct, random_markov
from tests.stats import counts_chisquare, transition_counts
from tests.test_loop import kernel_after_transform
from tests.test_openai_api import http_pipeline
from tests.test_seeds import SUPPORT, TokenizedMarkov, run_all

# -- the grammar alone --------------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000  # past json's decoder: RecursionError, which was INTERNAL / a 500
BAD = [
    (model_pb2.Constraint(json_schema="{not json"), "constraint.json_schema"),
    (model_pb2.Constraint(json_schema=DEEP), "constraint.json_schema"),
    (model_pb2.Constraint(json_schema='{"type": "nonsense"}'), "constraint.json_schema"),
    (model_pb2.Constraint(regex="a(b"), "constraint.regex"),
    (model_pb2.Constraint(choice=model_pb2.Choices()), "constraint.choice"),
    (model_pb2.Constraint(grammar="start: undefined_rule"), "constraint.grammar"),
    (model_pb2.Constraint(), "constraint"),
]


@pytest.mark.parametrize("constraint, field", BAD, ids=[f for _, f in BAD[:-1]] + ["unset"])
def test_an_invalid_constraint_is_refused_naming_its_field(constraint, field):
    with pytest.raises(InvalidArgument) as err:
        grammar.grammar_of(constraint)
    assert err.value.message.startswith(field + ":") or err.value.message.startswith(field + " ")
    assert not err.value.message.endswith(":"), err.value.message  # says what is wrong, on one line
    if constraint.regex:
        assert err.value.message.endswith("regex parse error: unclosed group") and "\n" not in err.value.message


@pytest.fixture(scope="module")
def markov_table():
    backend = TokenizedMarkov(random_markov(len(SUPPORT), 1))
    return backend, grammar.TokenTable.of(backend)


def test_masks_in_one_pass_are_the_masks_a_token_at_a_time(markov_table):
    _, table = markov_table
    matcher = grammar.Matcher(table, grammar.grammar_of(model_pb2.Constraint(regex="([hij][klm])*")), 0)
    h, i, k, z = 10, 11, 13, 28
    drafts = [h, k, i, z, h]  # z is forbidden: the rows after it are never reached
    together = matcher.masks(drafts)
    for n in range(4):  # the masks a token at a time: pushed one by one
        assert np.array_equal(together[n], matcher.masks()[0])
        assert matcher.push(drafts[n : n + 1]) == (1 if n < 3 else 0)
    matcher.pop()
    assert (together[4:] == -1).all()  # after z: every token (never read)
    allowed = grammar.allowed_tokens(together, table.vocab_size)
    assert allowed[0].nonzero()[0].tolist() == [2, 10, 11, 12]  # accepting (the empty string): EOS too
    assert allowed[1].nonzero()[0].tolist() == [13, 14, 15]
    # A committed token the grammar forbids is refused, and the matcher is as it was.
    with pytest.raises(InvalidArgument, match="append_tokens: token 13"):
        matcher.commit([h, k, k], "append_tokens")
    matcher.commit([h, k], "append_tokens")
    assert np.array_equal(matcher.masks(), together[2:3])
    matcher.rollback(0)  # the committed length: no constrained token
    assert np.array_equal(matcher.masks(), together[:1])


# -- through the loop, in process (stand-ins) --------------------------------------------------

PARITY = model_pb2.Constraint(regex="([hij][klm])*")  # the allowed set changes every position
PROMPT = [SUPPORT[0]]


def pair(target_kernel, draft_kernel, drafter=MODEL):
    from draft_service.server import DraftServicer
    from specdec.runtime.engine import SessionEngine
    from target_service.server import TargetServicer

    target = TargetServicer(SessionEngine(TokenizedMarkov(target_kernel), "target"))
    draft = DraftServicer(SessionEngine(TokenizedMarkov(draft_kernel), "draft"), drafter)
    return Direct(draft), Direct(target)


GREEDY = SamplingParams()


def generate(draft, target, n: int, sampling=GREEDY, seed: int = 3, constraint=PARITY, **config):
    loop = SpeculativeLoop(draft, target, PROMPT, LoopConfig(sampling, n, seed=seed, constraint=constraint, **config))
    for _ in loop.rounds():
        pass
    return loop.generated, loop.stats


def masked_argmax_decode(logits_of, table, constraint, prompt: list[int], n: int) -> list[int]:
    """The reference: the target alone, its argmax over the tokens the grammar allows, a token at a time."""
    matcher = grammar.Matcher(table, grammar.grammar_of(constraint), len(prompt))
    out = []
    while len(out) < n:
        logits = logits_of(prompt + out)
        token = int(torch.argmax(matcher.apply(logits[None], matcher.masks())[0]))
        if token in table.eos:
            break
        matcher.commit([token], "reference")
        out.append(token)
    return out


SCHEDULES = [
    {"lookahead": 1},
    {"lookahead": 4},
    {"lookahead": 4, "overlap": True},
    {"lookahead": 6, "adaptive": True, "overlap": True},
    {"lookahead": 3, "tree_nodes": 6},
    {"lookahead": 6, "adaptive": True, "tree_nodes": 8},
    {"lookahead": 4, "overlap": True, "rule": "invariant"},
]


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize("drafter", [MODEL, NGRAM], ids=["model", "ngram"])
def test_greedy_is_the_masked_argmax_of_the_target_alone(drafter, markov_table):
    target_kernel = random_markov(len(SUPPORT), 31, alpha=0.3)
    weights = 0.7 * target_kernel + 0.3 * random_markov(len(SUPPORT), 32)
    draft, target = pair(target_kernel, weights, drafter)
    backend, table = markov_table
    reference_backend = TokenizedMarkov(target_kernel)
    expected = masked_argmax_decode(lambda ids: reference_backend.forward([], ids, 1)[0], table, PARITY, PROMPT, 120)
    for schedule in SCHEDULES:
        out, stats = generate(draft, target, 120, **schedule)
        assert out == expected, schedule
        # adaptive lookahead may choose no drafts under load: counts only for a fixed k
        assert "adaptive" in schedule or stats.draft_tokens > 0, schedule
    assert draft.servicer.engine.open_sessions == 0 == target.servicer.engine.open_sessions


@pytest.mark.usefixtures("draft_awaited")
def test_the_invariant_rules_seeded_sample_is_the_target_alones():
    target_kernel = random_markov(len(SUPPORT), 41, alpha=0.4)
    draft, target = pair(target_kernel, random_markov(len(SUPPORT), 42))
    sampling = SamplingParams(temperature=0.9, top_k=2)
    alone, _ = generate(draft, target, 120, sampling, seed=5, speculate=False, rule="invariant")
    for schedule in SCHEDULES[1:]:
        out, stats = generate(draft, target, 120, sampling, seed=5, **{"rule": "invariant", **schedule})
        assert out == alone, schedule
        assert "adaptive" in schedule or 0 < stats.accepted_tokens < stats.draft_tokens, schedule


# -- the law through the three services ---------------------------------------------------------

SAMPLING = SamplingParams(temperature=0.9, top_p=0.95)  # top-p after the mask


def parity_kernel(kernel) -> np.ndarray:
    """The masked law of the next token given the last one: from h, i, j only k, l, m, and back."""
    masked = np.array(kernel, dtype=np.float64)
    masked[:3, :3] = 0.0
    masked[3:, 3:] = 0.0
    return kernel_after_transform(masked, SAMPLING)


@pytest.fixture(scope="module")
def kernels():
    return random_markov(len(SUPPORT), 81), random_markov(len(SUPPORT), 82)


def chains_through_the_services(target_kernel, draft_kernel, tokens: int) -> np.ndarray:
    with pipeline(TokenizedMarkov(draft_kernel), TokenizedMarkov(target_kernel)) as p:
        requests = [
            orchestrator_pb2.GenerateRequest(
                token_ids=orchestrator_pb2.TokenIds(ids=PROMPT),
                sampling=SAMPLING.to_proto(),
                seed=300 + i,
                max_new_tokens=tokens,
                constraint=PARITY,
                speculation=orchestrator_pb2.SpeculationParams(lookahead=3, overlap=bool(i % 2)),
            )
            for i in range(8)
        ]
        outputs = run_all(p.addresses["orchestrator"], requests)
        assert p.sessions_freed_within(5)
    index = {t: i for i, t in enumerate(SUPPORT)}
    return transition_counts([[index[t] for t in out] for out in outputs], len(SUPPORT))


@pytest.mark.slow
def test_the_law_through_the_services_is_the_masked_targets(kernels):
    target_kernel, draft_kernel = kernels
    counts = chains_through_the_services(target_kernel, draft_kernel, 500)
    assert counts_chisquare(counts, parity_kernel(target_kernel)) > 1e-3
    assert counts_chisquare(counts, parity_kernel(draft_kernel)) < 1e-3


def unmasked_in_the_rule(engine, session, k, params, uniforms, assumed=(), noise_seed=None, alternatives=None):
    """A wrong draft: it samples from its masked rows but tells the rule its unmasked ones."""
    steps, logits, raw = (
        proposer.propose(engine, session, k, params, uniforms, assumed, noise_seed, alternatives),
        None,
        [],
    )
    try:
        while True:
            logits = yield steps.send(logits)
            raw.append(logits[0].clone())
    except StopIteration as stop:
        drafts, _ = stop.value
    rows = probs_from_logits(torch.stack(raw[: len(drafts)]), params)
    session.proposal_rows[len(session.proposal_rows) - len(drafts) :] = rows
    return drafts, [float(rows[i, t]) for i, t in enumerate(drafts)]


@pytest.mark.slow
def test_a_draft_row_left_unmasked_in_the_rule_fails_the_same_test(kernels, monkeypatch):
    wrong = drafters.Drafter(unmasked_in_the_rule, proposer.proposal_row, proposer.propose_tree)
    monkeypatch.setattr(drafters, "MODEL", wrong)  # the draft service runs in this process
    target_kernel, draft_kernel = kernels
    counts = chains_through_the_services(target_kernel, draft_kernel, 500)
    assert counts_chisquare(counts, parity_kernel(target_kernel)) < 1e-3


# -- the tiny models: JSON over gRPC and HTTP ---------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}
JSON_PROMPT = [1, 10, 7, 14, 14, 17]


class Item(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=5)
    n: int = pydantic.Field(ge=0, le=99)
    ok: bool


@pytest.fixture(scope="module")
def json_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("json")
    target = make_tiny_model(root / "target", seed=5, chars=JSON_CHARS)
    draft = make_tiny_model(root / "draft", seed=6, like=target, noise=0.3, chars=JSON_CHARS)
    return {name: HFBackend(ModelSpec(path, "cpu", "float32")) for name, path in (("target", target), ("draft", draft))}


@pytest.fixture(scope="module")
def json_stack(json_models):
    with http_pipeline(json_models["draft"], json_models["target"]) as both:
        yield both


def schema_request(seed=0, temperature=0.0, logprobs=None, **speculation) -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=JSON_PROMPT),
        sampling=model_pb2.SamplingParams(temperature=temperature),
        seed=seed,
        max_new_tokens=64,
        constraint=model_pb2.Constraint(json_schema=json.dumps(SCHEMA)),
        speculation=orchestrator_pb2.SpeculationParams(**speculation),
    )
    if logprobs is not None:
        request.logprobs = logprobs
    return request


def target_logits(backend: HFBackend, ids: list[int]) -> torch.Tensor:
    """The target alone's logits after each prefix of `ids` ([len(ids), vocab]), one forward."""
    with torch.no_grad():
        return backend.model(torch.tensor([ids])).logits[0].float()


def test_greedy_json_over_grpc_is_the_masked_argmax_of_the_target_alone(json_models, json_stack):
    p, _ = json_stack
    backend = json_models["target"]
    table = grammar.TokenTable.of(backend)
    constraint = model_pb2.Constraint(json_schema=json.dumps(SCHEMA))
    expected = masked_argmax_decode(lambda ids: target_logits(backend, ids)[-1], table, constraint, JSON_PROMPT, 64)
    jsonschema.validate(json.loads(backend.tokenizer.decode(expected)), SCHEMA)
    schedules = [
        {"disabled": True},
        {"lookahead": 4, "overlap": False},
        {"lookahead": 4},
        {"lookahead": 6, "adaptive": True},
        {"lookahead": 4, "tree_nodes": 8},
    ]
    stub = orchestrator_pb2_grpc.OrchestratorStub(__import__("grpc").insecure_channel(p.addresses["orchestrator"]))
    for schedule in schedules:
        for rule in (orchestrator_pb2.RULE_LEVIATHAN, orchestrator_pb2.RULE_INVARIANT):
            reply = stub.Generate(schema_request(rule=rule, **schedule), timeout=120)
            assert list(reply.token_ids) == expected and reply.finish_reason == "stop", schedule
    assert p.sessions_freed_within(5)


@pytest.mark.slow
def test_a_hundred_sampled_json_outputs_parse_and_validate(json_stack):
    p, _ = json_stack
    requests = [schema_request(seed=i, temperature=1.0, lookahead=4) for i in range(100)]
    stub = orchestrator_pb2_grpc.OrchestratorStub(__import__("grpc").insecure_channel(p.addresses["orchestrator"]))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda r: stub.Generate(r, timeout=300), requests))
    texts = {reply.text for reply in replies}
    for reply in replies:
        assert reply.finish_reason == "stop", reply.text
        jsonschema.validate(json.loads(reply.text), SCHEMA)
    assert len(texts) > 50  # samples, not one text
    assert sum(r.stats.accepted_tokens for r in replies) > 0


def test_logprobs_are_the_target_alones_masked_log_softmax(json_models, json_stack):
    p, _ = json_stack
    backend = json_models["target"]
    table = grammar.TokenTable.of(backend)
    stub = orchestrator_pb2_grpc.OrchestratorStub(__import__("grpc").insecure_channel(p.addresses["orchestrator"]))
    cases = [(0.0, {"disabled": True}), (0.0, {"lookahead": 4}), (0.8, {"disabled": True}), (0.8, {"lookahead": 4})]
    cases += [
        (0.8, {"lookahead": 3, "tree_nodes": 6}),
        (0.8, {"lookahead": 4, "rule": orchestrator_pb2.RULE_INVARIANT}),
    ]
    cases = [(*case, True) for case in cases]  # and without the grammar (the target's own greedy chain):
    cases += [
        (0.0, {"disabled": True}, False),
        (0.8, {"disabled": True, "rule": orchestrator_pb2.RULE_INVARIANT}, False),
    ]
    for temperature, speculation, constrained in cases:
        request = schema_request(7, temperature, logprobs=3, **speculation)
        if not constrained:
            request.ClearField("constraint")
        reply = stub.Generate(request, timeout=120)
        ids = list(reply.token_ids)
        assert len(reply.logprobs) == len(ids) > 0
        if speculation.get("disabled"):  # several steps a Score, each with its row's: it ran a Score a token
            assert reply.stats.rounds < len(ids) / 2, (reply.stats.rounds, len(ids))
        masked = target_logits(backend, JSON_PROMPT + ids)[len(JSON_PROMPT) - 1 : -1]
        if constrained:
            matcher = grammar.Matcher(table, grammar.grammar_of(schema_request().constraint), 0)
            masked = matcher.apply(masked, matcher.masks(ids)[: len(ids)])
        expected = torch.log_softmax(masked / (temperature or 1.0), dim=-1)
        for i, (token, entry) in enumerate(zip(ids, reply.logprobs, strict=True)):
            assert entry.token_id == token and entry.token == backend.tokenizer.decode([token])
            assert abs(entry.logprob - expected[i, token].item()) < 1e-4, (temperature, speculation, i)
            top = [(t, v) for v, t in zip(*torch.topk(expected[i], 3), strict=True) if v > -math.inf]
            assert [t.token_id for t in entry.top][:1] == [int(top[0][0])]
            assert [t.logprob for t in entry.top] == pytest.approx([float(v) for _, v in top], abs=1e-4)


# -- over HTTP ------------------------------------------------------------------------------


def test_the_openai_clients_pydantic_response_format_round_trips(json_stack):
    _, http = json_stack
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0)
    for seed in range(4):
        completion = client.chat.completions.parse(
            model="tiny-target",
            messages=[{"role": "user", "content": "an item"}],
            response_format=Item,
            max_tokens=64,
            temperature=1.0,
            seed=seed,
        )
        item = completion.choices[0].message.parsed
        assert isinstance(item, Item) and completion.choices[0].finish_reason == "stop"
        assert Item.model_validate_json(completion.choices[0].message.content) == item


def test_the_openai_client_reads_the_logprobs(json_stack):
    p, http = json_stack
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0)
    extra = {"guided_json": SCHEMA, "speculation": {"lookahead": 4}}
    completion = client.completions.create(
        model="tiny-target", prompt=JSON_PROMPT, max_tokens=64, logprobs=2, temperature=0.8, seed=7, extra_body=extra
    )
    grpc_reply = orchestrator_pb2_grpc.OrchestratorStub(
        __import__("grpc").insecure_channel(p.addresses["orchestrator"])
    ).Generate(schema_request(7, 0.8, logprobs=2, lookahead=4), timeout=120)
    logprobs = completion.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in grpc_reply.logprobs], abs=1e-6)
    assert "".join(logprobs.tokens) == completion.choices[0].text == grpc_reply.text
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)  # those with a probability
    chat = client.chat.completions.create(
        model="tiny-target",
        messages=[{"role": "user", "content": "an item"}],
        max_tokens=64,
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_object"},
    )
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(c.logprob <= 0 and 1 <= len(c.top_logprobs) <= 2 for c in content)
    json.loads(chat.choices[0].message.content)
    stream = client.chat.completions.create(
        model="tiny-target",
        messages=[{"role": "user", "content": "an item"}],
        max_tokens=64,
        logprobs=True,
        response_format={"type": "json_object"},
        stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    streamed = [entry for c in chunks if c.logprobs for entry in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(c.token, c.logprob) for c in content]
    assert "".join(c.delta.content or "" for c in chunks) == chat.choices[0].message.content


BAD_HTTP = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        "response_format",
    ),  # fmt: skip
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize("params, param", BAD_HTTP, ids=[p for _, p in BAD_HTTP])
def test_an_invalid_constraint_over_http_is_400_naming_the_parameter(json_stack, params, param):
    from tests.test_openai_api import http_json

    _, http = json_stack
    body = {"model": "tiny-target", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **params}
    status, reply = http_json(http.url + "/v1/chat/completions", body)
    assert (status, reply["error"]["param"]) == (400, param), reply
