"""The pair priced before its first request: at start, a few short greedy generations on built-in
prompts of several kinds run through the same loop as a request, with adaptive lookahead up to
validation.MEASURED_LOOKAHEAD (so the target verifies blocks of several sizes and the draft proposes
at several k). What they measure goes into the pair's shared costs (orchestrator.pair_costs), so a
request that names no lookahead gets the k a warm server would give it, not DEFAULT_LOOKAHEAD.
Then the same prompts run once at that k and once without speculation, interleaved (`alone_gain`):
where speculation timed clearly slower (pair_costs.ALONE_PLAIN), a request alone that names no
lookahead runs plain rounds
(generation.default_lookahead; docs/adaptive.md#the-default-k). Requests in service refine the
prices as before.

A successor on the same pair (an orchestrator restarted by `specdec serve`, or by Ray under `ray up`)
takes its predecessor's measurements from a store instead (`priced_once`): it serves at once, priced,
where the calibration took 3-6 s on the default pair (a SIGKILLed orchestrator served again 7-8 s
after, against 11-12). `specdec serve`'s store is a file in its folder; `ray up`'s is the target's
actor (deploy.ray_actors), which a restart on another node finds as well.

Owns: the prompts, the run, the summary line, what is stored. Not: the prices themselves
(orchestrator.lookahead's `price`), nor when it runs (deploy.hosting and deploy.serve_replicas call
it before serving)."""

from __future__ import annotations

import io
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from orchestrator import CALIBRATION_TOKENS, KEEP_PRICES_EVERY, pair_costs
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


class PricesStore(Protocol):
    """Where a pair's measurements wait for the next orchestrator on it: `read` gives what was
    written (None: nothing), `write` replaces it whole."""

    def read(self) -> bytes | None: ...

    def write(self, data: bytes) -> None: ...


class PricesFile:
    """A file (`specdec orchestrator --prices-file`, which `specdec serve` gives in its folder)."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> bytes | None:
        return self.path.read_bytes() if self.path.exists() else None

    def write(self, data: bytes) -> None:
        part = self.path.with_suffix(".part")
        part.write_bytes(data)
        part.replace(self.path)  # whole or not at all


def priced_once(
    pair: ModelPair,
    store: PricesStore | None,
    tokens: int = CALIBRATION_TOKENS,
    defaults: RequestDefaults | None = None,
    log: Callable[[str], None] | None = None,
    every: float = KEEP_PRICES_EVERY,
) -> KeptPrices | None:
    """`calibrate`, or where `store` holds what a predecessor on this pair measured, that instead;
    what the calibration measured is then written to `store` (None: calibrate only), and again every
    `every` seconds while the pair serves (the KeptPrices returned; stop it with the orchestrator).
    What another pair or another version wrote, or what cannot be read, is calibrated over."""
    identity = _identity(pair)
    data = None
    if store is not None:
        try:
            data = store.read()
        except Exception as err:  # noqa: BLE001 - a store that cannot be read (a holder gone): price again
            if log:
                log(f"the prices kept for this pair could not be read ({err}); pricing it again")
    kept = KeptPrices(pair, store, identity, every, log) if store is not None else None
    if data is not None:
        try:
            saved = _Measurements(io.BytesIO(data)).load()
            taken = saved["pair"] == identity and pair.costs.carry_over(saved["costs"])
        except Exception:  # noqa: BLE001 - a file cut short, of an old layout or not one of ours: price again
            taken = False
        if taken:
            if log:
                priced = price(pair.costs, MEASURED_LOOKAHEAD, default_overlap(pair, defaults or RequestDefaults()))
                log(f"priced the pair as before its restart: {priced.summary() if priced else 'not priced'}")
            return kept.start()
    priced = calibrate(pair, tokens, defaults, log)
    if kept is not None and (priced is not None or pair.costs.alone_timed):  # a calibration that ran through
        kept.write()
        return kept.start()
    return None


class KeptPrices:
    """The pair's measurements written to its store now (`write`) and every `every` seconds from a
    thread (`start`, until `stop`): a successor takes what service refined since the start, and a
    store that lost them (ray up's target actor, restarted) has them again within `every`."""

    def __init__(self, pair: ModelPair, store: PricesStore, identity: tuple, every: float, log):
        self.pair, self.store, self.identity, self.every, self.log = pair, store, identity, every, log
        self.failed = False  # said once, not every `every` seconds
        self._stop = threading.Event()

    def write(self) -> None:
        try:
            self.store.write(pickle.dumps({"pair": self.identity, "costs": self.pair.costs.snapshot()}))
            self.failed = False
        except Exception as err:  # noqa: BLE001 - serving priced matters more than a successor's start
            if self.log and not self.failed:
                self.log(f"the pair's prices could not be kept for a restart ({err})")
            self.failed = True

    def start(self) -> KeptPrices:
        if self.every > 0:
            threading.Thread(target=self._run, name="specdec-prices", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.write()

    def stop(self) -> None:
        self._stop.set()


class _Measurements(pickle.Unpickler):
    """PairCosts.snapshot() read back: plain values and pair_costs' own records, and nothing else
    (a pickle may name any callable; this one's file may be any path a user gives)."""

    RECORDS = frozenset({"DecayedMean", "CostLine", "Revisits"})

    def find_class(self, module: str, name: str):
        if module == pair_costs.__name__ and name in self.RECORDS:
            return getattr(pair_costs, name)
        raise pickle.UnpicklingError(f"not a measurement: {module}.{name}")


def _identity(pair: ModelPair) -> tuple:
    """What makes a predecessor's measurements this pair's: its models as the services describe
    them, and what the price reads of the draft's start-up profile."""
    return (
        pair.model_name,
        pair.vocab_size,
        pair.max_context,
        pair.draft is not None,
        pair.index_drafts,
        pair.tree_verify,
        pair.shared_device,
        sorted(pair.costs.draft_profile),
        pair.costs.sharing is not None,
    )


def calibrate(
    pair: ModelPair,
    tokens: int = CALIBRATION_TOKENS,
    defaults: RequestDefaults | None = None,
    log: Callable[[str], None] | None = None,
) -> Price | None:
    """Run `tokens` greedy tokens over PROMPTS on `pair`, then time speculation against plain rounds
    on them (alone_gain; not where the draft has index drafts, nor where the price itself says
    speculation loses: its price is the gain then), and return the price it then gives a
    request that names no lookahead (None: no draft, tokens 0, or nothing priced: rounds that all
    fed the target one token, the draft never paying; timed all the same). A generation that fails
    (a service lost meanwhile) ends the calibration: the pair serves unpriced, as before."""
    if pair.draft is None or tokens <= 0 or not pair.health[0].state().up:
        return None
    start, defaults = time.perf_counter(), defaults or RequestDefaults()
    chat = bool(getattr(pair.tokenizer, "chat_template", None))
    each = -(-tokens // len(PROMPTS))
    adaptive = orchestrator_pb2.SpeculationParams(adaptive=True, lookahead=MEASURED_LOOKAHEAD)
    since = pair.costs.tally
    try:
        for prompt in PROMPTS:
            _run(pair, prompt, chat, each, adaptive, defaults)
        pair.costs.pool_acceptance(since)  # every prompt's, not the last one's tail
    except Exception as err:  # noqa: BLE001 - a start-up measurement: serving goes on without it
        if log:
            log(f"pricing the pair failed ({err}); requests run k = {DEFAULT_LOOKAHEAD} until their rounds measure it")
        return None
    overlap = default_overlap(pair, defaults)
    priced = price(pair.costs, MEASURED_LOOKAHEAD, overlap)
    if not pair.index_drafts:  # an index's drafts gain on text that copies, which these prompts are not
        _set_alone_gain(pair, priced, each, chat, defaults, log)
    pair.costs.pool_acceptance(since)  # the timing's rounds too
    priced = price(pair.costs, MEASURED_LOOKAHEAD, overlap)  # with the timing (Price.timed)
    if log:
        gain = pair.costs.alone_gain
        timed = f"; timed alone {gain:.2f}x plain rounds" if gain else ""
        what = priced.summary() if priced else f"not priced{timed}"
        log(f"priced the pair in {time.perf_counter() - start:.1f} s: {what}")
    return priced


def _set_alone_gain(
    pair: ModelPair, priced: Price | None, tokens: int, chat: bool, defaults: RequestDefaults, log
) -> None:
    """pair.costs.alone_gain: the price's own where it says speculation loses (no seconds spent
    timing it), else timed (alone_gain); a timing that fails leaves the price standing, untimed."""
    if priced is not None and priced.speedup < 1:
        pair.costs.alone_gain = priced.speedup
        return
    try:
        pair.costs.alone_gain, pair.costs.alone_timed = alone_gain(pair, tokens, chat, defaults), True
    except Exception as err:  # noqa: BLE001 - a start-up measurement, as calibrate's
        if log:
            log(f"timing the pair's regimes failed ({err}); a request alone speculates at the price's k")


def alone_gain(pair: ModelPair, tokens: int, chat: bool, defaults: RequestDefaults) -> float:
    """The measured default's speed over plain rounds' for a generation alone: PROMPTS at `tokens`
    greedy tokens each, each prompt once each way (interleaved: a drift in the machine's speed
    slows both alike), timed over the generations' wall time, prefill included."""
    seconds = {True: 0.0, False: 0.0}
    for prompt in PROMPTS:
        for speculate in (True, False):
            t0 = time.perf_counter()
            _run(pair, prompt, chat, tokens, orchestrator_pb2.SpeculationParams(disabled=not speculate), defaults)
            seconds[speculate] += time.perf_counter() - t0
    return seconds[False] / seconds[True]


def _run(pair: ModelPair, prompt: str, chat: bool, tokens: int, speculation, defaults: RequestDefaults) -> None:
    request = orchestrator_pb2.GenerateRequest(
        prompt=prompt, chat_template=chat, max_new_tokens=tokens, speculation=speculation
    )
    for _ in generate(pair, request, timeout=60.0, defaults=defaults):
        pass
