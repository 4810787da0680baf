"""`specdec bench --quick` runs end to end on tiny models: JSON, table and plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.run import alpha_from_tokens_per_round, theoretical_speedup


def test_bench_quick_on_tiny_models(tiny_models, tmp_path):
    cmd = [sys.executable, "-m", "cli", "bench", "--quick", "--drafters", "model,ngram", "--kinds", "chat,list"]
    cmd += ["--out", str(tmp_path)]  # the summarisation passages exceed the tiny models' context
    cmd += ["--target-model", tiny_models["target"], "--draft-model", tiny_models["draft"], "--draft-dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["method"], r["drafter"], r["k"]): r for r in results["rows"]}
    expected = {("hf-target", "-", "-"), ("hf-target-1core", "-", "-"), ("hf-assisted", "model", "auto"),
                ("hf-assisted", "ngram", "10"), ("specdec-off", "-", "-")}  # fmt: skip
    expected |= {
        (m, d, k) for m in ("specdec", "specdec-seq") for d in ("model", "ngram") for k in ("2", "4", "adaptive")
    }
    assert set(rows) == expected
    for key, row in rows.items():
        assert row["tokens_per_second"] > 0 and row["speedup"] > 0 and row["runs"] == 2, key
    model_k4 = rows[("specdec", "model", "4")]
    assert 0 < model_k4["acceptance_rate"] <= 1 and model_k4["cost_ratio"] > 0
    assert model_k4["theoretical_speedup"] > 0 and model_k4["bytes_per_round"] > 0
    assert model_k4["draft_ms_per_token"] > 0 and model_k4["target_ms_per_round"] > 0
    # --quick takes one prompt of each of two kinds; the baseline's ratio to itself is exactly 1
    assert len(model_k4["speedup_by_kind"]) == 2
    assert set(rows[("hf-target", "-", "-")]["speedup_by_kind"].values()) == {1.0}
    for png in ("speedup.png", "timeline.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The timeline: both services busy in turn (sequential) and at once (overlapped).
    lines = results["timelines"]
    assert {t.split()[-1] for t in lines} == {"sequential", "overlapped"}
    for line in lines.values():
        assert {s["side"] for s in line["spans"]} == {"draft", "target"} and line["round_ends"]
    assert "tok/s" in out.stdout and "specdec" in out.stdout and "by prompt kind" in out.stdout


def test_alpha_inverts_tokens_per_round():
    for alpha, k in [(0.5, 4), (0.9, 2), (0.97, 8)]:
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
        assert alpha_from_tokens_per_round(tokens, k) == pytest.approx(alpha, abs=1e-6)
        assert theoretical_speedup(alpha, k, 0.0) == pytest.approx(tokens)
