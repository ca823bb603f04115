#!/usr/bin/env python
"""GPT-2 small's shape against Hugging Face's PyTorch model on the CPU (issue 34, item 7).

    python bench/gpt2.py                  # 124M parameters, random weights; 5 rounds
    python bench/gpt2.py --rounds 9       # more rounds (the figures are each side's minimum)
    python bench/gpt2.py --smoke          # a tiny GPT-2, one round: a CI check that it runs
    python bench/gpt2.py --folder-only D  # write the 124M random-weights GPT-2 folder to D
                                          # (what demos/finetune.py --model D fine-tunes)

One GPT-2 folder with random weights (``transformers.GPT2LMHeadModel(GPT2Config())``,
float32, written by ``save_pretrained``; dropout 0) is loaded by both sides, each in a
fresh process with the same thread settings: npformer (``fast.CausalLM.from_pretrained``,
the fast tier, the NumPy backend; it never imports torch) and transformers'
``GPT2LMHeadModel`` (its default attention).  Each side times, after one untimed
warm-up of each:

* ``forward``: the logits of a (4, 256) batch under no_grad / npformer.no_grad;
* ``train step``: forward, next-token cross-entropy, backward, global-norm clipping to 1
  and an AdamW update (lr 3e-4, weight decay 0.1) on the same (4, 256) batch;
* ``generate 64``: 64 new tokens, greedy, with the KV cache, after a 16-token prompt
  (batch 1; transformers' ``generate(do_sample=False)``, npformer's ``generate``).

Both sides are loaded once, in two processes that stay alive, and take turns run by
run: the runner asks one side for one timed run, then the other, ``--rounds`` times
for each measurement (training last: its updates change the weights), so both sample
the same minutes of a machine whose speed drifts as other work comes and goes.  A
figure is the minimum over a side's runs (other processes share the cores: the
minimum is the least disturbed).  The sides must agree: the first training step's loss
to 1e-4, and the greedy tokens (reported: float32 rounding can break a near tie
differently).  Prints a table, with each forward's and training step's FLOPs (counted
from GPT-2's shape: bench/flops.py, the formula in bench/README.md) and their share of the
float32 matrix-product peak the parent measures after the sides (bench/peak.py, with the
memory bandwidth).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:  # `python bench/gpt2.py`: the bench package, not this file
    sys.path.insert(0, str(ROOT))

from bench import peak  # noqa: E402
from bench.flops import layer_shapes, share_of_peak, step_flops  # noqa: E402
from bench.report import cpu_model, gflop, percent  # noqa: E402

RESULT = "GPT2_BENCH "
SMALL = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
SMOKE = dict(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4)
BATCH, LENGTH, PROMPT, NEW = (4, 256), 256, 16, 64
SMOKE_SIZES = (2, 16), 16, 4, 8
LR, WEIGHT_DECAY, CLIP = 3e-4, 0.1, 1.0


def write_folder(folder: Path, sizes: dict, vocab_text: str | None = None) -> Path:
    """A GPT-2 folder of random weights (seed 0, float32, dropout 0) and a byte-level BPE
    tokenizer trained on ``vocab_text`` (any tokenizer fits: its vocabulary is at most
    the model's), so demos/finetune.py can load it."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    config = transformers.GPT2Config(**sizes, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(sizes["vocab_size"], 8000),
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([vocab_text or (ROOT / "README.md").read_text()], trainer)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def batch_of(vocab: int, shape: tuple[int, int], length: int, prompt: int):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (shape[0], length + 1))
    return ids[:, :-1], ids[:, 1:], ids[0, :prompt]


# --------------------------------------------------------------------------- the sides
def blas_threads() -> int:
    """NumPy's BLAS on every core this process may use, as the torch side's
    ``torch.set_num_threads(os.cpu_count())``; returns the thread count in effect."""
    from threadpoolctl import threadpool_info, threadpool_limits

    threadpool_limits(len(os.sched_getaffinity(0)), user_api="blas")
    return min(pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas")


def npformer_side(folder: Path, sizes: tuple) -> dict:
    """{measurement: a function running it once} for npformer, and what the checks read."""
    from npformer import backend, fast, no_grad
    from npformer.decoding import generate

    shape, length, prompt_len, new = sizes
    model = fast.CausalLM.from_pretrained(folder)
    x, y, prompt = batch_of(model.config.vocab_size, shape, length, prompt_len)
    optimizer = fast.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    loss_with_gradient = type(model).cross_entropy_with_gradient  # the fast tier's loss
    seen = {"side": f"npformer, fast tier, numpy backend, {blas_threads()} BLAS threads"}

    def forward():
        model.eval()
        with no_grad():
            model(backend.asarray(x))
        model.train()

    def train_step():
        optimizer.zero_grad()
        loss, dlogits = loss_with_gradient(model(backend.asarray(x)), backend.asarray(y))
        model.backward(dlogits)
        optimizer.clip_grad_norm(model.named_parameters(), CLIP)
        optimizer.step()
        seen.setdefault("first_loss", backend.to_float(loss))

    def decode():
        seen["tokens"] = generate(model, prompt.tolist(), new, greedy=True)[prompt_len:]

    return {"forward": forward, "generate": decode, "train_step": train_step}, seen


def torch_side(folder: Path, sizes: tuple) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    shape, length, prompt_len, new = sizes
    model = transformers.GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32)
    x, y, prompt = (torch.tensor(a) for a in batch_of(model.config.vocab_size, shape,
                                                      length, prompt_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    seen = {"side": f"transformers {transformers.__version__} "
                    f"({model.config._attn_implementation} attention), torch "
                    f"{torch.__version__}, {torch.get_num_threads()} threads"}

    def forward():
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()

    def train_step():
        optimizer.zero_grad()
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        seen.setdefault("first_loss", loss.item())

    def decode():
        model.eval()
        with torch.no_grad():
            out = model.generate(prompt[None], max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones(1, prompt_len, dtype=torch.long))
        model.train()
        seen["tokens"] = out[0, prompt_len:].tolist()

    return {"forward": forward, "generate": decode, "train_step": train_step}, seen


def worker(side: str, folder: Path, sizes: tuple) -> None:
    """Load the side, warm each measurement up once (training's warm-up is its first
    step), then serve the runner (:func:`serve`)."""
    serve(*(npformer_side if side == "npformer" else torch_side)(folder, sizes))


def serve(runs: dict, seen: dict) -> None:
    """Warm up the measurements that change no weights (forward, generate), say ready,
    then run one timed measurement per line of standard input and print its seconds."""
    runs["forward"](), runs["generate"]()
    print(RESULT + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name == "quit":
            break
        start = time.perf_counter()
        runs[name]()
        seconds = time.perf_counter() - start
        print(RESULT + json.dumps({"name": name, "seconds": seconds, **seen}), flush=True)


# --------------------------------------------------------------------------- the runner
class Side:
    """A worker process kept alive for the whole run (``script``'s ``--worker SIDE``)."""

    def __init__(self, side: str, folder: Path, smoke: bool, script: str = __file__):
        command = [sys.executable, str(Path(script).resolve()), "--worker", side,
                   "--folder", str(folder)] + (["--smoke"] if smoke else [])
        self.name = side
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.read()  # ready

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        raise SystemExit(f"error: the {self.name} worker ended (status {self.proc.wait()})")

    def run(self, name: str) -> dict:
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait()


def take_turns(sides: list[Side], names: tuple[str, ...], rounds: int) -> tuple[dict, dict]:
    """Each measurement of ``names`` in order (training last: it moves the weights),
    ``rounds`` times, the sides taking turns (the first side first in even rounds), then
    the workers closed -> ({side: {name: [seconds]}}, {side: its last result})."""
    times = {side.name: {name: [] for name in names} for side in sides}
    seen = {}
    for name in names:
        for round_ in range(rounds):
            for side in sides if round_ % 2 == 0 else sides[::-1]:
                result = side.run(name)
                times[side.name][name].append(result["seconds"])
                seen[side.name] = result
                print(f"{name} round {round_}: {side.name} {result['seconds']:.3f} s",
                      flush=True)
    for side in sides:
        side.close()
    return times, seen


def check_losses_agree(seen: dict, keys: tuple[str, ...] = ("first_loss",)) -> None:
    """Stop the run where the sides' first steps' losses (``keys`` of each side's last
    result) differ by more than 1e-4 relative: they would not be computing one model."""
    for key in keys:
        ours, theirs = seen["npformer"][key], seen["torch"][key]
        if abs(ours - theirs) > 1e-4 * abs(theirs):
            raise SystemExit(f"error: the first steps' losses differ ({key}): npformer {ours}, "
                             f"PyTorch {theirs}: the sides do not compute the same model")


def agreement_lines(seen: dict, rounds: int, losses: str) -> list[str]:
    """The lines under a table: ``losses`` (the first steps' losses, as the caller words
    them), how many greedy tokens the sides share, each side, the CPU and the rounds."""
    ours, theirs = seen["npformer"], seen["torch"]
    same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
    return ["", f"{losses}; greedy tokens equal: {same} of {len(theirs['tokens'])}",
            f"npformer: {ours['side']}", f"PyTorch: {theirs['side']}",
            f"CPU: {cpu_model()}, {os.cpu_count()} cores; the minimum of {rounds} runs a "
            "side, the sides taking turns"]


def flops_config(sizes: dict, batch: int, length: int) -> dict:
    """GPT-2's shape ``sizes`` on a (batch, length) batch as a bench/flops.py configuration
    (a causal LM: tied head, feed-forward 4 D)."""
    return dict(kind="causal_lm", vocab_size=sizes["vocab_size"], d_model=sizes["n_embd"],
                num_heads=sizes["n_head"], num_layers=sizes["n_layer"],
                d_ff=4 * sizes["n_embd"], seq_len=length, batch=batch)


def run_config(args) -> dict:
    """The flops configuration of this run (GPT-2 small, or the smoke model)."""
    (batch, _), length = (SMOKE_SIZES if args.smoke else (BATCH, LENGTH))[:2]
    return flops_config(SMOKE if args.smoke else SMALL, batch, length)


FLOPS_PHASE = {"forward": "infer", "train_step": "train"}  # generate: not counted


def report(times: dict, seen: dict, args, limits: dict) -> str:
    names = {"forward": f"forward {BATCH if not args.smoke else SMOKE_SIZES[0]}",
             "train_step": "train step (forward, backward, clip, AdamW)",
             "generate": f"generate {NEW if not args.smoke else SMOKE_SIZES[3]} tokens "
                         "(greedy, KV cache)"}
    flops, peak_gflops = step_flops(run_config(args)), limits["matmul"]["gflops"]
    lines = ["| measurement | npformer s | PyTorch (HF) s | ratio | GFLOP | npformer share of "
             "peak | PyTorch share of peak |", "|---|---:|---:|---:|---:|---:|---:|"]
    for key, name in names.items():
        ours, theirs = min(times["npformer"][key]), min(times["torch"][key])
        counted = flops.get(FLOPS_PHASE.get(key))
        shares = (f"{gflop(counted)} | {percent(share_of_peak(counted, ours, peak_gflops))} | "
                  f"{percent(share_of_peak(counted, theirs, peak_gflops))}" if counted
                  else "n/a | n/a | n/a")
        lines.append(f"| {name} | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f}x | "
                     f"{shares} |")
    ours, theirs = seen["npformer"], seen["torch"]
    lines += agreement_lines(seen, args.rounds, f"first-step loss: npformer "
                             f"{ours['first_loss']:.6f}, PyTorch {theirs['first_loss']:.6f}")
    lines += ["GFLOP: the matrix products of the step, counted from GPT-2's shape "
              "(bench/flops.py; training 3x the forward); share of peak: over the time and "
              "the peak below (generate is bound by memory, not products: not counted)",
              *peak.peak_lines(limits)]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--folder-only", type=Path, default=None, metavar="FOLDER")
    parser.add_argument("--worker", choices=["npformer", "torch"], default=None)
    args = parser.parse_args(argv)
    sizes = SMOKE_SIZES if args.smoke else (BATCH, LENGTH, PROMPT, NEW)
    if args.worker:
        worker(args.worker, args.folder, sizes)
        return 0
    if args.folder_only:
        write_folder(args.folder_only, SMALL)
        print(f"wrote {args.folder_only}")
        return 0
    args.rounds = 1 if args.smoke else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or write_folder(Path(tmp) / "gpt2", SMOKE if args.smoke else SMALL)
        sides = [Side(name, folder, args.smoke) for name in ("npformer", "torch")]
        times, seen = take_turns(sides, ("forward", "generate", "train_step"), args.rounds)
    check_losses_agree(seen)
    limits = peak.measure(layer_shapes(run_config(args)), os.cpu_count() or 1, args.smoke)
    print(report(times, seen, args, limits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
