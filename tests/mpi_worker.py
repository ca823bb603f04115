"""The ranks' side of tests/test_distributed.py: ``mpiexec -n N python tests/mpi_worker.py
SCENARIO OUTDIR [RESUME_FROM]`` with the repository on PYTHONPATH.

Rank 0 writes what the ranks computed to OUTDIR (``.npz`` files, text files); the
pytest process compares it with a single process's results.  Scenarios:

* ``checks``: gradients of every case (in buckets of two sizes; the sparse case's summed
  by row and whole), the
  Adam trajectories, runs with dropout (1 and 2 thread replicas a rank), checkpoints
  (and, given RESUME_FROM, a resumed run), the mismatch refusals, ``shard_map`` and the
  rank-0-only output, in one launch;
* ``gpu``: the gradients of every case on the CuPy backend (a GPU per rank);
* ``fail``: rank 1 raises inside a training step while the others wait in the
  all-reduce: every rank must end, with rank 1's message.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from npformer import backend, parallel
from npformer.parallel import DataParallel, RanksDiffer
from tests import parallel_cases as cases
from tests.helpers import using_tier


def save_npz(path: Path, **arrays) -> None:
    np.savez(path, **arrays)


def gradients(ctx, out: Path) -> None:
    """Every case's gradients, summed in buckets of the default size and of 64 bytes
    (many: each a non-blocking all-reduce, started as the backward finishes it)."""
    for name, rows in cases.GRADIENT_CASES.items():
        for bucket_bytes, suffix in cases.BUCKET_SIZES.items():
            model, task, batch = cases.build(name, rows)
            if ctx.rank:  # other ranks start from other weights: the broadcast must fix that
                for p in model.parameters():
                    p.data = p.data + 1.0
            engine = DataParallel(model, 1, ctx, bucket_bytes=bucket_bytes)
            model.zero_grad()
            share, count = engine.loss_and_grad(task, batch, 1.0, seed=0, ends_step=True)
            loss = engine.reduce_step(share)
            if ctx.is_main:
                save_npz(out / f"grads_{name}{suffix}.npz", loss=loss, count=count,
                         **{n: backend.to_numpy(p.grad) for n, p in model.named_parameters()})


def sparse_sums(ctx, out: Path) -> None:
    """The sparse case's gradients summed by row and whole, on each tier, with 1 and 2
    thread replicas a rank: every rank's (``rank<r>.<name>``), and the bytes each sum
    carried."""
    for tier in ("fast", "textbook"):
        with using_tier(tier):
            for replicas in (1, 2):
                for row_sparse in (True, False):
                    grads, sent = cases.reduced_gradients(ctx, replicas, row_sparse)
                    everyone = ctx.allgather(grads)
                    if ctx.is_main:
                        kind = "rows" if row_sparse else "whole"
                        save_npz(out / f"sparse_{tier}_{replicas}_{kind}.npz", sent=sent,
                                 **{f"rank{r}.{name}": g for r, theirs in enumerate(everyone)
                                    for name, g in theirs.items()})


def trajectories(ctx, out: Path) -> None:
    for name, spec in cases.TRAJECTORIES.items():
        losses, params = cases.train(steps=10, **spec)
        if ctx.is_main:
            save_npz(out / f"adam_{name}.npz", losses=losses, **params)
    losses, params = cases.train("classifier", 6, dropout=0.3, batch_rows=8)
    if ctx.is_main:
        save_npz(out / "dropout.npz", losses=losses, **params)
    losses, params = cases.train("classifier", 6, replicas=2, dropout=0.3, batch_rows=8)
    if ctx.is_main:  # ranks x 2 thread replicas
        save_npz(out / "dropout_2_replicas.npz", losses=losses, **params)


def checkpoints(ctx, out: Path, resume_from: str | None) -> None:
    import npformer.train.loop as train_module

    original = train_module.save_checkpoint

    def recording(path, *args, **kwargs):  # who writes checkpoints
        (out / f"saved_by_rank{ctx.rank}").write_text(str(path))
        return original(path, *args, **kwargs)

    train_module.save_checkpoint = recording
    try:
        cases.train("classifier", 3, batch_rows=8, save_to=out / "half.npz")
        if resume_from:
            losses, params = cases.train("classifier", 6, batch_rows=8, resume_from=resume_from)
            if ctx.is_main:
                save_npz(out / "resumed.npz", losses=losses, **params)
    finally:
        train_module.save_checkpoint = original


def mismatches(ctx, out: Path) -> None:
    messages = []
    model, _, _ = cases.build("lm")
    if ctx.rank == 1:  # a different model configuration on rank 1
        model, _, _ = cases.build("classifier")
    try:
        DataParallel(model, 1, ctx)
    except RanksDiffer as error:
        messages.append(str(error))
    model, task, batch = cases.build("lm", 5)
    engine = DataParallel(model, 1, ctx)
    if ctx.rank == 1:  # different data (another data seed) on rank 1
        batch = cases.build("lm", 5, seed=7)[2]
    try:
        engine.loss_and_grad(task, batch, 1.0, seed=0)
    except RanksDiffer as error:
        messages.append(str(error))
    try:
        cases.train("lm", 1, batch_rows=5, max_seconds=100.0 + ctx.rank)  # a different config
    except RanksDiffer as error:
        messages.append(str(error))
    if ctx.is_main:
        (out / "mismatch.txt").write_text("\n".join(messages))


def sharding(ctx, out: Path) -> None:
    computed = []

    def square(i):
        computed.append(i)
        return i * i

    results = ctx.shard_map(square, range(11), replicas=2)
    everyone = ctx.allgather(sorted(computed))  # which items each rank computed
    if ctx.is_main:
        save_npz(out / "shard_map.npz", results=np.array(results),
                 computed=np.concatenate([np.array(c, dtype=int) for c in everyone]),
                 per_rank=np.array([len(c) for c in everyone]))


def fail(ctx) -> None:
    class Failing(type(cases.build("lm")[1])):
        def loss_and_grad(self, model, batch, grad_scale=1.0):
            if ctx.rank == 1 and self.calls == 2:
                raise ValueError("rank 1 failed on purpose in its third batch")
            self.calls += 1
            return super().loss_and_grad(model, batch, grad_scale)

    model, _, pool = cases.build("lm", rows=8)
    task = Failing()
    task.calls = 0
    engine = DataParallel(model, 1, ctx)
    for step in range(5):
        model.zero_grad()
        engine.reduce_step(engine.loss_and_grad(task, pool, 1.0, seed=step)[0])


def main(argv) -> int:
    scenario, out = argv[1], Path(argv[2])
    resume_from = argv[3] if len(argv) > 3 else None
    backend.set_backend("numpy", seed=0)
    backend.set_default_float("float64")
    ctx = parallel.setup()
    print(f"printed by rank {ctx.rank} of {ctx.size}")  # only rank 0's may come out
    if scenario == "fail":
        fail(ctx)
        return 0
    if scenario == "gpu":  # the CuPy path: each rank's own GPU, a device all-reduce
        backend.set_backend("cupy", seed=0)
        backend.set_default_float("float64")
        gradients(ctx, out)
        return 0
    gradients(ctx, out)
    sparse_sums(ctx, out)
    trajectories(ctx, out)
    checkpoints(ctx, out, resume_from)
    mismatches(ctx, out)
    sharding(ctx, out)
    ctx.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
