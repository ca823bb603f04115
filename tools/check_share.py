"""The checks' share of a training step: profile one demo's update (default the lm of
``demos/generate.py``: pre-norm GELU, 4 layers, width 128, 4 heads, context 64, batch 12,
AdamW, clipping at 1; ``--config imdb`` or ``seq2seq``: the other demos' default models,
batches of their default shapes) and report how much of its time is spent inside
argument checks, and the update's time without the profiler.

    python tools/check_share.py [--config lm|imdb|seq2seq] [--tier fast|textbook] [--updates 30]
    PYTHONPATH=/path/to/an/older/checkout python tools/check_share.py   # the same, before

A *check* is a function whose name starts with ``check`` or ``_check`` (``check_size``,
``_check_lr``, ``check_inputs``), or any function defined in the contracts module
(``npformer/ops/contracts.py``; ``npformer/validation.py`` before it, and the former
per-family check modules ``npformer/ops/_checks.py``); not the door's wrappers
(``checked``, ``run_trusted``, ...), which run the op inside them, and not the array
libraries' own checks.
Its time is counted once, at the outermost check (a check called by another check is
not counted twice): the cumulative time on every call edge from a non-check caller.
The profile is cProfile's, so both figures carry its overhead; the ratio is the claim.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from types import SimpleNamespace

import numpy as np

CHECK_FILES = ("npformer/ops/contracts.py", "npformer/validation.py", "npformer/ops/_checks.py")
# the door's wrappers run the op (or the layer) itself inside them: not checks; an op's own
# bookkeeping (its cache made and opened: the wrapper's "op" before the door moved into the
# op's first statement) is not one either
DOOR_WRAPPERS = ("op", "checked", "recorded", "run_trusted", "trusted", "trusting", "door",
                 "with_saved", "opened", "unchecked")


def is_check(key: tuple) -> bool:
    filename, _, name = key
    if "npformer" not in filename or name in DOOR_WRAPPERS:
        return False  # a library's own argument checks are its, not npformer's
    if name.startswith(("check", "_check")):
        return True
    return filename.endswith(CHECK_FILES)


def outermost_check_seconds(stats: pstats.Stats) -> tuple[float, int]:
    """Seconds inside checks, each counted at its outermost check, and the calls made
    from outside any check."""
    seconds, calls = 0.0, 0
    for key, (_, _, _, _, callers) in stats.stats.items():
        if not is_check(key):
            continue
        for caller, (_, primitive_calls, _, cumulative) in callers.items():
            if not is_check(caller):
                seconds += cumulative
                calls += primitive_calls
    return seconds, calls


def _padded(rng, lengths, width: int, vocab: int, low: int):
    ids = np.zeros((len(lengths), width), dtype=np.int64)  # pad id 0
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(low, vocab, size=n)
    return ids


TIERS = ("fast", "textbook")
MODEL_NAMES = ("CausalLM", "TransformerClassifier", "Seq2SeqTransformer")
OPTIMIZER_NAMES = ("Adam", "AdamW")


def tier_classes(tier: str) -> SimpleNamespace:
    """The models and optimizers of ``tier`` (``.CausalLM``, ``.AdamW``, ...):
    npformer.fast's, or the textbook's (npformer.models, npformer.optim).  A checkout
    from before the tiers' classes were named (one with ``npformer.set_engine``) has its
    engine set to ``tier``, and its textbook names make that tier's objects."""
    import npformer
    from npformer import models, optim

    def named(models_from, optimizers_from) -> SimpleNamespace:
        return SimpleNamespace(**{n: getattr(models_from, n) for n in MODEL_NAMES},
                               **{n: getattr(optimizers_from, n) for n in OPTIMIZER_NAMES})

    if hasattr(npformer, "set_engine"):  # an older checkout: one global switch
        npformer.set_engine(tier)
        return named(models, optim)
    if tier == "textbook":
        return named(models, optim)
    from npformer import fast

    return named(fast, fast)


def demo_run(name: str, tier: str = "fast"):
    """(model, optimizer, task, batch) of one demo's default run on ``tier``, built
    through the API both this checkout and the one before the renames accept
    (``max_len``: the old name of ``block_size``, still read with a DeprecationWarning).
    The batches are made here, not by ``bench.configs``, which imports the demos and so
    runs only on today's package."""
    import warnings

    from npformer.models import CausalLMConfig, ClassifierConfig, Seq2SeqConfig
    from npformer.optim import warmup_cosine, warmup_inverse_sqrt
    from npformer.train.tasks import Classification, LanguageModeling, Translation

    warnings.simplefilter("ignore", DeprecationWarning)
    classes = tier_classes(tier)
    rng = np.random.default_rng(0)
    if name == "lm":  # demos/generate.py
        model = classes.CausalLM(CausalLMConfig(vocab_size=65, block_size=64, d_model=128,
                                                num_heads=4, num_layers=4, d_ff=512,
                                                dropout=0.0))
        tokens = rng.integers(0, 65, size=(12, 65))
        batch, task = (tokens[:, :-1], tokens[:, 1:]), LanguageModeling()
    elif name == "imdb":  # demos/imdb.py
        model = classes.TransformerClassifier(ClassifierConfig(
            vocab_size=20002, num_classes=2, d_model=64, num_heads=4, num_layers=1, d_ff=256,
            max_len=256, dropout=0.1, pooling="mean", pad_id=0))
        lengths = rng.integers(64, 257, size=32)
        batch = (_padded(rng, lengths, 256, 20002, 1), lengths, rng.integers(0, 2, size=32))
        task = Classification()
    else:  # demos/translate.py
        model = classes.Seq2SeqTransformer(Seq2SeqConfig(
            src_vocab_size=9653, tgt_vocab_size=17221, d_model=256, num_heads=4,
            num_encoder_layers=2, num_decoder_layers=2, d_ff=1024, max_len=11, dropout=0.1,
            pad_id=0, bos_id=1, eos_id=2))
        src_lens, tgt_lens = rng.integers(5, 10, size=128), rng.integers(5, 10, size=128)
        body = _padded(rng, tgt_lens - 1, 9, 17221, 4)
        tgt_in, tgt_out = np.zeros((128, 9), np.int64), np.zeros((128, 9), np.int64)
        for row, n in enumerate(tgt_lens):
            tgt_in[row, :n] = [1, *body[row, :n - 1]]
            tgt_out[row, :n] = [*body[row, :n - 1], 2]
        batch = (_padded(rng, src_lens, 9, 9653, 4), src_lens, tgt_in, tgt_out, tgt_lens)
        task = Translation()
    if name == "seq2seq":
        optimizer = classes.Adam(model.parameters(),
                                 lr=warmup_inverse_sqrt(warmup=400, peak_lr=1e-3),
                                 betas=(0.9, 0.98), eps=1e-9)
    else:
        optimizer = classes.AdamW(model.parameters(), lr=warmup_cosine(1e-3, 10, 10**6),
                                  betas=(0.9, 0.99), weight_decay=0.1)
    return model, optimizer, task, batch


def build_trainer(name: str = "lm", tier: str = "fast"):
    from npformer.train import TrainConfig, Trainer

    model, optimizer, task, batch = demo_run(name, tier)
    train_config = TrainConfig(10**9, clip_norm=1.0, progress=False)  # the update count
    return Trainer(model, optimizer, task, lambda _rng: batch, train_config, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", choices=TIERS, default="fast",
                        help="npformer's tier whose classes run (default: %(default)s)")
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--config", choices=("imdb", "lm", "seq2seq"), default="lm",
                        help="which demo's default run (default: lm, the Shakespeare demo)")
    args = parser.parse_args()
    import npformer

    trainer = build_trainer(args.config, args.tier)
    for _ in range(3):  # warm up: first calls compile kernels and fill caches
        trainer.update()
    start = time.perf_counter()
    for _ in range(args.updates):
        trainer.update()
    plain = (time.perf_counter() - start) / args.updates
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.updates):
        trainer.update()
    profile.disable()
    stats = pstats.Stats(profile)
    check_seconds, check_calls = outermost_check_seconds(stats)
    profiled = stats.total_tt / args.updates
    print(f"npformer from {os.path.dirname(npformer.__file__)}, {args.config}, tier "
          f"{args.tier} ({type(trainer.model).__module__}.{type(trainer.model).__name__})")
    print(f"update: {plain * 1e3:.1f} ms unprofiled, {profiled * 1e3:.1f} ms under cProfile")
    print(f"checks: {check_calls / args.updates:.0f} outermost check calls per update, "
          f"{check_seconds / args.updates * 1e3:.2f} ms per update under cProfile = "
          f"{check_seconds / stats.total_tt:.1%} of the profiled update")


if __name__ == "__main__":
    main()
