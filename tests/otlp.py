"""A real OTLP/gRPC receiver on loopback (traces and metrics), built from opentelemetry-proto's
collector services: what the services export to, in tests and in scripts/trace_overhead.py."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    kind: int
    attributes: dict


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _attributes(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """Collects what OTLP exporters send; `endpoint` is the OTEL_EXPORTER_OTLP_ENDPOINT for them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._metrics: list = []  # (service, Metric proto)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(None)

    def Export(self, request, context):
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self._add_spans(request)
            return trace_service_pb2.ExportTraceServiceResponse()
        self._add_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def _add_spans(self, request) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(
                        Span(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            attributes=_attributes(s.attributes),
                        )
                    )
        with self._lock:
            self._spans += spans

    def _add_metrics(self, request) -> None:
        metrics = []
        for resource_metrics in request.resource_metrics:
            service = _attributes(resource_metrics.resource.attributes).get("service.name", "")
            for scope_metrics in resource_metrics.scope_metrics:
                metrics += [(service, m) for m in scope_metrics.metrics]
        with self._lock:
            self._metrics += metrics

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def metrics(self, service: str, name: str) -> list:
        """Every export of one metric from one service, oldest first (Metric protos)."""
        with self._lock:
            return [m for s, m in self._metrics if s == service and m.name == name]
