"""HF `generate` with the static cache (compiled on CUDA), fp32, for each model directory given:
three runs of 128 tokens (the first compiles). Part of scripts/gpu/run.sh."""

import sys
import time

import torch
from transformers import AutoModelForCausalLM

for path in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ids = torch.tensor([[1, *range(100, 140)]], device="cuda")
    kw = dict(max_new_tokens=128, min_new_tokens=128, do_sample=False, cache_implementation="static")
    for r in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        print(f"    {path} hf static generate run {r}: {128 / (time.perf_counter() - t0):.1f} tok/s", flush=True)
    del model
    torch.cuda.empty_cache()
