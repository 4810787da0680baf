"""The orchestrator's servicer and startup: connect to both services, check they are a pair,
serve the client API (Generate, GenerateStream)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grpc

from orchestrator.admission import GroupAdmission
from orchestrator.availability import Availability, confirm
from orchestrator.generation import Chunk, ModelPair, RequestDefaults, default_overlap, generate
from orchestrator.lookahead import price
from orchestrator.loop import OVERLAP_LOAD, RUNNING, SessionLost
from orchestrator.pair_costs import PairCosts, Sharing
from orchestrator.prompts import load_tokenizer
from orchestrator.recovery import Address, ResilientStub
from orchestrator.scheduler import SCHEDULER
from orchestrator.step_link import DRAFT_STEPS, TARGET_STEPS, step_stub
from orchestrator.turns import Turns
from specdec.errors import FailedPrecondition, Unavailable
from specdec.limits import AdmissionLimits, RecoveryConfig
from specdec.serving import lifecycle
from specdec.serving.security import RECONNECT, ClientSecurity, ServerSecurity
from specdec.serving.security import channel as secure_channel
from specdec.serving.service import CHANNEL_OPTIONS, deadline_seconds
from specdec.serving.telemetry import Telemetry, disabled
from specdec.v1 import model_pb2, model_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc
from specdec.validation import MEASURED_LOOKAHEAD

SERVICE_NAME = "specdec.v1.Orchestrator"
DRAFT_SERVICE, TARGET_SERVICE = "specdec.v1.DraftService", "specdec.v1.TargetService"
DRAFT_START_WAIT = 10.0  # seconds the orchestrator's start waits for its draft before serving without it
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a client request; beyond it gRPC answers RESOURCE_EXHAUSTED


def connect(
    draft_address: Address | None,
    target_address: Address,
    wait_seconds: float = 60.0,
    security: ClientSecurity | None = None,
    telemetry: Telemetry | None = None,
    recovery: RecoveryConfig | None = None,
) -> ModelPair:
    """Stubs for both services, after checking they can speculate together.

    A draft and target must share a tokenizer (the same token -> id map); a pair whose tokenizers
    differ is refused with a message that names both models and tokens that differ. Output layers
    of different sizes (one tokenizer, embeddings padded to different row counts) share the
    smaller's rows: every session on the pair is opened over them (OpenSessionRequest.vocab_size),
    so neither side draws past them and the rule sees rows of that size. With no draft address the
    orchestrator serves target-only decoding. `security` sets TLS, the client certificate and the
    bearer token for both channels; `telemetry` instruments them. An address is HOST:PORT, or a
    function returning the service's current one (a service that moves when it restarts); the
    stubs find a restarted service again (orchestrator.recovery).

    The target must answer within `wait_seconds`. The draft is an accelerator: one that does not
    answer within DRAFT_START_WAIT seconds (or `wait_seconds`, if shorter) leaves the pair serving
    target-only, degraded, until the draft answers and is checked (orchestrator.availability); one
    attached so must cover the target's rows (sessions opened before it hold them all).
    """
    security = security or ClientSecurity()
    telemetry = telemetry or disabled()
    recovery = recovery or RecoveryConfig()

    def channel(address: str, wait: float) -> grpc.Channel:
        return telemetry.channel(_channel(address, wait, security))

    # Propose, ProposalRow and Score on each service's step stream (orchestrator.step_link), the rest unary.
    # Scores held for their turn at the target (orchestrator.turns).
    turns = Turns()
    target_stub = step_stub(model_pb2_grpc.TargetServiceStub, TARGET_SERVICE, TARGET_STEPS, telemetry, turns, "target")
    draft_stub = step_stub(model_pb2_grpc.DraftServiceStub, DRAFT_SERVICE, DRAFT_STEPS, telemetry, turns, "draft")
    target = ResilientStub(target_stub, target_address, channel, "target", recovery, wait_seconds)
    target_info = target.Describe(model_pb2.DescribeRequest(), timeout=wait_seconds)
    target_health = Availability("target", lambda: target.address, target.probe, recovery)
    tokenizer = load_tokenizer(target.GetTokenizer(model_pb2.GetTokenizerRequest()))
    draft, draft_health = None, Availability("draft")
    max_context = target_info.max_context
    vocab_size = target_info.vocab_size
    shared_device = False  # a draft found after the start is taken as on its own device
    profile, sharing = {}, None  # the draft's batched step costs (adaptive lookahead's prior for its steps)
    index_drafts = index_apart = False
    if draft_address:
        wait = min(wait_seconds, DRAFT_START_WAIT)
        draft = ResilientStub(draft_stub, draft_address, channel, "draft", recovery, wait, optional=True)

        def draft_tokenizer():
            return load_tokenizer(draft.GetTokenizer(model_pb2.GetTokenizerRequest()))

        def attach(info) -> str:  # a draft found after the start: it must cover the target's rows
            mismatch = pair_mismatch(info, target_info, tokenizer, draft_tokenizer)
            if not mismatch and info.vocab_size < target_info.vocab_size:
                mismatch = f"the draft's output layer ({info.vocab_size} rows) is smaller than the target's: restart"
            return mismatch

        draft_health = Availability("draft", lambda: draft.address, draft.probe, recovery, check=attach)
        try:
            draft_info = draft.Describe(model_pb2.DescribeRequest(), timeout=wait)
        except (SessionLost, grpc.RpcError) as err:
            draft_health.lost(f"not answering at start ({_reason(err)})")
        else:
            vocab_size = check_pair(draft_info, target_info, tokenizer, draft_tokenizer)
            for stub, info in ((draft, draft_info), (target, target_info)):
                if vocab_size < info.vocab_size:
                    stub.vocab_size = vocab_size
            max_context = min(max_context, draft_info.max_context)
            curves = _curves(draft_info.step_costs, "sessions")
            profile = curves[max(curves)] if curves else {}  # at its own threads
            sharing = shared_cores(draft_info, target_info)
            shared_device = shared_accelerator(draft_info, target_info)
            index_drafts = draft_info.index_drafts
            index_apart = index_drafts and draft_info.dtype not in ("", "none")  # a model beside it: the hybrid
    return ModelPair(
        draft=draft,
        target=target,
        tokenizer=tokenizer,
        max_context=max_context,
        vocab_size=vocab_size,
        eos_token_ids=frozenset(target_info.eos_token_ids),
        model_name=target_info.model_name,
        # on devices of their own (no cores nor accelerator shared), adaptive lookahead's rounds stop
        # overlapping under load as a fixed k's do
        costs=PairCosts(
            profile, sharing, index_apart, overlap_load=None if sharing is not None or shared_device else OVERLAP_LOAD
        ),
        tree_verify=target_info.tree_verify,
        shared_device=shared_device,
        health=(draft_health, target_health),
        draft_timeout=recovery.draft_timeout,
        index_drafts=index_drafts,
        max_sessions=target_info.max_sessions,
    )


def _reason(err: Exception) -> str:
    return err.details() if isinstance(err, grpc.RpcError) else str(err)


def shared_cores(draft: model_pb2.ModelInfo, target: model_pb2.ModelInfo) -> Sharing | None:
    """How the two services share one machine's cores (specdec.runtime.placement), if they do: both on
    the CPU of one machine (its boot id), their cores overlapping, each having timed its forwards
    at two thread counts (its share and every core). None otherwise (two hosts, a GPU, a service
    pinned to its own cores): each runs on its own threads, whatever the round."""
    if not draft.machine or draft.machine != target.machine or {draft.device, target.device} != {"cpu"}:
        return None
    if not set(draft.cpus) & set(target.cpus):
        return None
    drafts, verify = _curves(draft.step_costs, "sessions"), _curves(target.step_costs, "tokens")
    if len(drafts) < 2 or len(verify) < 2:
        return None
    return Sharing((min(drafts), max(drafts)), (min(verify), max(verify)), drafts, verify)


def shared_accelerator(draft: model_pb2.ModelInfo, target: model_pb2.ModelInfo) -> bool:
    """Whether the two services run on one accelerator: one machine, and the same device_id (a CUDA
    device's UUID; a CPU has none)."""
    return bool(draft.device_id) and draft.device_id == target.device_id and draft.machine == target.machine


def _curves(costs, size: str) -> dict[int, dict[int, float]]:
    """A profile (Describe's step_costs) by threads: {threads: {sessions or tokens: seconds}}."""
    out: dict[int, dict[int, float]] = {}
    for c in costs:
        out.setdefault(c.threads, {})[getattr(c, size) or 1] = c.seconds
    return out


def check_pair(draft: model_pb2.ModelInfo, target: model_pb2.ModelInfo, tokenizer, draft_tokenizer) -> int:
    """The vocabulary size the pair shares: the smaller output layer's rows (past them, rows padded
    beyond the tokenizer). FailedPrecondition where the tokenizers differ (naming tokens that do), or
    where a token of their tokenizer (`tokenizer`, the target's) is a target row past the draft's
    output layer. `draft_tokenizer()`: the draft's, fetched only to say how the two differ."""
    names = f"draft model {draft.model_name!r} and target model {target.model_name!r}"
    if draft.tokenizer_digest != target.tokenizer_digest:
        differ = vocabulary_difference(draft_tokenizer().get_vocab(), tokenizer.get_vocab())
        raise FailedPrecondition(
            f"{names} do not share a vocabulary (tokenizers {draft.tokenizer_digest[:12]} and "
            f"{target.tokenizer_digest[:12]}): {differ}; speculative decoding needs the same tokenizer on both sides"
        )
    shared = min(draft.vocab_size, target.vocab_size)
    cut = sorted(i for i in tokenizer.get_vocab().values() if shared <= i < target.vocab_size)
    if cut:  # tokens the target draws that no session on the pair could: its law would change
        raise FailedPrecondition(
            f"{names} share a tokenizer whose token ids {cut[0]}..{cut[-1]} are rows of the target's output "
            f"layer ({target.vocab_size} rows) past the draft's ({shared}): the pair cannot draw them"
        )
    return shared


def vocabulary_difference(draft: dict[str, int], target: dict[str, int], shown: int = 5) -> str:
    """How two token -> id maps differ, for a person: how many tokens, and the first few."""
    differ = sorted(set(draft) ^ set(target) | {t for t in set(draft) & set(target) if draft[t] != target[t]})
    differ.sort(key=lambda t: min(draft.get(t, 1 << 62), target.get(t, 1 << 62)))
    examples = ", ".join(
        f"{t!r} (draft {draft.get(t, 'none')}, target {target.get(t, 'none')})" for t in differ[:shown]
    )
    more = f" and {len(differ) - shown} more" if len(differ) > shown else ""
    return f"{len(differ)} tokens differ: {examples}{more}"


def pair_mismatch(draft: model_pb2.ModelInfo, target: model_pb2.ModelInfo, tokenizer, draft_tokenizer) -> str:
    """Why the two cannot speculate together (check_pair's refusal); "" when they can."""
    try:
        check_pair(draft, target, tokenizer, draft_tokenizer)
    except FailedPrecondition as err:
        return err.message
    return ""


def _channel(address: str, wait_seconds: float, security: ClientSecurity) -> grpc.Channel:
    channel = secure_channel(address, security, CHANNEL_OPTIONS + RECONNECT)
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=wait_seconds)
    except grpc.FutureTimeoutError:
        # Unsubscribed and closed: a channel left watching its connectivity keeps a polling thread
        # for the life of the process (a lost service's prober makes one a probe).
        ready.cancel()
        channel.close()
        hint = " (over TLS: check the CA, the certificates and the server name)" if security.uses_tls else ""
        raise ConnectionError(f"no service answered at {address} within {wait_seconds:.0f} s{hint}") from None
    return channel


def client_identity(context) -> str:
    """Who sent a call, as far as this server can tell them apart: the client certificate mutual TLS
    verified (its PEM, a digest of it in the history scope); else "" (a bearer token is one for all
    of this server's clients, and without one every caller is anonymous: one client)."""
    auth = context.auth_context() if hasattr(context, "auth_context") else {}
    cert = auth.get("x509_pem_cert") or []
    return "cert:" + cert[0].decode(errors="replace") if cert else ""


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(
        self,
        pair: ModelPair,
        telemetry: Telemetry | None = None,
        defaults: RequestDefaults | None = None,
        admission: lifecycle.Admission | None = None,
        identifies_clients: bool = False,
    ):
        """`identifies_clients`: callers present certificates the server verifies (mutual TLS); only
        then is a call's client asked for (client_identity: gRPC's auth_context cost 16-230 us a
        request on the scheduler's thread, for "" without a client certificate)."""
        self.identifies_clients = identifies_clients
        self.pair = pair
        self.telemetry = telemetry or disabled()
        self.defaults = defaults or RequestDefaults()  # for requests that leave speculation fields unset
        self.admission = admission  # what Describe reports of it
        self._stopped = False  # the server stops: generations still in flight end (stop)

    def stop(self) -> None:
        """The server stops with generations in flight (its drain ran out): each ends at its next
        round with UNAVAILABLE saying so, before gRPC cancels what is left ("Cancelling all calls")."""
        self._stopped = True

    def _active(self, context) -> Callable[[], bool]:
        def active() -> bool:
            if self._stopped:
                raise Unavailable("the orchestrator stopped with this request in flight (its drain ran out); retry")
            return context.is_active()

        return active

    def _chunks(self, request, context, streamed: bool = True):
        chunks = generate(
            self.pair,
            request,
            timeout=deadline_seconds(context),
            observe=self.telemetry.rounds,
            active=self._active(context),
            defaults=self.defaults,
            client=client_identity(context) if self.identifies_clients else "",
            streamed=streamed,
        )
        return self.telemetry.requests(chunks)

    def Generate(self, request, context):
        # A task of the scheduler (orchestrator.scheduler): this thread waits for its answer.
        return SCHEDULER.run(self._generate, request, context)

    def _generate(self, request, context):
        ids, text, logprobs = [], [], []
        last = None
        for chunk in self._chunks(request, context, streamed=False):
            ids += chunk.token_ids
            text.append(chunk.text)
            logprobs += chunk.logprobs
            last = chunk
        return orchestrator_pb2.GenerateResponse(
            token_ids=ids, text="".join(text), finish_reason=last.finish_reason, stats=last.stats, logprobs=logprobs
        )

    def GenerateStream(self, request, context):
        for chunk in SCHEDULER.iterate(lambda: self._chunks(request, context)):
            yield _chunk_proto(chunk)

    def Describe(self, request, context):
        info = describe(self.pair, self.defaults)
        if self.admission is not None:
            a = self.admission
            info.max_concurrent, info.max_queue = a.max_concurrent, a.limits.max_queue
            info.queued, info.refused = a.waiting, a.refused
        return info


def describe(pair: ModelPair, defaults: RequestDefaults | None = None) -> orchestrator_pb2.OrchestratorInfo:
    """The pair's status: each service's availability, what it means for requests, and the price of
    a request that names no lookahead (`defaults`: the server's, for the kind of round). A service
    taken as up that has not answered within the last second is asked first (a Describe on the
    pair's link, at most a second: orchestrator.availability.confirm), so that one that died while
    no request called it is reported lost, not available."""
    draft_health, target_health = pair.health
    checks = [(target_health, _check(pair.target))]
    if pair.draft is not None:
        checks.append((draft_health, _check(pair.draft)))
    confirm(*checks)

    def status(role: str, stub, health) -> orchestrator_pb2.ServiceStatus:
        state = health.state()
        return orchestrator_pb2.ServiceStatus(
            role=role,
            address=getattr(stub, "address", ""),
            available=state.up,
            reason=state.reason,
            seconds=state.seconds,
            losses=state.losses,
        )

    info = orchestrator_pb2.OrchestratorInfo(
        model_name=pair.model_name, target=status("target", pair.target, target_health), running=RUNNING.count()
    )
    if pair.draft is not None:
        info.draft.CopyFrom(status("draft", pair.draft, draft_health))
        priced = price(pair.costs, MEASURED_LOOKAHEAD, default_overlap(pair, defaults or RequestDefaults()))
        if priced is not None:
            info.pricing.CopyFrom(
                orchestrator_pb2.Pricing(**dataclasses.asdict(priced), carried_over=pair.costs.carried_over)
            )
    if not target_health.up:
        info.status = "unavailable: target unavailable"
    elif pair.draft is not None and not draft_health.up:
        info.status = "degraded: draft unavailable"
    else:
        info.status = "ok"
    return info


def _check(stub):
    """send(timeout): a Describe of the service on the pair's link to it, as a future."""
    return lambda timeout: stub.Describe.future(model_pb2.DescribeRequest(), timeout=timeout)


def _chunk_proto(chunk: Chunk) -> orchestrator_pb2.GenerateChunk:
    return orchestrator_pb2.GenerateChunk(
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=chunk.finish_reason,
        stats=chunk.stats,
        logprobs=chunk.logprobs,
        spans=[orchestrator_pb2.TextSpan(length=n, drafted=d) for n, d in chunk.spans],
        rounds=orchestrator_pb2.RoundCounts(
            rounds=chunk.rounds[0], draft_tokens=chunk.rounds[1], accepted_tokens=chunk.rounds[2]
        ),
    )


def serve(
    pair: ModelPair,
    host: str = "127.0.0.1",
    port: int = 0,
    security: ServerSecurity | None = None,
    telemetry: Telemetry | None = None,
    admission: AdmissionLimits | None = None,
    defaults: RequestDefaults | None = None,
    health_socket: str | None = None,
    front_door: bool = False,
):
    """Start the orchestrator on host:port; returns (server, bound port).

    `security` adds TLS / token auth; pass the same `telemetry`
    (specdec.serving.telemetry.setup("orchestrator")) as to connect(); `admission` bounds the
    generations running and queued (a request's n choices admitted as one: orchestrator.admission);
    `defaults` is what requests that leave speculation.overlap or speculation.rule unset get;
    `health_socket`, a Unix socket's path where it also answers health checks (and only those: its
    supervisor's probes, past TLS); `front_door`: the HTTP front door will call it from this process
    (make_server's). The server drains with server.drain() (specdec.serving.lifecycle).
    """
    telemetry = telemetry or disabled()
    mtls = security is not None and security.client_ca is not None
    limits = admission or AdmissionLimits()
    admission = GroupAdmission(limits, pair.max_sessions)
    draft_health, target_health = pair.health
    telemetry.watch_services({"target": target_health, **({"draft": draft_health} if pair.draft else {})})
    telemetry.watch_admission(admission)
    servicer = OrchestratorServicer(pair, telemetry, defaults, admission, mtls)
    served, bound = lifecycle.start(
        lambda server: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server),
        SERVICE_NAME,
        [f"/{SERVICE_NAME}/Generate", f"/{SERVICE_NAME}/GenerateStream"],
        host,
        port,
        admission=admission,
        interceptors=telemetry.server_interceptors(),
        security=security,
        # Queued requests hold a thread while they wait; leave some for health checks.
        max_workers=limits.max_concurrent + limits.max_queue + 4,
        max_receive_bytes=MAX_REQUEST_BYTES,
        health_socket=health_socket,
        front_door=front_door,
    )
    served.stopping.append(servicer.stop)
    return served, bound
