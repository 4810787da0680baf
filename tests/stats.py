"""Goodness-of-fit for Markov chains: is a token sequence driven by the expected kernel?"""

from __future__ import annotations

import numpy as np
from scipy import stats


def transition_counts(tokens, vocab: int) -> np.ndarray:
    """Counts of (previous, next) pairs in a token sequence, or summed over a list of them."""
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    for chain in tokens if tokens and isinstance(tokens[0], list) else [tokens]:
        np.add.at(counts, (np.asarray(chain[:-1]), np.asarray(chain[1:])), 1)
    return counts


def markov_chisquare(tokens, kernel: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square test that `tokens` (a sequence, or a list of independent
    ones) follow the transition `kernel`.

    Conditional on each previous token, the next-token counts are multinomial; cells with an
    expected count under `min_expected` are pooled per row so the chi-square law holds.
    """
    kernel = np.asarray(kernel, dtype=np.float64)
    return counts_chisquare(transition_counts(tokens, kernel.shape[0]), kernel, min_expected)


def counts_chisquare(counts: np.ndarray, kernel: np.ndarray, min_expected: float = 5.0) -> float:
    """markov_chisquare from [vocab, vocab] transition counts (of one chain or of many pooled)."""
    kernel = np.asarray(kernel, dtype=np.float64)
    kernel = kernel / kernel.sum(axis=1, keepdims=True)
    chi2, dof = 0.0, 0
    for prev in range(kernel.shape[0]):
        n = counts[prev].sum()
        if n == 0:
            continue
        expected = n * kernel[prev]
        observed = counts[prev]
        if (observed[expected == 0] > 0).any():
            return 0.0  # a transition the kernel forbids: certainly not this chain
        big = expected >= min_expected
        obs = list(observed[big])
        exp = list(expected[big])
        if (~big).any() and expected[~big].sum() > 0:
            obs.append(observed[~big].sum())
            exp.append(expected[~big].sum())
        if len(exp) < 2:
            continue
        obs, exp = np.array(obs), np.array(exp)
        chi2 += ((obs - exp) ** 2 / exp).sum()
        dof += len(exp) - 1
    return float(stats.chi2.sf(chi2, dof))
