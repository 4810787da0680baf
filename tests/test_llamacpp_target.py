"""The llama.cpp target (specdec.runtime.llamacpp on the embedded GGUF requantised to F32) keeps the
output exact, through the three services on loopback with the llama.cpp draft (Q8_0).

- The F32 GGUF holds the fp32 transformers target's weights, bit for bit.
- Greedy: output equals llama.cpp target-only decoding through the same target service, for
  k = 1, 4, 8 and for draft trees; and equals the eager transformers fp32 target's.
- Sampling: the tokens follow the target's law (a chi-square test on the randomised
  probability integral transform, below), through the whole loop.
- Rollback (the RPC, stale expected_length) and recovery from a target process killed
  mid-generation leave the output unchanged.
- Sessions whose verify blocks share llama_batches (different widths and lengths) get what each
  gets alone, and the service ends holding no session.

Near-ties. Token-for-token equality holds except where two tokens' logits are (almost) tied.
llama.cpp's numerics depend on the shape of the work: a verify block of k + 1 tokens runs its
matrix products as a matrix-matrix kernel where a one-token decode runs a matrix-vector one,
and with the KV cache shared by all sessions (unified cells) the cells a session's keys land in
depend on its neighbours, which changes the grouping of the attention sums. Both move logits
by ~3e-5 (`test_shape_moves_logits_only_in_the_last_bits` bounds it), as do the two libraries'
kernels between llama.cpp and transformers. So at a top-2 gap below NEAR_TIE two correct runs
may pick different tokens, and the rest of the text then differs. A divergence is accepted only
there: the gap is checked at the point of divergence. (With flash attention, which llama.cpp
turns on by default, the logits move by ~1e-2: the F32 target runs without it.)
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch
from scipy import stats

from cli.main import build_parser
from deploy.configs import ModelServiceConfig
from orchestrator.loop import LoopConfig, SpeculativeLoop
from orchestrator.server import connect
from specdec.decoding.sampling import SamplingParams, probs_from_logits
from specdec.limits import SessionLimits
from specdec.runtime.llamacpp import LlamaCppBackend
from specdec.runtime.startup import PROFILE_SESSIONS
from specdec.serving import wire
from specdec.v1 import model_pb2, orchestrator_pb2
from specdec.weights import models
from tests.harness import ServiceProcess, open_sessions, pipeline, run_clients, run_sequentially

real_model = pytest.mark.real_model  # every test but the selection ones loads the GGUF

TEXTS = ["List three colours.", "Write a haiku about rain.", "What is 12 times 13?"]
NEW_TOKENS = 40
NEAR_TIE = 1e-3  # logit gap within which rounding (shape, library) may flip greedy: 30x what it moves


@pytest.mark.slow
def test_backend_selection():
    """Config: `auto` (the default) runs the embedded default in float32 on a CPU with llama.cpp,
    anything else with transformers; a .gguf target implies llamacpp, and a .gguf draft the
    llamacpp drafter (it was loaded as a transformers config: "not a valid JSON file"); llamacpp
    wants a GGUF or the alias; the CLI fails with one line before a model loads."""
    from draft_service import drafters

    fastest = "llamacpp" if models.llamacpp_installed() else "torch"
    assert ModelServiceConfig("target").backend == "auto" and ModelServiceConfig("target").runtime == fastest
    for spec in (
        models.ModelSpec("org/model"),
        models.ModelSpec(device="cuda:0"),
        models.ModelSpec(dtype="bfloat16"),
        models.ModelSpec("smollm2-135m-x4"),
    ):
        assert ModelServiceConfig("target", spec).runtime == "torch", spec
    assert ModelServiceConfig("target", backend="torch").runtime == "torch"
    assert ModelServiceConfig("draft").runtime == "torch"  # a draft's runtime is its drafter's
    assert ModelServiceConfig("target", models.ModelSpec("/m/x.gguf")).backend == "llamacpp"
    assert drafters.runtime(models.ModelSpec("/m/x.Q4_1.gguf")) == "llamacpp"
    assert ModelServiceConfig("target", backend="llamacpp").spec.model == models.DEFAULT_ALIAS
    for bad in (
        dict(role="target", spec=models.ModelSpec("org/model"), backend="llamacpp"),
        dict(role="target", backend="onnx"),
        dict(role="draft", backend="llamacpp"),
    ):
        with pytest.raises(ValueError):
            ModelServiceConfig(**bad)
    cmd = [sys.executable, "-m", "cli", "target-service", "--backend", "llamacpp", "--model", "org/model"]
    out = subprocess.run(cmd + ["--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("specdec: error:") and ".gguf" in out.stderr
    parser = build_parser()
    assert parser.parse_args(["target-service", "--backend", "llamacpp"]).backend == "llamacpp"
    for command in (["generate", "hi"], ["serve"]):
        assert parser.parse_args([*command, "--target-backend", "llamacpp"]).target_backend == "llamacpp"
        assert parser.parse_args(command).target_backend == "auto"


class Counting:
    """The llama.cpp target, counting the sessions in each batched forward."""

    def __init__(self, backend):
        self._backend = backend
        self.sizes: list[int] = []

    def forward_batch(self, items):
        self.sizes.append(len(items))
        return self._backend.forward_batch(items)

    def __getattr__(self, name):
        return getattr(self._backend, name)


@pytest.fixture(scope="module")
def backends():
    draft = LlamaCppBackend(models.ModelSpec())
    target = LlamaCppBackend(models.ModelSpec(), models.f32_gguf_path)
    return draft, target


@pytest.fixture(scope="module")
def services(backends):
    draft, target = backends
    counting = Counting(target)
    # No prefix cache: tests here also take the backends' sequences directly, which closed
    # sessions' kept caches would hold (tests/test_prefix.py covers llama.cpp's prefix cache).
    with pipeline(draft, counting, limits=SessionLimits(prefix_cache=False)) as p:
        p.counting = counting
        yield p


@pytest.fixture(scope="module")
def prompts(backends):
    tokenizer = backends[1].tokenizer
    out = []
    for text in TEXTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if not isinstance(ids, list) else ids))
    return out


def generate(stub, ids, k=4, disabled=False, n=NEW_TOKENS, tree_nodes=0, **kw):
    speculation = orchestrator_pb2.SpeculationParams(lookahead=k, disabled=disabled, tree_nodes=tree_nodes)
    request = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=ids), max_new_tokens=n, speculation=speculation, **kw
    )
    return stub.Generate(request, timeout=600)


@pytest.fixture(scope="module")
def alone(services, prompts):
    """llama.cpp target-only greedy decoding through the same target service."""
    return [list(generate(services.orchestrator, ids, disabled=True).token_ids) for ids in prompts]


def target_row(target_stub, ids) -> np.ndarray:
    """The target service's next-token distribution (temperature 1) after `ids`."""
    sid = f"row-{time.monotonic_ns()}"
    target_stub.OpenSession(model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=ids))
    try:
        ref = model_pb2.SessionRef(session_id=sid, expected_length=len(ids))
        sampling = model_pb2.SamplingParams(temperature=1.0)
        return wire.decode_row(target_stub.Score(model_pb2.ScoreRequest(session=ref, sampling=sampling)).row)
    finally:
        target_stub.CloseSession(model_pb2.CloseSessionRequest(session_id=sid))


def top2_gap(row: np.ndarray) -> float:
    """The logit gap of the two most likely tokens, from their probabilities."""
    p1, p2 = np.sort(row.astype(np.float64))[-2:][::-1]
    return float(np.log(p1) - np.log(p2))


def assert_equal_but_near_ties(target_stub, prompt, got, expected, what):
    if got == expected:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected)))
    gap = top2_gap(target_row(target_stub, prompt + expected[:i]))
    assert gap < NEAR_TIE, f"{what}: diverged at token {i} where the target's top-2 gap is {gap:.2e}"


@real_model
def test_f32_gguf_holds_the_fp32_weights():
    """llama.cpp's requantisation and transformers' dequantisation give the same floats."""
    from gguf import GGMLQuantizationType, GGUFReader
    from safetensors import safe_open

    reader = GGUFReader(models.f32_gguf_path())
    assert {t.tensor_type for t in reader.tensors} == {GGMLQuantizationType.F32}
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    path = models.ensure_default_converted() / "model.safetensors"
    with safe_open(path, "pt") as f:
        pairs = [("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight")]
        pairs.append(("token_embd.weight", "model.embed_tokens.weight"))
        for gguf_name, hf_name in pairs:
            hf = f.get_tensor(hf_name).numpy()
            assert tensors[gguf_name].shape == hf.shape and np.array_equal(tensors[gguf_name], hf), gguf_name


@real_model
def test_q8_draft_gguf_holds_the_weights_within_half_a_step():
    """The drafter's default file: every matrix requantised to Q8_0 (vectors stay F32), each
    weight within half a Q8_0 step of the fp32 one (plus its fp16 scale's rounding)."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = GGUFReader(models.draft_gguf_path())
    kinds = {(t.tensor_type, len(t.shape)) for t in reader.tensors}
    assert kinds == {(GGMLQuantizationType.Q8_0, 2), (GGMLQuantizationType.F32, 1)}
    tensors = {t.name: t for t in reader.tensors}
    path = models.ensure_default_converted() / "model.safetensors"
    with safe_open(path, "pt") as f:
        for gguf_name, hf_name in [("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight")]:
            hf = f.get_tensor(hf_name).numpy().reshape(-1, 32)  # Q8_0's blocks of 32
            tensor = tensors[gguf_name]
            q8 = dequantize(tensor.data, tensor.tensor_type).reshape(hf.shape)
            step = np.abs(hf).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(q8 - hf) <= 0.6 * step), gguf_name


@real_model
def test_describe_reports_the_backend(services):
    info = services.target.Describe(model_pb2.DescribeRequest())
    # named as the user named it: the OpenAI API serves the docs' "smollm2-135m", not the file
    assert (info.backend, info.dtype, info.model_name) == ("llamacpp", "float32", models.DEFAULT_ALIAS)
    draft = services.draft.Describe(model_pb2.DescribeRequest())
    assert (draft.backend, draft.dtype) == ("llamacpp", "Q8_0")
    # The draft's batched step as it timed it at start: 16 sessions in one llama_batch cost
    # less than 16 steps of one (measured on one core: 88 ms against 16 x 8).
    steps = {c.sessions: c.seconds for c in draft.step_costs}
    assert sorted(steps) == list(PROFILE_SESSIONS)
    assert steps[16] < 16 * steps[1]


@real_model
def test_shape_moves_logits_only_in_the_last_bits(backends, prompts):
    """The same positions' logits from one verify block and from one-token decodes, and
    with another session's cells in the way: equal up to rounding (what NEAR_TIE allows for)."""
    _, target = backends
    ids = prompts[0]
    block, steps, other = target.new_cache(), target.new_cache(), target.new_cache()
    try:
        target.forward(other, prompts[1], 1)  # cells before the others' in the unified cache
        together = target.forward(block, ids, 5).clone()  # the last 5 positions of one forward (views: copied)
        target.forward(steps, ids[:-5], 1)
        one_by_one = torch.cat([target.forward(steps, [t], 1).clone() for t in ids[-5:]])
        diff = float((together - one_by_one).abs().max())
        assert diff < NEAR_TIE / 10, diff
        assert torch.equal(together.argmax(-1), one_by_one.argmax(-1))
    finally:
        for cache in (block, steps, other):
            target.release(cache)


@real_model
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_equals_target_only(services, prompts, alone, k):
    accepted = drafted = 0
    for ids, expected in zip(prompts, alone, strict=True):
        response = generate(services.orchestrator, ids, k)
        accepted += response.stats.accepted_tokens
        drafted += response.stats.draft_tokens
        assert_equal_but_near_ties(services.target, ids, list(response.token_ids), expected, f"k={k}")
    assert drafted > 0 and accepted / drafted > 0.5


@real_model
@pytest.mark.parametrize("depth,nodes", [(4, 8), (8, 12)])
def test_greedy_trees_equal_target_only(services, prompts, alone, depth, nodes):
    """Draft trees (the llama.cpp draft's spine with runners-up), scored chain by chain in each
    session's own KV stream (target_service.scorer.tree_rows)."""
    accepted = drafted = 0
    for ids, expected in zip(prompts, alone, strict=True):
        response = generate(services.orchestrator, ids, depth, tree_nodes=nodes)
        accepted += response.stats.accepted_tokens
        drafted += response.stats.draft_tokens
        assert_equal_but_near_ties(services.target, ids, list(response.token_ids), expected, f"tree {depth}/{nodes}")
    assert drafted > 0 and accepted / drafted > 0.3
    assert open_sessions(services.target) == 0


@real_model
def test_greedy_equals_the_transformers_fp32_target(services, prompts, alone):
    model, _ = models.load(models.ModelSpec())
    eos = services_eos(services)
    for ids, got in zip(prompts, alone, strict=True):
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = out[0, len(ids) :].tolist()
        if expected and expected[-1] in eos:
            expected = expected[:-1]  # the pipeline does not emit the EOS it stopped at
        assert_equal_but_near_ties(services.target, ids, got, expected, "vs transformers")


def services_eos(services) -> set[int]:
    return set(services.target.Describe(model_pb2.DescribeRequest()).eos_token_ids)


@real_model
def test_sampled_tokens_follow_the_target_law(services, backends, prompts):
    """Randomised PIT: for a token x drawn from a row p (tokens ranked by p), F(x-) + V p(x) is
    uniform on [0, 1) for V uniform; every position has its own p, the values are independent.
    The rows are the target's (teacher-forced over the generated tokens, one forward each);
    a chi-square test on 20 bins (~350 tokens: p ~ 0.9 here). The same tokens judged by the rows
    at temperature 0.8 fail it (p ~ 1e-17): the test has power for a law that far off."""
    _, target = backends
    eos = services_eos(services)
    rng = np.random.default_rng(0)
    pit = {1.0: [], 0.8: []}
    for seed in range(6):
        ids = prompts[seed % len(prompts)]
        sampling = model_pb2.SamplingParams(temperature=1.0)
        response = generate(services.orchestrator, ids, 4, n=64, sampling=sampling, seed=seed)
        tokens = list(response.token_ids) + ([min(eos)] if response.finish_reason == "stop" else [])
        # The services are idle between requests: the backend is free for this one forward.
        cache = target.new_cache()
        try:
            logits = target.forward(cache, ids + tokens[:-1], len(tokens)).double()  # [len(tokens), vocab]
        finally:
            target.release(cache)
        v = rng.random(len(tokens))
        for temperature in pit:
            probs = probs_from_logits(logits, SamplingParams(temperature=temperature)).numpy()
            for row, x, u in zip(probs, tokens, v, strict=True):
                above = row[row > row[x]].sum()  # the mass ranked before x (ties: none here)
                pit[temperature].append(above + u * row[x])
    counts = {t: np.histogram(values, bins=20, range=(0, 1))[0] for t, values in pit.items()}
    assert sum(counts[1.0]) > 250
    assert stats.chisquare(counts[1.0]).pvalue > 1e-3, counts[1.0]
    assert stats.chisquare(counts[0.8]).pvalue < 1e-6, counts[0.8]


@real_model
def test_rollback(services, prompts, alone):
    target, ids, expected = services.target, prompts[0], alone[0]
    sid = "rollback"
    target.OpenSession(model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=ids))

    def score(length, drafts, append=()):
        ref = model_pb2.SessionRef(session_id=sid, expected_length=length)
        request = model_pb2.ScoreRequest(session=ref, append_tokens=list(append), draft_token_ids=drafts)
        return list(target.Score(request).argmax_token_ids)

    try:
        first = score(len(ids), expected[:4])
        assert first == expected[:5]
        assert score(len(ids), expected[4:8], append=expected[:4]) == expected[4:9]
        for _ in range(2):  # absolute: twice equals once
            target.Rollback(model_pb2.RollbackRequest(session_id=sid, to_length=len(ids) + 1))
        state = target.GetSession(model_pb2.GetSessionRequest(session_id=sid))
        assert list(state.token_ids) == ids + expected[:1] and state.cached_length <= len(ids)
        assert score(len(ids) + 1, expected[1:4]) == first[1:]  # the cells past it are gone
        with pytest.raises(grpc.RpcError) as err:
            score(len(ids) + 4, expected[4:6])  # the caller's view is stale
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        target.CloseSession(model_pb2.CloseSessionRequest(session_id=sid))


def target_process(workdir, port=0) -> ServiceProcess:
    """`specdec target-service --backend llamacpp` as a child process."""
    return ServiceProcess("target", models.DEFAULT_ALIAS, workdir, port, ["--backend", "llamacpp", "--threads", "1"])


@real_model
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
def test_killed_target_process_leaves_the_output_unchanged(services, prompts, tmp_path, temperature):
    target = target_process(tmp_path)
    try:
        address = target.wait_ready(timeout=180)
        pair = connect(services.addresses["draft"], address)
        config = LoopConfig(SamplingParams(temperature=temperature), 30, lookahead=4, seed=3)

        def run(kill_after=None, restart=lambda: None):
            loop = SpeculativeLoop(pair.draft, pair.target, prompts[1], config)
            for i, _ in enumerate(loop.rounds()):
                if i == kill_after:
                    restart()
            return loop

        reference = run()

        def kill_and_restart():
            nonlocal target
            target.kill()
            target = target_process(tmp_path, port=address.rsplit(":", 1)[1])

        loop = run(kill_after=2, restart=kill_and_restart)  # the restarted process is still starting
        assert loop.stats.recoveries == 1 and pair.target.reopens == 1
        if temperature == 0:
            assert_equal_but_near_ties(services.target, prompts[1], loop.generated, reference.generated, "recovered")
        else:  # the same seed, the same uniforms: equal unless a near-tie moved a draw
            assert loop.generated == reference.generated
        assert target.wait_ready(timeout=180) == address
    finally:
        target.kill()


@real_model
def test_sessions_batched_together_equal_each_alone(services, prompts):
    """Four clients at once, different prompts (lengths) and lookaheads (verify widths)."""
    per_client = [
        [orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=prompts[i % len(prompts)][: len(prompts[i % len(prompts)]) - i]),
            max_new_tokens=24 + 4 * i,
            speculation=orchestrator_pb2.SpeculationParams(lookahead=(1, 3, 5, 8)[i]),
        )]
        for i in range(4)
    ]  # fmt: skip
    address = services.addresses["orchestrator"]
    sequential = run_sequentially(address, per_client)
    services.counting.sizes.clear()
    together = run_clients(address, per_client)
    assert max(services.counting.sizes) > 1  # verify blocks of several sessions in one llama_batch
    for requests, got, expected in zip(per_client, together, sequential, strict=True):
        prompt = list(requests[0].token_ids.ids)
        assert_equal_but_near_ties(services.target, prompt, list(got[0]), list(expected[0]), "batched")
    assert open_sessions(services.target) == 0 and open_sessions(services.draft) == 0


@real_model
@pytest.mark.parametrize("which", ["draft", "target"])
def test_a_filled_gap_leaves_every_stream_as_it_was(backends, prompts, which):
    """Steps whose streams skip ids: a short gap is filled (a token in each missing stream, removed
    after the decode) so that the step is one ubatch. Every session's logits, the skipped ones' after
    their fillers included, are those of the session alone: bit for bit on the Q8_0 draft (whose
    numbers the Leviathan rule reads), up to the rounding that any batch moves them by on the F32
    target (test_shape_moves_logits_only_in_the_last_bits): a stale filler would move them far more."""
    backend = backends[0 if which == "draft" else 1]
    rng = np.random.default_rng(3)
    n, steps = 6, 8
    own = [[int(t) for t in rng.integers(0, 5000, steps)] for _ in range(n)]  # each session's tokens

    def skipped(t: int) -> set[int]:  # gaps of 1 (session 2), and of 3 (1 to 3) every third step
        return {1, 2, 3} if t % 3 == 0 else {2} if t % 2 == 0 else set()

    caches = [backend.new_cache() for _ in range(n)]
    filled = backend.filled
    together = [[] for _ in range(n)]
    try:
        for i, cache in enumerate(caches):
            backend.forward(cache, prompts[i % len(prompts)], 1)
        fed = [0] * n
        for t in range(3 * steps):
            items = [(c, [own[i][fed[i]]], 1) for i, c in enumerate(caches) if i not in skipped(t) and fed[i] < steps]
            if not items:
                continue
            for (cache, _, _), rows in zip(items, backend.forward_batch(items), strict=True):
                i = caches.index(cache)
                together[i].append(rows[0].clone())
                fed[i] += 1
        assert fed == [steps] * n
    finally:
        for cache in caches:
            backend.release(cache)
    assert backend.filled > filled  # the gaps of 1 were filled
    for i in range(n):
        alone = backend.new_cache()
        try:
            backend.forward(alone, prompts[i % len(prompts)], 1)
            expected = [backend.forward(alone, [token], 1)[0].clone() for token in own[i]]
        finally:
            backend.release(alone)
        for got, want in zip(together[i], expected, strict=True):
            if which == "draft":
                assert torch.equal(got, want), i
            else:
                assert float((got - want).abs().max()) < NEAR_TIE / 10 and got.argmax() == want.argmax(), i
