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
    """One attention layer's cached keys and values, (B, H, S, E) each (None before use)."""

    def __init__(self):
        self.keys = None
        self.values = None

    @property
    def length(self) -> int:
        """S: the number of cached positions."""
        return 0 if self.keys is None else int(self.keys.shape[2])

    def append(self, keys: Array, values: Array) -> None:
        """Add the keys and values (B, H, T_new, E) of T_new more positions."""
        if self.keys is None:
            self.keys, self.values = keys, values
            return
        xp = backend.namespace_of(keys)
        self.keys = xp.concat([self.keys, keys], axis=2)  # (B, H, S + T_new, E)
        self.values = xp.concat([self.values, values], axis=2)

    def select(self, rows: Array) -> None:
        """Keep batch rows ``rows`` (integers, (B',), repeats allowed) in that order."""
        if self.keys is not None:
            xp = backend.namespace_of(self.keys)
            self.keys = xp.take(self.keys, rows, axis=0)
            self.values = xp.take(self.values, rows, axis=0)


class BlockCache:
    """The caches of one block: its self-attention's and, in a decoder block, its
    cross-attention's (the encoder memory's keys and values)."""

    def __init__(self, cross: bool = False, layer_cache: type = KVCache):
        self.self_attn = layer_cache()
        self.cross_attn = layer_cache() if cross else None

    def select(self, rows: Array) -> None:
        self.self_attn.select(rows)
        if self.cross_attn is not None:
            self.cross_attn.select(rows)


class DecodingCache:
    """A model's caches: one :class:`BlockCache` per block, and the decoded length.
    ``layer_cache``: each attention layer's (the model's ``KVCache``)."""

    def __init__(self, num_blocks: int, cross: bool = False, layer_cache: type = KVCache):
        self.blocks = [BlockCache(cross, layer_cache) for _ in range(num_blocks)]

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
