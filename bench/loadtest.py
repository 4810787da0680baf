"""A bounded load test: a fixed number of requests from a fixed number of concurrent clients,
within a time limit; reports throughput, latency percentiles and errors by status code.

Owns the run and the report. It does not build requests or channels (the CLI does) and it
imports no torch: it is a client. Bounded twice over: no more than `requests` calls, and
every call's deadline ends at the time limit, so the run ends by then whatever the server does.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from specdec.serving.security import SecurityError, host_of, is_loopback


@dataclass(frozen=True)
class LoadTestConfig:
    requests: int = 32  # calls in all
    concurrency: int = 4  # clients sending at once
    time_limit: float = 300.0  # seconds for the whole run; calls still running then are cut

    def __post_init__(self):
        if self.requests < 1 or self.concurrency < 1:
            raise ValueError("--requests and --concurrency must be at least 1")
        if not 0 < self.time_limit < math.inf:
            raise ValueError("--time-limit must be a positive number of seconds")


@dataclass
class LoadTestReport:
    config: LoadTestConfig
    wall_seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # seconds, of the calls that succeeded
    generated_tokens: int = 0
    errors: Counter = field(default_factory=Counter)  # status code name -> calls
    not_started: int = 0  # calls never sent because the time limit came first

    @property
    def completed(self) -> int:
        return len(self.latencies)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.not_started

    def percentile(self, q: float) -> float | None:
        return percentile(self.latencies, q)

    def as_dict(self) -> dict:
        wall = self.wall_seconds
        return {
            "requests": self.config.requests,
            "concurrency": self.config.concurrency,
            "time_limit_seconds": self.config.time_limit,
            "completed": self.completed,
            "errors": sum(self.errors.values()),
            "errors_by_code": dict(sorted(self.errors.items())),
            "not_started": self.not_started,
            "wall_seconds": self.wall_seconds,
            "requests_per_second": self.completed / wall if wall else None,
            "generated_tokens": self.generated_tokens,
            "tokens_per_second": self.generated_tokens / wall if wall else None,
            "latency_p50_seconds": self.percentile(50),
            "latency_p99_seconds": self.percentile(99),
            "latency_max_seconds": max(self.latencies, default=None),
        }

    def text(self) -> str:
        d = self.as_dict()
        by_code = ", ".join(f"{code} {n}" for code, n in d["errors_by_code"].items())
        return "\n".join(
            [
                f"loadtest: {d['requests']} requests, concurrency {d['concurrency']}, "
                f"{d['wall_seconds']:.2f} s (limit {d['time_limit_seconds']:g} s)",
                f"  completed {d['completed']}, errors {d['errors']}"
                + (f" ({by_code})" if by_code else "")
                + f", not started {d['not_started']}",
                f"  throughput {d['requests_per_second'] or 0:.2f} req/s, "
                f"{d['tokens_per_second'] or 0:.1f} generated tok/s",
                f"  latency p50 {_seconds(d['latency_p50_seconds'])}, p99 {_seconds(d['latency_p99_seconds'])}, "
                f"max {_seconds(d['latency_max_seconds'])}",
            ]
        )


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100): the smallest value with at least q% of values <= it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def check_target(address: str, allow_remote: bool) -> None:
    """A load test is aimed at loopback unless the caller says otherwise: it is traffic on purpose."""
    if not (allow_remote or is_loopback(host_of(address))):
        raise SecurityError(f"loadtest targets loopback addresses only; {address} is not (give --allow-remote)")


def run(call: Callable[[float], int], config: LoadTestConfig) -> LoadTestReport:
    """Send config.requests calls from config.concurrency threads.

    `call(timeout)` sends one request with that deadline and returns the tokens it generated;
    a grpc.RpcError counts as an error by its status code, anything else propagates.
    """
    report = LoadTestReport(config)
    lock = threading.Lock()
    started = 0
    t0 = time.monotonic()
    deadline = t0 + config.time_limit

    def client() -> None:
        nonlocal started
        while True:
            with lock:
                remaining = deadline - time.monotonic()
                if started >= config.requests or remaining <= 0:
                    return
                started += 1
            begin = time.monotonic()
            try:
                tokens = call(remaining)
            except grpc.RpcError as err:
                with lock:
                    report.errors[err.code().name] += 1
                continue
            with lock:
                report.latencies.append(time.monotonic() - begin)
                report.generated_tokens += tokens

    with futures.ThreadPoolExecutor(config.concurrency, thread_name_prefix="loadtest") as pool:
        for f in [pool.submit(client) for _ in range(config.concurrency)]:
            f.result()
    report.wall_seconds = time.monotonic() - t0
    report.not_started = config.requests - started
    return report
