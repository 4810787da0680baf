"""Where a model service computes on a CPU machine: the cores it may use, its threads, and how two
services on one machine share its cores.

`apply` is called once, before the model loads: it pins the process to its cores (when told) and
sets its threads; every backend sizes its thread pool from them (torch's intra-op threads;
llama.cpp's n_threads reads `threads()`). Cores are counted from the process's affinity, never
os.cpu_count(), which ignores it.

Sharing. A draft and a target on one machine whose cores both may use (Describe's `machine` and
`cpus`) share them in one of two ways, which the orchestrator chooses per round by measured cost
(orchestrator.lookahead):
- space-sharing: both compute at once (overlapped rounds), each with its share of the threads
  (`split_threads`: the target three quarters, the draft the rest, at least one each), as a GPU
  pair gives each service its device;
- time-sharing: they take turns (sequential rounds), each forward on every core.
A request names the threads its forwards may use (ProposeRequest.threads); `Cores` runs each
step with them and takes the machine's core lock (`CORE_LOCK`), shared for a step on no more
than the service's share, exclusive for a step on more: a forward on every core never runs
beside the other service's, whatever the rounds of several generations, or two orchestrators,
ask for (on 2 cores, a 2-thread forward of each at once ran 20-30x slower: OpenMP threads
wait for each other at every operator). A service pinned to its own cores (`--cpus`) owns them:
it takes no lock, and its threads are its own.

An idle service must not hold the cores the other computes on. Both runtimes use libgomp
(torch's intra-op threads and MKL's; llama.cpp's ggml, built with OpenMP), whose threads wait
for the next parallel region spinning GOMP_SPINCOUNT times (300000 by default) before they
sleep: after each llama.cpp decode its threads burnt ~7 ms of a core (torch's, measured, none).
Taking turns on 2 cores with the llama.cpp F32 target (a 9-token verify, then 4 draft steps,
each on 2 threads), the verify took 1.21x its cost alone, the round 74-80 ms; with
GOMP_SPINCOUNT=10000 (~1 ms of spinning) 0.95-1.01x, 59-64 ms. OMP_WAIT_POLICY=PASSIVE (no spin
at all) made every barrier inside a forward a sleep: the Q8_0 draft step 3.2x slower, the F32
target's verify 2x. So a service process sets SERVICE_ENV before torch or llama.cpp loads (libgomp
reads it then; cli.serving).

Start-up. Each service times its forwards at start (its step profile, which the orchestrator
prices rounds by), and on shared cores it must not time them beside the other service's own
start-up: the model's load and its warm-up take no core lock (no step runs yet), and the draft's
steps on every core, timed beside the target's load, came out 3-7x their cost (a step of one
session 89-96 ms against 13 ms timed alone, 2026-12-02), so every sequential round was priced at
2.5-7x its draft cost and the default chose overlapped rounds of k = 2-3, 0.93x plain rounds where
the sequential rounds of k = 5-7 it now chooses run 1.04x (docs/architecture.md).
So start-ups take turns on the machine's start-up lock (STARTUP_LOCK): a service holds it shared
from before its model loads until its warm-up ends (`starting`, `started`), and exclusively while
it times its forwards (`timing`). Serving steps never take it: a service that restarts beside a
serving one times its forwards beside that one's steps, under the core lock, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import queue
import re
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

# The environment of a process that serves a model on a machine it may share with another
# (read by libgomp when it loads, so set before torch or llama.cpp is imported).
SERVICE_ENV = {"GOMP_SPINCOUNT": "10000"}
CORE_LOCK = Path(tempfile.gettempdir()) / f"specdec-cores-{os.getuid()}.lock"
# Seconds a step waits for the other service's hold on the cores before it steps beside it: longer
# than any step of a live service (a long prompt's prefill on every core), short enough that the
# other one stopped or hung inside a step (SIGSTOP, a stuck driver: it keeps its lock) costs this
# service seconds, not every request until it is woken.
LOCK_PATIENCE = 3.0
STARTUP_LOCK = Path(tempfile.gettempdir()) / f"specdec-startup-{os.getuid()}.lock"
# Seconds a start-up waits for the other's (its model's load: ~13 s for the default F32 target on 2
# cores) before it goes on beside it, timing what it times beside it.
STARTUP_PATIENCE = 120.0

log = logging.getLogger("specdec.runtime.placement")


def usable_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def machine() -> str:
    """This machine, as its services name it (Describe's machine): the kernel's boot id, shared
    by the containers of one host (which share its cores), different on another host."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@functools.cache  # fixed for the process; Describe asks it on every call
def device_id(device: str) -> str:
    """The accelerator `device` names (Describe's device_id): a CUDA device's UUID, which names one
    GPU whatever index each process sees it by (CUDA_VISIBLE_DEVICES, Ray's placement); empty for
    a CPU, or where torch does not say."""
    if not device.startswith("cuda"):
        return ""
    import torch

    try:
        return str(getattr(torch.cuda.get_device_properties(torch.device(device)), "uuid", "") or "")
    except (RuntimeError, AssertionError, ValueError):  # a torch without CUDA (llama.cpp's own CUDA build)
        return ""


def parse_cpus(text: str) -> tuple[int, ...]:
    """A core list as taskset writes it ("0", "0,2", "0-3,6") -> sorted core ids."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        low, high = (int(match[1]), int(match[2] or match[1])) if match else (1, 0)
        if high < low:
            raise ValueError(f"--cpus: {text!r} is not a core list like 0 or 0,2 or 0-3")
        cores.update(range(low, high + 1))
    if not cores:
        raise ValueError("--cpus: the core list is empty")
    return tuple(sorted(cores))


def apply(cpus: Iterable[int] | None = None, threads: int | None = None) -> tuple[list[int], int]:
    """Pin this process to `cpus` (None: keep its affinity) and use `threads` threads
    (None: one per usable core). Returns (cores, threads) as they now are."""
    if cpus is not None:
        wanted = set(cpus)
        missing = wanted - set(range(os.cpu_count() or 1))
        if missing:
            raise ValueError(f"--cpus: no such core {sorted(missing)} on this machine")
        os.sched_setaffinity(0, wanted)
    import torch  # here, not at the top: the CLI parses and splits core lists without torch

    cores = usable_cores()
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads or len(cores))
    return cores, torch.get_num_threads()


def threads() -> int:
    """The thread count the service's forwards use (set by apply)."""
    import torch  # as in apply()

    return torch.get_num_threads()


def split_threads(cores: int) -> tuple[int, int]:
    """The threads of the draft and of the target computing at once on `cores` shared cores: the
    target, the heavy model, three quarters, at least one each (one each on one core)."""
    draft = max(1, cores // 4)
    return draft, max(1, cores - draft)


class Cores:
    """A model service's threads step by step (module docstring): `step(asked)` runs a batched
    forward with the fewest threads its requests allow, under the machine's core lock unless the
    service owns its cores. Used by the model worker's thread only."""

    def __init__(
        self,
        role: str,
        threads: int,
        shared: bool,
        lock_path: Path = CORE_LOCK,
        cores: int = 0,
        startup_path: Path = STARTUP_LOCK,
    ):
        """`threads`: the most a step uses (the service's); `shared`: the machine's `cores` (0:
        those this process may use) are the other service's too, so its steps take the lock, and
        its start-up takes turns with the other's (`startup_path`, module docstring)."""
        self.role = role
        self.threads = threads
        self.shared = shared
        draft, target = split_threads(cores or len(usable_cores()))
        self.share = min(threads, target if role == "target" else draft) if shared else threads
        self._lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600) if shared else None
        self._locker = _Locker(self._lock) if shared else None
        self._startup = os.open(startup_path, os.O_RDWR | os.O_CREAT, 0o600) if shared else None
        self._current = threads

    def starting(self) -> None:
        """This service's start-up begins (before its model loads): held shared until `started`,
        no other service on these cores times its forwards meanwhile (module docstring)."""
        if self._startup is not None and not _flock_within(self._startup, fcntl.LOCK_SH, STARTUP_PATIENCE):
            log.warning("another service's start-up held the cores for %.0f s: loading beside it", STARTUP_PATIENCE)

    def started(self) -> None:
        """Its model loaded and warmed up: the other service may time its forwards."""
        if self._startup is not None:
            fcntl.flock(self._startup, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Time the start-up's forwards with no other start-up computing on these cores: waits for
        the others' `started` (at most STARTUP_PATIENCE) and holds them off until done."""
        held = self._startup is not None and _flock_within(self._startup, fcntl.LOCK_EX, STARTUP_PATIENCE)
        if self._startup is not None and not held:
            log.warning("another service has been starting for %.0f s: timing the forwards beside it", STARTUP_PATIENCE)
        try:
            yield
        finally:
            if held:
                fcntl.flock(self._startup, fcntl.LOCK_UN)

    def counts(self) -> list[int]:
        """The thread counts a request may get: its share and every core (one, if they agree)."""
        return sorted({self.share, self.threads})

    def of(self, asked: Iterable[int | None]) -> int:
        """A step's threads: the fewest any of its requests allows (None: the service's own),
        never more than the service's."""
        return max(1, min([self.threads, *(a or self.threads for a in asked)]))

    @contextlib.contextmanager
    def step(self, threads: int, backend) -> Iterator[float]:
        """Run a step on `threads` threads (the backend's set_threads, called when they change);
        yields the seconds it waited for the core lock (0 when it takes none)."""
        waited, held = 0.0, False
        if self._locker is not None:
            t0 = time.perf_counter()
            held = self._locker.take(fcntl.LOCK_SH if threads <= self.share else fcntl.LOCK_EX)
            waited = time.perf_counter() - t0
        try:
            if threads != self._current:
                set_threads = getattr(backend, "set_threads", None)
                if set_threads is not None:
                    set_threads(threads)
                self._current = threads
            yield waited
        finally:
            if held:
                fcntl.flock(self._lock, fcntl.LOCK_UN)


def _flock_within(fd: int, mode: int, seconds: float) -> bool:
    """flock(fd, mode), waiting at most `seconds`: whether it is held."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


class _Attempt:
    """One wait for the lock on the locker's thread: "waiting", then "held" or "abandoned"."""

    def __init__(self, mode: int):
        self.mode = mode
        self.state = "waiting"
        self.guard = threading.Lock()
        self.taken = threading.Event()  # held, for the step that asked
        self.over = threading.Event()  # the locker is done with it (held, or taken and let go)


class _Locker:
    """Takes the core lock for a step, waiting at most LOCK_PATIENCE (module docstring): free, at
    once; held by the other service, on a thread of its own, so that the step can stop waiting. A
    wait given up goes on there and lets the lock go when it gets it; until then steps take none
    (the other service is stuck: waiting again would cost each step the patience)."""

    def __init__(self, fd: int):
        self._fd = fd
        self._asks: queue.SimpleQueue[_Attempt] = queue.SimpleQueue()
        self._abandoned: _Attempt | None = None
        threading.Thread(target=self._run, name="core-lock", daemon=True).start()

    def take(self, mode: int) -> bool:
        """Whether the lock is now held in `mode` (the caller lets it go); False: step without it."""
        try:
            fcntl.flock(self._fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if self._abandoned is not None:
            if not self._abandoned.over.is_set():
                return False
            log.warning("the machine's cores are shared again: the other service let its lock go")
            self._abandoned = None
        attempt = _Attempt(mode)
        self._asks.put(attempt)
        if attempt.taken.wait(LOCK_PATIENCE):
            return True
        with attempt.guard:
            if attempt.state == "held":
                return True
            attempt.state = "abandoned"
        self._abandoned = attempt
        log.warning(
            "the other service has held the machine's cores for %.1f s (stopped or hung?): "
            "stepping beside it until it lets them go", LOCK_PATIENCE,
        )  # fmt: skip
        return False

    def _run(self) -> None:
        while True:
            attempt = self._asks.get()
            fcntl.flock(self._fd, attempt.mode)
            with attempt.guard:
                if attempt.state == "abandoned":
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                else:
                    attempt.state = "held"
                    attempt.taken.set()
            attempt.over.set()
