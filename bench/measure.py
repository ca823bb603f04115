"""The worker side of the benchmark: one (configuration, side) in a fresh process,
built, warmed up, and measured (training steps, inference, peak memory); its result
is one JSON line on standard output."""
from __future__ import annotations

import json
import os
import re
import sys
import time

from bench.configs import LR, PAD, ROOT, WARMUP_CONFIGS, make_batch, npformer_model
from bench.torch_models import torch_reference

RESULT_PREFIX = "BENCH_RESULT "


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure_training(make_optimizer, step, warmup: int, steps: int) -> dict:
    """Baseline RSS, optimizer, warmup + timed training steps, peak RSS."""
    import gc

    gc.collect()
    baseline = current_rss()
    optimizer = make_optimizer()
    losses = []
    times = timed(lambda: losses.append(step(optimizer)), warmup, steps)
    peak = peak_rss()
    return dict(baseline_rss=baseline, peak_rss=peak, mem_growth=peak - baseline,
                losses=losses, train_times=times)


def timed(fn, warmup: int, steps: int, sync=None) -> list[float]:
    """Seconds of each of ``steps`` calls of ``fn`` after ``warmup`` untimed ones.
    ``sync`` (a device's synchronize) runs before the clock is read at the start and
    at the end of each call, so asynchronous device work is inside the call's time."""
    sync = sync or (lambda: None)
    times = []
    for i in range(warmup + steps):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        elapsed = time.perf_counter() - started
        if i >= warmup:
            times.append(elapsed)
    return times


class Prepared:
    """One side's model on one batch: ``step(optimizer) -> loss`` and ``infer()``."""

    def __init__(self, model, make_optimizer, step, infer):
        self.model, self.make_optimizer, self.step, self.infer = (model, make_optimizer, step,
                                                                  infer)


def prepare_pytorch(cfg: dict, seed: int, weights: str | None, rows: tuple | None = None,
                    wrap=None, device: str = "cpu") -> Prepared:
    """The PyTorch side on the batch's ``rows`` (lo, hi) (all by default); ``wrap``:
    e.g. DistributedDataParallel around the model for training.  Model and batch live
    on ``device`` ("cpu", "cuda"); the model is built on the CPU first, so its initial
    weights are the same whatever the device."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    model = torch_reference(cfg).train()  # train(): dropout is 0 anyway
    if weights:
        np.savez(weights, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    model.to(device)
    lo, hi = rows or (0, cfg["batch"])
    batch = [torch.from_numpy(np.asarray(a)[lo:hi]).to(device)
             for a in make_batch(cfg, seed + 1)]
    kind = cfg["kind"]
    net = wrap(model) if wrap else model

    def forward():
        if kind == "classifier":
            return net(batch[0], batch[1])
        if kind == "causal_lm":
            return net(batch[0])
        return net(batch[0], batch[2], batch[1], batch[4])

    def loss_fn(logits):
        if kind == "classifier":
            return F.cross_entropy(logits, batch[2])
        if kind == "causal_lm":
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))
        targets = torch.where(batch[3] == PAD, -100, batch[3])  # padding targets ignored
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100, label_smoothing=0.0)

    def step(optimizer):
        optimizer.zero_grad()
        loss = loss_fn(forward())
        loss.backward()
        optimizer.step()
        return loss.item()

    def infer():
        with torch.inference_mode():
            forward()

    return Prepared(model, lambda: torch.optim.Adam(model.parameters(), lr=LR), step, infer)


def prepare_npformer(cfg: dict, seed: int, weights: str | None, threads: int = 1,
                     backend_name: str = "numpy") -> Prepared:
    """npformer on ``backend_name``.  The CPU path ("numpy") with ``threads`` cores: that
    many data-parallel replicas in threads, each with single-threaded BLAS (training),
    and the batch split the same way for inference; other backends ("cupy") take one
    replica (threads=1).  The training batch stays on the host, as npformer's tasks take
    it (each step copies its ids to the device); the inference batch is copied once."""
    from npformer import backend, no_grad, optim
    from npformer.parallel import DataParallel, parallel_map, split_batch

    if backend_name != "numpy" and threads != 1:
        raise ValueError(f"threads: backend {backend_name!r} runs one replica, so threads "
                         f"must be 1, got {threads}")
    backend.set_backend(backend_name, seed=seed)
    backend.set_default_float("float32")
    kind = cfg["kind"]
    model, task = npformer_model(cfg, weights)
    model.train()
    batch = make_batch(cfg, seed + 1)
    parallel = DataParallel(model, threads)
    shards = [[backend.asarray(a) for a in shard] for shard in split_batch(tuple(batch), threads)]

    def step(optimizer):
        optimizer.zero_grad()
        loss, _ = parallel.loss_and_grad(task, batch, 1.0, seed=0)
        optimizer.step()
        return loss

    def forward(inputs):
        if kind == "classifier":
            return model(inputs[0], inputs[1])
        if kind == "causal_lm":
            return model(inputs[0])
        return model(inputs[0], inputs[2], inputs[1], inputs[4])

    def infer():
        with no_grad():
            parallel_map(forward, shards, threads)

    return Prepared(model, lambda: optim.Adam(model.parameters(), lr=LR), step, infer)


def initial_weights(side: str, path: str | None) -> tuple[str | None, bool]:
    """(weights, loaded): PyTorch writes the initial weights to ``path`` (loaded False);
    npformer reads them if they are there (loaded True), else starts from its own."""
    if side == "pytorch":
        return path, False
    loaded = bool(path) and os.path.exists(path)
    return (path if loaded else None), loaded


def warm_up(prepare, kind: str, seed: int) -> None:
    """One step and one inference of a tiny model of kind ``kind``, so that code the
    libraries load on first use (PyTorch imports ~800 modules, ~70 MiB, at its first
    Adam step; CuPy compiles its kernels) is neither timed nor counted as step memory."""
    import gc

    tiny = prepare(WARMUP_CONFIGS[kind], seed, None)
    tiny.step(tiny.make_optimizer())
    tiny.model.eval()
    tiny.infer()
    del tiny
    gc.collect()


def run_side(spec: dict) -> dict:
    """Library warm-up on a tiny model, then the measured model: training, then inference."""
    import numpy as np

    side, cfg, seed = spec["side"], spec["config"], spec["seed"]
    weights, loaded = initial_weights(side, spec.get("weights"))
    if side == "pytorch":
        import torch

        torch.set_num_threads(spec["threads"])
        prepare = prepare_pytorch
        info = dict(threads=torch.get_num_threads(), version=torch.__version__,
                    blas=_torch_blas(torch))
    else:
        try:  # the *_NUM_THREADS variables set by the parent already limit OpenBLAS
            from threadpoolctl import threadpool_limits

            threadpool_limits(spec["threads"])
        except ImportError:
            pass
        threads = spec["threads"]

        def prepare(cfg_, seed_, weights_):
            return prepare_npformer(cfg_, seed_, weights_, threads)
        info = dict(threads=threads, version=np.__version__, blas=_numpy_blas(np))

    warm_up(prepare, cfg["kind"], seed)
    run = prepare(cfg, seed, weights)
    result = measure_training(run.make_optimizer, run.step, spec["warmup"], spec["steps"])
    run.model.eval()  # npformer: no dropout masks; PyTorch: eval mode (may take fast paths)
    result["infer_times"] = timed(run.infer, spec["warmup"], spec["steps"])
    if side == "pytorch":
        params = sum(p.numel() for p in run.model.parameters())
    else:
        params = sum(int(np.prod(p.shape)) for p in run.model.parameters())
    result.update(info, params=params, weights_loaded=loaded)
    return result


def worker_result(proc, side: str) -> dict:
    """The result a finished worker process (``subprocess.run``, text output) printed,
    or {"side", "error"} with the last line of its standard error."""
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return dict(side=side, error=f"worker exited {proc.returncode}: {tail}")


def _torch_blas(torch) -> str:
    info = torch.__config__.show()
    m = re.search(r"BLAS_INFO=(\w+)", info)
    return m.group(1) if m else "?"


def _numpy_blas(np) -> str:
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # noqa: BLE001 - informational only
        return "?"


def worker_main(spec_json: str, run=run_side) -> int:
    """A worker process: ``run(spec)`` (the CPU bench's ``run_side`` by default), its
    result printed as one JSON line after ``RESULT_PREFIX``."""
    spec = json.loads(spec_json)
    sys.path.insert(0, str(ROOT))
    result = run(spec)
    result["side"] = spec["side"]
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0

