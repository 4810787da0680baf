"""A causal LM behind the small interface the session engine needs.

Backend interface (duck-typed; tests supply in-process stand-ins with fixed distributions):
- vocab_size, max_context, eos_token_ids, name, dtype, device; optionally kind (what runs the
  model, for Describe: "torch" here, "llamacpp" in specdec.runtime.llamacpp)
- new_cache() -> cache
- forward(cache, token_ids, n_logits) -> [n_logits, vocab] float32 logits of the last
  n_logits fed positions; the cache grows by len(token_ids)
- crop(cache, keep): keep the first `keep` cached tokens (O(1), no copies)
- tokenizer_files() -> {name: bytes}; tokenizer_digest() -> str
Optional, for a backend that batches across sessions (the model worker uses them when present):
- forward_batch([(cache, token_ids, n_logits), ...]) -> [logits, ...]: one forward for all
- release(cache): the session ended; its cache may be reused
- set_threads(n): the threads of the next forwards (called on the thread that runs them;
  specdec.runtime.placement.Cores)
Optional, for the prefix cache (specdec.runtime.prefix; a backend without copy_prefix caches no prefix):
- copy_prefix(src, dst, n): cache dst holds src's first n positions and nothing past them
- free_caches() -> int: caches new_cache gives without growing or refusing
Optional, for a backend that verifies draft trees (`trees = True`; the engine sends them no other):
- forward_batch(items, trees=[Tree | None per item]) (specdec.runtime.kvcache.Tree: the item's block
  extends a tree of nodes, each attending to the chain and its ancestors)
- compact(cache, keep, sources): keep `keep` positions, then positions `sources` after them
The logits a forward returns are valid until the backend's next forward: a caller reads or
copies them before (the llama.cpp backend returns views of llama.cpp's own buffer, no copy).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import tempfile
import threading
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec.errors import FailedPrecondition
from specdec.runtime import architectures
from specdec.runtime.kvcache import PackedView, Slot, SlotCache, causal_visible, compact, copy_prefix
from specdec.weights import models

PACKED_ATTENTION = "specdec"  # transformers' name of the attention a packed forward runs (see HFBackend)


class Tokenized:
    """What Describe serves of a backend's tokenizer (`self.tokenizer`, a transformers tokenizer):
    its files and the digest of its vocabulary, which the orchestrator compares across the pair."""

    def tokenizer_files(self) -> dict[str, bytes]:
        return tokenizer_files(self.tokenizer)

    def tokenizer_digest(self) -> str:
        # Kept on the instance: functools.cache on a method would keep every backend (and its
        # model) alive for the life of the process, as a test session makes hundreds.
        if (digest := self.__dict__.get("_tokenizer_digest")) is None:
            digest = self.__dict__["_tokenizer_digest"] = vocab_digest(self.tokenizer)
        return digest


class HFBackend(Tokenized):
    """A transformers causal LM over a slot KV cache (specdec.runtime.kvcache): a slot per session,
    the forwards of several sessions batched into one, the logits computed only at the
    positions asked for. What it computes is the model's own: specdec.runtime.architectures says which
    architectures, and what the masks and the output layer reproduce of each; any other is
    refused when it loads.

    A batch of rows of different widths is packed where the architecture allows it
    (architectures.Family.packed): the rows' new tokens one after another in a single sequence, each at
    its own position, attention per group of rows of one width over their slots
    (kvcache.PackedView), so a step costs the tokens it feeds. Padded to the widest row
    instead, a step cost rows x the widest: a prompt's prefill chunk beside decode rows made
    every row 100-128 wide (15 one-token rows and a 100-token chunk: 4299 ms padded, 467 ms
    packed, one core; 15 one-token rows and a 5-token verify block: 333 and 165 ms), and under
    load most of the target's time went there (16 clients: 6 such steps, 22 s of 38). Rows of
    one width, and other models, run padded (right-padded rows, per-row positions, a 4D mask):
    as fast, and a few milliseconds less of bookkeeping.
    """

    kind = "torch"  # Describe's `backend`
    # Prompt tokens a prefill step feeds (specdec.runtime.engine): one forward of 512 where chunks of 128 took
    # 1.4-1.5x as long on a CPU (1,343 tokens, the fp32 default target, in process: 3.1-3.5 s against
    # 4.7-4.8; transformers' generate 3.05), and a GPU's eager prefill is launch-bound per chunk.
    prefill_chunk = 512
    trees = True  # verifies draft trees: a tree's rows run padded, under their ancestors' mask

    def __init__(self, spec: models.ModelSpec):
        self.spec = spec
        self.model, self.tokenizer = models.load(spec)
        config = self.model.config
        self.arch = architectures.describe(self.model)
        self.name = spec.model
        self.dtype = spec.dtype
        self.device = torch.device(spec.device)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 2048)
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        parameters = inspect.signature(self.model.base_model.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"  # transformers renames it
        layers, kv_heads, head_dim, dtype = self._cache_shape()
        self.kv = SlotCache(layers, kv_heads, head_dim, dtype, self.device)
        # Packed forwards replace the model's attention: only where it is SDPA (not eager, e.g. Gemma 2's soft-capping).
        self.packed = self.arch.packed and config._attn_implementation == "sdpa"
        if self.packed:
            _register_packed_attention()
            config._attn_implementation = PACKED_ATTENTION
        self._lock = threading.Lock()

    @torch.inference_mode()
    def _cache_shape(self) -> tuple[int, int, int, torch.dtype]:
        """(layers, kv heads, head dim, dtype) of the keys and values the model writes, read off a
        one-token forward: the config's names for them differ by architecture (and GQA, multi-query
        or fused heads change them). Refused where a layer writes none, or layers differ."""
        shapes = _Shapes()
        one = torch.ones(1, 1, 1, dtype=torch.bool, device=self.device)
        zero = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.model.base_model(
            input_ids=zero,
            attention_mask=self.arch.mask(one, zero, zero, next(self.model.parameters()).dtype),
            position_ids=zero,
            use_cache=True,
            **{self._cache_arg: shapes},
        )
        layers = self.model.config.num_hidden_layers
        kinds = set(shapes.seen.values())
        if sorted(shapes.seen) != list(range(layers)) or len(kinds) != 1:
            raise FailedPrecondition(
                f"architecture {self.arch.model_type!r}: its layers' keys and values do not fit one slot cache "
                f"(written by layers {sorted(shapes.seen)} of {layers}, shapes {sorted(map(str, kinds))})"
            )
        [(kv_heads, key_dim, value_dim, dtype)] = kinds
        if key_dim != value_dim:
            raise FailedPrecondition(
                f"architecture {self.arch.model_type!r}: keys of {key_dim} and values of {value_dim} per head"
            )
        return layers, kv_heads, key_dim, dtype

    def new_cache(self) -> Slot:
        with self._lock:
            return self.kv.acquire()

    def set_threads(self, n: int) -> None:
        torch.set_num_threads(n)  # this thread's OpenMP team and MKL's (the worker's)

    def release(self, cache: Slot) -> None:
        with self._lock:
            self.kv.release(cache)

    def copy_prefix(self, src: Slot, dst: Slot, n: int) -> None:
        with self._lock, torch.inference_mode():  # the cache's tensors are inference tensors
            copy_prefix(self.kv, src, dst, n)

    def free_caches(self) -> int:
        return len(self.kv.free)

    def forward(self, cache: Slot, token_ids: list[int], n_logits: int) -> torch.Tensor:
        return self.forward_batch([(cache, token_ids, n_logits)])[0]

    def forward_batch(self, items: list[tuple[Slot, list[int], int]], trees=None) -> list[torch.Tensor]:
        """One forward for several sessions' blocks: [n_logits, vocab] float32 logits each.
        `trees`: a kvcache.Tree (or None) for each item."""
        with self._lock:  # one worker uses a backend; the lock only guards a shared one
            return self._forward_batch(items, trees)

    def compact(self, cache: Slot, keep: int, sources: list[int]) -> None:
        with self._lock, torch.inference_mode():  # the cache's tensors are inference tensors
            compact(self.kv, cache, keep, sources)

    @torch.inference_mode()
    def _forward_batch(self, items: list[tuple[Slot, list[int], int]], trees=None) -> list[torch.Tensor]:
        order = sorted(range(len(items)), key=lambda i: items[i][0].index)  # consecutive slots: no gather
        rows = [items[i] for i in order]
        slots, blocks, wanted = (list(x) for x in zip(*rows, strict=True))
        if trees is not None and any(tree is not None for tree in trees):
            hidden = picked(self._hidden(slots, blocks, [trees[i] for i in order]), blocks, wanted)
        else:
            hidden = self._last_hidden(slots, blocks, wanted)
        logits = self.arch.logits(self.model, hidden)  # [sum n_logits, vocab]
        out: list[torch.Tensor] = [torch.empty(0)] * len(items)
        start = 0
        for i, (slot, tokens, n) in zip(order, rows, strict=True):
            slot.length += len(tokens)
            out[i] = logits[start : start + n]
            start += n
        return out

    def _last_hidden(self, slots: list[Slot], blocks: list[list[int]], wanted: list[int]) -> torch.Tensor:
        """The last hidden states at the last wanted[b] positions of each row's block, rows in
        order: [sum wanted, hidden]. Writes the blocks' keys and values; lengths unchanged."""
        widths = [len(tokens) for tokens in blocks]
        if not self.packed or min(widths) == max(widths):  # rows of one width: padding costs nothing
            return picked(self._hidden(slots, blocks), blocks, wanted)
        view = PackedView(self.kv, slots, widths, self.arch.windows)
        ids = torch.tensor([t for tokens in blocks for t in tokens], device=self.device)
        hidden = self._base(
            input_ids=ids[None],
            attention_mask=_NO_MASK,  # 4D, so transformers builds none: PackedView.attend masks
            position_ids=view.positions[None],
            cache=view,
            packed=view,  # reaches the attention (_packed_attention)
        )[0]  # [T, hidden]
        ends = torch.cumsum(torch.tensor(widths), 0)
        at = torch.cat([torch.arange(end - n, end) for end, n in zip(ends.tolist(), wanted, strict=True)])
        return hidden[at.to(self.device)]

    def _hidden(self, slots: list[Slot], blocks: list[list[int]], trees=None) -> torch.Tensor:
        """A padded forward: the last hidden states of row b's block at columns
        0..len(blocks[b]) - 1: [B, >= max width, hidden]. Writes the blocks' keys and values.
        A row with a tree (kvcache.Tree) takes its nodes' depths as positions, its ancestors as mask."""
        width = max(len(tokens) for tokens in blocks)
        view = self.kv.view(slots, width)
        ids = torch.zeros(len(blocks), width, dtype=torch.long)
        for b, tokens in enumerate(blocks):  # right-padded; a pad's outputs are never read
            ids[b, : len(tokens)] = torch.tensor(tokens)
        positions = view.positions  # each query's place in the sequence: a tree's node, its depth's
        keys = torch.arange(view.kv_length, device=self.device)  # ... and each key's
        visible = causal_visible(positions, view.kv_length)
        if any(tree is not None for tree in trees or ()):
            positions, visible = positions.clone(), visible.clone()
            keys = keys.expand(len(blocks), -1).clone()
            for b, tree in enumerate(trees):
                if tree is not None:
                    rotary, visible[b] = tree.row(slots[b].length, width, view.kv_length)
                    positions[b] = torch.tensor(rotary, device=self.device)
                    if self.arch.sliding:
                        keys[b] = torch.tensor(tree.positions(view.kv_length), device=self.device)
        return self._base(
            input_ids=ids.to(self.device),
            attention_mask=self.arch.mask(visible, positions, keys, self.kv.dtype),
            position_ids=positions,
            cache=view,
        )  # [B, width, hidden]

    def _base(self, cache, **inputs) -> torch.Tensor:
        """The model's decoder over a cache view: the last hidden states."""
        return self.model.base_model(use_cache=True, **{self._cache_arg: cache}, **inputs).last_hidden_state

    def crop(self, cache: Slot, keep: int) -> None:
        cache.length = min(cache.length, keep)


def picked(hidden: torch.Tensor, blocks: list[list[int]], wanted: list[int]) -> torch.Tensor:
    """From a padded forward's [B, width, hidden], row b's last wanted[b] block positions."""
    pick = [
        (b, t)
        for b, (tokens, n) in enumerate(zip(blocks, wanted, strict=True))
        for t in range(len(tokens) - n, len(tokens))
    ]
    at_b, at_t = (torch.tensor(x, device=hidden.device) for x in zip(*pick, strict=True))
    return hidden[at_b, at_t]


_NO_MASK = torch.zeros(1, 1, 1, 1)


class _Shapes:
    """past_key_values of a forward that records the shape of what each layer writes."""

    def __init__(self):
        self.seen: dict[int, tuple] = {}  # layer -> (kv heads, key dim, value dim, dtype)

    def get_seq_length(self, layer: int = 0) -> int:
        return 0

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args, **kwargs):
        self.seen[layer] = (keys.shape[1], keys.shape[-1], values.shape[-1], keys.dtype)
        return keys, values


def _packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention of HFBackend's models: a packed forward's (kvcache.PackedView.attend),
    transformers' SDPA for any other (a padded or static forward)."""
    packed = kwargs.pop("packed", None)
    if packed is not None:
        return packed.attend(module.layer_idx, query, scaling), None
    if attention_mask is _NO_MASK:  # a packed forward whose view the model did not pass down: no mask at all
        raise RuntimeError(f"{type(module).__name__}: a packed forward did not reach the attention")
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


@functools.cache
def _register_packed_attention() -> None:
    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
    # The model's own masks, as for SDPA, where it builds them (its forward or generate outside the backend).
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files save_pretrained writes for a tokenizer, by name."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def vocab_digest(tokenizer) -> str:
    """sha256 of the token -> id map: equal digests mean interchangeable token ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _eos_ids(model, tokenizer) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return sorted({int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])})
