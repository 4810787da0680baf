"""Liveness: a process that answers nothing for a while is hung (stopped, deadlocked), not slow.

What restarts a process that dies (deploy.local's monitor, Ray for its actors) leaves one that is
alive and silent as it is: its port open, every call to it waiting out its deadline. A supervisor
probes what it watches every `period(limit)` seconds; `Silence` says which has answered nothing
for `limit` seconds, and the supervisor kills it, so that it is restarted as a crashed one is:
- `specdec serve` (deploy.local.LocalPipeline): a gRPC health check of each child; SIGKILL;
- under Ray, a `Watch` thread (deploy.ray_actors): the orchestrator's host (`ray up`'s actor, each
  Serve replica) probes each model service by a Describe on the pair's own link (`service_probe`),
  and `ray up`'s target service probes the orchestrator by an actor call (a Serve replica is
  Serve's to check); the actor is killed through its handle, Ray restarts it (`max_restarts`), and
  the pair finds a service on its new port.
A health check answers NOT_SERVING while a process drains, and a Describe may answer an error
status: an answer all the same. Where the watch cannot tell a live process from a dead one (a
service under Ray), a refused connection is one down or restarting, its restarter's business, not
silence; an actor that Ray's table does not list ALIVE (being created, restarting) is not asked.
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


# A probe of one process, given its deadline in seconds: True it answered, False it did not, None it
# is not there to ask (not started, restarting, gone: its restarter's business, not silence).
Probe = Callable[[float], "bool | None"]


class Watch:
    """A thread that probes each named process every `period(limit)` seconds and calls `kill(name)`
    for one that has answered nothing for `limit` seconds (0: never); what restarts a dead process
    restarts it (Ray, for an actor: Ray restarts only one that dies, and a stopped or deadlocked one
    would stay hung, each request through it waiting out its deadline)."""

    def __init__(self, probes: dict[str, Probe], kill: Callable[[str], None], limit: float):
        self.probes, self.kill, self.limit = probes, kill, limit
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-watch", daemon=True)

    def start(self) -> Watch:
        if self.limit > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()

    def _run(self) -> None:
        silence, every = Silence(self.limit), period(self.limit)
        while not self._stopping.wait(every):
            for name, probe in self.probes.items():
                sent = time.monotonic()
                try:
                    answered = probe(every)
                except Exception:  # noqa: BLE001 - a probe that cannot ask (a cluster call failing): not silence
                    log.debug("probing %s failed", name, exc_info=True)
                    answered = None
                if answered is None:
                    silence.forget(name)
                elif silence.heard(name, answered, sent) and not self._stopping.is_set():
                    log.warning("%s answered nothing for %g s (stopped or hung); killing it", name, self.limit)
                    self.kill(name)
                    silence.forget(name)


def service_probe(stub) -> Probe:
    """A model service probed by a Describe on the pair's link to it (an orchestrator.recovery stub)."""
    from specdec.v1 import model_pb2

    def probe(timeout: float) -> bool | None:
        try:
            call = stub.Describe.future(model_pb2.DescribeRequest(), timeout=timeout)
        except Exception:  # noqa: BLE001 - not connected: a restart under way
            return None
        return not silent(call, stub.address)

    return probe
