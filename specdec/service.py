"""gRPC plumbing shared by the three services: errors -> status codes, health, serving.

Also the session RPCs both model services expose (open, append, rollback, get, close,
describe, tokenizer), so each service's servicer adds only its one verb.
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec import validation
from specdec.engine import SessionEngine
from specdec.errors import SpecdecError
from specdec.limits import SessionLimits
from specdec.security import ServerSecurity, bind, server_interceptors
from specdec.telemetry import Telemetry, disabled
from specdec.v1 import model_pb2

log = logging.getLogger("specdec")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class ErrorInterceptor(grpc.ServerInterceptor):
    """SpecdecError -> its status code; anything else -> INTERNAL, logged with its traceback."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request, context):
                try:
                    return inner(request, context)
                except Exception as err:  # noqa: BLE001 - the last line of defence
                    _abort(context, method, err)

            return handler._replace(unary_unary=unary)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            def stream(request, context):
                try:
                    yield from inner_stream(request, context)
                except Exception as err:  # noqa: BLE001
                    _abort(context, method, err)

            return handler._replace(unary_stream=stream)
        return handler


def _abort(context, method: str, err: Exception):
    if isinstance(err, SpecdecError):
        context.abort(err.code, err.message)
    if isinstance(err, grpc.RpcError) and isinstance(err, grpc.Call):
        if context.code() is not None:  # already aborted: let gRPC finish it
            raise err
        # A call to another service failed: pass its status on, naming where it came from.
        context.abort(err.code(), f"{method}: downstream {err.code().name}: {err.details()}")
    log.exception("%s failed", method)
    context.abort(grpc.StatusCode.INTERNAL, f"{method}: {type(err).__name__}: {err}")


def deadline_seconds(context) -> float | None:
    """Seconds left of the caller's deadline, or None when it set none."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e8 else remaining


def make_server(
    host: str,
    port: int,
    max_workers: int = 16,
    security: ServerSecurity | None = None,
    interceptors=(),
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
) -> tuple[grpc.Server, int]:
    """A server with the error interceptor, bound to host:port (0 picks a free port), with TLS
    and token auth when `security` asks for them. A request over max_receive_bytes is refused
    by gRPC with RESOURCE_EXHAUSTED.

    Order, outermost first: auth (an unauthenticated call goes no further), `interceptors`
    (telemetry: outside the error interceptor, so spans see the status codes), errors.
    """
    security = security or ServerSecurity()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[*server_interceptors(security), *interceptors, ErrorInterceptor()],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive_bytes),
        ],
    )
    bound = bind(server, host, port, security)
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    return server, bound


def model_server(
    backend,
    role: str,
    host: str,
    port: int,
    telemetry: Telemetry | None = None,
    security: ServerSecurity | None = None,
    limits: SessionLimits | None = None,
    interceptors=(),
):
    """A server and a SessionEngine for a model service, observed by `telemetry` when given.

    `interceptors` go inside telemetry's. Returns (server, bound port, engine); the caller
    adds its servicer and starts it.
    """
    telemetry = telemetry or disabled(role)
    engine = SessionEngine(telemetry.backend(backend), role, limits)
    telemetry.watch(engine)
    interceptors = [*telemetry.server_interceptors(), *interceptors]
    server, bound = make_server(host, port, security=security, interceptors=interceptors)
    return server, bound, engine


def add_health(server: grpc.Server, *service_names: str) -> health.HealthServicer:
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", *service_names):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def session_state(session) -> model_pb2.SessionState:
    return model_pb2.SessionState(
        length=len(session.tokens), cached_length=len(session.cached), token_ids=session.tokens
    )


class SessionServicer:
    """The session RPCs of a model service, delegating to a SessionEngine: each validates at
    the edge, then runs on the engine's model worker and waits (a cancelled call is dropped)."""

    def __init__(self, engine: SessionEngine):
        self.engine = engine

    def OpenSession(self, request, context):
        length = self.engine.open(request.session_id, list(request.prompt_token_ids), context)
        return model_pb2.OpenSessionResponse(length=length)

    def Append(self, request, context):
        validation.token_ids(request.token_ids, self.engine.backend.vocab_size, "token_ids")
        ref = request.session

        def append(session):
            self.engine.check_room(len(session.tokens) + len(request.token_ids), "token_ids")
            self.engine.commit(session, list(request.token_ids))
            return session_state(session)

        return self.engine.call(ref.session_id, ref.expected_length, append, context)

    def Rollback(self, request, context):
        def rollback(session):
            self.engine.rollback(session, request.to_length)
            return session_state(session)

        return self.engine.call(request.session_id, None, rollback, context)

    def GetSession(self, request, context):
        return self.engine.call(request.session_id, None, session_state, context)

    def CloseSession(self, request, context):
        self.engine.close(request.session_id, context)
        return model_pb2.Empty()

    def Describe(self, request, context):
        backend = self.engine.backend
        return model_pb2.ModelInfo(
            model_name=backend.name,
            vocab_size=backend.vocab_size,
            tokenizer_digest=backend.tokenizer_digest(),
            max_context=backend.max_context,
            dtype=str(backend.dtype),
            device=str(backend.device),
            eos_token_ids=backend.eos_token_ids,
            role=self.engine.role,
            open_sessions=self.engine.open_sessions,
        )

    def GetTokenizer(self, request, context):
        files = self.engine.backend.tokenizer_files()
        return model_pb2.GetTokenizerResponse(
            files=[model_pb2.TokenizerFile(name=n, content=c) for n, c in sorted(files.items())]
        )
