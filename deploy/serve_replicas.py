"""What runs in the replicas of a specdec Serve application (deploy.ray_serve builds it from these
classes; the replicas' names, status and health, which both read, are deploy.serve_status's).

- Pair: one replica is one pair. Serve reserves the replica's placement group (bundle 0: the
  replica itself and the draft, bundle 1: the target; `pack` on one node or `spread` on two);
  the replica starts the draft and target services in it as Ray actors (deploy.ray_actors,
  named NAME-REPLICA-draft and -target in the specdec namespace, restarted by Ray when they
  die, killed by the replica's watch when they hang: deploy.liveness) and runs the orchestrator
  in its own process: each request is the orchestrator's servicer called in process
  (orchestrator.continuation.stream), on a thread of its own, its chunks handed to Serve as they
  come. Serve's max_ongoing_requests is the pair's admission.
  A request may carry a Resume: the rest of a request another replica lost.
- Door: the ingress, holding no model. A gRPC server on loopback serves the Orchestrator API
  with orchestrator.continuation.ResumingServicer over a handle to Pair: every request goes
  to the pair with the fewest requests ongoing (LeastOutstanding), streams from it, and when
  the pair's replica dies mid-generation it finishes on another. The server has the
  deployment's token and the door's admission. Serve's gRPC proxy brings Generate and
  GenerateStream (with the client's metadata, so its token) to that server, and Serve's HTTP
  proxy the OpenAI-compatible API (orchestrator.openai_api, a client of the same server) and
  GET /health, which lists every replica and the health of its services.

Ray Serve is imported here at module import: only the cluster imports this module.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import ray
from ray import serve
from ray.serve.request_router import FIFOMixin, RequestRouter
from ray.util.placement_group import get_current_placement_group

from deploy import ray_deploy, serve_status
from deploy.ray_actors import actor_endpoint, watch_services, worker_environment
from orchestrator import continuation, openai_api
from orchestrator.admission import GroupAdmission
from orchestrator.calibration import calibrate
from orchestrator.generation import request_defaults
from orchestrator.server import MAX_REQUEST_BYTES, SERVICE_NAME, connect
from specdec.errors import Unavailable
from specdec.limits import AdmissionLimits, ResumePolicy
from specdec.serving import lifecycle, security, telemetry
from specdec.serving.security import ClientSecurity, ServerSecurity
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

# Errors of a call to a pair that mean its replica went away (not the request's own error).
LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, Unavailable)
FORWARDED_METADATA = (security.AUTH_HEADER, "traceparent", "tracestate")  # client -> door's server
LOOPBACK = "127.0.0.1"  # the door's own gRPC server, which its HTTP API and Serve's gRPC proxy call


@dataclass(frozen=True)
class DoorConfig:
    """What the door replica needs: the deployment's name (to list its replicas), the token it
    checks, how it checks the services' health, its admission and how it resumes."""

    name: str
    server_security: ServerSecurity
    service_security: ClientSecurity
    admission: AdmissionLimits
    resume: ResumePolicy = field(default_factory=ResumePolicy)
    start_timeout: float = 600.0


class LeastOutstanding(FIFOMixin, RequestRouter):
    """Serve's request router, choosing among all replicas rather than two at random: the one
    with the fewest requests ongoing (Serve's count is the pair's queue: its generations running
    and waiting).

    Serve compares the counts it holds (each 10 s fresh) and probes the others only when none is
    held: a replica whose probe went unanswered would lose every request to one whose count is
    known, however busy. So the replicas with no count are probed first, and a probe has a second
    to answer (Serve's 0.1 s is often missed by a pair whose process is generating on a loaded
    host: two streams went to one pair of two, CI 2026-11-26)."""

    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 4.0

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        counts = self.replica_queue_len_cache
        unknown = [r for r in candidate_replicas if counts.get(r.replica_id) is None]
        if 0 < len(unknown) < len(candidate_replicas):
            await self._probe_queue_lens(unknown, 0)  # fills the counts; the base probes when none is held
        return [candidate_replicas]


class Pair:
    def __init__(self, config: ray_deploy.RayDeployConfig):
        self.config = config
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.services = ray_deploy.start_services(
            config,
            get_current_placement_group(),  # Serve's, for this replica
            lambda role: serve_status.service_name(config.name, self.replica, role),
            namespace=ray_deploy.NAMESPACE,
        )
        ray_deploy.started(self.services, config.start_timeout)
        self.telemetry = telemetry.setup("orchestrator", environ=worker_environment())
        orchestrator = config.orchestrator
        self.pair = connect(
            actor_endpoint(self.services["draft"]),
            actor_endpoint(self.services["target"]),
            wait_seconds=orchestrator.connect_seconds,
            security=config.service_security,
            telemetry=self.telemetry,
            recovery=orchestrator.recovery,
        )
        self.defaults = request_defaults(orchestrator)
        calibrate(self.pair, orchestrator.calibration_tokens, self.defaults)  # priced before Serve routes to it
        self.watch = watch_services(self.pair, self.services, config.health_timeout)  # Serve watches this replica
        # A generation blocks its thread for its whole length: one each, as many as Serve lets in.
        self.pool = ThreadPoolExecutor(orchestrator.admission.max_concurrent + 2, "specdec-pair")

    def model_name(self) -> str:
        return self.pair.model_name

    async def generate(self, request: orchestrator_pb2.GenerateRequest, resume, timeout: float | None):
        """The request's chunks (or its rest's, after `resume`). Cancelled by Serve (its caller went
        away), the generation stops at its next round and closes its sessions."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        context = continuation.CallContext(timeout)
        end = object()

        def produce():
            try:
                chunks = continuation.stream(self.pair, request, resume, context, self.telemetry, self.defaults)
                for chunk in chunks:
                    loop.call_soon_threadsafe(queue.put_nowait, chunk)
                loop.call_soon_threadsafe(queue.put_nowait, end)
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(queue.put_nowait, err)

        loop.run_in_executor(self.pool, produce)
        try:
            while (item := await queue.get()) is not end:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            context.cancel()

    async def check_health(self) -> None:
        """Unhealthy once a service actor is gone for good (past its restarts): Serve then
        replaces the replica, placement group and services included. A service still restarting
        is not a fault: the orchestrator waits for it (one that hangs is the watch's to kill)."""
        for role, handle in self.services.items():
            try:
                await asyncio.wait_for(handle.where.remote(), 1.0)
            except asyncio.TimeoutError:
                pass  # restarting, or busy
            except ray.exceptions.ActorDiedError as err:
                raise RuntimeError(f"the {role} service actor died for good: {err}") from None

    def __del__(self):
        """Serve stops the replica: the services finish their calls and flush telemetry (they
        die with the replica, which owns them)."""
        if hasattr(self, "watch"):
            self.watch.stop()
        services = getattr(self, "services", {})
        if services:
            ray.wait([h.stop.remote(2.0) for h in services.values()], num_returns=len(services), timeout=5)


@serve.ingress()
class Door:
    async def __init__(self, pairs, config: DoorConfig):
        self.pairs = pairs
        self.config = config
        self.telemetry = telemetry.setup("orchestrator", environ=worker_environment())  # it serves the orchestrator API
        self.servicer = continuation.ResumingServicer(self._open, lambda err: isinstance(err, LOST), config.resume)
        token = config.server_security.token
        self.server, port = lifecycle.start(
            lambda server: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(self.servicer, server),
            SERVICE_NAME,
            [f"/{SERVICE_NAME}/Generate", f"/{SERVICE_NAME}/GenerateStream"],
            LOOPBACK,
            0,
            admission=GroupAdmission(config.admission),
            interceptors=self.telemetry.server_interceptors(),
            security=ServerSecurity(token=token),
            max_workers=config.admission.max_concurrent + config.admission.max_queue + 4,
            max_receive_bytes=MAX_REQUEST_BYTES,
        )
        self.address = f"{LOOPBACK}:{port}"
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.aio.insecure_channel(self.address))
        self.own = security.channel(self.address, ClientSecurity(token=token))  # the HTTP API's, with the token
        self.model = await asyncio.wait_for(self.pairs.model_name.remote(), config.start_timeout)

    def __serve_build_asgi_app__(self):
        api = openai_api.app(self.own, self.model, self.config.server_security.token, self.telemetry)

        async def asgi(scope, receive, send):
            if scope["type"] == "http" and scope["path"] == "/health":
                return await self._health(scope, receive, send)
            return await api(scope, receive, send)

        return asgi

    # -- the gRPC API, through Serve's gRPC proxy ---------------------------------------------
    async def Generate(self, request, grpc_context):
        try:
            return await self.stub.Generate(request, metadata=_forwarded(grpc_context))
        except grpc.aio.AioRpcError as err:
            _refuse(grpc_context, err)

    async def GenerateStream(self, request, grpc_context):
        call = self.stub.GenerateStream(request, metadata=_forwarded(grpc_context))
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as err:
            _refuse(grpc_context, err)
        finally:
            call.cancel()  # the client went away: the pair stops at its next round

    # -- the servicer's streams -----------------------------------------------------------
    def _open(self, request, resume, timeout):
        """A stream of the request from a pair (ResumingServicer's opener), on the server's thread."""
        response = self.pairs.options(stream=True).generate.remote(request, resume, timeout)
        try:
            yield from response
        except ray.exceptions.RayTaskError as err:  # raised in the pair: the request's own error
            raise err.cause from None
        finally:
            response.cancel()

    async def _health(self, scope, receive, send):
        report = await asyncio.to_thread(serve_status.health, self.config.name, self.config.service_security)
        code = 503 if report["status"] == "unavailable" else 200
        body = json.dumps(report).encode()
        await send({"type": "http.response.start", "status": code, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    def __del__(self):
        if hasattr(self, "server"):
            self.server.stop(1.0)


def _forwarded(grpc_context) -> list[tuple[str, str]]:
    return [(k, v) for k, v in grpc_context.invocation_metadata() if k in FORWARDED_METADATA]


def _refuse(grpc_context, err: grpc.aio.AioRpcError):
    """The door server's status, as the status Serve's proxy answers with (set, then raised)."""
    grpc_context.set_code(err.code())
    grpc_context.set_details(err.details())
    raise RuntimeError(err.details())
