"""The step stream (specdec.serving.steps, orchestrator.step_link): one message carries a step's calls of
every session, and every session keeps its own outcome.

On a service: the calls of one message run in one batched step; each call keeps its own status,
deadline and cancellation; a broken stream fails its calls in flight (UNAVAILABLE) and the next
call opens a new one. Through the three services with 64 sessions at once: greedy outputs are the
target's, a Leviathan seed's text is the one it gets alone, the output law is the target's, a
session that fails mid-step or is cancelled or expires leaves every other unchanged, and one step
mixes lookaheads 0..16, a draft tree and a grammar.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from deploy import hosting
from deploy.configs import ModelServiceConfig
from orchestrator.scheduler import SCHEDULER
from orchestrator.step_link import StepError, StepLink
from specdec.limits import AdmissionLimits, SessionLimits
from specdec.runtime.standin import StandinBackend
from specdec.v1 import model_pb2, model_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc
from tests.harness import SlowBackend, pipeline, wait_until
from tests.stats import counts_chisquare, transition_counts
from tests.test_seeds import SUPPORT, TokenizedMarkov, request, support_kernel

TARGET = "specdec.v1.TargetService"
MANY = 64
LIMITS = SessionLimits(max_sessions=2 * MANY + 8)
ADMISSION = AdmissionLimits(max_concurrent=MANY + 8, max_queue=MANY)


# -- on one service ---------------------------------------------------------------------------


@pytest.fixture
def target_service():
    """A stand-in target (its forward sleeps 20 ms) served on loopback; (address, server)."""
    server, port = hosting.serve_model(ModelServiceConfig("target", limits=LIMITS), StandinBackend("standin:20"))
    try:
        yield f"127.0.0.1:{port}", server
    finally:
        server.stop(None)


def open_sessions(address: str, n: int) -> list[str]:
    stub = model_pb2_grpc.TargetServiceStub(grpc.insecure_channel(address))
    ids = [f"s{i}" for i in range(n)]
    for sid in ids:
        stub.OpenSession(model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=[5, 6, 7]), timeout=10)
    return ids


def score(sid: str, length: int = 3, call_id: int = 0, timeout: float = 0.0, **fields) -> model_pb2.StepCall:
    ref = model_pb2.SessionRef(session_id=sid, expected_length=length)
    return model_pb2.StepCall(id=call_id, timeout=timeout, score=model_pb2.ScoreRequest(session=ref, **fields))


def send(
    address: str, messages: list[list[model_pb2.StepCall]], expect: int, pause: float = 0.0, replies: list | None = None
) -> dict[int, model_pb2.StepResult]:
    """Send each message's calls (ids numbered here) on one stream, `pause` seconds apart; the first
    `expect` results, by id (`replies`, if given, gets each reply's ids, sorted)."""
    channel = grpc.insecure_channel(address)
    steps = channel.stream_stream(
        f"/{TARGET}/Steps",
        request_serializer=model_pb2.StepCalls.SerializeToString,
        response_deserializer=model_pb2.StepResults.FromString,
    )
    ids = iter(range(1, 10_000))
    for message in messages:
        for call in message:
            call.id = call.id or next(ids)
    results: dict[int, model_pb2.StepResult] = {}
    done = threading.Event()

    def outgoing():
        for i, message in enumerate(messages):
            if i:
                time.sleep(pause)
            yield model_pb2.StepCalls(calls=message)
        done.wait(30)  # the stream stays open until the results came

    for reply in steps(outgoing(), timeout=30):
        results.update((r.id, r) for r in reply.results)
        if replies is not None:
            replies.append(sorted(r.id for r in reply.results))
        if len(results) >= expect:
            done.set()
            break
    channel.close()
    return results


def test_the_calls_of_one_message_run_in_one_step(target_service):
    address, _ = target_service
    sessions = open_sessions(address, 8)
    results = send(address, [[score(sid) for sid in sessions]], 8)
    assert all(r.code == 0 for r in results.values())
    # one batched forward ran all eight: each Score reports the step it ran in
    assert [r.score.step_sessions for r in results.values()] == [8] * 8


def test_each_call_keeps_its_own_status(target_service):
    address, _ = target_service
    [sid] = open_sessions(address, 1)
    propose = model_pb2.StepCall(propose=model_pb2.ProposeRequest(session=model_pb2.SessionRef(session_id=sid), k=1))
    calls = [
        score(sid, append_tokens=[9]),  # fine: commits a token
        score("nobody"),  # no such session
        score(sid, length=9),  # a length the session does not have (it runs after the first: 4)
        score(sid, length=4, draft_token_ids=[10_000]),  # a token outside the vocabulary
        propose,  # not a target's call
    ]
    results = send(address, [calls], len(calls))
    codes = [grpc.StatusCode.OK.value[0]] + [
        c.value[0]
        for c in (
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.UNIMPLEMENTED,
        )
    ]
    assert [results[i].code for i in range(1, 6)] == codes
    assert results[3].details and results[5].details
    assert results[1].score.length == 4  # the good call ran: its session went on
    # the stream and the session still serve
    again = send(address, [[score(sid, length=4, append_tokens=[9])]], 1)
    assert again[1].code == 0 and again[1].score.length == 5


def test_a_score_that_ends_its_session_closes_it(target_service):
    """ScoreRequest.close_session: the session is gone once the Score answers (on the stream and
    unary); a Score that fails leaves it open; the tokens are those of the same Score without it."""
    address, _ = target_service
    kept, ended, failed = open_sessions(address, 3)
    calls = [
        score(kept, decode_steps=4),
        score(ended, decode_steps=4, close_session=True),
        score(failed, length=9, decode_steps=4, close_session=True),  # a length it does not have
    ]
    results = send(address, [calls], 3)
    assert [results[i].code for i in (1, 2)] == [0, 0]
    assert results[3].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert list(results[2].score.argmax_token_ids) == list(results[1].score.argmax_token_ids)  # the same prompt
    stub = model_pb2_grpc.TargetServiceStub(grpc.insecure_channel(address))

    def is_open(sid: str) -> bool:
        try:
            stub.GetSession(model_pb2.GetSessionRequest(session_id=sid), timeout=10)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND
            return False
        return True

    assert [is_open(sid) for sid in (kept, ended, failed)] == [True, False, True]
    last = model_pb2.ScoreRequest(session=model_pb2.SessionRef(session_id=kept, expected_length=3), close_session=True)
    assert stub.Score(last, timeout=10).length == 3  # the decode's tokens were never committed
    assert not is_open(kept)


def test_a_call_past_its_timeout_or_cancelled_is_dropped():
    slow, port = hosting.serve_model(
        ModelServiceConfig("target", limits=LIMITS), SlowBackend(StandinBackend("standin:0"), 0.5)
    )
    try:
        slow_address = f"127.0.0.1:{port}"
        a, b, c = open_sessions(slow_address, 3)
        late = score(a, timeout=0.05)
        cancelled = score(b, call_id=7)
        results = send(slow_address, [[late, cancelled, score(c)], [model_pb2.StepCall(id=7, cancel=True)]], 3)
        assert results[1].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert results[7].code == grpc.StatusCode.CANCELLED.value[0]
        assert results[2].code == 0
    finally:
        slow.stop(None)


def test_a_call_cancelled_before_its_message_left_never_runs(target_service):
    """A scheduler task's call waits for the step's flush; cancelled before it (a speculation-cache
    branch no longer wanted), it is never sent: its cancel must not leave alone, find nothing on the
    service and let the call run when it comes (which took the draft for a whole proposal)."""
    address, _ = target_service
    [sid] = open_sessions(address, 1)
    link = StepLink(grpc.insecure_channel(address), TARGET)

    def appending(token: int) -> model_pb2.ScoreRequest:
        return model_pb2.ScoreRequest(
            session=model_pb2.SessionRef(session_id=sid, expected_length=3), append_tokens=[token]
        )

    def task():
        dropped = link.future("Score", "score", appending(8), timeout=10)
        dropped.cancel()
        time.sleep(0.3)  # whatever the link sends alone meanwhile has left
        return dropped.cancelled(), link.future("Score", "score", appending(9), timeout=10).result()

    try:
        cancelled, after = SCHEDULER.run(task)
        assert cancelled
        assert after.length == 4  # the session held 3 tokens when it came: the cancelled one never ran
    finally:
        link.close()


def test_a_close_leaves_before_the_next_step():
    """A call that runs no forward (a close) answers between two steps of the others, not after
    the next one: its result leaves in a message of its own while a decode of another session is
    still running."""
    slow, port = hosting.serve_model(
        ModelServiceConfig("target", limits=LIMITS), SlowBackend(StandinBackend("standin:0"), 0.6)
    )
    try:
        address = f"127.0.0.1:{port}"
        decoding, closing = open_sessions(address, 2)
        close = model_pb2.StepCall(id=2, close_session=model_pb2.CloseSessionRequest(session_id=closing))
        messages = []  # the close is sent 0.3 s in: within the decode's first step
        send(address, [[score(decoding, call_id=1, decode_steps=2)], [close]], 2, pause=0.3, replies=messages)
        assert messages == [[2], [1]]  # the close first, alone
    finally:
        slow.stop(None)


def test_a_broken_stream_fails_its_calls_and_the_next_call_opens_another():
    limits = ModelServiceConfig("target", limits=LIMITS)
    server, port = hosting.serve_model(limits, SlowBackend(StandinBackend("standin:0"), 0.5))
    address = f"127.0.0.1:{port}"
    try:
        [sid] = open_sessions(address, 1)
        link = StepLink(grpc.insecure_channel(address), TARGET)
        call = link.future("Score", "score", score(sid).score, timeout=20)
        time.sleep(0.2)  # sent, and running its forward
        server.server.stop(None)  # the gRPC server at once (the service's own stop lets the step finish first)
        server.stop(None)
        with pytest.raises(StepError) as err:
            call.result()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        server, _ = hosting.serve_model(limits, StandinBackend("standin:0"), "127.0.0.1", port)
        [sid] = open_sessions(address, 1)
        assert wait_until(lambda: _scores(link, sid), 10)
    finally:
        server.stop(None)


def _scores(link: StepLink, sid: str) -> bool:
    try:
        return link.future("Score", "score", score(sid).score, timeout=5).result().length == 3
    except StepError:  # the channel still reconnecting
        return False


# -- through the three services, 64 sessions at once -------------------------------------------


def standin_greedy(prompt: list[int], n: int) -> list[int]:
    """The stand-in target's greedy continuation, in process."""
    backend = StandinBackend("standin:0")
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(backend._next(tokens[-1], len(tokens) - 1))
    return tokens[len(prompt) :]


def generate_all(address: str, requests, timeout: float = 120) -> list:
    """Every request at once, each on its own thread: its response, or the error it failed with."""
    stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))

    def one(req):
        try:
            return stub.Generate(req, timeout=timeout)
        except grpc.RpcError as err:
            return err

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def prompts(n: int) -> list[list[int]]:
    return [[3 + (7 * i + j) % 40 for j in range(4 + i % 5)] for i in range(n)]


def speculation(i: int) -> orchestrator_pb2.SpeculationParams:
    """Request i's: speculation off, a fixed k of 1..16, adaptive, or the server's default."""
    kind = i % 19
    if kind == 0:
        return orchestrator_pb2.SpeculationParams(disabled=True)
    if kind == 17:
        return orchestrator_pb2.SpeculationParams(adaptive=True)
    if kind == 18:
        return orchestrator_pb2.SpeculationParams()
    return orchestrator_pb2.SpeculationParams(lookahead=kind)


@pytest.mark.usefixtures("draft_awaited")
def test_64_sessions_at_once_each_get_the_targets_greedy_text():
    draft, target = StandinBackend("standin:2:0.8"), StandinBackend("standin:5")
    with pipeline(draft, target, limits=LIMITS, admission=ADMISSION, lookahead=None) as p:
        requests = [
            orchestrator_pb2.GenerateRequest(
                token_ids=orchestrator_pb2.TokenIds(ids=ids), max_new_tokens=48, speculation=speculation(i)
            )
            for i, ids in enumerate(prompts(MANY))
        ]
        replies = generate_all(p.addresses["orchestrator"], requests)
        assert [list(r.token_ids) for r in replies] == [standin_greedy(ids, 48) for ids in prompts(MANY)]
        assert sum(r.stats.accepted_tokens for r in replies) > 0  # they speculated
        assert p.sessions_freed_within(10)


@pytest.mark.slow
def test_a_leviathan_seed_gives_one_text_among_64_requests(markov_pipeline):
    address = markov_pipeline
    leviathan = orchestrator_pb2.RULE_LEVIATHAN
    [alone] = generate_all(address, [request(31, 48, 4, leviathan)])
    together = generate_all(address, [request(31, 48, 4, leviathan)] * MANY)
    assert [list(r.token_ids) for r in together] == [list(alone.token_ids)] * MANY


@pytest.mark.slow
@pytest.mark.parametrize("rule", [orchestrator_pb2.RULE_LEVIATHAN, orchestrator_pb2.RULE_INVARIANT])
def test_the_output_law_of_64_sessions_at_once_is_the_targets(markov_kernels_64, rule):
    target_kernel, draft_kernel = markov_kernels_64
    with pipeline(
        TokenizedMarkov(draft_kernel), TokenizedMarkov(target_kernel), limits=LIMITS, admission=ADMISSION
    ) as p:
        replies = generate_all(p.addresses["orchestrator"], [request(500 + i, 160, 4, rule) for i in range(MANY)])
        assert p.sessions_freed_within(10)
    index = {t: i for i, t in enumerate(SUPPORT)}
    counts = transition_counts([[0, *(index[t] for t in r.token_ids)] for r in replies], len(SUPPORT))
    assert counts_chisquare(counts, support_kernel(target_kernel)) > 1e-3
    assert counts_chisquare(counts, support_kernel(draft_kernel)) < 1e-3  # the test's power: the draft's law fails
    assert sum(r.stats.accepted_tokens for r in replies) > 0


@pytest.fixture(scope="module")
def markov_kernels_64():
    from tests.standins import random_markov

    return random_markov(len(SUPPORT), 81), random_markov(len(SUPPORT), 82)


@pytest.fixture(scope="module")
def markov_pipeline(markov_kernels_64):
    target_kernel, draft_kernel = markov_kernels_64
    with pipeline(
        TokenizedMarkov(draft_kernel), TokenizedMarkov(target_kernel), limits=LIMITS, admission=ADMISSION
    ) as p:
        yield p.addresses["orchestrator"]


class FailingStandin(StandinBackend):
    """A stand-in whose forward fails for a session fed the token POISON (the worker then runs the
    step's sessions one by one: only that one fails)."""

    POISON = 4

    def forward_batch(self, items):
        if any(self.POISON in cache[:1] or (not cache and self.POISON in ids[:1]) for cache, ids, _ in items):
            raise RuntimeError("a forward failed")
        return super().forward_batch(items)


def test_a_session_failed_cancelled_or_expired_mid_step_leaves_the_others_unchanged():
    draft, target = StandinBackend("standin:2:0.8"), FailingStandin("standin:5")
    with pipeline(draft, target, limits=LIMITS, admission=ADMISSION, lookahead=4) as p:
        address = p.addresses["orchestrator"]
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))
        ids = [x for x in prompts(MANY - 12) if x[0] != FailingStandin.POISON]
        good = [tokens_request(x, 96) for x in ids]
        long = tokens_request([5, 6, 7], 5000)
        streams = [stub.GenerateStream(long, timeout=120) for _ in range(4)]  # cancelled mid-generation
        expiring = [stub.Generate.future(long, timeout=0.5) for _ in range(4)]
        failing = [
            stub.Generate.future(tokens_request([FailingStandin.POISON, 5, 6], 96), timeout=120) for _ in range(4)
        ]

        def cancel():
            for stream in streams:
                next(stream)
            time.sleep(0.2)
            for stream in streams:
                stream.cancel()

        canceller = threading.Thread(target=cancel)
        canceller.start()
        replies = generate_all(address, good)
        canceller.join()
        assert [list(r.token_ids) for r in replies] == [standin_greedy(x, 96) for x in ids]
        for future in expiring:
            assert future.exception().code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for future in failing:
            assert future.exception().code() == grpc.StatusCode.INTERNAL
        for stream in streams:
            assert stream.code() == grpc.StatusCode.CANCELLED
        assert p.sessions_freed_within(10)


def tokens_request(ids: list[int], max_tokens: int) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(token_ids=orchestrator_pb2.TokenIds(ids=ids), max_new_tokens=max_tokens)


@pytest.mark.slow
def test_one_step_mixes_lookaheads_a_tree_and_a_grammar(tiny_backends):
    parity = model_pb2.Constraint(regex="([hij][klm])*")
    requests = [
        orchestrator_pb2.GenerateRequest(prompt=f"mix {i}", max_new_tokens=24, speculation=speculation(i))
        for i in range(17)
    ]
    requests.append(
        orchestrator_pb2.GenerateRequest(
            prompt="a tree",
            max_new_tokens=24,
            speculation=orchestrator_pb2.SpeculationParams(lookahead=4, tree_nodes=8),
        )
    )
    requests.append(orchestrator_pb2.GenerateRequest(prompt="hk", max_new_tokens=12, constraint=parity))
    with pipeline(tiny_backends["draft"], tiny_backends["target"], limits=LIMITS, admission=ADMISSION) as p:
        address = p.addresses["orchestrator"]
        alone = [generate_all(address, [r])[0] for r in requests]
        together = generate_all(address, requests)
        assert [list(r.token_ids) for r in together] == [list(r.token_ids) for r in alone]
        assert together[-2].stats.draft_tokens > 0 and set(together[-1].text) <= set("hijklm")
        assert p.sessions_freed_within(10)
