#!/usr/bin/env python
"""Decoding at the memory bound (issue 48, item 3): per-token greedy latency with the KV
cache against transformers' ``generate`` and against the time it takes to read the
weights and the cache from memory.

    python bench/decode.py               # the lm and GPT-2 small shapes, batch 1 and 8
    python bench/decode.py --markdown    # also the table as markdown (bench/README.md)
    python bench/decode.py --smoke       # tiny shapes, one round: a check that it runs

Two shapes, random weights, float32: ``lm``, the benchmark's lm configuration (nanoGPT's
baby GPT, ``demos/generate.py --preset nanogpt``: D 128, 4 layers, 65 characters, block
64) and ``gpt2``, GPT-2 small's (D 768, 12 layers, 12 heads, 50,257 tokens, block 1,024).
Each side runs in a process of its own with every core: npformer (the fast tier's
``CausalLM``, ``npformer.decoding.generate(greedy=True)``) and transformers'
``GPT2LMHeadModel`` of the same shape (``generate(do_sample=False)``).  At batch 1 and
batch 8 each side decodes greedily ``NEW`` tokens after an 8-token prompt: the per-token
latency is

    t_token = t(NEW) / NEW

t the minimum over ``--rounds`` runs.  It includes the prompt's encoding, one pass over
the weights like a token's step, so it is high by about one step in NEW (a difference
of two lengths would cancel it, but on a shared machine the difference of two noisy
minima came out negative).  The machine's memory bandwidth is measured in the same run
(the best of a large float32 array read by a sum, NumPy's and torch's; and a copy's, as
bench/peak.py counts it), and the bound is

    t_bound = (4 * weights read + 4 * 2 * layers * B * c * D) / read bandwidth

the bytes one cached step must read: every parameter once (the tied embedding whole, as
the output projection; the learned positions' B rows are left out), and every layer's
keys and values at the mean context c of the NEW steps.  Method in bench/README.md.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:  # `python bench/decode.py`: the bench package, not this file
    sys.path.insert(0, str(ROOT))

from bench.peak import best_seconds, copy_rates, read_rates  # noqa: E402
from bench.report import cpu_model  # noqa: E402

RESULT = "DECODE_BENCH "
SHAPES = {
    "lm": dict(vocab_size=65, block_size=64, d_model=128, num_heads=4, num_layers=4),
    "gpt2": dict(vocab_size=50257, block_size=1024, d_model=768, num_heads=12, num_layers=12),
}
SMOKE_SHAPES = {
    "lm": dict(vocab_size=65, block_size=32, d_model=32, num_heads=2, num_layers=1),
    "gpt2": dict(vocab_size=300, block_size=64, d_model=32, num_heads=4, num_layers=2),
}
BATCHES = (1, 8)
PROMPT, NEW = 8, 48  # prompt + NEW fits the lm's block of 64: no re-encoding
SMOKE_LENGTHS = (4, 6)
ROUNDS = 3
READ_BYTES = 256 * 2 ** 20
SMOKE_READ_BYTES = 4 * 2 ** 20


def prompts(vocab: int, batch: int, prompt: int) -> np.ndarray:
    """(batch, prompt) token ids, the same on both sides."""
    return np.random.default_rng(0).integers(0, vocab, (batch, prompt))


# --------------------------------------------------------------------------- the sides
def npformer_decoder(shape: dict):
    """(generate(ids (B, P), new) -> None, parameter count) for npformer's fast tier."""
    from npformer import backend, fast
    from npformer.decoding import generate
    from npformer.models import CausalLMConfig

    backend.set_backend("numpy", seed=0)
    backend.set_default_float("float32")
    model = fast.CausalLM(CausalLMConfig(**shape, d_ff=4 * shape["d_model"], dropout=0.0))
    model.eval()

    def run(ids: np.ndarray, new: int) -> None:
        out = generate(model, ids, new, greedy=True)
        assert all(len(row) == ids.shape[1] + new for row in out)

    return run, sum(int(p.data.size) for p in model.parameters())


def torch_decoder(shape: dict):
    """The same for transformers' GPT2LMHeadModel of the shape (random weights)."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=shape["vocab_size"], n_positions=shape["block_size"],
        n_embd=shape["d_model"], n_layer=shape["num_layers"], n_head=shape["num_heads"],
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).to(torch.float32).eval()

    def run(ids: np.ndarray, new: int) -> None:
        x = torch.tensor(ids)
        with torch.no_grad():
            out = model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0, attention_mask=torch.ones_like(x))
        assert out.shape == (ids.shape[0], ids.shape[1] + new)

    return run, sum(p.numel() for p in model.parameters())


def worker(side: str, shapes: dict, lengths: tuple, rounds: int) -> None:
    """Every shape and batch on one side: {name: {batch: t(NEW)}} (the minimum of
    ``rounds`` runs after one untimed) and the parameter counts."""
    prompt, new = lengths
    make = npformer_decoder if side == "npformer" else torch_decoder
    times, params = {}, {}
    for name, shape in shapes.items():
        run, params[name] = make(shape)
        times[name] = {}
        for batch in BATCHES:
            ids = prompts(shape["vocab_size"], batch, prompt)
            times[name][batch] = best_seconds(functools.partial(run, ids, new), rounds)
    print(RESULT + json.dumps(dict(times=times, params=params)), flush=True)


def run_side(side: str, args) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", side,
               "--rounds", str(args.rounds)] + (["--smoke"] if args.smoke else [])
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise SystemExit(f"error: the {side} side ended with status {proc.returncode}:\n"
                     f"{proc.stderr[-3000:]}")


# --------------------------------------------------------------------------- bandwidth
def bandwidth(smoke: bool) -> dict:
    """{"read": the best read rate, "copy": the best copy rate} (GB/s, with the library)."""
    threads, repeats = os.cpu_count() or 1, 2 if smoke else 5
    nbytes = SMOKE_READ_BYTES if smoke else READ_BYTES
    return {"read": max(read_rates(nbytes, threads, repeats), key=lambda r: r["gb_s"]),
            "copy": max(copy_rates(nbytes, threads, repeats), key=lambda r: r["gb_s"])}


# --------------------------------------------------------------------------- the bound
def bytes_per_token(shape: dict, params: int, batch: int, context: float) -> float:
    """Bytes one cached decoding step of ``batch`` rows reads (float32): every parameter
    but the learned positions' table once, and each layer's keys and values of
    ``context`` positions per row."""
    weights = params - shape["block_size"] * shape["d_model"]
    cache = 2 * shape["num_layers"] * batch * context * shape["d_model"]
    return 4.0 * (weights + cache)


def rows(results: dict, shapes: dict, lengths: tuple, read_gb_s: float) -> list[dict]:
    """One row per shape and batch: both sides' per-token seconds and the bound's."""
    prompt, new = lengths
    context = prompt + new / 2  # the mean context of the timed steps
    out = []
    for name, shape in shapes.items():
        params = results["npformer"]["params"][name]
        for batch in BATCHES:
            per_token = {side: r["times"][name][str(batch)] / new
                         for side, r in results.items()}
            nbytes = bytes_per_token(shape, params, batch, context)
            out.append(dict(model=name, batch=batch, params=params, **per_token,
                            bytes=nbytes, bound=nbytes / (read_gb_s * 1e9)))
    return out


def table(found: list[dict], markdown: bool) -> str:
    head = ["model", "batch", "npformer ms/token", "transformers ms/token", "ratio",
            "MB read/token", "bound ms/token", "npformer / bound"]
    body = [[r["model"], str(r["batch"]), f"{r['npformer'] * 1e3:.2f}",
             f"{r['torch'] * 1e3:.2f}", f"{r['npformer'] / r['torch']:.2f}x",
             f"{r['bytes'] / 1e6:.1f}", f"{r['bound'] * 1e3:.2f}",
             f"{r['npformer'] / r['bound']:.2f}x"] for r in found]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |",
                          "|---|---:|" + "---:|" * (len(head) - 2)]
                         + ["| " + " | ".join(cells) + " |" for cells in body])
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths))
                     for row in [head] + body)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"runs of each length a side, the minimum kept (default {ROUNDS})")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one round")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    parser.add_argument("--worker", choices=["npformer", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    lengths = SMOKE_LENGTHS if args.smoke else (PROMPT, NEW)
    if args.worker:
        worker(args.worker, shapes, lengths, 1 if args.smoke else args.rounds)
        return 0
    started = time.perf_counter()
    results = {side: run_side(side, args) for side in ("npformer", "torch")}
    if results["npformer"]["params"] != results["torch"]["params"]:
        raise SystemExit(f"error: the sides' models differ in size: npformer "
                         f"{results['npformer']['params']}, transformers "
                         f"{results['torch']['params']} parameters")
    memory = bandwidth(args.smoke)
    found = rows(results, shapes, lengths, memory["read"]["gb_s"])
    if args.smoke:
        print("SMOKE RUN: tiny shapes, timings meaningless")
    prompt, new = lengths
    print(f"greedy decoding with the KV cache, float32, random weights; prompt {prompt}, "
          f"per token = t({new} new) / {new} (the prompt's encoding included), t the "
          f"minimum of {1 if args.smoke else args.rounds} runs; {os.cpu_count()} cores, "
          f"CPU: {cpu_model()}")
    print(f"bandwidth: read {memory['read']['gb_s']:.1f} GB/s ({memory['read']['library']} "
          f"sum of {memory['read']['bytes'] / 2 ** 20:.0f} MiB), copy "
          f"{memory['copy']['gb_s']:.1f} GB/s ({memory['copy']['library']}, read + written); "
          "bound = bytes read per token / read bandwidth")
    print(table(found, markdown=False))
    if args.markdown:
        print()
        print(table(found, markdown=True))
    print(f"\n(total wall time {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
