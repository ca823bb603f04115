r"""CPU kernels of the fast tier, compiled with numba: one pass over memory per op.

Why numba.  It is the NumPy ecosystem's just-in-time compiler: it compiles a Python
loop over NumPy arrays into machine code with LLVM, with no C toolchain at install
time and no build step (a wheel, like NumPy's).  Its kernels release the GIL
(``nogil=True``), so the thread replicas of :class:`npformer.parallel.DataParallel`
run their element-wise work side by side instead of waiting for each other between
NumPy calls; and ``cache=True`` keeps the compiled code on disk (next to this file in
``__pycache__``, or under ``NUMBA_CACHE_DIR`` / the user's cache directory where the
package is installed read-only), so only the first run of a machine pays the
compile.  Cython or a C extension would need a compiler on the user's machine (or
per-platform wheels); Pythran and Taichi are further from NumPy's own arrays.
``fastmath=False``: no reassociation or multiply-add contraction, so each kernel does
the textbook's operations in the textbook's order, and the tests can hold it to the
textbook op within 1e-12 in float64.  One exception: the float32 GELU kernels let LLVM
contract a * b + c into a fused multiply-add (``fastmath={"contract"}``: one rounding
instead of two, no reassociation), which took the forward from 0.40 to 0.27 ms on a
(768, 512) array (torch: 0.18 ms; the figures below); they stay within float32's
tolerance of the textbook op (1e-6) and within 3e-7 of float64 truth, as tested.  Not
``parallel=True``: on the 2-core machines this was measured on, two thread replicas
already keep both cores busy.

The kernels (each an in-place routine over C-contiguous NumPy arrays, float32 or
float64; the ops in :mod:`npformer.fast` call them and keep the array statements for
every other array):

* :func:`gelu_forward` / :func:`gelu_backward`: the exact GELU, $y = x\Phi(x)$, with
  erfc computed branch-free so LLVM vectorizes the loop.  ``math.erfc`` in a numba loop
  is a scalar libm call per element (measured 4.7 ms on a (768, 512) float32 array, as
  slow as SciPy's 4.4 ms), and numba's wheels have no vector math library (SVML), so
  ``math.exp`` would not vectorize either: :func:`_exp` is Cody and Waite's reduction
  $e^a = 2^n e^r$, $|r| \le \ln 2 / 2$, with $e^r$ its Taylor polynomial, and $2^n$
  built from its bits.  float64: W. J. Cody's rational approximations (the textbook
  :func:`npformer.ops.activations.erfc`'s coefficients), all three ranges evaluated and
  one chosen, one division, $e^{-y^2}$ with $y^2$ kept exact by Dekker's product; a few
  ulps, as the textbook's.  float32: float32 arithmetic (twice the vector lanes) and
  Numerical Recipes' erfcc, fractional error below 1.2e-7 (about 2 float32 ulps).
  Only x is kept for the backward, which computes Phi(x) again in its own pass.
  Measured by ``python bench/kernels.py`` on a (768, 512) float32 array (AMD EPYC,
  2026-11-24, idle, one thread each): forward 0.266 ms against torch's 0.183 ms (1.45x),
  SciPy's path 5.4 ms; backward (Phi recomputed) 0.359 ms against torch's 0.349 ms.
* :func:`gelu_tanh_forward` / :func:`gelu_tanh_backward`: GPT-2's tanh GELU, the
  textbook's statements in one pass each, tanh(u) = sign(u) (1 - e) / (1 + e) with
  e = exp(-2|u|) from the same vectorizable exp (an absolute error of a few ulps of 1,
  which is what 1 + t and 1 - t^2 read); the cache (x, t) is the textbook's.
* :func:`layernorm_forward` / :func:`layernorm_backward`: row by row, the mean, the
  variance, then x-hat and y (the row stays in cache: one pass over memory); the
  backward's two row means in one loop, dx in a second, dgamma and dbeta accumulated
  on the way.
* :func:`attention_softmax` / :func:`attention_probabilities` /
  :func:`attention_softmax_backward`: the masked softmax inside blocked attention, on a
  block of scores (A, H, t, s) in place, a row at a time: the bias added, the max, exp,
  the sum and the division, and the row's log-sum-exp (the forward); P = exp(A + bias -
  lse) (the backward's recomputed probabilities); dA = (dP - <dP, P>) P.  Each row stops
  where its masked tail begins (the causal future: about half of a causal block).
* :func:`cross_entropy_rows` / :func:`cross_entropy_grad`: the fused loss (label
  smoothing, ignored rows): per-row losses and log-sum-exps from two reads of each row,
  nothing of size (N, V) written; the gradient w (p - q) in one pass.
* :func:`adamw_flat`: Adam or AdamW over one flat buffer of every parameter
  (:class:`npformer.nn.FlatParameters`), the decay applied segment by segment to the
  decayed parameters only; :func:`sum_of_squares`: the gradient norm's one pass.
* :func:`scatter_add_rows`: the embedding's backward, each position's gradient added
  into its token's row, in order, bit-identical to ``np.add.at`` (NumPy's general
  scatter). ``python bench/kernels.py`` (AMD EPYC, 2026-11-24, idle, one thread): on the
  lm demo's 768 positions of 128, 0.011 ms against ``np.add.at``'s 0.85 ms and torch's
  ``index_add_`` 0.024 ms; on the imdb demo's 8,192 positions of 64, 0.17 ms against
  5.2 ms and 0.22 ms.

Cost (``python bench/kernels.py --compile``, AMD EPYC, 2 cores, 2026-11-24, idle): the
first call of every kernel in both dtypes compiles them, 10.3 s with an empty cache; a
later process loads them from the cache, 4.5 s for all of them (import 0.3 s).  A demo
uses only its dtype's kernels, so it pays about half of either figure once.

Where numba is not installed, or ``NPFORMER_NO_NUMBA=1``, :data:`COMPILED` is False,
the ops run their NumPy statements, and the first op that would have used a kernel
warns once, naming them all (:func:`usable`).
"""
from __future__ import annotations

import math
import os
import warnings

import numpy as np

from ..backend import Array
from ..ops import activations as _textbook_gelu

KERNELS = ("gelu_forward", "gelu_backward", "gelu_tanh_forward", "gelu_tanh_backward",
           "layernorm_forward", "layernorm_backward",
           "attention_softmax", "attention_probabilities", "attention_softmax_backward",
           "cross_entropy_rows", "cross_entropy_grad", "adamw_flat", "sum_of_squares",
           "scatter_add_rows")


def _load_numba():
    """numba, or None with the reason (not installed, or NPFORMER_NO_NUMBA=1)."""
    if os.environ.get("NPFORMER_NO_NUMBA", "").strip() not in ("", "0"):
        return None, "NPFORMER_NO_NUMBA is set"
    try:
        import numba
    except ImportError:
        return None, "numba is not installed (pip install numba)"
    return numba, ""


_numba, WHY_NOT_COMPILED = _load_numba()
COMPILED = _numba is not None
_warned = False


def usable(*arrays: Array) -> bool:
    """Whether the compiled kernels take these arrays: numba present, and every array a
    C-contiguous NumPy float32/float64 array of one dtype.  Warns once per process
    (naming the kernels) when NumPy arrays could have used them but numba is missing."""
    global _warned
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype not in (np.float32, np.float64) \
                or a.dtype != arrays[0].dtype:
            return False
    if not COMPILED:
        if not _warned:
            _warned = True
            warnings.warn(f"npformer's fast tier runs without its compiled kernels "
                          f"({WHY_NOT_COMPILED}): {', '.join(KERNELS)} fall back to NumPy "
                          "statements (same results, slower)", RuntimeWarning, stacklevel=3)
        return False
    return all(a.flags.c_contiguous for a in arrays)


def _jit(fn=None, inline: str = "never", contract: bool = False):
    """numba's njit with the tier's options, or the function itself without numba.
    ``inline="always"``: a scalar helper inlined into its callers by numba, so LLVM sees
    one loop body and vectorizes it.  error_model="numpy": a division by zero gives inf
    as in NumPy (no per-division check, which would stop vectorization).
    ``contract=True``: a * b + c may become one fused multiply-add (one rounding instead
    of two; no reassociation): the float32 GELU kernels' polynomials only."""
    if fn is None:
        return lambda f: _jit(f, inline, contract)
    if not COMPILED:
        return fn
    return _numba.njit(cache=True, fastmath={"contract"} if contract else False,
                       nogil=True, error_model="numpy", inline=inline)(fn)


def _bitcast(int_name: str, float_name: str, ir_float: str):
    """An intrinsic reinterpreting an integer's bits as the float of the same width (2^n
    built from its exponent bits); vectorizes, unlike ``math.ldexp``.  None without numba."""
    if not COMPILED:
        return None
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    float_type, int_type = getattr(types, float_name), getattr(types, int_name)

    @intrinsic
    def bits_to_float(typingctx, bits):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], getattr(ir, ir_float)())
        return float_type(int_type), codegen

    return bits_to_float


_bits_to_float = _bitcast("int64", "float64", "DoubleType")

# =========================================================================== exp, erfc
_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # ln 2 split: n * _LN2_HI is exact for |n| < 2^20
_LN2_LO = 1.90821492927058770002e-10
_EXP_MIN = -1400.0  # exp underflows to 0 far above; keeps n in int64 and 2^(n/2) normal


@_jit(inline="always")
def _exp(a):
    """exp(a) for a <= 710 (float64; -inf and a below -1400 give 0), branch-free."""
    a = max(a, _EXP_MIN)
    n = np.floor(a * _LOG2E + 0.5)
    r = (a - n * _LN2_HI) - n * _LN2_LO  # |r| <= ln2 / 2
    p = 1.0 / 6227020800.0  # Taylor to r^13, Horner
    p = p * r + 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    k = np.int64(n)
    half = k >> 1  # 2^n = 2^half * 2^(n - half): each factor a normal number
    return p * _bits_to_float((half + 1023) << 52) * _bits_to_float((k - half + 1023) << 52)


# Cody's coefficients: the textbook's own (npformer.ops.activations), unpacked into names
# numba reads as compile-time constants
_SP0, _SP1, _SP2, _SP3, _SP4 = _textbook_gelu._SMALL_P
_SQ0, _SQ1, _SQ2, _SQ3 = _textbook_gelu._SMALL_Q
_MP, _MQ = _textbook_gelu._MID_P, _textbook_gelu._MID_Q
_LP, _LQ = _textbook_gelu._LARGE_P, _textbook_gelu._LARGE_Q
_MP0, _MP1, _MP2, _MP3, _MP4, _MP5, _MP6, _MP7, _MP8 = _MP
_MQ0, _MQ1, _MQ2, _MQ3, _MQ4, _MQ5, _MQ6, _MQ7 = _MQ
_LP0, _LP1, _LP2, _LP3, _LP4, _LP5 = _LP
_LQ0, _LQ1, _LQ2, _LQ3, _LQ4 = _LQ
_INV_SQRT_PI = 1.0 / math.sqrt(math.pi)
_SQRT1_2 = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


_SPLIT = 134217729.0  # 2^27 + 1: Veltkamp's split of a double into two 26-bit halves


@_jit(inline="always")
def _exp_minus_square(t):
    """exp(-t^2) for t >= 0, with t^2 = hi + lo exactly (Dekker's product, no fma):
    the rounding error of t^2, which exp would amplify by t^2, is kept in lo and
    applied as exp(-hi) (1 - lo).  One exp where the textbook splits into two."""
    c = _SPLIT * t
    t_hi = c - (c - t)
    t_lo = t - t_hi
    hi = t * t
    lo = ((t_hi * t_hi - hi) + 2.0 * t_hi * t_lo) + t_lo * t_lo
    return _exp(-hi) * (1.0 - lo)


@_jit(inline="always")
def _erfc(x):
    """erfc(x) in float64 by Cody's three ranges, branch-free: each range's numerator
    and denominator computed, one pair chosen, one division (plus 1/t^2), one exp."""
    y = abs(x)
    # |x| <= 0.46875: 1 - erf(x) = (Q - x P) / Q at x^2
    xs = min(max(x, -0.46875), 0.46875)
    z = xs * xs
    num = _SP4 * z
    den = z
    num = (num + _SP0) * z
    den = (den + _SQ0) * z
    num = (num + _SP1) * z
    den = (den + _SQ1) * z
    num = (num + _SP2) * z
    den = (den + _SQ2) * z
    small_den = den + _SQ3
    small_num = small_den - xs * (num + _SP3)
    # y > 0.46875: e = exp(-t^2) at t = y clamped to [0.46875, 28]
    t = min(max(y, 0.46875), 28.0)
    e = _exp_minus_square(t)
    # t <= 4: exp(-t^2) R(t)
    num = _MP8 * t
    den = t
    num = (num + _MP0) * t
    den = (den + _MQ0) * t
    num = (num + _MP1) * t
    den = (den + _MQ1) * t
    num = (num + _MP2) * t
    den = (den + _MQ2) * t
    num = (num + _MP3) * t
    den = (den + _MQ3) * t
    num = (num + _MP4) * t
    den = (den + _MQ4) * t
    num = (num + _MP5) * t
    den = (den + _MQ5) * t
    num = (num + _MP6) * t
    den = (den + _MQ6) * t
    mid_num = e * (num + _MP7)
    mid_den = den + _MQ7
    # t > 4: exp(-t^2) / t (1/sqrt(pi) - z S(z)), z = 1/t^2
    g = max(t, 4.0)
    z = 1.0 / (g * g)
    num = _LP5 * z
    den = z
    num = (num + _LP0) * z
    den = (den + _LQ0) * z
    num = (num + _LP1) * z
    den = (den + _LQ1) * z
    num = (num + _LP2) * z
    den = (den + _LQ2) * z
    num = (num + _LP3) * z
    den = (den + _LQ3) * z
    large_den = den + _LQ4
    large_num = e * (_INV_SQRT_PI * large_den - z * (num + _LP4))
    large_den = g * large_den
    top = mid_num if y <= 4.0 else large_num
    bottom = mid_den if y <= 4.0 else large_den
    top = small_num if y <= 0.46875 else top
    bottom = small_den if y <= 0.46875 else bottom
    ratio = top / bottom
    return 2.0 - ratio if (x < 0.0 and y > 0.46875) else ratio


# --------------------------------------------------------------------------- float32
# A float32 array gets float32 arithmetic: twice the vector lanes of float64, and an
# erfc accurate to float32 (not to float64) at a third of the work: Numerical Recipes'
# erfcc (Press et al., 2nd ed., 6.2), fractional error below 1.2e-7 everywhere.
_F = np.float32
_LOG2E_F, _LN2_HI_F, _LN2_LO_F = _F(1.442695), _F(0.693359375), _F(-2.12194440e-4)
_EXP_MIN_F = _F(-87.3)  # e^-87.3 = 1.2e-38, the smallest normal float32
_EXP32 = tuple(_F(1.0 / math.factorial(k)) for k in range(8))
_E0, _E1, _E2, _E3, _E4, _E5, _E6, _E7 = _EXP32
_NR = tuple(_F(c) for c in (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
                              0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277))
_N0, _N1, _N2, _N3, _N4, _N5, _N6, _N7, _N8, _N9 = _NR
_HALF_F, _ONE_F, _TWO_F, _ZERO_F = _F(0.5), _F(1.0), _F(2.0), _F(0.0)
_SQRT1_2_F, _INV_SQRT_2PI_F = _F(math.sqrt(0.5)), _F(1.0 / math.sqrt(2.0 * math.pi))


_bits_to_float32 = _bitcast("int32", "float32", "FloatType")


@_jit(inline="always")
def _exp32(a):
    """exp(a) in float32 for a <= 88, Cody-Waite with e^r's Taylor polynomial to r^6
    (its remainder below 1.2e-7, 1 float32 ulp); a below -87.3 (where exp leaves the
    normal float32 numbers) gives 0, so 2^n is one normal float built from its bits."""
    a_clamped = max(a, _EXP_MIN_F)
    n = np.floor(a_clamped * _LOG2E_F + _HALF_F)
    r = (a_clamped - n * _LN2_HI_F) - n * _LN2_LO_F
    p = _E6 * r + _E5
    p = p * r + _E4
    p = p * r + _E3
    p = p * r + _E2
    p = p * r + _E1
    p = p * r + _E0
    scaled = p * _bits_to_float32((np.int32(n) + np.int32(127)) << np.int32(23))
    return scaled if a >= _EXP_MIN_F else _ZERO_F


@_jit(inline="always")
def _erfc32(x):
    """erfc(x) in float32 (Numerical Recipes' erfcc), branch-free."""
    z = abs(x)
    t = _ONE_F / (_ONE_F + _HALF_F * z)
    p = _N9 * t + _N8
    p = p * t + _N7
    p = p * t + _N6
    p = p * t + _N5
    p = p * t + _N4
    p = p * t + _N3
    p = p * t + _N2
    p = p * t + _N1
    p = p * t + _N0
    ans = t * _exp32(p - z * z)
    return _TWO_F - ans if x < _ZERO_F else ans


# =========================================================================== GELU
@_jit
def gelu_forward64(x: np.ndarray, y: np.ndarray) -> None:
    """x (N,) -> y = x Phi(x), Phi(x) = erfc(-x / sqrt 2) / 2, written into y (N,);
    computed in float64, rounded once to y's dtype."""
    for i in range(x.size):
        xi = np.float64(x[i])
        y[i] = xi * (0.5 * _erfc(-_SQRT1_2 * xi))
    return None


@_jit(contract=True)
def gelu_forward32(x: np.ndarray, y: np.ndarray) -> None:
    """:func:`gelu_forward64` of float32 arrays, in float32 arithmetic."""
    for i in range(x.size):
        xi = x[i]
        y[i] = xi * (_HALF_F * _erfc32(-_SQRT1_2_F * xi))
    return None


@_jit(contract=True)
def gelu_backward32(dy: np.ndarray, x: np.ndarray, dx: np.ndarray) -> None:
    """:func:`gelu_backward64` of float32 arrays, in float32 arithmetic."""
    for i in range(x.size):
        xi = x[i]
        p = _HALF_F * _erfc32(-_SQRT1_2_F * xi)
        pdf = _INV_SQRT_2PI_F * _exp32(-_HALF_F * xi * xi)
        dx[i] = dy[i] * (p + xi * pdf)
    return None


@_jit
def gelu_backward64(dy: np.ndarray, x: np.ndarray, dx: np.ndarray) -> None:
    """dy, x (N,) -> dx = dy (Phi(x) + x phi(x)), phi(x) = exp(-x^2/2)/sqrt(2 pi), with
    Phi(x) recomputed exactly as the forward computes it (so nothing but x is kept)."""
    for i in range(x.size):
        xi = np.float64(x[i])
        p = 0.5 * _erfc(-_SQRT1_2 * xi)
        pdf = _INV_SQRT_2PI * _exp(-0.5 * xi * xi)
        dx[i] = dy[i] * (p + xi * pdf)
    return None


def gelu_forward(x: np.ndarray) -> np.ndarray:
    """x (...) -> y = x Phi(x) (...): the compiled kernel of x's dtype (x must pass
    :func:`usable`)."""
    y = np.empty_like(x)
    kernel = gelu_forward32 if x.dtype == np.float32 else gelu_forward64
    kernel(x.reshape(-1), y.reshape(-1))
    return y


def gelu_backward(dy: np.ndarray, x: np.ndarray) -> np.ndarray:
    """dy, x (...) -> dx = dy (Phi(x) + x phi(x)) (...), compiled, Phi(x) recomputed."""
    dx = np.empty_like(dy)
    kernel = gelu_backward32 if x.dtype == np.float32 else gelu_backward64
    kernel(dy.reshape(-1), x.reshape(-1), dx.reshape(-1))
    return dx


# =========================================================================== GELU (tanh form)
_GELU_C, _GELU_A = _textbook_gelu.GELU_C, _textbook_gelu.GELU_A
_GELU_C_F, _GELU_A_F, _THREE_F = _F(_GELU_C), _F(_GELU_A), _F(3.0)


@_jit(inline="always")
def _tanh(u):
    """tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|) <= 1: no overflow, and an
    absolute error of a few ulps of 1 (what 1 + t and 1 - t^2 of the tanh GELU read)."""
    e = _exp(-2.0 * abs(u))
    t = (1.0 - e) / (1.0 + e)
    return t if u >= 0.0 else -t


@_jit(inline="always")
def _tanh32(u):
    """:func:`_tanh` in float32 arithmetic."""
    e = _exp32(-_TWO_F * abs(u))
    t = (_ONE_F - e) / (_ONE_F + e)
    return t if u >= _ZERO_F else -t


@_jit
def gelu_tanh_forward64(x: np.ndarray, y: np.ndarray, t: np.ndarray) -> None:
    """x (N,) -> t = tanh(c (x + a x^3)) and y = x (1 + t) / 2, written into t and y (N,):
    the textbook's statements (:func:`npformer.ops.activations.gelu_tanh_forward`) in its
    order, one pass."""
    for i in range(x.size):
        xi = x[i]
        ti = _tanh(_GELU_C * (xi + _GELU_A * xi * xi * xi))
        t[i] = ti
        y[i] = 0.5 * xi * (1.0 + ti)
    return None


@_jit
def gelu_tanh_forward32(x: np.ndarray, y: np.ndarray, t: np.ndarray) -> None:
    """:func:`gelu_tanh_forward64` of float32 arrays, in float32 arithmetic."""
    for i in range(x.size):
        xi = x[i]
        ti = _tanh32(_GELU_C_F * (xi + _GELU_A_F * xi * xi * xi))
        t[i] = ti
        y[i] = _HALF_F * xi * (_ONE_F + ti)
    return None


@_jit
def gelu_tanh_backward64(dy: np.ndarray, x: np.ndarray, t: np.ndarray,
                         dx: np.ndarray) -> None:
    """dy, x, t (N,) -> dx = dy ((1 + t) / 2 + x (1 - t^2) c (1 + 3 a x^2) / 2), one pass."""
    for i in range(x.size):
        xi, ti = x[i], t[i]
        dx[i] = dy[i] * (0.5 * (1.0 + ti) + 0.5 * xi * (1.0 - ti * ti) * _GELU_C
                         * (1.0 + 3.0 * _GELU_A * xi * xi))
    return None


@_jit
def gelu_tanh_backward32(dy: np.ndarray, x: np.ndarray, t: np.ndarray,
                         dx: np.ndarray) -> None:
    """:func:`gelu_tanh_backward64` of float32 arrays, in float32 arithmetic."""
    for i in range(x.size):
        xi, ti = x[i], t[i]
        dx[i] = dy[i] * (_HALF_F * (_ONE_F + ti) + _HALF_F * xi * (_ONE_F - ti * ti)
                         * _GELU_C_F * (_ONE_F + _THREE_F * _GELU_A_F * xi * xi))
    return None


def gelu_tanh_forward(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (...) -> y, t (...) of the tanh GELU, compiled (x must pass :func:`usable`)."""
    y, t = np.empty_like(x), np.empty_like(x)
    kernel = gelu_tanh_forward32 if x.dtype == np.float32 else gelu_tanh_forward64
    kernel(x.reshape(-1), y.reshape(-1), t.reshape(-1))
    return y, t


def gelu_tanh_backward(dy: np.ndarray, x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """dy, x, t (...) -> dx (...) of the tanh GELU, compiled."""
    dx = np.empty_like(dy)
    kernel = gelu_tanh_backward32 if x.dtype == np.float32 else gelu_tanh_backward64
    kernel(dy.reshape(-1), x.reshape(-1), t.reshape(-1), dx.reshape(-1))
    return dx


# =========================================================================== layer norm
def layernorm_forward(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray,
                      eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (..., D), gamma, beta (D,) -> y, x_hat (..., D), r (..., 1), compiled."""
    y, x_hat = np.empty_like(x), np.empty_like(x)
    r = np.empty(x.shape[:-1] + (1,), dtype=x.dtype)
    d = x.shape[-1]
    _layernorm_forward(x.reshape(-1, d), gamma, beta, eps, y.reshape(-1, d),
                       x_hat.reshape(-1, d), r.reshape(-1, 1))
    return y, x_hat, r


def layernorm_backward(dy: np.ndarray, x_hat: np.ndarray, r: np.ndarray,
                       gamma: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dy, x_hat (..., D), r (..., 1), gamma (D,) -> dx (..., D), dgamma, dbeta (D,)."""
    dx = np.empty_like(dy)
    dgamma, dbeta = np.empty_like(gamma), np.empty_like(gamma)
    d = dy.shape[-1]
    _layernorm_backward(dy.reshape(-1, d), x_hat.reshape(-1, d), r.reshape(-1, 1), gamma,
                        dx.reshape(-1, d), dgamma, dbeta)
    return dx, dgamma, dbeta


@_jit(inline="always")
def _row_sums(x, gamma, mu, x_hat, kind):
    """One row's sum in float64, as four running sums (four independent chains of
    additions instead of one: the loop is bound by the adder's latency otherwise).
    kind 0: sum x; 1: sum (x - mu)^2; 2: sum x gamma; 3: sum (x gamma) x_hat."""
    d = x.size
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    j = 0
    while j < d:
        for k in range(4):
            if j + k < d:
                if kind == 0:
                    term = np.float64(x[j + k])
                elif kind == 1:
                    c = x[j + k] - mu
                    term = np.float64(c * c)
                elif kind == 2:
                    term = np.float64(x[j + k] * gamma[j + k])
                else:
                    term = np.float64((x[j + k] * gamma[j + k]) * x_hat[j + k])
                if k == 0:
                    s0 += term
                elif k == 1:
                    s1 += term
                elif k == 2:
                    s2 += term
                else:
                    s3 += term
        j += 4
    return (s0 + s1) + (s2 + s3)


@_jit
def _layernorm_forward(x, gamma, beta, eps, y, x_hat, r):
    """x (N, D), gamma, beta (D,) -> y, x_hat (N, D), r (N, 1), written in place.
    Row sums in float64; mu, the variance and r rounded as the textbook rounds them."""
    n, d = x.shape
    for i in range(n):
        row = x[i]
        mu = x.dtype.type(_row_sums(row, gamma, x.dtype.type(0.0), row, 0) / d)
        var = x.dtype.type(_row_sums(row, gamma, mu, row, 1) / d)
        ri = x.dtype.type(1.0) / np.sqrt(var + x.dtype.type(eps))
        r[i, 0] = ri
        for j in range(d):
            h = (x[i, j] - mu) * ri
            x_hat[i, j] = h
            y[i, j] = h * gamma[j] + beta[j]
    return None


@_jit
def _layernorm_backward(dy, x_hat, r, gamma, dx, dgamma, dbeta):
    """dy, x_hat (N, D), r (N, 1), gamma (D,) -> dx (N, D), dgamma, dbeta (D,), in place:
    dx = r (g - mean(g) - x_hat mean(g x_hat)), g = dy gamma."""
    n, d = dy.shape
    dgamma_acc = np.zeros(d)
    dbeta_acc = np.zeros(d)
    for i in range(n):
        for j in range(d):  # independent across j: vectorizes
            dgamma_acc[j] += dy[i, j] * x_hat[i, j]
            dbeta_acc[j] += dy[i, j]
        mean_g = dy.dtype.type(_row_sums(dy[i], gamma, dy.dtype.type(0.0), x_hat[i], 2) / d)
        mean_gx = dy.dtype.type(_row_sums(dy[i], gamma, dy.dtype.type(0.0), x_hat[i], 3) / d)
        ri = r[i, 0]
        for j in range(d):
            g = dy[i, j] * gamma[j]
            dx[i, j] = ri * (g - mean_g - x_hat[i, j] * mean_gx)
    for j in range(d):
        dgamma[j] = dgamma_acc[j]
        dbeta[j] = dbeta_acc[j]
    return None


# =========================================================================== attention
# The masked softmax inside blocked attention (npformer.fast.attention), on a block of
# scores (A, H, t, s) written in place, one row of s keys at a time (the row stays in
# cache): the textbook's statements, each rounded to the scores' dtype as there, the row
# sums accumulated in float64.  The scores arrive as Q K^T, unscaled: the kernels apply
# the scale alpha on their way through a row (no scaled copy of Q is made).  The mask's
# bias arrives broadcast to the scores' shape (a strided view, no copy); ``has_bias``
# False: no bias (the view is not read).
#
# ``keys`` (A, t), a broadcast view of host integers: row (a, ., t) is computed over its
# first keys[a, t] keys only, and the rest are written 0 (their probability and gradient).
# The caller makes every key from there on masked for every head (the causal future,
# padding) and keys[a, t] a multiple of 8 or s: each running max and sum then takes the
# same elements in the same order as over the whole row (the cut-off elements would add
# exact zeros), so the results are the same bits, with the masked half of a causal row
# never exponentiated.
def _attention_kernels(exp, dtype):
    """(softmax_lse, probabilities, softmax_backward) kernels of one dtype's ``exp``."""
    zero, neg_inf = dtype(0.0), dtype(-np.inf)

    @_jit
    def softmax_lse(scores, bias, has_bias, scale, lse, keys):
        """scores (A, H, t, s) -> P = softmax(scale scores + bias) in place; lse (A, H, t)
        = max + log(sum exp(. - max)); a row with every key masked: P = 0, lse = 0."""
        na, nh, nt, _ = scores.shape
        for a in range(na):
            for h in range(nh):
                for t in range(nt):
                    n = keys[a, t]
                    row = scores[a, h, t, :n]
                    scores[a, h, t, n:] = zero  # masked: probability 0
                    _scale_add_into(row, scale, bias[a, h, t, :n], has_bias)
                    m = _max8(row, neg_inf)
                    if m == neg_inf:  # every key masked: e = 0, total = 1 (textbook)
                        for j in range(n):
                            row[j] = zero
                        lse[a, h, t] = zero
                        continue
                    for j in range(n):  # element-wise: vectorizes
                        row[j] = exp(row[j] - m)
                    total = dtype(_sum4(row, row, 0))
                    for j in range(n):
                        row[j] = row[j] / total
                    lse[a, h, t] = m + np.log(total)
        return None

    @_jit
    def probabilities(scores, bias, has_bias, scale, lse, keys):
        """scores (A, H, t, s) -> P = exp((scale scores + bias) - lse) in place, lse
        (A, H, t) from the forward: the backward's recomputed probabilities."""
        na, nh, nt, _ = scores.shape
        for a in range(na):
            for h in range(nh):
                for t in range(nt):
                    n = keys[a, t]
                    row = scores[a, h, t, :n]
                    scores[a, h, t, n:] = zero
                    shift = lse[a, h, t]
                    _scale_add_into(row, scale, bias[a, h, t, :n], has_bias)
                    for j in range(n):  # contiguous, element-wise: vectorizes
                        row[j] = exp(row[j] - shift)
        return None

    @_jit
    def softmax_backward(dp, p, scale, keys):
        """dp, p (A, H, t, s) -> scale dA, dA = (dp - <dp, p>) p, in dp's buffer, row by
        row: the gradient of the unscaled scores Q K^T (0 where p was cut off to 0)."""
        na, nh, nt, _ = dp.shape
        for a in range(na):
            for h in range(nh):
                for t in range(nt):
                    n = keys[a, t]
                    row, prow = dp[a, h, t, :n], p[a, h, t, :n]
                    dp[a, h, t, n:] = zero
                    inner = dtype(_sum4(row, prow, 1))
                    for j in range(n):
                        row[j] = ((row[j] - inner) * prow[j]) * scale
        return None

    return softmax_lse, probabilities, softmax_backward


@_jit(inline="always")
def _scale_add_into(row, scale, bias, has_bias):
    """row = scale row (+ bias where has_bias), element by element (the bias row may be
    a strided view)."""
    if has_bias:
        for j in range(row.size):
            row[j] = row[j] * scale + bias[j]
    else:
        for j in range(row.size):
            row[j] = row[j] * scale


@_jit(inline="always")
def _max8(x, start):
    """max(start, max x) over a row, as eight running maxima (independent chains)."""
    n = x.size
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = start
    j = 0
    while j + 8 <= n:
        m0 = max(m0, x[j])
        m1 = max(m1, x[j + 1])
        m2 = max(m2, x[j + 2])
        m3 = max(m3, x[j + 3])
        m4 = max(m4, x[j + 4])
        m5 = max(m5, x[j + 5])
        m6 = max(m6, x[j + 6])
        m7 = max(m7, x[j + 7])
        j += 8
    while j < n:
        m0 = max(m0, x[j])
        j += 1
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


@_jit(inline="always")
def _sum4(x, y, kind):
    """sum x (kind 0) or sum x y (kind 1) over a row, in float64 as four running sums."""
    n = x.size
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    j = 0
    while j + 4 <= n:
        if kind == 0:
            s0 += np.float64(x[j])
            s1 += np.float64(x[j + 1])
            s2 += np.float64(x[j + 2])
            s3 += np.float64(x[j + 3])
        else:
            s0 += np.float64(x[j] * y[j])
            s1 += np.float64(x[j + 1] * y[j + 1])
            s2 += np.float64(x[j + 2] * y[j + 2])
            s3 += np.float64(x[j + 3] * y[j + 3])
        j += 4
    while j < n:
        s0 += np.float64(x[j]) if kind == 0 else np.float64(x[j] * y[j])
        j += 1
    return (s0 + s1) + (s2 + s3)


if COMPILED:
    attention_softmax64, attention_probabilities64, attention_softmax_backward64 = \
        _attention_kernels(_exp, np.float64)
    attention_softmax32, attention_probabilities32, attention_softmax_backward32 = \
        _attention_kernels(_exp32, np.float32)


def _broadcast_bias(bias: np.ndarray | None, scores: np.ndarray) -> tuple[np.ndarray, bool]:
    """(the bias as a view of the scores' shape, whether there is one)."""
    if bias is None:
        return np.broadcast_to(np.zeros((1,) * scores.ndim, dtype=scores.dtype),
                               scores.shape), False
    return np.broadcast_to(bias, scores.shape), True


def _all_keys(keys: np.ndarray | None, scores: np.ndarray) -> np.ndarray:
    """The kernels' per-row key counts as an (A, t) view: ``keys`` broadcast, or every
    key s of the block where None."""
    counts = np.full((1, 1), scores.shape[-1], dtype=np.int64) if keys is None else keys
    return np.broadcast_to(counts, (scores.shape[0], scores.shape[2]))


def attention_softmax(scores: np.ndarray, bias: np.ndarray | None, scale: float,
                      lse: np.ndarray, keys: np.ndarray | None = None) -> None:
    """scores Q K^T (A, H, t, s), C-contiguous -> P = softmax(scale scores + bias) in
    place (fully masked rows 0), lse (A, H, t, 1) written: one compiled pass a row.
    ``keys``: int64, broadcasting to (A, t), how many leading keys each row computes
    (see the kernels' comment: every later key masked, a multiple of 8 or s); None: all."""
    view, has_bias = _broadcast_bias(bias, scores)
    kernel = attention_softmax32 if scores.dtype == np.float32 else attention_softmax64
    kernel(scores, view, has_bias, scores.dtype.type(scale), lse[..., 0],
           _all_keys(keys, scores))


def attention_probabilities(scores: np.ndarray, bias: np.ndarray | None, scale: float,
                            lse: np.ndarray, keys: np.ndarray | None = None) -> None:
    """scores Q K^T (A, H, t, s) -> P = exp(scale scores + bias - lse) in place, lse
    (A, H, t, 1); ``keys`` as for :func:`attention_softmax`."""
    view, has_bias = _broadcast_bias(bias, scores)
    kernel = (attention_probabilities32 if scores.dtype == np.float32
              else attention_probabilities64)
    kernel(scores, view, has_bias, scores.dtype.type(scale), lse[..., 0],
           _all_keys(keys, scores))


def attention_softmax_backward(dp: np.ndarray, p: np.ndarray, scale: float,
                               keys: np.ndarray | None = None) -> None:
    """dp, p (A, H, t, s) -> scale dA, dA = (dp - <dp, p>) p, written into dp; ``keys``
    as for :func:`attention_softmax` (0 from there on)."""
    kernel = (attention_softmax_backward32 if dp.dtype == np.float32
              else attention_softmax_backward64)
    kernel(dp, p, dp.dtype.type(scale), _all_keys(keys, dp))


# =========================================================================== the loss
# Cross-entropy with label smoothing and ignored rows (npformer.fast.losses), one row of
# V logits at a time: the forward reads each row twice (its max; then exp into a row of
# scratch and the sums) and writes nothing of size (N, V); the backward writes dz in one
# pass, recomputing p = exp(z - lse).  Row sums in float64, results rounded to the
# logits' dtype as the textbook rounds them.
def _loss_kernels(exp, dtype):
    """(cross_entropy_rows, cross_entropy_grad) kernels of one dtype's ``exp``."""
    neg_inf = dtype(-np.inf)

    @_jit
    def cross_entropy_rows(z, targets, smoothing, per_row, lse):
        """z (N, V), targets (N,) in [0, V) -> per_row (N,) = (1 - eps)(log Z - s_y)
        + eps (log Z - mean s), s = z - max z, Z = sum exp(s); lse (N,) = max z + log Z."""
        n, v = z.shape
        e = np.empty(v, dtype=z.dtype)  # one row of exp(s), reused
        for i in range(n):
            row = z[i]
            m = _max8(row, neg_inf)
            for j in range(v):  # element-wise: vectorizes
                e[j] = exp(row[j] - m)
            log_total = np.log(dtype(_sum4(e, e, 0)))
            picked = row[targets[i]] - m
            loss = dtype(1.0 - smoothing) * (log_total - picked)
            if smoothing > 0.0:
                mean_shifted = dtype(_sum4(row, row, 0) / v) - m  # mean(z) - m = mean(s)
                loss = loss + dtype(smoothing) * (log_total - mean_shifted)
            per_row[i] = loss
            lse[i] = m + log_total
        return None

    @_jit
    def cross_entropy_grad(z, lse, targets, weight, smoothing, in_place, dz):
        """z (N, V), lse, targets, weight (N,) -> dz (N, V) = w (p - q), p = exp(z - lse),
        q = (1 - eps) onehot(y) + eps / V; rows of weight 0 (ignored) give 0.
        ``in_place``: dz is z itself (each row's target logit is read before the row is
        written)."""
        n, v = z.shape
        spread = dtype(smoothing / v)
        on_target = dtype(1.0 - smoothing)
        for i in range(n):
            row, out, shift, w = z[i], dz[i], lse[i], weight[i]
            t = targets[i]
            p_target = exp(row[t] - shift)
            if in_place:  # one name for the one array: the loop vectorizes (under two
                for j in range(v):  # names the compiler's overlap check finds them equal
                    row[j] = (exp(row[j] - shift) - spread) * w  # and runs scalar code)
            else:
                for j in range(v):  # element-wise: vectorizes
                    out[j] = (exp(row[j] - shift) - spread) * w
            out[t] = ((p_target - spread) - on_target) * w
        return None

    return cross_entropy_rows, cross_entropy_grad


if COMPILED:
    cross_entropy_rows64, cross_entropy_grad64 = _loss_kernels(_exp, np.float64)
    cross_entropy_rows32, cross_entropy_grad32 = _loss_kernels(_exp32, np.float32)


def cross_entropy_rows(z: np.ndarray, targets: np.ndarray,
                       smoothing: float) -> tuple[np.ndarray, np.ndarray]:
    """z (N, V) C-contiguous, targets (N,) int64 in [0, V) -> per-row losses (N,) and each
    row's log-sum-exp (N,), compiled; nothing of size (N, V) is written."""
    per_row = np.empty(z.shape[0], dtype=z.dtype)
    lse = np.empty(z.shape[0], dtype=z.dtype)
    kernel = cross_entropy_rows32 if z.dtype == np.float32 else cross_entropy_rows64
    kernel(z, targets, smoothing, per_row, lse)
    return per_row, lse


def cross_entropy_grad(z: np.ndarray, lse: np.ndarray, targets: np.ndarray,
                       weight: np.ndarray, smoothing: float,
                       out: np.ndarray | None = None) -> np.ndarray:
    """z (N, V), lse, targets, weight (N,) -> dz = weight (softmax(z) - q) (N, V), compiled;
    written into ``out`` when given (z itself: the logits' buffer reused)."""
    in_place = out is z
    dz = np.empty_like(z) if out is None else out
    kernel = cross_entropy_grad32 if z.dtype == np.float32 else cross_entropy_grad64
    kernel(z, lse, targets, weight, smoothing, in_place, dz)
    return dz


# =========================================================================== optimizer
@_jit
def adamw_flat(data: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray,
               segments: np.ndarray, decay_factor: float, one_minus_beta1: float,
               one_minus_beta2: float, beta2: float, sqrt_bias_correction2: float, eps: float,
               step_size: float) -> None:
    """One Adam(W) update of every parameter in the flat buffers data, grad, m, v (P,).

    ``segments`` (K, 2): the [lo, hi) ranges of the decayed parameters, whose data first
    shrinks by ``decay_factor`` = 1 - lr lambda (AdamW); then, everywhere, the statements
    of :meth:`npformer.optim.Adam._update` in their order, each rounded to the buffers'
    dtype (the coefficients come already rounded to it)."""
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


@_jit
def sum_of_squares(g: np.ndarray) -> float:
    """sum(g^2) over a flat array (N,), accumulated in float64 as eight running sums
    (independent chains, which LLVM packs into one vector register: 0.22 ms against one
    chain's 0.66 ms over 806k float32 values, a one-off timing, AMD EPYC, 2026-11-24)."""
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


# =========================================================================== embedding
@_jit
def scatter_add_rows(index: np.ndarray, values: np.ndarray, out: np.ndarray) -> None:
    """out[index[n], :] += values[n, :] for n = 0, 1, ... in order (repeated indices
    accumulate, in the order ``np.add.at`` adds them): index (N,), values (N, D), out
    (V, D)."""
    for n in range(index.size):
        row, value = out[index[n]], values[n]
        for j in range(value.size):  # contiguous, element-wise: vectorizes
            row[j] += value[j]
    return None
