"""Comparison helpers shared by the test files."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from npformer import backend
from npformer.ops import attention as attention_op


def rel_diff(actual, expected) -> float:
    """max |actual - expected| / max |expected| (norm-wise relative difference).

    Element-wise relative error is meaningless for entries near zero, so the
    difference is measured against the size of the whole expected tensor.
    """
    a = np.asarray(backend.to_numpy(actual), dtype=np.float64)
    e = np.asarray(backend.to_numpy(expected), dtype=np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != expected {e.shape}"
    scale = float(np.max(np.abs(e), initial=0.0))
    diff = float(np.max(np.abs(a - e), initial=0.0))
    return diff if scale == 0.0 else diff / scale


def assert_close(actual, expected, rtol: float, what: str = "") -> None:
    d = rel_diff(actual, expected)
    assert d <= rtol, f"{what}: relative difference {d:.3e} exceeds {rtol:.1e}"


# Tolerances of the PyTorch parity tests (issue: 1e-5 float32, 1e-10 float64).
PARITY_RTOL = {"float32": 1e-5, "float64": 1e-10}
GRADCHECK_TOL = 1e-6


# Block sizes for the attention op: the default (one block at test sizes) and 5 scores,
# which at test sizes gives blocks of single queries, of query ranges and of whole rows,
# with the keys a block cannot see cut off.
ATTENTION_BLOCKS = (None, 5)


@contextmanager
def attention_blocks(scores: int | None):
    """Run the attention op in blocks of about ``scores`` scores (None: its default)."""
    default = attention_op.BLOCK_SCORES
    attention_op.BLOCK_SCORES = default if scores is None else scores
    try:
        yield
    finally:
        attention_op.BLOCK_SCORES = default
