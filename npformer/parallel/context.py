"""Joining the ranks (:func:`setup`) and this process's place among them (:class:`Context`).

:class:`Context` is the communicator :class:`npformer.parallel.DataParallel` sums
through (see that module): rank, size, an in-place ``allreduce`` of one flat buffer
(``start_allreduce``: the same without waiting, a gradient bucket's), ``allgather``,
``from_main`` and ``check_same``.  A single process is rank 0 of 1, whose collectives
return their input; mpi4py is imported only when a launcher started several ranks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..backend import keep_freed_memory
from . import fingerprint, transports
from .buckets import DONE
from .failure import (
    abort_all_on_uncaught_exception,
    end_the_launch,
    join_timeout,
    stop_unless_joined_within,
)
from .launcher import LoneRank, launched_by_mpi, refuse_a_lone_rank, refuse_another_mpi
from .placement import select_gpu, share_cores
from .replicas import parallel_map
from .shards import shard_bounds


class RanksDiffer(RuntimeError):
    """The ranks were started with different configurations, data or models."""


@dataclasses.dataclass(frozen=True)
class Context:
    """Who this process is among the ranks, and the collective calls.

    ``comm`` is the mpi4py communicator (None in a single process without MPI).
    ``local_rank`` is the rank among the ``local_size`` ranks on this machine (GPU
    choice, and the cores each rank may use).
    """

    comm: Any | None
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    _sums: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, plots, writes metrics and checkpoints."""
        return self.rank == 0

    @property
    def alone(self) -> bool:
        """A single process: every collective returns its input."""
        return self.comm is None or self.size == 1

    # ----------------------------------------------------------------- collectives
    def allreduce(self, buffer: Any) -> None:
        """``buffer`` (a flat NumPy array, or CuPy on a GPU) becomes the sum of every
        rank's, in place.  The transport (:mod:`.transports`) is chosen on first use."""
        if self.alone:
            return
        on_device = not isinstance(buffer, np.ndarray)
        if on_device not in self._sums:
            self._sums[on_device] = transports.make_allreduce(self.comm, on_device)
        self._sums[on_device](buffer)

    def start_allreduce(self, buffer: Any) -> Any:
        """The sum of ``buffer`` in place started without waiting (a host buffer:
        ``MPI_Iallreduce``) -> a handle: ``test()`` progresses it, ``wait()`` ends it;
        nothing may touch the buffer meanwhile.  A device buffer is summed at once (its
        transports block), as is nothing in a process alone."""
        if self.alone or not isinstance(buffer, np.ndarray):
            self.allreduce(buffer)
            return DONE
        if False not in self._sums:
            self._sums[False] = transports.make_allreduce(self.comm, False)
        return self._sums[False].start(buffer)

    def allgather(self, value: Any) -> list:
        """[value of rank 0, value of rank 1, ...] on every rank (any picklable value)."""
        return [value] if self.alone else self.comm.allgather(value)

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank (a decision all must share)."""
        return value if self.alone else self.comm.bcast(value, root=0)

    def barrier(self) -> None:
        if not self.alone:
            self.comm.Barrier()

    def abort_others(self, code: int) -> None:
        """After this rank has reported its failure: end every rank (``MPI_Abort``), so
        none is left waiting in a collective call; nothing in a single process."""
        if not self.alone:
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
        between ranks: ``ctx.check_same(args=vars(args), data=batch)``.  Values are
        compared by a hash (:mod:`.fingerprint`); the message names what differs and
        shows each rank's value (shortened)."""
        if self.alone:
            return
        problems = fingerprint.differences(self.allgather(fingerprint.fingerprints(values)))
        if problems:
            raise RanksDiffer("the ranks were not started alike, refusing to train: "
                              + " | ".join(problems) + ". Start every rank with the same "
                              "command line, configuration and data.")


SINGLE = Context(comm=None)  # a process alone: rank 0 of 1
_context: Context | None = None


def current() -> Context:
    """The context :func:`setup` made, else a single process (rank 0 of 1)."""
    return _context or SINGLE


def setup(*, quiet_workers: bool = True, keep_memory: bool = True,
          abort_on_error: bool = True) -> Context:
    """Join the ranks (once per process; later calls return the same context).

    * Started by an MPI launcher with several ranks: initialise MPI (mpi4py) and
      return this rank's :class:`Context`; otherwise a single-process context
      (mpi4py is not even imported).
    * ``quiet_workers``: standard output of ranks other than 0 goes to /dev/null, so
      the program's prints come once (errors, on standard error, still come from all).
    * ``keep_memory``: :func:`npformer.backend.keep_freed_memory` (freed
      activations stay in the process).
    * ``abort_on_error``: an exception that ends this rank prints its traceback with
      the rank's number to standard error and aborts every rank (``MPI_Abort``):
      the others are not left waiting in a collective call forever.
    * CuPy installed with GPUs: this rank uses GPU ``local_rank % device_count``
      (call ``setup()`` before ``backend.set_backend("cupy")``).
    * Never a wait for ever: ``NPFORMER_MPI=0`` in a process a launcher started as one of
      several ranks is refused (:func:`~.launcher.refuse_a_lone_rank`) and ends every rank
      at once (:func:`~.failure.end_the_launch`), and a rank whose peers have not all
      joined within ``NPFORMER_MPI_TIMEOUT`` seconds (default 300) says so and stops (the
      launcher then ends the others).
    * One MPI: ranks that each see themselves alone although the launcher started several
      (an mpiexec of another MPI than mpi4py's) are refused, naming both
      (:func:`~.launcher.refuse_another_mpi`).
    """
    global _context
    if _context is not None:
        return _context
    if keep_memory:
        keep_freed_memory()
    _join_or_end_the_launch()
    if not launched_by_mpi():
        _context = SINGLE
        return _context
    if importlib.util.find_spec("mpi4py") is None:
        raise RuntimeError(
            "this process was started by an MPI launcher with several ranks, but mpi4py is "
            "not installed: pip install 'npformer[mpi]' (mpi4py and an MPICH wheel), or "
            "pip install mpi4py built against your cluster's MPI, or start one process "
            "without mpiexec")
    with stop_unless_joined_within(join_timeout()), warnings.catch_warnings(), \
            python_signal_handlers_kept():
        # mpi4py's own warning on another MPI's launcher: refuse_another_mpi says more
        warnings.filterwarnings("ignore", "suspicious MPI execution environment")
        from mpi4py import MPI  # MPI_Init: waits for every rank of the launch

        comm = MPI.COMM_WORLD
        comm.Barrier()  # every rank has reached setup()
    refuse_another_mpi(comm.Get_size(), " ".join(MPI.Get_library_version().split("\n")[0].split()))
    machine = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this machine
    ctx = Context(comm=comm, rank=comm.Get_rank(), size=comm.Get_size(),
                  local_rank=machine.Get_rank(), local_size=machine.Get_size())
    if abort_on_error and ctx.size > 1:
        abort_all_on_uncaught_exception(ctx.rank, ctx.size, comm.Abort)
    if quiet_workers and not ctx.is_main:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    share_cores(ctx.local_size)
    select_gpu(ctx.local_rank)
    _context = ctx
    return ctx


@contextlib.contextmanager
def python_signal_handlers_kept() -> Iterator[None]:
    """Joining MPI leaves the program's signal handlers as they were.  ``MPI_Init``
    (MPICH's) installs a C handler of its own for SIGHUP, under Python's: a Python handler
    set before (a demo's, which stops and saves the run) would never run.  Each handler
    Python holds is set again after the block."""
    held = {s: signal.getsignal(s) for s in signal.Signals}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():  # (else none is Python's)
            for s, handler in held.items():
                if callable(handler):
                    signal.signal(s, handler)


def join_if_launched() -> Context:
    """The ranks a trainer runs on: those :func:`setup` joined; else, when an MPI launcher
    started this process as one of several, they are joined now; else this process
    alone (its allocator left as it is)."""
    if _context is not None:
        return _context
    _join_or_end_the_launch()
    return setup() if launched_by_mpi() else SINGLE


def _join_or_end_the_launch() -> None:
    """A process with MPI turned off that a launcher started as one of several ranks
    refuses (:class:`~.launcher.LoneRank`), and ends the launch: its peers would wait."""
    try:
        refuse_a_lone_rank()
    except LoneRank as refused:
        end_the_launch(str(refused))
        raise
