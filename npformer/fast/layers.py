"""The basic layers of the fast tier: the textbook layers (:mod:`npformer.nn.layers`) on
the fast ops, with what the blocks need to recompute instead of keep.

Each is a subclass of its textbook layer (the same parameters, names and
initialisation) whose forward and backward call the fast op of the same name.  Gradients
are added in place (:func:`npformer.nn.flat.accumulate`), into the flat buffer's views.
What each adds:

* :class:`Linear` and :meth:`Embedding.project`: ``keep_input=False`` keeps no input; the
  caller recomputes it and passes it to the backward.  :class:`LoRALinear`, the adapter
  of this tier's Linear, takes the same arguments.
* :class:`LayerNorm`, :class:`Activation`: :meth:`output_again`, the last forward's output
  computed again from the saved values its backward keeps anyway.
* :class:`Dropout`: :meth:`mask_again`, an array through the last forward's mask again.
* :class:`LearnedPositionalEmbedding`: the textbook's, its gradient added in place.

Tested equal to the textbook layers in ``tests/test_fast_layers.py``.
"""
from __future__ import annotations

from .. import backend, nn, ops
from ..backend import Array
from ..nn import lora
from ..nn.flat import accumulate
from . import activations, dropout, embedding, layernorm, linear, rmsnorm
from .recompute import activation_output, layernorm_output


class LoRALinear(lora.LoRALinear):
    """The textbook adapter (:class:`npformer.nn.lora.LoRALinear`) in place of this tier's
    Linear: it takes that layer's arguments, and always keeps its input (``keep_input``
    and ``x`` are accepted and not needed).  It runs on rows, as this tier's Linear does
    (one matrix product over every position): so an adapter whose B is zero computes
    its Linear's output to the bit, not a batched product's rounding of it."""

    def forward(self, x: Array, keep_input: bool = True) -> Array:
        xp = backend.namespace_of(x)
        rows = super().forward(xp.reshape(x, (-1, x.shape[-1])))  # (N, D_in) -> (N, D_out)
        return xp.reshape(rows, tuple(x.shape[:-1]) + (rows.shape[-1],))

    def backward(self, dy: Array, x: Array | None = None) -> Array:
        xp = backend.namespace_of(dy)
        dx_rows = super().backward(xp.reshape(dy, (-1, dy.shape[-1])))  # (N, D_in)
        return xp.reshape(dx_rows, tuple(dy.shape[:-1]) + (dx_rows.shape[-1],))


class Linear(nn.Linear):
    __doc__ = nn.Linear.__doc__
    LoRALinear = LoRALinear  # the adapter apply_lora puts in its place

    def forward(self, x: Array, keep_input: bool = True) -> Array:
        """x (..., in) -> (..., out).  ``keep_input=False``: x is not kept for the backward
        (the caller recomputes it and passes it to :meth:`backward`)."""
        bias = None if self.bias is None else self.bias.data
        y, saved = linear.linear_forward(x, self.weight.data, bias, keep_input)
        self._save(saved)
        return y

    def backward(self, dy: Array, x: Array | None = None) -> Array:
        """dy (..., out) -> dx (..., in); ``x``: the forward's input, where it was not kept."""
        dx, dw, db = linear.linear_backward(dy, self._pop_saved(), x, weights=self.trains())
        accumulate(self.weight, dw)
        if self.bias is not None:
            accumulate(self.bias, db)
        return dx


class LayerNorm(nn.LayerNorm):
    __doc__ = nn.LayerNorm.__doc__

    def forward(self, x: Array) -> Array:
        y, saved = layernorm.layernorm_forward(x, self.weight.data, self.bias.data, self.eps)
        self._save(saved)
        return y

    def backward(self, dy: Array) -> Array:
        dx, dgamma, dbeta = layernorm.layernorm_backward(dy, self._pop_saved())
        accumulate(self.weight, dgamma)
        accumulate(self.bias, dbeta)
        return dx

    def output_again(self) -> Array:
        """The last forward's output, computed again from its saved values (which stays for the
        backward): for a next layer that did not keep it."""
        return layernorm_output(self._peek_saved().values, self.bias.data)


class RMSNorm(nn.RMSNorm):
    __doc__ = nn.RMSNorm.__doc__

    def forward(self, x: Array) -> Array:
        y, saved = rmsnorm.rmsnorm_forward(x, self.weight.data, self.eps)
        self._save(saved)
        return y

    def backward(self, dy: Array) -> Array:
        dx, dweight = rmsnorm.rmsnorm_backward(dy, self._pop_saved())
        accumulate(self.weight, dweight)
        return dx


class Embedding(nn.Embedding):
    __doc__ = nn.Embedding.__doc__

    def backward(self, dy: Array) -> None:
        """dy (..., D) -> None: integer ids are not differentiable.  The table's gradient
        is added in place, the rows looked up recorded by its flat buffer
        (:func:`npformer.nn.flat.rows_written`)."""
        saved = self._pop_saved()
        if not self.weight.frozen:  # a frozen table's rows take no gradient
            accumulate(self.weight, embedding.embedding_backward(dy, saved),
                       ops.embedding_rows(saved))
        return None

    def project(self, h: Array, keep_input: bool = True) -> Array:
        """The tied output projection h (..., D) -> logits (..., V) = h W^T.
        ``keep_input=False``: h is not kept (:meth:`project_backward` is given it again)."""
        logits, saved = linear.linear_forward(h, self.weight.data.mT, None, keep_input)
        self._save(saved, slot="_project_saved")
        return logits

    def project_backward(self, dlogits: Array, h: Array | None = None) -> Array:
        """dlogits (..., V) -> dh (..., D); W^T's gradient is added into the one table, in
        every row (its flat buffer's record of the rows written becomes None).  ``h``:
        the projection's input, where it was not kept."""
        frozen = self.weight.frozen  # then W^T's gradient is not computed
        dh, dtable_t, _ = linear.linear_backward(dlogits, self._pop_saved("_project_saved"), h,
                                                 weights=not frozen)
        if not frozen:
            accumulate(self.weight, dtable_t.mT)
        return dh


class LearnedPositionalEmbedding(nn.LearnedPositionalEmbedding):
    __doc__ = nn.LearnedPositionalEmbedding.__doc__

    def backward(self, dy: Array) -> Array:
        """As the textbook's, the table's gradient added into the flat buffer in place."""
        saved = self._pop_saved()
        if saved.op == "embedding_forward":  # the rows P[position_ids], looked up
            accumulate(self.weight, ops.embedding_backward(dy, saved))
            return dy
        dx, dtable = ops.add_positions_backward(dy, saved)
        accumulate(self.weight, dtable)
        return dx


class Dropout(nn.Dropout):
    __doc__ = nn.Dropout.__doc__

    def forward(self, x: Array) -> Array:
        y, saved = dropout.dropout_forward(x, self.p, self.training)
        self._save(saved)
        return y

    def backward(self, dy: Array) -> Array:
        return dropout.dropout_backward(dy, self._pop_saved())

    def mask_again(self, x: Array) -> Array:
        """x through the last forward's dropout again: the same kept positions and scale
        (the saved values stays for the backward).  Dropout multiplies by m / (1 - p) both ways,
        so the backward op is what applies it."""
        return dropout.dropout_backward(x, self._peek_saved())


class Activation(nn.Activation):
    __doc__ = nn.Activation.__doc__

    def forward(self, x: Array) -> Array:
        y, saved = activations.activation(self.name)[0](x)
        self._save(saved)
        return y

    def backward(self, dy: Array) -> Array:
        return activations.activation(self.name)[1](dy, self._pop_saved())

    def output_again(self) -> Array:
        """The last forward's output, computed again from its saved values (which stays for the
        backward): for a next layer that did not keep it."""
        return activation_output(self.name)(self._peek_saved().values)
