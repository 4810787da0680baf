"""The orchestrator's OpenAI-compatible HTTP front door: POST /v1/chat/completions and
/v1/completions (JSON or server-sent events), GET /v1/models (and /v1/models/{id}), GET /health, and the playground
page at / (orchestrator/static).

Owns: the routes, the bearer-token check and TLS of the HTTP port, the body's size limit, and the
uvicorn server in a thread (serve_http). The JSON on either side of the gRPC hop is
orchestrator.openai_json's (requests) and orchestrator.openai_answers' (answers).

It generates nothing itself. Each request goes to the orchestrator's own gRPC API over loopback,
so admission (429), drain (503), auth, limits, validation and stop handling are the gRPC
server's: one loop, two front doors. A 429 says only that the server is full (OpenAI's clients
retry it). A body over MAX_BODY_BYTES is refused here (413, counted while the body is read,
before anything reaches the gRPC hop).

A client that goes away cancels its gRPC call, streamed or not, and the orchestrator closes the
sessions at its next round: an abandoned request costs at most one more round. Streams: one SSE
chunk per GenerateChunk (one per committed round), then `data: [DONE]`. Calls go over the plain
channel with the trace context injected by hand: the OpenTelemetry client interceptor wraps a
stream call in a generator that cannot be cancelled.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import grpc
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from orchestrator.choices import Choices
from orchestrator.openai_answers import Completion
from orchestrator.openai_json import APIError, choice_requests, generate_request, unknown_model
from orchestrator.server import MAX_REQUEST_BYTES
from specdec.serving import security
from specdec.serving.telemetry import Telemetry, disabled
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc

STATIC = Path(__file__).parent / "static"
PAGE_FILES = ("playground.html", "playground.js")  # the playground, served as they are
HEALTH_TIMEOUT = 2.0  # seconds for each gRPC health check behind GET /health
# A larger request body is refused with 413 as soon as that many bytes have come in. A
# GenerateRequest is smaller than the JSON it is built from (keys, quotes, escapes, digits), so
# a body under this limit fits the orchestrator's gRPC limit; the margin is headroom.
MAX_BODY_BYTES = MAX_REQUEST_BYTES - 64 * 1024
CLIENT_CLOSED = 499  # the status logged (never delivered) for a request whose client went away
NESTED = "the request body is JSON nested too deeply"


class Gateway:
    """The routes, over a channel to the orchestrator's gRPC API."""

    def __init__(self, channel: grpc.Channel, model: str, telemetry: Telemetry):
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        self.model = model
        self.telemetry = telemetry
        self.health_stub = health_pb2_grpc.HealthStub(channel)

    async def chat(self, request: Request):
        return await self._complete(request, "chat")

    async def completions(self, request: Request):
        return await self._complete(request, "completions")

    async def _complete(self, request: Request, endpoint: str):
        try:
            return await self._answer(request, endpoint)
        except ClientDisconnect:  # nobody to answer; its gRPC call, if any, is cancelled
            return Response(status_code=CLIENT_CLOSED)

    async def _answer(self, request: Request, endpoint: str):
        try:
            generate, options = generate_request(await read_json(request), endpoint, self.model)
        except APIError as err:
            return err.response()
        except RecursionError:  # a body just shallow enough to read, too deep to write out (json.dumps)
            return APIError(400, NESTED).response()
        completion = Completion.start(endpoint, self.model, options["logprobs"], options["tools"])
        metadata = self.telemetry.trace_metadata()
        if options["n"] > 1 or (options["tools"] is not None and options["stream"]):
            return await self._choices(
                request, Choices(self.stub, choice_requests(generate, options["n"]), metadata), completion, options
            )
        if not options["stream"]:
            call = self.stub.Generate.future(generate, metadata=metadata)
            try:
                return JSONResponse(completion.response(await _wait(request, call, call.result)))
            except grpc.RpcError as err:
                return APIError.from_rpc(err, endpoint, options["max_tokens"], options["constraint"]).response()
        call = self.stub.GenerateStream(generate, metadata=metadata)
        try:  # the first chunk before answering: a refusal (400, 429, 503) is then a status
            first = await _wait(request, call, lambda: next(call, None))
        except grpc.RpcError as err:
            return APIError.from_rpc(err, endpoint, options["max_tokens"], options["constraint"]).response()
        return EventSourceResponse(self._events(call, first, completion, options), ping=15)

    async def _events(self, call, chunk, completion: Completion, options: dict):
        include_usage = options["include_usage"]
        try:
            first, offset, held = True, 0, []
            while chunk is not None:
                event, held = completion.chunk(chunk, first, include_usage, offset, held=held)
                yield json.dumps(event)
                offset += len(chunk.text)
                if chunk.finish_reason:
                    if include_usage:
                        yield json.dumps(completion.usage_chunk(chunk.stats))
                    break
                first = False
                chunk = await _next(call)
            yield "[DONE]"
        except grpc.RpcError as err:  # after the status line went out: an error event
            yield json.dumps(
                APIError.from_rpc(err, completion.endpoint, options["max_tokens"], options["constraint"]).body()
            )
        finally:
            call.cancel()  # a client gone away: the orchestrator frees the sessions at the next round

    async def _choices(self, request: Request, choices: Choices, completion: Completion, options: dict):
        """A request's n choices (orchestrator.choices), or its one under tools and streamed: one answer
        with n choices, or one stream of their chunks, each with its choice's index (under tools: each
        choice whole, once generated)."""
        try:
            first = await _wait(request, choices, choices.first)
            if not options["stream"]:
                return JSONResponse(completion.response(*await _wait(request, choices, lambda: choices.answers(first))))
            if completion.tools is not None:  # a call is known once its text is whole: streamed whole
                answers = await _wait(request, choices, lambda: choices.answers(first))
                events = [json.dumps(c) for c in completion.whole_chunks(answers, options["include_usage"])]
                return EventSourceResponse(iter([*events, "[DONE]"]), ping=15)
        except grpc.RpcError as err:
            choices.cancel()
            return APIError.from_rpc(err, completion.endpoint, options["max_tokens"], options["constraint"]).response()
        return EventSourceResponse(self._choice_events(choices, first, completion, options), ping=15)

    async def _choice_events(self, choices: Choices, first, completion: Completion, options: dict):
        include_usage, n = options["include_usage"], len(choices.requests)
        started, offsets, stats, held = set(), [0] * n, [None] * n, [[] for _ in range(n)]
        merged = choices.merged()
        try:
            item = (0, first)
            while item is not None:
                i, chunk = item
                if isinstance(chunk, grpc.RpcError):
                    raise chunk
                if chunk is not None:
                    event, held[i] = completion.chunk(chunk, i not in started, include_usage, offsets[i], i, held[i])
                    yield json.dumps(event)
                    started.add(i)
                    offsets[i] += len(chunk.text)
                    if chunk.finish_reason:
                        stats[i] = chunk.stats
                item = await anyio.to_thread.run_sync(next, merged, None, abandon_on_cancel=True)
            if include_usage and all(s is not None for s in stats):
                yield json.dumps(completion.usage_chunk(*stats))
            yield "[DONE]"
        except grpc.RpcError as err:  # after the status line went out: an error event
            yield json.dumps(
                APIError.from_rpc(err, completion.endpoint, options["max_tokens"], options["constraint"]).body()
            )
        finally:
            choices.cancel()

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model_info(self, request: Request):
        """GET /v1/models/{id} (the SDK's models.retrieve): the model this server serves, else 404."""
        name = request.path_params["model"]
        if name != self.model:
            return unknown_model(name, self.model).response()
        return JSONResponse(self._model())

    def _model(self) -> dict:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "specdec"}

    async def health(self, request: Request):
        """The orchestrator's health and its services' availability as it sees them (its Describe):
        200 "ok"; 200 "degraded" while the draft is lost (served target-only, exactly); 503
        "unavailable" while the target is lost or the orchestrator drains."""
        body = await anyio.to_thread.run_sync(self._health)
        return JSONResponse(body, 503 if body["status"] == "unavailable" else 200)

    def _health(self) -> dict:
        try:
            reply = self.health_stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT)
            own = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            info = self.stub.Describe(model_pb2.DescribeRequest(), timeout=HEALTH_TIMEOUT)
        except grpc.RpcError as err:
            return {"status": "unavailable", "reason": f"orchestrator: {err.code().name}", "services": {}}
        services = {"orchestrator": own}
        for service in (info.draft, info.target) if info.HasField("draft") else (info.target,):
            services[service.role] = "SERVING" if service.available else "UNAVAILABLE"
        status, _, reason = info.status.partition(": ")
        if own != "SERVING":
            status, reason = "unavailable", f"orchestrator {own}"
        body = {"status": status, "services": services}
        return {**body, "reason": reason} if reason else body

    async def page(self, request: Request):
        name = request.path_params.get("name", "playground.html")
        if name not in PAGE_FILES:
            return APIError(404, f"no such page: /{name}", None, "not_found_error").response()
        return FileResponse(STATIC / name)


async def read_json(request: Request):
    """The request's body as JSON, read as it arrives: APIError 413 once it passes MAX_BODY_BYTES
    (or at once when its Content-Length says it will; whatever the header says, the count
    decides), 400 when it is not JSON or is nested deeper than json's decoder goes."""
    too_large = APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    try:
        return json.loads(body)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, "the request body is not valid JSON") from None
    except RecursionError:  # the C decoder past the interpreter's recursion limit (was a plain-text 500)
        raise APIError(400, NESTED) from None


async def _wait(request: Request, call, wait: Callable):
    """wait(), a blocking wait on the gRPC `call`, run in a worker thread while the client is
    watched. A client that goes away first cancels the call (the orchestrator closes its
    sessions at the next round; a call still queued for admission leaves the queue), and
    ClientDisconnect is raised. The body has been read, so the next ASGI message is
    http.disconnect."""
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        call.cancel()  # ends wait()

    def outcome():  # raised in the task group's body, an error would come out as an ExceptionGroup
        try:
            return wait(), None
        except Exception as err:  # noqa: BLE001 - raised again below
            return None, err

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(watch)
            value, error = await anyio.to_thread.run_sync(outcome, abandon_on_cancel=True)
            tasks.cancel_scope.cancel()
    except BaseException:  # this task was cancelled (the server stops): nobody waits for the call
        call.cancel()
        raise
    if gone:
        raise ClientDisconnect
    if error is not None:
        raise error
    return value


async def _next(call) -> orchestrator_pb2.GenerateChunk | None:
    """The stream's next chunk, waited for in a worker thread; None at its end. Cancelling the
    waiting task leaves the thread to the gRPC call, which call.cancel() then ends."""
    return await anyio.to_thread.run_sync(next, call, None, abandon_on_cancel=True)


class BearerAuth:
    """ASGI middleware: `Authorization: Bearer <token>` on every route but /health and the
    playground's static files (a browser cannot send a header to load a page; the page asks for
    the token and sends it with its API calls)."""

    OPEN = {"/health", "/", *(f"/{name}" for name in PAGE_FILES)}

    def __init__(self, app, token: str | Callable[[], str | None]):
        """`token`: the token, or a function giving the one in force (it changes on a reload)."""
        self.app = app
        self.token = token if callable(token) else (lambda: token)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        values = [v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"]
        if len(values) == 1 and security.bearer_matches(values[0], self.token()):
            return await self.app(scope, receive, send)
        error = APIError(401, "missing or invalid bearer token (Authorization: Bearer)", None, "authentication_error")
        await error.response()(scope, receive, send)


def app(
    channel: grpc.Channel,
    model: str,
    token: str | Callable[[], str | None] | None = None,
    telemetry: Telemetry | None = None,
):
    """The ASGI app over `channel` (to the orchestrator's gRPC API, carrying the token); `token`
    as BearerAuth's (None: none asked)."""
    telemetry = telemetry or disabled()
    gateway = Gateway(channel, model, telemetry)
    routes = [
        Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.model_info, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/", gateway.page, methods=["GET"]),
        Route("/{name:str}", gateway.page, methods=["GET"]),
    ]
    asgi = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    if token:
        asgi = BearerAuth(asgi, token)
    return telemetry.asgi(asgi)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such path, a method the path does not take) in OpenAI's shape,
    as every other error here: they came as text/plain."""
    path = request.url.path
    if exc.status_code == 404:
        error = APIError(404, f"no such path: {path}", None, "not_found_error")
    elif exc.status_code == 405:
        error = APIError(405, f"{request.method} is not allowed on {path} ({exc.headers.get('Allow', '')})")
    else:
        error = APIError(exc.status_code, exc.detail)
    response = error.response()
    response.headers.update(exc.headers or {})
    return response


# -- the server --------------------------------------------------------------------------
@dataclass
class HTTPServer:
    """A running HTTP front door; stop() ends it (streams still open are cut)."""

    url: str
    _server: uvicorn.Server
    _thread: threading.Thread
    _channel: grpc.Channel

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._channel.close()


def _pem_files(folder: str, credentials: security.ServerSecurity) -> tuple[Path, Path]:
    """The certificate and its key written to `folder` (the ssl module and uvicorn read PEM files;
    ServerSecurity holds bytes), the key readable by this user only."""
    cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
    cert.write_bytes(credentials.cert_chain)
    key.touch(0o600)
    key.write_bytes(credentials.private_key)
    return cert, key


def _reloaded_certificates(rotation: security.Rotation, config: uvicorn.Config):
    """An SSLContext.sni_callback (called at each handshake, with a server name or without) that
    hands the handshake a context of the rotation's current certificate once it has reloaded."""
    served, context = rotation.generation, None

    def pick(ssl_object, _server_name, _context) -> None:
        nonlocal served, context
        generation, current = rotation.generation, rotation.current
        if generation != served:
            with tempfile.TemporaryDirectory() as tmp:
                cert, key = _pem_files(tmp, current)
                context = uvicorn.config.create_ssl_context(
                    cert, key, None, config.ssl_version, config.ssl_cert_reqs, None, config.ssl_ciphers
                )
            served = generation
        if context is not None:
            ssl_object.context = context

    return pick


def serve_http(
    grpc_address: str,
    host: str,
    port: int,
    client_security: security.ClientSecurity,
    server_security: security.ServerSecurity,
    telemetry: Telemetry | None = None,
    model: str = "specdec",
) -> HTTPServer:
    """Serve the HTTP API on host:port (0: a free port) in a thread, for the orchestrator at
    `grpc_address` (reached with `client_security`: its TLS and token). `server_security` gives
    the HTTP port its TLS certificate and the token clients must send; plaintext only on loopback
    unless it allows otherwise. Where it reloads (its rotation), connections made after a reload
    get the new certificate and requests need the new token, as on the gRPC port."""
    security.check_bind(host, server_security, "HTTP")
    if server_security.client_ca is not None:
        raise security.SecurityError("the HTTP port does not do mutual TLS: HTTP clients authenticate with the token")
    channel = security.channel(grpc_address, client_security)
    asgi = app(channel, model, server_security.current_token() if server_security.token else None, telemetry)
    config = uvicorn.Config(asgi, host=host, port=port, log_level="warning", lifespan="off")
    with tempfile.TemporaryDirectory() as tmp:
        if server_security.tls:
            config.ssl_certfile, config.ssl_keyfile = _pem_files(tmp, server_security)
        config.load()
    if server_security.tls and server_security.rotation is not None:
        config.ssl.sni_callback = _reloaded_certificates(server_security.rotation, config)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="specdec-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    scheme = "https" if server_security.tls else "http"
    shown = f"[{host}]" if ":" in host else host
    return HTTPServer(f"{scheme}://{shown}:{bound}", server, thread, channel)
