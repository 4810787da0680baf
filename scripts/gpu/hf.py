"""HF `generate` in process, for each model directory given (scripts/gpu/run.sh, wide.sh):
the static cache (compiled on CUDA), three runs of 128 greedy tokens (the first compiles); with
--assistant DIR, then HF assisted generation of each with that draft, twice.

    python3 scripts/gpu/hf.py [--dtype bfloat16] [--assistant DRAFT_DIR] TARGET_DIR..."""

import argparse
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.getcwd())
from bench.run import BenchConfig, hf_generate  # noqa: E402

PROMPT = "Explain how a refrigerator keeps food cold."
TOKENS = 128


def timed(model, ids: list[int], **kw) -> float:
    """Greedy tokens a second of one generate of TOKENS tokens (bench.run.hf_generate: the bench's own)."""
    return hf_generate(model, ids, BenchConfig(max_tokens=TOKENS), 0.0, **kw)["tokens_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--assistant", help="a draft's directory: also HF assisted generation (bf16 draft)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    for path in args.paths:
        ids = AutoTokenizer.from_pretrained(path)(PROMPT).input_ids
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        for r in range(3):
            rate = timed(model, ids, cache_implementation="static")
            print(f"    {path} {args.dtype}: hf static generate run {r}: {rate:.1f} tok/s", flush=True)
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
