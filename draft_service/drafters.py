"""Which drafter a draft service runs: a factory from a method name to (backend, drafter).

- model: a transformers causal LM, k autoregressive steps (draft_service.proposer);
- ngram: model-free prompt lookup over the session's tokens (draft_service.ngram);
- llamacpp: a GGUF run natively by llama.cpp, same proposer, KV rollback by truncation
  (specdec.runtime.llamacpp, shared with the llama.cpp target; needs the optional llama-cpp-python package);
- suffix: model-free lookup of the longest suffix in the session's tokens and in a store of the
  service's recent sessions' (draft_service.suffix);
- hybrid: the suffix index where its match is strong, else the draft model, run by `runtime`'s
  drafter (llamacpp or model); with its model on a CPU it rents the index's rounds before paying the
  model's catch-up (suffix.HybridDrafter.choose), on an accelerator, whose prefill costs little
  beside a round, it prefills every prompt at open and catches up at once;
- auto (the default): the hybrid. Its model runs on llamacpp for the embedded default (its GGUF,
  requantised to Q8_0, drafts several times faster than the bf16 copy on a CPU, which is what makes
  speculation pay there) and for a .gguf path, on model for anything else or without
  llama-cpp-python. A stand-in draft (specdec.runtime.standin) runs the model drafter whatever the
  method (deploy.hosting).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from draft_service import METHODS, ngram, proposer, suffix
from specdec.weights import models


@dataclass(frozen=True)
class Drafter:
    # (engine, session, k, params, uniforms, assumed) -> (token ids, draft probs of them)
    propose: Callable
    # (session, position, token id or None) -> [vocab] draft distribution of the last proposal
    proposal_row: Callable
    # (engine, session, depth, nodes, params, uniforms, noise_seed) -> proposer.TreeProposal
    propose_tree: Callable
    # propose takes `free` (ProposeRequest.free_lookahead): the index's chains, sized by its score
    free: bool = False
    # some of its chains come from an index of tokens, without a forward (ModelInfo.index_drafts)
    indexed: bool = True
    # the longest prompt its sessions' open prefills (SessionEngine.prefill_at_open; None: any)
    prefill_at_open: int | None = None


MODEL = Drafter(proposer.propose, proposer.proposal_row, proposer.propose_tree, indexed=False)
NGRAM = Drafter(ngram.propose, proposer.proposal_row, ngram.propose_tree)


def suffix_drafter(
    stores: suffix.Stores | None = None, hybrid: bool = False, accelerated: bool = False, window: int | None = None
) -> Drafter:
    """A suffix (or hybrid) drafter with stores of its own (a draft service's), or `stores`.
    `accelerated`: the hybrid's model runs on an accelerator: it never rents (catch_up infinite)
    and prefills every prompt at open; `window`: the most prompt tokens its model's catch-up
    feeds, the prompt's last (HybridDrafter's; its backend must `restart` a cache)."""
    if not hybrid:
        index = suffix.SuffixDrafter(stores)
        return Drafter(index.propose, proposer.proposal_row, index.propose_tree, free=True)
    index = suffix.HybridDrafter(stores, catch_up=math.inf if accelerated else suffix.CATCH_UP, window=window)
    prefill = None if accelerated else suffix.PREFILL_AT_OPEN
    return Drafter(index.propose, proposer.proposal_row, index.propose_tree, free=True, prefill_at_open=prefill)


def make(method: str, spec, compile: bool | None = None, limits=None):
    """(backend, Drafter) for a method name; raises ValueError on an unknown one. `compile`:
    the model drafter's forwards as CUDA graphs (specdec.runtime.graphs.hf_backend; None: by device);
    `limits`: the service's SessionLimits, which size a llama.cpp context (llamacpp.sessions_for)."""
    if method == "model":
        from specdec.runtime.graphs import hf_backend

        return hf_backend(spec, compile), MODEL
    if method == "ngram":
        return ngram.TokenizerBackend(spec), NGRAM
    if method == "suffix":
        backend = ngram.TokenizerBackend(spec)
        backend.name = f"suffix({spec.model})"
        return backend, suffix_drafter()
    if method in ("hybrid", "auto"):
        on_cpu = runtime(spec) == "llamacpp" and not accelerated(spec)  # a window where llama.cpp prefills on a CPU
        hybrid = suffix_drafter(hybrid=True, accelerated=accelerated(spec), window=suffix.WINDOW if on_cpu else None)
        return make(runtime(spec), spec, compile, limits)[0], hybrid
    if method == "llamacpp":
        from specdec.runtime.llamacpp import LlamaCppBackend, sessions_for

        return LlamaCppBackend(spec, sessions=sessions_for(limits)), MODEL
    raise ValueError(f"unknown drafter {method!r}: choose one of {', '.join(METHODS)}")


def runtime(spec) -> str:
    """The model drafter that runs the hybrid's draft model (and so auto's): a GGUF file is
    llama.cpp's to run (without llama-cpp-python, its error says what to install), as is the
    embedded default where llama-cpp-python is installed; transformers runs anything else."""
    if spec.model.endswith(".gguf") or (spec.model in models.ALIASES and models.llamacpp_installed()):
        return "llamacpp"
    return "model"


def accelerated(spec) -> bool:
    """Whether the draft model runs on an accelerator (a device other than the CPU)."""
    return not spec.device.startswith("cpu")
