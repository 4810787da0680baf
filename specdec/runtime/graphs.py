"""Static forwards over a fixed slot KV cache, captured as CUDA graphs at start (on a CPU, run eagerly).

GraphBackend is specdec.runtime.backend.HFBackend whose short forwards (decode steps and verify blocks:
widths up to MAX_LOOKAHEAD + 1) run a forward of static shapes, as SGLang's CudaGraphRunner,
vLLM and gpt-fast do:
- the KV cache is allocated once, in `prepare` (before the service says ready): max_sessions
  slots of max_kv_tokens / max_sessions positions each (no cap: the model's context), on CUDA
  within KV_MEMORY_FRACTION of the free memory; it never grows, so captured graphs keep their
  addresses. The slot's capacity is the service's max_context (Describe): a longer sequence is
  refused with OUT_OF_RANGE before anything changes (specdec.runtime.engine), a session past the slots
  with RESOURCE_EXHAUSTED (the engine's max_sessions, the same number);
- a step's shape is bucketed three ways (Buckets): rows up to a batch size, columns up to a
  width, the KV positions attended up to a length. One graph a (batch, width, length), all
  captured in `prepare` on the thread that will replay them (specdec.serving.lifecycle runs it on the
  model worker; torch's graph state is per thread, pytorch issue #123177);
- a graph reads one static input tensor (ids, positions, and the slot each column writes to)
  that a step fills with one host-to-device copy, and writes the last hidden states of every
  column; the step gathers the columns it wants and applies the output layer eagerly;
- every row attends over `[:length]` of its slot with a mask: the committed keys before its
  window's start, and within a window of TREE_WINDOW positions after it the keys its `seen` row
  allows (window_visible). A chain sees the window's columns up to its own; a draft tree's node (the
  target's verify, the draft's extend_tree) sees its ancestors, at its depth's rotary position,
  so one graph serves both; a tree past the window runs eager. A slice of the static block keeps
  its address;
- a pad column (past its row's block) and a pad row write into a pad slot no session owns, so
  padding never touches a session's keys; their outputs are never read. Rollback stays a length.
Anything outside the buckets (a prompt's prefill chunk wider than the widest, more rows than
the largest batch, a length past the largest) runs HFBackend's eager forward on the same cache.
The static forwards take the architecture's masks (specdec.runtime.architectures: a layer's sliding window
is measured in the keys' places in the sequence, a tree's nodes at their depths'). An architecture
whose forward cannot be captured (MoE routers: the experts a token goes to are read back to the
host) is served eager on CUDA, all its forwards HFBackend's, with one log line saying so. Pieces
compiled before the capture: specdec.runtime.fusion. On a CPU this backend runs only for the tests (a CPU
serves HFBackend), its static forwards eager, which exercises the buffers, buckets and padding.

`builds` counts graphs built, `builds_after_ready` those built after `prepare` finished: a
step that found no graph for its bucket builds one then (not the eager forward: the shapes are
within the buckets). That never happens when the buckets are consistent; Describe and the
metrics export it, and a test holds it at zero.

Why and what was measured: docs/gpu.md#why-graphs-of-the-eager-forward-bucketed-by-kv-length.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.limits import SessionLimits
from specdec.runtime import fusion
from specdec.runtime.backend import HFBackend
from specdec.runtime.kvcache import Slot, SlotCache
from specdec.validation import MAX_LOOKAHEAD, MAX_TREE_NODES
from specdec.weights import models

# On CUDA, of the device's free memory at start, at most for the KV cache: a draft and a target starting
# together on one GPU each see it all free.
KV_MEMORY_FRACTION = 0.4
# A CUDA model's norms, gated MLPs and rotary embedding are compiled by inductor before the capture
# (specdec.runtime.fusion) where triton is installed; SPECDEC_FUSE=0 captures the eager forward's kernels
# as they are, =1 fuses, another value names torch.compile's backend. The command line
# (cli.options.apply_environment) reads it: set_fuse.
FUSE_ENV = "SPECDEC_FUSE"
_fuse: str | None = None  # set_fuse's; None: by device (fuse_backend)
MIN_LENGTH = 256  # the shortest KV-length bucket by default; the next ones double up to the capacity
# Tree nodes cached before a block that its columns may see (a draft's tree grown a depth at a time); a
# step's mask covers this many keys more than its width (specdec.runtime.graphs.window_visible).
TREE_WINDOW = MAX_TREE_NODES


@dataclass(frozen=True)
class Buckets:
    """The shapes graphs are captured for; empty lengths: MIN_LENGTH, doubling, up to the capacity.
    Sizes past the slots (batches) or the capacity (widths, lengths) are cut to it."""

    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    widths: tuple[int, ...] = (1, 2, 4, 8, 16, MAX_LOOKAHEAD + 1)  # a verify block is k + 1 wide
    lengths: tuple[int, ...] = ()


@dataclass
class Built:
    """What `prepare` built, for the log and Describe."""

    mode: str  # "cuda-graphs" (captured) or "eager" (a CPU: the static forwards run eagerly)
    batches: tuple[int, ...]
    widths: tuple[int, ...]
    lengths: tuple[int, ...]
    slots: int  # sessions the KV cache holds
    capacity: int  # positions a slot holds
    kv_bytes: int
    graphs: int = 0
    seconds: float = 0.0
    hits: Counter = field(default_factory=Counter)  # (batch, width, length) -> steps it ran


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= n, or None past the largest."""
    return next((s for s in sizes if s >= n), None)


def default_on(device: str) -> bool:
    """Whether a service captures graphs when not told: on CUDA only (see the module docstring)."""
    return torch.device(device).type == "cuda"


def kv_shape(limits: SessionLimits, max_context: int, token_bytes: int, free_bytes: int | None) -> tuple[int, int]:
    """(slots, positions a slot) of the fixed cache for these limits (module docstring)."""
    slots = limits.max_sessions
    capacity = max_context if not limits.max_kv_tokens else min(max_context, limits.max_kv_tokens // slots)
    if free_bytes is not None:  # + 1: the pad slot
        capacity = min(capacity, int(KV_MEMORY_FRACTION * free_bytes) // ((slots + 1) * token_bytes))
    if capacity < 1:
        raise ValueError(
            f"a KV cache of {slots} slots leaves no position for a session (max_kv_tokens "
            f"{limits.max_kv_tokens}, {token_bytes} bytes a position): lower max_sessions or raise max_kv_tokens"
        )
    return slots, capacity


class GraphBackend(HFBackend):
    """HFBackend with static short forwards over a fixed cache, built by prepare(limits)."""

    def __init__(self, spec: models.ModelSpec, buckets: Buckets = Buckets(), fuse: str | None = None):
        """fuse: torch.compile's backend for specdec.runtime.fusion ("inductor"), "" for none; None: set_fuse's."""
        super().__init__(spec)
        self.buckets = buckets
        self.fuse = fuse_backend(self.device) if fuse is None else fuse
        self.fused: list[str] = []
        self.built: Built | None = None
        self.builds = 0
        self.builds_after_ready = 0
        self._steps: dict[tuple[int, int, int], _Step] = {}
        self._pool = None  # the CUDA graphs' shared memory pool
        self._pad = -1
        self._owner: int | None = None  # the thread that built the graphs, which alone replays them
        self._ready = False

    @torch.inference_mode()
    def prepare(self, limits: SessionLimits) -> Built:
        """Allocate the KV cache and build every step of the buckets; call it once, on the thread
        that will run the forwards, before serving."""
        if self.built is not None:
            return self.built
        config = self.model.config
        cuda = self.device.type == "cuda"
        layers, (kv_heads, head_dim), dtype = config.num_hidden_layers, self.kv.shape, self.kv.dtype
        token_bytes = SlotCache.token_bytes(layers, kv_heads, head_dim, dtype)
        free = torch.cuda.mem_get_info(self.device)[0] if cuda else None
        slots, capacity = kv_shape(limits, self.max_context, token_bytes, free)
        self.kv = SlotCache(layers, kv_heads, head_dim, dtype, self.device, slots + 1, capacity, fixed=True)
        self._pad = self.kv.free.pop(0)  # the highest slot: sessions take the lowest free one
        self.max_context = capacity
        b = self.buckets
        lengths = b.lengths or (*(MIN_LENGTH << i for i in range(32) if MIN_LENGTH << i < capacity), capacity)
        self.built = built = Built(
            "cuda-graphs" if cuda else "eager",
            _cut(b.batches, slots),
            _cut(b.widths, capacity),
            _cut(lengths, capacity),
            slots,
            capacity,
            self.kv.nbytes,
        )
        self._owner = threading.get_ident()
        if cuda and not self.arch.graphs:  # the KV cache stays fixed; every forward runs HFBackend's
            built.mode = "eager"
            self._ready = True
            print(
                f"specdec: {self.name}: architecture {self.arch.model_type!r} served eager, no CUDA graphs: its MoE "
                "router reads the routing back to the host, which a capture cannot hold",
                file=sys.stderr,
                flush=True,
            )
            return built
        self._pool = torch.cuda.graph_pool_handle() if cuda else None
        t0 = time.perf_counter()
        # Largest first: the smaller graphs' activations then fit in the pool's blocks the larger freed.
        keys = sorted(((n, w, c) for n in built.batches for w in built.widths for c in built.lengths), reverse=True)
        if self.fuse:  # compiled at the warm-up runs (a first one here, on any device), before their captures
            self.fused = fusion.fuse(self.model, self.fuse)
        try:
            if self.fused:
                self._trial(keys[0])
            for key in keys:
                self._build(key)
        except Exception as err:  # a compiler's failure: of any type
            if not self.fused:
                raise
            print(
                f"specdec: {self.name}: compiling the fused pieces failed ({type(err).__name__}: {err}); "
                "capturing the eager forward instead",
                file=sys.stderr,
                flush=True,
            )
            fusion.unfuse(self.model)
            self.fused, self.builds = [], 0
            self._steps.clear()
            for key in keys:
                self._build(key)
        built.graphs, built.seconds = len(keys), time.perf_counter() - t0
        self._ready = True
        what = "CUDA graphs captured" if cuda else "static forwards built (eager, no capture on a CPU)"
        if self.fused:
            what += f" ({', '.join(self.fused)} compiled by torch.compile, {self.fuse})"
        print(
            f"specdec: {self.name}: {built.graphs} {what} in {built.seconds:.1f} s, batches {_span(built.batches)} "
            f"x widths {_span(built.widths)} x KV lengths {_span(built.lengths)}; KV cache {slots} slots x "
            f"{capacity} positions ({built.kv_bytes / 2**30:.2f} GiB)",
            file=sys.stderr,
            flush=True,
        )
        return built

    def _last_hidden(self, slots: list[Slot], blocks: list[list[int]], wanted: list[int]) -> torch.Tensor:
        hidden = self._static(slots, blocks)
        if hidden is None:
            return super()._last_hidden(slots, blocks, wanted)
        width = hidden.shape[1]
        ends = [row * width + len(tokens) for row, tokens in enumerate(blocks)]  # past each row's last column
        at = torch.tensor([e - n + t for e, n in zip(ends, wanted, strict=True) for t in range(n)], device=self.device)
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, at)

    def _hidden(self, slots: list[Slot], blocks: list[list[int]], trees=None) -> torch.Tensor:
        hidden = self._static(slots, blocks, trees)
        return super()._hidden(slots, blocks, trees) if hidden is None else hidden

    def _static(self, slots: list[Slot], blocks: list[list[int]], trees=None) -> torch.Tensor | None:
        """The static forward of these rows: [batch, width, hidden] (padded rows and columns; until the
        next step runs), or None where the step is outside the buckets (HFBackend's forward then)."""
        if self.built is None:
            raise RuntimeError(f"{type(self).__name__}.prepare(limits) must run before a forward")
        b = self.built
        if not b.graphs:  # served eager (prepare)
            return None
        batch = bucket(len(blocks), b.batches)
        width = bucket(max(len(tokens) for tokens in blocks), b.widths)
        length = bucket(max(s.length + len(t) for s, t in zip(slots, blocks, strict=True)), b.lengths)
        if batch is None or width is None or length is None:
            return None
        # One host array of ids, write positions, slots, rotary positions and window starts, the
        # windows' masks, and the places in the sequence of the windows' keys (a tree's node: its
        # depth's; what a sliding window measures): three copies to the device. A pad cell writes the
        # pad slot at its column's index (a position within every slot) and sees its window's first
        # key (no row all masked).
        host = np.zeros((5, batch, width), dtype=np.int64)
        seen = np.zeros((batch, width, TREE_WINDOW + width), dtype=bool)
        places = np.broadcast_to(np.arange(TREE_WINDOW + width), (batch, TREE_WINDOW + width)).copy()
        host[1] = host[3] = np.arange(width)
        host[2] = self._pad
        seen[:, :, 0] = True
        lower = np.tril(np.ones((width, width), dtype=bool))
        for row, (slot, tokens) in enumerate(zip(slots, blocks, strict=True)):
            w, start = len(tokens), slot.length
            tree = trees[row] if trees else None
            low = start if tree is None else min(start, tree.floor)  # keys before it: all seen
            if start + w - low > TREE_WINDOW + width:
                return None  # a tree past the window (a draft's, grown beyond MAX_TREE_NODES)
            host[0, row, :w] = tokens
            host[1, row, :w] += start
            host[2, row, :w] = slot.index
            host[4, row] = low
            places[row] += low
            if tree is None:  # a chain: the window starts at the block, causal within it
                host[3, row, :w] = host[1, row, :w]
                seen[row, :w, :width] = lower[:w]
            else:  # a node's rotary position is its depth's; it sees its ancestors
                rotary, visible = tree.row(start, w, start + w)
                host[3, row, :w] = rotary
                seen[row, :w, : start + w - low] = visible[:, low:].numpy()
                places[row, : start + w - low] = [tree.depth(j) for j in range(low, start + w)]
        key = (batch, width, length)
        step = self._steps.get(key) or self._build(key)
        if step.graph is not None and threading.get_ident() != self._owner:
            raise RuntimeError("CUDA graphs are replayed on the thread that captured them (the model worker)")
        b.hits[key] += 1
        return step.run(
            torch.from_numpy(host), torch.from_numpy(seen), torch.from_numpy(places)
        )  # [batch, width, hidden]

    def _build(self, key: tuple[int, int, int]) -> _Step:
        if self._ready:
            self.builds_after_ready += 1
            print(f"specdec: {self.name}: building the step {key} while serving", file=sys.stderr, flush=True)
        if self._owner is not None and threading.get_ident() != self._owner:
            raise RuntimeError("a graph must be built and replayed on the thread that built the others")
        self.builds += 1
        # An eager run before the first capture of a (batch, width): the lazy initialisation a first
        # launch does (module loading, kernel selection) must not happen under capture. Lengths
        # change only the attention's shapes; a run before every capture took 10.1 s of 126 graphs'
        # capture where this takes 5.8 (fp32, one H100).
        warm = not any(k[:2] == key[:2] for k in self._steps)
        step = _Step(self._forward_of(key[2]), self._buffers(*key[:2]), self._pad, self._pool, warm)
        self._steps[key] = step
        return step

    def _trial(self, key: tuple[int, int, int]) -> None:
        """One eager static forward of a bucket (the pad slot's), on any device: the fused pieces' first
        compile, where a compiler's failure shows before any capture."""
        buffers = self._buffers(*key[:2])
        buffers[0][2] = self._pad
        self._forward_of(key[2])(*buffers)

    def _buffers(self, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs = torch.zeros(5, batch, width, dtype=torch.long, device=self.device)
        seen = torch.zeros(batch, width, TREE_WINDOW + width, dtype=torch.bool, device=self.device)
        seen[:, :, 0] = True
        places = torch.arange(TREE_WINDOW + width, device=self.device).expand(batch, -1).clone()
        return inputs, seen, places

    def _forward_of(self, length: int):
        return functools.partial(self._static_forward, length=length)

    def _static_forward(
        self, inputs: torch.Tensor, seen: torch.Tensor, places: torch.Tensor, length: int
    ) -> torch.Tensor:
        """inputs: [5, B, W] (ids, write positions, slots, rotary positions, each row's window start);
        seen: [B, W, TREE_WINDOW + W], whether a column sees each key of its row's window (keys before
        the window: all; past it: none); places: [B, TREE_WINDOW + W], the window's keys' places in
        the sequence (keys before it: their own) -> the last hidden states, [B, W, hidden]."""
        ids, writes, slots, rotary, low = inputs
        visible, keys = window_visible(low[:, 0], seen, places, length)
        with fusion.active(bool(self.fused)):
            return self._base(
                input_ids=ids,
                attention_mask=self.arch.mask(visible, rotary, keys, self.kv.dtype),
                position_ids=rotary,
                cache=StaticView(self.kv, slots, writes, length),
            )


def window_visible(
    low: torch.Tensor, seen: torch.Tensor, places: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys [B, W, length] each column of rows whose keys before low[b] are all seen, those from
    it by seen[b, column, key - low[b]] and those past the window none, sees; and each key's place in
    the sequence [B, length] (in the window: places[b, key - low[b]], else its own)."""
    window = seen.shape[-1]
    own = torch.arange(length, device=low.device)
    at = own - low[:, None]  # [B, length]: a key's place in its window
    inside = (at >= 0) & (at < window)
    index = at.clamp(0, window - 1)
    keys = torch.where(inside, places.gather(-1, index), own)
    gathered = seen.gather(-1, index[:, None, :].expand(-1, seen.shape[1], -1))
    visible = (at < 0)[:, None, :] | (gathered & inside[:, None, :])
    return visible, keys


class _Step:
    """One static forward: its input buffers, and on CUDA its captured graph and output."""

    def __init__(self, forward, buffers: tuple[torch.Tensor, ...], pad: int, pool, warm: bool = True):
        self.forward = forward
        self.buffers = buffers  # inputs [5, batch, width], seen [batch, width, window], places [batch, window]
        buffers[0][2] = pad  # a warm-up run writes only the pad slot
        self.graph = None
        if buffers[0].device.type != "cuda":
            return
        if warm:  # off the capturing stream, as torch's docs do before a capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                forward(*self.buffers)
            torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = forward(*self.buffers)

    def run(self, *host: torch.Tensor) -> torch.Tensor:
        for buffer, values in zip(self.buffers, host, strict=True):
            buffer.copy_(values)
        if self.graph is None:
            return self.forward(*self.buffers)
        self.graph.replay()
        return self.output


class StaticView:
    """past_key_values of a static forward: each column writes its keys and values at its slot and
    position; each row reads `[:length]` of its slot (the mask hides what is past its position)."""

    def __init__(self, cache: SlotCache, slots: torch.Tensor, positions: torch.Tensor, length: int):
        self.cache, self.slots, self.positions, self.length = cache, slots, positions, length
        self.rows = slots[:, 0]  # a row's first column is never a pad column

    def get_seq_length(self, layer: int = 0) -> int:
        """The positions attended (a model reads it only to make positions or masks of its own,
        which a static forward passes it)."""
        return self.length

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args, **kwargs):
        """keys, values: [B, kv_heads, W, head_dim] -> [B, kv_heads, length, head_dim] each."""
        out = []
        for store, new in ((self.cache.keys[layer], keys), (self.cache.values[layer], values)):
            store[self.slots, :, self.positions] = new.transpose(1, 2).to(store.dtype)
            out.append(store[:, :, : self.length].index_select(0, self.rows))
        return out[0], out[1]


def set_fuse(value: str | None) -> None:
    """The fusion setting of this process, a FUSE_ENV value ("0", "1", a backend; None or "": by device), from
    its composition root (the CLI, a Ray actor): a module-level setting, not a parameter, as the backends are
    built by draft_service.drafters and deploy.hosting, from configs that carry no such field."""
    global _fuse
    _fuse = value


def fuse_backend(device: torch.device) -> str:
    """torch.compile's backend for specdec.runtime.fusion: set_fuse's ("" for 0, inductor for 1); where unset,
    inductor on CUDA with triton installed, else "" (none)."""
    value = (_fuse or "").strip()
    if value:
        return "" if value == "0" else "inductor" if value == "1" else value
    return "inductor" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else ""


def _cut(sizes: tuple[int, ...], most: int) -> tuple[int, ...]:
    """The sizes, each at most `most` (the largest bucket then covers everything up to it)."""
    return tuple(sorted({min(s, most) for s in sizes if s >= 1}))


def _span(sizes: tuple[int, ...]) -> str:
    return f"{sizes[0]}-{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])


def hf_backend(spec: models.ModelSpec, graphs: bool | None = None) -> HFBackend:
    """The transformers backend for a spec: with static forwards (CUDA graphs) or eager;
    None: default_on(spec.device)."""
    if graphs is None:
        graphs = default_on(spec.device)
    return GraphBackend(spec) if graphs else HFBackend(spec)
