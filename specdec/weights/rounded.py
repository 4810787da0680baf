"""Weaker drafts from the embedded model: its decoder's weights rounded to fewer bits.

The embedded draft agrees with the embedded target almost everywhere (the same weights: greedy
acceptance 0.91-0.97 on the bench's prompts), so a draft tree has nothing to add to a chain there.
Real pairs agree less (a 1B draft under a 70B target, another family's draft). Weights cannot be
downloaded everywhere, so these aliases make a weaker draft of the model the package ships: every
linear weight of its decoder layers rounded to nearest on a grid of 2^bits levels a group of 32
(symmetric, scale = the group's largest magnitude over 2^(bits-1) - 1), stored dequantised in fp32.
The embeddings, norms and the (tied) output layer stay. The agreement with the embedded target,
teacher-forced on its greedy replies to the bench's 8 prompts (64 tokens each; the target's token
within the draft's top 1 / 2 / 4):

    smollm2-135m-int4  0.80 / 0.92 / 0.97   a good small draft's regime (EAGLE's heads: ~0.8)
    smollm2-135m-int3  0.46 / 0.60 / 0.71   a weak draft, where trees pay

They cost what the embedded model costs (rounding, not a smaller format): they change the
acceptance, not the draft's speed. Each is built once from the fp32 conversion into
$SPECDEC_CACHE/SmolLM2-135M-Instruct-int{bits} (a transformers checkpoint; its config.json says
"specdec_rounded_bits"). This module owns the aliases (ROUNDED_ALIASES; specdec.weights.models names them
too) and builds on specdec.weights.embedded; models.resolve calls ensure_rounded.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from specdec.weights import embedded

GROUP = 32  # weights sharing a scale
WEIGHTS = "model.safetensors"
ROUNDED_ALIASES = {f"{embedded.DEFAULT_ALIAS}-int4": 4, f"{embedded.DEFAULT_ALIAS}-int3": 3}  # alias -> bits


def round_weight(w, bits: int, group: int = GROUP):
    """`w` rounded to nearest on a symmetric grid of 2^bits levels per `group` consecutive weights."""
    import torch

    most = 2 ** (bits - 1) - 1
    g = w.reshape(-1, group)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / most
    return (torch.clamp(torch.round(g / scale), -most - 1, most) * scale).reshape(w.shape)


def rounded_state_dict(state: dict, bits: int) -> dict:
    """The decoder layers' linear weights (2-D, under model.layers.) rounded; the rest as they are."""
    return {
        name: round_weight(w, bits) if w.dim() == 2 and name.startswith("model.layers.") else w.clone()
        for name, w in state.items()
    }


def rounded_dir(bits: int) -> Path:
    return embedded.cache_dir() / f"SmolLM2-135M-Instruct-int{bits}"


def ensure_rounded(alias: str) -> Path:
    """Build the alias's directory once (from the fp32 conversion, which comes first); return its
    path. Locked and renamed into place as embedded.ensure_default_converted is."""
    bits = ROUNDED_ALIASES[alias]
    target = rounded_dir(bits)
    if (target / WEIGHTS).exists():
        return target
    base = embedded.ensure_default_converted()  # before the lock: it takes the same one
    embedded.built_once(target / WEIGHTS, lambda: build(base, target, bits))
    return target


def build(base: Path, target: Path, bits: int) -> None:
    """Write `base` (a transformers Llama directory) rounded to `bits` to `target`: written beside
    it, then renamed into place."""
    from safetensors.torch import load_file, save_file

    print(f"specdec: rounding {base.name} to {bits} bits in {target} (once, seconds)", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        for f in base.iterdir():  # tokenizer, chat template, generation config
            if f.is_file() and f.name not in (WEIGHTS, "config.json"):
                shutil.copy2(f, tmp / f.name)
        config = json.loads((base / "config.json").read_text())
        config.update(
            specdec_rounded_from=embedded.DEFAULT_ALIAS, specdec_rounded_bits=bits, specdec_rounded_group=GROUP
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(rounded_state_dict(load_file(base / WEIGHTS), bits), tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / WEIGHTS).chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache's directory from other users
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
