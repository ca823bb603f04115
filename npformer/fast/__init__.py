"""The fast tier: whole implementations of the textbook's ops, layers, models and
optimizers, computed for speed, each tested equal to its textbook one
(docs/derivations.md Part II).

The ops (the same names and arguments as :mod:`npformer.ops`, tested equal in
``tests/test_fast_equals_textbook.py``), each module with its numba kernels beside the
textbook op it must equal (``python bench/kernels.py --op NAME`` checks and times one):
:mod:`.attention`, :mod:`.losses`, :mod:`.softmax`, :mod:`.activations`, :mod:`.layernorm`,
:mod:`.rmsnorm`, :mod:`.swiglu`, :mod:`.rotary`, :mod:`.grouped_attention`, :mod:`.dropout`,
:mod:`.embedding`, :mod:`.linear` and :mod:`.adamw`; the numba set-up is :mod:`.compiler`
and the shared numerics (exp, erfc) :mod:`.numerics`.

The classes (subclasses of the textbook's, the same parameters and initialisation,
tested equal in ``tests/test_fast_layers.py``): :mod:`.layers`, :mod:`.blocks` (on packed
rows, :mod:`.packing`, recomputing their widest activations, :mod:`.recompute`),
:mod:`.models` (weights in one flat buffer, :mod:`npformer.nn.flat`), :mod:`.llama` and
:mod:`.optim`.  Where nothing is recorded (``no_grad``), each encoder and Llama block, and
a causal LM's whole stack, runs as one compiled kernel: :mod:`.compiled`.

Nothing chooses this tier behind a reader's back: a program names the fast classes where
it builds them (``fast.CausalLM(config)``, ``fast.AdamW(params)``; the demos' ``--tier``
option, :func:`npformer.checkpoint.build_model`'s ``tier``), and a fast model's layers
and loss are named on its class (``CausalLM.EncoderBlock``).
"""
from .. import ops as _textbook
from ..nn.flat import FlatParameters, flat_buffer_of
from . import blocks, layers, llama, models, optim
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
from .grouped_attention import grouped_attention_backward, grouped_attention_forward
from .layernorm import layernorm_backward, layernorm_forward
from .linear import linear_backward, linear_forward
from .llama import LlamaCausalLM
from .losses import cross_entropy_backward, cross_entropy_forward, cross_entropy_with_gradient
from .models import CausalLM, Seq2SeqTransformer, TransformerClassifier
from .optim import Adam, AdamW, clip_grad_norm, global_grad_norm
from .packing import Packing
from .rmsnorm import rmsnorm_backward, rmsnorm_forward
from .rotary import rotary_backward, rotary_forward
from .softmax import softmax_backward, softmax_forward
from .swiglu import swiglu_backward, swiglu_forward

FAST_OPS = ("attention_forward", "attention_backward", "linear_forward", "linear_backward",
            "cross_entropy_forward", "cross_entropy_backward", "cross_entropy_with_gradient",
            "softmax_forward", "softmax_backward", "relu_forward", "relu_backward",
            "gelu_forward", "gelu_backward", "layernorm_forward", "layernorm_backward",
            "activation", "dropout_forward", "dropout_backward", "embedding_backward",
            "rmsnorm_forward", "rmsnorm_backward", "swiglu_forward", "swiglu_backward",
            "rotary_forward", "rotary_backward", "grouped_attention_forward",
            "grouped_attention_backward")

# The textbook ops, the same functions in this tier.
IGNORE_INDEX = _textbook.IGNORE_INDEX
POOLINGS = _textbook.POOLINGS
add_positions_backward = _textbook.add_positions_backward
add_positions_forward = _textbook.add_positions_forward
attention_weights = _textbook.attention_weights
causal_mask = _textbook.causal_mask
embedding_forward = _textbook.embedding_forward
embedding_rows = _textbook.embedding_rows
hashed_bigrams = _textbook.hashed_bigrams
log_softmax_backward = _textbook.log_softmax_backward
log_softmax_forward = _textbook.log_softmax_forward
padding_mask = _textbook.padding_mask
pool_backward = _textbook.pool_backward
pool_forward = _textbook.pool_forward
rotary_table = _textbook.rotary_table
sinusoidal_table = _textbook.sinusoidal_table
valid_rows_backward = _textbook.valid_rows_backward
valid_rows_forward = _textbook.valid_rows_forward


MODELS = {cls.kind: cls for cls in (TransformerClassifier, CausalLM, Seq2SeqTransformer,
                                    LlamaCausalLM)}

__all__ = [name for name in dir() if not name.startswith("_")]
