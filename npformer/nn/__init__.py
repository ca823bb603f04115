"""Layers: modules with parameters, a forward that caches and a backward that accumulates."""
from .attention import MultiHeadAttention, merge_heads, split_heads
from .blocks import DecoderBlock, EncoderBlock, FeedForward, ResidualNorm
from .cache import BlockCache, DecodingCache, KVCache
from .layers import (Activation, Dropout, Embedding, LayerNorm, LearnedPositionalEmbedding,
                     Linear, SinusoidalPositionalEncoding)
from .module import (FlatParameters, Module, Parameter, evaluating, flat_parameters_of,
                     grad_enabled, no_grad, set_grad_enabled)
from .padding import Padding

__all__ = [name for name in dir() if not name.startswith("_")]
