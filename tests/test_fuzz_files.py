"""Fuzzing as a test: damaged files into the three loaders and the checkpoint reader.

Small synthetic files (a tar.gz in aclImdb's layout, a zip holding fra-eng/fra.txt, a
Shakespeare text file, a checkpoint .npz) are truncated at random points and have random
bytes flipped.  Every call either returns results of the documented shape, or raises one
of the documented exceptions, ``DatasetFormatError`` (loaders) or ``CheckpointError``
(checkpoints), whose message names the file; never ``ZeroDivisionError``, ``IndexError``,
``AttributeError``, ``KeyError``, ``UnicodeDecodeError``, ``zipfile.BadZipFile``,
``tarfile.ReadError``, ``EOFError`` or a NumPy error from inside.

Also: fra-eng lines with no tab or an empty side are skipped and reported in one
DatasetWarning naming the file, the count and the line numbers.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from npformer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from npformer.data import (
    DatasetFormatError,
    DatasetWarning,
    read_fra_eng,
    read_imdb_archive,
    read_shakespeare,
)
from npformer.data.fra_eng import parse_fra_eng

from .conftest import using_backend
from .helpers import tiered
from .test_checkpoint_train import lm
from .test_data import SHAKESPEARE_TEXT, make_fra_zip, make_imdb_tar

FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, bytes]:
    """The bytes of one good file of each kind."""
    folder = tmp_path_factory.mktemp("pristine")
    shakespeare = folder / "input.txt"
    shakespeare.write_text(SHAKESPEARE_TEXT, encoding="utf-8")
    with using_backend("numpy", "float32"):
        model = lm()
        checkpoint = save_checkpoint(folder / "model.npz", model, tiered.Adam(model.parameters()))
    return {"imdb": make_imdb_tar(folder / "aclImdb_v1.tar.gz").read_bytes(),
            "fra": make_fra_zip(folder / "fra-eng.zip").read_bytes(),
            "shakespeare": shakespeare.read_bytes(),
            "checkpoint": checkpoint.read_bytes()}


def damaged(data: bytes, cut: float, flips: list[tuple[float, int]]) -> bytes:
    """``data`` truncated to a fraction ``cut`` of its length, with bytes XOR-ed at
    relative positions ``flips``."""
    out = bytearray(data[:max(0, int(len(data) * cut))])
    for where, mask in flips:
        if out:
            out[min(int(where * len(out)), len(out) - 1)] ^= mask
    return bytes(out)


damage = dict(cut=st.one_of(st.just(1.0), st.floats(0.0, 1.0)),
              flips=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(1, 255)), max_size=4))


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _assert_names_the_file(exc: Exception, path: Path):
    assert path.name in str(exc), f"{type(exc).__name__} does not name {path.name}: {exc}"


# =========================================================================== loaders
@FUZZ
@given(**damage)
def test_fuzz_imdb_archive(pristine, tmp_path, cut, flips):
    path = _write(tmp_path, "aclImdb_v1.tar.gz", damaged(pristine["imdb"], cut, flips))
    try:
        splits = read_imdb_archive(path)
    except DatasetFormatError as exc:
        _assert_names_the_file(exc, path)
        return
    for split, items in splits.items():
        assert split in ("train", "test") and items
        assert all(isinstance(text, str) and label in (0, 1) for text, label in items)


@FUZZ
@given(**damage)
def test_fuzz_fra_eng_zip(pristine, tmp_path, cut, flips):
    path = _write(tmp_path, "fra-eng.zip", damaged(pristine["fra"], cut, flips))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DatasetWarning)
            pairs = read_fra_eng(path)
    except DatasetFormatError as exc:
        _assert_names_the_file(exc, path)
        return
    assert pairs and all(en and fr for en, fr in pairs)  # no empty side ever comes out


@FUZZ
@given(**damage)
def test_fuzz_shakespeare_text(pristine, tmp_path, cut, flips):
    path = _write(tmp_path, "input.txt", damaged(pristine["shakespeare"], cut, flips))
    try:
        text = read_shakespeare(path)
    except DatasetFormatError as exc:
        _assert_names_the_file(exc, path)
        return
    assert isinstance(text, str) and text


# =========================================================================== checkpoints
@FUZZ
@given(**damage)
def test_fuzz_checkpoint_file(pristine, tmp_path, cut, flips):
    path = _write(tmp_path, "model.npz", damaged(pristine["checkpoint"], cut, flips))
    try:
        checkpoint = load_checkpoint(path)
    except CheckpointError as exc:
        _assert_names_the_file(exc, path)
        return
    assert checkpoint.kind == "causal_lm"
    assert all(np.isfinite(v).all() for v in checkpoint.params.values())


@pytest.mark.parametrize("content", [b"", b"PK", b"\x93NUMPY", b"{}", "é".encode("latin-1")])
def test_checkpoint_of_the_wrong_kind(tmp_path, content):
    path = _write(tmp_path, "model.npz", content)
    with pytest.raises(CheckpointError, match="model.npz"):
        load_checkpoint(path)


# =========================================================================== fra-eng lines
def test_malformed_fra_eng_lines_are_skipped_and_counted(tmp_path):
    lines = ["Go.\tVa !", "no tab on this line", "\tOnly French.", "Only English.\t",
             "  \t  ", "", "Hi.\tSalut !"]
    path = tmp_path / "fra.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.warns(DatasetWarning, match=r"fra\.txt: skipped 4 malformed line\(s\) .*"
                                            r"\(line 2, 3, 4, 5\)") as record:
        pairs = read_fra_eng(path)
    assert pairs == [(["go", "."], ["va", "!"]), (["hi", "."], ["salut", "!"])]
    assert record[0].message.line_numbers == [2, 3, 4, 5]


def test_well_formed_fra_eng_gives_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(parse_fra_eng("Go.\tVa !\n\nHi.\tSalut !\n")) == 2  # blank line: silent


# =========================================================================== labelled rows
# Issue 37, case 9: a delimiter inside a text must never shift a column.  Rows written by
# csv's own writer (quoting what needs it) load exactly; rows joined by hand with the
# delimiter either load exactly (no delimiter inside a field) or are refused naming the
# file and the line, never returned with a text cut or a label taken from a text.
texts = st.text(st.characters(codec="utf-8", exclude_characters="\r\n\x00\ufeff"),
                min_size=1, max_size=12).filter(lambda t: t.strip() == t and t.strip())
rows = st.lists(st.tuples(texts, st.sampled_from(["pos", "neg", "a,b", "x\ty"])),
                min_size=1, max_size=6)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=rows, tab=st.booleans(), by_hand=st.booleans())
def test_a_delimiter_in_a_field_never_shifts_a_column(tmp_path, rows, tab, by_hand):
    import csv
    import io

    from npformer.data import read_labelled_texts

    delimiter = "\t" if tab else ","
    # a quote written by hand into a CSV field is CSV's quoting, not a text's character
    assume(tab or not by_hand or not any('"' in text for text, _ in rows))
    path = tmp_path / ("rows.tsv" if tab else "rows.csv")
    if by_hand or tab:  # TSV has no quoting: always by hand
        lines = [f"text{delimiter}label"] + [f"{t}{delimiter}{label}" for t, label in rows]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    else:
        buffer = io.StringIO(newline="")
        csv.writer(buffer, lineterminator="\n").writerows([("text", "label"), *rows])
        path.write_text(buffer.getvalue(), encoding="utf-8")
    fields_clean = all(delimiter not in text + label for text, label in rows)
    try:
        records = read_labelled_texts(path)
    except DatasetFormatError as exc:
        assert (by_hand or tab) and not fields_clean, exc
        _assert_names_the_file(exc, path)
        assert re.search(r", line \d+: ", str(exc)), exc
        return
    assert [(text, label) for text, label, _ in records] == rows
