r"""Multi-head attention (Vaswani et al., 2017, section 3.2.2).

    $\text{head}_h = \text{Attention}(X_q W^Q_h, X_{kv} W^K_h, X_{kv} W^V_h)$
    $\text{MHA} = \text{Concat}(\text{head}_1, \dots, \text{head}_H)\, W^O$

Shapes: B batch, T query positions, S key positions, D model width, H heads,
E per-head width.  The paper's heads have E = D / H (the default); Bloem's "wide"
heads have E = D (pass ``head_dim=d_model``).  The projections W^Q, W^K, W^V are
(D, H*E) and W^O is (H*E, D); column block h of W^Q is head h.

Narrow heads (``narrow_heads=True``; Bloem's ``former``, ``SelfAttentionNarrow``).  The
input is cut into H slices of width E = D / H, and one set of (E, E) maps, shared by
all heads, is applied to every slice:

    $X = [X_1, \dots, X_H]$ (column blocks of width E)
    $\text{head}_h = \text{Attention}(X_{q,h} W^Q, X_{kv,h} W^K, X_{kv,h} W^V)$

The standard layer projects, then cuts the result into heads; the narrow one cuts, then
projects each slice (:meth:`_heads`).  Its backward sums the shared map's gradient over
the heads, $\bar W^Q = \sum_h X_{q,h}^\top \bar Q_h$.  Three (E, E) maps replace three
(D, D) ones: about H^2 times fewer parameters, and no mixing of the slices before W^O.

Query-key normalization (``qk_norm=True``; ``former``'s ``qk_norm``): a layer norm over
each head's E features of the queries and of the keys (one each, shared by the heads):

    $\hat Q_h = \text{LN}_q(Q_h)$,  $\hat K_h = \text{LN}_k(K_h)$,
    $\text{head}_h = \text{softmax}(\hat Q_h \hat K_h^\top / \sqrt{E} + M)\, V_h$

so the scores no longer grow with the size of the queries and keys.  (``former`` scales
by $1/\sqrt{D}$; npformer keeps the paper's $1/\sqrt{E}$.)  Both options are derived in
docs/derivations.md, "Options: Bloem's narrow heads, and qk_norm".

Self-attention: ``forward(x, mask=mask)``; cross-attention: ``forward(x,
context=memory, mask=mask)``.  Decoding (under ``no_grad``) passes a
:class:`npformer.nn.KVCache`.  The attention probabilities (one (T, S) matrix per head):
``forward(..., need_weights=True)``, or :func:`record_attention` for a whole model.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from .. import backend, ops
from ..backend import Array
from ..ops.contracts import (
    check_flag,
    check_float,
    check_heads_divide,
    check_mask,
    check_narrow_heads,
    check_real,
    check_same_dtype,
    check_sequence_input,
    check_size,
)
from .cache import KVCache, check_layer_cache
from .layers import LayerNorm, Linear
from .module import Module


def split_heads(x: Array, num_heads: int) -> Array:
    """(B, T, H*E) -> (B, H, T, E): column block h becomes head h."""
    xp = backend.namespace_of(x)
    batch, length, inner = x.shape
    x = xp.reshape(x, (batch, length, num_heads, inner // num_heads))  # (B, T, H, E)
    return xp.permute_dims(x, (0, 2, 1, 3))  # (B, H, T, E)


def merge_heads(x: Array) -> Array:
    """(B, H, T, E) -> (B, T, H*E), the inverse of :func:`split_heads`."""
    xp = backend.namespace_of(x)
    batch, heads, length, width = x.shape
    x = xp.permute_dims(x, (0, 2, 1, 3))  # (B, T, H, E)
    return xp.reshape(x, (batch, length, heads * width))  # (B, T, H*E)


# Narrow heads: the input cut into the heads' slices before the projection (split_heads,
# the two steps below, cuts after it).
def slices(x: Array, num_heads: int) -> Array:
    """(..., H*E) -> (..., H, E): the last axis cut into H column blocks."""
    xp = backend.namespace_of(x)
    return xp.reshape(x, tuple(x.shape[:-1]) + (num_heads, x.shape[-1] // num_heads))


def unslice(x: Array) -> Array:
    """(..., H, E) -> (..., H*E), the inverse of :func:`slices`."""
    xp = backend.namespace_of(x)
    return xp.reshape(x, tuple(x.shape[:-2]) + (x.shape[-2] * x.shape[-1],))


def swap_heads(x: Array) -> Array:
    """(B, T, H, E) <-> (B, H, T, E): axes 1 and 2 swapped (its own inverse)."""
    return backend.namespace_of(x).permute_dims(x, (0, 2, 1, 3))


class MultiHeadAttention(Module):
    """Multi-head scaled dot-product attention: ``H`` heads of width ``E`` (default
    ``d_model // num_heads``) over projections of the queries ``x`` (B, T, D) and the
    keys and values (``x`` itself, or ``context`` (B, S, D)).

    Options (the module docstring): ``narrow_heads=True``, Bloem's narrow heads (E = D / H);
    ``qk_norm=True``, each head's queries and keys layer-normed, of epsilon ``norm_eps``.

    Attributes:
        q_proj, k_proj, v_proj (:class:`Linear`, D -> H*E, or E -> E when narrow) and
            out_proj (H*E -> D): the weights, laid out as PyTorch's
            ``MultiheadAttention`` (see :mod:`npformer.interop.pytorch`).
        q_norm, k_norm (:class:`LayerNorm` over E, with ``qk_norm``; else None).
        keep_attention: set True to keep every forward's attention weights in
            ``last_attention`` (as :func:`record_attention` does for a whole model).
        last_attention: the (B, H, T, S) probabilities of the last forward while
            ``keep_attention`` is set, else None.

    The weights of one call: ``y, weights = attention(x, mask=mask, need_weights=True)``,
    weights (B, H, T, S) with rows summing to 1 and 0 at every masked key.
    """

    Linear, LayerNorm = Linear, LayerNorm  # the layers it builds (the fast tier's, its own)
    ops = ops  # the ops it calls: npformer.ops (the fast tier's blocked attention there)

    def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None,
                 bias: bool = True, narrow_heads: bool = False, qk_norm: bool = False, *,
                 norm_eps: float = ops.layernorm.EPS):
        check_size(d_model, "d_model", 1)
        check_size(num_heads, "num_heads", 1)
        check_flag(narrow_heads, "narrow_heads")
        check_flag(qk_norm, "qk_norm")
        check_flag(bias, "bias")
        check_real(norm_eps, "norm_eps", 0.0, inclusive=False)
        if head_dim is not None:
            check_size(head_dim, "head_dim", 1)
        if narrow_heads:
            check_narrow_heads(d_model, num_heads, head_dim)
        if head_dim is None:
            check_heads_divide(d_model, num_heads)
            head_dim = d_model // num_heads
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, head_dim
        self.narrow_heads, self.qk_norm = narrow_heads, qk_norm
        inner = num_heads * head_dim
        # one projection reads a slice and writes one head's (narrow), or reads x, writes all
        width_in, width_out = (head_dim, head_dim) if narrow_heads else (d_model, inner)
        self.q_proj = self.Linear(width_in, width_out, bias)
        self.k_proj = self.Linear(width_in, width_out, bias)
        self.v_proj = self.Linear(width_in, width_out, bias)
        self.out_proj = self.Linear(inner, d_model, bias)
        self.q_norm = self.LayerNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = self.LayerNorm(head_dim, norm_eps) if qk_norm else None
        self.keep_attention = False  # set True to keep the last probabilities (documented above)
        self.last_attention = None  # (B, H, T, S) when keep_attention

    def check_inputs(self, x: Array, context: Array | None = None, mask: Array | None = None,
                     need_weights: bool = False, kv_cache: KVCache | None = None) -> None:
        """x (B, T, D), context (B, S, D), floats of the weights' dtype; mask boolean,
        broadcasting to the scores (B, H, T, S); need_weights True or False; a cache only
        under ``no_grad``."""
        check_flag(need_weights, "need_weights")
        check_float(x, "attention input")
        check_sequence_input(x, self.d_model, "attention input")
        self._check_keys(x, x.shape[0], x.shape[1], context, mask, kv_cache)

    def _check_keys(self, x: Array, batch: int, length: int, context: Array | None,
                    mask: Array | None, kv_cache: KVCache | None) -> None:
        """What queries x of ``batch`` sequences of ``length`` positions attend to: the
        context, the cache and the mask."""
        keys = length
        if context is not None:
            check_float(context, "attention context")
            check_sequence_input(context, self.d_model, "attention context")
            if context.shape[0] != batch:
                raise ValueError(f"attention context has batch {context.shape[0]} but the "
                                 f"queries have batch {batch}")
            keys = context.shape[1]
        check_same_dtype("attention", input=x, context=context, weight=self.q_proj.weight.data)
        if kv_cache is not None:
            check_layer_cache(kv_cache, batch, self.num_heads, self.head_dim)
            keys = kv_cache.length + length if context is None else keys
        if mask is not None:
            check_mask(mask, (batch, self.num_heads, length, keys), "attention mask")

    def forward(self, x: Array, context: Array | None = None, mask: Array | None = None,
                need_weights: bool = False, kv_cache: KVCache | None = None
                ) -> Array | tuple[Array, Array]:
        """x (B, T, D), context (B, S, D) or None (self-attention), mask bool
        broadcasting to (B, H, T, S), True = may attend -> (B, T, D).

        ``need_weights=True``: returns ``(y, weights)``, weights the (B, H, T, S)
        attention probabilities of every head (PyTorch's ``need_weights=True,
        average_attn_weights=False``; average over axis 1 for its default).

        ``kv_cache`` (decoding, under ``no_grad``): self-attention appends the keys and
        values of x's T positions to it and attends over all S cached ones; cross-attention
        fills it from the context on the first call and reuses it after.
        """
        q = through_norm(self.q_norm, self._heads(self.q_proj, x))  # (B, T, D) -> (B, H, T, E)
        k, v = self._keys_and_values(x if context is None else context, kv_cache,
                                     is_self=context is None)  # (B, H, S, E) each
        heads, attention_saved = self.ops.attention_forward(q, k, v, mask)  # (B, H, T, E)
        y = self.out_proj(merge_heads(heads))  # (B, T, H*E) -> (B, T, D)
        self._save((attention_saved, context is None))
        weights = self.ops.attention_weights(q, k, mask) if need_weights or self.keep_attention \
            else None  # (B, H, T, S)
        self.last_attention = weights if self.keep_attention else None
        return (y, weights) if need_weights else y

    def _heads(self, projection: Linear, source: Array) -> Array:
        """source (B, S, D) -> (B, H, S, E) through ``projection``: the standard heads
        project the whole width, then cut the result into heads; narrow heads cut the
        width into the heads' slices, then project each with the one shared map."""
        if self.narrow_heads:
            return swap_heads(projection(slices(source, self.num_heads)))  # (B, S, H, E) ->
        return split_heads(projection(source), self.num_heads)  # (B, S, H*E) -> (B, H, S, E)

    def _heads_backward(self, projection: Linear, dheads: Array) -> Array:
        """dheads (B, H, S, E) -> dsource (B, S, D): :meth:`_heads` in reverse."""
        if self.narrow_heads:
            return unslice(projection.backward(swap_heads(dheads)))  # sums over heads
        return projection.backward(merge_heads(dheads))

    def _keys_and_values(self, source: Array, kv_cache: KVCache | None,
                         is_self: bool) -> tuple[Array, Array]:
        """K and V (B, H, S, E) of ``source`` (B, S, D), through the cache where there is one."""
        if kv_cache is not None and not is_self and kv_cache.length > 0:
            return kv_cache.keys, kv_cache.values  # the memory's, computed on the first call
        k = through_norm(self.k_norm, self._heads(self.k_proj, source))  # (B, S, D) -> (B, H, S, E)
        return self._through_cache(k, self._heads(self.v_proj, source), kv_cache)

    @staticmethod
    def _through_cache(k: Array, v: Array, kv_cache: KVCache | None) -> tuple[Array, Array]:
        """New keys and values (B, H, S, E) appended to the cache where there is one: then
        all it holds."""
        if kv_cache is None:
            return k, v
        kv_cache.append(k, v)
        return kv_cache.keys, kv_cache.values

    def backward(self, dy: Array) -> Array | tuple[Array, Array]:
        """dy (B, T, D) -> dx for self-attention, (dx, dcontext) for cross-attention
        (dcontext (B, S, D))."""
        attention_saved, is_self = self._pop_saved()
        dheads = split_heads(self.out_proj.backward(dy), self.num_heads)  # (B, H, T, E)
        dq, dk, dv = self.ops.attention_backward(dheads, attention_saved)  # (B, H, T|S, E) each
        dx = self._heads_backward(self.q_proj, through_norm_backward(self.q_norm, dq))  # (B, T, D)
        dx_keys = self._heads_backward(self.k_proj, through_norm_backward(self.k_norm, dk))
        dx_values = self._heads_backward(self.v_proj, dv)  # (B, S, D) each: keys', values' input
        if is_self:
            return dx + dx_keys + dx_values  # x fed the queries, the keys and the values
        return dx, dx_keys + dx_values  # the context fed the keys and the values


def through_norm(norm: LayerNorm | None, heads: Array) -> Array:
    """qk_norm: each head's E features through the layer norm (none: as they are)."""
    return heads if norm is None else norm(heads)


def through_norm_backward(norm: LayerNorm | None, dheads: Array) -> Array:
    return dheads if norm is None else norm.backward(dheads)


# --------------------------------------------------------------------------- recording
def attention_layers(model: Module, prefix: str = "") -> Iterator[tuple[str, MultiHeadAttention]]:
    """(dotted name, layer) of every :class:`MultiHeadAttention` inside ``model``, in
    definition order: e.g. ``"blocks.0.self_attn"``, ``"decoder.1.cross_attn"``."""
    if isinstance(model, MultiHeadAttention):
        yield prefix.rstrip("."), model
        return
    for name, child in model._children():
        if isinstance(child, Module):
            yield from attention_layers(child, f"{prefix}{name}.")


class AttentionRecord(Mapping):
    """{layer name: (B, H, T, S) attention weights} of the forward passes run inside
    :func:`record_attention`: each layer's latest.  Layers that have not run are
    absent.  Read it inside the ``with`` block or after: on leaving the block it keeps
    what it holds then."""

    def __init__(self, layers: dict):
        self._layers = layers
        self._kept: dict | None = None
        # what each layer held when this record began (an outer record's): not this one's
        self._before = {name: layer.last_attention for name, layer in layers.items()}

    def _current(self) -> dict:
        if self._kept is not None:
            return self._kept
        return {name: layer.last_attention for name, layer in self._layers.items()
                if layer.last_attention is not None
                and layer.last_attention is not self._before[name]}

    def __getitem__(self, name: str):
        current = self._current()
        if name not in current:
            state = "has not run" if name in self._layers else "is no attention layer"
            raise KeyError(f"{name!r} {state} (recorded: {sorted(current)})")
        return current[name]

    def __iter__(self):
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def _keep(self) -> None:
        self._kept = self._current()


@contextmanager
def record_attention(model: Module) -> Iterator[AttentionRecord]:
    """Record the attention weights of every attention layer of ``model``.

    ::

        with record_attention(model) as weights:
            model(ids)
        weights["blocks.0.self_attn"]   # (B, H, T, T) probabilities of the first layer

    Yields an :class:`AttentionRecord`, ``{layer name: (B, H, T, S)}`` (names as
    :func:`attention_layers` gives them), filled by every forward pass (and cached
    decoding step) run inside the block; a layer run several times keeps its latest.
    On leaving, the layers stop recording and drop what they held; inside another
    ``record_attention`` of the same layers (nested), they go on recording for the outer
    one, which holds every forward of its block, the inner block's included.
    """
    if not isinstance(model, Module):
        raise TypeError(f"record_attention takes a Module (a model or a layer), got "
                        f"{type(model).__name__}")
    layers = dict(attention_layers(model))
    before = {name: layer.keep_attention for name, layer in layers.items()}
    for layer in layers.values():
        if not layer.keep_attention:  # an outer record keeps what it holds
            layer.last_attention = None
        layer.keep_attention = True
    record = AttentionRecord(layers)
    try:
        yield record
    finally:
        record._keep()
        for name, layer in layers.items():
            layer.keep_attention = before[name]
            if not before[name]:
                layer.last_attention = None
