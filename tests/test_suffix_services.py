"""The suffix and hybrid drafters through the three services on loopback: exactness, the pair's
prices, seeds, the store of earlier answers and whose requests it drafts."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from draft_service import suffix
from draft_service.drafters import Drafter, suffix_drafter
from draft_service.ngram import TokenizerBackend
from draft_service.proposer import proposal_row
from draft_service.server import serve as serve_draft
from orchestrator.generation import RequestDefaults
from orchestrator.loop import FREE_START
from orchestrator.server import connect
from orchestrator.server import serve as serve_orchestrator
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.validation import MAX_LOOKAHEAD
from specdec.weights.models import ModelSpec
from target_service.server import serve as serve_target
from tests.conftest import make_tokenizer

# -- through the three services on loopback -----------------------------------------------------

REPEATING = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick"
PLAIN = "hello world, write me a short poem"
TOKENIZER = make_tokenizer()


@contextlib.contextmanager
def services(tiny_models, tiny_backends, kind: str, pair_out: list | None = None, lookahead: int | None = 4):
    """(stub, the draft's stores) of three services with the suffix or hybrid drafter, the server's
    default `lookahead`; `pair_out` gets the orchestrator's ModelPair."""
    if kind == "suffix":
        backend = TokenizerBackend(ModelSpec(tiny_models["draft"], "cpu", "float32"))
    else:
        backend = tiny_backends["draft"]
    drafter = suffix_drafter(hybrid=kind == "hybrid")
    draft_server, draft_port = serve_draft(backend, drafter=drafter)
    target_server, target_port = serve_target(tiny_backends["target"])
    pair = connect(f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}")
    if pair_out is not None:
        pair_out.append(pair)
    orch_server, orch_port = serve_orchestrator(pair, defaults=RequestDefaults(lookahead=lookahead))
    try:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{orch_port}"))
        yield stub, drafter.propose.__self__.stores
    finally:
        for server in (orch_server, draft_server, target_server):
            server.stop(None)


def request(ids, n=60, sampling=None, seed=None, rule=orchestrator_pb2.RULE_UNSPECIFIED, disabled=False, **history):
    spec = orchestrator_pb2.SpeculationParams(rule=rule, disabled=disabled, **history)
    if not disabled:
        spec.lookahead = 4
    out = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=ids),
        sampling=sampling or model_pb2.SamplingParams(),
        max_new_tokens=n,
        speculation=spec,
    )
    if seed is not None:
        out.seed = seed
    return out


def ids(text: str) -> list[int]:
    return TOKENIZER(text)["input_ids"]


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_through_the_services(tiny_models, tiny_backends, kind):
    with services(tiny_models, tiny_backends, kind) as (stub, _):
        accepted = 0
        for prompt in (REPEATING, PLAIN):
            on = stub.Generate(request(ids(prompt)))
            off = stub.Generate(request(ids(prompt), disabled=True))
            assert list(on.token_ids) == list(off.token_ids) and off.stats.draft_tokens == 0
            accepted += on.stats.accepted_tokens
        assert accepted > 0
        sampling = model_pb2.SamplingParams(temperature=0.8)
        for rule in (orchestrator_pb2.RULE_LEVIATHAN, orchestrator_pb2.RULE_INVARIANT):
            out = stub.Generate(request(ids(REPEATING), 50, sampling, seed=7, rule=rule))
            assert out.stats.generated_tokens == 50 or out.finish_reason == "stop"
            if rule == orchestrator_pb2.RULE_INVARIANT:
                alone = stub.Generate(request(ids(REPEATING), 50, sampling, seed=7, rule=rule, disabled=True))
                assert list(out.token_ids) == list(alone.token_ids)


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_the_pair_prices_a_hybrids_model_by_its_model_rounds(tiny_models, tiny_backends, kind):
    """The hybrid's index rounds (no forward; a copy's acceptance) count for the target's verify
    only: its model's drafts are priced by the model's rounds, each token a step's (PairCosts
    .index_apart; counted as the model's, 18 code requests priced the default pair's draft token
    at 0.1 ms and k = 16). The suffix drafter, an index alone, is priced by its index rounds."""
    pair = []
    with services(tiny_models, tiny_backends, kind, pair, lookahead=None) as (stub, _):
        index = 0
        for prompt in (REPEATING, PLAIN, REPEATING):
            unset = request(ids(prompt), 80)
            unset.speculation.ClearField("lookahead")  # the measured default: its rounds price the pair
            index += stub.Generate(unset).stats.index_proposals
        costs = pair[0].costs
        assert index > 0 and costs.index_apart == (kind == "hybrid")
        if kind == "hybrid":  # the drafts priced are its model's: a token a forward, none free
            assert 0 < costs.draft_tokens <= costs.draft_steps + 1e-9, (costs.draft_tokens, costs.draft_steps)
        else:
            assert costs.draft_steps == 0 and costs.draft_tokens > 0


@pytest.mark.usefixtures("draft_awaited")
def test_a_seeded_leviathan_sample_replays_its_text_without_the_store(tiny_models, tiny_backends):
    """A Leviathan sample's text depends on its drafts: drafted from the store, a seed's second run
    would draft the first one's answer and sample other text. A seeded sample neither drafts from
    the store nor enters it; a greedy request (its text the target's whatever drafts it) does."""
    sampling = model_pb2.SamplingParams(temperature=0.8)
    with services(tiny_models, tiny_backends, "suffix") as (stub, stores):
        texts = [list(stub.Generate(request(ids(PLAIN), 40, sampling, seed=7)).token_ids) for _ in range(3)]
        assert texts[0] == texts[1] == texts[2] and stores.tokens == 0
        stub.Generate(request(ids(PLAIN), 40))
        stub.Generate(request(ids(PLAIN), 40))  # its proposals enter the closed greedy session
        assert stores.tokens > 0
        for _ in range(20):  # unseeded samples draft from the store (rejections read their rows)
            out = stub.Generate(request(ids(PLAIN), 40, sampling))
            assert out.stats.generated_tokens == 40 or out.finish_reason == "stop"


def test_only_a_seeded_leviathan_sample_opens_a_reproducible_draft_session(tiny_models, tiny_backends, monkeypatch):
    """The orchestrator asks for drafts that are a function of the tokens (OpenSessionRequest.reproducible)
    where the text depends on them and a seed must replay it: a seeded Leviathan sample; not an
    unseeded one, not a greedy one, not the invariant rule's (their texts are the target's own)."""
    seen = []
    choose = suffix.HybridDrafter.choose

    def recording(self, session, assumed, k):
        seen.append(session.reproducible)
        return choose(self, session, assumed, k)

    monkeypatch.setattr(suffix.HybridDrafter, "choose", recording)
    sampling = model_pb2.SamplingParams(temperature=0.8)
    cases = [
        (request(ids(PLAIN), 40, sampling, seed=7), True),
        (request(ids(PLAIN), 40, sampling), False),
        (request(ids(PLAIN), 40, seed=7), False),
        (request(ids(PLAIN), 40, sampling, seed=7, rule=orchestrator_pb2.RULE_INVARIANT), False),
    ]
    with services(tiny_models, tiny_backends, "hybrid") as (stub, _):
        for sent, wanted in cases:
            seen.clear()
            stub.Generate(sent)
            assert set(seen) <= {wanted}, sent
            assert seen or not wanted  # a Leviathan sample at a fixed k waits for its draft: it drafts


@pytest.mark.usefixtures("draft_awaited")
def test_a_request_that_names_no_lookahead_takes_the_index_s_chains(tiny_models, tiny_backends):
    """A greedy request that names no lookahead (nor does the server) lets the suffix drafter size its
    chains up to MAX_LOOKAHEAD (ProposeRequest.free_lookahead; FREE_START until a chain is accepted
    whole), past the k the pair prices; a Leviathan sample keeps k (its uniforms are k): the text is
    the target alone's either way."""
    asked = []  # (k, free_lookahead, tokens proposed)
    index = suffix_drafter()

    def propose(engine, session, k, *args, free=0):
        tokens, probs = index.propose(engine, session, k, *args, free=free)
        asked.append((k, free, len(tokens)))
        return tokens, probs

    backend = TokenizerBackend(ModelSpec(tiny_models["draft"], "cpu", "float32"))
    draft_server, draft_port = serve_draft(
        backend, drafter=Drafter(propose, proposal_row, index.propose_tree, free=True)
    )
    target_server, target_port = serve_target(tiny_backends["target"])
    pair = connect(f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}")
    orch_server, orch_port = serve_orchestrator(pair)
    try:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{orch_port}"))
        greedy = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=ids(REPEATING)), max_new_tokens=80
        )
        on = stub.Generate(greedy)
        off = stub.Generate(request(ids(REPEATING), 80, disabled=True))
        assert list(on.token_ids) == list(off.token_ids) and on.stats.accepted_tokens > 0
        frees = [free for _, free, _ in asked if free]
        assert frees[0] <= FREE_START and max(frees) <= MAX_LOOKAHEAD
        assert any(n > k for k, _, n in asked), asked  # chains past the priced k
        asked.clear()
        sampled = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=ids(REPEATING)),
            max_new_tokens=40,
            sampling=model_pb2.SamplingParams(temperature=0.8),
            seed=3,
        )
        stub.Generate(sampled)
        assert asked and all(free == 0 and n <= k for k, free, n in asked), asked
    finally:
        for server in (orch_server, draft_server, target_server):
            server.stop(None)


@pytest.mark.usefixtures("draft_awaited")
def test_a_resent_request_drafts_from_the_store(tiny_models, tiny_backends):
    """An agent resends its request with a little more: what the target wrote the first time,
    which the new session has not seen, is drafted from the store. (The tiny target's greedy
    text loops, which its own tokens predict: a seeded sample under the invariant rule, the same
    token at a position whatever the schedule, is text the session's own tokens do not predict.)"""
    prompt = ids("zebra")  # its sample at seed 2 meets no EOS for 150 tokens
    sampling = model_pb2.SamplingParams(temperature=1.0)
    rule = orchestrator_pb2.RULE_INVARIANT
    with services(tiny_models, tiny_backends, "suffix") as (stub, store):
        first = stub.Generate(request(prompt, 120, sampling, seed=2, rule=rule))
        resent = prompt + list(first.token_ids)[:10]
        assert store.tokens == 0
        again = stub.Generate(request(resent, 100, sampling, seed=2, rule=rule))
        assert store.tokens >= len(prompt) + 100  # the first session entered the store
        assert list(again.token_ids) == list(first.token_ids)[10:110]
    with services(tiny_models, tiny_backends, "suffix") as (stub, _):  # an empty store
        fresh = stub.Generate(request(resent, 100, sampling, seed=2, rule=rule))
    assert list(fresh.token_ids) == list(again.token_ids)
    assert again.stats.accepted_tokens > fresh.stats.accepted_tokens + 30, (again.stats, fresh.stats)


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_a_prediction_drafts_the_answer_and_changes_no_token(tiny_models, tiny_backends, kind):
    """SpeculationParams.prediction (OpenAI's predicted outputs): a request that predicts its answer
    (here the same request's earlier answer, as text) drafts it from its first round, and its text is
    the one it has without (the invariant rule: the same token at a position whatever the drafts;
    greedy: the target's own). No store: history false."""
    prompt = ids("zebra")  # its sample at seed 2 meets no EOS for 150 tokens
    sampling = model_pb2.SamplingParams(temperature=1.0)
    rule = orchestrator_pb2.RULE_INVARIANT
    with services(tiny_models, tiny_backends, kind) as (stub, stores):
        alone = stub.Generate(request(prompt, 100, sampling, seed=2, rule=rule, history=False))
        text = TOKENIZER.decode(list(alone.token_ids))
        predicted = stub.Generate(request(prompt, 100, sampling, seed=2, rule=rule, history=False, prediction=text))
        assert list(predicted.token_ids) == list(alone.token_ids)
        assert predicted.stats.accepted_tokens > alone.stats.accepted_tokens + 30, (predicted.stats, alone.stats)
        greedy = stub.Generate(request(prompt, 60, history=False))
        wrong = stub.Generate(request(prompt, 60, history=False, prediction=TOKENIZER.decode(ids(PLAIN) * 4)))
        assert list(wrong.token_ids) == list(greedy.token_ids)
        assert stores.tokens == 0
        with pytest.raises(grpc.RpcError) as err:  # longer than the model's context
            stub.Generate(request(prompt, 10, prediction="zebra " * 100_000))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "speculation.prediction of" in err.value.details()


@pytest.mark.usefixtures("draft_awaited")
def test_earlier_answers_draft_only_the_same_clients_requests(tiny_models, tiny_backends):
    """The store is kept per client (credential and salt): the request resent under another salt
    drafts nothing from the first answer, under the same salt it does, and with history false it
    neither drafts from it nor is kept. The text is the same in all three (drafts are point masses)."""
    prompt = ids("zebra")
    sampling = model_pb2.SamplingParams(temperature=1.0)
    rule = orchestrator_pb2.RULE_INVARIANT
    with services(tiny_models, tiny_backends, "suffix") as (stub, stores):
        first = stub.Generate(request(prompt, 120, sampling, seed=2, rule=rule, history_salt="alice"))
        resent = prompt + list(first.token_ids)[:10]
        other = stub.Generate(request(resent, 100, sampling, seed=2, rule=rule, history_salt="bob"))
        same = stub.Generate(request(resent, 100, sampling, seed=2, rule=rule, history_salt="alice"))
        off = stub.Generate(request(resent, 100, sampling, seed=2, rule=rule, history_salt="alice", history=False))
        kept = stores.tokens
        stub.Generate(request(resent, 10, sampling, seed=2, rule=rule, history=False))
        assert stores.tokens == kept and stores.scopes() == 2  # alice and bob; nothing from the opted out
    texts = [list(r.token_ids) for r in (other, same, off)]
    assert texts[0] == texts[1] == texts[2] == list(first.token_ids)[10:110]
    for without in (other, off):
        assert same.stats.accepted_tokens > without.stats.accepted_tokens + 30, (same.stats, without.stats)


def test_history_scope_names_the_client_and_the_salt():
    """orchestrator.server.client_identity: a verified client certificate tells clients apart, a
    bearer token does not (one for all); the scope a digest of it and the salt; "" when opted out."""
    from orchestrator.generation import history_scope
    from orchestrator.server import client_identity

    class Context:
        def __init__(self, auth):
            self.auth = auth

        def auth_context(self):
            return self.auth

    a, b = (client_identity(Context({"x509_pem_cert": [pem]})) for pem in (b"PEM A", b"PEM B"))
    anonymous = client_identity(Context({}))
    assert a != b and anonymous == "" and a.startswith("cert:")
    spec = orchestrator_pb2.SpeculationParams
    scopes = {history_scope(who, spec(history_salt=salt)) for who in (a, b, anonymous) for salt in ("", "x")}
    assert len(scopes) == 6 and "" not in scopes
    assert history_scope(a, spec(history=True)) == history_scope(a, spec())
    assert history_scope(a, spec(history=False, history_salt="x")) == ""
