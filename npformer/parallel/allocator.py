"""Allocator tuning: freed activations stay in the process instead of going back to the OS.

glibc serves allocations above a dynamic threshold (up to 32 MiB) with ``mmap`` and
returns them at ``free``, and trims the heap top above 128 KiB: a training step that
frees and re-allocates its activations then page-faults them back in, every step, and
those faults do not scale across cores (two ranks side by side: 49 and 70 ms against
41 ms alone for the lm step; with this setting 35 and 29 ms, see ``bench/README.md``).
Thread replicas suffer too: the lm step as 2 thread replicas of one process took
53-59 ms without it and 43-47 ms with it (3 runs each, AMD EPYC, 2026-11-24; a
one-off script, its method in ``bench/README.md``).

:class:`npformer.train.Trainer` and :func:`npformer.parallel.setup` call
:func:`keep_freed_memory`: a training process allocates the same arrays every step, so
keeping them costs no more than the step's peak, which it reaches anyway.
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
