"""What telemetry puts around the services' code: the instruments and their buckets, the gRPC
interceptors that time calls (ServerTimer on a model service, WireTimer on its client: the time
a call spent on the wire), the proxy that makes a backend's forwards spans (ObservedBackend), a
step stream call's span (StepCallSpan), and the attributes spans carry.

specdec.serving.telemetry owns the setup (exporters, providers, from_env) and the Telemetry object that
installs these; nothing here reads the environment or starts an exporter. OpenTelemetry is
imported lazily, inside the functions that need it (the module imports without the SDK).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

SERVER_SECONDS_KEY = "specdec-server-seconds"  # trailing metadata: the service's own time on a call
HEALTH = "/grpc.health.v1.Health/"

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 33)
RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TOKENS_PER_SECOND_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def current_span():
    from opentelemetry import trace

    return trace.get_current_span()


def round_attributes(step) -> dict:
    attrs = {
        "specdec.proposed": step.proposed,
        "specdec.accepted": step.accepted,
        "specdec.committed": len(step.token_ids),
        "specdec.tokens": list(step.token_ids),
    }
    if step.finish_reason:
        attrs["specdec.finish_reason"] = step.finish_reason
    return attrs


def stats_attributes(s) -> dict:
    return {
        "specdec.rounds": s.rounds,
        "specdec.prompt_tokens": s.prompt_tokens,
        "specdec.generated_tokens": s.generated_tokens,
        "specdec.draft_tokens": s.draft_tokens,
        "specdec.accepted_tokens": s.accepted_tokens,
        "specdec.acceptance_rate": s.acceptance_rate,
        "specdec.tokens_per_second": s.tokens_per_second,
        "specdec.seed": str(s.seed),  # uint64 does not fit an int64 attribute
    }


def request_attributes(request) -> dict:
    """Session id and sizes of a model-service request, whatever its type."""
    attrs = {}
    session = getattr(request, "session", None)
    session_id = session.session_id if session is not None else getattr(request, "session_id", "")
    if session_id:
        attrs["specdec.session_id"] = session_id
    for field, key in (
        ("k", "specdec.k"),
        ("append_tokens", "specdec.append_tokens"),
        ("draft_token_ids", "specdec.draft_tokens"),
        ("prompt_token_ids", "specdec.prompt_tokens"),
        ("to_length", "specdec.to_length"),
    ):
        value = getattr(request, field, None)
        if value is not None:
            attrs[key] = value if isinstance(value, int) else len(value)
    return attrs


class Instruments:
    """Every instrument, by name (see docs/observability.md's Metrics table)."""

    def __init__(self, meter):
        def hist(name, unit, description, buckets=SECONDS_BUCKETS):
            return meter.create_histogram(name, unit, description, explicit_bucket_boundaries_advisory=buckets)

        # Orchestrator, per round.
        self.accepted_length = hist(
            "specdec.round.accepted_length",
            "{token}",
            "Tokens committed per round: accepted drafts plus the recovered or bonus token",
            LENGTH_BUCKETS,
        )
        self.round_duration = hist("specdec.round.duration", "s", "Wall time of a round")
        self.draft_duration = hist(
            "specdec.draft.duration", "s", "Time a round waited on the draft service (Propose, ProposalRow)"
        )
        self.verify_duration = hist("specdec.verify.duration", "s", "Time a round waited on the target service (Score)")
        self.draft_tokens = meter.create_counter("specdec.draft.tokens", "{token}", "Draft tokens proposed")
        self.accepted_tokens = meter.create_counter("specdec.accepted.tokens", "{token}", "Draft tokens accepted")
        self.generated_tokens = meter.create_counter("specdec.generated.tokens", "{token}", "Tokens generated")
        self.rounds_without_draft = meter.create_counter(
            "specdec.rounds.without_draft", "{round}", "Rounds that went without drafts because the draft was lost"
        )
        # Orchestrator, per request.
        self.request_duration = hist(
            "specdec.request.duration", "s", "Wall time of a request, prefill included", REQUEST_SECONDS_BUCKETS
        )
        self.tokens_per_second = hist(
            "specdec.request.tokens_per_second", "{token}/s", "Generated tokens per second", TOKENS_PER_SECOND_BUCKETS
        )
        self.acceptance_rate = hist(
            "specdec.request.acceptance_rate", "1", "Accepted / proposed draft tokens of a request", RATE_BUCKETS
        )
        self.active_requests = meter.create_up_down_counter(
            "specdec.requests.active", "{request}", "Requests in progress"
        )
        self.wire_duration = hist(
            "specdec.rpc.wire.duration", "s", "RPC time not spent in the called service: network, (de)serialisation"
        )
        # Model services.
        self.server_duration = hist("specdec.rpc.server.duration", "s", "Time the service spent on a call")
        self.forward_duration = hist("specdec.forward.duration", "s", "Time of one model forward pass")
        self.forward_tokens = meter.create_counter("specdec.forward.tokens", "{token}", "Tokens fed to the model")


class StepCallSpan:
    """The span of one step stream call and what its end records (Telemetry.step_server, step_client)."""

    def __init__(self, span, record: Callable[..., None]):
        self.span = span
        self._record = record

    def current(self):
        """A context in which the span is the current one (what runs for the call is its child)."""
        from opentelemetry import trace

        return trace.use_span(self.span, end_on_exit=False)

    def end(self, seconds: float, code: grpc.StatusCode, *record) -> None:
        """The call ended after `seconds` with `code`; `record`: what the recorder takes after them."""
        from opentelemetry.trace import Status, StatusCode

        self._record(seconds, *record)
        if code != grpc.StatusCode.OK:
            self.span.set_status(Status(StatusCode.ERROR, code.name))
        self.span.end()


class ServerTimer(grpc.ServerInterceptor):
    """Times each unary call, sends the time back in trailing metadata, tags the server span."""

    def __init__(self, instruments: Instruments, attrs: dict):
        self._duration = instruments.server_duration
        self._attrs = attrs

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None or handler_call_details.method.startswith(HEALTH):
            return handler
        inner = handler.unary_unary
        attrs = {**self._attrs, "rpc.method": handler_call_details.method.rsplit("/", 1)[-1]}

        def unary(request, context):
            current_span().set_attributes(request_attributes(request))
            t0 = time.perf_counter()
            response = inner(request, context)
            seconds = time.perf_counter() - t0
            context.set_trailing_metadata(((SERVER_SECONDS_KEY, repr(seconds)),))
            self._duration.record(seconds, attrs)
            return response

        return handler._replace(unary_unary=unary)


class WireTimer(grpc.UnaryUnaryClientInterceptor):
    """Client side: call time minus the server's own time (from trailing metadata) is wire time."""

    def __init__(self, instruments: Instruments):
        self._duration = instruments.wire_duration

    def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        method = (method.decode() if isinstance(method, bytes) else method).rsplit("/", 1)[-1]
        t0 = time.perf_counter()
        outcome = continuation(client_call_details, request)
        outcome.add_done_callback(lambda call: self._record(call, method, time.perf_counter() - t0))
        return outcome

    def _record(self, call, method: str, seconds: float) -> None:
        server = dict(call.trailing_metadata() or ()).get(SERVER_SECONDS_KEY)
        if server is None:  # failed, or a service without telemetry
            return
        wire = max(0.0, seconds - float(server))
        self._duration.record(wire, {"rpc.method": method})
        current_span().set_attributes({"specdec.server_seconds": float(server), "specdec.wire_seconds": wire})


class ObservedBackend:
    """A backend whose forward passes and cache crops are spans and metrics; all else passes through.

    On CUDA the forward span measures the launch: the caller's device sync falls in the server span.
    """

    def __init__(self, backend, tracer, instruments: Instruments, attrs: dict):
        self._backend = backend
        self._tracer = tracer
        self._instruments = instruments
        self._attrs = attrs

    def __getattr__(self, name):
        attribute = getattr(self._backend, name)  # absent on the backend: absent here (the engine asks)
        return self._copy_prefix if name == "copy_prefix" else attribute

    def _copy_prefix(self, src, dst, n):
        with self._tracer.start_as_current_span("specdec.kv.copy", attributes={"specdec.tokens": n}):
            return self._backend.copy_prefix(src, dst, n)

    def forward(self, cache, token_ids, n_logits):
        with self._tracer.start_as_current_span(
            "specdec.forward", attributes={"specdec.tokens": len(token_ids), "specdec.logits": n_logits}
        ):
            t0 = time.perf_counter()
            logits = self._backend.forward(cache, token_ids, n_logits)
            self._instruments.forward_duration.record(time.perf_counter() - t0, self._attrs)
        self._instruments.forward_tokens.add(len(token_ids), self._attrs)
        return logits

    def forward_batch(self, items, **trees):
        """One span for a batched forward of several sessions (specdec.runtime.backend), in the trace of
        the first session's request (the model worker runs it in that request's context)."""
        tokens = sum(len(ids) for _, ids, _ in items)
        attributes = {"specdec.tokens": tokens, "specdec.logits": sum(n for *_, n in items), "specdec.rows": len(items)}
        with self._tracer.start_as_current_span("specdec.forward", attributes=attributes):
            t0 = time.perf_counter()
            batch = getattr(self._backend, "forward_batch", None)
            logits = batch(items, **trees) if batch else [self._backend.forward(*item) for item in items]
            self._instruments.forward_duration.record(time.perf_counter() - t0, self._attrs)
        self._instruments.forward_tokens.add(tokens, self._attrs)
        return logits

    def crop(self, cache, keep):
        with self._tracer.start_as_current_span("specdec.kv.crop", attributes={"specdec.keep": keep}):
            return self._backend.crop(cache, keep)
