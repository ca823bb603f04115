"""The checks' share of a training step: profile the Shakespeare demo's update (the lm of
``demos/generate.py``: pre-norm GELU, 4 layers, width 128, 4 heads, context 64, batch 12,
AdamW, clipping at 1) and report how much of its time is spent inside argument checks.

    python tools/check_share.py [--engine fast|textbook] [--updates 30]
    PYTHONPATH=/path/to/an/older/checkout python tools/check_share.py   # the same, before

A *check* is a function whose name starts with ``check`` or ``_check`` (``check_size``,
``_check_lr``, ``check_inputs``), or any function defined in the validation module
(``npformer/validation.py``) or in the former per-family check modules
(``npformer/ops/_checks.py``); not the door's wrappers (``checked``, ``run_trusted``, ...),
which run the op inside them, and not the array libraries' own checks.
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

import numpy as np

CHECK_FILES = ("npformer/validation.py", "npformer/ops/_checks.py")
# the door's wrappers run the op (or the layer) itself inside them: not checks
DOOR_WRAPPERS = ("op", "checked", "recorded", "run_trusted", "trusted")


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


def build_trainer(updates: int):
    from npformer.models import CausalLM, CausalLMConfig
    from npformer.optim import AdamW, warmup_cosine
    from npformer.tasks import LanguageModeling
    from npformer.train import TrainConfig, Trainer

    rng = np.random.default_rng(0)
    config = CausalLMConfig(vocab_size=65, block_size=64, d_model=128, num_heads=4,
                            num_layers=4, d_ff=512, dropout=0.0)
    model = CausalLM(config)
    optimizer = AdamW(model.parameters(), lr=warmup_cosine(1e-3, 10, 10**6, min_lr=1e-4),
                      betas=(0.9, 0.99), weight_decay=0.1)
    tokens = rng.integers(0, 65, size=(12, 65))
    batch = (tokens[:, :-1], tokens[:, 1:])
    train_config = TrainConfig(10**9, clip_norm=1.0, progress=False)  # the update count
    return Trainer(model, optimizer, LanguageModeling(), lambda _rng: batch, train_config, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default=os.environ.get("NPFORMER_ENGINE", "fast"))
    parser.add_argument("--updates", type=int, default=30)
    args = parser.parse_args()
    import npformer

    npformer.set_engine(args.engine)
    trainer = build_trainer(args.updates)
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
    print(f"npformer from {os.path.dirname(npformer.__file__)}, engine {args.engine}")
    print(f"update: {plain * 1e3:.1f} ms unprofiled, {profiled * 1e3:.1f} ms under cProfile")
    print(f"checks: {check_calls / args.updates:.0f} outermost check calls per update, "
          f"{check_seconds / args.updates * 1e3:.2f} ms per update under cProfile = "
          f"{check_seconds / stats.total_tt:.1%} of the profiled update")


if __name__ == "__main__":
    main()
