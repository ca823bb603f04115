"""Sentiment classification of IMDB movie reviews with a Transformer trained from scratch.

    python demos/imdb.py                      # default run: <= 15 minutes on 2 CPU cores
    python demos/imdb.py --preset large       # bigger model, longer
    python demos/imdb.py --predict "A wonderful, moving film."
    python demos/imdb.py --smoke              # seconds, tiny subset (CI)

Reads aclImdb_v1.tar.gz in place (--data, $NPFORMER_DATA, or the user cache;
downloads it if missing).  Holds out 2,500 training reviews for validation,
keeps the checkpoint with the best validation accuracy, and scores all 25,000
test reviews once, at the end.  Writes model.npz, curves.png, attention.png and
metrics.json to --out.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

import numpy as np

from npformer import backend, ops
from npformer.checkpoint import CheckpointError, build_model, load_checkpoint
from npformer.cli import (Stopwatch, add_common_args, machine_description, plot_attention,
                          plot_curves, run_demo, setup, write_json)
from npformer.data import (Vocab, length_bucketed_batches, load_imdb_splits, pad_batch,
                           split_validation, tokenize_imdb)
from npformer.models import ClassifierConfig, TransformerClassifier
from npformer.nn import no_grad
from npformer.optim import AdamW, warmup_cosine
from npformer.parallel import parallel_map
from npformer.tasks import Classification
from npformer.train import Trainer, TrainConfig

LABELS = ("negative", "positive")


@dataclass
class Preset:
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 1
    d_ff: int = 256
    max_len: int = 256
    head_tokens: int = 64  # truncation keeps the first 64 and the last max_len - 64 tokens
    vocab_size: int = 20000
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 300
    epochs: float = 4.0
    dropout: float = 0.1
    pooling: str = "mean"
    max_minutes: float = 12.0  # training budget inside the 15-minute run


PRESETS = {
    "default": Preset(),
    "large": Preset(d_model=128, num_heads=8, num_layers=4, d_ff=512, max_len=512,
                    head_tokens=128, lr=5e-4, epochs=6.0, max_minutes=120.0),
    "smoke": Preset(d_model=16, num_heads=2, num_layers=1, d_ff=32, max_len=64, head_tokens=16,
                    vocab_size=2000, batch_size=16, warmup_steps=5, epochs=1.0,
                    max_minutes=2.0),
}


# --------------------------------------------------------------------------- data
def truncate(tokens: list, max_len: int, head: int) -> list:
    """At most max_len tokens: all of a short review; else its first ``head`` tokens and its
    last max_len - head (a review's verdict is often in its closing lines)."""
    if len(tokens) <= max_len:
        return tokens
    return tokens[:head] + tokens[len(tokens) - (max_len - head):]


def encode_reviews(examples, vocab: Vocab, max_len: int, head: int):
    """[(text, label)] -> (list of truncated id lists, labels array)."""
    ids = [vocab.encode(truncate(tokenize_imdb(text), max_len, head)) or [vocab.unk_id]
           for text, _ in examples]
    return ids, np.array([label for _, label in examples], dtype=np.int64)


def make_batches(ids, labels, order, pad_id: int):
    """Padded (ids, valid_lens, labels) for the rows in ``order``."""
    padded, lens = pad_batch([ids[i] for i in order], pad_id)
    return padded, lens, labels[order]


def evaluate(model, ids, labels, batch_size: int, pad_id: int, workers: int = 1) -> dict:
    """Accuracy and mean loss over a whole split (sorted by length: little padding),
    batches spread over ``workers`` threads."""
    order = np.argsort([len(x) for x in ids], kind="stable")

    def score(rows):  # -> (summed loss, correct predictions) of one batch
        x, lens, y = make_batches(ids, labels, rows, pad_id)
        logits = model(backend.asarray(x), backend.asarray(lens))
        loss, _ = ops.cross_entropy_forward(logits, backend.asarray(y))
        correct = int(np.sum(np.argmax(backend.to_numpy(logits), axis=-1) == y))
        return backend.to_float(loss) * len(rows), correct

    model.eval()
    with no_grad():
        results = parallel_map(score, [order[i:i + batch_size]
                                       for i in range(0, len(order), batch_size)], workers)
    model.train()
    return {"accuracy": sum(c for _, c in results) / len(order),
            "loss": sum(loss for loss, _ in results) / len(order)}


def batch_stream(ids, labels, batch_size: int, pad_id: int):
    """next_batch(rng) for the Trainer: length-bucketed, reshuffled every epoch."""
    lengths = [len(x) for x in ids]
    queue: list = []

    def next_batch(rng):
        if not queue:
            queue.extend(length_bucketed_batches(lengths, batch_size, rng=rng))
        return make_batches(ids, labels, queue.pop(), pad_id)
    return next_batch


# --------------------------------------------------------------------------- predict
def predict(args) -> int:
    path = args.checkpoint or f"{args.out}/model.npz"
    text = args.predict.strip()
    if not text:
        print("error: --predict needs some text to classify, got an empty string", file=sys.stderr)
        return 2
    try:
        checkpoint = load_checkpoint(path)
        if checkpoint.extra.get("demo") != "imdb":
            raise CheckpointError(f"{path} was not saved by the IMDB demo "
                                  f"(it comes from {checkpoint.extra.get('demo', 'elsewhere')!r})")
        model = build_model(checkpoint, expected_kind="classifier")
    except (FileNotFoundError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    vocab = Vocab.from_json(checkpoint.extra["vocab"])
    head = checkpoint.extra.get("head_tokens", model.config.max_len)
    ids = vocab.encode(truncate(tokenize_imdb(text), model.config.max_len, head)) or [vocab.unk_id]
    probs = backend.to_numpy(model.predict(backend.asarray(np.array([ids], dtype=np.int64))))[0]
    label = int(np.argmax(probs))
    print(f"{LABELS[label]} (p = {probs[label]:.3f})")
    return 0


# --------------------------------------------------------------------------- train
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    add_common_args(parser, "runs/imdb")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--epochs", type=float, help="override the preset's epochs")
    parser.add_argument("--max-minutes", type=float, help="override the training time budget")
    parser.add_argument("--predict", metavar="TEXT", help="classify TEXT with a saved checkpoint")
    parser.add_argument("--checkpoint", help="checkpoint for --predict (default: OUT/model.npz)")
    args = parser.parse_args(argv)
    out = setup(args)
    if args.predict is not None:
        return predict(args)

    clock = Stopwatch()
    preset = PRESETS["smoke" if args.smoke else args.preset]
    preset = replace(preset, epochs=args.epochs or preset.epochs,
                     max_minutes=args.max_minutes or preset.max_minutes)
    splits = load_imdb_splits(args.data)
    train, val = split_validation(splits["train"], 64 if args.smoke else 2500, seed=args.seed)
    test = splits["test"]
    if args.smoke:
        rng = np.random.default_rng(args.seed)
        pick = lambda xs, n: [xs[i] for i in rng.permutation(len(xs))[:n]]  # noqa: E731
        train, test = pick(train, 256), pick(test, 128)
    vocab = Vocab.build([tokenize_imdb(t) for t, _ in train], min_freq=2,
                        max_size=preset.vocab_size)
    train_ids, train_y = encode_reviews(train, vocab, preset.max_len, preset.head_tokens)
    val_ids, val_y = encode_reviews(val, vocab, preset.max_len, preset.head_tokens)
    test_ids, test_y = encode_reviews(test, vocab, preset.max_len, preset.head_tokens)
    print(f"{len(train)} train, {len(val)} validation, {len(test)} test reviews; "
          f"vocabulary {len(vocab)}; data ready in {clock.seconds():.0f} s")

    config = ClassifierConfig(vocab_size=len(vocab), d_model=preset.d_model,
                              num_heads=preset.num_heads, num_layers=preset.num_layers,
                              d_ff=preset.d_ff, max_len=preset.max_len, dropout=preset.dropout,
                              pooling=preset.pooling, pad_id=vocab.pad_id)
    model = TransformerClassifier(config)
    steps_per_epoch = int(np.ceil(len(train_ids) / preset.batch_size))
    total_steps = max(1, int(preset.epochs * steps_per_epoch))
    warmup = min(preset.warmup_steps, max(1, total_steps // 10))
    optimizer = AdamW(model.parameters(), lr=warmup_cosine(preset.lr, warmup, total_steps),
                      weight_decay=preset.weight_decay)
    print(f"model: {model.num_parameters():,} parameters; {total_steps} steps "
          f"({preset.epochs} epochs of {steps_per_epoch})")

    checkpoint_path = out / "model.npz"
    trainer = Trainer(
        model, optimizer, Classification(),
        batch_stream(train_ids, train_y, preset.batch_size, vocab.pad_id),
        TrainConfig(max_steps=total_steps, max_seconds=preset.max_minutes * 60,
                    data_parallel=args.replicas, clip_norm=1.0,
                    eval_every=max(1, steps_per_epoch // 2),
                    checkpoint_path=checkpoint_path, select_metric="val_accuracy",
                    progress=not args.no_progress, desc="imdb"),
        eval_fn=lambda m: {f"val_{k}": v for k, v in
                           evaluate(m, val_ids, val_y, 64, vocab.pad_id, args.replicas).items()},
        checkpoint_extra={"demo": "imdb", "vocab": vocab.to_json(),
                          "head_tokens": preset.head_tokens}, seed=args.seed)
    history = trainer.fit()
    train_seconds = clock.seconds()

    best = build_model(load_checkpoint(checkpoint_path), expected_kind="classifier")
    test_metrics = evaluate(best, test_ids, test_y, 64, vocab.pad_id, args.replicas)
    total_seconds = clock.seconds()
    print(f"test accuracy {test_metrics['accuracy']:.4f} on {len(test_ids)} reviews "
          f"(best validation accuracy {trainer.best:.4f}); {total_seconds / 60:.1f} min in all")

    plot_curves(out / "curves.png", history, ["val_accuracy", "val_loss"], "IMDB classifier")
    draw_attention(best, vocab, test_ids, out / "attention.png")
    write_json(out / "metrics.json", {
        "test_accuracy": test_metrics["accuracy"], "test_loss": test_metrics["loss"],
        "best_val_accuracy": trainer.best, "steps": trainer.step,
        "train_minutes": train_seconds / 60, "total_minutes": total_seconds / 60,
        "preset": args.preset if not args.smoke else "smoke", "seed": args.seed,
        "machine": machine_description(), "parameters": model.num_parameters()})
    print(f"wrote {checkpoint_path}, curves.png, attention.png, metrics.json to {out}")
    return 0


def draw_attention(model, vocab: Vocab, ids, path) -> None:
    """Heat-map of the first layer's attention (mean over heads) for a short test review."""
    short = min((x for x in ids if 12 <= len(x) <= 40), key=len, default=ids[0][:40])
    attention = model.blocks[0].self_attn
    attention.keep_attention = True
    model.eval()
    with no_grad():
        model(backend.asarray(np.array([short], dtype=np.int64)))
    weights = backend.to_numpy(attention.last_attention)[0].mean(axis=0)  # (T, T)
    attention.keep_attention, attention.last_attention = False, None
    tokens = vocab.decode(short)
    plot_attention(path, weights, tokens, tokens, "IMDB classifier: layer 1 attention, "
                   "mean over heads")


if __name__ == "__main__":
    sys.exit(run_demo(main))
