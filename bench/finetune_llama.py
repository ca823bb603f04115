"""Fine-tuning a Llama of SmolLM2-135M's shape on the CPU: seconds per update and peak
memory, full fine-tuning and LoRA, each update as demos/finetune.py makes it.

    python bench/finetune_llama.py                  # full and LoRA, each run twice
    python bench/finetune_llama.py --mode lora --runs 1
    python bench/finetune_llama.py --smoke          # tiny shapes, seconds (the tests)

The model: SmolLM2-135M's config (hidden 576, intermediate 1536, 30 layers, 9 heads, 3
key/value heads, vocabulary 49152, tied embeddings, rope_theta 100000) with random
weights, in float32 (the demo's default dtype), npformer.models.LlamaCausalLM.  The
update: the demo's default one: batch 4 windows of 256 tokens of random ids, fast.AdamW
(lr 3e-5, betas (0.9, 0.95), weight decay 0.1), gradients clipped to norm 1, one
data-parallel replica per core (the Trainer's update).  LoRA: rank 8 on q_proj and
v_proj, alpha 16 (``--lora 8 --lora-targets q_proj,v_proj``), the model frozen.

Each measurement is a fresh process pinned to ``--cores`` cores: ``--warmup`` untimed
updates, then ``--updates`` timed ones; it reports the median seconds per update (and the
range) and the process's peak resident memory, VmHWM from /proc/self/status (the model's
creation and the warm-up included), and the machine's load average after it.  The header
names the CPU model.  On a machine others
share, run each measurement more than once (``--runs``, default 2) and report them all.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:  # `python bench/finetune_llama.py`: the bench package
    sys.path.insert(0, str(ROOT))

from bench.report import cpu_model, load_average  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, d_model=576, d_ff=1536,
                    num_layers=30, num_heads=9, num_kv_heads=3,
                    block_size=8192, norm_eps=1e-5, rope_theta=100000.0,
                    tie_weights=True)
SMOKE_SHAPE = dict(vocab_size=64, d_model=16, d_ff=24, num_layers=2,
                   num_heads=4, num_kv_heads=2, block_size=32,
                   norm_eps=1e-5, rope_theta=100000.0, tie_weights=True)
MODES = ("full", "lora")
LORA_RANK, LORA_ALPHA, LORA_TARGETS = 8, 16.0, ("q_proj", "v_proj")
LR, BETAS, WEIGHT_DECAY, CLIP_NORM = 3e-5, (0.9, 0.95), 0.1, 1.0  # the demo's
RESULT = "result: "  # the child's last line: RESULT + its JSON


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--mode", choices=(*MODES, "both"), default="both",
                        help="full fine-tuning, LoRA, or both (default: %(default)s)")
    parser.add_argument("--runs", type=positive, default=2,
                        help="measurements of each mode, each a fresh process "
                             "(default: %(default)s)")
    parser.add_argument("--batch-size", type=positive, default=4,
                        help="windows per update (default: the demo's, %(default)s)")
    parser.add_argument("--block-size", type=positive, default=256,
                        help="tokens per window (default: the demo's, %(default)s)")
    parser.add_argument("--warmup", type=nonnegative, default=1,
                        help="untimed updates first (default: %(default)s)")
    parser.add_argument("--updates", type=positive, default=3,
                        help="timed updates (default: %(default)s)")
    parser.add_argument("--cores", type=positive, default=2,
                        help="cores each measurement is pinned to, one replica each "
                             "(default: %(default)s)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, batch 2 x 16, one run of 2 updates (the tests)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    return parser


def positive(text: str) -> int:
    return _integer(text, 1)


def nonnegative(text: str) -> int:
    return _integer(text, 0)


def _integer(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
    return value


def settle(args: argparse.Namespace) -> argparse.Namespace:
    """--smoke's sizes; --cores at most the cores there are (refused beyond them)."""
    if args.smoke:
        args.batch_size, args.block_size, args.warmup, args.updates = 2, 16, 1, 2
        args.runs = 1
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    if args.cores > available:
        raise SystemExit(f"error: --cores {args.cores}: this process may run on "
                         f"{available} cores only")
    return args


# --------------------------------------------------------------------------- one measurement
def peak_memory_bytes() -> int | None:
    """The process's peak resident memory (VmHWM), where /proc tells it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure(mode: str, args: argparse.Namespace) -> dict:
    """One mode's seconds per update and peak memory, in this process."""
    import numpy as np

    from npformer import fast
    from npformer.data import lm_batch
    from npformer.interop import peft
    from npformer.models.llama import LlamaCausalLM, LlamaConfig
    from npformer.train import TrainConfig, Trainer
    from npformer.train.tasks import LanguageModeling

    config = LlamaConfig(**(SMOKE_SHAPE if args.smoke else SMOLLM2_135M))
    model = LlamaCausalLM(config)  # random weights, float32
    if mode == "lora":
        peft.apply_adapters(model, peft.llama_names(config), list(LORA_TARGETS), LORA_RANK,
                            LORA_ALPHA)
    optimizer = fast.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, 200_000)
    trainer = Trainer(model, optimizer, LanguageModeling(),
                      lambda rng: lm_batch(ids, args.block_size, args.batch_size, rng),
                      TrainConfig(max_iters=args.warmup + args.updates, clip_norm=CLIP_NORM,
                                  replicas=args.cores, progress=False))
    seconds = []
    for update in range(args.warmup + args.updates):
        started = time.perf_counter()
        trainer.update()
        if update >= args.warmup:
            seconds.append(time.perf_counter() - started)
    return {"mode": mode, "seconds": seconds, "peak_bytes": peak_memory_bytes(),
            "parameters": model.num_parameters(),
            "trained": sum(p.data.size for p in optimizer.params)}


def run_child(mode: str, args: argparse.Namespace) -> dict:
    """``measure(mode)`` in a fresh process pinned to the first ``--cores`` cores."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode,
               "--batch-size", str(args.batch_size), "--block-size", str(args.block_size),
               "--warmup", str(args.warmup), "--updates", str(args.updates),
               "--cores", str(args.cores)] + (["--smoke"] if args.smoke else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"error: the {mode} measurement failed (exit {proc.returncode}):\n"
                         + proc.stderr[-3000:])
    return json.loads(lines[-1][len(RESULT):])


def pin(cores: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])


# --------------------------------------------------------------------------- the report
def describe(result: dict, run: int, load: float | None) -> str:
    seconds = sorted(result["seconds"])
    median = seconds[len(seconds) // 2] if len(seconds) % 2 else \
        (seconds[len(seconds) // 2 - 1] + seconds[len(seconds) // 2]) / 2
    peak = result["peak_bytes"]
    memory = f"{peak / 2 ** 30:.2f} GiB" if peak is not None else "unknown"
    return (f"{result['mode']:<5} run {run}: {median:.2f} s/update (median of "
            f"{len(seconds)}; {seconds[0]:.2f}-{seconds[-1]:.2f}), peak memory (VmHWM) "
            f"{memory}, {result['trained']:,} of {result['parameters']:,} parameters trained; "
            f"load average {'unknown' if load is None else f'{load:.1f}'} after it")


def main(argv: list[str] | None = None) -> int:
    args = settle(build_parser().parse_args(argv))
    if args.child:
        pin(args.cores)
        print(RESULT + json.dumps(measure(args.child, args)), flush=True)
        return 0
    shape = "tiny (--smoke)" if args.smoke else "SmolLM2-135M's, random weights"
    print(f"cpu: {cpu_model()} ({os.cpu_count()} cores here; each run pinned to "
          f"{args.cores}, {args.cores} replicas)")
    print(f"model: {shape}; float32; batch {args.batch_size} x {args.block_size} tokens; "
          f"{args.warmup} warm-up + {args.updates} timed updates per run; LoRA: rank "
          f"{LORA_RANK} on {','.join(LORA_TARGETS)}, alpha {LORA_ALPHA:g}")
    modes = MODES if args.mode == "both" else (args.mode,)
    for mode in modes:
        for run in range(1, args.runs + 1):
            result = run_child(mode, args)
            print(describe(result, run, load_average()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
