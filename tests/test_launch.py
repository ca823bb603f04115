"""A demo's default command re-launches itself on one MPI rank per core
(npformer/parallel/relaunch.py): when it does and when it does not, that the ranks' figures are one
process's, and that exit codes and messages come through once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from npformer.parallel import relaunch

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ROOT / "demos" / "generate.py"
CLEAN = {name: None for name in (relaunch.LAUNCHED_MARK, *relaunch.LAUNCHER_VARIABLES,
                                 "NPFORMER_BACKEND")}


def options(**given):
    return SimpleNamespace(**{"procs": None, "replicas": None, "backend": None,
                              "resume": False, "out": "runs/x", **given})


# =========================================================================== the decision
@pytest.mark.parametrize("given, training, environ, expected", [
    ({}, True, {}, "cores"),                                  # the default: every core
    ({"procs": 3}, True, {}, 3),
    ({"procs": 1}, True, {}, 1),                              # the opt-out
    ({"replicas": 2}, True, {}, 1),                           # thread replicas by name
    ({"replicas": 2, "procs": 2}, True, {}, 2),
    ({"tier": "textbook"}, True, {}, 1),                      # the textbook: one process
    ({"tier": "textbook", "procs": 2}, True, {}, 2),          # unless ranks are asked for
    ({"tier": "fast"}, True, {}, "cores"),
    ({}, False, {}, 1),                                       # sampling, predicting
    ({"backend": "cupy"}, True, {}, 1),                       # one GPU, one process
    ({}, True, {"NPFORMER_BACKEND": "cupy"}, 1),
    ({"procs": 2}, True, {"PMI_SIZE": "2"}, 1),               # mpiexec started it already
    ({}, True, {relaunch.LAUNCHED_MARK: "1"}, 1),               # our own child
    ({}, True, {"OMPI_COMM_WORLD_SIZE": "4"}, 1),
])
def test_planned_procs(given, training, environ, expected):
    want = relaunch.usable_cores() if expected == "cores" else expected
    assert relaunch.planned_procs(options(**given), training, environ) == want


@pytest.mark.parametrize("given, saved, expected", [
    ({}, 2, 2), ({}, 1, 1),                      # the saved run's ranks, even with --replicas
    ({"replicas": 2}, 2, 2), ({"procs": 2}, 2, 2),
    ({"procs": 3}, 2, 3), ({"procs": 1}, 2, 1),  # the count asked for (cli.runs keeps the
])                                               # workers with the replicas of each)
def test_resume_takes_the_saved_runs_ranks_unless_told(given, saved, expected, monkeypatch):
    """A resumed run is on the saved run's ranks, or on the number asked for (issue 37 case
    31: --procs 1 was refused, while the README says a run resumes on any number)."""
    monkeypatch.setattr(relaunch, "saved_procs", lambda out: saved)
    assert relaunch.planned_procs(options(resume=True, **given), True, {}) == expected


@pytest.mark.parametrize("given, asked", [
    ({}, "the default 2 MPI ranks (one per core)"), ({"procs": 3}, "--procs 3")])
def test_without_mpi_a_demo_runs_in_one_process_and_says_so(given, asked, monkeypatch,
                                                            capsys):
    """issue 47 case 22: the demos' default MPI ranks need mpi4py and an mpiexec; without
    them the run falls back to one process with one line saying so (the default run fell
    back without a word, so its figures were not the README's 2-rank ones)."""
    monkeypatch.setattr(relaunch, "usable_cores", lambda: 2)
    monkeypatch.setattr(relaunch, "find_mpiexec", lambda: None)
    monkeypatch.delenv("NPFORMER_BACKEND", raising=False)
    for name in (relaunch.LAUNCHED_MARK, *relaunch.LAUNCHER_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    assert relaunch.relaunch(options(**given), None) is None
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"note: {asked} need mpi4py and an mpiexec (pip install -e '.[demos]' or "
                    "'npformer[mpi]'); running in one process with thread replicas")


def test_the_demos_extra_brings_mpi():
    """issue 47 case 22: `pip install -e ".[demos]"` (the README's first command) gives
    what the results assume, the demos' default MPI ranks: mpi4py and MPICH's mpiexec."""
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    demos = config["options.extras_require"]["demos"].split()
    assert "mpich" in demos and any(r.startswith("mpi4py") for r in demos), demos


def test_called_as_a_function_never_relaunches():
    """main(argv) from Python (tests, notebooks) runs in this process."""
    assert relaunch.relaunch(options(procs=2), ["--smoke"]) is None


def test_children_get_the_allocator_tunables_and_the_mark():
    env = relaunch.child_environment("/tmp/launch", {"PATH": "/bin"})
    assert env[relaunch.LAUNCHED_MARK] == "/tmp/launch"  # the launch's folder
    assert "mmap_threshold=4294967296" in env["GLIBC_TUNABLES"]
    assert "trim_threshold=4294967296" in env["GLIBC_TUNABLES"]
    mine = relaunch.child_environment("/tmp/launch", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"})
    assert mine["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=1"  # the user's own is kept


def test_rank_alike_messages_come_once():
    lines = ["error: no data\n", "error: no data\n",
             "Abort(2) on node 0 (rank 0 in comm 0): application called "
             "MPI_Abort(MPI_COMM_WORLD, 2) - process 0\n",
             "npformer rank 1 of 2 failed, aborting all ranks:\n", "Traceback (x)\n",
             "Traceback (x)\n"]
    shown = list(relaunch.shown_once(lines, set()))
    assert shown == ["error: no data\n", "npformer rank 1 of 2 failed, aborting all ranks:\n",
                     "Traceback (x)\n", "Traceback (x)\n"]  # tracebacks pass whole


# A rank that says its error and aborts every rank: mpiexec may drop the rank's pending
# standard error in the abort (seen once in a loaded CI run of tests/test_demos.py: exit
# status 2 and nothing said).  The rank leaves the line in the launch's folder too, and
# the launcher shows it when the stream did not.
RANK = """
import os, sys
from npformer.parallel import relaunch
print_it = sys.argv[1] == "forwarded"
if print_it:
    sys.stderr.write("error: the data is corrupt\\n")
relaunch.record_last_words("error: the data is corrupt")
sys.exit(2)
"""


@pytest.mark.parametrize("stream", ["forwarded", "dropped"])
def test_a_ranks_last_words_are_shown_once_even_if_mpiexec_drops_them(stream, tmp_path,
                                                                        capfd):
    folder = tmp_path / "launch"
    folder.mkdir()
    (folder / relaunch.LAUNCH_FILE).write_text(json.dumps({"ranks": 1, "mpiexec": "x"}))
    env = relaunch.child_environment(folder, {**os.environ, "PYTHONPATH": str(ROOT)})
    code = relaunch.run_children([sys.executable, "-c", RANK, stream], env, folder)
    assert code == 2
    assert capfd.readouterr().err.splitlines() == ["error: the data is corrupt"]


MESSAGE = """error: Could not find the dataset file 'input.txt'.
Searched:
  - $NPFORMER_DATA: not set
To fix: download it yourself"""

RANKS_SAY = """
import sys
from npformer.cli.output import say
from npformer.parallel import relaunch
message = sys.argv[1]
say(message)
relaunch.record_last_words(message)
sys.exit(2)
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_multi_line_message_is_shown_once_whatever_its_length(ranks, tmp_path, capfd):
    """issue 47 case 20: every rank says the same error of several lines; the launcher
    compared line by line, so the lines after the first (no ``error:`` prefix) came
    twice on 2 ranks.  Now a message travels as one line and is shown once, whole."""
    folder = tmp_path / "launch"
    folder.mkdir()
    (folder / relaunch.LAUNCH_FILE).write_text(json.dumps({"ranks": ranks, "mpiexec": "x"}))
    env = relaunch.child_environment(folder, {**os.environ, "PYTHONPATH": str(ROOT)})
    rank = [sys.executable, "-c", RANKS_SAY, MESSAGE]
    command = ["bash", "-c", " & ".join(['"$@"'] * ranks) + "; wait", "ranks", *rank]
    assert relaunch.run_children(command, env, folder) == 0
    assert capfd.readouterr().err == MESSAGE + "\n"


def test_without_a_launcher_nothing_is_left_behind(tmp_path):
    relaunch.record_last_words("error: x", {})  # not a launched rank: no folder, no file
    relaunch.record_last_words("error: x", {relaunch.LAUNCHED_MARK: str(tmp_path)})  # no launch
    assert list(tmp_path.iterdir()) == []


# =========================================================================== the demo
def run_generate(*args: str, data: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    env.update(PYTHONPATH=str(ROOT), NPFORMER_DATA=str(data))
    return subprocess.run([sys.executable, str(GENERATE), "--smoke", "--no-progress", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from tests.test_demos import SHARED_DATA, synthetic_data

    return SHARED_DATA if SHARED_DATA.is_dir() else synthetic_data(
        tmp_path_factory.mktemp("data"))


@pytest.mark.mpi
def test_self_launch_on_two_ranks_equals_one_process(data, tmp_path):
    """`python demos/generate.py --smoke --procs 2` starts 2 ranks by itself, says so once,
    and writes the metrics of a one-process run (float32 sums in another order)."""
    from tests.test_distributed import mpiexec

    mpiexec()  # a skip (or a CI error) where MPI is missing
    ranks = run_generate("--procs", "2", "--out", str(tmp_path / "ranks"), data=data)
    assert ranks.returncode == 0, ranks.stdout[-3000:] + ranks.stderr[-3000:]
    assert ranks.stdout.count("running on 2 MPI ranks") == 1
    one = run_generate("--procs", "1", "--out", str(tmp_path / "one"), data=data)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "MPI ranks" not in one.stdout
    ours = json.loads((tmp_path / "ranks" / "metrics.json").read_text())
    single = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert ours["updates"] == single["updates"]
    for key in ("val_loss", "train_loss"):
        assert ours[key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), key


@pytest.mark.mpi
def test_self_launch_exit_codes_and_one_message(data, tmp_path):
    """A user error on every rank: exit 2, its message once; --stop-after: exit 130, the
    resume hint once, and --resume (no --procs) continues on the saved run's 2 ranks to
    the uninterrupted run's figures."""
    from tests.test_distributed import mpiexec

    mpiexec()
    bad = run_generate("--procs", "2", "--out", str(tmp_path / "bad"), "--data",
                       str(tmp_path / "missing"), data=data)
    assert bad.returncode == 2, bad.stderr[-3000:]
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "missing" in errors[0], bad.stderr
    assert "MPI_Abort" not in bad.stderr
    out = tmp_path / "stopped"
    stopped = run_generate("--procs", "2", "--out", str(out), "--stop-after", "5", data=data)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert stopped.stderr.count("continue it with:") == 1
    resumed = run_generate("--out", str(out), "--resume", data=data)  # on the saved 2 ranks
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("running on 2 MPI ranks") == 1
    whole = run_generate("--procs", "2", "--out", str(tmp_path / "whole"), data=data)
    assert whole.returncode == 0, whole.stderr[-3000:]
    ours = json.loads((out / "metrics.json").read_text())
    uninterrupted = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    assert ours["updates"] == uninterrupted["updates"] == 20
    assert ours["val_loss"] == uninterrupted["val_loss"]  # the same ranks: exactly
