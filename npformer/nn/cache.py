"""Key/value caches for decoding one position at a time (inference only).

Each self-attention layer appends the keys and values of the new positions to its
:class:`KVCache`, so earlier positions are never recomputed; a cross-attention layer
fills its cache once from the encoder memory.  Keys and values are (B, H, S, E):
batch, heads, cached positions, per-head width.  Beam search reorders the batch
rows of every cache with ``select`` when hypotheses are kept, dropped or copied.
"""
from __future__ import annotations

from .. import backend
from ..backend import Array
from .module import grad_enabled


class KVCache:
    """One attention layer's cached keys and values, (B, H, S, E) each (None before use).

    They live at the start of buffers (B, H, C, E) with room for C >= S positions, C
    doubled when full: appending a step's position copies that position only, not the S
    cached before it (a concatenation would copy them all, every step)."""

    def __init__(self):
        self._keys = None    # (B, H, C, E): positions [0, S) hold the keys
        self._values = None  # (B, H, C, E): and the values
        self._length = 0     # S

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

    def append(self, keys: Array, values: Array) -> None:
        """Add the keys and values (B, H, T_new, E) of T_new more positions."""
        start, stop = self._length, self._length + int(keys.shape[2])
        if self._keys is None or stop > self._keys.shape[2]:  # full: a buffer twice as long
            self._keys = self._grown(self._keys, keys, 2 * stop)
            self._values = self._grown(self._values, values, 2 * stop)
        self._keys[:, :, start:stop, :] = keys
        self._values[:, :, start:stop, :] = values
        self._length = stop

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


class BlockCache:
    """The caches of one block: its self-attention's and, in a decoder block, its
    cross-attention's (the encoder memory's keys and values)."""

    def __init__(self, cross: bool = False):
        self.self_attn = KVCache()
        self.cross_attn = KVCache() if cross else None

    def select(self, rows: Array) -> None:
        self.self_attn.select(rows)
        if self.cross_attn is not None:
            self.cross_attn.select(rows)


class DecodingCache:
    """A model's caches: one :class:`BlockCache` per block, and the decoded length."""

    def __init__(self, num_blocks: int, cross: bool = False):
        self.blocks = [BlockCache(cross) for _ in range(num_blocks)]

    @property
    def length(self) -> int:
        """The number of positions decoded so far (the position of the next one)."""
        return self.blocks[0].self_attn.length if self.blocks else 0

    def select(self, rows: Array) -> None:
        """Reorder the batch rows of every cache (beam search: each kept hypothesis's origin)."""
        for block in self.blocks:
            block.select(rows)


def check_decoding_cache(kv_cache: object, num_blocks: int, owner: str, cross: bool = False
                         ) -> None:
    """``kv_cache`` is a :class:`DecodingCache` of ``num_blocks`` blocks (with
    cross-attention caches when ``cross``), as ``owner``'s ``new_cache()`` makes it (zip
    would silently leave layers without their cache)."""
    if not isinstance(kv_cache, DecodingCache):
        raise TypeError(f"kv_cache must be a DecodingCache ({owner}.new_cache()), got "
                        f"{type(kv_cache).__name__}")
    held = len(kv_cache.blocks)
    crossing = all(block.cross_attn is not None for block in kv_cache.blocks)
    if held != num_blocks or (cross and not crossing):
        raise ValueError(f"kv_cache holds the caches of {held} blocks"
                         f"{'' if crossing or not cross else ' without cross-attention'}, "
                         f"but {owner} has {num_blocks}: pass the cache {owner}.new_cache() "
                         "made")


def check_layer_cache(kv_cache: KVCache, batch: int, heads: int, width: int) -> None:
    """An attention layer's ``kv_cache`` at its door: used under ``no_grad`` only, and
    holding (batch, heads, S, width) keys, if any: another batch's (a beam search's rows
    not selected) or another model's is refused before the concatenation would fail."""
    if grad_enabled():
        raise RuntimeError("a KVCache is for inference: call the attention under "
                           "npformer.no_grad() (it keeps nothing for a backward)")
    if not isinstance(kv_cache, KVCache):
        raise TypeError(f"kv_cache must be a KVCache (a block's cache of the model's "
                        f"new_cache()), got {type(kv_cache).__name__}")
    if kv_cache.keys is None:
        return
    held = tuple(kv_cache.keys.shape)
    if (held[0], held[1], held[3]) != (batch, heads, width):
        raise ValueError(f"the key/value cache holds keys of shape {held} (batch, heads, "
                         f"positions, head_dim), but the layer has {heads} heads of width "
                         f"{width} and the input a batch of {batch}: pass the cache this "
                         "model filled for these rows (new_cache() to start again)")
