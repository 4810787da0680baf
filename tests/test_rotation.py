"""Credentials rotate without a restart: a real orchestrator process serving TLS with a token
re-reads its certificate, key and token file on SIGHUP. Connections made afterwards get the
new certificate and calls need the new token (the old one is refused); a stream started
before the rotation runs to its end on its old connection. A reload that cannot read its
files keeps the credentials in use. Certificates are made in the test (tests/certs.py).

The model services run in this process (plaintext on loopback, slowed so that the stream
outlasts the rotation); the orchestrator runs as `python -m cli orchestrator`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import threading
import time

import grpc
import pytest

from draft_service.server import serve as serve_draft
from specdec.serving.security import ClientSecurity, channel
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from target_service.server import serve as serve_target
from tests.certs import make_pki
from tests.harness import SlowBackend, cli_process, long_request, status_of, wait_until

pytestmark = pytest.mark.slow  # processes started, killed and signalled

Code = grpc.StatusCode


def orchestrator(address: str, ca_path, token: str):
    security = ClientSecurity(root_ca=ca_path.read_bytes(), token=token)
    return orchestrator_pb2_grpc.OrchestratorStub(channel(address, security))


def test_sighup_rotates_certificate_and_token_without_dropping_a_stream(tiny_backends, tmp_path):
    old, new = make_pki(tmp_path / "old", "old"), make_pki(tmp_path / "new", "new")
    old_token, new_token = "old-" + secrets.token_urlsafe(12), "new-" + secrets.token_urlsafe(12)
    live = tmp_path / "live"
    live.mkdir()
    cert, key, token_file = live / "server.pem", live / "server.key", live / "token"
    shutil.copy(old.server_cert, cert), shutil.copy(old.server_key, key), token_file.write_text(old_token)

    draft, draft_port = serve_draft(SlowBackend(tiny_backends["draft"], 0.02))
    target, target_port = serve_target(SlowBackend(tiny_backends["target"], 0.02))
    args = ["orchestrator", "--draft-address", f"127.0.0.1:{draft_port}", "--target-address",
            f"127.0.0.1:{target_port}", "--tls-cert", str(cert), "--tls-key", str(key),
            "--auth-token-file", str(token_file)]  # fmt: skip
    try:
        with cli_process(*args, ready_file=tmp_path / "ready", log=tmp_path / "log") as (proc, address):
            request = long_request(300, speculation=orchestrator_pb2.SpeculationParams(lookahead=1))
            stream = orchestrator(address, old.ca, old_token).GenerateStream(request, timeout=300)
            chunks: list[tuple[float, orchestrator_pb2.GenerateChunk]] = [(time.monotonic(), next(stream))]
            reader = threading.Thread(target=lambda: chunks.extend((time.monotonic(), c) for c in stream))
            reader.start()

            shutil.copy(new.server_cert, cert), shutil.copy(new.server_key, key), token_file.write_text(new_token)
            os.kill(proc.pid, signal.SIGHUP)
            rotated = orchestrator(address, new.ca, new_token)
            assert wait_until(lambda: _serves(rotated), 60, step=0.2), (tmp_path / "log").read_text()
            assert status_of(lambda: orchestrator(address, new.ca, old_token).Generate(long_request(2))).code() == (
                Code.UNAUTHENTICATED
            )
            # A new connection that trusts only the old CA is refused: the new certificate is served.
            err = status_of(lambda: orchestrator(address, old.ca, new_token).Generate(long_request(2), timeout=10))
            assert err.code() == Code.UNAVAILABLE
            rotation_done = time.monotonic()

            token_file.write_text("")  # a reload that cannot read its files keeps what is in use
            os.kill(proc.pid, signal.SIGHUP)
            assert wait_until(lambda: "credentials not reloaded" in (tmp_path / "log").read_text(), 30)
            assert _serves(rotated)

            reader.join(timeout=240)
            assert chunks[-1][0] > rotation_done, "the stream ended before the rotation: make it longer"
            assert chunks[-1][1].finish_reason == "length"
            tokens = [t for _, c in chunks for t in c.token_ids]
            assert tokens == list(rotated.Generate(request, timeout=300).token_ids)
    finally:
        draft.stop(None)
        target.stop(None)


def _serves(stub) -> bool:
    try:
        return stub.Generate(long_request(2), timeout=10).finish_reason == "length"
    except grpc.RpcError:
        return False


def test_serve_reads_the_clients_token_file_again_on_sighup(tmp_path):
    """`specdec serve --auth-token-file F`, then F replaced and SIGHUP: calls need the new token.
    Before, serve handed the orchestrator the token's value at start (in its environment), and
    a SIGHUP re-read only the TLS files: the old token went on opening it, the new one was refused."""
    token_file = tmp_path / "token"
    old_token, new_token = "old-" + secrets.token_urlsafe(12), "new-" + secrets.token_urlsafe(12)
    token_file.write_text(old_token)
    args = ["serve", "--target-model", "standin:1", "--draft-model", "standin:0.2:0.8",
            "--calibration-tokens", "0", "--auth-token-file", str(token_file)]  # fmt: skip
    with cli_process(*args, ready_file=tmp_path / "ready", log=tmp_path / "log") as (proc, address):

        def stub(token: str):
            return orchestrator_pb2_grpc.OrchestratorStub(channel(address, ClientSecurity(token=token)))

        def serves(token: str) -> bool:
            try:
                request = orchestrator_pb2.GenerateRequest(prompt="hi", max_new_tokens=2)
                return stub(token).Generate(request, timeout=30).finish_reason == "length"
            except grpc.RpcError:
                return False

        assert serves(old_token) and not serves(new_token)
        token_file.write_text(new_token)
        os.kill(proc.pid, signal.SIGHUP)
        assert wait_until(lambda: serves(new_token), 30, step=0.2), (tmp_path / "log").read_text()
        request = orchestrator_pb2.GenerateRequest(prompt="hi", max_new_tokens=2)
        assert status_of(lambda: stub(old_token).Generate(request, timeout=30)).code() == Code.UNAUTHENTICATED
        proc.terminate()  # serve stops its services (cli_process's SIGKILL would leave them running)
        assert proc.wait(60) == 0, (tmp_path / "log").read_text()
