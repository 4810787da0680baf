"""A compiled forward over the slot KV cache: torch.compile with static shapes (CUDA graphs on CUDA).

CompiledBackend is specdec.backend.HFBackend whose short blocks (decode steps and verify
blocks: widths up to MAX_LOOKAHEAD + 1) run one compiled function of static shapes, as
gpt-fast and transformers' StaticCache generation do:
- the width is padded up to a bucket (WIDTHS) and the batch up to a power of 2 (BATCHES):
  a pad row writes into a scratch slot the backend holds, a pad column past a row's block
  writes keys past its length, which no query of it sees (its causal mask) and later
  writes overwrite;
- every row attends over the whole slot capacity with a mask (keys 0..its own position),
  no `[:kv_length]` slice: positions and rows are tensors, so one compiled function serves
  every length;
- rollback stays a length (specdec.kvcache).
Longer blocks (prompt prefill chunks) and batches beyond the largest bucket run eager on the
same cache; a prompt of up to 33 tokens is prefilled compiled, in the widest bucket.

The capacity: the slot cache still grows by doubling, and the compiled function is
specialised on it (one variant per capacity reached: 256, 512, ...). Preallocating the max
context instead would make every forward attend over it: 8192 positions x 30 layers of the
default target are ~12 MB of keys and values per row per layer (~380 MB a forward, most of
what the weights cost), read at every step for a session of 100 tokens; and times
max_sessions slots the block would be 24 GB.
Doubling keeps the attended span within 2x of the longest session for a few recompiles.
The slot count (dim 0) is marked dynamic, so sessions opening do not recompile.

Variants compile lazily, on first use, with a line on stderr (`specdec: compiling ...`, then
the seconds it took): on this 2-core CPU one variant of the default target took 75-120 s
(20 s when inductor's on-disk cache already holds its graph, e.g. after a restart), and there
are |WIDTHS| x |BATCHES| x capacities of them: compiling them all at start-up would take
an hour for variants most deployments never meet. On CUDA each growth of the block (more
slots, more capacity) is a new address for the CUDA graphs, hence a recompile too.

What was measured (SmolLM2-135M fp32, context 80; a 2-core machine shared with three other
jobs, load 8-11, so absolute times are ~2x a quiet machine's: read the ratios):
- Eager one-token forward, by operator (torch.profiler, 1 thread): the matrix products are
  81-83% of operator time (211 a forward: 7 per layer x 30, and the output layer); SDPA
  2%, the KV index_put 1%, the mask a few small ops, everything else elementwise. Wall
  time minus operator time (Python and dispatch): ~10 ms of ~57 ms (quiet moment). The
  forward reads ~540 MB of fp32 weights a token; one core's matrix-vector products run at
  13-15 GB/s (a 576 x 1536 product: ~250 us), so ~38 ms is the weights alone. It is
  bandwidth, not per-op overhead, that bounds it; the overhead compile can remove is ~20%.
- The cheap eager wins are each under 1-2 ms of that: the 4D mask (a few ops a forward),
  the index_put (~0.4 ms), SDPA vs eager attention (SDPA is ~1 ms), inference_mode (on).
  A second thread does not help under load (OpenMP threads wait for a core: 2 threads ran
  a product 3-10x slower than 1 while the machine was busy).
- scripts/cost_model.py, interleaved, medians of 15, 1 thread: eager / compiled (ms)
  n=1 111.8 / 102.1 (0.91x), n=3 126.7 / 143.5 (padded to 4), n=5 183.8 / 196.6 (to 8),
  n=9 243.3 / 231.9 (to 16); llama.cpp Q4_1 draft 41.7. inductor freezing (weights
  prepacked for MKL) gave the same 0.91x.
So on a CPU the compiled path is off by default (`--compile` turns it on): ~10% on a
one-token forward, lost to padding on verify blocks, for minutes of compiling. On CUDA,
where per-kernel launch overhead is what CUDA graphs remove, it is on by default.
"""

from __future__ import annotations

import sys
import time

import torch

from specdec import models
from specdec.backend import HFBackend, picked
from specdec.kvcache import Slot, causal_mask
from specdec.validation import MAX_LOOKAHEAD

WIDTHS = (1, 2, 4, 8, 16, MAX_LOOKAHEAD + 1)  # a verify block is k + 1 wide
BATCHES = (1, 2, 4, 8, 16, 32, 64)


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= n, or None past the largest."""
    return next((s for s in sizes if s >= n), None)


def default_on(device: str) -> bool:
    """Whether a service compiles when not told: on CUDA (CUDA graphs remove the launch
    overhead), not on a CPU, where a variant compiles for 1-2 minutes and gains ~10%."""
    return torch.device(device).type == "cuda"


class CompiledBackend(HFBackend):
    """HFBackend with its short forwards compiled: widths up to max(widths), batches up to
    max(batches); anything larger runs eager."""

    # No batched-step profile at start (engine.profile_steps): each batch size would compile a
    # variant first, minutes on a CPU.
    profiled = False

    def __init__(self, spec: models.ModelSpec, widths=WIDTHS, batches=BATCHES):
        super().__init__(spec)
        self.widths, self.batches = tuple(widths), tuple(batches)
        self._pad = self.kv.acquire()  # pad rows of a bucketed batch write here
        cuda = self.device.type == "cuda"
        _raise_recompile_limits()
        self._step = torch.compile(self._static_forward, dynamic=False, mode="reduce-overhead" if cuda else None)
        self.variants: set[tuple[int, int, int]] = set()  # (batch, width, capacity) compiled so far
        self._marked: torch.Tensor | None = None

    def _last_hidden(self, slots: list[Slot], blocks: list[list[int]], wanted: list[int]) -> torch.Tensor:
        width = bucket(max(len(tokens) for tokens in blocks), self.widths)
        batch = bucket(len(blocks), self.batches)
        if width is None or batch is None:
            return super()._last_hidden(slots, blocks, wanted)
        return picked(self._compiled_hidden(slots, blocks, batch, width), blocks, wanted)

    def _compiled_hidden(self, slots: list[Slot], blocks: list[list[int]], batch: int, width: int) -> torch.Tensor:
        self.kv.reserve(max(s.length for s in slots) + width)
        if self._marked is not self.kv.keys[0]:  # a new block: sessions opening must not recompile
            for store in (*self.kv.keys, *self.kv.values):
                torch._dynamo.maybe_mark_dynamic(store, 0)
                if self.device.type == "cuda":
                    torch._dynamo.mark_static_address(store)
            self._marked = self.kv.keys[0]
        ids = torch.zeros(batch, width, dtype=torch.long)
        starts = torch.zeros(batch, dtype=torch.long)
        rows = torch.full((batch,), self._pad.index, dtype=torch.long)
        for b, (slot, tokens) in enumerate(zip(slots, blocks, strict=True)):
            ids[b, : len(tokens)] = torch.tensor(tokens)
            starts[b], rows[b] = slot.length, slot.index
        positions = starts[:, None] + torch.arange(width)  # [batch, width]
        key = (batch, width, self.kv.capacity)
        if key not in self.variants:
            print(
                f"specdec: compiling {self.name}'s forward for batch {batch} x width {width}, "
                f"capacity {self.kv.capacity} (once)",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.perf_counter()
        to = self.device
        if to.type == "cuda":  # a new step: the previous replay's outputs (already read) may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        hidden = self._step(ids.to(to), positions.to(to), rows.to(to), self.kv.keys, self.kv.values)
        if key not in self.variants:
            self.variants.add(key)
            print(f"specdec: compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return hidden

    def _static_forward(self, ids, positions, rows, keys, values) -> torch.Tensor:
        """ids, positions: [B, W]; rows: [B] slot indices -> [B, W, hidden]."""
        return self.model.base_model(
            input_ids=ids,
            attention_mask=causal_mask(positions, keys[0].shape[2], keys[0].dtype),  # over the whole capacity
            position_ids=positions,
            past_key_values=StaticView(keys, values, rows, positions),
            use_cache=True,
        ).last_hidden_state


class StaticView:
    """past_key_values of a compiled forward: each row writes its block at its positions and
    reads its whole slot (the mask hides what is past its own position)."""

    def __init__(self, keys, values, rows, positions):
        self.keys, self.values, self.rows, self.positions = keys, values, rows, positions

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args, **kwargs):
        """keys, values: [B, kv_heads, W, head_dim] -> [B, kv_heads, capacity, head_dim] each."""
        out = []
        for store, new in ((self.keys[layer], keys), (self.values[layer], values)):
            store[self.rows[:, None], :, self.positions] = new.transpose(1, 2).to(store.dtype)
            out.append(store.index_select(0, self.rows))
        return out[0], out[1]


def _raise_recompile_limits() -> None:
    """One variant a (batch, width, capacity) bucket: more than dynamo's default 8."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 256))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 1024)


def hf_backend(spec: models.ModelSpec, compile: bool | None = None) -> HFBackend:
    """The transformers backend for a spec: compiled or eager (None: default_on(spec.device))."""
    if compile is None:
        compile = default_on(spec.device)
    return CompiledBackend(spec) if compile else HFBackend(spec)
