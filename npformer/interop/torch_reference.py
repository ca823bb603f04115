"""The PyTorch reference models: npformer's three models assembled from torch.nn layers.

Each is a plain ``torch.nn.Module`` built from an npformer model configuration, with
the attribute names :mod:`npformer.interop.pytorch` converts weights under:

* classifier: ``tok_emb``, ``pos_emb`` (learned positions only), ``bigram_emb`` (with
  ``bigram_buckets``), ``layers.<i>``
  (``nn.TransformerEncoderLayer(batch_first=True)``), ``norm`` (pre-norm only), ``head``;
* causal LM: ``tok_emb``, ``pos_emb``, ``layers.<i>``, ``norm`` (pre-norm only),
  ``lm_head`` (untied only; tied, the logits are ``h @ tok_emb.weight.T``);
* seq2seq: ``src_tok_emb``, ``tgt_tok_emb``, ``src_pos_emb``/``tgt_pos_emb`` (learned
  only), ``encoder.layers.<i>``, ``encoder.norm`` (pre-norm only), ``decoder.layers.<i>``
  (``nn.TransformerDecoderLayer``), ``decoder.norm`` (pre-norm only), ``out_proj``
  (untied only; tied, the logits are ``y @ tgt_tok_emb.weight.T``).

They compute what the npformer model computes: the same norm_first and activation
(npformer's "gelu" is torch's exact ``F.gelu``, "gelu_tanh" is ``approximate="tanh"``),
torch's masks (True = ignore), pooling over the valid positions, sinusoidal positions
as npformer's table in a non-persistent buffer (not in the state dict).  Dropout is the
configuration's, where npformer has it: after the embeddings (and positions), in the
residual branches and the feed-forward's hidden layer, and none on the attention
probabilities (torch's layers drop those too; here their attention dropout is set to 0).
In eval mode no dropout applies, and the outputs are npformer's.

:func:`torch_attention` is npformer's attention layer with its options (Bloem's narrow
heads, qk_norm) written in torch the way Bloem's ``former`` writes them, for the parity
tests of those options (``torch.nn.MultiheadAttention`` has neither).

The parity tests, the benchmark (``bench/``) and :func:`npformer.interop.pytorch.to_torch`
build these; torch is imported when they are first asked for, never with npformer.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import backend, ops


def torch_activation(name: str) -> str | Callable:
    """npformer's activation name as ``torch.nn.Transformer*Layer``'s ``activation``."""
    import torch.nn.functional as F

    if name == "gelu_tanh":  # torch has no string for the tanh form
        return functools.partial(F.gelu, approximate="tanh")
    return name  # "relu", and "gelu" (exact, erf) in both libraries


def _positions(torch: Any, module: Any, prefix: str, positional: str, block_size: int,
               d_model: int, dtype: Any) -> None:
    """A learned table (an Embedding, in state_dict) or npformer's sinusoids (a buffer)."""
    if positional == "learned":
        setattr(module, prefix + "pos_emb", torch.nn.Embedding(block_size, d_model, dtype=dtype))
    else:
        table = backend.to_numpy(ops.sinusoidal_table(block_size, d_model, dtype=np.float64,
                                                      like=np.zeros(1)))
        module.register_buffer(prefix + "pe", torch.from_numpy(np.array(table, dtype=np.float64))
                               .to(dtype), persistent=False)


def _add_positions(module: Any, prefix: str, x: Any) -> Any:
    pos_emb = getattr(module, prefix + "pos_emb", None)
    table = pos_emb.weight if pos_emb is not None else getattr(module, prefix + "pe")
    return x + table[:x.shape[1]][None]


def _without_attention_dropout(layer: Any) -> Any:
    """``layer`` (a torch Transformer layer) with no dropout of its attention probabilities,
    as npformer (the module's docstring)."""
    for name in ("self_attn", "multihead_attn"):
        attention = getattr(layer, name, None)
        if attention is not None:
            attention.dropout = 0.0
    return layer


@functools.cache
def torch_models() -> dict[str, type]:
    """{"classifier", "causal_lm", "seq2seq": class(npformer config, torch dtype)}: the
    reference classes, made on the first call (torch is imported here) and the same
    classes on every later call (so ``isinstance`` works across calls)."""
    import torch

    tnn = torch.nn

    def layer(kind: type, c: Any, dtype: Any) -> Any:
        """A torch Transformer*Layer (``kind``) with the configuration's options."""
        return _without_attention_dropout(kind(
            c.d_model, c.num_heads, c.d_ff, dropout=c.dropout,
            activation=torch_activation(c.activation), layer_norm_eps=c.norm_eps,
            batch_first=True, norm_first=c.norm_first, dtype=dtype))

    def run(module: Any, x: Any, *memory: Any, **masks: Any) -> Any:
        """x through ``module.layers`` and then ``module.norm`` (pre-norm only)."""
        for each in module.layers:
            x = each(x, *memory, **masks)
        return module.norm(x) if hasattr(module, "norm") else x

    class Encoder(tnn.Module):
        """The classifier's and the causal LM's shared part: ``tok_emb``, the positions,
        the embedding dropout, ``layers`` and ``norm`` (pre-norm only)."""

        def __init__(self, c, dtype):
            super().__init__()
            self.c = c
            self.tok_emb = tnn.Embedding(c.vocab_size, c.d_model, dtype=dtype)
            _positions(torch, self, "", c.positional, c.block_size, c.d_model, dtype)
            self.drop = tnn.Dropout(c.dropout)  # npformer's embedding dropout
            self.layers = tnn.ModuleList(layer(tnn.TransformerEncoderLayer, c, dtype)
                                         for _ in range(c.num_layers))
            if c.norm_first:
                self.norm = tnn.LayerNorm(c.d_model, eps=c.norm_eps, dtype=dtype)

    def ignored(ids: Any, valid_lens: Any, pad_id: int) -> tuple[Any, Any]:
        """(B, T) True at padding: positions at or after valid_lens (default: the count of
        non-pad ids per row, as npformer counts them)."""
        if valid_lens is None:
            valid_lens = (ids != pad_id).sum(1)
        positions = torch.arange(ids.shape[1], device=ids.device)[None, :]
        return positions >= valid_lens[:, None], valid_lens

    class TorchClassifier(Encoder):
        """npformer.models.TransformerClassifier in torch.nn: forward(ids, valid_lens=None)."""

        def __init__(self, c, dtype=torch.float32):
            super().__init__(c, dtype)
            if c.bigram_buckets:
                self.bigram_emb = tnn.Embedding(c.bigram_buckets, c.d_model, dtype=dtype)
            self.head = tnn.Linear(c.d_model, c.num_classes, dtype=dtype)

        def forward(self, ids: Any, valid_lens: Any = None) -> Any:
            """ids (B, T), valid_lens (B,) or None -> logits (B, C)."""
            ignore, valid_lens = ignored(ids, valid_lens, self.c.pad_id)  # (B, T)
            x = self.drop(_add_positions(self, "", self.tok_emb(ids)))
            if self.c.bigram_buckets:  # fastText's hashed pairs (ops.hashed_bigrams' formula)
                previous = torch.nn.functional.pad(ids[:, :-1], (1, 0), value=-1)
                p1, p2 = 1_000_003, 998_244_353
                x = x + self.bigram_emb(((previous + 1) * p1 + ids * p2) % self.c.bigram_buckets)
            x = run(self, x, src_key_padding_mask=ignore)
            valid = (~ignore)[:, :, None]
            if self.c.pooling == "mean":
                pooled = (x * valid).sum(1) / valid_lens[:, None].to(x.dtype)
            elif self.c.pooling == "max":
                pooled = x.masked_fill(~valid, -math.inf).max(dim=1).values
            else:
                pooled = x[:, 0]
            return self.head(pooled)

    class TorchLM(Encoder):
        """npformer.models.CausalLM in torch.nn: forward(ids) -> logits (B, T, V)."""

        def __init__(self, c, dtype=torch.float32):
            super().__init__(c, dtype)
            if not c.tie_weights:
                self.lm_head = tnn.Linear(c.d_model, c.vocab_size, bias=False, dtype=dtype)

        def forward(self, ids: Any) -> Any:
            length = ids.shape[1]
            x = self.drop(_add_positions(self, "", self.tok_emb(ids)))
            causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=ids.device),
                                diagonal=1)
            x = run(self, x, src_mask=causal, is_causal=True)
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
        """npformer.models.Seq2SeqTransformer in torch.nn:
        forward(src, tgt_in, src_lens=None, tgt_lens=None) -> logits (B, T, V_tgt)."""

        def __init__(self, c, dtype=torch.float32):
            super().__init__()
            self.c = c
            self.src_tok_emb = tnn.Embedding(c.src_vocab_size, c.d_model, dtype=dtype)
            self.tgt_tok_emb = tnn.Embedding(c.tgt_vocab_size, c.d_model, dtype=dtype)
            _positions(torch, self, "src_", c.positional, c.block_size, c.d_model, dtype)
            _positions(torch, self, "tgt_", c.positional, c.block_size, c.d_model, dtype)
            self.drop = tnn.Dropout(c.dropout)  # npformer's embedding dropout (each side)

            def norm() -> Any:
                return (tnn.LayerNorm(c.d_model, eps=c.norm_eps, dtype=dtype)
                        if c.norm_first else None)

            self.encoder = Stack([layer(tnn.TransformerEncoderLayer, c, dtype)
                                  for _ in range(c.num_encoder_layers)], norm())
            self.decoder = Stack([layer(tnn.TransformerDecoderLayer, c, dtype)
                                  for _ in range(c.num_decoder_layers)], norm())
            if not c.tie_weights:
                self.out_proj = tnn.Linear(c.d_model, c.tgt_vocab_size, dtype=dtype)

        def forward(self, src: Any, tgt_in: Any, src_lens: Any = None, tgt_lens: Any = None) -> Any:
            scale = math.sqrt(self.c.d_model) if self.c.scale_embeddings else 1.0
            src_ignore, _ = ignored(src, src_lens, self.c.pad_id)  # (B, S)
            tgt_ignore, _ = ignored(tgt_in, tgt_lens, self.c.pad_id)  # (B, T)
            causal = torch.triu(torch.ones(tgt_in.shape[1], tgt_in.shape[1], dtype=torch.bool,
                                           device=src.device), diagonal=1)  # (T, T)
            x = self.drop(_add_positions(self, "src_", self.src_tok_emb(src) * scale))
            x = run(self.encoder, x, src_key_padding_mask=src_ignore)
            y = self.drop(_add_positions(self, "tgt_", self.tgt_tok_emb(tgt_in) * scale))
            y = run(self.decoder, y, x, tgt_mask=causal, tgt_key_padding_mask=tgt_ignore,
                    memory_key_padding_mask=src_ignore)
            if self.c.tie_weights:
                return y @ self.tgt_tok_emb.weight.T
            return self.out_proj(y)

    return {"classifier": TorchClassifier, "causal_lm": TorchLM, "seq2seq": TorchSeq2Seq}


@functools.cache
def torch_attention() -> type:
    """``TorchAttention(d_model, num_heads, narrow_heads=False, qk_norm=False, bias=True,
    dtype=torch.float32, eps=1e-5)``: :class:`npformer.nn.MultiHeadAttention` with its options,
    written in torch as Bloem's ``former`` writes ``SelfAttention`` (with ``qk_norm``) and
    ``SelfAttentionNarrow``: ``toqueries``, ``tokeys``, ``tovalues`` (D -> D, or one E -> E
    map applied to every head's slice when narrow), ``qln`` and ``kln`` (layer norms over
    a head's E features, with qk_norm), ``unifyheads`` (D -> D).  npformer's layer differs
    from ``former``'s in two ways, and this reference follows npformer: the scores are
    scaled by 1 / sqrt(E), the paper's (``former`` divides by sqrt(D)), and the narrow
    heads keep the output projection (``former``'s narrow layer drops it).

    ``forward(x, context=None, mask=None)``: x (B, T, D), context (B, S, D) (keys and
    values; default x), mask bool broadcasting to (B, H, T, S), True = may attend."""
    import torch

    tnn, F = torch.nn, torch.nn.functional

    class TorchAttention(tnn.Module):
        def __init__(self, d_model: int, num_heads: int, narrow_heads: bool = False,
                     qk_norm: bool = False, bias: bool = True, dtype: Any = torch.float32,
                     eps: float = 1e-5):
            super().__init__()
            self.heads, self.narrow_heads, self.qk_norm = num_heads, narrow_heads, qk_norm
            s = d_model // num_heads
            width = s if narrow_heads else d_model  # a slice, or the whole vector
            self.toqueries = tnn.Linear(width, width, bias=bias, dtype=dtype)
            self.tokeys = tnn.Linear(width, width, bias=bias, dtype=dtype)
            self.tovalues = tnn.Linear(width, width, bias=bias, dtype=dtype)
            if qk_norm:
                self.qln = tnn.LayerNorm([s], eps=eps, dtype=dtype)
                self.kln = tnn.LayerNorm([s], eps=eps, dtype=dtype)
            self.unifyheads = tnn.Linear(d_model, d_model, bias=bias, dtype=dtype)

        def project(self, linear: Any, x: Any) -> Any:
            """(b, t, e) -> (b, t, h, s): narrow heads cut x first, the others after."""
            b, t, e = x.size()
            h = self.heads
            if self.narrow_heads:
                return linear(x.view(b, t, h, e // h))
            return linear(x).view(b, t, h, e // h)

        def forward(self, x: Any, context: Any = None, mask: Any = None) -> Any:
            context = x if context is None else context
            b, t, e = x.size()
            h, s = self.heads, e // self.heads
            queries = self.project(self.toqueries, x)  # (b, t, h, s)
            keys = self.project(self.tokeys, context)  # (b, t_kv, h, s)
            values = self.project(self.tovalues, context)
            if self.qk_norm:
                keys, queries = self.kln(keys), self.qln(queries)
            queries, keys, values = (z.transpose(1, 2) for z in (queries, keys, values))
            dot = queries @ keys.transpose(-1, -2) / math.sqrt(s)  # (b, h, t, t_kv)
            if mask is not None:
                dot = dot.masked_fill(~mask, float("-inf"))
            out = F.softmax(dot, dim=-1) @ values  # (b, h, t, s)
            return self.unifyheads(out.transpose(1, 2).contiguous().view(b, t, h * s))

    return TorchAttention
