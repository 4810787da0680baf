"""A frozen draft, then a frozen target, by hand: the default pair in three processes (deploy.local),
as tests/test_hung_peers.py runs it with stand-in models.

1. A greedy request; the same request again, and SIGSTOP to the draft 3 s into it: how long after
   the stop it finishes, and whether its text is the first one's. A new 24-token request while the
   draft is stopped; then SIGCONT, and how soon a request speculates again.
2. Two requests, one with a 5 s deadline and one without; SIGSTOP to the target 1 s in: when and how
   each fails. A new request while the target is stopped; then SIGCONT, and how soon one succeeds.

    python scripts/hung_peers.py [--max-tokens N] [--standins] [--drop | --kill]

`--standins`: stand-in models (standin:20, standin:2:0.9) instead of the default pair. `--drop`: the
draft's and the target's links hold every packet (bench.relay between the orchestrator and each
service) instead of SIGSTOP to the process. `--kill`: instead of both, SIGKILL to the draft 3 s into
a request (the pipeline restarts it on its address): whether the request finishes with its text,
and how soon after the new draft answers on its address a request speculates again.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.relay import DelayRelay  # noqa: E402
from deploy.local import LocalPipeline, PipelineConfig  # noqa: E402
from specdec.v1 import model_pb2, orchestrator_pb2_grpc  # noqa: E402
from specdec.v1 import orchestrator_pb2 as pb  # noqa: E402
from specdec.weights.models import ModelSpec  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper."


def request(n: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=PROMPT, chat_template=True, max_new_tokens=n)


def timed(call) -> tuple[float, str]:
    """(seconds, "OK" or the error's code and details)."""
    start = time.monotonic()
    try:
        call()
        outcome = "OK"
    except grpc.RpcError as err:
        outcome = f"{err.code().name}: {err.details()[:160]}"
    return time.monotonic() - start, outcome


def until(call, within: float = 30.0) -> float | None:
    """Seconds until call() is true (None if not within `within`)."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        try:
            if call():
                return time.monotonic() - start
        except grpc.RpcError:
            pass
        time.sleep(0.25)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=300, help="the long requests' tokens (default 300)")
    parser.add_argument("--standins", action="store_true", help="stand-in models instead of the default pair")
    parser.add_argument("--drop", action="store_true", help="hold each link's packets instead of SIGSTOP")
    parser.add_argument("--kill", action="store_true", help="kill the draft mid-request; it restarts on its address")
    args = parser.parse_args()
    config = PipelineConfig()
    if args.standins:
        config = PipelineConfig(target=ModelSpec(model="standin:20"), draft=ModelSpec(model="standin:2:0.9"))
    relays: dict[str, DelayRelay] = {}

    def link(name: str, address: str) -> str:
        relays[name] = DelayRelay(address, rtt_ms=0).start()
        return relays[name].address

    def fault(name: str, pid: int, on: bool) -> None:
        if args.drop:
            relays[name].hold = on
        else:
            os.kill(pid, signal.SIGSTOP if on else signal.SIGCONT)

    if args.drop:
        config = replace(config, link=link)
    what, ended = ("cut off", "let through") if args.drop else ("stopped", "woken")
    with LocalPipeline(config, log=print) as pipeline:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipeline.address))
        stub.Generate(request(16), timeout=120)
        start = time.monotonic()
        first = stub.Generate(request(args.max_tokens), timeout=300)
        print(f"a request: {len(first.token_ids)} tokens in {time.monotonic() - start:.2f} s")

        if args.kill:
            return killed_draft(pipeline, stub, first, args.max_tokens)
        draft = pipeline.procs["draft"].pid
        in_flight = stub.Generate.future(request(args.max_tokens), timeout=300)
        time.sleep(3.0)
        fault("draft", draft, True)
        stopped = time.monotonic()
        try:
            reply = in_flight.result()
            same = list(reply.token_ids) == list(first.token_ids)
            print(f"draft {what}: the request in flight finished {time.monotonic() - stopped:.2f} s after the stop, "
                  f"same text: {same}, rounds without the draft: {reply.stats.rounds_without_draft}")  # fmt: skip
        except grpc.RpcError as err:
            print(f"draft {what}: the request in flight failed after {time.monotonic() - stopped:.2f} s: {err.code()}")
        seconds, outcome = timed(lambda: stub.Generate(request(24), timeout=60))
        print(f"draft {what}: a new 24-token request {outcome} in {seconds:.2f} s")
        fault("draft", draft, False)
        back = until(lambda: stub.Generate(request(24), timeout=60).stats.accepted_tokens > 0)
        print(f"draft {ended}: speculating again after {back if back is None else round(back, 2)} s")

        target = pipeline.procs["target"].pid
        long = request(4 * args.max_tokens)
        with_deadline = stub.Generate.future(long, timeout=5.0)
        without = stub.Generate.future(long, timeout=300)
        time.sleep(1.0)
        fault("target", target, True)
        stopped = time.monotonic()
        for name, future in (("with a 5 s deadline", with_deadline), ("without a deadline", without)):
            seconds, outcome = timed(future.result)
            print(f"target {what}: the request {name}: {outcome}, {time.monotonic() - stopped:.2f} s after the stop")
        seconds, outcome = timed(lambda: stub.Generate(request(24), timeout=60))
        print(f"target {what}: a new request {outcome} in {seconds:.2f} s")
        fault("target", target, False)
        back = until(lambda: len(stub.Generate(request(8), timeout=60).token_ids) > 0)
        print(f"target {ended}: served again after {back if back is None else round(back, 2)} s")
    return 0


def killed_draft(pipeline, stub, first, max_tokens: int) -> int:
    """SIGKILL to the draft 3 s into a request; the pipeline restarts it on its address."""
    old = pipeline.procs["draft"].pid
    in_flight = stub.Generate.future(request(max_tokens), timeout=300)
    time.sleep(3.0)
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    try:
        pipeline.serving_pid("draft", 120, exclude=(old,))  # the supervisor found it serving on its address
    except TimeoutError:
        print("draft killed: not back on its address within 120 s")
        return 1
    answered = time.monotonic()
    print(f"draft killed: the new draft answers on its address {answered - killed:.2f} s after the kill")
    found = until(lambda: stub.Describe(model_pb2.DescribeRequest(), timeout=5).draft.available, within=30)
    print(f"draft back: the orchestrator finds it {found if found is None else round(found, 2)} s after it answers")
    back = until(lambda: stub.Generate(request(24), timeout=60).stats.accepted_tokens > 0)
    print(f"draft back: a new request speculates {back if back is None else round(back, 2)} s after that")
    reply = in_flight.result()
    same = list(reply.token_ids) == list(first.token_ids)
    print(f"draft killed: the request in flight finished {time.monotonic() - killed:.2f} s after the kill, "
          f"same text: {same}, rounds without the draft: {reply.stats.rounds_without_draft}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
