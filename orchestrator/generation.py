"""A request around the loop: its settings (defaults, lookahead, rule, trees), its text as it is
generated (stop strings, spans, log probabilities) and its stats. The prompt's token ids and the
text's decoding are orchestrator.prompts'.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from orchestrator.availability import Availability
from orchestrator.lookahead import measured_lookahead
from orchestrator.loop import RUNNING, LoopConfig, SpeculativeLoop
from orchestrator.pair_costs import PairCosts
from orchestrator.prompts import decode, encode, prompt_ids
from orchestrator.speculation_cache import CacheRates
from orchestrator.trees import PairTrees
from specdec import validation
from specdec.decoding import grammar
from specdec.decoding.sampling import SamplingParams
from specdec.errors import Cancelled, FailedPrecondition, InvalidArgument, OutOfRange
from specdec.v1 import orchestrator_pb2

DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class ModelPair:
    """What the orchestrator knows of the two services after checking them at startup."""

    draft: object  # DraftService stub
    target: object  # TargetService stub
    tokenizer: object
    max_context: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    model_name: str = ""  # the target's, as it describes itself (what GET /v1/models lists)
    # What adaptive lookahead has measured of this pair, shared by the generations on it.
    costs: PairCosts = field(default_factory=PairCosts, compare=False)
    tree_verify: bool = False  # the target verifies draft trees (ModelInfo.tree_verify)
    # The two services run on one accelerator (ModelInfo.device_id, at connect): overlapped rounds'
    # kernels would time-slice it, so requests that leave overlap unset run sequential rounds.
    shared_device: bool = False
    # What the generations on the pair learn of its draft trees (orchestrator.trees).
    trees: PairTrees = field(default_factory=PairTrees, compare=False)
    # The draft's and the target's availability (orchestrator.availability): a lost draft leaves
    # the pair serving target-only, a lost target fails new requests at once.
    health: tuple[Availability, Availability] = field(
        default_factory=lambda: (Availability("draft"), Availability("target")), compare=False
    )
    draft_timeout: float | None = None  # seconds a draft call may take (RecoveryConfig.draft_timeout)
    # the draft proposes some chains from an index, without a forward (ModelInfo.index_drafts, at connect)
    index_drafts: bool = False
    # Sessions the target holds open at once (ModelInfo.max_sessions, at connect; 0: it does not say):
    # the orchestrator admits no more generations (lifecycle.Admission), the rest queue.
    max_sessions: int = 0
    # What the generations on the pair measure for the speculation cache (orchestrator.speculation_cache).
    cache_rates: CacheRates = field(default_factory=CacheRates, compare=False)

    def close(self) -> None:
        """Stop probing lost services (the orchestrator stops)."""
        for health in self.health:
            health.close()


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    stats: orchestrator_pb2.GenerateStats | None = None
    spans: list[tuple[int, bool]] = field(default_factory=list)  # (characters, drafted): see TextSpan
    rounds: tuple[int, int, int] = (0, 0, 0)  # rounds, drafts proposed, drafts accepted: see RoundCounts
    logprobs: list[orchestrator_pb2.TokenLogprob] = field(default_factory=list)  # one a token, if asked for


@dataclass(frozen=True)
class RequestDefaults:
    """What a request that leaves a speculation field unset gets (the orchestrator's flags)."""

    # speculation.overlap; None: by placement, sequential where the two services share one accelerator
    # (ModelPair.shared_device; one H200: overlapped rounds 0.78-0.87x sequential ones), else overlapped
    overlap: bool | None = None
    rule: str = "leviathan"  # speculation.rule, one of orchestrator.RULES
    tree_nodes: int = 0  # speculation.tree_nodes (0: chains)
    cache: bool = True  # speculation.cache: the speculation cache (orchestrator.speculation_cache)
    # speculation.lookahead; None: measured (loop_config's default_lookahead)
    lookahead: int | None = None
    adaptive: bool = False  # speculation.adaptive


def request_defaults(config) -> RequestDefaults:
    """What an orchestrator's settings (deploy.configs.OrchestratorConfig) give requests that leave fields unset."""
    return RequestDefaults(
        overlap=config.overlap,
        rule=config.rule,
        tree_nodes=config.tree_nodes,
        cache=config.speculation_cache,
        lookahead=config.lookahead,
        adaptive=config.adaptive,
    )


# SpeculationParams.rule -> the loop's rule; RULE_UNSPECIFIED takes the orchestrator's default
_RULES = {orchestrator_pb2.RULE_LEVIATHAN: "leviathan", orchestrator_pb2.RULE_INVARIANT: "invariant"}


def loop_config(
    pair: ModelPair, request, prompt_len: int, defaults: RequestDefaults = RequestDefaults(), client: str = ""
) -> LoopConfig:
    """The loop's settings for a request; `defaults` for the fields it leaves unset; `client`: who
    sent it (history_scope)."""
    s, spec = request.sampling, request.speculation
    validation.generate_request(request)  # an explicit value is checked there, zero included
    # Unset fields take their documented defaults (the server's, checked at its start).
    # unset: the default, or the room the context leaves where that is less (as OpenAI and vLLM cap it)
    room = max(1, pair.max_context - prompt_len)
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else min(DEFAULT_MAX_NEW_TOKENS, room)
    lookahead = spec.lookahead if spec.HasField("lookahead") else defaults.lookahead
    validation.token_ids(request.stop_token_ids, pair.vocab_size, "stop_token_ids")
    validation.token_ids(list(s.logit_bias), pair.vocab_size, "sampling.logit_bias")
    # The message names the field to change: the prompt when it leaves no room for a single new
    # token, else max_new_tokens (the HTTP front door reports the first word as the parameter).
    if prompt_len >= pair.max_context:
        raise OutOfRange(
            f"prompt of {prompt_len} tokens leaves no room for max_new_tokens {max_new} "
            f"in the model context of {pair.max_context}"
        )
    if prompt_len + max_new > pair.max_context:
        raise OutOfRange(
            f"max_new_tokens {max_new} + a prompt of {prompt_len} tokens exceeds the model context of "
            f"{pair.max_context}: at most {pair.max_context - prompt_len} new tokens fit"
        )
    constraint = None
    if request.HasField("constraint"):  # refused here, naming the field, before a session opens
        grammar.grammar_of(request.constraint)
        constraint = request.constraint
    logprobs = request.logprobs if request.HasField("logprobs") else None
    config = LoopConfig(
        constraint=constraint,
        logprobs=logprobs,
        sampling=SamplingParams.from_proto(s),
        max_new_tokens=max_new,
        lookahead=validation.DEFAULT_LOOKAHEAD if lookahead is None else lookahead,
        speculate=not spec.disabled and pair.draft is not None,  # no draft service: target-only
        adaptive=spec.adaptive if spec.HasField("adaptive") else defaults.adaptive,
        overlap=spec.overlap if spec.HasField("overlap") else default_overlap(pair, defaults),
        rule=_rule(spec.rule, defaults.rule),
        tree_nodes=_tree_nodes(pair, spec, defaults.tree_nodes),
        cache=spec.cache if spec.HasField("cache") else defaults.cache,
        seed=request.seed if request.HasField("seed") else random.getrandbits(63),
        stop_token_ids=pair.eos_token_ids | frozenset(request.stop_token_ids),
        history_scope=history_scope(client, spec),
        prediction=prediction_tokens(pair, spec),
    )
    if request.HasField("seed") and not config.coupled:  # a seed replays the text only of the same drafts
        config = dataclasses.replace(config, history_scope="", reproducible=True)
    return default_lookahead(pair, config) if lookahead is None else config


def prediction_tokens(pair: ModelPair, spec) -> tuple[int, ...]:
    """SpeculationParams.prediction as the draft's session takes it (prediction_token_ids): its
    text encoded without special tokens; () where none, or where no draft will see it."""
    if not spec.prediction or spec.disabled or pair.draft is None:
        return ()
    tokens = tuple(encode(pair.tokenizer, spec.prediction, add_special_tokens=False))
    if len(tokens) > pair.max_context:
        raise InvalidArgument(
            f"speculation.prediction of {len(tokens)} tokens exceeds the model context of {pair.max_context}"
        )
    return tokens


def history_scope(client: str, spec) -> str:
    """The draft's store of earlier answers a request drafts from and enters
    (OpenSessionRequest.history_scope): a digest of its client (who the orchestrator authenticated:
    orchestrator.server.client_identity) and its SpeculationParams.history_salt; "" where it opted
    out (history false). Requests of two clients, or of two salts, never share one. A seeded
    Leviathan sample uses none (loop_config): its text depends on its drafts, and a seed replays it
    only where they are a function of its own tokens, not of what the store held when it ran."""
    validation.at_most_chars(spec.history_salt, validation.MAX_SCOPE_CHARS, "speculation.history_salt")
    if spec.HasField("history") and not spec.history:
        return ""
    return hashlib.sha256(f"{client}\0{spec.history_salt}".encode()).hexdigest()[:32]


def default_lookahead(pair: ModelPair, config: LoopConfig) -> LoopConfig:
    """A request that names no lookahead (nor does the server): a chain at a fixed k runs at the k its
    pair's measured costs and acceptance price fastest (orchestrator.lookahead.measured_lookahead, up
    to validation.MEASURED_LOOKAHEAD), where its text does not depend on k (greedy, the invariant rule), once the
    pair has measured them; DEFAULT_LOOKAHEAD before that, and always for a Leviathan sample (its seed
    replays whatever ran before it), draft trees and adaptive lookahead (its largest k). Under load
    such a generation runs that k or plain rounds, whichever the pair measures faster (`measured`:
    orchestrator.lookahead's Default k); alone, plain rounds where the start-up calibration timed
    them clearly faster than that k on its prompts (PairCosts.alone_plain), else that k.

    Where its text does not depend on k, such a request also lets a drafter that sizes its chains
    by its own score (the suffix drafter; the hybrid's index rounds) propose up to MAX_LOOKAHEAD
    tokens a round (free_lookahead; 16 until a chain is accepted whole, loop.FREE_START): they cost
    no forward, and its match knows this text better than a k priced over every request (copied
    code: k = 2 ran 52 tok/s, 16 87)."""
    if config.tree_nodes or not config.coupled or not config.speculate:
        return config
    config = dataclasses.replace(config, free_lookahead=validation.MAX_LOOKAHEAD)
    if config.adaptive:
        return config
    if pair.costs.alone_plain() and RUNNING.count() == 0:
        return dataclasses.replace(config, speculate=False)
    k = measured_lookahead(pair.costs, validation.MEASURED_LOOKAHEAD, config.overlap)
    return dataclasses.replace(config, lookahead=k or config.lookahead, measured=True)


def default_overlap(pair: ModelPair, defaults: RequestDefaults) -> bool:
    """Overlapped rounds for a request that leaves speculation.overlap unset: the server's flag, or by
    placement where it has none (sequential on one shared accelerator)."""
    return (not pair.shared_device) if defaults.overlap is None else defaults.overlap


def _tree_nodes(pair: ModelPair, spec, default: int) -> int:
    nodes = spec.tree_nodes if spec.HasField("tree_nodes") else default
    validation.tree_nodes(nodes, "speculation.tree_nodes")
    if nodes and not pair.tree_verify and not spec.disabled:
        raise FailedPrecondition(
            "speculation.tree_nodes: the target service does not verify draft trees; leave tree_nodes unset or 0"
        )
    return nodes


def _rule(value: int, default: str) -> str:
    if value == orchestrator_pb2.RULE_UNSPECIFIED:
        return default
    if value not in _RULES:
        raise InvalidArgument(f"speculation.rule: unknown rule {value} (RULE_LEVIATHAN or RULE_INVARIANT)")
    return _RULES[value]


def generate(
    pair: ModelPair,
    request,
    timeout=None,
    observe=None,
    active: Callable[[], bool] = lambda: True,
    defaults: RequestDefaults = RequestDefaults(),
    client: str = "",
    streamed: bool = True,
) -> Iterator[Chunk]:
    """Run one request; yield a chunk per round with new tokens, the last one with stats.

    `observe(loop)`, if given, stands in for loop.rounds() (telemetry wraps the rounds with it).
    `active()` is asked after each round: once it is False (the client went away) the
    generation stops and its sessions are closed. `defaults`: what a request that does not say gets.
    `client`: who sent it, as orchestrator.server.client_identity names them (history_scope).
    `streamed`: False where the caller reads nothing before the last chunk (a unary call): without
    stop strings to look for, the target-only rounds are longer (LoopConfig.streamed).
    """
    start = time.perf_counter()
    ids = prompt_ids(pair, request)
    config = loop_config(pair, request, len(ids), defaults, client)
    stop_strings = list(request.stop_strings)
    quiet = not streamed and not stop_strings  # nothing read before the end: the text decoded once, there
    if quiet:
        config = dataclasses.replace(config, streamed=False)
    hold = max((len(s) for s in stop_strings), default=1) - 1  # chars that may start a stop
    loop = SpeculativeLoop(
        pair.draft,
        pair.target,
        ids,
        config,
        timeout=timeout,
        costs=pair.costs,
        trees=pair.trees,
        health=pair.health,
        draft_timeout=pair.draft_timeout,
        cache_rates=pair.cache_rates,
    )
    tok = pair.tokenizer
    emitted = 0  # characters of text already sent
    text = ""
    pending_ids: list[int] = []
    pending_logprobs: list[orchestrator_pb2.TokenLogprob] = []  # the same tokens', when asked for
    finish = ""
    marks: list[tuple[int, bool]] = []  # (end in `text`, drafted) of each round's spans not yet sent
    counts = (0, 0, 0)  # rounds, proposed, accepted since the last chunk
    rounds = loop.rounds() if observe is None else observe(loop)
    try:
        for step in rounds:
            if not active():
                raise Cancelled("the client cancelled or its deadline passed")
            pending_ids += step.token_ids
            pending_logprobs += token_logprobs(tok, step) if config.logprobs is not None else []
            finish = step.finish_reason
            counts = (counts[0] + 1, counts[1] + step.proposed, counts[2] + step.accepted)
            if quiet:
                if finish:
                    break
                continue
            text = decode(tok, loop.generated)
            marks += _round_marks(tok, loop.generated, step, len(text))
            search_from = max(0, emitted - hold)
            cut = _find_stop(text, stop_strings, search_from)
            if cut is not None:
                # Keep tokens up to the one that completes the stop string, text before it.
                keep = _tokens_through_stop(tok, loop.generated, len(step.token_ids), stop_strings, search_from)
                pending_ids = pending_ids[: len(pending_ids) - (len(loop.generated) - keep)]
                pending_logprobs = pending_logprobs[: len(pending_ids)] if pending_logprobs else []
                loop.truncate(keep)
                text, finish = text[:cut], "stop"
            if finish:
                break
            # Hold back an incomplete character and what may be the start of a stop string.
            ready = len(text) - hold if stop_strings else len(text)
            if text.endswith("\ufffd"):
                ready = min(ready, len(text.rstrip("\ufffd")))
            if ready > emitted and pending_ids:
                spans = _spans(marks, emitted, ready)
                yield Chunk(pending_ids, text[emitted:ready], spans=spans, rounds=counts, logprobs=pending_logprobs)
                marks = [m for m in marks if m[0] > ready]
                emitted, pending_ids, pending_logprobs, counts = ready, [], [], (0, 0, 0)
    finally:
        rounds.close()  # closes the sessions even when the client went away
    if quiet:
        text = decode(tok, loop.generated)
    wall = time.perf_counter() - start
    spans = _spans(marks, emitted, len(text))
    stats = _stats(loop, len(ids), wall, config.seed)
    yield Chunk(pending_ids, text[emitted:], finish, stats, spans, counts, pending_logprobs)


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """A byte-level BPE's characters (GPT-2's bytes_to_unicode: printable bytes as themselves, the
    rest moved past 255) back to the bytes they stand for."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # a SentencePiece byte-fallback token


def token_bytes(tok, token: int, text: str) -> bytes:
    """A token's own UTF-8 bytes (OpenAI's `bytes`): a token that holds part of a character decodes
    alone to U+FFFD, whose bytes joined with its neighbours' did not give the character back; its
    bytes come from its piece then (a byte-level BPE's characters, SentencePiece's <0xNN>)."""
    if "\ufffd" not in text:
        return text.encode()
    piece = tok.convert_ids_to_tokens(token) if hasattr(tok, "convert_ids_to_tokens") else None
    if not isinstance(piece, str):
        return text.encode()
    if found := BYTE_PIECE.match(piece):
        return bytes([int(found.group(1), 16)])
    alphabet = _byte_level_alphabet()
    if all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return text.encode()


def token_logprobs(tok, step) -> list[orchestrator_pb2.TokenLogprob]:
    """A round's tokens' log probabilities (Round.logprobs) as TokenLogprob, each token's text
    decoded alone, its bytes its own (token_bytes)."""

    def entry(token: int, logprob: float, top=()) -> orchestrator_pb2.TokenLogprob:
        text = tok.decode([token])
        return orchestrator_pb2.TokenLogprob(
            token_id=token,
            token=text,
            token_bytes=token_bytes(tok, token, text),
            logprob=logprob,
            top=[entry(*t) for t in top],
        )

    # the most likely tokens that have a probability (a mask or top-k leaves fewer than asked for)
    return [
        entry(t, lp, [x for x in top if x[1] > -math.inf])
        for t, (lp, top) in zip(step.token_ids, step.logprobs, strict=True)
    ]


def _round_marks(tok, generated: list[int], step, text_len: int) -> list[tuple[int, bool]]:
    """Where the round's text ends, split into its accepted drafts and the target's own token
    (which max_new_tokens or a stop token may have cut off)."""
    drafted = min(step.accepted, len(step.token_ids))
    if 0 < drafted < len(step.token_ids):
        through_drafts = generated[: len(generated) - len(step.token_ids) + drafted]
        drafts_end = len(decode(tok, through_drafts))
        return [(drafts_end, True), (text_len, False)]
    return [(text_len, drafted > 0)]


def _spans(marks: list[tuple[int, bool]], start: int, end: int) -> list[tuple[int, bool]]:
    """text[start:end] as (length, drafted) runs; a decode that shrank (a character completed)
    leaves no gap: what no mark covers counts as the target's."""
    spans, at = [], start
    for mark_end, drafted in marks:
        if min(mark_end, end) > at:
            spans.append((min(mark_end, end) - at, drafted))
            at = min(mark_end, end)
    if end > at:
        spans.append((end - at, False))
    return spans


def _tokens_through_stop(tok, ids: list[int], last_round: int, stops, start: int) -> int:
    """Fewest tokens whose text holds a stop string (searched from `start`)."""
    for n in range(len(ids) - last_round + 1, len(ids)):
        if _find_stop(decode(tok, ids[:n]), stops, start) is not None:
            return n
    return len(ids)


def _find_stop(text: str, stop_strings: list[str], start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stop_strings) if i >= 0]
    return min(hits) if hits else None


def _stats(loop: SpeculativeLoop, prompt_len: int, wall: float, seed: int):
    s = loop.stats
    return orchestrator_pb2.GenerateStats(
        rounds=s.rounds,
        draft_tokens=s.draft_tokens,
        accepted_tokens=s.accepted_tokens,
        acceptance_rate=s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0,
        mean_accepted_length=s.committed_tokens / s.rounds if s.rounds else 0.0,
        tokens_per_second=len(loop.generated) / wall if wall > 0 else 0.0,
        wall_seconds=wall,
        prompt_tokens=prompt_len,
        generated_tokens=len(loop.generated),
        draft_seconds=s.draft_seconds,
        target_seconds=s.target_seconds,
        seed=seed,
        round_seconds=s.round_seconds,
        draft_compute_seconds=s.draft_compute_seconds,
        target_compute_seconds=s.target_compute_seconds,
        wire_bytes=s.wire_bytes,
        drafted_tokens=s.drafted_tokens,
        draft_core_seconds=s.draft_core_seconds,
        target_core_seconds=s.target_core_seconds,
        draft_forward_seconds=s.draft_forward_seconds,
        target_forward_seconds=s.target_forward_seconds,
        rounds_without_draft=s.rounds_without_draft,
        cache_branches=s.cache_branches,
        cache_hits=s.cache_hits,
        draft_mask_seconds=s.draft_mask_seconds,
        target_mask_seconds=s.target_mask_seconds,
        lookahead=loop.config.lookahead if loop.config.speculate else 0,
        proposals=s.proposals,
        index_proposals=s.index_proposals,
    )
