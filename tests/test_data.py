"""Tests of npformer.data: loaders, tokenizers, vocabularies, batching, locating files.

Most tests build small archives in the canonical layouts in ``tmp_path``; the
tests marked ``data`` read the real files (conftest's ``SHARED_DATA``, or the
folder named by ``NPFORMER_DATA``) and are skipped when they are absent. No test
touches the network or the user's cache: every test runs with
``XDG_CACHE_HOME`` in ``tmp_path`` and a network that refuses to connect.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import urllib.error
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npformer.data import (
    FRA_ENG,
    IMDB,
    TINY_SHAKESPEARE,
    CharVocab,
    ChecksumError,
    DatasetFormatError,
    DatasetNotFoundError,
    Vocab,
    batches,
    cache_dir,
    fetch,
    filter_by_length,
    length_bucketed_batches,
    lm_batch,
    load_fra_eng,
    load_imdb,
    load_imdb_splits,
    load_shakespeare,
    locate,
    pad_batch,
    preprocess_fra_eng,
    read_fra_eng,
    read_imdb_archive,
    split_90_10,
    split_by_source,
    split_validation,
    tokenize_fra_eng,
    tokenize_imdb,
)
from npformer.data import download as download_module

from .conftest import SHARED_DATA

_env_data = os.environ.get("NPFORMER_DATA")
REAL_DATA = SHARED_DATA if SHARED_DATA.is_dir() else Path(_env_data) if _env_data else None


@pytest.fixture(autouse=True)
def isolated_environment(tmp_path, monkeypatch):
    """No NPFORMER_DATA, a private cache folder, and no network."""
    monkeypatch.delenv("NPFORMER_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))

    def no_network(url, output_file, pooch_instance, check_only=False):
        raise urllib.error.URLError("network disabled in tests")

    monkeypatch.setattr(download_module, "_downloader", lambda url: no_network)


# --------------------------------------------------------------------------
# Builders of small archives in the canonical layouts
# --------------------------------------------------------------------------

def _add_file(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _add_dir(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    tar.addfile(info)


SMALL_IMDB = {
    # (split, label folder): [(id, rating, text)]
    ("train", "pos"): [(0, 9, "A <br /><br />GREAT film!"), (10, 8, "Loved it."),
                       (2, 7, "Café crème, très bon.")],
    ("train", "neg"): [(1, 2, "Awful.<br />Truly."), (3, 1, "Worst ever...")],
    ("test", "pos"): [(0, 10, "Superb.")],
    ("test", "neg"): [(5, 3, "Meh, boring."), (4, 4, "Not good")],
}


def make_imdb_tar(path: Path, reviews=SMALL_IMDB, *, reverse: bool = False,
                  official_extras: bool = True) -> Path:
    """A tar.gz with aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt and aclImdb/README."""
    members = [(f"aclImdb/{split}/{label}/{i}_{rating}.txt", text.encode("utf-8"))
               for (split, label), items in reviews.items() for i, rating, text in items]
    if official_extras:  # files of the official download that are not labelled reviews
        members += [("aclImdb/train/unsup/0_0.txt", b"unlabelled"),
                    ("aclImdb/train/labeledBow.feat", b"0:1"),
                    ("aclImdb/imdb.vocab", b"the\n")]
    members.sort(reverse=reverse)
    with tarfile.open(path, "w:gz") as tar:
        _add_dir(tar, "aclImdb")
        _add_file(tar, "aclImdb/README", b"Large Movie Review Dataset v1.0\n")
        for name, data in members:
            _add_file(tar, name, data)
    return path


FRA_LINES = [
    "Go.\tVa !",
    "Hi.\tSalut !",
    "Run!\tCours\u202f!",
    "Run!\tCourez\u202f!",
    "Who?\tQui ?\tCC-BY 2.0 (France) Attribution: tatoeba.org #2083030 (CK)",
    "",
    "Wow!\tÇa alors\u00a0!",
    "I'm OK.\tÇa va.",
    "Hello, Tom.\tBonjour, Tom.",
    "Hello,Tom.\tSalut,Tom.",
]


def make_fra_zip(path: Path, lines=FRA_LINES, member: str = "fra-eng/fra.txt") -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("fra-eng/", b"")
        archive.writestr(member, "\n".join(lines) + "\n")
    return path


SHAKESPEARE_TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
                    "All:\nSpeak, speak.\n")


def truncate(path: Path, keep_fraction: float = 0.5) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    return path


# --------------------------------------------------------------------------
# IMDB
# --------------------------------------------------------------------------

def test_tokenize_imdb_lowercases_splits_breaks_and_punctuation():
    assert tokenize_imdb("Great film!<br /><br />Didn't LOVE it...") == [
        "great", "film", "!", "didn", "'", "t", "love", "it", ".", ".", "."]
    assert tokenize_imdb("end.<br />Start") == ["end", ".", "start"]  # no "<", "br", "/", ">"
    assert tokenize_imdb("(10/10) \"wow\"") == ["(", "10", "/", "10", ")", '"', "wow", '"']
    assert tokenize_imdb("Café CRÈME") == ["café", "crème"]
    assert tokenize_imdb("   \n\t ") == []


def test_read_imdb_archive_labels_counts_and_order(tmp_path):
    archive = make_imdb_tar(tmp_path / "aclImdb_v1.tar.gz")
    splits = read_imdb_archive(archive)
    assert set(splits) == {"train", "test"}
    train, test = splits["train"], splits["test"]
    assert len(train) == 5 and len(test) == 3
    # negatives first, then positives, each by numeric id (2 before 10)
    assert train == [("Awful.<br />Truly.", 0), ("Worst ever...", 0),
                     ("A <br /><br />GREAT film!", 1), ("Café crème, très bon.", 1),
                     ("Loved it.", 1)]
    assert test == [("Not good", 0), ("Meh, boring.", 0), ("Superb.", 1)]


def test_read_imdb_archive_does_not_depend_on_member_order(tmp_path):
    forward = read_imdb_archive(make_imdb_tar(tmp_path / "a.tar.gz"))
    backward = read_imdb_archive(make_imdb_tar(tmp_path / "b.tar.gz", reverse=True,
                                               official_extras=False))
    assert forward == backward


def test_load_imdb_one_split_from_a_folder(tmp_path):
    make_imdb_tar(tmp_path / "aclImdb_v1.tar.gz")
    test = load_imdb("test", path=tmp_path)
    assert [label for _, label in test] == [0, 0, 1]
    assert load_imdb_splits(tmp_path)["test"] == test
    with pytest.raises(ValueError, match="unknown IMDB split"):
        load_imdb("unsup", path=tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_imdb_archive_gives_a_clear_error(tmp_path, damage):
    archive = make_imdb_tar(tmp_path / "aclImdb_v1.tar.gz")
    if damage == "truncated":
        truncate(archive)
    elif damage == "garbage":
        archive.write_bytes(b"this is not a tarball at all" * 100)
    else:
        archive.write_bytes(b"")
    with pytest.raises(DatasetFormatError) as info:
        read_imdb_archive(archive)
    assert f"{archive} is not a readable aclImdb_v1.tar.gz" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_imdb_archive_without_expected_members_is_an_error(tmp_path):
    no_test_split = {k: v for k, v in SMALL_IMDB.items() if k[0] == "train"}
    archive = make_imdb_tar(tmp_path / "partial.tar.gz", no_test_split)
    assert len(read_imdb_archive(archive, splits=("train",))["train"]) == 5
    with pytest.raises(DatasetFormatError, match=r"no aclImdb/test/\{neg,pos\}"):
        read_imdb_archive(archive)
    only_neg = {k: v for k, v in SMALL_IMDB.items() if k[1] == "neg"}
    with pytest.raises(DatasetFormatError, match=r"no aclImdb/train/\{pos\}"):
        read_imdb_archive(make_imdb_tar(tmp_path / "neg.tar.gz", only_neg))


def test_split_validation_is_disjoint_complete_and_seeded():
    items = list(range(100))
    train, val = split_validation(items, 20, seed=3)
    assert len(val) == 20 and len(train) == 80
    assert sorted(train + val) == items
    assert train == sorted(train) and val == sorted(val)  # original relative order
    assert split_validation(items, 20, seed=3) == (train, val)
    assert split_validation(items, 20, seed=4)[1] != val
    with pytest.raises(ValueError):
        split_validation(items, 101)


# --------------------------------------------------------------------------
# Vocab
# --------------------------------------------------------------------------

CORPUS = [["b", "a", "c", "a"], ["a", "b", "d"], ["e", "c"]]  # a:3 b:2 c:2 d:1 e:1


def test_vocab_specials_and_deterministic_order():
    vocab = Vocab.build(CORPUS)
    assert vocab.tokens == ("<pad>", "<unk>", "a", "b", "c", "d", "e")  # freq desc, then string
    assert (vocab.pad_id, vocab.unk_id) == (0, 1)
    assert Vocab.build(reversed(CORPUS)) == vocab
    with pytest.raises(ValueError, match="no <bos>"):
        _ = vocab.bos_id
    with_both = Vocab.build(CORPUS, bos=True, eos=True)
    assert with_both.tokens[:4] == ("<pad>", "<unk>", "<bos>", "<eos>")
    assert (with_both.bos_id, with_both.eos_id) == (2, 3)
    assert Vocab.build(CORPUS, eos=True).eos_id == 2


def test_vocab_min_freq_and_max_size():
    assert Vocab.build(CORPUS, min_freq=2).tokens[2:] == ("a", "b", "c")
    assert Vocab.build(CORPUS, max_size=2).tokens[2:] == ("a", "b")
    small = Vocab.build(CORPUS, min_freq=2, max_size=10, bos=True)
    assert len(small) == 3 + 3  # specials are not counted by max_size
    assert Vocab.build(CORPUS, max_size=0).tokens == ("<pad>", "<unk>")


def test_vocab_encode_decode_and_unknowns():
    vocab = Vocab.build(CORPUS, min_freq=2, eos=True)
    ids = vocab.encode(["a", "zzz", "c", "<eos>"])
    assert ids == [3, 1, 5, 2]
    assert vocab.decode(ids) == ["a", "<unk>", "c", "<eos>"]
    assert vocab.decode(np.array([0, 3, 2]), skip_specials=True) == ["a"]
    assert "a" in vocab and "zzz" not in vocab
    assert vocab.index("zzz") == vocab.unk_id


def test_vocab_json_round_trip_through_an_npz(tmp_path):
    vocab = Vocab.build(CORPUS + [["ça", "va", "«"]], bos=True, eos=True)
    assert Vocab.from_json(vocab.to_json()) == vocab
    np.savez(tmp_path / "ckpt.npz", vocab=np.array(vocab.to_json()))
    with np.load(tmp_path / "ckpt.npz") as ckpt:
        stored = ckpt["vocab"]
        assert stored.shape == () and stored.dtype.kind == "U"
        assert Vocab.from_json(stored) == vocab
    assert vocab != Vocab.build(CORPUS)
    with pytest.raises(ValueError):
        Vocab.from_json(CharVocab("ab").to_json())


def test_vocab_rejects_a_bad_token_list():
    with pytest.raises(ValueError):
        Vocab(["a", "<pad>", "<unk>"])
    with pytest.raises(ValueError):
        Vocab(["<pad>", "<unk>", "a", "a"])


# --------------------------------------------------------------------------
# English-French
# --------------------------------------------------------------------------

def test_preprocess_fra_eng_matches_d2l():
    assert preprocess_fra_eng("Cours\u202f!") == "cours !"
    assert preprocess_fra_eng("Ça alors\u00a0!") == "ça alors !"
    assert preprocess_fra_eng("Hello,Tom.") == "hello ,tom ."
    assert preprocess_fra_eng("Wait... What?!") == "wait . . . what ? !"
    assert preprocess_fra_eng("Go .") == "go ."  # already spaced: unchanged
    assert tokenize_fra_eng("Hello, Tom.") == ["hello", ",", "tom", "."]
    assert tokenize_fra_eng("Qui\u202f?  ") == ["qui", "?"]


def test_read_fra_eng_zip(tmp_path):
    pairs = read_fra_eng(make_fra_zip(tmp_path / "fra-eng.zip"))
    assert len(pairs) == 9  # the blank line is skipped
    assert pairs[0] == (["go", "."], ["va", "!"])
    assert pairs[2] == (["run", "!"], ["cours", "!"])
    assert pairs[4] == (["who", "?"], ["qui", "?"])  # third column ignored
    assert pairs[5] == (["wow", "!"], ["ça", "alors", "!"])
    assert pairs[6] == (["i'm", "ok", "."], ["ça", "va", "."])
    assert pairs[8] == (["hello", ",tom", "."], ["salut", ",tom", "."])  # d2l splits on spaces only


def test_read_fra_eng_plain_text_and_other_layouts(tmp_path):
    from_zip = read_fra_eng(make_fra_zip(tmp_path / "fra-eng.zip"))
    plain = tmp_path / "fra.txt"
    plain.write_text("\r\n".join(FRA_LINES), encoding="utf-8")  # CRLF line ends too
    assert read_fra_eng(plain) == from_zip
    manythings = make_fra_zip(tmp_path / "manythings.zip", member="fra.txt")  # fra.txt at the root
    assert read_fra_eng(manythings) == from_zip
    assert load_fra_eng(tmp_path / "fra-eng.zip") == from_zip
    assert load_fra_eng(tmp_path) == from_zip  # a folder holding fra-eng.zip


@pytest.mark.filterwarnings("ignore::npformer.data.DatasetWarning")  # no-pairs: 1 line skipped
@pytest.mark.parametrize("damage", ["truncated", "garbage", "no-member", "latin-1", "no-pairs"])
def test_corrupt_fra_eng_gives_a_clear_error(tmp_path, damage):
    path = make_fra_zip(tmp_path / "fra-eng.zip")
    if damage == "truncated":
        truncate(path)
    elif damage == "garbage":
        path.write_bytes(b"PK\x03\x04" + b"\x00" * 50)
    elif damage == "no-member":
        path = make_fra_zip(tmp_path / "other.zip", member="fra-eng/deu.txt")
    elif damage == "latin-1":
        path = tmp_path / "fra.txt"
        path.write_bytes("Ça va.\tÇa va.\n".encode("latin-1"))
    else:
        path = tmp_path / "fra.txt"
        path.write_text("no tabs here\n", encoding="utf-8")
    with pytest.raises(DatasetFormatError, match=str(path.name)):
        read_fra_eng(path)


def test_filter_by_length_keeps_pairs_short_on_both_sides():
    pairs = [(["a"] * 3, ["b"] * 3), (["a"] * 4, ["b"]), (["a"], ["b"] * 4)]
    assert filter_by_length(pairs, 3) == pairs[:1]
    assert filter_by_length(pairs, 4) == pairs


def test_load_fra_eng_max_len(tmp_path):
    make_fra_zip(tmp_path / "fra-eng.zip")
    short = load_fra_eng(tmp_path, max_len=2)
    assert short and all(len(en) <= 2 and len(fr) <= 2 for en, fr in short)


sentence_ids = st.lists(st.integers(0, 30), min_size=1, max_size=80)


@settings(max_examples=60, deadline=None)
@given(sources=sentence_ids, data=st.data())
def test_split_by_source_holds_out_whole_sentences(sources, data):
    """For any corpus with repeated English sentences, the held-out sentences are
    absent from training and every one of their translations is a reference."""
    pairs = [([f"en{s}"], [f"fr{s}", f"v{i}"]) for i, s in enumerate(sources)]
    n_distinct = len(set(sources))
    n_held = data.draw(st.integers(0, n_distinct))
    seed = data.draw(st.integers(0, 2**32 - 1))
    train, heldout = split_by_source(pairs, n_held, seed)
    assert len(heldout) == n_held
    train_sentences = {" ".join(en) for en, _ in train}
    assert train_sentences.isdisjoint(heldout)
    assert train_sentences | set(heldout) == {f"en{s}" for s in sources}
    assert len(train) + sum(len(refs) for refs in heldout.values()) == len(pairs)
    for english, references in heldout.items():
        assert references == [" ".join(fr) for en, fr in pairs if " ".join(en) == english]
    assert split_by_source(pairs, n_held, seed) == (train, heldout)


def test_split_by_source_on_the_small_zip(tmp_path):
    pairs = read_fra_eng(make_fra_zip(tmp_path / "fra-eng.zip"))
    seeds_holding_run = [seed for seed in range(50)
                         if "run !" in split_by_source(pairs, 3, seed)[1]]
    assert seeds_holding_run, "some seed should hold out 'run !'"
    train, heldout = split_by_source(pairs, 3, seeds_holding_run[0])
    assert heldout["run !"] == ["cours !", "courez !"]  # both translations
    assert all(en != ["run", "!"] for en, _ in train)
    with pytest.raises(ValueError, match="distinct English sentences"):
        split_by_source(pairs, 100, 0)


# --------------------------------------------------------------------------
# Tiny Shakespeare
# --------------------------------------------------------------------------

def test_char_vocab_round_trip():
    vocab = CharVocab.from_text(SHAKESPEARE_TEXT)
    assert vocab.chars == "".join(sorted(set(SHAKESPEARE_TEXT)))
    assert vocab.chars[0] == "\n" and len(vocab) == len(set(SHAKESPEARE_TEXT))
    ids = vocab.encode(SHAKESPEARE_TEXT)
    assert vocab.decode(ids) == SHAKESPEARE_TEXT
    assert CharVocab.from_json(vocab.to_json()) == vocab
    assert CharVocab.from_json(np.array(vocab.to_json())) == vocab
    with pytest.raises(KeyError, match="'#'"):
        vocab.encode("#")


def test_split_90_10_as_nanogpt():
    train, val = split_90_10(np.arange(1001))
    assert len(train) == 900 and len(val) == 101  # int(1001 * 0.9) = 900
    assert train[-1] + 1 == val[0]


@pytest.mark.parametrize("layout", ["tinyshakespeare/input.txt", "input.txt"])
def test_load_shakespeare_from_either_folder_layout(tmp_path, layout):
    target = tmp_path / layout
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(SHAKESPEARE_TEXT, encoding="utf-8", newline="")
    assert load_shakespeare(tmp_path) == SHAKESPEARE_TEXT
    assert load_shakespeare(target) == SHAKESPEARE_TEXT


def test_load_shakespeare_rejects_a_binary_file(tmp_path):
    bad = tmp_path / "input.txt"
    bad.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(DatasetFormatError, match="not a UTF-8 text file"):
        load_shakespeare(bad)


# --------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------

def test_pad_batch_pads_and_truncates():
    ids, valid = pad_batch([[5, 6, 7], [8], []], pad_id=0)
    assert ids.dtype == np.int64 and valid.dtype == np.int64
    np.testing.assert_array_equal(ids, [[5, 6, 7], [8, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(valid, [3, 1, 0])
    ids, valid = pad_batch([[5, 6, 7], [8]], pad_id=9, max_len=2)
    np.testing.assert_array_equal(ids, [[5, 6], [8, 9]])
    np.testing.assert_array_equal(valid, [2, 1])
    ids, valid = pad_batch([], pad_id=0)
    assert ids.shape == (0, 0) and valid.shape == (0,)


def test_pad_batch_takes_numpy_ids():
    ids, valid = pad_batch([np.array([5, 6], dtype=np.int32), np.arange(3, dtype=np.uint8)],
                           pad_id=np.int64(0), max_len=np.int64(2))
    np.testing.assert_array_equal(ids, [[5, 6], [0, 1]])
    np.testing.assert_array_equal(valid, [2, 2])


@pytest.mark.parametrize("seqs, kwargs, error, message", [
    # issue 37, case 23: 1.5 became 1 silently
    ([[1.5, 2], [3]], {}, TypeError, r"sequence 0 must hold integer token ids, got 1\.5 \(float\)"),
    ([[1], [2.0]], {}, TypeError, r"sequence 1 must hold integer token ids, got 2\.0 \(float\)"),
    ([np.array([1.5])], {}, TypeError, r"sequence 0 must hold integer token ids, got 1\.5"),
    ([["a", "b"]], {}, TypeError, r"sequence 0 must hold integer token ids, got 'a' \(str\)"),
    ([[True, False]], {}, TypeError, r"got True \(bool\)"),
    ([[1, [2, 3]]], {}, TypeError, r"sequence 0 must be a flat sequence of integer token ids"),
    ([[[1, 2]]], {}, TypeError, r"sequence 0 must be a flat sequence .* shape \(1, 2\)"),
    ([[2**70]], {}, ValueError, r"sequence 0 holds token ids beyond int64"),
    ([[1]], {"pad_id": 0.5}, TypeError, r"pad_id must be an integer, got 0\.5"),
    ([[1]], {"max_len": 2.5}, TypeError, r"max_len must be an integer or None, got 2\.5"),
    ([[1]], {"max_len": -1}, ValueError, r"max_len must be at least 0, got -1"),
])
def test_pad_batch_refuses_what_is_not_integer_ids(seqs, kwargs, error, message):
    with pytest.raises(error, match=message):
        pad_batch(seqs, **{"pad_id": 0, **kwargs})


@settings(max_examples=80, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(1, 50), max_size=12), min_size=1, max_size=8),
       max_len=st.one_of(st.none(), st.integers(0, 12)))
def test_pad_batch_property(seqs, max_len):
    """Row b holds the first valid_lens[b] ids of sequence b, then only padding."""
    ids, valid = pad_batch(seqs, pad_id=0, max_len=max_len)
    limit = max_len if max_len is not None else max(map(len, seqs))
    assert ids.shape == (len(seqs), max(min(len(s), limit) for s in seqs))
    for row, seq, n in zip(ids, seqs, valid):
        assert n == min(len(seq), limit)
        assert list(row[:n]) == seq[:n] and not row[n:].any()


def test_batches_cover_every_index_once():
    ordered = list(batches(10, 4))
    assert [b.tolist() for b in ordered] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [len(b) for b in batches(10, 4, drop_last=True)] == [4, 4]
    shuffled = list(batches(10, 4, shuffle=True, rng=np.random.default_rng(0)))
    assert sorted(np.concatenate(shuffled).tolist()) == list(range(10))
    again = list(batches(10, 4, shuffle=True, rng=np.random.default_rng(0)))
    assert all(np.array_equal(a, b) for a, b in zip(shuffled, again))
    assert all(b.dtype == np.int64 for b in shuffled)
    with pytest.raises(ValueError, match="rng"):
        next(batches(10, 4, shuffle=True))


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), max_size=200), batch_size=st.integers(1, 16),
       seed=st.integers(0, 1000))
def test_length_bucketed_batches_partition_the_data(lengths, batch_size, seed):
    result = length_bucketed_batches(lengths, batch_size, np.random.default_rng(seed),
                                     pool_batches=4)
    assert sorted(np.concatenate(result).tolist() if result else []) == list(range(len(lengths)))
    assert all(1 <= len(b) <= batch_size for b in result)


def test_length_bucketed_batches_group_similar_lengths():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=2000)
    result = length_bucketed_batches(lengths, 32, rng, pool_batches=20)
    spread = np.mean([np.ptp(lengths[b]) for b in result])
    random_spread = np.mean([np.ptp(lengths[b]) for b in batches(2000, 32, True, rng)])
    assert spread < random_spread / 5
    deterministic = length_bucketed_batches(lengths, 32)
    assert np.all(np.diff(lengths[np.concatenate(deterministic)]) >= 0)


def test_lm_batch_windows_and_shifted_targets():
    data = np.arange(1000, dtype=np.uint16) * 3
    x, y = lm_batch(data, block_size=8, batch_size=5, rng=np.random.default_rng(0))
    assert x.shape == y.shape == (5, 8) and x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])       # targets are inputs shifted by one
    np.testing.assert_array_equal(np.diff(x, axis=1), 3)      # contiguous windows of the stream
    np.testing.assert_array_equal(y[:, -1], x[:, -1] + 3)     # the token after the window
    x2, _ = lm_batch(data, 8, 5, np.random.default_rng(0))
    np.testing.assert_array_equal(x, x2)


def test_lm_batch_uses_the_last_token_as_a_target_only():
    data = np.arange(9)
    x, y = lm_batch(data, block_size=8, batch_size=3, rng=np.random.default_rng(1))
    np.testing.assert_array_equal(x, np.tile(np.arange(8), (3, 1)))
    np.testing.assert_array_equal(y, np.tile(np.arange(1, 9), (3, 1)))
    with pytest.raises(ValueError):
        lm_batch(np.arange(8), 8, 1, np.random.default_rng(0))


# --------------------------------------------------------------------------
# Locating and downloading
# --------------------------------------------------------------------------

URL = "https://example.org/data/thing.bin"
PAYLOAD = b"dataset bytes" * 1000
PAYLOAD_SHA256 = hashlib.sha256(PAYLOAD).hexdigest()


def _put(folder: Path, name: str = "thing.bin", data: bytes = b"x") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return folder / name


def test_cache_dir_follows_xdg_cache_home(tmp_path, monkeypatch):
    assert cache_dir() == tmp_path / "xdg-cache" / "npformer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "npformer"


def test_locate_search_order(tmp_path, monkeypatch):
    explicit = _put(tmp_path / "explicit")
    env = _put(tmp_path / "env")
    cached = _put(cache_dir())
    monkeypatch.setenv("NPFORMER_DATA", str(tmp_path / "env"))
    assert locate("thing.bin", URL, set(), path=tmp_path / "explicit") == explicit
    assert locate("thing.bin", URL, set(), path=explicit) == explicit           # the file itself
    other = _put(tmp_path / "anywhere", name="my-own-name.bin")
    assert locate("thing.bin", URL, set(), path=other) == other                 # any file name
    assert locate("thing.bin", URL, set()) == env
    monkeypatch.delenv("NPFORMER_DATA")
    assert locate("thing.bin", URL, set()) == cached


def test_locate_does_not_checksum_local_files(tmp_path):
    local = _put(tmp_path, data=b"a user's own copy")
    assert locate("thing.bin", URL, {PAYLOAD_SHA256}, path=tmp_path) == local


def test_locate_alternative_names(tmp_path):
    bare = _put(tmp_path, "input.txt")
    assert locate(TINY_SHAKESPEARE.filename, TINY_SHAKESPEARE.url, TINY_SHAKESPEARE.checksums,
                  path=tmp_path, alternatives=TINY_SHAKESPEARE.alternatives) == bare
    nested = _put(tmp_path / "tinyshakespeare", "input.txt")
    assert locate(TINY_SHAKESPEARE.filename, TINY_SHAKESPEARE.url, TINY_SHAKESPEARE.checksums,
                  path=tmp_path, alternatives=TINY_SHAKESPEARE.alternatives) == nested


def test_an_explicit_folder_without_the_file_is_an_error_naming_both(tmp_path, monkeypatch):
    """--data FOLDER is taken at its word: no fall-through to $NPFORMER_DATA or the cache,
    and no download, even when another copy exists there."""
    _put(tmp_path / "env", "aclImdb_v1.tar.gz")
    monkeypatch.setenv("NPFORMER_DATA", str(tmp_path / "env"))
    (tmp_path / "data").mkdir()
    with pytest.raises(DatasetNotFoundError,
                       match=rf"the data folder {re.escape(str(tmp_path / 'data'))} has no "
                             r"aclImdb_v1\.tar\.gz"):
        load_imdb("train", path=tmp_path / "data")
    assert not cache_dir().exists()  # nothing downloaded


def test_missing_data_without_network_gives_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("NPFORMER_DATA", str(tmp_path / "env-folder"))
    with pytest.raises(DatasetNotFoundError) as info:
        load_imdb("train")
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    for expected in ["aclImdb_v1.tar.gz", str(tmp_path / "env-folder"),
                     str(cache_dir()), IMDB.url, "network disabled in tests",
                     "--data PATH", "NPFORMER_DATA"]:
        assert expected in message, expected
    assert not cache_dir().exists() or not any(cache_dir().rglob("*"))  # nothing left behind


def test_missing_data_when_the_download_function_fails(tmp_path, monkeypatch):
    def failing_fetch(url, destination, checksums=()):
        raise OSError("no route to host")

    monkeypatch.setattr(download_module, "fetch", failing_fetch)
    with pytest.raises(DatasetNotFoundError, match="(?s)NPFORMER_DATA: not set.*no route to host"):
        load_shakespeare()


def test_locate_explicit_path_that_does_not_exist(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="does-not-exist.tar.gz does not exist"):
        load_imdb("train", path=tmp_path / "does-not-exist.tar.gz")


def test_locate_without_download(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="Downloading was disabled"):
        locate("thing.bin", URL, set(), download=False)


def _serve(monkeypatch, data: bytes) -> list[str]:
    """Replace pooch's HTTP downloader by one that writes ``data`` (no network)."""
    requested = []

    def fake_download(url, output_file, pooch_instance, check_only=False):
        requested.append(url)
        Path(output_file).write_bytes(data)

    monkeypatch.setattr(download_module, "_downloader", lambda url: fake_download)
    return requested


def test_download_into_the_cache_with_a_good_checksum(monkeypatch):
    requested = _serve(monkeypatch, PAYLOAD)
    path = locate("sub/thing.bin", URL, {PAYLOAD_SHA256, "0" * 64})
    assert path == cache_dir() / "sub" / "thing.bin" and path.read_bytes() == PAYLOAD
    assert requested == [URL]
    assert list(path.parent.iterdir()) == [path]  # no temporary file left
    assert locate("sub/thing.bin", URL, {PAYLOAD_SHA256}) == path  # second time: from the cache
    assert requested == [URL]


def test_download_accepts_a_sha1_checksum(tmp_path, monkeypatch):
    _serve(monkeypatch, PAYLOAD)
    target = fetch(URL, tmp_path / "thing.bin", {hashlib.sha1(PAYLOAD).hexdigest()})
    assert target.read_bytes() == PAYLOAD


def test_download_with_a_bad_checksum_is_deleted(monkeypatch):
    _serve(monkeypatch, PAYLOAD[:-1])
    with pytest.raises(ChecksumError, match="none of the accepted"):
        locate("thing.bin", URL, {PAYLOAD_SHA256})
    assert not any(cache_dir().iterdir())  # neither the file nor a temporary file


def test_dataset_specs_are_consistent():
    for spec in (IMDB, FRA_ENG, TINY_SHAKESPEARE):
        assert spec.url.endswith(Path(spec.filename).name)
        assert spec.checksums and all(len(c) in (40, 64) for c in spec.checksums)
        assert all(int(c, 16) >= 0 for c in spec.checksums)


def test_data_package_does_not_import_torch():
    """The data package is host-side: importing it pulls in no torch or cupy."""
    code = ("import sys, npformer; before = set(sys.modules); import npformer.data; "
            "new = set(sys.modules) - before; "
            "print(sorted(m for m in new if m.split('.')[0] in ('torch', 'cupy')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1], check=True)
    assert result.stdout.strip() == "[]"


# --------------------------------------------------------------------------
# The real datasets (conftest's SHARED_DATA, or $NPFORMER_DATA)
# --------------------------------------------------------------------------

needs_real_data = pytest.mark.skipif(REAL_DATA is None, reason="real datasets not found")


@pytest.fixture(scope="module")
def real_imdb():
    if REAL_DATA is None:
        pytest.skip("real datasets not found")
    return load_imdb_splits(REAL_DATA)


@pytest.mark.data
@needs_real_data
def test_real_imdb_counts(real_imdb):
    for split in ("train", "test"):
        labels = np.array([label for _, label in real_imdb[split]])
        assert len(labels) == 25_000
        assert (labels == 1).sum() == 12_500 and (labels == 0).sum() == 12_500
    assert any("<br />" in text for text, _ in real_imdb["train"][:100])


@pytest.mark.data
@needs_real_data
def test_real_imdb_token_statistics_match_the_reference(real_imdb):
    """ANCHORS.md: reviews average 279 tokens (median 208) with its tokenization."""
    lengths = np.array([len(tokenize_imdb(text)) for text, _ in real_imdb["train"]])
    assert round(lengths.mean()) == 279 and np.median(lengths) == 208


@pytest.mark.data
@needs_real_data
def test_real_fra_eng_pairs():
    pairs = load_fra_eng(REAL_DATA)
    assert len(pairs) == 167_130
    assert pairs[0] == (["go", "."], ["va", "!"])
    assert not any("\u202f" in t or "\xa0" in t for _, fr in pairs for t in fr)


@pytest.mark.data
@needs_real_data
def test_real_shakespeare():
    text = load_shakespeare(REAL_DATA)
    assert len(text) == 1_115_394
    vocab = CharVocab.from_text(text)
    assert len(vocab) == 65
    train, val = split_90_10(np.array(vocab.encode(text)))
    assert len(train) == 1_003_854 and len(val) == 111_540


@pytest.mark.data
@needs_real_data
def test_real_checksums_are_accepted():
    sums = REAL_DATA / "SHA256SUMS"
    if not sums.is_file():
        pytest.skip("no SHA256SUMS beside the data")
    listed = dict(line.split()[::-1] for line in sums.read_text().splitlines() if line.strip())
    for spec in (IMDB, FRA_ENG, TINY_SHAKESPEARE):
        assert listed[spec.filename] in spec.checksums


@pytest.mark.parametrize("call, error, match", [
    (lambda v: Vocab.build(["a b", "c"]), TypeError, r"token_lists\[0\] must be a list of "
                                                     r"tokens, got a str \('a b'\)"),
    (lambda v: Vocab.build([["a"], [1]]), TypeError, r"token_lists\[1\]\[0\] must be a token"),
    (lambda v: Vocab.build([["a"]], bos="no"), TypeError, "bos must be True or False, got 'no'"),
    (lambda v: Vocab.build([["a"]], min_freq=1.5), TypeError, "min_freq must be an integer"),
    (lambda v: v.encode("ab"), TypeError, "tokens must be a list of tokens, got a str"),
    (lambda v: v.encode(["a", 3]), TypeError, r"tokens\[1\] must be a token \(a str\)"),
    (lambda v: v.decode([2, -1]), ValueError, r"ids\[1\] must be at least 0, got -1"),
    (lambda v: v.decode([2, 99]), ValueError, r"ids\[1\] = 99 is outside the vocabulary"),
    (lambda v: v.decode(["2"]), TypeError, r"ids\[0\] must be an integer"),
    (lambda v: v.decode("23"), TypeError, "ids must be a list of token ids"),
    (lambda v: v.decode([2], skip_specials="yes"), TypeError, "skip_specials must be True or "
                                                              "False"),
])
def test_vocab_refuses_a_str_for_a_list_and_ids_of_the_wrong_kind(call, error, match):
    """issue 47 (the token-list and switch kinds at the Vocab): a str where a list of
    tokens is meant was spelled as characters, a negative id indexed from the end."""
    vocab = Vocab.build([["a", "b", "c"]])
    with pytest.raises(error, match=match):
        call(vocab)
    assert vocab.decode(np.array([2, 3], dtype=np.int32)) == ["a", "b"]


@pytest.mark.parametrize("text, error, match", [
    ("", ValueError, "the Vocab's JSON is not a serialised Vocab: it is not valid JSON"),
    (None, TypeError, "must be a JSON document \\(a str\\), got None"),
    ('{"type": "Vocab"}', ValueError, "it has no 'itos'"),
    ('{"type": "Vocab", "itos": "abc"}', ValueError, "itos must be a list of tokens, got a str"),
    ('{"type": "Vocab", "itos": ["<pad>", "<unk>", 3]}', ValueError, r"itos\[2\] must be a "
                                                                     r"token"),
    ('{"type": "BPE", "itos": []}', ValueError, "its \"type\" is 'BPE', not \"Vocab\""),
])
def test_vocab_from_json_names_the_document_and_its_fault(text, error, match):
    """issue 47 (the JSON document kind, as BPE.from_json): a damaged saved vocabulary was
    a raw JSONDecodeError, KeyError or TypeError."""
    with pytest.raises(error, match=match):
        Vocab.from_json(text)
    vocab = Vocab.build([["a", "b"]], eos=True)
    assert Vocab.from_json(np.array(vocab.to_json()), "the checkpoint's src_vocab") == vocab
