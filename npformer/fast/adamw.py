r"""Adam and AdamW, fast (docs/derivations.md §23): the update of
:class:`npformer.optim.Adam` (and ``AdamW``'s decay) over every parameter at once, and the
gradient norm's one pass.  The optimizer's statements in its order, each rounded to the
buffers' dtype (the coefficients first), so ``torch.optim.AdamW``'s numbers, and the
textbook update's bit for bit in float32:

    p <- p (1 - lr lambda)                      (AdamW, decayed parameters only)
    m <- m + (1 - beta1)(g - m)
    v <- beta2 v + (1 - beta2) g^2
    p <- p - step m / (sqrt(v) / sqrt(bc2) + eps),   step = lr / bc1

:func:`adamw_flat_update` over flat buffers (compiled, :func:`adamw_flat`, on NumPy);
:func:`sum_of_squares` in float64 as eight running sums; :func:`adam_update_cupy`, one
parameter's update as one CuPy kernel (``--fmad=false``: bit for bit the expressions').
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from .. import backend, optim
from ..backend import Array
from .compiler import compilable, jit


# =========================================================================== one flat pass
@jit
def adamw_flat(data: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray,
               segments: np.ndarray, decay_factor: float, one_minus_beta1: float,
               one_minus_beta2: float, beta2: float, sqrt_bias_correction2: float, eps: float,
               step_size: float) -> None:
    """One Adam(W) update of every parameter in the flat buffers data, grad, m, v (P,),
    the kernel.  ``segments`` (K, 2): the [lo, hi) ranges of the decayed parameters,
    whose data first shrinks by ``decay_factor``; the coefficients come already rounded
    to the buffers' dtype."""
    for k in range(segments.shape[0]):
        for i in range(segments[k, 0], segments[k, 1]):
            data[i] = data[i] * decay_factor
    for i in range(data.size):
        g = grad[i]
        mi = m[i] + (g - m[i]) * one_minus_beta1
        vi = v[i] * beta2 + (g * g) * one_minus_beta2
        m[i] = mi
        v[i] = vi
        denom = np.sqrt(vi) / sqrt_bias_correction2 + eps
        data[i] = data[i] - (mi / denom) * step_size
    return None


def adamw_flat_update(data: Array, grad: Array, m: Array, v: Array,
                      decay_segments: Sequence[tuple[int, int]], decay_factor: float,
                      beta1: float, beta2: float, eps: float, step_size: float,
                      bias_correction2: float) -> None:
    """One Adam(W) update over flat buffers data, grad, m, v (P,), in place.

    ``decay_segments`` (K, 2): the [lo, hi) ranges whose data first shrinks by
    ``decay_factor`` = 1 - lr lambda (AdamW; K = 0 for none).  Then Adam's statements,
    element by element, in their order, with step_size = lr / (1 - beta1^t) and
    bias_correction2 = 1 - beta2^t; the coefficients rounded to the buffers' dtype
    first.  Compiled on C-contiguous, writable NumPy buffers with numba, else the
    textbook's statements (:func:`npformer.optim.adam_step`) over the buffers.
    """
    if compilable(data, grad, m, v) and all(a.flags.writeable for a in (data, m, v)):
        cast = data.dtype.type
        segments = np.asarray(decay_segments, dtype=np.int64).reshape(-1, 2)
        adamw_flat(data, grad, m, v, segments, cast(decay_factor), cast(1 - beta1),
                   cast(1 - beta2), cast(beta2), cast(bias_correction2**0.5), cast(eps),
                   cast(step_size))
        return
    for lo, hi in decay_segments:  # the textbook's statements, over the whole buffer
        data[lo:hi] *= decay_factor                       # p <- p (1 - lr lambda)
    data[...] = optim.adam_step(data, grad, m, v, beta1, beta2, eps, step_size,
                                bias_correction2)


# =========================================================================== the norm
@jit
def _sum_of_squares(g: np.ndarray) -> float:
    """sum(g^2) over a flat array (N,), accumulated in float64 as eight running sums."""
    n = g.size
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    i = 0
    while i + 8 <= n:
        a0, a1 = np.float64(g[i]), np.float64(g[i + 1])
        a2, a3 = np.float64(g[i + 2]), np.float64(g[i + 3])
        a4, a5 = np.float64(g[i + 4]), np.float64(g[i + 5])
        a6, a7 = np.float64(g[i + 6]), np.float64(g[i + 7])
        s0 += a0 * a0
        s1 += a1 * a1
        s2 += a2 * a2
        s3 += a3 * a3
        s4 += a4 * a4
        s5 += a5 * a5
        s6 += a6 * a6
        s7 += a7 * a7
        i += 8
    while i < n:
        s0 += np.float64(g[i]) * np.float64(g[i])
        i += 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


def sum_of_squares(flat: Array) -> float:
    """sum(g^2) of a flat array (N,) as a Python float: compiled on a NumPy float array
    with numba (in float64), else one dot product in the array's dtype."""
    if compilable(flat) and flat.ndim == 1:
        return float(_sum_of_squares(flat))
    return backend.to_float(flat @ flat)


# =========================================================================== CuPy
_ADAM = """
T delta = g - m;
delta = delta * one_minus_beta1;
m = m + delta;
T g_sq = g * g;
g_sq = g_sq * one_minus_beta2;
v = v * beta2;
v = v + g_sq;
T denom = sqrt(v);
denom = denom / sqrt_bias_correction2;
denom = denom + eps;
T update = m / denom;
update = update * step_size;
p_new = p - update;
"""


@functools.cache
def _adam_kernel():
    import cupy

    return cupy.ElementwiseKernel(
        "T p, T g, T one_minus_beta1, T one_minus_beta2, T beta2, T sqrt_bias_correction2, "
        "T eps, T step_size", "T p_new, T m, T v", _ADAM, name="npformer_adam",
        options=("--fmad=false",))


def fuses(*arrays: Array) -> bool:
    """Whether these arrays' library compiles fused kernels (CuPy)."""
    return all(type(a).__module__.startswith("cupy") for a in arrays)


def adam_update_cupy(p: Array, g: Array, m: Array, v: Array, beta1: float, beta2: float,
                     eps: float, step_size: float, bias_correction2: float) -> Array:
    """Adam's update of one CuPy parameter: m and v (the moments) in place, and the new
    data returned (a parameter's data is rebound, never written through)."""
    import cupy

    cast = p.dtype.type
    p_new = cupy.empty_like(p)
    _adam_kernel()(p, g, cast(1 - beta1), cast(1 - beta2), cast(beta2),
                   cast(bias_correction2**0.5), cast(eps), cast(step_size), p_new, m, v)
    return p_new
