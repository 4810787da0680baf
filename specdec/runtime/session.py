"""What a model service's engine (specdec.runtime.engine) keeps of a session, and what its worker runs:
a session's tokens and cache (`Session`), a validated request on one session (`SessionCall`), and one
session's part of a batched step (`Forward`). Plain data; the engine changes them on its model worker."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.runtime.kvcache import Tree


@dataclass
class Session:
    tokens: list[int]
    cache: Any
    cached: list[int] = field(default_factory=list)
    # A draft's window (SessionEngine.catch_up): the cache's keys and values start at this position;
    # `cached` before it names tokens no forward fed (0: the cache holds every position it names).
    window_start: int = 0
    # Draft only: the distributions of the last proposal (and of the proposal it continued),
    # [n, vocab], for ProposalRow; row 0 is at absolute position proposal_start.
    proposal_rows: torch.Tensor | None = None
    proposal_start: int = 0
    proposal_tokens: list[int] = field(default_factory=list)  # the token each row drew
    kv_tokens: int = 0  # reserved in the engine's KV budget
    kv_floor: int = 0  # held in the budget until it closes (OpenSessionRequest.reserve_tokens)
    threads: int | None = None  # the threads the request running on it allows (None: the service's)
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False
    claimed: bool = False  # a request has used it since OpenSession
    # when its caller was found gone (SessionEngine.disown): a call begun before that claims it no more
    disowned: float = float("-inf")
    # The cache's positions from tree.floor on hold a draft tree (a target's verify), `cached`
    # its nodes flattened; the next commit keeps the accepted path (kvcache.Tree, compact).
    tree: Tree | None = None
    # Structured output: the grammar's matcher (specdec.decoding.grammar.Matcher), kept at the committed tokens.
    constraint: Any = None
    # The rows its logits have: the vocabulary the pair shares (OpenSessionRequest.vocab_size); 0: all.
    vocab_size: int = 0
    # How many of `tokens` are the prompt (specdec.decoding.penalties counts the generated ones past it).
    prompt_length: int = 0
    # Draft only: the store of earlier sessions it drafts from and enters (OpenSessionRequest.history_scope).
    history_scope: str = ""
    # Draft only: its drafts are a function of its tokens alone (OpenSessionRequest.reproducible).
    reproducible: bool = False
    # Draft only: tokens its answer is expected to repeat, which an index drafter searches
    # (OpenSessionRequest.prediction_token_ids).
    prediction: tuple[int, ...] = ()


@dataclass(frozen=True)
class SessionCall:
    """A request on one session, validated and ready for the worker (SessionEngine.call's arguments):
    `run(session)`, a function or a generator function of Forwards, once the session's committed
    length is found to be `expected_length` (None: not checked); its forwards use at most `threads`;
    `final`: the call ends the session, closed once `run` returns (ScoreRequest.close_session)."""

    session_id: str
    expected_length: int | None
    run: Callable
    threads: int | None = None
    final: bool = False


@dataclass(slots=True)
class Forward:
    """One session's part of a worker step: feed `tokens`, return the logits of the last
    n_logits of them ([n_logits, vocab]); afterwards the cache holds `cached`."""

    session: Session
    tokens: list[int]
    n_logits: int
    cached: list[int]
    prefill: bool = False  # a prompt's chunk: counts against a step's prefill budget
    threads: int | None = None  # the most threads it may run with (None: the service's)
    steps: int = 0  # once run: the batched forwards it ran in (a chain's: one a token)
    step_tokens: int = 0  # ... their tokens, all sessions', summed
    step_sessions: int = 0  # ... the most sessions one of them ran
    step_threads: int = 0  # ... the threads the last ran with
    waited: float = 0.0  # ... the seconds they waited for the machine's core lock
    seconds: float = 0.0  # ... and the seconds of the batched forwards (on a GPU: their launch)
    tree: Tree | None = None  # the block extends a draft tree (forward_tree)
    # greedy: the request reads each row's argmax (`argmax`, once run), which the step finds for all
    # its greedy forwards at once (step_argmax): on a GPU one device sync a step, not one a session
    greedy: bool = False
    argmax: list[int] | None = None
    # A greedy chain of `chain` one-token steps (a draft's proposal, a target's decode steps): each
    # after the first feeds the last one's argmax, on the worker, the request not woken between
    # them; it ends after a token in `stop`. `argmax` holds the chain's tokens, the logits the
    # request gets are its last step's. Between its steps the session's cache holds `cached`.
    chain: int = 1
    stop: frozenset[int] = frozenset()
