"""Which transformers architectures the torch backend serves exactly, and what it must know of each.

The backend (specdec.runtime.backend) runs a model's own embedding and decoder layers over its slot KV cache
(specdec.runtime.kvcache), with attention masks it builds itself (a row's own positions, a draft tree's
ancestors), and applies the output layer itself at the positions asked for. That computes what the
model computes where the model
- attends causally, each layer over every earlier key or within a sliding window of its own
  (`kv > q - window`, transformers' masking_utils): a layer's window comes from `layer_types`
  (Gemma 2/3 and Qwen2 alternate sliding and full layers) or, for the Mistral family, from
  `sliding_window` on every layer. The backend keeps every key and masks those out of the window;
- takes its positions from `position_ids` (rotary, partial rotary, learned absolute positions),
  which is what lets a tree's node take its depth's position;
- writes its keys and values through the cache's `update` and reads nothing else of it;
- computes its logits as the output layer followed by what this table names (Gemma's final
  soft-capping, Cohere's logit scale, Granite's logit scaling).
An architecture is served only if it is in FAMILIES: each was run against its own forward and
`generate` (tests/test_architectures.py, on tiny random checkpoints of every family), with its
features switched on (attention biases, soft-capping, q/k norms, partial rotary, MoE routers,
parallel attention and MLP, embedding scaling). Any other is refused at start (FailedPrecondition,
naming the architecture and the reason), as are features of a family that the backend does not
reproduce (ALiBi, chunked attention, recurrent layers): never served silently different.

This module knows nothing of sessions, caches or RPC: it describes, builds masks and logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.errors import FailedPrecondition
from specdec.runtime.kvcache import additive, within

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer types the masks reproduce


@dataclass(frozen=True)
class Family:
    """What the backend knows of one architecture (a config's model_type)."""

    windows: str = "none"  # "none": every layer full; "all": config.sliding_window on every layer;
    #                        "types": by config.layer_types, the model taking one mask per type (a dict)
    packed: bool = False  # its attention reaches the backend's packed one (kvcache.PackedView) and is plain SDPA
    moe: bool = False  # routed experts: the router's host sync rules out CUDA graph capture (specdec.runtime.graphs)
    head: tuple[str, ...] = ()  # transforms after the output layer, in order: "scale", "divide", "softcap"
    check: Callable | None = None  # config -> why a feature it switches on is refused, or None


def _falcon(config) -> str | None:
    if getattr(config, "alibi", False):
        return "ALiBi positions (built from a padding mask, not per-row positions)"
    return None


def _generic(config) -> str | None:
    """Features transformers switches on by config across families that the masks do not reproduce."""
    if getattr(config, "attention_chunk_size", None):
        return "chunked attention"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (an encoder, e.g. EmbeddingGemma)"
    return None


FAMILIES: dict[str, Family] = {
    "llama": Family(packed=True),
    "mistral": Family(windows="all", packed=True),
    "mixtral": Family(windows="all", packed=True, moe=True),
    "qwen2": Family(windows="types", packed=True),
    "qwen2_moe": Family(windows="types", packed=True, moe=True),
    "qwen3": Family(windows="types", packed=True),
    "qwen3_moe": Family(windows="all", packed=True, moe=True),
    "gemma": Family(packed=True),
    "gemma2": Family(windows="types", head=("softcap",)),  # attention soft-capping: eager attention, padded
    "gemma3_text": Family(windows="types", packed=True, head=("softcap",)),
    "phi3": Family(windows="all", packed=True),
    "olmo2": Family(packed=True),
    "starcoder2": Family(windows="all", packed=True),
    "granite": Family(packed=True, head=("divide",)),
    "cohere": Family(packed=True, head=("scale",)),
    "cohere2": Family(windows="types", packed=True, head=("scale",)),
    "exaone4": Family(windows="types", packed=True),
    "granitemoe": Family(packed=True, moe=True, head=("divide",)),
    "glm": Family(packed=True),
    "glm4": Family(packed=True),
    "helium": Family(packed=True),
    "internlm3": Family(packed=True),
    "ernie4_5": Family(packed=True),
    "arcee": Family(packed=True),
    "gpt_bigcode": Family(packed=True),
    "gptj": Family(packed=True),
    "codegen": Family(packed=True),
    "gpt_neox": Family(),
    "gpt2": Family(),
    "falcon": Family(check=_falcon),
}


@dataclass(frozen=True)
class Architecture:
    """What a loaded model needs of the backend's masks, forwards and output layer."""

    model_type: str
    windows: tuple[int | None, ...]  # each decoder layer's sliding window (None: every earlier key)
    layer_types: tuple[str, ...] | None  # the model takes a mask per layer type (None: one mask for all)
    packed: bool
    graphs: bool  # CUDA graphs may capture its forwards
    head: tuple[tuple[str, float], ...]  # (transform, its constant) after the output layer

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    def mask(self, visible: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype):
        """The `attention_mask` a forward passes the model: one additive mask [B, 1, W, kv] or one per
        layer type (a dict). visible [B, W, kv]: which keys each query may see (causal, a tree's
        ancestors); queries [B, W] and keys [B, kv] (or [kv]): their positions in the sequence, which
        the sliding windows are measured in."""
        masks = {w: additive(within(visible, queries, keys, w), dtype) for w in set(self.windows)}
        if self.layer_types is None:
            return masks[self.windows[0]]
        return {t: masks[w] for t, w in zip(self.layer_types, self.windows, strict=True)}

    def logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits at these hidden states, float32: its output layer and its own
        transforms after it (in the model's dtype, as its forward computes them)."""
        logits = model.get_output_embeddings()(hidden)
        for transform, c in self.head:
            if transform == "scale":
                logits = logits * c
            elif transform == "divide":
                logits = logits / c
            else:  # softcap
                logits = torch.tanh(logits / c) * c
        return logits.float()


def describe(model) -> Architecture:
    """What the backend must know of a loaded transformers causal LM; FailedPrecondition, naming the
    architecture and what is unsupported, where it cannot serve it exactly."""
    config = model.config
    kind = config.model_type
    refuse = _refusal(config)
    if refuse:
        raise FailedPrecondition(f"architecture {kind!r} ({type(model).__name__}) is not supported: {refuse}")
    family = FAMILIES[kind]
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = None
    if family.windows == "types":
        types = tuple(config.layer_types)
        windows = tuple(window if t == SLIDING else None for t in types)
    elif family.windows == "all":
        windows = (window,) * layers
    else:
        windows = (None,) * layers
    head = []
    for transform in family.head:
        c = {
            "scale": getattr(config, "logit_scale", None),
            "divide": getattr(config, "logits_scaling", None),
            "softcap": getattr(config, "final_logit_softcapping", None),
        }[transform]
        if c is not None and not (transform != "softcap" and c == 1.0):
            head.append((transform, float(c)))
    return Architecture(kind, windows, types, family.packed, not family.moe, tuple(head))


def _refusal(config) -> str | None:
    """Why the backend cannot serve this config exactly, or None."""
    kind = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model; the backend serves decoder-only ones"
    types = set(getattr(config, "layer_types", None) or ())
    other = sorted(types - {FULL, SLIDING})
    if other:
        return f"layers of type {', '.join(other)}: only full and sliding-window attention keep exact in the slot cache"
    if kind not in FAMILIES:
        return (
            "not an architecture specdec has verified exact (its attention, cache use or output layer may "
            f"differ from the backend's); verified: {', '.join(sorted(FAMILIES))} (docs/models.md)"
        )
    family = FAMILIES[kind]
    if family.windows == "types" and SLIDING in types and getattr(config, "sliding_window", None) is None:
        return "sliding-window layers without a sliding_window"
    for check in (_generic, family.check):
        reason = check(config) if check is not None else None
        if reason:
            return reason
    return None
