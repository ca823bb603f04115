"""The IMDB Large Movie Review Dataset (Maas et al., 2011), read from its tarball.

Format of ``aclImdb_v1.tar.gz`` (the official download, and the offline copy)::

    aclImdb/README
    aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt    one review per file, UTF-8
    aclImdb/train/unsup/*.txt, *.feat, imdb.vocab, ...  (official only; ignored here)

Each labelled split holds 12,500 positive (rating >= 7) and 12,500 negative
(rating <= 4) reviews. Reviews contain raw HTML line breaks (``<br /><br />``).

The archive is read in place as a stream (no extraction of its 50,000 files),
both splits in one pass. Reviews are returned sorted by (label, id), negatives
first, whatever the member order of the archive, so the official download and
the offline copy give the same lists: shuffle before training.
"""

from __future__ import annotations

import os
import re
import tarfile
import zlib
from pathlib import Path

import numpy as np

from .download import IMDB, DatasetFormatError, locate_dataset

__all__ = ["SPLITS", "read_imdb_archive", "load_imdb", "load_imdb_splits", "tokenize_imdb",
           "split_validation"]

SPLITS = ("train", "test")
_LABELS = {"neg": 0, "pos": 1}
_MEMBER = re.compile(r"^(?:\./)?aclImdb/(train|test)/(pos|neg)/(\d+)_(\d+)\.txt$")

_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)  # the data holds only "<br />"
# A word is a run of word characters (Unicode letters, digits, underscore);
# every other non-space character is a token by itself, so "didn't" is
# "didn", "'", "t". This reproduces the reference figures' statistics on the
# training split: 279.2 tokens a review on average, median 208.
_TOKEN = re.compile(r"\w+|[^\w\s]")


def tokenize_imdb(text: str) -> list[str]:
    """Lowercase, turn ``<br />`` into a space, split into words and punctuation.

    >>> tokenize_imdb("Great film!<br /><br />Didn't LOVE it, though...")
    ['great', 'film', '!', 'didn', "'", 't', 'love', 'it', ',', 'though', '.', '.', '.']
    """
    return _TOKEN.findall(_BREAK.sub(" ", text.lower()))


def read_imdb_archive(archive: str | os.PathLike,
                      splits: tuple[str, ...] = SPLITS) -> dict[str, list[tuple[str, int]]]:
    """``{split: [(text, label), ...]}`` for ``splits`` (of ``"train"``, ``"test"``) from
    the tarball ``archive`` (any name, any compression tarfile reads) in one streaming
    pass: label 1 = positive, 0 = negative, each list sorted by (label, review id).

    Raises:
        DatasetFormatError: the file is not a readable gzip tar archive, or it
            lacks ``aclImdb/<split>/{pos,neg}/*.txt`` reviews.
    """
    archive = Path(archive)
    unknown = set(splits) - set(SPLITS)
    if unknown:
        raise ValueError(f"unknown IMDB split(s) {sorted(unknown)}; expected among {SPLITS}")
    keyed: dict[str, list[tuple[int, int, str]]] = {split: [] for split in splits}
    try:
        with tarfile.open(archive, mode="r|*") as tar:
            for member in tar:
                match = _MEMBER.match(member.name)
                if match is None or not member.isfile() or match[1] not in keyed:
                    continue
                label = _LABELS[match[2]]
                raw = tar.extractfile(member).read()
                text = raw.decode("utf-8", errors="replace")
                keyed[match[1]].append((label, int(match[3]), text))
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise DatasetFormatError(
            f"{archive} is not a readable aclImdb_v1.tar.gz: {type(exc).__name__}: {exc}. "
            f"The file may be truncated or corrupt: delete it and download it again.") from exc
    for split, items in keyed.items():
        present = {label for label, _, _ in items}
        missing = [name for name, label in _LABELS.items() if label not in present]
        if missing:
            raise DatasetFormatError(
                f"{archive} is not a readable aclImdb_v1.tar.gz: it has no "
                f"aclImdb/{split}/{{{','.join(missing)}}}/<id>_<rating>.txt reviews.")
    return {split: [(text, label) for label, _, text in sorted(items)]
            for split, items in keyed.items()}


def load_imdb_splits(path: str | os.PathLike | None = None) -> dict[str, list[tuple[str, int]]]:
    """Both labelled splits, ``{"train": [...], "test": [...]}``, from one pass; ``path``
    is the tarball or a folder holding it (else :func:`locate_dataset` finds it)."""
    return read_imdb_archive(locate_dataset(IMDB, path))


def load_imdb(split: str = "train", path: str | os.PathLike | None = None) -> list[tuple[str, int]]:
    """One labelled split, ``"train"`` or ``"test"``, as ``[(text, label), ...]``."""
    return read_imdb_archive(locate_dataset(IMDB, path), splits=(split,))[split]


def split_validation(examples: list, n_val: int, seed: int = 0) -> tuple[list, list]:
    """``(train, val)``: a random validation set of ``n_val`` examples carved out of
    ``examples`` (the same ``seed``, the same ones), each part in its original order."""
    if not 0 <= n_val <= len(examples):
        raise ValueError(f"n_val must be in [0, {len(examples)}], got {n_val}")
    rng = np.random.default_rng(seed)
    is_val = np.zeros(len(examples), dtype=bool)
    is_val[rng.permutation(len(examples))[:n_val]] = True
    return ([ex for ex, v in zip(examples, is_val) if not v],
            [ex for ex, v in zip(examples, is_val) if v])
