"""Pairs over one tokenizer whose output layers differ in size run; pairs whose tokenizers differ do not.

A padded pair (the Qwen2.5 case: one tokenizer, embeddings padded to 152064 rows on the 7B and
151936 on the 0.5B) is made here with tiny checkpoints: target and draft padded past the
character tokenizer's 45 tokens to 64 and 48 rows (tests/checkpoints.py, padded as transformers
pads them). Through the three services on loopback:
- greedy text equals the target's own `generate`, token for token, with chains and trees;
- sampled text never holds a token past the shared 48 rows (at a temperature where the target's
  padded rows would take a visible share of its mass), and the draft's rows the rule reads have 48;
- the law (chi-square with power, on a non-Llama architecture): Gemma 2 with final soft-capping,
  its attention output zeroed so its next token depends on the last alone and its law is a Markov
  kernel read off the model's own forward: the chains follow that kernel over the shared rows, and
  the same test rejects (p < 1e-3) the kernel without soft-capping (a backend that skipped it);
- a session asked for more rows than the model has, or none, is INVALID_ARGUMENT.
Tokenizers that differ are refused, naming the tokens (tests/test_orchestrator.py); so is a shared
tokenizer with tokens in target rows past the draft's output layer (the pair could not draw them).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from orchestrator.server import check_pair
from specdec.decoding.sampling import SamplingParams, probs_from_logits
from specdec.errors import FailedPrecondition
from specdec.limits import SessionLimits
from specdec.runtime.backend import HFBackend
from specdec.v1 import model_pb2, orchestrator_pb2
from specdec.weights.models import ModelSpec
from tests.checkpoints import tiny_checkpoint
from tests.conftest import make_tokenizer
from tests.harness import pipeline, status_of
from tests.stats import markov_chisquare

TOKENS = len(make_tokenizer())  # 45
TARGET_ROWS, DRAFT_ROWS = 64, 48
PROMPTS = [[1, 10, 7, 14, 14, 17, 39, 20, 21], [1, 22, 3, 19, 31]]
LIMITS = SessionLimits(max_sessions=4)  # a draft profiles its steps of 1-4 sessions at start, not 1-16


def backend(path) -> HFBackend:
    return HFBackend(ModelSpec(path, "cpu", "float32"))


def request(prompt, max_new_tokens=24, sampling=None, seed=0, **speculation) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=prompt),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        speculation=orchestrator_pb2.SpeculationParams(**speculation),
    )


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    root = tmp_path_factory.mktemp("padded")
    target = tiny_checkpoint(root / "target", "qwen2", extra_rows=TARGET_ROWS - TOKENS)
    draft = tiny_checkpoint(root / "draft", "qwen2", seed=1, like=target, extra_rows=DRAFT_ROWS - TOKENS)
    return target, draft


def test_a_padded_pair_decodes_as_the_target_and_draws_only_shared_rows(padded):
    from transformers import AutoModelForCausalLM

    target_path, draft_path = padded
    target, draft = backend(target_path), backend(draft_path)
    assert (target.vocab_size, draft.vocab_size) == (TARGET_ROWS, DRAFT_ROWS)
    assert target.tokenizer_digest() == draft.tokenizer_digest()
    model = AutoModelForCausalLM.from_pretrained(target_path).eval()
    with torch.no_grad():
        want = [
            model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None)[
                0, len(p) :
            ].tolist()
            for p in PROMPTS
        ]
    with pipeline(draft, target, limits=LIMITS) as p:
        for speculation in ({"lookahead": 4}, {"lookahead": 3, "tree_nodes": 6}):
            got = [list(p.orchestrator.Generate(request(prompt, **speculation)).token_ids) for prompt in PROMPTS]
            assert got == want, speculation
        # hot sampling: the target's 19 padded rows hold their share of its mass, were they drawable
        hot = model_pb2.SamplingParams(temperature=8.0)
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda s: p.orchestrator.Generate(request(PROMPTS[0], 48, hot, s)), range(8)))
        drawn = {t for out in outs for t in out.token_ids}
        assert max(drawn) < DRAFT_ROWS and len(drawn) > 20
        # the draft's rows are the shared size (what the rule reads on a rejection)
        p.draft.OpenSession(model_pb2.OpenSessionRequest(session_id="rows", prompt_token_ids=[1, 2], vocab_size=40))
        ref = model_pb2.SessionRef(session_id="rows", expected_length=2)
        p.draft.Propose(model_pb2.ProposeRequest(session=ref, k=2, sampling=hot, uniforms=[0.3, 0.6]))
        row = p.draft.ProposalRow(model_pb2.ProposalRowRequest(session=ref, position=1))
        assert row.vocab_size == 40
        p.draft.CloseSession(model_pb2.CloseSessionRequest(session_id="rows"))
        for bad in (TARGET_ROWS + 1, 0):
            opened = model_pb2.OpenSessionRequest(session_id="bad", prompt_token_ids=[1], vocab_size=bad)
            err = status_of(lambda o=opened: p.target.OpenSession(o))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocab_size" in err.details()
        assert p.sessions_freed_within(5)


def test_a_draft_whose_output_layer_is_the_larger_draws_only_the_targets_rows(tmp_path):
    """The draft padded past the target (137 rows against 73), its padded rows random and large (an
    untrained checkpoint's): every session it opens is over the target's 73 rows, the first one
    too (sent as a call that can be cancelled), so greedy is the target's `generate` and a sample
    draws nothing past them, with chains and trees."""
    from transformers import AutoModelForCausalLM

    target_rows, draft_rows = 73, 137
    target_path = tiny_checkpoint(tmp_path / "target", "qwen2", extra_rows=target_rows - TOKENS)
    draft_path = tiny_checkpoint(tmp_path / "draft", "qwen2", seed=1, like=target_path, extra_rows=draft_rows - TOKENS)
    target, draft = backend(target_path), backend(draft_path)
    with torch.no_grad():
        head = draft.model.get_output_embeddings().weight
        head[target_rows:] = 5.0 * torch.randn(
            draft_rows - target_rows, head.shape[1], generator=torch.Generator().manual_seed(3)
        )
    model = AutoModelForCausalLM.from_pretrained(target_path).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=24, do_sample=False, eos_token_id=None)
    with pipeline(draft, target, limits=LIMITS) as p:
        for speculation in ({"lookahead": 4}, {"lookahead": 3, "tree_nodes": 6}):
            got = p.orchestrator.Generate(request(PROMPTS[0], **speculation))
            assert list(got.token_ids) == want[0, len(PROMPTS[0]) :].tolist(), speculation
            hot = model_pb2.SamplingParams(temperature=2.0)
            outs = [p.orchestrator.Generate(request(PROMPTS[1], 32, hot, seed, **speculation)) for seed in range(3)]
            assert max(t for out in outs for t in out.token_ids) < target_rows
            assert sum(out.stats.draft_tokens for out in outs) > 0
        assert p.sessions_freed_within(5)


@pytest.mark.slow
def test_the_law_of_a_padded_soft_capped_pair_is_the_targets_over_the_shared_rows(tmp_path):
    target_path = tiny_checkpoint(tmp_path / "target", "gemma2", extra_rows=TARGET_ROWS - TOKENS)
    draft_path = tiny_checkpoint(tmp_path / "draft", "gemma2", seed=1, like=target_path, extra_rows=DRAFT_ROWS - TOKENS)
    target, draft = backend(target_path), backend(draft_path)
    for model in (target.model, draft.model):
        with torch.no_grad():  # attention adds nothing: the next token depends on the last one alone
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
    sampling = SamplingParams(temperature=1.0)
    with torch.inference_mode():
        hidden = target.model.model(torch.arange(TARGET_ROWS)[:, None]).last_hidden_state[:, -1]
        raw = target.model.lm_head(hidden).float()  # [rows, rows]: before the model's soft-capping
    cap = target.model.config.final_logit_softcapping
    shared = probs_from_logits((torch.tanh(raw / cap) * cap)[:DRAFT_ROWS, :DRAFT_ROWS], sampling).double().numpy()
    uncapped = probs_from_logits(raw[:DRAFT_ROWS, :DRAFT_ROWS], sampling).double().numpy()
    with pipeline(draft, target, limits=LIMITS) as p:
        proto = sampling.to_proto()
        starts = [3 + i % 40 for i in range(24)]
        with ThreadPoolExecutor(4) as pool:
            chains = list(
                pool.map(
                    lambda i: [
                        starts[i],
                        *p.orchestrator.Generate(request([starts[i]], 100, proto, i, lookahead=3)).token_ids,
                    ],
                    range(len(starts)),
                )
            )
    assert markov_chisquare(chains, shared) > 1e-3
    assert markov_chisquare(chains, uncapped) < 1e-3  # power: a backend that skipped soft-capping is caught


def test_tokens_the_target_draws_past_the_drafts_rows_are_refused():
    tokenizer = make_tokenizer()  # ids 0..44

    def info(rows):
        return model_pb2.ModelInfo(model_name=f"m{rows}", vocab_size=rows, tokenizer_digest="same")

    with pytest.raises(
        FailedPrecondition, match=r"token ids 42\.\.44 are rows of the target's output layer \(64 rows\)"
    ):
        check_pair(info(42), info(TARGET_ROWS), tokenizer, make_tokenizer)
    assert check_pair(info(DRAFT_ROWS), info(TARGET_ROWS), tokenizer, make_tokenizer) == DRAFT_ROWS
    # a draft short of the tokenizer beside a target as short: neither draws those ids; a larger draft: masked
    assert check_pair(info(42), info(42), tokenizer, make_tokenizer) == 42
    assert check_pair(info(TARGET_ROWS), info(DRAFT_ROWS), tokenizer, make_tokenizer) == DRAFT_ROWS


def test_a_backend_is_freed_once_unused(tiny_models):
    """Its tokenizer digest is kept on it, not in a process-wide cache that would keep every
    backend (and its model) alive: a test session makes hundreds."""
    import gc
    import weakref

    from specdec.weights.models import ModelSpec

    backend = HFBackend(ModelSpec(tiny_models["target"], "cpu", "float32"))
    assert backend.tokenizer_digest() == backend.tokenizer_digest()
    freed = weakref.ref(backend)
    del backend
    gc.collect()
    assert freed() is None
