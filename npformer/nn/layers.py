"""The basic layers: each wraps one op and owns its parameters.

Each forward calls its op in :mod:`npformer.ops` and keeps the op's saved values; each
backward hands them back and adds the parameters' gradients (the fast tier's subclasses,
:mod:`npformer.fast.layers`, call the fast ops).  Parameters are created in the backend's
default float dtype; initialisations follow PyTorch's.
"""
from __future__ import annotations

import math

from .. import backend, ops
from ..backend import Array
from ..ops.contracts import check_flag, check_float, check_probability, check_real, check_size
from .module import Module, Parameter


def _uniform(shape, bound: float):
    """U(-bound, bound) samples in the default float dtype."""
    return (backend.random_uniform(shape) * 2.0 - 1.0) * bound


class Linear(Module):
    """y = x W + b, with W of shape (in_features, out_features); PyTorch's init
    U(-1/sqrt(in), 1/sqrt(in)) for both W and b."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        check_size(in_features, "in_features", 1)
        check_size(out_features, "out_features", 1)
        bias = check_flag(bias, "bias")
        bound = 1.0 / math.sqrt(in_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(_uniform((in_features, out_features), bound))
        self.bias = Parameter(_uniform((out_features,), bound), decay=False) if bias else None

    def forward(self, x: Array) -> Array:
        """x (..., in) -> (..., out)."""
        bias = None if self.bias is None else self.bias.data
        y, saved = ops.linear_forward(x, self.weight.data, bias)
        self._save(saved)
        return y

    def backward(self, dy: Array) -> Array:
        """dy (..., out) -> dx (..., in); a frozen layer's weights take no gradient."""
        dx, dw, db = ops.linear_backward(dy, self._pop_saved(), weights=self.trains())
        self.weight.accumulate(dw)
        if self.bias is not None:
            self.bias.accumulate(db)
        return dx

    def trains(self) -> bool:
        """Whether any of the layer's weights trains (a frozen one's gradient is not
        computed: LoRA's base maps)."""
        return not (self.weight.frozen and (self.bias is None or self.bias.frozen))


class LayerNorm(Module):
    """Layer norm over the last axis (of size ``normalized_shape``, PyTorch's name; an int
    D here), weight (gamma) 1 and bias (beta) 0 at init; ``eps`` a positive number."""

    def __init__(self, normalized_shape: int, eps: float = ops.layernorm.EPS):
        check_size(normalized_shape, "layer norm width", 1)
        xp, dtype, dev = backend.xp(), backend.default_float(), backend.device()
        self.eps = check_real(eps, "layer norm eps", 0.0, inclusive=False)
        self.weight = Parameter(xp.ones((normalized_shape,), dtype=dtype, device=dev),
                                decay=False)
        self.bias = Parameter(xp.zeros((normalized_shape,), dtype=dtype, device=dev),
                              decay=False)

    def forward(self, x: Array) -> Array:
        y, saved = ops.layernorm_forward(x, self.weight.data, self.bias.data, self.eps)
        self._save(saved)
        return y

    def backward(self, dy: Array) -> Array:
        dx, dgamma, dbeta = ops.layernorm_backward(dy, self._pop_saved())
        self.weight.accumulate(dgamma)
        self.bias.accumulate(dbeta)
        return dx


class Embedding(Module):
    """Token ids (...) -> vectors (..., D); weight N(0, init_std^2), PyTorch's std 1 by default."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float = 1.0):
        check_size(num_embeddings, "num_embeddings", 1)
        check_size(embedding_dim, "embedding_dim", 1)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = Parameter(backend.random_normal((num_embeddings, embedding_dim),
                                                      std=init_std), decay=False)

    def forward(self, ids: Array) -> Array:
        y, saved = ops.embedding_forward(ids, self.weight.data)
        self._save(saved)
        return y

    def backward(self, dy: Array) -> None:
        """dy (..., D) -> None: integer ids are not differentiable."""
        saved = self._pop_saved()
        if not self.weight.frozen:  # a frozen table's rows take no gradient
            self.weight.accumulate(ops.embedding_backward(dy, saved))
        return None

    def project(self, h: Array) -> Array:
        """The tied output projection (Press & Wolf, 2017): h (..., D) -> logits (..., V)
        = h W^T with W this embedding's table, so W gets gradient from both uses."""
        logits, saved = ops.linear_forward(h, self.weight.data.mT)
        self._save(saved, slot="_project_saved")
        return logits

    def project_backward(self, dlogits: Array) -> Array:
        """dlogits (..., V) -> dh (..., D); W^T's gradient is added into the one table."""
        frozen = self.weight.frozen  # then W^T's gradient is not computed
        dh, dtable_t, _ = ops.linear_backward(dlogits, self._pop_saved("_project_saved"),
                                              weights=not frozen)
        if not frozen:
            self.weight.accumulate(dtable_t.mT)
        return dh


class LearnedPositionalEmbedding(Module):
    """x (B, T, D) -> x + P[:T], with a trainable table P (block_size, D); or, given
    ``position_ids`` (B, T), x + P[position_ids]: each token's own row (a left-padded
    batch counts each row's positions from its first token)."""

    def __init__(self, block_size: int, d_model: int, init_std: float = 0.02):
        check_size(block_size, "block_size", 1)
        check_size(d_model, "d_model", 1)
        self.block_size = block_size
        self.weight = Parameter(backend.random_normal((block_size, d_model), std=init_std),
                                decay=False)

    def forward(self, x: Array, position_ids: Array | None = None) -> Array:
        """x (B, T, D), position_ids (B, T) integers in [0, block_size) or None -> (B, T, D)."""
        if position_ids is None:
            y, saved = ops.add_positions_forward(x, self.weight.data)  # x + P[:T]
        else:
            rows, saved = ops.embedding_forward(position_ids, self.weight.data)  # P[ids]
            y = x + rows  # (B, T, D)
        self._save(saved)
        return y

    def backward(self, dy: Array) -> Array:
        """dy (B, T, D) -> dx = dy; the table's gradient is added (every position's row)."""
        saved = self._pop_saved()
        if saved.op == "embedding_forward":  # the rows P[position_ids], looked up
            self.weight.accumulate(ops.embedding_backward(dy, saved))
            return dy
        dx, dtable = ops.add_positions_backward(dy, saved)
        self.weight.accumulate(dtable)
        return dx


class SinusoidalPositionalEncoding(Module):
    """x (B, T, D) -> x + PE[:T] with the paper's fixed sines and cosines (no parameters)."""

    def __init__(self, block_size: int, d_model: int):
        check_size(block_size, "block_size", 1)
        check_size(d_model, "d_model", 1)
        self.block_size = block_size
        self._table = ops.sinusoidal_table(block_size, d_model)  # not a Parameter: never trained

    def forward(self, x: Array, position_ids: Array | None = None) -> Array:
        """x (B, T, D) -> x + PE[:T], or x + PE[position_ids] with position_ids (B, T)."""
        check_float(x, "input to the positional encoding")  # before its dtype is read
        table = self._table
        if table.dtype != x.dtype:
            table = backend.namespace_of(x).astype(table, x.dtype)
        if position_ids is None:
            y, saved = ops.add_positions_forward(x, table)
        else:
            rows, saved = ops.embedding_forward(position_ids, table)  # PE[ids], (B, T, D)
            y = x + rows
        self._save(saved)
        return y

    def backward(self, dy: Array) -> Array:
        """dy (B, T, D) -> dx = dy: a fixed table is added (nothing to train)."""
        self._pop_saved()
        return dy


class Dropout(Module):
    """Inverted dropout in training mode, identity in eval mode."""

    def __init__(self, p: float = 0.1):
        check_probability(p)
        self.p = p

    def forward(self, x: Array) -> Array:
        y, saved = ops.dropout_forward(x, self.p, self.training)
        self._save(saved)
        return y

    def backward(self, dy: Array) -> Array:
        return ops.dropout_backward(dy, self._pop_saved())


class Activation(Module):
    """ReLU or GELU (exact or tanh form) as a layer."""

    def __init__(self, name: str = "relu"):
        self.name = name
        ops.activation(name)  # an unknown name fails here, with the choices

    def forward(self, x: Array) -> Array:
        y, saved = ops.activation(self.name)[0](x)
        self._save(saved)
        return y

    def backward(self, dy: Array) -> Array:
        return ops.activation(self.name)[1](dy, self._pop_saved())


class RMSNorm(Module):
    """Root-mean-square norm over the last axis (Llama's ``LlamaRMSNorm``): weight 1 at
    init, no bias; ``eps`` a positive number (Llama's 1e-6)."""

    def __init__(self, normalized_shape: int, eps: float = ops.rmsnorm.EPS):
        check_size(normalized_shape, "RMS norm width", 1)
        xp, dtype, dev = backend.xp(), backend.default_float(), backend.device()
        self.eps = check_real(eps, "RMS norm eps", 0.0, inclusive=False)
        self.weight = Parameter(xp.ones((normalized_shape,), dtype=dtype, device=dev),
                                decay=False)

    def forward(self, x: Array) -> Array:
        """x (..., D) -> (..., D)."""
        y, saved = ops.rmsnorm_forward(x, self.weight.data, self.eps)
        self._save(saved)
        return y

    def backward(self, dy: Array) -> Array:
        """dy (..., D) -> dx (..., D); the weight's gradient is added."""
        dx, dweight = ops.rmsnorm_backward(dy, self._pop_saved())
        self.weight.accumulate(dweight)
        return dx
