"""The textbook tier: the mathematics of the Transformer as pure forward/backward pairs.

Every op is a pair ``name_forward(inputs...) -> (output, saved)`` and
``name_backward(d_output, saved) -> gradients``; the forward keeps in its saved exactly
what the backward needs.  Each module's docstring holds the derivation;
``docs/derivations.md`` walks through them line by line.  An op's body is that derivation
only: its contract (shapes, dtypes, masks, token ids, the upstream gradient, whose saved it
takes) is named on its decorator and checked once, at the door, by
:mod:`npformer.ops.contracts` (``tools/count_checks.py`` keeps it so).

Nothing here exists only for speed: the fast tier (:mod:`npformer.fast`) holds the blocked,
fused and in-place versions, each tested equal to its op here; a program names the tier it
runs where it builds its model and optimizer.

Shape letters used throughout: B batch, T query (target) positions, S key (source)
positions, H heads, E per-head query/key width, F per-head value width, D model width, V
vocabulary, N flattened rows.
"""
from .activations import activation, gelu_backward, gelu_forward, relu_backward, relu_forward
from .attention import attention_backward, attention_forward, attention_weights
from .dropout import dropout_backward, dropout_forward
from .embedding import embedding_backward, embedding_forward, embedding_rows, hashed_bigrams
from .grouped_attention import grouped_attention_backward, grouped_attention_forward
from .layernorm import layernorm_backward, layernorm_forward
from .linear import linear_backward, linear_forward
from .losses import (
    IGNORE_INDEX,
    cross_entropy_backward,
    cross_entropy_forward,
    cross_entropy_with_gradient,
)
from .masks import causal_mask, padding_mask
from .pooling import POOLINGS, pool_backward, pool_forward, valid_rows_backward, valid_rows_forward
from .positional import add_positions_backward, add_positions_forward, sinusoidal_table
from .rmsnorm import rmsnorm_backward, rmsnorm_forward
from .rotary import rotary_backward, rotary_forward, rotary_table
from .softmax import log_softmax_backward, log_softmax_forward, softmax_backward, softmax_forward
from .swiglu import swiglu_backward, swiglu_forward

__all__ = [name for name in dir() if not name.startswith("_")]
