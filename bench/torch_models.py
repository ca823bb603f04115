"""The PyTorch reference models, in one place: the parity tests
(tests/test_models_parity.py) and the benchmark (bench/) both build them.

Each is a plain ``torch.nn.Module`` assembled from torch.nn layers, with the
attribute names :mod:`npformer.torch_interop` expects (tok_emb, pos_emb,
layers.<i> = ``nn.TransformerEncoderLayer(batch_first=True)``, norm, head /
lm_head; src_tok_emb, tgt_tok_emb, encoder.layers.<i>, decoder.layers.<i> =
``nn.TransformerDecoderLayer``, encoder.norm, decoder.norm, out_proj), built
from an npformer model configuration: the same dropout (none on the attention
probabilities, as in npformer; the embeddings' dropout after the positions), norm_first and
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


def _without_attention_dropout(layer):
    """A torch Transformer layer built with dropout p drops its attention probabilities
    too; npformer drops only the residual branches, the FFN's hidden layer and the
    embeddings, so the reference drops nothing in attention either."""
    for name in ("self_attn", "multihead_attn"):
        attention = getattr(layer, name, None)
        if attention is not None:
            attention.dropout = 0.0
    return layer


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
        return _without_attention_dropout(tnn.TransformerEncoderLayer(
            c.d_model, c.num_heads, c.d_ff, dropout=c.dropout,
            activation=_torch_activation(c.activation), layer_norm_eps=ops.layernorm.EPS,
            batch_first=True, norm_first=c.norm_first, dtype=dtype))

    class TorchClassifier(tnn.Module):
        def __init__(self, c, dtype):
            super().__init__()
            self.c = c
            self.tok_emb = tnn.Embedding(c.vocab_size, c.d_model, dtype=dtype)
            _positions(tnn, torch, self, "", c.positional, c.max_len, c.d_model, dtype)
            self.drop = tnn.Dropout(c.dropout)  # npformer's embedding dropout
            self.layers = tnn.ModuleList(encoder_layer(c, dtype) for _ in range(c.num_layers))
            if c.norm_first:
                self.norm = tnn.LayerNorm(c.d_model, eps=ops.layernorm.EPS, dtype=dtype)
            self.head = tnn.Linear(c.d_model, c.num_classes, dtype=dtype)

        def forward(self, ids, valid_lens):
            x = self.drop(_add_positions(self, "", self.tok_emb(ids)))
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
            self.drop = tnn.Dropout(c.dropout)  # npformer's embedding dropout
            self.layers = tnn.ModuleList(encoder_layer(c, dtype) for _ in range(c.num_layers))
            if c.norm_first:
                self.norm = tnn.LayerNorm(c.d_model, eps=ops.layernorm.EPS, dtype=dtype)
            if not c.tie_weights:
                self.lm_head = tnn.Linear(c.d_model, c.vocab_size, bias=False, dtype=dtype)

        def forward(self, ids):
            length = ids.shape[1]
            x = self.drop(_add_positions(self, "", self.tok_emb(ids)))
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
            self.drop = tnn.Dropout(c.dropout)  # npformer's embedding dropout (each side)

            def norm():
                return (tnn.LayerNorm(c.d_model, eps=ops.layernorm.EPS, dtype=dtype)
                        if c.norm_first else None)

            self.encoder = Stack([encoder_layer(c, dtype) for _ in range(c.num_encoder_layers)],
                                 norm())
            self.decoder = Stack([_without_attention_dropout(tnn.TransformerDecoderLayer(
                c.d_model, c.num_heads, c.d_ff, dropout=c.dropout,
                activation=_torch_activation(c.activation), layer_norm_eps=ops.layernorm.EPS,
                batch_first=True, norm_first=c.norm_first, dtype=dtype))
                for _ in range(c.num_decoder_layers)], norm())
            self.out_proj = tnn.Linear(c.d_model, c.tgt_vocab_size, dtype=dtype)

        def forward(self, src, tgt_in, src_lens, tgt_lens):
            scale = math.sqrt(self.c.d_model) if self.c.scale_embeddings else 1.0
            device = src.device  # the masks live with the inputs (CPU or GPU)
            src_ignore = torch.arange(src.shape[1], device=device)[None, :] >= src_lens[:, None]
            tgt_ignore = torch.arange(tgt_in.shape[1], device=device)[None, :] >= tgt_lens[:, None]
            causal = torch.triu(torch.ones(tgt_in.shape[1], tgt_in.shape[1], dtype=torch.bool,
                                           device=device), diagonal=1)
            x = self.drop(_add_positions(self, "src_", self.src_tok_emb(src) * scale))
            for layer in self.encoder.layers:
                x = layer(x, src_key_padding_mask=src_ignore)
            if self.c.norm_first:
                x = self.encoder.norm(x)
            y = self.drop(_add_positions(self, "tgt_", self.tgt_tok_emb(tgt_in) * scale))
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


# --------------------------------------------------------------------------- the demos' update
def decays(model) -> dict:
    """{parameter name: whether weight decay touches it}, npformer's rule in PyTorch terms:
    matrices decay; biases, norm gains and embedding tables (a tied head's too) do not."""
    import torch

    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {name: p.ndim >= 2 and id(p) not in tables for name, p in model.named_parameters()}


def torch_optimizer_like(npformer_optimizer, model):
    """(optimizer, scheduler): ``torch.optim.AdamW`` or ``Adam`` with the hyperparameters
    of an npformer AdamW / Adam, weight decay on the parameters :func:`decays` names (two
    groups), and its learning-rate schedule as a ``LambdaLR`` (npformer's update t uses
    schedule(t), t from 1; LambdaLR's factor e, from 0, times a base rate of 1)."""
    import torch

    from npformer import optim

    o = npformer_optimizer
    kind = torch.optim.AdamW if isinstance(o, optim.AdamW) else torch.optim.Adam
    decay = decays(model)
    named = dict(model.named_parameters())
    groups = [{"params": [named[n] for n in named if decay[n]], "weight_decay": o.weight_decay},
              {"params": [named[n] for n in named if not decay[n]], "weight_decay": 0.0}]
    optimizer = kind(groups, lr=1.0, betas=(o.beta1, o.beta2), eps=o.eps)
    schedule = o.schedule if o.schedule is not None else (lambda t, lr=o.lr: lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: schedule(e + 1))


# --------------------------------------------------------------------------- nanoGPT's GPT
NANOGPT = "../shared/anchors/nanogpt"  # nanoGPT's model.py, relative to the repository root


def nanogpt_folder(root):
    """The folder of nanoGPT's model.py: $NPFORMER_NANOGPT, else ``root``/NANOGPT; None
    where it is not there (the benchmark then leaves nanoGPT out)."""
    import os
    from pathlib import Path

    folder = Path(os.environ.get("NPFORMER_NANOGPT") or Path(root) / NANOGPT).resolve()
    return folder if (folder / "model.py").is_file() else None


def nanogpt_state_dict(reference: dict, num_layers: int) -> dict:
    """The reference LM's state dict (:func:`torch_models`' TorchLM, tied, pre-norm, the
    names torch_interop uses) under nanoGPT's names.  torch's fused in_proj (3D, D) is
    nanoGPT's c_attn (q, k, v stacked by rows, the same head split); the tied head is
    nanoGPT's lm_head = wte."""
    names = {"tok_emb.weight": "transformer.wte.weight",
             "pos_emb.weight": "transformer.wpe.weight",
             "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias"}
    per_layer = {"self_attn.in_proj_weight": "attn.c_attn.weight",
                 "self_attn.in_proj_bias": "attn.c_attn.bias",
                 "self_attn.out_proj.weight": "attn.c_proj.weight",
                 "self_attn.out_proj.bias": "attn.c_proj.bias",
                 "norm1.weight": "ln_1.weight", "norm1.bias": "ln_1.bias",
                 "norm2.weight": "ln_2.weight", "norm2.bias": "ln_2.bias",
                 "linear1.weight": "mlp.c_fc.weight", "linear1.bias": "mlp.c_fc.bias",
                 "linear2.weight": "mlp.c_proj.weight", "linear2.bias": "mlp.c_proj.bias"}
    for i in range(num_layers):
        names.update({f"layers.{i}.{ours}": f"transformer.h.{i}.{theirs}"
                      for ours, theirs in per_layer.items()})
    if set(reference) != set(names):
        raise ValueError(f"the reference LM's names do not map onto nanoGPT's: "
                         f"{sorted(set(reference) ^ set(names))}")
    state = {names[k]: v for k, v in reference.items()}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def nanogpt_model(config, folder):
    """nanoGPT's own ``GPT`` for an npformer CausalLMConfig: bias=True (npformer's
    Linear and LayerNorm layers have biases; nanoGPT's CPU baby-GPT run uses
    bias=False), exact GELU (nn.GELU), tied head, dropout as configured."""
    if not (config.norm_first and config.tie_weights and config.activation == "gelu"
            and config.positional == "learned" and config.d_ff == 4 * config.d_model):
        raise ValueError(f"nanoGPT's GPT is a pre-norm, tied, exact-GELU model with learned "
                         f"positions and a 4 D feed-forward; this configuration is not: "
                         f"{config}")
    import sys

    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    from model import GPT, GPTConfig  # nanoGPT's model.py

    return GPT(GPTConfig(block_size=config.block_size, vocab_size=config.vocab_size,
                         n_layer=config.num_layers, n_head=config.num_heads,
                         n_embd=config.d_model, dropout=config.dropout, bias=True))
