"""Tiny Shakespeare: the character-level corpus of char-rnn and nanoGPT.

Format: ``tinyshakespeare/input.txt`` is plain ASCII text, 1,115,394 characters
of 65 distinct kinds. As in nanoGPT's ``shakespeare_char``, the vocabulary is
the sorted set of distinct characters (no special tokens), and the encoded
text is split 90/10: the first 90% for training, the last 10% for validation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import numpy as np

from ..ops.contracts import read_json_object, shown
from .download import TINY_SHAKESPEARE, DatasetFormatError, locate_dataset
from .vocab import TokenTable

__all__ = ["CharVocab", "read_shakespeare", "load_shakespeare", "split_90_10"]


class CharVocab(TokenTable):
    """A character <-> id map: id ``i`` is the ``i``-th character of ``chars``."""

    def __init__(self, chars: Iterable[str]):
        chars = tuple(chars)
        if any(len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
            raise ValueError("a CharVocab needs distinct single characters")
        self._itos = chars
        self._stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        """The sorted distinct characters of ``text``."""
        return cls(sorted(set(text)))

    def __repr__(self) -> str:
        return f"CharVocab(size={len(self)})"

    @property
    def chars(self) -> str:
        """All characters, in id order."""
        return "".join(self._itos)

    def encode(self, text: str) -> list[int]:
        """Map each character to its id; KeyError names an unknown character."""
        try:
            return [self._stoi[c] for c in text]
        except KeyError as exc:
            raise KeyError(f"character {exc.args[0]!r} is not in this vocabulary") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Map ids back to a string."""
        return "".join(self._itos[int(i)] for i in ids)

    def to_json(self) -> str:
        """A JSON string holding the vocabulary (for a checkpoint)."""
        return json.dumps({"type": "CharVocab", "chars": self.chars}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str, what: str = "the CharVocab's JSON") -> CharVocab:
        """Rebuild a vocabulary from :meth:`to_json`'s output (str, or a 0-d array);
        anything else is refused naming ``what`` and what is wrong."""
        data = read_json_object(text, what, ("type", "chars"), "a serialised CharVocab",
                                "CharVocab")
        if not isinstance(data["chars"], str):
            raise ValueError(f"{what} is not a serialised CharVocab: its \"chars\" must be a "
                             f"string, got {shown(data['chars'])}")
        return cls(data["chars"])


def read_shakespeare(path: str | os.PathLike) -> str:
    """The text of ``input.txt`` (UTF-8; the original is ASCII).

    Raises:
        DatasetFormatError: the file is not UTF-8 text, or is empty.
    """
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise DatasetFormatError(f"{path} is not a UTF-8 text file: {exc}") from exc
    if not text:
        raise DatasetFormatError(f"{path} is empty.")
    return text


def load_shakespeare(path: str | os.PathLike | None = None) -> str:
    """The tiny Shakespeare text; ``path`` is ``input.txt`` or a folder holding it
    (as ``tinyshakespeare/input.txt`` or ``input.txt``)."""
    return read_shakespeare(locate_dataset(TINY_SHAKESPEARE, path))


def split_90_10(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """nanoGPT's split: the first 90% of ``ids`` for training, the last 10% for validation."""
    ids = np.asarray(ids)
    n_train = int(len(ids) * 0.9)
    return ids[:n_train], ids[n_train:]
