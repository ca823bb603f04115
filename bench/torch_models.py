"""The PyTorch reference models, in one place: the parity tests
(tests/test_models_parity.py) and the benchmark (bench/) both build them.

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

import functools
import math

import numpy as np

from npformer import backend, ops


def _torch_activation(name: str):
    import torch.nn.functional as F

    if name == "gelu_tanh":  # torch has no string for the tanh form
        return functools.partial(F.gelu, approximate="tanh")
    return name  # "relu", and "gelu" (exact, erf) in both libraries


def _positions(tnn, torch, module, prefix, positional, max_len, d_model, dtype):
    """A learned table (an Embedding, in state_dict) or npformer's sinusoids (a buffer)."""
    if positional == "learned":
        setattr(module, prefix + "pos_emb", tnn.Embedding(max_len, d_model, dtype=dtype))
    else:
        table = backend.to_numpy(ops.sinusoidal_table(max_len, d_model, dtype=np.float64,
                                                      like=np.zeros(1)))
        module.register_buffer(prefix + "pe", torch.from_numpy(np.array(table, dtype=np.float64))
                               .to(dtype), persistent=False)


def _add_positions(module, prefix, x):
    length = x.shape[1]
    pos_emb = getattr(module, prefix + "pos_emb", None)
    if pos_emb is not None:
        return x + pos_emb.weight[:length][None]
    return x + getattr(module, prefix + "pe")[:length][None]


def torch_models() -> dict:
    """{"classifier", "causal_lm", "seq2seq": class(npformer config, torch dtype)}: the
    reference classes (built on call: torch is imported here, never by npformer)."""
    import torch

    tnn = torch.nn

    def encoder_layer(c, dtype):
        return tnn.TransformerEncoderLayer(c.d_model, c.num_heads, c.d_ff, dropout=0.0,
                                           activation=_torch_activation(c.activation),
                                           layer_norm_eps=ops.layernorm.EPS, batch_first=True,
                                           norm_first=c.norm_first, dtype=dtype)

    class TorchClassifier(tnn.Module):
        def __init__(self, c, dtype):
            super().__init__()
            self.c = c
            self.tok_emb = tnn.Embedding(c.vocab_size, c.d_model, dtype=dtype)
            _positions(tnn, torch, self, "", c.positional, c.max_len, c.d_model, dtype)
            self.layers = tnn.ModuleList(encoder_layer(c, dtype) for _ in range(c.num_layers))
            if c.norm_first:
                self.norm = tnn.LayerNorm(c.d_model, eps=ops.layernorm.EPS, dtype=dtype)
            self.head = tnn.Linear(c.d_model, c.num_classes, dtype=dtype)

        def forward(self, ids, valid_lens):
            x = _add_positions(self, "", self.tok_emb(ids))
            ignore = (torch.arange(ids.shape[1], device=ids.device)[None, :]
                      >= valid_lens[:, None])  # (B, T)
            for layer in self.layers:
                x = layer(x, src_key_padding_mask=ignore)
            if self.c.norm_first:
                x = self.norm(x)
            valid = (~ignore)[:, :, None]
            if self.c.pooling == "mean":
                pooled = (x * valid).sum(1) / valid_lens[:, None].to(x.dtype)
            elif self.c.pooling == "max":
                pooled = x.masked_fill(~valid, -math.inf).max(dim=1).values
            else:
                pooled = x[:, 0]
            return self.head(pooled)

    class TorchLM(tnn.Module):
        def __init__(self, c, dtype):
            super().__init__()
            self.c = c
            self.tok_emb = tnn.Embedding(c.vocab_size, c.d_model, dtype=dtype)
            _positions(tnn, torch, self, "", c.positional, c.block_size, c.d_model, dtype)
            self.layers = tnn.ModuleList(encoder_layer(c, dtype) for _ in range(c.num_layers))
            if c.norm_first:
                self.norm = tnn.LayerNorm(c.d_model, eps=ops.layernorm.EPS, dtype=dtype)
            if not c.tie_weights:
                self.lm_head = tnn.Linear(c.d_model, c.vocab_size, bias=False, dtype=dtype)

        def forward(self, ids):
            length = ids.shape[1]
            x = _add_positions(self, "", self.tok_emb(ids))
            causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=ids.device),
                                diagonal=1)
            for layer in self.layers:
                x = layer(x, src_mask=causal, is_causal=True)
            if self.c.norm_first:
                x = self.norm(x)
            if self.c.tie_weights:
                return x @ self.tok_emb.weight.T
            return self.lm_head(x)

    class Stack(tnn.Module):
        def __init__(self, layers, norm):
            super().__init__()
            self.layers = tnn.ModuleList(layers)
            if norm is not None:
                self.norm = norm

    class TorchSeq2Seq(tnn.Module):
        def __init__(self, c, dtype):
            super().__init__()
            self.c = c
            self.src_tok_emb = tnn.Embedding(c.src_vocab_size, c.d_model, dtype=dtype)
            self.tgt_tok_emb = tnn.Embedding(c.tgt_vocab_size, c.d_model, dtype=dtype)
            _positions(tnn, torch, self, "src_", c.positional, c.max_len, c.d_model, dtype)
            _positions(tnn, torch, self, "tgt_", c.positional, c.max_len, c.d_model, dtype)

            def norm():
                return (tnn.LayerNorm(c.d_model, eps=ops.layernorm.EPS, dtype=dtype)
                        if c.norm_first else None)

            self.encoder = Stack([encoder_layer(c, dtype) for _ in range(c.num_encoder_layers)],
                                 norm())
            self.decoder = Stack([tnn.TransformerDecoderLayer(
                c.d_model, c.num_heads, c.d_ff, dropout=0.0,
                activation=_torch_activation(c.activation), layer_norm_eps=ops.layernorm.EPS,
                batch_first=True, norm_first=c.norm_first, dtype=dtype)
                for _ in range(c.num_decoder_layers)], norm())
            self.out_proj = tnn.Linear(c.d_model, c.tgt_vocab_size, dtype=dtype)

        def forward(self, src, tgt_in, src_lens, tgt_lens):
            scale = math.sqrt(self.c.d_model) if self.c.scale_embeddings else 1.0
            device = src.device  # the masks live with the inputs (CPU or GPU)
            src_ignore = torch.arange(src.shape[1], device=device)[None, :] >= src_lens[:, None]
            tgt_ignore = torch.arange(tgt_in.shape[1], device=device)[None, :] >= tgt_lens[:, None]
            causal = torch.triu(torch.ones(tgt_in.shape[1], tgt_in.shape[1], dtype=torch.bool,
                                           device=device), diagonal=1)
            x = _add_positions(self, "src_", self.src_tok_emb(src) * scale)
            for layer in self.encoder.layers:
                x = layer(x, src_key_padding_mask=src_ignore)
            if self.c.norm_first:
                x = self.encoder.norm(x)
            y = _add_positions(self, "tgt_", self.tgt_tok_emb(tgt_in) * scale)
            for layer in self.decoder.layers:
                y = layer(y, x, tgt_mask=causal, tgt_key_padding_mask=tgt_ignore,
                          memory_key_padding_mask=src_ignore)
            if self.c.norm_first:
                y = self.decoder.norm(y)
            return self.out_proj(y)

    return {"classifier": TorchClassifier, "causal_lm": TorchLM, "seq2seq": TorchSeq2Seq}


def torch_reference(cfg: dict):
    """The benchmark's PyTorch model of configuration ``cfg`` (float32)."""
    import torch

    from bench.configs import npformer_config

    return torch_models()[cfg["kind"]](npformer_config(cfg), torch.float32)
