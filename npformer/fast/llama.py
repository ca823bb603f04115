"""The Llama-shaped model of the fast tier: the textbook's (:mod:`npformer.nn.llama`,
:mod:`npformer.models.llama`) on this tier's layers and ops.

Each class is a subclass of its textbook class that names this tier's layers and ops and
nothing else: the same equations, parameters, names and initial weights.  What runs
faster is below them: the projections (:class:`.layers.Linear`), the RMS norms and the
gated SiLU as compiled kernels, rotary positions in one compiled pass, blocked attention
over the repeated key/value heads, the loss fused with its gradient, and every weight in
one flat buffer that the optimizer adopts.  One method of its own: where nothing is
recorded (``no_grad``), :class:`LlamaBlock` runs as one compiled kernel
(:mod:`npformer.fast.compiled`).

Tested equal to the textbook classes in ``tests/test_fast_layers.py``.
"""
from __future__ import annotations

from types import SimpleNamespace

from .. import models, nn
from ..backend import Array
from ..nn import KVCache
from . import compiled, grouped_attention, layers, rotary, swiglu
from .models import _FastModel

# The ops the Llama layers call (``self.ops``, npformer.ops in the textbook tier): this tier's.
llama_ops = SimpleNamespace(
    swiglu_forward=swiglu.swiglu_forward, swiglu_backward=swiglu.swiglu_backward,
    rotary_forward=rotary.rotary_forward, rotary_backward=rotary.rotary_backward,
    grouped_attention_forward=grouped_attention.grouped_attention_forward,
    grouped_attention_backward=grouped_attention.grouped_attention_backward)


class SwiGLUFeedForward(nn.SwiGLUFeedForward):
    __doc__ = nn.SwiGLUFeedForward.__doc__
    Linear, ops = layers.Linear, llama_ops


class GroupedQueryAttention(nn.GroupedQueryAttention):
    __doc__ = nn.GroupedQueryAttention.__doc__
    Linear, RMSNorm, ops = layers.Linear, layers.RMSNorm, llama_ops


class LlamaBlock(nn.LlamaBlock):
    __doc__ = nn.LlamaBlock.__doc__
    GroupedQueryAttention, SwiGLUFeedForward, RMSNorm = \
        GroupedQueryAttention, SwiGLUFeedForward, layers.RMSNorm

    def forward(self, x: Array, cos: Array, sin: Array, mask: Array | None = None,
                kv_cache: KVCache | None = None) -> Array:
        """As the textbook block's; where nothing is recorded, one compiled kernel where it
        takes the inputs (:func:`npformer.fast.compiled.llama_block_forward`)."""
        y = compiled.llama_block_forward(self, x, cos, sin, mask, kv_cache)
        return super().forward(x, cos, sin, mask, kv_cache) if y is None else y


class LlamaCausalLM(_FastModel, models.LlamaCausalLM):
    __doc__ = models.LlamaCausalLM.__doc__
    LlamaBlock, RMSNorm = LlamaBlock, layers.RMSNorm
