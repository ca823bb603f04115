r"""Byte-pair encoding of words into subword pieces (Sennrich, Haddow and Birch, 2016).

A word-level vocabulary cannot translate a word it has never seen often enough: it is
``<unk>``. Byte-pair encoding splits rare words into pieces that are frequent, so that
every word is spelled with the pieces the model knows. Learning, on a corpus of words
with their counts::

    start:  every word is its characters          chat -> c@@ h@@ a@@ t
    repeat num_merges times:
        count every adjacent pair of symbols, each word weighted by its count
        merge the most frequent pair (a@@, b) into one symbol a+b everywhere

The merges, in the order learned, are the whole model. A piece that does not end a word
carries the continuation mark ``@@`` (subword-nmt's convention), so pieces join back
into words without a separate list of word boundaries::

    ["je", "suis", "dé@@", "sol@@", "é", "."]  ->  ["je", "suis", "désolé", "."]

A pair is always (a piece marked ``@@``, the piece after it), and merging drops the mark
between them: ``merge("dé@@", "sol@@") = "désol@@"``. Encoding a new word starts from its
characters and applies the learned merges by rank, the lowest (earliest learned) pair
first, as GPT-2's ``bpe()`` does, which reproduces the segmentation of learning.

Words that hold ``@@`` cannot be encoded (their pieces would not join back uniquely): a
ValueError names them.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from ..ops.contracts import (
    KindError,
    check_size,
    check_string_lists,
    check_strings,
    read_json_object,
    shown,
)

__all__ = ["BPE", "MARK"]

MARK = "@@"  # ends every piece that does not end its word


def _check_word(word: str) -> None:
    if not isinstance(word, str):
        raise KindError(f"byte-pair encoding encodes words (str), got {shown(word)} "
                        f"({type(word).__name__})")
    if MARK in word:
        raise ValueError(f"byte-pair encoding cannot encode the word {word!r}: it holds the "
                         f"continuation mark {MARK!r}, so its pieces would not join back")
    if not word or word.isspace():
        raise ValueError(f"byte-pair encoding encodes words, got {word!r}")


def check_strings_or_pairs(merges: Any) -> list:
    """The merges given to :class:`BPE`: a list (any iterable but a str) of pairs."""
    if isinstance(merges, (str, bytes)) or not isinstance(merges, Iterable):
        raise KindError(f"merges must be a list of (piece, piece) pairs, got {shown(merges)} "
                        f"({type(merges).__name__})")
    return list(merges)


def _merge(entry: Any, i: int) -> tuple[str, str]:
    """merges[i]: a pair of strings (a piece marked ``@@``, the piece after it)."""
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 2:
        size = f" of {len(entry)} items" if isinstance(entry, Sequence) and not isinstance(
            entry, (str, bytes)) else ""
        raise KindError(f"merges[{i}] must be a pair (piece, piece), got {shown(entry)}{size}")
    first, second = entry
    if not (isinstance(first, str) and isinstance(second, str)):
        raise KindError(f"merges[{i}] must be a pair of strings, got {shown(entry)}")
    if not first.endswith(MARK) or len(first) == len(MARK) or not second:
        raise ValueError(f"merges[{i}] is not a byte-pair merge: {(first, second)!r} (the "
                         f"first piece must end with {MARK!r}, the second be non-empty)")
    return first, second


def characters(word: str) -> tuple[str, ...]:
    """"chat" -> ("c@@", "h@@", "a@@", "t"): the word before any merge."""
    return tuple(c + MARK for c in word[:-1]) + (word[-1],)


def merge_symbols(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    """Replace every occurrence of ``pair`` in ``symbols`` (left to right, not overlapping)
    by its merge: (a@@, b) -> a+b without the mark between."""
    first, second = pair
    merged, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == first and symbols[i + 1] == second:
            merged.append(first[:-len(MARK)] + second)
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return tuple(merged)


def adjacent_pairs(symbols: Sequence[str]) -> Counter:
    """The adjacent pairs of one word's symbols, with how often each occurs in it."""
    return Counter(zip(symbols, symbols[1:]))


def learn_merges(word_counts: dict[str, int], num_merges: int,
                 min_count: int = 2) -> list[tuple[str, str]]:
    """The merges byte-pair encoding learns from ``{word: count}``, most frequent first.

    Each step merges the pair with the largest count (ties: the smaller pair, so the
    result does not depend on the order of ``word_counts``), and stops early when no
    pair occurs ``min_count`` times. Only the words holding the merged pair are
    re-counted: ``where[pair]`` lists them, and a heap of (-count, pair) finds the best
    pair, its stale entries (counts that have changed since) skipped when popped.
    """
    words = [characters(word) for word in word_counts]
    weights = list(word_counts.values())
    pair_counts: Counter = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for index, (symbols, weight) in enumerate(zip(words, weights)):
        for pair, n in adjacent_pairs(symbols).items():
            pair_counts[pair] += n * weight
            where[pair].add(index)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges and heap:
        negative_count, best = heapq.heappop(heap)
        if pair_counts.get(best, 0) != -negative_count:
            continue  # stale: this pair's count changed after the entry was pushed
        if -negative_count < min_count:
            break
        merges.append(best)
        changed = set()
        for index in where.pop(best):
            old, weight = words[index], weights[index]
            new = merge_symbols(old, best)
            words[index] = new
            old_pairs, new_pairs = adjacent_pairs(old), adjacent_pairs(new)
            for pair, n in old_pairs.items():
                pair_counts[pair] -= n * weight
                if pair not in new_pairs and pair != best:
                    where[pair].discard(index)
                changed.add(pair)
            for pair, n in new_pairs.items():
                pair_counts[pair] += n * weight
                where[pair].add(index)
                changed.add(pair)
        del pair_counts[best]
        for pair in changed - {best}:
            if pair_counts[pair] > 0:
                heapq.heappush(heap, (-pair_counts[pair], pair))
            else:
                del pair_counts[pair]
    return merges


class BPE:
    """Learned merges that split words into subword pieces, and join pieces back.

    >>> bpe = BPE.learn([["low", "lower", "lowest"]] * 3, num_merges=3)
    >>> bpe.encode(["lowly"])
    ['low@@', 'l@@', 'y']
    >>> bpe.decode(['low@@', 'l@@', 'y'])
    ['lowly']
    """

    def __init__(self, merges: Iterable[Sequence[str]]):
        merges = tuple(_merge(entry, i) for i, entry in enumerate(
            check_strings_or_pairs(merges)))
        self.merges, self._rank = merges, {}  # _rank: {pair: its rank, the order learned}
        for i, pair in enumerate(merges):
            if self._rank.setdefault(pair, i) != i:
                raise ValueError(f"a BPE's merges must be distinct: merges[{i}] {pair!r} is "
                                 f"merges[{self._rank[pair]}] again")
        self.encode_word = lru_cache(maxsize=1 << 16)(self._encode_word)

    @classmethod
    def learn(cls, token_lists: Iterable[Iterable[str]], num_merges: int,
              min_count: int = 2) -> BPE:
        """Learn ``num_merges`` merges (fewer when no pair is left ``min_count`` times)
        from a corpus of word lists, e.g. both sides of the training pairs."""
        num_merges = check_size(num_merges, "num_merges", 0)
        min_count = check_size(min_count, "min_count", 1)
        token_lists = check_string_lists(token_lists, "token_lists", "word")
        counts = Counter(word for words in token_lists for word in words)
        for word in counts:
            _check_word(word)
        return cls(learn_merges(dict(sorted(counts.items())), num_merges, min_count))

    def _encode_word(self, word: str) -> tuple[str, ...]:
        """One word -> its pieces: merge the lowest-ranked adjacent pair until none is
        a learned merge."""
        _check_word(word)
        symbols = characters(word)
        while len(symbols) > 1:
            ranked = [(self._rank[pair], pair) for pair in zip(symbols, symbols[1:])
                      if pair in self._rank]
            if not ranked:
                break
            symbols = merge_symbols(symbols, min(ranked)[1])
        return symbols

    def encode(self, words: Iterable[str]) -> list[str]:
        """Words -> pieces, every piece but a word's last marked with ``@@``."""
        return [piece for word in check_strings(words, "words", "word")
                for piece in self.encode_word(word)]

    @staticmethod
    def decode(pieces: Iterable[str]) -> list[str]:
        """Pieces -> words: a piece ending with ``@@`` joins the next one. A last piece
        still marked (a decoder stopped mid-word) ends its word without the mark."""
        words, partial = [], ""
        for piece in check_strings(pieces, "pieces", "piece"):
            if piece.endswith(MARK):
                partial += piece[:-len(MARK)]
            else:
                words.append(partial + piece)
                partial = ""
        if partial:
            words.append(partial)
        return words

    def __len__(self) -> int:
        return len(self.merges)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BPE) and self.merges == other.merges

    def __hash__(self) -> int:
        return hash(self.merges)

    def __repr__(self) -> str:
        return f"BPE(merges={len(self.merges)})"

    def to_json(self) -> str:
        """A JSON string holding the merges (for a checkpoint)."""
        return json.dumps({"type": "BPE", "merges": [list(m) for m in self.merges]},
                          ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str, what: str = "the BPE's JSON") -> BPE:
        """Rebuild from :meth:`to_json`'s output (str, or a 0-d array); anything else is
        refused naming ``what`` (e.g. "the checkpoint's BPE") and what is wrong: not a
        str, not JSON, not an object, no "type" "BPE" or "merges", a merge that is not
        a pair of pieces."""
        data = read_json_object(text, what, ("type", "merges"), "a serialised BPE", "BPE")
        if not isinstance(data["merges"], list):
            raise ValueError(f"{what} is not a serialised BPE: its \"merges\" must be a list "
                             f"of [piece, piece] pairs, got {shown(data['merges'])}")
        try:
            return cls(data["merges"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{what} is not a serialised BPE: {exc}") from None
