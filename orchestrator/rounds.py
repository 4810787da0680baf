"""What the loop's rounds are made of: a generation's settings (LoopConfig) and statistics
(LoopStats), what a round committed (Round), the drafts a round verifies (Proposal) and its random
draws (Draws), and the error a stub raises when its service lost a session (SessionLost).
orchestrator.loop runs the rounds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import grpc
import numpy as np

from orchestrator import RULES
from orchestrator import logprobs as token_logprobs
from specdec.decoding.sampling import SamplingParams
from specdec.errors import Unavailable
from specdec.v1 import model_pb2
from specdec.validation import DEFAULT_LOOKAHEAD, TREE_DRAWS


class SessionLost(Unavailable):
    """A side's service lost the session: it went away, or came back with empty caches.

    Raised by stubs that can recover; they also have `reopen(session_id, token_ids, timeout)`,
    which waits for the service and opens the session again holding `token_ids`. `gone`: the
    service did not answer (UNAVAILABLE, or past its budget); else it answered without the
    session (NOT_FOUND: it restarted, or reaped it).
    """

    def __init__(self, stub, message: str, gone: bool = True):
        super().__init__(message)
        self.stub = stub
        self.gone = gone

    # A call failing with one of these means the service, or its copy of the session, is gone. A
    # server that stops cancels the calls it was running: CANCELLED (the orchestrator's own
    # cancellations end its futures, not as errors).
    CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED)

    @classmethod
    def of(cls, stub, where: str, err: BaseException) -> SessionLost | None:
        """`err`, a call of `stub`'s to the service `where` names, as the session's loss; None
        for an error that is not one."""
        if isinstance(err, grpc.RpcError) and err.code() in cls.CODES:
            return cls(stub, f"{where}: {err.details()}", err.code() != grpc.StatusCode.NOT_FOUND)
        return None


@dataclass(frozen=True)
class LoopConfig:
    sampling: SamplingParams
    max_new_tokens: int
    lookahead: int = DEFAULT_LOOKAHEAD  # k, or the largest k when adaptive
    speculate: bool = True
    adaptive: bool = False  # choose k per round (orchestrator.lookahead)
    overlap: bool = False  # the draft proposes round r + 1 while the target verifies round r
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    rule: str = "leviathan"  # one of RULES
    tree_nodes: int = 0  # > 0: each round a draft tree of this many tokens at most, depth <= lookahead
    # Structured output: the grammar both services hold with the session (OpenSessionRequest.constraint)
    constraint: model_pb2.Constraint | None = None
    logprobs: int | None = None  # report each token's log probability, with this many top tokens
    cache: bool = False  # the speculation cache (orchestrator.speculation_cache), where it serves
    # the most tokens a chain its drafter sizes may hold (ProposeRequest.free_lookahead); 0: lookahead
    free_lookahead: int = 0
    measured: bool = False  # lookahead is the pair's measured choice: the rounds keep measuring it (a fixed policy)
    # The draft's store of earlier answers this generation drafts from and enters (OpenSessionRequest.history_scope;
    # "": none): a digest of its client and salt (orchestrator.generation.history_scope)
    history_scope: str = ""
    # Its drafts must be a function of its tokens alone (OpenSessionRequest.reproducible): a seeded
    # Leviathan sample, whose text depends on them (orchestrator.generation.loop_config)
    reproducible: bool = False
    # Tokens its answer is expected to repeat, which the draft's index searches
    # (SpeculationParams.prediction, encoded: OpenSessionRequest.prediction_token_ids); (): none
    prediction: tuple[int, ...] = ()
    # A client reads the answer as it grows (GenerateStream, or stop strings to look for): the first
    # token alone, a target-only Score of at most MAX_PLAIN_STEPS steps; False (a unary Generate
    # without stop strings): MAX_UNARY_STEPS, the first round's too (orchestrator.plain_rounds.PlainRounds._plain_steps)
    streamed: bool = True

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}: choose one of {', '.join(RULES)}")

    @property
    def coupled(self) -> bool:
        """Drafts are accepted iff equal to the target's token (greedy, or the invariant rule)."""
        return self.sampling.greedy or self.rule == "invariant"

    @property
    def noise_seed(self) -> int | None:
        """The seed the services key the invariant rule's noise by; None: they draw nothing."""
        return None if self.sampling.greedy or self.rule != "invariant" else self.seed


@dataclass
class LoopStats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    committed_tokens: int = 0  # what the rounds committed, before stop handling
    draft_seconds: float = 0.0  # waiting on the draft service
    target_seconds: float = 0.0  # waiting on the target service
    drafted_tokens: int = 0  # tokens the draft service proposed, continuations thrown away included
    proposals: int = 0  # proposals with tokens, continuations thrown away included
    index_proposals: int = 0  # ... of them those that ran no forward (an index's)
    draft_compute_seconds: float = 0.0  # of which the draft service reported computing
    target_compute_seconds: float = 0.0  # of which the target service reported computing
    draft_forward_seconds: float = 0.0  # of the draft's compute, its forwards'
    target_forward_seconds: float = 0.0  # of the target's compute, its forwards'
    draft_core_seconds: float = 0.0  # the draft's forward seconds times the threads they ran with
    target_core_seconds: float = 0.0  # the target's
    round_seconds: float = 0.0  # in rounds, prefill excluded
    wire_bytes: int = 0  # serialized round messages, both directions
    recoveries: int = 0  # sessions re-opened after a service lost them
    cache_branches: int = 0  # proposals the speculation cache prepared for rejections
    cache_hits: int = 0  # ... and those a round used
    rounds_without_draft: int = 0  # rounds that wanted drafts and went without them: the draft was lost
    overlapped_rounds: int = 0  # rounds whose drafts the draft proposed while the target verified
    draft_mask_seconds: float = 0.0  # structured output: the draft's grammar masks
    target_mask_seconds: float = 0.0  # the target's

    def add_proposal(self, proposal: model_pb2.ProposeResponse) -> None:
        """What a Propose reports: its tokens, its compute, its forwards and their threads."""
        self.drafted_tokens += len(proposal.token_ids)
        if proposal.token_ids:
            self.proposals += 1
            self.index_proposals += proposal.steps == 0
        self.draft_compute_seconds += proposal.compute_seconds
        self.draft_forward_seconds += proposal.forward_seconds
        self.draft_core_seconds += proposal.forward_seconds * proposal.threads
        self.draft_mask_seconds += proposal.mask_seconds

    def add_scores(self, scores: model_pb2.ScoreResponse) -> None:
        """What a Score reports: its compute, its forward and its threads."""
        self.target_compute_seconds += scores.compute_seconds
        self.target_forward_seconds += scores.forward_seconds
        self.target_core_seconds += scores.forward_seconds * scores.threads
        self.target_mask_seconds += scores.mask_seconds


@dataclass
class Round:
    """What one round committed (after stop handling) and how."""

    token_ids: list[int]
    proposed: int
    accepted: int
    finish_reason: str = ""  # "", "length" or "stop"
    # Tokens the rule committed, before stop handling: the accepted drafts and the recovered or
    # bonus token (none when a continuation's first token took the bonus position).
    committed: int = 0
    without_draft: bool = False  # it would have drafted, but the draft was lost (LoopStats.rounds_without_draft)
    # LoopConfig.logprobs set: each token's (orchestrator.logprobs.Entry)
    logprobs: list[token_logprobs.Entry] = field(default_factory=list)


@dataclass
class Proposal:
    """Draft tokens for a round (or its continuation), as the draft service proposed them."""

    tokens: list[int]
    probs: list[float]  # sampling: draft_probs of each token
    uniforms: list[float]  # sampling: the uniforms that drew them
    lost: bool = False  # a continuation whose rows a restarted draft service lost: proposed again
    report: model_pb2.ProposeResponse | None = None  # the service's reply (its costs), when proposed now
    # The speculation cache: each token's (draft's runner-up there, its probability, the runner-up's)
    alts: list[tuple[int, float, float]] = field(default_factory=list)

    @classmethod
    def of(cls, response: model_pb2.ProposeResponse, uniforms: list[float]) -> Proposal:
        alts = list(zip(response.runner_up_ids, response.top_probs, response.runner_up_probs, strict=True))
        return cls(list(response.token_ids), list(response.token_probs), list(uniforms), report=response, alts=alts)

    def after(self, n: int) -> Proposal:
        """Its tokens past the first n (a continuation's, once its first is committed)."""
        return Proposal(self.tokens[n:], self.probs[n:], self.uniforms[n:], alts=self.alts[n:])


@dataclass(frozen=True)
class Draws:
    """One round's uniforms, a fixed number whatever happens, so a seed replays a generation:
    the drafts, their acceptance tests (one more for a continuation's first token), the
    continuation's drafts, and the recovered or bonus token."""

    draft: list[float]
    accept: list[float]
    continuation: list[float]
    final: float
    steps: tuple[float, ...] = ()  # several plain steps a Score, the Leviathan rule: each step's token's

    def stepped(self, rng: np.random.Generator, lookahead: int, overlap: bool, steps: int) -> Draws:
        """These draws with the uniforms of `steps` plain steps in one Score: this round's last
        token's, then each later step's, drawn as that many plain rounds would draw them."""
        later = [self.draw(rng, lookahead, overlap=overlap).final for _ in range(steps - 1)]
        return dataclasses.replace(self, steps=(self.final, *later))

    @classmethod
    def none(cls) -> Draws:
        """A coupled rule's (greedy, the invariant rule): it draws nothing."""
        return cls([], [], [], 0.0)

    @classmethod
    def draw(cls, rng: np.random.Generator, lookahead: int, overlap: bool) -> Draws:
        if not overlap:  # the sequential rounds' draws, as they always were
            u = rng.random(2 * lookahead + 1).tolist()
            return cls(u[:lookahead], u[lookahead : 2 * lookahead], [], u[-1])
        u = rng.random(3 * lookahead + 3).tolist()
        n = lookahead + 1
        return cls(u[:lookahead], u[lookahead : lookahead + n], u[lookahead + n : lookahead + 2 * n], u[-1])

    @classmethod
    def draw_tree(cls, rng: np.random.Generator, lookahead: int, nodes: int) -> Draws:
        """A tree round's: its children's draws (TREE_DRAWS a depth: TREE_BRANCHES for each expanded node),
        a test a node, the last token."""
        drawn = lookahead * TREE_DRAWS
        u = rng.random(drawn + nodes + 1).tolist()
        return cls(u[:drawn], u[drawn:-1], [], u[-1])
