"""English-French sentence pairs (Tatoeba, via manythings.org), as d2l.ai reads them.

Format of d2l's ``fra-eng.zip``: one member ``fra-eng/fra.txt``, UTF-8, one pair
a line::

    Go.<TAB>Va !
    Run!<TAB>Cours<U+202F>!

Some releases (manythings.org's own ``fra-eng.zip``, with ``fra.txt`` at the
root) add a third, attribution column: only the first two columns are read. A
plain ``fra.txt`` is accepted too. The lines are sorted by English length.

Preprocessing is d2l's (``MTFraEng._preprocess``, :func:`preprocess_fra_eng`); tokens are
then the space-separated pieces. d2l's copy has 167,130 pairs.  Malformed lines are skipped
and counted in one :class:`~npformer.data.download.DatasetWarning` (:func:`parse_fra_eng`).

:func:`split_by_source` holds out whole English sentences, with all their
French translations, so that no test sentence is seen in training and BLEU can
use every translation as a reference.
"""

from __future__ import annotations

import os
import re
import struct
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .download import FRA_ENG, DatasetFormatError, DatasetWarning, locate_dataset

__all__ = ["preprocess_fra_eng", "tokenize_fra_eng", "parse_fra_eng", "read_fra_eng",
           "load_fra_eng", "filter_by_length", "split_by_source"]

Pair = tuple[list[str], list[str]]

# A mark of , . ! ? preceded by a character other than a space (d2l's no_space
# test, which looks at the *input* text, as a lookbehind does).
_NO_SPACE_BEFORE = re.compile(r"(?<=[^ ])([,.!?])")


def preprocess_fra_eng(text: str) -> str:
    """d2l's normalisation: no-break spaces to spaces, lowercase, space before ``,.!?``."""
    text = text.replace("\u202f", " ").replace("\xa0", " ").lower()
    return _NO_SPACE_BEFORE.sub(r" \1", text)


def _split_spaces(text: str) -> list[str]:
    return [token for token in text.split(" ") if token]


def tokenize_fra_eng(sentence: str) -> list[str]:
    """Preprocess one sentence and split it on spaces (empty pieces dropped)."""
    return _split_spaces(preprocess_fra_eng(sentence))


def parse_fra_eng(text: str, source: str = "fra.txt") -> list[Pair]:
    """Parse the content of ``fra.txt`` into ``[(english_tokens, french_tokens), ...]``.

    Columns after the second are ignored. Blank lines (the file's final newline) are
    skipped; lines with text but no tab, or with an empty side, are skipped and reported in
    one :class:`DatasetWarning` naming ``source``, their count and first line numbers (its
    ``line_numbers`` holds them all).  The whole text is preprocessed at once, as d2l does;
    the tokens are the same as tokenizing each column.
    """
    pairs, malformed = [], []
    for number, line in enumerate(preprocess_fra_eng(text).split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip(" "):  # blank (a tab alone is a line with two empty sides)
            continue
        columns = line.split("\t")
        english, french = (_split_spaces(columns[0]), _split_spaces(columns[1])
                           ) if len(columns) >= 2 else ([], [])
        if english and french:
            pairs.append((english, french))
        else:
            malformed.append(number)
    if malformed:
        first = ", ".join(map(str, malformed[:5])) + (", ..." if len(malformed) > 5 else "")
        warning = DatasetWarning(f"{source}: skipped {len(malformed)} malformed line(s) with "
                                 f"no tab or an empty side (line {first})")
        warning.line_numbers = malformed
        warnings.warn(warning, stacklevel=2)
    return pairs


def _read_zip_member(path: Path) -> str:
    """The text of the ``fra.txt`` member of a zip archive."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "fra.txt"]
            if not names:
                raise DatasetFormatError(
                    f"{path} is not a readable fra-eng.zip: it has no fra-eng/fra.txt member "
                    f"(members: {archive.namelist()[:5]}).")
            data = archive.read("fra-eng/fra.txt" if "fra-eng/fra.txt" in names else names[0])
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, struct.error, ValueError,
            NotImplementedError, RuntimeError, KeyError) as exc:
        # damaged headers surface as any of these (an unknown compression method is
        # NotImplementedError, a flipped encryption flag RuntimeError, a flipped UTF-8
        # name flag UnicodeDecodeError, a ValueError)
        if isinstance(exc, (FileNotFoundError, DatasetFormatError)):
            raise
        raise DatasetFormatError(
            f"{path} is not a readable fra-eng.zip: {type(exc).__name__}: {exc}. "
            f"The file may be truncated or corrupt: delete it and download it again.") from exc
    return _decode(data, path)


def _decode(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetFormatError(f"{path}: fra.txt is not UTF-8 text: {exc}") from exc


def read_fra_eng(path: str | os.PathLike) -> list[Pair]:
    """Read pairs from ``fra-eng.zip`` or a plain ``fra.txt``.

    A file is read as a zip when its name ends in ``.zip`` or it starts with the
    zip signature ``PK``; otherwise as UTF-8 text.

    Raises:
        DatasetFormatError: a corrupt zip, a zip without ``fra.txt``, non-UTF-8
            text, or a file holding no tab-separated pairs.
    """
    path = Path(path)
    with open(path, "rb") as f:
        is_zip = path.suffix.lower() == ".zip" or f.read(2) == b"PK"
    text = _read_zip_member(path) if is_zip else _decode(path.read_bytes(), path)
    pairs = parse_fra_eng(text, source=str(path))
    if not pairs:
        raise DatasetFormatError(f"{path} holds no english<TAB>french lines.")
    return pairs


def filter_by_length(pairs: list[Pair], max_len: int) -> list[Pair]:
    """Keep the pairs whose two sides both have at most ``max_len`` tokens."""
    return [(en, fr) for en, fr in pairs if len(en) <= max_len and len(fr) <= max_len]


def load_fra_eng(path: str | os.PathLike | None = None, max_len: int | None = None) -> list[Pair]:
    """All pairs, ``[(english_tokens, french_tokens), ...]``, in file order (with
    ``max_len``, those with at most that many tokens a side); ``path`` is the zip (or
    ``fra.txt``) or a folder holding it (else :func:`locate_dataset` finds it)."""
    pairs = read_fra_eng(locate_dataset(FRA_ENG, path))
    return pairs if max_len is None else filter_by_length(pairs, max_len)


def split_by_source(pairs: list[Pair], n_heldout_sentences: int,
                    seed: int = 0) -> tuple[list[Pair], dict[str, list[str]]]:
    """Hold out ``n_heldout_sentences`` distinct English sentences with all their pairs.

    Sentences are compared as their space-joined tokens, so two raw sentences
    differing only in case or spacing count as one.

    Returns:
        ``(train_pairs, heldout)``: ``train_pairs`` are the pairs whose English
        sentence was not held out, in their original order; ``heldout`` maps each
        held-out English sentence (space-joined tokens) to the list of its French
        translations (space-joined tokens), every one of them, in file order.
    """
    groups: dict[str, list[int]] = {}
    for i, (en, _) in enumerate(pairs):
        groups.setdefault(" ".join(en), []).append(i)
    sentences = list(groups)  # first-appearance order
    if not 0 <= n_heldout_sentences <= len(sentences):
        raise ValueError(f"n_heldout_sentences must be in [0, {len(sentences)}] "
                         f"(the number of distinct English sentences), got {n_heldout_sentences}")
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.permutation(len(sentences))[:n_heldout_sentences])
    heldout = {sentences[k]: [" ".join(pairs[i][1]) for i in groups[sentences[k]]] for k in chosen}
    train = [pair for pair in pairs if " ".join(pair[0]) not in heldout]
    return train, heldout
