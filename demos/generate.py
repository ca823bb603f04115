"""A character-level language model on tiny Shakespeare (nanoGPT's CPU "baby GPT").

    python demos/generate.py                  # the default run (its time: README.md)
    python demos/generate.py --preset nanogpt # nanoGPT's "baby GPT" settings, for comparison
    python demos/generate.py --preset llama   # the default run with Llama's blocks
    python demos/generate.py --sample-only --prompt "ROMEO:"
    python demos/generate.py --smoke          # seconds (CI)
    python demos/generate.py --resume         # continue an interrupted run exactly

The default run beats nanoGPT's CPU "baby GPT" (its README: block size 64, batch 12,
4 layers, 4 heads, d_model 128, dropout 0, learning rate 1e-3 with warmup and
cosine decay over 2,000 iterations; ``--preset nanogpt``) in loss and in time with
the same context and depth: a narrower model (d_model 96) that sees more text per
update (batch 16) at a higher learning rate (4e-3) for 1,800 updates.  For the same
compute a smaller model trained on more characters learns more (the compute-optimal
trade of "Training Compute-Optimal Large Language Models", Hoffmann et al. 2022).
Validation loss is estimated on 20 batches; the first 90% of the text trains, the
last 10% validates.  Writes model.npz, last.npz (the run, for
--resume), curves.png, sample.txt and metrics.json to --out.  Settings come from
a preset (--preset, --smoke); an option given overrides the preset's value.

``--arch llama`` (the ``llama`` preset: the default run with it) trains the same depth,
width and heads with the blocks of Llama and Qwen instead of GPT-2's: RMS norms, rotary
positions instead of a learned table, the gated SiLU feed-forward (its width 8/3 of
d_model, so that its three matrices hold what GELU's two of width 4 d_model hold), and
``--kv-heads`` key/value heads shared by groups of query heads.

Your own data: --data any UTF-8 text file (its characters are the vocabulary).
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
    check_divisible,
    demo_parser,
    extra_output,
    load_demo_model,
    nonnegative_int,
    option,
    plot_curves,
    positive_float,
    positive_int,
    probability,
    resume_run,
    run_demo,
    run_record,
    start_demo,
    write_metrics,
    write_text,
)
from npformer.cli.memory import check_training_fits
from npformer.data import CharVocab, lm_batch, load_shakespeare, read_text_file, split_90_10
from npformer.decoding import generate
from npformer.models import CausalLM, CausalLMConfig, LlamaCausalLM, LlamaConfig
from npformer.nn import evaluating
from npformer.nn.llama import check_kv_heads
from npformer.ops.contracts import check_rotary_width
from npformer.optim import AdamW, warmup_cosine
from npformer.train import TrainConfig, Trainer, progress
from npformer.train.tasks import LanguageModeling

DEMO = Demo(tag="shakespeare", title="Shakespeare", model_kind=("causal_lm", "llama"),
            script="demos/generate.py", out="runs/shakespeare")


ARCHS = ("gpt2", "llama")  # the blocks --arch chooses
DEFAULT_KV_HEADS = 2  # the llama blocks' key/value heads (a saved GPT-2 run holds it too)


@dataclass(frozen=True)
class Preset:
    max_iters: int = option(2000, "updates (nanoGPT's max_iters)")
    block_size: int = option(64, "context length in characters (nanoGPT's block_size)")
    batch_size: int = option(12, "windows per update")
    num_layers: int = option(4, "decoder layers")
    num_heads: int = option(4, "attention heads H (D must be a multiple)")
    d_model: int = option(128, "model width D (nanoGPT's n_embd); the feed-forward is 4 D")
    dropout: float = option(0.0, "dropout probability", probability)
    lr: float = option(1e-3, "peak learning rate (warmup, then cosine decay to a tenth)",
                       positive_float)
    eval_every: int = option(250, "estimate the losses every this many updates")
    eval_batches: int = option(20, "batches per loss estimate")
    length: int = option(500, "characters to sample", nonnegative_int)
    arch: str = option("gpt2", "the blocks: gpt2 (layer norm, GELU, learned positions) or "
                       "llama (RMS norm, gated SiLU, rotary positions, shared key/value heads)",
                       str, ARCHS)
    kv_heads: int = option(DEFAULT_KV_HEADS, "key/value heads of the llama blocks (dividing "
                           "--num-heads)", needs=(lambda preset: preset.arch == "llama",
                                                  "--arch llama"))

    # what --sample-only reads of these (the saved model has the rest): any other
    # setting given with it is refused (npformer.cli.options.refuse_unread_with_saved_model)
    read_with_saved_model = ("length",)

    def __post_init__(self):
        check_divisible(self, "d_model", "num_heads")
        if self.arch != "llama":
            if self.kv_heads != DEFAULT_KV_HEADS:  # a value GPT-2's blocks would not read
                raise ValueError(f"--kv-heads {self.kv_heads} is for --arch llama: GPT-2's "
                                 "blocks give every query head its own keys and values")
            return
        check_kv_heads(self.num_heads, self.kv_heads, "--num-heads", "--kv-heads")
        check_rotary_width(self.d_model // self.num_heads,
                           f"--arch llama's head width --d-model {self.d_model} / --num-heads "
                           f"{self.num_heads}")
        if self.dropout:
            raise DemoError(f"--arch llama has no dropout (Llama's blocks have none), "
                            f"got --dropout {self.dropout}")


PRESETS = {
    "default": Preset(max_iters=1800, batch_size=16, d_model=96, lr=4e-3),
    "nanogpt": Preset(),  # nanoGPT's README's CPU settings (what bench/ times)
    "llama": Preset(max_iters=1800, batch_size=16, d_model=96, lr=4e-3, arch="llama"),
    "smoke": Preset(max_iters=20, eval_every=10, eval_batches=2, length=50, num_layers=1,
                    d_model=32, num_heads=2, block_size=32),
}


def estimate_loss(model, data: np.ndarray, block_size: int, batch: int, batches: int,
                  seed: int, phase: str = "loss estimate") -> float:
    """Mean loss over ``batches`` random batches of ``batch`` windows (nanoGPT's
    estimate_loss); ``phase`` names the pass in the progress shown."""
    rng = np.random.default_rng(seed)
    losses = []
    with evaluating(model), progress.phase(phase, batches) as shown:
        for _ in range(batches):
            x, y = lm_batch(data, block_size, batch, rng)
            loss, _ = ops.cross_entropy_forward(model(backend.asarray(x)), backend.asarray(y))
            losses.append(backend.to_float(loss))
            shown.update(items=batch)
    return float(np.mean(losses))


def check_prompt(prompt: str, vocab: CharVocab) -> None:
    missing = sorted(set(prompt) - set(vocab.chars))
    if missing:
        raise DemoError(f"--prompt has characters the model never saw: {missing}")


def sample(model, vocab: CharVocab, prompt: str, length: int, temperature: float,
           top_k: int | None, seed: int) -> str:
    check_prompt(prompt, vocab)
    ids = generate(model, vocab.encode(prompt or "\n"), length, temperature=temperature,
                   top_k=top_k, rng=np.random.default_rng(seed))
    return vocab.decode(ids)


def split_text(text: str, vocab: CharVocab, block_size: int):
    """-> train and validation ids (the first 90% and the last 10% of the text)."""
    train_ids, val_ids = split_90_10(np.array(vocab.encode(text), dtype=np.int64))
    if len(val_ids) <= block_size:
        raise DemoError(f"the corpus is too short for --block-size {block_size}: its validation "
                        f"tenth holds {len(val_ids)} characters, and a window needs "
                        f"{block_size + 1}")
    return train_ids, val_ids


def load_text(data) -> str:
    """--data: any text file (tiny Shakespeare's input.txt, or the user's own), else the
    tiny Shakespeare download (a folder holding it, $NPFORMER_DATA, the user cache)."""
    if data is not None and Path(data).is_file():
        return read_text_file(data)
    return load_shakespeare(data)


# The model and its update (bench/ times these too: bench/configs.py imports them).
CLIP_NORM = 1.0  # the gradients' global norm is clipped to this


def model_config(preset: Preset, vocab_size: int) -> CausalLMConfig | LlamaConfig:
    """GPT-2's blocks (feed-forward 4 d_model wide), or with ``arch="llama"`` Llama's (the
    gated feed-forward 8/3 d_model wide, rounded to a multiple of 8: as many weights)."""
    if preset.arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, d_model=preset.d_model,
                           d_ff=8 * round(preset.d_model / 3),
                           num_layers=preset.num_layers,
                           num_heads=preset.num_heads,
                           num_kv_heads=preset.kv_heads,
                           block_size=preset.block_size)
    return CausalLMConfig(vocab_size=vocab_size, block_size=preset.block_size,
                          d_model=preset.d_model, num_heads=preset.num_heads,
                          num_layers=preset.num_layers, d_ff=4 * preset.d_model,
                          dropout=preset.dropout)


def implementations(tier: str = "fast", arch: str = "gpt2") -> tuple[type, type]:
    """(model class, optimizer class) that train on ``tier``: npformer.fast's, or the
    textbook's (``--tier textbook``, whose run never imports npformer.fast); both compute
    the same numbers up to rounding."""
    if tier != "fast":
        return (LlamaCausalLM, AdamW) if arch == "llama" else (CausalLM, AdamW)
    from npformer import fast  # the fast tier, imported only where it trains

    return (fast.LlamaCausalLM, fast.AdamW) if arch == "llama" else (fast.CausalLM, fast.AdamW)


def make_optimizer(params, preset: Preset, tier: str = "fast") -> AdamW:
    """nanoGPT's: AdamW, warmup over a twentieth of the run, cosine decay to a tenth."""
    warmup = max(1, preset.max_iters // 20)
    schedule = warmup_cosine(preset.lr, warmup, preset.max_iters, min_lr=preset.lr / 10)
    return implementations(tier, preset.arch)[1](params, lr=schedule, betas=(0.9, 0.99),
                                                 weight_decay=0.1)


def build_parser():
    parser = demo_parser(DEMO, __doc__, PRESETS)
    parser.add_argument("--prompt", default="\n",
                        help="text the sample continues (default: a newline)")
    parser.add_argument("--temperature", type=positive_float, default=0.8,
                        help="sampling temperature (default: %(default)s)")
    parser.add_argument("--top-k", type=positive_int, default=None,
                        help="sample among the k likeliest characters only (default: all)")
    parser.add_argument("--sample-only", action="store_true",
                        help=f"sample from OUT/{MODEL_FILE} without training")
    return parser


def main(argv=None) -> int:
    args, preset, out = start_demo(DEMO, build_parser(), PRESETS, argv, use_saved="sample_only")
    if args.sample_only:
        return sample_only(args, preset, out)

    text = load_text(args.data)
    vocab = CharVocab.from_text(text)
    check_prompt(args.prompt, vocab)  # before training, not after
    train_ids, val_ids = split_text(text, vocab, preset.block_size)
    config = model_config(preset, len(vocab))
    check_training_fits(config, preset.batch_size, preset.block_size, preset,
                        PRESETS["default"], args.dtype)  # before a weight is made
    model = implementations(args.tier, preset.arch)[0](config)
    optimizer = make_optimizer(model.parameters(), preset, args.tier)
    print(f"{len(train_ids):,} train / {len(val_ids):,} validation characters, vocabulary "
          f"{len(vocab)}; model {model.num_parameters():,} parameters")

    def eval_fn(m):
        return {"train_loss": estimate_loss(m, train_ids, preset.block_size, preset.batch_size,
                                            preset.eval_batches, seed=1, phase="training loss"),
                "val_loss": estimate_loss(m, val_ids, preset.block_size, preset.batch_size,
                                          preset.eval_batches, seed=2, phase="validation")}

    trainer = Trainer(model, optimizer, LanguageModeling(),
                      lambda rng: lm_batch(train_ids, preset.block_size, preset.batch_size, rng),
                      TrainConfig(max_iters=preset.max_iters, clip_norm=CLIP_NORM,
                                  replicas=args.replicas, eval_every=preset.eval_every,
                                  checkpoint_path=out / MODEL_FILE, last_path=out / LAST_FILE,
                                  stop_after=args.stop_after, progress=not args.no_progress,
                                  desc="shakespeare"),
                      eval_fn=eval_fn,
                      checkpoint_extra={"demo": DEMO.tag, "vocab": vocab.to_json(),
                                        "run": run_record(args, preset)},
                      seed=args.seed)
    if args.resume:
        resume_run(trainer, out / LAST_FILE)
    history = trainer.fit()
    train_seconds = trainer.train_seconds
    final = history.evals[-1]
    print(f"update {trainer.updates}: train loss {final['train_loss']:.4f}, validation loss "
          f"{final['val_loss']:.4f} ({train_seconds:.0f} s, "
          f"{1000 * train_seconds / trainer.updates:.0f} ms/update)")
    text_out = sample(model, vocab, args.prompt, preset.length, args.temperature, args.top_k,
                      args.seed)
    print("-" * 60 + "\n" + text_out + "\n" + "-" * 60)
    write_text(out / "sample.txt", text_out)
    write_metrics(out, args, model.num_parameters(), {
        "val_loss": final["val_loss"], "train_loss": final["train_loss"],
        "updates": trainer.updates, "train_seconds": train_seconds,
        "ms_per_update": 1000 * train_seconds / trainer.updates})
    extra_output("curves.png", plot_curves, out / "curves.png", history,
                 ["train_loss", "val_loss"], "tiny Shakespeare character LM")
    return 0


def sample_only(args, preset: Preset, out: Path) -> int:
    model, checkpoint = load_demo_model(out / MODEL_FILE, DEMO, args.tier)
    vocab = CharVocab.from_json(checkpoint.extra["vocab"])
    print(sample(model, vocab, args.prompt, preset.length, args.temperature, args.top_k,
                 args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(run_demo(main))
