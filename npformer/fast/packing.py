r"""Packing (fast tier, docs/derivations.md §22): the valid positions of a padded batch as
rows, and back.  With X the batch as (B*T, D) rows and ``index`` (N,) the flat positions
$bT + t$, $t < n_b$, of the valid tokens:

    pack:    $R = X_{\text{index}}$                         (N, D)
    unpack:  $X = 0$, then $X_{\text{index}} = R$           (B*T, D), zeros at padding

each the other's transpose, so each one's backward is the other.  The position-wise
layers run on the N rows; attention unpacks (:class:`npformer.fast.blocks.MultiHeadAttention`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import backend
from ..backend import Array
from ..ops.masks import real_positions
from .inplace import scatter_rows


@dataclass(frozen=True)
class Packing:
    """Where the valid positions of a (B, T) padded batch are: ``index`` (N,) flat positions."""

    index: Any  # (N,) integers b * T + t of the valid tokens, in order
    batch: int  # B
    length: int  # T

    @classmethod
    def from_lengths(cls, valid_lens: Array, length: int) -> Packing:
        """valid_lens (B,): the first valid_lens[b] positions of sequence b are real tokens."""
        xp = backend.namespace_of(valid_lens)  # (B,): checked by the model, the door
        valid = real_positions(valid_lens, length)  # (B, T)
        index = xp.nonzero(xp.reshape(valid, (-1,)))[0]  # (N,) flat positions
        return cls(index, int(valid_lens.shape[0]), length)

    def pack(self, x: Array) -> Array:
        """(B, T, D) -> (N, D): the rows of the valid positions (also unpack's backward)."""
        xp = backend.namespace_of(x)
        rows = xp.reshape(x, (self.batch * self.length, x.shape[-1]))  # (B*T, D)
        return xp.take(rows, self.index, axis=0)  # (N, D)

    def unpack(self, rows: Array) -> Array:
        """(N, D) -> (B, T, D), zeros at padding (also pack's backward)."""
        xp = backend.namespace_of(rows)
        full = scatter_rows(self.index, rows, self.batch * self.length)  # (B*T, D)
        return xp.reshape(full, (self.batch, self.length, rows.shape[-1]))  # (B, T, D)
