"""Launcher detection: was this process started by an MPI launcher, as one of how many ranks?

mpiexec / mpirun (MPICH's Hydra, Intel MPI, Open MPI, MVAPICH) and srun set variables
in every rank they start; reading them tells, before MPI is even imported, whether to
join the ranks.  ``NPFORMER_MPI=1`` forces MPI on, ``=0`` turns it off.
"""
from __future__ import annotations

import os

# Environment variables a launcher sets in every rank: MPICH/Hydra and Intel MPI
# (PMI_SIZE), Open MPI (OMPI_COMM_WORLD_SIZE), PMIx launchers such as srun (PMIX_RANK
# with SLURM_NTASKS / PMI_SIZE).
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK")
_OFF = ("0", "false", "no")


# The per-process size variables of the launchers that set one, and whose they are.
LAUNCHER_OF = {"PMI_SIZE": "MPICH's (Hydra) or Intel MPI's", "OMPI_COMM_WORLD_SIZE": "Open MPI's",
               "MV2_COMM_WORLD_SIZE": "MVAPICH's"}


def launched_by_mpi() -> bool:
    """True when an MPI launcher (mpiexec, mpirun, srun) started this process with
    more than one rank (``NPFORMER_MPI=1`` forces it, ``=0`` turns MPI off)."""
    forced = os.environ.get("NPFORMER_MPI")
    if forced is not None:
        return forced.strip() not in ("", *_OFF)
    return launcher_size() is not None


def launcher_size() -> tuple[str, int] | None:
    """(variable, ranks) where an MPI launcher's environment says this process is one of
    several ranks, else None (whatever ``NPFORMER_MPI`` says)."""
    for name in SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return name, int(value)
    return None


def launcher_rank() -> str:
    """This process's rank as the launcher's environment says it ("?" where none does):
    for messages written before MPI can tell."""
    return next((os.environ[name] for name in RANK_VARIABLES if name in os.environ), "?")


def refuse_a_lone_rank() -> None:
    """``NPFORMER_MPI=0`` in a process an MPI launcher started as one of several ranks:
    refuse (:class:`LoneRank`).  The other ranks would wait for this one in ``MPI_Init``
    for ever (an MPMD launch, ``mpiexec -n 1 env NPFORMER_MPI=0 python a.py : -n 1 python
    a.py``): :func:`npformer.parallel.failure.end_the_launch` ends them."""
    forced = os.environ.get("NPFORMER_MPI", "").strip()
    found = launcher_size()
    if forced in _OFF and found is not None:
        name, ranks = found
        raise LoneRank(
            f"NPFORMER_MPI={forced} turns MPI off, but an MPI launcher started this process "
            f"as one of {ranks} ranks ({name}={ranks}): the other ranks would wait for it "
            "for ever. Start it without mpiexec to run one process, or leave NPFORMER_MPI "
            "out to join the ranks")


class LoneRank(RuntimeError):
    """A process an MPI launcher started as one of several ranks, with MPI turned off."""


def refuse_another_mpi(size: int, library: str) -> None:
    """After joining: the ``size`` ranks MPI sees must be the ranks the launcher says it
    started.  Copies that each see themselves alone were started by the mpiexec of another
    MPI than the one mpi4py was built with (``library``): refuse, naming both."""
    for name, whose in LAUNCHER_OF.items():
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) != size:
            raise RuntimeError(
                f"{whose} mpiexec started this process as one of {value} ranks ({name}="
                f"{value}), but the MPI that mpi4py was built with ({library}) sees "
                f"{size}: the mpiexec found comes from another MPI. Use mpi4py's own "
                "(pip install 'npformer[mpi]' brings MPICH's mpiexec), or start one process "
                "without mpiexec")
