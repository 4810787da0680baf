"""Probability rows on the wire: raw little-endian bytes, sparse when most mass is zero.

Filling `repeated float` from Python is slow; bytes from numpy are near memcpy.
"""

from __future__ import annotations

import numpy as np

from specdec.v1 import model_pb2


def encode_row(probs: np.ndarray) -> model_pb2.ProbRow:
    """[vocab] float32 probabilities -> ProbRow (sparse if under half the entries are non-zero)."""
    probs = np.ascontiguousarray(probs, dtype="<f4")
    nonzero = np.flatnonzero(probs)
    if 2 * nonzero.size < probs.size:
        return model_pb2.ProbRow(
            vocab_size=probs.size,
            indices=nonzero.astype("<i4").tobytes(),
            values=probs[nonzero].tobytes(),
        )
    return model_pb2.ProbRow(vocab_size=probs.size, values=probs.tobytes())


def decode_row(row: model_pb2.ProbRow) -> np.ndarray:
    """ProbRow -> dense [vocab] float32 array."""
    values = np.frombuffer(row.values, dtype="<f4")
    if not row.indices:
        return values
    dense = np.zeros(row.vocab_size, dtype=np.float32)
    dense[np.frombuffer(row.indices, dtype="<i4")] = values
    return dense
