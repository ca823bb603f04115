"""Element-wise chains fused into one compiled kernel, where the array library compiles
kernels (CuPy); elsewhere the callers run their plain expressions.

On a GPU each array expression is one kernel launch, a few microseconds of host time
however small the array: Adam's update, thirteen expressions per parameter, costs more
in launches than in arithmetic for a small model.  Fused, it is one launch per parameter.
The kernel does the textbook's operations in the textbook's order, each rounded to the
parameter's dtype (``--fmad=false``: no multiply-add contraction), so its results are
the plain expressions' bit for bit (``tests/test_cupy.py``).
"""
from __future__ import annotations

import functools

from ..backend import Array

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


def adam_update(p: Array, g: Array, m: Array, v: Array, beta1: float, beta2: float, eps: float,
                step_size: float, bias_correction2: float) -> Array:
    """Adam's update of one parameter: m and v (the moments) in place, and the new data
    returned (a parameter's data is rebound, never written through).

    The same statements as :meth:`npformer.optim.Adam._update`; the coefficients are
    rounded to p's dtype first, as NumPy rounds a Python float that meets a float32 array.
    """
    import cupy

    cast = p.dtype.type
    p_new = cupy.empty_like(p)
    _adam_kernel()(p, g, cast(1 - beta1), cast(1 - beta2), cast(beta2),
                   cast(bias_correction2**0.5), cast(eps), cast(step_size), p_new, m, v)
    return p_new
