"""Structured output: a request's constraint as a grammar matcher over a model's vocabulary, and
the masks it puts on the model's rows.

The law of constrained output: at each position, the model's row masked to the tokens the grammar
allows there (the others' logits -inf), then the sampling transform (temperature, top-k, top-p,
specdec.decoding.sampling); greedy is the masked argmax. The draft masks its rows the same way, so the rule
(specdec.decoding.rule, unchanged) compares masked rows, and a token the grammar forbids has no mass in the
target's row: the rule never outputs one.

Owns: the Constraint message -> an llguidance grammar (refused with InvalidArgument naming the
field), a vocabulary's token table (built once per tokenizer: ~0.5 s for SmolLM2's 49152 tokens),
a session's Matcher kept at its committed tokens (commit, rollback) with a speculative stack on
top (a draft's tokens while it proposes), the masks of the k + 1 positions after a block of draft
tokens in one pass, and applying a mask to logits, never in place (llama.cpp's logits are views
of its buffers). Not: the rule, the sampling transform, the session's cache (specdec.runtime.engine holds
the Matcher with the session and keeps it at the committed tokens).

Where the masks are computed: beside each model, on its service. The draft must (each drafted
token changes the next mask, and its tokens exist only there); the target computes its k + 1
masks from the drafts it is sent, so no vocabulary-sized mask crosses the wire (on the
orchestrator they would be k + 1 bitmasks of vocab / 8 bytes a round, 55 KB at k = 8 for
SmolLM2, and a third matcher). Measured (SmolLM2's vocabulary, a JSON schema, a loaded 2-core
VM): computing a mask ~0.04 ms, the k + 1 of a verify at k = 8 ~0.4 ms, applying them 3.7 ms,
against a forward of tens of milliseconds; the services report theirs (mask_seconds).
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import torch

from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.v1 import model_pb2

# JSON without free whitespace between tokens: a model cannot spend its tokens on blanks, and the
# output is what OpenAI's strict mode gives. A schema's own "x-guidance" options override it.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = {"type": "object"}


def llguidance():
    """The grammar engine (imported on first use: the orchestrator's CLI client never needs it)."""
    import llguidance as llg

    return llg


# -- the constraint -> a grammar --------------------------------------------------------------
def grammar_of(constraint: model_pb2.Constraint, field: str = "constraint") -> str:
    """The llguidance grammar of a Constraint; InvalidArgument naming `field`.<kind> when it is
    invalid (bad JSON, a schema or regex or grammar llguidance refuses, an empty choice)."""
    llg = llguidance()
    kind = constraint.WhichOneof("kind")
    name = f"{field}.{kind}"
    try:
        if kind == "json_schema":
            try:
                schema = json.loads(constraint.json_schema)
            except ValueError as err:
                raise InvalidArgument(f"{name}: not JSON: {err}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidArgument(f"{name}: a JSON schema is an object")
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            if not constraint.json_object:
                raise InvalidArgument(f"{name} must be true when set")
            grammar = llg.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(constraint.regex)
        elif kind == "choice":
            choices = list(constraint.choice.choices)
            if not choices or "" in choices:
                raise InvalidArgument(f"{name}: needs at least one choice, none of them empty")
            grammar = llg.grammar_from("choice", choices)
        elif kind == "grammar":
            grammar = llg.grammar_from("grammar", constraint.grammar)
        else:
            raise InvalidArgument(f"{field}: one of json_schema, json_object, regex, choice or grammar must be set")
    except ValueError as err:  # llguidance's refusal of the text before compiling it
        raise InvalidArgument(f"{name}: {err}") from None
    except RecursionError:  # json's C decoder (or encoder) past the interpreter's recursion limit
        raise InvalidArgument(f"{name}: JSON nested too deeply") from None
    error = llg.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise InvalidArgument(f"{name}: {_first_line(error)}")
    return grammar


def _first_line(message: str) -> str:
    """llguidance's message in one line: its first, and the `error:` line that says what is wrong
    where one follows (a regex's: "... regex parse error:" then the pattern, a caret, "error: unclosed
    group"; the first line alone ended at "regex parse error:")."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return message
    reason = next((line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {reason}" if reason else lines[0]


# -- a vocabulary's token table ----------------------------------------------------------------
_TABLES: dict[int, tuple[object, TokenTable]] = {}
_TABLES_LOCK = threading.Lock()


class TokenTable:
    """llguidance's view of one vocabulary: each token's bytes, the EOS tokens, the row width."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        llg = llguidance()
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.eos = sorted(set(eos_token_ids)) or [tokenizer.eos_token_id]
        try:  # byte-level BPE and sentencepiece tokenizers: llguidance reads tokenizer.json
            from llguidance.hf import from_tokenizer

            self.tokenizer = from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=self.eos)
        except ValueError:  # any other decoder: each token's bytes as it decodes alone
            wrapper = llg.TokenizerWrapper(_DecodedTokens(tokenizer, self.eos[0]))
            self.tokenizer = llg.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=self.eos)
        self.words = (self.vocab_size + 31) // 32  # int32 words of a bitmask

    @classmethod
    def of(cls, backend) -> TokenTable:
        """The backend's table, built on first use and kept (one per tokenizer object)."""
        tokenizer = getattr(backend, "tokenizer", None)
        if tokenizer is None:
            model = getattr(backend, "name", type(backend).__name__)
            raise FailedPrecondition(f"constraint: the model {model!r} has no tokenizer to build the grammar's masks")
        with _TABLES_LOCK:
            held = _TABLES.get(id(tokenizer))
            if held is None or held[0] is not tokenizer:
                held = (tokenizer, cls(tokenizer, backend.vocab_size, list(backend.eos_token_ids)))
                _TABLES[id(tokenizer)] = held
        return held[1]


class _DecodedTokens:
    """What llguidance.TokenizerWrapper reads: each token's bytes (a special token's prefixed with
    0xff, as llguidance marks them), EOS and BOS, and an encoder."""

    def __init__(self, tokenizer, eos: int):
        specials = set(tokenizer.all_special_ids)
        self.eos_token_id, self.bos_token_id = eos, tokenizer.bos_token_id
        self.special_token_ids = sorted(specials)
        self.tokens = [
            b"\xff" + tokenizer.convert_ids_to_tokens(i).encode() if i in specials else tokenizer.decode([i]).encode()
            for i in range(len(tokenizer))
        ]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


# -- a session's matcher -------------------------------------------------------------------------
class Matcher:
    """The grammar's state after a session's committed tokens past the prompt, with a stack of
    speculative tokens on top (push / pop: a draft's proposal, a tree's path). Used on the
    service's model worker only."""

    def __init__(self, table: TokenTable, grammar: str, prompt_length: int):
        llg = llguidance()
        self.table = table
        self.prompt_length = prompt_length
        self._matcher = llg.LLMatcher(table.tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidArgument(f"constraint: {_first_line(self._matcher.get_error())}")
        self.committed = 0  # constrained tokens committed
        self.pushed = 0  # speculative tokens on top of them
        self.seconds = 0.0  # spent on masks (computing and applying them), for mask_seconds

    @classmethod
    def open(cls, backend, constraint: model_pb2.Constraint, tokens: list[int], prompt_length: int) -> Matcher:
        """A session's matcher: the constraint compiled for the backend's vocabulary, advanced
        over the tokens after the prompt (a session re-opened mid-generation)."""
        matcher = cls(TokenTable.of(backend), grammar_of(constraint), prompt_length)
        matcher.commit(tokens[prompt_length:], "prompt_token_ids")
        return matcher

    def commit(self, tokens: list[int], field: str) -> None:
        """Commit tokens (no speculative ones on top); refused before any change when the grammar
        forbids one of them."""
        assert self.pushed == 0, self.pushed
        if not tokens:
            return
        valid = self._matcher.validate_tokens(list(tokens))
        if valid < len(tokens):
            raise InvalidArgument(f"{field}: token {tokens[valid]} is not allowed by the constraint there")
        self._matcher.consume_tokens(list(tokens))
        self.committed += len(tokens)

    def rollback(self, length: int) -> None:
        """Back to a session's committed `length` (its prompt included)."""
        assert self.pushed == 0, self.pushed
        drop = self.committed - max(0, length - self.prompt_length)
        if drop > 0:
            self._matcher.rollback(drop)
            self.committed -= drop

    def push(self, tokens: list[int]) -> int:
        """Advance over speculative tokens while the grammar allows them: how many it took."""
        n = self._matcher.try_consume_tokens(list(tokens)) if tokens else 0
        self.pushed += n
        return n

    def pop(self, n: int | None = None) -> None:
        """Drop the last n speculative tokens (all of them: None)."""
        n = self.pushed if n is None else n
        if n:
            self._matcher.rollback(n)
            self.pushed -= n

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar allows from here (nothing changes)."""
        return self._matcher.validate_tokens(list(tokens)) if tokens else 0

    def stopped(self) -> bool:
        """The grammar has ended: only EOS may follow."""
        return self._matcher.is_stopped()

    def masks(self, tokens: list[int] = ()) -> np.ndarray:
        """Bitmasks [len(tokens) + 1, words] (int32) of the positions from here and after each of
        `tokens`, in one pass. Rows after a token the grammar forbids allow every token: the rule
        never reaches them (that token has no mass in the row before)."""
        t0 = time.perf_counter()
        bitmask = np.full((len(tokens) + 1, self.table.words), -1, dtype=np.int32)
        pointer, size = bitmask.ctypes.data, self.table.words * 4
        if tokens:
            rows = [(self._matcher, 0, list(tokens))]
            _executor().unsafe_compute_mask_ptr_with_draft_token(rows, pointer, size, bitmask.shape[0])
        else:
            self._matcher.unsafe_compute_mask_ptr(pointer, size)
        self.seconds += time.perf_counter() - t0
        return bitmask

    def mask_after(self, tokens: list[int]) -> np.ndarray:
        """The bitmask [1, words] of the position after speculative `tokens` (a tree's path)."""
        taken = self.push(tokens)
        try:
            if taken < len(tokens):  # a path through a forbidden token: never reached
                return np.full((1, self.table.words), -1, dtype=np.int32)
            return self.masks()
        finally:
            self.pop(taken)

    def tree_masks(self, tokens: list[int], parents: list[int]) -> np.ndarray:
        """Bitmasks [n + 1, words] of a draft tree's rows: the root's, then after each node (its
        path from the root; parents[i] an earlier index or -1)."""
        rows = [self.masks()]
        for node in range(len(tokens)):
            path, at = [], node
            while at >= 0:
                path.append(tokens[at])
                at = parents[at]
            rows.append(self.mask_after(path[::-1]))
        return np.concatenate(rows)

    def apply(self, logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
        """logits [n, vocab] with the tokens the masks [n, words] forbid at -inf, as a new float32
        tensor (float32 holds every bfloat16 and float16 value: the argmax and the transforms are
        unchanged). A row whose mask allows nothing (a grammar the vocabulary cannot continue)
        allows the EOS tokens: the generation ends there. On a CPU in numpy, one thread: torch's
        element-wise ops over a [9, 49152] block ran 10-30x slower on shared, loaded cores."""
        t0 = time.perf_counter()
        allowed = allowed_tokens(bitmask, logits.shape[-1])
        empty = ~allowed.any(axis=1)
        if empty.any():
            allowed[np.ix_(empty.nonzero()[0], self.table.eos)] = True
        if logits.device.type == "cpu":
            out = torch.from_numpy(np.where(allowed, logits.float().numpy(), np.float32(-np.inf)))
        else:
            out = logits.float().masked_fill(~torch.from_numpy(allowed).to(logits.device), float("-inf"))
        self.seconds += time.perf_counter() - t0
        return out


_EXECUTOR = []


def _executor():
    """One llguidance executor (a thread of its own) for the process's matchers: a pass of k + 1
    masks is one call to it, from the model worker."""
    with _TABLES_LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(llguidance().LLExecutor(1))
    return _EXECUTOR[0]


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bitmasks [n, words] (int32, token t is bit t % 32 of word t // 32) -> [n, vocab_size] bool
    (rows wider than the table: the tokens past it forbidden)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return bits.view(bool)


def apply(matcher: Matcher | None, logits: torch.Tensor, bitmask: np.ndarray | None) -> torch.Tensor:
    """logits masked by `bitmask` (matcher.apply), or as they are without a constraint."""
    return logits if matcher is None or bitmask is None else matcher.apply(logits, bitmask)
