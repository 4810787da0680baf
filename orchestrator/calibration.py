"""The pair priced before its first request: at start, a few short greedy generations on built-in
prompts of several kinds run through the same loop as a request, with adaptive lookahead up to
validation.MEASURED_LOOKAHEAD (so the target verifies blocks of several sizes and the draft proposes
at several k). What they measure goes into the pair's shared costs (orchestrator.pair_costs), so a
request that names no lookahead gets the k a warm server would give it, not DEFAULT_LOOKAHEAD.
Requests in service refine the prices as before.

Owns: the prompts, the run, the summary line. Not: the prices themselves (orchestrator.lookahead's
`price`), nor when it runs (deploy.hosting and deploy.serve_replicas call it before serving)."""

from __future__ import annotations

import time
from collections.abc import Callable

from orchestrator import CALIBRATION_TOKENS
from orchestrator.generation import ModelPair, RequestDefaults, default_overlap, generate
from orchestrator.lookahead import Price, price
from specdec.v1 import orchestrator_pb2
from specdec.validation import DEFAULT_LOOKAHEAD, MEASURED_LOOKAHEAD

# A question, a list and code: the kinds of text whose acceptance differs most on a chat model.
PROMPTS = (
    "Explain in two sentences how a hash table finds a key.",
    "List four things to pack for a day of hiking.",
    "Write a Python function that returns the squares of a list of numbers.",
)


def calibrate(
    pair: ModelPair,
    tokens: int = CALIBRATION_TOKENS,
    defaults: RequestDefaults | None = None,
    log: Callable[[str], None] | None = None,
) -> Price | None:
    """Run `tokens` greedy tokens over PROMPTS on `pair` and return the price it then gives a request
    that names no lookahead (None: no draft, tokens 0, or nothing priced). A generation that fails
    (a service lost meanwhile) ends the calibration: the pair serves unpriced, as before."""
    if pair.draft is None or tokens <= 0 or not pair.health[0].state().up:
        return None
    start, defaults = time.perf_counter(), defaults or RequestDefaults()
    chat = bool(getattr(pair.tokenizer, "chat_template", None))
    each = -(-tokens // len(PROMPTS))
    try:
        for prompt in PROMPTS:
            request = orchestrator_pb2.GenerateRequest(
                prompt=prompt,
                chat_template=chat,
                max_new_tokens=each,
                speculation=orchestrator_pb2.SpeculationParams(adaptive=True, lookahead=MEASURED_LOOKAHEAD),
            )
            for _ in generate(pair, request, timeout=60.0, defaults=defaults):
                pass
    except Exception as err:  # noqa: BLE001 - a start-up measurement: serving goes on without it
        if log:
            log(f"pricing the pair failed ({err}); requests run k = {DEFAULT_LOOKAHEAD} until their rounds measure it")
        return None
    priced = price(pair.costs, MEASURED_LOOKAHEAD, default_overlap(pair, defaults))
    if log and priced is not None:
        log(f"priced the pair in {time.perf_counter() - start:.1f} s: {priced.summary()}")
    return priced
