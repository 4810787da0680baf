"""A llama.cpp backend: a GGUF run natively (llama-cpp-python), sessions batched.

Both services use it: the draft service runs the embedded SmolLM2 GGUF requantised to Q8_0
(the default alias, `--drafter llamacpp`; specdec.weights.models.draft_gguf_path), the target service its
F32 requantisation (specdec.weights.models.f32_gguf_path: the same weights as the fp32 transformers
target, `--backend llamacpp`). One llama.cpp context holds every session: a session is a
sequence id with a KV stream of its own (SEQUENCE_CELLS cells, allocated at start), and
`forward_batch` puts the new tokens of several sessions into one llama_batch, each at its own
positions and sequence id, so the draft steps or the verify blocks (different widths, different
lengths) of many sessions are one llama_decode. Rolling back removes the sequence's cells past
the kept length (llama_memory_seq_rm); no re-prefill.

Invariant: a session's logits depend on its own tokens only, bit for bit the same alone, batched
with others, under churn and after a re-prefill, so a seeded request reproduces its text under
any load (the Leviathan rule reads the draft's probabilities). Three choices keep it so:
- a KV stream per session (kv_unified off): its tokens are in position order;
- ubatches under 64 tokens a stream (UBATCH_TOKENS) where flash attention runs (from 64 queries
  its CPU kernel switches to a tiled one with other logits); an F32 model runs plain attention,
  whose logits do not move with the ubatch, and takes F32_UBATCH_TOKENS;
- the sessions of a step in increasing sequence ids (llama.cpp puts only consecutive streams in
  one ubatch): a new session takes the lowest free id and a step is sorted.
A step whose streams skip an id would be two ubatches, so a short gap is filled (MAX_FILL): each
missing stream gets one token without logits at its next position, removed after the decode; the
filled stream is as it was. A shared prompt prefix (specdec.runtime.prefix) is copied with llama.cpp's
per-sequence state (llama_state_seq_get_data / set_data), then cut to the prefix: the logits after
it are bit for bit a fresh prefill's (not llama_memory_seq_cp: across streams it copies whole ones).

Implements the backend interface of specdec.runtime.backend. Logits are computed only at the
positions asked for (the last n_logits of each item: 1 for a draft step, k + 1 for a verify),
and returned as views of llama.cpp's output buffer, valid until the next forward (the
interface's contract): no row is copied. An F32 model runs in float32 throughout (F32 KV cache,
no flash attention); a quantised one with an F16 KV cache and flash attention.
Threads: the service's (specdec.runtime.placement, its --threads), and per step what its requests
allow (set_threads: llama_set_n_threads, no new threads: the OpenMP team of the next decode).

Why and what was measured: docs/models.md#the-llamacpp-backend-and-seeds.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from specdec.errors import ResourceExhausted
from specdec.limits import SessionLimits
from specdec.runtime import placement
from specdec.runtime.backend import Tokenized
from specdec.runtime.kvcache import Slot
from specdec.weights import models

SEQUENCE_CELLS = 4096  # KV cells of each session's stream: its longest sequence
# Sessions one context holds (its streams, the KV of all allocated at start): the service's --max-sessions,
# as many as its KV budget holds at SEQUENCE_CELLS each (sessions_for), at most llama.cpp's LLAMA_MAX_SEQ;
# the engine admits no more (SessionEngine: the backend's max_sessions), and neither does the orchestrator.
LLAMA_MAX_SEQ = 256  # llama.cpp's own bound on a context's sequences (src/llama-cparams.h)
KV_MEMORY_FRACTION = 0.8  # of the memory available at start, the most a context's KV cache may take
BATCH_TOKENS = 512  # tokens per llama_decode; a larger step is split
# A gap of at most this many stream ids in a step is filled (module docstring): while its fillers cost
# less than the second ubatch. A filler costs a token's share of a batched step (the F32 target: 3.5 ms,
# the Q8_0 draft: 2.4), the second ubatch about one session's step (19 ms, 7.5 ms).
MAX_FILL = 2
F32_MAX_FILL = 4
FILL_TOKEN = 0  # what fills it (never read: no logits, removed after the decode)
UBATCH_TOKENS = 32  # tokens of one session a ubatch holds: under the tiled attention kernel's 64
# An F32 model's ubatch (plain attention): its prefill of 1,336 tokens on 2 cores took 5.7 s in
# 128-token ubatches against 6.5 s in 32-token ones (in process, medians of 4; 512: 6.2 s).
F32_UBATCH_TOKENS = 128
GGML_TYPE_F32 = 0
FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}  # llama_ftype -> the torch dtype's name


def sessions_for(limits: SessionLimits | None) -> int:
    """The sessions a context of SEQUENCE_CELLS-cell streams holds under a service's `limits`: its
    max_sessions, no more than its KV budget fills (max_kv_tokens; 0: no cap), at most LLAMA_MAX_SEQ.
    The default limits: 65,536 / 4,096 = 16 sessions (~3 GB of F32 keys and values for the target)."""
    limits = limits or SessionLimits()
    n = limits.max_sessions
    if limits.max_kv_tokens:
        n = min(n, limits.max_kv_tokens // SEQUENCE_CELLS)
    return max(1, min(n, LLAMA_MAX_SEQ))


def _cell_bytes(llama_cpp, model, metadata: dict, f32: bool) -> int:
    """Bytes of one KV cell: a position's keys and values in every layer (F32, else F16); a head's
    width from the GGUF's key and value lengths where it gives them (Gemma), else n_embd / n_head."""
    arch = metadata.get("general.architecture", "")
    head = llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
    width = int(metadata.get(f"{arch}.attention.key_length", head)) + int(
        metadata.get(f"{arch}.attention.value_length", head)
    )
    return llama_cpp.llama_model_n_layer(model) * llama_cpp.llama_model_n_head_kv(model) * width * (4 if f32 else 2)


def _check_memory(kv_bytes: int, sessions: int, cells: int) -> None:
    """Refuse, before allocating it, a KV cache larger than KV_MEMORY_FRACTION of the memory the
    machine has available (llama.cpp allocates and clears it all at start)."""
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return  # not Linux: not checked
    if kv_bytes > KV_MEMORY_FRACTION * available:
        raise ValueError(
            f"a llama.cpp KV cache of {sessions} sessions x {cells} cells needs {kv_bytes / 2**30:.1f} GiB, more "
            f"than {KV_MEMORY_FRACTION:.0%} of the {available / 2**30:.1f} GiB available: lower --max-sessions "
            f"or --max-kv-tokens (a session's stream is {cells} cells)"
        )


class LlamaCppBackend(Tokenized):
    kind = "llamacpp"  # Describe's `backend`

    def __init__(
        self,
        spec: models.ModelSpec,
        default_file: Callable[[], Path] = models.draft_gguf_path,
        n_ctx: int = SEQUENCE_CELLS,
        sessions: int = sessions_for(None),  # without limits (scripts, tests): the default limits' 16
    ):
        """`spec.model`: a .gguf file, or the default alias, which runs `default_file()` (the
        embedded GGUF requantised to Q8_0 by default, models.draft_gguf_path; the target passes
        models.f32_gguf_path)."""
        try:
            import llama_cpp
            from llama_cpp import _internals, _logger
        except ImportError as err:
            raise RuntimeError("the llamacpp backend needs llama-cpp-python: pip install 'specdec[llamacpp]'") from err
        from transformers import AutoTokenizer

        if spec.model in models.ALIASES:
            self.path = default_file()
            self._tokenizer = lambda: AutoTokenizer.from_pretrained(models.resolve(spec.model))
        elif spec.model.endswith(".gguf") and Path(spec.model).expanduser().is_file():
            self.path = Path(spec.model).expanduser()
            self._tokenizer = functools.partial(models.gguf_tokenizer, self.path)
        else:
            models.check_local(spec.model)  # a .gguf file that is not here: named as such
            raise ValueError(f"the llamacpp backend needs a .gguf file or '{models.DEFAULT_ALIAS}', not {spec.model!r}")
        # The model as the user named it (the alias, or the file as given), as the torch backend names
        # its: what Describe reports and the OpenAI API serves (GET /v1/models); `kind` and `dtype` say how it runs.
        self.name = spec.model
        self.device = torch.device("cpu")
        llama_cpp.llama_backend_init()
        _logger.set_verbose(False)
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = -1 if spec.device.startswith("cuda") else 0
        self._model = _internals.LlamaModel(path_model=str(self.path), params=model_params, verbose=False)
        file_type = _file_type(self._model)
        # "float32" for an F32 file, else llama.cpp's name of the file type ("Q8_0"); desc: "llama 256M Q8_0"
        self.dtype = FILE_TYPES.get(file_type) or self._model.desc().split(" ", 2)[-1]
        params = llama_cpp.llama_context_default_params()
        # A stream of n_ctx cells per session, so a session's logits are its own (module docstring).
        if not 1 <= sessions <= LLAMA_MAX_SEQ:
            raise ValueError(f"a llama.cpp context holds 1 to {LLAMA_MAX_SEQ} sessions, not {sessions}")
        self.max_sessions = sessions  # the engine's and so the orchestrator's bound (SessionEngine)
        if not spec.device.startswith("cuda"):  # on a GPU the cache is the device's (llama.cpp's own error)
            cell = _cell_bytes(llama_cpp, self._model.model, self._model.metadata(), f32=file_type == 0)
            _check_memory(sessions * n_ctx * cell, sessions, n_ctx)
        params.n_ctx = sessions * n_ctx
        params.n_batch = BATCH_TOKENS + sessions  # a step's tokens and its fillers
        params.n_seq_max = sessions
        params.kv_unified = False
        # Sliding-window layers (Gemma 2/3) keep every cell, not the window's: a rollback then leaves
        # the keys the window needs again (llama.cpp's smaller SWA cache drops them as it goes).
        params.swa_full = True
        if file_type == 0:
            # An F32 model computes as the fp32 transformers target does: F32 keys and values, and
            # plain attention (with the CPU flash-attention kernel the logits moved by ~1e-2, measured).
            params.type_k = params.type_v = GGML_TYPE_F32
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            params.n_ubatch = F32_UBATCH_TOKENS
            self.max_fill = F32_MAX_FILL
        else:
            params.n_ubatch = UBATCH_TOKENS
            self.max_fill = MAX_FILL
        # Prompt tokens a prefill step feeds (specdec.runtime.engine): one ubatch. A quantised draft's
        # prefill costs the same in chunks of 32 as of 128 (700 tokens on one core: 5.8 s against
        # 5.5-5.9), and a generation that ends cancels its draft's prefill between two chunks: the
        # chunk under way, which takes the next request's cores, lasts 0.35 s rather than ~1.5 s.
        self.prefill_chunk = int(params.n_ubatch)
        params.n_threads = params.n_threads_batch = (
            placement.threads()
        )  # the service's threads (specdec.runtime.placement)
        self._ctx = _internals.LlamaContext(model=self._model, params=params, verbose=False)
        self._llama = llama_cpp
        self._batch = _internals.LlamaBatch(n_tokens=params.n_batch, embd=0, n_seq_max=1, verbose=False)
        self._slots: dict[int, Slot] = {}  # the sessions' streams by id (the others are free): where a filler goes
        self._n_ctx = n_ctx
        self.filled = 0  # filler tokens decoded so far (the module docstring)
        self.vocab_size = int(self._model.n_vocab())
        self.max_context = min(n_ctx, int(self._model.n_ctx_train()))
        self.eos_token_ids = [int(self._model.token_eos())]

    @functools.cached_property
    def tokenizer(self):
        """The transformers tokenizer (the services' GetTokenizer and digest): loaded when first
        asked for; a GGUF's is converted once and cached (models.gguf_tokenizer)."""
        return self._tokenizer()

    def new_cache(self) -> Slot:
        # the lowest free id: a step's sessions stay consecutive streams
        index = next((i for i in range(self.max_sessions) if i not in self._slots), None)
        if index is None:
            raise ResourceExhausted(f"the llama.cpp context holds {self.max_sessions} sessions at most")
        slot = self._slots[index] = Slot(index)
        return slot

    def set_threads(self, n: int) -> None:
        self._llama.llama_set_n_threads(self._ctx.ctx, n, n)
        torch.set_num_threads(n)  # the sampling transforms on its logits, on the same thread

    def release(self, cache: Slot) -> None:
        self._ctx.kv_cache_seq_rm(cache.index, 0, -1)
        self._slots.pop(cache.index, None)

    def free_caches(self) -> int:
        return self.max_sessions - len(self._slots)

    def copy_prefix(self, src: Slot, dst: Slot, n: int) -> None:
        """Stream dst holds src's first n positions (the module docstring)."""
        ctx = self._ctx.ctx
        size = self._llama.llama_state_seq_get_size(ctx, src.index)
        buffer = np.empty(size, dtype=np.uint8)
        pointer = buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        written = self._llama.llama_state_seq_get_data(ctx, pointer, size, src.index)
        if not written or not self._llama.llama_state_seq_set_data(ctx, pointer, written, dst.index):
            raise RuntimeError(f"llama.cpp could not copy sequence {src.index} to {dst.index}")
        self._ctx.kv_cache_seq_rm(dst.index, n, -1)
        dst.length = n

    def forward(self, cache: Slot, token_ids: list[int], n_logits: int) -> torch.Tensor:
        return self.forward_batch([(cache, token_ids, n_logits)])[0]

    def forward_batch(self, items: list[tuple[Slot, list[int], int]]) -> list[torch.Tensor]:
        """The new tokens of every session in llama_batches of up to BATCH_TOKENS tokens; the
        logits of the last n_logits positions of each ([n_logits, vocab] float32; views, valid
        until the next forward)."""
        order = sorted(range(len(items)), key=lambda i: items[i][0].index)  # increasing streams
        out, group, size = [], [], 0
        for item in (items[i] for i in order):
            if group and size + len(item[1]) > BATCH_TOKENS:
                out += [rows.clone() for rows in self._decode(group)]  # the next decode overwrites them
                group, size = [], 0
            group.append(item)
            size += len(item[1])
        out += self._decode(group)
        logits: list[torch.Tensor] = [torch.empty(0)] * len(items)
        for i, row in zip(order, out, strict=True):
            logits[i] = row
        return logits

    def _decode(self, items) -> list[torch.Tensor]:
        """One llama_decode of the items (in increasing streams), the short gaps between them filled."""
        batch = self._batch.batch
        batch.n_tokens = 0
        for _, tokens, n_logits in items:
            assert len(tokens) <= BATCH_TOKENS, (
                "a prompt is fed in chunks of prefill_chunk tokens (specdec.runtime.engine)"
            )
            assert 1 <= n_logits <= len(tokens), (n_logits, len(tokens))
        fillers = self._fillers([slot.index for slot, _, _ in items])
        entries = [(slot.index, slot.length, tokens, n_logits) for slot, tokens, n_logits in items]
        first = []  # the batch index of each item's first position with logits
        for stream, position, tokens, n_logits in sorted(entries + [(*f, [FILL_TOKEN], 0) for f in fillers]):
            wanted = len(tokens) - n_logits
            for i, token in enumerate(tokens):
                _put(batch, stream, position + i, token, i >= wanted)
            if n_logits:  # an item's (a filler has none)
                first.append(batch.n_tokens - n_logits)
        try:
            code = self._llama.llama_decode(self._ctx.ctx, batch)
        finally:
            for stream, position in fillers:  # each stream as it was (a rollback)
                self._ctx.kv_cache_seq_rm(stream, position, -1)
        if code == 1:  # nothing was placed: the batch can be run again (alone, by the worker)
            raise ResourceExhausted(f"a session's llama.cpp KV stream ({self.max_context} cells) is full; retry later")
        if code != 0:
            raise RuntimeError(f"llama_decode failed with code {code}")
        self.filled += len(fillers)
        for slot, tokens, _ in items:
            slot.length += len(tokens)
        # llama.cpp stores the rows asked for contiguously in batch order: an item's rows follow
        # its first one, so each item is a view of exactly its rows.
        return [
            torch.from_numpy(np.ctypeslib.as_array(self._ctx.get_logits_ith(j), shape=(n, self.vocab_size)))
            for j, (_, _, n) in zip(first, items, strict=True)
        ]

    def _fillers(self, streams: list[int]) -> list[tuple[int, int]]:
        """(stream, position) of a filler for each id missing between the increasing `streams`,
        where a gap is at most max_fill ids, the fillers are no more than the sessions, and the gap's
        streams have a free cell; the others stay gaps."""
        out = []
        for before, after in itertools.pairwise(streams):
            gap = range(before + 1, after)
            if not 0 < len(gap) <= self.max_fill or len(out) + len(gap) > len(streams):
                continue  # too long a gap, or more fillers than sessions: two ubatches cost less
            positions = [self._slots[i].length if i in self._slots else 0 for i in gap]
            if all(position < self._n_ctx for position in positions):
                out += zip(gap, positions, strict=True)
        return out

    def restart(self, cache: Slot, position: int) -> None:
        """Empty the stream; its next token goes at `position` (a draft's window: the positions before
        it hold nothing, and llama.cpp takes an empty sequence's first position as it comes)."""
        self._ctx.kv_cache_seq_rm(cache.index, 0, -1)
        cache.length = position

    def crop(self, cache: Slot, keep: int) -> None:
        if keep < cache.length:
            self._ctx.kv_cache_seq_rm(cache.index, keep, -1)
            cache.length = keep


def _put(batch, stream: int, position: int, token: int, logits: bool) -> None:
    """A token of `stream` at `position` at the end of a llama_batch."""
    j = batch.n_tokens
    batch.token[j], batch.pos[j] = token, position
    batch.seq_id[j][0], batch.n_seq_id[j] = stream, 1
    batch.logits[j] = logits
    batch.n_tokens += 1


def _file_type(model) -> int:
    """The GGUF's general.file_type (a llama_ftype); -1 if it does not say."""
    import llama_cpp

    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_model_meta_val_str(model.model, b"general.file_type", buf, len(buf))
    return int(buf.value) if n > 0 else -1
