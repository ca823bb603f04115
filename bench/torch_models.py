"""The PyTorch reference models of the benchmark: npformer's own
(:mod:`npformer.torch_reference`, which the parity tests build too).

Each is a plain ``torch.nn.Module`` assembled from torch.nn layers, with the
attribute names :mod:`npformer.torch_interop` expects (tok_emb, pos_emb,
layers.<i> = ``nn.TransformerEncoderLayer(batch_first=True)``, norm, head /
lm_head; src_tok_emb, tgt_tok_emb, encoder.layers.<i>, decoder.layers.<i> =
``nn.TransformerDecoderLayer``, encoder.norm, decoder.norm, out_proj), built
from an npformer model configuration: dropout 0, the same norm_first and
activation (npformer's "gelu_tanh" is torch's approximate="tanh"), torch's masks (True = ignore)
and pooling over valid positions.  Sinusoidal positions are npformer's table as
a non-persistent buffer (not in the state dict).  Weights move between the two
with ``npformer.torch_interop.load_torch_state_dict`` / ``to_torch_state_dict``.
"""
from __future__ import annotations

# The reference classes ship in the package (npformer/torch_reference.py); bench and the
# parity tests use them from there.
from npformer.torch_reference import torch_models


def torch_reference(cfg: dict):
    """The benchmark's PyTorch model of configuration ``cfg`` (float32)."""
    import torch

    from bench.configs import npformer_config

    return torch_models()[cfg["kind"]](npformer_config(cfg), torch.float32)
