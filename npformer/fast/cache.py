"""The fast tier's key/value cache: the textbook's :class:`npformer.nn.KVCache`, its keys
and values kept in buffers with room to grow.

The textbook cache concatenates a step's keys and values to everything cached before, so
every step copies the whole cache (at GPT-2 small's batch 8, 12 layers x 2 caches each
token).  Here they live at the start of buffers (B, H, C, E) with room for C >= S
positions, C doubled when full: appending a step's position copies that position only.
``keys`` and ``values`` are views (B, H, S, E) of the buffers, equal to the textbook's.

``finite`` counts the first positions a compiled block's kernel found finite: a decoding
step's kernel declines a cache holding a NaN or inf (the layers define what it gives),
and checks only the positions after those, not the whole cache every step.
"""
from __future__ import annotations

from .. import backend, nn
from ..backend import Array


class KVCache(nn.KVCache):
    __doc__ = nn.KVCache.__doc__

    def __init__(self):
        self._keys = None    # (B, H, C, E): positions [0, S) hold the keys
        self._values = None  # (B, H, C, E): and the values
        self._length = 0     # S
        self.finite = 0      # positions [0, finite) that a compiled block found finite

    @property
    def length(self) -> int:
        """S: the number of cached positions."""
        return self._length

    @property
    def keys(self) -> Array | None:
        """The cached keys (B, H, S, E): a view of the buffer."""
        return None if self._keys is None else self._keys[:, :, :self._length, :]

    @property
    def values(self) -> Array | None:
        """The cached values (B, H, S, E): a view of the buffer."""
        return None if self._values is None else self._values[:, :, :self._length, :]

    def append(self, keys: Array, values: Array, all_finite: bool = False) -> None:
        """Add the keys and values (B, H, T_new, E) of T_new more positions.
        ``all_finite``: the caller found every cached key and value finite, these and
        those before (a compiled block's kernel, :mod:`npformer.fast.compiled`, checks
        the positions from ``finite`` on), so a later step's kernel need not read them
        again."""
        start, stop = self._length, self._length + int(keys.shape[2])
        if self._keys is None or stop > self._keys.shape[2]:  # full: a buffer twice as long
            self._keys = self._grown(self._keys, keys, 2 * stop)
            self._values = self._grown(self._values, values, 2 * stop)
        self._keys[:, :, start:stop, :] = keys
        self._values[:, :, start:stop, :] = values
        self._length = stop
        if all_finite:
            self.finite = stop

    def _grown(self, buffer: Array | None, like: Array, capacity: int) -> Array:
        """A (B, H, capacity, E) buffer of like's dtype holding buffer's S positions."""
        xp = backend.namespace_of(like)
        batch, heads, _, width = like.shape
        grown = xp.empty((batch, heads, capacity, width), dtype=like.dtype,
                         device=backend.device_of(like))
        if buffer is not None:
            grown[:, :, :self._length, :] = buffer[:, :, :self._length, :]
        return grown

    def select(self, rows: Array) -> None:
        """Keep batch rows ``rows`` (integers, (B',), repeats allowed) in that order."""
        if self._keys is not None:
            xp = backend.namespace_of(self._keys)
            self._keys = xp.take(self.keys, rows, axis=0)  # (B', H, S, E): full, grows next
            self._values = xp.take(self.values, rows, axis=0)
