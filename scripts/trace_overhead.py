"""Overhead of telemetry: generated tokens/s with OTLP tracing on vs off (median of --runs runs).

For each mode the three services start as local processes (deploy.local), serve one warm-up
request and then --runs timed requests (greedy, so every run generates the same tokens);
tokens/s is the one the response reports. Modes:
  off             no telemetry (the default)
  traces          OTLP traces (gRPC) to --endpoint, or to an OTLP receiver started here
  traces+metrics  the same plus OTLP metrics and the Prometheus endpoints
Timings mean something only on a quiet machine.

    python scripts/trace_overhead.py                               # the default pair
    python scripts/trace_overhead.py --endpoint http://127.0.0.1:4317 --max-tokens 256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deploy.local import LocalPipeline, PipelineConfig  # noqa: E402
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc  # noqa: E402
from specdec.weights import models  # noqa: E402
from tests.otlp import OtlpReceiver  # noqa: E402

MODES = {
    "off": {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"},
    "traces": {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none"},
    "traces+metrics": {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp"},
}


def measure(config: PipelineConfig, request, runs: int) -> list[float]:
    with LocalPipeline(config, log=lambda msg: print(msg, file=sys.stderr)) as pipeline:
        stub = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipeline.address))
        stub.Generate(request)  # warm-up
        return [stub.Generate(request).stats.tokens_per_second for _ in range(runs)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", help="OTLP/gRPC endpoint of a collector (default: a receiver started here)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--lookahead", type=int, default=4)
    p.add_argument("--prompt", default="Explain speculative decoding in three sentences.")
    p.add_argument("--target-model", default=models.DEFAULT_ALIAS)
    p.add_argument("--draft-model", default=models.DEFAULT_ALIAS)
    p.add_argument("--draft-dtype", default=models.DEFAULT_DRAFT_DTYPE, choices=models.DTYPES)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = p.parse_args()

    request = orchestrator_pb2.GenerateRequest(
        prompt=args.prompt,
        chat_template=True,
        max_new_tokens=args.max_tokens,
        speculation=orchestrator_pb2.SpeculationParams(lookahead=args.lookahead),
    )
    with contextlib.ExitStack() as stack:
        endpoint = args.endpoint or stack.enter_context(OtlpReceiver()).endpoint
        results = {}
        for mode in args.modes:
            config = PipelineConfig(
                target=models.ModelSpec(args.target_model, "cpu", models.DEFAULT_TARGET_DTYPE),
                draft=models.ModelSpec(args.draft_model, "cpu", args.draft_dtype),
                metrics_port=0 if mode == "traces+metrics" else None,
            )
            # The services inherit the environment.
            os.environ.update(MODES[mode], OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
            runs = measure(config, request, args.runs)
            results[mode] = {"tokens_per_second": runs, "median": statistics.median(runs)}
            print(f"{mode:>15}: median {results[mode]['median']:.2f} tok/s of {runs}", file=sys.stderr)
    if "off" in results:
        base = results["off"]["median"]
        for r in results.values():
            r["overhead_percent"] = 100.0 * (base - r["median"]) / base
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
