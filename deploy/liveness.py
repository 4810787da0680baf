"""Liveness: a process that answers nothing for a while is hung (stopped, deadlocked), not slow.

What restarts a process that dies (deploy.local's monitor, Ray for its actors) leaves one that is
alive and silent as it is: its port open, every call to it waiting out its deadline. A supervisor
probes what it watches every `period(limit)` seconds; `Silence` says which has answered nothing
for `limit` seconds, and the supervisor kills it, so that it is restarted as a crashed one is:
- `specdec serve` (deploy.local.LocalPipeline): a gRPC health check of each child; SIGKILL;
- an orchestrator hosted by Ray (`ray up`'s actor, a Serve replica of `ray serve`): `ServiceWatch`,
  a Describe of each model service on the pair's own links; the service's actor killed through
  its handle, which Ray restarts (`max_restarts`) and the pair finds on its new port.
A health check answers NOT_SERVING while a process drains, and a Describe may answer an error
status: an answer all the same. Where the watch cannot tell a live process from a dead one (Ray's),
a refused connection is one down or restarting, its restarter's business, not silence.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

import grpc

log = logging.getLogger("specdec")

UNRESPONSIVE_SECONDS = 30.0  # silence before a process is killed; 0: never
PROBE_SECONDS = 5.0  # the most between two probes of a process, and each probe's deadline


def period(limit: float) -> float:
    """Seconds between probes for a silence `limit`: a few probes within it, at most PROBE_SECONDS."""
    return min(PROBE_SECONDS, max(0.5, limit / 3))


class Silence:
    """Since when each probed process has answered nothing (keyed as its supervisor knows it: a pid,
    a role)."""

    def __init__(self, limit: float):
        self.limit = limit
        self._since: dict[Hashable, float] = {}

    def heard(self, key: Hashable, answered: bool, sent: float) -> bool:
        """Record a probe of `key` sent at `sent` (monotonic); True once `key` has answered none for
        `limit` seconds (it stays silent until it answers or is forgotten)."""
        if answered:
            self._since.pop(key, None)
            return False
        return sent - self._since.setdefault(key, sent) >= self.limit

    def forget(self, key: Hashable) -> None:
        """A process killed or gone: its successor's silence counts afresh."""
        self._since.pop(key, None)


def silent(call: grpc.Future, address: str) -> bool:
    """Whether a probe of the process at `address` went unanswered: no answer in time, or the
    connection lost (a client's keepalive gives up on a silent peer), while its port still takes
    connections (a port that refuses them is a process gone or restarting)."""
    from orchestrator.recovery import refuses

    if call.exception() is None or call.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
        return False  # answered, an error status too
    return not refuses(address)


class ServiceWatch:
    """A thread beside an orchestrator hosted by Ray: a model service of its pair that answers no
    Describe for `limit` seconds is killed through its actor handle (Ray restarts only an actor that
    dies; a stopped or deadlocked one would stay hung, each request through it waiting out its
    deadline or the pair's hang_seconds). `stubs`: role -> the pair's orchestrator.recovery stub;
    `handles`: role -> the service's actor handle."""

    def __init__(self, stubs: dict, handles: dict, limit: float, kill: Callable | None = None):
        self.stubs, self.handles, self.limit = stubs, handles, limit
        self._kill = kill or _ray_kill
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-service-watch", daemon=True)

    def start(self) -> ServiceWatch:
        if self.limit > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()

    def _run(self) -> None:
        from specdec.v1 import model_pb2

        silence, every = Silence(self.limit), period(self.limit)
        while not self._stopping.wait(every):
            sent, calls = time.monotonic(), {}
            for role, stub in self.stubs.items():
                try:
                    calls[role] = stub.Describe.future(model_pb2.DescribeRequest(), timeout=every)
                except Exception:  # noqa: BLE001 - not connected (a restart under way): not silence
                    silence.forget(role)
            for role, call in calls.items():
                quiet = silent(call, self.stubs[role].address)
                if silence.heard(role, not quiet, sent) and not self._stopping.is_set():
                    what = f"the {role} service answered nothing for {self.limit:g} s (stopped or hung)"
                    log.warning("%s; killing its actor: Ray restarts it", what)
                    self._kill(self.handles[role])
                    silence.forget(role)


def _ray_kill(handle) -> None:
    import ray

    ray.kill(handle, no_restart=False)  # a stopped process too: Ray ends it (~5 s), then restarts the actor
