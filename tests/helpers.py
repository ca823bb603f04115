"""Comparison helpers shared by the test files."""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import numpy as np

from npformer import backend
from npformer import engine, fast, ops


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


# The attention op of each tier: the textbook dense op, the fast blocked op at its default
# block size (one block at test sizes), and the fast op in blocks of 5 scores, which at
# test sizes gives blocks of single queries, of query ranges and of whole rows, with the
# keys a block cannot see cut off.
ATTENTION_OPS = {
    "textbook": (ops.attention_forward, ops.attention_backward),
    "fast": (fast.attention_forward, fast.attention_backward),
    "fast_blocks5": (partial(fast.attention_forward, block_scores=5), fast.attention_backward),
}


@contextmanager
def using_engine(name: str):
    """Run a block on tier ``name`` ("fast" or "textbook"), then restore the previous one."""
    previous = engine.engine_name()
    engine.set_engine(name)
    try:
        yield
    finally:
        engine.set_engine(previous)
