"""A character-level language model on tiny Shakespeare (nanoGPT's CPU "baby GPT").

    python demos/generate.py                  # nanoGPT's settings: 2,000 iterations
    python demos/generate.py --sample-only --prompt "ROMEO:"
    python demos/generate.py --smoke          # seconds (CI)

Defaults follow nanoGPT's README for CPU: block 64, batch 12, 4 layers, 4 heads,
width 128, dropout 0, learning rate 1e-3 with warmup and cosine decay over
2,000 iterations, validation loss estimated on 20 batches; the first 90% of the
text trains, the last 10% validates.  Writes model.npz, curves.png,
sample.txt and metrics.json to --out.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from npformer import backend, ops
from npformer.checkpoint import CheckpointError, build_model, load_checkpoint
from npformer.cli import (Stopwatch, add_common_args, machine_description, plot_curves,
                          run_demo, setup, write_json)
from npformer.data import CharVocab, lm_batch, load_shakespeare, split_90_10
from npformer.decoding import generate
from npformer.models import CausalLM, CausalLMConfig
from npformer.nn import no_grad
from npformer.optim import AdamW, warmup_cosine
from npformer.tasks import LanguageModeling
from npformer.train import Trainer, TrainConfig


def estimate_loss(model, data: np.ndarray, block: int, batch: int, batches: int,
                  seed: int) -> float:
    """Mean loss over ``batches`` random windows (nanoGPT's estimate_loss)."""
    rng = np.random.default_rng(seed)
    model.eval()
    losses = []
    with no_grad():
        for _ in range(batches):
            x, y = lm_batch(data, block, batch, rng)
            loss, _ = ops.cross_entropy_forward(model(backend.asarray(x)), backend.asarray(y))
            losses.append(backend.to_float(loss))
    model.train()
    return float(np.mean(losses))


def sample(model, vocab: CharVocab, prompt: str, length: int, temperature: float,
           top_k: int | None, seed: int) -> str:
    missing = sorted(set(prompt) - set(vocab.chars))
    if missing:
        raise ValueError(f"prompt has characters the model never saw: {missing}")
    ids = generate(model, vocab.encode(prompt or "\n"), length, temperature=temperature,
                   top_k=top_k, rng=np.random.default_rng(seed))
    return vocab.decode(ids)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    add_common_args(parser, "runs/shakespeare")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--length", type=int, default=500, help="characters to sample")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--sample-only", action="store_true",
                        help="sample from OUT/model.npz without training")
    args = parser.parse_args(argv)
    out = setup(args)
    if args.sample_only:
        return sample_only(args, out)
    if args.smoke:
        args.iters, args.eval_every, args.eval_batches, args.length = 20, 10, 2, 50
        args.layers, args.width, args.heads, args.block = 1, 32, 2, 32

    clock = Stopwatch()
    text = load_shakespeare(args.data)
    vocab = CharVocab.from_text(text)
    train_ids, val_ids = split_90_10(np.array(vocab.encode(text), dtype=np.int64))
    config = CausalLMConfig(vocab_size=len(vocab), block_size=args.block, d_model=args.width,
                            num_heads=args.heads, num_layers=args.layers, d_ff=4 * args.width,
                            dropout=args.dropout)
    model = CausalLM(config)
    warmup = max(1, args.iters // 20)
    optimizer = AdamW(model.parameters(), lr=warmup_cosine(args.lr, warmup, args.iters,
                                                           min_lr=args.lr / 10),
                      betas=(0.9, 0.99), weight_decay=0.1)
    print(f"{len(train_ids):,} train / {len(val_ids):,} validation characters, vocabulary "
          f"{len(vocab)}; model {model.num_parameters():,} parameters")

    def eval_fn(m):
        return {"train_loss": estimate_loss(m, train_ids, args.block, args.batch,
                                            args.eval_batches, seed=1),
                "val_loss": estimate_loss(m, val_ids, args.block, args.batch,
                                          args.eval_batches, seed=2)}

    trainer = Trainer(model, optimizer, LanguageModeling(),
                      lambda rng: lm_batch(train_ids, args.block, args.batch, rng),
                      TrainConfig(max_steps=args.iters, clip_norm=1.0,
                                  data_parallel=args.replicas,
                                  eval_every=args.eval_every, checkpoint_path=out / "model.npz",
                                  progress=not args.no_progress, desc="shakespeare"),
                      eval_fn=eval_fn, checkpoint_extra={"demo": "shakespeare",
                                                         "vocab": vocab.to_json()},
                      seed=args.seed)
    history = trainer.fit()
    train_seconds = clock.seconds()
    final = history.evals[-1]
    print(f"step {trainer.step}: train loss {final['train_loss']:.4f}, validation loss "
          f"{final['val_loss']:.4f} ({train_seconds:.0f} s, "
          f"{1000 * train_seconds / trainer.step:.0f} ms/iteration)")
    text_out = sample(model, vocab, args.prompt, args.length, args.temperature, args.top_k,
                      args.seed)
    print("-" * 60 + "\n" + text_out + "\n" + "-" * 60)
    (out / "sample.txt").write_text(text_out)
    plot_curves(out / "curves.png", history, ["train_loss", "val_loss"],
                "tiny Shakespeare character LM")
    write_json(out / "metrics.json", {
        "val_loss": final["val_loss"], "train_loss": final["train_loss"],
        "iterations": trainer.step, "train_seconds": train_seconds,
        "ms_per_iteration": 1000 * train_seconds / trainer.step, "seed": args.seed,
        "machine": machine_description(), "parameters": model.num_parameters()})
    return 0


def sample_only(args, out) -> int:
    try:
        checkpoint = load_checkpoint(out / "model.npz")
        if checkpoint.extra.get("demo") != "shakespeare":
            raise CheckpointError("the checkpoint was not saved by the Shakespeare demo")
        model = build_model(checkpoint, expected_kind="causal_lm")
        vocab = CharVocab.from_json(checkpoint.extra["vocab"])
        print(sample(model, vocab, args.prompt, args.length, args.temperature, args.top_k,
                     args.seed))
    except (FileNotFoundError, CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run_demo(main))
