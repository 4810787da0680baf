"""`specdec bench serving`: the serving path under load, with stand-in models that cost no core.

The three services start as `specdec serve` starts them (deploy.local), with stand-ins
(specdec.runtime.standin): a target whose batched forward sleeps `target_ms` and a draft whose forward
sleeps `draft_ms`, agreeing with the target at `agreement`. A forward that sleeps is what an
accelerator's forward is to its host: a wait, not a core. What the cells measure is therefore the
serving path itself (the orchestrator, the wire, the services' bookkeeping) as it would run
beside GPUs, at a scale a few cores can hold.

For each number of clients c and each method (speculation off, a fixed k, adaptive lookahead,
the server's default), c closed-loop clients (one channel, a call in flight each, no thread a
client) send Generate back to back; after a warm-up, a cell is the tokens made in its window over
the window's length, each request's tokens counted at the share of its time (sent to answered)
that fell in the window (counting only the answers that ended in it moved a cell in steps of one
cohort's answers: 512 tok/s, ~9% at 64 clients and 64-token answers in 8 s). Beside it: c x that
method's one-client figure (linear scaling) and the ratio, and each process's CPU per generated
token in µs (from /proc, the client's included). The methods of one c run one after another, in
alternating order from one c (and one repeat) to the next, so no method always runs last. Before a c's
cells, where adaptive or the default is among the methods, a warm-up and `settle` seconds of its load run untimed, so
the pair's regimes are measured at that load before any cell is timed (see `settling`). With `repeats`,
each cell is run that many times and reports the medians (tokens/s, CPU per token) and the
spread of its tokens/s (1-2% a cell since tokens count by their share; a 2-core VM still drifts over
minutes).

Owns the load and the report; starts nothing but through deploy.local, and stops it however the
run ends.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field, replace

import grpc

from deploy.local import LocalPipeline, PipelineConfig
from orchestrator.pair_costs import MEASURED
from specdec.limits import AdmissionLimits, SessionLimits
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from specdec.validation import MAX_LOOKAHEAD
from specdec.weights.models import ModelSpec

PROMPT = "the quick brown fox jumps over the lazy dog"
METHODS = ("off", "k4", "adaptive", "default")
PROCESSES = ("orchestrator", "draft", "target")


@dataclass(frozen=True)
class ServingConfig:
    clients: tuple[int, ...] = (1, 8, 64)
    methods: tuple[str, ...] = METHODS  # off, kN (a fixed k = N), adaptive, default (the server's own choice)
    target_ms: float = 10.0
    draft_ms: float = 2.0
    agreement: float = 0.8  # the draft stand-in's, with the target's
    max_tokens: int = 64
    duration: float = 15.0  # seconds measured per cell
    warmup: float = 3.0  # seconds of load before each cell's window
    repeats: int = 1  # runs of each cell; it reports their medians
    settle: float = 2 * MEASURED + 2  # seconds of untimed load (after a warm-up) at each c before its cells

    def __post_init__(self):
        if not self.clients or min(self.clients) < 1:
            raise ValueError(f"--clients needs client counts >= 1, got {self.clients}")
        for method in self.methods:
            request(method, 1)  # raises on an unknown one
        timed = 0 < self.duration < math.inf and 0 <= self.warmup < math.inf and 0 <= self.settle < math.inf
        if not timed or self.max_tokens < 1 or self.repeats < 1:  # nan: refused, not slept on
            raise ValueError("--duration > 0, a warm-up >= 0, --settle >= 0, --max-tokens >= 1 and --repeats >= 1")
        if not (0 <= self.agreement <= 1 and 0 <= self.target_ms < math.inf and 0 <= self.draft_ms < math.inf):
            raise ValueError("stand-ins: forwards of >= 0 ms, an agreement in [0, 1]")


@dataclass
class Cell:
    method: str
    clients: int
    tokens_per_second: float
    requests: int  # finished in the window
    errors: dict[str, int] = field(default_factory=dict)  # status code name -> calls
    cpu_us_per_token: dict[str, float] = field(default_factory=dict)  # process -> µs of CPU a generated token
    samples: list[float] = field(default_factory=list)  # tokens/s of each run (repeats), in the order they ran


def request(method: str, max_tokens: int) -> orchestrator_pb2.GenerateRequest:
    """A method's Generate request (ValueError on an unknown method)."""
    if method == "off":
        speculation = orchestrator_pb2.SpeculationParams(disabled=True)
    elif method == "adaptive":
        speculation = orchestrator_pb2.SpeculationParams(adaptive=True)
    elif method == "default":
        speculation = None
    elif method.startswith("k") and method[1:].isdigit() and 1 <= int(method[1:]) <= MAX_LOOKAHEAD:
        speculation = orchestrator_pb2.SpeculationParams(lookahead=int(method[1:]))
    else:
        raise ValueError(f"unknown method {method!r}: off, kN (N in 1..{MAX_LOOKAHEAD}), adaptive or default")
    return orchestrator_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=max_tokens, speculation=speculation)


def pipeline_config(config: ServingConfig) -> PipelineConfig:
    """Stand-ins, and limits that let every client generate at once (no queue, no refusal)."""
    most = max(config.clients)
    return PipelineConfig(
        target=ModelSpec(model=f"standin:{config.target_ms:g}"),
        draft=ModelSpec(model=f"standin:{config.draft_ms:g}:{config.agreement:g}"),
        session_limits=SessionLimits(max_sessions=2 * most + 8),
        admission=AdmissionLimits(max_concurrent=most, max_queue=most),
    )


def run(config: ServingConfig, log=print) -> list[Cell]:
    cells = []
    with LocalPipeline(pipeline_config(config), log=lambda *_: None) as pipeline:
        channel = grpc.insecure_channel(pipeline.address)
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        pids = {name: proc.pid for name, proc in pipeline.procs.items()}
        turn = 0
        for c in sorted(config.clients):
            runs: dict[str, list[Cell]] = {method: [] for method in config.methods}
            if (method := settling(config)) and config.settle > 0:
                log(f"serving: c={c}: {config.settle:g} s of {method} untimed, the pair's regimes measured")
                cell(stub, request(method, config.max_tokens), method, c, replace(config, duration=config.settle), pids)
            for _ in range(config.repeats):
                for method in config.methods[:: 1 if turn % 2 == 0 else -1]:
                    measured = cell(stub, request(method, config.max_tokens), method, c, config, pids)
                    log(_line(measured))
                    runs[method].append(measured)
                turn += 1
            cells += [merged(runs[method]) for method in config.methods]
        channel.close()
    return cells


def settling(config: ServingConfig) -> str | None:
    """The method whose untimed load settles a c's measured regimes, or None where no method measures them.

    Adaptive lookahead and the default choose between speculation and plain rounds by the pair's measured
    rates at each load (orchestrator.pair_costs, Measured): the first time a load is met, each regime
    runs MEASURED seconds before the faster is kept. A server under steady load pays that once; a cell
    whose window held it would time the measuring, so whichever of the two ran first at a c would pay it.
    """
    return next((m for m in config.methods if m in ("adaptive", "default")), None)


def merged(runs: list[Cell]) -> Cell:
    """One cell from its runs: the median tokens/s and CPU per token, the requests and errors summed."""
    errors: dict[str, int] = {}
    for run in runs:
        for code, n in run.errors.items():
            errors[code] = errors.get(code, 0) + n
    return Cell(
        runs[0].method,
        runs[0].clients,
        statistics.median(r.tokens_per_second for r in runs),
        sum(r.requests for r in runs),
        errors,
        {p: statistics.median(r.cpu_us_per_token[p] for r in runs) for p in runs[0].cpu_us_per_token},
        [r.tokens_per_second for r in runs],
    )


def cell(stub, req, method: str, clients: int, config: ServingConfig, pids: dict[str, int]) -> Cell:
    """`clients` closed-loop clients sending `req` through `stub`, over the config's warm-up and window:
    its tokens/s (each answer counted at its share of the window) and the CPU a token of each process
    in `pids` and of this one."""
    lock = threading.Lock()
    finished: list[tuple[float, float, int]] = []  # (sent, answered, tokens) of each request that succeeded
    errors: dict[str, int] = {}
    stopping = threading.Event()
    live = [clients]
    idle = threading.Event()

    def send():
        sent = time.monotonic()
        future = stub.Generate.future(req, timeout=config.warmup + config.duration + 120)
        future.add_done_callback(lambda f: done(f, sent))

    def done(future, sent: float):
        try:
            tokens = len(future.result().token_ids)
            with lock:
                finished.append((sent, time.monotonic(), tokens))
        except grpc.RpcError as err:
            with lock:
                errors[err.code().name] = errors.get(err.code().name, 0) + 1
        if not stopping.is_set():
            send()
            return
        with lock:
            live[0] -= 1
            if not live[0]:
                idle.set()

    for _ in range(clients):
        send()
    time.sleep(config.warmup)
    cpu0, own0, t0 = cpu_seconds(pids), time.process_time(), time.monotonic()
    time.sleep(config.duration)
    cpu1, own1, t1 = cpu_seconds(pids), time.process_time(), time.monotonic()
    stopping.set()
    idle.wait(config.duration + 120)
    with lock:
        tokens = in_window(finished, t0, t1)
        requests = sum(1 for _, at, _ in finished if t0 <= at < t1)
    per_token = {name: (cpu1[name] - cpu0[name]) / max(tokens, 1) * 1e6 for name in pids}
    per_token["client"] = (own1 - own0) / max(tokens, 1) * 1e6
    rate = tokens / (t1 - t0)
    return Cell(method, clients, rate, requests, dict(errors), per_token, [rate])


def in_window(requests: list[tuple[float, float, int]], t0: float, t1: float) -> float:
    """The tokens made in [t0, t1): each (sent, answered, tokens) request's at the share of its time
    inside the window (a request's tokens taken as made evenly from its send to its answer)."""
    total = 0.0
    for sent, answered, tokens in requests:
        inside = min(answered, t1) - max(sent, t0)
        if inside > 0:
            total += tokens * inside / max(answered - sent, 1e-9)
    return total


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """Seconds of CPU each process has used (user + system), from /proc."""
    out = {}
    for name, pid in pids.items():
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _line(cell: Cell) -> str:
    cpu = ", ".join(f"{name} {us:.0f}" for name, us in cell.cpu_us_per_token.items())
    errors = f", errors {cell.errors}" if cell.errors else ""
    rate = f"{cell.tokens_per_second:.1f} tok/s"
    return f"serving: {cell.method} c={cell.clients}: {rate} (CPU µs a token: {cpu}){errors}"


def table(cells: list[Cell], config: ServingConfig) -> str:
    """One row a method: tokens/s at each c, with / (c x one client) where one client ran."""
    one = {c.method: c.tokens_per_second for c in cells if c.clients == 1}
    clients = sorted({c.clients for c in cells})
    by = {(c.method, c.clients): c for c in cells}
    head = (
        f"Stand-ins {config.target_ms:g} ms / {config.draft_ms:g} ms at {config.agreement:g}, "
        f"{config.max_tokens}-token answers, {config.duration:g} s a cell: tokens/s (/ c x one client)"
    )
    if config.repeats > 1:
        head += f"; medians of {config.repeats} runs a cell [their range]"
    lines = [head, "", "| method | " + " | ".join(f"c = {c}" for c in clients) + " |"]
    lines.append("|---|" + "---:|" * len(clients))
    for method in config.methods:
        row = []
        for c in clients:
            cell = by.get((method, c))
            if cell is None:
                row.append("")
                continue
            ratio = f" ({cell.tokens_per_second / (c * one[method]):.2f})" if one.get(method) else ""
            spread = f" [{min(cell.samples):,.0f}-{max(cell.samples):,.0f}]" if len(cell.samples) > 1 else ""
            row.append(f"{cell.tokens_per_second:,.0f}{ratio}{spread}")
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    lines += ["", "CPU per generated token (µs): " + ", ".join(PROCESSES) + ", client", ""]
    lines.append("| method | " + " | ".join(f"c = {c}" for c in clients) + " |")
    lines.append("|---|" + "---:|" * len(clients))
    for method in config.methods:
        row = []
        for c in clients:
            cell = by.get((method, c))
            us = cell.cpu_us_per_token if cell else {}
            row.append(" / ".join(f"{us[p]:.0f}" for p in (*PROCESSES, "client")) if us else "")
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def as_json(cells: list[Cell], config: ServingConfig) -> dict:
    return {"config": asdict(config), "cells": [asdict(c) for c in cells]}
