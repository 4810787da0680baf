"""The compiled backend (specdec.compiled) computes what the eager one does.

- ragged batched forwards (batches padded to a bucket, widths padded to a bucket, a prefill
  chunk past the largest width run eager on the same cache, a rollback then a different
  continuation, the capacity doubling) give the logits the eager backend gives;
- greedy generation through the loop with the compiled target equals the eager target's, and
  sessions generating together equal each alone;
- sampling through the loop with the compiled target follows its law (chi-square): the tiny
  target's attention output is zeroed, so its next token depends on the last token alone and
  its law is a Markov kernel we can read off the model;
- the embedded default target, compiled, decodes greedily as it does eager (real_model).
Few buckets and tiny models keep the compiles short.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from draft_service.drafters import MODEL
from draft_service.server import DraftServicer
from orchestrator.loop import LoopConfig, SpeculativeLoop
from specdec import models
from specdec.backend import HFBackend
from specdec.compiled import CompiledBackend, bucket
from specdec.engine import SessionEngine
from specdec.models import ModelSpec
from specdec.sampling import SamplingParams, probs_from_logits
from target_service.server import TargetServicer
from tests.conftest import make_tiny_model
from tests.standins import Direct, MarkovBackend, random_markov
from tests.stats import markov_chisquare

# One bucket each: every short forward pads to 4 rows x 8 columns (one variant per capacity).
WIDTHS, BATCHES = (8,), (4,)


@pytest.fixture(scope="module")
def compiled(tiny_models):
    return CompiledBackend(ModelSpec(tiny_models["target"], "cpu", "float32"), WIDTHS, BATCHES)


def test_forwards_equal_eager(tiny_models, compiled):
    eager = HFBackend(ModelSpec(tiny_models["target"], "cpu", "float32"))
    rng = np.random.default_rng(0)
    slots = {b: [b.new_cache() for _ in range(3)] for b in (eager, compiled)}
    steps = [
        [(0, 7, 2), (1, 3, 1), (2, 8, 3)],  # prefills of different lengths: a pad row, pad columns
        [(2, 2, 2), (0, 1, 1)],  # blocks of different widths, a row left out
        [(1, 4, 1)],
        [(0, 5, 5), (1, 20, 1)],  # a block past the largest width: this batch runs eager
        [(2, 3, 3)],
        [(0, 300, 1)],  # past the first capacity (256): it doubles, one more variant
        [(0, 6, 6), (2, 1, 1)],
    ]
    for step in steps:
        items = [(i, rng.integers(3, 40, size=width).tolist(), n) for i, width, n in step]
        got = {b: b.forward_batch([(slots[b][i], tokens, n) for i, tokens, n in items]) for b in slots}
        for a, c in zip(got[eager], got[compiled], strict=True):
            torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-4)
        if step == steps[2]:  # rollback is a length: crop, then a different continuation
            for b in slots:
                b.crop(slots[b][2], 5)
    assert [s.length for s in slots[compiled]] == [s.length for s in slots[eager]]
    assert compiled.variants == {(4, 8, 256), (4, 8, 512)}
    for b in slots:
        for slot in slots[b]:
            b.release(slot)


def test_buckets():
    assert [bucket(n, (1, 2, 4, 8, 33)) for n in (1, 3, 5, 8, 9, 33, 34)] == [1, 4, 8, 8, 33, 33, None]


def run(draft, target, prompt, sampling, n, k=4, seed=9):
    loop = SpeculativeLoop(draft, target, prompt, LoopConfig(sampling, n, lookahead=k, seed=seed))
    for _ in loop.rounds():
        pass
    return loop.generated


def services(draft_backend, target_backend):
    return (
        Direct(DraftServicer(SessionEngine(draft_backend, "draft"), MODEL)),
        Direct(TargetServicer(SessionEngine(target_backend, "target"))),
    )


def test_greedy_generation_equals_eager_alone_and_together(tiny_models, tiny_backends, compiled):
    prompts = [[1, 5, 6, 7], [1, 9], [1] + list(range(3, 30))]
    draft, eager = services(tiny_backends["draft"], tiny_backends["target"])
    expected = [run(draft, eager, p, SamplingParams(), 40, k=1 + i) for i, p in enumerate(prompts)]
    draft, target = services(tiny_backends["draft"], compiled)
    alone = [run(draft, target, p, SamplingParams(), 40, k=1 + i) for i, p in enumerate(prompts)]
    together: list = [None] * len(prompts)

    def generate(i):
        together[i] = run(draft, target, prompts[i], SamplingParams(), 40, k=1 + i)

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert alone == expected
    assert together == expected


def test_sampling_through_the_loop_follows_the_compiled_target(tmp_path):
    path = make_tiny_model(tmp_path / "markov", seed=4)
    spec = ModelSpec(path, "cpu", "float32")
    backend = CompiledBackend(spec, WIDTHS, BATCHES)
    with torch.no_grad():  # attention adds nothing: the next token depends on the last one alone
        for layer in backend.model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        backend.model.lm_head.weight.mul_(0.1)  # spread the law over the vocabulary
    vocab = backend.vocab_size
    with torch.inference_mode():
        logits = backend.model(torch.arange(vocab)[:, None]).logits[:, -1].float()
    sampling = SamplingParams(temperature=1.0)
    kernel = probs_from_logits(logits, sampling).double().numpy()
    draft_probs = random_markov(vocab, 5)
    draft, target = services(MarkovBackend(draft_probs), backend)
    # 15 chains of 200 tokens (the tiny model's context is 512): each crosses capacity 256
    chains = [[3, *run(draft, target, [3], sampling, 200, k=3, seed=11 + i)] for i in range(15)]
    assert markov_chisquare(chains, kernel) > 1e-3
    assert markov_chisquare(chains, draft_probs) < 1e-3
    assert backend.variants


@pytest.mark.real_model
def test_default_target_compiled_decodes_as_eager():
    eager = HFBackend(models.ModelSpec())
    compiled = CompiledBackend(models.ModelSpec(), widths=(8,), batches=(1,))
    tok = eager.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "List three colours."}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if not isinstance(prompt, list) else prompt)
    outputs = []  # the eager target drafts: every draft accepted, verify blocks 5 wide (bucket 8)
    for target_backend in (eager, compiled):
        draft_service, target = services(eager, target_backend)
        outputs.append(run(draft_service, target, prompt, SamplingParams(), 48, k=4))
    assert outputs[0] == outputs[1]
    assert compiled.variants == {(1, 8, 256)}


def test_flags():
    from cli import options
    from cli.main import build_parser

    parse = build_parser().parse_args
    assert options.pipeline_config(parse(["generate", "hi"])).target_compile is None  # by device
    assert options.pipeline_config(parse(["generate", "hi", "--no-target-compile"])).target_compile is False
    assert options.pipeline_config(parse(["serve", "--target-compile"])).target_compile is True
    assert parse(["target-service", "--compile"]).compile is True
    assert parse(["draft-service", "--no-compile"]).compile is False
