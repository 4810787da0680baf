"""Telemetry of the three services: OpenTelemetry traces and metrics, set up from the standard
OTEL_* variables. This module owns every span and instrument; the algorithm modules (rule, loop,
engine, proposer, scorer) know nothing of it and are observed from outside:

- gRPC interceptors: W3C trace context in the metadata (opentelemetry-instrumentation-grpc) and,
  on the model services, the time each call took, sent back in trailing metadata
  (`specdec-server-seconds`) so the orchestrator can tell time on the wire from compute;
- a thin proxy around the model backend (the forward span, forward latency);
- a wrapper around `SpeculativeLoop.rounds()`: a span and the metrics of each round. A generator
  runs in its caller's context, so the RPCs a round makes become children of its span;
- a wrapper around the orchestrator's chunks: request metrics from the very stats the response
  carries, so the two agree;
- observable gauges over a SessionEngine (open sessions, KV tokens held), counters of its prefix
  cache (prompt tokens, those reused; specdec.runtime.prefix) and of the graphs its backend built after it
  said ready (specdec.runtime.graphs).

One request is one trace:
  Orchestrator/Generate (server) -> specdec.round (one per round; the first also opens the two
  sessions, i.e. the prefill) -> DraftService/Propose, ProposalRow, TargetService/Score (client)
  -> the same methods (server, in the draft / target process) -> specdec.forward, specdec.kv.crop,
  specdec.kv.copy (a prefix another session's cache held, copied at OpenSession).

`setup(role, environ=...)` takes, from the environment its caller read (the CLI, a Ray actor: this
module reads none), OTEL_SERVICE_NAME, OTEL_TRACES_EXPORTER and OTEL_METRICS_EXPORTER
(none | console | otlp, comma-separated; metrics also prometheus), OTEL_EXPORTER_OTLP_PROTOCOL
(grpc | http/protobuf, per signal OTEL_EXPORTER_OTLP_{TRACES,METRICS}_PROTOCOL). The SDK's exporters
read the rest themselves (OTEL_EXPORTER_OTLP_ENDPOINT, headers, OTEL_BSP_*,
OTEL_METRIC_EXPORT_INTERVAL, OTEL_TRACES_SAMPLER). With everything off (the default) it returns
a Telemetry that adds nothing: no interceptor, no proxy, no wrapper. The instruments, the
interceptors and the backend proxy themselves are specdec.serving.instruments'.
"""

from __future__ import annotations

import importlib
import itertools
import time
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass

import grpc

from specdec.serving.instruments import (
    Instruments,
    ObservedBackend,
    ServerTimer,
    StepCallSpan,
    WireTimer,
    current_span,
    request_attributes,
    round_attributes,
    stats_attributes,
)

ROLES = ("orchestrator", "draft", "target")
TRACES_EXPORTERS = ("console", "otlp")
METRICS_EXPORTERS = ("console", "otlp", "prometheus")
PROTOCOLS = ("grpc", "http/protobuf")


@dataclass(frozen=True)
class TelemetryConfig:
    """What to export, and where the Prometheus endpoint listens."""

    role: str  # orchestrator | draft | target
    service_name: str = ""  # empty: specdec-<role>
    traces: tuple[str, ...] = ()  # console, otlp
    metrics: tuple[str, ...] = ()  # console, otlp, prometheus
    traces_protocol: str = "grpc"
    metrics_protocol: str = "grpc"
    metrics_port: int | None = None  # Prometheus scrape endpoint; 0 picks a free port
    metrics_host: str = "127.0.0.1"

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"telemetry role must be one of {', '.join(ROLES)}, not {self.role!r}")
        for variable, given, known in (
            ("OTEL_TRACES_EXPORTER", self.traces, TRACES_EXPORTERS),
            ("OTEL_METRICS_EXPORTER", self.metrics, METRICS_EXPORTERS),
        ):
            bad = [e for e in given if e not in known]
            if bad:
                raise ValueError(f"{variable}: unknown exporter {bad[0]!r} (known: none, {', '.join(known)})")
        for proto in (self.traces_protocol, self.metrics_protocol):
            if proto not in PROTOCOLS:
                raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {', '.join(PROTOCOLS)}, not {proto!r}")

    @property
    def name(self) -> str:
        return self.service_name or f"specdec-{self.role}"

    @classmethod
    def from_env(
        cls, role: str, environ: Mapping[str, str], metrics_port: int | None = None, metrics_host: str = "127.0.0.1"
    ) -> TelemetryConfig:
        """The standard OTEL_* variables; `metrics_port` (--metrics-port) adds a Prometheus endpoint."""
        protocol = environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        metrics = _exporters(environ.get("OTEL_METRICS_EXPORTER"))
        if metrics_port is not None and "prometheus" not in metrics:
            metrics += ("prometheus",)
        if metrics_port is None and "prometheus" in metrics:
            metrics_port = prometheus_port(environ)
            metrics_host = environ.get("OTEL_EXPORTER_PROMETHEUS_HOST", metrics_host)
        return cls(
            role=role,
            service_name=environ.get("OTEL_SERVICE_NAME", ""),
            traces=_exporters(environ.get("OTEL_TRACES_EXPORTER")),
            metrics=metrics,
            traces_protocol=environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol),
            metrics_protocol=environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", protocol),
            metrics_port=metrics_port,
            metrics_host=metrics_host,
        )


def prometheus_port(environ: Mapping[str, str]) -> int | None:
    """The port the OTEL_* variables ask a Prometheus endpoint on (OTEL_EXPORTER_PROMETHEUS_PORT,
    9464 by default); None where OTEL_METRICS_EXPORTER does not name `prometheus`."""
    if "prometheus" not in _exporters(environ.get("OTEL_METRICS_EXPORTER")):
        return None
    return int(environ.get("OTEL_EXPORTER_PROMETHEUS_PORT", "9464"))


def _exporters(value: str | None) -> tuple[str, ...]:
    names = [n.strip() for n in (value or "none").split(",") if n.strip()]
    return tuple(n for n in names if n != "none")


def setup(
    role: str, metrics_port: int | None = None, host: str = "127.0.0.1", environ: Mapping[str, str] | None = None
) -> Telemetry:
    """Telemetry for one service process, from the OTEL_* variables of `environ`, which its composition root
    (the CLI, a Ray actor) reads; None: none, telemetry off. Call once per process or actor.

    Hand the result to the service's `serve(..., telemetry=...)` and call its `shutdown()` after
    the server stopped: that flushes the last spans and metrics.
    """
    return start(TelemetryConfig.from_env(role, environ or {}, metrics_port, host))


def start(config: TelemetryConfig) -> Telemetry:
    """Providers and exporters for a config (no globals are set: several may live in one process)."""
    if not config.traces and not config.metrics:
        return Telemetry(config)
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create({SERVICE_NAME: config.name, "specdec.role": config.role})
    tracer_provider = _tracer_provider(config, resource) if config.traces else None
    meter_provider, metrics_server = _meter_provider(config, resource) if config.metrics else (None, None)
    return Telemetry(config, tracer_provider, meter_provider, metrics_server)


def _tracer_provider(config: TelemetryConfig, resource):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=resource)
    for name in config.traces:
        exporter = ConsoleSpanExporter() if name == "console" else _otlp_exporter("trace", config.traces_protocol)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _meter_provider(config: TelemetryConfig, resource):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    readers, server = [], None
    for name in config.metrics:
        if name == "prometheus":
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import CollectorRegistry, start_http_server

            registry = CollectorRegistry()  # one per Telemetry, not the process-wide default
            readers.append(PrometheusMetricReader(registry=registry, scope_info_enabled=False))
            try:
                server, _ = start_http_server(config.metrics_port, addr=config.metrics_host, registry=registry)
            except OSError as err:
                where = f"{config.metrics_host}:{config.metrics_port}"
                raise RuntimeError(f"cannot serve metrics on {where}: {err}") from None
            continue
        exporter = ConsoleMetricExporter() if name == "console" else _otlp_exporter("metric", config.metrics_protocol)
        readers.append(PeriodicExportingMetricReader(exporter))
    return MeterProvider(metric_readers=readers, resource=resource), server


def _otlp_exporter(signal: str, protocol: str):
    """OTLPSpanExporter / OTLPMetricExporter over gRPC or HTTP; they read OTEL_EXPORTER_OTLP_* themselves."""
    transport = "grpc" if protocol == "grpc" else "http"
    module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{transport}.{signal}_exporter")
    return getattr(module, "OTLPSpanExporter" if signal == "trace" else "OTLPMetricExporter")()


class Telemetry:
    """What a service host hands to its servers, channels, backend and loop; `shutdown()` at the end."""

    def __init__(self, config: TelemetryConfig, tracer_provider=None, meter_provider=None, metrics_server=None):
        from opentelemetry import metrics, trace

        self.config = config
        self.tracing = tracer_provider is not None
        self.enabled = self.tracing or meter_provider is not None
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._metrics_server = metrics_server
        self._tracer = (tracer_provider or trace.NoOpTracerProvider()).get_tracer("specdec")
        self._meter = (meter_provider or metrics.NoOpMeterProvider()).get_meter("specdec")
        self._instruments = Instruments(self._meter)
        self._attrs = {"specdec.role": config.role}

    @property
    def metrics_address(self) -> str | None:
        """host:port of the Prometheus endpoint (GET /metrics), if there is one."""
        if self._metrics_server is None:
            return None
        return f"{self.config.metrics_host}:{self._metrics_server.server_port}"

    # -- gRPC ----------------------------------------------------------------------------
    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        """To go before the error interceptor (outermost first)."""
        if not self.enabled:
            return []
        interceptors: list[grpc.ServerInterceptor] = [ServerTimer(self._instruments, self._attrs)]
        if self.tracing:
            from opentelemetry.instrumentation.grpc import filters, server_interceptor

            # Probes would bury the requests; a step stream's calls have spans of their own (step_server).
            traced = filters.negate(filters.any_of(filters.health_check(), filters.method_name("Steps")))
            interceptors.insert(0, server_interceptor(tracer_provider=self._tracer_provider, filter_=traced))
        return interceptors

    def channel(self, channel: grpc.Channel) -> grpc.Channel:
        """A client channel that carries the trace context and measures time on the wire."""
        if not self.enabled:
            return channel
        channel = grpc.intercept_channel(channel, WireTimer(self._instruments))
        if self.tracing:  # outermost: the client span covers the timing
            from opentelemetry.instrumentation.grpc import client_interceptor, filters
            from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

            calls = filters.negate(filters.method_name("Steps"))  # a step stream's calls: step_client
            interceptor = client_interceptor(tracer_provider=self._tracer_provider, filter_=calls)
            channel = intercept_channel(channel, interceptor)
        return channel

    # -- HTTP (orchestrator.openai_api) ---------------------------------------------------
    def asgi(self, app):
        """The app, with a server span per HTTP request (the root of the request's trace) and
        OpenTelemetry's HTTP server metrics; /health is left out."""
        if not self.enabled:
            return app
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

        return OpenTelemetryMiddleware(
            app,
            excluded_urls="health",
            tracer_provider=self._tracer_provider,
            meter_provider=self._meter_provider,
            exclude_spans=["receive", "send"],  # not one span per SSE chunk
        )

    def trace_metadata(self) -> list[tuple[str, str]]:
        """gRPC metadata carrying the current trace context (W3C traceparent), for a call made
        without the instrumented channel; empty when not tracing."""
        if not self.tracing:
            return []
        from opentelemetry import propagate

        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return list(carrier.items())

    # -- the step stream (specdec.serving.steps, orchestrator.step_link): a unary call's telemetry, per call
    def step_server(self, method: str, carrier: Mapping[str, str], request) -> StepCallSpan:
        """A step stream's call on its service (`method`: its unary RPC's full name): a server span,
        the child of the caller's span in `carrier`, and the server duration, as a unary call has."""
        from opentelemetry import propagate, trace

        parent = propagate.extract(carrier) if self.tracing else None
        span = self._tracer.start_span(method, context=parent, kind=trace.SpanKind.SERVER)
        span.set_attributes(request_attributes(request))
        attrs = {**self._attrs, "rpc.method": method.rsplit("/", 1)[-1]}
        return StepCallSpan(span, lambda seconds: self._instruments.server_duration.record(seconds, attrs))

    def step_client(self, method: str) -> tuple[StepCallSpan, dict[str, str]]:
        """A step stream's call from the orchestrator: a client span in the current context, the
        carrier of its context for StepCall.trace, and on its end the time on the wire."""
        from opentelemetry import propagate, trace

        span = self._tracer.start_span(method, kind=trace.SpanKind.CLIENT)
        carrier: dict[str, str] = {}
        if self.tracing:
            propagate.inject(carrier, context=trace.set_span_in_context(span))
        short = {"rpc.method": method.rsplit("/", 1)[-1]}

        def wire(seconds: float, server: float) -> None:
            wire_seconds = max(0.0, seconds - server)
            self._instruments.wire_duration.record(wire_seconds, short)
            span.set_attributes({"specdec.server_seconds": server, "specdec.wire_seconds": wire_seconds})

        return StepCallSpan(span, wire), carrier

    # -- model services ------------------------------------------------------------------
    def backend(self, backend):
        """The backend, with a span and metrics around each forward pass and cache crop."""
        return ObservedBackend(backend, self._tracer, self._instruments, self._attrs) if self.enabled else backend

    def watch(self, engine) -> None:
        """Gauges of a SessionEngine: open sessions and the tokens its KV caches hold (one engine per Telemetry)."""
        if not self.enabled:
            return
        from opentelemetry.metrics import Observation

        attrs = dict(self._attrs)
        self._meter.create_observable_gauge(
            "specdec.sessions.active",
            callbacks=[lambda _options: [Observation(engine.open_sessions, attrs)]],
            unit="{session}",
            description="Sessions open on this model service",
        )
        self._meter.create_observable_gauge(
            "specdec.kv.tokens",
            callbacks=[lambda _options: [Observation(engine.cached_tokens, attrs)]],
            unit="{token}",
            description="Tokens whose keys and values this service's KV caches hold, all sessions",
        )
        if engine.prefix is not None:
            self._watch_prefix(engine.prefix, attrs)
        self._meter.create_observable_counter(
            "specdec.builds_after_ready",
            callbacks=[lambda _options: [Observation(getattr(engine.backend, "builds_after_ready", 0), attrs)]],
            unit="{graph}",
            description="CUDA graphs captured (static forwards built) after the service said ready; 0 expected",
        )

    def _watch_prefix(self, cache, attrs: dict) -> None:
        """The prefix cache's counters (specdec.runtime.prefix.PrefixStats) and what it keeps now."""
        from opentelemetry.metrics import Observation

        stats = cache.stats
        for name, read, description in (
            ("specdec.prefix.prompt_tokens", lambda: stats.prompt_tokens, "Prompt tokens of the sessions opened"),
            (
                "specdec.prefix.hit_tokens",
                lambda: stats.hit_tokens,
                "Prompt tokens whose keys and values came from another session's cache, not a prefill",
            ),
            ("specdec.prefix.evictions", lambda: stats.evictions, "Kept caches dropped for room"),
        ):
            self._meter.create_observable_counter(
                name,
                callbacks=[lambda _options, read=read: [Observation(read(), attrs)]],
                unit="{token}" if name.endswith("tokens") else "{cache}",
                description=description,
            )
        self._meter.create_observable_gauge(
            "specdec.prefix.kept_tokens",
            callbacks=[lambda _options: [Observation(cache.retained_tokens, attrs)]],
            unit="{token}",
            description="Tokens of closed sessions' caches kept for the prefix cache (in the KV budget)",
        )

    # -- orchestrator --------------------------------------------------------------------
    def watch_services(self, health: dict) -> None:
        """A gauge of each model service's availability as the orchestrator sees it: 1 up, 0 lost
        (`health`: role -> orchestrator.availability.Availability)."""
        if not self.enabled:
            return
        from opentelemetry.metrics import Observation

        self._meter.create_observable_gauge(
            "specdec.service.available",
            callbacks=[
                lambda _options: [
                    Observation(int(h.up), {**self._attrs, "specdec.service": role}) for role, h in health.items()
                ]
            ],
            unit="1",
            description="1 while the orchestrator reaches the model service, 0 while it is lost (draft: target-only)",
        )

    def watch_admission(self, admission) -> None:
        """Gauges of the orchestrator's admission (specdec.serving.lifecycle.Admission): requests queued for a
        slot, the slots, and a counter of those refused (both full)."""
        if not self.enabled:
            return
        from opentelemetry.metrics import CallbackOptions, Observation

        def gauge(name: str, value, unit: str, description: str, kind="gauge") -> None:
            def observe(_options: CallbackOptions):
                return [Observation(value(), self._attrs)]

            make = self._meter.create_observable_gauge if kind == "gauge" else self._meter.create_observable_counter
            make(name, callbacks=[observe], unit=unit, description=description)

        gauge("specdec.requests.queued", lambda: admission.waiting, "{request}", "Requests waiting for a slot")
        gauge("specdec.requests.max_concurrent", lambda: admission.max_concurrent, "{request}", "Slots")
        gauge("specdec.requests.refused", lambda: admission.refused, "{request}", "Refused: full", "counter")

    def rounds(self, loop) -> Iterator:
        """loop.rounds(), with a span and the metrics of each round."""
        return self._observed_rounds(loop) if self.enabled else loop.rounds()

    def _observed_rounds(self, loop) -> Iterator:
        inner = loop.rounds()
        stats, m = loop.stats, self._instruments
        try:
            for index in itertools.count(1):
                draft0, target0 = stats.draft_seconds, stats.target_seconds
                t0 = time.perf_counter()
                with self._tracer.start_as_current_span("specdec.round") as span:
                    span.set_attributes(
                        {
                            "specdec.session_id": loop.session_id,
                            "specdec.round": index,
                            "specdec.lookahead": loop.config.lookahead,
                        }
                    )
                    step = next(inner, None)
                    if step is None:  # only if the loop ended without a finish reason
                        return
                    span.set_attributes(round_attributes(step))
                m.round_duration.record(time.perf_counter() - t0)
                m.accepted_length.record(step.committed)  # accepted drafts + the recovered or bonus token
                m.draft_tokens.add(step.proposed)
                m.accepted_tokens.add(step.accepted)
                if step.without_draft:
                    m.rounds_without_draft.add(1)
                if step.proposed:
                    m.draft_duration.record(stats.draft_seconds - draft0)
                m.verify_duration.record(stats.target_seconds - target0)
                yield step
                if step.finish_reason:
                    return
        finally:
            inner.close()

    def requests(self, chunks: Generator) -> Iterator:
        """The orchestrator's chunks of one request; records the stats the last one carries."""
        return self._observed_requests(chunks) if self.enabled else chunks

    def _observed_requests(self, chunks: Generator) -> Iterator:
        m = self._instruments
        m.active_requests.add(1)
        try:
            for chunk in chunks:
                if chunk.stats is not None:
                    # From the stats the response carries (stop strings may have cut the last round).
                    s = chunk.stats
                    m.generated_tokens.add(s.generated_tokens)
                    m.request_duration.record(s.wall_seconds)
                    m.tokens_per_second.record(s.tokens_per_second)
                    if s.draft_tokens:
                        m.acceptance_rate.record(s.acceptance_rate)
                    current_span().set_attributes(stats_attributes(s))
                yield chunk
        finally:
            m.active_requests.add(-1)
            chunks.close()

    def shutdown(self) -> None:
        """Flush and stop exporters, close the Prometheus endpoint. Idempotent."""
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
            self._tracer_provider = None
        if self._meter_provider is not None:
            self._meter_provider.shutdown()
            self._meter_provider = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None


def disabled(role: str = "orchestrator") -> Telemetry:
    """A Telemetry that adds nothing (what setup() gives with no OTEL_* exporter and no --metrics-port)."""
    return Telemetry(TelemetryConfig(role))
