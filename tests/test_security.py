"""TLS, mutual TLS and bearer tokens on every gRPC link, with certificates made in the test:
the right credentials pass; a wrong CA, a missing or foreign client certificate, plaintext, and
a missing or wrong token are refused on every method of all three services, unary and
streaming, before any servicer runs. Also the loopback-only rule for plaintext, and the CLI
(services, client, load test) with TLS and tokens through three real processes."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys

import grpc
import pytest
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cli import main as cli
from deploy.local import LocalPipeline, PipelineConfig
from draft_service.server import serve as serve_draft
from orchestrator.server import connect
from orchestrator.server import serve as serve_orchestrator
from specdec.serving import security
from specdec.serving.security import ClientSecurity, SecurityError, ServerSecurity, ServerTLSFiles
from specdec.serving.service import CHANNEL_OPTIONS, make_server
from specdec.v1 import model_pb2, model_pb2_grpc, orchestrator_pb2
from specdec.weights.models import ModelSpec
from target_service.server import serve as serve_target
from tests.certs import make_pki

TOKEN = "tok-" + secrets.token_urlsafe(16)
WRONG_TOKEN = "wrong-" + secrets.token_urlsafe(8)
Code = grpc.StatusCode

SERVICES = {
    "draft": model_pb2.DESCRIPTOR.services_by_name["DraftService"],
    "target": model_pb2.DESCRIPTOR.services_by_name["TargetService"],
    "orchestrator": orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"],
}
# Requests that would change state if they ran: a refused one must leave no trace.
REQUESTS = {
    "OpenSession": model_pb2.OpenSessionRequest(session_id="intruder", prompt_token_ids=[3, 4, 5]),
    "Generate": orchestrator_pb2.GenerateRequest(prompt="hi", max_new_tokens=4),
    "GenerateStream": orchestrator_pb2.GenerateRequest(prompt="hi", max_new_tokens=4),
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    return {"good": make_pki(root / "good", "good"), "rogue": make_pki(root / "rogue", "rogue")}


def server_security(pki, **overrides) -> ServerSecurity:
    good = pki["good"]
    fields = dict(
        cert_chain=good.read("server_cert"),
        private_key=good.read("server_key"),
        client_ca=good.read("ca"),
        token=TOKEN,
    )
    return ServerSecurity(**{**fields, **overrides})


def client_security(pki, **overrides) -> ClientSecurity:
    good = pki["good"]
    fields = dict(
        root_ca=good.read("ca"), cert_chain=good.read("client_cert"), private_key=good.read("client_key"), token=TOKEN
    )
    return ClientSecurity(**{**fields, **overrides})


@pytest.fixture(scope="module")
def secured(tiny_backends, pki):
    """Draft, target and orchestrator, each requiring mTLS and the token; the orchestrator
    reaches the services with its own client certificate and the token."""
    sec = server_security(pki)
    servers, addresses = [], {}
    try:
        for name, serve in (("draft", serve_draft), ("target", serve_target)):
            server, port = serve(tiny_backends[name], security=sec)
            servers.append(server)
            addresses[name] = f"127.0.0.1:{port}"
        pair = connect(addresses["draft"], addresses["target"], wait_seconds=30, security=client_security(pki))
        server, port = serve_orchestrator(pair, security=sec)
        servers.append(server)
        addresses["orchestrator"] = f"127.0.0.1:{port}"
        yield addresses
    finally:
        for server in servers:
            server.stop(None)


def call(channel: grpc.Channel, method) -> grpc.StatusCode:
    """Call `method` (a protobuf MethodDescriptor) with its request in REQUESTS or an empty
    one; the status code it ends with."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    request = REQUESTS.get(method.name) or GetMessageClass(method.input_type)()
    serialize = type(request).SerializeToString
    try:
        if method.client_streaming:  # the step streams: one message, then read to the end
            assert method.server_streaming, method.name
            list(channel.stream_stream(path, request_serializer=serialize)(iter([request]), timeout=30))
        elif method.server_streaming:
            list(channel.unary_stream(path, request_serializer=serialize)(request, timeout=30))
        else:
            channel.unary_unary(path, request_serializer=serialize)(request, timeout=30)
    except grpc.RpcError as err:
        return err.code()
    return Code.OK


def statuses(addresses, security_for_call: ClientSecurity) -> dict[str, grpc.StatusCode]:
    out = {}
    for name, service in SERVICES.items():
        with security.channel(addresses[name], security_for_call, CHANNEL_OPTIONS) as ch:
            for method in service.methods:
                out[f"{name}.{method.name}"] = call(ch, method)
    return out


STUBS = {"draft": model_pb2_grpc.DraftServiceStub, "target": model_pb2_grpc.TargetServiceStub}


def open_sessions(pki, addresses, name: str) -> int:
    with security.channel(addresses[name], client_security(pki), CHANNEL_OPTIONS) as ch:
        return STUBS[name](ch).Describe(model_pb2.DescribeRequest(), timeout=10).open_sessions


REFUSALS = {
    "no token": (lambda pki: {"token": None}, Code.UNAUTHENTICATED),
    "wrong token": (lambda pki: {"token": WRONG_TOKEN}, Code.UNAUTHENTICATED),
    "wrong CA": (lambda pki: {"root_ca": pki["rogue"].read("ca")}, Code.UNAVAILABLE),
    "no client certificate": (lambda pki: {"cert_chain": None, "private_key": None}, Code.UNAVAILABLE),
    "client certificate from another CA": (
        lambda pki: {"cert_chain": pki["rogue"].read("client_cert"), "private_key": pki["rogue"].read("client_key")},
        Code.UNAVAILABLE,
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_on_every_method(secured, pki, case):
    overrides, expected = REFUSALS[case]
    got = statuses(secured, client_security(pki, **overrides(pki)))
    assert len(got) == sum(len(s.methods) for s in SERVICES.values()) >= 19
    assert got == dict.fromkeys(got, expected)
    for name in ("draft", "target"):  # no servicer ran: the intruder's session was never opened
        assert open_sessions(pki, secured, name) == 0


def test_plaintext_to_a_tls_server_is_refused(secured):
    got = statuses(secured, ClientSecurity(token=TOKEN))  # loopback, so the client allows plaintext
    assert got == dict.fromkeys(got, Code.UNAVAILABLE)


def test_the_right_credentials_pass_on_every_method(secured, pki):
    got = statuses(secured, client_security(pki))
    refused = {m: c for m, c in got.items() if c in (Code.UNAUTHENTICATED, Code.UNAVAILABLE)}
    assert not refused
    assert got["draft.OpenSession"] == got["target.OpenSession"] == Code.OK
    assert got["orchestrator.Generate"] == got["orchestrator.GenerateStream"] == Code.OK
    for name in ("draft", "target"):
        with security.channel(secured[name], client_security(pki), CHANNEL_OPTIONS) as ch:
            STUBS[name](ch).CloseSession(model_pb2.CloseSessionRequest(session_id="intruder"))
        assert open_sessions(pki, secured, name) == 0


@pytest.mark.usefixtures("draft_awaited")
def test_generation_through_the_secured_chain(secured, pki):
    """Client -mTLS+token-> orchestrator -mTLS+token-> draft and target."""
    from specdec.v1 import orchestrator_pb2_grpc

    with security.channel(secured["orchestrator"], client_security(pki), CHANNEL_OPTIONS) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        request = orchestrator_pb2.GenerateRequest(prompt="hello world", max_new_tokens=16)
        unary = stub.Generate(request, timeout=60)
        chunks = list(stub.GenerateStream(request, timeout=60))
    assert len(unary.token_ids) == 16 and unary.stats.draft_tokens > 0
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)


def test_health_needs_no_token_but_does_need_tls(secured, pki):
    for name, address in secured.items():
        with security.channel(address, client_security(pki, token=None)) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
        with security.channel(address, ClientSecurity()) as ch:
            with pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert err.value.code() == Code.UNAVAILABLE, name


def test_the_token_is_never_echoed_or_logged(secured, pki, caplog):
    caplog.set_level(logging.DEBUG)
    with security.channel(secured["orchestrator"], client_security(pki, token=WRONG_TOKEN)) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary("/specdec.v1.Orchestrator/Generate")(b"", timeout=10)
    assert err.value.code() == Code.UNAUTHENTICATED and "bearer token" in err.value.details()
    assert "refused an unauthenticated call" in caplog.text
    for secret in (TOKEN, WRONG_TOKEN):
        assert secret not in err.value.details() and secret not in caplog.text
        assert secret not in repr(server_security(pki, token=secret)) + repr(client_security(pki, token=secret))
        assert secret not in repr(security.BearerToken(secret))
    assert pki["good"].read("client_key").decode() not in repr(client_security(pki))


def test_unknown_methods_are_refused_before_they_are_looked_up(secured, pki):
    for token, expected in ((None, Code.UNAUTHENTICATED), (TOKEN, Code.UNIMPLEMENTED)):
        with security.channel(secured["target"], client_security(pki, token=token)) as ch:
            with pytest.raises(grpc.RpcError) as err:
                ch.unary_unary("/specdec.v1.TargetService/NoSuchMethod")(b"", timeout=10)
            assert err.value.code() == expected


def test_orchestrator_refuses_services_it_cannot_trust(secured, pki):
    with pytest.raises(grpc.RpcError) as err:
        connect(secured["draft"], secured["target"], wait_seconds=10, security=client_security(pki, token=WRONG_TOKEN))
    assert err.value.code() == Code.UNAUTHENTICATED
    wrong_ca = client_security(pki, root_ca=pki["rogue"].read("ca"))
    with pytest.raises(ConnectionError, match="over TLS"):
        connect(secured["draft"], secured["target"], wait_seconds=2, security=wrong_ca)


def test_tls_without_client_certificates(tiny_backends, pki):
    good = pki["good"]
    server, port = serve_draft(
        tiny_backends["draft"], security=ServerSecurity(good.read("server_cert"), good.read("server_key"))
    )
    address = f"127.0.0.1:{port}"
    try:
        for client, expected in (
            (ClientSecurity(root_ca=good.read("ca")), Code.OK),
            (ClientSecurity(root_ca=good.read("ca"), server_name="localhost"), Code.OK),
            (ClientSecurity(root_ca=pki["rogue"].read("ca")), Code.UNAVAILABLE),
            (ClientSecurity(), Code.UNAVAILABLE),  # plaintext
        ):
            with security.channel(address, client) as ch:
                assert call(ch, SERVICES["draft"].methods_by_name["Describe"]) == expected
    finally:
        server.stop(None)


# -- the plaintext rule and the settings -------------------------------------------------
@pytest.mark.parametrize(
    "host, loopback",
    [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.7", False), ("example.com", False)],
)  # fmt: skip
def test_is_loopback(host, loopback):
    assert security.is_loopback(host) is loopback
    address = f"[{host.strip('[]')}]:50051" if ":" in host else f"{host}:50051"
    assert security.is_loopback(security.host_of(address)) is loopback


def test_plaintext_only_on_loopback_unless_allowed(pki):
    with pytest.raises(SecurityError, match="--allow-insecure"):
        make_server("0.0.0.0", 0)
    for sec in (ServerSecurity(allow_insecure=True), server_security(pki)):  # allowed, or TLS
        server, port = make_server("0.0.0.0", 0, security=sec)
        assert port > 0
        server.stop(None)
    with pytest.raises(SecurityError, match="--allow-insecure"):
        security.channel("10.0.0.7:50051", ClientSecurity(token=TOKEN))
    for address, client in (
        ("10.0.0.7:50051", ClientSecurity(allow_insecure=True)),
        ("10.0.0.7:50051", ClientSecurity(tls=True)),
        ("localhost:50051", ClientSecurity()),
    ):
        security.channel(address, client).close()  # no connection is made until a call


def test_settings_are_checked(tmp_path):
    with pytest.raises(SecurityError, match="private key"):
        ServerSecurity(cert_chain=b"x")
    with pytest.raises(SecurityError, match="needs TLS"):
        ServerSecurity(client_ca=b"x")
    with pytest.raises(SecurityError, match="private key"):
        ClientSecurity(cert_chain=b"x")
    for bad in ("", "two words", "caf\u00e9", "tab\there"):
        with pytest.raises(SecurityError, match="printable ASCII"):
            ServerSecurity(token=bad)
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    assert security.read_token(token_file, "from-env") == TOKEN  # the file wins
    assert security.read_token(None, "from-env\n") == "from-env"
    assert security.read_token(None, "") is None and security.read_token(None, None) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SecurityError, match="is empty"):
        security.read_token(tmp_path / "empty")
    with pytest.raises(SecurityError, match="cannot read"):
        security.read_token(tmp_path / "missing")
    with pytest.raises(SecurityError, match="cannot read"):
        security.read_pem(tmp_path / "missing.pem")
    files = ServerTLSFiles(cert=tmp_path / "c.pem", client_ca=tmp_path / "ca.pem")
    assert files.flags() == ["--tls-cert", str(tmp_path / "c.pem"), "--tls-client-ca", str(tmp_path / "ca.pem")]


def test_cli_refuses_plaintext_on_a_network_address(capsys):
    """Before any model loads or process starts: one line, exit 1."""
    for argv in (
        ["orchestrator", "--host", "0.0.0.0", "--target-address", "127.0.0.1:1"],
        ["draft-service", "--host", "0.0.0.0", "--model", "/nonexistent"],
        ["target-service", "--host", "10.1.2.3", "--model", "/nonexistent"],
        ["serve", "--host", "0.0.0.0", "--target-model", "/nonexistent"],
    ):
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("specdec: error: refusing to serve plaintext") and err.count("\n") == 1, argv
    assert cli.main(["generate", "hi", "--address", "192.0.2.1:50051"]) == 1
    assert "refusing plaintext gRPC to non-loopback address 192.0.2.1:50051" in capsys.readouterr().err


# -- the CLI through three processes -------------------------------------------------------
def run_cli(*args: str, env_token: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_") or k == "SPECDEC_CACHE"}
    if env_token:
        env[security.TOKEN_ENV] = env_token
    cmd = [sys.executable, "-m", "cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_cli_services_client_and_loadtest_with_mtls_and_token(tiny_models, pki, tmp_path):
    good = pki["good"]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    config = PipelineConfig(
        target=ModelSpec(tiny_models["target"], "cpu", "float32"),
        draft=ModelSpec(tiny_models["draft"], "cpu", "float32"),
        tls=ServerTLSFiles(good.server_cert, good.server_key, good.ca),
        auth_token=TOKEN,
    )
    with LocalPipeline(config, log=lambda msg: None) as p:
        tls = [
            "--address",
            p.address,
            "--tls-ca",
            good.ca,
            "--tls-cert",
            good.client_cert,
            "--tls-key",
            good.client_key,
        ]

        out = run_cli("generate", "hello", "--raw", "--json", "--max-tokens", "8", *tls, env_token=TOKEN)
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)["token_ids"]) == 8

        for token_flags in ([], ["--auth-token-file", tmp_path / "wrong"]):
            (tmp_path / "wrong").write_text(WRONG_TOKEN)
            out = run_cli("generate", "hello", *tls, *token_flags)
            assert out.returncode == 1 and out.stderr.startswith("specdec: error: UNAUTHENTICATED: ")
            assert "Traceback" not in out.stderr and WRONG_TOKEN not in out.stderr and TOKEN not in out.stderr

        # the model services are on loopback and require a token of their own: the clients' opens nothing
        assert p.addresses["draft"].startswith("127.0.0.1:") and p.addresses["target"].startswith("127.0.0.1:")
        assert p.service_token and p.service_token != TOKEN
        for role in ("draft", "target"):
            for token in (None, TOKEN):
                with security.channel(p.addresses[role], ClientSecurity(token=token)) as ch:
                    for method in ("OpenSession", "Describe"):
                        assert call(ch, SERVICES[role].methods_by_name[method]) == Code.UNAUTHENTICATED
            with security.channel(p.addresses[role], ClientSecurity(token=p.service_token)) as ch:
                assert call(ch, SERVICES[role].methods_by_name["Describe"]) == Code.OK

        load = ["loadtest", *tls, "--max-tokens", "8", "--json"]
        out = run_cli(*load, "--requests", "6", "--concurrency", "3", env_token=TOKEN)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert (report["completed"], report["errors"], report["not_started"]) == (6, 0, 0)
        assert 0 < report["generated_tokens"] <= 6 * 8 and report["tokens_per_second"] > 0
        assert 0 < report["latency_p50_seconds"] <= report["latency_p99_seconds"] <= report["wall_seconds"]

        out = run_cli(*load, "--requests", "4", "--concurrency", "2", env_token=WRONG_TOKEN)
        assert out.returncode == 1
        report = json.loads(out.stdout)
        assert report["errors_by_code"] == {"UNAUTHENTICATED": 4} and report["completed"] == 0
        assert report["latency_p50_seconds"] is None

        # a time limit too short for any generation cuts the run: every request is accounted for
        out = run_cli(*load, "--requests", "8", "--concurrency", "2", "--time-limit", "0.001", env_token=TOKEN)
        report = json.loads(out.stdout)
        assert out.returncode == 1 and report["completed"] < 8
        assert report["completed"] + report["errors"] + report["not_started"] == 8

        out = run_cli(*load[:-1], "--auth-token-file", token_file, "--requests", "2", "--concurrency", "2")  # text
        assert out.returncode == 0, out.stderr
        assert "completed 2, errors 0" in out.stdout and "p50" in out.stdout and "p99" in out.stdout


@pytest.mark.slow  # an orchestrator process stopped, killed and restarted
def test_a_hung_orchestrator_serving_mtls_is_found_on_its_health_socket_and_restarted(tiny_models, pki):
    """An orchestrator serving mutual TLS is probed on a Unix socket in the pipeline's folder, which
    answers health checks and refuses anything else, a call with the clients' token too; stopped
    (SIGSTOP), it is killed and restarted, and serves over mutual TLS again. (Before, an orchestrator
    serving TLS was not probed: it stayed hung.)"""
    from deploy.local import RestartPolicy
    from specdec.v1 import orchestrator_pb2_grpc

    good = pki["good"]
    config = PipelineConfig(
        target=ModelSpec(tiny_models["target"], "cpu", "float32"),
        draft=ModelSpec(tiny_models["draft"], "cpu", "float32"),
        tls=ServerTLSFiles(good.server_cert, good.server_key, good.ca),
        auth_token=TOKEN,
        restart=RestartPolicy(unresponsive=3.0),
        calibration_tokens=0,
        start_timeout=120,
    )
    request = orchestrator_pb2.GenerateRequest(prompt="hello", max_new_tokens=8)
    lines: list[str] = []
    with LocalPipeline(config, log=lines.append) as p:
        secured = orchestrator_pb2_grpc.OrchestratorStub(security.channel(p.address, client_security(pki)))
        before = list(secured.Generate(request, timeout=120).token_ids)
        socket_path = p.workdir / "orchestrator-health.sock"
        assert oct(p.workdir.stat().st_mode & 0o777) == "0o700"  # this user's only
        with grpc.insecure_channel(f"unix:{socket_path}") as ch:
            check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            bearer = [("authorization", f"Bearer {TOKEN}")]
            for method in (stub.Generate, stub.Describe):
                with pytest.raises(grpc.RpcError) as refused:
                    method(
                        REQUESTS["Generate"] if method is stub.Generate else model_pb2.DescribeRequest(),
                        metadata=bearer,
                        timeout=10,
                    )
                assert refused.value.code() == Code.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.GenerateStream(REQUESTS["GenerateStream"], metadata=bearer, timeout=10))
            assert refused.value.code() == Code.PERMISSION_DENIED
        frozen = p.serving_pid("orchestrator", 10)
        os.kill(frozen, signal.SIGSTOP)
        try:
            p.serving_pid("orchestrator", 120, exclude={frozen})
        finally:
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert p.restarts["orchestrator"] == 1
        assert f"specdec: the orchestrator service (pid {frozen}) answered no health check for 3 s; killing it" in lines
        secured = orchestrator_pb2_grpc.OrchestratorStub(security.channel(p.address, client_security(pki)))
        assert list(secured.Generate(request, timeout=120).token_ids) == before
