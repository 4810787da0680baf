"""Stateless checks of requests at the edge: each rejects with the status code the client
should see and a message that starts with the field's name.

This module owns the checks that need no session: ranges, counts, finiteness, the
vocabulary. Checks against a session's state are the engine's (unknown session, stale
length, room in the context, the KV budget). Servicers run these first, so a request is
refused in this order, and a refused request changes nothing:
INVALID_ARGUMENT (here), NOT_FOUND, FAILED_PRECONDITION, OUT_OF_RANGE, RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specdec.errors import InvalidArgument

MAX_LOOKAHEAD = 32  # draft tokens per round, at the orchestrator and the draft service
DEFAULT_LOOKAHEAD = 4  # draft tokens per round when a request names none and its pair has measured nothing
MEASURED_LOOKAHEAD = 16  # the largest k a measured default gives (orchestrator.generation.default_lookahead)
MAX_DECODE_STEPS = 64  # one-token steps of the target in one plain Score (ScoreRequest.decode_steps)
MAX_TREE_NODES = 64  # tokens of a draft tree
TREE_BRANCHES = 4  # children an expanded node of a draft tree may have (draws a node, in sampling mode)
TREE_EXPAND = 4  # nodes of a draft tree expanded a depth at most
TREE_DRAWS = TREE_BRANCHES * TREE_EXPAND  # a draft tree's uniforms a depth (sampling mode)
TREE_BUCKETS = 5  # draft-probability buckets of ProposeRequest.tree_acceptance
MAX_LOGPROBS = 20  # most likely tokens a position reports at most (OpenAI's top_logprobs bound)
MAX_SCOPE_CHARS = 256  # OpenSessionRequest.history_scope and SpeculationParams.history_salt, characters


def sampling(msg, field: str = "sampling") -> None:
    """SamplingParams, the fields that are set: temperature finite and >= 0; top_p in (0, 1];
    top_k >= 1; min_p in [0, 1]; frequency and presence penalties in [-2, 2]; repetition_penalty > 0;
    logit_bias's biases in [-100, 100] (its token ids against a vocabulary: token_ids). Unset fields
    take their defaults (specdec.decoding.sampling.SamplingParams.from_proto). A value refused is
    shown with %g: the client's -0.1, not its float32's -0.10000000149011612."""
    if not msg.ByteSize():  # all unset (greedy, as the orchestrator sends it): nothing to check
        return
    if msg.HasField("temperature") and not (math.isfinite(msg.temperature) and msg.temperature >= 0):
        raise InvalidArgument(f"{field}.temperature must be finite and >= 0, got {msg.temperature:g}")
    if msg.HasField("top_p") and not (math.isfinite(msg.top_p) and 0.0 < msg.top_p <= 1.0):
        raise InvalidArgument(f"{field}.top_p must be in (0, 1] (leave it unset for 1: off), got {msg.top_p:g}")
    if msg.HasField("top_k") and msg.top_k < 1:
        raise InvalidArgument(f"{field}.top_k must be >= 1 (leave it unset for off), got {msg.top_k}")
    if msg.HasField("min_p") and not (math.isfinite(msg.min_p) and 0.0 <= msg.min_p <= 1.0):
        raise InvalidArgument(f"{field}.min_p must be in [0, 1] (0: off), got {msg.min_p:g}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(msg, name)
        if msg.HasField(name) and not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise InvalidArgument(f"{field}.{name} must be in [-2, 2] (0: off), got {value:g}")
    r = msg.repetition_penalty
    if msg.HasField("repetition_penalty") and not (math.isfinite(r) and r > 0):
        raise InvalidArgument(f"{field}.repetition_penalty must be finite and > 0 (1: off), got {r:g}")
    for token, bias in msg.logit_bias.items():
        if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            raise InvalidArgument(f"{field}.logit_bias: the bias of token {token} must be in [-100, 100], got {bias:g}")
        if token < 0:
            raise InvalidArgument(f"{field}.logit_bias: token id {token} is negative")


def token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # the usual case, in C
        return
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{field}: token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}")


def at_least_one(value: int, field: str) -> None:
    if value < 1:
        raise InvalidArgument(f"{field} must be >= 1, got {value}")


def at_most_chars(text: str, n: int, field: str) -> None:
    if len(text) > n:
        raise InvalidArgument(f"{field} must be at most {n} characters, not {len(text)}")


def lookahead(k: int, field: str) -> None:
    if not 1 <= k <= MAX_LOOKAHEAD:
        raise InvalidArgument(f"{field} must be in 1..{MAX_LOOKAHEAD}, got {k}")


def probabilities(values: Sequence[float], count: int, field: str) -> None:
    """`count` probabilities, each finite and in [0, 1]."""
    if len(values) != count:
        raise InvalidArgument(f"{field}: needs {count} entries, got {len(values)}")
    bad = [v for v in values if not (math.isfinite(v) and 0.0 <= v <= 1.0)]
    if bad:
        raise InvalidArgument(f"{field}: {bad[0]} is not a probability in [0, 1]")


def uniforms(values: Sequence[float], count: int, field: str) -> None:
    """`count` uniforms, each in [0, 1)."""
    if len(values) != count:
        raise InvalidArgument(f"{field}: needs {count} entries, got {len(values)}")
    bad = [v for v in values if not 0.0 <= v < 1.0]  # NaN fails too
    if bad:
        raise InvalidArgument(f"{field}: {bad[0]} is outside [0, 1)")


def threads(request) -> int | None:
    """The threads a request names (at least one), or None where it names none."""
    if not request.HasField("threads"):
        return None
    if request.threads < 1:
        raise InvalidArgument(f"threads must be >= 1 when set, got {request.threads}")
    return request.threads


def logprobs(n: int, field: str) -> None:
    if not 0 <= n <= MAX_LOGPROBS:
        raise InvalidArgument(
            f"{field} must be in 0..{MAX_LOGPROBS} (the most likely tokens a position reports), got {n}"
        )


def tree_nodes(n: int, field: str) -> None:
    if not 0 <= n <= MAX_TREE_NODES:
        raise InvalidArgument(f"{field} must be in 0..{MAX_TREE_NODES} (0: a chain), got {n}")


def generate_request(request) -> None:
    """Orchestrator.Generate, the fields that need no model (the orchestrator checks the rest
    against its pair): a client starting services for a request checks these first, so a mistyped
    flag is refused before a minute of start-up, with the message the orchestrator would send."""
    if request.WhichOneof("input") == "prompt" and not request.prompt:
        raise InvalidArgument("prompt must not be empty")
    sampling(request.sampling, "sampling")
    if request.HasField("max_new_tokens"):  # unset: the default
        at_least_one(request.max_new_tokens, "max_new_tokens")
    spec = request.speculation
    if spec.HasField("lookahead"):
        lookahead(spec.lookahead, "speculation.lookahead")
    if spec.HasField("tree_nodes"):
        tree_nodes(spec.tree_nodes, "speculation.tree_nodes")
    at_most_chars(spec.history_salt, MAX_SCOPE_CHARS, "speculation.history_salt")
    if "" in request.stop_strings:
        raise InvalidArgument("stop_strings must not hold an empty string")
    if request.HasField("logprobs"):
        logprobs(request.logprobs, "logprobs")


def propose_request(request, vocab_size: int) -> None:
    """DraftService.Propose, before the session is touched."""
    lookahead(request.k, "k")
    threads(request)
    sampling(request.sampling)
    token_ids(request.append_tokens, vocab_size, "append_tokens")
    token_ids(request.assumed_tokens, vocab_size, "assumed_tokens")
    tree_nodes(request.tree_nodes, "tree_nodes")
    if request.free_lookahead:
        lookahead(request.free_lookahead, "free_lookahead")
        if request.sampling.temperature > 0 and not request.HasField("noise_seed"):
            raise InvalidArgument(
                "free_lookahead: only greedy and the invariant rule (a Leviathan round draws k uniforms)"
            )
    if request.tree_nodes and request.assumed_tokens:
        raise InvalidArgument("assumed_tokens: a tree is proposed after the committed tokens only")
    if request.tree_acceptance:
        probabilities(request.tree_acceptance, TREE_BRANCHES * TREE_BUCKETS, "tree_acceptance")
    if request.sampling.temperature > 0:
        # The invariant rule draws nothing: its noise comes from noise_seed. A tree draws its
        # children: TREE_BRANCHES for each of TREE_EXPAND nodes a depth.
        count = request.k * (TREE_DRAWS if request.tree_nodes else 1)
        uniforms(request.uniforms, 0 if request.HasField("noise_seed") else count, "uniforms")


def tree(parents: Sequence[int], tokens: Sequence[int], field: str) -> set[int]:
    """A draft tree's parents: one a token, each an earlier index or -1, siblings distinct tokens;
    returns the nodes that have children (-1: the root)."""
    if len(parents) != len(tokens):
        raise InvalidArgument(f"{field}: needs {len(tokens)} entries (one a draft token), got {len(parents)}")
    if len(tokens) > MAX_TREE_NODES:
        raise InvalidArgument(f"{field}: a tree holds at most {MAX_TREE_NODES} tokens, got {len(tokens)}")
    seen: set[tuple[int, int]] = set()
    for i, (parent, token) in enumerate(zip(parents, tokens, strict=True)):
        if not -1 <= parent < i:
            raise InvalidArgument(f"{field}[{i}]: a parent is -1 or an earlier index, got {parent}")
        if (parent, token) in seen:
            raise InvalidArgument(f"{field}[{i}]: token {token} is already a child of {parent}")
        seen.add((parent, token))
    return {parent for parent, _ in seen}


def score_request(request, vocab_size: int) -> None:
    """TargetService.Score, before the session is touched."""
    sampling(request.sampling)
    threads(request)
    token_ids(request.append_tokens, vocab_size, "append_tokens")
    token_ids(request.draft_token_ids, vocab_size, "draft_token_ids")
    if request.HasField("logprobs"):
        logprobs(request.logprobs, "logprobs")
    if request.HasField("decode_steps"):
        decode_steps(request, vocab_size)
    if request.draft_parent_ids:
        score_tree(request, vocab_size)
        return
    if request.sampling.temperature > 0:
        k = 0 if request.HasField("noise_seed") else len(request.draft_token_ids)  # invariant: ids only
        probabilities(request.draft_token_probs, k, "draft_token_probs")
        uniforms(request.accept_uniforms, k, "accept_uniforms")


def decode_steps(request, vocab_size: int) -> None:
    """A Score of several target-only steps: plain, with a token chosen on the target."""
    if not 1 <= request.decode_steps <= MAX_DECODE_STEPS:
        raise InvalidArgument(f"decode_steps: must be in 1..{MAX_DECODE_STEPS}, got {request.decode_steps}")
    if request.draft_token_ids:
        raise InvalidArgument("decode_steps: a plain decode scores no draft_token_ids")
    if request.sampling.temperature > 0 and not request.HasField("noise_seed"):
        uniforms(request.step_uniforms, request.decode_steps, "step_uniforms")
    token_ids(request.stop_token_ids, vocab_size, "stop_token_ids")


def score_tree(request, vocab_size: int) -> None:
    """A Score of a draft tree: its shape, and for the Leviathan rule its rows and uniforms."""
    internal = tree(request.draft_parent_ids, request.draft_token_ids, "draft_parent_ids")
    if request.sampling.temperature > 0 and not request.HasField("noise_seed"):
        n = len(request.draft_token_ids)
        uniforms(request.accept_uniforms, n, "accept_uniforms")
        if not (request.HasField("final_uniform") and 0.0 <= request.final_uniform < 1.0):
            raise InvalidArgument("final_uniform: a tree's last token needs a uniform in [0, 1)")
        nodes = list(request.draft_row_nodes)
        if len(nodes) != len(request.draft_rows) or set(nodes) != internal or len(set(nodes)) != len(nodes):
            raise InvalidArgument(
                f"draft_rows: one row for the root (-1) and each node with children, {sorted(internal)}; "
                f"got rows for {nodes}"
            )
        bad = [r.vocab_size for r in request.draft_rows if not 0 < r.vocab_size <= vocab_size]
        if bad:
            raise InvalidArgument(f"draft_rows: a row over {bad[0]} tokens, the vocabulary has {vocab_size}")
