"""A causal LM behind the small interface the session engine needs.

Backend interface (duck-typed; tests supply in-process stand-ins with fixed distributions):
- vocab_size, max_context, eos_token_ids, name, dtype, device; optionally kind (what runs the
  model, for Describe: "torch" here, "llamacpp" in specdec.llamacpp)
- new_cache() -> cache
- forward(cache, token_ids, n_logits) -> [n_logits, vocab] float32 logits of the last
  n_logits fed positions; the cache grows by len(token_ids)
- crop(cache, keep): keep the first `keep` cached tokens (O(1), no copies)
- tokenizer_files() -> {name: bytes}; tokenizer_digest() -> str
Optional, for a backend that batches across sessions (the model worker uses them when present):
- forward_batch([(cache, token_ids, n_logits), ...]) -> [logits, ...]: one forward for all
- release(cache): the session ended; its cache may be reused
"""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
import threading
from pathlib import Path

import torch

from specdec import models
from specdec.kvcache import Slot, SlotCache, causal_mask


class HFBackend:
    """A transformers causal LM over a slot KV cache (specdec.kvcache): a slot per session,
    the forwards of several sessions batched into one (ragged rows, per-row positions and a
    4D mask), the logits computed only at the positions asked for."""

    kind = "torch"  # Describe's `backend`

    def __init__(self, spec: models.ModelSpec):
        self.spec = spec
        self.model, self.tokenizer = models.load(spec)
        config = self.model.config
        self.name = spec.model
        self.dtype = spec.dtype
        self.device = torch.device(spec.device)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 2048)
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        dtype = next(self.model.parameters()).dtype
        self.kv = SlotCache(config.num_hidden_layers, kv_heads, head_dim, dtype, self.device)
        self._lock = threading.Lock()

    def new_cache(self) -> Slot:
        with self._lock:
            return self.kv.acquire()

    def release(self, cache: Slot) -> None:
        with self._lock:
            self.kv.release(cache)

    def forward(self, cache: Slot, token_ids: list[int], n_logits: int) -> torch.Tensor:
        return self.forward_batch([(cache, token_ids, n_logits)])[0]

    def forward_batch(self, items: list[tuple[Slot, list[int], int]]) -> list[torch.Tensor]:
        """One forward for several sessions' blocks: [n_logits, vocab] float32 logits each."""
        with self._lock:  # one worker uses a backend; the lock only guards a shared one
            return self._forward_batch(items)

    @torch.inference_mode()
    def _forward_batch(self, items: list[tuple[Slot, list[int], int]]) -> list[torch.Tensor]:
        order = sorted(range(len(items)), key=lambda i: items[i][0].index)  # consecutive slots: no gather
        rows = [items[i] for i in order]
        hidden = self._hidden([slot for slot, _, _ in rows], [tokens for _, tokens, _ in rows])
        pick = [(b, t) for b, (_, tokens, n) in enumerate(rows) for t in range(len(tokens) - n, len(tokens))]
        at_b, at_t = (torch.tensor(x, device=self.device) for x in zip(*pick, strict=True))
        logits = self.model.get_output_embeddings()(hidden[at_b, at_t]).float()  # [sum n_logits, vocab]
        out: list[torch.Tensor] = [torch.empty(0)] * len(items)
        start = 0
        for i, (slot, tokens, n) in zip(order, rows, strict=True):
            slot.length += len(tokens)
            out[i] = logits[start : start + n]
            start += n
        return out

    def _hidden(self, slots: list[Slot], blocks: list[list[int]]) -> torch.Tensor:
        """The last hidden states of row b's block at columns 0..len(blocks[b]) - 1:
        [B, >= max width, hidden]. Writes the blocks' keys and values; lengths unchanged."""
        width = max(len(tokens) for tokens in blocks)
        view = self.kv.view(slots, width)
        ids = torch.zeros(len(blocks), width, dtype=torch.long)
        for b, tokens in enumerate(blocks):  # right-padded; a pad's outputs are never read
            ids[b, : len(tokens)] = torch.tensor(tokens)
        return self.model.base_model(
            input_ids=ids.to(self.device),
            attention_mask=causal_mask(view.positions, view.kv_length, self.kv.dtype),
            position_ids=view.positions,
            past_key_values=view,
            use_cache=True,
        ).last_hidden_state  # [B, width, hidden]

    def crop(self, cache: Slot, keep: int) -> None:
        cache.length = min(cache.length, keep)

    def tokenizer_files(self) -> dict[str, bytes]:
        return tokenizer_files(self.tokenizer)

    @functools.cache  # noqa: B019 - one backend per process
    def tokenizer_digest(self) -> str:
        return vocab_digest(self.tokenizer)


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
