"""Run draft, target and orchestrator as three local processes on free loopback ports, and
keep them running.

Each child is `python -m cli <service> --port 0 --ready-file F`; it binds a free
port and writes {"address": ...} to F once it serves. Children log to files in the pipeline's
folder (`workdir`: a temporary one unless given), shown when one fails to start. stop() removes a
temporary folder once every child ended cleanly, and keeps it, saying where, when one failed, was
restarted or had to be killed: its logs are what tells why. They inherit the environment (OTEL_* configures their
telemetry, SPECDEC_FUSE their fusion: each child's command line reads it again), but for the cache:
SPECDEC_CACHE is set to this process's (specdec.weights.embedded.cache_dir), where start() built the models.

The draft and target bind loopback only; the orchestrator binds `host` and alone faces
clients, with TLS / mTLS when `tls` names files. On the CPU, the draft and the target may both
use every core unless told otherwise (--draft-cpus, --target-cpus pin them): the orchestrator
chooses, round by round, whether they compute at once on their shares of the cores or in turn
on all of them (specdec.runtime.placement). Tokens reach the children through their environment (never
argv, which other users can read). Least privilege: the clients' token (`auth_token`) opens the
orchestrator only; the model services require a token of their own, made here for this pipeline
(`service_token`), which only the orchestrator is given: a client's token opens no session on them.

Supervision: a monitor thread watches the children. A child that fails (a non-zero exit or a
signal: a crash, SIGKILL, the OOM killer) is started again on the ports it first bound. A model
service restarted so is found by the orchestrator at the same address, and its generations in
flight go on (orchestrator.recovery re-opens their sessions). A restarted orchestrator serves
new requests on the same gRPC, HTTP and metrics ports (those in flight failed with it), priced as
its first start priced the pair (its prices file, in the pipeline's folder); the
sessions it held on the model services are reaped as unclaimed (specdec.serving.steps: its
step streams ended). A restart that does not come up (the port still held, say) is retried after
a backoff that doubles up to a bound; more than `RestartPolicy.max_per_minute` attempts for one
child within 60 s end the pipeline, as does a child exiting cleanly (exit 0: it was told to
stop): `failure` then says why, and `specdec serve` exits non-zero with that message. A child
that is alive but answers no gRPC health check for `RestartPolicy.unresponsive` seconds (a hung
host: stopped, deadlocked; deploy.liveness) is killed, then restarted so; an orchestrator that
serves TLS is probed on a Unix socket in the pipeline's folder (`--health-socket`), where it
answers health checks and nothing else.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deploy import liveness
from deploy.configs import ModelServiceConfig
from orchestrator import CALIBRATION_TOKENS
from specdec.limits import DRAIN_TIMEOUT, AdmissionLimits, SessionLimits
from specdec.serving import security, telemetry
from specdec.weights import embedded, models

LOOPBACK = "127.0.0.1"
MODEL_SERVICES = ("draft", "target")
# serve's Prometheus ports: each process's offset from the base --metrics-port.
METRICS_OFFSETS = {"orchestrator": 0, "target": 1, "draft": 2}
POLL_SECONDS = 0.1  # how often the monitor looks at the children
# How a child that stop() sent SIGTERM ends cleanly: drained (0), or before its handler was set
# (killed by the signal, or 128 + SIGTERM where cli.main turns it into an exit: a child still starting).
STOPPED = (0, -signal.SIGTERM, 128 + signal.SIGTERM)


@dataclass(frozen=True)
class RestartPolicy:
    """How a failed child is restarted (a clean exit, code 0, is never restarted)."""

    first_backoff: float = 0.5  # seconds before retrying a restart that did not come up; doubles
    max_backoff: float = 8.0
    max_per_minute: int = 5  # restart attempts of one service within 60 s; one more ends the pipeline
    # A child that answers no health check for this long is killed (then restarted); 0: never.
    unresponsive: float = liveness.UNRESPONSIVE_SECONDS


@dataclass(frozen=True)
class Placement:
    """A model service's cores (a list as taskset writes it, "0-1") and threads; None: all it may
    use / one per core."""

    cpus: str | None = None
    threads: int | None = None

    def flags(self) -> list[str]:
        cpus = ["--cpus", self.cpus] if self.cpus else []
        return cpus + (["--threads", str(self.threads)] if self.threads else [])


@dataclass(frozen=True)
class PipelineConfig:
    target: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_TARGET_DTYPE)
    draft: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_DRAFT_DTYPE)
    drafter: str = "auto"  # a method of draft_service.drafters (auto: the hybrid)
    target_backend: str = "auto"  # auto | torch | llamacpp (deploy.configs.ModelServiceConfig.backend)
    host: str = "127.0.0.1"
    port: int = 0  # orchestrator port; 0 picks a free one
    start_timeout: float = 300.0
    tls: security.ServerTLSFiles = security.ServerTLSFiles()  # the orchestrator's certificate files
    auth_token: str | None = field(default=None, repr=False)  # required by all three when set
    # the file auth_token was read from: the orchestrator reads it there, and again on SIGHUP (a rotation)
    auth_token_file: Path | None = None
    allow_insecure: bool = False  # let the orchestrator serve plaintext on a non-loopback host
    # Prometheus endpoints: orchestrator on metrics_port, target +1, draft +2; 0: free ports; None: off.
    metrics_port: int | None = None
    session_limits: SessionLimits = SessionLimits()  # each model service's caps
    # The draft's prefix cache where it differs from session_limits.prefix_cache (None: the same):
    # `specdec generate --compare` turns the target's off and keeps the draft's (cli.generate).
    draft_prefix_cache: bool | None = None
    admission: AdmissionLimits = AdmissionLimits()  # the orchestrator's
    drain_timeout: float = DRAIN_TIMEOUT  # each child's, on SIGTERM
    restart: RestartPolicy = RestartPolicy()
    http_port: int | None = None  # the orchestrator's OpenAI-compatible HTTP API; 0: a free port; None: off
    overlap: bool | None = None  # the default for requests that leave speculation.overlap unset; None: by placement
    speculation_cache: bool = True  # ... and speculation.cache
    rule: str = "leviathan"  # ... and speculation.rule
    tree_nodes: int = 0  # ... and speculation.tree_nodes
    lookahead: int | None = None  # ... and speculation.lookahead (None: measured)
    adaptive: bool = False  # ... and speculation.adaptive
    calibration_tokens: int = CALIBRATION_TOKENS  # greedy tokens that price the pair before it serves; 0: none
    draft_placement: Placement = Placement()
    target_placement: Placement = Placement()
    target_compile: bool | None = None  # the target's --compile / --no-compile; None: its default (by device)
    # (service name, its address) -> the address the orchestrator is given for it: a link between
    # them (bench.chaos puts a relay there that it can slow or stop); None: the address itself.
    link: Callable[[str, str], str] | None = field(default=None, compare=False)


@dataclass
class _Restart:
    """A model service being restarted: what happened to it, and the attempt under way."""

    what: str
    backoff: float  # before the next attempt, should this one fail
    started: float | None = None  # when this attempt's process started; None: none running
    not_before: float = 0.0  # the next attempt starts no earlier


@dataclass
class LocalPipeline:
    """Three supervised child processes; use as a context manager, or call stop()."""

    config: PipelineConfig
    log: callable = print
    workdir: Path | None = None  # the children's logs, ready files, prices; None: a temporary folder (module doc)
    procs: dict = field(default_factory=dict)
    addresses: dict = field(default_factory=dict)
    metrics_addresses: dict = field(default_factory=dict)
    restarts: Counter = field(default_factory=Counter)  # service name -> restarts that came up
    failure: str | None = None  # why the pipeline stopped working, once it has
    http_url: str | None = None  # the orchestrator's HTTP API, when config.http_port is set
    placements: tuple[Placement, Placement] | None = None  # the draft's and the target's, as configured

    def __post_init__(self):
        self._temporary = self.workdir is None
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="specdec-"))
        self._tidied = False
        self._troubled: str | None = None  # why the folder's logs are kept (stop() removes a temporary one otherwise)
        self._commands: dict[str, list[str]] = {}  # name -> argv without --port
        self._serving: dict[str, int | None] = {}  # name -> pid of the process serving, None while down
        self._attempts = {name: deque() for name in (*MODEL_SERVICES, "orchestrator")}  # restarts in the last minute
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self.service_token = secrets.token_urlsafe(32)  # the model services' (module doc)

    def start(self) -> LocalPipeline:
        cfg = self.config
        target = ModelServiceConfig("target", cfg.target, backend=cfg.target_backend)  # checked before anything starts
        if models.ALIASES & {cfg.target.model, cfg.draft.model}:
            models.ensure_default_converted()  # once, here, so its progress bar is seen
        for derived in models.DERIVED_ALIASES & {cfg.target.model, cfg.draft.model}:
            models.resolve(derived)  # likewise (built from the conversion)
        if target.runtime == "llamacpp" and cfg.target.model in models.ALIASES:
            models.f32_gguf_path()  # likewise
        if (
            cfg.draft.model in models.ALIASES
            and cfg.drafter in ("auto", "hybrid", "llamacpp")
            and models.llamacpp_installed()
        ):
            models.draft_gguf_path()  # likewise (the llama.cpp drafter's default file)
        t0 = time.perf_counter()
        try:
            draft_place, target_place = self.placements = (cfg.draft_placement, cfg.target_placement)
            draft_args = [*_model_args(cfg.draft), "--drafter", cfg.drafter, *draft_place.flags()]
            self._spawn("draft", "draft-service", 0, LOOPBACK, draft_args)
            compiled = [] if cfg.target_compile is None else ["--compile" if cfg.target_compile else "--no-compile"]
            target_args = [*_model_args(cfg.target), "--backend", target.runtime, *target_place.flags(), *compiled]
            self._spawn("target", "target-service", 0, LOOPBACK, target_args)
            for name in MODEL_SERVICES:
                self._wait(name)
            self._spawn(
                "orchestrator",
                "orchestrator",
                cfg.port,
                cfg.host,
                ["--draft-address", self._linked("draft"), "--target-address", self._linked("target")]
                + cfg.tls.flags()
                + (["--auth-token-file", str(cfg.auth_token_file)] if cfg.auth_token and cfg.auth_token_file else [])
                + (["--allow-insecure"] if cfg.allow_insecure else [])
                + ([] if cfg.http_port is None else ["--http-port", str(cfg.http_port)])
                + {None: [], True: ["--overlap"], False: ["--no-overlap"]}[cfg.overlap]
                + ([] if cfg.speculation_cache else ["--no-speculation-cache"])
                + ["--rule", cfg.rule, "--tree", str(cfg.tree_nodes)]
                + ([] if cfg.lookahead is None else ["--lookahead", str(cfg.lookahead)])
                + (["--adaptive"] if cfg.adaptive else [])
                + ["--calibration-tokens", str(cfg.calibration_tokens), "--prices-file", str(self.workdir / "prices")]
                + (["--health-socket", str(self._health_socket)] if cfg.tls.flags() else []),
            )
            self._wait("orchestrator")
        except BaseException:
            self._troubled = self._troubled or "the start failed"
            self.stop()
            raise
        self._monitor = threading.Thread(target=self._watch, name="specdec-supervisor", daemon=True)
        self._monitor.start()
        if cfg.restart.unresponsive > 0:
            threading.Thread(target=self._probe, name="specdec-prober", daemon=True).start()
        self.log(f"specdec: services ready in {time.perf_counter() - t0:.1f} s ({self.describe()})")
        return self

    @property
    def _health_socket(self) -> Path:
        """Where an orchestrator that serves TLS answers the prober's health checks (workdir: this user's only)."""
        return self.workdir / "orchestrator-health.sock"

    def _probe_address(self, name: str) -> str:
        if name == "orchestrator" and self.config.tls.flags():
            return f"unix:{self._health_socket}"
        return self.addresses[name]  # a restart keeps it

    def _linked(self, name: str) -> str:
        link = self.config.link
        return self.addresses[name] if link is None else link(name, self.addresses[name])

    @property
    def address(self) -> str:
        return self.addresses["orchestrator"]

    def describe(self) -> str:
        metrics = "".join(f", {name} metrics http://{addr}/metrics" for name, addr in self.metrics_addresses.items())
        return ", ".join(f"{name} {addr}" for name, addr in self.addresses.items()) + metrics

    def serving_pid(self, name: str, timeout: float, exclude=()) -> int:
        """The pid of the process serving `name` (not one in `exclude`), waiting up to `timeout`
        seconds while it restarts; TimeoutError if it is not back by then."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._serving.get(name) not in (None, *exclude), timeout):
                raise TimeoutError(f"the {name} service is not serving after {timeout:g} s")
            return self._serving[name]

    # -- children ------------------------------------------------------------------------
    def _spawn(self, name: str, command: str, port: int, host: str, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "cli", command, "--host", host, "--ready-file", str(self._ready(name))]
        self._commands[name] = cmd + args + self._limit_args(name) + self._metrics_args(name)
        self._start(name, port)

    def _start(self, name: str, port: int, extra: tuple[str, ...] | list[str] = ()) -> None:
        self._ready(name).unlink(missing_ok=True)
        self.log(f"specdec: starting {name} service")
        with open(self.workdir / f"{name}.log", "ab") as logfile:  # appended: a restart keeps the crash's log
            self.procs[name] = subprocess.Popen(
                [*self._commands[name], "--port", str(port), *extra],
                stdout=logfile,
                stderr=subprocess.STDOUT,
                env=self._env(name),
                # out of the terminal's process group: Ctrl-C reaches this supervisor alone, which stops
                # them orchestrator first (reached by it too, all three drained at once and the services
                # went away under the orchestrator's drain: killed 30 s later)
                start_new_session=True,
            )

    def _bound_args(self, name: str) -> list[str]:
        """A restart's flags for the ports its first start chose (`--http-port 0`, `--metrics-port 0`):
        the last of a flag given twice is the one argparse keeps."""
        extra = []
        if name in self.metrics_addresses:
            extra += ["--metrics-port", self.metrics_addresses[name].rsplit(":", 1)[1]]
        if name == "orchestrator" and self.http_url:
            extra += ["--http-port", self.http_url.rsplit(":", 1)[1].rstrip("/")]
        return extra

    def _ready(self, name: str) -> Path:
        return self.workdir / f"{name}.ready"

    def _env(self, name: str) -> dict[str, str]:
        """The child's environment: the services' token to the model services (which require it)
        and to the orchestrator (which sends it to them), the clients' token to the orchestrator."""
        env = {k: v for k, v in os.environ.items() if k not in (security.TOKEN_ENV, security.SERVICE_TOKEN_ENV)}
        env[embedded.CACHE_ENV] = str(models.cache_dir())  # where start() built the models
        if name != "orchestrator":
            env[security.TOKEN_ENV] = self.service_token
            return env
        env[security.SERVICE_TOKEN_ENV] = self.service_token
        if self.config.auth_token and not self.config.auth_token_file:
            env[security.TOKEN_ENV] = self.config.auth_token
        return env

    def _limit_args(self, name: str) -> list[str]:
        cfg = self.config
        if name == "orchestrator":
            limits = [("--max-concurrent", cfg.admission.max_concurrent), ("--max-queue", cfg.admission.max_queue)]
        else:
            s = cfg.session_limits
            limits = [("--max-sessions", s.max_sessions), ("--max-kv-tokens", s.max_kv_tokens)]
            limits.append(("--session-ttl", s.idle_ttl))
        limits.append(("--drain-timeout", cfg.drain_timeout))
        cached = cfg.session_limits.prefix_cache
        if name == "draft" and cfg.draft_prefix_cache is not None:
            cached = cfg.draft_prefix_cache
        off = [] if name == "orchestrator" or cached else ["--no-prefix-cache"]
        return [str(x) for pair in limits for x in pair] + off

    def _metrics_args(self, name: str) -> list[str]:
        """Its Prometheus port: --metrics-port's, or where the environment asks each process for one
        (OTEL_METRICS_EXPORTER=prometheus), that port and the next two (one port each, not three
        processes binding OTEL_EXPORTER_PROMETHEUS_PORT)."""
        base = self.config.metrics_port
        if base is None:
            base = telemetry.prometheus_port(self._env(name))  # the environment the child gets
        if base is None:
            return []
        offset = METRICS_OFFSETS[name] if base else 0
        return ["--metrics-port", str(base + offset)]

    def _wait(self, name: str) -> None:
        started = time.monotonic()
        while not self._ready_now(name, started):
            if self._stopping.wait(0.1):
                raise RuntimeError(f"the pipeline stopped while the {name} service was starting")

    def _ready_now(self, name: str, started: float) -> bool:
        """Whether `name`, started at `started`, serves now (then its address is noted);
        raises if it exited while starting or is past the start timeout."""
        proc = self.procs[name]
        if not self._ready(name).exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the {name} service exited with code {proc.returncode} while starting:\n" + self.tail(name)
                )
            if time.monotonic() > started + self.config.start_timeout:
                raise TimeoutError(f"the {name} service did not start in time:\n" + self.tail(name))
            return False
        info = json.loads(self._ready(name).read_text())
        self.addresses[name] = info["address"]
        if "metrics_address" in info:
            self.metrics_addresses[name] = info["metrics_address"]
        self.http_url = info.get("http_url", self.http_url)
        self._set_serving(name, proc.pid)
        return True

    def _set_serving(self, name: str, pid: int | None) -> None:
        with self._cond:
            self._serving[name] = pid
            self._cond.notify_all()

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    # -- supervision ---------------------------------------------------------------------
    def _watch(self) -> None:
        """The monitor thread: restarts failed children (all at once if all failed), notes the end
        of the pipeline. Never blocks on a child."""
        restarting: dict[str, _Restart] = {}
        while not self._stopping.wait(POLL_SECONDS) and self.failure is None:
            for name in list(self.procs):
                if name in restarting:
                    if self._step_restart(name, restarting[name]):
                        del restarting[name]
                    continue
                proc = self.procs[name]
                code = proc.poll()
                if code is None:
                    continue
                self._set_serving(name, None)
                what = f"the {name} service (pid {proc.pid}) {_exit_text(code)}"
                if code == 0:
                    self._fail(f"{what}; the pipeline cannot go on without it")
                    return
                self.log(f"specdec: {what}; restarting it on {self.addresses[name]}")
                self._troubled = self._troubled or what  # its logs say why, restarted in time or not
                restarting[name] = _Restart(what, self.config.restart.first_backoff)

    def _probe(self) -> None:
        """The prober thread: a child serving that answers no health check (any answer counts,
        NOT_SERVING while it drains too) for `unresponsive` seconds is killed; the monitor then
        restarts it as it does a crashed one. A child's exit is the monitor's, never the prober's."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from specdec.serving.security import RECONNECT

        limit = self.config.restart.unresponsive
        silence, every = liveness.Silence(limit), liveness.period(limit)
        channels: dict[str, tuple[int, grpc.Channel]] = {}  # name -> (the pid it probes, a channel of its own)
        probed = [*MODEL_SERVICES, "orchestrator"]
        try:
            while not self._stopping.wait(every) and self.failure is None:
                sent, calls = time.monotonic(), {}
                for name in probed:
                    pid = self._serving.get(name)
                    if pid is None:  # down or restarting: the monitor's
                        continue
                    if channels.get(name, (None,))[0] != pid:
                        # A restarted child gets a channel of its own: the last one's reconnect
                        # backoff, grown while the child was down, failed its probes at once for
                        # seconds after it served again, and it was killed as hung (RECONNECT).
                        if name in channels:
                            channels[name][1].close()
                        channels[name] = pid, grpc.insecure_channel(self._probe_address(name), options=RECONNECT)
                    stub = health_pb2_grpc.HealthStub(channels[name][1])
                    calls[name] = pid, stub.Check.future(health_pb2.HealthCheckRequest(), timeout=every)
                for name, (pid, call) in calls.items():  # a pid a key: a restarted child's silence is its own
                    if silence.heard(pid, call.exception() is None, sent) and not self._stopping.is_set():
                        self._kill_unresponsive(name, pid, limit)
        finally:
            for _, channel in channels.values():
                channel.close()

    def _kill_unresponsive(self, name: str, pid: int, limit: float) -> None:
        with self._cond:
            if self._serving.get(name) != pid:  # exited (and maybe restarted) meanwhile
                return
            self.log(f"specdec: the {name} service (pid {pid}) answered no health check for {limit:g} s; killing it")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _step_restart(self, name: str, r: _Restart) -> bool:
        """Advance the restart of `name` by one step; True once it serves at its old address."""
        policy = self.config.restart
        address = self.addresses[name]
        now = time.monotonic()
        if r.started is None:
            if now < r.not_before:
                return False
            attempts = self._attempts[name]
            while attempts and now - attempts[0] > 60:
                attempts.popleft()
            if len(attempts) >= policy.max_per_minute:
                self._fail(f"{r.what}; giving up after {len(attempts)} restart attempts within 60 s")
                return False
            attempts.append(now)
            self._start(name, int(address.rsplit(":", 1)[1]), self._bound_args(name))  # clients find it again
            r.started = now
            return False
        try:
            if not self._ready_now(name, r.started):
                return False
        except (RuntimeError, TimeoutError) as err:  # e.g. the port still held: try again later
            self.procs[name].kill()
            self.procs[name].wait()
            self.log(f"specdec: restarting the {name} service failed; retrying in {r.backoff:g} s: {err}")
            r.started, r.not_before = None, now + r.backoff
            r.backoff = min(2 * r.backoff, policy.max_backoff)
            return False
        if self.addresses[name] != address:  # cannot happen with --port given; never move silently
            self._fail(f"the restarted {name} service serves on {self.addresses[name]}, not {address}")
            return False
        self.restarts[name] += 1
        self.log(f"specdec: the {name} service is back on {address} (pid {self.procs[name].pid})")
        return True

    def _fail(self, message: str) -> None:
        """The pipeline is broken: `failure` says why (its owner reports it and stops)."""
        with self._cond:
            self.failure = message
            self._cond.notify_all()

    def signal_all(self, sig: int) -> None:
        """Send `sig` to every child still running (serve passes SIGHUP on: credentials reload)."""
        for proc in list(self.procs.values()):
            if proc.poll() is None:
                proc.send_signal(sig)

    def stop(self, timeout: float | None = None) -> None:
        """Stop supervising, then SIGTERM, orchestrator first: it drains its generations while
        the model services still serve them; then the services (each drains too). A child still
        running `timeout` seconds later (default: the drain timeout + 10 s) is killed."""
        self._stopping.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join()
        timeout = self.config.drain_timeout + 10 if timeout is None else timeout
        stages = [[(n, p) for n, p in self.procs.items() if n == "orchestrator"]]
        stages.append([(n, p) for n, p in self.procs.items() if n != "orchestrator"])
        for stage in stages:
            for _, proc in stage:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.send_signal(signal.SIGCONT)  # a stopped child drains now, not killed after `timeout`
            for name, proc in stage:
                try:
                    code = proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    code = None
                if code not in STOPPED:
                    self._troubled = self._troubled or f"the {name} service " + (
                        f"did not stop within {timeout:g} s" if code is None else _exit_text(code)
                    )
        self.procs.clear()
        self._tidy()

    def _tidy(self) -> None:
        """Remove a temporary folder whose children all ended cleanly; else keep it and say where."""
        if self._tidied:
            return
        self._tidied = True
        reason = self.failure or self._troubled
        if reason is None and self._temporary:
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif reason is not None and self.workdir.exists():
            self.log(f"specdec: the services' logs are kept in {self.workdir} ({reason})")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _exit_text(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _model_args(spec: models.ModelSpec) -> list[str]:
    return ["--model", spec.model, "--device", spec.device, "--dtype", spec.dtype]
