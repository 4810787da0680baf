"""Batched forwards across sessions (specdec.runtime.worker, specdec.runtime.kvcache): what a session gets does
not depend on which other sessions share its forwards.

- the slot cache's ragged batched forward gives each row the logits a plain transformers
  forward of its whole sequence gives;
- greedy generations run together (different prompt lengths, one longer than a prefill
  chunk, joining and leaving mid-way, fixed and adaptive k, one cancelled, requests refused
  for bad input or failing in the worker next to them) equal each generation run alone, and
  the services end holding no session and no KV slot;
- sampled generations through batched verification follow the target's law (chi-square).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from draft_service.server import DraftServicer
from orchestrator.loop import LoopConfig, SpeculativeLoop
from specdec.decoding.sampling import SamplingParams
from specdec.runtime.backend import HFBackend
from specdec.runtime.engine import PREFILL_BUDGET, SessionEngine
from specdec.runtime.session import Session
from specdec.v1 import model_pb2, orchestrator_pb2
from specdec.weights.models import ModelSpec
from target_service.server import TargetServicer
from tests.harness import NO_EOS_PROMPT, SlowBackend, pipeline, status_of, wait_until
from tests.standins import Direct, MarkovBackend, random_markov
from tests.stats import markov_chisquare
from tests.test_loop import kernel_after_transform, pair

POISON = [0, 0, 0]  # a draft block the failing backend refuses


class Recorded(SlowBackend):
    """The tiny model, slowed so requests meet in the worker's queue; records batch sizes and
    fails any batched forward holding the POISON block (a fault of one session)."""

    def __init__(self, backend, delay: float):
        super().__init__(backend, delay)
        self.rows: list[int] = []

    def forward_batch(self, items):
        if any(list(tokens[-len(POISON) :]) == POISON for _, tokens, _ in items):
            raise RuntimeError("poisoned block")
        self.rows.append(len(items))
        return super().forward_batch(items)


@pytest.mark.parametrize("packed", [True, False])
def test_ragged_batch_equals_whole_sequence_forwards(tiny_models, packed):
    """Rows of different widths and lengths in one forward, packed (one sequence, attention per
    group of rows of one width) or padded: each row's logits are its whole sequence's."""
    from transformers import AutoModelForCausalLM

    backend = HFBackend(ModelSpec(tiny_models["target"], "cpu", "float32"))
    assert backend.packed  # a Llama
    backend.packed = packed
    model = AutoModelForCausalLM.from_pretrained(tiny_models["target"]).eval()

    def reference(tokens, n):
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0, -n:].float()

    a, b, c = [1, 5, 6, 7, 8, 9, 10], [1, 3, 4], [2, 8, 9, 10, 11, 12, 13, 14, 15, 20]
    slots = [backend.new_cache() for _ in range(3)]
    steps = [
        [(0, a, 2), (1, b, 1), (2, c, 3)],  # prefills of different lengths
        [(2, [5, 6], 2), (0, [7], 1)],  # verify blocks of different widths, a row left out
        [(1, [7, 7, 7, 7], 1)],
    ]
    held = {0: [], 1: [], 2: []}
    for step in steps:
        logits = backend.forward_batch([(slots[i], tokens, n) for i, tokens, n in step])
        for (i, tokens, n), got in zip(step, logits, strict=True):
            held[i] += tokens
            torch.testing.assert_close(got, reference(held[i], n), rtol=1e-4, atol=1e-4)
    backend.crop(slots[2], 5)  # rollback is a length
    held[2] = held[2][:5] + [30, 31, 32]
    [got] = backend.forward_batch([(slots[2], [30, 31, 32], 3)])
    torch.testing.assert_close(got, reference(held[2], 3), rtol=1e-4, atol=1e-4)
    for slot in slots:
        backend.release(slot)
    assert len(backend.kv.free) == backend.kv.slots


def _requests():
    """Greedy requests: prompts of 3 to 160 characters (one over a prefill chunk of 128
    tokens), lookahead 1 to 4 or adaptive, and lengths that end them at different rounds."""
    prompts = ["abc", "the cat sat on the mat", "x" * 40 + " long " * 20, "hi!", "1 2 3 4 5 6 7", "zz top"]
    return [
        orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=[1] + [3 + (ord(ch) % 40) for ch in prompt]),
            max_new_tokens=12 + 7 * i,
            speculation=orchestrator_pb2.SpeculationParams(lookahead=1 + i % 4, adaptive=i % 3 == 2),
        )
        for i, prompt in enumerate(prompts)
    ]


@pytest.mark.usefixtures("draft_awaited")  # it asserts the draft batched
def test_batched_generations_equal_each_run_alone(tiny_models):
    draft = Recorded(HFBackend(ModelSpec(tiny_models["draft"], "cpu", "float32")), 0.005)
    target = Recorded(HFBackend(ModelSpec(tiny_models["target"], "cpu", "float32")), 0.005)
    requests = _requests()
    with pipeline(draft, target) as p:
        stub = p.orchestrator
        alone = [list(stub.Generate(r, timeout=120).token_ids) for r in requests]
        draft.rows.clear()
        target.rows.clear()

        together: list = [None] * len(requests)
        errors: dict = {}

        def client(i):
            time.sleep(0.03 * i)  # join while the earlier ones run
            together[i] = list(stub.Generate(requests[i], timeout=120).token_ids)

        def cancelled():
            long = orchestrator_pb2.GenerateRequest(
                token_ids=orchestrator_pb2.TokenIds(ids=NO_EOS_PROMPT), max_new_tokens=400
            )
            call = stub.Generate.future(long, timeout=120)
            time.sleep(0.2)
            errors["cancelled"] = call.cancel() and call.cancelled()

        def refused_and_failing():
            bad = model_pb2.OpenSessionRequest(session_id="bad", prompt_token_ids=[1, 10_000])
            errors["refused"] = status_of(lambda: p.target.OpenSession(bad, timeout=30)).code()
            p.target.OpenSession(model_pb2.OpenSessionRequest(session_id="poison", prompt_token_ids=[1, 5, 6]))
            ref = model_pb2.SessionRef(session_id="poison", expected_length=3)
            stale = model_pb2.ScoreRequest(session=model_pb2.SessionRef(session_id="poison", expected_length=9))
            errors["stale"] = status_of(lambda: p.target.Score(stale, timeout=30)).code()
            poison = model_pb2.ScoreRequest(session=ref, draft_token_ids=POISON)
            errors["poison"] = status_of(lambda: p.target.Score(poison, timeout=30)).code()
            p.target.CloseSession(model_pb2.CloseSessionRequest(session_id="poison"))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
        threads += [threading.Thread(target=cancelled), threading.Thread(target=refused_and_failing)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)

        assert together == alone
        assert errors == {
            "cancelled": True,
            "refused": grpc.StatusCode.INVALID_ARGUMENT,
            "stale": grpc.StatusCode.FAILED_PRECONDITION,
            "poison": grpc.StatusCode.INTERNAL,
        }
        assert max(target.rows) > 1 and max(draft.rows) > 1, (target.rows, draft.rows)  # it did batch
        assert p.sessions_freed_within(10)
    for backend in (draft, target):  # every slot back: no KV held
        assert len(backend.kv.free) == backend.kv.slots


class BatchingMarkov(MarkovBackend):
    """The Markov stand-in with a batched forward (one call for all sessions), recording per
    forward the tokens each session fed (`steps`) and the sessions in it (`rows`)."""

    def __init__(self, probs):
        super().__init__(probs)
        self.steps: list[list[int]] = []

    @property
    def rows(self) -> list[int]:
        return [len(step) for step in self.steps]

    def forward_batch(self, items):
        self.steps.append([len(tokens) for _, tokens, _ in items])
        return [self.forward(*item) for item in items]


class Held:
    """A backend whose batched forward, once `hold()` is called, waits in the step until `release()`:
    `running` is set when that step has begun, so a test queues requests behind a step known to run."""

    def __init__(self, backend):
        self._backend = backend
        self.running, self._released = threading.Event(), threading.Event()
        self._released.set()

    def hold(self) -> None:
        self.running.clear()
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def forward_batch(self, items):
        if not self._released.is_set():
            self.running.set()
            assert self._released.wait(60)  # a hang guard only: the test releases it at once
        return self._backend.forward_batch(items)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def queue_behind_a_running_step(engine, backend: Held, blocker: threading.Thread, *others: threading.Thread):
    """Start `blocker`, and once its step runs, `others`; release the step once all of them are
    queued on the worker (each thread's session id its name), so that they run as one step."""
    backend.hold()
    blocker.start()
    assert backend.running.wait(60)  # a hang guard only
    for t in others:
        t.start()
    assert wait_until(lambda: engine.worker.busy() == {t.name for t in (blocker, *others)}, 60)
    backend.release()
    for t in (blocker, *others):
        t.join()


@pytest.mark.slow
def test_sampling_through_batched_verification_follows_the_target():
    target_probs, draft_probs = random_markov(8, 31), random_markov(8, 32)
    draft, target, draft_engine, target_engine = pair(target_probs, draft_probs)
    draft_engine.backend, target_engine.backend = BatchingMarkov(draft_probs), BatchingMarkov(target_probs)
    sampling = SamplingParams(temperature=1.0)
    chains: list = [None] * 4

    def generate(i):
        config = LoopConfig(sampling=sampling, max_new_tokens=6000, lookahead=1 + i, seed=40 + i)
        loop = SpeculativeLoop(draft, target, [0], config)
        for _ in loop.rounds():
            pass
        chains[i] = [0, *loop.generated]

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kernel = kernel_after_transform(target_probs, sampling)
    assert markov_chisquare(chains, kernel) > 1e-3
    assert max(target_engine.backend.rows) > 1  # verifications of different sessions shared forwards
    assert draft_engine.open_sessions == target_engine.open_sessions == 0


def test_score_reports_the_tokens_of_its_batched_step():
    """ScoreResponse.step_tokens: the tokens of the batched forward that scored the request, all
    sessions' together (what adaptive lookahead prices a round by); alone, its own block."""
    backend = Held(BatchingMarkov(random_markov(8, 31)))
    engine = SessionEngine(backend, "target")
    target = Direct(TargetServicer(engine))
    for sid in "abc":
        target.OpenSession(model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=[0, 1, 2]))
    steps = {}

    def score(sid, drafts):  # feeds the last prompt token again, then the drafts
        ref = model_pb2.SessionRef(session_id=sid, expected_length=3)
        request = model_pb2.ScoreRequest(session=ref, draft_token_ids=drafts)
        steps[sid] = target.Score(request).step_tokens

    # c's step is running: a and b queue behind it and run as one step.
    blocker = threading.Thread(target=score, args=("c", [1]), name="c")
    both = [threading.Thread(target=score, args=(s, d), name=s) for s, d in (("a", [1, 2]), ("b", [3, 4, 5, 6]))]
    queue_behind_a_running_step(engine, backend, blocker, *both)
    assert steps == {"c": 2, "a": 3 + 5, "b": 3 + 5}


def test_propose_reports_its_steps_and_their_tokens():
    """ProposeResponse.steps and step_tokens: the batched forwards that ran a proposal and their
    tokens, all sessions' (what adaptive lookahead prices the draft by); a proposal of 3 run
    alone is 3 one-token steps, two proposals of 3 side by side share their steps."""
    backend = Held(BatchingMarkov(random_markov(8, 31)))
    engine = SessionEngine(backend, "draft")
    draft = Direct(DraftServicer(engine))
    for sid in "abc":
        draft.OpenSession(model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=[0, 1, 2]))
    replies = {}

    def propose(sid, k=3):
        ref = model_pb2.SessionRef(session_id=sid, expected_length=3)
        replies[sid] = draft.Propose(model_pb2.ProposeRequest(session=ref, k=k))

    propose("a")
    assert (replies["a"].steps, replies["a"].step_tokens) == (3, 3)
    # c's step is running: a and b queue behind it and start together.
    blocker = threading.Thread(target=propose, args=("c", 1), name="c")
    both = [threading.Thread(target=propose, args=(sid,), name=sid) for sid in "ab"]
    queue_behind_a_running_step(engine, backend, blocker, *both)
    assert (replies["c"].steps, replies["c"].step_tokens) == (1, 1)
    assert {(replies[sid].steps, replies[sid].step_tokens) for sid in "ab"} == {(3, 6)}


def test_sessions_that_come_back_at_once_share_every_step():
    """Four sessions scoring in a loop, each sending its next request 2 ms after its answer (a
    round trip): a step waits that long for them, so every step holds all four, instead of
    the first to come back starting a step alone and the sessions splitting into cohorts."""
    backend = BatchingMarkov(random_markov(8, 31))
    target = Direct(TargetServicer(SessionEngine(SlowBackend(backend, 0.05), "target")))

    def loop(sid):
        target.OpenSession(model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=[0, 1, 2]))
        length, pending = 3, []
        for _ in range(12):
            ref = model_pb2.SessionRef(session_id=sid, expected_length=length)
            reply = target.Score(model_pb2.ScoreRequest(session=ref, append_tokens=pending))
            length, pending = reply.length, [reply.argmax_token_ids[0]]
            time.sleep(0.002)

    threads = [threading.Thread(target=loop, args=(sid,)) for sid in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 4 x 13 forwards (a prefill and 12 scores each): all but the first and last few steps full
    assert sum(backend.rows) == 52 and backend.rows.count(4) >= 10, backend.rows


def test_a_closed_session_is_not_waited_for():
    """A session that came back quickly is expected at the next steps; once closed it never
    comes back, and the next session's steps must not wait for it (they waited GATHER_MAX,
    10 ms a step, for a second after every generation ended)."""
    engine = SessionEngine(BatchingMarkov(random_markov(8, 31)), "target")
    target = Direct(TargetServicer(engine))
    target.OpenSession(model_pb2.OpenSessionRequest(session_id="a", prompt_token_ids=[0, 1, 2]))
    length, pending = 3, []
    for _ in range(4):  # answered, then back at once: a quick returner
        ref = model_pb2.SessionRef(session_id="a", expected_length=length)
        reply = target.Score(model_pb2.ScoreRequest(session=ref, append_tokens=pending))
        length, pending = reply.length, [reply.argmax_token_ids[0]]
    assert "a" in engine.worker._served  # expected back, as the gather window should
    target.CloseSession(model_pb2.CloseSessionRequest(session_id="a"))
    assert "a" not in engine.worker._served and "a" not in engine.worker._gaps


@pytest.fixture(autouse=True)
def _quiet_worker_logs(caplog):
    caplog.set_level("CRITICAL", logger="specdec")


def test_a_step_feeds_only_what_the_cache_does_not_hold():
    """The engine keeps a session's cached prefix across commits and speculative tails, and
    feeds from the first token it does not hold (it compares only past the committed prefix)."""
    engine = SessionEngine(MarkovBackend(random_markov(10, 0)), "draft")
    session = Session(tokens=[0, 1, 2], cache=engine.backend.new_cache())

    def step(speculative, n_logits=1):
        forward = engine.forward(session, speculative, n_logits)
        engine._run_batch([forward])
        return forward.tokens

    assert step([3, 4, 5]) == [0, 1, 2, 3, 4, 5]
    engine.commit(session, [3, 9])  # drafts 3 accepted, 4 replaced by 9: the tail past 3 goes
    assert session.cached == [0, 1, 2, 3]
    assert step([]) == [9]
    engine.commit(session, [7])  # the last committed token is fed again with the next block
    assert session.cached == [0, 1, 2, 3, 9]
    assert step([8, 6]) == [7, 8, 6]
    assert step([8, 5, 1]) == [5, 1]  # the same first draft, kept; the cache past it is not
    assert step([8, 5, 1, 2, 4], n_logits=3) == [1, 2, 4]  # the logits of 1 wanted: fed again
    # An overlapped round: the commit accepts drafts the continuation was proposed past; the
    # continuation's cached tail stays, and the next step feeds only its newest token.
    engine.commit(session, [8, 5])
    assert session.cached == [0, 1, 2, 3, 9, 7, 8, 5, 1, 2, 4]
    assert step([1, 2, 4, 6]) == [6]
    assert step([1, 2], n_logits=3) == [5, 1, 2]  # a verify feeds the last committed token again
    engine.rollback(session, 3)
    assert session.cached == [0, 1] and step([]) == [2]


def test_a_step_finds_its_greedy_forwards_argmax_at_once():
    """A forward asked greedy gets each of its rows' argmax from its step (greedy.step_argmax, one
    argmax for the step's greedy forwards); the others get their logits only."""
    engine = SessionEngine(MarkovBackend(random_markov(10, 0)), "target")
    sessions = [Session(tokens=[i, 1, 2], cache=engine.backend.new_cache()) for i in range(3)]
    forwards = [
        engine.forward(sessions[0], [3, 4], 3, greedy=True),
        engine.forward(sessions[1], [], 1),
        engine.forward(sessions[2], [5], 2, greedy=True),
    ]
    logits = engine._run_batch(forwards)
    assert forwards[0].argmax == torch.argmax(logits[0], dim=-1).tolist() and len(forwards[0].argmax) == 3
    assert forwards[1].argmax is None
    assert forwards[2].argmax == torch.argmax(logits[2], dim=-1).tolist()


def test_a_greedy_chain_is_its_one_token_steps_run_by_the_worker():
    """Forward.chain (a draft's greedy proposal, a target's decode steps): the worker runs its k
    one-token steps itself, each feeding the last one's argmax, and wakes the request once: the
    same tokens and cache as k forwards yielded one by one, its steps shared with another
    session's forwards; with stop tokens it ends after the first it draws."""
    backend = Held(BatchingMarkov(random_markov(10, 3)))
    engine = SessionEngine(backend, "draft")
    engine.start()
    try:
        for sid in ("blocker", "a", "b", "c"):
            engine.open(sid, [0, 1, 2])
        results, woken = {}, []

        def one_by_one(session):
            tokens = []
            for _ in range(6):
                forward = engine.forward(session, tokens, 1, greedy=True)
                yield forward
                tokens += forward.argmax
            return tokens, list(session.cached), 6

        def chained(stop):
            def run(session):
                forward = engine.forward(session, [], 1, greedy=True, chain=6, stop=stop)
                woken.append((yield forward))
                return forward.argmax, list(session.cached), forward.steps

            return run

        def call(sid, request):
            results[sid] = engine.call(sid, 3, request)

        blocker = threading.Thread(target=call, args=("blocker", one_by_one), name="blocker")
        both = [
            threading.Thread(target=call, args=("a", one_by_one), name="a"),
            threading.Thread(target=call, args=("b", chained(frozenset())), name="b"),
        ]
        queue_behind_a_running_step(engine, backend, blocker, *both)
        tokens, cached, _ = results["a"]
        assert results["b"] == (tokens, cached, 6) and len(woken) == 1
        assert cached == [0, 1, 2, *tokens[:-1]]  # the chain's last token is drawn, not fed
        assert backend._backend.rows.count(3) >= 5  # its steps ran beside the others' forwards
        stop = tokens[2]
        n = tokens.index(stop) + 1
        call("c", chained(frozenset({stop})))
        assert results["c"] == (tokens[:n], [0, 1, 2, *tokens[: n - 1]], n)
    finally:
        engine.stop()


def test_a_wave_of_prompts_prefills_within_the_budget_beside_the_decodes():
    """Six 300-token prompts arrive together while a session decodes: each step takes prompt
    chunks up to PREFILL_BUDGET tokens and the decoding session's forward rides in the steps
    that prefill (before the budget, the six prompts' first chunks ran as one step of 768
    tokens, and the decoding session waited for all of them)."""
    backend = BatchingMarkov(random_markov(8, 31))
    engine = SessionEngine(SlowBackend(backend, 0.02), "target")
    target = Direct(TargetServicer(engine))
    target.OpenSession(model_pb2.OpenSessionRequest(session_id="a", prompt_token_ids=[0, 1, 2]))
    backend.steps.clear()
    prompt = [i % 8 for i in range(300)]  # 299 prefilled: chunks of 128, 128 and 43 tokens
    opens = [
        threading.Thread(
            target=target.OpenSession,
            args=(model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=prompt),),
        )
        for sid in "bcdefg"
    ]
    length, pending = 3, []
    for t in opens:
        t.start()
    for _ in range(12):  # one-token scores (k = 0) all through the wave
        ref = model_pb2.SessionRef(session_id="a", expected_length=length)
        reply = target.Score(model_pb2.ScoreRequest(session=ref, append_tokens=pending))
        length, pending = reply.length, [reply.argmax_token_ids[0]]
    for t in opens:
        t.join()
    prefills = [[n for n in step if n > 1] for step in backend.steps]
    assert sum(map(sum, prefills)) == 6 * 299 and max(map(sum, prefills)) <= PREFILL_BUDGET, backend.steps
    beside = [step for step, chunks in zip(backend.steps, prefills, strict=True) if chunks and 1 in step]
    assert len(beside) >= 3, backend.steps  # the decode went on in the wave's steps
    assert engine.cached_tokens == 6 * 299 + length  # every prompt prefilled once, "a" whole
