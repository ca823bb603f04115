r"""The few-row product, streamed: $y = x W$ for a few rows x, each row of W read from
memory once for all of them.

A decoding step multiplies the batch's newest positions, a few rows $x \in
\mathbb{R}^{N \times D_{in}}$, by every weight matrix $W \in \mathbb{R}^{D_{in} \times
D_{out}}$ of the model: N multiply-adds for each weight read, so the step is as fast as
the weights can be read.  OpenBLAS reads W at the machine's bandwidth for one row (its
matrix-vector kernel) but at a third to a half of it for 2 to 16 rows (its matrix-matrix
kernel packs W into blocks first: bench/README.md, "Decoding at the memory bound").
This kernel reads W in its memory order instead, each row $W_p$ once, and adds its terms
into every row of y while it is in the CPU's cache:

    $y_r = (((x_{r,0} W_0 + x_{r,1} W_1) + x_{r,2} W_2) + \dots) + x_{r,D_{in}-1} W_{D_{in}-1}$

the terms in the order of the sum's index p, the textbook's order (no reassociation,
no fused multiply-add: the compiler's options, :mod:`.compiler`), so y equals NumPy's
product to rounding (float64 within 1e-12, float32 within float32's rounding:
``tests/test_streaming.py``), and a row's result does not depend on the other rows or on
the number of threads.

How the loop is laid out, for the compiler to vectorize it: four rows of W and two rows of
x a pass (:func:`_two_rows_four_terms`), the partial sums in a local array (which
aliases no argument), along the output columns; the columns are cut into one chunk a
thread (numba's ``prange``), each chunk's rows of W read once.

Used by the fast tier's :func:`npformer.fast.linear.linear_forward` when the rows are
few (:func:`takes`): decoding steps.  The textbook tier's op stays ``x @ W``.
"""
from __future__ import annotations

import threading

import numpy as np

from ..backend import Array
from .compiler import compilable, jit, numba, prange

MAX_ROWS = 16  # the most rows streamed: beyond it the library's blocked product is faster
MIN_WEIGHTS = 1 << 12  # the fewest weights streamed (a smaller W stays in cache either way)
PARALLEL_WEIGHTS = 1 << 18  # from this many weights on, every core takes a chunk of columns
_launch = threading.Lock()  # one parallel launch at a time (numba's workqueue threading
#   layer, its fallback, is not thread-safe; each launch uses every core anyway)


def takes(x_rows: Array, w: Array) -> bool:
    """Whether :func:`streamed_product` computes x_rows (N, D_in) @ w (D_in, D_out): NumPy
    float arrays of one dtype, C-contiguous, compiled kernels present, 1 <= N <= MAX_ROWS
    rows and a W of at least MIN_WEIGHTS numbers."""
    return 0 < x_rows.shape[0] <= MAX_ROWS and w.size >= MIN_WEIGHTS and compilable(x_rows, w)


def streamed_product(x_rows: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x_rows (N, D_in) @ w (D_in, D_out) -> (N, D_out), W streamed (see the module's
    docstring); the arrays as :func:`takes` accepts them."""
    out = np.empty((x_rows.shape[0], w.shape[1]), dtype=x_rows.dtype)
    if w.size < PARALLEL_WEIGHTS:
        _columns(x_rows, w, out, 0, w.shape[1])
        return out
    chunks = numba.get_num_threads()
    with _launch:
        _parallel_product(x_rows, w, out, chunks)
    return out


# =========================================================================== the kernels
@jit(inline="always")
def _two_rows_four_terms(y0, y1, x0, x1, w0, w1, w2, w3):
    """y0 += x0[0] w0 + ... + x0[3] w3 and y1 likewise with x1, the terms added in order,
    element by element (y0, y1, w0..w3 (M,), x0, x1 (4,))."""
    a0, a1, a2, a3 = x0[0], x0[1], x0[2], x0[3]
    b0, b1, b2, b3 = x1[0], x1[1], x1[2], x1[3]
    for j in range(y0.size):
        c0, c1, c2, c3 = w0[j], w1[j], w2[j], w3[j]
        y0[j] = (((y0[j] + a0 * c0) + a1 * c1) + a2 * c2) + a3 * c3
        y1[j] = (((y1[j] + b0 * c0) + b1 * c1) + b2 * c2) + b3 * c3


@jit(inline="always")
def _one_row_four_terms(y0, x0, w0, w1, w2, w3):
    """y0 += x0[0] w0 + ... + x0[3] w3, the terms added in order."""
    a0, a1, a2, a3 = x0[0], x0[1], x0[2], x0[3]
    for j in range(y0.size):
        y0[j] = (((y0[j] + a0 * w0[j]) + a1 * w1[j]) + a2 * w2[j]) + a3 * w3[j]


@jit(inline="always")
def _one_term(y0, a, w0):
    """y0 += a w0."""
    for j in range(y0.size):
        y0[j] = y0[j] + a * w0[j]


@jit
def _columns(x, w, out, j0, j1):
    """out[:, j0:j1] = x (N, K) @ w[:, j0:j1] (:func:`columns_into`'s loop, compiled on
    its own)."""
    columns_into(x, w, out, j0, j1)


@jit(inline="always")
def columns_into(x: np.ndarray, w: np.ndarray, out: np.ndarray, j0: int, j1: int) -> None:
    """out[:, j0:j1] = x (N, K) @ w[:, j0:j1]: W's rows p, p + 1, p + 2, p + 3 read once for
    every row of x, two rows at a time, their terms added in the order of p.  Inlined
    where another kernel calls it (:func:`npformer.fast.compiled._affine`)."""
    n, k = x.shape
    y = np.zeros((n, j1 - j0), dtype=x.dtype)  # local: it aliases no argument
    k4 = k - k % 4
    for p in range(0, k4, 4):
        w0, w1, w2, w3 = w[p, j0:j1], w[p + 1, j0:j1], w[p + 2, j0:j1], w[p + 3, j0:j1]
        for r in range(0, n - 1, 2):
            _two_rows_four_terms(y[r], y[r + 1], x[r, p:p + 4], x[r + 1, p:p + 4],
                                 w0, w1, w2, w3)
        if n % 2:
            _one_row_four_terms(y[n - 1], x[n - 1, p:p + 4], w0, w1, w2, w3)
    for p in range(k4, k):  # the last K mod 4 terms, still in order
        for r in range(n):
            _one_term(y[r], x[r, p], w[p, j0:j1])
    out[:, j0:j1] = y


@jit(parallel=True)
def _parallel_product(x, w, out, chunks):
    """out (N, M) = x (N, K) @ w (K, M), the columns cut into ``chunks`` chunks computed
    side by side (numba's prange: one thread a chunk)."""
    m = w.shape[1]
    for c in prange(chunks):
        _columns(x, w, out, c * m // chunks, (c + 1) * m // chunks)
