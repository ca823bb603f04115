#!/usr/bin/env python
"""SmolLM2-135M's shape against Hugging Face's PyTorch Llama on the CPU (issue 49).

    python bench/llama.py                  # 135M parameters, random weights; 5 rounds
    python bench/llama.py --rounds 9       # more rounds (the figures are each side's minimum)
    python bench/llama.py --smoke          # a tiny Llama, one round: a CI check that it runs

One Llama folder with random weights (``transformers.LlamaForCausalLM`` of SmolLM2-135M's
config: width 576, 30 layers, 9 query heads sharing 3 key/value heads, feed-forward 1536,
vocabulary 49,152, tied embeddings; float32, written by ``save_pretrained``) is loaded by
both sides, each in a fresh process: npformer (``fast.LlamaCausalLM.from_pretrained``, the
NumPy backend; it never imports torch) and
transformers' ``LlamaForCausalLM`` (its default attention).  After one untimed warm-up of
each, a side times:

* ``forward``: the logits of a (4, 256) batch without gradients;
* ``train step``: forward, next-token cross-entropy, backward, global-norm clipping to 1
  and an AdamW update (lr 3e-4, weight decay 0.1) on the same batch;
* ``LoRA step``: the same step on a second copy of the model with rank-8 adapters on
  q_proj and v_proj (alpha 16, no dropout), the rest frozen (npformer's ``apply_lora``;
  PEFT's ``get_peft_model`` with the same ``LoraConfig``);
* ``generate 64``: 64 new tokens, greedy, with the KV cache, after a 16-token prompt.

The sides take turns, run by run, as in ``bench/gpt2.py`` (whose runner this uses), and
must agree on the first training step's loss to 1e-4.  Prints a table of each side's
minimum and their ratio, with the CPU model.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:  # `python bench/llama.py`: the bench package, not this file
    sys.path.insert(0, str(ROOT))

from bench.gpt2 import (  # noqa: E402
    CLIP,
    LR,
    WEIGHT_DECAY,
    Side,
    agreement_lines,
    batch_of,
    blas_threads,
    check_losses_agree,
    serve,
    take_turns,
)

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
               rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
SMOKE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
BATCH, LENGTH, PROMPT, NEW = (4, 256), 256, 16, 64
SMOKE_SIZES = (2, 16), 16, 4, 8
LORA = dict(r=8, alpha=16, targets=["q_proj", "v_proj"])
MEASUREMENTS = ("forward", "generate", "lora_step", "train_step")  # training last


def write_folder(folder: Path, sizes: dict) -> Path:
    """A Llama folder of random weights (seed 0, float32)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**sizes, bos_token_id=0, eos_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------- the sides
def npformer_side(folder: Path, sizes: tuple) -> tuple[dict, dict]:
    """{measurement: a function running it once} for npformer, and what the checks read."""
    from npformer import backend, fast, no_grad
    from npformer.decoding import generate
    from npformer.nn.lora import apply_lora

    shape, length, prompt_len, new = sizes
    model = fast.LlamaCausalLM.from_pretrained(folder)
    adapted = fast.LlamaCausalLM.from_pretrained(folder)
    apply_lora(adapted, LORA["targets"], LORA["r"], LORA["alpha"])
    x, y, prompt = batch_of(model.config.vocab_size, shape, length, prompt_len)
    optimizers = {id(m): fast.AdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
                  for m in (model, adapted)}
    loss_with_gradient = type(model).cross_entropy_with_gradient  # the fast tier's loss
    seen = {"side": f"npformer, fast tier, numpy backend, {blas_threads()} BLAS threads"}

    def forward():
        model.eval()
        with no_grad():
            model(backend.asarray(x))
        model.train()

    def step(m, key):
        optimizer = optimizers[id(m)]
        optimizer.zero_grad()
        loss, dlogits = loss_with_gradient(m(backend.asarray(x)), backend.asarray(y))
        m.backward(dlogits)
        optimizer.clip_grad_norm(m.named_parameters(), CLIP)
        optimizer.step()
        seen.setdefault(key, backend.to_float(loss))

    def decode():
        seen["tokens"] = generate(model, prompt.tolist(), new, greedy=True)[prompt_len:]

    return {"forward": forward, "generate": decode,
            "train_step": lambda: step(model, "first_loss"),
            "lora_step": lambda: step(adapted, "first_lora_loss")}, seen


def torch_side(folder: Path, sizes: tuple) -> tuple[dict, dict]:
    import peft
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    shape, length, prompt_len, new = sizes
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    base = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapted = peft.get_peft_model(base, peft.LoraConfig(
        r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
        target_modules=LORA["targets"]))
    x, y, prompt = (torch.tensor(a) for a in batch_of(model.config.vocab_size, shape,
                                                      length, prompt_len))
    optimizers = {id(m): torch.optim.AdamW([p for p in m.parameters() if p.requires_grad],
                                           lr=LR, weight_decay=WEIGHT_DECAY)
                  for m in (model, adapted)}
    seen = {"side": f"transformers {transformers.__version__} "
                    f"({model.config._attn_implementation} attention), peft "
                    f"{peft.__version__}, torch {torch.__version__}, "
                    f"{torch.get_num_threads()} threads"}

    def forward():
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()

    def step(m, key):
        optimizer = optimizers[id(m)]
        optimizer.zero_grad()
        logits = m(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], CLIP)
        optimizer.step()
        seen.setdefault(key, loss.item())

    def decode():
        model.eval()
        with torch.no_grad():
            out = model.generate(prompt[None], max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones(1, prompt_len, dtype=torch.long))
        model.train()
        seen["tokens"] = out[0, prompt_len:].tolist()

    return {"forward": forward, "generate": decode,
            "train_step": lambda: step(model, "first_loss"),
            "lora_step": lambda: step(adapted, "first_lora_loss")}, seen


def worker(side: str, folder: Path, sizes: tuple) -> None:
    """Load the side and serve the runner (bench/gpt2.py's :func:`serve`)."""
    serve(*(npformer_side if side == "npformer" else torch_side)(folder, sizes))


# --------------------------------------------------------------------------- the runner
def report(times: dict, seen: dict, args) -> str:
    shape = SMOKE_SIZES[0] if args.smoke else BATCH
    names = {"forward": f"forward {shape}",
             "train_step": "train step (forward, backward, clip, AdamW)",
             "lora_step": f"LoRA step (r {LORA['r']} on q_proj, v_proj; the rest frozen)",
             "generate": f"generate {SMOKE_SIZES[3] if args.smoke else NEW} tokens "
                         "(greedy, KV cache)"}
    lines = ["| measurement | npformer s | PyTorch (HF) s | ratio |", "|---|---:|---:|---:|"]
    for key, name in names.items():
        ours, theirs = min(times["npformer"][key]), min(times["torch"][key])
        lines.append(f"| {name} | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f}x |")
    ours, theirs = seen["npformer"], seen["torch"]
    lines += agreement_lines(seen, args.rounds, f"first-step loss: npformer "
                             f"{ours['first_loss']:.6f}, PyTorch {theirs['first_loss']:.6f}; "
                             f"LoRA {ours['first_lora_loss']:.6f} and "
                             f"{theirs['first_lora_loss']:.6f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--worker", choices=["npformer", "torch"], default=None)
    args = parser.parse_args(argv)
    sizes = SMOKE_SIZES if args.smoke else (BATCH, LENGTH, PROMPT, NEW)
    if args.worker:
        worker(args.worker, args.folder, sizes)
        return 0
    args.rounds = 1 if args.smoke else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or write_folder(Path(tmp) / "llama", SMOKE if args.smoke
                                             else SMOLLM2)
        sides = [Side(name, folder, args.smoke, __file__) for name in ("npformer", "torch")]
        times, seen = take_turns(sides, MEASUREMENTS, args.rounds)
    check_losses_agree(seen, ("first_loss", "first_lora_loss"))
    print(report(times, seen, args))
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
