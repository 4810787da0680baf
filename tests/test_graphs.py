"""The static-forward backend (specdec.runtime.graphs) computes what the eager one does, builds everything
before it serves, on the thread that serves.

- ragged batched forwards (batches, widths and KV lengths padded to buckets, a block past the
  widest width, a row past the longest length, a rollback then a different continuation) give
  the logits the eager backend gives, and run the steps built at start;
- the KV cache is allocated once from the session limits: it never moves, a sequence past a
  slot's capacity is OUT_OF_RANGE and a session past the slots RESOURCE_EXHAUSTED;
- greedy generations through real gRPC services, several at once (batches), with fixed and
  adaptive k (verify blocks of k + 1), crossing every bucket, equal the eager services' token
  for token; no step is built after the services said ready (Describe, the backend's counter);
- every forward of a running service, its warm-up, graph building and draft profile included,
  runs on the service's model worker thread;
- sampling through the loop with the static target follows its law (chi-square): the tiny
  target's attention output is zeroed, so its next token depends on the last token alone and
  its law is a Markov kernel we can read off the model;
- the embedded default target decodes greedily as it does eager (real_model).
Every test runs on a CPU (the static forwards eager); where CUDA is available, the backend
tests run there too, captured as CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from deploy.configs import ModelServiceConfig
from draft_service.drafters import MODEL
from draft_service.server import DraftServicer
from orchestrator.loop import LoopConfig, SpeculativeLoop
from specdec.decoding.sampling import SamplingParams, probs_from_logits
from specdec.errors import OutOfRange, ResourceExhausted
from specdec.limits import SessionLimits
from specdec.runtime import fusion, graphs
from specdec.runtime.backend import HFBackend
from specdec.runtime.engine import SessionEngine
from specdec.runtime.graphs import Buckets, GraphBackend, bucket, fuse_backend, kv_shape
from specdec.runtime.kvcache import Slot
from specdec.runtime.startup import warm_up
from specdec.v1 import model_pb2, model_pb2_grpc, orchestrator_pb2
from specdec.weights import models
from specdec.weights.models import ModelSpec
from target_service.server import TargetServicer
from tests.conftest import make_tiny_model
from tests.harness import NO_EOS_PROMPT, SlowBackend, pipeline, run_clients
from tests.standins import Direct, MarkovBackend, random_markov
from tests.stats import markov_chisquare

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Few buckets keep the steps few: 4 slots of 300 positions, lengths past 128 run eager.
BUCKETS = Buckets(batches=(2, 4), widths=(4, 8), lengths=(32, 128))
LIMITS = SessionLimits(max_sessions=4, max_kv_tokens=4 * 300)
FUSE = {"cpu": "aot_eager", "cuda": "inductor"}


def graph_backend(path, device="cpu", buckets=BUCKETS, limits=LIMITS, fuse="") -> GraphBackend:
    backend = GraphBackend(ModelSpec(path, device, "float32"), buckets, fuse)
    backend.prepare(limits)
    return backend


# On a CPU, fused pieces run through torch.compile's aot_eager backend: its tracing, guards and variants are
# what a CUDA device's inductor compiles (inductor's C++ for a CPU takes ~25 s a variant here).
@pytest.mark.slow
@pytest.mark.parametrize("device, fuse", [(d, "") for d in DEVICES] + [(d, FUSE[d]) for d in DEVICES])
def test_forwards_equal_eager(tiny_models, device, fuse):
    eager = HFBackend(ModelSpec(tiny_models["target"], device, "float32"))
    static = graph_backend(tiny_models["target"], device, fuse=fuse)
    assert static.max_context == 300 and static.built.graphs == 2 * 2 * 2
    if fuse:
        assert sorted(static.fused) == ["LlamaMLP", "LlamaRMSNorm", "modeling_llama.apply_rotary_pos_emb"]
    rng = np.random.default_rng(0)
    slots = {b: [b.new_cache() for _ in range(3)] for b in (eager, static)}
    steps = [
        [(0, 7, 2), (1, 3, 1), (2, 8, 3)],  # prefills of different lengths: a pad row, pad columns
        [(2, 2, 2), (0, 1, 1)],  # blocks of different widths, a row left out
        [(1, 4, 1)],
        [(0, 5, 5), (1, 20, 1)],  # a block past the widest width: this batch runs eager
        [(2, 3, 3)],
        [(0, 120, 1)],
        [(0, 6, 6), (2, 1, 1)],  # row 0 attends 139 positions, past the longest length: eager
        [(1, 6, 2)],  # row 1 attends 33 positions: the length 128
        [(2, 100, 1)],
        [(2, 4, 4), (1, 1, 1)],  # row 2 attends 113 positions: the length 128
    ]
    for step in steps:
        items = [(i, rng.integers(3, 40, size=width).tolist(), n) for i, width, n in step]
        got = {b: b.forward_batch([(slots[b][i], tokens, n) for i, tokens, n in items]) for b in slots}
        for a, c in zip(got[eager], got[static], strict=True):
            torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-4)
        if step == steps[2]:  # rollback is a length: crop, then a different continuation
            for b in slots:
                b.crop(slots[b][2], 5)
    assert [s.length for s in slots[static]] == [s.length for s in slots[eager]]
    # the steps that ran static, by (rows, width, length): the others ran eager
    assert dict(static.built.hits) == {(4, 8, 32): 1, (2, 4, 32): 3, (2, 8, 128): 1, (2, 4, 128): 1}
    assert static.builds == static.built.graphs and static.builds_after_ready == 0
    for b in slots:
        for slot in slots[b]:
            b.release(slot)


@pytest.mark.slow
def test_fused_pieces_compile_once_for_all_layers(tmp_path):
    """One compiled function a piece serves every layer (a variant where a batch or width is 1, not a
    layer); the patched rotary embedding runs compiled only inside a fused backend's static forward."""
    path = make_tiny_model(tmp_path / "deep", seed=3, layers=10)
    torch._dynamo.reset()
    static = graph_backend(path, fuse="aot_eager")
    eager = HFBackend(ModelSpec(path, "cpu", "float32"))
    rng = np.random.default_rng(1)
    slots = {b: [b.new_cache(), b.new_cache()] for b in (static, eager)}
    for step in ([(0, 9, 1), (1, 3, 3)], [(0, 1, 1)], [(0, 4, 4), (1, 1, 1)], [(1, 6, 2)]):
        items = [(i, rng.integers(3, 40, size=width).tolist(), n) for i, width, n in step]
        got = {b: b.forward_batch([(slots[b][i], tokens, n) for i, tokens, n in items]) for b in slots}
        for a, c in zip(got[eager], got[static], strict=True):
            torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-4)
    # 3 pieces, 6 variants each at most (the first shape's, then batch and width dynamic where not 1), where a
    # compile per module would be 32 at least (21 norms, 10 MLPs, the rotary embedding)
    assert 3 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 18
    rotary = sys.modules[type(static.model).__module__].apply_rotary_pos_emb
    assert isinstance(rotary, fusion._Rotary)
    compiled, rotary.compiled = rotary.compiled, None  # called, it would raise
    try:  # another model of the architecture in the process, and the fused one's eager forwards (past the widths)
        for backend in (eager, static):
            assert backend.forward(backend.new_cache(), list(range(3, 23)), 3).shape == (3, backend.vocab_size)
    finally:
        rotary.compiled = compiled


def test_a_compiler_that_fails_leaves_the_eager_forward(tiny_models, capsys):
    def broken(graph, example_inputs):
        raise RuntimeError("no compiler here")

    static = graph_backend(tiny_models["target"], fuse=broken)
    assert static.fused == [] and static.builds == static.built.graphs == 8
    assert "compiling the fused pieces failed" in capsys.readouterr().err
    eager = HFBackend(ModelSpec(tiny_models["target"], "cpu", "float32"))
    blocks = [[5, 6, 7, 8], [9, 10]]
    got = [b.forward_batch([(b.new_cache(), tokens, 2) for tokens in blocks]) for b in (eager, static)]
    for a, c in zip(*got, strict=True):
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-4)
    assert static.built.hits == {(2, 4, 32): 1}  # the static forward ran, unfused


def test_fusing_by_default_on_cuda_with_triton_only(monkeypatch):
    monkeypatch.setattr(graphs, "_fuse", None)  # what the CLI sets from $SPECDEC_FUSE: unset
    assert fuse_backend(torch.device("cpu")) == ""  # a CPU serves eager: nothing to fuse
    has_triton = importlib.util.find_spec("triton") is not None
    assert fuse_backend(torch.device("cuda", 0)) == ("inductor" if has_triton else "")
    for value, backend in (("0", ""), ("1", "inductor"), ("aot_eager", "aot_eager")):
        monkeypatch.setattr(graphs, "_fuse", value)
        assert fuse_backend(torch.device("cuda", 0)) == fuse_backend(torch.device("cpu")) == backend


def test_buckets_and_the_kv_cache_shape():
    assert [bucket(n, (1, 2, 4, 8, 33)) for n in (1, 3, 5, 8, 9, 33, 34)] == [1, 4, 8, 8, 33, 33, None]
    per_token = 46_080  # the default target's keys and values of one position, fp32
    assert kv_shape(SessionLimits(), 8192, per_token, None) == (64, 1024)  # 65536 tokens over 64 slots
    assert kv_shape(SessionLimits(max_kv_tokens=0), 8192, per_token, None) == (64, 8192)  # no cap: the context
    assert kv_shape(SessionLimits(max_kv_tokens=10**6), 8192, per_token, None) == (64, 8192)
    # CUDA: at most 40% of the free memory, over the slots and the pad slot
    assert kv_shape(SessionLimits(max_sessions=4, max_kv_tokens=0), 8192, 1000, 50_000) == (4, 4)
    with pytest.raises(ValueError, match="no position"):
        kv_shape(SessionLimits(max_sessions=4, max_kv_tokens=0), 8192, 1000, 5_000)


def test_the_kv_cache_is_allocated_once_and_refuses_past_it(tiny_models):
    backend = graph_backend(tiny_models["target"])
    where = [t.data_ptr() for t in (*backend.kv.keys, *backend.kv.values)]
    engine = SessionEngine(backend, "target", LIMITS)
    try:
        with pytest.raises(OutOfRange, match="context of 300"):
            engine.open("long", [5] * 301)
        for i in range(4):
            engine.open(f"s{i}", [5] * (250 if i == 0 else 3))
        with pytest.raises(ResourceExhausted, match="max_sessions 4"):
            engine.open("fifth", [5, 6])
    finally:
        engine.stop()
    with pytest.raises(ResourceExhausted, match="slots"):  # the cache itself, under the engine's check
        backend.new_cache()
    slot = Slot(index=0, length=250)
    with pytest.raises(OutOfRange, match="capacity of 300"):  # eager (60 wide), past the slot
        backend.forward(slot, [5] * 60, 1)
    assert [t.data_ptr() for t in (*backend.kv.keys, *backend.kv.values)] == where
    assert backend.kv.capacity == 300 and backend.kv.slots == 4 + 1  # and the pad slot


class Threads:
    """A backend that notes the thread of every call that touches the model or its cache."""

    def __init__(self, backend):
        self._backend = backend
        self.seen: set[tuple[str, str, int]] = set()

    def _note(self, what: str) -> None:
        self.seen.add((what, threading.current_thread().name, threading.get_ident()))

    def prepare(self, limits):
        self._note("prepare")
        return self._backend.prepare(limits)

    def new_cache(self):
        self._note("new_cache")
        return self._backend.new_cache()

    def release(self, cache):
        self._note("release")
        return self._backend.release(cache)

    def forward(self, cache, token_ids, n_logits):
        self._note("forward")
        return self._backend.forward(cache, token_ids, n_logits)

    def forward_batch(self, items):
        self._note("forward_batch")
        return self._backend.forward_batch(items)

    def crop(self, cache, keep):
        self._note("crop")
        return self._backend.crop(cache, keep)

    def __getattr__(self, name):
        return getattr(self._backend, name)


@pytest.mark.usefixtures("draft_awaited")
def test_every_forward_of_a_service_runs_on_its_model_worker(tiny_models):
    """Building the graphs, the warm-up, the draft's step profile and serving: one thread a
    service, its model worker (CUDA graphs are captured and replayed on one thread). The rounds
    wait for the draft's session, so the target rolls back (crops) whatever the load (a greedy
    round goes without drafts until the draft is open: with the open 1 s late, `--late-draft 1`,
    the target's only crop was its cache's at the session's close; CI once saw none at all), and
    the sessions close before the services stop."""
    backends = {role: Threads(GraphBackend(ModelSpec(tiny_models[role], "cpu", "float32"), BUCKETS)) for role in
                ("draft", "target")}  # fmt: skip
    with pipeline(backends["draft"], backends["target"], limits=LIMITS) as p:
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=NO_EOS_PROMPT), max_new_tokens=20
        )
        assert len(p.orchestrator.Generate(request, timeout=60).token_ids) == 20
        assert p.sessions_freed_within(30)
    for role, backend in backends.items():
        calls = {what for what, _, _ in backend.seen}
        assert {"prepare", "forward", "forward_batch", "new_cache", "release", "crop"} <= calls, role
        assert {(name, ident) for _, name, ident in backend.seen} == {
            (f"{role}-model-worker", next(ident for *_, ident in backend.seen))
        }, role


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_generations_equal_eager_and_nothing_is_built_after_ready(tiny_models, tiny_backends, device):
    """Through real gRPC services, two clients at once (fixed k 3 and 7: verify blocks 4 and 8
    wide; adaptive k; speculation off; overlapped and sequential rounds), generations that cross
    every width and length bucket equal the eager services' token for token; with two forwards
    made to share a step (the batch bucket 2), neither service built a step after it said ready."""
    buckets = Buckets(batches=(1, 2), widths=(1, 4, 8), lengths=(32, 64, 128))

    def request(**speculation):
        ids = orchestrator_pb2.TokenIds(ids=NO_EOS_PROMPT)
        spec = orchestrator_pb2.SpeculationParams(**speculation)
        return orchestrator_pb2.GenerateRequest(token_ids=ids, max_new_tokens=150, speculation=spec)

    clients = [
        [request(lookahead=3), request(lookahead=7, adaptive=True)],
        [request(lookahead=7, overlap=False), request(disabled=True)],
    ]
    roles = ("draft", "target")
    eager = (
        tiny_backends
        if device == "cpu"
        else {r: HFBackend(ModelSpec(tiny_models[r], device, "float32")) for r in roles}
    )
    with pipeline(eager["draft"], eager["target"], limits=LIMITS) as p:
        expected = run_clients(p.addresses["orchestrator"], clients)
    static = {role: GraphBackend(ModelSpec(tiny_models[role], device, "float32"), buckets) for role in roles}
    slow = {role: SlowBackend(backend, 0.0) for role, backend in static.items()}
    with pipeline(slow["draft"], slow["target"], limits=LIMITS) as p:
        got = run_clients(p.addresses["orchestrator"], clients)
        stubs = {"draft": p.draft, "target": p.target}
        for role, stub in stubs.items():  # whether two rounds shared a step was up to timing
            batch_of_two(stub, slow[role])
        infos = {role: stub.Describe(model_pb2.DescribeRequest()) for role, stub in stubs.items()}
    assert got == expected
    for role, backend in static.items():
        info = infos[role]
        assert info.builds_after_ready == 0 and backend.builds_after_ready == 0, role
        assert backend.builds == info.static_forwards.built, role  # every one at start
        report = info.static_forwards
        mode = "cuda-graphs" if device == "cuda" else "eager"
        assert (report.mode, report.built, report.slots, report.capacity) == (mode, 2 * 3 * 3, 4, 300)
        assert (list(report.batches), list(report.widths), list(report.lengths)) == ([1, 2], [1, 4, 8], [32, 64, 128])
        assert info.max_context == 300 and report.kv_bytes == backend.kv.nbytes > 0
        hits = backend.built.hits
        assert {b for b, _, _ in hits} == {1, 2} and {c for _, _, c in hits} == {32, 64, 128}, (role, hits)
    assert {w for _, w, _ in static["target"].built.hits} == {1, 4, 8}  # off, verifies of 3 and 7 drafts


def batch_of_two(stub, slow: SlowBackend) -> None:
    """Two forwards queued behind a slow step run as one step (the worker takes every queued one)."""
    for sid in "abc":
        stub.OpenSession(model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=[1, 5, 6]))
    ref = {sid: model_pb2.SessionRef(session_id=sid, expected_length=3) for sid in "abc"}
    if isinstance(stub, model_pb2_grpc.DraftServiceStub):
        call = lambda sid: stub.Propose(model_pb2.ProposeRequest(session=ref[sid], k=1))  # noqa: E731
    else:
        call = lambda sid: stub.Score(model_pb2.ScoreRequest(session=ref[sid]))  # noqa: E731
    slow.delay = 0.3
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(call, "a")
        time.sleep(0.1)  # a's step is sleeping: b and c queue behind it
        rest = [pool.submit(call, sid) for sid in "bc"]
        for future in (first, *rest):
            future.result(timeout=30)
    slow.delay = 0.0
    for sid in "abc":
        stub.CloseSession(model_pb2.CloseSessionRequest(session_id=sid))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_graphs_replay_only_on_the_thread_that_captured_them(tiny_models):
    backend = graph_backend(tiny_models["target"], "cuda")
    slot = backend.new_cache()
    backend.forward(slot, [5, 6], 1)  # this thread captured them
    with ThreadPoolExecutor(1) as pool, pytest.raises(RuntimeError, match="thread"):
        pool.submit(backend.forward, slot, [7], 1).result()


def run(draft, target, prompt, sampling, n, k=4, seed=9):
    loop = SpeculativeLoop(draft, target, prompt, LoopConfig(sampling, n, lookahead=k, seed=seed))
    for _ in loop.rounds():
        pass
    return loop.generated


def services(draft_backend, target_backend):
    return (
        Direct(DraftServicer(SessionEngine(draft_backend, "draft"), MODEL)),
        Direct(TargetServicer(SessionEngine(target_backend, "target"))),
    )


@pytest.mark.slow
def test_sampling_through_the_loop_follows_the_static_target(tmp_path):
    path = make_tiny_model(tmp_path / "markov", seed=4)
    backend = GraphBackend(ModelSpec(path, "cpu", "float32"), BUCKETS)
    with torch.no_grad():  # attention adds nothing: the next token depends on the last one alone
        for layer in backend.model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        backend.model.lm_head.weight.mul_(0.1)  # spread the law over the vocabulary
    backend.prepare(LIMITS)
    vocab = backend.vocab_size
    with torch.inference_mode():
        logits = backend.model(torch.arange(vocab)[:, None]).logits[:, -1].float()
    sampling = SamplingParams(temperature=1.0)
    kernel = probs_from_logits(logits, sampling).double().numpy()
    draft_probs = random_markov(vocab, 5)
    draft, target = services(MarkovBackend(draft_probs), backend)
    # 15 chains of 200 tokens: each crosses every length bucket, then runs eager past the last
    chains = [[3, *run(draft, target, [3], sampling, 200, k=3, seed=11 + i)] for i in range(15)]
    assert markov_chisquare(chains, kernel) > 1e-3
    assert markov_chisquare(chains, draft_probs) < 1e-3
    assert {c for _, _, c in backend.built.hits} == {32, 128}


@pytest.mark.real_model
def test_default_target_static_decodes_as_eager():
    eager = HFBackend(models.ModelSpec())
    static = GraphBackend(models.ModelSpec(), Buckets(batches=(1,), widths=(8,), lengths=(256,)))
    warm_up(static, SessionLimits(max_sessions=2))
    tok = eager.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "List three colours."}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if not isinstance(prompt, list) else prompt)
    outputs = []  # the eager target drafts: every draft accepted, verify blocks 5 wide (bucket 8)
    for target_backend in (eager, static):
        draft_service, target = services(eager, target_backend)
        outputs.append(run(draft_service, target, prompt, SamplingParams(), 48, k=4))
    assert outputs[0] == outputs[1]
    assert set(static.built.hits) == {(1, 8, 256)} and static.builds_after_ready == 0


def test_flags():
    from cli import options
    from cli.main import build_parser

    parse = build_parser().parse_args
    assert options.pipeline_config(parse(["generate", "hi"])).target_compile is None  # by device
    assert options.pipeline_config(parse(["generate", "hi", "--no-target-compile"])).target_compile is False
    assert options.pipeline_config(parse(["serve", "--target-compile"])).target_compile is True
    assert parse(["target-service", "--compile"]).compile is True
    assert parse(["draft-service", "--no-compile"]).compile is False
    with pytest.raises(ValueError, match="needs a CUDA device"):  # a CPU serves eager
        ModelServiceConfig("target", compile=True)
    assert ModelServiceConfig("target", models.ModelSpec(device="cuda:0"), compile=True).compile
