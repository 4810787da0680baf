"""What a seed promises. The drafter-invariant rule (Gumbel-max coupling): the target alone's
text under any schedule. The Leviathan rule: one text for a fixed lookahead, under any load.

- its noise is counter-based: a token's noise at a position is a fixed function of (seed,
  position, token), the same whichever tokens are asked for, equal to its definition written
  with Python integers;
- coupled_tokens samples a row's law (chi-square over seeds) and never picks a zero-mass token;
  the same test rejects a plausible wrong coupling (noise added to the probabilities rather than
  their logarithms): that is the test's power;
- through the loop, seeded output is token for token the target alone's (speculation off), for
  any lookahead, adaptive or not, overlapped or not, drafted by a model or by n-gram lookup;
- through the three services on loopback, 8 clients at once with lookaheads 1..8 all give the
  target alone's text, and the output law is the target's (T = 0.7 with top-k and top-p), while
  the wrong coupling fails the same chi-square;
- Leviathan: 8 clients at once sending the same seeded request with a fixed lookahead all get
  the text it gets alone (no decision depends on timing, no service's numbers on the load).
(The embedded pair, llama.cpp draft included, is tested in test_real_model; `specdec chaos`
checks both rules' seeded streams under kills.)
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from draft_service.drafters import MODEL, NGRAM
from draft_service.server import DraftServicer
from orchestrator.loop import LoopConfig, SpeculativeLoop
from specdec.decoding import rule
from specdec.decoding.sampling import SamplingParams
from specdec.runtime.engine import SessionEngine
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from target_service.server import TargetServicer
from tests.conftest import make_tokenizer
from tests.harness import pipeline
from tests.standins import Direct, MarkovBackend, SupportMarkovBackend, random_markov
from tests.stats import counts_chisquare, markov_chisquare, transition_counts
from tests.test_loop import kernel_after_transform
from tests.test_overlap import near

MASK = (1 << 64) - 1


def reference_noise(seed: int, position: int, token: int) -> float:
    """rule.exponentials of one token, from its definition with Python integers (SplitMix64)."""

    def mix(x):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
        return x ^ (x >> 31)

    gamma = 0x9E3779B97F4A7C15
    key = mix((mix(seed & MASK) + position * gamma) & MASK)
    word = mix((token * gamma + key) & MASK)
    return -math.log(((word >> 11) + 0.5) * 2.0**-53)


def noise(seed: int, position: int, tokens) -> torch.Tensor:
    key = torch.tensor(rule._signed(rule.noise_key(seed, position)))
    return rule.exponentials(key, torch.as_tensor(tokens))


def test_noise_is_counter_based_and_matches_its_definition():
    for seed, position in [(0, 0), (1234, 57), (2**64 - 1, 10**6)]:
        tokens = [0, 1, 2, 49151, 7777]
        got = noise(seed, position, tokens).tolist()
        assert got == pytest.approx([reference_noise(seed, position, t) for t in tokens], rel=1e-12)
        # The noise of a token does not depend on which others are asked for.
        assert noise(seed, position, [7777]).item() == got[-1]
    whole = noise(5, 3, range(1000))
    assert not torch.equal(whole, noise(5, 4, range(1000))) and not torch.equal(whole, noise(6, 3, range(1000)))
    assert abs(whole.mean().item() - 1.0) < 0.1  # Exp(1)


def probs_plus_gumbel(probs: torch.Tensor, seed: int, positions: list[int]) -> list[int]:
    """A wrong coupling: over the row's support, Gumbel noise added to the probabilities, not to
    their logarithms."""
    tokens = torch.arange(probs.shape[1])
    gumbel = [-torch.log(noise(seed, p, tokens)) for p in positions]
    scores = [torch.where(row > 0, row.double() + g, -math.inf) for row, g in zip(probs, gumbel, strict=True)]
    return [int(torch.argmax(score)) for score in scores]


def test_coupled_tokens_sample_the_row():
    row = torch.tensor([[0.5, 0.25, 0.15, 0.0, 0.07, 0.03]])
    expected = 20_000 * row[0].double().numpy()

    def counts(coupling):
        drawn = [coupling(row, seed, [17])[0] for seed in range(20_000)]
        return np.bincount(drawn, minlength=6)

    exact = counts(rule.coupled_tokens)
    assert exact[3] == 0  # zero mass is never drawn
    assert counts_chisquare(exact[None], expected[None] / expected.sum()) > 1e-3
    assert counts_chisquare(counts(probs_plus_gumbel)[None], expected[None] / expected.sum()) < 1e-3


def test_rows_are_sampled_alike_one_by_one_and_together():
    probs = torch.softmax(3 * torch.randn(6, 300, generator=torch.Generator().manual_seed(0)), dim=-1)
    together = rule.coupled_tokens(probs, 9, list(range(40, 46)))
    assert together == [rule.coupled_tokens(probs[i : i + 1], 9, [40 + i])[0] for i in range(6)]


# -- through the loop, in process ---------------------------------------------------------------


def pair(target_probs, draft_probs, drafter=MODEL):
    target = TargetServicer(SessionEngine(MarkovBackend(target_probs), "target"))
    draft = DraftServicer(SessionEngine(MarkovBackend(draft_probs), "draft"), drafter)
    return Direct(draft), Direct(target)


def generate(draft, target, n: int, seed: int, **config) -> tuple[list[int], object]:
    sampling = SamplingParams(temperature=0.7, top_k=8, top_p=0.95)
    loop_config = LoopConfig(sampling, n, seed=seed, rule="invariant", **config)
    loop = SpeculativeLoop(draft, target, [0, 1, 2], loop_config)
    for _ in loop.rounds():
        pass
    return loop.generated, loop.stats


SCHEDULES = [
    {"lookahead": 1},
    {"lookahead": 4},
    {"lookahead": 8},
    {"lookahead": 4, "overlap": True},
    {"lookahead": 8, "overlap": True},
    {"lookahead": 6, "adaptive": True},
    {"lookahead": 6, "adaptive": True, "overlap": True},
]


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.slow
@pytest.mark.parametrize("drafter", [MODEL, NGRAM], ids=["model", "ngram"])
def test_seeded_output_is_the_target_alones_under_any_schedule(drafter):
    target_probs = random_markov(12, 51, alpha=0.3)
    draft, target = pair(target_probs, near(target_probs, 52), drafter)
    for seed in (1, 2):
        alone, _ = generate(draft, target, 300, seed, speculate=False)
        for schedule in SCHEDULES:
            spec, stats = generate(draft, target, 300, seed, **schedule)
            assert spec == alone, schedule
            assert 0 < stats.accepted_tokens < stats.draft_tokens, schedule  # drafted, and rejections happened
    other, _ = generate(draft, target, 300, 3, speculate=False)
    assert other != alone  # the seed matters


@pytest.mark.slow
def test_the_distribution_through_the_loop_is_the_targets():
    target_probs, draft_probs = random_markov(6, 61), random_markov(6, 62)
    draft, target = pair(target_probs, draft_probs)
    tokens, stats = generate(draft, target, 8_000, seed=7, lookahead=4, overlap=True)
    kernel = kernel_after_transform(target_probs, SamplingParams(temperature=0.7, top_k=8, top_p=0.95))
    assert markov_chisquare([2, *tokens], kernel) > 1e-3
    assert 0 < stats.accepted_tokens < stats.draft_tokens


# -- through the three services on loopback -----------------------------------------------------

SUPPORT = [10, 11, 12, 13, 14, 15]  # the Markov chain's tokens, in the character tokenizer's vocabulary


class TokenizedMarkov(SupportMarkovBackend):
    """A Markov law over SUPPORT with the tests' character tokenizer, so an orchestrator can
    serve it (it fetches the tokenizer from the target)."""

    def __init__(self, kernel):
        self.tokenizer = make_tokenizer()
        super().__init__(len(self.tokenizer), SUPPORT, kernel)

    def tokenizer_files(self):
        from specdec.runtime.backend import tokenizer_files

        return tokenizer_files(self.tokenizer)


def request(
    seed: int, max_tokens: int, lookahead: int | None = None, rule=orchestrator_pb2.RULE_INVARIANT, **spec_fields
) -> orchestrator_pb2.GenerateRequest:
    spec = orchestrator_pb2.SpeculationParams(rule=rule, **spec_fields)
    if lookahead is None:
        spec.disabled = True
    else:
        spec.lookahead = lookahead
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=[SUPPORT[0]]),
        sampling=model_pb2.SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
        seed=seed,
        max_new_tokens=max_tokens,
        speculation=spec,
    )


def run_all(address: str, requests) -> list[list[int]]:
    stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda r: list(stub.Generate(r, timeout=300).token_ids), requests))


@pytest.mark.slow
def test_eight_clients_at_once_give_the_target_alones_text(tiny_backends):
    with pipeline(tiny_backends["draft"], tiny_backends["target"]) as p:
        address = p.addresses["orchestrator"]
        for seed in (11, 12):
            [alone] = run_all(address, [request(seed, 48)])
            together = run_all(address, [request(seed, 48, k) for k in (1, 2, 3, 4, 5, 6, 7, 8)])
            assert all(out == alone for out in together)
            adaptive = run_all(address, [request(seed, 48, 8, adaptive=True, overlap=bool(i % 2)) for i in range(8)])
            assert all(out == alone for out in adaptive)
        assert p.sessions_freed_within(5)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_leviathan_with_a_fixed_lookahead_gives_one_text_under_load(tiny_backends, overlap):
    leviathan = orchestrator_pb2.RULE_LEVIATHAN
    with pipeline(tiny_backends["draft"], tiny_backends["target"]) as p:
        address = p.addresses["orchestrator"]
        for seed, k in ((21, 4), (22, 8)):
            [alone] = run_all(address, [request(seed, 64, k, leviathan, overlap=overlap)])
            assert run_all(address, [request(seed, 64, k, leviathan, overlap=overlap)] * 8) == [alone] * 8
        assert p.sessions_freed_within(5)


@pytest.fixture(scope="module")
def markov_kernels():
    return random_markov(len(SUPPORT), 71), random_markov(len(SUPPORT), 72)


def chains_through_the_services(target_kernel, draft_kernel, n_chains: int, tokens: int) -> np.ndarray:
    with pipeline(TokenizedMarkov(draft_kernel), TokenizedMarkov(target_kernel)) as p:
        outputs = run_all(p.addresses["orchestrator"], [request(100 + i, tokens, 4) for i in range(n_chains)])
        assert p.sessions_freed_within(5)
    index = {t: i for i, t in enumerate(SUPPORT)}
    return transition_counts([[0, *(index[t] for t in out)] for out in outputs], len(SUPPORT))


def support_kernel(kernel) -> np.ndarray:
    return kernel_after_transform(kernel, SamplingParams(temperature=0.7, top_k=4, top_p=0.9))


@pytest.mark.slow
def test_the_output_law_through_the_services_is_the_targets(markov_kernels):
    target_kernel, draft_kernel = markov_kernels
    counts = chains_through_the_services(target_kernel, draft_kernel, 8, 1000)
    assert counts_chisquare(counts, support_kernel(target_kernel)) > 1e-3
    assert counts_chisquare(counts, support_kernel(draft_kernel)) < 1e-3


@pytest.mark.slow
def test_a_wrong_coupling_through_the_services_fails_the_same_test(markov_kernels, monkeypatch):
    monkeypatch.setattr(rule, "coupled_tokens", probs_plus_gumbel)  # the services run in this process
    target_kernel, draft_kernel = markov_kernels
    counts = chains_through_the_services(target_kernel, draft_kernel, 8, 500)
    assert counts_chisquare(counts, support_kernel(target_kernel)) < 1e-3
