"""Fewer kernels a static step: the model's elementwise pieces compiled by torch.compile before the
CUDA graphs are captured (specdec.runtime.graphs).

A graph captured from the eager forward replays every op of it as its own kernel: a Llama layer
launches ~40 (two RMSNorms of ~7 each, the rotary embedding's ~10 on queries and keys, the gated
MLP's activation and product, the projections, the cache writes and reads, the attention). A small
model's step on a GPU is bound by those launches, not by its weights' bytes, which is most of what
HF's compiled `generate` (one fused graph of the whole forward) gains over it. Compiling the whole
forward per (batch, width, KV length) bucket took 38-60 s a variant (graphs.py); compiling these
pieces takes seconds, because
- each is a small function of its inputs alone: the class's own `forward` (an RMSNorm, a gated MLP)
  or the architecture's `apply_rotary_pos_emb`, so inductor fuses its pointwise ops and reductions
  into one or two kernels and leaves the matmuls to cuBLAS;
- one compiled function serves every layer: the module is an argument (torch.compile lifts its
  parameters as inputs); the first shape compiles static, and the batch and width turn dynamic at the
  next (torch's automatic dynamic shapes; sizes of 1 stay specialized): a handful of variants a piece,
  the hidden size static in all of them (inductor's reductions over it then fit one block).
What it computes is the module's own code; inductor's fused reductions round differently (within
fp32 rounding; tests/test_graphs.py, aot_eager on a CPU).

The RMSNorm and MLP modules of the model are patched one by one (their `forward`). The rotary
embedding is a function of the architecture's modeling module, which every model of that
architecture in the process calls: it is replaced by one that runs the compiled version only inside
`active()` (a fused backend's static forwards, on the thread running them), the original elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import torch

ROTARY = "apply_rotary_pos_emb"
_local = threading.local()


@contextlib.contextmanager
def active(on: bool = True):
    """Within it, on this thread, a patched rotary embedding runs compiled (module docstring)."""
    before = getattr(_local, "on", False)
    _local.on = on
    try:
        yield
    finally:
        _local.on = before


class _Rotary:
    """A modeling module's apply_rotary_pos_emb: compiled inside active(), the original outside."""

    def __init__(self, original, backend: str):
        self.original = original
        self.compiled = torch.compile(original, dynamic=None, backend=backend)
        functools.update_wrapper(self, original)

    def __call__(self, *args, **kwargs):
        return (self.compiled if getattr(_local, "on", False) else self.original)(*args, **kwargs)


def fusible(module: torch.nn.Module) -> bool:
    """An RMSNorm, or a gated MLP (gate, up and down projections) that is not a mixture of experts."""
    name = type(module).__name__
    gated = all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn"))
    return name.endswith("RMSNorm") or (gated and "Expert" not in name and "Moe" not in name)


def fuse(model: torch.nn.Module, backend: str = "inductor") -> list[str]:
    """Patch the model's fusible modules and its architecture's rotary embedding to run compiled
    (module docstring); returns the names of what was fused, once each. Compiling happens at the first
    call of each variant (the graph backend's warm-up runs, before any capture)."""
    # a variant a piece where a batch or width is 1 (and a norm's per-head use, Qwen3's, Gemma 3's): past torch's
    # default of 8 a code object, the rest would run eager
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    setattr(config, limit, max(getattr(config, limit), 32))
    compiled: dict[type, object] = {}
    for module in model.modules():
        if fusible(module) and not isinstance(module.forward, functools.partial):
            cls = type(module)
            if cls not in compiled:
                compiled[cls] = torch.compile(cls.forward, dynamic=None, backend=backend)
            module.forward = functools.partial(compiled[cls], module)
    names = [cls.__name__ for cls in compiled]
    for modeling in {sys.modules[type(m).__module__] for m in model.modules()}:
        rotary = getattr(modeling, ROTARY, None)
        if callable(rotary) and not isinstance(rotary, _Rotary):
            setattr(modeling, ROTARY, _Rotary(rotary, backend))
        if isinstance(getattr(modeling, ROTARY, None), _Rotary):
            names.append(f"{modeling.__name__.rsplit('.', 1)[-1]}.{ROTARY}")
    return names


def unfuse(model: torch.nn.Module) -> None:
    """Undo fuse() on the model's modules (the rotary embedding's replacement stays, inert outside active())."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), functools.partial):
            del module.forward
