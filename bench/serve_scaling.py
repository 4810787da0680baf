"""`specdec ray bench`: pairs behind one Ray Serve endpoint, measured at a scale this machine
cannot hold, with sleeping stand-ins (specdec.runtime.standin) so that N pairs fit on a few cores.

- Scaling: for each N (default 1, 2, 4, 8) one application of N pair replicas (rescaled in
  place between rows), then a load that saturates them: N x (max_concurrent + 1) clients, each
  sending Generate back to back through Serve's gRPC proxy (every pair full, one more request
  waiting per pair at the door), for a warm-up and then `duration` seconds. A row is the tokens
  generated in that window (each request's pro rata of its time in it) over its length, and
  its ratio to N = 1's.
  Target: 8 pairs >= 7x one.
- Overhead: one client, short requests, alternately through the Serve endpoint (one pair) and
  directly to one orchestrator (deploy.ray_deploy's single pair, the same stand-ins): the
  difference of the median latencies is what Serve's proxy, the door and the router add per
  request.

A stand-in's forward sleeps, so the models cost the host no core: what the rows measure is the
serving (orchestrators, services' bookkeeping, gRPC, Serve) as it would run beside real
accelerators. Timings depend on the machine's other load: run it on a quiet one.

Owns the load and the report. It starts nothing itself but through deploy (a local Ray
cluster, the applications), and stops all of it however the run ends.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc

from deploy import ray_cluster, ray_deploy, ray_serve
from deploy.configs import ModelServiceConfig, OrchestratorConfig
from specdec.limits import AdmissionLimits
from specdec.runtime.standin import StandinSpec
from specdec.serving.security import ServerSecurity
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights.models import ModelSpec

PROMPT = [5, 12, 30, 18, 7, 25, 40, 9]  # token ids of the stand-ins' vocabulary
NAME = "specdec-bench"


@dataclass(frozen=True)
class ScalingConfig:
    replicas: tuple[int, ...] = (1, 2, 4, 8)
    max_concurrent: int = 4  # generations a pair runs at once (Serve's max_ongoing_requests)
    clients_per_replica: int | None = None  # None: max_concurrent + 1
    duration: float = 60.0  # seconds measured per row
    warmup: float = 10.0  # seconds of load before each row's window
    max_tokens: int = 64
    lookahead: int = 4
    draft_ms: float = 10.0
    target_ms: float = 100.0
    agreement: float = 0.8  # the draft stand-in's, with the target stand-in
    overhead_requests: int = 40  # per path
    overhead_tokens: int = 8
    start_timeout: float = 600.0

    def __post_init__(self):
        if not self.replicas or min(self.replicas) < 1:
            raise ValueError(f"--replicas needs replica counts >= 1, got {self.replicas}")
        if self.duration <= 0 or self.warmup < 0 or self.max_tokens < 1 or self.overhead_requests < 1:
            raise ValueError("--duration > 0, --warmup >= 0, --max-tokens >= 1 and --overhead-requests >= 1")
        # The stand-ins' own checks, here rather than in an actor once Ray has started.
        draft = f"--draft-ms {self.draft_ms:g} --agreement {self.agreement:g}"
        for flags, ms, agreement in ((draft, self.draft_ms, self.agreement), ("--target-ms", self.target_ms, 1)):
            try:
                StandinSpec(ms / 1000, agreement)
            except ValueError as err:
                raise ValueError(f"{flags}: {err}") from None

    @property
    def clients(self) -> int:
        return self.clients_per_replica or self.max_concurrent + 1


@dataclass
class Row:
    replicas: int
    clients: int
    requests: int  # in the window, wholly or in part
    tokens: int
    seconds: float
    errors: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Report:
    config: ScalingConfig
    rows: list[Row] = field(default_factory=list)
    direct_ms: list[float] = field(default_factory=list)  # one orchestrator, per request
    serve_ms: list[float] = field(default_factory=list)  # through Serve's gRPC proxy and the door

    def as_dict(self) -> dict:
        base = self.rows[0].tokens_per_second if self.rows else None
        return {
            "config": asdict(self.config),
            "rows": [
                {**asdict(r), "tokens_per_second": r.tokens_per_second, "x_first": r.tokens_per_second / base}
                for r in self.rows
            ],
            "overhead": {
                "requests": len(self.direct_ms),
                "direct_p50_ms": _median(self.direct_ms),
                "serve_p50_ms": _median(self.serve_ms),
                "added_p50_ms": _median(self.serve_ms) - _median(self.direct_ms) if self.direct_ms else None,
            },
        }

    def text(self) -> str:
        c = self.config
        d = self.as_dict()
        lines = [
            f"stand-ins: draft {c.draft_ms:g} ms/forward (agreement {c.agreement:g}), target {c.target_ms:g} "
            f"ms/forward; {c.max_tokens} tokens a request, lookahead {c.lookahead}, "
            f"{c.max_concurrent} generations a pair",
            "| pairs | clients | requests | tokens | seconds | tokens/s | x 1st row | errors |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in d["rows"]:
            lines.append(
                f"| {r['replicas']} | {r['clients']} | {r['requests']} | {r['tokens']} | {r['seconds']:.1f} | "
                f"{r['tokens_per_second']:.1f} | {r['x_first']:.2f} | {r['errors']} |"
            )
        o = d["overhead"]
        if o["requests"]:
            lines.append(
                f"per request ({c.overhead_tokens} tokens, one client, {o['requests']} each): one orchestrator "
                f"{o['direct_p50_ms']:.1f} ms, through Serve's gRPC proxy, the door and the router "
                f"{o['serve_p50_ms']:.1f} ms (p50): +{o['added_p50_ms']:.1f} ms"
            )
        return "\n".join(lines)


def run(config: ScalingConfig, state_file: Path, log: Callable[[str], None] = lambda msg: None) -> Report:
    """Start a local Ray cluster, measure, stop everything; the report."""
    env = {**os.environ, **ray_cluster.auth_env(dict(os.environ))}
    os.environ.update(env)
    # Logical CPUs (Ray takes whole ones): a stand-in service reserves a tenth of one and uses none.
    cluster = ray_cluster.start(state_file, env, num_cpus=2 + max(config.replicas), dashboard=False)
    try:
        ray_deploy.connect(cluster.address)
        return _measure(config, log)
    finally:
        import ray

        ray.shutdown()
        ray_cluster.stop(cluster, state_file)


def _measure(config: ScalingConfig, log) -> Report:
    report = Report(config)
    serve = _serve_config(config, replicas=config.replicas[0])
    deployment = ray_serve.up(serve, log)
    try:
        stub = _stub(deployment.grpc_address)
        for n in config.replicas:
            ray_serve.rescale(replace(serve, replicas=n))
            log(
                f"specdec bench: {n} pair(s) up; {n * config.clients} clients for {config.warmup + config.duration:g} s"
            )
            report.rows.append(_load(stub, n, config))
            log(f"specdec bench: {report.rows[-1].tokens_per_second:.1f} tokens/s")
        ray_serve.rescale(replace(serve, replicas=1))
        direct = ray_deploy.up(replace(serve.pair, name=f"{NAME}-direct", port=ray_cluster.free_port()), log)
        try:
            report.direct_ms, report.serve_ms = _overhead(_stub(direct.address), stub, config)
        finally:
            ray_deploy.down(direct.name)
    finally:
        ray_serve.down(serve.pair.name)
    return report


def _serve_config(config: ScalingConfig, replicas: int) -> ray_serve.ServeConfig:
    def service(role: str, model: str) -> ModelServiceConfig:
        return ModelServiceConfig(role, ModelSpec(model, "cpu", "float32"))

    pair = ray_deploy.RayDeployConfig(
        name=NAME,
        target=service("target", f"standin:{config.target_ms:g}"),
        draft=service("draft", f"standin:{config.draft_ms:g}:{config.agreement:g}"),
        target_resources=ray_deploy.Resources(0.1),
        draft_resources=ray_deploy.Resources(0.1),
        orchestrator=OrchestratorConfig(admission=AdmissionLimits(config.max_concurrent, 4 * max(config.replicas))),
        start_timeout=config.start_timeout,
        server_security=ServerSecurity(),
        loopback=True,
    )
    return ray_serve.ServeConfig(
        pair, replicas=replicas, grpc_port=ray_cluster.free_port(), http_port=ray_cluster.free_port()
    )


def _request(tokens: int, lookahead: int) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=PROMPT),
        max_new_tokens=tokens,
        speculation=orchestrator_pb2.SpeculationParams(lookahead=lookahead),
    )


def _load(stub, replicas: int, config: ScalingConfig) -> Row:
    """Clients back to back for warm-up + duration, then until their last requests end; each
    request's tokens counted in the window pro rata of its time in it (a request's tokens come
    at a steady rate, a round at a time)."""
    request = _request(config.max_tokens, config.lookahead)
    clients = replicas * config.clients
    start = time.monotonic() + config.warmup
    end = start + config.duration
    done: list[tuple[float, float, int]] = []  # (sent, answered, tokens)
    errors = 0
    lock = threading.Lock()

    def client():
        nonlocal errors
        while (sent := time.monotonic()) < end:
            try:
                tokens = len(stub.Generate(request, timeout=config.start_timeout).token_ids)
            except grpc.RpcError:
                with lock:
                    errors += 1
                continue
            with lock:
                done.append((sent, time.monotonic(), tokens))

    with ThreadPoolExecutor(clients, thread_name_prefix="bench-client") as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    shares = [(n * (min(b, end) - max(a, start)) / (b - a)) for a, b, n in done if a < end and b > start]
    return Row(replicas, clients, len(shares), round(sum(shares)), config.duration, errors)


def _overhead(direct, served, config: ScalingConfig) -> tuple[list[float], list[float]]:
    """Per-request latency (ms) of one client, alternately direct and through Serve (drift hits both)."""
    request = _request(config.overhead_tokens, config.lookahead)
    for stub in (direct, served):  # warm both paths
        stub.Generate(request, timeout=config.start_timeout)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(config.overhead_requests):
        for stub, out in zip((direct, served), times, strict=True):
            t0 = time.perf_counter()
            stub.Generate(request, timeout=config.start_timeout)
            out.append(1000 * (time.perf_counter() - t0))
    return times


def _stub(address: str):
    return orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
