"""Transports: how one flat buffer is summed across the ranks, in place.

A NumPy buffer goes through MPI's ``Allreduce``.  A CuPy buffer (each rank on a GPU)
goes through NCCL (``cupy.cuda.nccl``) when CuPy has it and each rank has a GPU of its
own, else through a CUDA-aware MPI that reads device memory, else staged through host
memory; ``NPFORMER_GPU_ALLREDUCE=nccl|mpi|host`` picks one.  Every transport is a
callable ``sum_in_place(buffer) -> None``; :func:`make_allreduce` chooses.  The host's
also starts a sum without waiting for it (``start``: ``MPI_Iallreduce``), as the gradient
buckets do (:mod:`.buckets`).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

GPU_KINDS = ("nccl", "mpi", "host")


class HostAllreduce:
    """MPI ``Allreduce`` (sum, in place) of a host buffer."""

    def __init__(self, comm: Any):
        self.comm = comm

    def __call__(self, buffer: np.ndarray) -> None:
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)

    def start(self, buffer: np.ndarray) -> Pending:
        """The sum of ``buffer`` in place started (``MPI_Iallreduce``); until its
        ``wait()`` returns, nothing may read or write the buffer."""
        from mpi4py import MPI

        return Pending(self.comm.Iallreduce(MPI.IN_PLACE, buffer, op=MPI.SUM))


class Pending:
    """A started MPI sum: ``test()`` lets MPI progress it (-> whether it is done),
    ``wait()`` ends it."""

    def __init__(self, request: Any):
        self.request = request

    def test(self) -> bool:
        return bool(self.request.Test())

    def wait(self) -> None:
        self.request.Wait()


class DeviceThroughHost:
    """A device buffer summed through host memory (an MPI without CUDA support)."""

    def __init__(self, comm: Any):
        self.host = HostAllreduce(comm)

    def __call__(self, buffer: Any) -> None:
        import cupy

        staged = cupy.asnumpy(buffer)
        self.host(staged)
        buffer.set(staged)


class CudaAwareMPI:
    """``Allreduce`` straight on a CuPy buffer: an MPI built with CUDA support reads
    device memory (mpi4py passes ``__cuda_array_interface__``)."""

    def __init__(self, comm: Any):
        self.host = HostAllreduce(comm)

    def __call__(self, buffer: Any) -> None:
        import cupy

        cupy.cuda.get_current_stream().synchronize()  # the gradients are written
        self.host(buffer)


class Nccl:
    """NCCL all-reduce on the current stream (``cupy.cuda.nccl``); rank 0 makes the
    communicator's id and MPI broadcasts it."""

    def __init__(self, comm: Any):
        from cupy.cuda import nccl

        self.nccl = nccl
        uid = nccl.get_unique_id() if comm.Get_rank() == 0 else None
        uid = comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
        self.types = {np.dtype("float32"): nccl.NCCL_FLOAT32,
                      np.dtype("float64"): nccl.NCCL_FLOAT64,
                      np.dtype("float16"): nccl.NCCL_FLOAT16}

    def __call__(self, buffer: Any) -> None:
        import cupy

        stream = cupy.cuda.get_current_stream()
        self.comm.allReduce(buffer.data.ptr, buffer.data.ptr, buffer.size,
                            self.types[np.dtype(buffer.dtype)], self.nccl.NCCL_SUM, stream.ptr)


def ranks_share_a_gpu(comm: Any) -> bool:
    """Whether two ranks use the same GPU (more ranks on a machine than devices):
    every rank's (machine, PCI bus id) gathered and compared."""
    import cupy
    from mpi4py import MPI

    mine = (MPI.Get_processor_name(), cupy.cuda.Device().pci_bus_id)
    everyone = comm.allgather(mine)
    return len(set(everyone)) < len(everyone)


def gpu_allreduce_kind(shared_gpu: bool = False) -> str:
    """Which device all-reduce the CuPy path uses: NPFORMER_GPU_ALLREDUCE, else NCCL
    where CuPy has it and every rank has a GPU of its own (NCCL refuses two ranks of
    one communicator on one device), else CUDA-aware MPI where the MPI says it is,
    else via the host."""
    chosen = os.environ.get("NPFORMER_GPU_ALLREDUCE", "").strip().lower()
    if chosen:
        if chosen not in GPU_KINDS:
            raise ValueError(f"NPFORMER_GPU_ALLREDUCE must be nccl, mpi or host, got {chosen!r}")
        if chosen == "nccl" and shared_gpu:
            raise ValueError("NPFORMER_GPU_ALLREDUCE=nccl needs one GPU per rank, but two "
                             "ranks share a GPU here (more ranks than devices): start fewer "
                             "ranks, or use NPFORMER_GPU_ALLREDUCE=mpi or host")
        return chosen
    if not shared_gpu:
        try:
            from cupy.cuda import nccl  # noqa: F401

            return "nccl"
        except ImportError:
            pass
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    return "mpi" if query is not None and query() else "host"


def make_allreduce(comm: Any, on_device: bool) -> Callable[[Any], None]:
    """The in-place sum across ``comm``'s ranks of a host buffer, or of a device buffer
    (``on_device``; a collective call: every rank makes it at the same point)."""
    if not on_device:
        return HostAllreduce(comm)
    kind = gpu_allreduce_kind(ranks_share_a_gpu(comm))
    return {"nccl": Nccl, "mpi": CudaAwareMPI, "host": DeviceThroughHost}[kind](comm)
