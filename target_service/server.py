"""The target service's servicer: translate protos, delegate to the engine and scorer."""

from __future__ import annotations

import time

from specdec import validation
from specdec.decoding.sampling import SamplingParams
from specdec.limits import SessionLimits
from specdec.runtime.session import SessionCall
from specdec.serving import wire
from specdec.serving.lifecycle import serve_model
from specdec.serving.security import ServerSecurity
from specdec.serving.service import SessionServicer
from specdec.serving.steps import StepMethod
from specdec.serving.telemetry import Telemetry
from specdec.v1 import model_pb2, model_pb2_grpc
from target_service import scorer

SERVICE_NAME = "specdec.v1.TargetService"


class TargetServicer(SessionServicer, model_pb2_grpc.TargetServiceServicer):
    service_name = SERVICE_NAME

    def Score(self, request, context):
        return self.engine.run_call(self.score_call(request), context)

    def score_call(self, request: model_pb2.ScoreRequest) -> SessionCall:
        """A Score, validated, for the model worker (the unary RPC's and the step stream's)."""
        validation.score_request(request, self.engine.backend.vocab_size)
        ref = request.session

        def run(session):  # on the model worker
            start = time.perf_counter()
            steps = request.decode_steps if request.HasField("decode_steps") else 0
            extra = len(request.draft_token_ids) + max(0, steps - 1)
            what = "append_tokens + decode_steps" if steps else "append_tokens + draft_token_ids"
            self.engine.open_round(session, request.append_tokens, extra, what)
            params = SamplingParams.from_proto(request.sampling)
            noise_seed = request.noise_seed if request.HasField("noise_seed") else None
            logprobs = request.logprobs if request.HasField("logprobs") else None
            if steps:
                stops = frozenset(request.stop_token_ids)
                uniforms = list(request.step_uniforms)
                scores = yield from scorer.decode(
                    self.engine, session, steps, params, noise_seed, stops, uniforms, logprobs
                )
            elif request.draft_parent_ids:
                walk = None
                if not params.greedy and noise_seed is None:
                    vocab = session.vocab_size or self.engine.backend.vocab_size
                    rows = scorer.draft_rows(map(wire.decode_row, request.draft_rows), request.draft_row_nodes, vocab)
                    walk = scorer.TreeRule(rows, list(request.accept_uniforms), request.final_uniform)
                ids, parents = list(request.draft_token_ids), list(request.draft_parent_ids)
                scores = yield from scorer.score_tree(
                    self.engine, session, ids, parents, params, noise_seed, walk, logprobs
                )
            else:
                scores = yield from scorer.score(
                    self.engine,
                    session,
                    list(request.draft_token_ids),
                    params,
                    list(request.draft_token_probs),
                    list(request.accept_uniforms),
                    noise_seed,
                    logprobs,
                )
            response = model_pb2.ScoreResponse(
                argmax_token_ids=scores.argmax,
                draft_token_target_probs=scores.draft_token_probs,
                row_position=scores.row_position,
                row=wire.encode_row(scores.row) if scores.row is not None else None,
                length=len(session.tokens),
                # less its wait for the other service's step on shared cores: not its compute
                compute_seconds=time.perf_counter() - start - scores.waited,
                step_tokens=scores.step_tokens,
                step_sessions=scores.step_sessions,
                threads=scores.step_threads,
                forward_seconds=scores.forward_seconds,
                accepted_nodes=scores.accepted_nodes,
                final_token=scores.final_token,
                mask_seconds=scores.mask_seconds,
            )
            if scores.logprobs is not None:
                lp = scores.logprobs
                response.draft_token_logprobs[:] = lp.draft_tokens
                response.final_token_logprob = lp.final_token
                for (token, logprob), (ids, values) in zip(lp.own, lp.top, strict=True):
                    response.row_logprobs.add(own_token=token, own_logprob=logprob, top_ids=ids, top_logprobs=values)
            return response

        return SessionCall(ref.session_id, ref.expected_length, run, validation.threads(request), request.close_session)

    def step_calls(self) -> dict[str, StepMethod]:
        score = StepMethod("Score", lambda request, deadline: self.engine.item(self.score_call(request), deadline))
        return {**super().step_calls(), "score": score}


def serve(
    backend,
    host: str = "127.0.0.1",
    port: int = 0,
    security: ServerSecurity | None = None,
    telemetry: Telemetry | None = None,
    limits: SessionLimits | None = None,
    cores=None,
):
    """Start a target service on host:port; returns (server, bound port).

    `security` adds TLS / token auth; `telemetry` (specdec.serving.telemetry.setup("target")) adds spans
    and metrics, and the caller shuts it down; `limits` caps sessions and KV tokens; `cores`
    (specdec.runtime.placement.Cores) sets each step's threads. The server drains with server.drain()
    (specdec.serving.lifecycle).
    """

    def add_servicer(engine, server, telemetry):
        model_pb2_grpc.add_TargetServiceServicer_to_server(TargetServicer(engine, telemetry), server)

    return serve_model(
        backend,
        "target",
        SERVICE_NAME,
        add_servicer,
        host,
        port,
        limits=limits,
        telemetry=telemetry,
        security=security,
        cores=cores,
    )
