"""`specdec bench compare --quick` runs end to end on tiny models: JSON, table and plot. The engine
rows: llama-speculative's output parsed (a recorded sample), llamacpp-target on the real GGUF."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench import concurrency, costs, engines
from bench.run import _chat_ids, alpha_from_tokens_per_round, theoretical_speedup

DATA = Path(__file__).with_name("data")


@pytest.mark.slow
def test_bench_quick_on_tiny_models(tiny_models, tmp_path):
    cmd = [sys.executable, "-m", "cli", "bench", "compare", "--quick"]
    cmd += ["--drafters", "model,ngram", "--kinds", "chat,list"]
    cmd += ["--hf-static"]  # on by default for a CUDA target only
    cmd += ["--trees", "6"]  # a draft tree of 6 nodes beside each fixed k
    cmd += ["--out", str(tmp_path)]  # the summarisation passages exceed the tiny models' context
    cmd += ["--target-model", tiny_models["target"], "--draft-model", tiny_models["draft"], "--draft-dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["method"], r["drafter"], r["k"]): r for r in results["rows"]}
    expected = {("hf-target", "-", "-"), ("hf-static", "-", "-"), ("hf-target-1core", "-", "-"),
                ("hf-assisted", "model", "auto"), ("hf-assisted", "ngram", "10"),
                ("specdec-off", "-", "-")}  # fmt: skip
    expected |= {
        (m, d, k) for m in ("specdec", "specdec-seq") for d in ("model", "ngram") for k in ("2", "4", "adaptive")
    }
    expected |= {("specdec-tree", d, k) for d in ("model", "ngram") for k in ("2/6", "4/6")}
    assert set(rows) == expected
    for key, row in rows.items():
        assert row["tokens_per_second"] > 0 and row["speedup"] > 0 and row["runs"] == 2, key
    model_k4 = rows[("specdec", "model", "4")]
    assert 0 < model_k4["acceptance_rate"] <= 1 and model_k4["cost_ratio"] > 0
    assert model_k4["theoretical_speedup"] > 0 and model_k4["bytes_per_round"] > 0
    assert model_k4["draft_ms_per_token"] > 0 and model_k4["target_ms_per_round"] > 0
    # The bound from one-process costs, each model timed alone on its service's cores
    costs = results["forward_costs"]
    assert set(costs["target"]) == {"1", "2", "3", "5", "9"} and set(costs["draft"]) == {"model"}
    for method in ("specdec", "specdec-seq"):
        row = rows[(method, "model", "4")]
        assert row["bound_tokens_per_second"] > 0 and row["bound_efficiency"] > 0
    # --quick takes one prompt of each of two kinds; the baseline (hf-static, where it ran) to itself is exactly 1
    assert len(model_k4["speedup_by_kind"]) == 2
    assert results["baseline"] == "hf-static"
    assert set(rows[("hf-static", "-", "-")]["speedup_by_kind"].values()) == {1.0}
    for png in ("speedup.png", "timeline.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The timeline: both services busy in turn (sequential) and at once (overlapped).
    lines = results["timelines"]
    assert {t.split()[-1] for t in lines} == {"sequential", "overlapped"}
    for line in lines.values():
        assert {s["side"] for s in line["spans"]} == {"draft", "target"} and line["round_ends"]
    assert "tok/s" in out.stdout and "specdec" in out.stdout and "speedup over hf-static by prompt kind" in out.stdout
    # Every row says its threads; the services share the machine's cores (nothing pinned), and the
    # target alone (specdec-off) runs on all of them, as in-process generate (hf-target) does.
    n = len(os.sched_getaffinity(0))
    assert rows[("hf-target", "-", "-")]["threads"] == str(n) and rows[("hf-target-1core", "-", "-")]["threads"] == "1"
    assert rows[("specdec-off", "-", "-")]["threads"] == f"{n:.1f}"
    assert ("target_share" in costs) == (n > 1)
    # Where a round's time goes: a line per specdec row
    assert "where a round's time goes" in out.stdout
    for key in (("specdec-off", "-", "-"), ("specdec-seq", "model", "4")):
        time = rows[key]["time"]
        assert time["round_ms"] >= time["target_wait_ms"] > 0 and 0 < time["busy_cores"] <= 1, key


@pytest.mark.slow
def test_round_overhead_on_tiny_models(tiny_models):
    """bench.overhead: the services in their own processes, their forwards timed; a round is its
    forwards plus what the services, the wire and the orchestrator add."""
    from bench import overhead

    r = overhead.measure(tiny_models["target"], tiny_models["draft"], "cpu", 3, 2, 16, None, "float32")
    assert r["forwards"] > 0 and r["round"] > r["forwards"] and 0 < r["outside_share"] < 1
    assert 1 <= r["tokens_per_round"] <= 4


def test_a_concurrency_cell_holds_c_clients_for_its_duration():
    """One wave: each request once. With a duration: c clients, each sending the requests back to
    back from its own offset until the time is up; never more than c in flight."""
    import threading
    import time

    sent, lock, flight = [], threading.Lock(), [0, 0]

    def generate(ids):
        with lock:
            sent.append(ids)
            flight[0] += 1
            flight[1] = max(flight[1], flight[0])
        time.sleep(0.01)
        with lock:
            flight[0] -= 1
        return {"tokens": 2, "wall": 0.01, "tokens_per_second": 200.0}

    wave = concurrency._cell(["a", "b", "c", "d"], 2, generate)
    assert sorted(sent) == ["a", "b", "c", "d"] and wave["requests"] == 4 and wave["tokens"] == 8
    sent.clear()
    steady = concurrency._cell(["a", "b", "c", "d"], 2, generate, duration=0.3)
    assert steady["requests"] == len(sent) > 8 and flight[1] == 2 and set(sent) == {"a", "b", "c", "d"}
    assert steady["total_tokens_per_second"] == pytest.approx(2 * len(sent) / 0.3, rel=0.25)


def test_the_methods_of_one_concurrency_run_side_by_side():
    """A column's cells run together; with a duration, each method half the time in order and half
    in reverse, so every method's cell is centred on the same moment (a linear drift of the machine
    slows them alike); one wave a cell alternates the order from one c to the next."""
    steady = concurrency.schedule(3, (1, 8), 60.0)
    assert [(c, m) for c, m, _ in steady] == [(1, 0), (1, 1), (1, 2), (1, 2), (1, 1), (1, 0)] + [
        (8, 0),
        (8, 1),
        (8, 2),
        (8, 2),
        (8, 1),
        (8, 0),
    ]
    assert all(seconds == 30.0 for _, _, seconds in steady)
    for m in range(3):  # the mean position of each method's halves, in a column of 6 slots
        assert statistics.mean(i for i, (_, n, _) in enumerate(steady[:6]) if n == m) == 2.5
    waves = concurrency.schedule(2, (1, 2, 4), None)
    assert waves == [(1, 0, None), (1, 1, None), (2, 1, None), (2, 0, None), (4, 0, None), (4, 1, None)]


def test_a_cell_of_two_halves_counts_both():
    half = ([{"tokens": 10, "wall": 1.0, "tokens_per_second": 10.0}] * 3, 3.0)
    other = ([{"tokens": 10, "wall": 2.0, "tokens_per_second": 5.0}], 2.0)
    cell = concurrency.summarise([half, other])
    assert cell["requests"] == 4 and cell["tokens"] == 40 and cell["total_tokens_per_second"] == 8.0
    assert cell["p99_latency"] == 2.0 and cell["request_tokens_per_second"] == 10.0


@pytest.mark.parametrize("duration", [None, 0.05])
def test_one_client_runs_on_the_calling_thread(duration):
    """The in-process generate rows are one client: on a pool thread, after the main thread ran a
    forward, torch's forwards ran at 0.55-0.6x their speed, which flattered every ratio to them."""
    import threading

    threads = set()

    def generate(ids):
        threads.add(threading.get_ident())
        return {"tokens": 1, "wall": 0.001, "tokens_per_second": 1000.0}

    cell = concurrency._cell(["a", "b"], 1, generate, duration=duration)
    assert threads == {threading.get_ident()} and cell["requests"] >= 2


@pytest.mark.parametrize("seconds", ["0", "inf"])
def test_a_duration_needs_seconds(seconds):
    cmd = [sys.executable, "-m", "cli", "bench", "concurrency", "--clients", "2", "--duration", seconds]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 1 and "--duration needs a number of seconds > 0" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["compare", "--ks", ""], "--ks needs one or more lookaheads in 1..32"),
        (["concurrency", "--ks", ""], "--ks needs one or more lookaheads in 1..32"),
        (["compare", "--ks", "0,4"], "--ks is a comma list of whole numbers in 1..32, not '0,4'"),
        (["network", "--ks", "0"], "--ks is a comma list of whole numbers in 1..32, not '0'"),
        (["compare", "--ks", "4,99"], "--ks is a comma list of whole numbers in 1..32, not '4,99'"),
        (["compare", "--temperatures", "0,-1"], "--temperatures is a comma list of numbers >= 0, not '0,-1'"),
        (["concurrency", "--clients", "1,x"], "--clients is a comma list of whole numbers >= 1, not '1,x'"),
        # each of these started the pipeline first
        (["network", "--rtt-ms", "-5"], "--rtt-ms is a comma list of numbers >= 0, not '-5'"),
        (["network", "--rtt-ms", "nan"], "--rtt-ms is a comma list of numbers >= 0, not 'nan'"),
        (["compare", "--prompt-tokens", "0"], "--prompt-tokens is a comma list of whole numbers >= 1, not '0'"),
        (["compare", "--trees", "-3"], "--trees is a comma list of whole numbers in 1..64, not '-3'"),
        (["structured", "--k", "99"], "--k needs a lookahead in 1..32, not 99"),
    ],
)
def test_a_list_flag_out_of_form_is_refused_before_anything_starts(args, expected):
    out = subprocess.run([sys.executable, "-m", "cli", "bench", *args], capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.startswith("specdec bench") and expected in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "starting" not in out.stderr


def test_overlap_bound_is_the_busier_device():
    verify = {1: 0.050, 5: 0.090, 9: 0.110}  # seconds by tokens fed
    assert costs.verify_cost(verify, 3) == pytest.approx(0.070)  # interpolated
    assert costs.verify_cost(verify, 11) == pytest.approx(0.120)  # extended past the last width
    # k = 4: the target's verify of 5 (90 ms) outlasts 4 draft steps of 10 ms
    assert costs.overlap_bound(4.9, 4, 0.010, verify) == pytest.approx(4.9 / 0.090)
    # k = 8 with a slow draft: its 8 steps of 20 ms set the pace
    assert costs.overlap_bound(8.5, 8, 0.020, verify) == pytest.approx(8.5 / 0.160)


def test_alpha_inverts_tokens_per_round():
    for alpha, k in [(0.5, 4), (0.9, 2), (0.97, 8)]:
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
        assert alpha_from_tokens_per_round(tokens, k) == pytest.approx(alpha, abs=1e-6)
        assert theoretical_speedup(alpha, k, 0.0) == pytest.approx(tokens)


def test_llama_speculative_output_parsed():
    # A recorded sample: the output of the llama-speculative built by `make llama-tools`
    # (llama-cpp-python 0.3.36's llama.cpp) on the first chat prompt, greedy, k = 4, -n 63,
    # on a machine shared by several jobs (hence its low speed).
    text = (DATA / "llama_speculative_greedy_k4.txt").read_text()
    run = engines.parse_speculative_output(text)
    assert run["prompt_tokens"] == 44 and run["tokens"] == 67
    assert run["wall"] == pytest.approx(19.880 + 65.004)
    assert run["tokens_per_second"] == pytest.approx(67 / (19.880 + 65.004))
    assert run["decode_tokens_per_second"] == pytest.approx(67 / 65.004)
    assert run["acceptance_rate"] == pytest.approx(52 / 56)
    assert run["tokens_per_round"] == pytest.approx(67 / 15) and run["drafts_per_round"] == pytest.approx(56 / 15)


def test_llama_speculative_output_not_recognised():
    text = (DATA / "llama_speculative_greedy_k4.txt").read_text().replace("n_accept", "n_accepted_tokens")
    with pytest.raises(ValueError, match=r"not recognised \(no accepted\)"):
        engines.parse_speculative_output(text)


@pytest.mark.real_model
def test_llamacpp_target_greedy_equals_transformers():
    """The llamacpp-target row decodes what hf-target decodes: the F32 GGUF holds the fp32
    target's weights. EOS is masked: always max_tokens tokens."""
    import torch

    from specdec.weights import models

    model, tokenizer = models.load(models.ModelSpec())
    ids = _chat_ids(tokenizer, "List three colours.")
    with torch.inference_mode():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    target = engines.LlamaCppTarget(models.f32_gguf_path(), threads=torch.get_num_threads())
    run = target.generate(ids, 12, 0.0, seed=1)
    assert run["token_ids"] == expected[0, len(ids) :].tolist()
    sampled = [target.generate(ids, 12, 0.7, seed=1)["token_ids"] for _ in range(2)]
    assert len(sampled[0]) == 12 and sampled[0] == sampled[1]  # seeded, from a fresh state each time


@pytest.mark.real_model
def test_the_engine_row_runs_every_prompt_at_every_concurrency():
    """The engine alone's row (the bound of speculation off) runs all of a cell's prompts at every c,
    in waves of c: its "x c=1" weighs the same prefills as the clients' (who cycle through them all)."""
    from specdec.runtime.llamacpp import LlamaCppBackend
    from specdec.weights import models

    backend = LlamaCppBackend(models.ModelSpec(models.DEFAULT_ALIAS))
    free = backend.free_caches()
    steps, forward = [], backend.forward_batch
    backend.forward_batch = lambda items: steps.append([len(tokens) for _, tokens, _ in items]) or forward(items)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
    for c in (1, 2, 4):
        steps.clear()
        cell = concurrency._llamacpp_batch(backend, prompts, c, 3)
        prefills = sorted(widths[0] for widths in steps if widths[0] > 1)
        decodes = [widths for widths in steps if widths[0] == 1]
        assert prefills == [2, 2, 3, 4], c  # every prompt, once
        assert decodes == [[1] * c] * (2 * len(prompts) // c), c  # max_tokens - 1 batched steps a wave
        assert cell["total_tokens_per_second"] > 0 and backend.free_caches() == free


@pytest.mark.slow
def test_the_concurrency_bench_on_tiny_models_with_adaptive_trees(tiny_models, tmp_path):
    """`specdec bench concurrency` with --trees: adaptive rows with draft trees beside the chains-only one."""
    from specdec.weights.models import ModelSpec

    config = concurrency.ConcurrencyConfig(
        concurrency=(1, 2),
        drafters=("model",),
        ks=(2,),
        trees=(4,),
        max_tokens=8,
        prompts=1,  # the chat prompt (the second, a passage, exceeds the tiny models' context)
        hf_baselines=False,
        target=ModelSpec(tiny_models["target"], "cpu", "float32"),
        draft=ModelSpec(tiny_models["draft"], "cpu", "float32"),
        out=tmp_path,
    )
    rows = concurrency.run(config)["rows"]
    adaptive = {"specdec model k=adaptive", "specdec model k=adaptive tree 4"}
    assert set(rows) == {"specdec-off", "specdec model k=2", *adaptive}
    for name, cells in rows.items():
        assert set(cells) == {"1", "2"} and all(cell["total_tokens_per_second"] > 0 for cell in cells.values()), name
    assert "k=adaptive tree 4" in concurrency.format_table(json.loads((tmp_path / "concurrency.json").read_text()))


@pytest.mark.slow
def test_the_network_bench_on_tiny_models(tiny_models, tmp_path):
    """`specdec bench network`: the services on a core each, a delaying relay before the target, each
    row at each RTT."""
    # 32 tokens: 12 ended, once under CI's load, before the draft's session opened (a cell without drafts)
    cmd = [sys.executable, "-m", "cli", "bench", "network", "--rtt-ms", "0,10", "--ks", "2", "--max-tokens", "32"]
    cmd += ["--kinds", "chat", "--drafter", "model", "--out", str(tmp_path), "--target-model", tiny_models["target"]]
    cmd += ["--draft-model", tiny_models["draft"], "--draft-dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "network.json").read_text())
    assert set(results["rtts"]) == {"0.0", "10.0"} and results["baseline"]["tokens_per_second"] > 0
    for cells in results["rtts"].values():
        assert set(cells) == {"alone", "overlap k=2", "overlap+cache k=2", "seq k=2", "adaptive"}
        assert all(cell["tokens_per_second"] > 0 for cell in cells.values())
        assert cells["seq k=2"]["acceptance_rate"] > 0
    assert "alone, no link" in out.stdout and "overlap k=2" in out.stdout


@pytest.mark.slow
def test_the_ttft_bench_times_each_turn_from_a_client(tiny_models, tiny_backends, tmp_path):
    """bench/ttft.py's client on in-process services with the prefix cache on (`specdec bench ttft` starts
    LocalPipelines instead): every case timed from the stream, the next turn and the same request again
    reuse the conversation on both services, and the table holds each ratio beside issue 43's bound."""
    from bench import ttft
    from specdec.weights import models
    from tests.harness import pipeline

    config = ttft.TTFTConfig(max_tokens=4, repeats=1, turns=3, out=tmp_path)
    chat = ttft.load_chat()
    system = f"Conversation 1.\n{chat['system'][:60]}"
    model, tokenizer = models.load(models.ModelSpec(tiny_models["target"], "cpu", "float32"))
    ids = ttft._ids(
        tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": chat["questions"][0]}]
    )
    runs = {("-", "prefill"): [{"seconds": ttft._prefill_seconds(model, ids), "prompt_tokens": len(ids)}]}
    with pipeline(tiny_backends["draft"], tiny_backends["target"]) as p:
        services = {"target": p.target, "draft": p.draft}
        for case, result in ttft._conversation(p.orchestrator, services, system, chat["questions"][:3], config):
            runs.setdefault(("on", case), []).append(result)
    results = ttft.summarise(config, runs)
    rows = {(r["case"], r["cache"]): r for r in results["rows"]}
    assert set(rows) == {("prefill", "-"), *((case, "on") for case in ttft.CASES)}
    assert rows[("first", "on")]["prompt_tokens"] == len(ids)  # the bench's prompt is the server's
    for row in rows.values():
        assert row["seconds"] > 0
    for case in ("second", "identical", "multi-turn"):  # the conversation so far, on both sides
        assert rows[(case, "on")]["target_hit"] > rows[("first", "on")]["prompt_tokens"] > 0, case
        # the draft's: the prompt at least (all but its last token, which a session's next forward
        # feeds); its answer too where the draft's session opened before the 4-token answer ended,
        # which a loaded machine may not give it
        assert rows[(case, "on")]["draft_hit"] >= rows[("first", "on")]["prompt_tokens"] - 1, case
    assert rows[("identical", "on")]["target_hit"] == rows[("identical", "on")]["prompt_tokens"] - 1
    assert [rows[(c, "on")]["criterion"] for c in ("first", "second", "identical")] == [1.1, 0.2, 0.1]
    table = ttft.format_table(json.loads((tmp_path / "ttft.json").read_text()))
    assert "<= 0.2x" in table and "multi-turn" in table


@pytest.mark.slow
def test_the_serving_bench_runs_its_cells_from_the_command_line(tmp_path):
    """`specdec bench serving`: stand-ins, a cell a (method, clients), each with its rate and every
    process's CPU per token; the table and the JSON. Adaptive's regimes are settled at each c, untimed,
    before that c's first cell."""
    cmd = [sys.executable, "-m", "cli", "bench", "serving", "--clients", "1,3", "--methods", "off,k2,adaptive"]
    cmd += ["--standins", "2,1,0.8", "--max-tokens", "16", "--duration", "1.5", "--settle", "0.5"]
    out = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, check=True).stdout
    cells = json.loads((tmp_path / "serving.json").read_text())["cells"]
    assert {(c["method"], c["clients"]) for c in cells} == {(m, c) for m in ("off", "k2", "adaptive") for c in (1, 3)}
    for cell in cells:
        assert cell["tokens_per_second"] > 0 and not cell["errors"]
        assert set(cell["cpu_us_per_token"]) == {"orchestrator", "draft", "target", "client"}
    assert "| off | " in out and "| k2 | " in out and "| adaptive | " in out
    lines = [line for line in out.splitlines() if line.startswith("serving: ")]
    settles = [i for i, line in enumerate(lines) if "untimed" in line]
    assert settles == [0, 4] and "c=3: 0.5 s of adaptive" in lines[4], lines  # before each c's three cells


@pytest.mark.slow
def test_the_columnar_round_script_serves_the_targets_greedy_text_beside_the_orchestrator():
    """scripts/columnar_round.py: its own loop over every session on the stand-in services, in process
    and behind a Generate of its own, beside the orchestrator's cells; every answer it makes is checked
    against the target's greedy text (it raises on one that differs), and each way gets its row."""
    cmd = [sys.executable, str(DATA.parent.parent / "scripts" / "columnar_round.py"), "--clients", "1,4", "--k", "3"]
    cmd += ["--standins", "2,1,0.8", "--max-tokens", "16", "--duration", "1.5", "--warmup", "0.5"]
    cmd += ["--repeats", "1", "--cohorts", "2", "--servers", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    for way in ("specdec", "columnar, 2 cohorts, 0 ms an answer", "columnar server, 1 cohort"):
        assert f"| {way} | " in out, out
    assert "tokens a verify" in out


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--clients", "0"], "--clients"),
        (["--clients", "2", "--methods", "k0"], "k0"),
        (["--repeats", "0"], "--repeats"),
        (["--standins", "a,b,c"], "three numbers"),  # it said "could not convert string to float: 'a'"
        (["--standins", "10,2"], "three numbers"),
        (["--standins", "nan,2,0.8"], "stand-ins: forwards of >= 0 ms"),
        (["--clients", "1.5"], "--clients is a comma list of whole numbers >= 1, not '1.5'"),  # ran one client
        (["--duration", "nan"], "--duration > 0, a warm-up >= 0"),  # "Invalid value NaN" once the services ran
        (["--settle", "-1"], "--settle >= 0"),
    ],
)
def test_the_serving_bench_refuses_bad_flags(flags, expected):
    cmd = [sys.executable, "-m", "cli", "bench", "serving", *flags]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "specdec bench" in run.stderr and expected in run.stderr, run.stderr
    assert "starting" not in run.stderr


def test_the_serving_bench_settles_the_regimes_of_the_methods_that_measure_them():
    from bench import serving

    assert serving.settling(serving.ServingConfig(methods=("off", "k4"))) is None  # neither measures regimes
    assert serving.settling(serving.ServingConfig(methods=("off", "default", "adaptive"))) == "default"
    assert serving.ServingConfig().settle > 2 * serving.MEASURED  # both regimes run MEASURED at a load first


def test_the_serving_bench_reports_the_median_of_its_repeats():
    """--repeats: a cell is the median of its runs (tokens/s, each process's CPU per token), its
    requests and errors summed, and the table shows the runs' range beside the median."""
    from bench import serving

    def run(rate, orchestrator, errors=None):
        cpu = {"orchestrator": orchestrator, "draft": 5.0, "target": 4.0, "client": 1.0}
        return serving.Cell("k4", 2, rate, 10, errors or {}, cpu, [rate])

    cell = serving.merged([run(90.0, 30.0), run(120.0, 10.0, {"UNAVAILABLE": 1}), run(100.0, 20.0, {"UNAVAILABLE": 2})])
    assert cell.tokens_per_second == 100.0 and cell.samples == [90.0, 120.0, 100.0]
    assert cell.cpu_us_per_token == {"orchestrator": 20.0, "draft": 5.0, "target": 4.0, "client": 1.0}
    assert cell.requests == 30 and cell.errors == {"UNAVAILABLE": 3}
    one = serving.merged([serving.Cell("k4", 1, 60.0, 5, {}, dict(cell.cpu_us_per_token), [60.0])])
    config = serving.ServingConfig(clients=(1, 2), methods=("k4",), repeats=3)
    table = serving.table([one, cell], config)
    assert "| k4 | 60 (1.00) | 100 (0.83) [90-120] |" in table and "medians of 3 runs" in table
    with pytest.raises(ValueError, match="--repeats"):
        serving.ServingConfig(repeats=0)
    with pytest.raises(ValueError, match="k99"):  # refused before a cell runs (every request would be)
        serving.ServingConfig(methods=("k99",))


def test_the_serving_bench_counts_the_tokens_made_in_its_window():
    """A cell counts each request's tokens at the share of its time inside the window, not whole at
    its answer: 64 clients' answers end together, and counting them whole moved a cell in steps of
    one cohort's answers."""
    from bench import serving

    requests = [
        (0.0, 2.0, 64),  # half inside [1, 3): 32
        (2.0, 4.0, 64),  # half inside: 32
        (1.0, 3.0, 64),  # whole inside: 64
        (3.0, 5.0, 64),  # after it: none
        (-1.0, 1.0, 64),  # before it: none
        (0.0, 4.0, 40),  # its middle half: 20
    ]
    assert serving.in_window(requests, 1.0, 3.0) == pytest.approx(32 + 32 + 64 + 20)
    # a window as long as the whole run counts every token once
    assert serving.in_window(requests, -1.0, 5.0) == pytest.approx(64 * 5 + 40)
