"""The draft service's servicer: translate protos, delegate to the engine and proposer."""

from __future__ import annotations

import inspect
import time

from draft_service.drafters import MODEL, Drafter
from specdec import validation
from specdec.decoding.sampling import SamplingParams
from specdec.limits import SessionLimits
from specdec.runtime.engine import SessionEngine
from specdec.runtime.session import SessionCall
from specdec.serving import wire
from specdec.serving.lifecycle import serve_model
from specdec.serving.security import ServerSecurity
from specdec.serving.service import SessionServicer
from specdec.serving.steps import StepMethod
from specdec.serving.telemetry import Telemetry
from specdec.v1 import model_pb2, model_pb2_grpc

SERVICE_NAME = "specdec.v1.DraftService"


def _metered(proposal, steps: list):
    """Run a proposal's forwards (session.Forward) on the worker, appending each, once run, to `steps`."""
    logits = None
    try:
        while True:
            forward = proposal.send(logits)
            logits = yield forward
            steps.append(forward)
    except StopIteration as stop:
        return stop.value


class DraftServicer(SessionServicer, model_pb2_grpc.DraftServiceServicer):
    service_name = SERVICE_NAME

    def __init__(self, engine: SessionEngine, drafter: Drafter = MODEL, telemetry=None):
        super().__init__(engine, telemetry)
        self.drafter = drafter
        engine.prefill_at_open = drafter.prefill_at_open

    def Describe(self, request, context):
        info = super().Describe(request, context)
        info.index_drafts = self.drafter.indexed
        return info

    def Propose(self, request, context):
        return self.engine.run_call(self.propose_call(request), context)

    def propose_call(self, request: model_pb2.ProposeRequest) -> SessionCall:
        """A Propose, validated, for the model worker (the unary RPC's and the step stream's)."""
        validation.propose_request(request, self.engine.backend.vocab_size)
        ref = request.session

        def run(session):  # on the model worker
            start = time.perf_counter()
            masked = session.constraint.seconds if session.constraint is not None else 0.0
            extra = len(request.assumed_tokens) + max(request.k, request.free_lookahead)
            what = "append_tokens + assumed_tokens + k" if request.assumed_tokens else "append_tokens + k"
            self.engine.open_round(session, request.append_tokens, extra, what)
            params = SamplingParams.from_proto(request.sampling)
            noise_seed = request.noise_seed if request.HasField("noise_seed") else None
            alternatives = [] if request.alternatives else None  # (runner-up, probabilities) a token
            if request.tree_nodes:
                proposal = self.drafter.propose_tree(
                    self.engine,
                    session,
                    request.k,
                    request.tree_nodes,
                    params,
                    list(request.uniforms),
                    noise_seed,
                    list(request.tree_acceptance),
                )
            else:
                proposal = self.drafter.propose(
                    self.engine,
                    session,
                    request.k,
                    params,
                    list(request.uniforms),
                    list(request.assumed_tokens),
                    noise_seed,
                    alternatives,
                    **({"free": request.free_lookahead} if self.drafter.free else {}),
                )
            steps: list = []  # the forwards of the proposal, as they ran (batched with others')
            result = (yield from _metered(proposal, steps)) if inspect.isgenerator(proposal) else proposal
            response = model_pb2.ProposeResponse(
                length=len(session.tokens),
                # less its waits for the other service's steps on shared cores: not its compute
                compute_seconds=time.perf_counter() - start - sum(f.waited for f in steps),
                steps=sum(f.steps for f in steps),
                step_tokens=sum(f.step_tokens for f in steps),
                threads=min((f.step_threads for f in steps), default=0),
                forward_seconds=sum(f.seconds for f in steps),
                mask_seconds=session.constraint.seconds - masked if session.constraint is not None else 0.0,
            )
            if request.tree_nodes:
                response.token_ids[:], response.token_probs[:] = result.tokens, result.probs
                response.parent_ids[:] = result.parents
                for node, row in sorted(result.rows.items()):
                    response.row_nodes.append(node)
                    response.node_rows.append(wire.encode_row(row.float().cpu().numpy()))
            else:
                response.token_ids[:], response.token_probs[:] = result
                for second, top, second_prob in alternatives or ():
                    response.runner_up_ids.append(second)
                    response.top_probs.append(top)
                    response.runner_up_probs.append(second_prob)
            return response

        return SessionCall(ref.session_id, ref.expected_length, run, validation.threads(request))

    def ProposalRow(self, request, context):
        return self.engine.run_call(self.row_call(request), context)

    def row_call(self, request: model_pb2.ProposalRowRequest) -> SessionCall:
        """A ProposalRow, for the model worker."""
        ref = request.session

        def row(session):
            token = request.token_id if request.HasField("token_id") else None
            return wire.encode_row(self.drafter.proposal_row(session, request.position, token))

        return SessionCall(ref.session_id, ref.expected_length, row)

    def step_calls(self) -> dict[str, StepMethod]:
        return {
            **super().step_calls(),
            "propose": StepMethod("Propose", lambda r, deadline: self.engine.item(self.propose_call(r), deadline)),
            "proposal_row": StepMethod("ProposalRow", lambda r, deadline: self.engine.item(self.row_call(r), deadline)),
        }


def serve(
    backend,
    host: str = "127.0.0.1",
    port: int = 0,
    drafter: Drafter = MODEL,
    security: ServerSecurity | None = None,
    telemetry: Telemetry | None = None,
    limits: SessionLimits | None = None,
    cores=None,
):
    """Start a draft service on host:port; returns (server, bound port).

    `security` adds TLS / token auth; `telemetry` (specdec.serving.telemetry.setup("draft")) adds spans
    and metrics, and the caller shuts it down; `limits` caps sessions and KV tokens; `cores`
    (specdec.runtime.placement.Cores) sets each step's threads. The server drains with server.drain()
    (specdec.serving.lifecycle).
    """

    def add_servicer(engine, server, telemetry):
        model_pb2_grpc.add_DraftServiceServicer_to_server(DraftServicer(engine, drafter, telemetry), server)

    return serve_model(
        backend,
        "draft",
        SERVICE_NAME,
        add_servicer,
        host,
        port,
        limits=limits,
        telemetry=telemetry,
        security=security,
        cores=cores,
    )
