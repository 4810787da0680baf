"""A llama.cpp draft backend: a GGUF run natively (llama-cpp-python), sessions batched.

With the default alias it runs the embedded SmolLM2 Q4_1 GGUF, so the draft is the quantised
model and the target its fp32 dequantisation. One llama.cpp context holds every session:
a session is a sequence id of its KV cache (unified: the cells are shared, so sessions of
any lengths fit in CONTEXT_CELLS together), and `forward_batch` puts the new tokens of
several sessions into one llama_batch, each at its own positions and sequence id, so the
draft steps of many sessions are one llama_decode. Rolling back removes the sequence's
cells past the kept length (llama_memory_seq_rm, O(cells)); no re-prefill.

Implements the backend interface of specdec.backend for the draft proposer; only the last
position's logits of each session are computed (a draft needs no more). Threads: the
service's torch thread count (its --threads).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdec import models, placement
from specdec.backend import tokenizer_files, vocab_digest
from specdec.kvcache import Slot

DEFAULT_CONTEXT = 4096  # positions per session
CONTEXT_CELLS = 8192  # KV cells shared by all sessions (the model's trained context)
MAX_SEQUENCES = 64  # sessions one context holds (the services' default max_sessions)
BATCH_TOKENS = 512  # tokens per llama_decode; a larger step is split


class LlamaCppBackend:
    def __init__(self, spec: models.ModelSpec, n_ctx: int = DEFAULT_CONTEXT):
        try:
            import llama_cpp
            from llama_cpp import _internals, _logger
        except ImportError as err:
            raise RuntimeError("the llamacpp drafter needs llama-cpp-python: pip install 'specdec[llamacpp]'") from err
        from transformers import AutoTokenizer

        if spec.model in models.ALIASES:
            self.path = models.gguf_path()
            self.tokenizer = AutoTokenizer.from_pretrained(models.resolve(spec.model))
        elif spec.model.endswith(".gguf") and Path(spec.model).is_file():
            self.path = Path(spec.model)
            self.tokenizer = AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        else:
            raise ValueError(f"the llamacpp drafter needs a .gguf file or '{models.DEFAULT_ALIAS}', not {spec.model!r}")
        self.name = f"llama.cpp:{self.path.name}"
        self.dtype = "gguf"
        self.device = torch.device("cpu")
        llama_cpp.llama_backend_init()
        _logger.set_verbose(False)
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = -1 if spec.device.startswith("cuda") else 0
        self._model = _internals.LlamaModel(path_model=str(self.path), params=model_params, verbose=False)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = CONTEXT_CELLS
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.n_seq_max = MAX_SEQUENCES
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = placement.threads()  # the service's threads (specdec.placement)
        self._ctx = _internals.LlamaContext(model=self._model, params=params, verbose=False)
        self._batch = _internals.LlamaBatch(n_tokens=BATCH_TOKENS, embd=0, n_seq_max=1, verbose=False)
        self._free = list(range(MAX_SEQUENCES - 1, -1, -1))
        self.vocab_size = int(self._model.n_vocab())
        self.max_context = min(n_ctx, int(self._model.n_ctx_train()))
        self.eos_token_ids = [int(self._model.token_eos())]

    def new_cache(self) -> Slot:
        if not self._free:
            raise RuntimeError(f"the llama.cpp context holds {MAX_SEQUENCES} sessions at most")
        return Slot(self._free.pop())

    def release(self, cache: Slot) -> None:
        self._ctx.kv_cache_seq_rm(cache.index, 0, -1)
        self._free.append(cache.index)

    def forward(self, cache: Slot, token_ids: list[int], n_logits: int) -> torch.Tensor:
        return self.forward_batch([(cache, token_ids, n_logits)])[0]

    def forward_batch(self, items: list[tuple[Slot, list[int], int]]) -> list[torch.Tensor]:
        """The new tokens of every session in llama_batches of up to BATCH_TOKENS tokens; the
        last position's logits of each ([1, vocab] float32)."""
        assert all(n == 1 for _, _, n in items), "the llama.cpp backend computes the last position only"
        out, group, size = [], [], 0
        for item in items:
            if group and size + len(item[1]) > BATCH_TOKENS:
                out += self._decode(group)
                group, size = [], 0
            group.append(item)
            size += len(item[1])
        return out + self._decode(group)

    def _decode(self, items) -> list[torch.Tensor]:
        batch = self._batch.batch
        batch.n_tokens = 0
        last = []
        for slot, tokens, _ in items:
            assert len(tokens) <= BATCH_TOKENS, "a block is fed in chunks (specdec.engine.PREFILL_CHUNK)"
            for i, token in enumerate(tokens):
                j = batch.n_tokens
                batch.token[j], batch.pos[j] = token, slot.length + i
                batch.seq_id[j][0], batch.n_seq_id[j] = slot.index, 1
                batch.logits[j] = i == len(tokens) - 1
                batch.n_tokens += 1
            last.append(batch.n_tokens - 1)
        self._ctx.decode(self._batch)
        for slot, tokens, _ in items:
            slot.length += len(tokens)
        return [
            torch.from_numpy(np.ctypeslib.as_array(self._ctx.get_logits_ith(j), shape=(self.vocab_size,)).copy())[None]
            for j in last
        ]

    def crop(self, cache: Slot, keep: int) -> None:
        if keep < cache.length:
            self._ctx.kv_cache_seq_rm(cache.index, keep, -1)
            cache.length = keep

    def tokenizer_files(self) -> dict[str, bytes]:
        return tokenizer_files(self.tokenizer)

    def tokenizer_digest(self) -> str:
        return vocab_digest(self.tokenizer)
