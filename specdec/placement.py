"""Where a model service computes on a CPU machine: the cores it may use and its thread count.

On one machine, a service pinned to its own cores stands in for a service on its own GPU: the
draft and the target then work at the same time without taking each other's cores (the point
of overlapped rounds). `apply` is called once, before the model loads; every backend sizes its
thread pool from what it sets (torch's intra-op threads; llama.cpp's n_threads reads
`threads()`). Cores are counted from the process's affinity, never os.cpu_count(), which
ignores it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable


def usable_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


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


def split_for_pair(cores: list[int]) -> tuple[list[int], list[int]] | None:
    """Disjoint cores for a draft and a target on one machine: the target, the heavy model,
    gets three quarters (at least one core each); None with a single core. Two services that
    share cores slow each other down (llama.cpp's threads spin while they wait)."""
    if len(cores) < 2:
        return None
    draft = max(1, len(cores) // 4)
    return cores[:draft], cores[draft:]


def format_cpus(cores: list[int]) -> str:
    return ",".join(map(str, cores))
