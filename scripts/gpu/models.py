"""A random SmolLM2-135M-shaped Llama (the tests' character tokenizer padded to 49152 tokens) and its
x8 growth (specdec.weights.grow), at the two paths given. Part of scripts/gpu/run.sh: timings need the
shapes, not the weights, and the grown model computes the base's function, so the base as draft
is accepted everywhere (the real pair's upper bound)."""

import os
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.getcwd())
from specdec.weights import grow  # noqa: E402
from tests.conftest import make_tokenizer  # noqa: E402

base, x8 = sys.argv[1], sys.argv[2]
t0 = time.time()
tok = make_tokenizer(49152 - 46)
config = LlamaConfig(
    vocab_size=len(tok),
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    bos_token_id=tok.bos_token_id,
    eos_token_id=tok.eos_token_id,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained(base)
tok.save_pretrained(base)
grow.build(Path(base), Path(x8), grow.GROWTH["x8"], "smolrand", "x8")
print(f"models built in {time.time() - t0:.0f} s (random SmolLM2-135M shape; x8 grown)")
