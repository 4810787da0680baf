"""`specdec generate`: one request to a running orchestrator, or to three local processes
started for it. A client: it imports grpc and the stubs, never torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from cli import options
from deploy.local import LocalPipeline
from specdec import validation
from specdec.serving import security
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc

# The request's fields that generate's and loadtest's flags set; a refusal's message starts with its field.
FIELD_FLAGS = {
    "max_new_tokens": "--max-tokens",
    "sampling.temperature": "--temperature",
    "sampling.top_p": "--top-p",
    "sampling.top_k": "--top-k",
    "sampling.min_p": "--min-p",
    "sampling.frequency_penalty": "--frequency-penalty",
    "sampling.presence_penalty": "--presence-penalty",
    "sampling.repetition_penalty": "--repetition-penalty",
    "speculation.lookahead": "--lookahead",
    "speculation.tree_nodes": "--tree",
    "stop_strings": "--stop",
}


def name_flag(message: str) -> str:
    """'max_new_tokens must be >= 1' -> 'max_new_tokens (--max-tokens) must be >= 1': the server
    names the request's field; the user typed the flag."""
    field = message.split(" ", 1)[0].rstrip(":")
    flag = FIELD_FLAGS.get(field)
    return message if flag is None else f"{field} ({flag}){message[len(field) :]}"


def add_parser(sub) -> argparse.ArgumentParser:
    g = sub.add_parser(
        "generate",
        help="generate text (starts local services unless --address is given)",
        description="Generate a continuation of PROMPT. Without --address, starts the draft, "
        "target and orchestrator as three local processes, generates, and stops them.",
    )
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--address", type=options.host_port, help="HOST:PORT of a running orchestrator")
    # Default None: only what the user gives is sent; the server applies the defaults named here.
    g.add_argument("--max-tokens", type=int, help="tokens to generate at most, >= 1 (default 128)")
    g.add_argument("--temperature", type=float, help="0 is greedy (default 0)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass, in (0, 1] (default 1: off)")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens, >= 1 (default: off)")
    g.add_argument("--min-p", type=float, help="drop tokens below MIN_P x the most likely one's, in [0, 1] (default 0)")
    g.add_argument("--frequency-penalty", type=float, help="minus this per time a token was generated, [-2, 2]")
    g.add_argument("--presence-penalty", type=float, help="minus this if a token was generated at all, [-2, 2]")
    g.add_argument("--repetition-penalty", type=float, help="HF's repetition penalty, > 0 (default 1: off)")
    g.add_argument("--seed", type=int, help="seed for sampling (default: a random one)")
    options.add_lookahead_flag(g)
    g.add_argument("--no-speculation", action="store_true", help="target-only decoding through the target service")
    g.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        help="choose k per round in 1..--lookahead from acceptance (default: the server's, off unless it was "
        "started with --adaptive)",
    )
    options.add_overlap_flag(g, client=True)
    options.add_rule_flag(g, client=True)
    options.add_tree_flag(g, client=True)
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stream", action="store_true", help="print tokens as they are committed (not with --json)")
    g.add_argument(
        "--json", action="store_true", help="print one JSON object with text, token ids and stats (at the end)"
    )
    g.add_argument(
        "--compare",
        action="store_true",
        help="then generate again with the target alone (--no-speculation, same services: locally, on every core "
        "unless --target-cpus pins it) and print the speedup (tokens/s, prefill included: the local target it starts "
        "keeps no prefix cache, so both runs prefill the prompt on it; the draft keeps its own; with --address the "
        "second run may reuse the prompt's keys and values the first computed, unless that server runs with "
        "--no-prefix-cache)",
    )
    g.add_argument("--timeout", type=float, default=None, help="deadline for the request in seconds")
    local = options.local_pipeline_group(g, "generate")
    options.add_prefix_cache_flag(local)
    options.add_pair_flags(local)
    options.add_client_security_flags(g)
    return g


def run(args) -> int:
    if args.address:
        options.refuse_local_flags(args)
    if args.timeout is not None and not args.timeout > 0:  # else DEADLINE_EXCEEDED at once
        raise ValueError(f"--timeout is seconds > 0, not {args.timeout:g}")
    if args.seed is not None and not 0 <= args.seed < 2**64:  # else protobuf's "Value out of range: -1"
        raise ValueError(f"--seed must be in 0..{2**64 - 1}, got {args.seed}")
    if args.stream and args.json:  # one JSON object at the end, or the text as it comes: not both
        raise ValueError("--stream prints the text as it comes; --json one object at the end: give one of them")
    client = options.client_security(args)
    if args.address:
        return _generate_at(args.address, args, client)
    # Refused now, as the orchestrator would refuse it, rather than after a minute of start-up.
    validation.generate_request(request(args))
    with local_pipeline(args, client, quiet=args.json) as pipeline:
        return _generate_at(pipeline.address, args, client)


def local_pipeline(args, client: security.ClientSecurity, quiet: bool = False) -> LocalPipeline:
    """The three services as local processes for this client; they require its token, if any.
    With --compare the target keeps no prefix cache: the target alone's run would otherwise reuse the
    prompt's prefill that the speculative run paid for, and the speedup would not be like for like.
    The draft keeps its own (unless --no-prefix-cache), which the target alone never reads: the chat
    template's system prompt, cached by the start-up's pricing, is then not prefilled again beside
    the target's first tokens, as on any server that has answered a request (`make demo`'s first
    speculative round came 110-420 ms sooner, 2026-12-02)."""
    if client.uses_tls:
        raise security.SecurityError("--tls* flags apply with --address; local services talk over loopback")
    log = (lambda *a: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    config = options.pipeline_config(args, auth_token=client.token)
    if getattr(args, "compare", False):
        limits = dataclasses.replace(config.session_limits, prefix_cache=False)
        config = dataclasses.replace(
            config, session_limits=limits, draft_prefix_cache=config.session_limits.prefix_cache
        )
    return LocalPipeline(config, log=log)


def request(args) -> orchestrator_pb2.GenerateRequest:
    given = options.given
    speculation = orchestrator_pb2.SpeculationParams(
        disabled=args.no_speculation, **given(lookahead=args.lookahead, adaptive=args.adaptive)
    )
    if args.overlap is not None:
        speculation.overlap = args.overlap
    if args.no_speculation_cache:
        speculation.cache = False
    if args.rule is not None:
        speculation.rule = orchestrator_pb2.Rule.Value(f"RULE_{args.rule.upper()}")
    if args.tree is not None:
        speculation.tree_nodes = args.tree
    return orchestrator_pb2.GenerateRequest(
        prompt=args.prompt,
        chat_template=not args.raw,
        sampling=model_pb2.SamplingParams(
            **given(
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                min_p=args.min_p,
                frequency_penalty=args.frequency_penalty,
                presence_penalty=args.presence_penalty,
                repetition_penalty=args.repetition_penalty,
            )
        ),
        stop_strings=args.stop,
        speculation=speculation,
        **given(seed=args.seed, max_new_tokens=args.max_tokens),
    )


def _generate_at(address: str, args, client: security.ClientSecurity) -> int:
    stub = orchestrator_pb2_grpc.OrchestratorStub(security.channel(address, client))
    req = request(args)
    if args.stream:
        parts, stats, finish = [], None, None
        call = stub.GenerateStream(req, timeout=args.timeout)
        try:
            for chunk in call:
                print(chunk.text, end="", flush=True)
                parts.append(chunk.text)
                if chunk.finish_reason:
                    stats, finish = chunk.stats, chunk.finish_reason
        finally:  # Ctrl-C: the orchestrator stops it now (it generated on until its drain timed out)
            call.cancel()
        print()
        _print_stats(stats, finish)
        if args.compare:
            _print_speedup("".join(parts), stats, _alone(stub, req, args.timeout))
        return 0
    response = _unary(stub, req, args.timeout)
    alone = _alone(stub, req, args.timeout) if args.compare else None
    if args.json:
        out = _response_json(response)
        if alone is not None:
            out["target_alone"] = _response_json(alone)
        print(json.dumps(out, ensure_ascii=False))
        return 0
    print(response.text)
    _print_stats(response.stats, response.finish_reason)
    if alone is not None:
        _print_speedup(response.text, response.stats, alone)
    return 0


def _alone(stub, req: orchestrator_pb2.GenerateRequest, timeout: float | None):
    """The same request again with the target alone (--compare)."""
    req.speculation.disabled = True
    return _unary(stub, req, timeout)


def _unary(stub, req: orchestrator_pb2.GenerateRequest, timeout: float | None):
    """Generate, cancelled if the wait for it is interrupted (Ctrl-C), as a stream is."""
    call = stub.Generate.future(req, timeout=timeout)
    try:
        return call.result()
    finally:
        call.cancel()  # done: nothing


def _print_speedup(text: str, stats, alone) -> None:
    fast, slow = stats.tokens_per_second, alone.stats.tokens_per_second
    same = "the same text" if alone.text == text else "a different sample (sampling)"
    # no drafts at all: plain rounds (timed faster alone at the orchestrator's start, or the draft lost)
    ran = "speculative decoding" if stats.draft_tokens else "plain rounds (no drafts)"
    print(
        f"[{ran} {fast:.1f} tok/s vs the target alone{_threads(alone.stats)} {slow:.1f} tok/s: "
        f"{fast / slow if slow else 0:.2f}x speedup; {same}]",
        file=sys.stderr,
    )


def _threads(s) -> str:
    """The threads the target's steps ran with, as ' on N threads', where its service reports them."""
    if not (s.target_core_seconds and s.target_forward_seconds):
        return ""
    return f" on {s.target_core_seconds / s.target_forward_seconds:.0f} threads"


def _response_json(response) -> dict:
    s = response.stats
    return {
        "text": response.text,
        "token_ids": list(response.token_ids),
        "finish_reason": response.finish_reason,
        "stats": {
            "rounds": s.rounds,
            "draft_tokens": s.draft_tokens,
            "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": s.acceptance_rate,
            "mean_accepted_length": s.mean_accepted_length,
            "tokens_per_second": s.tokens_per_second,
            "wall_seconds": s.wall_seconds,
            "rounds_without_draft": s.rounds_without_draft,
        },
    }


def _print_stats(s, finish: str) -> None:
    print(
        f"[{s.generated_tokens} tokens in {s.wall_seconds:.2f} s = {s.tokens_per_second:.1f} tok/s | "
        f"{s.rounds} rounds, acceptance {s.acceptance_rate:.1%} of {s.draft_tokens} drafts, "
        f"{s.mean_accepted_length:.2f} tokens/round{_without_draft(s)} | finish: {finish}]",
        file=sys.stderr,
    )


def _without_draft(s) -> str:
    return f", {s.rounds_without_draft} rounds without the lost draft" if s.rounds_without_draft else ""


def add_status_parser(sub) -> None:
    s = sub.add_parser(
        "status",
        help="a running orchestrator's status: ok, degraded (draft lost) or unavailable (target lost)",
        description="Ask a running orchestrator how it reaches its model services (its Describe): ok; degraded: "
        "the draft is lost and requests are served target-only, exactly; unavailable: the target is lost and new "
        "requests fail until it is back. Exits 0 while it serves (ok, degraded), 1 otherwise.",
    )
    s.add_argument("--address", type=options.host_port, required=True, help="HOST:PORT of a running orchestrator")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    options.add_client_security_flags(s)


def status(args) -> int:
    from google.protobuf.json_format import MessageToDict

    stub = orchestrator_pb2_grpc.OrchestratorStub(security.channel(args.address, options.client_security(args)))
    info = stub.Describe(model_pb2.DescribeRequest(), timeout=10)
    if args.json:
        print(json.dumps(MessageToDict(info, always_print_fields_with_no_presence=True)))
    else:
        load = f"{info.running} running"
        if info.max_concurrent:  # the admission: its slots, its queue and what it refused
            load += f" of {info.max_concurrent}, {info.queued} queued of {info.max_queue}, {info.refused} refused"
        print(f"{info.status} (model {info.model_name}, {load})")
        for service in (info.target, info.draft) if info.HasField("draft") else (info.target,):
            state = "available" if service.available else f"unavailable: {service.reason}"
            since = f"for {service.seconds:.1f} s, lost {service.losses} times"
            print(f"  {service.role:6} {service.address}  {state} ({since})")
        if info.HasField("pricing"):  # what a request that names no lookahead runs at
            from orchestrator.lookahead import Price

            price = Price(**{f.name: getattr(info.pricing, f.name) for f in dataclasses.fields(Price)})
            carried = " (as before its restart)" if info.pricing.carried_over else ""
            print(f"  priced{carried}: {price.summary()}")
    return 1 if info.status.startswith("unavailable") else 0
