"""The machine's limits, measured in the benchmark's own run (in its parent process, before
or after the sides, never inside a timed step): the float32 matrix-product peak and the
memory bandwidth.

Peak: the best GFLOP/s of float32 products ``out = a @ b`` on ``threads`` cores, over a
few square sizes and the configurations' own product shapes (bench/flops.py's
``layer_shapes``), each the minimum time of ``repeats`` runs after one untimed, through
NumPy's BLAS and, where it is installed, torch's: the best of all.

Bandwidth: a large float32 array copied into another (``np.copyto``; torch's ``copy_``
where installed, which uses every thread), the best of ``repeats``, counted as the bytes
read plus the bytes written (STREAM's "copy" convention: a cache's write-allocate read of
the destination is not counted).  :func:`read_rates` gives the read rate alone (a sum of
the array, its bytes over the time: bench/decode.py's bound).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import NamedTuple

from bench.report import cpu_model

SQUARE_SIZES = (1024, 2048)
SMOKE_SQUARE_SIZES = (64, 128)
REPEATS = 5
SMOKE_REPEATS = 2
COPY_BYTES = 256 * 2 ** 20
SMOKE_COPY_BYTES = 4 * 2 ** 20


def best_seconds(fn, repeats: int) -> float:
    """The least time of ``repeats`` calls of ``fn`` after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


class Library(NamedTuple):
    """What a library's timed calls are made of: each takes sizes and returns a call."""

    product: Callable  # (m, k, n) -> out = a @ b of float32 (m, k) by (k, n)
    copy: Callable  # nbytes -> a float32 array of nbytes copied into another
    read: Callable  # nbytes -> a float32 array of nbytes summed (read once)


@contextlib.contextmanager
def numpy_library(threads: int):
    """A :class:`Library` through NumPy, its BLAS on ``threads`` threads (threadpoolctl
    where installed, else as the environment set it)."""
    import numpy as np

    try:
        from threadpoolctl import threadpool_limits
        limits = threadpool_limits(threads)
    except ImportError:
        limits = contextlib.nullcontext()
    rng = np.random.default_rng(0)

    def product(m, k, n):
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        out = np.empty((m, n), dtype=np.float32)
        return lambda: np.matmul(a, b, out=out)

    def copy(nbytes):
        src = np.ones(nbytes // 4, dtype=np.float32)
        dst = np.empty_like(src)
        return lambda: np.copyto(dst, src)

    def read(nbytes):
        src = np.ones(nbytes // 4, dtype=np.float32)
        return lambda: src.sum()

    with limits:
        yield Library(product, copy, read)


@contextlib.contextmanager
def torch_library(threads: int):
    """The same through torch on ``threads`` threads (its count restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)

    def product(m, k, n):
        a = torch.randn(m, k, generator=generator)
        b = torch.randn(k, n, generator=generator)
        out = torch.empty(m, n)
        return lambda: torch.mm(a, b, out=out)

    def copy(nbytes):
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    def read(nbytes):
        src = torch.ones(nbytes // 4)
        return lambda: src.sum()

    try:
        yield Library(product, copy, read)
    finally:
        torch.set_num_threads(before)


def libraries() -> dict:
    """{name: library} of the installed ones: NumPy, and torch if it imports."""
    found = {"numpy": numpy_library}
    try:
        import torch  # noqa: F401
    except ImportError:
        return found
    found["torch"] = torch_library
    return found


def matmul_rates(shapes, threads: int, repeats: int) -> list[dict]:
    """[{library, shape (m, k, n), gflops}] of every installed library on every shape."""
    rates = []
    for name, library in libraries().items():
        with library(threads) as calls:
            for m, k, n in shapes:
                seconds = best_seconds(calls.product(m, k, n), repeats)
                rates.append(dict(library=name, shape=(m, k, n),
                                  gflops=2 * m * k * n / seconds / 1e9))
    return rates


def copy_rates(nbytes: int, threads: int, repeats: int) -> list[dict]:
    """[{library, bytes, gb_s}]: the copy of ``nbytes`` in every installed library."""
    rates = []
    for name, library in libraries().items():
        with library(threads) as calls:
            seconds = best_seconds(calls.copy(nbytes), repeats)
            rates.append(dict(library=name, bytes=nbytes, gb_s=2 * nbytes / seconds / 1e9))
    return rates


def read_rates(nbytes: int, threads: int, repeats: int) -> list[dict]:
    """[{library, bytes, gb_s}]: a float32 array of ``nbytes`` read by a sum in every
    installed library; the bytes read over the best time."""
    rates = []
    for name, library in libraries().items():
        with library(threads) as calls:
            seconds = best_seconds(calls.read(nbytes), repeats)
            rates.append(dict(library=name, bytes=nbytes, gb_s=nbytes / seconds / 1e9))
    return rates


def measure(shapes, threads: int, smoke: bool = False) -> dict:
    """{"matmul": the best product rate, "copy": the best copy rate, "cpu": the model
    name, "threads"}: the squares of SQUARE_SIZES (smoke: SMOKE_SQUARE_SIZES) and
    ``shapes``; ``smoke``: tiny sizes and 2 repeats (a check that it runs)."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    squares = SMOKE_SQUARE_SIZES if smoke else SQUARE_SIZES
    repeats = SMOKE_REPEATS if smoke else REPEATS
    all_shapes = sorted({(s, s, s) for s in squares} | {tuple(s) for s in shapes})
    best = max(matmul_rates(all_shapes, threads, repeats), key=lambda r: r["gflops"])
    copy = max(copy_rates(SMOKE_COPY_BYTES if smoke else COPY_BYTES, threads, repeats),
               key=lambda r: r["gb_s"])
    return dict(matmul=best, copy=copy, cpu=cpu_model(), threads=threads,
                shapes=len(all_shapes), repeats=repeats)


def peak_lines(limits: dict) -> list[str]:
    """The header's lines of the measured limits."""
    m, c = limits["matmul"], limits["copy"]
    rows, inner, cols = m["shape"]
    return [f"peak:      float32 matrix products {m['gflops']:.1f} GFLOP/s on "
            f"{limits['threads']} threads ({m['library']}, ({rows}x{inner})@({inner}x{cols}); "
            f"the best of {limits['shapes']} shapes, each the minimum of {limits['repeats']} "
            f"runs); CPU: {limits['cpu']}",
            f"bandwidth: {c['gb_s']:.1f} GB/s (a {c['bytes'] / 2 ** 20:.0f} MiB float32 copy, "
            f"{c['library']}, bytes read + written, best of {limits['repeats']})"]
