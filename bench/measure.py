"""The worker side of the benchmark: one (configuration, side) in a fresh process,
built, warmed up, and measured (training steps, inference, peak memory); its result
is one JSON line on standard output."""
from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np

from bench.configs import (
    PAD,
    ROOT,
    SEED,
    WARMUP_CONFIGS,
    clip_norm,
    demo_initial_state,
    label_smoothing,
    make_batch,
    npformer_config,
    npformer_model,
    npformer_optimizer,
)
from bench.torch_models import (
    NANOGPT,
    nanogpt_folder,
    nanogpt_model,
    nanogpt_state_dict,
    torch_optimizer_like,
    torch_reference,
)

RESULT_PREFIX = "BENCH_RESULT "


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Start the peak RSS over from the current RSS (Linux: writing 5 to
    /proc/self/clear_refs resets VmHWM), so that the peak read after the steps is
    theirs, not that of building the model or of the loss check before them.  False
    where the kernel does not allow it (the peak is then the process's whole life)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """The peak RSS since the last reset (VmHWM), else the process's (``ru_maxrss``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim(0)``), so that the
    baseline RSS holds live memory only: memory freed before it (the loss check's
    forward, building the model) would otherwise stay resident and be reused by the
    steps without showing as growth.  False where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def measure_training(make_optimizer, step, warmup: int, steps: int) -> dict:
    """Baseline RSS, optimizer, warmup + timed training steps, peak RSS over them."""
    import gc

    gc.collect()
    release_free_heap()
    baseline = current_rss()
    peak_reset = reset_peak_rss()
    optimizer = make_optimizer()
    losses = []
    times = timed(lambda: losses.append(step(optimizer)), warmup, steps)
    peak = peak_rss()
    return dict(baseline_rss=baseline, peak_rss=peak, mem_growth=peak - baseline,
                peak_reset=peak_reset,
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
    """One side's model on one batch: ``make_optimizer() -> state`` (built after the
    memory baseline), ``step(state) -> loss`` (one update as the demo makes it),
    ``infer()``, and ``check_loss()``: the loss at the current weights with dropout off
    (the sides' first-step losses are compared on it: dropout masks differ)."""

    def __init__(self, model, make_optimizer, step, infer, check_loss):
        self.model, self.make_optimizer, self.step = model, make_optimizer, step
        self.infer, self.check_loss = infer, check_loss


def torch_batch(cfg: dict, seed: int, rows: tuple | None, device: str):
    import numpy as np
    import torch

    lo, hi = rows or (0, cfg["batch"])
    return [torch.from_numpy(np.asarray(a)[lo:hi]).to(device) for a in make_batch(cfg, seed + 1)]


def torch_update(cfg: dict, model, loss_of, net=None) -> tuple:
    """(make_optimizer, step) of the demo's update in PyTorch: zero_grad, the loss
    (``loss_of(net)``), backward, clip_grad_norm_, the AdamW / Adam step, the schedule."""
    import torch

    from npformer import optim
    from npformer.nn import Parameter

    net = net or model
    stand_in = [Parameter(np.zeros(1, dtype=np.float32))]  # the demo's optimizer, read
    settings = npformer_optimizer(cfg, stand_in)
    max_norm = clip_norm(cfg)
    assert isinstance(settings, optim.Adam), settings  # Adam or AdamW: torch has both

    def make_optimizer():
        return torch_optimizer_like(settings, model)

    def step(state):
        optimizer, scheduler = state
        optimizer.zero_grad()
        loss = loss_of(net)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        scheduler.step()
        return loss.item()

    return make_optimizer, step


def torch_check_loss(model, loss_of):
    """The loss with dropout off (eval mode; gradients on, so no inference fast path)."""
    def check_loss():
        model.eval()
        try:
            return loss_of(model).item()
        finally:
            model.train()
    return check_loss


def prepare_pytorch(cfg: dict, seed: int, weights: str | None, rows: tuple | None = None,
                    wrap=None, device: str = "cpu") -> Prepared:
    """The PyTorch side on the batch's ``rows`` (lo, hi) (all by default), from the demo's
    own initial weights (:func:`bench.configs.demo_initial_state`), which it writes to
    ``weights`` for npformer and nanoGPT; ``wrap``:
    e.g. DistributedDataParallel around the model for training.  Model and batch live
    on ``device`` ("cpu", "cuda"); the model is built on the CPU first, so its initial
    weights are the same whatever the device."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    model = torch_reference(cfg).train()
    initial = demo_initial_state(cfg, seed)  # the demo's own init, not torch's
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    if weights:
        np.savez(weights, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    model.to(device)
    batch = torch_batch(cfg, seed, rows, device)
    kind, smoothing = cfg["kind"], label_smoothing(cfg)

    def forward(net):
        if kind == "classifier":
            return net(batch[0], batch[1])
        if kind == "causal_lm":
            return net(batch[0])
        return net(batch[0], batch[2], batch[1], batch[4])

    def loss_of(net):
        logits = forward(net)
        if kind == "classifier":
            return F.cross_entropy(logits, batch[2])
        if kind == "causal_lm":
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))
        targets = torch.where(batch[3] == PAD, -100, batch[3])  # padding targets ignored
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100, label_smoothing=smoothing)

    def infer():
        with torch.inference_mode():
            forward(model)

    make_optimizer, step = torch_update(cfg, model, loss_of, wrap(model) if wrap else model)
    return Prepared(model, make_optimizer, step, infer, torch_check_loss(model, loss_of))


def prepare_nanogpt(cfg: dict, seed: int, weights: str | None) -> Prepared:
    """nanoGPT's own ``GPT`` (model.py in the folder ``$NPFORMER_NANOGPT`` names) for the lm
    configuration, with the reference's initial weights from ``weights`` (mapped to
    nanoGPT's names) and the demo's update, on the same batch; its forward computes the
    loss itself."""
    import torch

    folder = nanogpt_folder(ROOT)
    if folder is None:
        raise FileNotFoundError(f"no nanoGPT model.py: set ${NANOGPT} to its folder")
    config = npformer_config(cfg)
    torch.manual_seed(seed)
    model = nanogpt_model(config, folder).train()
    if weights:
        with np.load(weights) as f:
            state = nanogpt_state_dict({k: torch.from_numpy(f[k]) for k in f.files},
                                       config.num_layers)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any(not k.endswith("attn.bias") for k in missing):  # causal buffers
            raise ValueError(f"nanoGPT weights: missing {missing}, unexpected {unexpected}")
    x, y = torch_batch(cfg, seed, None, "cpu")

    def loss_of(net):
        return net(x, y)[1]

    def infer():
        with torch.inference_mode():
            model(x, y)

    make_optimizer, step = torch_update(cfg, model, loss_of)
    return Prepared(model, make_optimizer, step, infer, torch_check_loss(model, loss_of))


def prepare_npformer(cfg: dict, seed: int, weights: str | None, threads: int = 1,
                     backend_name: str = "numpy", tier: str = "fast") -> Prepared:
    """npformer's ``tier`` ("fast", the demos' default, or "textbook": the model and
    optimizer classes the demo's ``implementations(tier)`` names) on ``backend_name``,
    updated by the demos' own Trainer.update() (its data-parallel workers, the demo's
    clipping and optimizer).  The CPU path ("numpy")
    with ``threads`` cores: that many data-parallel replicas in threads, each with
    single-threaded BLAS (training), and the batch split the same way for inference;
    other backends ("cupy") take one replica (threads=1).  The training batch stays on
    the host, as npformer's tasks take it (each step copies its ids to the device); the
    inference batch is copied once."""
    from npformer import backend, no_grad, ops
    from npformer.nn import evaluating
    from npformer.parallel import parallel_map, split_batch

    if backend_name != "numpy" and threads != 1:
        raise ValueError(f"threads: backend {backend_name!r} runs one replica, so threads "
                         f"must be 1, got {threads}")
    backend.set_backend(backend_name, seed=seed)
    backend.set_default_float("float32")
    kind = cfg["kind"]
    model, task = npformer_model(cfg, weights, tier)
    model.train()
    batch = make_batch(cfg, seed + 1)
    shards = [[backend.asarray(a) for a in shard] for shard in split_batch(tuple(batch), threads)]

    def make_optimizer():
        return npformer_trainer(cfg, model, task, batch, threads, tier)

    def step(trainer):
        return trainer.update()

    def forward(inputs):
        if kind == "classifier":
            return model(inputs[0], inputs[1])
        if kind == "causal_lm":
            return model(inputs[0])
        return model(inputs[0], inputs[2], inputs[1], inputs[4])

    def infer():
        with no_grad():
            parallel_map(forward, shards, threads)

    def check_loss():
        with evaluating(model), no_grad():  # dropout off
            logits = forward([backend.asarray(a) for a in batch])
            if kind == "classifier":
                targets, smoothing = batch[2], 0.0
            elif kind == "causal_lm":
                targets, smoothing = batch[1], 0.0
            else:
                targets = np.where(batch[3] == PAD, ops.IGNORE_INDEX, batch[3])
                smoothing = label_smoothing(cfg)
            loss, _ = ops.cross_entropy_forward(logits, backend.asarray(targets),
                                                label_smoothing=smoothing)
        return backend.to_float(loss)

    return Prepared(model, make_optimizer, step, infer, check_loss)


def npformer_trainer(cfg: dict, model, task, batch, replicas: int, tier: str = "fast"):
    """The demo's Trainer (its optimizer on ``tier``, its clipping) on one fixed batch: its
    update() is the step users run (threads, or MPI ranks under mpiexec)."""
    from npformer.train import TrainConfig, Trainer

    optimizer = npformer_optimizer(cfg, model.parameters(), tier)
    return Trainer(model, optimizer, task, lambda rng: batch,
                   TrainConfig(max_iters=10**9, replicas=replicas, clip_norm=clip_norm(cfg),
                               progress=False), seed=SEED)


def initial_weights(side: str, path: str | None) -> tuple[str | None, bool]:
    """(weights, loaded): PyTorch writes the initial weights to ``path`` (loaded False);
    npformer reads them if they are there (loaded True), else starts from its own."""
    if side == "pytorch":
        return path, False  # nanoGPT and npformer read them
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


def side_library(side: str, threads: int, tier: str = "fast") -> tuple:
    """(prepare(cfg, seed, weights), library info) of a side, its threads set (npformer:
    on ``tier``)."""
    if side in ("pytorch", "nanogpt"):
        import torch

        torch.set_num_threads(threads)
        info = dict(threads=torch.get_num_threads(), version=torch.__version__,
                    blas=_torch_blas(torch))
        return (prepare_pytorch if side == "pytorch" else prepare_nanogpt), info
    try:  # the *_NUM_THREADS variables set by the parent already limit OpenBLAS
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads)
    except ImportError:
        pass

    def prepare(cfg_, seed_, weights_):
        return prepare_npformer(cfg_, seed_, weights_, threads, tier=tier)
    return prepare, dict(threads=threads, version=np.__version__, blas=_numpy_blas(np),
                         tier=tier)


def run_side(spec: dict) -> dict:
    """Library warm-up on a tiny model, then the measured model: the loss with dropout off
    at the initial weights, training, then inference.  npformer runs on ``spec["tier"]``
    (default "fast"; the other sides ignore it)."""
    side, cfg, seed = spec["side"], spec["config"], spec["seed"]
    weights, loaded = initial_weights(side, spec.get("weights"))
    prepare, info = side_library(side, spec["threads"], spec.get("tier", "fast"))
    warm_up(prepare, cfg["kind"], seed)
    run = prepare(cfg, seed, weights)
    check_loss = run.check_loss()
    result = measure_training(run.make_optimizer, run.step, spec["warmup"], spec["steps"])
    run.model.eval()  # npformer: no dropout masks; PyTorch: eval mode (may take fast paths)
    result["infer_times"] = timed(run.infer, spec["warmup"], spec["steps"])
    if side == "npformer":
        params = sum(int(np.prod(p.shape)) for p in run.model.parameters())
    else:
        params = sum(p.numel() for p in run.model.parameters())
    result.update(info, params=params, weights_loaded=loaded, check_loss=check_loss)
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
    """torch.__config__'s BLAS (e.g. "mkl, oneAPI Math Kernel Library 2024.2")."""
    info = torch.__config__.show()
    m = re.search(r"BLAS_INFO=(\w+)", info)
    version = re.search(r"Math Kernel Library Version ([\d.]+)", info)
    return ", ".join(x for x in (m.group(1) if m else "?",
                                 f"MKL {version.group(1)}" if version else "") if x)


def _numpy_blas(np) -> str:
    """NumPy's BLAS: np.show_config's build entry, and threadpoolctl's view of the library
    loaded (its version and the CPU kernels it picked, e.g. "openblas 0.3.27 SkylakeX")."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        built = f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # noqa: BLE001 - informational only
        built = "?"
    try:
        from threadpoolctl import threadpool_info

        loaded = [f"{i.get('internal_api', '?')} {i.get('version') or ''} "
                  f"{i.get('architecture') or ''}".strip()
                  for i in threadpool_info() if i.get("user_api") == "blas"]
    except ImportError:
        loaded = []
    return built + (f"; loaded: {', '.join(loaded)}" if loaded else "")


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

