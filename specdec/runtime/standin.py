"""Stand-in models: a model service whose forwards cost a fixed time and no core.

A forward on an accelerator costs its host a wait, not a core. A stand-in is that wait and
nothing else: each batched forward takes a fixed time (one for all the sessions in the step,
as a GPU decodes a batch for about the cost of one), its logits from a fixed law that costs
microseconds a session made within that time and the rest of it slept. Many pairs then fit
on a few cores, and what is measured is the serving around the models (the orchestrator, the
services' bookkeeping, gRPC, Ray Serve's proxies and router), as it would be at that scale with
real accelerators.

A stand-in is named by its model string, `standin:MS[:AGREE]`: forwards of MS milliseconds,
a law that agrees with the reference law at a share AGREE of (token, position) contexts
(default 1: the reference law itself). The reference law puts most of the mass on one
token that depends only on the last token and its position (a hash), so generations do not
settle into a cycle and greedy decoding is deterministic; a draft `standin:5:0.8` proposes
the target `standin:40`'s token 80% of the time. Both use one character tokenizer (built
here, a few kilobytes), so any two stand-ins form a pair; no token is EOS, so a generation
runs to max_new_tokens.

Stand-ins verify chains, not draft trees. They implement the backend interface of
specdec.runtime.backend; the services host them unchanged (deploy.hosting).
"""

from __future__ import annotations

import functools
import hashlib
import string
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

PREFIX = "standin:"
CHARS = string.ascii_lowercase + string.digits + " .,:;!?'-\n"
SPECIALS = ["<unk>", "<s>", "</s>"]
PEAK = 8.0  # the chosen token's logit over the others' 0: ~97% of the mass at temperature 1
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class StandinSpec:
    forward_seconds: float
    agreement: float = 1.0

    def __post_init__(self):
        if not 0 <= self.forward_seconds <= 60:
            raise ValueError(f"a stand-in's forward takes 0..60000 ms, not {self.forward_seconds * 1000:g}")
        if not 0 <= self.agreement <= 1:
            raise ValueError(f"a stand-in's agreement is a share in [0, 1], not {self.agreement:g}")

    @classmethod
    def parse(cls, model: str) -> StandinSpec:
        """`standin:MS[:AGREE]` -> its spec; ValueError naming the form on anything else."""
        parts = model[len(PREFIX) :].split(":") if is_standin(model) else []
        try:
            if len(parts) not in (1, 2):
                raise ValueError
            return cls(float(parts[0]) / 1000, float(parts[1]) if len(parts) == 2 else 1.0)
        except ValueError as err:
            detail = f": {err}" if str(err) else ""
            form = "standin:MS[:AGREE] (e.g. standin:40, standin:5:0.8)"
            raise ValueError(f"a stand-in model is {form}, not {model!r}{detail}") from None


def is_standin(model: str) -> bool:
    return model.startswith(PREFIX)


class StandinBackend:
    """A sleeping forward over a fixed law (the module docstring)."""

    kind = "standin"
    trees = False  # chains only
    dtype = "float32"
    device = "standin"  # not "cpu": its steps take no core, so it shares none with another service
    max_context = 32768
    eos_token_ids: list[int] = []

    def __init__(self, model: str):
        self.spec = StandinSpec.parse(model)
        self.name = model
        self.vocab_size = len(SPECIALS) + len(CHARS)
        self._first = len(SPECIALS)  # the law picks only printable tokens

    def new_cache(self) -> list[int]:
        return []  # the tokens fed so far

    def crop(self, cache: list[int], keep: int) -> None:
        del cache[keep:]

    def copy_prefix(self, src: list[int], dst: list[int], n: int) -> None:
        dst[:] = src[:n]  # a shared prefix (specdec.runtime.prefix): its "keys and values" are its tokens

    def forward(self, cache, token_ids, n_logits):
        return self.forward_batch([(cache, token_ids, n_logits)])[0]

    def forward_batch(self, items):
        # One forward_seconds for the whole batch, the law's logits computed within it (as a
        # device's step holds the logits' making): the wait is what is left of it after them.
        start = time.perf_counter()
        peaks = []  # the law's likeliest token at each position whose logits are wanted, all sessions'
        for cache, token_ids, n_logits in items:
            cache.extend(token_ids)
            peaks.extend(self._next(cache[p], p) for p in range(len(cache) - n_logits, len(cache)))
        rows = torch.zeros(len(peaks), self.vocab_size)  # one tensor for the step: microseconds a session
        rows[torch.arange(len(peaks)), torch.tensor(peaks)] = PEAK
        out = list(rows.split([n_logits for *_, n_logits in items]))
        time.sleep(max(0.0, self.spec.forward_seconds - (time.perf_counter() - start)))
        return out

    def _next(self, token: int, position: int) -> int:
        """The law's likeliest token after `token` at `position`."""
        choices = self.vocab_size - self._first
        h = _mix(token * 1_000_003 + position)
        reference = self._first + h % choices
        if _mix(h) % 1_000_000 < self.spec.agreement * 1_000_000:
            return reference
        return self._first + (reference - self._first + 1 + _mix(h + 1) % (choices - 1)) % choices

    def tokenizer_files(self) -> dict[str, bytes]:
        return dict(_tokenizer_files())

    def tokenizer_digest(self) -> str:
        files = _tokenizer_files()
        return hashlib.sha256(b"".join(name.encode() + files[name] for name in sorted(files))).hexdigest()


def _mix(x: int) -> int:
    """A 32-bit integer hash (splitmix's finaliser): cheap, and every bit depends on every input bit."""
    x = (x ^ (x >> 16)) * 0x45D9F3B & 0xFFFFFFFF
    x = (x ^ (x >> 16)) * 0x45D9F3B & 0xFFFFFFFF
    return x ^ (x >> 16)


@functools.cache
def _tokenizer_files() -> dict[str, bytes]:
    """The stand-ins' character tokenizer, as the files transformers saves (GetTokenizer's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
