"""A llama.cpp draft backend: a GGUF run natively (llama-cpp-python), KV rollback by truncation.

With the default alias it runs the embedded SmolLM2 Q4_1 GGUF, so the draft is the quantised
model and the target its fp32 dequantisation. One llama.cpp context per session (the weights
are memory-mapped once by the OS and shared); rolling back sets the context's token count,
and llama.cpp drops the cells past it (kv_cache_seq_rm) before its next decode.

Implements the backend interface of specdec.backend for the draft proposer; only the last
position's logits are computed (a draft needs no more).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdec import models, placement
from specdec.backend import tokenizer_files, vocab_digest

DEFAULT_CONTEXT = 4096


class LlamaCppBackend:
    def __init__(self, spec: models.ModelSpec, n_ctx: int = DEFAULT_CONTEXT):
        try:
            import llama_cpp
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
        self._llama = llama_cpp.Llama
        self.name = f"llama.cpp:{self.path.name}"
        self.dtype = "gguf"
        self.device = torch.device("cpu")
        self.n_ctx = n_ctx
        self.n_gpu_layers = -1 if spec.device.startswith("cuda") else 0
        probe = self.new_cache()
        self.vocab_size = int(probe.n_vocab())
        self.max_context = min(n_ctx, int(probe.n_ctx()))
        self.eos_token_ids = [int(probe.token_eos())]

    def new_cache(self):
        return self._llama(
            model_path=str(self.path),
            n_ctx=self.n_ctx,
            n_threads=placement.threads(),  # the service's threads (specdec.placement), not every core
            n_gpu_layers=self.n_gpu_layers,
            logits_all=False,
            verbose=False,
        )

    def forward(self, cache, token_ids: list[int], n_logits: int) -> torch.Tensor:
        assert n_logits == 1, "the llama.cpp backend computes the last position only"
        cache.eval(token_ids)
        logits = np.ctypeslib.as_array(cache._ctx.get_logits(), shape=(self.vocab_size,))
        return torch.from_numpy(logits.copy())[None]

    def crop(self, cache, keep: int) -> None:
        cache.n_tokens = min(cache.n_tokens, keep)  # eval() drops the cells past n_tokens first

    def tokenizer_files(self) -> dict[str, bytes]:
        return tokenizer_files(self.tokenizer)

    def tokenizer_digest(self) -> str:
        return vocab_digest(self.tokenizer)
