"""specdec on Ray: a real Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster),
tiny random models in real service actors.

- placement: `spread` puts draft and target on different nodes and `pack` on one, as Ray's
  own node ids say; generation works end to end through the orchestrator actor (the spread
  deployment with mutual TLS and a token on all its links, the packed one in plaintext,
  allowed explicitly); plaintext on the cluster network is refused unless allowed;
- fault tolerance: killing the target actor, and separately the draft actor, between two
  rounds of a greedy generation (a random round, 5 trials each) gives exactly the tokens of
  an uninterrupted run (the target waited for, the draft not: rounds went on without it), and
  the actor did restart (new pid, one more restart in Ray's table);
- a stream through the orchestrator actor, whose target is killed mid-generation, delivers
  each token once, in order;
- a target actor that hangs (stopped: alive, its port open) is killed by the orchestrator's
  watch and restarted by Ray, and serves the same tokens; so is a hung orchestrator, by the
  target's watch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import ray
from ray.cluster_utils import Cluster

from deploy import liveness, ray_deploy
from deploy.configs import ModelServiceConfig, OrchestratorConfig
from deploy.ray_actors import actor_endpoint
from orchestrator.loop import LoopConfig, SpeculativeLoop
from orchestrator.server import connect
from specdec.decoding.sampling import SamplingParams
from specdec.serving import security
from specdec.serving.security import ClientSecurity, SecurityError, ServerSecurity
from specdec.v1 import model_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights.models import ModelSpec
from tests.certs import make_pki
from tests.harness import greedy, wait_until

pytestmark = pytest.mark.slow  # a Ray cluster

PROMPT = [1, 10, 7, 14, 14, 17, 39]
INSECURE = ClientSecurity(allow_insecure=True)  # plaintext to the node's address, allowed
NEW_TOKENS = 40
TRIALS = 3


def two_nodes() -> Cluster:
    """Two Ray nodes on this machine (each its own raylet and node id)."""
    c = Cluster()
    try:
        c.add_node(num_cpus=3, include_dashboard=False)
        c.add_node(num_cpus=3)
    except BaseException:
        c.shutdown()
        raise
    return c


@pytest.fixture(scope="module")
def cluster():
    """The two-node cluster; the driver connected in the specdec namespace."""
    try:
        c = two_nodes()
    except Exception:  # noqa: BLE001 - Ray's bare Exception when a node misses its 30 s to register:
        c = two_nodes()  # a machine busy with other work can; once more (a setup failure, not a finding)
    try:
        ray_deploy.connect(c.address)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


PLAINTEXT = {"server_security": ServerSecurity(allow_insecure=True), "service_security": INSECURE}


def config(
    tiny_models, name, placement, health_timeout=liveness.UNRESPONSIVE_SECONDS, prices_every=None, **security_settings
):
    every = {} if prices_every is None else {"orchestrator": OrchestratorConfig(prices_every=prices_every)}
    return ray_deploy.RayDeployConfig(
        name=name,
        target=ModelServiceConfig("target", ModelSpec(tiny_models["target"], "cpu", "float32")),
        draft=ModelServiceConfig("draft", ModelSpec(tiny_models["draft"], "cpu", "float32")),
        placement=placement,
        port=0,
        placement_timeout=60,
        start_timeout=300,
        health_timeout=health_timeout,
        **every,
        **(security_settings or PLAINTEXT),
    )


@pytest.fixture(scope="module")
def packed(cluster, tiny_models):
    # A service silent for 6 s is killed (test_a_hung_service_actor_is_killed_and_restarted)
    # Its prices are written every second: a target restarted by an earlier test holds them again
    deployment = ray_deploy.up(config(tiny_models, "t-pack", "pack", health_timeout=6.0, prices_every=1.0))
    try:
        yield deployment
    finally:
        ray_deploy.down(deployment.name)


@pytest.fixture(scope="module")
def reference(tiny_backends):
    """The target's greedy continuation of PROMPT, in process (what the pipeline must produce)."""
    return greedy(tiny_backends["target"], PROMPT, NEW_TOKENS)


def request(max_new_tokens: int = NEW_TOKENS) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=PROMPT),
        max_new_tokens=max_new_tokens,
        speculation=orchestrator_pb2.SpeculationParams(lookahead=3),
    )


def orchestrator(address: str, client: ClientSecurity = INSECURE):
    return orchestrator_pb2_grpc.OrchestratorStub(security.channel(address, client))


def by_role(name: str) -> dict[str, ray_deploy.ActorStatus]:
    return {s.role: s for s in ray_deploy.status(name)}


def test_spread_places_draft_and_target_on_different_nodes(cluster, tiny_models, reference, tmp_path):
    pki = make_pki(tmp_path, "ray")  # the server certificate names localhost: checked by that name
    token = "t" * 32
    server = ServerSecurity(
        cert_chain=pki.read("server_cert"), private_key=pki.read("server_key"), client_ca=pki.read("ca"), token=token
    )
    client = ClientSecurity(
        root_ca=pki.read("ca"),
        cert_chain=pki.read("client_cert"),
        private_key=pki.read("client_key"),
        server_name="localhost",
        token=token,
    )
    deployment = ray_deploy.up(
        config(tiny_models, "t-spread", "spread", server_security=server, service_security=client)
    )
    try:
        actors = by_role(deployment.name)
        node_ids = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(node_ids) == 2
        assert actors["draft"].node_id in node_ids and actors["target"].node_id in node_ids
        assert actors["draft"].node_id != actors["target"].node_id
        assert ray_deploy.placement(deployment.name) == "STRICT_SPREAD"
        reply = orchestrator(deployment.address, client).Generate(request())
        assert list(reply.token_ids) == reference and reply.stats.draft_tokens > 0
        no_certificate = ClientSecurity(root_ca=pki.read("ca"), server_name="localhost", token=token)
        with pytest.raises(grpc.RpcError) as refused:  # mutual TLS: no client certificate, no call
            orchestrator(deployment.address, no_certificate).Generate(request(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        removed = ray_deploy.down(deployment.name)
    assert set(removed) == {"t-spread-orchestrator", "t-spread-draft", "t-spread-target", "t-spread-pg"}
    assert all(s.state == "ABSENT" for s in ray_deploy.status("t-spread")) and not ray_deploy.placement("t-spread")


def test_plaintext_on_the_cluster_network_must_be_allowed(tiny_models):
    with pytest.raises(SecurityError, match="--allow-insecure"):
        config(tiny_models, "t-refused", "pack", server_security=ServerSecurity(), service_security=INSECURE)
    with pytest.raises(SecurityError, match="--service-tls-ca"):
        config(tiny_models, "t-refused", "pack", server_security=ServerSecurity(allow_insecure=True))
    # A cluster that is this one machine binds loopback, where plaintext is fine.
    assert config(tiny_models, "t-local", "pack", server_security=ServerSecurity(), loopback=True).loopback


@pytest.mark.parametrize(
    ("placement", "target_cpus", "why"),
    [("pack", 2.5, "no node has both"), ("spread", 4.0, "no two nodes have them")],  # two nodes of 3 CPUs
)
def test_a_pair_the_cluster_cannot_hold_is_refused_at_once(cluster, tiny_models, placement, target_cpus, why):
    """Refused before anything is created, naming what it needs and what the cluster has (Ray
    would wait the placement timeout for it, saying nothing)."""
    big = dataclasses.replace(
        config(tiny_models, "t-big", placement), target_resources=ray_deploy.Resources(cpus=target_cpus)
    )
    refusal = f"target {target_cpus:g} CPU with {placement} .*: {why}; the cluster has 2 node"
    with pytest.raises(RuntimeError, match=refusal):
        ray_deploy.up(big)
    assert ray_deploy.status("t-big") == [ray_deploy.ActorStatus(role, "ABSENT") for role in ray_deploy.ROLES]
    assert ray_deploy.placement("t-big") == ""  # no placement group either


def test_pack_places_both_on_one_node(packed, reference):
    actors = by_role(packed.name)
    assert actors["draft"].node_id == actors["target"].node_id
    assert {a.state for a in actors.values()} == {"ALIVE"}
    assert ray_deploy.placement(packed.name) == "STRICT_PACK"
    # the orchestrator is on the head node and serves where `up` said
    head = next(n["NodeID"] for n in ray.nodes() if ray_deploy.HEAD_RESOURCE in n["Resources"])
    assert actors["orchestrator"].node_id == head and actors["orchestrator"].endpoint == packed.address
    reply = orchestrator(packed.address).Generate(request())
    assert list(reply.token_ids) == reference


def test_a_second_up_with_the_same_name_is_refused(packed, tiny_models):
    with pytest.raises(RuntimeError, match="already up"):
        ray_deploy.up(config(tiny_models, packed.name, "pack"))
    assert by_role(packed.name)["orchestrator"].state == "ALIVE"  # and the first one is untouched


def kill(name: str, role: str) -> ray_deploy.ActorStatus:
    """Kill the actor (Ray may restart it); return once its process is gone."""
    before = by_role(name)[role]
    ray.kill(ray.get_actor(ray_deploy.actor_name(name, role)), no_restart=False)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{before.pid}").exists() and "State:\tZ" not in _proc_status(before.pid):
        assert time.monotonic() < deadline, f"the {role} actor (pid {before.pid}) did not die"
        time.sleep(0.05)
    return before


def _proc_status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def driver_pair(packed):
    """The orchestrator's stubs, in the test process, reaching the services through their actors."""
    draft, target = (ray.get_actor(ray_deploy.actor_name(packed.name, role)) for role in ("draft", "target"))
    return connect(actor_endpoint(draft), actor_endpoint(target), security=INSECURE)


@pytest.mark.usefixtures("draft_awaited")
@pytest.mark.parametrize("trial", range(TRIALS))
@pytest.mark.parametrize("role", ["target", "draft"])
def test_killed_service_actor_mid_generation(packed, driver_pair, reference, role, trial):
    config = LoopConfig(sampling=SamplingParams(), max_new_tokens=NEW_TOKENS, lookahead=3)
    health = driver_pair.health
    assert health[0].wait(up=True, timeout=60)  # a draft killed by the previous case is back
    uninterrupted = SpeculativeLoop(driver_pair.draft, driver_pair.target, PROMPT, config, health=health)
    rounds = list(uninterrupted.rounds())
    # A round after which the killed service is called again (the last rounds may not draft).
    candidates = [i for i in range(len(rounds) - 1) if role == "target" or rounds[i + 1].proposed > 0]
    kill_after = random.Random(f"{role}-{trial}").choice(candidates)
    loop = SpeculativeLoop(driver_pair.draft, driver_pair.target, PROMPT, config, health=health)
    before = None
    for i, _ in enumerate(loop.rounds()):
        if i == kill_after:
            before = kill(packed.name, role)
    assert loop.generated == uninterrupted.generated == reference, f"killed after round {kill_after}"
    if role == "target":  # waited for, and the round re-run
        assert loop.stats.recoveries >= 1
    else:  # not waited for: the rounds went on without it, exactly
        assert loop.stats.rounds_without_draft >= 1
    assert wait_until(lambda: by_role(packed.name)[role].state == "ALIVE", 60)  # Ray restarts it
    after = by_role(packed.name)[role]
    assert after.restarts >= before.restarts + 1 and after.pid != before.pid
    assert after.node_id == before.node_id  # back in its placement group bundle


def test_stream_survives_a_target_kill_mid_generation(packed):
    # A channel without keepalive pings: this client must not give up on the orchestrator while
    # the test holds it frozen (a client with specdec's keepalive drops a peer silent for 3 s).
    stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(packed.address))
    long = request(max_new_tokens=400)
    long.speculation.lookahead = 1  # many rounds: the generation is far from done when frozen
    expected = list(stub.Generate(long).token_ids)
    host = ray.get_actor(ray_deploy.actor_name(packed.name, "orchestrator"))
    reopens = ray.get(host.reopens.remote())
    orchestrator_pid = by_role(packed.name)["orchestrator"].pid
    stream = stub.GenerateStream(long)
    chunks = [next(stream)]
    # Freeze the orchestrator mid-generation, kill the target, let the orchestrator go on.
    os.kill(orchestrator_pid, signal.SIGSTOP)
    try:
        kill(packed.name, "target")
    finally:
        os.kill(orchestrator_pid, signal.SIGCONT)
    chunks += list(stream)
    assert [t for c in chunks for t in c.token_ids] == expected  # each token once, in order
    assert chunks[-1].finish_reason == "length" and len(expected) == 400
    assert ray.get(host.reopens.remote())["target"] > reopens["target"]  # the target's session was re-opened


def test_a_hung_service_actor_is_killed_and_restarted(packed, reference):
    """Ray restarts an actor that dies, not one that hangs: the orchestrator's watch
    (deploy.liveness) kills the target actor once it has answered nothing (SIGSTOP: alive, its
    port open) for the deployment's health_timeout, Ray restarts it, and the deployment serves
    the same greedy tokens on it."""
    handle = ray.get_actor(ray_deploy.actor_name(packed.name, "target"))

    def target() -> ray_deploy.ActorStatus:  # from Ray's table: asks nothing of the frozen actor
        return ray_deploy.describe(handle, "target", {}, endpoint=False)

    assert wait_until(lambda: target().state == "ALIVE" and target().pid > 0, 120)  # os.kill(0) stops our group
    before = target()
    os.kill(before.pid, signal.SIGSTOP)
    try:
        stopped = ray_deploy.describe(handle, "target", {}, probe_seconds=1)  # `ray status` asks it its endpoint
        assert stopped.pid != before.pid or (stopped.answering is False and "not answering" in stopped.shown_state)
        assert wait_until(lambda: (now := target()).pid != before.pid and now.state == "ALIVE", 120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(before.pid, signal.SIGCONT)
    assert not Path(f"/proc/{before.pid}").exists() or "State:\tZ" in _proc_status(before.pid)
    assert target().restarts == before.restarts + 1
    assert list(orchestrator(packed.address).Generate(request(), timeout=120).token_ids) == reference


def test_a_hung_orchestrator_actor_is_killed_and_restarted(packed, reference):
    """The same for the orchestrator, watched from the target's host (under `ray up` nothing else
    would): stopped, it is killed and restarted (on a port of its own: the deployment's is 0), and
    serves the same greedy tokens. The last test of the packed deployment: its address moved."""
    assert wait_until(lambda: by_role(packed.name)["orchestrator"].pid > 0, 120)  # os.kill(0) stops our group
    before = by_role(packed.name)["orchestrator"]
    priced = orchestrator(before.endpoint).Describe(model_pb2.DescribeRequest(), timeout=30).pricing
    os.kill(before.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: (now := by_role(packed.name)["orchestrator"]).pid != before.pid and now.endpoint, 180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(before.pid, signal.SIGCONT)
    after = by_role(packed.name)["orchestrator"]
    assert after.state == "ALIVE" and after.restarts == before.restarts + 1
    # priced as the first start priced the pair: its measurements waited in the target's actor
    again = orchestrator(after.endpoint).Describe(model_pb2.DescribeRequest(), timeout=30).pricing
    assert not priced.carried_over and again.carried_over and again.lookahead > 0
    assert list(orchestrator(after.endpoint).Generate(request(), timeout=120).token_ids) == reference


def test_a_driver_connected_by_specdec_keeps_its_sigterm_handler(cluster):
    """ray.init replaces the process's SIGTERM handler (here with its own exit; in `specdec ray
    bench` the driver aborted with a stack dump and no `finally` ran: its local cluster was left
    running); connect() keeps the process's own, so the command unwinds."""
    code = (
        "import signal, sys, time; from deploy import ray_deploy; "
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); "
        f"ray_deploy.connect({cluster.address!r}); print('connected', flush=True); time.sleep(120)"
    )
    root = Path(__file__).resolve().parents[1]
    driver = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "connected"
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(60) == 143
    finally:
        driver.kill()
        driver.wait()
