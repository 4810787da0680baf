"""The Ray actors: thin hosts around the same gRPC servers that run outside Ray.

A ModelServiceHost builds one model service (deploy.hosting, the composition the CLI and
the tests use too) on its node's address and a free port; an OrchestratorHost connects to
the two through their actor handles (so it finds a restarted service on its new port),
serves the client API and kills a service that hangs, for Ray to restart (deploy.liveness); its
prices wait in the target's actor for its own restart (ActorPrices). Neither adds behaviour of its
own: what the services do, how they are secured (specdec.serving.security: TLS, mTLS, a token,
plaintext only where allowed) and observed (specdec.serving.telemetry, from the OTEL_* variables of
the actor's environment, e.g. a runtime_env) is the same inside and outside Ray. A Ray worker runs
no command line, so its actors' entry (worker_environment) reads that environment, as
cli.options.apply_environment does elsewhere: the OTEL_* variables, SPECDEC_CACHE and, where a
model is hosted, SPECDEC_FUSE.

Ray's decorators are applied where the actors are created (deploy.ray_deploy). Ray, and
deploy.hosting (torch and the models), are imported inside the actors: a driver that only
creates them needs neither.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from deploy import liveness
from deploy.configs import ModelServiceConfig, OrchestratorConfig
from specdec.serving.security import ClientSecurity, ServerSecurity

LOOPBACK = "127.0.0.1"


class _Host:
    host: str
    port: int
    node_id: str
    server: object
    telemetry: object

    def _locate(self, loopback: bool) -> None:
        """Where to bind: this node's address, or loopback when the whole cluster is this machine."""
        import ray

        self.host = LOOPBACK if loopback else ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()

    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def where(self) -> dict:
        return {"endpoint": self.endpoint(), "node_id": self.node_id, "pid": os.getpid()}

    def stop(self, grace: float = 5.0) -> None:
        """Finish the calls in flight (up to `grace` seconds), then flush telemetry."""
        self.server.stop(grace).wait()
        self.telemetry.shutdown()


class ModelServiceHost(_Host):
    """The draft or target service, in a Ray actor; `watch`: the name of an orchestrator actor to
    kill when it answers nothing for `health_timeout` seconds (`ray up`'s target watches its
    orchestrator, which watches the services)."""

    def __init__(
        self,
        config: ModelServiceConfig,
        security: ServerSecurity,
        loopback: bool,
        watch: str | None = None,
        health_timeout: float = 0.0,
    ):
        from deploy import hosting
        from specdec.serving import lifecycle, telemetry

        self._locate(loopback)
        self.telemetry = telemetry.setup(config.role, environ=worker_environment(hosts_model=True))
        self.server, self.port = hosting.start_model_service(config, self.host, 0, security, self.telemetry)
        self.watch = watch_orchestrator(watch, health_timeout)
        self.prices: bytes | None = None
        lifecycle.freeze_heap()

    def stop(self, grace: float = 5.0) -> None:
        self.watch.stop()
        super().stop(grace)

    def hold_prices(self, data: bytes) -> None:
        """Keep what the orchestrator measured of the pair, for its next start (ActorPrices)."""
        self.prices = data

    def held_prices(self) -> bytes | None:
        return self.prices


class ActorPrices:
    """An orchestrator's prices store (orchestrator.calibration) in its target's actor: a restarted
    orchestrator actor finds it on whatever node it lands; a restarted target holds none until the
    orchestrator's next write (KeptPrices, every minute), and one restarted meanwhile prices again."""

    TIMEOUT = 10.0  # seconds; a target that does not answer: priced again, or not kept

    def __init__(self, target):
        self.target = target

    def read(self) -> bytes | None:
        import ray

        return ray.get(self.target.held_prices.remote(), timeout=self.TIMEOUT)

    def write(self, data: bytes) -> None:
        import ray

        ray.get(self.target.hold_prices.remote(data), timeout=self.TIMEOUT)


class OrchestratorHost(_Host):
    """The orchestrator, in a Ray actor, reaching the services through their actor handles."""

    def __init__(
        self,
        draft,
        target,
        port: int,
        config: OrchestratorConfig,
        security: ServerSecurity,
        service_security: ClientSecurity,
        loopback: bool,
        health_timeout: float = 0.0,
    ):
        from deploy import hosting
        from specdec.serving import lifecycle, telemetry

        self._locate(loopback)
        self.telemetry = telemetry.setup("orchestrator", environ=worker_environment())
        self.orchestrator = hosting.start_orchestrator(
            actor_endpoint(draft),
            actor_endpoint(target),
            config,
            self.host,
            port,
            security,
            service_security,
            self.telemetry,
            prices=ActorPrices(target),
        )
        self.server, self.port, self.pair = self.orchestrator.server, self.orchestrator.port, self.orchestrator.pair
        self.watch = watch_services(self.pair, {"draft": draft, "target": target}, health_timeout)
        lifecycle.freeze_heap()

    def where(self) -> dict:
        http = self.orchestrator.http
        return {**super().where(), "http_url": http.url if http else None}

    def stop(self, grace: float = 5.0) -> None:
        self.watch.stop()
        if self.orchestrator.http is not None:
            self.orchestrator.http.stop()
        super().stop(grace)

    def reopens(self) -> dict[str, int]:
        """Sessions re-opened after each service lost them, since this actor started."""
        return {"draft": self.pair.draft.reopens, "target": self.pair.target.reopens}


def worker_environment(hosts_model: bool = False) -> dict[str, str]:
    """A Ray worker's settings from its own environment (a runtime_env's variables, else those of the
    raylet that started it), read at an actor's entry as it has no command line: the cache
    (specdec.weights.embedded.set_cache_dir) and, for an actor that hosts a model, the fusion setting
    (specdec.runtime.graphs.set_fuse, which imports torch) are set; the environment is returned for
    specdec.serving.telemetry.setup."""
    from specdec.weights import embedded

    environ = dict(os.environ)
    embedded.set_cache_dir(environ.get(embedded.CACHE_ENV))
    if hosts_model:
        from specdec.runtime import graphs

        graphs.set_fuse(environ.get(graphs.FUSE_ENV))
    return environ


def watch_services(pair, handles: dict, limit: float) -> liveness.Watch:
    """The pair's model services (`handles`: role -> actor handle) watched from the orchestrator's
    host: one that answers no Describe on the pair's link for `limit` seconds while its port takes
    connections is killed, and Ray restarts it; the pair finds it on its new port (0: never)."""
    import ray

    roles = {f"the {role} service": role for role in handles}
    stubs = {"draft": pair.draft, "target": pair.target}
    return liveness.Watch(
        {name: liveness.service_probe(stubs[role]) for name, role in roles.items()},
        # a stopped process too: Ray ends it (~5 s), then restarts the actor (max_restarts)
        lambda name: ray.kill(handles[roles[name]], no_restart=False),
        limit,
    ).start()


def watch_orchestrator(name: str | None, limit: float) -> liveness.Watch:
    """The orchestrator actor named `name` watched from a service's host (`ray up`: nothing else
    would): one alive in Ray's table that answers no actor call for `limit` seconds is killed, and
    Ray restarts it (at the same address where its port is fixed). One being created or restarted
    (its start prices the pair) is not asked (None or 0: never)."""
    import ray

    limit = limit if name is not None else 0.0

    def probe(timeout: float) -> bool | None:
        try:
            handle = ray.get_actor(name)
        except ValueError:  # not created yet, or removed
            return None
        record = actor_record(handle)
        if record is None or record["State"] != "ALIVE":
            return None
        try:
            ray.get(handle.where.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            return False
        except ray.exceptions.RayError:  # died meanwhile: Ray's to restart
            return None
        return True

    return liveness.Watch(
        {"the orchestrator": probe}, lambda _name: ray.kill(ray.get_actor(name), no_restart=False), limit
    ).start()


def actor_record(handle) -> dict | None:
    """The actor's entry in GCS's actor table (State, Address.NodeID, Pid, NumRestarts).

    Read from the GCS directly: Ray's public state API (ray.util.state) needs the dashboard,
    which a cluster may run without. `_actor_id` is how Ray's own docs name a handle's id.
    """
    from ray._private import state

    return state.actors(handle._actor_id.hex()) or None


def actor_endpoint(handle) -> Callable[[float], str]:
    """A resolver for orchestrator.recovery: the service actor's current HOST:PORT.

    While the actor restarts, the call waits for it (up to the timeout).
    """
    import ray

    def resolve(timeout: float) -> str:
        return ray.get(handle.endpoint.remote(), timeout=timeout)

    return resolve
