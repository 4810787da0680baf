"""scripts/replay_drafters.py: the hybrid's choice of proposer replayed on given answers, costed by
given forwards (no model, no timing): its accounting, and the hybrid against the model draft alone
on an answer that copies its prompt and on one that copies nothing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from draft_service import suffix

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "replay_drafters.py"


@pytest.fixture(scope="module")
def replay():
    spec = importlib.util.spec_from_file_location("replay_drafters", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def costs(replay):
    return replay.Costs((1, 7, 33), (20.0, 38.0, 90.0), draft_step=8.0, prefill_token=3.0, overhead=1.0)


def test_a_draft_that_is_always_right_commits_k_plus_one_a_round_at_its_forwards_cost(replay):
    """An answer of fresh tokens (nothing to copy), the draft right at every position: every round
    is the model's, k + 1 tokens for k draft steps and a verify of k + 1, against the target alone's
    one token for a verify of one; the hybrid finds nothing and replays the same."""
    k, rounds = 6, 5
    prompt = list(range(1000, 1030))
    answer = list(range(2000, 2001 + rounds * (k + 1)))  # the first token, then `rounds` whole rounds
    request = {"workload": "novel", "ids": prompt, "answer": answer, "agree": [1] * len(answer)}
    c = costs(replay)
    expected = (k + 1) * (20.0 + 1.0) / (k * 8.0 + 38.0 + 1.0)
    alone = replay.replay([request], k, c, None)["novel"]
    assert alone["rounds"] == rounds and alone["speedup"] == pytest.approx(expected)
    hybrid = replay.replay([request], k, c, suffix.HybridDrafter(window=suffix.WINDOW))["novel"]
    assert hybrid == alone | {"index_rounds": 0}


def test_the_hybrid_copies_a_prompt_the_draft_cannot(replay):
    """An answer that repeats its prompt verbatim, the draft wrong everywhere: the model draft alone
    commits a token a round at more than the target alone's cost (below 1x); the hybrid's index
    proposes the copy (index rounds) and runs well past the target alone."""
    prompt = [7, 8, 9] + list(range(3000, 3100))
    answer = list(range(3000, 3100))
    request = {"workload": "copy", "ids": prompt, "answer": answer, "agree": [0] * len(answer)}
    c = costs(replay)
    alone = replay.replay([request], 6, c, None)["copy"]
    hybrid = replay.replay([request], 6, c, suffix.HybridDrafter(window=suffix.WINDOW))["copy"]
    assert alone["speedup"] < 1.0 and alone["index_rounds"] == 0
    assert hybrid["index_rounds"] > 0 and hybrid["speedup"] > 2.0


def test_an_agents_first_request_drafts_its_resend_from_the_store_but_is_not_counted(replay):
    """A request sent untimed (an agent's first) enters the store and is left out of the table; its
    resend, whose answer nothing in its prompt holds and the draft gets wrong, is copied from it."""
    prompt, answer = list(range(4000, 4040)), list(range(5000, 5060))
    first = {"workload": "agent", "timed": False, "ids": prompt, "answer": answer, "agree": [0] * len(answer)}
    resend = first | {"timed": True}
    c = costs(replay)
    alone = replay.replay([resend], 6, c, suffix.HybridDrafter(window=suffix.WINDOW))["agent"]
    stored = replay.replay([first, resend], 6, c, suffix.HybridDrafter(window=suffix.WINDOW))["agent"]
    assert alone["rounds"] == len(answer) - 1 and alone["speedup"] < 1.0  # a token a round
    assert stored["rounds"] < 10 and stored["speedup"] > 3.0


def test_a_variant_names_a_rule_of_the_hybrid(replay):
    assert replay.variant("rate=0.7") == ("rate=0.7", {"rate": 0.7})
    assert replay.variant("match=8") == ("match=8", {"match": 8})
    with pytest.raises(SystemExit, match="not one of"):
        replay.variant("window=3")


@pytest.mark.real_model
def test_the_script_answers_times_and_replays_the_workloads(tmp_path):
    """End to end on the embedded pair: every request answered (and cached), the forwards timed, a
    row per rule with a cell per workload; a second run reads the cached answers."""
    cache = tmp_path / "replay.json"
    cmd = [sys.executable, str(SCRIPT), "--problems", "1", "--chats", "1", "--max-tokens", "12"]
    cmd += ["--sequences", str(cache), "--variants", "match=8"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    answers = json.loads(cache.read_text())
    assert {a["workload"] for a in answers} >= {"humaneval", "copy", "agent", "chat", "code", "list"}
    assert all(0 < len(a["answer"]) <= 12 and len(a["agree"]) == len(a["answer"]) for a in answers)
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    for out in (first, second):
        assert "costs, ms: a verify of n tokens (1: " in out
        rows = [line for line in out.splitlines() if line.startswith(("model draft alone", "hybrid"))]
        assert [r.split("  ")[0] for r in rows] == ["model draft alone", "hybrid (default)", "hybrid match=8"]
        assert all(r.count("x (") == 7 for r in rows), rows
    assert "the draft agrees at" in first and "the draft agrees at" not in second
