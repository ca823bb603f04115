"""transformers' Llama, Qwen2 and Qwen3 modules as float64 references.

transformers computes two pieces in float32 whatever the model's dtype: RMSNorm's mean of
squares (``LlamaRMSNorm`` casts its input to float32) and the rotary tables
(``LlamaRotaryEmbedding``'s inverse frequencies and angles).  A float64 model there is only
float32-accurate, so 1e-10 parity needs them in float64 on the reference side:
:func:`float64_reference` patches both (the norms compute in their input's dtype; the
tables come from transformers' formulas transcribed in float64,
``tests.test_ops_parity.reference_table``), never the tolerance.  Attention runs as
``sdpa`` (torch's scaled_dot_product_attention computes in float64; the ``eager`` path
rounds its softmax to float32).
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from npformer import backend

from .test_ops_parity import reference_table

FAMILIES = ("llama", "qwen2", "qwen3")


def hf_classes(family: str):
    """(config class, module of the modeling code) of a family."""
    import transformers

    module = getattr(transformers.models, family)
    modeling = getattr(module, f"modeling_{family}")
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "qwen3": transformers.Qwen3Config}[family]
    return config, modeling


def _rms_norm_in_input_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * (variance + self.variance_epsilon).rsqrt())


def _rotary_in_float64(self, x, position_ids):
    import torch

    params = self.config.rope_parameters
    scaling = params if params.get("rope_type") == "llama3" else None
    head_dim = getattr(self.config, "head_dim", None) or \
        self.config.hidden_size // self.config.num_attention_heads
    cos, sin = reference_table(torch, head_dim, params["rope_theta"], scaling,
                               position_ids.cpu().numpy())
    return cos.to(device=x.device, dtype=x.dtype), sin.to(device=x.device, dtype=x.dtype)


@contextmanager
def float64_reference(monkeypatch=None):
    """Within the block, every family's RMS norm computes in its input's dtype and its
    rotary tables in float64 (see the module docstring)."""
    import pytest

    patcher = monkeypatch or pytest.MonkeyPatch()
    for family in FAMILIES:
        _, modeling = hf_classes(family)
        prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
        patcher.setattr(getattr(modeling, f"{prefix}RMSNorm"), "forward",
                        _rms_norm_in_input_dtype)
        patcher.setattr(getattr(modeling, f"{prefix}RotaryEmbedding"), "forward",
                        _rotary_in_float64)
    try:
        yield
    finally:
        if monkeypatch is None:
            patcher.undo()


def hf_state(named_arrays: dict) -> dict:
    """npformer's {name: array} -> transformers' {name: float64 CPU tensor}: the names as
    transformers' layers name them (npformer.hf.llama.hf_name); a Linear's weight, (in,
    out) here, is (out, in) there."""
    import torch

    from npformer.hf.llama import hf_name

    state = {}
    for name, value in named_arrays.items():
        host = backend.to_numpy(value)
        if host.ndim == 2 and not name.endswith("embed.weight"):
            host = host.T
        state[hf_name(name).removeprefix("model.")] = torch.tensor(np.ascontiguousarray(host))
    return state


def ours_from_hf(tensor_by_name: dict) -> dict:
    """transformers' {name: tensor} -> npformer's {name: host array}, the inverse of
    :func:`hf_state`."""
    from npformer.hf.llama import npformer_name

    out = {}
    for name, tensor in tensor_by_name.items():
        host = tensor.detach().cpu().numpy()
        out[npformer_name(name)] = host.T if host.ndim == 2 and \
            not name.endswith("embed_tokens.weight") else host
    return out


def additive_mask(torch, mask: np.ndarray):
    """A boolean mask (True = may attend) as the float mask transformers adds to scores."""
    return torch.where(torch.tensor(mask), 0.0, float("-inf")).to(torch.float64)
