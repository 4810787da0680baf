"""The prefix cache (specdec.runtime.prefix): a session opens from the keys and values another session's
cache holds, and nothing it outputs changes.

- Greedy output is the target's own (transformers' generate), the cache on and off, for the
  turns of a conversation (the next turn takes the last one's kept cache over, the same request
  again copies it), a system prompt shared by another conversation, with chains, draft trees,
  overlapped rounds, and several generations batched at once; the draft hits as the target does.
- Two sessions sharing a prefix, the second opening while the first runs (a copy of a live
  session's rows), then diverging, each give their own text.
- Eviction: under a small KV budget, and with a fixed cache's few slots (the CUDA graph
  backend's, eager on a CPU), kept caches are evicted and every request is still correct; the
  budget is never passed, and closing everything leaks no slot and no budget.
- What is indexed: never a speculative tail nor a draft tree; a rollback below an indexed block
  drops it; a hash collision serves nothing.
- llama.cpp: a copied prefix's logits are bit for bit a fresh prefill's (the per-sequence state copy).
- A generation that ends while the draft still prefills its prompt stops that prefill (it would
  take the cores from the next request's); what it computed stays cached.
- The sampling law through the services with the cache on (Markov stand-ins, chi-square, with a
  wrong law failing), and Describe, the metrics and --no-prefix-cache.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from draft_service.server import DraftServicer
from orchestrator.loop import LoopConfig, SpeculativeLoop
from specdec.decoding.sampling import SamplingParams
from specdec.limits import SessionLimits
from specdec.runtime import prefix
from specdec.runtime.engine import SessionEngine
from specdec.runtime.graphs import Buckets, GraphBackend
from specdec.serving.service import prefix_cache
from specdec.v1 import model_pb2, orchestrator_pb2
from specdec.weights.models import ModelSpec
from target_service.server import TargetServicer
from tests.harness import SlowBackend, greedy, pipeline, wait_until
from tests.standins import Direct, MarkovBackend, random_markov
from tests.stats import counts_chisquare, transition_counts

ON, OFF = SessionLimits(), SessionLimits(prefix_cache=False)


def tokens(seed: int, n: int) -> list[int]:
    """n character tokens of the tiny models (ids 3..42), from a seed."""
    return torch.randint(3, 43, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = [1, *tokens(0, 60)]  # a system prompt shared by the conversations below


def poison(backend) -> None:
    """Fill the free slots of a backend's slot cache with large values: a row a session reads
    without having written or copied it (a copy one short) moves its logits far, where stale rows
    of an earlier session with the same tokens would have hidden it. Finite: a masked position of
    a slot is still multiplied (then masked), and a NaN there would spoil every row."""
    with torch.inference_mode():
        for store in (*backend.kv.keys, *backend.kv.values):
            store[backend.kv.free] = 100.0


class Pair:
    """Draft and target engines over the tiny backends, with the loop's in-process stubs; their
    kept caches are freed at the end (the backends serve other tests)."""

    def __init__(self, tiny_backends, limits: SessionLimits = ON, target_backend=None):
        self.target_backend = target_backend or tiny_backends["target"]
        self.target_engine = SessionEngine(self.target_backend, "target", limits)
        self.draft_engine = SessionEngine(tiny_backends["draft"], "draft", limits)
        self.target = Direct(TargetServicer(self.target_engine))
        self.draft = Direct(DraftServicer(self.draft_engine))

    def loop(self, prompt: list[int], n: int = 24, **config) -> SpeculativeLoop:
        config = {"lookahead": 3, **config}
        return SpeculativeLoop(self.draft, self.target, prompt, LoopConfig(SamplingParams(), n, **config))

    def generate(self, prompt: list[int], n: int = 24, **config) -> list[int]:
        loop = self.loop(prompt, n, **config)
        for _ in loop.rounds():
            pass
        return loop.generated

    def hits(self) -> tuple[int, int]:
        return tuple(e.prefix.stats.hit_tokens if e.prefix else 0 for e in (self.draft_engine, self.target_engine))

    def close(self) -> None:
        engines = (self.draft_engine, self.target_engine)
        # A generation that ended before its draft's session opened closes it once the open is done
        # (orchestrator.loop): on a loaded machine, after the test's last generation returned.
        wait_until(lambda: all(engine.open_sessions == 0 for engine in engines), 30)
        for engine in engines:
            engine.stop()
            assert engine.open_sessions == 0 and engine.kv.held == 0  # nothing kept, nothing leaked


@pytest.fixture
def pairs(tiny_backends):
    made = []
    taken = {role: b.kv.slots - len(b.kv.free) for role, b in tiny_backends.items()}  # by earlier tests

    def make(limits=ON, **kw):
        made.append(Pair(tiny_backends, limits, **kw))
        return made[-1]

    for backend in tiny_backends.values():
        poison(backend)
    yield make
    for p in made:
        p.close()
    assert {role: b.kv.slots - len(b.kv.free) for role, b in tiny_backends.items()} == taken  # every slot back


def conversation(pair: Pair, **config) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) of: a first turn, its next turn (taking the first's kept cache over), the
    same request again (copying the kept one), and another conversation on the same system prompt."""
    config = {"n": 16, **config}
    done = []
    first = [*SYSTEM, *tokens(1, 12)]
    done.append((first, pair.generate(first, **config)))
    second = [*first, *done[0][1], *tokens(2, 9)]
    done.append((second, pair.generate(second, **config)))
    done.append((second, pair.generate(second, **config)))
    other = [*SYSTEM, *tokens(3, 7)]
    done.append((other, pair.generate(other, **config)))
    return done


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize(
    "config",
    [{}, {"overlap": True}, {"tree_nodes": 6}],
    ids=["chains", "overlap", "trees"],
)
def test_greedy_output_is_the_targets_with_the_cache_on_and_off(pairs, tiny_backends, config):
    on, off = pairs(), pairs(OFF)
    with_cache, without = conversation(on, **config), conversation(off, **config)
    target = tiny_backends["target"]
    for prompt, output in with_cache:
        assert output == greedy(target, prompt, len(output)), len(prompt)
    assert [o for _, o in with_cache] == [o for _, o in without]
    assert off.hits() == (0, 0)
    stats = on.target_engine.prefix.stats, on.draft_engine.prefix.stats
    assert all(s.hits == 3 for s in stats)  # the second turn, the same again, the other conversation


@pytest.mark.parametrize("backend", ["eager", "fixed"])
def test_a_session_from_a_hit_computes_what_a_prefill_does(tiny_models, tiny_backends, backend):
    """The logits after a prefix taken from an open session (copied), from a kept one taken over
    and from a kept one copied equal a cold session's (within float rounding: the rows were computed
    in other forwards' shapes), on the eager backend and in the fixed cache of the graph backend."""
    if backend == "fixed":
        limits = SessionLimits(max_sessions=4, max_kv_tokens=4 * 300)
        model = GraphBackend(ModelSpec(tiny_models["target"], "cpu", "float32"), Buckets((1, 2), (4, 8), (128, 300)))
        model.prepare(limits)
    else:
        limits, model = SessionLimits(), tiny_backends["target"]
    base = [*SYSTEM, *tokens(90, 40)]
    prompts = [[*base, *tokens(91, 20)], [*base[:70], *tokens(92, 9)], [*base, *tokens(91, 20), *tokens(93, 3)]]

    def logits(engine, sid, prompt):
        engine.open(sid, prompt)

        def step(session):  # the prompt's last position, then two tokens on
            first = (yield engine.forward(session, [], 1)).clone()
            return torch.cat([first, (yield engine.forward(session, [7, 8], 2))])

        return engine.call(sid, None, step)

    results = {}
    for limits_ in (replace(limits, prefix_cache=False), limits):
        poison(model)
        engine = SessionEngine(model, "target", limits_)
        try:
            source = engine.open("source", base)  # open, holding base[:-1]
            assert source == len(base)
            got = [logits(engine, "live", prompts[0]), logits(engine, "other", prompts[1])]
            engine.close("live")  # kept: prompts[0] + [7, 8]
            got.append(logits(engine, "extends", prompts[2]))  # ... which prompts[2] extends: taken over
            results[limits_.prefix_cache] = got
            stats = engine.prefix.stats if engine.prefix else None
        finally:
            for sid in ("source", "other", "extends"):
                engine.close(sid)
            engine.stop()
    assert (stats.hits, stats.hit_tokens) == (3, len(base) - 1 + 70 + len(prompts[0]))
    assert stats.copied_tokens == len(base) - 1 + 70  # the third took the kept cache over
    for cold, hit in zip(results[False], results[True], strict=True):
        torch.testing.assert_close(hit, cold, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("draft_awaited")
def test_the_same_request_again_reuses_all_but_its_last_token_on_both_sides(pairs):
    pair = pairs()
    prompt = [*SYSTEM, *tokens(4, 30)]
    first = pair.generate(prompt)
    before = pair.hits()
    assert pair.generate(prompt) == first
    assert [after - b for after, b in zip(pair.hits(), before, strict=True)] == [len(prompt) - 1] * 2


def test_sessions_sharing_a_prefix_then_diverging_give_their_own_texts(pairs, tiny_backends):
    """The second opens while the first is generating (its rows copied from a live session), then
    both go on, their steps batched; and four at once from threads, two prefixes between them."""
    pair, target = pairs(), tiny_backends["target"]
    a, b = [*SYSTEM, *tokens(5, 20)], [*SYSTEM, *tokens(5, 10), *tokens(6, 15)]
    first = pair.loop(a, 30)
    rounds = first.rounds()
    next(rounds)
    next(rounds)  # a's session is open, its cache past the shared part
    assert pair.generate(b, 30) == greedy(target, b, 30)
    assert pair.target_engine.prefix.stats.copied_tokens >= len(SYSTEM) + 10
    for _ in rounds:
        pass
    assert first.generated == greedy(target, a, 30)

    prompts = [[*SYSTEM, *tokens(7 + i, 5 + i)] for i in range(2)] + [[*b, *tokens(9 + i, 4)] for i in range(2)]
    outputs: list = [None] * 4

    def generate(i):
        outputs[i] = pair.generate(prompts[i], 30, overlap=bool(i % 2))

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outputs == [greedy(target, p, 30) for p in prompts]


def test_a_small_kv_budget_evicts_kept_caches_and_loses_nothing(pairs, tiny_backends):
    """Room for about two prompts: the kept caches go, oldest first, as sessions need the room;
    every request still gets the target's own output and none is refused."""
    pair = pairs(SessionLimits(max_kv_tokens=260))
    target = tiny_backends["target"]
    prompts = [[*SYSTEM, *tokens(20 + i, 15)] for i in range(3)] + [[1, *tokens(30 + i, 80)] for i in range(3)]
    for prompt in [*prompts, *prompts[::-1]]:
        assert pair.generate(prompt, 16) == greedy(target, prompt, 16)
        for engine in (pair.draft_engine, pair.target_engine):
            assert engine.kv.held <= 260
    stats = pair.target_engine.prefix.stats
    assert stats.evictions > 0 and stats.hits > 0


def test_a_fixed_cache_evicts_kept_caches_for_its_slots(tiny_models, tiny_backends, pairs):
    """The CUDA graph backend's cache (allocated once, on a CPU its static forwards eager): prefixes
    are copied inside it, a new session takes a kept cache's slot when none is free, and the output
    is the eager target's."""
    limits = SessionLimits(max_sessions=2, max_kv_tokens=2 * 300)
    backend = GraphBackend(ModelSpec(tiny_models["target"], "cpu", "float32"), Buckets((1, 2), (4, 8), (128, 300)))
    backend.prepare(limits)
    pair = pairs(limits, target_backend=backend)
    eager = tiny_backends["target"]
    for prompt in [[*SYSTEM, *tokens(40 + i, 9)] for i in range(4)]:
        assert pair.generate(prompt, 16) == greedy(eager, prompt, 16)
    stats = pair.target_engine.prefix.stats
    assert stats.hits == 3 and stats.evictions >= 2 and len(pair.target_engine.prefix.retained) <= 2
    pair.close()
    assert len(backend.kv.free) == 2  # both slots back (the pad slot is no session's)


def test_what_is_indexed_is_the_committed_tokens_held(tiny_backends):
    """A speculative tail past the committed tokens is never served; a rollback below an indexed
    block drops it; a hash collision serves nothing."""
    engine = SessionEngine(tiny_backends["target"], "target")
    try:
        prompt = [*SYSTEM, *tokens(50, 20)]
        engine.open("a", prompt)
        tail = tokens(51, 20)

        def speculate(session):
            return (yield engine.forward(session, tail, 1))

        engine.call("a", None, speculate)
        a = engine._sessions["a"]
        assert a.cached == prompt + tail
        source, hit = engine.prefix.lookup([*prompt, *tail, 5])
        assert source is a and hit == len(prompt)  # not the tail

        def rollback(session):
            engine.rollback(session, 20)
            return engine.prefix.index.blocks(session)  # at once: not only once the request ends

        assert engine.call("a", None, rollback) == 19 // prefix.BLOCK_TOKENS
        assert engine.prefix.lookup([*prompt, 5]) == (a, 19)

        other = [*tokens(52, 40), 5]
        for h in _hashes(other):  # a prompt whose every block's hash collides with a's
            engine.prefix.index._by_hash[h] = {id(a): a}
        assert engine.prefix.lookup(other) == (None, 0)
    finally:
        engine.close("a")
        engine.stop()
    assert engine.kv.held == 0


def _hashes(prompt: list[int]) -> list[int]:
    index = prefix.PrefixIndex()
    holder = object()
    index.index(holder, prompt, len(prompt))
    return list(index._chains[id(holder)][1])


@pytest.mark.big_memory
def test_llamacpp_copies_a_prefix_bit_for_bit():
    """A session opening from a live session's stream (the state copy, then a cut) and from a kept
    one (taken over) computes exactly what a fresh prefill does (the embedded Q8_0 draft GGUF)."""
    pytest.importorskip("llama_cpp")
    from specdec.runtime.llamacpp import LlamaCppBackend
    from specdec.weights import models

    if not models.draft_gguf_path().exists():
        pytest.skip("the embedded GGUF is not converted (make setup)")
    backend = LlamaCppBackend(ModelSpec(models.DEFAULT_ALIAS))
    base = tokens(60, 80)
    prompts = {"live": [*base, *tokens(61, 20)], "kept": [*base, *tokens(62, 15)]}

    def first_logits(engine, sid, prompt):
        engine.open(sid, prompt)

        def step(session):
            return (yield engine.forward(session, [], 1)).clone()

        return engine.call(sid, None, step)

    cold = SessionEngine(backend, "draft", OFF)
    try:
        expected = {name: first_logits(cold, name, p) for name, p in prompts.items()}
    finally:
        for sid in ("live", "kept"):
            cold.close(sid)
        cold.stop()
    engine = SessionEngine(backend, "draft")
    try:
        engine.open("source", [*base, 0])  # holds `base`
        got = first_logits(engine, "live", prompts["live"])  # copied from the open session
        engine.close("live")
        engine.close("source")
        kept = first_logits(engine, "kept", prompts["kept"])  # taken over: the source's whole cache
        stats = engine.prefix.stats
        assert (stats.hits, stats.hit_tokens, stats.copied_tokens) == (2, 2 * len(base), len(base))
    finally:
        engine.close("kept")
        engine.stop()
    assert torch.equal(got, expected["live"]) and torch.equal(kept, expected["kept"])
    assert backend.free_caches() == 16


@pytest.mark.slow
def test_the_law_through_the_services_with_the_cache_on():
    """Sampling at temperature 1, many short generations from one shared prompt (each opening from
    the last's kept cache, or copying it): the transitions follow the target's Markov law, and the
    test tells the draft's law apart."""
    vocab = 6
    target_probs, draft_probs = random_markov(vocab, 71, alpha=0.4), random_markov(vocab, 72, alpha=0.4)
    target_engine = SessionEngine(MarkovBackend(target_probs), "target")
    draft_engine = SessionEngine(MarkovBackend(draft_probs), "draft")
    target, draft = Direct(TargetServicer(target_engine)), Direct(DraftServicer(draft_engine))
    prompt = np.random.default_rng(7).integers(0, vocab, 40).tolist()
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    for seed in range(160):  # 4,000 transitions: the target's law passes (p ~0.3), the draft's fails (p < 1e-12)
        config = LoopConfig(SamplingParams(temperature=1.0), 25, lookahead=3, seed=seed, overlap=bool(seed % 2))
        loop = SpeculativeLoop(draft, target, prompt, config)
        for _ in loop.rounds():
            pass
        counts += transition_counts([prompt[-1], *loop.generated], vocab)
    assert counts_chisquare(counts, target_probs) > 1e-3
    assert counts_chisquare(counts, draft_probs) < 1e-3
    for engine in (target_engine, draft_engine):
        assert engine.prefix.stats.hits >= 159 and engine.open_sessions == 0
        engine.stop()


@pytest.mark.usefixtures("draft_awaited")
def test_describe_reports_the_prefix_cache_and_the_flag_turns_it_off(tiny_backends):
    """Through gRPC services: the same request twice, then with the cache off."""
    ask = [*SYSTEM, *tokens(80, 10)]
    request = orchestrator_pb2.GenerateRequest(token_ids=orchestrator_pb2.TokenIds(ids=ask), max_new_tokens=8)
    seen = {}
    for limits in (ON, OFF):
        with pipeline(tiny_backends["draft"], tiny_backends["target"], limits=limits) as p:
            texts = [list(p.orchestrator.Generate(request, timeout=60).token_ids) for _ in range(2)]
            infos = [s.Describe(model_pb2.DescribeRequest(), timeout=10) for s in (p.draft, p.target)]
            seen[limits.prefix_cache] = texts, infos
    (on_texts, on), (off_texts, off) = seen[True], seen[False]
    assert on_texts[0] == on_texts[1] == off_texts[0] == off_texts[1]
    for info in on:
        cache = info.prefix_cache
        assert info.HasField("prefix_cache") and cache.hits == 1 and cache.hit_tokens == len(ask) - 1
        assert cache.prompt_tokens == 2 * len(ask) and cache.kept >= 1 and cache.block_tokens == 16
        assert info.kv_tokens == 0 and cache.kept_tokens >= len(ask)  # the kept caches, outside open sessions'
    assert not any(info.HasField("prefix_cache") for info in off)
    assert prefix_cache(None) is None


class CountingSlowBackend(SlowBackend):
    """A slow backend that counts its forwards, prefilling in chunks of 128 tokens."""

    prefill_chunk = 128

    def __init__(self, backend, delay: float):
        super().__init__(backend, delay)
        self.forwards = 0

    def forward_batch(self, items, **trees):
        self.forwards += 1
        return super().forward_batch(items, **trees)


def test_a_generation_that_ends_stops_the_drafts_prefill(tiny_backends):
    """A long prompt, a short answer, a draft that prefills slowly (1 s a chunk of 128 tokens, 4
    chunks): the draft's session opens after the first token, and the generation ends before it is
    open. Its OpenSession is cancelled: the draft stops between chunks instead of prefilling to the
    end and then closing. The next request finds what it computed in the draft's prefix cache."""
    draft = CountingSlowBackend(tiny_backends["draft"], 0.0)
    prompt = [1, *tokens(90, 480)]
    request = orchestrator_pb2.GenerateRequest(token_ids=orchestrator_pb2.TokenIds(ids=prompt), max_new_tokens=4)
    want = greedy(tiny_backends["target"], prompt, 4)
    with pipeline(draft, tiny_backends["target"]) as p:
        draft.forwards, draft.delay = 0, 1.0  # slow from now on: its start-up (warm-up, step profile) is done
        assert list(p.orchestrator.Generate(request, timeout=60).token_ids) == want
        assert wait_until(lambda: p.open_sessions() == (0, 0), 30)
        stopped_after = draft.forwards
        assert stopped_after < 4, stopped_after  # a whole prefill: 4 chunks
        assert list(p.orchestrator.Generate(request, timeout=60).token_ids) == want
        assert wait_until(lambda: p.open_sessions() == (0, 0), 30)
        assert p.draft.Describe(model_pb2.DescribeRequest(), timeout=10).prefix_cache.hit_tokens >= 128


@pytest.mark.parametrize(
    "argv",
    [
        ["serve"],
        ["target-service"],
        ["draft-service"],
        ["generate", "hi"],
        ["ray", "up", "--address", "auto", "--allow-insecure"],
    ],
    ids=lambda argv: argv[0] if argv[0] != "ray" else "ray up",
)
def test_no_prefix_cache_reaches_the_services(argv, tmp_path):
    """`--no-prefix-cache` on every command that starts model services: their SessionLimits, and the
    flag a local pipeline passes its service processes."""
    from cli import options
    from cli.main import build_parser
    from cli.ray import pair_config
    from deploy.local import LocalPipeline

    parser = build_parser()
    for flag, on in (([], True), (["--no-prefix-cache"], False)):
        args = parser.parse_args([*argv, *flag])
        if argv[0] == "ray":
            limits = pair_config(args).target.limits
        elif argv[0] == "generate":  # no limit flags: the pipeline's
            limits = options.pipeline_config(args).session_limits
        else:
            limits = options.session_limits(args)
        assert limits.prefix_cache is on
        if argv[0] in ("serve", "generate"):
            local = LocalPipeline(options.pipeline_config(args, session_limits=limits), workdir=tmp_path)
            assert ("--no-prefix-cache" in local._limit_args("target")) is not on


def test_generate_compare_prefills_both_runs():
    """`specdec generate --compare` starts its target without the prefix cache: the target alone's
    run would otherwise reuse the prompt's keys and values the speculative run computed, and the
    speedup it prints would weigh one prefill against none. The draft, which the target alone never
    reads, keeps its own, unless --no-prefix-cache turns both off."""
    import shutil

    from cli.generate import local_pipeline
    from cli.main import build_parser
    from specdec.serving.security import ClientSecurity

    parser = build_parser()
    cases = (
        (["generate", "hi"], True, True),
        (["generate", "hi", "--compare"], False, True),
        (["generate", "hi", "--compare", "--no-prefix-cache"], False, False),
    )
    for argv, target, draft in cases:
        pipeline = local_pipeline(parser.parse_args(argv), ClientSecurity(), quiet=True)
        try:
            assert pipeline.config.session_limits.prefix_cache is target
            assert ("--no-prefix-cache" in pipeline._limit_args("target")) is not target
            assert ("--no-prefix-cache" in pipeline._limit_args("draft")) is not draft
        finally:
            shutil.rmtree(pipeline.workdir, ignore_errors=True)


def test_a_lookup_among_a_thousand_kept_caches_compares_the_newest_few(monkeypatch):
    """A service that keeps every closed session's cache holds hundreds on one system prompt: a
    session's open compares the newest LOOKUP_CANDIDATES of them token by token, not each (~0.1 ms
    a session's open, on the model's thread), and still finds the kept cache its prompt extends whole
    among them (a conversation's next turn opens right after its last)."""
    cache = prefix.PrefixCache(backend=None, budget=type("Budget", (), {})())
    system = tokens(60, 3 * prefix.BLOCK_TOKENS + 1)
    for n in range(1000):  # each holds the system prompt's 3 blocks and a part of the next
        entry = prefix.Retained(cache=None, tokens=[*system, *tokens(1000 + n, 10)])
        cache.index.index(entry, entry.tokens, len(entry.tokens))
        cache.retained[id(entry)] = entry
    compared = []
    real = prefix.common_prefix
    monkeypatch.setattr(prefix, "common_prefix", lambda *a: compared.append(a) or real(*a))

    newest = entry
    assert cache.index.candidates(newest.tokens) == ([*reversed(cache.retained.values())], 3)
    assert cache.index.candidates(newest.tokens, 4) == ([*reversed(cache.retained.values())][:4], 3)  # not copied whole
    assert cache.lookup([*newest.tokens, 7]) == (newest, len(newest.tokens))
    assert 0 < len(compared) <= prefix.LOOKUP_CANDIDATES
    compared.clear()
    source, hit = cache.lookup([*system, *tokens(9, 30)])  # a new user message: the system prompt
    assert isinstance(source, prefix.Retained) and hit >= 3 * prefix.BLOCK_TOKENS
    assert source.tokens[:hit] == [*system, *tokens(9, 30)][:hit]
    assert len(compared) <= prefix.LOOKUP_CANDIDATES
