"""The bench's prompt-length axis (bench.run.at_lengths, `specdec bench compare --prompt-tokens`): each
prompt at each length, a document before its question, the chat-templated prompt about N tokens; and
what its speedups are over without the transformers rows (llama.cpp's target alone)."""

from __future__ import annotations

from bench.report import Row, baseline_method
from bench.run import _chat_ids, at_lengths
from tests.conftest import make_tokenizer

PROMPTS = [{"kind": "chat", "prompt": "What is the return fee?"}, {"kind": "code", "prompt": "Write a loop."}]


def test_each_prompt_at_each_length_ends_with_its_question():
    tokenizer = make_tokenizer()
    out = at_lengths(PROMPTS, tokenizer, (10, 250, 2000))
    assert [p["kind"] for p in out] == ["10 tokens"] * 2 + ["250 tokens"] * 2 + ["2000 tokens"] * 2
    assert [p["prompt"] for p in out[:2]] == [p["prompt"] for p in PROMPTS]  # shorter than the question: itself
    for p, base in zip(out[2:], PROMPTS * 2, strict=True):
        n = int(p["kind"].split()[0])
        assert p["prompt"].startswith("A document:") and p["prompt"].endswith(base["prompt"])
        assert n - 16 <= len(_chat_ids(tokenizer, p["prompt"])) <= n  # about N tokens, never more


def test_without_the_transformers_rows_speedups_are_over_llamacpp_alone():
    rows = [Row("llamacpp-target", "-", 0.0, "-"), Row("specdec", "llamacpp", 0.0, "4")]
    assert baseline_method(rows) == "llamacpp-target"
    assert baseline_method([*rows, Row("hf-target", "-", 0.0, "-")]) == "hf-target"
