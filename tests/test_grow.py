"""The grown target (specdec.weights.grow): the construction keeps every logit, the check that says so
fails on a wrong construction, the alias cache builds once, and the grown aliases stay off
llama.cpp while the default alias keeps its llama.cpp drafter."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from deploy.configs import ModelServiceConfig
from draft_service import drafters
from specdec.weights import grow, models
from tests.conftest import make_tiny_model

TOLERANCE = 1e-4  # fp32; the extra zero terms only reorder a sum
# the embedded model's config (its fp32 conversion's config.json), for the shapes the docstring claims
SMOLLM2 = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def grown_model(base: LlamaForCausalLM, shape: grow.Shape, corrupt=None) -> LlamaForCausalLM:
    """`base` grown to `shape` in memory; `corrupt(state, config)` may edit the grown weights first."""
    config = base.config.to_dict()
    state = grow.grow_state_dict(base.state_dict(), config, shape)
    new_config = grow.grown_config(config, shape, "base")
    if corrupt is not None:
        corrupt(state, new_config)
    model = LlamaForCausalLM(LlamaConfig(**new_config))
    model.load_state_dict(state, strict=True)
    return model.eval()


@torch.no_grad()
def max_logit_difference(a, b, batches) -> float:
    return max((a(ids).logits - b(ids).logits).abs().max().item() for ids in batches)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("grow") / "base", seed=3, layers=3)
    torch.manual_seed(0)
    batches = [torch.randint(3, 40, (2, n)) for n in (1, 9, 40)]
    return path, LlamaForCausalLM.from_pretrained(path).eval(), batches


def test_layer_sources_keep_the_base_layers_in_order():
    assert grow.layer_sources(3, 6) == [(0, True), (0, False), (1, True), (1, False), (2, True), (2, False)]
    for base, layers in [(30, 60), (30, 90), (3, 7), (4, 4)]:
        sources = grow.layer_sources(base, layers)
        assert len(sources) == layers
        assert [i for i, kept in sources if kept] == list(range(base))
        assert sources[0] == (0, True)  # an identity copies the base layer before it


def test_grown_tiny_model_computes_the_base_logits(tiny):
    _, base, batches = tiny
    shape = grow.Shape(layers=7, intermediate=150)  # neither a multiple of the base's 3 layers nor its 64 neurons
    grown = grown_model(base, shape)
    assert max_logit_difference(base, grown, batches) <= TOLERANCE
    assert sum(p.numel() for p in grown.parameters()) == grow.parameter_count(grown.config.to_dict())
    # the identities compute on real weights: only their output projections are zero
    identities = grown.config.specdec_identity_layers
    assert identities == [1, 3, 5, 6]
    for j, (i, kept) in enumerate(grow.layer_sources(3, 7)):
        layer, source = grown.model.layers[j], base.model.layers[i]
        assert torch.equal(layer.self_attn.q_proj.weight, source.self_attn.q_proj.weight)
        assert torch.equal(layer.mlp.gate_proj.weight[:64], source.mlp.gate_proj.weight)
        if not kept:
            assert layer.self_attn.o_proj.weight.abs().max() == 0 and layer.mlp.down_proj.weight.abs().max() == 0
    # the added neurons compute (their gate/up rows are copies) and contribute nothing
    kept = grown.model.layers[0].mlp
    assert torch.equal(kept.up_proj.weight[64:128], base.model.layers[0].mlp.up_proj.weight)
    assert kept.down_proj.weight[:, 64:].abs().max() == 0
    assert torch.equal(kept.down_proj.weight[:, :64], base.model.layers[0].mlp.down_proj.weight)


@pytest.mark.parametrize("tied", [False, True])
def test_widened_tiny_model_computes_the_base_logits(tiny, tied):
    """Net2WiderNet: hidden units, heads, KV heads and neurons copied, their readers split."""
    _, base, batches = tiny
    if tied:  # the embedded model ties its lm_head to its embeddings: the grown one unties them
        base = LlamaForCausalLM(LlamaConfig(**{**base.config.to_dict(), "tie_word_embeddings": True})).eval()
    for shape in (grow.Shape(layers=3, intermediate=192, width=3), grow.Shape(layers=5, intermediate=140, width=2)):
        wide = grown_model(base, shape)
        config = wide.config
        assert (
            (config.hidden_size, config.num_attention_heads, config.num_key_value_heads)
            == (32 * shape.width, 4 * shape.width, 2 * shape.width)
            and config.head_dim == 8
            and not config.tie_word_embeddings
        )
        assert max_logit_difference(base, wide, batches) <= TOLERANCE, shape
        assert sum(p.numel() for p in wide.parameters()) == grow.parameter_count(config.to_dict())


def _unsplit_q(state, config):
    state["model.layers.0.self_attn.q_proj.weight"].mul_(3)  # copies read in full, not split: 3x the scores


def _tied_head(state, config):
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # the head not divided: 3x the logits


@pytest.mark.parametrize("corrupt", [_unsplit_q, _tied_head])
def test_the_logit_check_fails_a_wrong_widening(tiny, corrupt):
    _, base, batches = tiny
    wide = grown_model(base, grow.Shape(layers=3, intermediate=192, width=3), corrupt)
    assert max_logit_difference(base, wide, batches) > 100 * TOLERANCE


def _down_column(state, config):
    state["model.layers.0.mlp.down_proj.weight"][:, -1] = 0.05  # an added neuron that contributes


def _identity_o_proj(state, config):
    j = config["specdec_identity_layers"][0]
    state[f"model.layers.{j}.self_attn.o_proj.weight"].fill_(0.01)  # an identity that is not


@pytest.mark.parametrize("corrupt", [_down_column, _identity_o_proj])
def test_the_logit_check_fails_a_wrong_construction(tiny, corrupt):
    _, base, batches = tiny
    grown = grown_model(base, grow.Shape(layers=7, intermediate=150), corrupt)
    assert max_logit_difference(base, grown, batches) > 100 * TOLERANCE


def test_build_writes_a_sharded_checkpoint_from_pretrained_loads(tiny, tmp_path, capfd):
    path, base, batches = tiny
    target = tmp_path / "grown"
    grow.build(Path(path), target, grow.GROWTH["x8"], "tiny", "x8", shard_bytes=64 << 10)
    assert "specdec: growing tiny to x8: 9 layers, hidden 32, MLP 256" in capfd.readouterr().err
    shards = sorted(p.name for p in target.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert not list(tmp_path.glob(".convert-*")) and not list(target.glob(".part-*"))
    config = json.loads((target / "config.json").read_text())
    assert (config["specdec_grown_from"], config["specdec_grown_factor"]) == ("tiny", "x8")
    grown = LlamaForCausalLM.from_pretrained(target).eval()
    assert (grown.config.num_hidden_layers, grown.config.intermediate_size) == (9, 256)
    assert max_logit_difference(base, grown, batches) <= TOLERANCE
    assert AutoTokenizer.from_pretrained(target).chat_template == AutoTokenizer.from_pretrained(path).chat_template


@pytest.mark.slow
def test_grown_alias_is_built_once_under_concurrent_starts(tiny, tmp_path):
    """Two processes resolve the alias at once (the base: a tiny model where the embedded model's
    conversion would be): one builds, the other waits for it; a later resolve builds nothing."""
    path, base, batches = tiny
    shutil.copytree(path, tmp_path / "SmolLM2-135M-Instruct")
    env = {**os.environ, "SPECDEC_CACHE": str(tmp_path)}
    # a process of its own: $SPECDEC_CACHE applied as the CLI applies it
    code = "from cli import options; options.apply_environment(); from specdec.weights import models; "
    code += "print(models.resolve('smollm2-135m-x4'))"
    ready = "import safetensors.torch, specdec.weights.grow; print('ready', flush=True); " + code
    # The cache's lock held here until both have imported what building needs: they reach it together,
    # and without it both would build (two notices, or a failed rename)
    with open(tmp_path / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", ready], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        assert [p.stdout.readline() for p in procs] == ["ready\n"] * 2
        time.sleep(0.5)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    target = tmp_path / "SmolLM2-135M-Instruct-x4"
    assert {out.strip() for out, _ in outs} == {str(target)}
    assert sum(err.count("specdec: growing smollm2-135m to x4") for _, err in outs) == 1
    assert not list(tmp_path.glob(".convert-*"))
    grown = LlamaForCausalLM.from_pretrained(target).eval()
    assert (grown.config.num_hidden_layers, grown.config.intermediate_size) == (6, 184)  # 3x2 layers, 64x2.875
    assert max_logit_difference(base, grown, batches) <= TOLERANCE
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert again.stdout.strip() == str(target) and "growing" not in again.stderr


def test_the_aliases_shapes_land_near_their_factors():
    base = grow.parameter_count(SMOLLM2)
    assert base == 134_515_008
    factors = {"x4": 4, "x8": 8, "w4": 14.3, "w4x4": 52.2}  # the module docstring's table
    for alias, growth in models.GROWN_ALIASES.items():
        shape = grow.GROWTH[growth].shape(SMOLLM2)
        count = grow.parameter_count(grow.grown_config(SMOLLM2, shape, "base"))
        assert abs(count / base - factors[growth]) < 0.02 * factors[growth], (alias, shape, count)
    assert grow.GROWTH["x4"].shape(SMOLLM2) == grow.Shape(60, 4416)  # the module docstring's table
    assert grow.GROWTH["x8"].shape(SMOLLM2) == grow.Shape(90, 6144)
    assert grow.GROWTH["w4"].shape(SMOLLM2) == grow.Shape(30, 6144, 4)


@pytest.mark.slow
def test_derived_aliases_are_transformers_only_and_the_default_keeps_its_drafter():
    for alias in models.DERIVED_ALIASES:
        spec = models.ModelSpec(alias)
        assert ModelServiceConfig("target", spec).runtime == "torch"  # auto: transformers
        with pytest.raises(ValueError, match="llama.cpp has no GGUF of it"):
            ModelServiceConfig("target", spec, backend="llamacpp")
        assert drafters.runtime(spec) == "model"
    cmd = [sys.executable, "-m", "cli", "target-service", "--backend", "llamacpp", "--model", "smollm2-135m-x8"]
    out = subprocess.run([*cmd, "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("specdec: error:") and "no GGUF" in out.stderr, out.stderr
    expected = "llamacpp" if models.llamacpp_installed() else "model"
    assert drafters.runtime(models.ModelSpec(models.DEFAULT_ALIAS, dtype=models.DEFAULT_DRAFT_DTYPE)) == expected
    assert ModelServiceConfig("target", models.ModelSpec(), backend="llamacpp").backend == "llamacpp"


@pytest.fixture(autouse=True)
def one_thread():
    """One thread for torch's forwards: on a busy machine a forward's threads mostly wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.real_model
def test_the_embedded_model_grown_computes_its_logits():
    path = models.ensure_default_converted()
    base = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [
        "Write a haiku about the sea.",
        "What is 17 times 23?",
        "def fib(n):",
        "Translate 'good night' to French.",
    ]
    batches = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for p in prompts
    ]
    grown = grown_model(base, grow.Shape(layers=36, intermediate=1664))  # 1.2x: the construction, not the cost
    assert max_logit_difference(base, grown, batches) <= TOLERANCE
    # and not vacuously: the same check sees an added neuron that contributes
    wrong = grown_model(base, grow.Shape(layers=36, intermediate=1664), _down_column)
    assert max_logit_difference(base, wrong, batches) > 100 * TOLERANCE
