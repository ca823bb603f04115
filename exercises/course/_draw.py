"""Inputs shared by several exercises' specs (the test suite's strategies, restated:
exercises/ does not import from tests/)."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

batch = st.integers(1, 3)
length = st.integers(1, 4)
width = st.integers(1, 5)


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return rng.standard_normal(tuple(shape)) * scale


def away_from_zero(rng: np.random.Generator, shape, margin: float = 0.1) -> np.ndarray:
    """Normal samples at least ``margin`` from 0 (a kink such as relu's at 0: central
    differences need |x| > h)."""
    x = rng.standard_normal(tuple(shape))
    return np.where(x >= 0, x + margin, x - margin)


def distinct_values(rng: np.random.Generator, shape) -> np.ndarray:
    """Values at least 0.05 apart: a maximum's winner never changes under +-h."""
    n = int(np.prod(shape))
    return (rng.permutation(n) * 0.05 + rng.uniform(0, 0.01, n)).reshape(shape) - 0.025 * n


def rows_to_normalise(rng: np.random.Generator, lead, d: int) -> np.ndarray:
    """Rows with a random mean and a standard deviation in [0.5, 2] (never nearly
    constant: there 1/sqrt(var + eps) bends on a scale close to h)."""
    z = rng.standard_normal(tuple(lead) + (d,))
    if d > 1:
        z = (z - z.mean(-1, keepdims=True)) / z.std(-1, keepdims=True)
        z = z * rng.uniform(0.5, 2.0, size=tuple(lead) + (1,))
    return z + rng.normal(0.0, 3.0, size=tuple(lead) + (1,))


def mask_with_dead_row(rng: np.random.Generator, shape, axis: int = -1,
                       dead: bool = True) -> np.ndarray:
    """A boolean mask of ``shape`` (True: keep) with, along ``axis``, a fully masked row
    (``dead``) and, where the axis is longer than 1, a row with one valid entry."""
    mask = rng.random(tuple(shape)) < 0.6
    moved = np.moveaxis(mask, axis, -1).copy()
    flat = moved.reshape(-1, moved.shape[-1])
    order = rng.permutation(flat.shape[0])
    if dead:
        flat[order[0]] = False
    if flat.shape[0] > 1 and flat.shape[1] > 1:
        flat[order[1]] = False
        flat[order[1], rng.integers(flat.shape[1])] = True
    return np.moveaxis(flat.reshape(moved.shape), -1, axis)
