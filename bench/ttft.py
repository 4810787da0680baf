"""`specdec bench ttft`: time to first token from a client, a long system prompt, turn by turn.

bench/long_chat.json is a chat: a store's return policy as the system prompt (1,298 tokens of the
default pair's tokenizer; 1,336 with the first question in the chat template) and four questions.
A client of the orchestrator (GenerateStream, the messages rendered by the server's chat template,
greedy answers of --max-tokens) times, from the call to the first chunk holding a token:
- first: the system prompt and the first question, cold: each repeat opens its system prompt with
  a line of its own ("Conversation 3."), so nothing of it is cached yet;
- second: the same messages, the first answer and the second question (the next turn);
- identical: the second turn's request again;
- multi-turn: the third and fourth turns, each with the whole conversation so far.
Against `prefill`: the target model in this process, transformers `generate` of one token on the
first turn's prompt ids (every core, as the target alone would run it); where the pipeline's target
runs on llama.cpp (the default pair on a CPU), also `prefill llama.cpp`: that engine's prefill of
the same ids in this process, in the chunks the service feeds (every core), the target alone on
the engine the pipeline runs it on. Reported: each case's
median time to first token over the repeats, and its ratio (the first turn's to the prefill, the
others' to the first turn's), with issue 43's criteria (first <= 1.1x prefill, second <= 0.2x
first, identical <= 0.1x first). The same conversation runs on a second pipeline with the prefix
cache off ("off" rows: every turn prefills its whole history), and each row says the prompt
tokens the target and the draft reused (Describe's prefix_cache, before and after the request).
The pipelines and the in-process model take turns, repeat by repeat, so a drift in machine speed
slows each alike. Prints a table and writes ttft.json to --out.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.report import format_rows
from deploy.local import LocalPipeline, PipelineConfig
from specdec.limits import SessionLimits
from specdec.weights import models

CHAT = Path(__file__).with_name("long_chat.json")
CRITERIA = {"first": 1.1, "second": 0.2, "identical": 0.1}  # issue 43's bounds on the ratios
CASES = ("first", "second", "identical", "multi-turn")


@dataclass(frozen=True)
class TTFTConfig:
    target: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_TARGET_DTYPE)
    draft: models.ModelSpec = models.ModelSpec(dtype=models.DEFAULT_DRAFT_DTYPE)
    drafter: str = "auto"  # the default pair's: the hybrid (the llama.cpp Q8_0 draft and a suffix index)
    target_backend: str = "torch"
    max_tokens: int = 48  # each answer's tokens at most
    repeats: int = 3
    turns: int = 4  # of the chat's questions (>= 2: the second turn is a criterion)
    cold: bool = True  # also the pipeline with the prefix cache off
    system_chars: int = 0  # the system prompt cut to its first characters (0: whole; tiny models' short context)
    out: Path = Path("bench-results")


def load_chat() -> dict:
    return json.loads(CHAT.read_text())


def run(config: TTFTConfig, log=print) -> dict:
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc

    chat = load_chat()
    if config.system_chars:
        chat["system"] = chat["system"][: config.system_chars]
    if not 2 <= config.turns <= len(chat["questions"]):
        raise ValueError(f"turns must be in 2..{len(chat['questions'])}, not {config.turns}")
    model, tokenizer = models.load(config.target)
    engine = _llamacpp_target(config)
    runs: dict[tuple[str, str], list[dict]] = {}
    caches = {"on": True, "off": False} if config.cold else {"on": True}
    with ExitStack() as stack:
        stubs = {}
        for name, on in caches.items():  # up for the whole run, so that they take turns
            pipeline_config = PipelineConfig(
                target=config.target,
                draft=config.draft,
                drafter=config.drafter,
                target_backend=config.target_backend,
                session_limits=SessionLimits(prefix_cache=on),
            )
            pipeline = stack.enter_context(LocalPipeline(pipeline_config, log=log))
            orchestrator = orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(pipeline.address))
            stubs[name] = orchestrator, _services(pipeline)
        for rep in range(config.repeats + 1):  # the first, a conversation of its own, warms up and is dropped
            system = f"Conversation {rep}.\n{chat['system']}"
            first = [{"role": "system", "content": system}, {"role": "user", "content": chat["questions"][0]}]
            ids = _ids(tokenizer, first)
            prefill = {"seconds": _prefill_seconds(model, ids), "prompt_tokens": len(ids)}
            engine_prefill = {"seconds": _engine_prefill_seconds(engine, ids)} if engine is not None else None
            for name, (stub, services) in stubs.items():
                for case, result in _conversation(stub, services, system, chat["questions"][: config.turns], config):
                    if rep:
                        runs.setdefault((name, case), []).append(result)
            if rep:
                runs.setdefault(("-", "prefill"), []).append(prefill)
                if engine_prefill is not None:
                    runs.setdefault(("-", "prefill llama.cpp"), []).append(engine_prefill)
            log(f"ttft: repeat {rep} of {config.repeats} done" + ("" if rep else " (the warm-up)"))
    return summarise(config, runs)


def _services(pipeline) -> dict:
    """Stubs of the pipeline's model services (their token: LocalPipeline's service token)."""
    from specdec.serving import security
    from specdec.v1 import model_pb2_grpc

    client = security.ClientSecurity(token=pipeline.service_token)
    return {
        "target": model_pb2_grpc.TargetServiceStub(security.channel(pipeline.addresses["target"], client)),
        "draft": model_pb2_grpc.DraftServiceStub(security.channel(pipeline.addresses["draft"], client)),
    }


def _hit_tokens(services: dict) -> dict[str, int]:
    from specdec.v1 import model_pb2

    infos = {role: stub.Describe(model_pb2.DescribeRequest(), timeout=30) for role, stub in services.items()}
    return {role: info.prefix_cache.hit_tokens for role, info in infos.items()}


def _conversation(stub, services: dict, system: str, questions: list[str], config: TTFTConfig):
    """(case, result) of each timed request of one conversation, in order."""
    messages = [{"role": "system", "content": system}]
    for turn, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        result = _timed(stub, services, messages, config)
        yield ("first" if turn == 0 else "second" if turn == 1 else "multi-turn"), result
        if turn == 1:
            yield "identical", _timed(stub, services, messages, config)
        messages.append({"role": "assistant", "content": result.pop("text")})


def _timed(stub, services: dict, messages: list[dict], config: TTFTConfig) -> dict:
    """One streamed request: seconds to its first token, its length, and the prompt tokens each
    service reused for it (their prefix caches' counts, before and after; the services serve no one else)."""
    from specdec.v1 import model_pb2, orchestrator_pb2

    request = orchestrator_pb2.GenerateRequest(
        messages=orchestrator_pb2.ChatMessages(
            messages=[orchestrator_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        ),
        max_new_tokens=config.max_tokens,
        sampling=model_pb2.SamplingParams(temperature=0.0),
    )
    before = _hit_tokens(services)
    first, text, stats = None, [], None
    t0 = time.perf_counter()
    for chunk in stub.GenerateStream(request, timeout=600):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
        text.append(chunk.text)
        if chunk.finish_reason:
            stats = chunk.stats
    after = _hit_tokens(services)
    return {
        "seconds": first,
        "wall": time.perf_counter() - t0,
        "prompt_tokens": stats.prompt_tokens if stats is not None else None,
        "target_hit": after["target"] - before["target"],
        "draft_hit": after["draft"] - before["draft"],
        "text": "".join(text),
    }


def _ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def _prefill_seconds(model, ids: list[int]) -> float:
    """transformers generate of one token on the prompt ids, in this process: a prefill."""
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(torch.tensor([ids], device=model.device), max_new_tokens=1, do_sample=False)
    return time.perf_counter() - t0


def _llamacpp_target(config: TTFTConfig):
    """The target on llama.cpp in this process, as its service builds it, where the pipeline runs
    it there; else None."""
    from deploy import hosting
    from deploy.configs import ModelServiceConfig

    service = ModelServiceConfig("target", config.target, backend=config.target_backend)
    return hosting.target_backend(service) if service.runtime == "llamacpp" else None


def _engine_prefill_seconds(backend, ids: list[int]) -> float:
    """llama.cpp's prefill of the ids, in the chunks a service feeds (its prefill_chunk,
    specdec.runtime.engine), the last position's logits: what the target service computes for the first token."""
    chunk = backend.prefill_chunk
    slot = backend.new_cache()
    try:
        t0 = time.perf_counter()
        for start in range(0, len(ids), chunk):
            backend.forward(slot, ids[start : start + chunk], 1)
        return time.perf_counter() - t0
    finally:
        backend.release(slot)


def summarise(config: TTFTConfig, runs: dict) -> dict:
    def median(name, case, key="seconds"):
        values = [r[key] for r in runs.get((name, case), []) if r.get(key) is not None]
        return statistics.median(values) if values else None

    prefill = median("-", "prefill")
    rows = [
        {
            "case": "prefill",
            "cache": "-",
            "seconds": prefill,
            "prompt_tokens": median("-", "prefill", "prompt_tokens"),
            "against": "in-process generate, 1 token",
        }
    ]
    engine = median("-", "prefill llama.cpp")
    if engine is not None:
        rows.append({"case": "prefill", "cache": "-", "seconds": engine, "against": "in-process llama.cpp"})
    for name in ("on", "off"):
        first = median(name, "first")
        for case in CASES:
            seconds = median(name, case)
            if seconds is None:
                continue
            bases = [(first, "first")]
            if case == "first":  # the target alone: on the pipeline's engine (llama.cpp), and transformers'
                bases = [(engine, "prefill llama.cpp")] * (engine is not None and name == "on") + [(prefill, "prefill")]
            bound = CRITERIA.get(case) if name == "on" else None
            for base, against in bases:
                ratio = seconds / base if seconds is not None and base else None
                rows.append(
                    {
                        "case": case,
                        "cache": name,
                        "seconds": seconds,
                        "ratio": ratio,
                        "against": against,
                        "criterion": bound,
                        "met": None if bound is None or ratio is None else ("yes" if ratio <= bound else "NO"),
                        "prompt_tokens": median(name, case, "prompt_tokens"),
                        "target_hit": median(name, case, "target_hit"),
                        "draft_hit": median(name, case, "draft_hit"),
                    }
                )
    result = {"config": {**asdict(config), "out": str(config.out)}, "rows": rows, "runs": _plain(runs)}
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "ttft.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def _plain(runs: dict) -> dict:
    return {f"{name}/{case}": values for (name, case), values in runs.items()}


HEADERS = ["case", "prefix cache", "TTFT s", "ratio", "of", "bound", "met", "prompt tok", "target reused",
           "draft reused"]  # fmt: skip
KEYS = [("case", "{}"), ("cache", "{}"), ("seconds", "{:.3f}"), ("ratio", "{:.3f}x"), ("against", "{}"),
        ("criterion", "<= {:.1f}x"), ("met", "{}"), ("prompt_tokens", "{:.0f}"), ("target_hit", "{:.0f}"),
        ("draft_hit", "{:.0f}")]  # fmt: skip


def format_table(results: dict) -> str:
    return format_rows(results["rows"], HEADERS, KEYS)


def quick(config: TTFTConfig) -> TTFTConfig:
    """A check that it runs: one repeat, two turns, short answers, the prefix cache on only."""
    return replace(config, repeats=1, turns=2, max_tokens=8, cold=False)
