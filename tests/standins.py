"""In-process stand-ins for models, with fixed distributions: token t is followed by a
distribution that depends only on t (a Markov chain), so the exact output law is known.

They implement the backend interface of specdec.runtime.backend and are hosted by the real
SessionEngine and servicers; only the neural network is replaced.
"""

from __future__ import annotations

import threading

import numpy as np
import torch


class MarkovBackend:
    """logits of the next token = log(probs[last token])."""

    def __init__(self, probs: np.ndarray, name: str = "markov"):
        self.probs = np.asarray(probs, dtype=np.float64)
        self.logits = torch.log(torch.tensor(self.probs, dtype=torch.float32))
        self.name = name
        self.vocab_size = self.probs.shape[0]
        self.max_context = 1_000_000
        self.eos_token_ids: list[int] = []
        self.dtype, self.device = "float32", torch.device("cpu")

    def new_cache(self):
        return []  # the tokens fed so far

    def forward(self, cache, token_ids, n_logits):
        cache.extend(token_ids)
        return self.logits[torch.tensor(token_ids[-n_logits:])]

    def crop(self, cache, keep):
        del cache[keep:]

    def copy_prefix(self, src, dst, n):  # the prefix cache (specdec.runtime.prefix)
        dst[:] = src[:n]

    # A draft tree: a node's logits are its token's row, whatever its ancestors.
    trees = True

    def compact(self, cache, keep, sources):
        cache[keep:] = [cache[i] for i in sources]

    def tokenizer_files(self):
        return {}

    def tokenizer_digest(self):
        return f"markov-{self.vocab_size}"


class Direct:
    """Call a servicer in-process with the stubs' calling convention (no network)."""

    def __init__(self, servicer):
        self.servicer = servicer

    def __getattr__(self, name):
        method = getattr(self.servicer, name)
        return lambda request, timeout=None: method(request, Waiting())


class Waiting:
    """The servicer context of an in-process call: its caller always waits for the answer."""

    def is_active(self) -> bool:
        return True

    def add_callback(self, callback) -> bool:
        return True  # registered; never called: the call does not end before its answer


def random_markov(vocab: int, seed: int, alpha: float = 0.5) -> np.ndarray:
    """[vocab, vocab] rows drawn from Dirichlet(alpha): uneven, so rule errors show."""
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.full(vocab, alpha), size=vocab)


class SupportMarkovBackend(MarkovBackend):
    """A Markov law on a few `support` tokens of a large vocabulary, rows built on the fly.

    From support[i] the next token is support[j] with probability kernel[i][j]; from any
    other token it is support[0]. Every other token has probability zero.
    """

    def __init__(self, vocab_size: int, support: list[int], kernel: np.ndarray):
        self.support = torch.tensor(support)
        self.index = {t: i for i, t in enumerate(support)}
        self.kernel_logits = torch.log(torch.tensor(kernel, dtype=torch.float32))
        self.name = "support-markov"
        self.vocab_size = vocab_size
        self.max_context = 1_000_000
        self.eos_token_ids: list[int] = []
        self.dtype, self.device = "float32", torch.device("cpu")

    def forward(self, cache, token_ids, n_logits):
        cache.extend(token_ids)
        rows = torch.full((n_logits, self.vocab_size), float("-inf"))
        for r, t in enumerate(token_ids[-n_logits:]):
            if t in self.index:
                rows[r, self.support] = self.kernel_logits[self.index[t]]
            else:
                rows[r, self.support[0]] = 0.0
        return rows


class ChainsOnly:
    """A backend as one without tree attention sees it (as llama.cpp's): the target scores a
    draft tree chain by chain (target_service.scorer.tree_rows), the draft drafts a spine."""

    trees = False

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name):
        return getattr(self._backend, name)


def markov_pair(target_probs, draft_probs, method) -> tuple[Direct, Direct]:
    """A draft and a target service in process over Markov chains (`method`: the draft's drafter,
    draft_service.drafters), called as a step link calls them."""
    from draft_service.server import DraftServicer
    from specdec.runtime.engine import SessionEngine
    from target_service.server import TargetServicer

    target = TargetServicer(SessionEngine(MarkovBackend(target_probs), "target"))
    draft = DraftServicer(SessionEngine(MarkovBackend(draft_probs), "draft"), method)
    return Direct(draft), Direct(target)


def draft_opens_first(draft, target):
    """(draft, target) stubs whose target's Score waits for the draft's session to open: a greedy
    round does not wait for it (orchestrator.sessions), and on a loaded machine the open (on the
    continuation pool) once came after the last round: no drafts at all."""
    opened = threading.Event()

    class Draft:
        def OpenSession(self, request, timeout=None):
            response = draft.OpenSession(request, timeout=timeout)
            opened.set()
            return response

        def __getattr__(self, name):
            return getattr(draft, name)

    class Target:
        def Score(self, request, timeout=None):
            assert opened.wait(30)
            return target.Score(request, timeout=timeout)

        def __getattr__(self, name):
            return getattr(target, name)

    return Draft(), Target()
