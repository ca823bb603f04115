"""The cores one operation may use: BLAS's thread count, and independent pieces of work
run side by side on that many threads.

NumPy runs its element-wise work, and the fast tier's compiled kernels, on one core; only
BLAS uses several.  An operation made of many small products and kernels (attention's
blocks: a few heads' scores at a time) keeps every core busy when its independent pieces
run in threads, each with single-threaded BLAS, rather than one after another with BLAS
sharing out each small product.  NumPy's products and the compiled kernels (numba's
``nogil``) release the GIL, so the threads run at once.

How many: the BLAS threads in effect.  Thread replicas (:mod:`npformer.parallel.replicas`)
and MPI ranks that share a machine's cores set BLAS to one thread (or their share), so an
operation inside them runs its pieces in order, on the core it was given.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

_controller = None  # found once: looking up the loaded BLAS libraries reads /proc
_pool: ThreadPoolExecutor | None = None  # the operations' threads, started at first use


def _blas() -> Any:
    """threadpoolctl's controller of the loaded BLAS libraries (None without threadpoolctl)."""
    global _controller
    if _controller is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # pragma: no cover - threadpoolctl is a dependency
            return None
        _controller = ThreadpoolController().select(user_api="blas")
    return _controller


def single_threaded_blas() -> Any:
    """A context in which BLAS runs on one thread (threads that share the cores)."""
    blas = _blas()
    return nullcontext() if blas is None or not blas.lib_controllers else blas.limit(limits=1)


def blas_threads() -> int:
    """The threads BLAS runs a product on now (1 inside :func:`single_threaded_blas`)."""
    blas = _blas()
    if blas is None or not blas.lib_controllers:
        return 1
    return min(lib.get_num_threads() for lib in blas.lib_controllers)


def run_side_by_side(work: Callable, pieces: Sequence) -> None:
    """``work(piece)`` for every piece, the pieces independent of each other: on as many
    threads as BLAS has now, each with single-threaded BLAS; in order on this thread when
    BLAS has one (or there is one piece)."""
    threads = min(blas_threads(), len(pieces))
    if threads <= 1:
        for piece in pieces:
            work(piece)
        return
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                   thread_name_prefix="npformer-op")

    def run(share):  # one thread's pieces, in their order
        for piece in share:
            work(piece)

    shares = [pieces[i::threads] for i in range(threads)]  # every threads-th piece each
    with single_threaded_blas():
        for _ in _pool.map(run, shares):  # map re-raises a piece's error here
            pass
