r"""The fast tier's compiler: numba, whether it is usable here, and the one decorator
every kernel is compiled with.

Why numba: it compiles a Python loop over NumPy arrays into machine code with LLVM, with
no C toolchain or build step at install time (a wheel, like NumPy's), and its kernels
release the GIL, so thread replicas run their element-wise work side by side.  (Cython
or C would need a compiler or per-platform wheels; Pythran and Taichi are further from
NumPy's arrays.)

The options every kernel shares (:func:`jit`):

* ``fastmath=False``: no reassociation or multiply-add contraction, so each kernel does
  the textbook's operations in the textbook's order, and the tests can hold it to the
  textbook op within 1e-12 in float64.  One exception, asked for by name
  (``contract=True``): the float32 GELU kernels let LLVM contract a * b + c into one
  fused multiply-add (one rounding instead of two, no reassociation).
* ``error_model="numpy"``: a division by zero gives inf, as in NumPy (no check per
  division, which would stop LLVM vectorizing the loop).
* ``nogil=True``; not ``parallel=True``: on the 2-core machines this was measured on,
  two thread replicas already keep both cores busy.  One exception, asked for by name
  (``parallel=True``): the few-row product of :mod:`.streaming`, a decoding step's,
  which one thread cannot feed from memory as fast as every core can.
* ``cache=True``: the machine code is kept on disk (next to the kernel's file in
  ``__pycache__``, or under ``NUMBA_CACHE_DIR``, or the user's cache directory where the
  package is installed read-only), so a kernel compiles once per machine and version
  and a later process loads it.  Two rules keep that true.  Every kernel is a
  module-level function: numba keys a closure's cache entry on its captured values
  pickled, which differ in every process, so a kernel built inside a function was
  compiled again, and its cache grew by one file, in every new process.  And numba
  stamps an entry with the contents of the kernel's own file only, while every kernel
  inlines the shared numerics of :mod:`.numerics` (and this file's options): the
  stamp here also covers those two files (:data:`SHARED_SOURCES`), so an edit to the
  exp makes every kernel compile again instead of loading stale code.

Without numba (not installed, or turned off by numba's own ``NUMBA_DISABLE_JIT=1``: this
package reads no environment variable on import) :data:`COMPILED` is False, :func:`jit`
returns the Python function itself, the ops run their NumPy statements, and the first
op that would have used a kernel warns once, naming the kernels (:func:`compilable`).
"""
from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..backend import Array


def _load_numba() -> tuple[Any, str]:
    """numba, or None with the reason (not installed, or turned off by its own switch)."""
    try:
        import numba
    except ImportError:
        return None, "numba is not installed (pip install numba)"
    if numba.config.DISABLE_JIT:
        return None, "NUMBA_DISABLE_JIT is set"
    return numba, ""


numba, WHY_NOT_COMPILED = _load_numba()
COMPILED = numba is not None
prange = numba.prange if COMPILED else range  # a parallel kernel's loop (``parallel=True``)
KERNELS: list[tuple[str, str]] = []  # (module, name) of every kernel, as :func:`jit` meets it
_warned = False


def compilable(*arrays: Array) -> bool:
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
            names = ", ".join(f"{module.rsplit('.', 1)[-1]}.{name}" for module, name in KERNELS)
            warnings.warn(f"npformer's fast tier runs without its compiled kernels "
                          f"({WHY_NOT_COMPILED}): {names} fall back to NumPy statements "
                          "(same results, slower)", RuntimeWarning, stacklevel=3)
        return False
    return all(a.flags.c_contiguous for a in arrays)


# =========================================================================== the decorator
HERE = Path(__file__).resolve().parent
SHARED_SOURCES = (HERE / "compiler.py", HERE / "numerics.py")  # inlined into every kernel


def _sources_stamp(sources: tuple[Path, ...]) -> str:
    """A hash of the sources' contents: part of a kernel's cache stamp."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _kernel_cache_class(sources: tuple[Path, ...] = SHARED_SOURCES) -> type:
    """numba's on-disk function cache, with each entry's freshness stamp (numba's: the
    kernel's own file's contents) extended by the contents of ``sources``."""
    from numba.core.caching import CompileResultCacheImpl, FunctionCache

    shared = _sources_stamp(sources)

    class SharedSourcesImpl(CompileResultCacheImpl):
        def __init__(self, py_func: Callable) -> None:
            super().__init__(py_func)
            own_stamp = self.locator.get_source_stamp
            self.locator.get_source_stamp = lambda: (own_stamp(), shared)

    class KernelCache(FunctionCache):
        _impl_class = SharedSourcesImpl

    return KernelCache


_KernelCache = _kernel_cache_class() if COMPILED else None


def jit(fn: Callable | None = None, inline: str = "never", contract: bool = False,
        calls: tuple[Path, ...] = (), parallel: bool = False) -> Any:
    """numba's njit with the tier's options (see the module's docstring), or the function
    itself without numba.  ``inline="always"``: a scalar helper that numba inlines into
    its callers, so LLVM sees one loop body and vectorizes it (not cached on its own,
    not a kernel).  ``contract=True``: a * b + c may become one fused multiply-add.
    ``calls``: the files of the other kernels it calls, whose code its cache entry holds
    too (their contents join the entry's stamp).  ``parallel=True``: its ``prange`` loop
    runs on every core (numba's threads; :mod:`.streaming`'s product, where one thread
    cannot read memory as fast as two)."""
    if fn is None:
        return lambda f: jit(f, inline, contract, calls, parallel)
    if inline == "never":
        KERNELS.append((fn.__module__, fn.__name__))
    if not COMPILED:
        return fn
    dispatcher = numba.njit(fastmath={"contract"} if contract else False, nogil=True,
                            error_model="numpy", inline=inline, parallel=parallel)(fn)
    if inline == "never":
        cache = _kernel_cache_class(SHARED_SOURCES + calls) if calls else _KernelCache
        dispatcher._cache = cache(dispatcher.py_func)  # numba's cache=True, stamped
    return dispatcher
