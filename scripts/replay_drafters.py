"""The hybrid drafter's choice of proposer, replayed on real greedy answers: no timing noise.

    python scripts/replay_drafters.py [--problems 8] [--chats 2] [--max-tokens 256] [--k 6]
        [--variants rate=0.7,match=8,catch_up=16] [--sequences replay.json]

Live benches of the hybrid move with the VM's speed by more than its rules move it. This replays
instead: the workloads of `specdec bench workloads` (HumanEval rewritten, copied, an agent's request
resent, chat) and bench/prompts.json's other kinds, in that order, each answered greedily by the
F32 target on llama.cpp, with the Q8_0 draft's greedy token at each position given the answer so
far (both once, cached in --sequences). Each answer is then committed round by round, sequentially,
as the loop would: a round asks draft_service.suffix.HybridDrafter.choose (the service's own rule
and index, one store across the requests, a session's model prefilled at open only for prompts of
PREFILL_AT_OPEN tokens or fewer) and commits what its proposer would get accepted plus the bonus
token: the index's chain up to its first miss, or the model's k drafts up to the first the draft
gets wrong. A round costs the forwards it makes, timed here on the same backends first (a verify of
n tokens, a draft step, the draft's prefill a token for a catch-up) plus --overhead-ms. Printed: each
workload's replayed tokens/s over the target alone, for the model draft alone, the hybrid as it
ships, and each variant of it (name=value: HybridDrafter's match, rate or catch_up). Not modelled:
overlapped rounds, the adaptive k, the first tokens beside the draft's open.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draft_service import suffix  # noqa: E402
from orchestrator.loop import FREE_START  # noqa: E402
from specdec.runtime.engine import catch_up_from  # noqa: E402
from specdec.runtime.session import Session  # noqa: E402
from specdec.validation import MAX_LOOKAHEAD  # noqa: E402

VERIFY_SIZES = (1, 2, 4, 8, 16, 33)


@dataclass
class Costs:
    """What a round's forwards cost, ms: a verify of n tokens (interpolated between sizes), a draft step,
    the draft's prefill a token, and the rest of a round."""

    verify_sizes: tuple[int, ...]
    verify_ms: tuple[float, ...]
    draft_step: float
    prefill_token: float
    overhead: float = 1.5

    def verify(self, n: int) -> float:
        return float(np.interp(n, self.verify_sizes, self.verify_ms))

    def catch_up(self, tokens: int) -> float:
        return max(self.draft_step, self.prefill_token * tokens)


def replay(requests: list[dict], k: int, costs: Costs, drafter: suffix.HybridDrafter | None) -> dict:
    """Each request's answer committed round by round; drafter None: the model draft alone.
    {workload: {"speedup", "rounds", "index_rounds"}} of the timed requests (an agent's first is
    not: only its answer in the store counts), the speedup over the target alone's one token a round."""
    out: dict[str, list[float]] = {}
    for r in requests:
        ids, agree = r["ids"], r["agree"]
        full, p0 = ids + r["answer"], len(ids)
        session = Session(tokens=full[: p0 + 1], cache=None, prompt_length=p0, history_scope="replay")
        opened = drafter is None or p0 <= suffix.PREFILL_AT_OPEN
        session.cached = list(ids) if opened else []
        window = None if drafter is None else drafter.window
        p, ms, rounds, indexed, copying = p0 + 1, 0.0, 0, 0, False
        while p < len(full):
            drafts = (
                None
                if drafter is None
                else drafter.choose(session, [], max(k, MAX_LOOKAHEAD if copying else FREE_START))
            )
            if drafts is None:  # the model's round: its catch-up, k steps, a verify of k + 1
                backlog = len(session.tokens) - max(len(session.cached), catch_up_from(session, window))
                first = costs.catch_up(backlog) if backlog > 1 else costs.draft_step
                ms += first + (k - 1) * costs.draft_step + costs.verify(k + 1)
                got = 0
                while got < k and p + got < len(full) and agree[p - p0 + got]:
                    got += 1
                session.cached = full[: p + got]
            else:  # the index's chain (or no drafts): a verify of it and the bonus token
                got = 0
                while got < len(drafts) and p + got < len(full) and drafts[got] == full[p + got]:
                    got += 1
                ms += costs.verify(len(drafts) + 1)
                copying = bool(drafts) and got == len(drafts)
                indexed += 1
            ms += costs.overhead
            p = min(len(full), p + got + 1)
            rounds += 1
            session.tokens = full[:p]
        session.closed = True  # it enters the store at the next request's first proposal
        if not r.get("timed", True):  # an agent's first request: in the store, not in the table
            continue
        totals = out.setdefault(r["workload"], [0, 0.0, 0, 0])
        totals[0] += len(full) - p0 - 1
        totals[1] += ms
        totals[2] += rounds
        totals[3] += indexed
    alone = costs.verify(1) + costs.overhead
    return {w: {"speedup": n * alone / ms, "rounds": rs, "index_rounds": i} for w, (n, ms, rs, i) in out.items()}


def backends():
    """The embedded pair on llama.cpp, one session each: the F32 target and the Q8_0 draft."""
    from specdec.runtime.llamacpp import LlamaCppBackend
    from specdec.weights import models

    target = LlamaCppBackend(models.ModelSpec(), models.f32_gguf_path, sessions=1)
    return target, LlamaCppBackend(models.ModelSpec(), sessions=1)


def sequences(path: Path, problems: int, chats: int, max_tokens: int, pair) -> list[dict]:
    """The requests in the order sent, each with its prompt's ids, the target's greedy answer and, at
    each answer position, whether the draft's greedy token given the answer so far is the target's."""
    if path.exists():
        return json.loads(path.read_text())
    from transformers import AutoTokenizer

    from bench.run import PROMPTS, _chat_ids
    from bench.workloads import WorkloadsConfig, requests
    from specdec.runtime.llamacpp import BATCH_TOKENS
    from specdec.weights import models

    def greedy(backend, cache, tokens: list[int], last: int) -> list[int]:
        """Feed `tokens` (in chunks the backend takes): the greedy token after each of the last `last`."""
        out = []
        for start in range(0, len(tokens), BATCH_TOKENS):
            chunk = tokens[start : start + BATCH_TOKENS]
            wanted = max(0, min(len(chunk), start + len(chunk) - (len(tokens) - last)))
            rows = backend.forward(cache, chunk, max(wanted, 1))
            out += rows[len(rows) - wanted :].argmax(-1).tolist() if wanted else []
        return out

    sent = requests(WorkloadsConfig(problems=problems, chats=chats, max_tokens=max_tokens))
    sent += [
        {"workload": p["kind"], "prompt": p["prompt"]} for p in json.loads(PROMPTS.read_text()) if p["kind"] != "chat"
    ]
    tokenizer = AutoTokenizer.from_pretrained(models.resolve(models.DEFAULT_ALIAS))
    target, draft = pair
    out = []
    for i, r in enumerate(sent):
        ids = _chat_ids(tokenizer, r["prompt"])
        cache = target.new_cache()
        answer = greedy(target, cache, ids, 1)
        while len(answer) < max_tokens and answer[-1] != tokenizer.eos_token_id:
            answer += greedy(target, cache, answer[-1:], 1)
        target.release(cache)
        cache = draft.new_cache()
        guesses = greedy(draft, cache, (ids + answer)[:-1], len(answer))
        draft.release(cache)
        agree = [int(g == t) for g, t in zip(guesses, answer, strict=True)]
        out.append(
            {"workload": r["workload"], "timed": r.get("timed", True), "ids": ids, "answer": answer, "agree": agree}
        )
        shape = f"{len(ids)} + {len(answer)} tokens"
        print(f"  {i + 1}/{len(sent)} {r['workload']}: {shape}, the draft agrees at {np.mean(agree):.2f}", flush=True)
    path.write_text(json.dumps(out))
    return out


def measure(pair, reps: int = 15, context: int = 200) -> Costs:
    """The forwards' costs on this machine: medians of `reps` on a cached context, every size timed in
    turn each rep (two reps of warm-up dropped), so that a drift in the machine's speed hits all alike."""
    target, draft = pair
    forwards = [(target, n) for n in VERIFY_SIZES] + [(draft, 1), (draft, 64)]
    caches = {id(b): b.new_cache() for b in pair}
    for backend in pair:
        backend.forward(caches[id(backend)], [100 + i % 1000 for i in range(context)], 1)
    times: list[list[float]] = [[] for _ in forwards]
    for _ in range(reps + 2):
        for (backend, n), out in zip(forwards, times, strict=True):
            t0 = time.perf_counter()
            backend.forward(caches[id(backend)], [200 + i for i in range(n)], n)
            out.append(time.perf_counter() - t0)
            backend.crop(caches[id(backend)], context)
    for backend in pair:
        backend.release(caches[id(backend)])
    ms = [1000 * statistics.median(t[2:]) for t in times]
    return Costs(VERIFY_SIZES, tuple(ms[: len(VERIFY_SIZES)]), ms[-2], ms[-1] / 64)


def variant(spec: str) -> tuple[str, dict]:
    name, _, value = spec.partition("=")
    if name not in ("match", "rate", "catch_up"):
        raise SystemExit(f"--variants: {name!r} is not one of match, rate, catch_up (name=value)")
    try:
        return spec, {name: float(value) if name == "rate" else int(value)}
    except ValueError:
        raise SystemExit(f"--variants: {spec!r}: {name} takes a number") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--problems", type=int, default=8, help="HumanEval's first problems (default 8)")
    p.add_argument("--chats", type=int, default=2, help="bench/prompts.json's chat prompts (default 2)")
    p.add_argument("--max-tokens", type=int, default=256, help="an answer's most tokens (default 256)")
    p.add_argument("--k", type=int, default=6, help="the model draft's k a round (default 6)")
    p.add_argument("--variants", default="", help="hybrids to replay beside the default, e.g. rate=0.7,match=8")
    p.add_argument("--overhead-ms", type=float, default=1.5, help="a round's cost past its forwards (default 1.5)")
    p.add_argument("--sequences", type=Path, default=Path("bench-results/replay.json"), help="the answers' cache")
    args = p.parse_args()
    variants = [variant(spec) for spec in filter(None, args.variants.split(","))]  # before the models load
    args.sequences.parent.mkdir(parents=True, exist_ok=True)
    pair = backends()
    requests = sequences(args.sequences, args.problems, args.chats, args.max_tokens, pair)
    costs = measure(pair)
    costs.overhead = args.overhead_ms
    verify = ", ".join(f"{n}: {v:.1f}" for n, v in zip(costs.verify_sizes, costs.verify_ms, strict=True))
    print(f"costs, ms: a verify of n tokens ({verify});")
    rest = f"a prefill token {costs.prefill_token:.2f}, a round's rest {costs.overhead}"
    print(f"  a draft step {costs.draft_step:.1f}, {rest}")
    rows = {"model draft alone": replay(requests, args.k, costs, None)}
    window = suffix.WINDOW
    rows["hybrid (default)"] = replay(requests, args.k, costs, suffix.HybridDrafter(window=window))
    for spec, kwargs in variants:
        rows[f"hybrid {spec}"] = replay(requests, args.k, costs, suffix.HybridDrafter(window=window, **kwargs))
    workloads = list(rows["model draft alone"])
    print(f"\nreplayed speedup over the target alone, sequential rounds, k = {args.k} (index rounds / rounds):")
    print(f"{'':22s}" + "".join(f"{w:>20s}" for w in workloads))
    for label, row in rows.items():
        cells = (f"{row[w]['speedup']:6.2f}x ({row[w]['index_rounds']:3d}/{row[w]['rounds']:3d})" for w in workloads)
        print(f"{label:22s}" + "".join(f"{c:>20s}" for c in cells))


if __name__ == "__main__":
    main()
