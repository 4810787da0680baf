"""`specdec ray up`, then `specdec generate --address`, `ray status` and `ray down`, each a
separate process as a user runs them: a local Ray cluster that `up` starts (token
authentication on) and the embedded default pair (SmolLM2-135M-Instruct). `up` applies the
same limit flags as `serve` (checked with --max-sessions)."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import urllib.request
import uuid

import grpc
import pytest

from deploy import ray_cluster
from specdec.serving import security
from specdec.v1 import model_pb2, model_pb2_grpc
from specdec.weights import models

pytestmark = pytest.mark.real_model


def specdec(*args, env, timeout=600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def assert_max_sessions(endpoint: str, role: str, limit: int, token: str) -> None:
    stub_class = model_pb2_grpc.DraftServiceStub if role == "draft" else model_pb2_grpc.TargetServiceStub
    with pytest.raises(grpc.RpcError) as err:  # least privilege: the services' own token, no other
        bare = stub_class(grpc.insecure_channel(endpoint))
        bare.OpenSession(model_pb2.OpenSessionRequest(session_id="x"), timeout=60)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stub = stub_class(security.channel(endpoint, security.ClientSecurity(token=token)))
    ids = [f"limit-{role}-{i}" for i in range(limit + 1)]
    try:
        for sid in ids[:limit]:
            stub.OpenSession(model_pb2.OpenSessionRequest(session_id=sid, prompt_token_ids=[1, 2, 3]), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            stub.OpenSession(model_pb2.OpenSessionRequest(session_id=ids[-1], prompt_token_ids=[1, 2, 3]), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions 2" in err.value.details()
    finally:
        for sid in ids[:limit]:
            stub.CloseSession(model_pb2.CloseSessionRequest(session_id=sid), timeout=60)


def test_ray_up_then_generate_status_and_down():
    name = f"test-{uuid.uuid4().hex[:8]}"
    # Token auth with a token of our own, so that Ray writes none to ~/.ray.
    env = {**os.environ, "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    # The model services' token, chosen here so that the test can reach them (ray up makes one otherwise).
    service_token = secrets.token_urlsafe(16)
    env[security.SERVICE_TOKEN_ENV] = service_token
    state = models.cache_dir() / "ray" / f"{name}.json"
    try:
        up = specdec(
            "ray",
            "up",
            "--name",
            name,
            "--port",
            "0",
            "--http-port",
            "0",
            "--no-dashboard",
            "--max-sessions",
            "2",
            env=env,
        )
        assert up.returncode == 0, up.stderr
        address = up.stdout.split()[-1]
        assert address.startswith("127.0.0.1:")  # a local cluster's actors serve on loopback

        # The orchestrator actor's HTTP API (orchestrator.openai_api).
        (http_url,) = re.findall(r"OpenAI-compatible API at (http://127\.0\.0\.1:\d+)/v1", up.stderr)
        with urllib.request.urlopen(http_url + "/v1/models", timeout=30) as response:
            (model,) = [m["id"] for m in json.loads(response.read())["data"]]
        body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8}).encode()
        request = urllib.request.Request(http_url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            assert 0 < json.loads(response.read())["usage"]["completion_tokens"] <= 8

        prompt = "Write a haiku about GPUs"
        # a lookahead named: a request alone may run plain rounds where the start timed them faster
        out = specdec(
            "generate", prompt, "--address", address, "--json", "--max-tokens", "24", "--lookahead", "4", env=env
        )
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["text"] and result["token_ids"] and result["stats"]["draft_tokens"] > 0

        status = specdec("ray", "status", "--name", name, "--json", env=env)
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        actors = {a["role"]: a for a in report["actors"]}
        assert report["placement"] == "STRICT_PACK" and set(actors) == {"orchestrator", "draft", "target"}
        assert all(a["state"] == "ALIVE" and a["restarts"] == 0 and a["pid"] for a in actors.values())
        assert actors["orchestrator"]["endpoint"] == address
        assert actors["draft"]["node_id"] == actors["target"]["node_id"]

        # The services were built with `up`'s limits: the third session is refused at once.
        for role in ("draft", "target"):
            assert_max_sessions(actors[role]["endpoint"], role, 2, service_token)

        # The cluster refuses a wrong token (and Ray gives up on it after 2 s instead of 20).
        wrong = {**env, "RAY_AUTH_TOKEN": "0" * 32, "RAY_gcs_rpc_server_connect_timeout_s": "2"}
        refused = specdec("ray", "status", "--name", name, env=wrong, timeout=120)
        assert refused.returncode == 1 and "token is missing or incorrect" in refused.stderr
    finally:
        down = specdec("ray", "down", "--name", name, env=env)
        leftover = ray_cluster.load(state)
        if leftover is not None:  # `down` failed: stop the cluster anyway
            ray_cluster.stop(leftover, state)
    assert down.returncode == 0, down.stderr
    assert f"removed {name}-orchestrator, {name}-draft, {name}-target, {name}-pg" in down.stdout
    assert "stopped the local Ray cluster" in down.stdout and not state.exists()
