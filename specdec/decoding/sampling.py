"""Sampling transforms: logits -> probabilities, identical on the draft and the target.

Temperature 0 is greedy and has no distribution: callers take the argmax instead.
Pure torch functions; rows stay on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.v1 import model_pb2


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    # functions of the sequence so far (specdec.decoding.penalties), applied to the logits first
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit), by token

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def raw_greedy(self) -> bool:
        """Greedy on the model's own rows (no penalty or bias): with no grammar either, a token is
        its row's argmax as the worker's step finds it (specdec.runtime.session.Forward.argmax)."""
        return self.temperature == 0.0 and not self.penalized

    @property
    def penalized(self) -> bool:
        """Whether rows depend on the sequence before them beyond the model (penalties, biases)."""
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    # The wire form, both ways: the only place that knows both shapes.
    @classmethod
    def from_proto(cls, msg: model_pb2.SamplingParams) -> SamplingParams:
        """From a validated proto message (specdec.validation.sampling); unset fields: the defaults."""
        if not msg.ByteSize():  # all unset: greedy, every transform off
            return GREEDY
        return cls(
            temperature=msg.temperature,  # unset reads as 0
            top_k=msg.top_k if msg.HasField("top_k") else 0,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            min_p=msg.min_p,  # unset reads as 0: off
            frequency_penalty=msg.frequency_penalty,
            presence_penalty=msg.presence_penalty,
            repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
            logit_bias=tuple(sorted((t, b) for t, b in msg.logit_bias.items() if b)) if msg.logit_bias else (),
        )

    def to_proto(self) -> model_pb2.SamplingParams:
        """Only what differs from the defaults is set: an explicit top_k 0 or top_p 1 is refused
        (greedy's is an empty message)."""
        msg = model_pb2.SamplingParams(logit_bias=dict(self.logit_bias))
        if self.temperature:
            msg.temperature = self.temperature
        if self.top_k:
            msg.top_k = self.top_k
        if self.top_p < 1.0:
            msg.top_p = self.top_p
        for name in ("min_p", "frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                setattr(msg, name, getattr(self, name))
        if self.repetition_penalty != 1.0:
            msg.repetition_penalty = self.repetition_penalty
        return msg


GREEDY = SamplingParams()  # what an empty SamplingParams message means


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits over `temperature`, each row shifted by its largest first (softmax is the same):
    divided as they came, a temperature of 1e-40 took a positive logit to inf and the row to NaN
    (a 500); shifted, the largest are 0 and the rest -inf at worst, greedy's limit (ties split)."""
    logits = logits.float()
    return (logits - logits.max(dim=-1, keepdim=True).values) / temperature


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature, top-k, min-p, top-p
    (the penalties and biases come before, on the logits: specdec.decoding.penalties)."""
    assert not params.greedy, "greedy decoding has no distribution"
    logits = tempered(logits, params.temperature)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:  # below min_p x the row's most probable: dropped (that one always stays)
        drop = probs < params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass
        # before it already does. The top token is always kept.
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def logprobs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 log probabilities of the law a token is drawn from:
    the log of probs_from_logits (temperature, top-k, min-p, top-p; a dropped token -inf); greedy,
    whose law is a point mass, reports the log-softmax of its (penalised) logits at temperature 1."""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    if params.top_k == 0 and params.top_p >= 1.0 and params.min_p == 0.0:  # the log-softmax: exact far into the tail
        return torch.log_softmax(tempered(logits, params.temperature), dim=-1)
    return torch.log(probs_from_logits(logits, params))
