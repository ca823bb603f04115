"""Data parallelism across processes (and machines) over MPI, through mpi4py.

``mpiexec -n N python train.py`` starts N copies of one program (ranks).  Each keeps
a whole model; every step they agree on everything but which rows they compute:

1. rank 0's initial parameters are broadcast to every rank;
2. every rank draws the *same* global batch (the same data generator, seeded the
   same), exactly the batch one process would see for that seed and step, and
   keeps its rows: rank r of N takes shard r of ``shard_bounds(B, N)``;
3. rank r's loss is weighted by its share of the counted items (rows, tokens or
   real target tokens; ``task.count``), so that, with n_r items of n on rank r,

       L = sum_r (n_r / n) L_r      =>      dL/dw = sum_r (n_r / n) dL_r/dw

   the *sum* of the ranks' gradients is the single-process gradient of the global
   batch (every rank holds the global batch, so the counts are known on every rank
   without a message);
4. ONE in-place ``Allreduce`` (sum) per optimizer step, over one flat contiguous
   buffer in the training dtype holding every gradient and, in its last slot, the
   ranks' weighted losses; afterwards the parameters' gradients are views into it;
5. clipping and the optimizer step then run identically on every rank (the same
   gradients, the same optimizer state), so the parameters stay equal everywhere
   without being sent again.

Dropout masks: rank r's shard i (of its thread replicas) draws from
``thread_generator(seed + r * replicas + i)``, the ``seed`` the trainer draws from
its data generator every batch: a run repeats exactly, and 2 ranks of 1 replica
draw the same masks as 1 process of 2 thread replicas.  Ranks and threads combine.

Only the main rank (0) prints, plots, writes metrics and checkpoints; checkpoints
hold no per-rank state, so a run resumes on any number of ranks.  An exception on
any rank prints that rank's message and aborts every rank (no hang); so does a rank
whose peers never join (one started with ``NPFORMER_MPI=0``), after a timeout.  Ranks
started with different configurations, data or model shapes are refused before
the first step (:meth:`Context.check_same`).

The one call a program makes, first thing::

    from npformer import distributed
    ctx = distributed.setup()      # size 1, rank 0 when not started by mpiexec
    ...                            # ctx.rank, ctx.size, ctx.is_main, ctx.shard_map(...)

after which :class:`npformer.train.Trainer` trains across the ranks by itself.

GPUs (CuPy backend): rank r uses device ``local_rank % device_count`` and the
all-reduce runs on the device buffer, through NCCL (``cupy.cuda.nccl``) when
CuPy has it and each rank has a GPU of its own, else through a CUDA-aware MPI,
else staged through host memory (``NPFORMER_GPU_ALLREDUCE=nccl|mpi|host`` picks one).
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.util
import os
import select
import signal
import stat
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import backend
from .nn import Module, Parameter
from .nn.module import flat_parameters_of
from .parallel import DataParallel, parallel_map, shard_bounds

if TYPE_CHECKING:  # annotations only: importing these here would be circular
    from .tasks import Task

__all__ = ["Context", "DistributedDataParallel", "RanksDiffer", "setup", "current",
           "data_parallel", "launched_by_mpi", "keep_freed_memory", "batch_fingerprint"]

# Environment variables a launcher sets in every rank: MPICH/Hydra and Intel MPI
# (PMI_SIZE), Open MPI (OMPI_COMM_WORLD_SIZE), PMIx launchers such as srun (PMIX_RANK
# with SLURM_NTASKS / PMI_SIZE).
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK")


class RanksDiffer(RuntimeError):
    """The ranks were started with different configurations, data or models."""


# --------------------------------------------------------------------------- allocator
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_KEEP_BYTES = 2**31 - 1  # mallopt takes an int: 2 GiB, far above any one activation


def keep_freed_memory() -> bool:
    """Keep freed memory in the process instead of handing it back to the OS (glibc).

    glibc serves allocations above a dynamic threshold (up to 32 MiB) with ``mmap`` and
    returns them at ``free``, and trims the heap top above 128 KiB: a training step that
    frees and re-allocates its activations then page-faults them back in, every step,
    and those faults do not scale across cores (two ranks side by side: 49 and 70 ms
    against 41 ms alone for the lm step; with this setting 35 and 29 ms, see
    ``bench/README.md``).  This is ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:
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


# --------------------------------------------------------------------------- the context
def launched_by_mpi() -> bool:
    """True when an MPI launcher (mpiexec, mpirun, srun) started this process with
    more than one rank (``NPFORMER_MPI=1`` forces it, ``=0`` turns MPI off)."""
    forced = os.environ.get("NPFORMER_MPI")
    if forced is not None:
        return forced.strip() not in ("", "0", "false", "no")
    return launcher_size() is not None


def launcher_size() -> tuple[str, int] | None:
    """(variable, ranks) where an MPI launcher's environment says this process is one of
    several ranks, else None (whatever ``NPFORMER_MPI`` says)."""
    for name in _SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return name, int(value)
    return None


def refuse_a_lone_rank() -> None:
    """``NPFORMER_MPI=0`` in a process an MPI launcher started as one of several ranks:
    refuse.  The other ranks would wait for this one in ``MPI_Init`` for ever (an MPMD
    launch, ``mpiexec -n 1 env NPFORMER_MPI=0 python a.py : -n 1 python a.py``)."""
    forced = os.environ.get("NPFORMER_MPI", "").strip()
    found = launcher_size()
    if forced in ("0", "false", "no") and found is not None:
        name, ranks = found
        raise RuntimeError(
            f"NPFORMER_MPI={forced} turns MPI off, but an MPI launcher started this process "
            f"as one of {ranks} ranks ({name}={ranks}): the other ranks would wait for it "
            "for ever. Start it without mpiexec to run one process, or leave NPFORMER_MPI "
            "out to join the ranks")


@dataclasses.dataclass(frozen=True)
class Context:
    """Who this process is among the ranks, and the collective helpers.

    ``comm`` is the mpi4py communicator (None in a single process without MPI).
    ``local_rank`` is the rank among the ``local_size`` ranks on this machine (GPU
    choice, and the cores each rank may use).
    """

    comm: object | None
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, plots, writes metrics and checkpoints."""
        return self.rank == 0

    # ----------------------------------------------------------------- collectives
    def allgather(self, value: Any) -> list:
        """[value of rank 0, value of rank 1, ...] on every rank (any picklable value)."""
        return [value] if self.comm is None or self.size == 1 else self.comm.allgather(value)

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank (a decision all must share)."""
        return value if self.comm is None or self.size == 1 else self.comm.bcast(value, root=0)

    def barrier(self) -> None:
        if self.comm is not None and self.size > 1:
            self.comm.Barrier()

    def abort_others(self, code: int) -> None:
        """After this rank has reported its failure: end every rank (``MPI_Abort``), so
        none is left waiting in a collective call; nothing in a single process."""
        if self.comm is not None and self.size > 1:
            sys.stderr.flush()
            self.comm.Abort(code)

    def shard_map(self, fn: Callable, items: Sequence, replicas: int = 1) -> list:
        """[fn(item) for item in items], the items shared out across the ranks (contiguous
        blocks, rank order) and, inside each rank, across ``replicas`` threads; every rank
        gets the whole list back, in order (evaluation, decoding).  ``fn``'s results are
        pickled across ranks: return small host values (scores, token lists)."""
        items = list(items)
        lo, hi = shard_bounds(len(items), self.size)[self.rank]
        mine = parallel_map(fn, items[lo:hi], replicas)
        return [result for block in self.allgather(mine) for result in block]

    def check_same(self, **values: Any) -> None:
        """Refuse (every rank raises :class:`RanksDiffer`) if any named value differs
        between ranks: ``ctx.check_same(args=vars(args), data=fingerprint)``.  Values are
        compared by a hash of their ``repr``; the message names what differs and shows
        each rank's value (shortened)."""
        if self.size == 1:
            return
        mine = {name: (_digest(value), _short(value))
                for name, value in _flatten(values).items()}
        everyone = self.allgather(mine)
        problems = []
        for name in sorted(set().union(*everyone)):
            seen = {}
            for rank, entries in enumerate(everyone):
                digest, text = entries.get(name, ("(missing)", "(not given)"))
                seen.setdefault(digest, (text, []))[1].append(rank)
            if len(seen) > 1:
                groups = "; ".join(f"ranks {ranks}: {text}" for text, ranks in seen.values())
                problems.append(f"{name} differs between ranks ({groups})")
        if problems:
            raise RanksDiffer("the ranks were not started alike, refusing to train: "
                              + " | ".join(problems) + ". Start every rank with the same "
                              "command line, configuration and data.")


def _flatten(values: dict, prefix: str = "") -> dict:
    """{"a.b": leaf}: dicts and dataclasses opened (so a message names the field)."""
    flat = {}
    for name, value in values.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            flat.update(_flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _digest(value) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _short(value, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_SINGLE = Context(comm=None)
_context: Context | None = None


def current() -> Context:
    """The context :func:`setup` made, else a single process (rank 0 of 1)."""
    return _context or _SINGLE


def setup(*, quiet_workers: bool = True, keep_memory: bool = True,
          abort_on_error: bool = True) -> Context:
    """Join the ranks (once per process; later calls return the same context).

    * Started by an MPI launcher with several ranks: initialise MPI (mpi4py) and
      return this rank's :class:`Context`; otherwise a single-process context
      (mpi4py is not even imported).
    * ``quiet_workers``: standard output of ranks other than 0 goes to /dev/null, so
      the program's prints come once (errors, on standard error, still come from all).
    * ``keep_memory``: :func:`keep_freed_memory` (freed activations stay in the process).
    * ``abort_on_error``: an exception that ends this rank prints its traceback with
      the rank's number to standard error and aborts every rank (``MPI_Abort``):
      the others are not left waiting in a collective call forever.
    * CuPy installed with GPUs: this rank uses GPU ``local_rank % device_count``
      (call ``setup()`` before ``backend.set_backend("cupy")``).
    * Never a wait for ever: ``NPFORMER_MPI=0`` in a process a launcher started as one of
      several ranks is refused (:func:`refuse_a_lone_rank`), and a rank whose peers have
      not all joined within ``NPFORMER_MPI_TIMEOUT`` seconds (default 300) says so and
      stops (the launcher then ends the others).
    """
    global _context
    if _context is not None:
        return _context
    if keep_memory:
        keep_freed_memory()
    refuse_a_lone_rank()
    if not launched_by_mpi():
        _context = _SINGLE
        return _context
    if importlib.util.find_spec("mpi4py") is None:
        raise RuntimeError(
            "this process was started by an MPI launcher with several ranks, but mpi4py is "
            "not installed: pip install 'npformer[mpi]' (mpi4py and an MPICH wheel), or "
            "pip install mpi4py built against your cluster's MPI, or start one process "
            "without mpiexec")
    with _stop_unless_joined_within(join_timeout()):
        from mpi4py import MPI  # MPI_Init: waits for every rank of the launch

        comm = MPI.COMM_WORLD
        comm.Barrier()  # every rank has reached setup()
    machine = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this machine
    local_rank = machine.Get_rank()
    ctx = Context(comm=comm, rank=comm.Get_rank(), size=comm.Get_size(),
                  local_rank=local_rank, local_size=machine.Get_size())
    if abort_on_error and ctx.size > 1:
        _abort_all_on_uncaught_exception(ctx)
    if quiet_workers and not ctx.is_main:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    _share_cores(ctx.local_size)
    _select_gpu(local_rank)
    _context = ctx
    return ctx


JOIN_TIMEOUT = 300.0  # seconds the ranks wait for each other to start (NPFORMER_MPI_TIMEOUT)


def join_timeout() -> float:
    """Seconds a rank waits for the others to join (``NPFORMER_MPI_TIMEOUT``, else 300)."""
    text = os.environ.get("NPFORMER_MPI_TIMEOUT", "").strip()
    if not text:
        return JOIN_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"NPFORMER_MPI_TIMEOUT must be a positive number of seconds, "
                         f"got {text!r}")
    return seconds


class _stop_unless_joined_within:
    """Joining the ranks, in a ``with`` block: if it has not ended after ``seconds``,
    print why and kill this process (the launcher then ends the others).

    ``MPI_Init`` and the first barrier wait in C, holding the GIL, for ranks that may
    never come (one started with MPI off, or another program): no Python thread or
    signal handler runs there.  The watchdog is a forked child waiting on a pipe; the
    parent closes the pipe when it has joined (or dies, which closes it too)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        if not hasattr(os, "fork"):
            self.pipe = None
            return self
        read_end, self.pipe = os.pipe()
        parent = os.getpid()
        rank = next((os.environ[name] for name in _RANK_VARIABLES if name in os.environ), "?")
        self.watchdog = os.fork()
        if self.watchdog == 0:  # the watchdog
            os.close(self.pipe)
            joined, _, _ = select.select([read_end], [], [], self.seconds)
            if not joined:
                message = (f"npformer: rank {rank} waited "
                           f"{self.seconds:g} s for the other MPI ranks to join, and they did "
                           "not (one started with NPFORMER_MPI=0, or not running npformer?); "
                           "stopping it (NPFORMER_MPI_TIMEOUT sets the wait)\n")
                os.write(2, message.encode())
                os.kill(parent, signal.SIGKILL)
            os._exit(0)
        os.close(read_end)
        return self

    def __exit__(self, *exc_info):
        if self.pipe is not None:
            os.close(self.pipe)  # the watchdog wakes up and ends
            os.waitpid(self.watchdog, 0)
        return False


def _abort_all_on_uncaught_exception(ctx: Context) -> None:
    previous = sys.excepthook

    def hook(kind, error, tb):
        text = "".join(traceback.format_exception(kind, error, tb))
        sys.stderr.write(f"npformer rank {ctx.rank} of {ctx.size} failed, aborting all "
                         f"ranks:\n{text}")
        sys.stderr.flush()
        if kind is KeyboardInterrupt:
            previous(kind, error, tb)
        wait_until_read(sys.stderr)
        ctx.comm.Abort(1)

    sys.excepthook = hook


def wait_until_read(stream: Any, timeout: float = 5.0) -> None:
    """Where ``stream`` is a pipe (an MPI launcher's, forwarding a rank's output), wait
    until the reader has taken everything written to it, at most ``timeout`` seconds.

    ``MPI_Abort`` makes the launcher kill every rank and its own forwarding processes;
    text still in the pipe then is lost (seen in CI: the failing rank's message missing
    from the output).  Elsewhere (a terminal, a file) it returns at once."""
    try:
        import fcntl
        import termios

        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
        unread = bytearray(4)  # an int, filled by the ioctl
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fcntl.ioctl(fd, termios.FIONREAD, unread)  # bytes still in the pipe (Linux)
            if int.from_bytes(unread, sys.byteorder) == 0:
                return
            time.sleep(0.01)
    except (ImportError, OSError, ValueError, AttributeError):  # not POSIX, no descriptor
        return


BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _share_cores(local_size: int) -> None:
    """The ranks on one machine share its cores: each rank's BLAS gets cores / local_size
    threads (else every rank's BLAS starts one thread per core, and N ranks oversubscribe
    the machine N times).  A thread count the user set in the environment is kept."""
    if any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=max(1, (os.cpu_count() or 1) // local_size), user_api="blas")


def _select_gpu(local_rank: int) -> None:
    """CuPy installed with GPUs: this rank's device is ``local_rank % device_count``
    (before any array is made: call :func:`setup` before ``backend.set_backend``)."""
    if importlib.util.find_spec("cupy") is None:
        return
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - CuPy without a driver or device: the CPU it is
        return
    if count:
        cupy.cuda.Device(local_rank % count).use()


# --------------------------------------------------------------------------- gradients
class FlatGradients:
    """Every parameter's gradient (and one loss slot) in one contiguous buffer.

    ``pack`` copies the gradients in (they are rebound, never written in place, by the
    layers, so they cannot live in the buffer while the backward pass runs; the copy
    is one pass over the parameters' size); ``unpack`` makes each gradient a view of
    its slice (no copy back).  The buffer is allocated once and reused every step.
    """

    def __init__(self, params: Sequence[Parameter], xp: Any):
        self.xp = xp
        self.shapes = [tuple(p.shape) for p in params]
        sizes = [int(np.prod(shape)) for shape in self.shapes]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        self.slices = [(int(lo), int(hi)) for lo, hi in zip(offsets[:-1], offsets[1:])]
        dtype = params[0].data.dtype if params else backend.default_float()
        self.buffer = xp.zeros(int(offsets[-1]) + 1, dtype=dtype)  # (P + 1,): grads, loss

    def pack(self, params: Sequence[Parameter], loss: float) -> None:
        host = self.xp is np  # NumPy, or the strict backend's arrays copied to the host
        for p, (lo, hi) in zip(params, self.slices):
            grad = backend.to_numpy(p.grad) if host else p.grad
            self.buffer[lo:hi] = self.xp.reshape(grad, (-1,))
        self.buffer[-1] = loss

    def unpack(self, params: Sequence[Parameter]) -> float:
        for p, (lo, hi), shape in zip(params, self.slices, self.shapes):
            p.grad = self.xp.reshape(self.buffer[lo:hi], shape)
        return float(self.buffer[-1])


class _HostAllreduce:
    """MPI ``Allreduce`` (sum, in place) of a host buffer."""

    def __init__(self, comm):
        self.comm = comm

    def __call__(self, buffer) -> None:
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)


class _DeviceThroughHost:
    """A device buffer summed through host memory (an MPI without CUDA support)."""

    def __init__(self, comm):
        self.host = _HostAllreduce(comm)

    def __call__(self, buffer) -> None:
        import cupy

        staged = cupy.asnumpy(buffer)
        self.host(staged)
        buffer.set(staged)


class _CudaAwareMPI:
    """``Allreduce`` straight on a CuPy buffer: an MPI built with CUDA support reads
    device memory (mpi4py passes ``__cuda_array_interface__``)."""

    def __init__(self, comm):
        self.host = _HostAllreduce(comm)

    def __call__(self, buffer) -> None:
        import cupy

        cupy.cuda.get_current_stream().synchronize()  # the gradients are written
        self.host(buffer)


class _Nccl:
    """NCCL all-reduce on the current stream (``cupy.cuda.nccl``); rank 0 makes the
    communicator's id and MPI broadcasts it."""

    def __init__(self, comm):
        from cupy.cuda import nccl

        self.nccl = nccl
        uid = nccl.get_unique_id() if comm.Get_rank() == 0 else None
        uid = comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
        self.types = {np.dtype("float32"): nccl.NCCL_FLOAT32,
                      np.dtype("float64"): nccl.NCCL_FLOAT64,
                      np.dtype("float16"): nccl.NCCL_FLOAT16}

    def __call__(self, buffer) -> None:
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
        if chosen not in ("nccl", "mpi", "host"):
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


def make_allreduce(ctx: Context) -> Callable[[Any], None]:
    """The in-place sum across ranks for this backend's gradient buffers."""
    if backend.backend_name() != "cupy":
        return _HostAllreduce(ctx.comm)
    kind = gpu_allreduce_kind(ranks_share_a_gpu(ctx.comm))
    return {"nccl": _Nccl, "mpi": _CudaAwareMPI, "host": _DeviceThroughHost}[kind](ctx.comm)


def buffer_namespace() -> Any:
    """Gradient buffers live where the parameters do: CuPy on a GPU, NumPy otherwise
    (the strict backend's arrays are copied into a NumPy buffer and back)."""
    if backend.backend_name() == "cupy":
        import cupy

        return cupy
    return np


# --------------------------------------------------------------------------- the engine
def model_signature(model: Module) -> dict:
    """What must be equal on every rank before parameters are broadcast: the model's
    configuration and every parameter's name, shape and dtype."""
    return {"class": type(model).__name__, "config": getattr(model, "config", None),
            "parameters": [(name, tuple(p.shape), str(p.data.dtype))
                           for name, p in model.named_parameters()]}


def batch_fingerprint(batch: tuple) -> str:
    """A hash of a batch's arrays (shapes, dtypes, contents): equal batches, equal hashes."""
    digest = hashlib.sha256()
    for array in batch:
        array = np.ascontiguousarray(backend.to_numpy(array))
        digest.update(repr((array.shape, str(array.dtype))).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:16]


def broadcast_parameters(model: Module, ctx: Context) -> None:
    """Every rank's parameters become rank 0's (one host broadcast per parameter, once)."""
    for p in model.parameters():
        values = np.ascontiguousarray(backend.to_numpy(p.data))
        ctx.comm.Bcast(values, root=0)
        p.assign(backend.asarray(values, dtype=p.data.dtype))  # into a flat view, if any


class DistributedDataParallel:
    """The trainer's data-parallel engine across MPI ranks (threads inside each rank).

    ``loss_and_grad(task, global_batch, grad_scale, seed)`` runs this rank's rows of the
    global batch and returns (this rank's share of the global mean loss, the global
    count); ``reduce_step(summed share)`` makes the one all-reduce of the step and
    returns the step's global mean loss.  Everything that must match across ranks is
    checked on construction (model) and on the first batch (data).
    """

    def __init__(self, model: Module, replicas: int = 1, ctx: Context | None = None, **same: Any):
        self.ctx = ctx or current()
        if self.ctx.size < 2 or self.ctx.comm is None:
            raise ValueError("DistributedDataParallel needs at least 2 MPI ranks; run under "
                             "mpiexec -n N (with one process, use parallel.DataParallel)")
        self.model = model
        self.local = DataParallel(model, replicas)
        self.ctx.check_same(model=model_signature(model), replicas=replicas, **same)
        broadcast_parameters(model, self.ctx)
        params = model.parameters()
        self.flat = FlatGradients(params, buffer_namespace())
        self._loss = np.zeros(1, dtype=np.float64)  # the loss shares, beside a flat buffer
        self.allreduce = make_allreduce(self.ctx)
        self._data_checked = False

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    def my_rows(self, rows: int) -> tuple[int, int]:
        return shard_bounds(rows, self.ctx.size)[self.ctx.rank]

    def loss_and_grad(self, task: Task, batch: tuple, grad_scale: float,
                      seed: int) -> tuple[float, int]:
        """This rank's rows of ``batch`` (the global batch, the same on every rank):
        forward + backward of its loss weighted by n_r / n -> (n_r / n * L_r, n)."""
        if not self._data_checked:
            self.ctx.check_same(data=batch_fingerprint(batch))
            self._data_checked = True
        shards = [tuple(a[lo:hi] for a in batch)
                  for lo, hi in shard_bounds(batch[0].shape[0], self.ctx.size)]
        counts = [task.count(shard) if shard[0].shape[0] else 0 for shard in shards]
        total, mine = sum(counts), counts[self.ctx.rank]
        if total == 0:
            raise ValueError("the global batch has no counted items (task.count is 0)")
        if mine == 0:  # no rows (or no counted items) here: a zero gradient, a zero share
            return 0.0, total
        replicas = len(self.local.models)
        loss, _ = self.local.loss_and_grad(task, shards[self.ctx.rank],
                                           grad_scale * mine / total,
                                           seed + self.ctx.rank * replicas)
        return loss * mine / total, total

    def reduce_step(self, loss_share: float) -> float:
        """The step's one all-reduce: gradients and loss shares summed over the ranks, in
        place; the parameters' gradients become views of the summed buffer.  Where the
        gradients already live in one flat buffer (:class:`npformer.nn.FlatParameters`,
        the fast tier's optimizers), that buffer is sent as it is, with no packing copy,
        and the loss shares in a one-element buffer of their own."""
        params = self.model.parameters()
        flat = flat_parameters_of(params)
        if flat is not None and buffer_namespace() is np:
            self.allreduce(flat.grad)
            self._loss[0] = loss_share
            self.allreduce(self._loss)
            return float(self._loss[0])
        self.flat.pack(params, loss_share)
        self.allreduce(self.flat.buffer)
        loss = self.flat.unpack(params)
        if backend.backend_name() == "strict":  # back to the strict namespace
            for p in params:
                p.grad = backend.asarray(p.grad)
        return loss

    def from_main(self, value: Any) -> Any:
        return self.ctx.from_main(value)


def data_parallel(model: Module, replicas: int = 1,
                  **same: Any) -> DataParallel | DistributedDataParallel:
    """The trainer's engine: :class:`DistributedDataParallel` across the ranks when the
    process runs under an MPI launcher with several ranks (joining them with
    :func:`setup` if the program has not), else :class:`DataParallel` (threads).
    ``same``: values every rank must share (checked before the first step)."""
    ctx = current()
    if _context is None:
        refuse_a_lone_rank()
    if ctx.size == 1 and _context is None and launched_by_mpi():
        ctx = setup()
    if ctx.size > 1:
        return DistributedDataParallel(model, replicas, ctx, **same)
    return DataParallel(model, replicas)
