#!/usr/bin/env python
"""npformer against a plain PyTorch reference: training step, inference, memory.

    python bench/bench.py                       # imdb, lm, seq2seq; 3 rounds of 10 steps
                                                # after 2 warmup, the sides taking turns
    python bench/bench.py --sweeps              # + sequence-length and batch-size sweeps (imdb)
    python bench/bench.py --smoke               # tiny sizes, 1 step: a CI check that it all runs
    python bench/bench.py --markdown            # + README-ready tables
    python bench/bench.py --processes           # 2 MPI ranks / 2 threads / PyTorch DDP / 2
                                                # threads; scaling; Allreduce vs size; projection
    python bench/bench.py --processes --smoke   # the same, tiny: a CI check that it all runs

Every (configuration, side) runs in a fresh subprocess (``--worker``, JSON on
stdout), one after the other, ``--rounds`` times with the sides taking turns (the
figures pool every round's steps: these machines' speed drifts by tens of percent
within minutes, and a side that ran alone in a slow minute would take the blame), with
the same environment (thread variables,
``GLIBC_TUNABLES``) on both sides.  The PyTorch side is a plain torch.nn model
written here (nn.Embedding, nn.TransformerEncoderLayer / DecoderLayer with
batch_first=True, norm_first=False, dropout 0, nn.Linear); it is built first and
given the demo's own initial weights (npformer's model as the demo builds it, from
``seed``: ``bench.configs.demo_initial_state``; the lm's tied embedding N(0, 0.02^2),
so its first loss is about ln 65, as in the demo), which it hands to the npformer and
nanoGPT sides (an .npz file, loaded with ``npformer.interop.pytorch.load_torch_state_dict``),
so both sides train the same model on the same batch and their first-step losses
must agree.  The npformer worker never imports torch.  Before anything is measured,
each worker runs one training step and one inference of a tiny model of the same
kind, so code loaded on first use (PyTorch imports ~800 modules, ~70 MiB, at its
first Adam step) is neither timed nor counted.

Memory: peak RSS growth during the measured steps, the same way on both sides: the
peak RSS after the steps (``VmHWM``, reset to the current RSS at the baseline by
writing 5 to ``/proc/self/clear_refs``; ``ru_maxrss``, the whole process's peak,
where that is refused) minus the current RSS (``/proc/self/statm``) taken right
before the first step, once model and batch are built and the heap's free pages are
handed back to the OS (glibc's ``malloc_trim(0)``).  Without the reset, the peak of
building the model or of the loss check before the steps can exceed the steps' own
and be counted as theirs; without the trim, memory those freed stays resident, the
steps reuse it, and it does not show as growth (PyTorch's loss check, run with
gradients on, frees a whole forward's saved activations just before the baseline).  The optimizer is
built after that baseline on both sides (npformer allocates Adam's moments in its
constructor, PyTorch at its first step), so optimizer state is in the growth.

Utilisation: after the sides, the parent measures the machine's float32 matrix-product
peak and memory bandwidth (bench/peak.py, all ``--threads`` cores, square sizes and the
configurations' own product shapes) and prints, for every configuration and side, a
step's FLOPs (bench/flops.py: counted from the configuration; the formula is in
bench/README.md) and its share of that peak, in training and in inference.

The code: bench/configs.py (configurations, batches, the npformer models),
bench/torch_models.py (the PyTorch references, shared with the parity tests),
bench/measure.py (the workers), bench/report.py (tables), bench/processes.py (the
process modes, ``--processes``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:  # `python bench/bench.py`: the bench package, not this file
    sys.path.insert(0, str(ROOT))

from bench import peak, processes, runner  # noqa: E402
from bench.configs import CONFIGS, SEED, SMOKE  # noqa: E402
from bench.configs import sweeps as imdb_sweeps  # noqa: E402
from bench.flops import layer_shapes  # noqa: E402
from bench.measure import worker_main  # noqa: E402
from bench.report import (  # noqa: E402
    describe,
    machine_load,
    print_header,
    print_main_table,
    print_markdown,
    print_sweep,
    print_utilisation,
)
from bench.runner import ALLOCATORS, NO_TRIM_TUNABLE, worker_env  # noqa: E402
from npformer.checkpoint import TIERS  # noqa: E402


# =========================================================================== parent side
def run_worker(side: str, cfg: dict, args, weights: str | None,
               threads: int | None = None, tier: str = "fast") -> dict:
    """One (configuration, side) in a fresh worker; npformer runs on ``tier`` (the
    spec's "tier": the other sides ignore it)."""
    spec = dict(side=side, config=cfg, steps=args.steps, warmup=args.warmup,
                threads=threads or args.threads, seed=SEED, weights=weights, tier=tier)
    env = worker_env(threads or args.threads, args.allocator)
    return runner.run_worker(Path(__file__).resolve(), spec, env)


def tier_side(tier: str) -> str:
    """The results key of npformer on ``tier``: "npformer" is the fast tier."""
    return "npformer" if tier == "fast" else f"npformer {tier}"


def run_pair(cfg: dict, args, tiers=("fast",)) -> dict:
    """Every side of one configuration, PyTorch first (it writes the initial weights),
    npformer once per tier in ``tiers``, nanoGPT's GPT on lm; ``args.rounds`` times
    in turn, pooled (:func:`bench.runner.pooled_rounds`)."""
    tiers = {tier_side(t): t for t in tiers}

    def run_side(side, weights):
        if side in tiers:
            return run_worker("npformer", cfg, args, weights, tier=tiers[side])
        return run_worker(side, cfg, args, weights)

    return runner.pooled_rounds([runner.run_sides(cfg, run_side, list(tiers))
                                 for _ in range(args.rounds)])


def tier_results(results: dict, tier: str) -> dict:
    """{config: {"pytorch": ..., "npformer": npformer on ``tier``}}, for the tables."""
    return {name: {**pair, "npformer": pair[tier_side(tier)]}
            for name, pair in results.items()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="imdb,lm,seq2seq",
                   help="comma-separated subset of imdb,lm,seq2seq (empty: none)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; smoke 1)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (default 2; smoke 0)")
    p.add_argument("--rounds", type=int, default=None,
                   help="times every side runs, the sides taking turns; the figures pool "
                        "the rounds' steps (default 3; smoke 1)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads for both sides (default: all usable cores)")
    p.add_argument("--sweeps", action="store_true",
                   help="imdb: sequence length 64..1024 at 8192 tokens/batch, batch 8..64 at 256")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 step: checks that it runs")
    p.add_argument("--allocator", choices=ALLOCATORS,
                   default="inherit",
                   help="GLIBC_TUNABLES for both sides: inherit = as in this environment "
                        f"(default), glibc-default = unset, keep-heap = {NO_TRIM_TUNABLE}")
    p.add_argument("--markdown", action="store_true", help="also print README-ready tables")
    p.add_argument("--tiers", default="fast,textbook",
                   help="npformer tiers to measure, comma-separated (default: %(default)s; "
                        "the sweeps and --processes use the fast tier)")
    p.add_argument("--processes", action="store_true",
                   help="process modes instead: npformer on 2 MPI ranks vs 2 thread replicas "
                        "vs PyTorch DDP (gloo, 2 processes) vs PyTorch with 2 threads; scaling "
                        "1 -> 2 ranks; Allreduce time vs size at 2 and 4 ranks; projection")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    for flag in processes.WORKERS:
        p.add_argument(flag, metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 1 if args.smoke else 10
    if args.warmup is None:
        args.warmup = 0 if args.smoke else 2
    if args.rounds is None:
        args.rounds = 1 if args.smoke else 3
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or args.threads < 1:
        p.error("--steps, --rounds and --threads must be at least 1, --warmup at least 0")
    args.tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if not args.tiers or any(t not in TIERS for t in args.tiers):
        p.error(f"--tiers must list fast and/or textbook, got {args.tiers}")
    args.names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    for flag, worker in processes.WORKERS.items():
        spec = getattr(args, flag.lstrip("-").replace("-", "_"))
        if spec:
            return worker(json.loads(spec))
    args.env = worker_env(args.threads, args.allocator)
    args.load_at_start = machine_load()
    table = SMOKE if args.smoke else CONFIGS
    started = time.perf_counter()
    if args.processes:
        return main_processes(args, table, started)
    results, cfgs = {}, {}
    for name in args.names:
        cfgs[name] = table[name]
        results[name] = run_pair(table[name], args, args.tiers)
    sweeps = [(title, [(c, run_pair(c, args)) for c in rows])
              for title, rows in (imdb_sweeps(args.smoke) if args.sweeps else [])]
    limits = machine_limits(cfgs, args) if results else None
    first = next(iter(results.values()), None) or (sweeps[0][1][0][1] if sweeps else {})
    print_header(args, first)
    if limits:
        print("\n".join(peak.peak_lines(limits)))
    if args.smoke:
        print("SMOKE RUN: tiny sizes, timings meaningless")
    for name in args.names:
        print("  " + describe(name, cfgs[name]))
    for tier in args.tiers if results else ():
        print(f"\n== npformer's {tier} tier against PyTorch ==")
        print_main_table(tier_results(results, tier), cfgs)
        print_utilisation(tier_results(results, tier), cfgs, limits["matmul"]["gflops"])
        if args.markdown:
            print_markdown(tier_results(results, tier), cfgs, limits["matmul"]["gflops"])
    for title, rows in sweeps:
        print_sweep(title, rows, args.markdown)
    print(f"\n(total wall time {time.perf_counter() - started:.0f} s)")
    failed = [n for n, pair in results.items() if any("error" in r for r in pair.values())]
    failed += [title for title, rows in sweeps for _, pair in rows
               if any("error" in r for r in pair.values())]
    return 1 if failed else 0



def machine_limits(cfgs: dict, args) -> dict:
    """The matrix-product peak and memory bandwidth (bench/peak.py), measured here in the
    parent after the sides ran, on ``args.threads`` cores, over square sizes and the
    products of the configurations in ``cfgs``."""
    shapes = {shape for cfg in cfgs.values() for shape in layer_shapes(cfg)}
    return peak.measure(sorted(shapes), args.threads, smoke=args.smoke)


def main_processes(args, table: dict, started: float) -> int:
    """``--processes``: the process modes of every configuration, the Allreduce sweep and
    the projection (bench/processes.py)."""
    def thread_mode(side, cfg, threads, weights):
        return run_worker(side, cfg, args, weights, threads=threads)

    results = {name: runner.pooled_rounds([processes.run_modes(table[name], args, thread_mode)
                                           for _ in range(args.rounds)])
               for name in args.names}
    sweep = processes.run_allreduce_sweep(args)
    first = next(iter(results.values()), {})
    print_header(args, {"pytorch": first.get("PyTorch 2 threads", {}),
                        "npformer": first.get("npformer 2 threads", {})})
    if args.smoke:
        print("SMOKE RUN: tiny sizes, timings meaningless")
    for name in args.names:
        print("  " + describe(name, table[name]))
    processes.print_process_modes(results)
    processes.print_allreduce(sweep)
    processes.print_projection(results)
    print(f"\n(total wall time {time.perf_counter() - started:.0f} s)")
    failed = [n for n, modes in results.items() if any("error" in r for r in modes.values())]
    failed += [ranks for ranks, res in sweep.items() if "error" in res]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
