"""A model-free drafter: n-gram lookup over the session's own tokens (prompt lookup decoding).

The last n committed tokens (n from max_n down to min_n) are searched for earlier in the
sequence; the tokens that followed their most recent earlier occurrence are proposed. No
model, no distributions: proposals are deterministic, so the rule sees a draft probability
of 1 for each (a point mass), which keeps its output exact. With no match it proposes
nothing and the round is plain target decoding. Under a constraint (structured output) it
proposes only the tokens the session's grammar allows, up to the first it forbids.
"""

from __future__ import annotations

import numpy as np
import torch

from draft_service.proposer import TreeProposal
from specdec.decoding.sampling import SamplingParams
from specdec.runtime.engine import SessionEngine
from specdec.runtime.session import Session

MAX_NGRAM = 3
MIN_NGRAM = 1


def lookup(tokens: list[int], k: int, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix."""
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # excludes the suffix itself
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist()
    return []


def propose(
    engine: SessionEngine,
    session: Session,
    k: int,
    params: SamplingParams,
    uniforms: list[float],
    assumed: list[int] = (),
    noise_seed: int | None = None,
    alternatives: list | None = None,
) -> tuple[list[int], list[float]]:
    """At most k tokens after the committed ones and `assumed`; draft probs of 1 (sampling
    mode), one-hot rows for ProposalRow (the assumed tokens' too: they are point masses).
    Under the invariant rule (`noise_seed`) a proposal is only token ids: the target accepts
    those equal to its own sample, whatever proposed them."""
    assumed = list(assumed)
    drafts = allowed(session, assumed, lookup(session.tokens + assumed, k))
    return point_masses(engine, session, params, noise_seed, assumed, drafts)


def point_masses(
    engine: SessionEngine, session: Session, params: SamplingParams, noise_seed, assumed: list[int], drafts: list[int]
) -> tuple[list[int], list[float]]:
    """A model-free proposal of `drafts` after `assumed`, each a point mass (draft prob 1). In
    Leviathan sampling mode, rows kept for ProposalRow from the first assumed token on: one-hot,
    but where the session holds the rows of the proposal that drew `assumed` (a hybrid's model
    round this one continues), those. A continuation that finds nothing still holds the rows of
    `assumed`, which a rejection among them reads."""
    if params.greedy or noise_seed is not None:
        session.proposal_rows = None
        return drafts, []
    assumed, start, kept = list(assumed), len(session.tokens), session.proposal_rows
    rows = one_hot(assumed + drafts, session.vocab_size or engine.backend.vocab_size)
    first = start - session.proposal_start
    if assumed and kept is not None and first >= 0 and session.proposal_tokens[first : first + len(assumed)] == assumed:
        rows[: len(assumed)] = kept[first : first + len(assumed)]
    session.proposal_rows, session.proposal_start, session.proposal_tokens = rows, start, assumed + drafts
    return drafts, [1.0] * len(drafts)


def one_hot(tokens: list[int], vocab: int) -> torch.Tensor:
    rows = torch.zeros(len(tokens), vocab)
    rows[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return rows


def allowed(session: Session, assumed: list[int], drafts: list[int]) -> list[int]:
    """Structured output: the drafts the session's grammar allows after `assumed`, up to the first
    it forbids (the target would reject it for sure: its row gives it no mass)."""
    grammar = session.constraint
    if grammar is None or not drafts:
        return drafts
    taken = grammar.push(assumed)
    try:
        return drafts[: grammar.valid_prefix(drafts)] if taken == len(assumed) else []
    finally:
        grammar.pop()


class TokenizerBackend:
    """The backend of a model-free drafter: a tokenizer and a vocabulary size, no weights.

    The engine's prefill and cache calls are no-ops; the drafter reads session tokens only.
    """

    def __init__(self, spec):
        from transformers import AutoConfig, AutoTokenizer

        from specdec.weights import models

        path = models.resolve(spec.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        self.name = f"ngram({spec.model})"
        self.dtype, self.device = "none", torch.device("cpu")
        self.vocab_size = int(config.vocab_size)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
        self.eos_token_ids = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]

    def new_cache(self):
        return None

    def forward(self, cache, token_ids, n_logits):
        return torch.empty(0)

    def crop(self, cache, keep):
        pass

    def tokenizer_files(self):
        from specdec.runtime.backend import tokenizer_files

        return tokenizer_files(self.tokenizer)

    def tokenizer_digest(self):
        from specdec.runtime.backend import vocab_digest

        return vocab_digest(self.tokenizer)


def propose_tree(
    engine: SessionEngine, session: Session, depth: int, nodes: int, params, uniforms, noise_seed=None, _=()
):
    """n-gram lookup cannot branch: its tree is the chain it finds (at most min(depth, nodes)
    tokens), each a point mass, its rows one-hot (sampling)."""
    drafts = allowed(session, [], lookup(session.tokens, min(depth, nodes)))
    proposal = TreeProposal(drafts, list(range(-1, len(drafts) - 1)), [1.0] * len(drafts))
    if drafts and not params.greedy and noise_seed is None:
        rows = torch.zeros(len(drafts), session.vocab_size or engine.backend.vocab_size)
        rows[torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0
        proposal.rows = dict(zip(range(-1, len(drafts) - 1), rows, strict=True))
    return proposal
