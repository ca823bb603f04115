"""Placement: which cores and which GPU each rank of a machine uses.

The ranks on one machine share its cores (each rank's BLAS gets its part) and its
GPUs (rank r uses device ``local_rank % device_count``).
"""
from __future__ import annotations

import importlib.util
import os

BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def share_cores(local_size: int) -> None:
    """The ranks on one machine share its cores: each rank's BLAS gets cores / local_size
    threads (else every rank's BLAS starts one thread per core, and N ranks oversubscribe
    the machine N times).  A thread count the user set in the environment is kept."""
    if any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=max(1, (os.cpu_count() or 1) // local_size), user_api="blas")


def select_gpu(local_rank: int) -> None:
    """CuPy installed with GPUs: this rank's device is ``local_rank % device_count``
    (before any array is made: join the ranks before ``backend.set_backend``)."""
    if importlib.util.find_spec("cupy") is None:
        return
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - CuPy without a driver or device: the CPU it is
        return
    if count:
        cupy.cuda.Device(local_rank % count).use()
