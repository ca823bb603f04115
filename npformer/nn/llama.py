r"""The layers of Llama-shaped models (Llama 3, SmolLM2, TinyLlama, Qwen2, Qwen3), as
Hugging Face's ``LlamaDecoderLayer``, ``Qwen2DecoderLayer`` and ``Qwen3DecoderLayer``
compute them: each layer's forward calls the ops, its backward their backwards in reverse.

Shapes: B batch, T query positions, S key positions (the cached ones and T), D model width
(``d_model``), H query heads, $H_{kv}$ key/value heads, E per-head width (``head_dim``, not
necessarily D / H), $D_{ff}$ the feed-forward width (``d_ff``).

:class:`SwiGLUFeedForward`: $y = W_{down}\,(\mathrm{silu}(W_{gate}\,x) \odot W_{up}\,x)$,
no biases (:mod:`npformer.ops.swiglu`).  Backward: the down projection's, SwiGLU's, and
the two input projections' gradients added, since x fed both.

:class:`GroupedQueryAttention`: projections of x into H query heads and $H_{kv}$
key/value heads (optional q/k/v biases, as Qwen2's), an optional RMS norm over each
head's E features of the queries and of the keys (QK-norm, Qwen3's; one norm for the
queries and one for the keys, shared by the heads), the rotation of queries and keys by
their positions (:mod:`npformer.ops.rotary`; the model passes the tables), grouped-query
attention (:mod:`npformer.ops.grouped_attention`) and the output projection:

    $Q = \mathrm{rot}(\mathrm{N_q}(\mathrm{heads}(x W_q + b_q)))$,
    $K = \mathrm{rot}(\mathrm{N_k}(\mathrm{heads}(x W_k + b_k)))$,
    $V = \mathrm{heads}(x W_v + b_v)$
    $y = \mathrm{merge}(\mathrm{GQA}(Q, K, V, M))\, W_o$

Backward, in reverse: $\bar Q, \bar K, \bar V$ from the attention's backward (each key
and value head summing its group's), then the rotations' (the turn by the negative
angle), the norms', and the three projections' gradients added into $\bar x$.

A :class:`npformer.nn.KVCache` (decoding, under ``no_grad``) receives the rotated keys and
the values of the $H_{kv}$ heads only: H / $H_{kv}$ times less than multi-head attention's.

:class:`LlamaBlock`: pre-norm residual block, RMS norms,
$h = x + \mathrm{attn}(\mathrm{N_1}(x))$, $y = h + \mathrm{ffn}(\mathrm{N_2}(h))$.
"""
from __future__ import annotations

from .. import backend, ops
from ..backend import Array
from ..ops.contracts import (
    check_flag,
    check_float,
    check_heads_divide,
    check_mask,
    check_real,
    check_rotary_width,
    check_same_dtype,
    check_sequence_input,
    check_size,
    rotary_inputs,
)
from .attention import merge_heads, split_heads, through_norm, through_norm_backward
from .cache import KVCache, check_layer_cache
from .layers import Linear, RMSNorm
from .module import Module


class SwiGLUFeedForward(Module):
    """x (..., D) -> down_proj(silu(gate_proj(x)) * up_proj(x)) (..., D); three Linear
    layers without bias: gate_proj and up_proj D -> d_ff, down_proj d_ff -> D."""

    Linear = Linear  # the layers it builds
    ops = ops  # the ops it calls: npformer.ops (npformer.fast in the fast tier)

    def __init__(self, d_model: int, d_ff: int):
        check_size(d_model, "d_model", 1)
        check_size(d_ff, "d_ff", 1)
        self.d_model = d_model
        self.gate_proj = self.Linear(d_model, d_ff, bias=False)
        self.up_proj = self.Linear(d_model, d_ff, bias=False)
        self.down_proj = self.Linear(d_ff, d_model, bias=False)

    def check_inputs(self, x: Array) -> None:
        check_float(x, "feed-forward input")
        check_same_dtype("feed-forward", input=x, weight=self.gate_proj.weight.data)
        if x.ndim < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"feed-forward input must have width (last axis) {self.d_model}, "
                             f"got shape {tuple(x.shape)}")

    def forward(self, x: Array) -> Array:
        """x (..., D) -> (..., D)."""
        h, saved = self.ops.swiglu_forward(self.gate_proj(x), self.up_proj(x))  # (..., d_ff)
        self._save(saved)
        return self.down_proj(h)

    def backward(self, dy: Array) -> Array:
        """dy (..., D) -> dx (..., D): x fed the gate and the up projection."""
        dgate, dup = self.ops.swiglu_backward(self.down_proj.backward(dy), self._pop_saved())
        return self.gate_proj.backward(dgate) + self.up_proj.backward(dup)


def check_kv_heads(num_heads: int, num_kv_heads: int,
                   heads_name: str = "num_heads",
                   kv_heads_name: str = "num_kv_heads") -> None:
    """num_kv_heads in [1, num_heads], dividing it: each key/value head serves a group of
    num_heads / num_kv_heads query heads (one place for the rule; the two names are the
    values as the caller's user knows them: a config's fields, a demo's options)."""
    if num_heads % num_kv_heads:
        divisors = [g for g in range(1, num_heads + 1) if num_heads % g == 0]
        raise ValueError(f"{heads_name} {num_heads} is not a multiple of {kv_heads_name} "
                         f"{num_kv_heads}: each key/value head serves a group of query heads; "
                         f"{kv_heads_name} must be one of {divisors}")


class GroupedQueryAttention(Module):
    """Llama's self-attention: ``num_heads`` query heads of width ``head_dim`` (default
    D / H) over ``num_kv_heads`` key/value heads (default H; 1: multi-query), rotary
    positions, an optional QK-norm (``qk_norm``, RMS norms of epsilon ``norm_eps``) and
    optional biases: ``qkv_bias`` on the q, k and v projections (Qwen2), ``output_bias``
    on the output projection (Llama's ``attention_bias`` sets both).

    Attributes: q_proj (D -> H*E), k_proj and v_proj (D -> Hkv*E), out_proj (H*E -> D)
    (:class:`Linear`, weights (in, out)); q_norm, k_norm (:class:`RMSNorm` over E) or None.
    """

    Linear, RMSNorm = Linear, RMSNorm  # the layers it builds
    ops = ops  # the ops it calls: npformer.ops (npformer.fast in the fast tier)

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, qkv_bias: bool = False,
                 output_bias: bool = False, qk_norm: bool = False,
                 norm_eps: float = ops.rmsnorm.EPS):
        check_size(d_model, "d_model", 1)
        check_size(num_heads, "num_heads", 1)
        num_kv_heads = num_heads if num_kv_heads is None else \
            check_size(num_kv_heads, "num_kv_heads", 1)
        check_kv_heads(num_heads, num_kv_heads)
        if head_dim is None:
            check_heads_divide(d_model, num_heads)
            head_dim = d_model // num_heads
        check_rotary_width(head_dim)
        check_flag(qkv_bias, "qkv_bias")
        check_flag(output_bias, "output_bias")
        check_flag(qk_norm, "qk_norm")
        check_real(norm_eps, "norm_eps", 0.0, inclusive=False)
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.q_proj = self.Linear(d_model, num_heads * head_dim, qkv_bias)
        self.k_proj = self.Linear(d_model, num_kv_heads * head_dim, qkv_bias)
        self.v_proj = self.Linear(d_model, num_kv_heads * head_dim, qkv_bias)
        self.out_proj = self.Linear(num_heads * head_dim, d_model, output_bias)
        self.q_norm = self.RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = self.RMSNorm(head_dim, norm_eps) if qk_norm else None

    def check_inputs(self, x: Array, cos: Array, sin: Array, mask: Array | None = None,
                     kv_cache: KVCache | None = None) -> None:
        """x (B, T, D) of the weights' dtype; cos and sin (T, E) or (B or 1, T, E) of x's
        dtype; mask boolean broadcasting to (B, H, T, S); a cache only under no_grad."""
        check_float(x, "attention input")
        check_sequence_input(x, self.d_model, "attention input")
        check_same_dtype("attention", input=x, weight=self.q_proj.weight.data)
        batch, length = x.shape[0], x.shape[1]
        rotary_inputs(  # the tables fit the queries (B, H, T, E)
            _shape_only(x, (batch, self.num_heads, length, self.head_dim)), cos, sin)
        keys = length
        if kv_cache is not None:
            check_layer_cache(kv_cache, batch, self.num_kv_heads, self.head_dim)
            keys += kv_cache.length
        if mask is not None:
            check_mask(mask, (batch, self.num_heads, length, keys), "attention mask")

    def forward(self, x: Array, cos: Array, sin: Array, mask: Array | None = None,
                kv_cache: KVCache | None = None) -> Array:
        """x (B, T, D); cos, sin (T, E) or (B, T, E), the rotary tables of x's positions;
        mask bool broadcasting to (B, H, T, S), True = may attend -> (B, T, D).

        ``kv_cache`` (decoding, under ``no_grad``): the rotated keys and the values of x's T
        positions are appended to it (Hkv heads) and the queries attend over all S."""
        q = through_norm(self.q_norm, split_heads(self.q_proj(x), self.num_heads))  # (B,H,T,E)
        k = through_norm(self.k_norm, split_heads(self.k_proj(x), self.num_kv_heads))
        v = split_heads(self.v_proj(x), self.num_kv_heads)  # (B, Hkv, T, E)
        q, q_turn = self.ops.rotary_forward(q, cos, sin)  # (B, H, T, E)
        k, k_turn = self.ops.rotary_forward(k, cos, sin)  # (B, Hkv, T, E)
        if kv_cache is not None:
            kv_cache.append(k, v)
            k, v = kv_cache.keys, kv_cache.values  # (B, Hkv, S, E)
        heads, attention_saved = self.ops.grouped_attention_forward(q, k, v, mask)  # (B,H,T,E)
        self._save((q_turn, k_turn, attention_saved))
        return self.out_proj(merge_heads(heads))  # (B, T, H*E) -> (B, T, D)

    def backward(self, dy: Array) -> Array:
        """dy (B, T, D) -> dx (B, T, D): x fed the queries, the keys and the values."""
        q_turn, k_turn, attention_saved = self._pop_saved()
        dheads = split_heads(self.out_proj.backward(dy), self.num_heads)  # (B, H, T, E)
        dq, dk, dv = self.ops.grouped_attention_backward(dheads, attention_saved)  # H, Hkv, Hkv
        dq = through_norm_backward(self.q_norm, self.ops.rotary_backward(dq, q_turn))
        dk = through_norm_backward(self.k_norm, self.ops.rotary_backward(dk, k_turn))
        return (self.q_proj.backward(merge_heads(dq)) + self.k_proj.backward(merge_heads(dk))
                + self.v_proj.backward(merge_heads(dv)))  # (B, T, D) each


def _shape_only(x: Array, shape: tuple) -> Array:
    """A stand-in of ``shape`` and x's dtype for a contract that reads shapes and dtypes
    (no data: a zero-strided broadcast of one element)."""
    xp = backend.namespace_of(x)
    return xp.broadcast_to(xp.zeros((1,) * len(shape), dtype=x.dtype,
                                    device=backend.device_of(x)), shape)


class LlamaBlock(Module):
    """Pre-norm block of Llama's decoder: x (B, T, D) -> h = x + attn(norm(x)),
    h + ffn(norm(h)), with RMS norms of epsilon ``norm_eps`` (Llama's 1e-6 or 1e-5)."""

    GroupedQueryAttention, SwiGLUFeedForward, RMSNorm = \
        GroupedQueryAttention, SwiGLUFeedForward, RMSNorm  # the layers it builds

    def __init__(self, d_model: int, num_heads: int, d_ff: int,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 qkv_bias: bool = False, output_bias: bool = False, qk_norm: bool = False,
                 norm_eps: float = ops.rmsnorm.EPS):
        self.attn_norm = self.RMSNorm(d_model, norm_eps)
        self.self_attn = self.GroupedQueryAttention(d_model, num_heads, num_kv_heads, head_dim,
                                                    qkv_bias, output_bias, qk_norm, norm_eps)
        self.ffn_norm = self.RMSNorm(d_model, norm_eps)
        self.ffn = self.SwiGLUFeedForward(d_model, d_ff)

    def check_inputs(self, x: Array, cos: Array, sin: Array, mask: Array | None = None,
                     kv_cache: KVCache | None = None) -> None:
        self.self_attn.check_inputs(x, cos, sin, mask, kv_cache)

    def forward(self, x: Array, cos: Array, sin: Array, mask: Array | None = None,
                kv_cache: KVCache | None = None) -> Array:
        """x (B, T, D), the rotary tables, mask, cache as :class:`GroupedQueryAttention`'s."""
        h = x + self.self_attn(self.attn_norm(x), cos, sin, mask, kv_cache)  # (B, T, D)
        return h + self.ffn(self.ffn_norm(h))

    def backward(self, dy: Array) -> Array:
        """dy (B, T, D) -> dx (B, T, D): each residual passes the gradient through as well."""
        dh = dy + self.ffn_norm.backward(self.ffn.backward(dy))
        return dh + self.attn_norm.backward(self.self_attn.backward(dh))
