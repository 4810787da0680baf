"""Transport security and authentication for every gRPC link: TLS, mutual TLS, bearer tokens.

Owns: the server and client security settings (frozen dataclasses), building server
credentials and binding ports, the loopback-only rule for plaintext, the server interceptor
that checks `authorization: Bearer <token>` on every method, the client channels that
carry TLS credentials and the token, keepalive on every channel and server, and the
rotation of a running server's certificate, key and token (Rotation, on SIGHUP). It reads
the files it is pointed at and no argv or environment: the command line (cli.options) reads
the token variables and passes them in.

Decisions:
- Plaintext is allowed only on loopback addresses, for servers (bind) and clients (connect)
  alike, unless `allow_insecure` is set: a token or a prompt never crosses a network in the
  clear by accident.
- The token is compared in constant time (hmac.compare_digest over SHA-256 digests, so not
  even its length leaks) and never appears in a repr, a log line or an error message.
- `grpc.health.v1.Health` needs no token: probes (load balancers, Kubernetes) cannot send one,
  and it tells only SERVING / NOT_SERVING. It is still behind TLS / mTLS when those are on.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

log = logging.getLogger("specdec")

# Keepalive on every link: a peer that vanishes without closing its connection (a host
# powered off, a network partition) is noticed within seconds, not at a call's deadline.
# Clients ping every 2 s, idle or not, and drop a connection whose ping goes unanswered for
# 3 s (its calls fail UNAVAILABLE, which the orchestrator's recovery handles); servers accept
# pings that often and ping their own clients every 10 s.
CLIENT_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    # Any ping (keepalive or flow control) unanswered this long drops the connection: a keepalive
    # ping sent while another is unanswered waits on that one (default 60 s).
    ("grpc.http2.ping_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # default 2: a silent link would stop the pings
    ("grpc.http2.min_time_between_pings_ms", 1000),
]
SERVER_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.ping_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),  # never answer a client's pings with GOAWAY
    ("grpc.http2.max_pings_without_data", 0),
]

# A channel that connects afresh: its own subchannel (gRPC shares one per address between the
# channels of a process, with its reconnect backoff: after a restart of a few seconds a new channel
# waited out a backoff grown to seconds, failing UNAVAILABLE at once meanwhile), and reconnects at
# most a second apart. The orchestrator's links to its services and a supervisor's health probes.
RECONNECT = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

HEALTH_PREFIX = "/grpc.health.v1.Health/"
AUTH_HEADER = "authorization"
TOKEN_ENV = "SPECDEC_AUTH_TOKEN"
SERVICE_TOKEN_ENV = "SPECDEC_SERVICE_AUTH_TOKEN"


class SecurityError(ValueError):
    """A security setting that cannot work; raised at startup, with what to change."""


@dataclass(frozen=True)
class ServerSecurity:
    """How a server accepts connections. With cert and key: TLS; with client_ca as well: mTLS."""

    cert_chain: bytes | None = None  # PEM, the server's certificate (chain)
    private_key: bytes | None = field(default=None, repr=False)  # PEM
    client_ca: bytes | None = None  # PEM; clients must present a certificate signed by it
    token: str | None = field(default=None, repr=False)  # callers must send `Bearer <token>`
    allow_insecure: bool = False  # plaintext on a non-loopback address
    # Where the running server reads its current credentials, when they can change (reloadable()).
    rotation: Rotation | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if (self.cert_chain is None) != (self.private_key is None):
            raise SecurityError("TLS needs both a certificate and its private key (--tls-cert and --tls-key)")
        if self.client_ca is not None and self.cert_chain is None:
            raise SecurityError("mutual TLS (--tls-client-ca) needs TLS: give --tls-cert and --tls-key too")
        _check_token(self.token)

    @property
    def tls(self) -> bool:
        return self.cert_chain is not None

    def current_token(self) -> Callable[[], str | None]:
        """The token in force, asked at each call: the rotation's current one where it reloads."""
        rotation = self.rotation
        return (lambda: rotation.current.token) if rotation is not None else (lambda: self.token)


@dataclass(frozen=True)
class ClientSecurity:
    """How a client connects. TLS when `tls` or any certificate is given; mTLS with cert and key."""

    tls: bool = False  # TLS with the system's root certificates unless root_ca is given
    root_ca: bytes | None = None  # PEM, the CA that signed the server's certificate
    cert_chain: bytes | None = None  # PEM, this client's certificate, for mTLS
    private_key: bytes | None = field(default=None, repr=False)  # PEM
    server_name: str | None = None  # the name to verify in the server's certificate, if not the host
    # sent as `authorization: Bearer <token>`; or a function giving the one in force at each call (a
    # client in its server's own process, which follows the server's rotation: ServerSecurity.current_token)
    token: str | Callable[[], str | None] | None = field(default=None, repr=False)
    allow_insecure: bool = False  # plaintext to a non-loopback address

    def __post_init__(self):
        if (self.cert_chain is None) != (self.private_key is None):
            raise SecurityError("a client certificate needs its private key (--tls-cert and --tls-key)")
        if not callable(self.token):
            _check_token(self.token)

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.root_ca is not None or self.cert_chain is not None


@dataclass(frozen=True)
class ServerTLSFiles:
    """Where a server's PEM files are; what a launcher passes on to a child process as flags."""

    cert: Path | None = None
    key: Path | None = None
    client_ca: Path | None = None

    def flags(self) -> list[str]:
        pairs = (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-client-ca", self.client_ca))
        return [arg for flag, path in pairs if path is not None for arg in (flag, str(path))]

    def load(self, token: str | None = None, allow_insecure: bool = False) -> ServerSecurity:
        return ServerSecurity(
            cert_chain=read_pem(self.cert),
            private_key=read_pem(self.key),
            client_ca=read_pem(self.client_ca),
            token=token,
            allow_insecure=allow_insecure,
        )


class Rotation:
    """A running server's credentials, replaced from their files by reload() (on SIGHUP).

    Connections made after a reload get the new certificate, calls made after it need the new
    token; a connection or a call already under way keeps what it started with. A reload may
    replace the files' contents, not turn TLS, client certificates or the token on or off; a
    reload that fails (a missing or bad file) keeps the credentials in use and says why.
    """

    def __init__(self, load: Callable[[], ServerSecurity]):
        self._load = load
        self._lock = threading.Lock()
        self.current = load()
        self.generation = 0  # reloads so far

    def reload(self) -> bool:
        try:
            fresh = self._load()
        except SecurityError as err:
            log.error("credentials not reloaded; the current ones stay in use: %s", err)
            return False
        if _kind(fresh) != _kind(self.current):
            log.error("credentials not reloaded: a reload replaces TLS files and the token, it cannot add or drop one")
            return False
        with self._lock:
            self.current, self.generation = fresh, self.generation + 1
        log.warning("credentials reloaded (TLS certificate and key, client CA, token)")
        return True

    def certificate_fetcher(self) -> Callable[[], grpc.ServerCertificateConfiguration | None]:
        """For grpc.dynamic_ssl_server_credentials: called at each TLS handshake, it returns the
        certificate configuration once after each reload (None: keep the current one)."""
        served = self.generation

        def fetch():
            nonlocal served
            with self._lock:
                if served == self.generation:
                    return None
                served, current = self.generation, self.current
            return _certificate_configuration(current)

        return fetch


def reloadable(load: Callable[[], ServerSecurity]) -> ServerSecurity:
    """The ServerSecurity load() reads now, able to re-read its files: pass its
    rotation.reload to whatever asks for a reload (the CLI: SIGHUP)."""
    rotation = Rotation(load)
    return replace(rotation.current, rotation=rotation)


def _kind(security: ServerSecurity) -> tuple[bool, bool, bool]:
    return security.tls, security.client_ca is not None, security.token is not None


def _check_token(token: str | None) -> None:
    # gRPC metadata values are printable ASCII; say so here rather than fail on the first call.
    if token is not None and (not token or not token.isascii() or not token.isprintable() or " " in token):
        raise SecurityError("the auth token must be non-empty printable ASCII without spaces")


def read_pem(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise SecurityError(f"cannot read {path}: {err.strerror}") from None


def read_token(path: Path | None, env_value: str | None = None) -> str | None:
    """The token from a file (surrounding whitespace stripped), else from an environment value."""
    if path is not None:
        try:
            token = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise SecurityError(f"cannot read the auth token file {path}: {err}") from None
        if not token:
            raise SecurityError(f"the auth token file {path} is empty")
        return token
    return env_value.strip() if env_value and env_value.strip() else None


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IPs; a wildcard or any other name is not loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(address: str) -> str:
    """The host of HOST:PORT, [IPV6]:PORT or HOST."""
    if address.startswith("["):
        return address[1 : address.index("]")]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


# -- server ------------------------------------------------------------------------------
def check_bind(host: str, security: ServerSecurity, protocol: str = "gRPC") -> None:
    """Plaintext is served on loopback only, unless explicitly allowed."""
    if not (security.tls or is_loopback(host) or security.allow_insecure):
        raise SecurityError(
            f"refusing to serve plaintext {protocol} on non-loopback address {host}: give --tls-cert and "
            "--tls-key, or --allow-insecure to accept it on a trusted network"
        )


def bind(server: grpc.Server, host: str, port: int, security: ServerSecurity) -> int:
    """Bind host:port with TLS (and client certificates) when configured, else plaintext."""
    check_bind(host, security)
    address = f"{host}:{port}"
    if not security.tls:
        return server.add_insecure_port(address)
    if security.rotation is not None:  # the certificate a handshake gets is the current one
        creds = grpc.dynamic_ssl_server_credentials(
            _certificate_configuration(security),
            security.rotation.certificate_fetcher(),
            require_client_authentication=security.client_ca is not None,
        )
    else:
        creds = grpc.ssl_server_credentials(
            [(security.private_key, security.cert_chain)],
            root_certificates=security.client_ca,
            require_client_auth=security.client_ca is not None,
        )
    return server.add_secure_port(address, creds)


def _certificate_configuration(security: ServerSecurity) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(security.private_key, security.cert_chain)], root_certificates=security.client_ca
    )


def server_interceptors(security: ServerSecurity) -> list[grpc.ServerInterceptor]:
    if not security.token:
        return []
    return [TokenAuthInterceptor(security.current_token())]


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses any call without `authorization: Bearer <token>` (UNAUTHENTICATED), before the
    servicer runs; unary and streaming alike. Health checks pass (see the module docstring).
    `token()` gives the token in force (it changes when the credentials are reloaded)."""

    def __init__(self, token: Callable[[], str]):
        self._token = token

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX) or self._authorized(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        log.warning("refused an unauthenticated call to %s", method)
        handler = continuation(handler_call_details)
        return _refusal(handler)

    def _authorized(self, metadata) -> bool:
        values = [v for k, v in metadata or () if k == AUTH_HEADER]
        if len(values) != 1 or not isinstance(values[0], str):
            return False
        return hmac.compare_digest(_digest(values[0]), _digest(f"Bearer {self._token()}"))


def bearer_matches(header: str, token: str) -> bool:
    """An `authorization` value is `Bearer <token>` (constant time; the HTTP port's check)."""
    return hmac.compare_digest(_digest(header), _digest(f"Bearer {token}"))


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


def _refuse(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token (authorization metadata)")


def _refusal(handler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses; for unknown methods, a unary one
    (an unauthenticated caller learns nothing about which methods exist)."""
    if handler is None:
        return grpc.unary_unary_rpc_method_handler(_refuse)
    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(_refuse, request_deserializer=handler.request_deserializer)


# -- client ------------------------------------------------------------------------------
def channel(address: str, security: ClientSecurity, options=()) -> grpc.Channel:
    """A channel to address: TLS (and a client certificate) when configured, plaintext only to
    loopback unless allowed, the bearer token on every call when one is set, and keepalive
    (`options` may override it)."""
    options = [*CLIENT_KEEPALIVE, *options]
    if security.uses_tls:
        creds = grpc.ssl_channel_credentials(
            root_certificates=security.root_ca,
            private_key=security.private_key,
            certificate_chain=security.cert_chain,
        )
        if security.server_name:
            options.append(("grpc.ssl_target_name_override", security.server_name))
        ch = grpc.secure_channel(address, creds, options=options)
    elif is_loopback(host_of(address)) or security.allow_insecure:
        ch = grpc.insecure_channel(address, options=options)
    else:
        raise SecurityError(
            f"refusing plaintext gRPC to non-loopback address {address}: give --tls-ca (or --tls), "
            "or --allow-insecure on a trusted network"
        )
    if security.token:
        ch = grpc.intercept_channel(ch, BearerToken(security.token))
    return ch


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class BearerToken(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor
):
    """Adds `authorization: Bearer <token>` to every call (works on plaintext loopback channels
    too, where gRPC's call credentials are refused); `token` a string, or a function giving the
    one in force at each call."""

    def __init__(self, token: str | Callable[[], str | None]):
        self._header = (AUTH_HEADER, f"Bearer {token}") if isinstance(token, str) else None
        self._token = token

    def __repr__(self) -> str:
        return "BearerToken(***)"

    def _details(self, d):
        metadata = [*(d.metadata or ()), self._header or (AUTH_HEADER, f"Bearer {self._token()}")]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
