"""How far a plain float64 ``transformers`` Llama is from npformer's float64 Llama, and
why the tests patch two pieces of the reference to reach 1e-10.

    python tools/llama_float64_gap.py

Builds tiny ``LlamaForCausalLM`` models offline (random weights, float64, ``sdpa``
attention; the default rotary positions and Llama 3's scaled ones), saves each, loads it
with :meth:`npformer.models.LlamaCausalLM.from_pretrained` in float64, and prints the largest
absolute and relative difference of the logits on a left-padded batch, twice:

* ``plain``: the transformers model as it is.  ``LlamaRMSNorm`` casts its input to float32
  before the mean of squares, and ``LlamaRotaryEmbedding`` computes its inverse
  frequencies and angles in float32, so a float64 model is only float32-accurate there;
* ``norms64``, ``rotary64``: one of the two pieces computed in float64;
* ``patched``: both computed in float64 (the patches of ``tests/llama_reference.py``'s
  ``float64_reference``, which ``tests/test_hf_llama.py`` compares against).

Needs ``torch`` and ``transformers``; nothing is downloaded.
"""
from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no bar for each save

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
MODELS = {"default rotary": {}, "llama3 rotary": {"rope_theta": 500000.0, "rope_scaling": LLAMA3}}
ROWS = [[3, 7, 1, 9, 4, 2, 8, 5, 6, 10, 12, 11], [5, 8, 8, 2, 1], [11, 2, 6, 1, 4, 4, 9]]
PAD = 0


def build(torch, folder: Path, fields: dict):
    """A tiny transformers Llama with random float64 weights, saved in ``folder``."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=13, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, attn_implementation="sdpa", pad_token_id=PAD,
        tie_word_embeddings=False, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float64)
    with torch.no_grad():  # norms away from their 1s
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model.eval()


def logits_gap(torch, theirs, ours) -> tuple[float, float]:
    """(max |difference|, max |difference| / max |logit|) at the real tokens."""
    from npformer import backend
    from npformer.models.lm import positions_of

    width = max(map(len, ROWS))
    ids = np.array([[PAD] * (width - len(r)) + r for r in ROWS])
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in ROWS])
    positions = backend.to_numpy(positions_of(backend.asarray(mask.astype(bool))))
    with torch.no_grad():
        expected = theirs(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                          position_ids=torch.tensor(positions)).logits.numpy()
    got = backend.to_numpy(ours(backend.asarray(ids), attention_mask=backend.asarray(mask)))
    real = mask.astype(bool)
    gap = np.abs(got[real] - expected[real]).max()
    return float(gap), float(gap / np.abs(expected[real]).max())


@contextmanager
def float64_pieces(norms: bool, rotary: bool):
    """transformers' Llama with its RMS norms and/or its rotary tables computed in float64
    (the patches of ``tests/llama_reference.py``), restored after the block."""
    from transformers.models.llama import modeling_llama

    from tests import llama_reference

    patches = [(modeling_llama.LlamaRMSNorm, llama_reference._rms_norm_in_input_dtype, norms),
               (modeling_llama.LlamaRotaryEmbedding, llama_reference._rotary_in_float64, rotary)]
    saved = [(cls, cls.forward) for cls, _, on in patches if on]
    for cls, forward, on in patches:
        if on:
            cls.forward = forward
    try:
        yield
    finally:
        for cls, forward in saved:
            cls.forward = forward


REFERENCES = {  # name -> (norms in float64, rotary tables in float64)
    "plain": (False, False), "norms64": (True, False), "rotary64": (False, True),
    "patched": (True, True)}


def main() -> None:
    import torch

    from npformer import backend
    from npformer.models import LlamaCausalLM

    backend.set_backend("numpy")
    backend.set_default_float("float64")
    print(f"{'model':<16} {'reference':<9} {'max |diff|':>11} {'relative':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, fields in MODELS.items():
            folder = Path(tmp) / name.replace(" ", "_")
            theirs = build(torch, folder, fields)
            ours = LlamaCausalLM.from_pretrained(folder, dtype="float64")
            for kind, (norms, rotary) in REFERENCES.items():
                with float64_pieces(norms, rotary):
                    gap, relative = logits_gap(torch, theirs, ours)
                print(f"{name:<16} {kind:<9} {gap:>11.1e} {relative:>10.1e}")


if __name__ == "__main__":
    main()
