"""Sequence classifier (Bloem, "Transformers from scratch"): the IMDB sentiment model.

    ids (B, T) -> embeddings + positions (+ hashed word pairs) -> N encoder blocks (padding masked)
               -> pool over the valid positions -> linear head -> logits (B, C)

Padding is hidden from attention by the key mask (B, 1, 1, T) and from pooling by the
valid lengths, so it changes no valid position's value.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..backend import Array
from ..nn import Embedding, EncoderBlock, LayerNorm, Linear, Module, evaluating
from ..ops.contracts import check_rank, check_valid_lengths
from .common import (
    TokenEmbedding,
    block_options,
    check_config,
    check_lengths,
    check_weights_fit,
    final_norm,
    model_input,
    valid_lengths,
)


@dataclass
class ClassifierConfig:
    """The shape of a :class:`TransformerClassifier` (saved with its checkpoints).

    vocab_size: token ids are in [0, vocab_size); num_classes: C, the labels (>= 2);
    d_model: width D; num_heads: H (D must be a multiple unless head_dim is set);
    num_layers: encoder blocks; d_ff: feed-forward width; block_size: the longest sequence
    (the positional table's length); dropout: probability in [0, 1); activation: "relu",
    "gelu" or "gelu_tanh"; norm_first: pre-norm blocks (a final layer norm) instead of
    post-norm; head_dim: per-head width E (default D / H); positional: "learned" or
    "sinusoidal"; pooling: how the valid positions become one vector
    (``npformer.ops.POOLINGS``); pad_id: the padding token, ignored by attention and
    pooling; narrow_heads, qk_norm: the attention's options
    (:class:`npformer.nn.MultiHeadAttention`); norm_eps: every layer norm's epsilon;
    bigram_buckets: 0, or K > 0 to add to each position the embedding of its word pair
    (previous id, id) hashed into K rows (:func:`npformer.ops.hashed_bigrams`; fastText's
    bigrams), a table that starts at zero.  Invalid values raise ValueError naming the field.
    """

    vocab_size: int
    num_classes: int = 2
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 256
    block_size: int = 256
    dropout: float = 0.1
    activation: str = "relu"
    norm_first: bool = False
    head_dim: int | None = None
    positional: str = "learned"
    pooling: str = "mean"
    pad_id: int = 0
    narrow_heads: bool = False
    qk_norm: bool = False
    norm_eps: float = ops.layernorm.EPS
    bigram_buckets: int = 0

    def __post_init__(self):
        check_config(self)


class TransformerClassifier(Module):
    """Encoder-only sequence classifier: ids (B, T) -> logits (B, C).

    Token and position embeddings, ``num_layers`` encoder blocks over the valid
    positions, pooling (mean by default) and a linear head (see the module docstring).
    ``model(ids, valid_lens)`` gives logits, :meth:`predict` probabilities;
    ``model.backward(dlogits)`` accumulates the parameter gradients.  Train it with
    :class:`npformer.train.tasks.Classification` (README: "Train on your own data").
    """

    kind = "classifier"
    config_class = ClassifierConfig
    # the layers it builds; the fast tier's model names its own
    TokenEmbedding, Embedding, EncoderBlock, LayerNorm, Linear = \
        TokenEmbedding, Embedding, EncoderBlock, LayerNorm, Linear

    def __init__(self, config: ClassifierConfig):
        check_weights_fit(config)  # before any table is allocated
        self.config = c = config
        self.embed = self.TokenEmbedding(c.vocab_size, c.d_model, c.block_size, c.positional,
                                    c.dropout, scale_by_sqrt_d=False)
        # zero at the start: the pairs add nothing until training finds a use for them
        self.bigrams = self.Embedding(c.bigram_buckets, c.d_model, init_std=0.0) \
            if c.bigram_buckets else None
        self.blocks = [self.EncoderBlock(c.d_model, c.num_heads, c.d_ff, c.dropout, c.activation,
                                         c.norm_first, c.head_dim, **block_options(c))
                       for _ in range(c.num_layers)]
        self.norm = final_norm(c, self.LayerNorm)
        self.head = self.Linear(c.d_model, c.num_classes)

    def check_inputs(self, ids: Array, valid_lens: Array | None = None) -> None:
        ids = model_input(ids, "token ids")
        valid_lens = model_input(valid_lens, "valid_lens", rank=1)
        check_rank(ids, 2, "token ids (batch, positions)")
        if ids.shape[0] > 0 and ids.shape[1] == 0:
            raise ValueError(f"{type(self).__name__} needs at least one position per "
                             f"sequence, got token ids of shape {tuple(ids.shape)} (axis 1, "
                             "the positions, is empty)")
        self.embed.check_inputs(ids)
        check_lengths(ids, valid_lens, "valid_lens", minimum=1)  # pooling needs a token a row

    def forward(self, ids: Array, valid_lens: Array | None = None) -> Array:
        """ids (B, T) token ids, valid_lens (B,) (default: the count of non-pad ids, padding
        at the end of each row) -> logits (B, C).

        ids and valid_lens may be arrays or nested lists.  An empty batch (B = 0) gives
        the empty logits (0, C); sequences without positions (T = 0, B > 0) are refused
        (ValueError): pooling is not defined over no positions."""
        ids, valid_lens = self._ids_and_lengths(ids, valid_lens)  # (B, T), (B,)
        mask = ops.padding_mask(valid_lens, ids.shape[1])  # (B, 1, 1, T): padding keys hidden
        x = self._embedded(ids)  # (B, T, D)
        for block in self.blocks:
            x = block(x, mask)
        if self.norm is not None:
            x = self.norm(x)
        pooled, pool_saved = ops.pool_forward(x, valid_lens, self.config.pooling)  # (B, D)
        self._save(pool_saved)
        return self.head(pooled)  # (B, C)

    def _ids_and_lengths(self, ids: Array, valid_lens: Array | None) -> tuple[Array, Array]:
        """forward's ids (B, T) and valid lengths (B,) as backend arrays: lengths given were
        checked at the door (check_inputs); lengths counted from the ids are checked here
        (pooling needs a token a row)."""
        ids, given = model_input(ids, "token ids"), model_input(valid_lens, "valid_lens", rank=1)
        valid_lens = valid_lengths(ids, given, self.config.pad_id)  # (B,)
        if given is None:
            check_valid_lengths(valid_lens, ids.shape[1], 1)
        return ids, valid_lens

    def _embedded(self, ids: Array) -> Array:
        """ids (B, T) -> the blocks' input (B, T, D): token and position embeddings, plus
        the embeddings of the hashed word pairs where the config asks for them."""
        x = self.embed(ids)  # (B, T, D)
        if self.bigrams is not None:
            x = x + self.bigrams(ops.hashed_bigrams(ids, self.config.bigram_buckets))
        return x

    def _embedded_backward(self, dx: Array) -> None:
        """dx (B, T, D) -> None: the sum's gradient reaches both tables unchanged."""
        if self.bigrams is not None:
            self.bigrams.backward(dx)
        return self.embed.backward(dx)

    def backward(self, dlogits: Array) -> None:
        """dlogits (B, C) -> None (token ids are not differentiable)."""
        dx = ops.pool_backward(self.head.backward(dlogits), self._pop_saved())  # (B, T, D)
        if self.norm is not None:
            dx = self.norm.backward(dx)
        self._gradients_final(self.head, self.norm)
        for block in reversed(self.blocks):
            dx = block.backward(dx)
            self._gradients_final(block)
        return self._embedded_backward(dx)

    def predict(self, ids: Array, valid_lens: Array | None = None) -> Array:
        """Class probabilities (B, C), without keeping anything for a backward (the
        arguments and empty axes as in :meth:`forward`: B = 0 gives (0, C))."""
        with evaluating(self):
            probs, _ = ops.softmax_forward(self.forward(ids, valid_lens), axis=-1)
        return probs
