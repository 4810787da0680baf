"""`specdec bench workloads` (bench/workloads.py): HumanEval's functions as edits, copies and an
agent's resent request; run end to end on tiny models (the drafters' speed is the bench's to
measure, not this test's: it checks what is sent, and that every answer is the target alone's)."""

from __future__ import annotations

import pytest

from bench import workloads
from specdec.weights.models import ModelSpec


def test_humaneval_functions_and_a_resent_request_with_one_line_changed():
    functions = workloads.humaneval_functions(3)
    assert [f["name"] for f in functions] == ["has_close_elements", "separate_paren_groups", "truncate_number"]
    code = functions[2]["code"]
    changed = workloads.one_line_changed(code)
    diff = [(a, b) for a, b in zip(code.splitlines(), changed.splitlines(), strict=True) if a != b]
    assert len(diff) == 1 and diff[0][1].strip() == "# " + diff[0][0].strip()  # its first body line
    assert '"""' not in diff[0][0] and diff[0][0].strip() == "return number % 1.0"


def test_the_requests_in_the_order_they_are_sent():
    config = workloads.WorkloadsConfig(problems=4, chats=1)
    sent = workloads.requests(config)
    kinds = [(r["workload"], r["timed"]) for r in sent]
    assert kinds.count(("humaneval", True)) == 4 and kinds.count(("copy", True)) == 4
    assert kinds.count(("agent", False)) == 2 and kinds.count(("agent", True)) == 2 and kinds[-1] == ("chat", True)
    first, resent = [r["prompt"] for r in sent if r["workload"] == "agent"][:2]
    assert first == sent[0]["prompt"] and first != resent  # the rewrite, then it again with a line changed
    assert "renaming `has_close_elements` to `has_close_elements_v2`" in sent[1]["prompt"]


@pytest.mark.parametrize(
    "kw, message",
    [({"workloads": ("essays",)}, "unknown workloads"), ({"drafters": ("eagle",)}, "unknown drafters"),
     ({"problems": 0}, "at least 1")],
)  # fmt: skip
def test_bad_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        workloads.WorkloadsConfig(**kw)


@pytest.mark.slow
def test_the_workloads_bench_on_tiny_models(tiny_models, tmp_path, monkeypatch):
    short = [{"name": f"f{i}", "code": f'def f{i}(x):\n    """Add {i}."""\n    return x + {i}\n'} for i in range(2)]
    monkeypatch.setattr(workloads, "humaneval_functions", lambda n: short[:n])  # the tiny models' context: 512
    config = workloads.WorkloadsConfig(
        workloads=("copy", "agent"),
        drafters=("suffix",),
        problems=2,
        max_tokens=12,
        target=ModelSpec(tiny_models["target"], "cpu", "float32"),
        draft=ModelSpec(tiny_models["draft"], "cpu", "float32"),
        llamacpp_alone=False,  # the embedded default's GGUF only
        out=tmp_path,
    )
    result = workloads.run(config)
    rows = {(r["workload"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(w, m) for w in ("copy", "agent") for m in ("target alone", "suffix", "bound")}
    for row in rows.values():
        assert row["tokens_per_second"] > 0 and row["requests"] == (2 if row["workload"] == "copy" else 1)
        assert row["same_text"] == f"{row['requests']}/{row['requests']}"  # exact: the target alone's answers
    assert rows[("agent", "suffix")]["acceptance_rate"] is not None
    assert rows[("copy", "bound")]["acceptance_rate"] is not None  # the resent requests drafted their own answers
    assert (tmp_path / "workloads.json").exists() and "x llama.cpp alone" in workloads.format_table(result)
