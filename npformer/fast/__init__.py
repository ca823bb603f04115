"""The fast tier: the ops of :mod:`npformer.ops`, computed for speed.

Each name here is the same function as the textbook op of the same name (same
arguments, same results up to rounding, same gradients), tested equal to it in
``tests/test_fast_equals_textbook.py``.  What exists only for speed lives here:

* :mod:`.attention`: blocked attention with the stored log-sum-exp and recomputed P
  (``block_scores`` an argument);
* :mod:`.losses`: softmax and cross-entropy fused (no one-hot, no log-probabilities);
* :mod:`.softmax`: in-place variants (``overwrite_input``);
* :mod:`.activations`: ReLU's backward from its output, sign(y), in place; the exact
  GELU forward and backward as compiled kernels (and ``activation``, the tier's table
  of activations);
* :mod:`.layernorm`: layer norm forward and backward, one compiled kernel each;
* :mod:`.kernels`: the numba kernels (GELU, layer norm, AdamW over one flat buffer),
  with NumPy statements as the fallback where numba is missing;
* :mod:`.dropout`: the keep mask cached as booleans, not as a float array;
* :mod:`.embedding`: the backward's scatter-add as one compiled loop (the forward is
  the textbook's gather);
* :mod:`.linear`: the rows flattened into one matrix product, the bias added in place;
* :mod:`.packing`: the valid positions of a padded batch as rows (:class:`Packing`),
  which :class:`npformer.nn.Padding` uses in this tier;
* :mod:`.inplace`: the in-place kernels (``exp_into``, ``add_at_columns``, ``scatter_rows``).

Every op without a fast version is the textbook op itself, bound by name below (one
function, so the two tiers can never drift apart, and go-to-definition finds it).
"""
from .. import ops as _textbook
from .activations import (
    activation,
    activation_output,
    gelu_backward,
    gelu_forward,
    relu_backward,
    relu_forward,
)
from .attention import BLOCK_SCORES, attention_backward, attention_forward
from .dropout import dropout_backward, dropout_forward
from .embedding import embedding_backward
from .layernorm import layernorm_backward, layernorm_forward
from .linear import linear_backward, linear_forward
from .losses import cross_entropy_backward, cross_entropy_forward
from .packing import Packing
from .softmax import softmax_backward, softmax_forward

FAST_OPS = ("attention_forward", "attention_backward", "linear_forward", "linear_backward",
            "cross_entropy_forward", "cross_entropy_backward", "softmax_forward",
            "softmax_backward", "relu_forward", "relu_backward", "gelu_forward", "gelu_backward",
            "layernorm_forward", "layernorm_backward", "activation", "activation_output",
            "dropout_forward", "dropout_backward", "embedding_backward")

# The textbook ops, the same functions in this tier.
IGNORE_INDEX = _textbook.IGNORE_INDEX
POOLINGS = _textbook.POOLINGS
add_positions_backward = _textbook.add_positions_backward
add_positions_forward = _textbook.add_positions_forward
attention_weights = _textbook.attention_weights
causal_mask = _textbook.causal_mask
embedding_forward = _textbook.embedding_forward
layernorm_output = _textbook.layernorm_output  # gamma x_hat + beta: one NumPy statement
log_softmax_backward = _textbook.log_softmax_backward
log_softmax_forward = _textbook.log_softmax_forward
padding_mask = _textbook.padding_mask
pool_backward = _textbook.pool_backward
pool_forward = _textbook.pool_forward
sinusoidal_table = _textbook.sinusoidal_table
