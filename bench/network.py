"""`specdec bench network --rtt-ms 0,1,5,20`: what a network's round trip does to a round, and how much of
it the overlapped rounds hide.

Two one-core hosts on this machine: the draft service pinned to one core and the target service
to another (deploy.local's processes, --draft-cpus / --target-cpus; by default the first and last
cores), the orchestrator in this process beside one of them: by default the draft (`remote`
"target", as the README's two-host layout puts it), or the target (`remote` "draft"). For each
round-trip time, a delaying relay (bench.relay: these kernels have no netem) stands between the
orchestrator and the remote service, and an orchestrator is connected through it. Rows, each run
on the same prompts (greedy, client wall time, prefill included):
- alone, no link: the target alone with the orchestrator beside it (RTT 0): the user's baseline;
- alone: the target alone across the link;
- seq k, overlap k: the split across the link, sequential and overlapped rounds, per fixed k;
- overlap+cache k: overlapped rounds with the speculation cache (orchestrator.speculation_cache:
  the draft also prepares the next round for the likeliest rejections), with its hit rate;
- adaptive: adaptive lookahead, which measures the waits the link adds and prices them.
Reported: tokens/s (median over prompts x repeats), the ratio to the no-link baseline, the
ratio to the same row at the first RTT given (usually 0), acceptance and tokens a round, and
the rounds' own tokens/s. Writes network.json to --out.

This module owns the runs and the table; the relay is bench.relay, the services deploy.local's.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.relay import DelayRelay
from bench.run import COLD, BenchConfig, _chat_ids, _specdec_generate, load_prompts
from deploy import hosting
from deploy.configs import OrchestratorConfig
from deploy.local import LocalPipeline, PipelineConfig, Placement
from specdec.runtime import placement
from specdec.serving.security import ClientSecurity
from specdec.weights import models


@dataclass(frozen=True)
class NetworkConfig:
    rtts_ms: tuple[float, ...] = (0.0, 1.0, 5.0, 20.0)
    remote: str = "target"  # the service across the link from the orchestrator: "target" or "draft"
    ks: tuple[int, ...] = (4, 8)
    adaptive: bool = True
    overlap: tuple[bool, ...] = (True, False)
    drafter: str = "auto"
    max_tokens: int = 128
    repeats: int = 1
    prompt_kinds: tuple[str, ...] = ()
    max_prompts: int = 0
    target: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_TARGET_DTYPE)
    draft: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_DRAFT_DTYPE)
    target_backend: str = "auto"
    draft_placement: Placement = field(default_factory=Placement)  # default: the first core
    target_placement: Placement = field(default_factory=Placement)  # default: the last core
    out: Path = Path("bench-results")

    def __post_init__(self):
        if self.remote not in ("target", "draft"):
            raise ValueError(f"the remote service is the target or the draft, not {self.remote!r}")


def one_core_hosts(config: NetworkConfig) -> tuple[Placement, Placement]:
    """The draft's and the target's placements: as given, else a core each (two one-core hosts)."""
    cores = placement.usable_cores()
    draft = config.draft_placement if config.draft_placement.cpus else Placement(str(cores[0]), 1)
    target = config.target_placement if config.target_placement.cpus else Placement(str(cores[-1]), 1)
    return draft, target


def rows_for(config: NetworkConfig) -> list[tuple[str, str, bool, bool]]:
    """(row name, k as bench.run takes it, overlap, speculation cache) of the rows run across the link."""
    rows = [("alone", "-", False, False)]
    for k in config.ks:
        rows += [(f"{'overlap' if o else 'seq'} k={k}", str(k), o, False) for o in config.overlap]
        if True in config.overlap:
            rows.append((f"overlap+cache k={k}", str(k), True, True))
    if config.adaptive:
        rows.append(("adaptive", "adaptive", True, True))
    return rows


def run(config: NetworkConfig, log=print) -> dict:
    draft_place, target_place = one_core_hosts(config)
    pipeline_config = PipelineConfig(
        target=config.target,
        draft=config.draft,
        drafter=config.drafter,
        target_backend=config.target_backend,
        draft_placement=draft_place,
        target_placement=target_place,
        session_limits=COLD,
    )
    bench = BenchConfig(ks=config.ks, max_tokens=config.max_tokens, prompt_kinds=config.prompt_kinds)
    prompts = load_prompts(bench)
    prompts = prompts[: config.max_prompts] if config.max_prompts else prompts
    results: dict[str, dict] = {"config": {k: str(v) for k, v in asdict(config).items()}, "rtts": {}}
    with LocalPipeline(pipeline_config, log=log) as pipeline:  # its own orchestrator is not used
        services = ClientSecurity(token=pipeline.service_token)
        draft, target = pipeline.addresses["draft"], pipeline.addresses["target"]

        def connected(draft_address: str, target_address: str):
            settings = OrchestratorConfig()
            return hosting.start_orchestrator(draft_address, target_address, settings, service_security=services)

        direct = connected(draft, target)  # no link: the baseline
        try:
            ids = [_chat_ids(direct.pair.tokenizer, p["prompt"]) for p in prompts]
            stub = _stub(direct.port)
            _specdec_generate(stub, ids[0], bench, 0.0, "-")  # warm-up
            results["baseline"] = _row(stub, ids, bench, "-", False, config.repeats)
            log(f"network: alone, no link: {results['baseline']['tokens_per_second']:.2f} tok/s")
        finally:
            direct.stop(None)
        for rtt in config.rtts_ms:
            remote_target = config.remote == "target"
            with DelayRelay(target if remote_target else draft, rtt) as relay:
                orchestrator = connected(draft, relay.address) if remote_target else connected(relay.address, target)
                try:
                    stub = _stub(orchestrator.port)
                    results["rtts"][str(rtt)] = cells = {}
                    for name, k, overlap, cache in rows_for(config):
                        _specdec_generate(stub, ids[0], bench, 0.0, k, overlap, cache=cache)  # warm-up
                        cells[name] = _row(stub, ids, bench, k, overlap, config.repeats, cache)
                        log(f"network: RTT {rtt:g} ms, {name}: {cells[name]['tokens_per_second']:.2f} tok/s")
                finally:
                    orchestrator.stop(None)
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "network.json").write_text(json.dumps(results, indent=2))
    return results


def _stub(port: int):
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc

    return orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def _row(
    stub, ids: list[list[int]], bench: BenchConfig, k: str, overlap: bool, repeats: int, cache: bool = False
) -> dict:
    runs = [_specdec_generate(stub, x, bench, 0.0, k, overlap, cache=cache) for _ in range(repeats) for x in ids]

    def median(key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "tokens_per_second": median("tokens_per_second"),
        "round_tokens_per_second": median("round_tokens_per_second"),
        "acceptance_rate": median("acceptance_rate"),
        "tokens_per_round": median("tokens_per_round"),
        "cache_hit_rate": median("cache_hit_rate"),
        "cache_hits_per_round": median("cache_hits_per_round"),
    }


def format_table(results: dict) -> str:
    base = results["baseline"]["tokens_per_second"]
    rtts = list(results["rtts"])
    first = results["rtts"][rtts[0]]
    header = ["RTT ms", "row", "tok/s", "x alone, no link", f"x RTT {float(rtts[0]):g}", "accept", "tok/round"]
    header += ["rounds tok/s", "cache hits"]
    lines = [header, ["-", "alone, no link", f"{base:.2f}", "1.00x", "-", "-", "-", "-", "-"]]
    for rtt, cells in results["rtts"].items():
        for name, cell in cells.items():
            tps = cell["tokens_per_second"]
            accept, per_round = cell["acceptance_rate"], cell["tokens_per_round"]
            rounds = cell["round_tokens_per_second"]
            lines.append(
                [
                    f"{float(rtt):g}",
                    name,
                    f"{tps:.2f}",
                    f"{tps / base:.2f}x",
                    f"{tps / first[name]['tokens_per_second']:.2f}x",
                    "-" if accept is None else f"{accept:.3f}",
                    "-" if per_round is None else f"{per_round:.2f}",
                    "-" if rounds is None else f"{rounds:.2f}",
                    _hits(cell),
                ]
            )
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in lines)


def _hits(cell: dict) -> str:
    """The speculation cache's hits: of its branches, and a round."""
    rate, per_round = cell.get("cache_hit_rate"), cell.get("cache_hits_per_round")
    return "-" if rate is None else f"{rate:.2f} ({per_round:.2f}/round)"
