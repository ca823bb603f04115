r"""The numerics every compiled kernel shares: exp and erfc that vectorize, and a row's max
and sum, scalar functions numba inlines into the kernels (``inline="always"``): in a numba
loop ``math.exp`` and ``math.erfc`` are a libm call per element, which does not vectorize
(numba's wheels have no SVML).  The method is docs/derivations.md §19's; each accuracy
stated below is measured element by element against a higher precision, and
``tests/test_numerics.py`` holds it.

:func:`exp64`, :func:`exp32` (:func:`exp32_of_sum`): $e^a = 2^n e^r$, $|r| \le \ln 2 / 2$,
$e^r$ its Taylor polynomial (to $r^{13}$, $r^6$), $2^n$ from its exponent bits.  float64
within 1 ulp of mpmath's exp, float32 within 3 ulps of float64's; :func:`exp` picks by
precision.  :func:`erfc64`: Cody's ranges (the textbook's coefficients), within 5 ulps
(plus 8 subnormal steps).  :func:`erfc32`: $t\,Q(2t - 1)\,e^{-z^2}$, $t = 1/(1 + z/2)$,
$z^2$ exact (:func:`square32`), within 7 float32 ulps where erfc is normal (z < 9.19);
:func:`normal_cdf32`, $\Phi(x) = \text{erfc}(-x/\sqrt 2)/2$, within 8 where $\Phi$ is
normal (x > -12.95).  :func:`max8` and :func:`sum4`: eight running maxima, four running
sums in float64.  :func:`all_finite`: whether an op may leave the textbook's statements.
"""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..backend import Array
from ..ops import activations as _textbook_gelu
from .compiler import COMPILED, jit


def _intrinsics(float_name: str, int_name: str) -> tuple:
    """(bits_to_float, float_to_bits, fma) of one width: an integer's bits read as the
    float of the same width and back (2^n built from its exponent bits, which vectorizes,
    unlike ``math.ldexp``), and a * b + c with one rounding (LLVM's fma: one instruction
    on x86-64 since Haswell and on ARM64; a libm call elsewhere).  Nones without numba."""
    if not COMPILED:
        return None, None, None
    from numba.core import types
    from numba.extending import intrinsic

    float_type, int_type = getattr(types, float_name), getattr(types, int_name)

    @intrinsic
    def bits_to_float(typingctx, bits):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(float_type))
        return float_type(int_type), codegen

    @intrinsic
    def float_to_bits(typingctx, value):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(int_type))
        return int_type(float_type), codegen

    @intrinsic
    def fma(typingctx, a, b, c):
        def codegen(context, builder, signature, args):
            return builder.fma(*args)
        return float_type(float_type, float_type, float_type), codegen

    return bits_to_float, float_to_bits, fma


_bits_to_float64, _float64_to_bits, _fma64 = _intrinsics("float64", "int64")
_bits_to_float32, _float32_to_bits, fma32 = _intrinsics("float32", "int32")


# =========================================================================== exp, float64
# exp(a) = 2^n e^r: n the integer nearest a log2(e), found by adding 1.5 2^52 (the sum's
# low bits are then n: no float-to-integer conversion, which a NaN would make undefined),
# r = a - n ln 2 (ln 2 split in two, so that n ln 2 is exact), |r| <= ln 2 / 2.  a is
# clamped first by max and min, which keep their first argument where the comparison
# fails: a NaN stays NaN through every step.
_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # ln 2 split: n * _LN2_HI is exact for |n| < 2^20
_LN2_LO = 1.90821492927058770002e-10
_SHIFT = 6755399441055744.0  # 1.5 * 2^52: x + _SHIFT rounds x to an integer, in its low bits
_SHIFT_BITS = 0x4338000000000000  # the bits of _SHIFT
_EXP_MIN = -1400.0  # exp underflows to 0 far above; keeps n in int64 and 2^(n/2) normal
_EXP_MAX = 710.0  # exp overflows from 709.78: 2^n with n = 1024 is inf, the right answer


@jit(inline="always")
def exp64(a: float) -> float:
    """exp(a) in float64, branch-free: NaN stays NaN, -inf gives 0, +inf gives inf."""
    c = min(max(a, _EXP_MIN), _EXP_MAX)
    shifted = c * _LOG2E + _SHIFT
    n = shifted - _SHIFT
    r = (c - n * _LN2_HI) - n * _LN2_LO
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
    k = _float64_to_bits(shifted) - _SHIFT_BITS  # n
    half = k >> 1  # 2^n = 2^half * 2^(n - half): each factor a normal number
    return p * _bits_to_float64((half + 1023) << 52) * _bits_to_float64((k - half + 1023) << 52)


# =========================================================================== exp, float32
_F = np.float32
_LOG2E_F, _LN2_HI_F, _LN2_LO_F = _F(1.442695), _F(0.693359375), _F(-2.12194440e-4)
_SHIFT_F, _SHIFT_BITS_F = _F(12582912.0), np.int32(0x4B400000)  # 1.5 * 2^23 and its bits
_EXP_MIN_F = _F(-87.3)  # e^-87.3 = 1.2e-38, the smallest normal float32
_E0, _E1, _E2, _E3, _E4, _E5, _E6 = (_F(1.0 / math.factorial(k)) for k in range(7))
_HALF_F, _ONE_F, _TWO_F = _F(0.5), _F(1.0), _F(2.0)
_ZERO_F, _MINUS_ZERO_F = _F(0.0), _F(-0.0)


@jit(inline="always")
def exp32_of_sum(big: float, small: float) -> float:
    """exp(big + small) in float32, branch-free, the sum never rounded: big enters the
    reduction r = big - n ln 2 (+ small) exactly (|small| well below 1, e.g. the
    rounding error of a large big).  NaN stays NaN, -inf and sums below -87.3 (where
    exp leaves the normal float32 numbers) give 0.  For sums up to 89 only: from 88.376
    the result is inf (exp overflows float32 from 88.72: the few values between are lost
    to its one scale factor 2^n), and above 89 (+inf included) it is not defined; every
    kernel takes exp of at most 0 (x - max x, -x^2) or NaN.  (Clamping from above too
    slowed the loss's kernel down: bench/README.md, "The compiled kernels".)"""
    a = min(big, big + small)  # rounded: only to choose n, and the range (the min: big
    c = max(a, _EXP_MIN_F)  # = -inf with a NaN or +inf small gives 0)
    shifted = c * _LOG2E_F + _SHIFT_F
    n = shifted - _SHIFT_F
    r = ((big - n * _LN2_HI_F) + small) - n * _LN2_LO_F
    p = _E6 * r + _E5  # Taylor to r^6
    p = p * r + _E4
    p = p * r + _E3
    p = p * r + _E2
    p = p * r + _E1
    p = p * r + _E0
    k = _float32_to_bits(shifted) - _SHIFT_BITS_F  # n
    e = p * _bits_to_float32((k + np.int32(127)) << np.int32(23))
    return _ZERO_F if a < _EXP_MIN_F else e


@jit(inline="always")
def exp32(a: float) -> float:
    """exp(a) in float32: :func:`exp32_of_sum` of a and -0.0 (which adds nothing, and
    LLVM drops)."""
    return exp32_of_sum(a, _MINUS_ZERO_F)


def exp(a: float) -> float:
    """exp(a) in a's precision: :func:`exp32` for float32, :func:`exp64` otherwise (numba
    chooses at compile time, so a kernel written once runs in either dtype)."""
    return math.exp(a)


if COMPILED:
    from numba import types
    from numba.extending import overload

    @overload(exp)  # LLVM inlines the call (numba's own inlining of an overload that
    def _exp_of_its_precision(a):  # inlines exp32 in turn miscompiled the kernels)
        return (lambda a: exp32(a)) if a == types.float32 else (lambda a: exp64(a))


# =========================================================================== erfc, float64
# Cody's coefficients: the textbook's own (npformer.ops.activations), unpacked into names
# numba reads as compile-time constants
_SP0, _SP1, _SP2, _SP3, _SP4 = _textbook_gelu._SMALL_P
_SQ0, _SQ1, _SQ2, _SQ3 = _textbook_gelu._SMALL_Q
_MP0, _MP1, _MP2, _MP3, _MP4, _MP5, _MP6, _MP7, _MP8 = _textbook_gelu._MID_P
_MQ0, _MQ1, _MQ2, _MQ3, _MQ4, _MQ5, _MQ6, _MQ7 = _textbook_gelu._MID_Q
_LP0, _LP1, _LP2, _LP3, _LP4, _LP5 = _textbook_gelu._LARGE_P
_LQ0, _LQ1, _LQ2, _LQ3, _LQ4 = _textbook_gelu._LARGE_Q
_INV_SQRT_PI = 1.0 / math.sqrt(math.pi)
_SPLIT = 134217729.0  # 2^27 + 1: Veltkamp's split of a double into two 26-bit halves


@jit(inline="always")
def _exp_minus_square(t: float) -> float:
    """exp(-t^2) for t >= 0, with t^2 = hi + lo exactly (Dekker's product, no fma):
    the rounding error of t^2, which exp would amplify by t^2, is kept in lo and
    applied as exp(-hi) (1 - lo).  One exp where the textbook splits into two."""
    c = _SPLIT * t
    t_hi = c - (c - t)
    t_lo = t - t_hi
    hi = t * t
    lo = ((t_hi * t_hi - hi) + 2.0 * t_hi * t_lo) + t_lo * t_lo
    return exp64(-hi) * (1.0 - lo)


@jit(inline="always")
def erfc64(x: float) -> float:
    """erfc(x) in float64 by Cody's three ranges, branch-free: each range's numerator
    and denominator computed, one pair chosen, one division (plus 1/t^2), one exp.
    NaN stays NaN, erfc(-inf) = 2, erfc(inf) = 0."""
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
    ratio = 2.0 - ratio if (x < 0.0 and y > 0.46875) else ratio
    return ratio if x == x else x


# =========================================================================== erfc, float32
# Numerical Recipes' erfcc (Press et al., 2nd ed., 6.2): erfc(z) = t exp(-z^2 + P(t)),
# t = 1 / (1 + z/2), P of degree 9 (its coefficients _NR_P, constant term first); within
# 1.2e-7 of erfc (relative) in exact arithmetic.  Here exp(P(t)) is re-expanded as a
# polynomial Q of degree 12 in u = 2t - 1: the least-squares fit of its relative error at
# 6,000 Chebyshev points of t in [0, 1] (numpy.linalg.lstsq on the Vandermonde matrix in
# u), within 1.1e-9 of exp(P(t)), 4.4e-8 with its coefficients rounded to float32
# (tests/test_numerics.py holds that), which are below 0.52: float32's Horner sum is well
# conditioned.  So erfc(z) = t Q(u) exp(-z^2), whose exponent is -z^2 alone, computed
# exactly (:func:`square32`, :func:`exp32_of_sum`), and is the normal density's: GELU's
# backward needs one exp for Phi and phi.
_NR_P = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
         -1.13520398, 1.48851587, -0.82215223, 0.17087277)
_Q12, _Q11, _Q10, _Q9, _Q8, _Q7, _Q6, _Q5, _Q4, _Q3, _Q2, _Q1, _Q0 = (_F(c) for c in (
    1.2587109267769847e-05, 4.493897722568363e-05, 7.4350305112602655e-06,
    -0.00016018692986108363, -0.000264534231973812, 0.0005542528233490884,
    0.0015138562303036451, -0.0032975182402879, -0.01074889488518238,
    0.018231315538287163, 0.13973559439182281,
    0.34357982873916626, 0.5107913613319397))
_SQRT1_2_F = _F(math.sqrt(0.5))


@jit(inline="always")
def square32(a: float) -> tuple[float, float]:
    """a^2 as (hi, lo), hi + lo exactly: hi rounded, lo its rounding error (one fma).
    (Where a^2 overflows, hi is inf and lo -inf or NaN: exp32_of_sum(-hi, -lo) is 0.)"""
    hi = a * a
    return hi, fma32(a, a, -hi)


@jit(inline="always")
def erfc32_scaled(z: float) -> float:
    """erfc(z) exp(z^2) = t Q(2t - 1), t = 1 / (1 + z/2), for z >= 0 (0 at z = inf)."""
    t = _ONE_F / (_ONE_F + _HALF_F * z)
    u = _TWO_F * t - _ONE_F
    q = _Q12 * u + _Q11
    q = q * u + _Q10
    q = q * u + _Q9
    q = q * u + _Q8
    q = q * u + _Q7
    q = q * u + _Q6
    q = q * u + _Q5
    q = q * u + _Q4
    q = q * u + _Q3
    q = q * u + _Q2
    q = q * u + _Q1
    q = q * u + _Q0
    return t * q


@jit(inline="always")
def erfc32(x: float) -> float:
    """erfc(x) in float32 (see the module's docstring for its accuracy).  NaN stays NaN,
    erfc(-inf) = 2, erfc(inf) = 0."""
    hi, lo = square32(x)
    tail = erfc32_scaled(abs(x)) * exp32_of_sum(-hi, -lo)  # erfc(|x|), x^2 never rounded
    return _TWO_F - tail if x < _ZERO_F else tail


@jit(inline="always")
def normal_exp32(x: float) -> float:
    """exp(-x^2 / 2) in float32, x^2 never rounded: the normal density's exponential, and
    erfc's at z = -x / sqrt 2."""
    hi, lo = square32(x)
    return exp32_of_sum(-_HALF_F * hi, -_HALF_F * lo)


@jit(inline="always")
def normal_cdf32_given(x: float, normal_exp: float) -> float:
    """Phi(x) = erfc(-x / sqrt 2) / 2 in float32, given ``normal_exp`` = exp(-x^2 / 2)
    (:func:`normal_exp32`): the exponent taken from x itself (-x / sqrt 2 rounded to
    float32 would cost 2 z^2 times its rounding, 1e-5 at x = -12.8)."""
    z = -_SQRT1_2_F * x
    tail = erfc32_scaled(abs(z)) * normal_exp  # erfc(|z|)
    return _HALF_F * (_TWO_F - tail if z < _ZERO_F else tail)


@jit(inline="always")
def normal_cdf32(x: float) -> float:
    """Phi(x) = erfc(-x / sqrt 2) / 2 in float32."""
    return normal_cdf32_given(x, normal_exp32(x))


# =========================================================================== a row's max, sum
@jit(inline="always")
def max8(x: np.ndarray, start: float) -> float:
    """max(start, max x) over a row, as eight running maxima (independent chains).  A NaN
    is passed over (numba's max keeps its first argument where the comparison fails;
    NumPy's maximum, which keeps the NaN, slowed the softmax kernels down:
    bench/README.md): the kernels' NaN comes through exp(NaN - max) = NaN in the row's
    sum instead."""
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


@jit(inline="always")
def sum4(x: np.ndarray, y: np.ndarray, kind: int) -> float:
    """sum x (kind 0) or sum x y (kind 1) over a row, in float64 as four running sums."""
    n = x.size
    s0 = s1 = s2 = s3 = 0.0
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


# =========================================================================== finite inputs
def all_finite(*arrays: Array) -> bool:
    """Whether no array holds a NaN or an infinity (one reduction an array).  An op whose
    compiled or blocked path would not give the textbook's NaN and inf on such input
    (they skip masked keys, or combine terms in another order) runs the textbook's
    statements instead: they are the definition."""
    for a in arrays:
        if type(a) is np.ndarray:  # NumPy's own call: no namespace look-up, no transfer
            finite = bool(np.isfinite(a).all())
        else:
            xp = backend.namespace_of(a)
            finite = bool(backend.to_numpy(xp.all(xp.isfinite(a))))
        if not finite:
            return False
    return True
