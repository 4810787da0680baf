"""The llama.cpp drafter (the embedded GGUF requantised to Q8_0, run natively) keeps the output exact.

- Greedy: with the fp32 target (its dequantisation), output equals target-only decoding.
- Sampling: against a stand-in target with a known Markov law on a few tokens of the same
  49152-token vocabulary, the loop's output passes the chi-square test. (The draft is the
  real GGUF model; it puts mass everywhere, so the rule must reject and recover correctly.)
"""

from __future__ import annotations

import numpy as np
import pytest

from draft_service.drafters import MODEL
from draft_service.server import DraftServicer
from orchestrator.loop import LoopConfig, SpeculativeLoop
from specdec import models
from specdec.backend import HFBackend
from specdec.engine import SessionEngine
from specdec.llamacpp import LlamaCppBackend
from specdec.sampling import SamplingParams
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


def test_distribution_through_the_loop(llama_draft):
    draft, backend = llama_draft
    support = [504, 260, 30, 28, 314]  # a handful of ordinary tokens of the SmolLM2 vocabulary
    small = np.random.default_rng(0).dirichlet(np.ones(len(support)), size=len(support))
    target = Direct(TargetServicer(SessionEngine(SupportMarkovBackend(backend.vocab_size, support, small), "target")))
    loop = run(draft, target, [support[0]], SamplingParams(temperature=1.0), 3000, k=2)
    tokens = [support[0], *loop.generated]
    index = {t: i for i, t in enumerate(support)}
    assert set(tokens) <= set(support)
    assert markov_chisquare([index[t] for t in tokens], small) > 1e-3
    assert loop.stats.accepted_tokens > 0
