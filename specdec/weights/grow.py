"""Growing the embedded model into a target that costs like a large one and computes exactly its function.

The embedded default pair is one model twice, so on a GPU, where both cost the same few ms a
forward, speculation cannot pay; weights cannot be downloaded everywhere. So this grows the
embedded model the Net2Net way into one that costs more while every logit stays the base model's:

- extra decoder layers whose output projections (o_proj, down_proj) are zero: each adds
  nothing to the residual stream, so each is an identity, but its attention and MLP still run on
  real weights (copies of the base layer before it), its KV cache fills, its matmuls cost;
- wider MLPs: added intermediate neurons whose gate/up rows are copies of existing rows and
  whose down_proj columns are zero, so they compute and contribute nothing;
- a wider model (Net2WiderNet, `width` m): every hidden unit, head (and KV head) and MLP neuron
  duplicated m times, and every weight that reads duplicated units split among the copies (1/m
  each), so each copy computes the base unit's value (every RMSNorm sees the same mean square,
  each duplicated head attends as its original, the output projections' m copies sum to the
  base's output). The embeddings are repeated, the lm_head the embeddings over m (untied).

Vocab, tokenizer, chat template and generation config stay. The acceptance of the embedded draft
against a grown target is therefore exactly its acceptance against the base model: a grown alias
measures the cost regime of a large target, not a different model.

The aliases (GROWN_ALIASES maps each to its factor; GROWTH says how a factor is met),
from the base's 30 layers, MLP 1536, 134.5M parameters (tied embeddings counted once):

    smollm2-135m-x4    60 layers (2x), MLP 4416 (2.875x)              539.3M parameters  4.01x  (CPU benches)
    smollm2-135m-x8    90 layers (3x), MLP 6144 (4x)                1,063.6M parameters  7.91x  (GPUs)
    smollm2-135m-w4    30 layers, hidden 2304, 36 heads, MLP 6144   1,925.3M parameters  14.3x  (GPUs: a 1B-like)
    smollm2-135m-w4x4 120 layers, hidden 2304, 36 heads, MLP 6144   7,021.8M parameters  52.2x  (GPUs: an 8B-like)

Each is built once, from the fp32 conversion, into $SPECDEC_CACHE/SmolLM2-135M-Instruct-x{factor}:
a transformers Llama checkpoint (sharded safetensors + index, config, tokenizer) that any code
loads with from_pretrained. Its config.json says what it is ("specdec_grown_from",
"specdec_grown_factor", "specdec_identity_layers").

This module owns the construction (pure functions over a state dict and a config dict), the
aliases (specdec.weights.models names them too) and their cache, built from specdec.weights.embedded's conversion;
models.resolve calls ensure_grown. It knows nothing of sessions, RPC or llama.cpp
(no GGUF of a grown model exists: the grown aliases are transformers-only).
Why and what was measured: docs/models.md#a-target-that-outweighs-its-draft-smollm2-135m-x4-smollm2-135m-x8.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from specdec.weights import embedded

SHARD_BYTES = 1 << 30  # a written shard's size at most (one tensor aside): the builder holds one shard at a time
INDEX = "model.safetensors.index.json"
WEIGHTS = ("model.safetensors", INDEX)  # what save_pretrained writes, unsharded or sharded: not copied from the base


@dataclass(frozen=True)
class Growth:
    """How a grown alias is made: the model `width` times as wide (Net2WiderNet: hidden size,
    heads, KV heads and MLP neurons), then layers times `layers` (an integer: every base layer
    keeps a slot and is followed by layers - 1 identities), the MLP `mlp` times as wide again
    (zero neurons)."""

    layers: int
    mlp: float = 1.0
    width: int = 1

    def shape(self, config: Mapping) -> Shape:
        inter = config["intermediate_size"] * self.width
        return Shape(config["num_hidden_layers"] * self.layers, round(inter * self.mlp), self.width)


@dataclass(frozen=True)
class Shape:
    layers: int
    intermediate: int  # the grown MLP's neurons: the base's times width duplicated, the rest zero
    width: int = 1


# alias suffix -> growth (the docstring's table)
GROWTH = {
    "x4": Growth(layers=2, mlp=2.875),
    "x8": Growth(layers=3, mlp=4.0),
    "w4": Growth(layers=1, width=4),
    "w4x4": Growth(layers=4, width=4),
}
GROWN_ALIASES = {f"{embedded.DEFAULT_ALIAS}-{g}": g for g in GROWTH}  # alias -> its growth (a key of GROWTH)


def layer_sources(base_layers: int, layers: int) -> list[tuple[int, bool]]:
    """For each grown layer: (the base layer whose weights it takes, whether it is that layer itself).
    The base layers keep their order, spread evenly; each identity copies the base layer before it."""
    assert layers >= base_layers >= 1, (base_layers, layers)
    starts = {i * layers // base_layers: i for i in range(base_layers)}  # slot -> base layer (distinct: layers >= base)
    sources, source = [], 0
    for j in range(layers):
        if j in starts:
            source = starts[j]
        sources.append((source, j in starts))
    return sources


def grown_config(config: Mapping, shape: Shape, grown_from: str, factor: str | None = None) -> dict:
    """The base's config with the grown shape and a note of what it is."""
    assert config["model_type"] == "llama", config["model_type"]
    sources = layer_sources(config["num_hidden_layers"], shape.layers)
    m = shape.width
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {
        **config,
        "hidden_size": config["hidden_size"] * m,
        "num_attention_heads": config["num_attention_heads"] * m,
        "num_key_value_heads": config["num_key_value_heads"] * m,
        "head_dim": head_dim,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings")) and m == 1,
        "num_hidden_layers": shape.layers,
        "intermediate_size": shape.intermediate,
        "specdec_grown_from": grown_from,
        "specdec_grown_factor": factor,
        "specdec_identity_layers": [j for j, (_, kept) in enumerate(sources) if not kept],
    }


def widened(name: str, w, m: int):
    """A base tensor, m times as wide (Net2WiderNet, see the module doc): copies of units in the
    copy-major order (copy c of unit i at c * units + i, so copy c of query head h meets copy c of
    its KV head), and the inputs that read copies split among them. A new tensor."""
    if m == 1:
        return w.clone()
    if name == "model.embed_tokens.weight":  # [vocab, hidden]: each token's vector repeated
        return w.repeat(1, m)
    if name == "lm_head.weight":  # reads the repeated stream: each copy carries 1/m
        return w.repeat(1, m) / m
    if w.dim() == 1:  # an RMSNorm's gains
        return w.repeat(m)
    return w.repeat(m, m) / m  # a projection [out, in]: out units copied, in units split


def grown_tensors(state: Mapping, config: Mapping, shape: Shape) -> Iterator[tuple[str, object]]:
    """The grown model's weights, name by name, from the base's `state` (name -> tensor) and
    `config`: the non-layer weights as they are, then layer by layer (so a writer holds one
    shard at a time). Every tensor is new (no view of `state`, none shared)."""
    import torch

    m = shape.width
    base_layers, inter = config["num_hidden_layers"], config["intermediate_size"] * m
    assert shape.intermediate >= inter, (shape, inter)
    # a bias on o_proj or down_proj would make an identity add it: none here (as in every Llama release)
    assert not config.get("attention_bias") and not config.get("mlp_bias"), "biased projections are not grown"
    prefix = "model.layers."
    for name, tensor in state.items():
        if not name.startswith(prefix):
            yield name, widened(name, tensor, m)
    if m > 1 and "lm_head.weight" not in state:  # tied: the lm_head of its own, over m
        yield "lm_head.weight", widened("lm_head.weight", state["model.embed_tokens.weight"], m)
    # the added neurons copy the base's, in turn: row j of the wide gate/up is row j mod inter
    rows = torch.arange(shape.intermediate) % inter
    for j, (i, kept) in enumerate(layer_sources(base_layers, shape.layers)):
        for suffix in sorted(n[len(f"{prefix}{i}.") :] for n in state if n.startswith(f"{prefix}{i}.")):
            w = widened(suffix, state[f"{prefix}{i}.{suffix}"], m)  # [out, in] for a projection
            if suffix in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):  # [intermediate, hidden]
                w = w[rows]
            elif suffix == "mlp.down_proj.weight":  # [hidden, intermediate]: the added neurons' columns zero
                wide = w.new_zeros(w.shape[0], shape.intermediate)
                if kept:
                    wide[:, :inter] = w
                w = wide
            elif suffix == "self_attn.o_proj.weight" and not kept:
                w = torch.zeros_like(w)
            yield f"{prefix}{j}.{suffix}", w


def grow_state_dict(state: Mapping, config: Mapping, shape: Shape) -> dict:
    """grown_tensors as one dict (for a model held in memory)."""
    return dict(grown_tensors(state, config, shape))


def parameter_count(config: Mapping) -> int:
    """A Llama's parameters from its config (tied embeddings counted once; no biases)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    layer = hidden * q * 2 + hidden * kv * 2 + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return config["num_hidden_layers"] * layer + embeddings + hidden


def grown_dir(growth: str) -> Path:
    return embedded.cache_dir() / f"SmolLM2-135M-Instruct-{growth}"


def ensure_grown(alias: str) -> Path:
    """Build the grown alias's directory once (from the fp32 conversion, which comes first); return
    its path. Locked and renamed into place as embedded.ensure_default_converted is."""
    factor = GROWN_ALIASES[alias]  # a key of GROWTH
    target = grown_dir(factor)
    if (target / INDEX).exists():
        return target
    base = embedded.ensure_default_converted()  # before the lock: it takes the same one
    embedded.built_once(target / INDEX, lambda: build(base, target, GROWTH[factor], embedded.DEFAULT_ALIAS, factor))
    return target


def build(
    base: Path, target: Path, growth: Growth, grown_from: str, factor: str | None = None, shard_bytes: int = SHARD_BYTES
) -> None:
    """Write the grown `base` (a transformers Llama directory) to `target`: written beside it, then
    renamed into place; progress on stderr."""
    from safetensors.torch import load_file

    config = json.loads((base / "config.json").read_text())
    shape = growth.shape(config)
    new_config = grown_config(config, shape, grown_from, factor)
    print(
        f"specdec: growing {grown_from} to {factor}: {shape.layers} layers, hidden {new_config['hidden_size']}, "
        f"MLP {shape.intermediate}, "
        f"{parameter_count(new_config) / 1e6:,.1f}M parameters, in {target} (once)",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        for f in base.iterdir():  # tokenizer, chat template, generation config
            if f.is_file() and f.name not in WEIGHTS and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
        _write_shards(grown_tensors(load_file(base / "model.safetensors"), config, shape), tmp, shard_bytes)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache's directory from other users
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"specdec: growing done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)


def _write_shards(tensors: Iterator[tuple[str, object]], out: Path, shard_bytes: int) -> None:
    """Sharded safetensors and the index from_pretrained reads, as save_pretrained names them."""
    from safetensors.torch import save_file

    parts, shard, size, total = [], {}, 0, 0

    def flush():
        parts.append(list(shard))  # the names only: the tensors go once written
        save_file(shard, out / f".part-{len(parts)}", metadata={"format": "pt"})
        shard.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name], size, total = tensor, size + nbytes, total + nbytes
    if shard:
        flush()
    weight_map = {}
    for k, names in enumerate(parts, 1):
        file = f"model-{k:05d}-of-{len(parts):05d}.safetensors"
        (out / f".part-{k}").chmod(0o644)  # safetensors writes 0600, which would hide a shared cache's file
        (out / f".part-{k}").rename(out / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
