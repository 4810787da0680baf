"""The KubeRay manifests parse, agree with each other and with our CLI, keep Ray's token
authentication on and the dashboard inside the cluster, and name the resources and images
that the README says. The RayService's Serve config is the one `specdec ray up --serve-config`
writes for its flags (regenerated here), secured the same way, on GPU workers that fit its
largest number of pairs."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cli import ray as ray_cli
from cli.main import build_parser
from deploy import ray_serve
from tests.certs import make_pki

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kuberay").glob("*.yaml"))
README = (ROOT / "README.md").read_text()


def docs() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def one(kind: str) -> dict:
    found = [d for d in docs() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def cluster_specs() -> list[dict]:
    """The RayCluster's spec and the RayService's cluster."""
    return [one("RayCluster")["spec"], one("RayService")["spec"]["rayClusterConfig"]]


def test_every_manifest_parses_as_kuberay_v1():
    assert {p.name for p in MANIFESTS} == {"raycluster.yaml", "rayjob.yaml", "rayservice.yaml"}
    for doc in docs():
        assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in ("RayCluster", "RayJob", "RayService"), doc["kind"]
        assert doc["metadata"]["name"]


@pytest.mark.parametrize("spec", cluster_specs(), ids=["RayCluster", "RayService"])
def test_cluster_has_token_auth_and_no_exposed_dashboard(spec):
    assert spec["authOptions"]["mode"] == "token"
    major, minor, *_ = (int(x) for x in spec["rayVersion"].split("."))
    assert (major, minor) >= (2, 52), "token authentication needs Ray 2.52 or newer"
    head = spec["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP" and head.get("enableIngress", False) is False
    for doc in docs():  # nothing that reaches outside the cluster
        assert doc["kind"] not in ("Ingress", "Route", "Gateway")
        assert "NodePort" not in str(doc) and "LoadBalancer" not in str(doc)
    for group in [head, *spec["workerGroupSpecs"]]:
        image = containers(group)[0]["image"]
        assert image.startswith("rayproject/ray:" + spec["rayVersion"]), image


def test_gpu_workers_fit_the_job():
    cluster, job = one("RayCluster"), one("RayJob")
    (workers,) = cluster["spec"]["workerGroupSpecs"]
    gpus = int(containers(workers)[0]["resources"]["limits"]["nvidia.com/gpu"])
    assert int(workers["rayStartParams"]["num-gpus"]) == gpus and workers["replicas"] >= 1
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["specdec", "ray", "up"]
    args = build_parser().parse_args(argv[1:])  # our own CLI accepts the job's command
    assert args.address == "auto" and args.name == cluster["metadata"]["name"]
    if args.placement == "spread":  # one service per host
        assert workers["replicas"] >= 2 and max(args.draft_gpus, args.target_gpus) <= gpus
    else:  # both on one host
        assert args.draft_gpus + args.target_gpus <= gpus
    head_ports = {p["name"]: p["containerPort"] for p in containers(cluster["spec"]["headGroupSpec"])[0]["ports"]}
    assert head_ports["specdec"] == args.port and not args.orchestrator_anywhere  # served from the head


def test_specdec_links_use_tls_and_a_token_from_secrets():
    head = one("RayCluster")["spec"]["headGroupSpec"]
    container = containers(head)[0]
    args = build_parser().parse_args(shlex.split(one("RayJob")["spec"]["entrypoint"])[1:])
    assert not args.allow_insecure and args.service_tls_ca and args.service_tls_server_name
    secret_volumes = {v["name"]: v["secret"]["secretName"] for v in head["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: secret_volumes[m["name"]] for m in container["volumeMounts"]}
    for path in (args.tls_cert, args.tls_key, args.service_tls_ca):  # files the driver reads in the head pod
        assert str(path.parent) in mounts, path
    env = {e["name"]: e for e in container["env"]}
    assert env["SPECDEC_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]  # the token, from a Secret
    for secret in {*mounts.values(), env["SPECDEC_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]}:
        assert f"`{secret}`" in README, f"README does not say how to create the Secret {secret}"


def test_job_runs_on_the_cluster_with_specdec_installed():
    cluster, job = one("RayCluster"), one("RayJob")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert f"specdec=={version}" in runtime_env["pip"]


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob", "RayService"])
def test_readme_names_each_resource(kind):
    name = one(kind)["metadata"]["name"]
    assert re.search(rf"\|\s*`{kind}`\s*\|\s*`{re.escape(name)}`", README), f"README's table lacks {kind} {name}"


def test_readme_names_the_images_the_manifests_use():
    used = {containers(g)[0]["image"] for c in cluster_specs() for g in [c["headGroupSpec"], *c["workerGroupSpecs"]]}
    assert set(re.findall(r"rayproject/ray:[\w.\-]+", README)) == used


# -- the RayService ---------------------------------------------------------------------------
def serve_config() -> dict:
    return yaml.safe_load(one("RayService")["spec"]["serveConfigV2"])


def service_flags():
    (app,) = serve_config()["applications"]
    return build_parser().parse_args(["ray", "up", *shlex.split(app["args"]["flags"])])


def test_rayservice_serves_the_config_that_specdec_writes(tmp_path):
    document = serve_config()
    ServeDeploySchema.model_validate(document)  # what KubeRay hands to Serve
    (app,) = document["applications"]
    # The same flags, with the Secrets' files made here, give the same config file.
    pki = make_pki(tmp_path, "kuberay")
    (tmp_path / "token").write_text("t" * 32)
    files = {
        "/etc/specdec/tls/tls.crt": pki.server_cert,
        "/etc/specdec/tls/tls.key": pki.server_key,
        "/etc/specdec/tls/ca.crt": pki.ca,
        "/etc/specdec/auth/token": tmp_path / "token",
    }
    flags = app["args"]["flags"]
    for mounted, here in files.items():
        flags = flags.replace(mounted, str(here))
    args = build_parser().parse_args(
        ["ray", "up", *shlex.split(flags), "--runtime-env", json.dumps(app["runtime_env"])]
    )
    written = json.dumps(ray_serve.config_file(ray_cli.serve_config(args), ray_cli.config_flags(args, args.up_parser)))
    for mounted, here in files.items():
        written = written.replace(str(here), mounted)
    assert json.loads(written) == document


def test_rayservice_keeps_tls_and_the_token_and_fits_its_pairs():
    spec = one("RayService")["spec"]["rayClusterConfig"]
    args = service_flags()
    assert args.address == "auto" and not args.allow_insecure  # so Serve's plaintext gRPC proxy stays closed
    assert serve_config()["grpc_options"]["grpc_servicer_functions"] == []
    assert args.tls_cert and args.tls_key and args.service_tls_ca and args.service_tls_server_name
    assert args.auth_token_file
    http = serve_config()["http_options"]
    assert (http["ssl_certfile"], http["ssl_keyfile"]) == (str(args.tls_cert), str(args.tls_key))
    head = spec["headGroupSpec"]
    ports = {p["name"]: p["containerPort"] for p in containers(head)[0]["ports"]}
    assert ports["serve"] == http["port"] == args.http_port
    for group in [head, *spec["workerGroupSpecs"]]:  # the application is built, and pairs run, on any pod
        volumes = {v["name"]: v["secret"]["secretName"] for v in group["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in containers(group)[0]["volumeMounts"]}
        for path in (args.tls_cert, args.tls_key, args.service_tls_ca, args.auth_token_file):
            assert str(path.parent) in mounts, (group.get("groupName", "head"), path)
        for secret in mounts.values():
            assert f"`{secret}`" in README, f"README does not say how to create the Secret {secret}"
    (workers,) = spec["workerGroupSpecs"]
    gpus = int(containers(workers)[0]["resources"]["limits"]["nvidia.com/gpu"])
    assert int(workers["rayStartParams"]["num-gpus"]) == gpus and spec["enableInTreeAutoscaling"]
    per_pair = 2 if args.placement == "spread" else 1  # hosts a pair takes
    assert max(args.draft_gpus, args.target_gpus) <= gpus
    assert workers["minReplicas"] >= per_pair * args.min_replicas
    assert workers["maxReplicas"] >= per_pair * args.max_replicas
