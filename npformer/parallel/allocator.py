"""Allocator tuning: freed activations stay in the process instead of going back to the OS.

glibc serves allocations above a dynamic threshold (up to 32 MiB) with ``mmap`` and
returns them at ``free``, and trims the heap top above 128 KiB: a training step that
frees and re-allocates its activations then page-faults them back in, every step, and
those faults do not scale across cores: two ranks side by side each take longer than
one alone, and with this setting no longer do.  Thread replicas of one process gain
too.  The measurements, and how they were taken: ``bench/README.md``, "The allocator".

:class:`npformer.train.Trainer`, :func:`npformer.parallel.setup` and the fast tier's models
call :func:`keep_freed_memory`: a training process allocates the same arrays every step, and
a model called again the same arrays every call, so keeping them costs no more than the
peak, which it reaches anyway.
"""
from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_KEEP_BYTES = 2**31 - 1  # mallopt takes an int: 2 GiB, far above any one activation


def keep_freed_memory() -> bool:
    """Keep freed memory in the process instead of handing it back to the OS (glibc).

    This is ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:
    glibc.malloc.trim_threshold=...`` set from inside the process with ``mallopt``, so
    it needs no launcher flag.  Returns False where there is no glibc (nothing changed).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) and mallopt(_M_TRIM_THRESHOLD,
                                                                       _KEEP_BYTES))
