"""One composition: a model service or an orchestrator, built from one frozen config.

The command line (`specdec draft-service`, `target-service`, `orchestrator`), the Ray actors
(deploy.ray_actors) and the test harness start their servers here and nowhere else, so what a
service is made of (its backend, drafter, session limits, admission limits, recovery
settings, security and telemetry) cannot drift between them.

The configs are deploy.configs (light, for the CLI and the Ray driver); this module imports
the services and the orchestrator, which import torch, so the CLI imports it only in the
commands that host something. It reads no argv or environment: telemetry and security come
in built.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from deploy.configs import ModelServiceConfig, OrchestratorConfig
from draft_service import drafters
from draft_service.server import serve as serve_draft
from orchestrator.calibration import KeptPrices, PricesFile, PricesStore, priced_once
from orchestrator.generation import ModelPair, request_defaults
from orchestrator.openai_api import HTTPServer, serve_http
from orchestrator.recovery import Address
from orchestrator.server import connect
from orchestrator.server import serve as serve_orchestrator
from specdec.runtime import placement, standin
from specdec.runtime.graphs import hf_backend
from specdec.serving.lifecycle import Served
from specdec.serving.security import ClientSecurity, ServerSecurity
from specdec.serving.telemetry import Telemetry
from specdec.weights import models
from target_service.server import serve as serve_target


def start_model_service(
    config: ModelServiceConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    security: ServerSecurity | None = None,
    telemetry: Telemetry | None = None,
) -> tuple[Served, int]:
    """Pin the process to the config's cores and threads, load its model (or drafter) and serve
    it; returns (server, bound port). Unpinned on a CPU of several cores, its steps share the
    machine's cores with another service's as the requests ask (specdec.runtime.placement.Cores). A
    stand-in model (specdec.runtime.standin) takes no core: it serves without the core lock."""
    if standin.is_standin(config.spec.model):
        return serve_model(config, standin.StandinBackend(config.spec.model), host, port, None, security, telemetry)
    usable, threads = placement.apply(config.cpus, config.threads)
    shared = config.cpus is None and config.spec.device == "cpu" and len(usable) > 1
    cores = placement.Cores(config.role, threads, shared)
    cores.starting()  # until its warm-up ends, the other service times no forward (placement: Start-up)
    if config.role == "draft":
        backend, drafter = drafters.make(config.drafter, config.spec, config.compile, config.limits)
    else:
        backend, drafter = target_backend(config), None
    return serve_model(config, backend, host, port, drafter, security, telemetry, cores)


def target_backend(config: ModelServiceConfig):
    """The target's backend: transformers, or llama.cpp on a GGUF (the default alias: the
    embedded GGUF requantised to F32, the same weights as the fp32 transformers target); `auto`
    resolved where the service runs (deploy.configs.target_runtime)."""
    if config.runtime == "torch":
        return hf_backend(config.spec, config.compile)
    from specdec.runtime.llamacpp import LlamaCppBackend, sessions_for  # llama-cpp-python: only when asked for

    return LlamaCppBackend(config.spec, models.f32_gguf_path, sessions=sessions_for(config.limits))


def serve_model(
    config: ModelServiceConfig,
    backend,
    host: str = "127.0.0.1",
    port: int = 0,
    drafter: drafters.Drafter | None = None,
    security: ServerSecurity | None = None,
    telemetry: Telemetry | None = None,
    cores: placement.Cores | None = None,
) -> tuple[Served, int]:
    """Serve an already built backend in the config's role (the harness passes its tiny models);
    `drafter` defaults to the model drafter; `cores`: its threads step by step (None: the
    process's, no core lock)."""
    common = {"security": security, "telemetry": telemetry, "limits": config.limits, "cores": cores}
    if config.role == "draft":
        return serve_draft(backend, host, port, drafter or drafters.MODEL, **common)
    return serve_target(backend, host, port, **common)


def _log(message: str) -> None:
    print(f"specdec: orchestrator: {message}", file=sys.stderr, flush=True)


@dataclass
class Orchestrator:
    """A started orchestrator: its gRPC server, the connected pair, and its HTTP front door."""

    server: Served
    port: int
    pair: ModelPair
    http: HTTPServer | None = None  # config.http_port set: the OpenAI-compatible API
    prices: KeptPrices | None = None  # the pair's prices, written to their store while it serves

    def stop(self, grace: float | None = None):
        if self.prices is not None:
            self.prices.stop()
        if self.http is not None:
            self.http.stop()
        self.pair.close()
        return self.server.stop(grace)


def start_orchestrator(
    draft: Address | None,
    target: Address,
    config: OrchestratorConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    security: ServerSecurity | None = None,
    service_security: ClientSecurity | None = None,
    telemetry: Telemetry | None = None,
    prices: PricesStore | None = None,
) -> Orchestrator:
    """Connect to the two services (no draft: target-only), serve the client API, and with
    config.http_port the HTTP front door (orchestrator.openai_api: a client of this gRPC port
    over loopback, with the token in force: on a plaintext loopback port of its own where this
    one serves TLS, make_server's front_door). `prices`: where a predecessor's
    measurements are read and this one's written (None: config.prices_file's, if set)."""
    config = config or OrchestratorConfig()
    security = security or ServerSecurity()
    pair = connect(
        draft,
        target,
        wait_seconds=config.connect_seconds,
        security=service_security,
        telemetry=telemetry,
        recovery=config.recovery,
    )
    defaults = request_defaults(config)
    if prices is None and config.prices_file is not None:
        prices = PricesFile(Path(config.prices_file))
    # before it serves: the first request priced (as a predecessor on this pair priced it, where one did)
    kept = priced_once(pair, prices, config.calibration_tokens, defaults, log=_log, every=config.prices_every)
    server, bound = serve_orchestrator(
        pair,
        host,
        port,
        security,
        telemetry=telemetry,
        admission=config.admission,
        defaults=defaults,
        health_socket=config.health_socket,
        front_door=config.http_port is not None,
    )
    admission = server.gate.admission
    if admission.max_concurrent < admission.limits.max_concurrent:
        _log(f"runs {admission.max_concurrent} generations at once ({admission.bound()}); the rest queue")
    orchestrator = Orchestrator(server, bound, pair, prices=kept)
    if config.http_port is not None:
        # TLS: its plaintext loopback port (make_server's front_door); else this port, on loopback
        # (client certificates: none, and the HTTP port refuses them)
        loopback = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        hop = server.front_door or f"{loopback}:{bound}"
        own = ClientSecurity(token=security.current_token() if security.token else None)  # the one in force
        try:
            orchestrator.http = serve_http(hop, host, config.http_port, own, security, telemetry, pair.model_name)
        except BaseException:
            server.stop(None)
            raise
    return orchestrator
