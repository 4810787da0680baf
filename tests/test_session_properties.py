"""Property-based test of the model services' session API (hypothesis, stateful).

Random sequences of open, propose, score, append, rollback, get and close (duplicate ids,
stale lengths, unknown and empty ids, out-of-vocabulary tokens, lengths past the context,
more sessions than the cap) go to a real draft and target service over loopback gRPC. A
reference model (a dict of committed token lists per service) predicts every status code;
after every step each service's sessions equal the model's, and after every sequence no
session is left open.
"""

from __future__ import annotations

import copy

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from draft_service.server import serve as serve_draft
from specdec.limits import SessionLimits
from specdec.v1 import model_pb2
from target_service.server import serve as serve_target
from tests.harness import model_stubs, open_sessions

pytestmark = pytest.mark.slow  # hypothesis: 60 random sequences through real services

Code = grpc.StatusCode
OK = Code.OK
CONTEXT = 12  # a short context, so that running past it is common
MAX_SESSIONS = 2  # fewer than the ids drawn, so that the cap is hit
VOCAB = 45
MAX_K = 32

ids = st.sampled_from(["a", "a", "a", "b", "c", ""])  # "a" is opened first, "c" finds the cap
sides = st.sampled_from(["draft", "target"])
tokens = st.lists(st.integers(-1, VOCAB), max_size=6).map(tuple)  # -1 and VOCAB are outside
drifts = st.sampled_from([0, 0, 0, -1, 1])  # mostly the true length, sometimes a stale one


@pytest.fixture(scope="module")
def stubs(tiny_backends):
    servers = []
    try:
        limits = SessionLimits(max_sessions=MAX_SESSIONS)
        for serve, name in ((serve_draft, "draft"), (serve_target, "target")):
            backend = copy.copy(tiny_backends[name])
            backend.max_context = CONTEXT  # the same model with a shorter limit
            servers.append(serve(backend, limits=limits))
        yield dict(zip(("draft", "target"), model_stubs(*(f"127.0.0.1:{port}" for _, port in servers)), strict=True))
    finally:
        for server, _ in servers:
            server.stop(None)


def outside(ids_) -> bool:
    return any(not 0 <= t < VOCAB for t in ids_)


class Sessions(RuleBasedStateMachine):
    stubs: dict  # set by the test

    def __init__(self):
        super().__init__()
        self.model: dict[str, dict[str, list[int]]] = {"draft": {}, "target": {}}

    # -- the reference model's verdicts, in the services' order of checks --------------------
    def stateful(self, side, sid, expected_length, growth) -> Code:
        """NOT_FOUND, FAILED_PRECONDITION (when the request carries a length), OUT_OF_RANGE."""
        committed = self.model[side].get(sid)
        if committed is None:
            return Code.NOT_FOUND
        if expected_length is not None and expected_length != len(committed):
            return Code.FAILED_PRECONDITION
        return Code.OUT_OF_RANGE if len(committed) + growth > CONTEXT else OK

    def call(self, expected: Code, side: str, method: str, request):
        try:
            response = getattr(self.stubs[side], method)(request, timeout=30)
        except grpc.RpcError as err:
            assert err.code() == expected, f"{side}.{method}: got {err.code()} ({err.details()}), model says {expected}"
            return None
        assert expected == OK, f"{side}.{method} succeeded, model says {expected}"
        return response

    def ref(self, side, sid, drift) -> model_pb2.SessionRef:
        length = len(self.model[side].get(sid, ())) + drift
        return model_pb2.SessionRef(session_id=sid, expected_length=length)

    # -- operations --------------------------------------------------------------------------
    @initialize(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6).map(tuple))
    def open_a_on_both(self, prompt):
        for side in self.model:
            self.open(side, "a", prompt)

    @rule(side=sides, sid=ids, prompt=tokens)
    def open(self, side, sid, prompt):
        sessions = self.model[side]
        if not sid or not prompt or outside(prompt):
            expected = Code.INVALID_ARGUMENT
        elif len(prompt) > CONTEXT:
            expected = Code.OUT_OF_RANGE
        elif sid in sessions:
            expected = Code.ALREADY_EXISTS
        elif len(sessions) >= MAX_SESSIONS:
            expected = Code.RESOURCE_EXHAUSTED
        else:
            expected = OK
        response = self.call(
            expected, side, "OpenSession", model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=prompt)
        )
        if response is not None:
            assert response.length == len(prompt)
            sessions[sid] = list(prompt)

    @rule(sid=ids, drift=drifts, append=tokens, k=st.integers(1, 4) | st.integers(-1, MAX_K + 1))
    def propose(self, sid, drift, append, k):
        if not 1 <= k <= MAX_K or outside(append):
            expected = Code.INVALID_ARGUMENT
        else:
            expected = self.stateful("draft", sid, len(self.model["draft"].get(sid, ())) + drift, len(append) + k)
        request = model_pb2.ProposeRequest(session=self.ref("draft", sid, drift), append_tokens=append, k=k)
        response = self.call(expected, "draft", "Propose", request)
        if response is not None:
            self.model["draft"][sid] += append
            assert response.length == len(self.model["draft"][sid])
            assert len(response.token_ids) == k and not outside(response.token_ids)

    @rule(sid=ids, drift=drifts, append=tokens, drafts=tokens)
    def score(self, sid, drift, append, drafts):
        if outside(append) or outside(drafts):
            expected = Code.INVALID_ARGUMENT
        else:
            length = len(self.model["target"].get(sid, ())) + drift
            expected = self.stateful("target", sid, length, len(append) + len(drafts))
        request = model_pb2.ScoreRequest(
            session=self.ref("target", sid, drift), append_tokens=append, draft_token_ids=drafts
        )
        response = self.call(expected, "target", "Score", request)
        if response is not None:
            self.model["target"][sid] += append
            assert response.length == len(self.model["target"][sid])
            assert len(response.argmax_token_ids) == len(drafts) + 1

    @rule(side=sides, sid=ids, drift=drifts, append=tokens)
    def append(self, side, sid, drift, append):
        if outside(append):
            expected = Code.INVALID_ARGUMENT
        else:
            expected = self.stateful(side, sid, len(self.model[side].get(sid, ())) + drift, len(append))
        request = model_pb2.AppendRequest(session=self.ref(side, sid, drift), token_ids=append)
        response = self.call(expected, side, "Append", request)
        if response is not None:
            self.model[side][sid] += append
            assert list(response.token_ids) == self.model[side][sid]

    @rule(side=sides, sid=ids, drop=st.integers(-2, 4))
    def rollback(self, side, sid, drop):
        committed = self.model[side].get(sid)
        to_length = len(committed or ()) - drop  # beyond the length when drop < 0
        if committed is None:
            expected = Code.NOT_FOUND
        else:
            expected = OK if 1 <= to_length <= len(committed) else Code.OUT_OF_RANGE
        request = model_pb2.RollbackRequest(session_id=sid, to_length=to_length)
        response = self.call(expected, side, "Rollback", request)
        if response is not None:
            del committed[to_length:]
            assert list(response.token_ids) == committed

    @rule(side=sides, sid=st.sampled_from(["a", "b", "c", "", "x", "y"]))  # closes "a" seldom
    def close(self, side, sid):
        expected = OK if sid in self.model[side] else Code.NOT_FOUND
        if self.call(expected, side, "CloseSession", model_pb2.CloseSessionRequest(session_id=sid)) is not None:
            del self.model[side][sid]

    # -- checks ------------------------------------------------------------------------------
    @invariant()
    def services_hold_what_the_model_holds(self):
        for side, sessions in self.model.items():
            assert open_sessions(self.stubs[side]) == len(sessions)
            for sid, committed in sessions.items():
                state = self.stubs[side].GetSession(model_pb2.GetSessionRequest(session_id=sid))
                assert list(state.token_ids) == committed

    def teardown(self):
        for side, sessions in self.model.items():
            for sid in list(sessions):
                self.stubs[side].CloseSession(model_pb2.CloseSessionRequest(session_id=sid))
            assert open_sessions(self.stubs[side]) == 0, f"{side} leaked a session"


def test_random_session_operations_match_the_reference_model(stubs):
    Sessions.stubs = stubs
    run_state_machine_as_test(
        Sessions,
        settings=settings(
            max_examples=60,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            database=None,
        ),
    )
