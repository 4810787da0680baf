"""Penalties, biases and min_p under speculation (specdec.decoding.penalties, specdec.decoding.sampling): the output
follows the target's law under the request's transform exactly, the draft held to the same one.

- the transform of a chain's and a tree's rows equals a naive one row at a time, and keeps -inf;
- greedy: token for token a reference penalised-argmax decode of the target alone, with chains,
  trees, overlapped rounds, adaptive lookahead and the invariant rule (Markov stand-ins, in process);
- sampling, through the three services: a law whose rows depend on the whole history (frequency and
  presence penalties), and a Markov one (logit_bias and min_p), each chi-square against the exact
  law, and failing when the target's rows skip the transform, or when the draft tells the rule
  other rows (its raw ones) than the penalised ones it drew from;
- over HTTP: the parameters are taken, and a value out of range is a 400 naming it.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from draft_service import drafters, proposer
from orchestrator.loop import LoopConfig, SpeculativeLoop
from specdec.decoding import penalties
from specdec.decoding.sampling import SamplingParams, probs_from_logits
from specdec.v1 import orchestrator_pb2
from target_service import scorer
from tests.harness import pipeline
from tests.standins import random_markov
from tests.stats import counts_chisquare
from tests.test_openai_api import MESSAGES, MODEL, client_for, http_pipeline
from tests.test_seeds import SUPPORT, TokenizedMarkov, run_all
from tests.test_structured import pair, unmasked_in_the_rule

PROMPT = [SUPPORT[0], SUPPORT[0], SUPPORT[3]]  # a repeated token: the repetition penalty sees it


def naive(row: np.ndarray, params: SamplingParams, prompt: list[int], history: list[int]) -> np.ndarray:
    """One row's penalised logits, token by token (the reference for specdec.decoding.penalties)."""
    out = row.astype(np.float64).copy()
    for t in range(len(out)):
        n = history.count(t)
        if params.repetition_penalty != 1.0 and (n or t in prompt):
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
        out[t] -= params.frequency_penalty * n + (params.presence_penalty if n else 0.0)
    for t, b in params.logit_bias:
        out[t] += b
    return out


ALL = SamplingParams(
    temperature=1.0,
    frequency_penalty=0.4,
    presence_penalty=-0.3,
    repetition_penalty=1.3,
    logit_bias=((2, 1.5), (5, -2.0)),
)


def test_a_chains_and_a_trees_rows_are_each_row_penalised_alone():
    rng = np.random.default_rng(0)
    logits = torch.tensor(rng.normal(size=(4, 8)), dtype=torch.float32)
    logits[1, 3] = -math.inf  # masked (a grammar): stays so
    prompt, generated, drafts = [1, 1, 6], [2, 2, 3], [3, 2, 7]
    out = penalties.penalize(logits, ALL, prompt, generated, penalties.chain(drafts, 4))
    for i in range(4):
        expected = naive(logits[i].numpy(), ALL, prompt, generated + drafts[:i])
        np.testing.assert_allclose(out[i].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert out[1, 3] == -math.inf
    tokens, parents = [3, 4, 2], [-1, -1, 0]  # two children of the root, a grandchild under the first
    assert penalties.paths(tokens, parents) == [[], [3], [4], [3, 2]]
    assert penalties.penalize(logits, SamplingParams(temperature=1.0), prompt, generated, [[]] * 4) is logits


def test_min_p_drops_what_is_below_its_share_of_the_most_probable():
    probs = probs_from_logits(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), SamplingParams(1.0, min_p=0.2))
    np.testing.assert_allclose(probs[0].numpy(), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], rtol=1e-6)


# -- greedy, in process ------------------------------------------------------------------------

GREEDY = SamplingParams(frequency_penalty=0.6, presence_penalty=0.2, repetition_penalty=1.2, logit_bias=((12, 0.4),))
SCHEDULES = [
    {"lookahead": 1},
    {"lookahead": 4},
    {"lookahead": 4, "overlap": True},
    {"lookahead": 6, "adaptive": True, "overlap": True},
    {"lookahead": 3, "tree_nodes": 6},
    {"lookahead": 4, "overlap": True, "rule": "invariant"},
]


def penalised_argmax_decode(backend, params: SamplingParams, n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        row = backend.forward([], PROMPT + out, 1)[0].numpy()
        out.append(int(np.argmax(naive(row, params, PROMPT, out))))
    return out


@pytest.mark.usefixtures("draft_awaited")
def test_greedy_is_the_penalised_argmax_of_the_target_alone():
    target_kernel = random_markov(len(SUPPORT), 51, alpha=0.3)
    draft, target = pair(target_kernel, 0.7 * target_kernel + 0.3 * random_markov(len(SUPPORT), 52))
    expected = penalised_argmax_decode(TokenizedMarkov(target_kernel), GREEDY, 100)
    plain = penalised_argmax_decode(TokenizedMarkov(target_kernel), SamplingParams(), 100)
    assert expected != plain  # the penalties change the text
    for schedule in SCHEDULES:
        loop = SpeculativeLoop(draft, target, PROMPT, LoopConfig(GREEDY, 100, seed=3, **schedule))
        for _ in loop.rounds():
            pass
        assert loop.generated == expected, schedule
        assert "adaptive" in schedule or loop.stats.accepted_tokens > 0, schedule


# -- the law through the three services ----------------------------------------------------------

HISTORY = SamplingParams(temperature=1.0, frequency_penalty=0.08, presence_penalty=0.7)
MARKOV = SamplingParams(temperature=0.8, min_p=0.15, logit_bias=((SUPPORT[1], 1.2), (SUPPORT[4], -100.0)))


def sample_through_the_services(
    target_kernel, draft_kernel, params: SamplingParams, tokens: int, trees: bool = True
) -> list[list[int]]:
    with pipeline(TokenizedMarkov(draft_kernel), TokenizedMarkov(target_kernel)) as p:
        requests_ = [
            orchestrator_pb2.GenerateRequest(
                token_ids=orchestrator_pb2.TokenIds(ids=PROMPT),
                sampling=params.to_proto(),
                seed=700 + i,
                max_new_tokens=tokens,
                speculation=orchestrator_pb2.SpeculationParams(
                    lookahead=3, overlap=bool(i % 2), tree_nodes=5 * (trees and i % 3 == 2)
                ),
            )
            for i in range(8)
        ]
        outputs = run_all(p.addresses["orchestrator"], requests_)
        assert p.sessions_freed_within(5)
    return outputs


def law_counts(outputs: list[list[int]], kernel: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Observed (last token, next token) counts, and their expected counts: at each position the
    exact law given the history, summed by last token (a Pearson statistic over them is at most
    chi-square: conservative under the law, and the wrong law is far off)."""
    index = {t: i for i, t in enumerate(SUPPORT)}
    size = len(SUPPORT)
    observed, expected = np.zeros((size, size)), np.zeros((size, size))
    support_bias = SamplingParams(
        **{**params.__dict__, "logit_bias": tuple((index[t], b) for t, b in params.logit_bias)}
    )
    for out in outputs:
        history = [index[t] for t in out]
        last = index[PROMPT[-1]]
        for i, token in enumerate(history):
            row = np.log(kernel[last])
            logits = naive(row, support_bias, [index[t] for t in PROMPT], history[:i])
            probs = probs_from_logits(torch.tensor(logits[None], dtype=torch.float32), params)[0].double().numpy()
            expected[last] += probs / probs.sum()
            observed[last, token] += 1
            last = token
    seen = observed.sum(axis=1) > 0  # a banned token is never a last token
    return observed[seen], expected[seen]


@pytest.fixture(scope="module")
def kernels():
    return random_markov(len(SUPPORT), 91), random_markov(len(SUPPORT), 92)


@pytest.mark.slow
@pytest.mark.parametrize("params", [HISTORY, MARKOV], ids=["penalties", "bias-min-p"])
def test_the_law_through_the_services_is_the_transformed_targets(kernels, params):
    target_kernel, draft_kernel = kernels
    outputs = sample_through_the_services(target_kernel, draft_kernel, params, 250)
    observed, expected = law_counts(outputs, target_kernel, params)
    assert counts_chisquare(observed, expected) > 1e-3
    plain_observed, plain_expected = law_counts(outputs, target_kernel, SamplingParams(temperature=params.temperature))
    assert counts_chisquare(plain_observed, plain_expected) < 1e-3  # the test tells the laws apart


@pytest.mark.slow
def test_a_target_that_skips_the_transform_fails_the_same_test(kernels, monkeypatch):
    untransformed = types.SimpleNamespace(
        session_rows=lambda session, logits, params, before: logits, chain=penalties.chain, paths=penalties.paths
    )
    monkeypatch.setattr(scorer, "penalties", untransformed)  # the target service runs in this process
    target_kernel, draft_kernel = kernels
    outputs = sample_through_the_services(target_kernel, draft_kernel, HISTORY, 250)
    observed, expected = law_counts(outputs, target_kernel, HISTORY)
    assert counts_chisquare(observed, expected) < 1e-3


@pytest.mark.slow
def test_a_draft_that_tells_the_rule_other_rows_than_it_drew_from_fails_the_same_test(kernels, monkeypatch):
    """The rule needs the draft's rows to be the law its proposals were drawn from: a draft that
    draws from its penalised rows but tells the rule its raw ones is caught."""
    wrong = drafters.Drafter(unmasked_in_the_rule, proposer.proposal_row, proposer.propose_tree)
    monkeypatch.setattr(drafters, "MODEL", wrong)  # the draft service runs in this process
    target_kernel, draft_kernel = kernels
    outputs = sample_through_the_services(target_kernel, draft_kernel, HISTORY, 250, trees=False)
    observed, expected = law_counts(outputs, target_kernel, HISTORY)
    assert counts_chisquare(observed, expected) < 1e-3


# -- over HTTP ---------------------------------------------------------------------------------


def test_the_openai_client_sends_them_and_a_bias_of_100_decides_greedy(tiny_backends):
    """A greedy answer under logit_bias +100 on one token is that token throughout; the penalties and
    min_p are taken (their laws: the tests above); out of range, each is a 400 naming it (test_openai_api)."""
    with http_pipeline(tiny_backends["draft"], tiny_backends["target"]) as (_, http):
        client = client_for(http)
        forced = 17
        reply = client.completions.create(
            model=MODEL, prompt="hello", max_tokens=12, temperature=0.0, logit_bias={str(forced): 100}
        )
        assert reply.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0.9,
            seed=4,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            extra_body={"min_p": 0.1, "repetition_penalty": 1.2},
        )
        assert chat.usage.completion_tokens > 0
    tok = tiny_backends["target"].tokenizer
    assert tok.encode(reply.choices[0].text, add_special_tokens=False) == [forced] * 12
