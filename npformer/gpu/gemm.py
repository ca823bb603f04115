r"""Matrix products that a CUDA graph can capture: ``matmul(a, b)`` is ``a @ b``.

On NumPy (and any namespace but CuPy) it is ``a @ b``.  On CuPy, while a step is
being captured into a CUDA graph (:mod:`npformer.gpu.cuda_graph`) or run eagerly the
way it will be replayed, it calls cuBLAS itself.  CuPy refuses every cuBLAS call
while a stream captures (its ``cublas.setStream`` raises NotImplementedError:
which conditions cuBLAS needs has not been settled there), although cuBLAS
supports capture when its handle is bound to the capturing stream and given its
workspace up front, so that it allocates nothing while capturing.  This module
does exactly that, through ``ctypes``, with a handle of its own per stream.

The product, in the row-major layout of the arrays: $C = A B$ with
A (..., M, K), B (..., K, N), C (..., M, N).  cuBLAS is column-major, and a
row-major (R, C) matrix read column-major is its transpose, so the call computes
$C^\top = B^\top A^\top$: m = N, n = M, k = K, the operands swapped.  An operand
that is the transpose of a contiguous matrix (``w.mT``) is passed with the
"transpose" flag instead of being copied; any other layout is copied contiguous
first.  Leading axes are one strided batch (a 2-d B is shared by every batch
entry with stride 0; a contiguous A with a 2-d B is one product of all its rows).

float32 products use cuBLAS's float32 compute type (no TF32, as CuPy's default;
``CUPY_TF32=1`` allows TF32, as it does for CuPy), float64 its float64 one.
Tested equal to ``@`` on the GPU (``tests/test_graph.py``).
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .. import backend
from ..backend import Array

WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommended workspace on Hopper GPUs
_OP_N, _OP_T = 0, 1  # cublasOperation_t
_GEMM_DEFAULT = -1  # cublasGemmAlgo_t
# dtype -> (cudaDataType_t, cublasComputeType_t, ctypes scalar of alpha and beta)
_TYPES = {"float32": (0, 68, ctypes.c_float), "float64": (1, 70, ctypes.c_double)}
_COMPUTE_32F_FAST_TF32 = 77

_state = threading.local()  # .on: products go through cuBLAS here (see graph_safe)


def capturing() -> bool:
    """Whether CuPy products go through this module's cuBLAS calls (inside
    :func:`npformer.gpu.cuda_graph.graph_safe`)."""
    return getattr(_state, "on", False)


def set_routed(on: bool) -> bool:
    """Route CuPy products here (True) or to CuPy (False); returns the previous setting."""
    previous = capturing()
    _state.on = on
    return previous


def matmul(a: Array, b: Array) -> Array:
    """``a @ b``; on CuPy inside :func:`npformer.gpu.cuda_graph.graph_safe`, cuBLAS called
    directly so that a CUDA graph can capture it."""
    if not (capturing() and type(a).__module__.startswith("cupy")):
        return a @ b
    return _cublas_matmul(a, b)


def column_sum(x: Array) -> Array:
    """x (N, D) -> its sum over the rows (D,).  On CuPy inside
    :func:`npformer.gpu.cuda_graph.graph_safe`, the product ones (1, N) @ x through cuBLAS:
    CuPy reduces N rows into D sums with D blocks, which leaves most of a GPU idle (a
    bias's gradient over many rows then takes much of an update: ``bench/README.md``,
    "On a GPU")."""
    if not (capturing() and type(x).__module__.startswith("cupy")):
        return backend.namespace_of(x).sum(x, axis=0)
    import cupy

    ones = cupy.ones((1, x.shape[0]), dtype=x.dtype)  # (1, N)
    return _cublas_matmul(ones, x).reshape(x.shape[1])  # (1, N) @ (N, D) -> (D,)


# =========================================================================== cuBLAS
class _Library:
    """libcublas (the copy CuPy loaded) and one handle per (device, stream)."""

    def __init__(self):
        import cupy

        cupy.cuda.device.get_cublas_handle()  # CuPy loads its libcublas
        self.lib = ctypes.CDLL(_loaded_path("libcublas.so"))
        for name in ("cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2",
                     "cublasGemmStridedBatchedEx"):
            getattr(self.lib, name).restype = ctypes.c_int
        self.handles: dict[tuple[int, int], tuple[ctypes.c_void_p, object]] = {}

    def handle(self, stream_ptr: int):
        """The handle bound to this stream, with its workspace (made on first use: call
        once outside a capture, as the graph's eager first update does)."""
        import cupy

        key = (cupy.cuda.Device().id, stream_ptr)
        if key not in self.handles:
            handle = ctypes.c_void_p()
            _check(self.lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
            _check(self.lib.cublasSetStream_v2(handle, ctypes.c_void_p(stream_ptr)),
                   "cublasSetStream")
            workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
            _check(self.lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(workspace.data.ptr),
                                                  ctypes.c_size_t(WORKSPACE_BYTES)),
                   "cublasSetWorkspace")
            self.handles[key] = (handle, workspace)  # the workspace lives with its handle
        return self.handles[key][0]


def _loaded_path(name: str) -> str:
    """The path of the shared library ``name`` this process has loaded (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if os.path.basename(path).startswith(name):
                return path
    import ctypes.util

    found = ctypes.util.find_library(name.removeprefix("lib").split(".")[0])
    if found is None:
        raise RuntimeError(f"{name} is not loaded in this process and was not found")
    return found


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


@functools.cache
def _lib() -> _Library:
    return _Library()


@dataclass(frozen=True)
class GemmCall:
    """The arguments of ``cublasGemmStridedBatchedEx`` (column-major) that compute the
    row-major product C = A B of the planned operands: the call's first operand is B,
    its second A (C^T = B^T A^T); strides and leading dimensions in elements."""

    op_first: int  # B's: N (row-major B) or T (B the transpose of a row-major matrix)
    op_second: int  # A's
    m: int  # N, the columns of C
    n: int  # M, the rows of C
    k: int  # K
    ld_first: int
    stride_first: int  # 0: one B for every batch entry
    ld_second: int
    stride_second: int
    ldc: int  # N: C is written row-major, (M, N) per batch entry
    stride_c: int  # M N
    batch: int


def _layout(x) -> tuple[int, int, int] | None:
    """(op, ld, batch stride) of a (..., R, C) operand read by cuBLAS, from its strides:
    op N with ld the row stride for a row-major matrix, op T with ld the column stride
    for the transpose of one; None where the layout is neither (it is copied first)."""
    item = x.itemsize
    rows, cols = x.shape[-2], x.shape[-1]
    s_row, s_col = x.strides[-2] // item, x.strides[-1] // item
    batch_stride = _batch_stride(x)
    if batch_stride is None:
        return None
    if s_col == 1 and s_row >= max(cols, 1):
        return _OP_N, s_row, batch_stride
    if s_row == 1 and s_col >= max(rows, 1):
        return _OP_T, s_col, batch_stride
    return None


def _batch_stride(x) -> int | None:
    """The stride (in elements) between consecutive matrices of the leading axes taken as
    one batch (0 for a single matrix), or None where they are not evenly spaced."""
    axes = [(size, stride // x.itemsize)
            for size, stride in zip(x.shape[:-2], x.strides[:-2]) if size != 1]
    if not axes:
        return 0
    innermost = expected = axes[-1][1]
    for size, stride in reversed(axes):
        if stride != expected:
            return None
        expected = stride * size
    return innermost


def plan(a: Array, b: Array, contiguous: Callable[[Array], Array]
         ) -> tuple[Array, Array, GemmCall, tuple[int, ...]] | None:
    """How cuBLAS computes ``a @ b`` (floating operands of one dtype, ndim >= 2, K >= 1,
    M N >= 1): (a, b as the call reads them, the call, the output's shape), or None where
    this module does not make the product (batches that broadcast).  ``contiguous(x)``: a
    C-contiguous copy (CuPy's on a GPU; NumPy's where the tests emulate the call)."""
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    out_shape = tuple(a.shape[:-1]) + (n,)
    if b.ndim == 2 and a.ndim > 2 and a.flags.c_contiguous:  # every row times one matrix
        a = a.reshape(-1, k)
        m = a.shape[0]
    lead_a, lead_b = tuple(a.shape[:-2]), tuple(b.shape[:-2])
    if lead_b and lead_a != lead_b:
        return None
    a, b = (x if _layout(x) is not None else contiguous(x) for x in (a, b))
    (op_a, ld_a, stride_a), (op_b, ld_b, stride_b) = _layout(a), _layout(b)
    call = GemmCall(op_first=op_b, op_second=op_a, m=n, n=m, k=k, ld_first=ld_b,
                    stride_first=stride_b if lead_b else 0, ld_second=ld_a,
                    stride_second=stride_a, ldc=n, stride_c=m * n,
                    batch=math.prod(lead_a))
    return a, b, call, out_shape


def _cublas_matmul(a, b):
    import cupy

    if a.dtype != b.dtype or a.dtype.name not in _TYPES or a.ndim < 2 or b.ndim < 2:
        return a @ b  # not a product this module makes: CuPy's (not capturable)
    k = a.shape[-1]  # = b.shape[-2]: the callers' contracts checked the shapes
    if k == 0 or a.shape[-2] == 0 or b.shape[-1] == 0 or 0 in a.shape[:-2]:
        return cupy.zeros(tuple(a.shape[:-1]) + (b.shape[-1],), dtype=a.dtype)
    planned = plan(a, b, cupy.ascontiguousarray)
    if planned is None:
        return a @ b  # batches that broadcast: CuPy's
    a, b, call, out_shape = planned
    out = cupy.empty(out_shape, dtype=a.dtype)
    data_type, compute, scalar = _TYPES[a.dtype.name]
    if data_type == 0 and os.environ.get("CUPY_TF32", "0") not in ("", "0"):
        compute = _COMPUTE_32F_FAST_TF32
    one, zero = scalar(1.0), scalar(0.0)
    lib = _lib()
    handle = lib.handle(cupy.cuda.get_current_stream().ptr)
    status = lib.lib.cublasGemmStridedBatchedEx(  # C^T (N, M) = B^T (N, K) A^T (K, M)
        handle, call.op_first, call.op_second, call.m, call.n, call.k, ctypes.byref(one),
        ctypes.c_void_p(b.data.ptr), data_type, call.ld_first,
        ctypes.c_longlong(call.stride_first),
        ctypes.c_void_p(a.data.ptr), data_type, call.ld_second,
        ctypes.c_longlong(call.stride_second),
        ctypes.byref(zero), ctypes.c_void_p(out.data.ptr), data_type, call.ldc,
        ctypes.c_longlong(call.stride_c), call.batch, compute, _GEMM_DEFAULT)
    _check(status, "cublasGemmStridedBatchedEx")
    return out
