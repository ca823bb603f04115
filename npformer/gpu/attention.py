r"""Attention as a step captured into a CUDA graph computes it (the GPU tier's).

The textbook op's dense statements (:mod:`npformer.ops.attention`) with every product
through cuBLAS (:func:`.gemm.matmul`, which a capture can record) and nothing read back
to the host; on CuPy the scale, the mask and the softmax are one kernel each way
(:func:`fused_softmax`, :func:`fused_softmax_backward`).  The fast tier's attention
(:mod:`npformer.fast.attention`) hands a step over to it while a CUDA graph captures
(:func:`.gemm.capturing`).  Tested equal to the textbook op (``tests/test_graph.py``; the
kernels on a GPU).
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np

from .. import backend
from ..backend import Array
from ..ops import softmax as _softmax
from ..ops.masks import align_mask
from .gemm import matmul


def capture_forward(q: Array, k: Array, v: Array, mask: Array | None) -> tuple[Array, Any]:
    """The module's forward, (out, saved) (not the fast tier's blocked walk, which reads the
    mask's extents on the host and its NaN test's flag)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    mask = align_mask(mask, q.ndim)
    if fuses_softmax(q, mask):
        p = fused_softmax(matmul(q, k.mT), scale, mask)  # P (..., T, S), over the scores
        return matmul(p, v), Fused((q, k, v, p, scale))
    scores = matmul(q, k.mT) * scale  # A = alpha Q K^T (..., T, S)
    p, softmax_saved = _softmax.softmax_forward(scores, axis=-1, mask=mask)  # P
    out = matmul(p, v)  # (..., T, S) @ (..., S, F) -> (..., T, F)
    return out, Captured((q, k, v, p, softmax_saved))


def capture_backward(dout: Array, values: Any) -> tuple[Array, Array, Array]:
    """The textbook backward's statements, the products through :func:`.gemm.matmul`."""
    q, k, v, p, softmax_saved = values
    scale = 1.0 / math.sqrt(q.shape[-1])
    dv = matmul(p.mT, dout)  # P^T dO: (..., S, T) @ (..., T, F)
    dp = matmul(dout, v.mT)  # dO V^T: (..., T, F) @ (..., F, S)
    dscores = _softmax.softmax_backward(dp, softmax_saved)  # dA (..., T, S)
    dq = matmul(dscores, k) * scale  # (..., T, S) @ (..., S, E)
    dk = matmul(dscores.mT, q) * scale  # (..., S, T) @ (..., T, E)
    return dq, dk, dv


class Captured(NamedTuple):
    """The saved values of :func:`capture_forward`: the textbook op's (q, k, v, P, and the
    softmax's saved values)."""

    values: Any


class Fused(NamedTuple):
    """The saved values of :func:`capture_forward` with the fused softmax: (q, k, v, P, alpha)."""

    values: Any


def fused_backward(dout: Array, values: Any) -> tuple[Array, Array, Array]:
    """The textbook backward with alpha dA = alpha P (dP - rowsum(dP P)) one kernel."""
    q, k, v, p, scale = values
    dv = matmul(p.mT, dout)  # P^T dO: (..., S, T) @ (..., T, F)
    dscores = fused_softmax_backward(matmul(dout, v.mT), p, scale)  # alpha dA, over dP
    dq = matmul(dscores, k)  # (..., T, S) @ (..., S, E)
    dk = matmul(dscores.mT, q)  # (..., S, T) @ (..., T, E)
    return dq, dk, dv


# =========================================================================== CuPy kernels
# The masked softmax of attention and its backward, one CUDA block a row of scores: the
# scale and the mask applied on the way (the mask as the textbook's bias, 0 or -inf, so
# a NaN score stays NaN even where masked), the row's max, sum and division in three
# sweeps of the row (which stays in cache), a fully masked row all zeros; the backward
# alpha P (dP - <dP, P>) in two.  The textbook's statements (mask_bias, softmax_forward,
# softmax_backward) make eleven passes over the (..., T, S) scores and write seven
# arrays of their size; these kernels read and write them once.  Tested equal to them
# (float64 within 1e-12) on a GPU.  NPFORMER_GPU_FUSED=0 runs the statements instead.
_SOFTMAX_CUDA = r"""
template <typename T> __device__ T negative_infinity();
template <> __device__ float negative_infinity<float>() { return __int_as_float(0xff800000); }
template <> __device__ double negative_infinity<double>() {
    return __longlong_as_double(0xfff0000000000000LL);
}
__device__ float exponential(float x) { return expf(x); }
__device__ double exponential(double x) { return exp(x); }

template <typename T> __device__ T block_max(T value, T* shared) {
    for (int offset = 16; offset > 0; offset >>= 1)
        value = max(value, __shfl_xor_sync(0xffffffff, value, offset));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = value;
    __syncthreads();
    if (warp == 0) {
        value = lane < (int)(blockDim.x >> 5) ? shared[lane] : negative_infinity<T>();
        for (int offset = 16; offset > 0; offset >>= 1)
            value = max(value, __shfl_xor_sync(0xffffffff, value, offset));
        if (lane == 0) shared[0] = value;
    }
    __syncthreads();
    T result = shared[0];
    __syncthreads();
    return result;
}

template <typename T> __device__ T block_sum(T value, T* shared) {
    for (int offset = 16; offset > 0; offset >>= 1)
        value += __shfl_xor_sync(0xffffffff, value, offset);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = value;
    __syncthreads();
    if (warp == 0) {
        value = lane < (int)(blockDim.x >> 5) ? shared[lane] : (T)0;
        for (int offset = 16; offset > 0; offset >>= 1)
            value += __shfl_xor_sync(0xffffffff, value, offset);
        if (lane == 0) shared[0] = value;
    }
    __syncthreads();
    T result = shared[0];
    __syncthreads();
    return result;
}

// scores (A, H, T, S) contiguous, overwritten by P; mask element strides (0: broadcast)
template <typename T>
__global__ void softmax_forward(T* scores, const bool* mask, int has_mask, long long heads,
                                long long queries, long long keys, long long mask_a,
                                long long mask_h, long long mask_t, long long mask_s, T scale) {
    __shared__ T shared[32];
    long long row = blockIdx.x;
    long long t = row % queries, h = (row / queries) % heads, a = row / (queries * heads);
    T* x = scores + row * keys;
    const bool* keep = mask + a * mask_a + h * mask_h + t * mask_t;
    T local = negative_infinity<T>();
    for (long long j = threadIdx.x; j < keys; j += blockDim.x) {
        T value = x[j] * scale;
        if (has_mask && !keep[j * mask_s]) value += negative_infinity<T>();
        local = max(local, value);
    }
    T top = block_max(local, shared);
    T shift = isfinite(top) ? top : (T)0;  // a fully masked row: its max is -inf
    T partial = 0;
    for (long long j = threadIdx.x; j < keys; j += blockDim.x) {
        T value = x[j] * scale;
        if (has_mask && !keep[j * mask_s]) value += negative_infinity<T>();
        partial += exponential(value - shift);
    }
    T total = block_sum(partial, shared);
    if (!(total > (T)0)) total = (T)1;  // 0 / 1 on a fully masked row
    for (long long j = threadIdx.x; j < keys; j += blockDim.x) {
        T value = x[j] * scale;
        if (has_mask && !keep[j * mask_s]) value += negative_infinity<T>();
        x[j] = exponential(value - shift) / total;
    }
}

// dp (rows, S) overwritten by alpha P (dP - <dP, P>); p (rows, S)
template <typename T>
__global__ void softmax_backward(T* dp, const T* p, long long keys, T scale) {
    __shared__ T shared[32];
    long long row = blockIdx.x;
    T* g = dp + row * keys;
    const T* q = p + row * keys;
    T partial = 0;
    for (long long j = threadIdx.x; j < keys; j += blockDim.x) partial += g[j] * q[j];
    T dot = block_sum(partial, shared);
    for (long long j = threadIdx.x; j < keys; j += blockDim.x)
        g[j] = scale * (q[j] * (g[j] - dot));
}
"""
_THREADS = 256  # a block per row of scores: 8 warps sweep it


def fused() -> bool:
    """NPFORMER_GPU_FUSED, read when attention runs (not on import: a bad value is then
    reported by the program, in one line; :func:`npformer.backend.check_environment`)."""
    return backend.switch("NPFORMER_GPU_FUSED")


def fuses_softmax(q: Array, mask: Array | None) -> bool:
    """Whether attention's softmax runs as the CuPy kernels: CuPy arrays of 4 axes
    (B, H, T, E), a mask of 4 axes or none, NPFORMER_GPU_FUSED not off."""
    return (type(q).__module__.startswith("cupy") and q.ndim == 4
            and (mask is None or mask.ndim == 4) and fused())


@functools.cache
def _softmax_module():
    import cupy

    names = [f"softmax_{way}<{t}>" for way in ("forward", "backward")
             for t in ("float", "double")]
    return cupy.RawModule(code=_SOFTMAX_CUDA, options=("-std=c++17",), name_expressions=names)


def _kernel(way: str, dtype) -> Any:
    return _softmax_module().get_function(
        f"softmax_{way}<{'float' if dtype.itemsize == 4 else 'double'}>")


def fused_softmax(scores: Array, scale: float, mask: Array | None) -> Array:
    """P = softmax(alpha scores + M) over the last axis, written over ``scores`` (A, H, T,
    S), C-contiguous, float32 or float64); ``mask`` (bool, 4 axes broadcasting to it)."""
    import cupy

    a, heads, queries, keys = scores.shape
    rows = a * heads * queries
    if rows == 0 or keys == 0:
        return scores
    cast = scores.dtype.type
    if mask is None:
        keep, strides = cupy.ones((1,), dtype=cupy.bool_), (0, 0, 0, 0)
    else:
        keep = cupy.ascontiguousarray(mask)
        strides = cupy.broadcast_to(keep, scores.shape).strides  # bytes = elements (bool)
    _kernel("forward", scores.dtype)(
        (rows,), (_THREADS,),
        (scores, keep, np.int32(mask is not None), np.int64(heads), np.int64(queries),
         np.int64(keys), *(np.int64(s) for s in strides), cast(scale)))
    return scores


def fused_softmax_backward(dp: Array, p: Array, scale: float) -> Array:
    """alpha dA = alpha P (dP - rowsum(dP P)), written over ``dp`` (both (..., S),
    C-contiguous)."""
    keys = dp.shape[-1]
    rows = dp.size // max(keys, 1)
    if rows == 0 or keys == 0:
        return dp
    _kernel("backward", dp.dtype)((rows,), (_THREADS,),
                                  (dp, p, np.int64(keys), dp.dtype.type(scale)))
    return dp
