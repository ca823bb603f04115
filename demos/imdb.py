"""Sentiment classification of IMDB movie reviews with a Transformer trained from scratch.

    python demos/imdb.py                      # default run: <= 15 minutes on 2 CPU cores
    python demos/imdb.py --preset large       # six models, longer (~30 minutes)
    python demos/imdb.py --predict "A wonderful, moving film."
    python demos/imdb.py --smoke              # seconds, tiny subset (CI)
    python demos/imdb.py --resume             # continue an interrupted run exactly

Reads aclImdb_v1.tar.gz in place (--data, $NPFORMER_DATA, or the user cache;
downloads it if missing).  Holds out 2,500 training reviews for validation and
trains --members models one after another (each reads words and word pairs: the
pairs hashed into --bigram-buckets embedding rows), each from its own seed (its own
initial weights, dropout and order), keeping each member's checkpoint with the
best validation accuracy; the prediction is the members' mean probability (an
ensemble).  Scores all 25,000 test reviews once, at the end.  Writes model.npz
and last.npz (the first member; the others' are model-2.npz, last-2.npz, ...),
curves.png, attention.png and metrics.json to --out.  Settings come
from a preset (--preset, --smoke); an option given overrides the preset's value.

Your own data: --data train.csv (or .tsv, .jsonl, .json) holding a text and a
label column (--text-column, --label-column; default "text" and "label"), any
labels; --validation-data and --test-data name the other splits.  Without a
validation file, --validation examples (at most a tenth) are held out of the
training file; without a test file, only validation is reported.  --predict
then prints your label names.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

try:
    import npformer  # noqa: F401  (reads $NPFORMER_BACKEND)
except (ValueError, RuntimeError) as exc:
    sys.exit(f"error: {exc}")

import numpy as np

from npformer import backend, ops
from npformer.cli import (
    LAST_FILE,
    MODEL_FILE,
    Demo,
    DemoError,
    Stopwatch,
    check_divisible,
    demo_parser,
    extra_output,
    load_demo_model,
    map_batches,
    nonnegative_float,
    nonnegative_int,
    option,
    plot_attention,
    plot_curves,
    positive_float,
    probability,
    resume_run,
    run_demo,
    run_record,
    start_demo,
    write_metrics,
)
from npformer.cli.memory import check_training_fits
from npformer.data import (
    Vocab,
    is_user_data,
    length_bucketed_batches,
    load_imdb_splits,
    load_text_classification,
    pad_batch,
    split_validation,
    tokenize_imdb,
)
from npformer.models import ClassifierConfig, TransformerClassifier
from npformer.nn import evaluating, record_attention
from npformer.optim import AdamW, warmup_cosine
from npformer.train import EpochBatches, TrainConfig, Trainer, TrainingInterrupted, progress
from npformer.train.tasks import Classification

DEMO = Demo(tag="imdb", title="IMDB", model_kind="classifier", script="demos/imdb.py",
            out="runs/imdb")
LABELS = ("negative", "positive")


@dataclass(frozen=True)
class Preset:
    d_model: int = option(64, "model width D")
    num_heads: int = option(4, "attention heads H (D must be a multiple)")
    num_layers: int = option(1, "encoder layers")
    d_ff: int = option(256, "feed-forward width")
    block_size: int = option(512, "tokens kept per review (the model's longest sequence)")
    head_tokens: int = option(128, "of those, taken from the review's start (the rest from its "
                                  "end)", nonnegative_int)
    vocab_size: int = option(20000, "at most this many words in the vocabulary")
    bigram_buckets: int = option(131072, "word pairs hashed into this many embedding rows, "
                                         "added to the words' (0: none)", nonnegative_int)
    batch_size: int = option(32, "reviews per update")
    lr: float = option(1e-3, "peak learning rate (warmup, then cosine decay)", positive_float)
    weight_decay: float = option(0.01, "AdamW's decoupled weight decay", nonnegative_float)
    warmup: int = option(300, "warmup updates (at most a tenth of the run)")
    epochs: float = option(2.5, "passes over the training reviews, each member",
                           positive_float)
    members: int = option(3, "models trained one after another from their own seeds, "
                             "their probabilities averaged (an ensemble)")
    dropout: float = option(0.1, "dropout probability", probability)
    pooling: str = option("mean", "how the encoder's outputs become one vector", str,
                          ops.POOLINGS)
    max_minutes: float = option(13.0, "training time budget, in minutes, shared equally by "
                                      "the members, inside the whole run's", positive_float)
    validation: int = option(2500, "training reviews held out for validation")
    train_reviews: int | None = option(None, "train on a random subset of this many reviews "
                                             "(None: all)")
    test_reviews: int | None = option(None, "test on a random subset of this many reviews "
                                            "(None: all)")

    # what --predict reads of these (the saved model has the rest): any other
    # setting given with it is refused (npformer.cli.options.refuse_unread_with_saved_model)
    read_with_saved_model = ()

    def __post_init__(self):
        check_divisible(self, "d_model", "num_heads")
        if self.head_tokens > self.block_size:
            raise ValueError(f"--head-tokens {self.head_tokens} is more than --block-size "
                             f"{self.block_size}")


PRESETS = {
    "default": Preset(),
    # Ensembles paid where a larger model did not (demos/README.md): six members, longer.
    "large": Preset(epochs=3.0, members=6, max_minutes=45.0),
    "smoke": Preset(d_model=16, num_heads=2, num_layers=1, d_ff=32, block_size=64, head_tokens=16,
                    vocab_size=2000, bigram_buckets=512, batch_size=16, warmup=5, epochs=1.0,
                    members=2,
                    max_minutes=2.0,
                    validation=64, train_reviews=256, test_reviews=128),
}


# --------------------------------------------------------------------------- model, update
# (bench/ times these too: bench/configs.py imports them)
CLIP_NORM = 1.0  # the gradients' global norm is clipped to this


def model_config(preset: Preset, vocab_size: int, pad_id: int,
                 num_classes: int = 2) -> ClassifierConfig:
    return ClassifierConfig(vocab_size=vocab_size, num_classes=num_classes,
                            d_model=preset.d_model,
                            num_heads=preset.num_heads, num_layers=preset.num_layers,
                            d_ff=preset.d_ff, block_size=preset.block_size, dropout=preset.dropout,
                            pooling=preset.pooling, pad_id=pad_id,
                            bigram_buckets=preset.bigram_buckets)


def implementations(tier: str = "fast") -> tuple[type, type]:
    """(model class, optimizer class) that train on ``tier``: npformer.fast's, or the
    textbook's (``--tier textbook``, whose run never imports npformer.fast); both compute
    the same numbers up to rounding."""
    if tier == "fast":
        from npformer import fast  # the fast tier, imported only where it trains

        return fast.TransformerClassifier, fast.AdamW
    return TransformerClassifier, AdamW


def make_optimizer(params, preset: Preset, total_updates: int, tier: str = "fast") -> AdamW:
    """AdamW, warmup (at most a tenth of the run), then cosine decay."""
    warmup = min(preset.warmup, max(1, total_updates // 10))
    return implementations(tier)[1](params, lr=warmup_cosine(preset.lr, warmup, total_updates),
                                    weight_decay=preset.weight_decay)


def train_member(member: int, args, preset: Preset, config: ClassifierConfig, vocab: Vocab,
                 labels, stop_after: int | None, train_split, val_split) -> Trainer:
    """Train member ``member`` (1-based) from seed ``args.seed + member - 1`` (its initial
    weights, dropout masks and batch order), or continue it from its last checkpoint
    under --resume (a member that had finished returns at once).  Each member gets an
    equal share of the time budget and keeps its best checkpoint by validation accuracy."""
    (train_ids, train_y), (val_ids, val_y) = train_split, val_split
    best_path, last_path = member_files(Path(args.out), member)
    seed = args.seed + member - 1
    backend.seed(seed)
    model = implementations(args.tier)[0](config)
    updates_per_epoch = int(np.ceil(len(train_ids) / preset.batch_size))
    total_updates = max(1, int(preset.epochs * updates_per_epoch))
    optimizer = make_optimizer(model.parameters(), preset, total_updates, args.tier)
    print(f"member {member} of {preset.members} (seed {seed}): {model.num_parameters():,} "
          f"parameters; {total_updates} updates ({preset.epochs} epochs of "
          f"{updates_per_epoch})")
    trainer = Trainer(
        model, optimizer, Classification(),
        batch_stream(train_ids, train_y, preset.batch_size, vocab.pad_id),
        TrainConfig(max_iters=total_updates,
                    max_seconds=preset.max_minutes * 60 / preset.members,
                    replicas=args.replicas, clip_norm=CLIP_NORM,
                    eval_every=max(1, updates_per_epoch // 2),
                    checkpoint_path=best_path, select_metric="val_accuracy",
                    last_path=last_path, stop_after=stop_after,
                    progress=not args.no_progress,
                    desc="imdb" if preset.members == 1 else f"imdb-{member}/{preset.members}"),
        eval_fn=lambda m: {f"val_{k}": v for k, v in
                           evaluate(m, val_ids, val_y, 64, vocab.pad_id, args.replicas,
                                    "validation").items()},
        checkpoint_extra={"demo": DEMO.tag, "vocab": vocab.to_json(),
                          "head_tokens": preset.head_tokens, "members": preset.members,
                          "labels": list(labels),
                          "run": run_record(args, preset)},
        seed=seed)
    if args.resume and last_path.is_file():
        resume_run(trainer, last_path)
    with progress.context(member_label(member, preset.members)):  # its evaluation lines
        trainer.fit()
    return trainer


# --------------------------------------------------------------------------- data
def truncate(tokens: list, block_size: int, head: int) -> list:
    """At most block_size tokens: all of a short review; else its first ``head`` tokens and
    its last block_size - head (a review's verdict is often in its closing lines)."""
    if len(tokens) <= block_size:
        return tokens
    return tokens[:head] + tokens[len(tokens) - (block_size - head):]


def encode_reviews(examples, vocab: Vocab, block_size: int, head: int):
    """[(text, label)] -> (list of truncated id lists, labels array)."""
    ids = [vocab.encode(truncate(tokenize_imdb(text), block_size, head)) or [vocab.unk_id]
           for text, _ in examples]
    return ids, np.array([label for _, label in examples], dtype=np.int64)


def make_batches(ids, labels, order, pad_id: int):
    """Padded (ids, valid_lens, labels) for the rows in ``order``."""
    padded, lens = pad_batch([ids[i] for i in order], pad_id)
    return padded, lens, labels[order]


def log_probabilities(model, ids, batch_size: int, pad_id: int, replicas: int = 1,
                      phase: str | None = None):
    """(N, C) log class probabilities (float64) of every review, in the order of ``ids``;
    batches sorted by length (little padding), spread over ``replicas`` threads; ``phase``
    names the pass in the progress shown ("validation")."""
    order = np.argsort([len(x) for x in ids], kind="stable")
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

    def score(rows):  # -> (B, C) log probabilities of one batch
        x, lens = pad_batch([ids[i] for i in rows], pad_id)
        logits = backend.to_numpy(model(backend.asarray(x), backend.asarray(lens)))
        return ops.log_softmax_forward(logits.astype(np.float64))[0]  # on the host

    with evaluating(model):
        results = map_batches(score, batches, replicas, phase)
    out = np.empty((len(ids), results[0].shape[-1]))
    for rows, log_p in zip(batches, results):
        out[rows] = log_p
    return out


def ensemble(member_log_probs: list):
    """log of the members' mean probability: log((1/K) sum_k p_k), (N, C)."""
    stacked = np.stack(member_log_probs)  # (K, N, C)
    top = stacked.max(axis=0)
    return top + np.log(np.exp(stacked - top).mean(axis=0))


def scores(log_probs, labels) -> dict:
    """Accuracy (argmax = label) and mean negative log-likelihood of the labels."""
    rows = np.arange(len(labels))
    return {"accuracy": float(np.mean(np.argmax(log_probs, axis=-1) == labels)),
            "loss": float(-np.mean(log_probs[rows, labels]))}


def evaluate(model, ids, labels, batch_size: int, pad_id: int, replicas: int = 1,
             phase: str | None = None) -> dict:
    """Accuracy and mean loss of one model over a whole split."""
    return scores(log_probabilities(model, ids, batch_size, pad_id, replicas, phase), labels)


def batch_stream(ids, labels, batch_size: int, pad_id: int) -> EpochBatches:
    """next_batch(rng) for the Trainer: length-bucketed, reshuffled every epoch."""
    lengths = [len(x) for x in ids]
    return EpochBatches(lambda rng: length_bucketed_batches(lengths, batch_size, rng=rng),
                        lambda rows: make_batches(ids, labels, rows, pad_id))


def load_data(preset: Preset, args):
    """-> train, validation and test examples [(text, label index)] as the preset asks
    (subsets drawn with ``args.seed``; test empty when there is none), and the label names.
    The IMDB archive, or the user's own files (:func:`load_user_data`)."""
    seed = args.seed
    if is_user_data(args.data):
        train, val, test, labels = load_user_data(preset, args)
    else:
        splits = load_imdb_splits(args.data)
        if preset.validation >= len(splits["train"]):
            raise DemoError(f"--validation {preset.validation} leaves nothing to train on: "
                            f"there are {len(splits['train'])} training reviews")
        train, val = split_validation(splits["train"], preset.validation, seed=seed)
        test, labels = splits["test"], LABELS
    rng = np.random.default_rng(seed)
    pick = lambda xs, n: [xs[i] for i in rng.permutation(len(xs))[:n]]  # noqa: E731
    if preset.train_reviews:
        train = pick(train, preset.train_reviews)
    if preset.test_reviews:
        test = pick(test, preset.test_reviews)
    return train, val, test, labels


def load_user_data(preset: Preset, args):
    """--data (and --validation-data, --test-data): the user's labelled files -> train,
    validation, test, label names.  Without a validation file, --validation examples,
    at most a tenth of the training file, are held out of it (drawn with the seed)."""
    data = load_text_classification(args.data, args.validation_data, args.test_data,
                                    text_column=args.text_column,
                                    label_column=args.label_column)
    train, val = data.train, data.validation
    if args.validation_data is None:
        train, val = split_validation(train, min(preset.validation, len(train) // 10),
                                      seed=args.seed)
    if not val:
        raise DemoError(f"{args.data} has {len(data.train)} examples: too few to hold a "
                        f"tenth out for validation; give --validation-data")
    return train, val, data.test, data.labels


# --------------------------------------------------------------------------- predict
def predict(args) -> int:
    text = args.predict.strip()
    if not text:
        raise DemoError("--predict needs some text to classify, got an empty string")
    out = Path(args.out)
    model, checkpoint = load_demo_model(args.checkpoint or out / MODEL_FILE, DEMO, args.tier)
    count = 1 if args.checkpoint else checkpoint.extra.get("members", 1)
    models = [model] + [load_demo_model(member_files(out, k)[0], DEMO, args.tier)[0]
                        for k in range(2, count + 1)]
    vocab = Vocab.from_json(checkpoint.extra["vocab"])
    head = checkpoint.extra.get("head_tokens", model.config.block_size)
    ids = vocab.encode(truncate(tokenize_imdb(text), model.config.block_size, head)) or [
        vocab.unk_id]
    probs = np.exp(ensemble([log_probabilities(m, [ids], 1, vocab.pad_id) for m in models]))[0]
    label = int(np.argmax(probs))
    names = checkpoint.extra.get("labels", LABELS)  # the user's own, for a model trained on them
    print(f"{names[label]} (p = {probs[label]:.3f})")
    return 0


# --------------------------------------------------------------------------- train
def build_parser():
    parser = demo_parser(DEMO, __doc__, PRESETS)
    parser.add_argument("--predict", metavar="TEXT", help="classify TEXT with a saved checkpoint")
    parser.add_argument("--checkpoint", help=f"one model's checkpoint for --predict "
                                             f"(default: the run in OUT, {MODEL_FILE} and "
                                             f"an ensemble's other members)")
    add_user_data_options(parser)
    from npformer.cli.options import needs  # an option read only with another

    needs(parser, "checkpoint", lambda args, preset: args.predict is not None, "--predict TEXT")
    for name in ("text_column", "label_column"):  # typed for IMDB's data: nothing reads them
        needs(parser, name, lambda args, preset: is_user_data(args.data),
              "--data FILE.csv (.tsv, .jsonl, .json), your own examples")
    return parser


def add_user_data_options(parser) -> None:
    """Options for training on the user's own labelled files (--data FILE.csv etc.)."""
    group = parser.add_argument_group(
        "your own data", "--data FILE.csv (.tsv, .jsonl, .json): your labelled training "
                         "examples instead of IMDB")
    group.add_argument("--validation-data", metavar="FILE",
                       help="your validation examples (default: --validation examples, at "
                            "most a tenth, held out of --data)")
    group.add_argument("--test-data", metavar="FILE",
                       help="your test examples (default: none; validation is reported)")
    group.add_argument("--text-column", default="text",
                       help="the column (JSON: key) holding the text (default: %(default)s)")
    group.add_argument("--label-column", default="label",
                       help="the column (JSON: key) holding the label (default: %(default)s)")


def check_user_data_options(parser, args) -> None:
    """--validation-data and --test-data go with --data FILE of the user's own; the text
    and the label are two columns."""
    for name in ("validation_data", "test_data"):
        if getattr(args, name) is not None and not is_user_data(args.data):
            parser.error(f"--{name.replace('_', '-')} goes with --data FILE.csv (.tsv, "
                         f".jsonl, .json): your own training examples")
    if args.text_column == args.label_column:
        parser.error(f"--text-column and --label-column both name {args.text_column!r}: "
                     "every text would be its own label")


def main(argv=None) -> int:
    args, preset, out = start_demo(DEMO, build_parser(), PRESETS, argv, use_saved="predict",
                                   check_options=check_user_data_options)
    if args.predict is not None:
        return predict(args)

    clock = Stopwatch()
    train, val, test, labels = load_data(preset, args)
    vocab = Vocab.build([tokenize_imdb(t) for t, _ in train], min_freq=2,
                        max_size=preset.vocab_size)
    train_ids, train_y = encode_reviews(train, vocab, preset.block_size, preset.head_tokens)
    val_ids, val_y = encode_reviews(val, vocab, preset.block_size, preset.head_tokens)
    test_ids, test_y = encode_reviews(test, vocab, preset.block_size, preset.head_tokens)
    print(f"{len(train)} train, {len(val)} validation, {len(test)} test reviews; "
          f"{len(labels)} labels; vocabulary {len(vocab)}; data ready in "
          f"{clock.seconds():.0f} s")

    config = model_config(preset, len(vocab), vocab.pad_id, num_classes=len(labels))
    check_training_fits(config, preset.batch_size, max(map(len, train_ids)), preset,
                        PRESETS["default"], args.dtype)  # before a weight is made
    trainers, updates_before = [], 0
    for member in range(1, preset.members + 1):
        stop_after = None if args.stop_after is None else args.stop_after - updates_before
        if stop_after is not None and stop_after <= 0:  # counted over all members' updates
            raise TrainingInterrupted(updates_before, f"stop_after={args.stop_after}",
                                      member_files(out, member - 1)[1])
        try:
            trainers.append(train_member(member, args, preset, config, vocab, labels,
                                         stop_after, (train_ids, train_y), (val_ids, val_y)))
        except TrainingInterrupted as stopped:  # said in all members' updates, as typed
            reason = (f"stop_after={args.stop_after}" if stopped.reason.startswith("stop_after")
                      else stopped.reason)
            raise TrainingInterrupted(updates_before + stopped.updates, reason,
                                      stopped.path) from None
        updates_before += trainers[-1].updates

    models = [load_demo_model(member_files(out, k)[0], DEMO, args.tier)[0]
              for k in range(1, preset.members + 1)]
    val_metrics, member_val = score_split(models, val_ids, val_y, vocab.pad_id, args.replicas,
                                          "validation")
    test_metrics, member_test = (score_split(models, test_ids, test_y, vocab.pad_id,
                                             args.replicas, "test") if test_ids
                                 else ({"accuracy": None, "loss": None}, []))
    total_seconds = clock.seconds()
    listed = lambda values: ", ".join(f"{v:.4f}" for v in values)  # noqa: E731
    validation = (f"ensemble {val_metrics['accuracy']:.4f}, members {listed(member_val)}"
                  if len(models) > 1 else f"accuracy {val_metrics['accuracy']:.4f}")
    if test_ids:
        members = f"ensemble of {len(models)}, members {listed(member_test)}; " \
            if len(models) > 1 else ""
        print(f"test accuracy {test_metrics['accuracy']:.4f} on {len(test_ids)} reviews "
              f"({members}validation: {validation}); {total_seconds / 60:.1f} min in all")
    else:
        print(f"no test file: validation {validation} on {len(val_ids)} reviews; "
              f"{total_seconds / 60:.1f} min in all")

    write_metrics(out, args, models[0].num_parameters(), {
        "test_accuracy": test_metrics["accuracy"], "test_loss": test_metrics["loss"],
        "val_accuracy": val_metrics["accuracy"], "members": len(models),
        "member_test_accuracy": member_test, "member_val_accuracy": member_val,
        "updates": sum(t.updates for t in trainers),
        "member_updates": [t.updates for t in trainers],
        "train_minutes": sum(t.train_seconds for t in trainers) / 60,
        "total_minutes": total_seconds / 60})
    for member, trainer in enumerate(trainers, start=1):
        curves = "curves.png" if member == 1 else f"curves-{member}.png"
        extra_output(curves, plot_curves, out / curves, trainer.history,
                     ["val_accuracy", "val_loss"],
                     "IMDB classifier" + (f", member {member}" if len(trainers) > 1 else ""))
    extra_output("attention.png", draw_attention, models[0], vocab, test_ids or val_ids,
                 out / "attention.png")
    print(f"wrote {', '.join(written_files(len(models)))} to {out}")
    return 0


def written_files(members: int) -> list[str]:
    """The names of the files a run of ``members`` members writes, in the order printed."""
    checkpoints = [path.name for k in range(1, members + 1) for path in member_files(Path(), k)]
    curves = ["curves.png"] + [f"curves-{k}.png" for k in range(2, members + 1)]
    return checkpoints + curves + ["attention.png", "metrics.json"]


def score_split(models, ids, labels, pad_id: int, replicas: int, phase: str):
    """-> the ensemble's {"accuracy", "loss"} on one split, and each member's accuracy;
    ``phase`` names the split in the progress shown (with the member: "member 2/3, test")."""
    log_probs = []
    for member, model in enumerate(models, start=1):
        with progress.context(member_label(member, len(models))):
            log_probs.append(log_probabilities(model, ids, 64, pad_id, replicas, phase))
    return scores(ensemble(log_probs), labels), [scores(p, labels)["accuracy"]
                                                 for p in log_probs]


def member_label(member: int, members: int) -> str | None:
    """What an ensemble member's lines begin with ("member 2/3"); None for a lone model."""
    return f"member {member}/{members}" if members > 1 else None


def member_files(out: Path, member: int) -> tuple[Path, Path]:
    """(best, last) checkpoints of ensemble member ``member`` (1-based): the first
    member's are model.npz and last.npz, a single model's names."""
    if member == 1:
        return out / MODEL_FILE, out / LAST_FILE
    return out / f"model-{member}.npz", out / f"last-{member}.npz"


def draw_attention(model, vocab: Vocab, ids, path) -> None:
    """Heat-map of the first layer's attention (mean over heads) for a short test review."""
    short = min((x for x in ids if 12 <= len(x) <= 40), key=len, default=ids[0][:40])
    with evaluating(model), record_attention(model) as recorded:
        model(backend.asarray(np.array([short], dtype=np.int64)))
    weights = backend.to_numpy(recorded["blocks.0.self_attn"])[0].mean(axis=0)  # (T, T)
    tokens = vocab.decode(short)
    plot_attention(path, weights, tokens, tokens, "IMDB classifier: layer 1 attention, "
                   "mean over heads")


if __name__ == "__main__":
    sys.exit(run_demo(main))
