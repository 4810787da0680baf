"""HF `generate` in process, for each model directory given (scripts/gpu/run.sh, wide.sh):
the static cache (compiled on CUDA), three runs of 128 greedy tokens (the first compiles); with
--batches 16,64, static-cache generate of that many copies of the prompt at once (twice each); with
--assistant DIR, HF assisted generation of each with that draft, twice.

    python3 scripts/gpu/hf.py [--dtype bfloat16] [--batches 16,64] [--assistant DRAFT_DIR] TARGET_DIR..."""

import argparse
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.getcwd())
from bench.run import BenchConfig, hf_generate  # noqa: E402

PROMPT = "Explain how a refrigerator keeps food cold."
TOKENS = 128


def timed(model, ids: list[int], **kw) -> float:
    """Greedy tokens a second of one generate of TOKENS tokens (bench.run.hf_generate: the bench's own)."""
    return hf_generate(model, ids, BenchConfig(max_tokens=TOKENS), 0.0, **kw)["tokens_per_second"]


def batched(model, ids: list[int], rows: int) -> float:
    """All rows' tokens a second of one static-cache generate of `rows` copies of the prompt (greedy, no stop)."""
    batch = torch.tensor([ids] * rows, device=model.device)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(
        batch,
        attention_mask=torch.ones_like(batch),
        max_new_tokens=TOKENS,
        min_new_tokens=TOKENS,
        do_sample=False,
        cache_implementation="static",
    )
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return rows * (out.shape[1] - len(ids)) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--assistant", help="a draft's directory: also HF assisted generation (bf16 draft)")
    parser.add_argument("--batches", default="", help="comma-separated batch sizes: also batched static generate")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    for path in args.paths:
        ids = AutoTokenizer.from_pretrained(path)(PROMPT).input_ids
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        for r in range(3):
            rate = timed(model, ids, cache_implementation="static")
            print(f"    {path} {args.dtype}: hf static generate run {r}: {rate:.1f} tok/s", flush=True)
        for rows in [int(b) for b in args.batches.split(",") if b]:
            for r in range(2):  # the first compiles for this batch size
                rate = batched(model, ids, rows)
                print(
                    f"    {path} {args.dtype}: hf static generate, batch {rows}, run {r}: {rate:.1f} tok/s", flush=True
                )
        if args.assistant:
            draft = AutoModelForCausalLM.from_pretrained(args.assistant, dtype=torch.bfloat16).to(device).eval()
            for r in range(2):
                rate = timed(model, ids, assistant_model=draft)
                print(f"    {path} {args.dtype}: hf assisted (bf16 draft) run {r}: {rate:.1f} tok/s", flush=True)
            del draft
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
