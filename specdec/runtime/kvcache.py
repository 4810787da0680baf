"""A slot KV cache: one preallocated block of keys and values per layer, a slot per session.

Layout: per layer, keys and values of shape [slots, kv_heads, capacity, head_dim]; a session
owns one slot and a length. Why this layout (and not a DynamicCache per session):
- rollback is a length (O(1)): nothing is copied or freed, later writes overwrite the tail;
- a batched forward over several sessions is a gather of their slots, and no copy at all
  when the slots are consecutive (sessions take the lowest free slot, so a full batch
  usually is `keys[lo:hi]`, a view); a DynamicCache grows by torch.cat, a copy of the whole
  cache every step;
- rows of different lengths share one tensor: each row writes its new keys at its own
  positions and a 4D mask hides the keys past its length, so verify blocks of different
  widths and caches of different lengths run as one ragged forward;
- it is the static cache CUDA graphs need (specdec.runtime.graphs): the storage never moves.
Two ways to size it. Growing (the eager backend's): the block grows by doubling (slots as
sessions open, capacity as a session needs it), so memory follows use; it never shrinks, and
the KV budget (specdec.limits) bounds tokens held, not the block: one long session makes every
slot that long. Fixed (`fixed=True`, the graph backend's): allocated once at start, never
reallocated (a captured graph holds its addresses); a session past its slot's capacity is
refused (OUT_OF_RANGE) and a slot past the last (RESOURCE_EXHAUSTED), never a new block.

`BatchView` is what the model sees as `past_key_values` for one padded forward: transformers'
attention calls `update(keys, values, layer)` with the new tokens' keys and values and
attends over what it returns. `PackedView` is the same for a packed forward: the rows' new
tokens one after another in a single sequence (no padding: a prompt's 128-token prefill chunk
beside 15 one-token decode rows is 143 positions, not 16 x 128), and `attend` runs attention
for each group of rows of one width over their slots (specdec.runtime.backend registers it with
transformers).

A shared prompt prefix is a copy of the source slot's first positions into the new session's slot
(`copy_prefix`; specdec.runtime.prefix decides which): one copy per layer's keys and values, ~60 MB at
1,300 tokens of the fp32 SmolLM2-135M, where prefilling them is a forward through every weight.
Blocks shared by reference (vLLM's paged blocks: refcounts, copy-on-write) would save that copy but
not the slot: attention here reads a slot's positions as one contiguous run, which is what lets a
batch be a view and a CUDA graph read fixed addresses. This module owns no model and no session
logic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import OutOfRange, ResourceExhausted

MIN_CAPACITY = 256


@dataclass
class Slot:
    """A session's place in the cache: its slot index and how many positions it holds."""

    index: int
    length: int = 0


class SlotCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 0,
        capacity: int = 0,
        fixed: bool = False,
    ):
        self.shape = (kv_heads, head_dim)
        self.layers, self.dtype, self.device = layers, dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._alloc(slots, capacity)
        self.free: list[int] = list(range(slots - 1, -1, -1))
        self.fixed = fixed

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def _alloc(self, slots: int, capacity: int) -> None:
        heads, dim = self.shape
        old = list(zip(self.keys, self.values, strict=True)) or [(None, None)] * self.layers
        self.keys, self.values = [], []
        for k, v in old:
            nk = torch.zeros(slots, heads, capacity, dim, dtype=self.dtype, device=self.device)
            nv = torch.zeros_like(nk)
            if k is not None and k.numel():
                nk[: k.shape[0], :, : k.shape[2]] = k
                nv[: v.shape[0], :, : v.shape[2]] = v
            self.keys.append(nk)
            self.values.append(nv)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @staticmethod
    def token_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of keys and values one cached position takes, all layers."""
        return 2 * layers * kv_heads * head_dim * dtype.itemsize

    def acquire(self) -> Slot:
        if not self.free and self.fixed:
            raise ResourceExhausted(f"all {self.slots} KV-cache slots are taken; retry when a session closes")
        if not self.free:
            old = self.slots
            self._alloc(max(1, 2 * old), self.capacity)
            self.free = list(range(self.slots - 1, old - 1, -1))
        self.free.sort(reverse=True)
        return Slot(self.free.pop())  # the lowest free slot keeps batches consecutive

    def release(self, slot: Slot) -> None:
        self.free.append(slot.index)
        slot.length = 0

    def reserve(self, length: int) -> None:
        """Make room for `length` positions in every slot (fixed: check there is)."""
        if length > self.capacity and self.fixed:
            raise OutOfRange(f"a sequence of {length} tokens exceeds the KV slot's capacity of {self.capacity}")
        if length > self.capacity:
            capacity = max(MIN_CAPACITY, self.capacity)
            while capacity < length:
                capacity *= 2
            self._alloc(self.slots, capacity)

    def view(self, slots: list[Slot], width: int) -> BatchView:
        """What a forward of `width` new positions per row sees; rows in the order of `slots`."""
        self.reserve(max(s.length for s in slots) + width)
        return BatchView(self, slots, width)


@dataclass(frozen=True)
class Tree:
    """A slot whose positions from `floor` on hold a draft tree, not a chain: position floor + i
    is a node whose parent is position parents[i] (floor - 1: the node follows the chain before
    the tree). A node attends to the chain and to its ancestors, and takes the rotary position of
    its depth (its parent's + 1); its keys and values sit at its own position in the slot, until
    `compact` moves the accepted path's to consecutive ones."""

    floor: int
    parents: tuple[int, ...]

    def depth(self, position: int) -> int:
        """A slot position's place in the sequence: a node's is its parent's + 1, any other its own."""
        place = position
        hops = 0
        while self.floor <= place < self.floor + len(self.parents):
            place = self.parents[place - self.floor]
            hops += 1
        return place + hops

    def positions(self, kv_length: int) -> list[int]:
        """Each of slot positions 0..kv_length - 1's place in the sequence (the key positions a
        sliding window is measured in)."""
        return [self.depth(j) for j in range(kv_length)]

    def row(self, start: int, width: int, kv_length: int) -> tuple[list[int], torch.Tensor]:
        """For a block written at start..start + width - 1: each position's rotary position (its
        place in the sequence, Tree.depth) and which of positions 0..kv_length - 1 it sees
        ([width, kv_length] bool). Positions below the floor, or past the tree (a pad's), are causal."""
        visible = torch.zeros(width, kv_length, dtype=torch.bool)
        for t in range(width):
            position = start + t
            if position < self.floor or position >= self.floor + len(self.parents):
                visible[t, : position + 1] = True
                continue
            visible[t, : self.floor] = True
            node = position
            while node >= self.floor:
                visible[t, node] = True
                node = self.parents[node - self.floor]
        return [self.depth(start + t) for t in range(width)], visible


def compact(cache: SlotCache, slot: Slot, keep: int, sources: list[int]) -> None:
    """Keep a slot's first `keep` positions, then the keys and values of positions `sources` (in
    that order: an accepted path of a tree) at keep, keep + 1, ...: one gather a layer."""
    if sources and sources != list(range(keep, keep + len(sources))):
        at = torch.tensor(sources, device=cache.device)
        for store in (*cache.keys, *cache.values):
            store[slot.index, :, keep : keep + len(sources)] = store[slot.index, :, at]
    slot.length = keep + len(sources)


def copy_prefix(cache: SlotCache, src: Slot, dst: Slot, n: int) -> None:
    """Slot dst holds src's first n positions (and nothing past them): one copy a layer's keys and
    values, within the block (a shared prefix, specdec.runtime.prefix)."""
    for store in (*cache.keys, *cache.values):
        store[dst.index, :, :n] = store[src.index, :, :n]
    dst.length = n


def causal_visible(positions: torch.Tensor, kv_length: int) -> torch.Tensor:
    """Which keys each query of a batched forward sees, causally: [B, width, kv_length], row b's
    query at positions[b, t] seeing key j iff j <= its position."""
    return torch.arange(kv_length, device=positions.device) <= positions[:, :, None]


def within(visible: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """visible [B, W, kv] narrowed to the keys in each query's sliding window (transformers' `kv > q -
    window`): queries [B, W] and keys [B, kv] or [kv] are positions in the sequence (a tree's node: its
    depth's). None: unchanged."""
    if window is None:
        return visible
    return visible & (keys[..., None, :] > queries[..., :, None] - window)


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, W, kv] bool -> the additive attention mask [B, 1, W, kv]: 0 where visible, the dtype's minimum elsewhere."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[:, None]


class BatchView:
    """The cache of one batched forward (transformers' `past_key_values`).

    Row b writes its `width` new positions at slot.length.. and reads positions
    0..kv_length; the caller's mask hides each row's positions past its own.
    """

    def __init__(self, cache: SlotCache, slots: list[Slot], width: int):
        self.cache = cache
        index = [s.index for s in slots]
        device = cache.device
        self.rows = torch.tensor(index, device=device)
        starts = torch.tensor([s.length for s in slots], device=device)
        self.positions = starts[:, None] + torch.arange(width, device=device)  # [B, width]
        self.kv_length = max(s.length for s in slots) + width
        self.width = width
        lo = min(index)
        # Consecutive slots in order: a view of the block, no gather.
        self.span = slice(lo, lo + len(index)) if index == list(range(lo, lo + len(index))) else None

    def get_seq_length(self, layer: int = 0) -> int:
        """The longest row's cached positions before this forward (a model reads it only to make
        positions or masks of its own, which a forward here passes it)."""
        return self.kv_length - self.width

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args, **kwargs):
        """keys, values: [B, kv_heads, width, head_dim] -> [B, kv_heads, kv_length, head_dim] each."""
        out = []
        for store, new in ((self.cache.keys[layer], keys), (self.cache.values[layer], values)):
            store[self.rows[:, None], :, self.positions] = new.transpose(1, 2).to(store.dtype)
            held = store[self.span] if self.span is not None else store.index_select(0, self.rows)
            out.append(held[:, :, : self.kv_length])
        return out[0], out[1]


class PackedView:
    """The cache of one packed forward: rows' blocks concatenated into one sequence of T tokens.

    `update` writes each token's keys and values at its row's slot and position; `attend` (the
    attention of a layer, called in place of transformers' own) attends, for each group of rows
    of the same width, the group's queries over its slots, each row up to its own positions and
    within the layer's sliding window (`windows`: each layer's, None for full attention).
    """

    def __init__(self, cache: SlotCache, slots: list[Slot], widths: list[int], windows=None):
        self.cache = cache
        device = cache.device
        cache.reserve(max(s.length + w for s, w in zip(slots, widths, strict=True)))
        rows = torch.repeat_interleave(torch.arange(len(slots)), torch.tensor(widths))  # [T]: each token's row
        starts = torch.tensor([s.length for s in slots])
        first = torch.cumsum(torch.tensor([0, *widths[:-1]]), 0)  # each row's first token
        offsets = torch.arange(len(rows)) - first[rows]
        index = torch.tensor([s.index for s in slots])
        self.token_slots = index[rows].to(device)
        self.positions = (starts[rows] + offsets).to(device)  # [T]
        self.windows = windows or [None] * cache.layers
        self.groups = []  # (slot indices [B], token indices [B, w], positions [B, w], kv): rows of width w
        for width in sorted(set(widths)):
            members = torch.tensor([r for r, w in enumerate(widths) if w == width])
            tokens = first[members][:, None] + torch.arange(width)
            positions = starts[members][:, None] + torch.arange(width)
            self.groups.append(
                (index[members].to(device), tokens.to(device), positions.to(device), int(positions.max()) + 1)
            )
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}  # (group, window) -> [B, 1, w, kv]

    def get_seq_length(self, layer: int = 0) -> int:
        """The longest row's cached positions before this forward (a model reads it only to make
        positions or masks of its own, which a forward here passes it)."""
        return max(int(positions[:, 0].max()) for _, _, positions, _ in self.groups)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args, **kwargs):
        """keys, values: [1, kv_heads, T, head_dim], written at each token's slot and position."""
        for store, new in ((self.cache.keys[layer], keys), (self.cache.values[layer], values)):
            store[self.token_slots, :, self.positions] = new[0].transpose(0, 1).to(store.dtype)
        return keys, values

    def _mask(self, group: int, window: int | None) -> torch.Tensor:
        if (group, window) not in self._masks:
            _, _, positions, kv = self.groups[group]
            keys = torch.arange(kv, device=positions.device)
            visible = within(causal_visible(positions, kv), positions, keys, window)
            self._masks[group, window] = additive(visible, self.cache.dtype)
        return self._masks[group, window]

    def attend(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query: [1, heads, T, head_dim] -> the attention output, [1, T, heads, head_dim]."""
        out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        for g, (slots, tokens, _, kv) in enumerate(self.groups):
            q = query[0][:, tokens].transpose(0, 1)  # [B, heads, w, head_dim]
            k = keys.index_select(0, slots)[:, :, :kv].to(q.dtype)
            v = values.index_select(0, slots)[:, :, :kv].to(q.dtype)
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=self._mask(g, self.windows[layer]), scale=scaling, enable_gqa=True
            )
            out[0, tokens] = o.transpose(1, 2)
        return out
