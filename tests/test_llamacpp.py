"""The llama.cpp drafter (the embedded GGUF requantised to Q8_0, run natively) keeps the output exact.

- Greedy: with the fp32 target (its dequantisation), output equals target-only decoding.
- Sampling: against a stand-in target with a known Markov law on a few tokens of the same
  49152-token vocabulary, the loop's output passes the chi-square test. (The draft is the
  real GGUF model; it puts mass everywhere, so the rule must reject and recover correctly.)
- Under a JSON schema (structured output) its masked views draft the schema, greedy output
  the target alone's.
- Its numbers are a session's own: bit for bit the same whatever shares its steps.
- The hybrid's catch-up on a long prompt feeds its last window only (a cache started mid-prompt),
  greedy output the target alone's; a cache cut below its window holds nothing and goes on from there.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from draft_service.drafters import MODEL, suffix_drafter
from draft_service.server import DraftServicer
from orchestrator.loop import LoopConfig, SpeculativeLoop
from specdec.decoding.sampling import SamplingParams
from specdec.errors import ResourceExhausted
from specdec.runtime.backend import HFBackend
from specdec.runtime.engine import SessionEngine
from specdec.runtime.llamacpp import LlamaCppBackend
from specdec.runtime.prefix import reusable
from specdec.v1 import model_pb2
from specdec.weights import models
from target_service.server import TargetServicer
from tests.standins import Direct, SupportMarkovBackend
from tests.stats import markov_chisquare

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def llama_draft():
    backend = LlamaCppBackend(models.ModelSpec(models.DEFAULT_ALIAS))
    return Direct(DraftServicer(SessionEngine(backend, "draft"), MODEL)), backend


def run(draft, target, prompt, sampling, n, k, speculate=True):
    loop = SpeculativeLoop(draft, target, prompt, LoopConfig(sampling, n, lookahead=k, speculate=speculate, seed=9))
    for _ in loop.rounds():
        pass
    return loop


def test_greedy_equals_target_only(llama_draft):
    draft, backend = llama_draft
    target_backend = HFBackend(models.ModelSpec())
    assert backend.tokenizer_digest() == target_backend.tokenizer_digest()
    assert backend.vocab_size == target_backend.vocab_size
    target = Direct(TargetServicer(SessionEngine(target_backend, "target")))
    tok = target_backend.tokenizer
    for text in ("List three colours.", "Write a haiku about rain."):
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt = list(prompt["input_ids"] if not isinstance(prompt, list) else prompt)
        greedy = SamplingParams()
        spec = run(draft, target, prompt, greedy, 40, k=4)
        plain = run(draft, target, prompt, greedy, 40, k=4, speculate=False)
        assert spec.generated == plain.generated
        assert spec.stats.accepted_tokens / spec.stats.draft_tokens > 0.5


def test_greedy_under_a_json_schema_equals_target_only(llama_draft):
    """Structured output with the llama.cpp draft, whose logits are views of llama.cpp's buffers:
    masked (never in place), its drafts follow the schema and the output is the target alone's."""
    draft, backend = llama_draft
    target_backend = HFBackend(models.ModelSpec())
    target = Direct(TargetServicer(SessionEngine(target_backend, "target")))
    tok = target_backend.tokenizer
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 12}, "warm": {"type": "boolean"}},
        "required": ["colour", "warm"],
        "additionalProperties": False,
    }
    constraint = model_pb2.Constraint(json_schema=json.dumps(schema))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name a colour as JSON."}], add_generation_prompt=True
    )
    prompt = list(prompt["input_ids"] if not isinstance(prompt, list) else prompt)
    outputs = []
    for speculate in (True, False):
        stops = frozenset(target_backend.eos_token_ids)
        config = LoopConfig(
            SamplingParams(), 48, lookahead=4, speculate=speculate, constraint=constraint, stop_token_ids=stops
        )
        loop = SpeculativeLoop(draft, target, prompt, config)
        rounds = list(loop.rounds())
        assert rounds[-1].finish_reason == "stop"  # the schema's end
        outputs.append(loop.generated)
        if speculate:
            assert loop.stats.accepted_tokens / loop.stats.draft_tokens > 0.5 and loop.stats.draft_mask_seconds > 0
    assert outputs[0] == outputs[1]
    jsonschema.validate(json.loads(tok.decode(outputs[0])), schema)


def test_distribution_through_the_loop(llama_draft):
    draft, backend = llama_draft
    support = [504, 260, 30, 28, 314]  # a handful of ordinary tokens of the SmolLM2 vocabulary
    small = np.random.default_rng(0).dirichlet(np.ones(len(support)), size=len(support))
    target = Direct(TargetServicer(SessionEngine(SupportMarkovBackend(backend.vocab_size, support, small), "target")))
    loop = run(draft, target, [support[0]], SamplingParams(temperature=1.0), 2000, k=2)
    tokens = [support[0], *loop.generated]
    index = {t: i for i, t in enumerate(support)}
    assert set(tokens) <= set(support)
    assert markov_chisquare([index[t] for t in tokens], small) > 1e-3
    assert loop.stats.accepted_tokens > 0


def test_a_sessions_logits_do_not_depend_on_the_sessions_beside_it(llama_draft):
    """A session's logits bit for bit the same alone, batched with other sessions' steps and
    prompts, while others roll back and re-grow (their freed cells reused), after its own
    re-prefill in other blocks, and on any number of threads: the Leviathan rule reads the
    draft's probabilities, so a seed reproduces its text under load only if they are the
    load's no matter."""
    _, backend = llama_draft
    rng = np.random.default_rng(0)
    prompt = [1, 4093, 198, 30, 500, 700, 900, 2000, 28, 10, 11]
    steps = [12, 1, 4093, 198, 49, 77, 5]

    def session_logits(neighbours: int, churn: bool, prompt_blocks: int):
        mine, others = backend.new_cache(), [backend.new_cache() for _ in range(neighbours)]
        try:
            for other in others:
                backend.forward(other, rng.integers(0, 5000, int(rng.integers(5, 90))).tolist(), 1)
            for block in np.array_split(prompt, prompt_blocks):  # prefilled beside the others' prompts
                items = [(mine, block.tolist(), 1)]
                items += [(o, rng.integers(0, 5000, 70).tolist(), 1) for o in others[:1]]
                backend.forward_batch(items)
            out = []
            for token in steps:
                if churn:
                    for other in others:  # speculative tails rejected: cells freed below mine
                        backend.crop(other, int(rng.integers(1, other.length)))
                        backend.forward(other, rng.integers(0, 5000, int(rng.integers(1, 6))).tolist(), 1)
                items = [(c, [int(rng.integers(0, 5000))], 1) for c in others] + [(mine, [token], 1)]
                out.append(backend.forward_batch(items)[-1][0].clone())  # a view until the next forward
            return torch.stack(out)
        finally:
            for cache in [mine, *others]:
                backend.release(cache)

    alone = session_logits(0, False, 1)
    for neighbours, churn, blocks in [(7, False, 1), (7, True, 1), (3, True, 4), (0, False, 5)]:
        assert torch.equal(session_logits(neighbours, churn, blocks), alone), (neighbours, churn, blocks)
    # nor on the threads of its steps: the orchestrator chooses them by the load (specdec.runtime.placement)
    threads = torch.get_num_threads()
    try:
        for n in {1, 2, threads}:
            backend.set_threads(n)
            assert torch.equal(session_logits(3, True, 2), alone), n
    finally:
        backend.set_threads(threads)


def test_a_prompt_is_prefilled_one_ubatch_a_step(llama_draft, monkeypatch):
    """The draft feeds a prompt one 32-token ubatch a worker step, so a generation that ends
    cancels its draft's prefill after at most that much (orchestrator.loop: the cancelled open
    stops between two chunks, on cores the next request's prefill needs)."""
    _, backend = llama_draft
    fed = []
    forward_batch = backend.forward_batch

    def recording(items):
        fed.append([len(tokens) for _, tokens, _ in items])
        return forward_batch(items)

    monkeypatch.setattr(backend, "forward_batch", recording)
    engine = SessionEngine(backend, "draft")
    try:
        engine.open("long", list(range(1000, 1100)))  # 99 tokens before the last, which the next block feeds
    finally:
        engine.close("long")
        engine.stop()
    assert fed[:4] == [[32], [32], [32], [3]]


def test_a_service_opens_no_more_sessions_than_its_context_holds():
    """A context sized for 2 sessions (llamacpp.sessions_for: --max-kv-tokens / 4,096) under the
    default limits (64): the service says 2 (Describe, which the orchestrator's admission follows)
    and refuses a third open with its limit, opening nothing."""
    backend = LlamaCppBackend(models.ModelSpec(models.DEFAULT_ALIAS), sessions=2)
    draft = Direct(DraftServicer(SessionEngine(backend, "draft"), MODEL))
    assert draft.Describe(model_pb2.DescribeRequest()).max_sessions == 2
    for sid in ("one", "two"):
        draft.OpenSession(model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=[1, 2, 3]))
    with pytest.raises(ResourceExhausted, match="max_sessions 2"):
        draft.OpenSession(model_pb2.OpenSessionRequest(session_id="three", prompt_token_ids=[1, 2, 3]))
    assert draft.Describe(model_pb2.DescribeRequest()).open_sessions == 2


def test_a_hybrid_catches_up_on_the_last_window_of_a_long_prompt(llama_draft, monkeypatch):
    """The hybrid's model lacks a long prompt (its session opened without the prefill): its catch-up
    feeds the prompt's last `window` tokens and those generated since, from their positions on a
    fresh stream, not the whole prompt; the drafts it makes so keep greedy output the target alone's."""
    _, backend = llama_draft
    window = 48
    fed = []  # (first position, tokens) of each of the draft's forwards
    forward_batch = backend.forward_batch

    def recording(items):
        fed.extend((slot.length, len(tokens)) for slot, tokens, _ in items)
        return forward_batch(items)

    monkeypatch.setattr(backend, "forward_batch", recording)
    engine = SessionEngine(backend, "draft")
    draft = Direct(DraftServicer(engine, suffix_drafter(hybrid=True, window=window)))
    target_backend = HFBackend(models.ModelSpec())
    target = Direct(TargetServicer(SessionEngine(target_backend, "target")))
    document = "The store takes back any item within thirty days, with its receipt, for a refund. " * 12
    text = f"A document:\n\n{document}\n\nWrite a short poem about the sea."
    messages = [{"role": "user", "content": text}]
    prompt = target_backend.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if not isinstance(prompt, list) else prompt)
    assert len(prompt) > 4 * window
    try:
        spec = run(draft, target, prompt, SamplingParams(), 48, k=4)
        plain = run(draft, target, prompt, SamplingParams(), 48, k=4, speculate=False)
    finally:
        engine.stop()
    assert spec.generated == plain.generated
    assert fed, "the model drafted no round"
    assert min(position for position, _ in fed) >= len(prompt) - 1 - window  # nothing before the window
    assert sum(tokens for _, tokens in fed) < len(prompt) // 2
    assert spec.stats.accepted_tokens > 0


def test_a_cache_cut_below_its_window_holds_nothing_and_goes_on_from_there(llama_draft):
    """After a windowed catch-up the session's cache holds the prompt's last `window` positions and
    those generated since, and the prefix cache offers none of them (they lack the positions
    before); a rollback into the window keeps it, one below it leaves an empty stream that the next
    forward feeds from its position."""
    _, backend = llama_draft
    engine = SessionEngine(backend, "draft")
    engine.prefill_at_open = 8
    prompt = list(range(1000, 1200))

    def catch_up(session):
        engine.commit(session, list(range(2000, 2020)))  # 20 tokens generated since (the index's rounds)
        yield from engine.catch_up(session, 64)
        return session.window_start, len(session.cached), session.cache.length, reusable(session)

    def rollback(to_length: int):
        def run(session):
            engine.rollback(session, to_length)
            rows = yield engine.forward(session, [], 1)
            return session.window_start, session.cache.length, tuple(rows.shape)

        return run

    try:
        engine.open("window", prompt)
        assert engine.call("window", None, catch_up) == (200 - 64, 219, 219, 0)  # the prompt's last 64 and after
        assert engine.prefix.lookup(prompt)[1] == 0
        assert engine.call("window", None, rollback(150)) == (136, 150, (1, backend.vocab_size))
        assert engine.call("window", None, rollback(100)) == (99, 100, (1, backend.vocab_size))
    finally:
        engine.close("window")
        engine.stop()
