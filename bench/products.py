#!/usr/bin/env python
"""The matrix products of a configuration's step alone: how fast this machine's BLAS runs
them, and so the best share of the peak any step built on it can reach.

    python bench/products.py                 # lm (nanoGPT's baby GPT); 7 repeats a product
    python bench/products.py --configs lm,imdb,seq2seq
    python bench/products.py --smoke         # tiny sizes: a check that it runs

A step's products are counted as ``bench/flops.py`` counts them (its ``forward_products``:
the projections, the attention's per-head products, the feed-forward, the head).  A
training step runs each forward product (m, k, n) and its two backward products: the
input's gradient dY W^T (m, n, k) and the weight's X^T dY (k, m, n).  Each is timed
here alone, in float32 through NumPy's BLAS (the products npformer's CPU tiers call), the
minimum of ``--repeats`` runs after one untimed, in the two ways the fast tier can run it:

* ``whole``: the whole batch's product, BLAS on every core;
* ``replicas``: each core's thread replica's product (rows split over the cores), BLAS
  on one core in each replica, the replicas at once (NumPy releases the GIL in a product).

The faster way is kept for each product; their sum is the time of the products alone,
with nothing between them: no element-wise pass, no Python, no wait.  That sum over the
peak measured in the same run (``bench/peak.py``) is the share of the peak a step can
reach on this BLAS when everything else costs nothing.  Prints a table a configuration and
the CPU model.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))

from bench import peak  # noqa: E402
from bench.configs import CONFIGS, SMOKE  # noqa: E402
from bench.flops import TRAIN_FACTOR, Product, forward_products, layer_shapes  # noqa: E402
from bench.report import cpu_model  # noqa: E402

LOOPS = 20  # a replica's products in a row, per timed run


def backward_shapes(p: Product) -> list[tuple[int, int, int]]:
    """The two products of ``p``'s backward as (m, k, n): dX = dY W^T and dW = X^T dY."""
    return [(p.m, p.n, p.k), (p.k, p.m, p.n)]


def split_rows(m: int, parts: int) -> list[int]:
    """``m`` rows shared out over ``parts`` replicas as the batch is (the first ones one
    row more when they do not divide)."""
    return [m // parts + (i < m % parts) for i in range(parts)]


def operands(count: int, m: int, k: int, n: int, rng) -> tuple:
    """a (count, m, k), b (count, k, n) float32 and the output (count, m, n); a count of 1
    gives the plain 2-d product."""
    lead = (count,) if count > 1 else ()
    a = rng.standard_normal(lead + (m, k), dtype=np.float32)
    b = rng.standard_normal(lead + (k, n), dtype=np.float32)
    return a, b, np.empty(lead + (m, n), dtype=np.float32)


def whole_seconds(count: int, m: int, k: int, n: int, threads: int, repeats: int) -> float:
    """One product of the whole batch (``count`` stacked ones, the per-head products'
    batch) with BLAS on ``threads`` cores."""
    from threadpoolctl import threadpool_limits

    a, b, out = operands(count, m, k, n, np.random.default_rng(0))
    with threadpool_limits(threads):
        return peak.best_seconds(lambda: np.matmul(a, b, out=out), repeats)


def replica_seconds(count: int, m: int, k: int, n: int, p: Product, threads: int,
                    repeats: int) -> float:
    """The same product shared over ``threads`` replicas at once, BLAS on one core each:
    the rows split (a per-head product: the heads' batch split).  Each replica's thread
    runs its share ``LOOPS`` times in a row (a thread's start is not a product's cost); the
    time until the last one ends, over ``LOOPS``, the minimum of ``repeats``."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    if p.per_head:
        parts = [operands(c, m, k, n, rng) for c in split_rows(count, threads) if c]
    else:
        parts = [operands(count, rows, k, n, rng) for rows in split_rows(m, threads) if rows]
    barrier = threading.Barrier(len(parts))

    def run_all():
        def one(a, b, out):
            barrier.wait()
            for _ in range(LOOPS):
                np.matmul(a, b, out=out)
        workers = [threading.Thread(target=one, args=part) for part in parts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    with threadpool_limits(1):
        return peak.best_seconds(run_all, repeats) / LOOPS


def product_rows(cfg: dict, threads: int, repeats: int) -> list[dict]:
    """Each forward product of ``cfg`` with its forward and backward times (the faster
    way of each), and which way won."""
    rows = []
    for p in forward_products(cfg, training=True):
        row = dict(product=p, forward=0.0, backward=0.0, ways=set(),
                   by_way={"whole": 0.0, "replicas": 0.0})  # the training step's, each way
        for phase, shapes in (("forward", [(p.m, p.k, p.n)]), ("backward", backward_shapes(p))):
            for m, k, n in shapes:
                # the per-head products are stacked: a batched product of p.count matrices
                count, times = (p.count if p.per_head else 1), {}
                times["whole"] = whole_seconds(count, m, k, n, threads, repeats)
                if threads > 1:
                    times["replicas"] = replica_seconds(count, m, k, n, p, threads, repeats)
                way = min(times, key=times.get)
                row["ways"].add(way)
                repeat = 1 if p.per_head else p.count  # the layers' products, each alike
                row[phase] += repeat * times[way]
                for each, seconds in times.items():
                    row["by_way"][each] += repeat * seconds
        rows.append(row)
    return rows


def table(name: str, cfg: dict, rows: list[dict], peak_gflops: float) -> str:
    lines = [f"### {name}", "", "| product | m x k x n | count | forward ms | backward ms | "
             "GFLOP/s |", "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        p = row["product"]
        seconds = row["forward"] + row["backward"]
        lines.append(f"| {p.name} ({'/'.join(sorted(row['ways']))}) | {p.m} x {p.k} x {p.n} "
                     f"| {p.count} | {1e3 * row['forward']:.3f} | {1e3 * row['backward']:.3f} "
                     f"| {TRAIN_FACTOR * p.flops / seconds / 1e9:.1f} |")
    infer = sum(row["forward"] for row in rows)
    train = infer + sum(row["backward"] for row in rows)
    flops = sum(row["product"].flops for row in rows)
    for phase, seconds, work in (("training step", train, TRAIN_FACTOR * flops),
                                 ("forward", infer, flops)):
        lines.append(f"\n{phase}: the products alone {1e3 * seconds:.2f} ms for "
                     f"{work / 1e9:.3f} GFLOP = {work / seconds / 1e9:.1f} GFLOP/s, "
                     f"{100 * work / seconds / 1e9 / peak_gflops:.0f}% of the peak; 70% of the "
                     f"peak is {1e3 * work / (0.7 * peak_gflops * 1e9):.2f} ms")
    for way, what in (("whole", "the whole batch, BLAS on every core"),
                      ("replicas", "the replicas' shares at once, BLAS on one core each")):
        seconds = sum(row["by_way"][way] for row in rows)
        if seconds:
            share = TRAIN_FACTOR * flops / seconds / 1e9 / peak_gflops
            lines.append(f"training step's products, every one as {what}: "
                         f"{1e3 * seconds:.2f} ms, {100 * share:.0f}% of the peak")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="lm")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    configs = SMOKE if args.smoke else CONFIGS
    names = args.configs.split(",")
    unknown = [n for n in names if n not in configs]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {sorted(configs)}")
    repeats = 2 if args.smoke else args.repeats
    shapes = {shape for name in names for shape in layer_shapes(configs[name])}
    limits = peak.measure(sorted(shapes), args.threads, smoke=args.smoke)  # as bench.py
    peak_gflops = limits["matmul"]["gflops"]
    for name in names:
        print(table(name, configs[name], product_rows(configs[name], args.threads, repeats),
                    peak_gflops), "\n", flush=True)
    print(f"CPU: {cpu_model()}, {args.threads} threads; peak {peak_gflops:.1f} GFLOP/s "
          f"({limits['matmul']['library']}, {limits['matmul']['shape']}), measured in this run; "
          f"each product the minimum of {repeats} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
