"""The pair priced before its first request (orchestrator.calibration): an orchestrator that runs its
pricing generations at start gives the first request that names no lookahead the k a warm server
gives it, shows the price in Describe, and leaves no session open; one that does not runs
DEFAULT_LOOKAHEAD until requests have measured the pair. The target is the tiny model slowed
(harness.SlowBackend: a step of a model far larger than its draft), the draft the same weights
unslowed: every draft is accepted and cheap, so the price is the most drafts a round, and a
request of 48 tokens that ran k = 4 would not (its text the same). Then it times the price's k
against plain rounds: a draft slower than its target leaves a request alone plain rounds, unless
the drafter drafts from an index (its gain is on text that copies)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import time

import pytest

from draft_service import drafters
from orchestrator.calibration import calibrate
from orchestrator.generation import ModelPair
from specdec.runtime.graphs import hf_backend
from specdec.v1 import model_pb2, orchestrator_pb2
from specdec.validation import DEFAULT_LOOKAHEAD, MEASURED_LOOKAHEAD
from specdec.weights.models import ModelSpec
from tests.harness import SlowBackend, pipeline


@pytest.fixture(scope="module")
def backends(tiny_models):
    spec = ModelSpec(tiny_models["target"], "cpu", "float32")
    return hf_backend(spec), SlowBackend(hf_backend(spec), 0.02)


def generate(stub) -> orchestrator_pb2.GenerateResponse:
    request = orchestrator_pb2.GenerateRequest(prompt="priced before it arrives", max_new_tokens=48)
    return stub.Generate(request, timeout=120)


@pytest.mark.parametrize("calibration_tokens", [0, 60])
def test_the_first_request_runs_the_warm_servers_k_once_the_pair_is_priced_at_start(backends, calibration_tokens):
    # sequential rounds: at every k the verify outweighs the drafts (overlapped, the price levels off
    # where the draft's k + 1 steps outlast the verify, and of equal prices takes the smallest k)
    with pipeline(*backends, lookahead=None, calibration_tokens=calibration_tokens, overlap=False) as p:
        info = p.orchestrator.Describe(model_pb2.DescribeRequest(), timeout=10)
        assert info.HasField("pricing") == bool(calibration_tokens)
        assert p.open_sessions() == (0, 0)  # the pricing generations closed theirs
        first, warm = generate(p.orchestrator), generate(p.orchestrator)
    assert warm.stats.lookahead == MEASURED_LOOKAHEAD  # every draft accepted, drafts cheap: the most
    assert first.token_ids == warm.token_ids  # greedy: the target's text whatever k
    if calibration_tokens:
        assert info.pricing.lookahead == first.stats.lookahead == warm.stats.lookahead
        assert info.pricing.acceptance > 0.9 and info.pricing.speedup > 1
        assert info.pricing.timed > 1 and not info.pricing.plain_alone  # timed against plain rounds: the drafts paid
        assert first.stats.draft_tokens > 0
    else:
        assert first.stats.lookahead == DEFAULT_LOOKAHEAD


@pytest.fixture(scope="module")
def slow_draft(tiny_models):
    """The same weights, the draft slowed far past its target: every draft accepted, none paying."""
    spec = ModelSpec(tiny_models["target"], "cpu", "float32")
    return SlowBackend(hf_backend(spec), 0.03), hf_backend(spec)


@pytest.mark.usefixtures("draft_awaited")
def test_a_request_alone_runs_plain_rounds_where_the_start_timed_them_faster(slow_draft):
    with pipeline(*slow_draft, lookahead=None, calibration_tokens=30) as p:
        info = p.orchestrator.Describe(model_pb2.DescribeRequest(), timeout=10)
        first = generate(p.orchestrator)
        assert p.sessions_freed_within(10)
        request = orchestrator_pb2.GenerateRequest(prompt="priced before it arrives", max_new_tokens=48)
        request.speculation.lookahead = 4  # named: the request's own k is kept
        named = p.orchestrator.Generate(request, timeout=120)
    if info.HasField("pricing"):  # a draft that never pays may leave the rounds unpriced: timed all the same
        assert 0 < info.pricing.timed < 1 and info.pricing.plain_alone
    assert first.stats.draft_tokens == 0 and named.stats.draft_tokens > 0
    assert first.token_ids == named.token_ids  # greedy: the target's text either way


@pytest.mark.usefixtures("draft_awaited")
def test_a_drafter_with_index_drafts_is_not_timed_against_plain_rounds(backends):
    # the model drafter declaring index drafts (as ngram, suffix and hybrid do): priced by its
    # forwards, as a hybrid's model half is, and not timed (timed, its drafts pay: above 1)
    assert drafters.NGRAM.indexed and drafters.suffix_drafter(hybrid=True).indexed and not drafters.MODEL.indexed
    indexed = dataclasses.replace(drafters.MODEL, indexed=True)
    with pipeline(*backends, lookahead=None, calibration_tokens=30, drafter=indexed) as p:
        info = p.orchestrator.Describe(model_pb2.DescribeRequest(), timeout=10)
        assert p.draft.Describe(model_pb2.DescribeRequest(), timeout=10).index_drafts
        first = generate(p.orchestrator)
    assert info.HasField("pricing") and info.pricing.timed == 0  # priced, not timed
    assert first.stats.draft_tokens > 0


def test_a_pair_without_a_draft_is_not_priced(tiny_backends):
    pair = ModelPair(draft=None, target=None, tokenizer=None, max_context=64, vocab_size=8, eos_token_ids=frozenset())
    assert calibrate(pair, 60) is None


def test_an_orchestrator_after_another_on_the_pair_takes_its_prices_from_the_file(backends, tmp_path):
    """`specdec serve` gives its orchestrator a prices file: a restarted one serves at once with
    what the first start measured (its verify line and its timing against plain rounds, to the last
    digit, which a pricing run of its own would not give; the draft's step is priced from the
    draft service's own start-up profile, as it is at every start), and a file it cannot read is
    priced over and rewritten, as is one that names anything but the measurements' own records."""
    prices = tmp_path / "prices"

    def pricing():
        with pipeline(*backends, lookahead=None, calibration_tokens=60, overlap=False, prices_file=str(prices)) as p:
            info = p.orchestrator.Describe(model_pb2.DescribeRequest(), timeout=10)
            assert p.open_sessions() == (0, 0)
            k = generate(p.orchestrator).stats.lookahead
        carried.append(info.pricing.carried_over)
        return (info.pricing.lookahead, info.pricing.verify_seconds, info.pricing.timed), k

    carried: list[bool] = []  # what each start's Describe says of where its prices came from
    first, k = pricing()
    assert prices.exists() and first[2] > 1 and k == first[0] == MEASURED_LOOKAHEAD
    again, k = pricing()
    assert again == first and k == first[0]  # taken, not measured again
    assert carried == [False, True]
    ran = tmp_path / "ran"

    class Foreign:  # a pickle that calls what it names as it loads
        def __reduce__(self):
            return os.mkdir, (str(ran),)

    for foreign in (b"cut short", pickle.dumps({"pair": Foreign(), "costs": {}})):
        prices.write_bytes(foreign)
        fresh, _ = pricing()
        assert fresh[0] == MEASURED_LOOKAHEAD and fresh[2] > 1 and fresh != first  # priced again
        assert pricing()[0] == fresh  # and written
    assert not ran.exists() and carried[2:] == [False, True, False, True]


def test_what_service_refines_is_kept_for_the_next_orchestrator(backends, tmp_path):
    """The prices are written again while the pair serves (every `prices_every` seconds): a successor
    takes what the first orchestrator's requests refined, not only what its start measured."""
    prices = tmp_path / "prices"
    every = 0.2

    def pricing(p) -> tuple:  # what is carried (the draft's step is priced from the draft service's own profile)
        info = p.orchestrator.Describe(model_pb2.DescribeRequest(), timeout=10).pricing
        return info.acceptance, info.verify_seconds, info.plain_token_seconds, info.timed

    settings = dict(lookahead=None, calibration_tokens=60, overlap=False, prices_file=str(prices), prices_every=every)
    with pipeline(*backends, **settings) as p:
        started = pricing(p)
        for _ in range(3):
            generate(p.orchestrator)
        time.sleep(3 * every)  # written since the last round
        refined = pricing(p)
    assert refined[1:3] != started[1:3]  # the requests' rounds moved the verify's and the plain step's costs
    with pipeline(*backends, **settings) as p:
        assert p.orchestrator.Describe(model_pb2.DescribeRequest(), timeout=10).pricing.carried_over
        assert pricing(p) == refined
