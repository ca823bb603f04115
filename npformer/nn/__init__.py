"""Layers: modules with parameters, a forward that caches and a backward that accumulates.

Attention weights: ``MultiHeadAttention(...)(x, need_weights=True)`` returns them with
the output; ``with record_attention(model) as weights: model(ids)`` collects every
attention layer's, ``{"blocks.0.self_attn": (B, H, T, S), ...}``.
"""
from .attention import (
                        AttentionRecord,
                        MultiHeadAttention,
                        attention_layers,
                        merge_heads,
                        record_attention,
                        split_heads,
)
from .blocks import DecoderBlock, EncoderBlock, FeedForward, NormAndDropout
from .cache import BlockCache, DecodingCache, KVCache
from .layers import (
                        Activation,
                        Dropout,
                        Embedding,
                        LayerNorm,
                        LearnedPositionalEmbedding,
                        Linear,
                        RMSNorm,
                        SinusoidalPositionalEncoding,
)
from .llama import GroupedQueryAttention, LlamaBlock, SwiGLUFeedForward
from .module import (
                        Module,
                        Parameter,
                        evaluating,
                        grad_enabled,
                        no_grad,
                        set_grad_enabled,
)

__all__ = [name for name in dir() if not name.startswith("_")]
