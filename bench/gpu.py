#!/usr/bin/env python
"""npformer on CuPy against PyTorch eager on CUDA: training step, inference, peak GPU memory.

    python bench/gpu.py                         # imdb, lm, seq2seq, imdb_large, lm_large
    python bench/gpu.py --configs lm_large --steps 50
    python bench/gpu.py --markdown --json gpu.json   # + README-ready table, + raw results
    python bench/gpu.py --smoke                 # tiny sizes, 2 steps: does it all run?
    python bench/gpu.py --profile lm            # npformer's step under cProfile (top 25)
    python bench/gpu.py --smoke --device cpu    # the same orchestration on the CPU (tests)

The same models and updates as bench/bench.py (the demos' own), float32, the same
batch, on one GPU.  npformer is timed twice on a GPU: eagerly ("npformer"), and with each
update replayed as a CUDA graph ("npformer-graph": NPFORMER_CUDA_GRAPH=1, the Trainer's
graph mode, npformer/gpu/cuda_graph.py; where it cannot capture it says so and runs eagerly).
Every (configuration, side) runs in a fresh subprocess (``--worker``, one JSON
line on stdout), PyTorch first: it writes its initial weights to an .npz that the
npformer side loads, so the first-step losses must agree.

Timing: the device is synchronized before the clock is read at the start and at the
end of every timed step (``torch.cuda.synchronize()``; CuPy: the current stream's
``synchronize()``).  Memory is measured afterwards, in a separate pass of a few more
training steps, so its bookkeeping never touches the times: PyTorch's
``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``; CuPy's
peak of the default memory pool's ``used_bytes()``, recorded by a tracking allocator
(``cupy.cuda.set_allocator``) around the pool's ``malloc``.  Both count memory handed
out to live arrays (parameters, gradients, Adam state, the batch, activations), not
free blocks kept cached by the allocators.

The code: bench/configs.py (the configurations, LARGE among them), bench/measure.py
(preparing each side, timing, the worker protocol), bench/runner.py (the workers'
environment and runner, shared with bench/bench.py), bench/report.py (the formatting,
shared with bench/bench.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:  # `python bench/gpu.py`: the bench package, not this file
    sys.path.insert(0, str(ROOT))

from bench import runner  # noqa: E402
from bench.configs import GPU_CONFIGS, GPU_SMOKE, SEED, SIDES  # noqa: E402
from bench.measure import (  # noqa: E402
    initial_weights,
    prepare_npformer,
    prepare_pytorch,
    timed,
    warm_up,
    worker_main,
)
from bench.report import (  # noqa: E402
    LOSS_NOTE,
    TRAIN_TIMING,
    describe,
    markdown_lines,
    ms,
    ratio_line,
    spread,
    summary,
)

MEMORY_STEPS = 3  # training steps of the memory pass, after the timed ones
GRAPH_SIDE = "npformer-graph"  # npformer with each update replayed as a CUDA graph
GPU_SIDES = SIDES + (GRAPH_SIDE,)
PROFILE_STEPS = 10
PROFILE_TOP = 25
TF32_VARIABLES = ("CUPY_TF32", "NVIDIA_TF32_OVERRIDE")


# =========================================================================== worker side
class NoDeviceMemory:
    """The CPU (``--device cpu``): no device memory to measure."""

    def start(self):
        return None

    def stop(self):
        return None


class TorchPeak:
    """PyTorch's ``max_memory_allocated`` between start() and stop(): bytes of live
    tensors handed out by its caching allocator (its cached free blocks not counted)."""

    def __init__(self, torch):
        self.torch = torch

    def start(self) -> int:
        """Resets the peak; returns the bytes in use now (at rest, before the pass)."""
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        return self.torch.cuda.memory_allocated()

    def stop(self) -> int:
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated()


class CupyPeak:
    """The peak of CuPy's default memory pool's ``used_bytes()`` between start() and
    stop(): bytes of live arrays (the pool's cached free blocks not counted).  A tracking
    allocator, installed with ``cupy.cuda.set_allocator`` only for the pass, calls the
    pool's ``malloc`` and reads ``used_bytes()`` after each allocation: the in-use total
    only rises at an allocation, so its maximum is seen there."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.pool = cupy.get_default_memory_pool()
        self.peak = 0

    def _malloc(self, size: int):
        memory = self.pool.malloc(size)
        self.peak = max(self.peak, self.pool.used_bytes())
        return memory

    def start(self) -> int:
        """Installs the tracking allocator; returns the bytes in use now (at rest)."""
        self.cupy.cuda.get_current_stream().synchronize()
        self.peak = self.pool.used_bytes()
        self.cupy.cuda.set_allocator(self._malloc)
        return self.peak

    def stop(self) -> int:
        self.cupy.cuda.get_current_stream().synchronize()
        self.cupy.cuda.set_allocator(self.pool.malloc)  # the default allocator again
        return self.peak


@dataclass
class Side:
    """What differs between the sides and devices: building a side's model on a batch
    (``prepare(cfg, seed, weights) -> measure.Prepared``), waiting for the device
    (``sync``, None on the CPU), its memory counter, and what it reports about itself."""
    prepare: Callable
    sync: Callable | None
    memory: Any
    info: dict


def _torch_tf32(torch) -> dict:
    """PyTorch's float32 matmul settings, as found (nothing is set here)."""
    import warnings

    with warnings.catch_warnings():  # newer releases deprecate some of these names
        warnings.simplefilter("ignore")
        return dict(allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
                    matmul_precision=torch.get_float32_matmul_precision(),
                    fp32_precision=getattr(torch.backends.cuda.matmul, "fp32_precision", None))


def pytorch_side(device: str) -> Side:
    import torch

    def prepare(cfg, seed, weights):
        return prepare_pytorch(cfg, seed, weights, device=device)

    info = dict(version=torch.__version__)
    if device == "cpu":
        return Side(prepare, None, NoDeviceMemory(), info)
    info.update(cuda=torch.version.cuda, device_name=torch.cuda.get_device_name(),
                tf32=_torch_tf32(torch))
    return Side(prepare, torch.cuda.synchronize, TorchPeak(torch), info)


def npformer_side(device: str, graph: bool = False) -> Side:
    import numpy as np

    backend_name = "numpy" if device == "cpu" else "cupy"
    os.environ["NPFORMER_CUDA_GRAPH"] = "1" if graph else "0"  # the Trainer reads it

    def prepare(cfg, seed, weights):
        return prepare_npformer(cfg, seed, weights, threads=1, backend_name=backend_name)

    info = dict(version=np.__version__, numpy=np.__version__)
    if device == "cpu":
        return Side(prepare, None, NoDeviceMemory(), info)
    import cupy

    def sync():
        cupy.cuda.get_current_stream().synchronize()

    info.update(version=cupy.__version__, cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                tf32_env={name: os.environ.get(name) for name in TF32_VARIABLES})
    return Side(prepare, sync, CupyPeak(cupy), info)


def make_side(name: str, device: str) -> Side:
    if name == "pytorch":
        return pytorch_side(device)
    return npformer_side(device, graph=name == GRAPH_SIDE)


def trainer_graphs(step_owner):
    """The CUDA graphs an npformer Trainer replays (``step_owner.cuda_graphs.graphs``), or
    None: another side's optimizer, or no graphs."""
    return getattr(getattr(step_owner, "cuda_graphs", None), "graphs", None)


def graph_pool_bytes(graphs) -> int:
    """The bytes the CUDA graphs' own memory pools hold (0 without graphs): every replay
    reuses them, so they stay in use for the graphs' life, outside the default pool that
    the memory pass watches."""
    if not graphs:
        return 0
    return sum(shape.pool.total_bytes() for shape in graphs.shapes.values()
               if shape.pool is not None)


def run_device_side(spec: dict) -> dict:
    """Library warm-up on a tiny model, then the measured model: timed training steps,
    the memory pass (more training steps), timed inference."""
    cfg, seed = spec["config"], spec["seed"]
    side = make_side(spec["side"], spec["device"])
    weights, loaded = initial_weights(spec["side"], spec.get("weights"))
    warm_up(side.prepare, cfg["kind"], seed)
    run = side.prepare(cfg, seed, weights)
    check_loss = run.check_loss()
    optimizer = run.make_optimizer()
    losses = []

    def train_step():
        losses.append(run.step(optimizer))

    train_times = timed(train_step, spec["warmup"], spec["steps"], side.sync)
    rest_bytes = side.memory.start()
    for _ in range(spec["memory_steps"]):
        train_step()
    peak_bytes = side.memory.stop()
    graphs = trainer_graphs(optimizer)  # the Trainer's CUDA graphs, if any
    graph_pools = graph_pool_bytes(graphs)
    if graph_pools:
        rest_bytes, peak_bytes = rest_bytes + graph_pools, peak_bytes + graph_pools
    run.model.eval()  # npformer: no dropout masks; PyTorch: eval mode (may take fast paths)
    infer_times = timed(run.infer, spec["warmup"], spec["steps"], side.sync)
    graph = (dict(captures=graphs.captures, capture_seconds=graphs.capture_seconds)
             if graphs else None)
    return dict(side.info, train_times=train_times, infer_times=infer_times, losses=losses,
                rest_bytes=rest_bytes, peak_bytes=peak_bytes, weights_loaded=loaded,
                check_loss=check_loss, graph=graph)


# =========================================================================== parent side
def missing_for_gpu(need_torch: bool = True) -> str | None:
    """What is missing for the GPU run (CuPy with a device; a CUDA build of torch), in
    one line, or None."""
    missing = []
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            missing.append("CuPy finds no GPU")
    except ImportError:
        missing.append("cupy is not installed (pip install -e \".[gpu-cuda13]\" or "
                       "\".[gpu-cuda12]\": docs/guide.md, \"On a GPU: install\", says which)")
    except Exception as exc:  # noqa: BLE001 - a CUDA driver/runtime error: report it
        missing.append(f"CuPy finds no usable GPU ({' '.join(str(exc).split())})")
    if need_torch:
        try:
            import torch

            if torch.version.cuda is None:
                missing.append(f"torch {torch.__version__} is a CPU-only build (a CUDA build "
                               "is needed)")
            elif not torch.cuda.is_available():
                missing.append(f"torch {torch.__version__} finds no CUDA device")
        except ImportError:
            missing.append("torch is not installed")
    return "; ".join(missing) or None


def run_worker(side: str, cfg: dict, args, weights: str) -> dict:
    spec = dict(side=side, config=cfg, steps=args.steps, warmup=args.warmup,
                memory_steps=MEMORY_STEPS, seed=SEED, weights=weights, device=args.device)
    return runner.run_worker(Path(__file__).resolve(), spec, runner.worker_env())


def run_pair(cfg: dict, args) -> dict:
    """Both sides of one configuration, PyTorch first (it writes the initial weights);
    nanoGPT's GPT is bench/bench.py's (CPU) only."""
    sides = ["npformer", GRAPH_SIDE] if args.device == "cuda" else ["npformer"]
    return runner.run_sides(cfg, lambda side, weights: run_worker(side, cfg, args, weights),
                            sides, nanogpt=False)


# --------------------------------------------------------------------------- formatting
def mib_cell(value: float | None) -> str:
    return "" if value is None else f"{value:,.1f}"


COLUMNS = (("side", 16), ("train ms (min-max)", 24), ("infer ms (min-max)", 24),
           ("tokens/s", 12), ("at rest MiB", 13), ("peak MiB", 11), ("first loss", 12),
           ("final loss", 12))


def table_row(cells) -> str:
    (first, width), *rest = COLUMNS
    return "  " + f"{cells[0]:<{width}}" + "".join(
        f"{cell:>{w}}" for cell, (_, w) in zip(cells[1:], rest))


def side_row(side: str, res: dict, cfg: dict) -> str:
    s = summary(res, cfg)
    if s is None:
        return f"  {side:<16}FAILED: {res['error']}"
    return table_row((side, spread(res["train_times"]), spread(res["infer_times"]),
                      f"{s['tok_s']:,.0f}", mib_cell(s["rest"]), mib_cell(s["mem"]),
                      f"{s['loss']:.5f}", f"{s['final_loss']:.5f}"))


def config_lines(name: str, cfg: dict, pair: dict) -> list[str]:
    """One configuration's table: a row per side, the npformer / PyTorch ratios with the
    first-step loss check (and a WARNING line when the losses disagree)."""
    lines = ["", describe(name, cfg), table_row([c for c, _ in COLUMNS]),
             "  " + "-" * sum(w for _, w in COLUMNS)]
    lines += [side_row(side, pair[side], cfg) for side in GPU_SIDES if side in pair]
    lines += ratio_line(name, pair, cfg, memory="peak memory").split("\n")
    if GRAPH_SIDE in pair:
        graph_pair = {**pair, "npformer": pair[GRAPH_SIDE]}
        lines += ratio_line(f"{name} graph", graph_pair, cfg, memory="peak memory").split("\n")
        lines.append("  " + graph_line(pair[GRAPH_SIDE]))
    return lines


def graph_line(res: dict) -> str:
    """How the graph side trained: its captures and their cost, or that it ran eagerly."""
    graph = res.get("graph")
    if "error" in res:
        return "graph mode: failed"
    if not graph or not graph["captures"]:
        return "graph mode: NOT captured (the update ran eagerly; the worker's log says why)"
    return (f"graph mode: {graph['captures']} capture(s), {graph['capture_seconds'] * 1e3:.0f} "
            "ms in all (untimed: the warmup steps)")


def tf32_line(py: dict, npf: dict) -> str:
    """Whether float32 matmuls may run as TF32 on each side, from what the workers found."""
    settings = py.get("tf32")
    env = npf.get("tf32_env")
    if settings is None or env is None:
        return "TF32:      unknown (a side failed)"
    override_off = env.get("NVIDIA_TF32_OVERRIDE") == "0"  # disables TF32 in every library
    torch_on = not override_off and (settings["allow_tf32"]
                                     or settings["matmul_precision"] in ("high", "medium")
                                     or settings["fp32_precision"] == "tf32")
    cupy_on = not override_off and env.get("CUPY_TF32") not in (None, "0")
    verdict = {(False, False): "off on both sides (full float32 matmuls)",
               (True, True): "ON on both sides"}.get(
        (torch_on, cupy_on), f"DIFFERS: torch {'on' if torch_on else 'off'}, "
                             f"CuPy {'on' if cupy_on else 'off'}")
    return (f"TF32:      {verdict}: torch.backends.cuda.matmul.allow_tf32="
            f"{settings['allow_tf32']}, float32 matmul precision "
            f"{settings['matmul_precision']!r}, fp32_precision {settings['fp32_precision']!r}; "
            f"CuPy: CUPY_TF32={env.get('CUPY_TF32') or 'unset'} (full float32 unless 1); "
            f"NVIDIA_TF32_OVERRIDE={env.get('NVIDIA_TF32_OVERRIDE') or 'unset'} "
            "(nothing set by this script)")


def header_lines(args, pair: dict) -> list[str]:
    py, npf = pair.get("pytorch", {}), pair.get("npformer", {})
    steps = f"median (min-max) of {args.steps} steps after {args.warmup} warmup"
    common = TRAIN_TIMING
    tokens = ("tokens/s:  token positions per training step (padding included; seq2seq "
              "counts source + target) / median step time")
    if args.device == "cpu":
        return ["npformer on NumPy against PyTorch on the CPU (--device cpu: a check of this "
                "script; bench/bench.py is the CPU comparison)",
                f"libraries: numpy {npf.get('version', '?')}, torch {py.get('version', '?')}; "
                f"Python {platform.python_version()}",
                f"timing:    {steps}; {common}",
                "memory:    not measured on the CPU (bench/bench.py measures RSS)", LOSS_NOTE,
                tokens]
    return ["npformer on CuPy against PyTorch eager on CUDA (float32; each configuration is "
            "a demo's default model and update, as in bench/bench.py; the same initial "
            "weights and batch)",
            f"device:    {py.get('device_name', '?')} (CUDA: torch built for "
            f"{py.get('cuda', '?')}, CuPy runtime {npf.get('cuda_runtime', '?')})",
            f"libraries: cupy {npf.get('version', '?')}, numpy {npf.get('numpy', '?')}, "
            f"torch {py.get('version', '?')}; Python {platform.python_version()}",
            tf32_line(py, npf),
            f"timing:    {steps}, the device synchronized before the clock is read at the "
            f"start and end of each step; {common}. PyTorch's batch is on the GPU; npformer's "
            "tasks take theirs from the host (its token ids are copied every step, as in "
            "training)",
            f"memory:    peak during {MEMORY_STEPS} more training steps after the timed ones "
            "(untimed): PyTorch torch.cuda.max_memory_allocated() after "
            "reset_peak_memory_stats(); CuPy the peak of the default memory pool's "
            "used_bytes() (a tracking allocator). The peak includes what is in use at rest, "
            "before the pass (\"at rest\": parameters, gradients, Adam state, the batch); "
            "free blocks cached by either allocator are not counted; npformer-graph adds "
            "its graphs' own memory pools (held for the graphs' life) to both", LOSS_NOTE,
            tokens]


def json_report(args, results: dict, cfgs: dict) -> dict:
    return dict(device=args.device, steps=args.steps, warmup=args.warmup,
                memory_steps=MEMORY_STEPS, smoke=args.smoke,
                configs={name: dict(config=cfgs[name], **pair,
                                    summary={side: summary(pair[side], cfgs[name])
                                             for side in GPU_SIDES if side in pair})
                         for name, pair in results.items()})


# --------------------------------------------------------------------------- profile
def profile_npformer(name: str, cfg: dict, device: str, warmup: int) -> str:
    """``PROFILE_STEPS`` npformer training steps under cProfile (after ``warmup`` untimed
    ones, the device synchronized before and after): the top functions by cumulative and
    by own time.  Time inside the stream's synchronize (or the loss's copy to the host)
    is waiting for the GPU; the rest is Python and kernel-launch overhead."""
    import cProfile
    import io
    import pstats

    side = npformer_side(device)
    run = side.prepare(cfg, SEED, None)
    optimizer = run.make_optimizer()
    sync = side.sync or (lambda: None)
    for _ in range(warmup):
        run.step(optimizer)
    sync()
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(PROFILE_STEPS):
        run.step(optimizer)
    sync()
    profiler.disable()
    elapsed = time.perf_counter() - started
    out = io.StringIO()
    out.write(f"npformer {name} on {'CuPy' if device == 'cuda' else 'NumPy'}: "
              f"{PROFILE_STEPS} training steps in {elapsed:.3f} s under cProfile "
              f"({ms(elapsed / PROFILE_STEPS)} ms per step, profiling overhead included)\n")
    stats = pstats.Stats(profiler, stream=out).strip_dirs()
    for key, title in (("cumulative", "cumulative time"), ("tottime", "own time (tottime)")):
        out.write(f"\n== top {PROFILE_TOP} by {title} ==\n")
        stats.sort_stats(key).print_stats(PROFILE_TOP)
    return out.getvalue()


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(GPU_CONFIGS),
                   help="comma-separated subset of %(default)s")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; smoke 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (default 5; smoke 1)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, few steps: checks that it runs")
    p.add_argument("--markdown", action="store_true", help="also print a README-ready table")
    p.add_argument("--json", metavar="PATH", help="also write every result to PATH")
    p.add_argument("--profile", metavar="CONFIG",
                   help=f"instead: {PROFILE_STEPS} npformer training steps of CONFIG under "
                        f"cProfile, top {PROFILE_TOP} functions by cumulative and own time")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): CuPy against torch on CUDA; cpu: NumPy against torch "
                        "on the CPU, to check this script where there is no GPU")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.smoke else 20
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 5
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps must be at least 1 and --warmup at least 0, got {args.steps} and "
                f"{args.warmup}")
    args.names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in args.names + ([args.profile] if args.profile else [])
               if n not in GPU_CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {list(GPU_CONFIGS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, run=run_device_side)
    if args.device == "cuda":
        missing = missing_for_gpu(need_torch=not args.profile)
        if missing:
            print(f"bench/gpu.py needs a GPU: {missing} (--device cpu runs this script on the "
                  "CPU)", file=sys.stderr)
            return 2
    table = GPU_SMOKE if args.smoke else GPU_CONFIGS
    if args.profile:
        print(profile_npformer(args.profile, table[args.profile], args.device, args.warmup))
        return 0
    started = time.perf_counter()
    cfgs = {name: table[name] for name in args.names}
    results = {name: run_pair(cfg, args) for name, cfg in cfgs.items()}
    lines = header_lines(args, next(iter(results.values()), {}))
    if args.smoke:
        lines.append("SMOKE RUN: tiny sizes, timings meaningless")
    for name, pair in results.items():
        lines += config_lines(name, cfgs[name], pair)
    if args.markdown:
        lines += markdown_lines(results, cfgs)
    lines.append(f"\n(total wall time {time.perf_counter() - started:.0f} s)")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_report(args, results, cfgs), f, indent=1)
    failed = [name for name, pair in results.items() if any("error" in r for r in pair.values())]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
