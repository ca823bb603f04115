"""Data parallelism over MPI ranks equals one process.

Each launch (``mpiexec -n 2`` and ``-n 3``, as subprocesses) runs tests/mpi_worker.py,
whose rank 0 writes what the ranks computed; these tests compare it with the same
computation in this (single) process:

* for each of the three models, the loss and every gradient of a global batch on 2 and
  3 ranks equal the single-process ones (float64, 1e-12 relative to the largest
  gradient), with uneven shards (7 and 5 rows) and a batch of fewer rows than ranks,
  summed in buckets of two sizes (npformer.parallel.buckets: tests/test_buckets.py);
* lookup tables summed by the rows the ranks changed equal them summed whole (2 ranks:
  bit for bit), on both tiers, with 1 and 2 thread replicas a rank;
* 10-step Adam trajectories (gradient accumulation, clipping among them) equal the
  single-process ones; with dropout, 2 ranks equal 2 thread replicas bit for bit;
* only rank 0 writes checkpoints and prints; a run resumes on another rank count;
* ranks started differently are refused before the first step, naming what differs;
* one rank failing ends every rank with its message, within a timeout.

And without MPI (a communicator standing in for the ranks): threads and ranks share the
one sharding and weighting, and a flat gradient buffer is all-reduced as it is.

Skipped outside CI where mpi4py or ``mpiexec`` is missing (CI installs both through the
test extra; there a missing one is an error).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npformer import backend, parallel
from npformer.nn.flat import flat_buffer_of
from npformer.parallel import (
    Context,
    DataParallel,
    PackedGradients,
    batch_fingerprint,
    keep_freed_memory,
    launched_by_mpi,
    workers,
)
from npformer.train.tasks import Task
from tests import parallel_cases as cases
from tests.conftest import using_backend
from tests.helpers import rel_diff, tiered, using_tier

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "mpi_worker.py"
LAUNCH_TIMEOUT = 120  # seconds for one mpiexec launch (a few on an idle machine)
FAIL_TIMEOUT = 60
GRAD_RTOL = 1e-12
TRAJECTORY_RTOL = 1e-10  # 10 Adam steps: the ranks sum gradients in another order


def mpiexec() -> str:
    """The mpiexec next to this Python (the mpich wheel's), else the one on PATH; a skip
    outside CI where MPI is missing, an error in CI (the test extra installs it)."""
    found = (shutil.which("mpiexec", path=str(Path(sys.executable).parent))
             or shutil.which("mpiexec"))
    missing = ("mpi4py is not installed" if importlib.util.find_spec("mpi4py") is None
               else None if found else "no mpiexec on PATH")
    if missing:
        if os.environ.get("CI"):
            raise RuntimeError(f"{missing}: CI installs mpi4py and mpich (pip install "
                               "-e '.[test]')")
        pytest.skip(f"{missing} (pip install -e '.[mpi]' gives mpi4py and mpich)")
    return found


def launch(ranks: int, *args, timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for name in ("NPFORMER_MPI", "PMI_SIZE", "PMI_RANK"):  # this process's own, if any
        env.pop(name, None)
    return subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, str(WORKER),
                           *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _checked(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"mpiexec exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{ranks: (output folder, stdout)}: 2 ranks, then 3 ranks resuming 2 ranks' checkpoint."""
    two, three = tmp_path_factory.mktemp("ranks2"), tmp_path_factory.mktemp("ranks3")
    first = _checked(launch(2, "checks", two))
    second = _checked(launch(3, "checks", three, two / "half.npz"))
    return {2: (two, first.stdout), 3: (three, second.stdout)}


def _load(path: Path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


# --------------------------------------------------------------------------- gradients
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("name", list(cases.GRADIENT_CASES))
@pytest.mark.parametrize("buckets", list(cases.BUCKET_SIZES.values()))
def test_gradients_equal_the_single_process_gradients(runs, ranks, name, buckets):
    """Summed in buckets (non-blocking all-reduces) of the default size and of 64 bytes."""
    ours = _load(runs[ranks][0] / f"grads_{name}{buckets}.npz")
    with using_backend("numpy", "float64"):
        loss, expected = cases.whole_batch_gradients(name, cases.GRADIENT_CASES[name])
    assert abs(float(ours["loss"]) - loss) <= GRAD_RTOL * abs(loss), (float(ours["loss"]), loss)
    # measured against the largest gradient: some (the key bias) are zero in theory
    scale = max(float(np.max(np.abs(g))) for g in expected.values())
    for param, g in expected.items():
        diff = float(np.max(np.abs(ours[param] - g)))
        assert diff <= GRAD_RTOL * scale, f"{param}: {diff / scale:.2e} relative"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("tier", ["fast", "textbook"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_lookup_tables_summed_by_row_equal_them_summed_whole(runs, ranks, tier, replicas):
    """The sparse case (token and word-pair tables a batch touches in few rows), summed
    across the ranks sending only the rows some rank changed, equals the whole sum on
    every rank: bit for bit on 2 ranks (a + b either way), to rounding on 3 (MPI may add
    the two messages' elements in other orders); both equal one process; less was sent."""
    by_rows = _load(runs[ranks][0] / f"sparse_{tier}_{replicas}_rows.npz")
    whole = _load(runs[ranks][0] / f"sparse_{tier}_{replicas}_whole.npz")
    assert by_rows.pop("sent") < whole.pop("sent") / 2
    with using_backend("numpy", "float64"), using_tier(tier):
        _, alone = cases.whole_batch_gradients("sparse", 6)
    scale = max(float(np.max(np.abs(g))) for g in alone.values())
    assert by_rows.keys() == whole.keys() == {f"rank{r}.{name}" for r in range(ranks)
                                               for name in alone}
    for key, g in whole.items():
        if ranks == 2:
            assert np.array_equal(by_rows[key], g), key
        else:
            assert float(np.max(np.abs(by_rows[key] - g))) <= GRAD_RTOL * scale, key
        name = key.split(".", 1)[1]
        assert float(np.max(np.abs(by_rows[key] - alone[name]))) <= GRAD_RTOL * scale, key


# --------------------------------------------------------------------------- training
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("name", list(cases.TRAJECTORIES))
def test_adam_trajectory_equals_the_single_process_one(runs, ranks, name):
    ours = _load(runs[ranks][0] / f"adam_{name}.npz")
    with using_backend("numpy", "float64"):
        losses, params = cases.train(steps=10, **cases.TRAJECTORIES[name])
    assert len(ours["losses"]) == 10
    assert rel_diff(ours["losses"], losses) <= TRAJECTORY_RTOL, (ours["losses"], losses)
    assert losses[-1] < losses[0]  # it trained
    for param, value in params.items():
        assert rel_diff(ours[param], value) <= TRAJECTORY_RTOL, param


@pytest.mark.mpi
def test_two_ranks_with_dropout_equal_two_thread_replicas_exactly(runs):
    """Rank r draws dropout masks from seed + r, as thread replica r does: the same
    masks, the same sums (a + b either way), the same run, bit for bit."""
    ours = _load(runs[2][0] / "dropout.npz")
    with using_backend("numpy", "float64"):
        losses, params = cases.train("classifier", 6, replicas=2, dropout=0.3, batch_rows=8)
        single, _ = cases.train("classifier", 6, replicas=1, dropout=0.3, batch_rows=8)
    assert not np.array_equal(losses, single)  # the masks matter: the check is sharp
    assert np.array_equal(ours["losses"], losses)
    for param, value in params.items():
        assert np.array_equal(ours[param], value), param


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_of_two_replicas_equal_one_process_of_twice_the_replicas(runs, ranks):
    """Worker g = rank * replicas + i takes shard g and the masks of seed + g, however
    the workers are laid out: ranks x 2 threads run 1 process x 2 * ranks threads."""
    ours = _load(runs[ranks][0] / "dropout_2_replicas.npz")
    with using_backend("numpy", "float64"):
        losses, params = cases.train("classifier", 6, replicas=2 * ranks, dropout=0.3,
                                     batch_rows=8)
    assert rel_diff(ours["losses"], losses) <= TRAJECTORY_RTOL
    for param, value in params.items():
        assert rel_diff(ours[param], value) <= TRAJECTORY_RTOL, param


@pytest.mark.mpi
def test_three_ranks_with_dropout_equal_three_thread_replicas(runs):
    ours = _load(runs[3][0] / "dropout.npz")
    with using_backend("numpy", "float64"):
        losses, params = cases.train("classifier", 6, replicas=3, dropout=0.3, batch_rows=8)
    assert rel_diff(ours["losses"], losses) <= TRAJECTORY_RTOL
    for param, value in params.items():
        assert rel_diff(ours[param], value) <= TRAJECTORY_RTOL, param


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_only_rank_zero_writes_checkpoints(runs, ranks):
    out = runs[ranks][0]
    assert (out / "half.npz").exists()
    writers = sorted(p.name for p in out.glob("saved_by_rank*"))
    assert writers == ["saved_by_rank0"], writers


@pytest.mark.mpi
def test_a_run_resumes_on_another_number_of_ranks(runs):
    """3 steps on 2 ranks, checkpoint, 3 more on 3 ranks == 6 steps in one process
    (the resumed run's history holds the 3 saved losses and its own 3)."""
    ours = _load(runs[3][0] / "resumed.npz")
    with using_backend("numpy", "float64"):
        losses, params = cases.train("classifier", 6, batch_rows=8)
    assert rel_diff(ours["losses"], losses) <= TRAJECTORY_RTOL
    for param, value in params.items():
        assert rel_diff(ours[param], value) <= TRAJECTORY_RTOL, param


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_only_rank_zero_prints(runs, ranks):
    out = runs[ranks][1]
    assert f"printed by rank 0 of {ranks}" in out
    assert "printed by rank 1" not in out and "printed by rank 2" not in out


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_shard_map_computes_each_item_once_and_returns_all_in_order(runs, ranks):
    result = _load(runs[ranks][0] / "shard_map.npz")
    assert result["results"].tolist() == [i * i for i in range(11)]
    assert sorted(result["computed"].tolist()) == list(range(11))
    assert len(result["per_rank"]) == ranks and max(result["per_rank"]) <= 11 // ranks + 1


# --------------------------------------------------------------------------- refusals
@pytest.mark.mpi
def test_ranks_started_differently_are_refused_naming_what_differs(runs):
    text = (runs[2][0] / "mismatch.txt").read_text().splitlines()
    assert len(text) == 3, text
    model, data, config = text
    assert "model.config.vocab_size differs between ranks (ranks [0]: 11; ranks [1]: 30)" \
        in model
    assert "data differs between ranks" in data
    assert "train_config.max_seconds differs between ranks (ranks [0]: 100.0; ranks [1]: " \
        "101.0)" in config


@pytest.mark.mpi
def test_a_failing_rank_ends_every_rank_with_its_message(tmp_path):
    started = time.perf_counter()
    proc = launch(3, "fail", tmp_path, timeout=FAIL_TIMEOUT)
    elapsed = time.perf_counter() - started
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "npformer rank 1 of 3 failed, aborting all ranks" in output, output
    assert "ValueError: rank 1 failed on purpose in its third batch" in output, output
    assert elapsed < FAIL_TIMEOUT


@pytest.mark.mpi
def test_a_rank_whose_peers_never_join_stops_after_the_join_timeout():
    """Its peer is no npformer program (it never calls MPI_Init): the rank says whom it
    waited for, and for how long, and stops (NPFORMER_MPI_TIMEOUT seconds)."""
    join = "from npformer import parallel; parallel.setup(); print('joined')"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NPFORMER_MPI_TIMEOUT": "3"}
    for name in ("NPFORMER_MPI", "PMI_SIZE", "PMI_RANK"):
        env.pop(name, None)
    started = time.perf_counter()
    proc = subprocess.run([mpiexec(), "-n", "1", sys.executable, "-c", join, ":", "-n", "1",
                           sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=FAIL_TIMEOUT)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "joined" not in output, output
    assert "npformer: rank 0 waited 3 s for the other MPI ranks to join" in output, output
    assert time.perf_counter() - started < 30


# --------------------------------------------------------------------------- GPU
@pytest.mark.mpi
@pytest.mark.gpu
def test_gpu_ranks_gradients_equal_the_single_process_gradients(tmp_path):
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no GPU")
    _checked(launch(2, "gpu", tmp_path))
    for name, rows in cases.GRADIENT_CASES.items():
        ours = _load(tmp_path / f"grads_{name}.npz")
        # one process on CuPy too: CuPy's random stream, not NumPy's, drew the weights
        with using_backend("cupy", "float64"):
            loss, expected = cases.whole_batch_gradients(name, rows)
        assert abs(float(ours["loss"]) - loss) <= 1e-10 * abs(loss)
        scale = max(float(np.max(np.abs(g))) for g in expected.values())
        for param, g in expected.items():
            assert float(np.max(np.abs(ours[param] - g))) <= 1e-10 * scale, param


# --------------------------------------------------------------------------- in-process
def _one_process(monkeypatch) -> None:
    for name in ("NPFORMER_MPI", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE",
                 "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert not launched_by_mpi()


def test_one_process_gets_the_thread_workers_and_a_single_context(monkeypatch):
    _one_process(monkeypatch)
    model, _, _ = cases.build("lm")
    workers = parallel.data_parallel(model, 2)
    assert type(workers) is DataParallel and workers.ranks is parallel.current()
    ctx = parallel.current()
    assert (ctx.rank, ctx.size, ctx.is_main) == (0, 1, True)
    assert ctx.shard_map(lambda i: i + 1, range(5), replicas=2) == [1, 2, 3, 4, 5]
    ctx.check_same(anything=object())  # nothing to compare with


def test_one_process_of_one_replica_trains_without_the_data_parallel_code(monkeypatch):
    """The single-process step stands off data parallelism: no workers are made, and an
    update runs with DataParallel's methods broken (a thread replica's run does not)."""
    from npformer.train import TrainConfig, Trainer

    _one_process(monkeypatch)

    def broken(*args, **kwargs):
        raise AssertionError("the single-process step went through DataParallel")

    for name in ("__init__", "loss_and_grad", "reduce_step"):
        monkeypatch.setattr(DataParallel, name, broken)
    model, task, batch = cases.build("lm")
    optimizer = tiered.Adam(model.parameters(), lr=1e-2)
    trainer = Trainer(model, optimizer, task, lambda _: batch,
                      TrainConfig(max_iters=1, progress=False))
    assert trainer.workers is None and trainer.ranks.size == 1
    assert np.isfinite(trainer.update())
    with pytest.raises(AssertionError, match="went through DataParallel"):
        Trainer(model, optimizer, task, lambda _: batch,
                TrainConfig(max_iters=1, replicas=2, progress=False))


@pytest.mark.parametrize("env, expected", [({"PMI_SIZE": "2"}, True), ({"PMI_SIZE": "1"}, False),
                                           ({"OMPI_COMM_WORLD_SIZE": "4"}, True),
                                           ({"NPFORMER_MPI": "0", "PMI_SIZE": "2"}, False),
                                           ({"NPFORMER_MPI": "1"}, True)])
def test_launchers_are_recognised_by_their_environment(monkeypatch, env, expected):
    for name in ("NPFORMER_MPI", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE",
                 "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launched_by_mpi() is expected


def test_packed_gradients_round_trip_as_views_of_one_buffer():
    with using_backend("numpy", "float64"):
        model, task, batch = cases.build("lm", 5)
        model.zero_grad()
        task.loss_and_grad(model, batch, 1.0)
        params = model.parameters()
        before = [p.grad.copy() for p in params]
        packed = PackedGradients(params)
        buffer = packed.pack(params)
        assert buffer is packed.buffer and buffer.dtype == np.float64
        assert buffer.size == sum(p.grad.size for p in params)
        buffer *= 2  # what a sum over two equal ranks does
        packed.unpack(params)
        for p, g in zip(params, before):
            assert np.array_equal(p.grad, 2 * g)
            assert np.shares_memory(p.grad, buffer)


# --------------------------------------------------------------------------- one algorithm
class EqualRanks:
    """Rank ``rank`` of ``size`` ranks that all hold this process's values: a
    communicator without MPI (its all-reduce multiplies by ``size``) that records the
    buffers it is given."""

    def __init__(self, rank: int = 0, size: int = 2):
        self.rank, self.size, self.summed = rank, size, []

    def allreduce(self, buffer) -> None:
        self.summed.append(buffer)
        buffer *= self.size

    def allgather(self, value) -> list:
        return [value] * self.size

    def from_main(self, value):
        return value

    def check_same(self, **values) -> None:
        pass


class Recording(Task):
    """batch = (row ids (B,), weights (B,)): ``count`` is the weights' sum (rows of weight
    0 make uneven counts), the loss the weighted mean of the ids.  Each call records
    (its row ids, its grad_scale, the first draw of its dropout stream)."""

    def __init__(self):
        self.calls = []

    def count(self, batch: tuple) -> int:
        return int(np.sum(batch[1]))

    def loss_and_grad(self, model, batch: tuple, grad_scale: float = 1.0) -> float:
        draw = float(backend.to_numpy(backend.random_uniform((1,)))[0])
        self.calls.append((tuple(batch[0].tolist()), grad_scale, draw))
        return float(np.sum(batch[0] * batch[1]) / np.sum(batch[1]))


def worker_calls(rows, weights, ranks: int, replicas: int):
    """(every worker's call in row order, the ranks' loss shares summed, n) of one batch."""
    batch = (np.arange(rows), np.asarray(weights[:rows]))
    calls, shares, totals = [], [], set()
    for rank in range(ranks):
        task = Recording()
        engine = DataParallel(tiered.Linear(2, 2), replicas,
                              None if ranks == 1 else EqualRanks(rank, ranks))
        share, total = engine.loss_and_grad(task, batch, 0.5, seed=7)
        calls += task.calls
        shares.append(share)
        totals.add(total)
    assert len(totals) == 1  # every rank counts the whole batch
    return sorted(calls), sum(shares), totals.pop()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 13), ranks=st.integers(2, 4), replicas=st.integers(1, 3),
       weights=st.lists(st.integers(0, 3), min_size=13, max_size=13))
def test_threads_and_ranks_shard_and_weight_alike(rows, ranks, replicas, weights):
    """Ranks x threads and one process of as many threads run the same calls: the same
    shards (uneven, some without counted items, some empty), each with grad_scale *
    n_g / n and the dropout stream of seed + g; the weights sum to 1 and the weighted
    losses to the whole batch's mean."""
    with using_backend("numpy", "float64"):
        laid_out, share, total = worker_calls(rows, weights, ranks, replicas)
        threads, alone, total_alone = worker_calls(rows, weights, 1, ranks * replicas)
    assert laid_out == threads and total == total_alone
    counted = sum(weights[:rows])
    assert total == counted
    if counted:
        assert abs(sum(scale for _, scale, _ in threads) - 0.5) <= 1e-14
        mean = sum(i * w for i, w in enumerate(weights[:rows])) / counted
        assert abs(share - mean) <= 1e-12 * max(1, mean)
        assert abs(alone - mean) <= 1e-12 * max(1, mean)
    else:
        assert threads == [] and share == alone == 0.0


def slices_of(views, buffer) -> list[tuple[int, int]]:
    """The (lo, hi) of ``buffer`` each of ``views`` is (each a view of it, none a copy)."""
    start = buffer.__array_interface__["data"][0]
    spans = []
    for view in views:
        assert view.base is buffer or view is buffer, "summed a copy, not the buffer"
        lo = (view.__array_interface__["data"][0] - start) // buffer.itemsize
        spans.append((lo, lo + view.size))
    return spans


def test_the_flat_gradient_buffer_is_all_reduced_as_it_is(monkeypatch):
    """Parameters in one flat buffer (the fast tier's AdamW): the all-reduces get slices of
    that gradient buffer itself (its buckets, and its lookup tables' start), covering it
    once, and no packing buffer is ever made (the engine used to allocate one beside it
    on construction, as large again)."""
    def no_packing(params):
        raise AssertionError("a packing buffer was made for a flat model")

    monkeypatch.setattr(workers, "PackedGradients", no_packing)
    with using_backend("numpy", "float64"), using_tier("fast"):
        model, task, batch = cases.build("lm", 5)
        optimizer = tiered.AdamW(model.parameters())
        flat = flat_buffer_of(model.parameters())
        assert flat is optimizer._flat is not None
        ranks = EqualRanks(rank=0, size=2)
        engine = DataParallel(model, 1, ranks, bucket_bytes=256)
        optimizer.zero_grad()
        share, _ = engine.loss_and_grad(task, batch, 1.0, seed=0)
        before = flat.grad.copy()
        assert engine.reduce_step(share) == 2 * share
        spans = sorted(slices_of(ranks.summed, flat.grad))
        assert len(spans) > 2 and spans[0][0] == 0 and spans[-1][1] == flat.grad.size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans  # each once
        assert np.array_equal(flat.grad, 2 * before)  # summed where the views look
        assert flat_buffer_of(model.parameters()) is flat


def test_separate_gradients_are_packed_into_one_buffer_and_come_back_as_views():
    """The textbook tier's gradients are separate arrays: they are packed into one
    buffer, all-reduced bucket by bucket (each element once), and each gradient is then
    a view of its slice."""
    with using_backend("numpy", "float64"), using_tier("textbook"):
        model, task, batch = cases.build("lm", 5)
        ranks = EqualRanks(rank=1, size=3)
        engine = DataParallel(model, 1, ranks, bucket_bytes=256)
        model.zero_grad()
        share, _ = engine.loss_and_grad(task, batch, 1.0, seed=0)
        before = [p.grad.copy() for p in model.parameters()]
        assert engine.reduce_step(share) == 3 * share
        buffer = engine._packed.buffer
        spans = sorted(slices_of(ranks.summed, buffer))
        assert len(spans) > 2 and spans[0][0] == 0 and spans[-1][1] == buffer.size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
        for p, g in zip(model.parameters(), before):
            assert np.array_equal(p.grad, 3 * g) and np.shares_memory(p.grad, buffer)


def test_batch_fingerprint_tells_batches_apart():
    a = (np.arange(6).reshape(2, 3), np.array([1, 2]))
    assert batch_fingerprint(a) == batch_fingerprint(tuple(x.copy() for x in a))
    assert batch_fingerprint(a) != batch_fingerprint((a[0], np.array([1, 3])))
    assert batch_fingerprint(a) != batch_fingerprint((a[0].astype(np.int32), a[1]))


def test_keep_freed_memory_takes_effect_on_glibc():
    if not os.path.exists("/lib/x86_64-linux-gnu/libc.so.6") and sys.platform != "linux":
        pytest.skip("not glibc")
    assert keep_freed_memory() is True


def test_a_single_context_check_needs_no_mpi():
    Context(comm=None).check_same(x=1)


def test_ranks_sharing_a_gpu_never_get_nccl(monkeypatch):
    """NCCL refuses two ranks of one communicator on one device (found on a one-GPU
    machine with 2 ranks: NCCL_ERROR_INVALID_USAGE); such ranks sum through MPI."""
    pytest.importorskip("mpi4py")
    monkeypatch.delenv("NPFORMER_GPU_ALLREDUCE", raising=False)
    assert parallel.gpu_allreduce_kind(shared_gpu=True) in ("mpi", "host")
    monkeypatch.setenv("NPFORMER_GPU_ALLREDUCE", "host")
    assert parallel.gpu_allreduce_kind(shared_gpu=True) == "host"
    monkeypatch.setenv("NPFORMER_GPU_ALLREDUCE", "nccl")
    assert parallel.gpu_allreduce_kind(shared_gpu=False) == "nccl"
    with pytest.raises(ValueError, match="needs one GPU per rank, but two ranks share a GPU"):
        parallel.gpu_allreduce_kind(shared_gpu=True)
    monkeypatch.setenv("NPFORMER_GPU_ALLREDUCE", "gloo")
    with pytest.raises(ValueError, match="must be nccl, mpi or host, got 'gloo'"):
        parallel.gpu_allreduce_kind()


def test_a_failing_rank_waits_until_its_message_has_left_the_pipe(tmp_path):
    """The abort hook's wait: returns once the reader has drained the pipe, not before;
    gives up after its timeout when nobody reads; returns at once on a file."""
    import threading

    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as stream, os.fdopen(read_end, "rb") as reader:
        stream.write("npformer rank 1 of 2 failed\n")
        stream.flush()
        drained = []
        reading = threading.Timer(0.3, lambda: drained.append(reader.read1(1 << 16)))
        reading.start()
        started = time.perf_counter()
        parallel.wait_until_read(stream, timeout=10.0)
        assert 0.25 <= time.perf_counter() - started < 5.0
        reading.join()  # the pipe empties inside read1, before the append
        assert drained == [b"npformer rank 1 of 2 failed\n"]
        stream.write("unread\n")
        stream.flush()
        started = time.perf_counter()
        parallel.wait_until_read(stream, timeout=0.2)
        assert 0.2 <= time.perf_counter() - started < 2.0
    with open(tmp_path / "log", "w") as file:
        file.write("text")
        started = time.perf_counter()
        parallel.wait_until_read(file, timeout=5.0)
        assert time.perf_counter() - started < 1.0
