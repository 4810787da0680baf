"""specdec on Ray Serve (deploy.ray_serve): a local Ray cluster, tiny random models in real
service actors, one application shared by the tests, deployed as `serve deploy` would deploy
the config file that `specdec ray up --min-replicas 1 --max-replicas 2 --serve-config` writes
(checked against Serve's own schema), with a bearer token at the door. In this order:

- autoscaling: from one pair, Serve adds a second under load; every output exact meanwhile;
- two pairs behind one gRPC and one HTTP address: `status` and GET /health list both replicas
  and their services; two streams at once go to different pairs (the least outstanding), and
  the greedy output through either door, from either pair, is the target's alone; calls
  without the token are refused at the door, a request's own error comes back as it would;
- a pair's replica killed (SIGKILL) mid-generation, while two streams and a unary call run:
  every request finishes with the target's greedy tokens, each streamed token once, and Serve
  starts a replica in its place;
- a pair's target service stopped (SIGSTOP): the replica's watch kills it, Ray restarts it,
  the same tokens served;
- once the load is gone, Serve removes a pair: one left, healthy.
(A test that needs two pairs makes them when an earlier one has not.)

Without a cluster: the config file repeats `up`'s flags (built again from them, the same
config), and opens Serve's plaintext gRPC proxy only on a local cluster or with
--allow-insecure; bad scaling flags are refused naming the flag.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.serve.schema import ServeDeploySchema

from cli import ray as ray_cli
from cli.main import build_parser, main
from deploy import ray_cluster, ray_deploy, ray_serve
from specdec.serving import security
from specdec.serving.security import ClientSecurity
from specdec.v1 import model_pb2, model_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc
from tests.certs import make_pki
from tests.harness import NO_EOS_PROMPT, greedy, wait_until

NAME = "t-serve"
TOKEN = "serve-test-token-0123456789abcdef"
# The model services' own (least privilege: the clients' opens nothing on them). Given to `up` by
# the environment, so that every build of the application from the flags (the config, the
# application, each rescale) gives them the same one; `up` makes one otherwise.
SERVICE_TOKEN = "serve-test-services-0123456789abcdef"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
LONG = 400  # tokens of a request that is still running when a test acts on it (lookahead 1)


@dataclass(frozen=True)
class App:
    config: ray_serve.ServeConfig
    grpc: str
    http: str

    def stub(self):
        return orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(self.grpc))


@pytest.fixture(scope="module")
def app(tiny_models, tmp_path_factory):
    environ = pytest.MonkeyPatch()
    environ.setenv(security.SERVICE_TOKEN_ENV, SERVICE_TOKEN)
    token = tmp_path_factory.mktemp("serve") / "token"
    token.write_text(TOKEN)
    ports = [str(ray_cluster.free_port()), str(ray_cluster.free_port())]
    argv = ["ray", "up", "--name", NAME, "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing", "1"]
    argv += ["--port", ports[0], "--http-port", ports[1]]
    argv += ["--target-model", tiny_models["target"], "--draft-model", tiny_models["draft"]]
    argv += ["--target-dtype", "float32", "--draft-dtype", "float32", "--target-cpus", "0.5", "--draft-cpus", "0.5"]
    argv += ["--auth-token-file", str(token), "--max-concurrent", "4"]
    argv += ["--health-timeout", "6"]  # test_a_hung_service_of_a_pair_is_killed_and_restarted
    args = build_parser().parse_args(argv)
    config = ray_cli.serve_config(args)
    document = ray_serve.config_file(config, ray_cli.config_flags(args, args.up_parser))
    ServeDeploySchema.model_validate(document)  # what `serve deploy` checks first
    cluster = Cluster()
    cluster.add_node(num_cpus=8, include_dashboard=False)
    try:
        ray_deploy.connect(cluster.address)
        # As Serve deploys a config file: the proxies from its top level, the application from its
        # import path and arguments (built here, where the token file is).
        serve.start(**{k: document[k] for k in ("proxy_location", "http_options", "grpc_options")})
        (entry,) = document["applications"]
        module, attr = entry["import_path"].split(":")
        assert (module, attr) == ("cli.ray", "serve_application")
        serve.run(ray_cli.serve_application(entry["args"]), name=entry["name"], route_prefix=entry["route_prefix"])
        app = App(config, f"127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}")
        scale(app)
        yield app
    finally:
        try:
            ray_serve.down(NAME)
        finally:
            ray.shutdown()
            cluster.shutdown()
            environ.undo()


@pytest.fixture(scope="module")
def reference(tiny_backends):
    """The target's greedy continuation of the prompt, in process."""
    return greedy(tiny_backends["target"], NO_EOS_PROMPT, LONG)


def scale(app: App, **replicas) -> None:
    """Rescale the application in place (`replicas`: ServeConfig's fields), with Serve's
    autoscaling quick to add a pair (1 s) and slow to remove one (600 s) unless told otherwise."""
    quick = {"upscale_delay": 1.0, "downscale_delay": 600.0, "metrics_interval": 0.5}
    ray_serve.rescale(replace(app.config, **{**quick, **replicas}))


def running_pairs() -> tuple[int, int]:
    """Pair replicas running, and in any state, as Serve counts them."""
    states = serve.status().applications[NAME].deployments["Pair"].replica_states
    return states.get("RUNNING", 0), sum(states.values())


@pytest.fixture
def two_pairs(app):
    """Two pairs running: as the autoscaling test leaves them, or made so."""
    if running_pairs() != (2, 2):
        scale(app, min_replicas=2)


def request(tokens: int = LONG, lookahead: int = 1) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=NO_EOS_PROMPT),
        max_new_tokens=tokens,
        speculation=orchestrator_pb2.SpeculationParams(lookahead=lookahead),
    )


def pairs() -> list[ray_serve.Replica]:
    return [r for r in ray_serve.status(NAME)[1] if r.actor.role == "pair"]


def target_sessions(replica: ray_serve.Replica) -> int:
    (target,) = [s for s in replica.services if s.role == "target"]
    stub = model_pb2_grpc.TargetServiceStub(security.channel(target.endpoint, ClientSecurity(token=SERVICE_TOKEN)))
    return stub.Describe(model_pb2.DescribeRequest(), timeout=10).open_sessions


def http(url: str, body: dict | None = None, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.slow
def test_autoscaling_adds_a_pair_under_load(app, reference):
    assert wait_until(lambda: running_pairs() == (1, 1), 300, step=0.5), running_pairs()
    stop = threading.Event()
    outputs = []

    def client():
        stub = app.stub()
        while not stop.is_set():
            outputs.append(list(stub.Generate(request(160), metadata=AUTH, timeout=600).token_ids))

    with ThreadPoolExecutor(3) as pool:  # 3 requests in flight, 1 the target a pair: Serve wants 2 pairs
        clients = [pool.submit(client) for _ in range(3)]
        try:
            assert wait_until(lambda: running_pairs() == (2, 2), 300, step=0.5), running_pairs()
        finally:
            stop.set()
        for c in clients:
            c.result(timeout=600)
    assert outputs and all(out == reference[:160] for out in outputs)


@pytest.mark.slow
def test_two_pairs_behind_one_grpc_and_one_http_address(app, two_pairs, reference):
    replicas = pairs()
    assert len(replicas) == 2 and ray_serve.status(NAME)[0] == "RUNNING"
    for r in replicas:
        assert r.actor.state == "ALIVE" and {s.role: s.state for s in r.services} == {
            "draft": "ALIVE",
            "target": "ALIVE",
        }
        assert len({s.node_id for s in r.services}) == 1  # pack: a pair on one node
    code, health = http(app.http + "/health", token=None)
    assert code == 200 and health["status"] == "ok"
    assert sorted(h["replica"] for h in health["replicas"]) == sorted(r.id for r in replicas)
    assert all(h["services"] == {"draft": "SERVING", "target": "SERVING"} for h in health["replicas"])

    stub = app.stub()
    streams, firsts = [], []
    for _ in range(2):  # the second starts once the first runs, and goes to the idle pair
        streams.append(stub.GenerateStream(request(), metadata=AUTH))
        firsts.append(next(streams[-1]))
    assert sorted(target_sessions(r) for r in replicas) == [1, 1]
    for first, stream in zip(firsts, streams, strict=True):
        assert [t for c in [first, *stream] for t in c.token_ids] == reference

    short = request(48, lookahead=3)
    reply = stub.Generate(short, metadata=AUTH)
    assert list(reply.token_ids) == reference[:48] and reply.stats.generated_tokens == 48
    code, completion = http(
        app.http + "/v1/completions", {"model": _model(app), "prompt": NO_EOS_PROMPT, "max_tokens": 48}
    )
    assert code == 200 and completion["choices"][0]["text"] == reply.text
    assert completion["usage"]["completion_tokens"] == 48
    streamed = {"model": _model(app), "prompt": NO_EOS_PROMPT, "max_tokens": 48, "stream": True}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    sse = urllib.request.Request(app.http + "/v1/completions", json.dumps(streamed).encode(), headers)
    with urllib.request.urlopen(sse, timeout=120) as response:
        data = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == reply.text

    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(short, timeout=60)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert http(app.http + "/v1/models", token="wrong")[0] == 401
    # A request's own error comes back from its pair as it would from one orchestrator.
    with pytest.raises(grpc.RpcError) as bad:
        stub.Generate(request(0), metadata=AUTH, timeout=60)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in bad.value.details()
    too_many = {"model": _model(app), "prompt": NO_EOS_PROMPT, "max_tokens": 10**9}  # past the pair's context
    code, error = http(app.http + "/v1/completions", too_many)
    assert code == 400 and error["error"]["param"] == "max_tokens" and "at most" in error["error"]["message"]


def _model(app: App) -> str:
    code, models = http(app.http + "/v1/models")
    assert code == 200
    return models["data"][0]["id"]


@pytest.mark.slow
def test_status_lists_every_replica_and_its_services(app, two_pairs, capsys):
    ray_cli._serve_status(argparse.Namespace(name=NAME, json=True), *ray_serve.status(NAME))
    report = json.loads(capsys.readouterr().out)
    assert report["serve"] == "RUNNING"
    roles = sorted(r["role"] for r in report["replicas"])
    assert roles == ["door", "pair", "pair"]
    for r in report["replicas"]:
        assert r["state"] == "ALIVE" and r["pid"]
        services = {s["role"]: s for s in r["services"]}
        assert set(services) == ({"draft", "target"} if r["role"] == "pair" else set())
        assert all(s["state"] == "ALIVE" and s["endpoint"].startswith("127.0.0.1:") for s in services.values())
    ray_cli._serve_status(argparse.Namespace(name=NAME, json=False), *ray_serve.status(NAME))
    table = capsys.readouterr().out.splitlines()
    assert table[0] == f"deployment {NAME}: Serve application RUNNING, 2 pair replica(s)"
    assert table[1].split() == ["REPLICA", "ROLE", "STATE", "NODE", "NODE", "IP", "ENDPOINT", "PID", "RESTARTS"]
    assert len(table) == 2 + 1 + 2 * 3  # the door; each pair and its two services


@pytest.mark.slow
def test_a_pair_killed_mid_generation_loses_no_request(app, two_pairs, reference):
    stub = app.stub()
    streams = [stub.GenerateStream(request(), metadata=AUTH) for _ in range(2)]
    received = [list(next(s).token_ids) for s in streams]
    with ThreadPoolExecutor(1) as pool:
        unary = pool.submit(stub.Generate, request(), metadata=AUTH)
        replicas = pairs()
        for r in replicas:  # frozen, so that their generations are still running when one dies
            os.kill(r.actor.pid, signal.SIGSTOP)
        try:
            busy = [r for r in replicas if target_sessions(r) > 0]
            assert busy, "no generation was running"
            victim = busy[0]
            os.kill(victim.actor.pid, signal.SIGKILL)
        finally:
            for r in replicas:
                if r is not victim:
                    os.kill(r.actor.pid, signal.SIGCONT)
        for tokens, stream in zip(received, streams, strict=True):
            for chunk in stream:
                tokens += chunk.token_ids
            assert tokens == reference  # each token once, in order
        assert list(unary.result(timeout=600).token_ids) == reference

    # Serve replaces the replica: a new one starts.
    assert wait_until(lambda: len({r.id for r in pairs()} - {r.id for r in replicas}) == 1, 120, step=0.5)
    assert victim.id not in {r.id for r in pairs()}


@pytest.mark.slow
def test_a_hung_service_of_a_pair_is_killed_and_restarted(app, reference):
    """Ray restarts a service actor that dies, not one that hangs: the pair replica's watch
    (deploy.liveness) kills its target once it has answered nothing (SIGSTOP) for the
    deployment's --health-timeout, Ray restarts it, and the deployment serves the same tokens."""

    def serving(replica) -> ray_deploy.ActorStatus | None:
        """Its target once alive: a pair the test before started may still be starting it."""
        target = next((s for s in replica.services if s.role == "target"), None)
        return target if target is not None and target.state == "ALIVE" and target.pid > 0 else None

    assert wait_until(lambda: any(serving(r) for r in pairs()), 180, step=0.5)
    replica = next(r for r in pairs() if serving(r))

    def target() -> ray_deploy.ActorStatus:
        (now,) = [r for r in pairs() if r.id == replica.id]
        return next(s for s in now.services if s.role == "target")

    before = serving(replica)
    assert before.pid > 0  # os.kill(0, ...) would stop this process's own group
    os.kill(before.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: (now := target()).pid != before.pid and now.state == "ALIVE", 180, step=0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(before.pid, signal.SIGCONT)
    assert target().restarts == before.restarts + 1
    assert list(app.stub().Generate(request(), metadata=AUTH, timeout=300).token_ids) == reference


@pytest.mark.slow
def test_autoscaling_removes_a_pair_once_the_load_is_gone(app):
    scale(app, downscale_delay=2.0)
    assert wait_until(lambda: running_pairs() == (1, 1), 300, step=0.5), running_pairs()
    code, health = http(app.http + "/health")
    assert code == 200 and health["status"] == "ok" and len(health["replicas"]) == 1


# -- without a cluster: the config and its file ------------------------------------------------
def up_args(*flags: str):
    return build_parser().parse_args(["ray", "up", *flags])


def test_the_config_file_repeats_the_flags_and_opens_grpc_only_where_plaintext_is_allowed(tmp_path, monkeypatch):
    # The model services' token: made where the application is built unless the environment gives one.
    monkeypatch.setenv(security.SERVICE_TOKEN_ENV, "services-token")
    pki = make_pki(tmp_path, "serve")
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--service-tls-ca", str(pki.ca)]
    remote = ["--address", "auto", "--replicas", "3", "--placement", "spread", *tls, "--service-tls-server-name", "x"]
    for flags, grpc_open in [
        (["--replicas", "2"], True),  # a local cluster: this machine
        (remote, False),  # Serve's gRPC proxy has no TLS
        ([*remote, "--allow-insecure"], True),
    ]:
        args = up_args(*flags)
        config = ray_cli.serve_config(args)
        document = ray_serve.config_file(config, ray_cli.config_flags(args, args.up_parser))
        ServeDeploySchema.model_validate(document)
        assert bool(document["grpc_options"]["grpc_servicer_functions"]) == grpc_open == config.grpc_door
        (app,) = document["applications"]
        again = up_args(*shlex.split(app["args"]["flags"]))
        assert ray_cli.serve_config(again) == config  # the application is built from these flags
    assert document["http_options"]["ssl_certfile"] == str(pki.server_cert)
    assert app["deployments"] == [{"name": "Pair", "num_replicas": 3}]


def test_bad_scaling_flags_are_refused_with_the_flag_named():
    for flags, message in [
        (["--min-replicas", "1"], "--max-replicas"),
        (["--replicas", "0"], "--replicas"),
        (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas <= --max-replicas"),
        (["--replicas", "2", "--target-ongoing", "0"], "--target-ongoing"),
    ]:
        with pytest.raises(ValueError, match=message):
            ray_cli.serve_config(up_args(*flags))
    assert main(["ray", "up", "--serve-config", "x.yaml"]) == 1  # a file of one pair: not a Serve deployment


def test_a_deployment_the_cluster_cannot_place_is_refused_naming_what_it_needs():
    """`ray up --replicas 2` on a 2-CPU cluster (a pair asks 2 CPUs) waited past 5 minutes for Serve
    to schedule it: now refused at once, with what it needs and what the cluster has; so is a pair
    the cluster's sums hold but no node (pack) or no two nodes (spread) can."""
    two = ray_cli.serve_config(up_args("--replicas", "2"))
    with pytest.raises(RuntimeError, match=r"2 pair\(s\): they need 4 CPU \(2 CPU a pair\), the cluster has 2 CPU"):
        ray_serve.check_fits(two, nodes=[{"CPU": 2.0}])
    ray_serve.check_fits(two, nodes=[{"CPU": 4.0}])  # fits
    ray_serve.check_fits(two, nodes=[{"CPU": 2.0}, {"CPU": 2.0}])  # a pair a node
    gpus = ray_cli.serve_config(up_args("--replicas", "1", "--draft-gpus", "1", "--target-gpus", "1"))
    with pytest.raises(RuntimeError, match=r"cannot place a pair: .*no node has both; the cluster has 1 node\(s\)"):
        ray_serve.check_fits(gpus, nodes=[{"CPU": 16.0}])
    big = ray_cli.serve_config(up_args("--replicas", "1", "--target-cpus", "3"))  # 4 CPU in all, 2 a node
    with pytest.raises(RuntimeError, match=r"target 3 CPU with pack .*no node has both.*\[CPU 2\]; \[CPU 2\]"):
        ray_serve.check_fits(big, nodes=[{"CPU": 2.0}, {"CPU": 2.0}])
    ray_serve.check_fits(big, nodes=[{"CPU": 1.0}, {"CPU": 4.0}])
    spread = ray_cli.serve_config(up_args("--replicas", "1", "--placement", "spread"))
    with pytest.raises(RuntimeError, match="with spread .*no two nodes have them; the cluster has 1 node"):
        ray_serve.check_fits(spread, nodes=[{"CPU": 8.0}])
    ray_serve.check_fits(spread, nodes=[{"CPU": 1.0}, {"CPU": 1.0}])
