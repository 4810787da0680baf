"""Run draft, target and orchestrator as three local processes on free loopback ports.

Each child is `python -m cli <service> --port 0 --ready-file F`; it binds a free
port and writes {"address": ...} to F once it serves. Children log to files in a temporary
folder, shown when one fails to start. They inherit the environment (OTEL_* configures their
telemetry).

The draft and target bind loopback only; the orchestrator binds `host` and alone faces
clients, with TLS / mTLS when `tls` names files. An auth token reaches every child through
its environment (never argv, which other users can read), and every service then requires it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec import models, placement, security

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Placement:
    cpus: str | None = None
    threads: int | None = None

    def flags(self) -> list[str]:
        return [
            *(["--cpus", self.cpus] if self.cpus else []),
            *(["--threads", str(self.threads)] if self.threads else []),
        ]


@dataclass(frozen=True)
class PipelineConfig:
    target: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_TARGET_DTYPE)
    draft: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_DRAFT_DTYPE)
    drafter: str = "auto"  # auto | model | ngram | llamacpp (draft_service.drafters)
    host: str = "127.0.0.1"
    port: int = 0  # orchestrator port; 0 picks a free one
    start_timeout: float = 300.0
    tls: security.ServerTLSFiles = security.ServerTLSFiles()  # the orchestrator's certificate files
    auth_token: str | None = field(default=None, repr=False)  # required by all three when set
    allow_insecure: bool = False  # let the orchestrator serve plaintext on a non-loopback host
    # Prometheus endpoints: orchestrator on metrics_port, target +1, draft +2; 0: free ports; None: off.
    metrics_port: int | None = None
    http_port: int | None = None  # the orchestrator's OpenAI-compatible HTTP API; 0: a free port; None: off
    overlap: bool = True  # the orchestrator's default for requests that leave speculation.overlap unset
    # Each model service's cores (a list as taskset writes it, "0-1") and threads; None: all / one per core.
    draft_placement: Placement = field(default_factory=lambda: Placement())
    target_placement: Placement = field(default_factory=lambda: Placement())


@dataclass
class LocalPipeline:
    """Three child processes; use as a context manager, or call stop()."""

    config: PipelineConfig
    log: callable = print
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="specdec-")))
    procs: dict = field(default_factory=dict)
    addresses: dict = field(default_factory=dict)
    metrics_addresses: dict = field(default_factory=dict)
    http_url: str | None = None  # the orchestrator's HTTP API, when config.http_port is set

    def start(self) -> LocalPipeline:
        cfg = self.config
        if models.ALIASES & {cfg.target.model, cfg.draft.model}:
            models.ensure_default_converted()  # once, here, so its progress bar is seen
        t0 = time.perf_counter()
        try:
            draft_args = [*_model_args(cfg.draft), "--drafter", cfg.drafter, *cfg.draft_placement.flags()]
            self._spawn("draft", "draft-service", draft_args, 0, LOOPBACK)
            self._spawn(
                "target", "target-service", [*_model_args(cfg.target), *cfg.target_placement.flags()], 0, LOOPBACK
            )
            for name in ("draft", "target"):
                self._wait(name)
            self._spawn(
                "orchestrator",
                "orchestrator",
                ["--draft-address", self.addresses["draft"], "--target-address", self.addresses["target"]]
                + cfg.tls.flags()
                + (["--allow-insecure"] if cfg.allow_insecure else [])
                + ([] if cfg.http_port is None else ["--http-port", str(cfg.http_port)])
                + ([] if cfg.overlap else ["--no-overlap"]),
                cfg.port,
                cfg.host,
            )
            self._wait("orchestrator")
        except BaseException:
            self.stop()
            raise
        self.log(f"specdec: services ready in {time.perf_counter() - t0:.1f} s ({self.describe()})")
        return self

    def _placements(self) -> tuple[Placement, Placement]:
        """As configured; with neither given and both on the CPU, disjoint cores for each, as a
        GPU pair gives each service its own device (specdec.placement.split_for_pair)."""
        cfg = self.config
        given = (cfg.draft_placement, cfg.target_placement)
        on_cpu = all(spec.device == "cpu" for spec in (cfg.draft, cfg.target))
        split = placement.split_for_pair(placement.usable_cores())
        if any(p.cpus for p in given) or not on_cpu or split is None:
            return given
        cores = [Placement(placement.format_cpus(c), p.threads) for c, p in zip(split, given, strict=True)]
        self.log(
            f"specdec: draft on cores {cores[0].cpus}, target on cores {cores[1].cpus} (--draft-cpus/--target-cpus)"
        )
        return cores[0], cores[1]

    @property
    def address(self) -> str:
        return self.addresses["orchestrator"]

    def describe(self) -> str:
        metrics = "".join(f", {name} metrics http://{addr}/metrics" for name, addr in self.metrics_addresses.items())
        return ", ".join(f"{name} {addr}" for name, addr in self.addresses.items()) + metrics

    def _spawn(self, name: str, command: str, args: list[str], port: int, host: str) -> None:
        ready = self.workdir / f"{name}.ready"
        logfile = open(self.workdir / f"{name}.log", "wb")
        cmd = [sys.executable, "-m", "cli", command, "--host", host]
        cmd += ["--port", str(port), "--ready-file", str(ready), *args, *self._metrics_args(name)]
        self.log(f"specdec: starting {name} service")
        self.procs[name] = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, env=self._env())

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (security.TOKEN_ENV, security.SERVICE_TOKEN_ENV)}
        if self.config.auth_token:
            env[security.TOKEN_ENV] = self.config.auth_token
        return env

    def _metrics_args(self, name: str) -> list[str]:
        base = self.config.metrics_port
        if base is None:
            return []
        offset = {"orchestrator": 0, "target": 1, "draft": 2}[name] if base else 0
        return ["--metrics-port", str(base + offset)]

    def _wait(self, name: str) -> None:
        ready = self.workdir / f"{name}.ready"
        deadline = time.monotonic() + self.config.start_timeout
        proc = self.procs[name]
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the {name} service exited with code {proc.returncode} while starting:\n" + self.tail(name)
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {name} service did not start in time:\n" + self.tail(name))
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        self.addresses[name] = info["address"]
        if "metrics_address" in info:
            self.metrics_addresses[name] = info["metrics_address"]
        self.http_url = info.get("http_url", self.http_url)

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, orchestrator first: it drains its generations while the model services
        still serve them; then the services (each drains too). Killed after `timeout`."""
        stages = [[p for n, p in self.procs.items() if n == "orchestrator"]]
        stages.append([p for n, p in self.procs.items() if n != "orchestrator"])
        for stage in stages:
            for proc in stage:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in stage:
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _model_args(spec: models.ModelSpec) -> list[str]:
    return ["--model", spec.model, "--device", spec.device, "--dtype", spec.dtype]
