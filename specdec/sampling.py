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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    # The wire form, both ways: the only place that knows both shapes.
    @classmethod
    def from_proto(cls, msg: model_pb2.SamplingParams) -> SamplingParams:
        """From a validated proto message (specdec.validation.sampling); unset fields: the defaults."""
        return cls(
            temperature=msg.temperature,  # unset reads as 0
            top_k=msg.top_k if msg.HasField("top_k") else 0,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        )

    def to_proto(self) -> model_pb2.SamplingParams:
        """Only what differs from the defaults is set: an explicit top_k 0 or top_p 1 is refused."""
        msg = model_pb2.SamplingParams(temperature=self.temperature)
        if self.top_k:
            msg.top_k = self.top_k
        if self.top_p < 1.0:
            msg.top_p = self.top_p
        return msg


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature, top-k, top-p."""
    assert not params.greedy, "greedy decoding has no distribution"
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
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
    the log of probs_from_logits (temperature, top-k, top-p; a dropped token -inf); greedy, whose
    law is a point mass, reports the model's own log-softmax (temperature 1)."""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    if params.top_k == 0 and params.top_p >= 1.0:  # the log-softmax itself: exact far into the tail
        return torch.log_softmax(logits.float() / params.temperature, dim=-1)
    return torch.log(probs_from_logits(logits, params))
