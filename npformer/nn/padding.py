"""Padding: the valid positions of one padded batch of sequences, described once.

A batch of B sequences padded to length T, the first ``valid_lens[b]`` positions of
sequence b real.  One :class:`Padding` holds everything the layers need to know
about it: the valid lengths (B,), the key mask (B, 1, 1, T) that hides padding keys
from attention, and the layout the position-wise layers run in:

* textbook tier: the padded (B, T, D) arrays themselves (``rows`` and ``unrows``
  are the identity; padding positions are computed and their gradients are 0);
* fast tier: the N valid positions packed as rows (N, D) (:class:`npformer.fast.Packing`),
  so linear maps, layer norms and the feed-forward network skip the padding.

The layout is also where outputs are needed: a model whose last layer runs on
``rows`` gives its outputs there, so a loss at the valid positions only
(:meth:`targets`) never computes logits for padding.  Attention, the one layer that
mixes positions, calls ``unrows`` on its projections and ``rows`` on its output.

``rows`` and ``unrows`` are linear and each is the other's transpose (a selection
matrix and its transpose, or the identity): each one's backward is the other.
"""
from __future__ import annotations

from typing import Any

from .. import backend, engine, ops
from ..backend import Array
from ..engine import Packing
from ..validation import check_rank, check_size, check_valid_lengths


class Padding:
    """valid_lens (B,) integers in [0, length]; ``pack``: run the position-wise layers on
    packed rows (default: what the engine's tier does).  B = 0 (no sequences) and
    length = 0 (sequences without positions) describe empty batches."""

    def __init__(self, valid_lens: Array, length: int, pack: bool | None = None,
                 min_length: int = 0):
        check_rank(valid_lens, 1, "valid lengths")
        if not backend.is_integer_array(valid_lens):
            raise TypeError(f"valid lengths must be integers, got dtype {valid_lens.dtype}")
        check_valid_lengths(valid_lens, check_size(length, "length"), min_length)
        self.valid_lens = valid_lens  # (B,)
        self.min_length = min_length  # every valid length is at least this (checked)
        self.batch, self.length = int(valid_lens.shape[0]), int(length)
        self.key_mask = ops.padding_mask(valid_lens, length)  # (B, 1, 1, T), True = valid
        pack = engine.packs_positions() if pack is None else pack
        self.packing = Packing.from_lengths(valid_lens, length) if pack else None

    @classmethod
    def of(cls, valid_lens: Any, length: int, pack: bool | None = None,
           min_length: int = 0) -> Padding:
        """A Padding from valid lengths given as host or backend integers."""
        return cls(backend.asarray(valid_lens), length, pack, min_length)

    def rows(self, x: Array) -> Array:
        """(B, T, ...) -> the position-wise layers' form: rows (N, ...) packed, or (B, T, ...)."""
        return x if self.packing is None else self.packing.pack(x)

    def unrows(self, x: Array) -> Array:
        """The position-wise layers' form -> (B, T, ...), zeros at padding when packed."""
        return x if self.packing is None else self.packing.unpack(x)

    def targets(self, targets: Array) -> Array:
        """targets (B, T) integers -> the targets of the outputs at ``rows``: the valid
        ones (N,) when packed, else (B, T) with padding set to the loss's ignore index."""
        xp = backend.namespace_of(targets)
        if self.packing is not None:
            return xp.take(xp.reshape(targets, (-1,)), self.packing.index, axis=0)  # (N,)
        valid = self.key_mask[:, 0, 0, :]  # (B, T)
        return xp.where(valid, targets, xp.full_like(targets, ops.IGNORE_INDEX))

    def check_rows(self, x: Array, width: int, what: str) -> None:
        """x must be this batch in the layers' form, of the given width."""
        expected = ((self.batch, self.length, width) if self.packing is None
                    else (int(self.packing.index.shape[0]), width))
        if tuple(x.shape) != expected:
            form = ("(B, T, D)" if self.packing is None
                    else "(N, D), the valid positions of the batch as rows")
            raise ValueError(f"{what} must be {form} = {expected}, got shape {tuple(x.shape)}")
