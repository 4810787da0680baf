"""Telemetry end to end: the three services as separate processes (tiny models) export OTLP to a
real OTLP/gRPC receiver started here and serve Prometheus endpoints; one Generate; then the one
trace, the scraped metrics and the OTLP metrics are checked against the response's stats.

The services are stopped (SIGTERM) before the checks, with export delays far longer than the
test, so what the receiver holds arrived through the shutdown flush.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.local import LocalPipeline, PipelineConfig
from specdec.serving import telemetry
from specdec.v1 import model_pb2, model_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.weights.models import ModelSpec
from tests.harness import service_channel
from tests.otlp import OtlpReceiver

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"orchestrator": "specdec-orchestrator", "draft": "specdec-draft", "target": "specdec-target"}
SERVER, CLIENT = 2, 3  # OTLP span kinds
SIDE_PROMPT = [3, 4, 5, 6, 7]
# Sampling with this seed runs to max_new_tokens with rejections, so every RPC kind appears.
# Sequential rounds: the span structure and counts checked below are those of one Propose then
# one Score a round (overlapped rounds add the next round's Propose inside the same round span).
REQUEST = orchestrator_pb2.GenerateRequest(
    prompt="hello world",
    max_new_tokens=24,
    sampling=model_pb2.SamplingParams(temperature=0.7),
    seed=5,
    speculation=orchestrator_pb2.SpeculationParams(lookahead=3, overlap=False),
)


def scrape(address: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} from a Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`; fails if there is none."""
    hits = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert hits, f"no sample {name} {labels} among {sorted({n for n, _ in samples})}"
    return sum(hits)


@pytest.fixture(scope="module")
def observed(tiny_models):
    with OtlpReceiver() as receiver:
        env = {
            "OTEL_SERVICE_NAME": "",  # the default names, whatever the outer environment says
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "600000",
            "OTEL_METRIC_EXPORT_INTERVAL": "600000",
        }
        config = PipelineConfig(
            target=ModelSpec(tiny_models["target"], "cpu", "float32"),
            draft=ModelSpec(tiny_models["draft"], "cpu", "float32"),
            metrics_port=0,
            start_timeout=180,
            calibration_tokens=0,  # the services' metrics count this request's calls alone
            drafter="model",  # a forward per draft token (the default hybrid's index rounds run none)
        )
        pipeline = LocalPipeline(config, log=lambda *_: None)
        try:
            with pytest.MonkeyPatch.context() as mp:  # the children inherit it
                for key, value in env.items():
                    mp.setenv(key, value)
                pipeline.start()
            channel = service_channel(pipeline.addresses["draft"], pipeline.service_token)
            draft = model_pb2_grpc.DraftServiceStub(channel)
            draft.OpenSession(model_pb2.OpenSessionRequest(session_id="side", prompt_token_ids=SIDE_PROMPT))
            side = scrape(pipeline.metrics_addresses["draft"])
            draft.CloseSession(model_pb2.CloseSessionRequest(session_id="side"))
            stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipeline.address))
            response = stub.Generate(REQUEST, timeout=120)
            scraped = {name: scrape(address) for name, address in pipeline.metrics_addresses.items()}
            # Stop them here, with time to spare on a busy machine (pipeline.stop() kills after 10 s).
            for proc in pipeline.procs.values():
                proc.send_signal(signal.SIGTERM)
            exit_codes = {name: proc.wait(timeout=120) for name, proc in pipeline.procs.items()}
        finally:
            pipeline.stop()
        yield SimpleNamespace(
            stats=response.stats,
            finish_reason=response.finish_reason,
            side=side,
            scraped=scraped,
            exit_codes=exit_codes,
            receiver=receiver,
        )


@pytest.mark.slow
def test_the_request_ran_many_rounds_and_services_exited_cleanly(observed):
    s = observed.stats
    assert observed.finish_reason == "length" and s.generated_tokens == 24
    assert s.rounds >= 4 and 0 < s.accepted_tokens < s.draft_tokens  # accepts and rejects both happen
    assert observed.exit_codes == {"draft": 0, "target": 0, "orchestrator": 0}  # SIGTERM -> flush -> exit 0


def check_one_trace(spans, stats) -> None:
    """The Generate request is one trace: Generate -> a span per round -> the round's calls
    (client) -> the same calls in the draft / target (server) -> forward passes."""
    (root,) = [s for s in spans if s.name == "/specdec.v1.Orchestrator/Generate"]
    assert root.service == SERVICES["orchestrator"] and root.parent_id == "" and root.kind == SERVER
    assert root.attributes["specdec.rounds"] == stats.rounds
    trace = [s for s in spans if s.trace_id == root.trace_id]
    assert {s.service for s in trace} == set(SERVICES.values())
    children = {}
    for s in trace:
        children.setdefault(s.parent_id, []).append(s)

    rounds = sorted((s for s in trace if s.name == "specdec.round"), key=lambda s: s.attributes["specdec.round"])
    assert len(rounds) == stats.rounds  # one round span per round in the stats
    assert [r.attributes["specdec.round"] for r in rounds] == list(range(1, stats.rounds + 1))
    assert all(r.parent_id == root.span_id and r.service == SERVICES["orchestrator"] for r in rounds)
    assert sum(r.attributes["specdec.proposed"] for r in rounds) == stats.draft_tokens
    assert sum(r.attributes["specdec.accepted"] for r in rounds) == stats.accepted_tokens
    assert sum(len(r.attributes["specdec.tokens"]) for r in rounds) == stats.generated_tokens
    session = rounds[0].attributes["specdec.session_id"]
    # Broken propagation would start new traces in the services: every span of the session is here.
    assert all(s.trace_id == root.trace_id for s in spans if s.attributes.get("specdec.session_id") == session)

    row_fetches, opened = 0, []
    for r in rounds:
        proposed, accepted = r.attributes["specdec.proposed"], r.attributes["specdec.accepted"]
        calls = [c for c in children.get(r.span_id, []) if c.kind == CLIENT]
        expected = ["Score"] + ["Propose"] * (proposed > 0) + ["ProposalRow"] * (accepted < proposed)
        names = [c.name.rsplit("/", 1)[-1] for c in calls]
        opened += [(r.attributes["specdec.round"], c.name) for c in calls if c.name.endswith("/OpenSession")]
        assert sorted(n for n in names if n != "OpenSession") == sorted(expected)
        row_fetches += "ProposalRow" in expected
        for client in calls:
            method = client.name.rsplit("/", 1)[-1]
            assert client.service == SERVICES["orchestrator"]
            (server,) = children[client.span_id]  # the server span in the called service, child of the call
            assert server.kind == SERVER and server.name == client.name
            assert server.service == SERVICES["draft" if "DraftService" in client.name else "target"]
            assert server.attributes["specdec.session_id"] == session
            forwards = [s for s in children.get(server.span_id, []) if s.name == "specdec.forward"]
            if method == "Propose":
                assert len(forwards) == proposed and server.attributes["specdec.k"] == proposed
            elif method == "Score":
                assert len(forwards) == 1 and forwards[0].attributes["specdec.logits"] == proposed + 1
    assert row_fetches > 0  # sampling rejected some drafts: the draft row was fetched
    # The first round opens the target's session (its prefill gives the first token); the draft's
    # opens in a round after it (orchestrator.loop's First token).
    assert sorted("DraftService" in name for _, name in opened) == [False, True]
    assert all(round_ == 1 for round_, name in opened if "TargetService" in name)


@pytest.mark.slow
def test_one_request_is_one_trace_with_rounds_parenting_draft_and_target_spans(observed):
    check_one_trace(observed.receiver.spans, observed.stats)


@pytest.mark.slow
def test_prometheus_metrics_agree_with_the_response(observed):
    s, orch = observed.stats, observed.scraped["orchestrator"]
    draft, target = observed.scraped["draft"], observed.scraped["target"]
    approx = lambda x: pytest.approx(x, rel=1e-6, abs=1e-9)  # noqa: E731 - sums of the same floats, reordered

    assert metric(orch, "specdec_round_accepted_length_count") == s.rounds
    assert metric(orch, "specdec_round_accepted_length_sum") == approx(s.mean_accepted_length * s.rounds)
    assert metric(orch, "specdec_round_duration_seconds_count") == s.rounds
    assert metric(orch, "specdec_draft_tokens_total") == s.draft_tokens
    assert metric(orch, "specdec_accepted_tokens_total") == s.accepted_tokens
    assert metric(orch, "specdec_generated_tokens_total") == s.generated_tokens
    assert metric(orch, "specdec_request_acceptance_rate_sum") == approx(s.acceptance_rate)
    assert metric(orch, "specdec_request_tokens_per_second_sum") == approx(s.tokens_per_second)
    assert metric(orch, "specdec_request_duration_seconds_sum") == approx(s.wall_seconds)
    assert metric(orch, "specdec_draft_duration_seconds_sum") == approx(s.draft_seconds)
    assert metric(orch, "specdec_verify_duration_seconds_sum") == approx(s.target_seconds)
    assert metric(orch, "specdec_verify_duration_seconds_count") == s.rounds
    assert metric(orch, "specdec_requests_active") == 0
    assert metric(orch, "specdec_requests_queued") == metric(orch, "specdec_requests_refused_total") == 0
    assert metric(orch, "specdec_requests_max_concurrent") >= 1
    assert metric(target, "specdec_builds_after_ready_total") == metric(draft, "specdec_builds_after_ready_total") == 0
    assert metric(orch, "specdec_service_available", specdec_service="draft") == 1
    assert metric(orch, "specdec_service_available", specdec_service="target") == 1

    # Each Score: the target's own time plus the wire time fit in what the orchestrator waited.
    assert metric(target, "specdec_rpc_server_duration_seconds_count", rpc_method="Score") == s.rounds
    assert metric(orch, "specdec_rpc_wire_duration_seconds_count", rpc_method="Score") == s.rounds
    score_server = metric(target, "specdec_rpc_server_duration_seconds_sum", rpc_method="Score")
    score_wire = metric(orch, "specdec_rpc_wire_duration_seconds_sum", rpc_method="Score")
    assert 0 < score_server and 0 < score_wire and score_server + score_wire <= s.target_seconds
    # Only the last round may skip the draft (one token left); the orchestrator saw each Propose.
    proposes = metric(draft, "specdec_rpc_server_duration_seconds_count", rpc_method="Propose")
    assert proposes in (s.rounds - 1, s.rounds)
    assert metric(orch, "specdec_draft_duration_seconds_count") == proposes
    # Draft: a forward per draft token, plus the prefills of the request and of the side session.
    assert metric(draft, "specdec_forward_duration_seconds_count") == s.draft_tokens + 2
    assert metric(target, "specdec_forward_duration_seconds_count") == s.rounds + 1  # prefill + one per round
    assert metric(target, "specdec_forward_tokens_total") >= s.prompt_tokens - 1 + s.generated_tokens

    for samples in (draft, target):  # the request's sessions are closed and their caches freed
        assert metric(samples, "specdec_sessions_active") == 0 and metric(samples, "specdec_kv_tokens") == 0
    # The prefix cache: every session's prompt counted, none long enough to reuse (a block is 16
    # tokens); the request's closed cache kept (its prompt and most of its tokens: a block's worth).
    assert metric(target, "specdec_prefix_prompt_tokens_total") == s.prompt_tokens
    # The draft's session opens after the first token, with it (orchestrator.loop's First token).
    assert metric(draft, "specdec_prefix_prompt_tokens_total") == s.prompt_tokens + 1 + len(SIDE_PROMPT)
    assert metric(target, "specdec_prefix_hit_tokens_total") == metric(draft, "specdec_prefix_hit_tokens_total") == 0
    assert metric(target, "specdec_prefix_kept_tokens") >= s.prompt_tokens
    # While the side session was open: one session, its prompt but the last token cached.
    assert metric(observed.side, "specdec_sessions_active", specdec_role="draft") == 1
    assert metric(observed.side, "specdec_kv_tokens", specdec_role="draft") == len(SIDE_PROMPT) - 1


@pytest.mark.slow
def test_otlp_metrics_arrive_and_agree(observed):
    s, receiver = observed.stats, observed.receiver

    def last(service: str, name: str):
        exports = receiver.metrics(SERVICES[service], name)
        assert exports, f"{service} exported no {name}"
        return exports[-1]

    def number(point) -> float:
        return getattr(point, point.WhichOneof("value"))  # as_int or as_double

    (generated,) = last("orchestrator", "specdec.generated.tokens").sum.data_points
    assert number(generated) == s.generated_tokens
    (length,) = last("orchestrator", "specdec.round.accepted_length").histogram.data_points
    assert length.count == s.rounds and length.sum == pytest.approx(s.mean_accepted_length * s.rounds)
    scores = [
        p for p in last("target", "specdec.rpc.server.duration").histogram.data_points
        if {a.key: a.value.string_value for a in p.attributes}.get("rpc.method") == "Score"
    ]  # fmt: skip
    assert len(scores) == 1 and scores[0].count == s.rounds
    assert number(last("draft", "specdec.forward.tokens").sum.data_points[0]) > 0


def test_in_process_stream_and_bad_input_keep_the_metrics_straight(tiny_backends):
    """Three Telemetry objects in one process (each its own registry and endpoint): a streamed
    request, then a refused one. Nothing leaks, and the stream's stats agree with the metrics."""
    from draft_service.server import serve as serve_draft
    from orchestrator.server import connect
    from orchestrator.server import serve as serve_orchestrator
    from target_service.server import serve as serve_target

    tels = {
        role: telemetry.start(telemetry.TelemetryConfig(role, metrics=("prometheus",), metrics_port=0))
        for role in SERVICES
    }
    servers = []
    try:
        servers.append(serve_draft(tiny_backends["draft"], telemetry=tels["draft"]))
        servers.append(serve_target(tiny_backends["target"], telemetry=tels["target"]))
        (_, draft_port), (_, target_port) = servers
        pair = connect(f"127.0.0.1:{draft_port}", f"127.0.0.1:{target_port}", telemetry=tels["orchestrator"])
        servers.append(serve_orchestrator(pair, telemetry=tels["orchestrator"]))
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{servers[-1][1]}"))
        chunks = list(stub.GenerateStream(REQUEST))
        stats = chunks[-1].stats
        bad = orchestrator_pb2.GenerateRequest(prompt="x", speculation=orchestrator_pb2.SpeculationParams(lookahead=99))
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        orch = scrape(tels["orchestrator"].metrics_address)
        assert metric(orch, "specdec_requests_active") == 0
        assert metric(orch, "specdec_request_duration_seconds_count") == 1  # the refused request made no stats
        assert metric(orch, "specdec_generated_tokens_total") == stats.generated_tokens
        assert stats.generated_tokens == sum(len(c.token_ids) for c in chunks)
        assert metric(orch, "specdec_round_accepted_length_count") == stats.rounds
        for role in ("draft", "target"):
            samples = scrape(tels[role].metrics_address)
            assert metric(samples, "specdec_sessions_active") == 0
            assert not any(name.startswith("specdec_round") for name, _ in samples)  # each its own registry
    finally:
        for server, _ in servers:
            server.stop(None)
        addresses = [t.metrics_address for t in tels.values()]
        for t in tels.values():
            t.shutdown()
    for address in addresses:  # the endpoints are closed
        with pytest.raises(OSError):
            scrape(address)


def test_local_pipeline_gives_each_process_its_prometheus_port(monkeypatch):
    """OTEL_METRICS_EXPORTER=prometheus under `specdec serve` (which passes the environment on):
    the three processes each bound OTEL_EXPORTER_PROMETHEUS_PORT, and the second to start failed
    ("cannot serve metrics on 127.0.0.1:9464: Address already in use"). Each gets its own port,
    laid out as --metrics-port's."""
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp,prometheus")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "9600")
    pipeline = LocalPipeline(PipelineConfig(), log=lambda *_: None)
    ports = {name: pipeline._metrics_args(name) for name in ("orchestrator", "target", "draft")}
    assert ports == {
        name: ["--metrics-port", str(port)]
        for name, port in (("orchestrator", 9600), ("target", 9601), ("draft", 9602))
    }
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    assert pipeline._metrics_args("draft") == []  # none asked


def test_config_from_the_standard_variables():
    env = {
        "OTEL_TRACES_EXPORTER": "otlp,console",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc",
    }
    c = telemetry.TelemetryConfig.from_env("draft", env, metrics_port=0)
    assert c.name == "specdec-draft" and c.traces == ("otlp", "console") and c.metrics == ("prometheus",)
    assert (c.traces_protocol, c.metrics_protocol, c.metrics_port) == ("http/protobuf", "grpc", 0)
    c = telemetry.TelemetryConfig.from_env("target", {"OTEL_SERVICE_NAME": "verifier"})
    assert c.name == "verifier" and c.traces == c.metrics == () and c.metrics_port is None
    c = telemetry.TelemetryConfig.from_env("target", {"OTEL_METRICS_EXPORTER": "prometheus"})
    assert c.metrics_port == 9464  # the standard default port
    c = telemetry.TelemetryConfig.from_env(
        "target", {"OTEL_METRICS_EXPORTER": "otlp,prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "9600"}
    )
    assert (c.metrics, c.metrics_port) == (("otlp", "prometheus"), 9600)
    for bad in ({"OTEL_TRACES_EXPORTER": "jaeger"}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}):
        with pytest.raises(ValueError):
            telemetry.TelemetryConfig.from_env("draft", bad)
    with pytest.raises(ValueError):
        telemetry.TelemetryConfig("sidecar")


def test_telemetry_off_adds_nothing():
    off = telemetry.start(telemetry.TelemetryConfig("target"))
    backend, channel = object(), grpc.insecure_channel("127.0.0.1:1")
    assert not off.enabled and off.server_interceptors() == [] and off.metrics_address is None
    assert off.backend(backend) is backend and off.channel(channel) is channel
    chunks = iter([])
    assert off.requests(chunks) is chunks
    off.shutdown()
    channel.close()


def test_a_bad_otel_setting_is_one_error_line():
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "zipkin"}
    cmd = [sys.executable, "-m", "cli", "orchestrator", "--port", "0", "--target-address", "127.0.0.1:1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("specdec: error: OTEL_TRACES_EXPORTER: unknown exporter 'zipkin'")


@pytest.mark.slow
def test_services_as_ray_actors_join_the_trace(tiny_models, monkeypatch, tmp_path_factory):
    """Draft and target hosted in Ray actors the way any host does it: telemetry.setup(role, environ=...) in the
    actor (OTEL_* from the runtime_env), serve(..., telemetry=...), and stop() = server stop then
    telemetry.shutdown() before the actor goes (ray.kill would lose the unflushed spans)."""
    ray = pytest.importorskip("ray")
    from orchestrator.server import connect
    from orchestrator.server import serve as serve_orchestrator

    class ServiceActor:
        def __init__(self, role: str, model: str):
            from deploy import hosting
            from deploy.configs import ModelServiceConfig
            from specdec.serving import telemetry

            self.telemetry = telemetry.setup(role, environ=os.environ)  # the actor's: OTEL_* from the runtime_env
            drafter = {"drafter": "model"} if role == "draft" else {}  # a forward per draft token
            config = ModelServiceConfig(role, ModelSpec(model, "cpu", "float32"), **drafter)
            self.server, self.port = hosting.start_model_service(config, telemetry=self.telemetry)

        def address(self) -> str:
            return f"127.0.0.1:{self.port}"

        def stop(self) -> None:
            self.server.stop(grace=5).wait()
            self.telemetry.shutdown()

    with OtlpReceiver() as receiver:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "600000",
            "OTEL_METRICS_EXPORTER": "none",
        }
        for key, value in env.items():  # the orchestrator, in this process
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
        # A cluster of its own ("local"), in a folder of its own: never another one on this machine.
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=100 * 1024 * 1024,
            _temp_dir=str(tmp_path_factory.mktemp("ray")),
            runtime_env={"env_vars": {**env, "PYTHONPATH": str(ROOT)}},
        )
        orchestrator = telemetry.setup("orchestrator", environ=os.environ)
        try:
            remote = ray.remote(ServiceActor)
            actors = {role: remote.remote(role, tiny_models[role]) for role in ("draft", "target")}
            addresses = {role: ray.get(a.address.remote(), timeout=300) for role, a in actors.items()}
            pair = connect(addresses["draft"], addresses["target"], telemetry=orchestrator)
            server, port = serve_orchestrator(pair, telemetry=orchestrator)
            try:
                stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
                stats = stub.Generate(REQUEST, timeout=120).stats
            finally:
                server.stop(None)
            ray.get([a.stop.remote() for a in actors.values()], timeout=60)
        finally:
            orchestrator.shutdown()
            ray.shutdown()
        check_one_trace(receiver.spans, stats)
