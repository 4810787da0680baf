"""What a columnar orchestrator would serve: every session's round as one pass, against specdec's.

    python scripts/columnar_round.py [--clients 1,64] [--k 4] [--standins 10,2,0.8] [--duration 8] \
        [--repeats 2] [--servers 1,2] [--split] [--cohorts 1,2] [--request-cpu-ms 0,1.8]

Issue 59 asks 64 clients at k = 4 for 0.75 of 64 x one client with stand-in models. This starts the
three processes as `specdec bench serving` does (deploy.local, stand-ins: forwards that sleep and cost
no core) and measures, alternating, for each number of clients c:

- `specdec`: c closed-loop clients through the orchestrator (bench.serving.cell), greedy, k fixed;
- `columnar`: a loop in place of the orchestrator, on the same two services and their step streams:
  each message a step's calls of all its sessions, each message of results ruled in one numpy pass
  (greedy: a draft kept while it equals the target's argmax), no task, future or loop object a
  session. `--cohorts N`: its sessions in N cohorts that take turns at the target (a cohort's Scores
  held while another's are in the target's step).
  - `columnar server` (`--servers`): the loop in a process of its own behind the client API's
    `Generate`, driven by the same clients as specdec's (a request's prompt encoded and its answer
    decoded on its gRPC handler's thread; no admission, deadline, stop string or stream); `--split`:
    the loop in a process of its own that the server's requests reach, and its answers leave, in batches;
  - `columnar, N cohorts, M ms an answer` (`--cohorts`, `--request-cpu-ms`): the loop in this process
    with c sessions of its own, an answer of --max-tokens tokens closing its sessions and opening the
    next request's in its slot, M ms of its thread's CPU burned an answer for a request's own cost.

Every answer the loop makes is checked against the stand-in target's greedy text (it raises on one
that differs). It prints tokens/s (each answer's tokens counted at its share of the window, as the
bench does), the ratio to c x the same way's one-client figure, each process's CPU per token (µs),
tokens a verify, and the sessions a step of the target held. Not the product: greedy, one fixed k, no
faults; a measurement of where the serving path's time goes.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import functools
import itertools
import multiprocessing
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import serving  # noqa: E402
from deploy.local import LocalPipeline  # noqa: E402
from orchestrator.prompts import load_tokenizer  # noqa: E402
from specdec.runtime.standin import StandinBackend  # noqa: E402
from specdec.serving import security  # noqa: E402
from specdec.v1 import model_pb2, model_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc  # noqa: E402

PROMPT = [5 + (i * 7) % 40 for i in range(24)]  # stand-in token ids


def greedy(prompt: list[int], n: int) -> list[int]:
    """The stand-in target's greedy continuation of `prompt` (every stand-in's reference law)."""
    law = StandinBackend("standin:0")
    cache, fed, tokens = law.new_cache(), list(prompt), []
    for _ in range(n):
        [row] = law.forward(cache, fed, 1)
        fed = [int(row.argmax())]
        tokens += fed
    return tokens


def drained(source: queue.SimpleQueue) -> list:
    """What `source` holds: at least one item (waited for), and every other one there now."""
    items = [source.get()]
    while True:
        try:
            items.append(source.get_nowait())
        except queue.Empty:
            return items


class Link:
    """One service's step stream: calls go out a message a flush, result messages come in on `inbox`."""

    def __init__(self, name: str, address: str, stub, token: str, inbox: queue.SimpleQueue):
        self.name = name
        self.calls: list = []
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._channel = security.channel(address, security.ClientSecurity(token=token))
        results = stub(self._channel).Steps(iter(self._out.get, None))
        threading.Thread(target=self._read, args=(results, inbox), daemon=True).start()

    def _read(self, results, inbox) -> None:
        try:
            for message in results:
                inbox.put((self, message))
        except grpc.RpcError:
            pass  # the stream ended (close)

    def flush(self) -> None:
        if self.calls:
            self._out.put(model_pb2.StepCalls(calls=self.calls))
            self.calls = []

    def close(self) -> None:
        self._out.put(None)
        self._channel.close()


class Slot:
    """One client's request at a time: its sessions, what each service holds and is owed."""

    __slots__ = (
        "index", "serial", "sid", "draft_length", "target_length", "draft_owed", "target_owed", "made", "drafts",
        "opening", "sent", "cohort", "prompt", "expected", "reply",
    )  # fmt: skip

    def __init__(self, index: int, cohort: int, prompt: list[int], expected: list[int], reply=None):
        self.index, self.serial, self.cohort = index, 0, cohort
        self.prompt, self.expected, self.reply = prompt, expected, reply  # reply(ids): a served request's answer


class ColumnarLoop:
    """c sessions' rounds on the two services, every message's results handled in one pass."""

    def __init__(
        self,
        addresses: dict,
        token: str,
        clients: int,
        k: int,
        max_tokens: int,
        request_cpu: float,
        cohorts: int,
    ):
        self.k, self.max_tokens, self.request_cpu = k, max_tokens, request_cpu
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.draft = Link("draft", addresses["draft"], model_pb2_grpc.DraftServiceStub, token, self.inbox)
        self.target = Link("target", addresses["target"], model_pb2_grpc.TargetServiceStub, token, self.inbox)
        self.ids = itertools.count(1)
        self.owner: dict[int, tuple[Slot, str]] = {}
        expected = greedy(PROMPT, max_tokens)
        self.slots = [Slot(i, i % cohorts, PROMPT, expected) for i in range(clients)]
        # Cohorts take turns at the target: a cohort's Scores wait while another's are there.
        self.cohorts = cohorts
        self.at_target = [0] * cohorts  # Scores in flight, a cohort
        self.held: list[list] = [[] for _ in range(cohorts)]  # (slot, drafts) waiting for their turn
        self.answers: list[tuple[float, float, int]] = []  # (sent, answered, tokens), as bench.serving counts
        self.target_steps: list[int] = []  # sessions in each message of the target's results
        self.verified = [0, 0]  # verifies of k drafts, the tokens they committed (a check on the rule)
        self.tag = f"columnar{os.getpid()}.{id(self)}"

    def _call(self, link: Link, slot: Slot, what: str, **call) -> None:
        call_id = next(self.ids)
        self.owner[call_id] = (slot, what)
        link.calls.append(model_pb2.StepCall(id=call_id, timeout=60, **call))

    def _open(self, slot: Slot) -> None:
        slot.serial += 1
        slot.sid = f"{self.tag}.{slot.index}.{slot.serial}"
        slot.draft_length = slot.target_length = len(slot.prompt)
        slot.draft_owed, slot.target_owed, slot.made, slot.drafts = [], [], [], []
        slot.opening, slot.sent = 2, time.monotonic()
        for link in (self.draft, self.target):
            request = model_pb2.OpenSessionRequest(session_id=slot.sid, prompt_token_ids=slot.prompt)
            self._call(link, slot, "open", open_session=request)

    def _propose(self, slot: Slot) -> None:
        ref = model_pb2.SessionRef(session_id=slot.sid, expected_length=slot.draft_length)
        self._call(
            self.draft,
            slot,
            "propose",
            propose=model_pb2.ProposeRequest(session=ref, append_tokens=slot.draft_owed, k=self.k),
        )
        slot.draft_length += len(slot.draft_owed)
        slot.draft_owed = []

    def _score(self, slot: Slot, drafts: list[int]) -> None:
        if any(n for c, n in enumerate(self.at_target) if c != slot.cohort):
            self.held[slot.cohort].append((slot, drafts))
            return
        self.at_target[slot.cohort] += 1
        ref = model_pb2.SessionRef(session_id=slot.sid, expected_length=slot.target_length)
        request = model_pb2.ScoreRequest(session=ref, append_tokens=slot.target_owed, draft_token_ids=drafts)
        self._call(self.target, slot, "score", score=request)
        slot.target_length += len(slot.target_owed)
        slot.target_owed, slot.drafts = [], drafts

    def _close(self, slot: Slot) -> None:
        for link in (self.draft, self.target):
            self._call(link, slot, "close", close_session=model_pb2.CloseSessionRequest(session_id=slot.sid))

    def _commit(self, slot: Slot, tokens: list[int], running: bool) -> None:
        tokens = tokens[: self.max_tokens - len(slot.made)]
        slot.made += tokens
        slot.draft_owed += tokens
        slot.target_owed += tokens
        if len(slot.made) < self.max_tokens:
            self._propose(slot)
            return
        if slot.made != slot.expected:  # greedy: every answer is the target's own
            raise RuntimeError(f"an answer differs from the target's greedy text: {slot.made} != {slot.expected}")
        self.answers.append((slot.sent, time.monotonic(), len(slot.made)))
        self._close(slot)
        if self.request_cpu:
            end = time.thread_time() + self.request_cpu
            while time.thread_time() < end:
                pass
        if slot.reply is not None:
            slot.reply(slot.made)
        elif running:
            self._open(slot)

    def run(self, warmup: float, duration: float, pids: dict[str, int]) -> dict:
        for slot in self.slots:
            self._open(slot)
        t_start = time.monotonic()
        t0 = t1 = None
        while True:
            now = time.monotonic()
            if t0 is None and now - t_start >= warmup:
                t0, cpu0, own0, steps0 = now, serving.cpu_seconds(pids), time.process_time(), len(self.target_steps)
            elif t0 is not None and t1 is None and now - t0 >= duration:
                t1, cpu1, own1, steps1 = now, serving.cpu_seconds(pids), time.process_time(), len(self.target_steps)
            if t1 is not None and not self.owner:
                break
            self.draft.flush()
            self.target.flush()
            self._handle(t1 is None)
        self.draft.close()
        self.target.close()
        tokens = serving.in_window(self.answers, t0, t1)
        per_token = {name: (cpu1[name] - cpu0[name]) / max(tokens, 1) * 1e6 for name in pids}
        per_token["columnar"] = (own1 - own0) / max(tokens, 1) * 1e6
        steps = self.target_steps[steps0:steps1]
        verified, committed = self.verified
        return {
            "tokens_per_second": tokens / (t1 - t0),
            "cpu": per_token,
            "steps": steps,
            "verify": committed / verified,
        }

    def _handle(self, running: bool) -> None:
        """The results that came since the last pass (one message or several), handled together."""
        scored = []
        for link, message in drained(self.inbox):
            if link is None:  # a served request: its slot, to open
                self._open(message)
                continue
            if link is self.target:
                scores = sum(1 for r in message.results if r.WhichOneof("result") == "score")
                if scores:
                    self.target_steps.append(scores)
            for result in message.results:
                slot, what = self.owner.pop(result.id)
                if result.code:
                    raise RuntimeError(f"{link.name} {what} failed: {result.code} {result.details}")
                if what == "open":
                    slot.opening -= 1
                    if not slot.opening:
                        self._score(slot, [])  # the first token: a plain round
                elif what == "propose":
                    self._score(slot, list(result.propose.token_ids))
                elif what == "score":
                    self.at_target[slot.cohort] -= 1
                    scored.append((slot, result.score.argmax_token_ids))
        full = [(slot, argmax) for slot, argmax in scored if len(slot.drafts) == self.k]
        for slot, argmax in scored:
            if len(slot.drafts) != self.k:  # a plain round (or a proposal cut short): its first token
                self._commit(slot, [argmax[0]], running)
        if full:  # the greedy rule for all of them at once
            drafts = np.array([slot.drafts for slot, _ in full])
            target = np.array([list(argmax) for _, argmax in full])
            missed = drafts != target[:, : self.k]
            kept = np.where(missed.any(1), missed.argmax(1), self.k)
            self.verified[0] += len(full)
            self.verified[1] += int(kept.sum()) + len(full)
            for (slot, _), row, n in zip(full, target.tolist(), kept.tolist(), strict=True):
                self._commit(slot, slot.drafts[:n] + [row[n]], running)
        for cohort in sorted(range(self.cohorts), key=lambda c: -len(self.held[c])):  # the turn passes
            held, self.held[cohort] = self.held[cohort], []
            for slot, drafts in held:
                self._score(slot, drafts)


class Server(orchestrator_pb2_grpc.OrchestratorServicer):
    """The client API's Generate in front of the loop: a request's prompt encoded on its handler's
    thread, handed to the loop (`forward`), its answer decoded there; no admission, deadline, stop
    string or stream."""

    def __init__(self, forward, max_tokens: int, target: str, token: str):
        self.forward = forward  # forward(request id, prompt ids, expected answer, reply(ids))
        self.max_tokens = max_tokens
        stub = model_pb2_grpc.TargetServiceStub(security.channel(target, security.ClientSecurity(token=token)))
        # the target's tokenizer, as the orchestrator loads it; its backend's encode keeps the GIL
        self.tokenizer = load_tokenizer(stub.GetTokenizer(model_pb2.GetTokenizerRequest())).backend_tokenizer
        self.expected: dict[tuple, list[int]] = {}  # a prompt's greedy answer, to check the loop's
        self.serial = itertools.count()

    def Generate(self, request, context):
        prompt = self.tokenizer.encode(request.prompt, add_special_tokens=False).ids
        expected = self.expected.get(tuple(prompt))
        if expected is None:
            expected = self.expected[tuple(prompt)] = greedy(prompt, self.max_tokens)
        done, answer = threading.Event(), []

        def reply(ids: list[int]) -> None:
            answer.extend(ids)
            done.set()

        self.forward(next(self.serial), prompt, expected, reply)
        done.wait()
        text = self.tokenizer.decode(answer)
        return orchestrator_pb2.GenerateResponse(token_ids=answer, text=text, finish_reason="length")


def batches(source: queue.SimpleQueue, send) -> None:
    """send(list) of whatever `source` holds, a list at a time, forever (a thread's)."""
    while True:
        send(drained(source))


def rounds(loop: ColumnarLoop) -> None:
    while True:
        loop.draft.flush()
        loop.target.flush()
        loop._handle(True)


def engine(conn, addresses: dict, token: str, k: int, max_tokens: int, cohorts: int) -> None:
    """The loop in a process of its own, fed requests and sending answers in batches on `conn`."""
    loop = ColumnarLoop(addresses, token, 0, k, max_tokens, 0.0, cohorts)
    answers: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:
        while True:
            for rid, prompt, expected in conn.recv():
                reply = functools.partial(lambda rid, ids: answers.put((rid, list(ids))), rid)
                loop.inbox.put((None, Slot(rid, rid % cohorts, prompt, expected, reply)))

    threading.Thread(target=receive, daemon=True).start()
    threading.Thread(target=batches, args=(answers, conn.send), daemon=True).start()
    rounds(loop)


def serve(draft: str, target: str, k: int, max_tokens: int, cohorts: int, split: bool) -> None:
    """The loop behind a gRPC port (its address and the loop's pid on stdout) until killed: in this
    process, or (`split`) in a process of its own that this one's requests reach in batches."""
    addresses, token = {"draft": draft, "target": target}, os.environ["COLUMNAR_TOKEN"]
    if split:
        here, there = multiprocessing.Pipe()
        worker = multiprocessing.get_context("spawn").Process(
            target=engine, args=(there, addresses, token, k, max_tokens, cohorts), daemon=True
        )
        worker.start()
        requests: queue.SimpleQueue = queue.SimpleQueue()
        waiting: dict[int, object] = {}

        def receive() -> None:
            while True:
                for rid, ids in here.recv():
                    waiting.pop(rid)(ids)

        def forward(rid, prompt, expected, reply) -> None:
            waiting[rid] = reply
            requests.put((rid, prompt, expected))

        threading.Thread(target=receive, daemon=True).start()
        threading.Thread(target=batches, args=(requests, here.send), daemon=True).start()
        pid = worker.pid
    else:
        loop = ColumnarLoop(addresses, token, 0, k, max_tokens, 0.0, cohorts)

        def forward(rid, prompt, expected, reply) -> None:
            loop.inbox.put((None, Slot(rid, rid % cohorts, prompt, expected, reply)))

        threading.Thread(target=rounds, args=(loop,), daemon=True).start()
        pid = os.getpid()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1024))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(Server(forward, max_tokens, target, token), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"127.0.0.1:{port} {pid}", flush=True)
    server.wait_for_termination()


def started_server(pipeline: LocalPipeline, k: int, max_tokens: int, cohorts: int, split: bool) -> subprocess.Popen:
    """A `serve` process on the pipeline's two services; its address is `.address`, the loop's pid `.loop`."""
    cmd = [sys.executable, __file__, "--serve-for", f"{pipeline.addresses['draft']},{pipeline.addresses['target']}"]
    cmd += ["--k", str(k), "--max-tokens", str(max_tokens), "--cohorts", str(cohorts)] + (["--split"] if split else [])
    env = {**os.environ, "COLUMNAR_TOKEN": pipeline.service_token}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline().split()
    if not line:
        raise RuntimeError("the columnar server did not start")
    proc.address, proc.loop = line[0], int(line[1])
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,64", help="numbers of clients (sessions), comma-separated")
    parser.add_argument("--k", type=int, default=4, help="the fixed lookahead")
    parser.add_argument("--standins", default="10,2,0.8", help="TARGET_MS,DRAFT_MS,AGREEMENT")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds measured a cell")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each cell (medians)")
    parser.add_argument("--cohorts", default="1", help="the columnar loop's cohorts (taking turns), comma-separated")
    parser.add_argument("--request-cpu-ms", default="0", help="the columnar loop's CPU an answer, comma-separated")
    parser.add_argument(
        "--servers", default="", help="cohorts of a columnar loop behind a gRPC Generate, comma-separated (none: off)"
    )
    parser.add_argument("--split", action="store_true", help="the --servers' loop in a process of its own")
    parser.add_argument("--serve-for", help=argparse.SUPPRESS)  # DRAFT,TARGET: run as such a server
    args = parser.parse_args()
    if args.serve_for:
        draft, target = args.serve_for.split(",")
        serve(draft, target, args.k, args.max_tokens, int(args.cohorts), args.split)
        return
    clients = [int(c) for c in args.clients.split(",")]
    variants = {  # the columnar loop's, in this process: (CPU an answer, seconds; cohorts)
        f"columnar, {n} cohort{'s' if n > 1 else ''}, {b:g} ms an answer": (b / 1000, n)
        for n in (int(x) for x in args.cohorts.split(","))
        for b in (float(x) for x in args.request_cpu_ms.split(","))
    }
    front = "server, its loop apart" if args.split else "server"
    served = {f"columnar {front}, {n} cohort{'s' if n > 1 else ''}": n for n in _ints(args.servers)}
    target_ms, draft_ms, agreement = (float(x) for x in args.standins.split(","))
    config = serving.ServingConfig(
        clients=tuple(clients), methods=(f"k{args.k}",), target_ms=target_ms, draft_ms=draft_ms,
        agreement=agreement, max_tokens=args.max_tokens, duration=args.duration, warmup=args.warmup,
    )  # fmt: skip
    ways = ["specdec", *served, *variants]
    cells: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    request = serving.request(f"k{args.k}", args.max_tokens)
    with (
        LocalPipeline(serving.pipeline_config(config), log=lambda *_: None) as pipeline,
        contextlib.ExitStack() as stack,
    ):
        pids = {name: proc.pid for name, proc in pipeline.procs.items()}
        services = {n: p for n, p in pids.items() if n != "orchestrator"}
        stubs = {"specdec": (orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipeline.address)), pids)}
        for way, cohorts in served.items():
            proc = stack.enter_context(started_server(pipeline, args.k, args.max_tokens, cohorts, args.split))
            stack.callback(proc.kill)
            if proc.loop != proc.pid:  # its loop's own process too (it holds the pipes this one holds)
                stack.callback(os.kill, proc.loop, signal.SIGKILL)
            stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(proc.address))
            apart = {"engine": proc.loop} if proc.loop != proc.pid else {}
            stubs[way] = (stub, {**services, "columnar": proc.pid, **apart})
        addresses = {name: pipeline.addresses[name] for name in ("draft", "target")}
        for turn, (c, _) in enumerate(itertools.product(clients, range(args.repeats))):
            for way in ways[:: 1 if turn % 2 == 0 else -1]:
                if way in stubs:  # clients through a server's Generate, as `specdec bench serving` sends them
                    stub, measured = stubs[way]
                    got = serving.cell(stub, request, way, c, config, measured)
                    out = {
                        "tokens_per_second": got.tokens_per_second,
                        "cpu": got.cpu_us_per_token,
                        "verify": 0,
                        "steps": [],
                    }
                else:
                    burn, cohorts = variants[way]
                    loop = ColumnarLoop(addresses, pipeline.service_token, c, args.k, args.max_tokens, burn, cohorts)
                    out = loop.run(args.warmup, args.duration, services)
                cells[way, c].append(out)
                cpu = " / ".join(f"{name} {us:.0f}" for name, us in out["cpu"].items())
                check = f", {out['verify']:.2f} tokens a verify" if out["verify"] else ""
                print(
                    f"{way}, c = {c}: {out['tokens_per_second']:,.0f} tok/s (CPU µs a token: {cpu}){check}", flush=True
                )
    print(f"\nk = {args.k}, stand-ins {args.standins}, {args.max_tokens}-token answers, medians of {args.repeats}")
    print("tokens/s (/ c x one client); CPU µs a token (the orchestrator or the columnar loop / draft / target)")
    heads = " | ".join(f"c = {c}" for c in clients)
    print(f"| way | {heads} | sessions a step of the target, at the most clients (commonest) |")
    print("|---|" + "---:|" * len(clients) + "---|")
    for way in ways:
        row, steps = [], []
        for c in clients:
            runs = cells[way, c]
            rate = statistics.median(r["tokens_per_second"] for r in runs)
            one = statistics.median(r["tokens_per_second"] for r in cells[way, clients[0]])
            own = "orchestrator" if way == "specdec" else "columnar"
            us = [
                statistics.median(r["cpu"][p] + r["cpu"].get("engine", 0) * (p == own) for r in runs)
                for p in (own, "draft", "target")
            ]
            row.append(f"{rate:,.0f} ({rate / (c * one):.2f}); {us[0]:.0f} / {us[1]:.0f} / {us[2]:.0f}")
            steps += [s for r in runs for s in r["steps"]] if c == clients[-1] else []
        common = collections.Counter(steps).most_common(3)
        step = ", ".join(f"{n} ({100 * m / len(steps):.0f}%)" for n, m in common) if steps else "-"
        print(f"| {way} | " + " | ".join(row) + f" | {step} |")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


if __name__ == "__main__":
    main()
