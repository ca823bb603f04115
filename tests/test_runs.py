"""A demo's run, its ranks and its folder (issue 37): one test per case, each failing on
the code before the change.

* the self-launched ranks: another MPI's mpiexec named (case 5), an environment variable
  checked before the launch (7), a rank refusing MPI ends its launch at once (8), a
  time budget that ends before the first evaluation on 2 ranks (28), option errors
  printed once, before the launch (32);
* resuming: the data a run was started on, restored and checked by its content (11,
  30); on another number of ranks, or without mpiexec, the run's workers kept and what
  changed said (4, 31); a broken checkpoint is one error line naming the file (26);
* the folder: a finished run of other settings is refused, ``--overwrite`` removes every
  file of it (29);
* an ensemble stopped by ``--stop-after N`` says N (33).

The signal cases (1-3) are in tests/test_signals.py.  MPI cases carry the ``mpi`` mark.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from npformer.checkpoint import load_checkpoint
from npformer.parallel import relaunch

ROOT = Path(__file__).resolve().parents[1]
DEMOS = ROOT / "demos"
CLEAN = (relaunch.LAUNCHED_MARK, *relaunch.LAUNCHER_VARIABLES, "NPFORMER_BACKEND",
         "NPFORMER_MPI_TIMEOUT")
ONE = ("--procs", "1", "--replicas", "2")  # one process of 2 thread replicas, any machine


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from tests.test_demos import SHARED_DATA, synthetic_data

    return SHARED_DATA if SHARED_DATA.is_dir() else synthetic_data(
        tmp_path_factory.mktemp("data"))


def environment(data: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    env.update(PYTHONPATH=str(ROOT), NPFORMER_DATA=str(data), **extra)
    return env


def demo(script: str, *args: str, data: Path, mpiexec: str | None = "found",
         **env: str) -> subprocess.CompletedProcess:
    """``python demos/SCRIPT ARGS`` as a user types it; ``mpiexec``: "found" (as
    installed), None (none found), or the path of the one the demo is to find."""
    command = [sys.executable, str(DEMOS / script), "--no-progress", *args]
    if mpiexec != "found":
        command = [sys.executable, "-c", (
            "import runpy, sys; import npformer.parallel.relaunch as relaunch; "
            f"relaunch.find_mpiexec = lambda: {mpiexec!r}; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')"), *command[1:]]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=environment(data, **env))


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    """The ``error:`` lines of a run that failed with status 2, no traceback."""
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]


def metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def need_mpi() -> None:
    from tests.test_distributed import mpiexec

    mpiexec()  # a skip (or a CI error) where MPI is missing


# =========================================================================== the ranks
FAKE_MPIEXEC = '''#!{python}
"""An mpiexec of another MPI, as mpi4py built with MPICH sees it: N copies, each told
by its own variables that it is one of N."""
import os, subprocess, sys
args = sys.argv[1:]
n = int(args[args.index("-n") + 1])
command = args[args.index("-n") + 2:]
told = {told}
copies = [subprocess.Popen(command, env=dict(os.environ, **{{k: v.format(n=n, r=r)
                                                         for k, v in told.items()}}))
          for r in range(n)]
sys.exit(max(copy.wait() for copy in copies))
'''


@pytest.mark.mpi
@pytest.mark.parametrize("told, named", [
    ({"OMPI_COMM_WORLD_SIZE": "{n}", "OMPI_COMM_WORLD_RANK": "{r}"},
     r"Open MPI's mpiexec started this process as one of 2 ranks \(OMPI_COMM_WORLD_SIZE=2\),"
     r" but the MPI that mpi4py was built with \(.+\) sees 1: the mpiexec found comes from "
     r"another MPI"),
    ({"PMIX_RANK": "{r}"},  # no size variable npformer reads
     r"\S+mpiexec was asked for 2 MPI ranks, but this process runs as one of 1: that mpiexec "
     r"belongs to another MPI than the one mpi4py was built with"),
])
def test_case05_an_mpiexec_of_another_mpi_is_named(told, named, data, tmp_path):
    """Before: each copy ran alone, and the second one to reach the folder said it was "in
    use by another run" (its twin)."""
    need_mpi()
    fake = tmp_path / "bin" / "mpiexec"
    fake.parent.mkdir()
    fake.write_text(FAKE_MPIEXEC.format(python=sys.executable, told=told))
    fake.chmod(0o755)
    result = demo("generate.py", "--smoke", "--procs", "2", "--out", str(tmp_path / "run"),
                  data=data, mpiexec=str(fake))
    errors = error_lines(result)
    assert len(errors) == 1 and re.search(named, errors[0]), result.stderr[-3000:]
    assert "in use by another run" not in result.stderr


@pytest.mark.mpi
def test_case07_a_bad_join_timeout_is_one_error_line_before_the_launch(data, tmp_path):
    """Before: each self-launched rank printed a ValueError traceback."""
    need_mpi()
    result = demo("generate.py", "--smoke", "--procs", "2", "--out", str(tmp_path),
                  data=data, NPFORMER_MPI_TIMEOUT="abc")
    assert error_lines(result) == ["error: NPFORMER_MPI_TIMEOUT must be a positive number "
                                   "of seconds, got 'abc'"]
    assert "MPI ranks" not in result.stdout  # refused before starting them


JOIN = ("from npformer import parallel; ctx = parallel.setup(); ctx.barrier(); "
        "print('joined', ctx.rank, ctx.size)")


@pytest.mark.mpi
def test_case08_a_rank_refusing_mpi_ends_its_peers_at_once(tmp_path):
    """mpiexec -n 1 env NPFORMER_MPI=0 python ... : -n 1 python ...  Before: the peer
    waited its whole join timeout (here 60 s; 300 by default) before it stopped."""
    from tests.test_distributed import mpiexec

    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    env.update(PYTHONPATH=str(ROOT), NPFORMER_MPI_TIMEOUT="60")
    started = time.perf_counter()
    result = subprocess.run([mpiexec(), "-n", "1", "env", "NPFORMER_MPI=0", sys.executable,
                             "-c", JOIN, ":", "-n", "1", sys.executable, "-c", JOIN],
                            env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    elapsed = time.perf_counter() - started
    output = result.stdout + result.stderr
    assert elapsed < 30, f"the peer stopped after {elapsed:.0f} s: {output[-3000:]}"
    assert result.returncode != 0 and "joined" not in result.stdout, output
    assert "error: NPFORMER_MPI=0 turns MPI off, but an MPI launcher started this process " \
        "as one of 2 ranks (PMI_SIZE=2)" in output, output


@pytest.mark.mpi
def test_case28_a_budget_ending_before_the_first_evaluation_keeps_the_run(data, tmp_path):
    """translate.py --max-minutes on 2 ranks, the budget ending before the first scheduled
    evaluation.  Before: rank 1 read model.npz while rank 0 was still writing it ("no
    checkpoint at ..."), and the abort that followed killed rank 0 mid-write: a
    .model.npz.<pid>.tmp left, no last.npz, the run lost."""
    need_mpi()
    out = tmp_path / "run"
    ok(demo("translate.py", "--smoke", "--procs", "2", "--max-minutes", "0.0001",
            "--out", str(out), data=data))
    assert (out / "model.npz").is_file() and (out / "last.npz").is_file()
    assert not list(out.glob(".*.tmp"))
    last = load_checkpoint(out / "last.npz")
    assert last.extra["trainer"]["finished"] and last.step == metrics(out)["updates"]


@pytest.mark.mpi
@pytest.mark.parametrize("args, message", [
    (("--d-model", "30", "--num-heads", "4"), "--d-model 30 is not divisible by --num-heads 4"),
    (("--overwrite", "--resume"), "--resume continues the saved run and --overwrite"),
])
def test_case32_an_option_error_is_printed_once_before_the_launch(args, message, data,
                                                                   tmp_path):
    """Before: each rank printed its usage and the error, after "running on 2 MPI ranks"."""
    need_mpi()
    result = demo("generate.py", "--smoke", "--procs", "2", "--out", str(tmp_path), *args,
                  data=data)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "MPI ranks" not in result.stdout
    assert result.stderr.count("usage:") == 1 and result.stderr.count(message) == 1, \
        result.stderr


# =========================================================================== resuming
def test_case11_a_resume_on_other_data_is_refused_naming_both(data, tmp_path):
    """Before: --resume --data other.txt continued the run on the other corpus."""
    text = (data / "tinyshakespeare" / "input.txt").read_text()[:200_000]
    mine, other = tmp_path / "mine.txt", tmp_path / "other.txt"
    mine.write_text(text)
    other.write_text(text[::-1])
    out = tmp_path / "run"
    stopped = demo("generate.py", "--smoke", *ONE, "--data", str(mine), "--out", str(out),
                   "--stop-after", "3", data=data)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    refused = demo("generate.py", "--out", str(out), "--resume", "--data", str(other),
                   *ONE, data=data)
    (error,) = error_lines(refused)
    assert str(mine) in error and str(other) in error and "holds other data" in error, error
    mine.write_text(text[:-1000])  # the same file, changed since the run started
    (error,) = error_lines(demo("generate.py", "--out", str(out), "--resume", *ONE,
                                data=data))
    assert f"--data {mine}" in error and "has changed since" in error, error
    mine.write_text(text)
    moved = tmp_path / "moved.txt"
    mine.rename(moved)  # the same data under another name: it is the run's data
    ok(demo("generate.py", "--out", str(out), "--resume", "--data", str(moved), *ONE,
            data=data))


def own_reviews(path: Path, rows: int = 160) -> Path:
    rng = np.random.default_rng(0)
    words = {"pos": "great superb wonderful moving".split(),
             "neg": "awful boring terrible dull".split()}
    lines = ["text,label"]
    for i in range(rows):
        label = "pos" if i % 2 else "neg"
        lines.append(" ".join(rng.choice(words[label] + ["the", "film", "was"], size=12))
                     + f",{label}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_case30_a_resume_takes_back_the_data_it_was_started_on(data, tmp_path):
    """An own-data run stopped, then `--out DIR --resume` alone.  Before: it loaded IMDB
    and failed on the vocabulary size ("vocab_size: checkpoint 52, model 20002")."""
    mine = own_reviews(tmp_path / "mine.csv")
    out = tmp_path / "run"
    stopped = demo("imdb.py", "--smoke", *ONE, "--data", str(mine), "--out", str(out),
                   "--stop-after", "3", data=data)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    resumed = ok(demo("imdb.py", "--out", str(out), "--resume", *ONE, data=data))
    assert "no test file" in resumed.stdout  # the own data's report: no IMDB test split
    whole = tmp_path / "whole"
    ok(demo("imdb.py", "--smoke", *ONE, "--data", str(mine), "--out", str(whole), data=data))
    assert metrics(out)["val_accuracy"] == metrics(whole)["val_accuracy"]
    assert metrics(out)["member_updates"] == metrics(whole)["member_updates"]


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["--procs 1", "no mpiexec"])
def test_case04_case31_a_two_rank_run_resumes_in_one_process_on_its_workers(how, data,
                                                                           tmp_path):
    """A run stopped on 2 ranks, resumed with --procs 1 (case 31: refused, "it used --procs
    2, not 1", while the README says a run resumes on any number of ranks) or where
    mpiexec is no longer found (case 4: it went on in one process with one replica and
    said nothing; its validation loss differed from the uninterrupted run's).  Now it
    continues on one process of 2 replicas, the run's 2 workers, says so, and ends with
    the figures of the uninterrupted run."""
    need_mpi()
    out = tmp_path / "run"
    stopped = demo("generate.py", "--smoke", "--procs", "2", "--out", str(out),
                   "--stop-after", "5", data=data)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    if how == "--procs 1":
        resumed = demo("generate.py", "--out", str(out), "--resume", "--procs", "1", data=data)
    else:
        resumed = demo("generate.py", "--out", str(out), "--resume", data=data, mpiexec=None)
        assert "note: the saved run's 2 MPI ranks need mpi4py and an mpiexec" in resumed.stderr
    ok(resumed)
    assert "note: the run was on 2 MPI ranks x 1 replica; it continues on 1 process x 2 " \
        "replicas: the same 2 workers" in resumed.stderr, resumed.stderr
    whole = tmp_path / "whole"
    ok(demo("generate.py", "--smoke", *ONE, "--out", str(whole), data=data))
    assert metrics(out)["updates"] == metrics(whole)["updates"] == 20
    assert metrics(out)["val_loss"] == pytest.approx(metrics(whole)["val_loss"], rel=1e-6)


def rewrite(path: Path, change) -> None:
    """Rewrite the checkpoint ``path`` with ``change(arrays)`` applied to its entries."""
    with np.load(path) as saved:
        arrays = {name: saved[name] for name in saved.files}
    change(arrays)
    np.savez(path, **arrays)


def drop_a_parameter(arrays: dict) -> None:
    del arrays[next(name for name in arrays if name.startswith("param/blocks.0."))]


def negate_second_moments(arrays: dict) -> None:
    for name in [name for name in arrays if name.startswith("optim/v.")]:
        arrays[name] = -1.0 - arrays[name]


@pytest.mark.parametrize("mode, engine, change, expected", [
    ("--resume", "textbook", drop_a_parameter, r"last\.npz cannot be resumed: .*missing"),
    ("--sample-only", "textbook", drop_a_parameter, r"model\.npz cannot be used: .*missing"),
    ("--resume", "fast", negate_second_moments, r"last\.npz cannot be resumed: .*negative"),
])
def test_case26_a_broken_checkpoint_is_one_error_line_naming_the_file(mode, engine, change,
                                                                      expected, data,
                                                                      tmp_path):
    """A checkpoint missing a parameter (one array per parameter, in either tier), or with
    negative Adam second moments.  Before: a traceback (ValueError: state_dict does not
    fit CausalLM: missing keys)."""
    out = tmp_path / "run"
    if mode == "--resume":
        run = demo("generate.py", "--smoke", *ONE, "--tier", engine, "--out", str(out),
                   "--stop-after", "2", data=data)
        assert run.returncode == 130, run.stderr[-3000:]
        rewrite(out / "last.npz", change)
    else:
        ok(demo("generate.py", "--smoke", *ONE, "--tier", engine, "--out", str(out),
                "--max-iters", "1", data=data))
        rewrite(out / "model.npz", change)
    (error,) = error_lines(demo("generate.py", "--out", str(out), mode, *ONE, data=data))
    assert re.search(expected, error) and str(out) in error, error


# =========================================================================== the folder
def test_case29_a_finished_run_of_other_settings_is_refused_and_overwrite_clears_it(
        data, tmp_path):
    """A folder holding a finished run, then a run of other settings into it.  Before: it
    replaced model.npz and left the old run's other files beside it (an ensemble's
    model-3.npz, curves-3.png): --predict then mixed the two."""
    out = tmp_path / "run"
    ok(demo("generate.py", "--smoke", *ONE, "--out", str(out), data=data))
    ok(demo("generate.py", "--smoke", *ONE, "--out", str(out), data=data))  # the same: fine
    (out / "model-3.npz").write_bytes((out / "model.npz").read_bytes())  # an old member's
    (out / "curves-3.png").write_bytes(b"png")
    (out / "notes.txt").write_text("the user's own file")
    refused = demo("generate.py", "--smoke", *ONE, "--seed", "1", "--out", str(out), data=data)
    (error,) = error_lines(refused)
    assert f"{out} holds a finished run of other settings (--seed 0, not 1)" in error
    assert "--overwrite" in error and "--resume" in error, error
    ok(demo("generate.py", "--smoke", *ONE, "--seed", "1", "--out", str(out), "--overwrite",
            data=data))
    assert not (out / "model-3.npz").exists() and not (out / "curves-3.png").exists()
    assert (out / "notes.txt").read_text() == "the user's own file"  # not the run's
    assert load_checkpoint(out / "model.npz").extra["run"]["settings"]["seed"] == 1


# =========================================================================== the ensemble
def test_case33_an_ensembles_stop_after_is_reported_as_typed(data, tmp_path):
    """--stop-after counts every member's updates; stopped in member 2.  Before: the
    message said member 2's own count (stop_after=2 after update 2)."""
    mine = own_reviews(tmp_path / "mine.csv")
    first = ok(demo("imdb.py", "--smoke", *ONE, "--data", str(mine), "--out",
                    str(tmp_path / "whole"), data=data))
    per_member = int(re.search(r"member 1 of 2 .*; (\d+) updates", first.stdout)[1])
    stop = per_member + 2
    stopped = demo("imdb.py", "--smoke", *ONE, "--data", str(mine), "--out",
                   str(tmp_path / "run"), "--stop-after", str(stop), data=data)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert f"training stopped (stop_after={stop}) after update {stop}; the run is saved in " \
        f"{tmp_path / 'run' / 'last-2.npz'}" in stopped.stderr, stopped.stderr
