"""The environment is read in cli/ only (issue 62): below it, settings arrive as parameters or
module-level settings the command line sets once (cli.options.apply_environment).

The reads left below cli are not configuration, or are a process's entry that has no command line
(a Ray actor, a script of its own): ALLOWED names each with its reason.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import tomllib  # Python 3.11, as tests/test_imports.py
import torch

from cli import options, serving
from deploy.local import LocalPipeline, PipelineConfig
from specdec.runtime import graphs
from specdec.serving import telemetry
from specdec.weights import embedded, models

ROOT = Path(__file__).resolve().parent.parent

# (file, enclosing function) -> why it may read os.environ there.
ALLOWED = {
    ("deploy/local.py", "LocalPipeline._env"): "the children's environment: the parent's, tokens swapped, cache set",
    ("deploy/ray_actors.py", "worker_environment"): "a Ray actor's entry: its worker runs no command line",
    ("deploy/ray_timing.py", "specdec"): "passes the environment on to the `specdec` child it runs",
    ("deploy/ray_timing.py", "main"): "a command line of its own; also Ray's auth variables for its driver",
    ("bench/serve_scaling.py", "run"): "the local Ray cluster's environment and Ray's auth for this driver",
}
READS = {"environ", "environb", "getenv", "getenvb"}


def packages_below_cli() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [p for p in config["tool"]["importlinter"]["root_packages"] if p != "cli"]


def environment_reads(path: Path) -> list[tuple[int, str]]:
    """(line, enclosing function's qualified name) of each os.environ / os.getenv in a module."""
    found = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            scope = [*scope, node.name]
        is_os_attr = (
            isinstance(node, ast.Attribute)
            and node.attr in READS
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        )
        from_os = isinstance(node, ast.ImportFrom) and node.module == "os" and READS & {a.name for a in node.names}
        if is_os_attr or from_os:
            found.append((node.lineno, ".".join(scope) or "<module>"))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(ast.parse(path.read_text(), str(path)), [])
    return found


def test_no_environment_read_below_the_cli():
    seen, unexpected = set(), []
    for package in packages_below_cli():
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, where in environment_reads(path):
                seen.add((rel, where))
                if (rel, where) not in ALLOWED:
                    unexpected.append(f"{rel}:{line} in {where}")
    assert not unexpected, "the environment is read outside cli/ (read it in cli.options, pass it down): " + ", ".join(
        unexpected
    )
    assert not set(ALLOWED) - seen, f"stale ALLOWED entries: {sorted(set(ALLOWED) - seen)}"


def test_the_scan_finds_each_form_of_read(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os\nfrom os import getenv\nA = os.environ.get('X')\n"
        "class C:\n    def f(self):\n        return os.getenv('Y'), dict(os.environ)\n"
    )
    assert environment_reads(source) == [(2, "<module>"), (3, "<module>"), (6, "C.f"), (6, "C.f")]


def test_the_cli_passes_specdec_cache_down(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "_cache", embedded._cache)  # restored after the test
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    options.apply_environment()
    assert embedded.cache_dir() == models.cache_dir() == tmp_path
    monkeypatch.delenv("SPECDEC_CACHE")
    options.apply_environment()
    assert models.cache_dir() == Path.home() / ".cache" / "specdec"  # the default, unchanged
    options.apply_environment({"SPECDEC_CACHE": str(tmp_path / "given")})
    assert models.cache_dir() == tmp_path / "given"


def test_the_library_reads_no_cache_variable(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "_cache", None)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert models.cache_dir() == Path.home() / ".cache" / "specdec"
    embedded.set_cache_dir(tmp_path)
    assert models.cache_dir() == tmp_path


def test_the_cli_passes_specdec_fuse_down(monkeypatch):
    assert options.FUSE_ENV == graphs.FUSE_ENV
    monkeypatch.setattr(graphs, "_fuse", graphs._fuse)
    cuda = torch.device("cuda", 0)
    for value, backend in (("0", ""), ("1", "inductor"), ("aot_eager", "aot_eager")):
        monkeypatch.setenv("SPECDEC_FUSE", value)
        options.apply_environment()
        assert graphs.fuse_backend(cuda) == graphs.fuse_backend(torch.device("cpu")) == backend
    monkeypatch.delenv("SPECDEC_FUSE")
    options.apply_environment()  # unset again: by device
    assert graphs.fuse_backend(torch.device("cpu")) == ""


def test_the_cli_passes_otel_variables_to_telemetry(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "verifier")
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    args = argparse.Namespace(metrics_port=None, host="127.0.0.1")
    t = serving._telemetry(args, "target")
    assert t.config.name == "verifier" and not t.enabled
    t.shutdown()
    off = telemetry.setup("target")  # nothing passed: off, whatever the environment says
    assert off.config.name == "specdec-target" and not off.enabled


def test_local_children_get_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "_cache", tmp_path)
    monkeypatch.setenv("SPECDEC_FUSE", "0")
    pipeline = LocalPipeline(PipelineConfig(), workdir=tmp_path / "work")
    for name in ("draft", "target", "orchestrator"):
        env = pipeline._env(name)
        assert env["SPECDEC_CACHE"] == str(tmp_path) and env["SPECDEC_FUSE"] == "0"  # the rest inherited


def test_a_child_command_line_reads_specdec_cache_again(tmp_path):
    """`python -m cli` (each child of deploy.local) sets its cache from its own environment: `ray status`
    finds the (unreadable) state file under $SPECDEC_CACHE, not under the default cache."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "env-test.json").write_text("not json")
    cmd = [sys.executable, "-m", "cli", "ray", "status", "--name", "env-test"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "SPECDEC_CACHE": str(tmp_path)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 1 and out.stderr.startswith("specdec: error: Expecting value"), out.stderr
    del env["SPECDEC_CACHE"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 1 and "no local cluster started" in out.stderr, out.stderr
