"""The load test's arithmetic and bounds, without a server (the command itself runs against
real services in test_security.py)."""

from __future__ import annotations

import pytest

from bench import loadtest
from specdec.serving.security import SecurityError


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(100, 0, -1)]  # 100 .. 1, unsorted on purpose
    assert loadtest.percentile(values, 50) == 50.0
    assert loadtest.percentile(values, 99) == 99.0
    assert loadtest.percentile(values, 100) == 100.0
    assert loadtest.percentile([3.0, 1.0], 50) == 1.0 and loadtest.percentile([3.0, 1.0], 99) == 3.0
    assert loadtest.percentile([7.0], 99) == 7.0
    assert loadtest.percentile([], 50) is None


def test_counts_and_figures():
    report = loadtest.run(lambda timeout: 5, loadtest.LoadTestConfig(requests=10, concurrency=3, time_limit=60))
    assert report.ok and report.completed == 10 and report.generated_tokens == 50
    figures = report.as_dict()
    assert figures["errors"] == 0 and figures["errors_by_code"] == {} and figures["not_started"] == 0
    assert figures["latency_p50_seconds"] <= figures["latency_p99_seconds"] <= figures["latency_max_seconds"]
    assert "completed 10, errors 0, not started 0" in report.text()


def test_other_exceptions_are_not_swallowed():
    def broken(timeout):
        raise KeyError("a bug in the client")

    with pytest.raises(KeyError):
        loadtest.run(broken, loadtest.LoadTestConfig(requests=2, concurrency=2))


@pytest.mark.parametrize(
    "kw", [dict(requests=0), dict(concurrency=0), dict(time_limit=0), dict(time_limit=float("inf"))]
)
def test_config_is_bounded(kw):
    with pytest.raises(ValueError):
        loadtest.LoadTestConfig(**kw)


def test_loopback_targets_only_unless_allowed():
    loadtest.check_target("127.0.0.1:50051", allow_remote=False)
    loadtest.check_target("[::1]:50051", allow_remote=False)
    loadtest.check_target("10.0.0.7:50051", allow_remote=True)
    with pytest.raises(SecurityError, match="--allow-remote"):
        loadtest.check_target("10.0.0.7:50051", allow_remote=False)
