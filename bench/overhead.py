"""`python -m bench.overhead`: where a round's time goes outside the model forwards.

One client, greedy, sequential rounds (the draft proposes, then the target verifies: their
times add up), a fixed k, through the draft and target services, each in its own process as
`specdec serve` runs them (deploy.hosting builds them), and the orchestrator in this one, on
loopback. Each backend is wrapped to time its forwards; on CUDA the timer waits for the device
(a sync the service would make anyway at its first read of the logits). Per round, in ms:
- round: the orchestrator's round time (GenerateStats.round_seconds / rounds; prefill excluded);
- forwards: the draft's steps and the target's verify, as the backends ran them;
- services: the services' own time less their forwards (compute_seconds: the model worker's
  loop and gather window, the engine's bookkeeping, input tensors, sampling, .tolist());
- wire: the rest (gRPC both ways, (de)serialisation, the orchestrator's rule and bookkeeping);
and outside = round - forwards, as a share of the round. The prompt is long enough that its
prefill chunk is wider than any round's forward, which tells the prefill's forwards apart.

    python -m bench.overhead --target-model PATH --draft-model PATH [--device cuda] [--k 4] [--draft-dtype bfloat16]

Knows nothing of the services' insides: it times what a backend is asked to do.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

PROMPT_TOKENS = 60  # its prefill chunk (59 tokens) is wider than a round's forwards at k <= 16


class TimedBackend:
    """A backend whose forwards are timed (rows no wider than `widest`: a round's, not a prefill's)."""

    def __init__(self, backend, widest: int):
        self._backend = backend
        self.widest = widest
        self.seconds = 0.0
        self.forwards = 0
        self._lock = threading.Lock()
        self._cuda = getattr(backend, "device", None) is not None and backend.device.type == "cuda"

    def forward_batch(self, items):
        t0 = time.perf_counter()
        out = self._backend.forward_batch(items)
        if self._cuda:
            import torch

            torch.cuda.synchronize(self._backend.device)
        if max(len(tokens) for _, tokens, _ in items) <= self.widest:
            with self._lock:
                self.seconds += time.perf_counter() - t0
                self.forwards += 1
        return out

    def forward(self, cache, token_ids, n_logits):
        return self.forward_batch([(cache, token_ids, n_logits)])[0]

    def reset(self) -> None:
        with self._lock:
            self.seconds, self.forwards = 0.0, 0

    def __getattr__(self, name):
        return getattr(self._backend, name)


def measure(
    target: str, draft: str, device: str, k: int, requests: int, max_tokens: int, graphs: bool | None, draft_dtype: str
) -> dict:
    import grpc

    from deploy import hosting
    from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

    models = {"draft": (draft, draft_dtype), "target": (target, "float32")}
    services = {role: _Service(role, path, dtype, device, k, graphs) for role, (path, dtype) in models.items()}
    orchestrator = None
    try:
        orchestrator = hosting.start_orchestrator(services["draft"].address, services["target"].address)
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{orchestrator.port}"))
        vocab = orchestrator.pair.vocab_size
        prompt = [(7 * i + 3) % vocab for i in range(PROMPT_TOKENS)]
        spec = orchestrator_pb2.SpeculationParams(lookahead=k, overlap=False)
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=prompt), max_new_tokens=max_tokens, speculation=spec
        )
        stub.Generate(request, timeout=600)  # warm: the first request pays for lazy initialisation
        rows = []
        for _ in range(requests):
            for service in services.values():
                service.ask("reset")
            s = stub.Generate(request, timeout=600).stats
            rounds = max(s.rounds, 1)
            forwards = sum(float(service.ask("read")) for service in services.values())
            compute = s.draft_compute_seconds + s.target_compute_seconds
            rows.append(
                {
                    "round": s.round_seconds / rounds,
                    "forwards": forwards / rounds,
                    "services": (compute - forwards) / rounds,
                    "wire": (s.round_seconds - compute) / rounds,
                    "tokens_per_round": s.mean_accepted_length,
                }
            )
    finally:
        if orchestrator is not None:
            orchestrator.stop(None)
        for service in services.values():
            service.stop()
    out = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    out["outside_share"] = 1 - out["forwards"] / out["round"]
    return out


class _Service:
    """A model service in a child process (as `specdec serve` runs it: its own interpreter), its
    forwards timed; `ask` sends it a line (reset, read) and returns its answer."""

    def __init__(self, role: str, model: str, dtype: str, device: str, k: int, graphs: bool | None):
        command = [sys.executable, "-m", "bench.overhead", "--serve", role, "--model", model, "--device", device]
        command += ["--draft-dtype", dtype]
        command += ["--k", str(k)] + ([] if graphs is None else ["--compile" if graphs else "--no-compile"])
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        port = self.proc.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"the {role} service did not start (exit {self.proc.wait()})")
        self.address = f"127.0.0.1:{port}"

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def stop(self) -> None:
        self.proc.stdin.close()  # the child stops its server at the end of its input
        self.proc.wait(timeout=60)


def serve(role: str, model: str, dtype: str, device: str, k: int, graphs: bool | None) -> None:
    """The child: serve `role` with timed forwards; print the port, then answer reset and read
    (the forward seconds since the last reset) on stdin until it ends."""
    from deploy import hosting
    from deploy.configs import ModelServiceConfig
    from draft_service import drafters
    from specdec.runtime import placement
    from specdec.weights import models

    if device == "cpu":  # two services and the orchestrator share the cores: one thread each, no spinning
        placement.apply(None, 1)
    config = ModelServiceConfig(role, models.ModelSpec(model, device, dtype), "model", compile=graphs)
    built = hosting.target_backend(config) if role == "target" else drafters.make("model", config.spec, graphs)[0]
    backend = TimedBackend(built, 2 * k + 2)
    server, port = hosting.serve_model(config, backend)
    print(port, flush=True)
    for line in sys.stdin:
        if line.strip() == "reset":
            backend.reset()
            print("ok", flush=True)
        else:
            print(backend.seconds, flush=True)
    server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-model", help="the target: a hub id, a local path or an alias (required)")
    parser.add_argument("--draft-model", help="the draft: a hub id, a local path or an alias (required)")
    parser.add_argument("--device", default="cpu", help="torch device of both models (default cpu)")
    parser.add_argument("--k", type=int, default=4, help="lookahead (default 4)")
    parser.add_argument("--requests", type=int, default=5, help="timed generations, the median reported (default 5)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens a generation (default 64)")
    parser.add_argument("--draft-dtype", default="float32", help="the draft's dtype (default float32; the target's)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, help="CUDA graphs (default: by device)")
    parser.add_argument("--serve", choices=("draft", "target"), help=argparse.SUPPRESS)  # a child: one service
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.model, args.draft_dtype, args.device, args.k, args.compile)
        return
    if not (args.target_model and args.draft_model):  # a child (--serve) takes --model instead
        parser.error("--target-model and --draft-model are required")
    r = measure(
        args.target_model, args.draft_model, args.device, args.k, args.requests, args.max_tokens, args.compile,
        args.draft_dtype,
    )  # fmt: skip
    print(
        f"per round (ms, median of {args.requests} generations, k = {args.k}, {r['tokens_per_round']:.2f} tokens a "
        f"round): round {1000 * r['round']:.2f} = forwards {1000 * r['forwards']:.2f} + services "
        f"{1000 * r['services']:.2f} + wire and orchestrator {1000 * r['wire']:.2f}; outside the forwards "
        f"{r['outside_share']:.0%}"
    )


if __name__ == "__main__":
    main()
