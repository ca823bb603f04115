"""The fast tier: whole implementations of the textbook's ops, layers, models and
optimizers, computed for speed, each tested equal to its textbook one.

The ops (the same names and arguments as :mod:`npformer.ops`, tested equal in
``tests/test_fast_equals_textbook.py``):

* :mod:`.attention`: blocked attention with the stored log-sum-exp and recomputed P;
* :mod:`.losses`: softmax and cross-entropy fused (no one-hot, no log-probabilities);
* :mod:`.softmax`: in-place variants (``overwrite_input``);
* :mod:`.activations`: ReLU's backward from its output; both GELUs as compiled kernels;
* :mod:`.layernorm`: layer norm forward and backward, one compiled kernel each;
* :mod:`.dropout`: the keep mask cached as booleans, not as a float array;
* :mod:`.embedding`: the backward's scatter-add as one compiled loop;
* :mod:`.linear`: the rows flattened into one matrix product, the bias added in place;
  ``keep_input=False`` keeps no input (the caller passes it to the backward again);
* :mod:`.adamw`: Adam(W)'s update over one flat buffer in one compiled pass, and on CuPy
  as one fused kernel per parameter.

Each op's numba kernels sit in its own module, beside the textbook op it must equal
(``python bench/kernels.py --op NAME`` checks one against it and times it); the numba
set-up is :mod:`.compiler` (NumPy statements run where numba is missing) and the shared
numerics (exp, erfc) :mod:`.numerics`.

The classes (subclasses of the textbook's, the same parameters and initialisation,
tested equal in ``tests/test_fast_layers.py``):

* :mod:`.layers`: Linear, LayerNorm, Embedding, Dropout, Activation on the fast ops,
  with what recomputation needs (:mod:`.recompute`);
* :mod:`.blocks`: the attention layer, the feed-forward network and the blocks, on
  packed rows (:mod:`.packing`), recomputing their widest activations;
* :mod:`.models`: the three models, their weights in one flat buffer (:mod:`.flat`);
* :mod:`.optim`: Adam and AdamW over that buffer, and the gradient norm in one pass.

:mod:`npformer.engine` chooses between the tiers: importing this package registers each
implementation here with it (below), so that in the fast tier ``CausalLM(config)`` is
this tier's ``CausalLM``.
"""
import sys as _sys

from .. import engine as _engine
from .. import models as _models
from .. import nn as _nn
from .. import ops as _textbook
from .. import optim as _optim
from ..backend import Array
from . import blocks, layers, models, optim
from .activations import (
    activation,
    gelu_backward,
    gelu_forward,
    relu_backward,
    relu_forward,
)
from .attention import BLOCK_SCORES, attention_backward, attention_forward
from .dropout import dropout_backward, dropout_forward
from .embedding import embedding_backward
from .flat import FlatParameters, flat_buffer_of
from .layernorm import layernorm_backward, layernorm_forward
from .linear import linear_backward, linear_forward
from .losses import cross_entropy_backward, cross_entropy_forward
from .packing import Packing
from .softmax import softmax_backward, softmax_forward

FAST_OPS = ("attention_forward", "attention_backward", "linear_forward", "linear_backward",
            "cross_entropy_forward", "cross_entropy_backward", "cross_entropy_with_gradient",
            "softmax_forward", "softmax_backward", "relu_forward", "relu_backward",
            "gelu_forward", "gelu_backward", "layernorm_forward", "layernorm_backward",
            "activation", "dropout_forward", "dropout_backward", "embedding_backward")

# The textbook ops, the same functions in this tier.
IGNORE_INDEX = _textbook.IGNORE_INDEX
POOLINGS = _textbook.POOLINGS
add_positions_backward = _textbook.add_positions_backward
add_positions_forward = _textbook.add_positions_forward
attention_weights = _textbook.attention_weights
causal_mask = _textbook.causal_mask
embedding_forward = _textbook.embedding_forward
hashed_bigrams = _textbook.hashed_bigrams
log_softmax_backward = _textbook.log_softmax_backward
log_softmax_forward = _textbook.log_softmax_forward
padding_mask = _textbook.padding_mask
pool_backward = _textbook.pool_backward
pool_forward = _textbook.pool_forward
sinusoidal_table = _textbook.sinusoidal_table
valid_rows_backward = _textbook.valid_rows_backward
valid_rows_forward = _textbook.valid_rows_forward


def cross_entropy_with_gradient(logits: Array, targets: Array, dloss: float = 1.0,
                                ignore_index: int = IGNORE_INDEX,
                                label_smoothing: float = 0.0) -> tuple[Array, Array]:
    """:func:`npformer.ops.cross_entropy_with_gradient`, the gradient written over the
    (N, V) array the forward kept (the caller hands over logits it no longer reads): the
    logits themselves where the compiled kernels run, the forward's softmax elsewhere."""
    loss, cache = cross_entropy_forward(logits, targets, ignore_index, label_smoothing)
    return loss, cross_entropy_backward(dloss, cache, overwrite_logits=True)


IMPLEMENTATIONS = {  # textbook -> this tier's: what npformer.engine.implementation returns
    _textbook: _sys.modules[__name__],
    _nn.Linear: layers.Linear, _nn.LayerNorm: layers.LayerNorm,
    _nn.Embedding: layers.Embedding, _nn.Dropout: layers.Dropout,
    _nn.LearnedPositionalEmbedding: layers.LearnedPositionalEmbedding,
    _nn.Activation: layers.Activation,
    _nn.MultiHeadAttention: blocks.MultiHeadAttention, _nn.FeedForward: blocks.FeedForward,
    _nn.EncoderBlock: blocks.EncoderBlock, _nn.DecoderBlock: blocks.DecoderBlock,
    _models.TransformerClassifier: models.TransformerClassifier,
    _models.CausalLM: models.CausalLM, _models.Seq2SeqTransformer: models.Seq2SeqTransformer,
    _optim.Adam: optim.Adam, _optim.AdamW: optim.AdamW,
    _optim.clip_grad_norm: optim.clip_grad_norm, _optim.global_grad_norm: optim.global_grad_norm,
}
for _textbook_one, _fast_one in IMPLEMENTATIONS.items():
    _engine.register(_textbook_one, _fast_one)

__all__ = [name for name in dir() if not name.startswith("_")]
