"""The benchmark's three configurations: the demos' default runs (and their smoke
versions), the batch every side trains on, and the npformer model and update of a
configuration, taken from the demo itself (the PyTorch side builds its reference from
the same npformer configuration and optimizer: bench/torch_models.py)."""
from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAD, BOS, EOS = 0, 2, 3  # the ids the demos' vocabularies give these (npformer.data.Vocab)
SEED = 0

# --------------------------------------------------------------------------- the demos
# Each configuration is a demo's default run: its preset (imported from the demo, so the
# two cannot drift), its model_config, make_optimizer, CLIP_NORM (and LABEL_SMOOTHING),
# on one batch of the demo's shape.  What the demo's data decides is a stand-in here,
# measured with the demos' own preprocessing (seed 0, 2026-11-23):
DEMO_OF = {"imdb": "imdb", "lm": "generate", "seq2seq": "translate"}
IMDB_VOCAB = 20_002          # <pad>, <unk> and the 20,000 most frequent words
IMDB_TRAIN_REVIEWS = 22_500  # 25,000 less 2,500 validation: sets the schedule's length
IMDB_LENGTH = 256            # the padded width of the demo's length-bucketed batches:
#                              mean 258 (reviews: mean 253 tokens, median 208, at most 512)
SHAKESPEARE_VOCAB = 65       # tiny Shakespeare's characters
FRA_ENG_VOCABS = (5_568, 7_210)  # subword pieces of 10,000 byte-pair merges (+ 4 specials;
#                                  seed 0's split, 2026-11-26)
FRA_ENG_LENGTH = 10          # the padded width of the length-bucketed batches: mean 9.85
#                              (sentences: mean 8.45 / 9.13 pieces with <eos>, at most 28)


@functools.cache
def demo_module(script: str):
    """demos/<script>.py as a module (its presets and model/update functions; its main
    is not run)."""
    name = f"npformer_demo_{script}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "demos" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def demo_preset(cfg: dict):
    """The demo preset a configuration was made from."""
    return demo_module(cfg["demo"]).Preset(**cfg["preset"])


def bench_config(name: str, preset: str = "default", vocab=None, length: int | None = None,
                 **changes) -> dict:
    """The benchmark configuration of demo ``DEMO_OF[name]`` run with its preset
    ``preset`` (fields changed by ``changes``): the preset itself (``preset``, what the
    workers rebuild the demo's model and update from) and the sizes the tables print.
    ``vocab`` and ``length`` replace the data's stand-ins (the smoke versions)."""
    script = DEMO_OF[name]
    p = replace(demo_module(script).PRESETS[preset], **changes)
    common = dict(demo=script, preset=asdict(p), dropout=p.dropout)
    if name == "imdb":
        updates = int(p.epochs * -(-IMDB_TRAIN_REVIEWS // p.batch_size))
        return dict(common, kind="classifier", vocab_size=vocab or IMDB_VOCAB, num_classes=2,
                    d_model=p.d_model, num_heads=p.num_heads, num_layers=p.num_layers, d_ff=p.d_ff,
                    seq_len=min(length or IMDB_LENGTH, p.block_size), batch=p.batch_size,
                    max_iters=updates)
    if name == "lm":
        return dict(common, kind="causal_lm", vocab_size=vocab or SHAKESPEARE_VOCAB,
                    d_model=p.d_model, num_heads=p.num_heads, num_layers=p.num_layers,
                    d_ff=4 * p.d_model, seq_len=p.block_size, batch=p.batch_size)
    src_vocab, tgt_vocab = vocab or FRA_ENG_VOCABS
    seq_len = min(length or FRA_ENG_LENGTH, demo_module(script).max_length(p) + 1)  # + <eos>
    return dict(common, kind="seq2seq", src_vocab_size=src_vocab, tgt_vocab_size=tgt_vocab,
                d_model=p.d_model, num_heads=p.num_heads, num_encoder_layers=p.num_layers,
                num_decoder_layers=p.num_layers, d_ff=p.d_ff, src_len=seq_len, seq_len=seq_len,
                batch=p.batch_size)


# --------------------------------------------------------------------------- configurations
# lm: nanoGPT's "baby GPT" (generate.py's nanogpt preset), the shape PyTorch and nanoGPT
# are timed at; the demo's default run is narrower.
CONFIGS = {"imdb": bench_config("imdb"), "lm": bench_config("lm", "nanogpt"),
           "seq2seq": bench_config("seq2seq")}
# The demos' own smoke presets, on tiny vocabularies and lengths.
SMOKE = {"imdb": bench_config("imdb", "smoke", vocab=200, length=16),
         "lm": bench_config("lm", "smoke", length=16),
         "seq2seq": bench_config("seq2seq", "smoke", vocab=(100, 100), length=8)}
# Larger configurations that fill a GPU (bench/gpu.py), and their smoke versions.
LARGE = {
    "imdb_large": bench_config("imdb", batch_size=256),
    "lm_large": bench_config("lm", "nanogpt", d_model=768, num_heads=12, num_layers=12,
                             block_size=1024, batch_size=8),
}
SMOKE_LARGE = {
    "imdb_large": bench_config("imdb", "smoke", vocab=200, length=16, batch_size=8),
    "lm_large": bench_config("lm", "smoke", num_layers=2),
}
GPU_CONFIGS = {**CONFIGS, **LARGE}
GPU_SMOKE = {**SMOKE, **SMOKE_LARGE}
WARMUP_CONFIGS = {c["kind"]: c for c in SMOKE.values()}  # library warm-up, per model kind
# The imdb sweeps (--sweeps): sequence length at a fixed number of tokens a batch, and
# batch size at the configuration's length.  The smoke sweep ends at the same longest
# length (at one sequence a batch), so that a smoke run meets what the full sweep meets.
SWEEP_TOKENS = 8192
SWEEP_LENGTHS = (64, 128, 256, 512, 1024)
SWEEP_BATCHES = (8, 16, 32, 64)
SMOKE_SWEEP_TOKENS = 1024
SMOKE_SWEEP_LENGTHS = (16, 1024)
SMOKE_SWEEP_BATCHES = (2, 4)


def sweeps(smoke: bool = False) -> list[tuple[str, list[dict]]]:
    """[(title, configurations)] of the imdb sweeps, in the order they run.

    The length sweep's model is built for the longest length it times (its preset's
    block_size is that length: the demo's 512 would refuse 1024), each row at
    ``tokens // T`` sequences a batch; the batch sweep's is the configuration's own.
    """
    tokens, lengths, batch_sizes = ((SMOKE_SWEEP_TOKENS, SMOKE_SWEEP_LENGTHS,
                                     SMOKE_SWEEP_BATCHES) if smoke
                                    else (SWEEP_TOKENS, SWEEP_LENGTHS, SWEEP_BATCHES))
    if tokens < max(lengths):
        raise ValueError(f"{tokens} tokens a batch hold no sequence of length {max(lengths)}")
    sizes = dict(vocab=200, length=16) if smoke else {}
    preset = "smoke" if smoke else "default"
    longest = bench_config("imdb", preset, block_size=max(lengths), **sizes)
    base = bench_config("imdb", preset, **sizes)
    return [(f"imdb sweep: sequence length at {tokens} tokens per batch (B = {tokens}/T)",
             [dict(longest, seq_len=T, batch=tokens // T) for T in lengths]),
            (f"imdb sweep: batch size at length {base['seq_len']}",
             [dict(base, batch=B) for B in batch_sizes])]

SIDES = ("pytorch", "npformer")  # PyTorch first: it writes the shared initial weights


def tokens_per_step(cfg: dict) -> int:
    """Token positions one step processes, padding included (seq2seq: source + target)."""
    return cfg["batch"] * (cfg["seq_len"] + cfg.get("src_len", 0))


def make_batch(cfg: dict, seed: int):
    """The same host NumPy batch on both sides (a fixed batch, reused every step)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    B, T = cfg["batch"], cfg["seq_len"]

    def padded(lengths, width, vocab, low):
        ids = np.full((len(lengths), width), PAD, dtype=np.int64)
        for b, n in enumerate(lengths):
            ids[b, :n] = rng.integers(low, vocab, size=n)
        return ids

    if cfg["kind"] == "classifier":
        lens = rng.integers(max(1, T // 4), T + 1, size=B).astype(np.int64)  # none fully padded
        return padded(lens, T, cfg["vocab_size"], 1), lens, rng.integers(0, cfg["num_classes"], B)
    if cfg["kind"] == "causal_lm":
        x = rng.integers(0, cfg["vocab_size"], size=(B, T + 1))
        return np.ascontiguousarray(x[:, :-1]), np.ascontiguousarray(x[:, 1:])
    S = cfg["src_len"]
    src_lens = rng.integers(max(1, S // 2), S + 1, size=B).astype(np.int64)
    tgt_lens = rng.integers(max(1, T // 2), T + 1, size=B).astype(np.int64)  # incl. <eos>
    src = padded(src_lens, S, cfg["src_vocab_size"], 4)
    body = padded(tgt_lens - 1, T, cfg["tgt_vocab_size"], 4)
    tgt_in = np.full((B, T), PAD, dtype=np.int64)
    tgt_out = np.full((B, T), PAD, dtype=np.int64)
    for b, n in enumerate(tgt_lens):
        tgt_in[b, :n] = [BOS, *body[b, :n - 1]]
        tgt_out[b, :n] = [*body[b, :n - 1], EOS]
    return src, src_lens, tgt_in, tgt_out, tgt_lens



@dataclass(frozen=True)
class StandInVocab:
    """What a demo's model_config reads of a vocabulary: its size and special ids."""

    size: int
    pad_id: int = PAD
    bos_id: int = BOS
    eos_id: int = EOS

    def __len__(self) -> int:
        return self.size


def npformer_config(cfg: dict):
    """The demo's own model configuration (its model_config) of a benchmark configuration."""
    demo, preset = demo_module(cfg["demo"]), demo_preset(cfg)
    if cfg["kind"] == "classifier":
        return demo.model_config(preset, cfg["vocab_size"], PAD)
    if cfg["kind"] == "causal_lm":
        return demo.model_config(preset, cfg["vocab_size"])
    return demo.model_config(preset, StandInVocab(cfg["src_vocab_size"]),
                             StandInVocab(cfg["tgt_vocab_size"]))


def checked_tier(tier: str) -> str:
    """``tier`` if it is one of npformer's tiers ("fast", "textbook"), else a ValueError
    (a demo's ``implementations`` reads anything but "fast" as the textbook)."""
    from npformer.checkpoint import TIERS

    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    return tier


def npformer_optimizer(cfg: dict, params, tier: str = "fast"):
    """The demo's own optimizer on ``tier`` (its make_optimizer: AdamW or Adam, the
    schedule) over ``params``."""
    demo, preset = demo_module(cfg["demo"]), demo_preset(cfg)
    if cfg["kind"] == "classifier":
        return demo.make_optimizer(params, preset, cfg["max_iters"], tier=checked_tier(tier))
    return demo.make_optimizer(params, preset, tier=checked_tier(tier))


def clip_norm(cfg: dict) -> float:
    return demo_module(cfg["demo"]).CLIP_NORM


def label_smoothing(cfg: dict) -> float:
    return getattr(demo_module(cfg["demo"]), "LABEL_SMOOTHING", 0.0)


def npformer_model(cfg: dict, weights: str | None = None, tier: str = "fast"):
    """(model, task) of ``cfg`` on the current backend, the demo's model class on ``tier``
    (its ``implementations(tier)``), with PyTorch's initial weights from ``weights`` (an
    .npz of a state dict) when given."""
    import numpy as np

    from npformer.interop.pytorch import load_torch_state_dict
    from npformer.train.tasks import Classification, LanguageModeling, Translation

    model_class, _ = demo_module(cfg["demo"]).implementations(checked_tier(tier))
    task = {
        "classifier": Classification,
        "causal_lm": LanguageModeling,
        "seq2seq": lambda: Translation(label_smoothing=label_smoothing(cfg), pad_id=PAD),
    }[cfg["kind"]]()
    model = model_class(npformer_config(cfg))
    if weights:
        with np.load(weights) as f:
            load_torch_state_dict(model, {k: f[k] for k in f.files})
    return model, task


def demo_initial_state(cfg: dict, seed: int) -> dict:
    """The demo's own initial weights of ``cfg`` as a PyTorch state dict of NumPy arrays:
    npformer's model as the demo builds it (on its default tier, fast; its init: e.g. the
    lm's tied embedding and learned positions N(0, 0.02^2), nanoGPT's rule, so its first
    loss is about ln V), float32, from ``seed`` on the NumPy backend (the backend and
    default float are restored after, the generator reseeded with ``seed``)."""
    from npformer import backend
    from npformer.interop.pytorch import to_torch_state_dict

    previous = backend.backend_name(), backend.default_float_name()
    backend.set_backend("numpy", seed=seed)
    backend.set_default_float("float32")
    try:
        model, _ = npformer_model(cfg)
        return to_torch_state_dict(model)
    finally:
        backend.set_backend(previous[0], seed=seed)
        backend.set_default_float(previous[1])
