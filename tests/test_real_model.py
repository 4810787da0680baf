"""The embedded default pair (SmolLM2-135M-Instruct: fp32 target, llama.cpp Q8_0 draft) through the
three processes as `specdec generate` starts them, against in-process transformers. The target's
backend is the default's (`auto`): on this CPU, with llama-cpp-python, llama.cpp on the F32 GGUF
(the same weights), so greedy output may leave transformers' only at a near-tie of the two
libraries' rounding (NEAR_TIE, as in test_llamacpp_target)."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
import torch

from deploy.local import LocalPipeline, PipelineConfig
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights import models
from tests.harness import model_stubs, open_sessions, run_clients, run_sequentially

pytestmark = pytest.mark.real_model

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List five fruits that are red.",
    "Explain photosynthesis in two sentences.",
    "Summarise: The cat sat on the mat all afternoon, watching birds through the window.",
    "Translate 'good morning' into Spanish and German.",
    "Give three tips for writing clear emails.",
    "What is 12 times 13?",
]
NEW_TOKENS = 64
NEAR_TIE = 1e-3  # logit gap within which the two libraries' rounding may flip greedy


@pytest.fixture(scope="module")
def local():
    with LocalPipeline(PipelineConfig(), log=lambda msg: None) as p:
        yield p


@pytest.fixture(scope="module")
def pipeline(local):
    return orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(local.address))


@pytest.fixture(scope="module")
def reference():
    """In-process transformers greedy decoding of the fp32 target on each prompt."""
    model, tokenizer = models.load(models.ModelSpec())
    out = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        tokens = gen[0, len(ids) :].tolist()
        eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
                  else [model.generation_config.eos_token_id])  # fmt: skip
        if tokens and tokens[-1] in eos:
            tokens = tokens[:-1]  # the pipeline does not emit the stopping EOS
        out.append((ids, tokens))
    return model, out


def top2_gap(model, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_equals_in_process_transformers(pipeline, reference, k):
    model, cases = reference
    accepted = drafted = 0
    for prompt_ids, expected in cases:
        response = pipeline.Generate(
            orchestrator_pb2.GenerateRequest(
                token_ids=orchestrator_pb2.TokenIds(ids=prompt_ids),
                max_new_tokens=NEW_TOKENS,
                speculation=orchestrator_pb2.SpeculationParams(lookahead=k),
            )
        )
        got = list(response.token_ids)
        accepted += response.stats.accepted_tokens
        drafted += response.stats.draft_tokens
        if got == expected:
            continue
        i = next(
            (j for j, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected))
        )
        gap = top2_gap(model, prompt_ids + expected[:i])
        assert gap < NEAR_TIE, f"k={k}: diverged at token {i} where the target's top-2 gap is {gap:.2e}"
    assert drafted > 0 and accepted / drafted > 0.8


def test_seeded_sampling_is_reproducible(pipeline):
    def run(seed):
        return pipeline.Generate(
            orchestrator_pb2.GenerateRequest(
                prompt=PROMPTS[2],
                chat_template=True,
                max_new_tokens=32,
                seed=seed,
                sampling=model_pb2.SamplingParams(temperature=0.8, top_p=0.95),
            )  # fmt: skip
        ).token_ids

    first = run(1234)
    assert run(1234) == first
    assert run(4321) != first


def test_cli_json_reports_high_greedy_acceptance():
    """The default pair is matched: the Q8_0 draft is the target's weights requantised, so greedy
    drafts are mostly accepted (a wrong tokenizer or a broken draft accepts next to nothing).
    Not all: each weight moved by up to half a Q8_0 step, which flips near-ties, and this
    repetitive poem has many (0.64 on 2026-12-06, 0.75-0.77 earlier; 0.85-1.0 on the bench's 8
    prompts, mean 0.91). The Q8_0 draft alone (`--drafter llamacpp`): the hybrid's index chains,
    which copy the poem's repeats, read 0.55-0.57 here and more on a loaded machine (its kind of
    round is timed), so the default drafter's figure says less about the pair."""
    # a lookahead named: where the start timed plain rounds faster (a CPU whose draft step is half the
    # target's), a request alone that names none drafts nothing
    cmd = [sys.executable, "-m", "cli", "generate", "Write a short poem about the sea.", "--json", "--lookahead", "8"]
    cmd += ["--drafter", "llamacpp"]
    out = subprocess.run(cmd + ["--max-tokens", "64"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    stats = result["stats"]
    assert stats["acceptance_rate"] == pytest.approx(stats["accepted_tokens"] / stats["draft_tokens"])
    assert result["text"] and stats["acceptance_rate"] > 0.5, result


def test_4_concurrent_clients_equal_their_sequential_runs(local):
    prompts = ["Name three colours.", "What is 2 + 2?", "Say hello in French.", "Write a word that rhymes with cat."]
    per_client = [[orchestrator_pb2.GenerateRequest(prompt=p, chat_template=True, max_new_tokens=16)] for p in prompts]
    sequential = run_sequentially(local.address, per_client)
    assert run_clients(local.address, per_client) == sequential
    assert all(ids for outputs in sequential for ids in outputs)
    draft, target = model_stubs(local.addresses["draft"], local.addresses["target"], local.service_token)
    assert (open_sessions(draft), open_sessions(target)) == (0, 0)


def seeded(rule, seed: int, **speculation) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        prompt="Write a haiku about GPUs.",
        chat_template=True,
        max_new_tokens=40,
        seed=seed,
        sampling=model_pb2.SamplingParams(temperature=0.8, top_p=0.95),
        speculation=orchestrator_pb2.SpeculationParams(rule=rule, **speculation),
    )


def test_a_seed_reproduces_its_text_under_8_clients(local):
    """The default pair (llama.cpp Q8_0 draft, fp32 target), 8 clients at once. Invariant rule: every
    lookahead, adaptive or not, overlapped or not, gives the target alone's seeded text. Leviathan:
    the same request with a fixed lookahead gives the text it gives alone (before the llama.cpp
    draft's logits stopped depending on the sessions beside it, 7 of 8 such texts differed)."""
    invariant, leviathan = orchestrator_pb2.RULE_INVARIANT, orchestrator_pb2.RULE_LEVIATHAN
    [[alone]] = run_sequentially(local.address, [[seeded(invariant, 7, disabled=True)]])
    schedules = [{"lookahead": k, "overlap": k % 2 == 0} for k in (1, 4, 8)] + [{"lookahead": 6, "adaptive": True}]
    per_client = [[seeded(invariant, 7, **schedules[i % len(schedules)])] for i in range(8)]
    assert run_clients(local.address, per_client) == [[alone]] * 8
    [[once]] = run_sequentially(local.address, [[seeded(leviathan, 8, lookahead=4)]])
    assert run_clients(local.address, [[seeded(leviathan, 8, lookahead=4)]] * 8) == [[once]] * 8
    draft, target = model_stubs(local.addresses["draft"], local.addresses["target"], local.service_token)
    assert (open_sessions(draft), open_sessions(target)) == (0, 0)
