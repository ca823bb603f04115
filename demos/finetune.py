"""Fine-tune a GPT-2, Llama, Qwen2 or Qwen3 checkpoint on a text file, with npformer's
hand-written backward.

    python demos/finetune.py                        # GPT-2 small ("gpt2") on tiny Shakespeare
    python demos/finetune.py --model path/to/gpt2-folder --data notes.txt
    python demos/finetune.py --model HuggingFaceTB/SmolLM2-135M --lora 8   # a Llama
    python demos/finetune.py --sample-only --prompt "ROMEO:"  # the model fine-tuned in --out
    python demos/finetune.py --smoke --model FOLDER # seconds (CI, on a small folder)
    python demos/finetune.py --resume               # continue an interrupted run exactly
    python demos/finetune.py --lora 8               # LoRA adapters of rank 8, the rest frozen

--model is a Hugging Face folder (config.json, model.safetensors, tokenizer.json: what
save_pretrained writes) of GPT2LMHeadModel, LlamaForCausalLM (Llama 3.x, SmolLM2,
TinyLlama), Qwen2ForCausalLM or Qwen3ForCausalLM, or a name on the Hugging Face Hub
("gpt2", "HuggingFaceTB/SmolLM2-135M"), downloaded once into the user's cache (pip
install "npformer[hf]").  The family is config.json's model_type (else its
architectures): GPT-2 loads as CausalLM, the others as LlamaCausalLM (no dropout), each
of --tier (npformer.fast's, or npformer.models' with --tier textbook).
The text (--data: any UTF-8 file; default tiny Shakespeare) is tokenized with the
checkpoint's tokenizer; the first 90% trains, the last 10% validates.  Settings follow
nanoGPT's finetune_shakespeare.py for a CPU: AdamW at a constant learning rate of 3e-5,
weight decay 0.1, betas (0.9, 0.95), gradients clipped to norm 1, no dropout, random
windows of --block-size tokens.
Prints the validation loss before and after, and a sample; writes the fine-tuned
model as a folder of its family (OUT/gpt2 or OUT/llama, which transformers loads too;
--sample-only without --model samples the newer), model.npz and last.npz (the run, for
--resume), sample.txt and metrics.json to --out.  The run records what it started from
(the data, and each file of a --model folder, by content): --resume refuses a changed one,
naming the file.

--lora R fine-tunes low-rank adapters instead of every weight (npformer.nn.lora): the
model is frozen (no gradients, no optimizer state for it) and each projection that
--lora-targets names gets W + (alpha / R) B A, alpha --lora-alpha, dropout --lora-dropout
on the adapter's input.  --lora-targets is PEFT's target_modules in the torch model's
names: GPT-2's c_attn, c_proj, c_fc (default c_attn,c_proj); Llama's and Qwen's q_proj,
k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (default q_proj,v_proj).  The three
options are refused without --lora R (nothing would read them).  The run also writes
OUT/adapter (adapter_model.safetensors and adapter_config.json:
peft.PeftModel.from_pretrained(the base torch model, OUT/adapter) loads it), and
OUT/gpt2 or OUT/llama holds the adapters merged into the weights.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
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
    demo_parser,
    nonnegative_float,
    nonnegative_int,
    nucleus,
    option,
    positive_float,
    positive_int,
    probability,
    read_demo_checkpoint,
    resume_run,
    run_demo,
    run_record,
    start_demo,
    write_folder,
    write_metrics,
    write_text,
)
from npformer.cli.memory import check_training_fits
from npformer.cli.options import flag
from npformer.cli.ranks import is_main
from npformer.data import lm_batch, load_shakespeare, read_text_file, split_90_10
from npformer.decoding import generate
from npformer.hf import gpt2
from npformer.hf import llama as hf_llama
from npformer.hf.gpt2 import Tokenizer, check_tokenizer
from npformer.interop import peft as adapters
from npformer.models import CausalLM, LlamaCausalLM
from npformer.nn import evaluating
from npformer.nn.lora import merge_lora, unmerge_lora
from npformer.optim import AdamW
from npformer.train import TrainConfig, Trainer
from npformer.train.tasks import LanguageModeling

DEMO = Demo(tag="finetune", title="fine-tuning", model_kind="causal_lm",
            script="demos/finetune.py", out="runs/finetune")
DEFAULT_MODEL = "gpt2"  # GPT-2 small on the Hugging Face Hub (124M parameters)
ADAPTER_FOLDER = "adapter"  # OUT/adapter: the LoRA adapters, as PEFT writes them
LORA_OPTIONS = ("lora_alpha", "lora_dropout", "lora_targets")  # read with --lora R only
# typed on the command line without --lora R, they are refused whatever their value
WITH_LORA = (lambda preset: bool(preset.lora), "--lora R (the rank)")


@dataclass(frozen=True)
class Preset:
    max_iters: int = option(50, "updates")
    block_size: int = option(256, "tokens per training window (at most the model's context)")
    batch_size: int = option(4, "windows per update")
    lr: float = option(3e-5, "learning rate (constant, nanoGPT's fine-tuning rate)",
                       positive_float)
    weight_decay: float = option(0.1, "AdamW's decoupled weight decay", nonnegative_float)
    dropout: float = option(0.0, "dropout probability", probability)
    eval_every: int = option(25, "estimate the validation loss every this many updates")
    eval_batches: int = option(8, "batches per loss estimate")
    length: int = option(100, "tokens to sample", nonnegative_int)
    lora: int = option(0, "LoRA rank (0: fine-tune every weight)", nonnegative_int)
    lora_alpha: float = option(16.0, "LoRA's alpha: the update is scaled by alpha / rank",
                               positive_float, needs=WITH_LORA)
    lora_dropout: float = option(0.0, "dropout on the LoRA adapters' input", probability,
                                 needs=WITH_LORA)
    lora_targets: str = option("", "the projections LoRA adapts, comma-separated (PEFT's "
                               "target_modules in the model's names; empty: the family's "
                               "default, GPT-2's c_attn,c_proj, Llama's and Qwen's "
                               "q_proj,v_proj)", str, needs=WITH_LORA)

    # what --sample-only reads of these (the saved model has the rest): any other
    # setting given with it is refused (npformer.cli.options.refuse_unread_with_saved_model)
    read_with_saved_model = ("length",)

    def __post_init__(self):
        if not self.lora:  # the adapters' options, which a run without adapters would not read
            given = [flag(f.name) for f in fields(self)
                     if f.name in LORA_OPTIONS and getattr(self, f.name) != f.default]
            if given:
                raise ValueError(f"{', '.join(given)} set the LoRA adapters, but --lora is 0 "
                                 "(every weight fine-tuned): add --lora R (the rank)")


PRESETS = {
    "default": Preset(),
    "smoke": Preset(max_iters=4, block_size=16, batch_size=2, eval_every=2, eval_batches=2,
                    length=12),
}
CLIP_NORM = 1.0  # the gradients' global norm is clipped to this


def build_parser():
    parser = demo_parser(DEMO, __doc__, PRESETS)
    parser.add_argument("--model", default=None,
                        help=f"a GPT-2, Llama, Qwen2 or Qwen3 folder or Hugging Face Hub "
                             f"name (default: "
                             f"{DEFAULT_MODEL}; --resume: the run's)")
    parser.add_argument("--prompt", default="\n",
                        help="text the sample continues (default: a newline)")
    parser.add_argument("--temperature", type=positive_float, default=0.8,
                        help="sampling temperature (default: %(default)s)")
    parser.add_argument("--top-k", type=positive_int, default=200,
                        help="sample among the k likeliest tokens (default: %(default)s)")
    parser.add_argument("--top-p", type=nucleus, default=None,
                        help="sample from the nucleus of this probability, in (0, 1] "
                             "(default: off)")
    parser.add_argument("--sample-only", action="store_true",
                        help="sample without training, from --model (default: the model "
                             "fine-tuned in --out, OUT/gpt2 or OUT/llama)")
    return parser


def implementations(tier: str = "fast", family: str = "GPT-2") -> tuple[type, type]:
    """(model class, optimizer class) that train on ``tier``: npformer.fast's, or the
    textbook's (``--tier textbook``, whose run never imports npformer.fast); both compute
    the same numbers up to rounding."""
    if tier != "fast":
        return (LlamaCausalLM, AdamW) if family != "GPT-2" else (CausalLM, AdamW)
    from npformer import fast  # the fast tier, imported only where it trains

    return (fast.LlamaCausalLM, fast.AdamW) if family != "GPT-2" else (fast.CausalLM,
                                                                        fast.AdamW)


# --------------------------------------------------------------------------- the families
@dataclass(frozen=True)
class Family:
    """An architecture the demo fine-tunes: how its Hugging Face folder loads and is
    written, and the torch names of its projections (--lora-targets, PEFT's files)."""

    name: str
    model_types: tuple[str, ...]  # config.json's model_type
    architectures: tuple[str, ...]  # config.json's architectures (where model_type is absent)
    folder: str  # OUT/<folder>: the fine-tuned model, as a Hugging Face folder
    loaders: str  # what loads that folder (printed)
    lora_targets: str  # --lora-targets' default (PEFT users' usual choice)
    load: Callable  # (source, dtype, dropout, tier) -> (model, tokenizer)
    naming: Callable  # model -> adapters.Naming (the torch module names of its Linears)
    save: Callable  # (model, tokenizer, folder) -> None
    check_fits: Callable  # (model, preset, dtype) -> None; refuses what cannot fit


def with_tokenizer(model, folder: Path):
    """(model, the folder's tokenizer), the tokenizer checked against the model."""
    tokenizer = Tokenizer.from_pretrained(folder)
    check_tokenizer(tokenizer, model)
    return model, tokenizer


def load_gpt2(source: str, dtype: str, dropout: float, tier: str):
    folder = gpt2.resolve(source)
    return with_tokenizer(implementations(tier)[0].from_pretrained(
        folder, dtype=dtype, dropout=dropout), folder)


def training_fits(model, preset: Preset, dtype: str) -> None:
    """Refuse a run whose training cannot fit in memory (either family's config)."""
    check_training_fits(model.config, preset.batch_size, preset.block_size, preset,
                        PRESETS["default"], dtype)


def load_llama(source: str, dtype: str, dropout: float, tier: str):
    """A Llama, Qwen2 or Qwen3 folder: a LlamaCausalLM of ``tier``; it has no dropout."""
    if dropout:
        raise DemoError(f"--dropout {dropout}: Llama and Qwen models have no dropout in "
                        "npformer (leave --dropout at 0)")
    folder = gpt2.resolve(source, "Llama or Qwen")
    return with_tokenizer(implementations(tier, "Llama/Qwen")[0].from_pretrained(
        folder, dtype=dtype), folder)


def save_llama(model, tokenizer, folder: Path) -> None:
    """The model's folder (save_pretrained), its tokenizer.json, and in config.json the
    tokenizer's end of text (eos_token_id, which Tokenizer.from_pretrained reads)."""
    model.save_pretrained(folder)
    tokenizer.save(folder / "tokenizer.json")
    if tokenizer.eos_id is not None:
        config = folder / "config.json"
        values = json.loads(config.read_text(encoding="utf-8"))
        config.write_text(json.dumps({**values, "eos_token_id": tokenizer.eos_id}, indent=2)
                          + "\n", encoding="utf-8")


GPT2 = Family(name="GPT-2", model_types=("gpt2",), architectures=("GPT2LMHeadModel",),
              folder="gpt2", loaders="CausalLM.from_pretrained, or transformers' "
              "GPT2LMHeadModel.from_pretrained", lora_targets="c_attn,c_proj",
              load=load_gpt2, naming=lambda model: adapters.gpt2_names(model.config),
              save=lambda model, tokenizer, folder: model.save_pretrained(
                  folder, tokenizer=tokenizer),
              check_fits=training_fits)
LLAMA = Family(name="Llama/Qwen", model_types=tuple(hf_llama.FAMILIES),
               architectures=tuple(sorted(hf_llama.ARCHITECTURES)), folder="llama",
               loaders="LlamaCausalLM.from_pretrained, or transformers' "
               "AutoModelForCausalLM.from_pretrained", lora_targets="q_proj,v_proj",
               load=load_llama, naming=lambda model: adapters.llama_names(model.config),
               save=save_llama, check_fits=training_fits)
FAMILIES = (GPT2, LLAMA)


def family_of(source: str) -> Family:
    """The family of the folder (or Hub name) ``source``: config.json's model_type, else
    its architectures; another one is one error line naming it."""
    try:
        folder = gpt2.resolve(source)
        if not (folder / gpt2.CONFIG_FILE).is_file():
            raise DemoError(f"--model {source}: {folder} has no {gpt2.CONFIG_FILE}: a model "
                            f"folder holds {gpt2.CONFIG_FILE}, {gpt2.WEIGHTS_FILE} and "
                            "tokenizer.json, as save_pretrained writes them")
        values = gpt2.read_config(folder)
    except (OSError, ValueError) as exc:  # PretrainedError, FileNotFoundError
        raise DemoError(f"--model {source}: {exc}") from None
    model_type = values.get("model_type")
    architectures = values.get("architectures")
    named = set(architectures) if isinstance(architectures, list) else set()
    for family in FAMILIES:
        if model_type in family.model_types or (model_type is None
                                                 and named & set(family.architectures)):
            return family
    known = ", ".join(t for family in FAMILIES for t in family.model_types)
    raise DemoError(f"--model {source}: {folder / gpt2.CONFIG_FILE} describes a "
                    f"{model_type!r} model (model_type): the demo fine-tunes {known} models")


def load_model(source: str, dtype: str, dropout: float, tier: str = "fast"):
    """(the family, the checkpoint's model (of ``tier``), its tokenizer); a problem with
    them is one error line."""
    family = family_of(source)
    try:
        return (family, *family.load(source, dtype, dropout, tier))
    except (OSError, ValueError) as exc:  # PretrainedError, FileNotFoundError
        raise DemoError(f"--model {source}: {exc}") from None


def encode_text(data, tokenizer) -> np.ndarray:
    """--data (any text file, else tiny Shakespeare) as the tokenizer's ids."""
    text = read_text_file(data) if data is not None and Path(data).is_file() \
        else load_shakespeare(data)
    return np.array(tokenizer.encode(text), dtype=np.int64)


def estimate_loss(model, ids: np.ndarray, preset: Preset, seed: int) -> float:
    """Mean next-token loss over ``eval_batches`` random windows (nanoGPT's estimate_loss)."""
    rng = np.random.default_rng(seed)
    losses = []
    with evaluating(model):
        for _ in range(preset.eval_batches):
            x, y = lm_batch(ids, preset.block_size, preset.batch_size, rng)
            loss, _ = ops.cross_entropy_forward(model(backend.asarray(x)), backend.asarray(y))
            losses.append(backend.to_float(loss))
    return float(np.mean(losses))


def prompt_ids(prompt: str, tokenizer, context: int) -> list[int]:
    """--prompt's tokens (the end-of-text token for an empty prompt), refused when longer
    than the model's context."""
    start = tokenizer.eos_ids[0] if tokenizer.eos_ids else 0  # the first end of text
    ids = tokenizer.encode(prompt) if prompt else [start]
    if len(ids) > context:
        raise DemoError(f"--prompt holds {len(ids)} tokens, more than the model's context of "
                        f"{context}: shorten it")
    return ids


def sample(model, tokenizer, prompt: list[int], args, length: int) -> str:
    ids = generate(model, prompt, length, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, eos_id=tokenizer.eos_id,
                   rng=np.random.default_rng(args.seed))
    return tokenizer.decode(ids)


def lora_targets(preset: Preset, family: Family) -> list[str]:
    """--lora-targets as PEFT's target_modules list (empty: the family's default)."""
    given = preset.lora_targets.strip() or family.lora_targets
    return [t.strip() for t in given.split(",") if t.strip()]


def add_adapters(model, preset: Preset, family: Family) -> list[str]:
    """--lora R: the model frozen, adapters on the --lora-targets projections; returns
    their names (none without --lora)."""
    if not preset.lora:
        return []
    targets = lora_targets(preset, family)
    try:
        return adapters.apply_adapters(model, family.naming(model), targets, preset.lora,
                                       preset.lora_alpha, preset.lora_dropout)
    except (ValueError, TypeError) as exc:
        raise DemoError(f"--lora-targets {','.join(targets)}: {exc}") from None


def save_model(model, tokenizer, source: str, out: Path, family: Family, lora: bool) -> None:
    """OUT/<the family's folder> (the adapters merged into it, then taken out again) and,
    with --lora, OUT/adapter."""
    if lora:
        write_folder(out / ADAPTER_FOLDER, lambda folder: adapters.save_adapter(
            model, folder, family.naming(model), base_model=source, task_type="CAUSAL_LM"))
        print(f"the adapters: {out / ADAPTER_FOLDER} (peft.PeftModel.from_pretrained)")
        merge_lora(model)
    try:
        write_folder(out / family.folder,
                     lambda folder: family.save(model, tokenizer, Path(folder)))
    finally:
        if lora:
            unmerge_lora(model)
    print(f"the fine-tuned model: {out / family.folder} ({family.loaders})")


def fine_tuned_folder(out: Path) -> Path:
    """The model fine-tuned in ``out`` (the newest of the families' folders there)."""
    folders = [out / family.folder for family in FAMILIES
               if (out / family.folder / "config.json").is_file()]
    if not folders:
        names = " or ".join(str(out / family.folder) for family in FAMILIES)
        raise DemoError(f"--sample-only samples the model fine-tuned in --out, but {names} "
                        f"holds none: fine-tune one first (`python {DEMO.script} --out "
                        f"{out}`), or give --model")
    return max(folders, key=lambda folder: (folder / "config.json").stat().st_mtime)


def base_model(args, out: Path) -> str:
    """The model to load: --model; for --sample-only without it, the model fine-tuned in
    --out; with --resume the run's (settled by start_demo: the same folder, unchanged)."""
    if args.sample_only and args.model is None:
        return str(fine_tuned_folder(out))
    extra = read_demo_checkpoint(out / LAST_FILE, DEMO).extra if args.resume else {}
    if args.resume and "model" not in extra["run"]["settings"]:  # saved before runs kept it
        saved = extra["base_model"]
        if args.model is not None and args.model != saved:
            raise DemoError(f"--resume continues the saved run, which fine-tunes --model "
                            f"{saved}, not {args.model} (leave --model out)")
        return saved
    return args.model or DEFAULT_MODEL


def main(argv=None) -> int:
    args, preset, out = start_demo(DEMO, build_parser(), PRESETS, argv, use_saved="sample_only")
    source = base_model(args, out)
    family, model, tokenizer = load_model(source, args.dtype, preset.dropout, args.tier)
    context = model.config.block_size
    prompt = prompt_ids(args.prompt, tokenizer, context)
    if args.sample_only:
        print(sample(model, tokenizer, prompt, args, preset.length))
        return 0
    if preset.block_size > context:
        raise DemoError(f"--block-size {preset.block_size} is longer than the model's context "
                        f"of {context} tokens: lower --block-size")
    train_ids, val_ids = split_90_10(encode_text(args.data, tokenizer))
    if len(val_ids) <= preset.block_size:
        raise DemoError(f"the text is too short for --block-size {preset.block_size}: its "
                        f"validation tenth holds {len(val_ids)} tokens, and a window needs "
                        f"{preset.block_size + 1}")
    family.check_fits(model, preset, args.dtype)
    adapted = add_adapters(model, preset, family)
    optimizer = implementations(args.tier)[1](model.parameters(), lr=preset.lr,
                                              betas=(0.9, 0.95),
                                              weight_decay=preset.weight_decay)
    trained = sum(p.data.size for p in optimizer.params)
    print(f"{source} ({family.name}): {model.num_parameters():,} parameters, {trained:,} trained"
          f"{f' (LoRA rank {preset.lora} on {len(adapted)} projections)' if adapted else ''}"
          f"; {len(train_ids):,} train / {len(val_ids):,} validation tokens")
    before = (read_demo_checkpoint(out / LAST_FILE, DEMO).extra["val_loss_before"]
              if args.resume else estimate_loss(model, val_ids, preset, seed=2))
    print(f"validation loss before fine-tuning: {before:.4f}")

    def eval_fn(m):
        return {"val_loss": estimate_loss(m, val_ids, preset, seed=2)}

    trainer = Trainer(model, optimizer, LanguageModeling(),
                      lambda rng: lm_batch(train_ids, preset.block_size, preset.batch_size, rng),
                      TrainConfig(max_iters=preset.max_iters, clip_norm=CLIP_NORM,
                                  replicas=args.replicas, eval_every=preset.eval_every,
                                  checkpoint_path=out / MODEL_FILE, last_path=out / LAST_FILE,
                                  stop_after=args.stop_after, progress=not args.no_progress,
                                  desc="finetune"),
                      eval_fn=eval_fn,
                      checkpoint_extra={"demo": DEMO.tag, "base_model": source,
                                        "val_loss_before": before,
                                        "run": run_record(args, preset)},
                      seed=args.seed)
    if args.resume:
        resume_run(trainer, out / LAST_FILE)
    history = trainer.fit()
    after = history.evals[-1]["val_loss"]
    seconds = trainer.train_seconds
    print(f"validation loss after {trainer.updates} updates: {after:.4f} (before {before:.4f}; "
          f"{seconds:.0f} s, {seconds / trainer.updates:.1f} s/update)")
    text = sample(model, tokenizer, prompt, args, preset.length)
    print("-" * 60 + "\n" + text + "\n" + "-" * 60)
    if is_main():
        save_model(model, tokenizer, source, out, family, bool(adapted))
    write_text(out / "sample.txt", text)
    write_metrics(out, args, model.num_parameters(), {
        "val_loss_before": before, "val_loss": after, "updates": trainer.updates,
        "train_seconds": seconds, "seconds_per_update": seconds / trainer.updates,
        "trained_parameters": trained})
    return 0


if __name__ == "__main__":
    sys.exit(run_demo(main))
