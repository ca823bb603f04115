"""Training on your own data: the loaders of npformer.data.files, the demos' --data
FILE, and the guide's "Train on your own data" block (docs/guide.md).

* Labelled texts: CSV (quoted commas and newlines), TSV (no quoting), JSON Lines and
  JSON arrays; named columns; any labels (strings, integers), sorted, from the
  training file; every malformed input refused naming the file, the line and the
  column (missing column, empty file, bad JSON, non-UTF-8 bytes, a label the training
  file lacks...).
* Sentence pairs (source<TAB>target) and plain text, with the same kind of errors.
* Each demo's --smoke on a tiny generated file of the user's (CSV classifier with its
  own column and label names, TSV pairs, a text file), then --predict printing the
  user's label name, --translate and --sample-only.
* The guide's block runs as written and trains.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from npformer import cli, parallel
from npformer.data import (
    DatasetFormatError,
    DatasetNotFoundError,
    is_user_data,
    load_text_classification,
    read_labelled_texts,
    read_sentence_pairs,
    read_text_file,
    sorted_labels,
    tokenize_fra_eng,
)
from tests.test_demos import SMOKE, run_demo

ROOT = Path(__file__).resolve().parents[1]


def write(folder: Path, name: str, content: str | bytes) -> Path:
    path = folder / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def format_error(match: str):
    return pytest.raises(DatasetFormatError, match=match)


# =========================================================================== labelled texts
def test_csv_named_columns_quotes_and_line_numbers(tmp_path):
    path = write(tmp_path, "r.csv", 'id,review,sentiment\n1,"great, really",pos\n'
                                    '2,"two\nlines",neg\n\n3,plain,pos\n')
    records = read_labelled_texts(path, text_column="review", label_column="sentiment")
    assert records == [("great, really", "pos", 2), ("two\nlines", "neg", 3),
                       ("plain", "pos", 6)]


def test_csv_with_a_byte_order_mark_and_windows_line_ends(tmp_path):
    path = write(tmp_path, "r.csv", "\ufefftext,label\r\nhi,a\r\nho,b\r\n".encode())
    assert read_labelled_texts(path) == [("hi", "a", 2), ("ho", "b", 3)]


def test_tsv_is_not_quoted(tmp_path):
    path = write(tmp_path, "r.tsv", 'label\ttext\n1 \t"quoted", he said\n0\tplain, text\n')
    assert read_labelled_texts(path) == [('"quoted", he said', "1", 2), ("plain, text", "0", 3)]


def test_json_lines_and_json_arrays(tmp_path):
    lines = write(tmp_path, "r.jsonl", '{"text": "a", "label": 3, "x": null}\n\n'
                                       '{"text": "b", "label": 10}\n')
    array = write(tmp_path, "r.json", json.dumps([{"text": "a", "label": " x"},
                                                   {"text": "b", "label": "y"}]))
    assert read_labelled_texts(lines) == [("a", 3, 1), ("b", 10, 3)]
    assert read_labelled_texts(array) == [("a", "x", 1), ("b", "y", 2)]


def test_labels_are_sorted_integers_first_numerically():
    assert sorted_labels(["pos", "neg", "pos"]) == ("neg", "pos")
    assert sorted_labels(["10", "9", "2", "-1"]) == ("-1", "2", "9", "10")
    assert sorted_labels([10, 9, 2]) == (2, 9, 10)
    assert sorted_labels(["b", "10", "a", "2"]) == ("2", "10", "a", "b")
    with format_error(r"mix integers \(1\) and strings \('pos'\)"):
        sorted_labels([1, "pos"])


def test_load_text_classification_maps_labels_from_the_training_file(tmp_path):
    train = write(tmp_path, "train.csv", "text,label\nfine,meh\ngood,pos\nbad,neg\n")
    val = write(tmp_path, "val.jsonl", '{"text": "so so", "label": "meh"}\n')
    test = write(tmp_path, "test.tsv", "text\tlabel\nawful\tneg\n")
    data = load_text_classification(train, val, test)
    assert data.labels == ("meh", "neg", "pos")
    assert data.train == [("fine", 0), ("good", 2), ("bad", 1)]
    assert data.validation == [("so so", 0)] and data.test == [("awful", 1)]
    only_train = load_text_classification(train)
    assert only_train.validation == [] and only_train.test == []


def test_integer_labels_in_json(tmp_path):
    train = write(tmp_path, "t.jsonl", "".join(json.dumps({"text": f"t{i}", "label": i % 3})
                                               + "\n" for i in range(6)))
    data = load_text_classification(train)
    assert data.labels == (0, 1, 2)
    assert [label for _, label in data.train] == [0, 1, 2, 0, 1, 2]


def test_a_label_unseen_in_training_names_the_label_and_the_line(tmp_path):
    train = write(tmp_path, "train.csv", "text,label\na,pos\nb,neg\n")
    test = write(tmp_path, "test.csv", "text,label\nc,pos\nd,neutral\n")
    with format_error(r"test\.csv, line 3: the label 'neutral' is not in the training file"):
        load_text_classification(train, test=test)


def test_a_single_label_is_refused(tmp_path):
    train = write(tmp_path, "train.csv", "text,label\na,pos\nb,pos\n")
    with format_error(r"train\.csv: every example has the label 'pos'.*at least two"):
        load_text_classification(train)


@pytest.mark.parametrize("name, content, message", [
    ("r.csv", "review,label\nhi,a\n",
     r"r\.csv, line 1: no column 'text' in the header \(its columns: 'review', 'label'\)"
     r".*--text-column"),
    ("r.csv", "text,label\nhi,a\nalone\n", r"r\.csv, line 3: expected 2 fields, as in the "
                                             r"header, saw 1"),
    ("r.csv", "text,text,label\nhi,ho,a\n", r"r\.csv, line 1: the header names 2 columns "
                                             r"'text' \(fields 1, 2\)"),
    ("r.csv", "text,label\nhi,\n", r"r\.csv, line 2, column 'label': the label is empty"),
    ("r.csv", "text,label\n", r"r\.csv has a header but no examples"),
    ("r.csv", "", r"r\.csv is empty"),
    ("r.csv", " \n\n", r"r\.csv is empty"),
    ("r.csv", 'text,label\n"open quote,a\n', r"r\.csv, line \d+: not valid CSV"),
    ("r.tsv", "text\tsentiment\nhi\ta\n", r"r\.tsv, line 1: no column 'label'"),
    ("r.jsonl", '{"text": "a", "label": 1}\n{"text": "b" "label": 0}\n',
     r"r\.jsonl, line 2, column 14: not valid JSON: Expecting ',' delimiter"),
    ("r.jsonl", '{"text": "a", "label": 1}\n["b", 0]\n', r"r\.jsonl, line 2: expected a JSON "
                                                          r"object"),
    ("r.jsonl", '{"review": "a", "label": 1}\n', r"r\.jsonl, line 1: no key 'text' \(its "
                                                  r"keys: 'review', 'label'\)"),
    ("r.jsonl", '{"text": 5, "label": 1}\n', r"line 1, key 'text': the text must be a string"),
    ("r.jsonl", '{"text": "a", "label": 1.5}\n', r"line 1, key 'label': a label must be"),
    ("r.jsonl", '{"text": "a", "label": true}\n', r"line 1, key 'label': a label must be"),
    ("r.jsonl", '{"text": "a", "label": " "}\n', r"line 1, key 'label': a label must be"),
    ("r.json", '[{"text": "a", "label": 1}, 7]', r"r\.json, object 2: expected a JSON object"),
    ("r.json", '[{"text": "a",\n "label": }]', r"r\.json, line 2, column 11: not valid JSON"),
    ("r.txt", "some text\n", r"r\.txt: labelled examples are read from a \.csv, \.tsv, "
                             r"\.jsonl, \.json file, not \.txt"),
    ("r.csv", b"text,label\nok,a\ncaf\xe9,b\n", r"r\.csv, line 3, column 4: not UTF-8 text "
                                                  r"\(byte 0xe9\)"),
])
def test_malformed_labelled_files_name_file_line_and_column(tmp_path, name, content, message):
    with format_error(message):
        read_labelled_texts(write(tmp_path, name, content))


# Issue 37, case 9: a delimiter inside a text made two fields of it, and the rest of the
# row shifted: the text was cut at the comma and its next piece became the label.
@pytest.mark.parametrize("name, content, line, saw", [
    ("r.csv", "text,label\nfine,pos\nI liked it, a lot,pos\nbad,neg\n", 3, 3),
    ("r.csv", "id,text,label\n1,fine,pos\n2,bad,neg,\n", 3, 4),  # a stray delimiter
    ("r.csv", 'text,label\n"two\nlines",pos\nok, fine,neg\n', 4, 3),  # after a quoted newline
    ("r.tsv", "text\tlabel\nfine\tpos\nI liked it\ta lot\tpos\n", 3, 3),
    ("r.tsv", "label\ttext\tid\npos\tfine\n", 2, 2),  # one too few
])
def test_a_row_of_another_field_count_than_the_header_is_refused(tmp_path, name, content, line,
                                                                 saw):
    fields = len(content.split("\n")[0].split("\t" if name.endswith("tsv") else ","))
    with format_error(rf"r\.[ct]sv, line {line}: expected {fields} fields, as in the header, "
                      rf"saw {saw}"):
        read_labelled_texts(write(tmp_path, name, content))


def test_the_field_count_message_says_how_to_write_the_text(tmp_path):
    with format_error(r'within double quotes: "I liked it, a lot"'):
        read_labelled_texts(write(tmp_path, "r.csv", "text,label\nI liked it, a lot,pos\n"))
    with format_error("TSV has no quoting"):
        read_labelled_texts(write(tmp_path, "r.tsv", "text\tlabel\na\tb\tpos\n"))


# Issue 37, case 10: one column named for both made every text its own label.
def test_the_text_and_the_label_column_must_differ(tmp_path):
    for name, content in (("r.csv", "review,label\nfine,pos\nbad,neg\n"),
                          ("r.jsonl", '{"review": "fine"}\n')):
        with pytest.raises(ValueError, match="text_column and label_column both name 'review'"):
            read_labelled_texts(write(tmp_path, name, content), text_column="review",
                                label_column="review")
    train = write(tmp_path, "t.csv", "review,label\nfine,pos\nbad,neg\n")
    with pytest.raises(ValueError, match="both name 'review'"):
        load_text_classification(train, text_column="review", label_column="review")
    with pytest.raises(TypeError, match="label_column must name a column"):
        read_labelled_texts(train, label_column=None)


# Issue 37, case 12: JSON's integer labels and CSV's text labels are compared by one rule.
def test_labels_are_compared_by_their_text_across_formats(tmp_path):
    train = write(tmp_path, "train.jsonl", '{"text": "good", "label": 1}\n'
                                           '{"text": "bad", "label": 0}\n')
    val = write(tmp_path, "val.csv", "text,label\nfine,1\nawful,0\n")
    test = write(tmp_path, "test.tsv", "text\tlabel\nok\t 1\n")
    data = load_text_classification(train, val, test)
    assert data.labels == (0, 1)
    assert data.validation == [("fine", 1), ("awful", 0)] and data.test == [("ok", 1)]
    # the other way round, and a label whose text differs ("01" is not 1) stays refused
    back = load_text_classification(val, train)
    assert back.labels == ("0", "1") and back.validation == [("good", 1), ("bad", 0)]
    other = write(tmp_path, "other.csv", "text,label\nfine,01\n")
    with format_error(r"other\.csv, line 2: the label '01' is not in the training file"):
        load_text_classification(train, other)


# Issue 37, case 13: csv's default field limit (128 KiB) refused a valid long review.
@pytest.mark.parametrize("name, delimiter", [("r.csv", ","), ("r.tsv", "\t")])
def test_a_long_field_loads_whole(tmp_path, name, delimiter):
    import csv

    long_text = "a long review, " * 20_000  # 300 KB, commas and all
    if name.endswith(".tsv"):
        long_text = long_text.replace(",", "")
    quoted = f'"{long_text}"' if name.endswith(".csv") else long_text
    path = write(tmp_path, name, f"text{delimiter}label\n{quoted}{delimiter}pos\n"
                                 f"short{delimiter}neg\n")
    previous = csv.field_size_limit(128 * 1024)  # csv's default (an earlier test may raise it)
    try:
        assert read_labelled_texts(path) == [(long_text, "pos", 2), ("short", "neg", 3)]
    finally:
        csv.field_size_limit(max(previous, csv.field_size_limit()))


def test_a_missing_file_is_not_found(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"nope\.csv does not exist"):
        load_text_classification(tmp_path / "nope.csv")


def test_which_data_is_the_users():
    for name in ("a.csv", "b.TSV", "c.jsonl", "d.json", "e.txt"):
        assert is_user_data(name)
    for name in ("aclImdb_v1.tar.gz", "fra-eng.zip", "folder", None):
        assert not is_user_data(name)


# =========================================================================== pairs and text
def test_sentence_pairs_are_tokenized_like_the_english_french_data(tmp_path):
    path = write(tmp_path, "p.tsv", "Hallo Welt!\tHello world!\n\nGuten Tag.\tGood day.\r\n")
    assert read_sentence_pairs(path) == [
        (tokenize_fra_eng("Hallo Welt!"), tokenize_fra_eng("Hello world!")),
        (["guten", "tag", "."], ["good", "day", "."])]


@pytest.mark.parametrize("content, message", [
    ("a\tb\nno tab here\n", r"p\.tsv, line 2: expected source<TAB>target \(2 tab-separated "
                            r"columns\), found 1"),
    ("a\tb\tc\n", r"line 1: .*found 3 column"),
    ("a\tb\n \tb\n", r"p\.tsv, line 2, column 1: the source sentence is empty"),
    ("a\t\n", r"p\.tsv, line 1, column 2: the target sentence is empty"),
    ("", r"p\.tsv is empty"),
    (b"a\tb\n\xffx\ty\n", r"p\.tsv, line 2, column 1: not UTF-8"),
])
def test_malformed_pairs_name_the_line(tmp_path, content, message):
    with format_error(message):
        read_sentence_pairs(write(tmp_path, "p.tsv", content))


def test_plain_text(tmp_path):
    assert read_text_file(write(tmp_path, "t.txt", "Ünïcode\ntext")) == "Ünïcode\ntext"
    with format_error(r"t\.txt is empty"):
        read_text_file(write(tmp_path, "t.txt", ""))
    with format_error(r"t\.txt, line 2, column 3: not UTF-8 text \(byte 0x80\)"):
        read_text_file(write(tmp_path, "t.txt", b"ok\nab\x80c\n"))


# =========================================================================== the demos
LABEL_WORDS = {"thumbs-up": "great superb wonderful".split(),
               "thumbs-down": "awful boring dull".split(),
               "so-so": "fine okay average".split()}
FILLER = "the film a was of and it plot actor scene".split()


def labelled_csv(path: Path, rows: int, seed: int) -> Path:
    """A CSV of the user's: other columns, its own column and label names."""
    rng = np.random.default_rng(seed)
    lines = ["id,review,sentiment"]
    for i in range(rows):
        label = list(LABEL_WORDS)[i % 3]
        lines.append(f'{i},"{" ".join(rng.choice(FILLER + LABEL_WORDS[label], size=12))}",'
                     f"{label}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("own")
    rng = np.random.default_rng(0)
    source = "ich du er sie wir sehe esse mag habe will die der katze hund haus auto".split()
    target = "i you he she we see eat like have want the the cat dog house car".split()
    pairs = []
    for _ in range(800):
        idx = rng.integers(0, len(source), size=int(rng.integers(2, 7)))
        pairs.append(" ".join(source[i] for i in idx) + " .\t" + " ".join(target[i] for i in idx)
                     + " .")
    text = "\n".join(" ".join(rng.choice(FILLER, size=8)) for _ in range(300))
    return {"train": labelled_csv(folder / "train.csv", 300, 0),
            "test": labelled_csv(folder / "test.csv", 60, 1),
            "pairs": write(folder, "pairs.tsv", "\n".join(pairs) + "\n"),
            "text": write(folder, "notes.txt", text)}


def smoke(script: str, out: Path, *args: str):
    result = run_demo(script, *SMOKE, "--no-progress", "--out", str(out), *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_imdb_demo_trains_on_a_users_csv_and_predicts_its_labels(user_files, tmp_path):
    result = smoke("imdb.py", tmp_path, "--data", str(user_files["train"]), "--test-data",
                   str(user_files["test"]), "--text-column", "review", "--label-column",
                   "sentiment")
    assert "3 labels" in result.stdout
    assert re.search(r"test accuracy [\d.]+ on 60 reviews", result.stdout)
    # the files it wrote, by their real names (the smoke preset trains 2 members)
    assert ("wrote model.npz, last.npz, model-2.npz, last-2.npz, curves.png, curves-2.png, "
            "attention.png, metrics.json") in result.stdout
    for name in ("model-2.npz", "curves-2.png", "attention.png"):
        assert (tmp_path / name).is_file()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert np.isfinite(metrics["test_accuracy"])
    assert metrics["machine"].endswith("backend numpy, 1 process, 2 replicas")
    predicted = run_demo("imdb.py", "--predict", "a superb and wonderful film", "--out",
                         str(tmp_path))
    assert predicted.returncode == 0, predicted.stderr
    label, probability = re.fullmatch(r"(\S+) \(p = ([\d.]+)\)\n", predicted.stdout).groups()
    assert label in LABEL_WORDS and 0 < float(probability) <= 1


def test_imdb_demo_without_a_test_file_reports_validation(user_files, tmp_path):
    result = smoke("imdb.py", tmp_path, "--data", str(user_files["train"]), "--text-column",
                   "review", "--label-column", "sentiment", "--members", "1")
    assert re.search(r"no test file: validation accuracy [\d.]+ on 30 reviews", result.stdout)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["test_accuracy"] is None and np.isfinite(metrics["val_accuracy"])


def test_imdb_demo_names_a_users_malformed_file(user_files, tmp_path):
    result = run_demo("imdb.py", *SMOKE, "--data", str(user_files["train"]), "--out",
                      str(tmp_path))  # the columns are review and sentiment
    assert result.returncode == 2
    assert "error: " in result.stderr and "Traceback" not in result.stderr
    assert "train.csv, line 1: no column 'text'" in result.stderr
    assert "aclImdb" not in result.stderr


def test_imdb_demo_refuses_a_row_cut_by_an_unquoted_comma(tmp_path):
    """Issue 37, case 9: the demo trained a classifier whose labels were ['neg', 'really']."""
    rows = ["text,label"] + [f"review {i},{'pos' if i % 2 else 'neg'}" for i in range(40)]
    rows[7] = "I liked it, really,pos"
    data = write(tmp_path, "mine.csv", "\n".join(rows) + "\n")
    result = run_demo("imdb.py", *SMOKE, "--data", str(data), "--out", str(tmp_path / "run"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {data}, line 8: expected 2 fields, as in the header, saw 3 (a comma inside a "
        'text must be within double quotes: "I liked it, a lot")')
    assert not (tmp_path / "run" / "model.npz").exists()


def test_imdb_demo_refuses_one_column_for_the_text_and_the_label(tmp_path):
    """Issue 37, case 10: every text became its own label."""
    result = run_demo("imdb.py", "--smoke", "--data", "mine.csv", "--text-column", "review",
                      "--label-column", "review", "--out", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith(
        "error: --text-column and --label-column both name 'review': every text would be its "
        "own label")


def test_imdb_demo_refuses_a_validation_file_without_a_users_training_file(tmp_path):
    result = run_demo("imdb.py", "--smoke", "--validation-data", "v.csv", "--out",
                      str(tmp_path))
    assert result.returncode == 2
    assert "--validation-data goes with --data FILE.csv" in result.stderr


def test_translate_demo_trains_on_a_users_pairs(user_files, tmp_path):
    result = smoke("translate.py", tmp_path, "--data", str(user_files["pairs"]))
    assert "held-out BLEU" in result.stdout
    assert (tmp_path / "cross_attention.png").is_file()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(metrics["probes"]) == 4  # the first held-out sentences of the user's file
    translated = run_demo("translate.py", "--translate", "ich sehe die katze .", "--out",
                          str(tmp_path))
    assert translated.returncode == 0, translated.stderr
    assert translated.stdout.count("\n") == 1  # one line (30 updates may well decode to "")


def test_translate_demo_names_a_word_subword_pieces_cannot_spell(user_files, tmp_path):
    """A word holding "@@" (the pieces' continuation mark) is refused in one line naming
    it and the way out (--bpe-merges 0); with whole words the pairs train."""
    pairs = user_files["pairs"].read_text(encoding="utf-8").splitlines()
    pairs[5] = "see a@@b .\tsiehe a@@b ."
    marked = tmp_path / "marked.tsv"
    marked.write_text("\n".join(pairs) + "\n", encoding="utf-8")
    result = run_demo("translate.py", "--smoke", "--data", str(marked), "--out",
                      str(tmp_path / "run"))
    assert result.returncode == 2
    assert "'a@@b'" in result.stderr and "--bpe-merges 0" in result.stderr
    assert "Traceback" not in result.stderr
    smoke("translate.py", tmp_path / "words", "--data", str(marked), "--bpe-merges", "0")


def test_generate_demo_trains_on_a_users_text(user_files, tmp_path):
    result = smoke("generate.py", tmp_path, "--data", str(user_files["text"]))
    assert "validation loss" in result.stdout
    vocabulary = set(user_files["text"].read_text())
    sampled = run_demo("generate.py", "--sample-only", "--prompt", "the ", "--out",
                       str(tmp_path))
    assert sampled.returncode == 0, sampled.stderr
    assert set(sampled.stdout.rstrip("\n")) <= vocabulary  # the user's characters only


# =========================================================================== the record
def test_machine_description_names_ranks_and_replicas(monkeypatch):
    assert cli.machine_description(2).endswith(", 1 process, 2 replicas")
    assert cli.machine_description(1).endswith(", 1 process, 1 replica")
    monkeypatch.setattr(parallel, "current", lambda: parallel.Context(comm=None, size=2))
    assert cli.machine_description(1).endswith(", 2 MPI ranks, 1 replica each")


# =========================================================================== the guide
def readme_block(heading: str) -> str:
    """The one python block under ``heading`` in docs/guide.md (the README points there)."""
    text = (ROOT / "docs" / "guide.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, f"expected one python block under {heading!r}"
    return blocks[0]


def test_readme_trains_on_your_own_data_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the block writes its reviews.csv in the current folder
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(readme_block("Train on your own data"), "docs/guide.md", "exec"), namespace)
    assert (tmp_path / "reviews.csv").is_file()
    assert printed.getvalue() == "good\n"
    # it trained: every training review is now classified right
    model, pad_batch = namespace["model"], namespace["pad_batch"]
    ids, labels = namespace["ids"], namespace["labels"]
    predicted = np.argmax(np.asarray(model.predict(*pad_batch(ids, 0))), axis=-1)
    np.testing.assert_array_equal(predicted, labels)
