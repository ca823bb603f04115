"""Weights out and in as safetensors, under PyTorch's names.

For each architecture (the torch reference models of tests/test_models_parity.py):

* npformer -> ``save_safetensors`` -> ``safetensors.torch.load_file`` -> the torch module
  (strict load) gives npformer's logits (float64, 1e-10);
* torch -> ``safetensors.torch.save_file(state_dict())`` -> ``load_safetensors`` -> a fresh
  npformer model gives torch's logits, and saving it again reproduces the torch tensors
  bit for bit;
* a truncated file, a file of another model and a missing file are clear errors.

The core writes with ``safetensors.numpy``: no torch import (checked in a subprocess).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from npformer import backend
from npformer.interop.pytorch import load_safetensors, save_safetensors
from npformer.interop.torch_reference import torch_models

from .conftest import using_backend
from .helpers import assert_close
from .test_models_parity import CONFIGS, KINDS

CASES = [
    ("classifier", dict(pooling="mean", norm_first=False, positional="learned")),
    ("causal_lm", dict(tie=True)),
    ("causal_lm", dict(tie=False, norm_first=False, positional="sinusoidal", activation="relu")),
    ("seq2seq", dict(norm_first=True, positional="learned", activation="gelu")),
]
IDS = [f"{kind}-{i}" for i, (kind, _) in enumerate(CASES)]


def _randomized(model, seed=3):
    rng = np.random.default_rng(seed)
    for _, p in model.named_parameters():
        p.data = backend.asarray(rng.standard_normal(p.shape) * 0.3, dtype="float64")
    return model


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_npformer_to_torch_and_back(case, torch, tmp_path):
    from safetensors.torch import load_file, save_file

    kind, kw = case
    config = CONFIGS[kind](**kw)
    glue = KINDS[kind]
    with using_backend("numpy", "float64"):
        batch = glue.batch_fn(np.random.default_rng(0), config)
        ours = _randomized(glue.build(config))
        path = save_safetensors(ours, tmp_path / "model.safetensors", {"kind": kind})
        ref = torch_models()[kind](config, torch.float64).train()
        result = ref.load_state_dict(load_file(str(path)), strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        with torch.no_grad():
            expected = glue.torch_logits(torch, ref, batch).numpy()
        assert_close(glue.our_logits(ours, batch), expected, 1e-10, "npformer -> torch")

        # and back: torch's own file into a fresh npformer model
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(1.5)
            expected = glue.torch_logits(torch, ref, batch).numpy()
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()},
                  str(tmp_path / "torch.safetensors"))
        fresh = glue.build(config)
        load_safetensors(fresh, tmp_path / "torch.safetensors")
        assert_close(glue.our_logits(fresh, batch), expected, 1e-10, "torch -> npformer")
        again = load_file(str(save_safetensors(fresh, tmp_path / "again.safetensors")))
    for name, tensor in ref.state_dict().items():
        assert torch.equal(again[name], tensor), name


def test_bad_files_are_clear_errors(tmp_path):
    kind, kw = CASES[1]
    with using_backend("numpy", "float64"):
        model = KINDS[kind].model_cls(CONFIGS[kind](**kw))
        path = save_safetensors(model, tmp_path / "m.safetensors")
        (tmp_path / "cut.safetensors").write_bytes(path.read_bytes()[:50])
        with pytest.raises(ValueError, match="cut.safetensors is not a readable safetensors"):
            load_safetensors(model, tmp_path / "cut.safetensors")
        other = KINDS["classifier"].model_cls(CONFIGS["classifier"]())
        with pytest.raises(ValueError, match="does not fit TransformerClassifier: missing keys"):
            load_safetensors(other, path)
        with pytest.raises(FileNotFoundError, match="no safetensors file"):
            load_safetensors(model, tmp_path / "absent.safetensors")
        with pytest.raises(TypeError, match="strings to strings"):
            save_safetensors(model, tmp_path / "x.safetensors", {"step": 3})


def test_saving_safetensors_does_not_import_torch(tmp_path):
    code = ("import sys; from npformer.models import CausalLM, CausalLMConfig; "
            "from npformer.interop.pytorch import save_safetensors; "
            "m = CausalLM(CausalLMConfig(vocab_size=5, block_size=4, d_model=4, num_heads=2, "
            "num_layers=1, d_ff=8)); "
            f"save_safetensors(m, {str(tmp_path / 'm.safetensors')!r}); "
            "print('torch' in sys.modules)")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={"PYTHONPATH": str(root), "PATH": ""}, check=True)
    assert out.stdout.strip() == "False"
