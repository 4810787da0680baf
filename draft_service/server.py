"""The draft service's servicer: translate protos, delegate to the engine and proposer."""

from __future__ import annotations

from draft_service.proposer import proposal_row, propose
from specdec import validation, wire
from specdec.engine import SessionEngine
from specdec.lifecycle import serve_model
from specdec.limits import SessionLimits
from specdec.sampling import SamplingParams
from specdec.service import SessionServicer
from specdec.v1 import model_pb2, model_pb2_grpc

SERVICE_NAME = "specdec.v1.DraftService"


class DraftServicer(SessionServicer, model_pb2_grpc.DraftServiceServicer):
    def Propose(self, request, context):
        validation.propose_request(request, self.engine.backend.vocab_size)
        ref = request.session
        with self.engine.session(ref.session_id, ref.expected_length) as session:
            # Checked before the commit, so a refused request changes nothing.
            length = len(session.tokens) + len(request.append_tokens) + request.k
            self.engine.reserve(session, length, "append_tokens + k")
            self.engine.commit(session, list(request.append_tokens))
            tokens, probs = propose(
                self.engine,
                session,
                request.k,
                SamplingParams.from_proto(request.sampling),
                list(request.uniforms),
            )
            return model_pb2.ProposeResponse(token_ids=tokens, token_probs=probs, length=len(session.tokens))

    def ProposalRow(self, request, context):
        ref = request.session
        with self.engine.session(ref.session_id, ref.expected_length) as session:
            return wire.encode_row(proposal_row(session, request.position))


def serve(backend, host: str = "127.0.0.1", port: int = 0, limits: SessionLimits | None = None):
    """Start a draft service on host:port; returns (server, bound port)."""
    servicer = DraftServicer(SessionEngine(backend, "draft", limits))
    return serve_model(servicer, model_pb2_grpc.add_DraftServiceServicer_to_server, SERVICE_NAME, host, port)
