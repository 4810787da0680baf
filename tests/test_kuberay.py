"""The KubeRay manifests parse, agree with each other and with our CLI, keep Ray's token
authentication on and the dashboard inside the cluster, and name the resources and images
that the README says."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from cli.main import build_parser

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


def test_every_manifest_parses_as_kuberay_v1():
    assert {p.name for p in MANIFESTS} == {"raycluster.yaml", "rayjob.yaml"}
    for doc in docs():
        assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in ("RayCluster", "RayJob"), doc.get("kind")
        assert doc["metadata"]["name"]


def test_cluster_has_token_auth_and_no_exposed_dashboard():
    cluster = one("RayCluster")
    spec = cluster["spec"]
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


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_readme_names_each_resource(kind):
    name = one(kind)["metadata"]["name"]
    assert re.search(rf"\|\s*`{kind}`\s*\|\s*`{re.escape(name)}`", README), f"README's table lacks {kind} {name}"


def test_readme_names_the_images_the_manifests_use():
    cluster = one("RayCluster")["spec"]
    used = {containers(g)[0]["image"] for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]}
    assert set(re.findall(r"rayproject/ray:[\w.\-]+", README)) == used
