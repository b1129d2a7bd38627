"""How far two correct evaluations of one quantity may differ when only the order of their floating-point sums
differs: another CPU's kernels (AVX-512 or AVX2 blocking of a matrix product), another split of the rows
across processes or micro-batches. Tests that compare such evaluations take their tolerance from here rather
than from a number that held on one machine.

The model: a sum of n terms, each rounded to the dtype's unit roundoff u (2^-24 for float32, 2^-8 for
bfloat16), has a relative rounding error whose worst case is (n-1)·u (Higham, Accuracy and Stability of
Numerical Algorithms, §4.2) and whose typical size, the roundings being independent, is ~√n·u. A value
computed through k such sums in sequence (a transformer's logprob: per layer the q/k/v, scores, weighted
values, output, gate/up and down products, then the head and the log-sum-exp) accumulates k of them, again
independently: ~√(k·n)·u, relative to the size of the value. The tolerance is SAFETY times that. For the tiny
test model (hidden 64, intermediate 192, vocabulary 2048, 2 layers: n = 2048, k = 14) and a logprob of -8:
8 · √(14·2048) · 2^-24 · 8 ≈ 6.5e-4, where the float32 differences seen across an AMD and an Intel CPU were
1.8e-5 (36x inside), and where a real divergence stays far outside: the same rows' logprobs one training
step apart (a rank that missed the update, the wrong checkpoint loaded) differ by a median 180x (LoRA) and
760x (full fine-tuning) the tolerance (`test_a_real_divergence_exceeds_the_tolerance`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

SAFETY = 8.0
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11, "float64": 2.0**-53}


def reduction_tolerance(magnitude: float, terms: int, chained: int = 1, dtype: str = "float32") -> float:
    """Absolute tolerance for a value of size `magnitude` computed through `chained` sums of at most `terms`
    terms each, in `dtype`, when two evaluations differ only in the order of those sums."""
    return SAFETY * math.sqrt(chained * terms) * UNIT_ROUNDOFF[dtype] * max(abs(magnitude), 1.0)


def tiny_model_logprob_tolerance(magnitude: float, dtype: str = "float32") -> float:
    """A token logprob of the tiny test model (artrl's `tiny` preset: 2 layers, hidden 64, intermediate 192,
    vocabulary 2048): 6 chained sums per layer, the head and the log-sum-exp, each of at most 2048 terms."""
    return reduction_tolerance(magnitude, terms=2048, chained=6 * 2 + 2, dtype=dtype)


def assert_logprobs_close(got: Sequence[float | None], want: Sequence[float | None]) -> None:
    """Token logprobs of the tiny model from two evaluations (two engines, processes or kernels): equal up to
    the summation order's rounding. None (a prompt token) only where the other has None too."""
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g is None) == (w is None), (i, g, w)
        assert w is None or abs(g - w) <= tiny_model_logprob_tolerance(w), (i, g, w)


def assert_same_adamw_update(weights1: dict, weights2: dict, lr: float) -> None:
    """Weights (or their updates) after AdamW steps from equal weights and optimizer states, computed in two
    summation orders: equal, except where AdamW amplifies rounding. Its first update is lr·g/(|g|+eps): an
    element whose gradient nearly cancels to ~eps turns the order's rounding into up to lr of difference
    (seen: 7e-5 at lr 1e-2, on 2 of 1.5k elements at most). So: at most max(2, 0.5%) of each tensor's
    elements differ by more than 1e-3·lr, none by more than 2·lr. A real divergence (a missed or doubled
    update, a wrong gradient) moves most elements by about lr. Compare gradients themselves through the
    optimizer's moments where they matter."""
    assert weights1.keys() == weights2.keys()
    for name in weights1:
        off = (weights2[name] - weights1[name]).abs() > 1e-3 * lr
        assert int(off.sum()) <= max(2, off.numel() // 200), (name, int(off.sum()))
        assert torch.allclose(weights2[name], weights1[name], atol=2 * lr), name
