"""The HTTP front door of an orchestrator that serves TLS: its own calls to the gRPC API reach it
whatever names the certificate holds (a host's certificate need not name 127.0.0.1), and after a
reload of the credentials (SIGHUP) its port asks for the new token and hands new connections the
new certificate, as the gRPC port does. The loopback port those calls take asks for the token as
well, and none is opened past client certificates. Real gRPC servers and uvicorn on loopback,
the tiny models; certificates made in the test (tests/certs.py).
"""

from __future__ import annotations

import contextlib
import shutil
import ssl

import grpc
import pytest

from deploy import hosting
from deploy.configs import ModelServiceConfig, OrchestratorConfig
from specdec.serving import security
from specdec.serving.service import make_server
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tests.certs import make_pki
from tests.test_openai_api import http_json

HOST = "specdec.example"  # the only name the server's certificates hold


@contextlib.contextmanager
def front_door(tiny_backends, server_security: security.ServerSecurity):
    """The two model services and an orchestrator serving `server_security`, with its HTTP port."""
    started = [hosting.serve_model(ModelServiceConfig(role), tiny_backends[role]) for role in ("draft", "target")]
    orchestrator = None
    try:
        draft, target = (f"127.0.0.1:{port}" for _, port in started)
        config = OrchestratorConfig(http_port=0, calibration_tokens=0)
        orchestrator = hosting.start_orchestrator(draft, target, config, security=server_security)
        yield orchestrator
    finally:
        if orchestrator is not None:
            orchestrator.stop(None)
        for server, _ in started:
            server.stop(None)


def ask(orchestrator) -> dict:
    """A completion request naming the model the orchestrator serves."""
    return {"model": orchestrator.pair.model_name, "prompt": "hello", "max_tokens": 4}


def trusting(ca_path) -> ssl.SSLContext:
    """A client that trusts `ca_path` and checks the chain, not the name (the certificate names HOST)."""
    context = ssl.create_default_context(cafile=str(ca_path))
    context.check_hostname = False
    return context


def test_https_front_door_with_a_certificate_of_another_name(tiny_backends, tmp_path):
    """Before: its calls went over TLS to 127.0.0.1 and failed the name check, so every request
    but /v1/models answered 503 ('Hostname Verification Check failed')."""
    pki = make_pki(tmp_path, "host", names=(HOST,))
    tls = security.ServerSecurity(cert_chain=pki.read("server_cert"), private_key=pki.read("server_key"), token="t0k")
    with front_door(tiny_backends, tls) as orchestrator:
        url, context = orchestrator.http.url, trusting(pki.ca)
        assert http_json(f"{url}/health", context=context) == (
            200,
            {"status": "ok", "services": {"orchestrator": "SERVING", "draft": "SERVING", "target": "SERVING"}},
        )
        status, reply = http_json(f"{url}/v1/completions", ask(orchestrator), token="t0k", context=context)
        assert status == 200 and reply["choices"][0]["finish_reason"] == "length"
        assert http_json(f"{url}/v1/completions", ask(orchestrator), token="wrong", context=context)[0] == 401
        # The loopback port its calls take asks for the token too.
        hop = orchestrator.server.front_door
        assert hop is not None and hop != f"127.0.0.1:{orchestrator.port}"
        plain = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(hop))
        with pytest.raises(grpc.RpcError) as err:
            plain.Generate(orchestrator_pb2.GenerateRequest(prompt="hi", max_new_tokens=2), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_no_loopback_port_past_client_certificates(tmp_path):
    pki = make_pki(tmp_path, "mtls")
    mtls = security.ServerSecurity(
        cert_chain=pki.read("server_cert"), private_key=pki.read("server_key"), client_ca=pki.read("ca")
    )
    for settings in (mtls, security.ServerSecurity()):  # client certificates; plaintext (the port itself)
        server, _ = make_server("127.0.0.1", 0, security=settings, front_door=True)
        try:
            assert server.front_door is None
        finally:
            server.stop(None)


def test_the_http_port_follows_a_reload(tiny_backends, tmp_path):
    """Before: the HTTP port kept the token and certificate of its start, and its own calls the
    token of the start, which the gRPC port refused after the reload: every request 401 or 503."""
    # for localhost and 127.0.0.1: before, the start served, and the reload is what failed
    old, new = make_pki(tmp_path / "old", "old"), make_pki(tmp_path / "new", "new")
    live = tmp_path / "live"
    live.mkdir()
    files = security.ServerTLSFiles(live / "server.pem", live / "server.key")
    token_file = live / "token"
    shutil.copy(old.server_cert, files.cert), shutil.copy(old.server_key, files.key), token_file.write_text("old-t0k")
    reloading = security.reloadable(lambda: files.load(security.read_token(token_file)))
    with front_door(tiny_backends, reloading) as orchestrator:
        url, body = orchestrator.http.url + "/v1/completions", ask(orchestrator)
        assert http_json(url, body, token="old-t0k", context=trusting(old.ca))[0] == 200

        shutil.copy(new.server_cert, files.cert), shutil.copy(new.server_key, files.key)
        token_file.write_text("new-t0k")
        assert reloading.rotation.reload()
        status, reply = http_json(url, body, token="new-t0k", context=trusting(new.ca))
        assert status == 200, reply
        assert http_json(url, body, token="old-t0k", context=trusting(new.ca))[0] == 401
        url = orchestrator.http.url
        assert http_json(f"{url}/health", context=trusting(new.ca))[1]["status"] == "ok"
        with pytest.raises(OSError):  # a new connection gets the new certificate: the old CA does not sign it
            http_json(f"{url}/health", context=trusting(old.ca))
