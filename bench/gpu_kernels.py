#!/usr/bin/env python
"""Where a replayed npformer update spends the GPU's time: its kernels, grouped by name.

    python bench/gpu_kernels.py                        # imdb_large, lm_large
    python bench/gpu_kernels.py --configs lm --top 15

Each configuration of bench/gpu.py is trained as bench/gpu.py's "npformer-graph" side
does (the demo's Trainer, NPFORMER_CUDA_GRAPH=1): a few updates (eager, captured, then
replayed), then ``--updates`` replays under PyTorch's profiler, which records every
kernel the process runs through CUPTI, CuPy's and cuBLAS's included.  Printed: the
kernels by total device time, with their count per update and share of the update's
kernel time.  Needs a GPU, CuPy and a CUDA build of torch.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))

from bench.configs import GPU_CONFIGS, SEED  # noqa: E402
from bench.measure import prepare_npformer  # noqa: E402


def kernel_table(name: str, updates: int, top: int) -> str:
    import cupy
    from torch.profiler import ProfilerActivity, profile

    os.environ["NPFORMER_CUDA_GRAPH"] = "1"
    run = prepare_npformer(GPU_CONFIGS[name], SEED, None, threads=1, backend_name="cupy")
    trainer = run.make_optimizer()
    for _ in range(3):  # eager, captured, replayed
        run.step(trainer)
    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(updates):
            run.step(trainer)
        cupy.cuda.Device().synchronize()
    rows = [(e.key, e.count, e.device_time_total) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    graphs = trainer.cuda_graphs.graphs  # the Trainer's CUDA graphs (False: eager)
    mode = f"{graphs.captures} capture(s)" if graphs else "NOT captured (eager)"
    lines = [f"{name}: {mode}; kernels {total / updates / 1e3:.2f} ms per update "
             f"({len(rows)} kinds)",
             f"  {'ms/update':>9} {'share':>6} {'count/update':>12}  kernel"]
    for key, count, time in rows[:top]:
        lines.append(f"  {time / updates / 1e3:9.3f} {time / total:6.1%} "
                     f"{count / updates:12.1f}  {key[:110]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="imdb_large,lm_large")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    for name in args.configs.split(","):
        print(kernel_table(name.strip(), args.updates, args.top), flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
