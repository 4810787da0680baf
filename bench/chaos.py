"""`specdec chaos`: many concurrent streams against a supervised local stack while a killer
sends SIGKILL to the draft and the target at random times (or, with `faults`, stops them or holds
or slows their links to the orchestrator); every stream is checked against a run without faults.

A run: start the three services (deploy.local, supervised: a killed model service comes back
on its port); send every request once without faults (the reference), `streams` clients at
once, each with its own requests (greedy and seeded sampling, different prompts and lengths);
then send them again, each client going round its requests until the killer is done, while
the killer, after each victim serves again, waits a random delay and kills it (the victims
and delays come from `seed`: the schedule is reproducible, the moments it meets in a
generation are not). While the target is down (restarting) a new request is refused at once
with UNAVAILABLE (orchestrator.availability); a client sends it again after a pause, as any
client of a service that restarts would (REFUSED_RETRY_SECONDS), and the report counts the
refusals. Checks, each a line of the report:
- every request completed, in both phases (errors, a stream broken after its first chunk among
  them, are counted by status code);
- each stream is whole: its chunks' tokens, reassembled, are the reference's, each exactly
  once and in order (a shorter one lost tokens, a longer one repeated some), with the same
  text and finish reason, and one final chunk, the last;
- the killer made its `kills` kills (both services) within `duration`, and the supervisor
  never gave up;
- afterwards each model service holds zero sessions (waiting up to `drain_seconds` for the
  closes in flight; with faults other than kills, as long as a service takes to reap a session
  whose opener gave up, unclaimed_ttl), and each service's resident memory (VmRSS of /proc/PID/status) is at
  most `rss_slack_mb` above its level after the reference phase.
Sampling is reproducible under faults by design: the orchestrator draws all randomness from
the request's seed and re-runs a round the target lost with the same draws. A lost draft is not
waited for: its generations go on with target-only rounds (orchestrator.availability). Greedy text
and the invariant rule's seeded text are the target's own and do not change; under the Leviathan
rule a seeded generation that ran rounds without its draft (GenerateStats.rounds_without_draft)
met other draws there, and is another sample of the same law: such a stream must be whole, not
equal (the report counts them).

This module owns the requests, the killer, the checks and the report; the stack is
deploy.local's, recovery is orchestrator.recovery's. It imports no torch: it is a client.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from bench.loadtest import percentile
from bench.relay import DelayRelay
from deploy.local import LocalPipeline, PipelineConfig, RestartPolicy
from specdec.serving.security import ClientSecurity, channel
from specdec.v1 import model_pb2, model_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc

PROMPTS = (
    "Write a haiku about GPUs.",
    "List three uses of a hash map.",
    "Explain speculative decoding in two sentences.",
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Summarise: the cat sat on the mat and looked at the rain all afternoon.",
    "Give me four words that rhyme with light.",
    "Why is the sky blue?",
)
VICTIMS = ("draft", "target")
# SIGKILL (the supervisor restarts it); SIGSTOP, then SIGCONT (a host that hangs); the link to the
# orchestrator holding every packet (dropped: TCP delivers them once they pass again); the link
# slowed to SLOW_ONE_WAY seconds a message. All but kill last `stop_seconds`.
FAULTS = ("kill", "stop", "drop", "slow")
MAX_SEED = 2**32 - 1  # --seed: the schedule's; each request's sampling seed is derived from it
SLOW_ONE_WAY = (0.2, 2.0)  # seconds a message: a slow link, and one slower than keepalive's 3 s timeout
REFUSED_RETRY_SECONDS = 0.25  # a client's pause before sending a refused request again


@dataclass(frozen=True)
class ChaosConfig:
    pipeline: PipelineConfig = PipelineConfig()
    streams: int = 8  # concurrent clients
    requests_per_stream: int = 3
    max_tokens: int = 64  # each request asks for between a quarter of this and this
    kills: int = 10  # SIGKILLs in all, shared between the draft and the target
    duration: float = 120.0  # seconds the killer may take for them
    seed: int = 1  # the schedule, the request lengths and the sampling seeds
    kill_delay: tuple[float, float] = (0.2, 1.5)  # seconds a victim serves before it is killed
    request_timeout: float = 300.0  # each request's deadline
    drain_seconds: float = 5.0  # wait for sessions still closing after the last request
    rss_slack_mb: float = 64.0  # resident memory allowed above the level after the reference
    faults: tuple[str, ...] = ("kill",)  # what each of the `kills` faults is, in turn from the seed
    stop_seconds: tuple[float, float] = (0.5, 3.0)  # how long a stopped service stays stopped

    def __post_init__(self):
        if self.streams < 1 or self.requests_per_stream < 1 or self.max_tokens < 4 or self.kills < 0:
            raise ValueError("--streams and --requests-per-stream must be >= 1, --max-tokens >= 4, --kills >= 0")
        if not 0 < self.duration < float("inf"):
            raise ValueError("--duration must be a positive number of seconds")
        if not 0 <= self.rss_slack_mb < float("inf"):  # nan passed every check; -5 failed every run
            raise ValueError(f"--rss-slack-mb must be a number of MB >= 0, not {self.rss_slack_mb}")
        if not 0 <= self.seed <= MAX_SEED:  # a request's seed is 1000 x this + n + 1, a uint64
            raise ValueError(f"--seed must be in 0..{MAX_SEED}, not {self.seed}")
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown or not self.faults:
            raise ValueError(f"--faults is a comma list of {', '.join(FAULTS)}, not {','.join(self.faults)!r}")


def make_requests(config: ChaosConfig) -> list[list[orchestrator_pb2.GenerateRequest]]:
    """Each stream's requests: prompts and lengths vary, every other one samples with a seed."""
    rng = random.Random(config.seed)
    streams = []
    for s in range(config.streams):
        requests = []
        for j in range(config.requests_per_stream):
            n = s * config.requests_per_stream + j
            request = orchestrator_pb2.GenerateRequest(
                prompt=PROMPTS[n % len(PROMPTS)],
                chat_template=True,
                max_new_tokens=rng.randint(config.max_tokens // 4, config.max_tokens),
            )
            if n % 2:
                request.sampling.temperature = 0.8
                request.sampling.top_k = 40
                request.seed = 1000 * config.seed + n + 1  # 0 would mean "random"
            requests.append(request)
        streams.append(requests)
    return streams


def kill_schedule(config: ChaosConfig) -> list[tuple[str, float, str, float]]:
    """(victim, seconds it serves before the fault, the fault, seconds a stop lasts), both services
    alike often and each fault in turn, from the seed."""
    rng = random.Random(config.seed)
    victims = [VICTIMS[i % 2] for i in range(config.kills)]
    rng.shuffle(victims)
    faults = [config.faults[i % len(config.faults)] for i in range(config.kills)]
    rng.shuffle(faults)
    return [
        (victim, rng.uniform(*config.kill_delay), fault, rng.uniform(*config.stop_seconds))
        for victim, fault in zip(victims, faults, strict=True)
    ]


@dataclass
class Outcome:
    """One request's stream, reassembled."""

    stream: int
    index: int
    seconds: float
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str = ""
    error: str | None = None  # status code name
    malformed: str | None = None  # a stream whose final chunk is missing, repeated or not last
    rounds_without_draft: int = 0  # the final chunk's stats: rounds its lost draft did not take part in
    refusals: int = 0  # times it was refused at once (UNAVAILABLE, no chunk) and sent again
    detail: str = ""  # the error's details

    def same_as(self, reference: Outcome) -> str | None:
        """None if this stream gave the reference's result, else what differs."""
        if self.malformed:
            return self.malformed
        got, want = self.token_ids, reference.token_ids
        if got == want:
            if (self.text, self.finish_reason) != (reference.text, reference.finish_reason):
                return "same tokens, different text or finish reason"
            return None
        if want[: len(got)] == got:
            return f"lost tokens: {len(got)} of {len(want)}"
        if got[: len(want)] == want:
            return f"duplicated tokens: {len(got)} for {len(want)}"
        first = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
        return f"changed at token {first}"


def stream_once(stub, request, stream: int, index: int, timeout: float) -> Outcome:
    """One request's stream; refused at once (the target down), it is sent again until `timeout`."""
    start, refusals = time.monotonic(), 0
    while True:
        ids, text, finals, late, finish, without = [], [], 0, False, "", 0
        try:
            for chunk in stub.GenerateStream(request, timeout=max(0.1, start + timeout - time.monotonic())):
                late = late or finals > 0
                ids += chunk.token_ids
                text.append(chunk.text)
                finals += bool(chunk.finish_reason)
                finish = chunk.finish_reason or ""
                without = chunk.stats.rounds_without_draft if chunk.finish_reason else without
        except grpc.RpcError as err:
            refused = err.code() == grpc.StatusCode.UNAVAILABLE and not ids and not finals
            if refused and time.monotonic() + REFUSED_RETRY_SECONDS < start + timeout:
                refusals += 1
                time.sleep(REFUSED_RETRY_SECONDS)
                continue
            seconds = time.monotonic() - start
            return Outcome(stream, index, seconds, error=err.code().name, refusals=refusals, detail=err.details())
        break
    malformed = None
    if finals != 1 or late:
        malformed = f"{finals} final chunks" + (", then more chunks" if late else "")
    seconds = time.monotonic() - start
    return Outcome(stream, index, seconds, tuple(ids), "".join(text), finish, None, malformed, without, refusals)


def run_phase(address: str, requests, timeout: float, keep_going=lambda: False) -> tuple[list[Outcome], float]:
    """Each stream sends its requests in turn, then again while keep_going(); all streams at once."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def client(s: int) -> None:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))
        n = 0
        while n < len(requests[s]) or keep_going():
            j = n % len(requests[s])
            outcome = stream_once(stub, requests[s][j], s, j, timeout)
            with lock:
                outcomes.append(outcome)
            n += 1

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(s,), name=f"chaos-stream-{s}") for s in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, time.monotonic() - start


@dataclass
class Killer:
    """A thread that kills the pipeline's model services on `schedule`, within `duration`."""

    pipeline: LocalPipeline
    schedule: list[tuple[str, float, str, float]]
    duration: float
    kills: list[tuple[float, str, int]] = field(default_factory=list)  # (seconds in, victim, pid): SIGKILLs
    # (seconds in, victim, seconds it lasted, fault): the faults that end by themselves
    stops: list[tuple[float, str, float, str]] = field(default_factory=list)
    relays: dict = field(default_factory=dict)  # victim -> bench.relay.DelayRelay, its link (drop, slow)
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Killer:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="chaos-killer", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        deadline = self._t0 + self.duration
        killed: set[int] = set()
        try:
            for victim, delay, fault, stopped in self.schedule:
                pid = self.pipeline.serving_pid(victim, max(0.0, deadline - time.monotonic()), exclude=killed)
                if time.monotonic() + delay > deadline:
                    return
                time.sleep(delay)
                if fault != "kill":
                    self.stops.append((time.monotonic() - self._t0, victim, stopped, fault))
                    self._fault(victim, pid, fault, stopped)
                    continue
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
                self.kills.append((time.monotonic() - self._t0, victim, pid))
        except TimeoutError:  # a victim not back before the deadline: no more kills
            pass
        finally:
            self.done.set()

    def _fault(self, victim: str, pid: int, fault: str, seconds: float) -> None:
        """A fault that ends by itself after `seconds`: the process stopped, its link held or slowed."""
        relay = self.relays.get(victim)
        if fault == "stop":
            os.kill(pid, signal.SIGSTOP)
        elif fault == "drop":
            relay.hold = True
        else:
            relay.one_way = SLOW_ONE_WAY[len(self.stops) % 2]
        try:
            time.sleep(seconds)
        finally:
            if fault == "stop":
                os.kill(pid, signal.SIGCONT)
            elif relay is not None:
                relay.hold, relay.one_way = False, 0.0

    def join(self) -> None:
        self._thread.join()


def rss_mb(pid: int) -> float:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def service_rss(pipeline: LocalPipeline) -> dict[str, float]:
    return {name: rss_mb(pipeline.serving_pid(name, 60)) for name in ("orchestrator", *VICTIMS)}


def open_sessions(pipeline: LocalPipeline) -> dict[str, int]:
    stubs = {"draft": model_pb2_grpc.DraftServiceStub, "target": model_pb2_grpc.TargetServiceStub}
    counts = {}
    for name, stub_class in stubs.items():  # with the services' own token (deploy.local)
        stub = stub_class(channel(pipeline.addresses[name], ClientSecurity(token=pipeline.service_token)))
        counts[name] = stub.Describe(model_pb2.DescribeRequest(), timeout=30).open_sessions
    return counts


def run(config: ChaosConfig, log=print) -> dict:
    """The whole run (module doc); returns the report: figures and checks, `ok` if all pass."""
    requests = make_requests(config)
    restart = RestartPolicy(first_backoff=0.2, max_backoff=2.0, max_per_minute=config.kills + 5)
    relays: dict[str, DelayRelay] = {}

    def link(name: str, address: str) -> str:  # a relay between the orchestrator and each service
        relays[name] = DelayRelay(address, rtt_ms=0).start()
        return relays[name].address

    links = {"link": link} if {"drop", "slow"} & set(config.faults) else {}
    with contextlib.ExitStack() as stack:
        pipeline = stack.enter_context(LocalPipeline(replace(config.pipeline, restart=restart, **links), log=log))
        for relay in relays.values():
            stack.callback(relay.stop)
        result = _run(config, requests, pipeline, relays, log)
    return result


def _run(config: ChaosConfig, requests, pipeline: LocalPipeline, relays: dict, log) -> dict:
    address = pipeline.address
    rss_cold = service_rss(pipeline)
    log(f"chaos: reference phase, {config.streams} streams x {config.requests_per_stream} requests")
    reference, reference_wall = run_phase(address, requests, config.request_timeout)
    rss_start = service_rss(pipeline)
    schedule = kill_schedule(config)
    faults = ", ".join(f"{n} {f}" for f, n in sorted(Counter(f for _, _, f, _ in schedule).items()))
    log(f"chaos: fault phase, {faults or 'no faults'} within {config.duration:g} s (seed {config.seed})")
    killer = Killer(pipeline, schedule, config.duration, relays=relays).start()
    faulted, faulted_wall = run_phase(
        address, requests, config.request_timeout, keep_going=lambda: not killer.done.is_set()
    )
    killer.join()
    for name in VICTIMS:  # the last one killed may still be restarting
        pipeline.serving_pid(name, config.pipeline.start_timeout)
    sessions = open_sessions(pipeline)
    # A stop or a held link can deliver an OpenSession after its caller gave up: the service reaps
    # such a session once unclaimed (SessionLimits.unclaimed_ttl), so the drain waits that long.
    drain = config.drain_seconds
    if set(config.faults) != {"kill"}:
        drain = max(drain, 1.25 * config.pipeline.session_limits.unclaimed_ttl + 5)  # the reaper's round too
    end = time.monotonic() + drain
    while any(sessions.values()) and time.monotonic() < end:
        time.sleep(0.1)
        sessions = open_sessions(pipeline)
    rss_end = service_rss(pipeline)
    reopened = (pipeline.workdir / "orchestrator.log").read_text(errors="replace").count("re-opened at length")
    restarts, failure = dict(pipeline.restarts), pipeline.failure
    return report(
        config, requests, reference, reference_wall, faulted, faulted_wall, killer.kills, restarts, reopened,
        failure, sessions, (rss_cold, rss_start, rss_end), killer.stops,
    )  # fmt: skip


def phase_figures(outcomes: list[Outcome], wall: float) -> dict:
    latencies = [o.seconds for o in outcomes if o.error is None]
    return {
        "requests": len(outcomes),
        "completed": len(latencies),
        "errors_by_code": dict(sorted(Counter(o.error for o in outcomes if o.error).items())),
        "refusals": sum(o.refusals for o in outcomes),
        "wall_seconds": wall,
        "latency_p50_seconds": percentile(latencies, 50),
        "latency_p99_seconds": percentile(latencies, 99),
    }


def report(
    config, requests, reference, reference_wall, faulted, faulted_wall, kills, restarts, reopened, failure, sessions,
    rss, stops=(),
):  # fmt: skip
    by_request = {(o.stream, o.index): o for o in reference}
    mismatches, resampled = [], 0
    for o in faulted:
        if o.error is None and (problem := o.same_as(by_request[o.stream, o.index])):
            if o.malformed is None and resampled_by_a_lost_draft(config, requests[o.stream][o.index], o):
                resampled += 1  # another sample of the law (module doc)
                continue
            mismatches.append(f"stream {o.stream} request {o.index}: {problem}")
    rss_cold, rss_start, rss_end = rss
    killed = Counter(victim for _, victim, _ in kills)
    grown = {n: rss_end[n] - rss_start[n] for n in rss_end if rss_end[n] - rss_start[n] > config.rss_slack_mb}
    ref, fault = phase_figures(reference, reference_wall), phase_figures(faulted, faulted_wall)
    malformed_reference = [f"stream {o.stream} request {o.index}: {o.malformed}" for o in reference if o.malformed]
    schedule = kill_schedule(config)
    wanted = Counter(f for _, _, f, _ in schedule)
    wanted_victims = {v for v, _, _, _ in schedule}
    done_victims = set(killed) | {victim for _, victim, *_ in stops}
    checks = {
        "every request completed": ref["completed"] == ref["requests"] and fault["completed"] == fault["requests"],
        "every stream equal to the reference": not mismatches and not malformed_reference,
        f"{config.kills} faults of both services": len(kills) == wanted["kill"]
        and Counter(f for *_, f in stops) == Counter({f: n for f, n in wanted.items() if f != "kill"})
        and done_victims == wanted_victims,
        "the supervisor kept the services up": failure is None,
        "zero sessions left": not any(sessions.values()),
        f"resident memory within {config.rss_slack_mb:g} MB of its start": not grown,
    }
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "streams": config.streams,
        "seed": config.seed,
        "reference": ref,
        "faults": fault,
        "kills": len(kills),
        "kills_by_service": dict(sorted(killed.items())),
        "kill_times_seconds": [round(t, 3) for t, _, _ in kills],
        "stops": len(stops),
        "stops_by_service": dict(sorted(Counter(victim for _, victim, *_ in stops).items())),
        "faults_by_kind": dict(sorted(Counter([f for *_, f in stops] + ["kill"] * len(kills)).items())),
        "stopped_seconds": [round(s, 2) for _, _, s, _ in stops],
        "restarts_by_service": restarts,
        "sessions_reopened": reopened,
        "rounds_without_draft": sum(o.rounds_without_draft for o in faulted),
        "streams_resampled_by_a_lost_draft": resampled,
        "mismatches": (malformed_reference + mismatches)[:20],
        "errors": [f"stream {o.stream} request {o.index}: {o.error}: {o.detail}" for o in faulted if o.error][:5],
        "supervisor_failure": failure,
        "open_sessions_after": sessions,
        "rss_mb": {"cold": rss_cold, "start": rss_start, "end": rss_end},
    }


def text(result: dict) -> str:
    def phase(name, d):
        errors = ", ".join(f"{code} {n}" for code, n in d["errors_by_code"].items()) or "none"
        return (
            f"  {name}: {d['requests']} requests, {d['completed']} completed in {d['wall_seconds']:.1f} s, "
            f"errors: {errors}, refused and sent again: {d['refusals']}; latency p50 "
            f"{_s(d['latency_p50_seconds'])}, p99 {_s(d['latency_p99_seconds'])}"
        )

    rss = result["rss_mb"]
    memory = ", ".join(f"{n} {rss['start'][n]:.0f} -> {rss['end'][n]:.0f}" for n in rss["end"])
    lines = [
        f"chaos: {result['streams']} streams, seed {result['seed']}",
        phase("without faults", result["reference"]),
        phase("under faults  ", result["faults"]),
        f"  faults {_counts(result.get('faults_by_kind', {'kill': result['kills']}))}: kills "
        f"({_counts(result['kills_by_service'])}), the others ({_counts(result.get('stops_by_service', {}))}); "
        "services restarted "
        f"{sum(result['restarts_by_service'].values())} ({_counts(result['restarts_by_service'])}), "
        f"sessions re-opened {result['sessions_reopened']}, rounds without the draft "
        f"{result['rounds_without_draft']} (Leviathan samples they changed: "
        f"{result['streams_resampled_by_a_lost_draft']})",
        f"  sessions after: {_counts(result['open_sessions_after'])}; resident MB after the reference -> "
        f"after the faults: {memory}",
    ]
    lines += [f"  {'ok  ' if passed else 'FAIL'} {name}" for name, passed in result["checks"].items()]
    lines += [f"       {m}" for m in result["mismatches"] + result.get("errors", [])]
    if result["supervisor_failure"]:
        lines.append(f"       {result['supervisor_failure']}")
    lines.append("chaos: " + ("PASS" if result["ok"] else "FAIL"))
    return "\n".join(lines)


def resampled_by_a_lost_draft(config: ChaosConfig, request, outcome: Outcome) -> bool:
    """Whether a stream may differ from its reference: a Leviathan sample (a seed, temperature > 0)
    whose generation ran rounds without its lost draft, and still ended as a generation ends."""
    sampled = request.sampling.temperature > 0 and config.pipeline.rule == "leviathan"
    ended = outcome.finish_reason == "stop" or len(outcome.token_ids) == request.max_new_tokens
    return sampled and outcome.rounds_without_draft > 0 and ended and len(outcome.token_ids) <= request.max_new_tokens


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def _counts(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"
