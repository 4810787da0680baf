"""gRPC plumbing shared by the three services: errors -> status codes, health, serving.

Also the session RPCs both model services expose (open, append, rollback, get, close,
describe, tokenizer), so each service's servicer adds only its one verb.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent import futures
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec import validation
from specdec.decoding import grammar
from specdec.errors import Cancelled, InvalidArgument, NotFound, SpecdecError
from specdec.runtime import placement
from specdec.runtime.engine import SessionEngine
from specdec.serving.security import HEALTH_PREFIX, SERVER_KEEPALIVE, ServerSecurity, bind, server_interceptors
from specdec.serving.steps import StepMethod, StepStream
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
        return wrap_handler(handler, lambda context: _errors_to_status(context, method))


@contextmanager
def _errors_to_status(context, method: str):
    try:
        yield
    except Exception as err:  # noqa: BLE001 - the last line of defence
        _abort(context, method, err)


def wrap_handler(handler: grpc.RpcMethodHandler, guard: Callable) -> grpc.RpcMethodHandler:
    """Run a unary or server-streaming handler inside `guard(context)`, a context manager;
    for a stream, until its last message is sent or the stream is closed."""
    if handler.unary_unary:
        inner = handler.unary_unary

        def unary(request, context):
            with guard(context):
                return inner(request, context)

        return handler._replace(unary_unary=unary)
    if handler.unary_stream:
        inner_stream = handler.unary_stream

        def stream(request, context):
            with guard(context):
                yield from inner_stream(request, context)

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
    health_socket: str | None = None,
    front_door: bool = False,
) -> tuple[grpc.Server, int]:
    """A server with the error interceptor, bound to host:port (0 picks a free port), with TLS
    and token auth when `security` asks for them. A request over max_receive_bytes is refused
    by gRPC with RESOURCE_EXHAUSTED. `health_socket`: the path of a Unix socket where it also
    answers health checks, and nothing else (HealthOnlyOnUnixSocket). `front_door`: where the
    port serves TLS without client certificates, it also listens in plaintext on a free port of
    127.0.0.1 (`server.front_door`, its address; None: none), for the HTTP front door in its own
    process: a hop over TLS checked the certificate's names against 127.0.0.1, which a host's
    certificate need not hold, and trusted the certificate of the start, which a rotation
    replaces. The token is asked there as on the port.

    Order, outermost first: the Unix socket's guard, auth (an unauthenticated call goes no
    further), `interceptors` (telemetry: outside the error interceptor, so spans see the status
    codes), errors.
    """
    security = security or ServerSecurity()
    guard = [HealthOnlyOnUnixSocket()] if health_socket else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[*guard, *server_interceptors(security), *interceptors, ErrorInterceptor()],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive_bytes),
            *SERVER_KEEPALIVE,
            # gRPC's default SO_REUSEPORT let a second server bind a port in use (clients then
            # reached either at random), and a port picked for 0 could be one in use already.
            ("grpc.so_reuseport", 0),
        ],
    )
    bound = bind(server, host, port, security)
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    if health_socket and not server.add_insecure_port(f"unix:{health_socket}"):  # a stale socket file is replaced
        raise RuntimeError(f"cannot bind the Unix socket {health_socket}")
    server.front_door = None
    if front_door and security.tls and security.client_ca is None:  # never a way past client certificates
        plain = server.add_insecure_port("127.0.0.1:0")
        if plain == 0:
            raise RuntimeError("cannot bind a loopback port for the HTTP front door")
        server.front_door = f"127.0.0.1:{plain}"
    return server, bound


class HealthOnlyOnUnixSocket(grpc.ServerInterceptor):
    """A server that also listens on a Unix socket (make_server's `health_socket`) answers only
    health checks there: its supervisor's probes reach it past the TLS (and client certificates)
    of its network port, which the socket skips; any other call that arrives on the socket is
    refused with PERMISSION_DENIED. Unary and server-streaming methods (the orchestrator's)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        return wrap_handler(handler, _not_on_unix_socket)


@contextmanager
def _not_on_unix_socket(context):
    if context.peer().startswith("unix:"):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "this Unix socket answers gRPC health checks only")
    yield


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


def static_forwards(built) -> model_pb2.StaticForwards | None:
    """Describe's report of what a backend built at start (specdec.runtime.graphs.Built), if it built any."""
    if built is None:
        return None
    return model_pb2.StaticForwards(
        mode=built.mode,
        batches=built.batches,
        widths=built.widths,
        lengths=built.lengths,
        built=built.graphs,
        seconds=built.seconds,
        slots=built.slots,
        capacity=built.capacity,
        kv_bytes=built.kv_bytes,
    )


def prefix_cache(cache) -> model_pb2.PrefixCache | None:
    """Describe's report of an engine's prefix cache (specdec.runtime.prefix.PrefixCache), if it has one."""
    if cache is None:
        return None
    stats = cache.stats
    return model_pb2.PrefixCache(
        prompt_tokens=stats.prompt_tokens,
        hit_tokens=stats.hit_tokens,
        hits=stats.hits,
        copied_tokens=stats.copied_tokens,
        kept=len(cache.retained),
        kept_tokens=cache.retained_tokens,
        evictions=stats.evictions,
        block_tokens=cache.block,
    )


class UnknownCloses:
    """Ids whose CloseSession found no session, and when, kept for `keep` seconds.

    A caller that gave up on an OpenSession closes the id at once; if that close overtakes
    the open on this service, the open must not leave a session behind for nobody to close.
    """

    def __init__(self, keep: float = 30.0):
        self.keep = keep
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def note(self, session_id: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._seen = {sid: t for sid, t in self._seen.items() if now - t < self.keep}
            self._seen[session_id] = now

    def since(self, session_id: str, start: float) -> bool:
        """Was `session_id` closed while unknown at or after `start`?"""
        with self._lock:
            return self._seen.get(session_id, -math.inf) >= start


class SessionServicer:
    """The session RPCs of a model service, delegating to a SessionEngine: each validates at
    the edge, then runs on the engine's model worker and waits (a cancelled call is dropped)."""

    service_name = ""  # "specdec.v1.DraftService": its methods' full names (telemetry)

    def __init__(self, engine: SessionEngine, telemetry=None):
        self.engine = engine
        self.telemetry = telemetry  # specdec.serving.telemetry.Telemetry: the step stream's calls' spans and metrics
        self.unknown_closes = UnknownCloses()

    def step_calls(self) -> dict[str, StepMethod]:
        """What the step stream takes: StepCall's oneof field -> its StepMethod (a servicer adds its verbs)."""
        opened = lambda length: model_pb2.OpenSessionResponse(length=length)  # noqa: E731
        return {
            "open_session": StepMethod("OpenSession", self._open_item, opened),
            "close_session": StepMethod("CloseSession", self._close_item, lambda _: model_pb2.Empty()),
        }

    def _open_item(self, request, deadline: float | None):
        """OpenSession on the step stream: checked as the unary call is, its constraint compiled here."""
        vocab = self._vocab(request)
        constraint = self._constraint(request)
        args = (request.session_id, list(request.prompt_token_ids), validation.threads(request), constraint, vocab)
        return self.engine.open_item(*args, deadline=deadline, **_session_options(request))

    def _close_item(self, request, deadline: float | None):
        """CloseSession on the step stream: noted where it finds no session, as the unary call does."""
        return self.engine.close_item(request.session_id, self.unknown_closes.note)

    @staticmethod
    def _vocab(request) -> int:
        vocab = request.vocab_size if request.HasField("vocab_size") else 0
        if request.HasField("vocab_size") and vocab < 1:
            raise InvalidArgument(f"vocab_size must be at least 1, not {vocab}")
        return vocab

    def Steps(self, request_iterator, context):
        """Many sessions' calls on one stream (specdec.serving.steps)."""
        stream = StepStream(self.engine, self.step_calls(), self.service_name, self.telemetry)
        yield from stream.serve(request_iterator, context)

    def OpenSession(self, request, context):
        start = time.monotonic()
        sid = request.session_id
        if not context.is_active():  # the caller left while this call was queued
            raise Cancelled("the caller stopped waiting for OpenSession")
        threads = validation.threads(request)
        vocab = self._vocab(request)
        constraint = self._constraint(request)
        tokens = list(request.prompt_token_ids)
        length = self.engine.open(sid, tokens, context, threads, constraint, vocab, **_session_options(request))
        # A caller that stopped waiting (deadline, cancel, connection lost), or closed the id
        # before it existed here, will not close this session: close it now.
        if not context.is_active() or self.unknown_closes.since(sid, start):
            with contextlib.suppress(NotFound):  # closed meanwhile
                self.engine.close(sid, context)
            raise Cancelled("the caller stopped waiting for OpenSession; the session was closed")
        return model_pb2.OpenSessionResponse(length=length)

    def _constraint(self, request) -> grammar.Matcher | None:
        """The session's grammar matcher, built here, off the model worker (compiling a grammar, or
        a vocabulary's first token table, takes milliseconds to a second)."""
        if not request.HasField("constraint"):
            return None
        tokens = list(request.prompt_token_ids)
        prompt_length = request.prompt_length if request.HasField("prompt_length") else len(tokens)
        if not 0 <= prompt_length <= len(tokens):
            raise InvalidArgument(f"prompt_length must be in 0..{len(tokens)}, got {prompt_length}")
        self.engine.check_tokens(tokens, "prompt_token_ids")
        return grammar.Matcher.open(self.engine.backend, request.constraint, tokens, prompt_length)

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
        try:
            # Not cancelled with its call: a close whose caller gave up waiting (the worker busy with
            # a wave of re-prefills after a restart, the orchestrator's 2 s passed) must still free
            # the session, which otherwise held its KV until the idle reaper (seen in chaos runs).
            self.engine.close(request.session_id)
        except NotFound:
            self.unknown_closes.note(request.session_id)
            raise
        return model_pb2.Empty()

    def Describe(self, request, context):
        engine = self.engine
        backend = engine.backend
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
            max_sessions=engine.limits.max_sessions,
            cpus=placement.usable_cores(),
            threads=engine.cores.threads if engine.cores is not None else placement.threads(),
            machine=placement.machine(),
            device_id=placement.device_id(str(backend.device)),
            kv_tokens=self.engine.session_kv_tokens,
            backend=getattr(backend, "kind", ""),
            step_costs=[
                model_pb2.StepCost(sessions=n, seconds=s, tokens=w, threads=t)
                for (t, n, w), s in sorted(engine.step_profile.items())
            ],
            static_forwards=static_forwards(getattr(backend, "built", None)),
            builds_after_ready=getattr(backend, "builds_after_ready", 0),
            tree_verify=self.engine.role == "target",  # in one forward or chain by chain (target_service.scorer)
            prefix_cache=prefix_cache(engine.prefix),
        )

    def GetTokenizer(self, request, context):
        files = self.engine.backend.tokenizer_files()
        return model_pb2.GetTokenizerResponse(
            files=[model_pb2.TokenizerFile(name=n, content=c) for n, c in sorted(files.items())]
        )


def _session_options(request) -> dict:
    """What an OpenSessionRequest tells the engine besides its tokens, threads, grammar and vocabulary
    (SessionEngine.open's keywords): prompt_length (None: unset, the whole of prompt_token_ids),
    history_scope, reproducible, prediction_token_ids (draft only) and reserve_tokens."""
    return {
        "prompt_length": request.prompt_length if request.HasField("prompt_length") else None,
        "history_scope": request.history_scope,
        "reproducible": request.reproducible,
        "prediction": request.prediction_token_ids,
        "reserve": request.reserve_tokens,
    }
