"""Your own data: labelled texts, sentence pairs and plain text, read from files.

Three kinds of file, one per model:

- **Labelled texts** for the classifier (:func:`load_text_classification`): CSV (``.csv``,
  comma-separated, ``"``-quoted fields may hold commas and newlines), TSV (``.tsv``,
  tab-separated, no quoting), or JSON Lines (``.jsonl``, one object a line; a ``.json``
  file is read as JSON Lines, or as one array of objects when it starts with ``[``).  CSV
  and TSV files start with a header row naming the columns; the text and the label are the
  columns named ``text_column`` and ``label_column`` (default ``"text"`` and ``"label"``),
  the others are ignored.  Labels are any strings (CSV, TSV) or strings and integers
  (JSON), white space around them ignored; an example's label becomes its index in the
  training file's label set (:func:`sorted_labels`).
- **Sentence pairs** for translation (:func:`read_sentence_pairs`): UTF-8 text,
  ``source<TAB>target`` a line, tokenized as the English-French data is
  (:func:`~npformer.data.tokenize_fra_eng`: lowercase, a space before ``, . ! ?``,
  split on spaces).
- **Plain text** for the character language model (:func:`read_text_file`): any
  UTF-8 file, read whole.

Every file must be UTF-8 (a byte-order mark is allowed).  A malformed file is refused with
a :class:`~npformer.data.DatasetFormatError` naming the file, the line and, where it helps,
the column (the readers' docstrings list the cases).  The demos take these files for
``--data`` (:func:`is_user_data`; docs/guide.md, "Train on your own data").
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .download import DatasetFormatError, DatasetNotFoundError
from .fra_eng import tokenize_fra_eng

__all__ = ["USER_DATA_SUFFIXES", "LABELLED_SUFFIXES", "TextClassificationData", "is_user_data",
           "read_labelled_texts", "sorted_labels", "load_text_classification",
           "read_sentence_pairs", "read_text_file"]

LABELLED_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json")
USER_DATA_SUFFIXES = (*LABELLED_SUFFIXES, ".txt")

Label = str | int
Record = tuple[str, Label, int]  # (text, label as in the file, line it starts on)


def is_user_data(path: str | os.PathLike | None) -> bool:
    """Whether ``--data path`` names a file of the user's own (by its extension: .csv,
    .tsv, .jsonl, .json, .txt) rather than a canonical download or a folder."""
    return path is not None and Path(path).suffix.lower() in USER_DATA_SUFFIXES


# --------------------------------------------------------------------------- bytes to text
def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DatasetNotFoundError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise DatasetNotFoundError(f"{path} is a folder, not a data file") from None


def _decode_utf8(data: bytes, path: Path) -> str:
    """UTF-8 text (a leading byte-order mark dropped); undecodable bytes are named by line
    and column (1-based, the column counted in bytes)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        start = exc.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        line = data.count(b"\n", 0, start) + 1
        column = start - (data.rfind(b"\n", 0, start) + 1) + 1
        raise DatasetFormatError(
            f"{path}, line {line}, column {column}: not UTF-8 text (byte "
            f"0x{data[start]:02x}); save the file as UTF-8") from None
    if not text.strip():
        raise DatasetFormatError(f"{path} is empty")
    return text


def read_text_file(path: str | os.PathLike) -> str:
    """The whole text of a UTF-8 file (for the character language model).

    Raises:
        DatasetNotFoundError: there is no such file.
        DatasetFormatError: the file is empty (or only white space), or holds bytes
            that are not UTF-8 (the message names their line and column).
    """
    path = Path(path)
    return _decode_utf8(_read_bytes(path), path)


# --------------------------------------------------------------------------- labelled texts
def read_labelled_texts(path: str | os.PathLike, text_column: str = "text",
                        label_column: str = "label") -> list[Record]:
    """The examples of a CSV, TSV or JSON Lines file as ``[(text, label, line), ...]``.

    ``label`` is as the file holds it (a string; or an integer, in JSON) and ``line``
    the line the example starts on (for JSON arrays, the object's 1-based position).
    Blank lines of a JSON Lines file are skipped.

    Raises:
        DatasetFormatError: an unknown extension, an empty file, non-UTF-8 bytes, a
            missing column or one the header names twice, a row whose number of fields
            is not the header's, a bad JSON line, a text that is not a string, a label
            that is empty or neither a string nor an integer.
        TypeError, ValueError: ``text_column`` or ``label_column`` is not a non-empty
            string, or both name the same column.
    """
    path = Path(path)
    for name, value in (("text_column", text_column), ("label_column", label_column)):
        if not isinstance(value, str) or not value.strip():
            raise TypeError(f"{name} must name a column (a non-empty string), got {value!r}")
    if text_column == label_column:
        raise ValueError(f"text_column and label_column both name {text_column!r}: every "
                         f"text would be its own label; name the label's own column "
                         f"(the demo: --text-column, --label-column)")
    suffix = path.suffix.lower()
    if suffix not in LABELLED_SUFFIXES:
        raise DatasetFormatError(
            f"{path}: labelled examples are read from a {', '.join(LABELLED_SUFFIXES)} file, "
            f"not {suffix or 'a file without an extension'}")
    text = _decode_utf8(_read_bytes(path), path)
    if suffix in (".csv", ".tsv"):
        return _read_delimited(text, path, suffix == ".tsv", text_column, label_column)
    return _read_json(text, path, text_column, label_column)


def _read_delimited(text: str, path: Path, tab: bool, text_column: str,
                    label_column: str) -> list[Record]:
    dialect = dict(delimiter="\t", quoting=csv.QUOTE_NONE) if tab else dict(delimiter=",")
    _allow_fields_of(len(text))
    reader = csv.reader(io.StringIO(text, newline=""), strict=True, **dialect)
    try:
        header = next(reader)
        columns = [_column_index(header, name, option, path)
                   for name, option in ((text_column, "text"), (label_column, "label"))]
        records, line = [], reader.line_num + 1
        for row in reader:
            if row:  # a blank line
                _check_field_count(row, header, path, line, tab)
                label = row[columns[1]].strip()
                if not label:
                    raise DatasetFormatError(f"{path}, line {line}, column {label_column!r}: "
                                             f"the label is empty")
                records.append((row[columns[0]], label, line))
            line = reader.line_num + 1
    except csv.Error as exc:
        raise DatasetFormatError(f"{path}, line {reader.line_num}: not valid "
                                 f"{'TSV' if tab else 'CSV'}: {exc}") from None
    if not records:
        raise DatasetFormatError(f"{path} has a header but no examples")
    return records


def _allow_fields_of(length: int) -> None:
    """Let csv read a field as long as the whole text (its default limit, 128 KiB, would
    refuse a valid long review).  The limit is the process's: it is only ever raised."""
    if csv.field_size_limit() < length:
        csv.field_size_limit(min(length, 2**31 - 1))  # a C long on every platform


def _check_field_count(row: list[str], header: list[str], path: Path, line: int,
                       tab: bool) -> None:
    """Every row has the header's number of fields: one more or one fewer means a
    delimiter inside a text (or one missing), and reading on would shift the columns."""
    if len(row) == len(header):
        return
    hint = ("TSV has no quoting, so a text cannot hold a tab: remove it, or save the file "
            "as CSV with the text in double quotes") if tab else \
        'a comma inside a text must be within double quotes: "I liked it, a lot"'
    raise DatasetFormatError(f"{path}, line {line}: expected {len(header)} fields, as in the "
                             f"header, saw {len(row)} ({hint})")


def _column_index(header: list[str], name: str, what: str, path: Path) -> int:
    names = [column.strip() for column in header]
    if name not in names:
        raise DatasetFormatError(
            f"{path}, line 1: no column {name!r} in the header (its columns: "
            f"{', '.join(map(repr, names))}); name the {what} column with "
            f"--{what}-column (the library: {what}_column=)")
    found = [number for number, column in enumerate(names, start=1) if column == name]
    if len(found) > 1:
        raise DatasetFormatError(
            f"{path}, line 1: the header names {len(found)} columns {name!r} (fields "
            f"{', '.join(map(str, found))}): rename all but the {what} column")
    return found[0] - 1


def _read_json(text: str, path: Path, text_column: str, label_column: str) -> list[Record]:
    if text.lstrip().startswith("["):  # one JSON array of objects
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetFormatError(f"{path}, line {exc.lineno}, column {exc.colno}: not "
                                     f"valid JSON: {exc.msg}") from None
        if not isinstance(items, list):
            raise DatasetFormatError(f"{path}: expected a JSON array of objects")
        located = [(item, f"object {k}", k) for k, item in enumerate(items, start=1)]
    else:  # JSON Lines
        located = []
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                located.append((json.loads(line), f"line {number}", number))
            except json.JSONDecodeError as exc:
                raise DatasetFormatError(f"{path}, line {number}, column {exc.colno}: not "
                                         f"valid JSON: {exc.msg}") from None
    records = []
    for item, where, number in located:
        if not isinstance(item, dict):
            raise DatasetFormatError(f"{path}, {where}: expected a JSON object "
                                     f"{{{text_column!r}: ..., {label_column!r}: ...}}, got "
                                     f"{type(item).__name__}")
        for name, what in ((text_column, "text"), (label_column, "label")):
            if name not in item:
                raise DatasetFormatError(
                    f"{path}, {where}: no key {name!r} (its keys: "
                    f"{', '.join(map(repr, item))}); name the {what} key with "
                    f"--{what}-column (the library: {what}_column=)")
        text_value, label = item[text_column], item[label_column]
        if not isinstance(text_value, str):
            raise DatasetFormatError(f"{path}, {where}, key {text_column!r}: the text must be "
                                     f"a string, got {type(text_value).__name__}")
        if isinstance(label, str):
            label = label.strip()
        if isinstance(label, bool) or not isinstance(label, (str, int)) or label == "":
            raise DatasetFormatError(f"{path}, {where}, key {label_column!r}: a label must be "
                                     f"a non-empty string or an integer, got {label!r}")
        records.append((text_value, label, number))
    if not records:
        raise DatasetFormatError(f"{path} holds no examples")
    return records


_INTEGER = re.compile(r"[+-]?\d+")


def sorted_labels(labels: Iterable[Label]) -> tuple[Label, ...]:
    """The distinct labels, sorted: integers (and strings that read as integers)
    numerically, then the other strings alphabetically.

    >>> sorted_labels(["pos", "neg", "pos"])
    ('neg', 'pos')
    >>> sorted_labels(["10", "9", "2"])
    ('2', '9', '10')
    """
    def key(label):
        if isinstance(label, int) or _INTEGER.fullmatch(label):
            return (0, int(label), str(label))
        return (1, 0, label)

    distinct = set(labels)
    kinds = {type(label) for label in distinct}
    if len(kinds) > 1:
        numbers = sorted(label for label in distinct if isinstance(label, int))
        words = sorted(label for label in distinct if isinstance(label, str))
        raise DatasetFormatError(f"the labels mix integers ({numbers[0]!r}) and strings "
                                 f"({words[0]!r}): write them all one way")
    return tuple(sorted(distinct, key=key))


@dataclass(frozen=True)
class TextClassificationData:
    """Labelled texts read by :func:`load_text_classification`: lists of ``(text,
    label_index)`` (``validation`` and ``test`` empty when no file was given), and the label
    names: example label ``i`` is ``labels[i]``."""

    train: list[tuple[str, int]]
    validation: list[tuple[str, int]]
    test: list[tuple[str, int]]
    labels: tuple[Label, ...]


def load_text_classification(train: str | os.PathLike,
                             validation: str | os.PathLike | None = None,
                             test: str | os.PathLike | None = None,
                             text_column: str = "text",
                             label_column: str = "label") -> TextClassificationData:
    """Read training (and optionally validation and test) files of labelled texts.

    The label set is the training file's (:func:`sorted_labels`); a label of the
    validation or test file that the training file lacks is an error naming it and
    its line.  Files of different formats may be mixed: labels are compared by their
    text, so a JSON file's integer ``1`` is a CSV file's ``"1"`` ("01" is another).

    A ``tiny.csv`` holding ``text,label`` / ``good,pos`` / ``bad,neg`` gives::

        data = load_text_classification("tiny.csv")
        data.labels  # ('neg', 'pos')
        data.train   # [('good', 1), ('bad', 0)]
    """
    read = lambda path: read_labelled_texts(path, text_column, label_column)  # noqa: E731
    train_records = read(train)
    labels = sorted_labels(label for _, label, _ in train_records)
    if len(labels) < 2:
        raise DatasetFormatError(f"{train}: every example has the label {labels[0]!r}; a "
                                 f"classifier needs at least two labels")
    index = {str(label): i for i, label in enumerate(labels)}  # compared by their text

    def indexed(records: Sequence[Record], path) -> list[tuple[str, int]]:
        for _, label, line in records:
            if str(label) not in index:
                raise DatasetFormatError(
                    f"{path}, line {line}: the label {label!r} is not in the training file "
                    f"{train} (its labels: {', '.join(map(repr, labels))})")
        return [(text, index[str(label)]) for text, label, _ in records]

    return TextClassificationData(
        train=indexed(train_records, train),
        validation=[] if validation is None else indexed(read(validation), validation),
        test=[] if test is None else indexed(read(test), test),
        labels=labels)


# --------------------------------------------------------------------------- sentence pairs
def read_sentence_pairs(path: str | os.PathLike) -> list[tuple[list[str], list[str]]]:
    """``[(source_tokens, target_tokens), ...]`` from ``source<TAB>target`` lines.

    Both sides are tokenized by :func:`~npformer.data.tokenize_fra_eng`. Blank lines
    are skipped.

    Raises:
        DatasetFormatError: an empty file, non-UTF-8 bytes, or a line that is not
            exactly two tab-separated sentences, both non-empty (named by its line).
    """
    path = Path(path)
    text = _decode_utf8(_read_bytes(path), path)
    pairs = []
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        columns = line.split("\t")
        if len(columns) != 2:
            raise DatasetFormatError(
                f"{path}, line {number}: expected source<TAB>target (2 tab-separated "
                f"columns), found {len(columns)} column(s)")
        source, target = (tokenize_fra_eng(column) for column in columns)
        for tokens, side, column in ((source, "source", 1), (target, "target", 2)):
            if not tokens:
                raise DatasetFormatError(f"{path}, line {number}, column {column}: the "
                                         f"{side} sentence is empty")
        pairs.append((source, target))
    return pairs
