"""A causal LM behind the small interface the session engine needs.

Backend interface (duck-typed; tests supply in-process stand-ins with fixed distributions):
- vocab_size, max_context, eos_token_ids, name, dtype, device
- new_cache() -> cache
- forward(cache, token_ids, n_logits) -> [n_logits, vocab] float32 logits of the last
  n_logits fed positions; the cache grows by len(token_ids)
- crop(cache, keep): keep the first `keep` cached tokens (O(1) per layer, no copies)
- tokenizer_files() -> {name: bytes}; tokenizer_digest() -> str
"""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
from pathlib import Path

import torch

from specdec import models


class HFBackend:
    """A transformers causal LM with a DynamicCache per session."""

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

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, cache, token_ids: list[int], n_logits: int) -> torch.Tensor:
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=n_logits)
        return out.logits[0, -n_logits:].float()

    def crop(self, cache, keep: int) -> None:
        drop = cache.get_seq_length() - keep
        if drop > 0:
            cache.crop(-drop)

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
