"""The model services over real gRPC on loopback, hosting tiny random Llama models."""

from __future__ import annotations

import grpc
import pytest
import torch

from draft_service.server import serve as serve_draft
from orchestrator.loop import LoopConfig, SpeculativeLoop
from specdec.decoding.sampling import SamplingParams
from specdec.serving.service import CHANNEL_OPTIONS
from specdec.v1 import model_pb2, model_pb2_grpc
from target_service.server import serve as serve_target

GREEDY = model_pb2.SamplingParams()


@pytest.fixture(scope="module")
def addresses(tiny_backends):
    draft_server, draft_port = serve_draft(tiny_backends["draft"])
    target_server, target_port = serve_target(tiny_backends["target"])
    yield f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}"
    draft_server.stop(None)
    target_server.stop(None)


@pytest.fixture(scope="module")
def stubs(addresses):
    draft = model_pb2_grpc.DraftServiceStub(grpc.insecure_channel(addresses[0], CHANNEL_OPTIONS))
    target = model_pb2_grpc.TargetServiceStub(grpc.insecure_channel(addresses[1], CHANNEL_OPTIONS))
    return draft, target


def ref(sid, length):
    return model_pb2.SessionRef(session_id=sid, expected_length=length)


def status_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_session_lifecycle(stubs):
    draft, target = stubs
    for stub in (draft, target):
        opened = stub.OpenSession(model_pb2.OpenSessionRequest(session_id="life", prompt_token_ids=[3, 4, 5]))
        assert opened.length == 3
        state = stub.GetSession(model_pb2.GetSessionRequest(session_id="life"))
        assert list(state.token_ids) == [3, 4, 5] and state.cached_length == 2
        dup = model_pb2.OpenSessionRequest(session_id="life", prompt_token_ids=[3])
        assert status_of(lambda s=stub, d=dup: s.OpenSession(d)) == grpc.StatusCode.ALREADY_EXISTS
        assert stub.Describe(model_pb2.DescribeRequest()).open_sessions == 1
        stub.CloseSession(model_pb2.CloseSessionRequest(session_id="life"))
        assert stub.Describe(model_pb2.DescribeRequest()).open_sessions == 0
        close = model_pb2.CloseSessionRequest(session_id="life")
        assert status_of(lambda s=stub, c=close: s.CloseSession(c)) == grpc.StatusCode.NOT_FOUND
        get = model_pb2.GetSessionRequest(session_id="life")
        assert status_of(lambda s=stub, g=get: s.GetSession(g)) == grpc.StatusCode.NOT_FOUND


def score(target, sid, length, drafts, append=()):
    return target.Score(
        model_pb2.ScoreRequest(
            session=ref(sid, length), append_tokens=list(append), draft_token_ids=drafts, sampling=GREEDY
        )
    )


def test_rollback_is_idempotent_and_restores_the_cache(stubs):
    _, target = stubs
    prompt = [3, 10, 7, 14, 14, 17]
    target.OpenSession(model_pb2.OpenSessionRequest(session_id="rb", prompt_token_ids=prompt))
    first = score(target, "rb", 6, [20, 21, 22])  # fills the cache with a speculative tail
    target.Append(model_pb2.AppendRequest(session=ref("rb", 6), token_ids=[20, 21, 22, 23]))
    once = target.Rollback(model_pb2.RollbackRequest(session_id="rb", to_length=6))
    twice = target.Rollback(model_pb2.RollbackRequest(session_id="rb", to_length=6))
    assert once == twice
    assert list(once.token_ids) == prompt and once.cached_length == 5
    again = score(target, "rb", 6, [20, 21, 22])
    assert list(again.argmax_token_ids) == list(first.argmax_token_ids)
    # ... and equal to a fresh session's view of the same tokens
    target.OpenSession(model_pb2.OpenSessionRequest(session_id="fresh", prompt_token_ids=prompt))
    assert list(score(target, "fresh", 6, [20, 21, 22]).argmax_token_ids) == list(first.argmax_token_ids)
    bad = model_pb2.RollbackRequest(session_id="rb", to_length=7)
    assert status_of(lambda: target.Rollback(bad)) == grpc.StatusCode.OUT_OF_RANGE
    for sid in ("rb", "fresh"):
        target.CloseSession(model_pb2.CloseSessionRequest(session_id=sid))


def test_expected_length_mismatch_is_rejected(stubs):
    draft, target = stubs
    for stub in (draft, target):
        stub.OpenSession(model_pb2.OpenSessionRequest(session_id="drift", prompt_token_ids=[5, 6, 7]))
    propose = model_pb2.ProposeRequest(session=ref("drift", 4), k=2, sampling=GREEDY)
    assert status_of(lambda: draft.Propose(propose)) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_of(lambda: score(target, "drift", 2, [8])) == grpc.StatusCode.FAILED_PRECONDITION
    append = model_pb2.AppendRequest(session=ref("drift", 9), token_ids=[1])
    assert status_of(lambda: target.Append(append)) == grpc.StatusCode.FAILED_PRECONDITION
    for stub in (draft, target):  # nothing changed
        assert stub.GetSession(model_pb2.GetSessionRequest(session_id="drift")).length == 3
        stub.CloseSession(model_pb2.CloseSessionRequest(session_id="drift"))


def run_loop(draft, target, prompt, k, n, speculate=True, after_round=None):
    config = LoopConfig(sampling=SamplingParams(), max_new_tokens=n, lookahead=k, speculate=speculate)
    loop = SpeculativeLoop(draft, target, prompt, config)
    for _ in loop.rounds():
        if after_round:
            after_round(loop)
    return loop


def test_caches_hold_the_committed_prefix_after_each_round(stubs):
    draft, target = stubs
    prompt = [3, 10, 7, 14, 14, 17]
    checked = []

    def check(loop):
        loop.flush()  # deliver the commit that would ride on the next request
        committed = prompt + loop.generated
        n = len(committed)
        for stub in (draft, target):
            state = stub.GetSession(model_pb2.GetSessionRequest(session_id=loop.session_id))
            assert list(state.token_ids) == committed
            # Only committed tokens are cached: at most all but the last (fed next round); the
            # draft may lag one more when every draft was accepted (its last draft was never fed).
            assert n - 2 <= state.cached_length <= n - 1
        # The cache content is right: next-token predictions equal a fresh session's.
        fresh = f"fresh-{n}"
        target.OpenSession(model_pb2.OpenSessionRequest(session_id=fresh, prompt_token_ids=committed))
        assert score(target, loop.session_id, n, []).argmax_token_ids == score(target, fresh, n, []).argmax_token_ids
        target.CloseSession(model_pb2.CloseSessionRequest(session_id=fresh))
        draft.OpenSession(model_pb2.OpenSessionRequest(session_id=fresh, prompt_token_ids=committed))
        ours, theirs = (
            draft.Propose(model_pb2.ProposeRequest(session=ref(sid, n), k=2, sampling=GREEDY)).token_ids
            for sid in (loop.session_id, fresh)
        )
        assert ours == theirs
        draft.CloseSession(model_pb2.CloseSessionRequest(session_id=fresh))
        checked.append(n)

    loop = run_loop(draft, target, prompt, k=3, n=40, after_round=check)
    assert len(checked) == loop.stats.rounds and loop.stats.accepted_tokens < loop.stats.draft_tokens


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_pipeline_equals_target_only(stubs, tiny_backends, k):
    draft, target = stubs
    prompt = [1, 10, 7, 14, 14, 17, 39]
    spec = run_loop(draft, target, prompt, k=k, n=60)
    plain = run_loop(draft, target, prompt, k=k, n=60, speculate=False)
    assert spec.generated == plain.generated
    assert 0 < spec.stats.accepted_tokens < spec.stats.draft_tokens  # both paths of the rule ran
    # target-only through the service equals in-process transformers greedy decoding
    model = tiny_backends["target"].model
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False, eos_token_id=None)
    assert plain.generated == out[0, len(prompt) :].tolist()


def test_sampling_rows_cross_only_when_needed(stubs):
    draft, target = stubs
    sampling = model_pb2.SamplingParams(temperature=1.0, top_k=8)
    for stub in (draft, target):
        stub.OpenSession(model_pb2.OpenSessionRequest(session_id="rows", prompt_token_ids=[3, 4]))
    proposal = draft.Propose(
        model_pb2.ProposeRequest(session=ref("rows", 2), k=3, sampling=sampling, uniforms=[0.1, 0.5, 0.9])
    )
    assert len(proposal.token_ids) == len(proposal.token_probs) == 3
    row = draft.ProposalRow(model_pb2.ProposalRowRequest(session=ref("rows", 2), position=1))
    assert len(row.indices) == 8 * 4  # top-k 8: a sparse row of 8 int32 ids
    scores = target.Score(
        model_pb2.ScoreRequest(
            session=ref("rows", 2),
            draft_token_ids=proposal.token_ids,
            sampling=sampling,
            draft_token_probs=proposal.token_probs,
            accept_uniforms=[0.5, 0.5, 0.5],
        )
    )
    assert len(scores.draft_token_target_probs) == 3 and 0 <= scores.row_position <= 3
    assert len(scores.row.values) == 8 * 4 and not scores.argmax_token_ids
    for stub in (draft, target):
        stub.CloseSession(model_pb2.CloseSessionRequest(session_id="rows"))


def test_the_draft_reports_its_batched_step_and_the_orchestrator_prices_by_it(stubs, addresses):
    """A draft service times its batched decode step for 1..16 sessions when it starts and says so
    in Describe (step_costs); a target does not. The scratch caches it used are gone, and the
    orchestrator's pair starts its adaptive lookahead's draft prices from the profile."""
    from orchestrator.server import connect
    from specdec.runtime.startup import PROFILE_SESSIONS

    draft, target = stubs
    info = draft.Describe(model_pb2.DescribeRequest())
    assert [c.sessions for c in info.step_costs] == list(PROFILE_SESSIONS)
    assert all(c.seconds > 0 for c in info.step_costs)
    assert (info.open_sessions, info.kv_tokens) == (0, 0)
    assert not target.Describe(model_pb2.DescribeRequest()).step_costs
    pair = connect(*addresses)
    assert pair.costs.draft_profile == {c.sessions: c.seconds for c in info.step_costs}


def test_a_port_in_use_is_refused():
    """A second server on a port in use fails to start: under gRPC's default SO_REUSEPORT it bound
    too, and clients reached either at random."""
    from specdec.serving.service import make_server

    first, port = make_server("127.0.0.1", 0)
    first.start()
    try:
        with pytest.raises(RuntimeError, match="bind"):
            make_server("127.0.0.1", port)
    finally:
        first.stop(None)
