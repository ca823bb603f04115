"""Tests of npformer.data.bpe: byte-pair encoding learned from words, and applied.

The learner keeps incremental pair counts and a heap; it is checked against the
algorithm as the paper states it (recount every pair, merge the most frequent), which
is too slow for real data but cannot be wrong in the same way.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer.data import BPE, Vocab
from npformer.data.bpe import MARK, characters, learn_merges, merge_symbols

# Words over a small alphabet, so that pairs repeat and merges happen.
WORDS = st.text(alphabet="abcdé@", min_size=1, max_size=7).filter(lambda w: MARK not in w)
CORPORA = st.lists(st.lists(WORDS, min_size=1, max_size=6), min_size=1, max_size=12)


def reference_merges(word_counts: dict[str, int], num_merges: int,
                     min_count: int = 2) -> list[tuple[str, str]]:
    """The paper's loop: count every adjacent pair of every word, merge the most frequent
    (ties: the smaller pair), repeat."""
    words = {word: characters(word) for word in word_counts}
    merges = []
    for _ in range(num_merges):
        counts = Counter()
        for word, symbols in words.items():
            for pair in zip(symbols, symbols[1:]):
                counts[pair] += word_counts[word]
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        if counts[best] < min_count:
            break
        merges.append(best)
        words = {word: merge_symbols(symbols, best) for word, symbols in words.items()}
    return merges


def test_a_worked_example():
    """low x3, lower x3, lowest x3: (l@@, o@@) occurs 9 times; then (lo@@, w@@) and
    (w@@, e@@) tie at 6 and the smaller pair wins; then (low@@, e@@)."""
    bpe = BPE.learn([["low", "lower", "lowest"]] * 3, num_merges=3)
    assert bpe.merges == (("l@@", "o@@"), ("lo@@", "w@@"), ("low@@", "e@@"))
    assert bpe.encode(["lower", "low", "lowly"]) == ["lowe@@", "r", "lo@@", "w",
                                                     "low@@", "l@@", "y"]
    assert bpe.decode(["lowe@@", "r", "lo@@", "w", "low@@", "l@@", "y"]) == [
        "lower", "low", "lowly"]


def test_characters_and_merge():
    assert characters("chat") == ("c@@", "h@@", "a@@", "t")
    assert characters("à") == ("à",)
    # every occurrence, left to right, never overlapping
    assert merge_symbols(("a@@", "a@@", "a@@", "a"), ("a@@", "a@@")) == ("aa@@", "a@@", "a")
    assert merge_symbols(("a@@", "b"), ("b@@", "c")) == ("a@@", "b")


@given(CORPORA, st.integers(0, 30), st.integers(1, 3))
def test_learner_equals_the_papers_loop(corpus, num_merges, min_count):
    counts = Counter(word for words in corpus for word in words)
    ordered = dict(sorted(counts.items()))
    assert learn_merges(ordered, num_merges, min_count) == reference_merges(
        ordered, num_merges, min_count)
    assert BPE.learn(corpus, num_merges, min_count).merges == tuple(
        reference_merges(ordered, num_merges, min_count))


@given(CORPORA, st.integers(0, 30))
def test_encoding_reproduces_learning(corpus, num_merges):
    """Applying the merges by rank to a training word gives the symbols the learner
    ended with (the reference loop's final words)."""
    bpe = BPE.learn(corpus, num_merges)
    for word in {w for words in corpus for w in words}:
        symbols = characters(word)
        for pair in bpe.merges:
            symbols = merge_symbols(symbols, pair)
        assert bpe.encode_word(word) == symbols


@given(CORPORA, st.integers(0, 30), st.lists(WORDS, max_size=8))
def test_decode_inverts_encode(corpus, num_merges, words):
    bpe = BPE.learn(corpus, num_merges)
    pieces = bpe.encode(words)
    assert bpe.decode(pieces) == words
    assert all(p.endswith(MARK) for w in words for p in bpe.encode_word(w)[:-1])
    assert not any(bpe.encode_word(w)[-1].endswith(MARK) for w in words)


@given(CORPORA, st.integers(0, 30), st.randoms(use_true_random=False))
def test_the_corpus_order_does_not_matter(corpus, num_merges, random):
    shuffled = [list(words) for words in corpus]
    random.shuffle(shuffled)
    for words in shuffled:
        random.shuffle(words)
    assert BPE.learn(corpus, num_merges) == BPE.learn(shuffled, num_merges)


def test_min_count_stops_learning():
    """Every pair occurs once: nothing is worth merging at min_count 2."""
    assert BPE.learn([["abc", "def"]], num_merges=10).merges == ()
    assert len(BPE.learn([["abc", "def"]], num_merges=10, min_count=1)) == 4


def test_a_decoder_stopped_mid_word():
    assert BPE.decode(["je", "sui@@"]) == ["je", "sui"]
    assert BPE.decode([]) == []
    assert BPE.decode(["<unk>", "ch@@", "at"]) == ["<unk>", "chat"]


def test_vocabulary_over_pieces_has_no_unknown_word():
    """A word the training words lack (<unk> to a word vocabulary) is spelled in known
    pieces. Three merges: (a@@, t@@), (c@@, h@@), (ch@@, at@@), all seen 6 times."""
    corpus = [["le", "chaton", "est", "là"], ["la", "chatte", "est", "là"]] * 3
    bpe = BPE.learn(corpus, num_merges=3)
    assert bpe.merges == (("a@@", "t@@"), ("c@@", "h@@"), ("ch@@", "at@@"))
    vocab = Vocab.build([bpe.encode(words) for words in corpus])
    assert "chatton" not in Vocab.build(corpus)
    ids = vocab.encode(bpe.encode(["chatton", "est", "là"]))
    assert vocab.decode(ids) == ["chat@@", "t@@", "o@@", "n", "e@@", "s@@", "t", "l@@", "à"]
    assert vocab.unk_id not in ids
    assert bpe.decode(vocab.decode(ids)) == ["chatton", "est", "là"]


def test_json_round_trip():
    bpe = BPE.learn([["désolé", "désolée", "solé"]] * 2, num_merges=8)
    again = BPE.from_json(np.array(bpe.to_json()))  # as a checkpoint holds it
    assert again == bpe and hash(again) == hash(bpe)
    assert again.encode(["désolés"]) == bpe.encode(["désolés"])
    assert repr(bpe) == f"BPE(merges={len(bpe)})"


@pytest.mark.parametrize("word", ["a@@b", "@@", "", " "])
def test_words_it_cannot_encode_are_named(word):
    with pytest.raises(ValueError, match="encod"):
        BPE.learn([["ok", word]], num_merges=2)
    with pytest.raises(ValueError, match="encod"):
        BPE([]).encode(["ok", word])


@pytest.mark.parametrize("merges", [[("a", "b")], [("@@", "b")], [("a@@", "")],
                                    [("a@@", "b"), ("a@@", "b")]])
def test_malformed_merges_are_refused(merges):
    with pytest.raises(ValueError, match="merge"):
        BPE(merges)


@pytest.mark.parametrize("num_merges", [-1, 1.5, True, "3"])
def test_bad_merge_counts_are_refused(num_merges):
    with pytest.raises(ValueError, match="num_merges"):
        BPE.learn([["ab", "ab"]], num_merges)


@pytest.mark.parametrize("min_count", [0, 2.0, False])
def test_bad_min_counts_are_refused(min_count):
    with pytest.raises(ValueError, match="min_count"):
        BPE.learn([["ab", "ab"]], 2, min_count)


@pytest.mark.parametrize("text", ['{"type": "Vocab", "itos": []}', "[1, 2]"])
def test_from_json_refuses_other_things(text):
    with pytest.raises(ValueError, match="not a serialised BPE"):
        BPE.from_json(text)


# --------------------------------------------------------------------------- issue 47
@pytest.mark.parametrize("call, match", [
    (lambda b: BPE.learn(["lower", "lowest"], num_merges=5),
     r"token_lists\[0\] must be a list of words, got a str \('lower'\)"),
    (lambda b: BPE.learn("lower lowest", num_merges=5), "token_lists must be a list of word "
                                                       "lists, got a str"),
    (lambda b: b.encode("lower"), r"words must be a list of words, got a str \('lower'\): "
                                  r"pass \['lower'\]"),
    (lambda b: b.decode("lo@@wer"), "pieces must be a list of pieces, got a str"),
    (lambda b: b.encode([5]), r"words\[0\] must be a word \(a str\), got 5 \(int\)"),
    (lambda b: b.encode(["ok", None]), r"words\[1\] must be a word \(a str\), got None"),
    (lambda b: b.decode([1, 2]), r"pieces\[0\] must be a piece \(a str\), got 1 \(int\)"),
    (lambda b: BPE.learn([["ok"], [b"ok"]], 2), r"token_lists\[1\]\[0\] must be a word"),
    (lambda b: BPE([("a@@", "b", "c")]), r"merges\[0\] must be a pair \(piece, piece\), got "
                                         r"\('a@@', 'b', 'c'\) of 3 items"),
    (lambda b: BPE([("a@@", "b"), ("c@@",)]), r"merges\[1\] must be a pair .* of 1 items"),
    (lambda b: BPE([("a@@", 2)]), r"merges\[0\] must be a pair of strings"),
    (lambda b: BPE("a@@b"), "merges must be a list of \\(piece, piece\\) pairs, got 'a@@b'"),
    (lambda b: BPE(5), "merges must be a list .* got 5"),
])
def test_a_str_or_an_item_of_the_wrong_type_is_refused_by_name(call, match):
    """issue 47 cases 6 and 15: learn(["lower", "lowest"]) learned 0 merges (each word's
    characters taken for words); encode("lower") spelled the string as characters;
    decode("lo@@wer") split it into characters; encode([5]), decode([1, 2]), a merge of
    three items or of one raised raw TypeError, AttributeError or unpacking errors."""
    bpe = BPE.learn([["low", "lower", "lowest"]] * 3, num_merges=3)
    with pytest.raises(TypeError, match=match):
        call(bpe)


def test_numpy_counts_are_accepted():
    """issue 47 case 15: num_merges=np.int64(5) was refused, though configs take NumPy
    integers."""
    corpus = [["low", "lower", "lowest"]] * 3
    assert BPE.learn(corpus, num_merges=np.int64(3), min_count=np.int32(2)) == \
        BPE.learn(corpus, num_merges=3, min_count=2)


@pytest.mark.parametrize("text, error, match", [
    ("", ValueError, "the BPE's JSON is not a serialised BPE: it is not valid JSON"),
    ("{not json", ValueError, "is not valid JSON"),
    (None, TypeError, "the BPE's JSON must be a JSON document \\(a str\\), got None"),
    (5, TypeError, "must be a JSON document"),
    ('{"type": "BPE"}', ValueError, "not a serialised BPE: it has no 'merges'"),
    ('{"merges": []}', ValueError, "not a serialised BPE: it has no 'type'"),
    ('{"type": "BPE", "merges": 5}', ValueError,
     "its \"merges\" must be a list of \\[piece, piece\\] pairs, got 5"),
    ('{"type": "BPE", "merges": [["a@@"]]}', ValueError, r"merges\[0\] must be a pair"),
    ('{"type": "BPE", "merges": [[1, 2]]}', ValueError, r"merges\[0\] must be a pair of str"),
    ('"BPE"', ValueError, "holds a JSON str, not an object"),
])
def test_from_json_refuses_damaged_documents_clearly(text, error, match):
    """issue 47 case 15: from_json('') / None / '{"type": "BPE"}' / merges 5 raised raw
    JSONDecodeError, KeyError or TypeError."""
    with pytest.raises(error, match=match):
        BPE.from_json(text)
    with pytest.raises(error, match="the checkpoint's BPE"):
        BPE.from_json(text, what="the checkpoint's BPE")
