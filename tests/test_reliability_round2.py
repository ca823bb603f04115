"""Reliability, second round (issue 18): where the library's own features meet.

One test per numbered case of the issue (case 3, the caches of the two tiers, lives with
the op contracts); each failed on the code before the fix.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for name in ("NPFORMER_MPI", "PMI_SIZE", "PMI_RANK"):
        env.pop(name, None)
    env.update(extra)
    return env


# --------------------------------------------------------------------------- case 1
JOIN = "from npformer import distributed; ctx = distributed.setup(); ctx.barrier(); print('joined', ctx.rank, ctx.size)"


@pytest.mark.mpi
def test_case01_a_rank_with_mpi_turned_off_stops_every_rank_with_a_message():
    """mpiexec -n 1 env NPFORMER_MPI=0 python ... : -n 1 python ...: before, rank 0 ran
    alone and rank 1 waited in MPI_Init for ever.  Now rank 0 refuses (it is one of 2
    ranks) and rank 1 stops after NPFORMER_MPI_TIMEOUT seconds, each with a message."""
    from tests.test_distributed import mpiexec

    started = time.perf_counter()
    proc = subprocess.run([mpiexec(), "-n", "1", "env", "NPFORMER_MPI=0", sys.executable,
                           "-c", JOIN, ":", "-n", "1", sys.executable, "-c", JOIN],
                          env=_env(NPFORMER_MPI_TIMEOUT="5"), capture_output=True, text=True,
                          timeout=90)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "NPFORMER_MPI=0 turns MPI off, but an MPI launcher started this process as one " \
        "of 2 ranks (PMI_SIZE=2)" in output, output
    assert "rank 1 waited 5 s for the other MPI ranks to join" in output, output
    assert "joined" not in output
    assert time.perf_counter() - started < 60


@pytest.mark.mpi
def test_case01_ranks_that_all_join_are_not_stopped():
    from tests.test_distributed import mpiexec

    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c", JOIN],
                          env=_env(NPFORMER_MPI_TIMEOUT="30"), capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "joined 0 2" in proc.stdout
