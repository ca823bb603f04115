"""Process modes of the benchmark (``python bench/bench.py --processes``): two cores used
by two processes instead of two threads, side by side for each configuration:

* ``npformer 2 ranks``: ``mpiexec -n 2``, 1 BLAS thread each, npformer.parallel (each
  rank its half of the global batch, one Allreduce of the flat gradient per step);
* ``npformer 2 threads``: one process, two thread replicas (npformer.parallel);
* ``PyTorch DDP 2``: ``torch.distributed`` (gloo), 2 processes, 1 thread each, each its
  half of the batch (DDP averages the two halves' gradients);
* ``PyTorch 2 threads``: one process, ``torch.set_num_threads(2)``;
* ``npformer 1 rank, half batch``: one process on half the batch, alone: a rank's work;
* ``npformer 2 x 1 rank, half``: two such processes at once, nothing sent between them:
  the 2-rank run without its gradient sum, what the two cores give two ranks when the
  sum costs nothing;

``--rounds`` times, the modes taking turns and their steps pooled; then the scaling
efficiency of npformer from 1 to 2 ranks at a fixed per-rank batch (1 process on half
the batch against 2 ranks on all of it), the same scaling of the two processes that
send nothing (the ceiling the machine sets: their shared caches, memory bandwidth and
clock), the share of a 2-rank step spent in the Allreduce, ``Allreduce`` time against
message size at 2 and 4 ranks with an alpha-beta fit, and the projection of step time
and efficiency at 8 to 64 ranks for a stated interconnect (method in bench/README.md).

Every rank runs ``bench.py --rank-worker``, ``--ddp-worker`` or ``--allreduce-worker``;
rank 0 prints one JSON result line.  npformer keeps freed memory in the process in
every mode (its ``Trainer`` and ``parallel.setup()`` call ``keep_freed_memory``:
glibc's mallopt, the same effect as the GLIBC_TUNABLES PyTorch's modes get from
--allocator).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.configs import ROOT, SEED, make_batch, npformer_model
from bench.measure import RESULT_PREFIX, npformer_trainer

BENCH = ROOT / "bench" / "bench.py"
ALLREDUCE_RANKS = (2, 4)
ALLREDUCE_SIZES = tuple(4 ** k for k in range(4, 13))  # float32 elements: 1 KiB .. 64 MiB
SMOKE_ALLREDUCE_SIZES = (256, 4096)
PROJECTED_RANKS = (8, 16, 32, 64)
# two single-rank processes on the half batch at once: 2 ranks without the gradient sum
TWO_AT_ONCE = "npformer 2 x 1 rank, half"
# a typical cluster interconnect: 100 Gb/s InfiniBand (EDR), ~12 GB/s achievable per
# link, a few microseconds of latency per message
CLUSTER_LATENCY_S = 5e-6
CLUSTER_BANDWIDTH_BPS = 12e9


def _emit(result: dict) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def _single_blas_thread() -> None:
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)


# =========================================================================== rank workers
def rank_worker(spec: dict) -> int:
    """One npformer MPI rank: training steps on the global batch (this rank's rows)."""
    import numpy as np

    from npformer import backend, parallel

    ctx = parallel.setup()
    _single_blas_thread()
    backend.set_backend("numpy", seed=SEED)
    backend.set_default_float("float32")
    cfg = spec["config"]
    model, task = npformer_model(cfg, spec.get("weights"))
    model.train()
    trainer = npformer_trainer(cfg, model, task, make_batch(cfg, SEED + 1), 1)
    workers = trainer.workers  # the demos' data-parallel workers: MPI ranks here
    reduce_times, wait_times, reduce_bytes = [], [], []
    if workers is not None:  # several ranks: time the step's gradient sum, count its bytes
        reduce_gradients = workers.reduce_gradients

        def timed_reduce_gradients():  # the wait for the slower rank (a barrier), then the sum
            started = time.perf_counter()
            ctx.barrier()
            arrived = time.perf_counter()
            reduce_gradients()
            wait_times.append(arrived - started)
            reduce_times.append(time.perf_counter() - arrived)
            reduce_bytes.append(workers.reduced_bytes + 4)  # + the loss

        workers.reduce_gradients = timed_reduce_gradients
    windows = []  # a projection's: each step's backward after its first, its last callback
    if ctx.size == 1 and spec.get("project"):
        record_overlap_windows(model, task, windows)
    losses, times = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        ctx.barrier()
        started = time.perf_counter()
        losses.append(trainer.update())
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - started)
    params = sum(int(np.prod(p.shape)) for p in model.parameters())
    projected, buckets = {}, []
    if ctx.size == 1 and spec.get("project"):  # the per-rank batch: what P ranks would send
        projected = sparse_sum_bytes(model, task, cfg, PROJECTED_RANKS)
        buckets = bucket_bytes(model)
    if ctx.is_main:
        _emit(dict(train_times=times, losses=losses, ranks=ctx.size, params=params,
                   allreduce_times=reduce_times[spec["warmup"]:],
                   wait_times=wait_times[spec["warmup"]:],
                   allreduce_bytes=statistics.median(reduce_bytes) if reduce_bytes else None,
                   dense_bytes=(params + 1) * 4, projected_bytes=projected,
                   bucket_bytes=buckets,
                   overlap_window=statistics.median([w for w, _ in windows[spec["warmup"]:]]
                                                    or [0.0]),
                   last_window=statistics.median([w for _, w in windows[spec["warmup"]:]]
                                                 or [0.0])))
    return 0


def record_overlap_windows(model, task, windows: list) -> None:
    """Each step's windows for the buckets' sums, appended to ``windows`` as (seconds after
    the first, after the last moment its backward says gradients are final, to its end):
    ``model._gradients_final``'s calls (where the first bucket could start, and the last)
    and the task's ``loss_and_grad`` returning.  A process alone starts no sum: the
    callback is this recorder's."""
    calls: list[float] = []

    def gradients_final(modules):
        calls.append(time.perf_counter())

    loss_and_grad = task.loss_and_grad

    def timed_loss_and_grad(*args, **kwargs):
        calls.clear()
        loss = loss_and_grad(*args, **kwargs)
        end = time.perf_counter()
        windows.append((end - calls[0], end - calls[-1]) if calls else (0.0, 0.0))
        return loss

    model._on_gradients_final = gradients_final
    task.loss_and_grad = timed_loss_and_grad


def bucket_bytes(model) -> list[int]:
    """[bytes of each gradient bucket, in the order they start] of ``model`` (float32):
    the sums that overlap the backward (npformer.parallel.buckets); the lookup tables'
    rows, summed after it, are the rest of ``sparse_sum_bytes``'."""
    import numpy as np

    from npformer.parallel.workers import gradient_buckets

    params = model.trainable_parameters()
    buckets, _ = gradient_buckets(model, params, 4)
    return [sum(int(np.prod(p.shape)) for p in params[first:end]) * 4
            for first, end in buckets]


def sparse_sum_bytes(model, task, cfg: dict, ranks_list) -> dict:
    """{P: bytes of the row-sparse gradient sum at P ranks}: P ranks of this per-rank batch
    shape, each its own batch (``make_batch``'s, seeds SEED + 2, SEED + 3, ...; the timed
    runs reuse one), send every parameter but, of each lookup table, only the union of
    the rows their batches wrote (npformer.parallel.sparse: the lookups' records, or where
    none is known, the rows a scan finds changed), plus the loss."""
    import numpy as np

    from npformer.nn.flat import flat_buffer_of, rows_written
    from npformer.parallel.sparse import WHOLE_TABLE_SHARE, lookup_tables, written_rows

    tables = lookup_tables(model)
    flat = flat_buffer_of(model.parameters())  # its zeroing empties the records
    dense = (sum(int(np.prod(p.shape)) for p in model.parameters()) + 1) * 4
    unions = [np.zeros(t.shape[0], dtype=bool) for t in tables]
    result = {}
    for ranks in range(1, max(ranks_list) + 1):
        (model if flat is None else flat).zero_grad()
        task.loss_and_grad(model, make_batch(cfg, SEED + 1 + ranks))
        for union, table in zip(unions, tables):
            union |= written_rows(table.grad, rows_written(table))
        saved = sum((t.shape[0] - u.sum()) * t.shape[1] * 4 for t, u in zip(tables, unions)
                    if u.sum() <= WHOLE_TABLE_SHARE * t.shape[0])
        if ranks in ranks_list:
            result[ranks] = int(dense - saved)
        if not saved:  # every table goes whole already: more ranks change it no more
            result.update({r: int(dense) for r in ranks_list if r > ranks})
            break
    return result


def ddp_worker(spec: dict) -> int:
    """One PyTorch DDP process (gloo, 1 thread): its rows of the batch."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from bench.measure import prepare_pytorch
    from npformer.parallel import shard_bounds

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{spec['port']}")
    try:
        cfg = spec["config"]
        rows = shard_bounds(cfg["batch"], world)[rank]
        run = prepare_pytorch(cfg, SEED, None, rows=rows, wrap=DistributedDataParallel)
        optimizer = run.make_optimizer()
        losses, times = [], []
        for i in range(spec["warmup"] + spec["steps"]):
            dist.barrier()
            started = time.perf_counter()
            losses.append(run.step(optimizer))
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - started)
        # the reported loss: the ranks' mean (DDP's own average of the shards' losses)
        mean_losses = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(mean_losses)
        if rank == 0:
            _emit(dict(train_times=times, losses=(mean_losses / world).tolist(), ranks=world))
    finally:
        dist.destroy_process_group()
    return 0


def allreduce_worker(spec: dict) -> int:
    """Allreduce (sum, in place, float32) time against message size; rank 0 reports."""
    import numpy as np

    from npformer import parallel

    ctx = parallel.setup()
    from mpi4py import MPI

    medians = []
    for size in spec["sizes"]:
        buffer = np.ones(size, dtype=np.float32)
        times = []
        for i in range(spec["warmup"] + spec["repeats"]):
            ctx.barrier()
            started = time.perf_counter()
            ctx.comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - started)
        slowest = ctx.comm.allreduce(statistics.median(times), op=MPI.MAX)
        medians.append(slowest)
    if ctx.is_main:
        _emit(dict(ranks=ctx.size, sizes=list(spec["sizes"]), seconds=medians))
    return 0


WORKERS = {"--rank-worker": rank_worker, "--ddp-worker": ddp_worker,
           "--allreduce-worker": allreduce_worker}


# =========================================================================== parent side
def _mpiexec() -> str | None:
    return (shutil.which("mpiexec", path=str(Path(sys.executable).parent))
            or shutil.which("mpiexec"))


def _result(stdout: str, stderr: str, returncode: int) -> dict:
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (stderr.strip().splitlines() or ["(no output)"])[-1]
    return dict(error=f"exited {returncode}: {tail}")


def single_thread_env(env: dict) -> dict:
    env = dict(env)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = "1"
    return env


def run_mpi(flag: str, ranks: int, spec: dict, env: dict) -> dict:
    mpiexec = _mpiexec()
    if mpiexec is None:
        return dict(error="no mpiexec (pip install -e '.[mpi]')")
    proc = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, str(BENCH), flag,
                           json.dumps(spec)], env=single_thread_env(env), capture_output=True,
                          text=True)
    return _result(proc.stdout, proc.stderr, proc.returncode)


def run_mpi_copies(flag: str, copies: int, spec: dict, env: dict) -> dict:
    """``copies`` independent single-rank runs of ``spec`` at once (``mpiexec -n 1`` each,
    nothing sent between them): the first copy's result, its step times pooled with every
    copy's.  Two of them on the half batch are a 2-rank run without its gradient sum."""
    mpiexec = _mpiexec()
    if mpiexec is None:
        return dict(error="no mpiexec (pip install -e '.[mpi]')")
    procs = [subprocess.Popen([mpiexec, "-n", "1", sys.executable, str(BENCH), flag,
                               json.dumps(spec)], env=single_thread_env(env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(copies)]
    results = [_result(*p.communicate(), p.returncode) for p in procs]
    failed = next((r for r in results if "error" in r), None)
    if failed is not None:
        return failed
    return dict(results[0], train_times=[t for r in results for t in r["train_times"]])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp(ranks: int, spec: dict, env: dict) -> dict:
    spec = dict(spec, port=_free_port())
    procs = [subprocess.Popen([sys.executable, str(BENCH), "--ddp-worker", json.dumps(spec)],
                              env=dict(single_thread_env(env), RANK=str(r),
                                       WORLD_SIZE=str(ranks)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(ranks)]
    outputs = [p.communicate() for p in procs]
    failed = next((p.returncode for p in procs if p.returncode), 0)
    return _result(outputs[0][0], "\n".join(err for _, err in outputs), failed)


def run_modes(cfg: dict, args, run_worker) -> dict:
    """Every mode of one configuration: {mode: result}.  ``run_worker(side, cfg, threads,
    weights)`` runs the thread modes (bench.py's ordinary workers)."""
    import tempfile

    spec = dict(config=cfg, steps=args.steps, warmup=args.warmup)
    half = dict(cfg, batch=max(1, cfg["batch"] // 2))
    with tempfile.TemporaryDirectory(prefix="npformer-bench-") as tmp:
        weights = os.path.join(tmp, "init.npz")
        modes = {"PyTorch 2 threads": run_worker("pytorch", cfg, 2, weights)}
        modes["npformer 2 threads"] = run_worker("npformer", cfg, 2, weights)
        modes["npformer 2 ranks"] = run_mpi("--rank-worker", 2, dict(spec, weights=weights),
                                            args.env)
        modes["npformer 1 rank, half batch"] = run_mpi(
            "--rank-worker", 1, dict(spec, config=half, weights=None, project=True), args.env)
        modes[TWO_AT_ONCE] = run_mpi_copies("--rank-worker", 2,
                                            dict(spec, config=half, weights=None), args.env)
        modes["PyTorch DDP 2"] = run_ddp(2, spec, args.env)
    return modes


def run_allreduce_sweep(args) -> dict:
    sizes = SMOKE_ALLREDUCE_SIZES if args.smoke else ALLREDUCE_SIZES
    spec = dict(sizes=list(sizes), warmup=1 if args.smoke else 3,
                repeats=1 if args.smoke else 20)
    return {ranks: run_mpi("--allreduce-worker", ranks, spec, args.env)
            for ranks in ALLREDUCE_RANKS}


# =========================================================================== analysis
def fit_alpha_beta(sizes_bytes, seconds) -> tuple[float, float]:
    """Least-squares t = alpha + beta * bytes: (latency alpha in s, s per byte beta)."""
    import numpy as np

    beta, alpha = np.polyfit(np.asarray(sizes_bytes, float), np.asarray(seconds, float), 1)
    return float(alpha), float(beta)


def ring_allreduce_seconds(ranks: int, message_bytes: float, alpha: float,
                           bandwidth: float) -> float:
    """Ring all-reduce (reduce-scatter + all-gather): 2 (P - 1) messages of n / P bytes,
    t = 2 (P - 1) alpha + 2 (P - 1) / P * n / bandwidth."""
    return 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * message_bytes / bandwidth


def projection(compute_s: float, message_bytes: float, ranks: int,
               buckets: Sequence[float] = (), window_s: float = 0.0, last_window_s: float = 0.0,
               alpha: float = CLUSTER_LATENCY_S,
               bandwidth: float = CLUSTER_BANDWIDTH_BPS) -> tuple[float, float]:
    """(step seconds, efficiency) at ``ranks`` with a fixed per-rank batch: the step's
    compute, then what of the gradient sum the backward does not hide.

    ``message_bytes`` is the whole sum's; of it, ``buckets`` (bytes, in the order they
    start) are summed while the backward runs: each bucket's ring all-reduce starts when
    the backward has finished it, one after another, within the backward's last
    ``window_s`` (from its first finished bucket to its end); what they take beyond that
    window is left over, and at least what the last bucket's takes beyond the backward's
    last ``last_window_s`` (from its last finished bucket, the first block's, to its end:
    the embeddings' backward).  The rest (the lookup tables' rows, summed after the
    backward) is not hidden.  No buckets: no overlap, the whole sum after the compute."""
    sums = [ring_allreduce_seconds(ranks, b, alpha, bandwidth) for b in buckets]
    hidden_behind = max(sums[-1] - last_window_s if sums else 0.0, sum(sums) - window_s, 0.0)
    rest = message_bytes - sum(buckets)
    tail = ring_allreduce_seconds(ranks, rest, alpha, bandwidth) if rest > 0 else 0.0
    step = compute_s + hidden_behind + tail
    return step, compute_s / step


def _median(result: dict, key: str = "train_times") -> float | None:
    values = result.get(key)
    return statistics.median(values) if values else None


def size_text(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.1f} KiB"


def print_process_modes(results: dict) -> None:
    from bench.report import ms, ratio

    print()
    print("process modes (2 cores): training step, median ms (min-max) | first-step loss")
    for name, modes in results.items():
        print(f"{name}:")
        for mode, res in modes.items():
            if "error" in res:
                print(f"  {mode:<28} FAILED: {res['error']}")
                continue
            times = res["train_times"]
            print(f"  {mode:<28} {ms(statistics.median(times)):>8} ({ms(min(times))}-"
                  f"{ms(max(times))})  loss {res['losses'][0]:.5f}")
        ranks2, torch2 = _median(modes["npformer 2 ranks"]), _median(modes["PyTorch 2 threads"])
        ddp, threads = _median(modes["PyTorch DDP 2"]), _median(modes["npformer 2 threads"])
        one = _median(modes["npformer 1 rank, half batch"])
        at_once = _median(modes[TWO_AT_ONCE])
        reduce = _median(modes["npformer 2 ranks"], "allreduce_times")
        line = (f"processes {name:<8} 2 ranks / PyTorch 2 threads {ratio(ranks2, torch2)}  "
                f"/ PyTorch DDP {ratio(ranks2, ddp)}  / npformer threads "
                f"{ratio(ranks2, threads)}")
        if one and ranks2:
            line += f"  | scaling 1->2 ranks {one / ranks2:.0%}"
        if one and at_once:
            line += f" (two processes at once, nothing summed: {one / at_once:.0%})"
        if reduce is not None and ranks2:
            sent = modes["npformer 2 ranks"]
            wait = _median(sent, "wait_times")
            line += (f"  | waiting for the slower rank {ms(wait)} ms = {wait / ranks2:.0%}, "
                     f"gradient sum {ms(reduce)} ms = {reduce / ranks2:.0%} of the step "
                     f"({size_text(sent['allreduce_bytes'])} sent of "
                     f"{size_text(sent['dense_bytes'])})")
        print(line)


def print_allreduce(sweep: dict) -> dict:
    """The Allreduce table and its alpha-beta fits: {ranks: (alpha, beta)}."""
    print()
    print("Allreduce (float32, sum, in place; median, slowest rank) against message size:")
    fits = {}
    for ranks, res in sweep.items():
        if "error" in res:
            print(f"  {ranks} ranks: FAILED: {res['error']}")
            continue
        cells = "  ".join(f"{4 * n / 1024:g} KiB {s * 1e6:.0f} us"
                          for n, s in zip(res["sizes"], res["seconds"]))
        alpha, beta = fit_alpha_beta([4 * n for n in res["sizes"]], res["seconds"])
        fits[ranks] = (alpha, beta)
        print(f"  {ranks} ranks: {cells}")
        print(f"  {ranks} ranks fit: alpha {alpha * 1e6:.1f} us, 1/beta "
              f"{(1 / beta if beta > 0 else float('inf')) / 1e9:.2f} GB/s")
    return fits


def print_projection(results: dict) -> None:
    print()
    print(f"projection at a fixed per-rank batch (half the configuration's batch), ring "
          f"all-reduce, alpha {CLUSTER_LATENCY_S * 1e6:g} us, bandwidth "
          f"{CLUSTER_BANDWIDTH_BPS / 1e9:g} GB/s (100 Gb/s InfiniBand); the buckets' sums "
          f"overlap the backward from its first finished bucket (the window, measured), the "
          f"lookup tables' rows are summed after it (in brackets: without overlap):")
    for name, modes in results.items():
        one = modes["npformer 1 rank, half batch"]
        compute, messages = _median(one), one.get("projected_bytes")
        if compute is None or not messages:
            print(f"  {name}: n/a (a mode failed)")
            continue
        buckets, window = one.get("bucket_bytes", []), one.get("overlap_window", 0.0)
        last = one.get("last_window", 0.0)
        cells = []
        for ranks in PROJECTED_RANKS:
            message = messages[str(ranks)]  # JSON keys: strings
            step, efficiency = projection(compute, message, ranks, buckets, window, last)
            _, alone = projection(compute, message, ranks)
            cells.append(f"{ranks} ranks {size_text(message)} {step * 1e3:.1f} ms "
                         f"{efficiency:.0%} ({alone:.0%})")
        print(f"  {name:<8} compute {compute * 1e3:.1f} ms, {len(buckets)} buckets "
              f"{size_text(sum(buckets))}, window {window * 1e3:.1f} ms (after the last "
              f"{last * 1e3:.1f} ms): " + "  ".join(cells))
