"""Batched beam search (all sentences in one decoder batch) against the per-sentence search.

``beam_search`` stacks the open hypotheses of every sentence along the batch axis of the
cached decoder and drops a sentence's rows once its search is over;
``_beam_search_reference`` is the original implementation, which searches one sentence
at a time.  They must return exactly the same hypotheses.

Why the comparison can be exact.  The two paths do the same arithmetic on the same
numbers except that their matmuls see different batch compositions (a sentence alone vs
stacked with others), and a BLAS may then round the last bit of a logit differently.
So the models here run in float64, where such a difference moves a score by ~1e-16
relative: the chosen tokens can only differ if two continuations' totals lie within that
of each other, which random float64 weights do not produce.  Ties that matter are made
*exact* by construction instead: tokens whose output-projection column is zero get the
logit ``bias`` exactly (0 * x summed is 0 in any order), so with a shared bias they tie
bit for bit in every row of both paths, and whole rows tie when every column is zero.
Both paths must then break the tie the same way (lower token id first within a
hypothesis: the order of a stable sort of the flattened totals), which the tied examples
check.  (Exact ties *between* hypotheses only arise here when their rows are identical,
where any order across hypotheses gives the same result: breaking those ties token
first instead was tried and not detected, nor could it change an output.)

* Hypothesis over random small seq2seq models (widths, layers, norm placement,
  positional tables, vocabularies of 5..12 so that <eos> and V < 2k both happen), batch
  sizes 1..6, beam sizes 1..5, padded sources with and without ``src_lens``, length
  limits 0..10, length penalties, an <eos> bias (searches end early, late or at the
  limit) and tied token groups: the same hypotheses, and the same search step by step:
  one ``forward_cached`` call per position, each over exactly the rows of the sentences still
  searching (the rows each sentence has alone at that position), with memory and memory
  mask of the same rows;
* the same on models with a likely <eos>, where (unlike most random draws, whose
  sentences mostly end together) sentences of a batch end at different steps, and the
  second stopping rule decides: both counted, so the test cannot pass without them
  (this is what fails when finished sentences keep their rows, or the batched search
  passes the stopping rule the wrong length);
* all logits equal: the result is the hand-derived one (always token 0);
* beam size 1 equals greedy decoding (Hypothesis);
* the strict array-API backend gives the same hypotheses.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npformer import backend, decoding
from npformer.decoding import beam_search, greedy_decode
from npformer.models import Seq2SeqConfig
from tests.beam_reference import _beam_search_reference
from tests.helpers import tiered

from .conftest import using_backend

# A behaviour test: it runs in both tiers (tests.helpers.tiered), which must behave the same.
pytestmark = pytest.mark.usefixtures("tier")

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SRC_VOCAB = 9


def dev(host):
    return backend.asarray(np.asarray(host, dtype=np.int64))


@st.composite
def decoding_cases(draw):
    """A random small seq2seq (its config and float64 weights, see :func:`build`) and a
    padded source batch, with or without lengths."""
    heads = draw(st.sampled_from([1, 2]))
    cfg = Seq2SeqConfig(src_vocab_size=SRC_VOCAB, tgt_vocab_size=draw(st.integers(5, 12)),
                        d_model=4 * heads, num_heads=heads,
                        num_encoder_layers=draw(st.integers(1, 2)),
                        num_decoder_layers=draw(st.integers(1, 2)), d_ff=12,
                        block_size=draw(st.sampled_from([8, 2, 5]) | st.integers(2, 8)),
                        dropout=0.1, activation="gelu",
                        norm_first=draw(st.booleans()),
                        positional=draw(st.sampled_from(["sinusoidal", "learned"])),
                        pad_id=PAD, bos_id=BOS, eos_id=EOS)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    std = draw(st.sampled_from([0.3, 0.8, 1.5]))
    with using_backend("numpy", "float64"):
        shapes = {name: p.shape for name, p in tiered.Seq2SeqTransformer(cfg).named_parameters()}
    params = {name: rng.standard_normal(shape) * std for name, shape in shapes.items()}
    # <eos> likely or not, so that searches end early, late or at the limit, and the
    # sentences of a batch at different steps
    params["lm_head.bias"][EOS] += draw(st.sampled_from([1.5, 0.0, 1.0, 2.0, 3.0, -2.0])
                                         | st.floats(-3.0, 3.0))
    tied = draw(st.lists(st.integers(0, cfg.tgt_vocab_size - 1), max_size=cfg.tgt_vocab_size,
                         unique=True))
    if tied:  # these tokens get the same logit, bit for bit, in every row
        params["lm_head.weight"][:, tied] = 0.0  # (D, V)
        params["lm_head.bias"][tied] = draw(st.floats(-1.0, 2.0))

    batch = draw(st.sampled_from([4, 1, 2, 6]) | st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, cfg.block_size), min_size=batch, max_size=batch))
    src = np.full((len(lengths), max(lengths)), PAD, dtype=np.int64)
    for b, n in enumerate(lengths):
        src[b, :n] = rng.integers(4, SRC_VOCAB, size=n)
    src_lens = np.asarray(lengths) if draw(st.booleans()) else None
    return cfg, params, src, src_lens


def build(cfg, params):
    """The model on the current backend with the drawn weights."""
    model = tiered.Seq2SeqTransformer(cfg)
    for name, p in model.named_parameters():
        p.data = backend.asarray(params[name], dtype="float64")
    return model


ALPHAS = st.sampled_from([0.0, 0.6, 1.0]) | st.floats(0.0, 2.0)


def recorded_steps(model, search, src, src_lens, beam_size, max_len, alpha):
    """Run ``search`` recording, for every forward_cached call, (position, rows of the
    target tokens, rows of memory, rows of the memory mask)."""
    calls = []
    original = model.forward_cached

    def recording(tgt_ids, memory, memory_mask, cache):
        calls.append((cache.length, tgt_ids.shape[0], memory.shape[0], memory_mask.shape[0]))
        return original(tgt_ids, memory, memory_mask, cache)

    model.forward_cached = recording  # an instance attribute: shadows the method
    try:
        result = search(model, dev(src), None if src_lens is None else dev(src_lens),
                        beam_size, max_len=max_len, alpha=alpha)
    finally:
        del model.forward_cached
    return result, calls


def assert_same_search(model, src, src_lens, beam_size, max_len, alpha):
    """Same hypotheses, and the same search: one forward_cached call per position for all
    sentences, each over exactly the rows the sentences still searching have when searched
    alone (so a sentence's rows leave the batch as soon as its search is over, and every
    step keeps as many open hypotheses as the reference), memory and mask of those rows."""
    args = (src, src_lens, beam_size, max_len, alpha)
    alone, alone_calls = recorded_steps(model, _beam_search_reference, *args)
    batched, batched_calls = recorded_steps(model, beam_search, *args)
    assert batched == alone
    per_sentence: list[list[int]] = []  # rows of each sentence's own search, by position
    for position, rows, _, _ in alone_calls:
        if position == 0:
            per_sentence.append([])
        per_sentence[-1].append(rows)
    steps = max((len(r) for r in per_sentence), default=0)
    assert [c[0] for c in batched_calls] == list(range(steps))
    expected_rows = [sum(r[p] for r in per_sentence if len(r) > p) for p in range(steps)]
    assert [c[1] for c in batched_calls] == expected_rows
    for _, rows, memory_rows, mask_rows in batched_calls:
        assert memory_rows == mask_rows == rows
    return [len(r) for r in per_sentence]  # the steps each sentence's search took


@settings(max_examples=150)
@given(case=decoding_cases(), beam_size=st.sampled_from([2, 1, 3, 4, 5]),
       max_len=st.sampled_from([10, 0, 1, 3, 6]) | st.integers(0, 10),
       alpha=ALPHAS)
def test_batched_beam_search_equals_per_sentence_search(case, beam_size, max_len, alpha):
    cfg, params, src, src_lens = case
    with using_backend("numpy", "float64"):
        model = build(cfg, params)
        assert_same_search(model, src, src_lens, beam_size, max_len, alpha)
        assert model.training  # decoding restores the mode


def test_same_search_when_sentences_end_at_different_steps(monkeypatch):
    """Two things random draws rarely produce, made common here (a likely <eos>, beam 2
    and 3) and counted so that the test cannot pass without them: sentences of one batch
    whose searches end at different steps (their rows must leave while the others go on),
    and searches ended by the second stopping rule (``beam_size`` hypotheses ended and none
    open beats the best at its current length), which must end at the same step."""
    decided, staggered = [], 0
    rule = decoding._search_done

    def counting_rule(finished, open_beams, k, length, max_length, alpha):
        done = rule(finished, open_beams, k, length, max_length, alpha)
        # with k out of reach only the first rule (no open one can still win) can fire
        if done and not rule(finished, open_beams, 10**9, length, max_length, alpha):
            decided.append(length)
        return done

    monkeypatch.setattr(decoding, "_search_done", counting_rule)
    with using_backend("numpy", "float64"):
        rng = np.random.default_rng(0)
        cfg = Seq2SeqConfig(src_vocab_size=SRC_VOCAB, tgt_vocab_size=7, d_model=8,
                            num_heads=2, num_encoder_layers=2, num_decoder_layers=2, d_ff=12,
                            block_size=8, pad_id=PAD, bos_id=BOS, eos_id=EOS)
        shapes = {n: p.shape for n, p in tiered.Seq2SeqTransformer(cfg).named_parameters()}
        for _ in range(15):
            params = {name: rng.standard_normal(shape) * 0.8 for name, shape in shapes.items()}
            params["lm_head.bias"][EOS] += 1.5
            model = build(cfg, params)
            src = rng.integers(4, SRC_VOCAB, size=(4, 6))
            src_lens = np.array([5, 3, 6, 2])
            for k in (2, 3):
                steps = assert_same_search(model, src, src_lens, k, 8, 1.0)
                staggered += len(set(steps)) > 1
        assert len(decided) >= 10  # counted in both searches: it decided some of these
        assert staggered >= 3, staggered  # of 30 batches


def test_all_logits_equal_breaks_ties_by_lowest_hypothesis_then_token():
    """Every token equally likely at every step (the output projection is zero), so every
    continuation of every hypothesis ties: the 2k best are taken in flat order (hypothesis,
    then token id), tokens 0..k-1 of hypothesis 0, <eos> (id 3) is never reached for k <= 3,
    and all open hypotheses tie at the limit, where the first (all token 0) is kept."""
    with using_backend("numpy", "float64"):
        cfg = Seq2SeqConfig(src_vocab_size=SRC_VOCAB, tgt_vocab_size=7, d_model=8,
                            num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=12,
                            block_size=6, pad_id=PAD, bos_id=BOS, eos_id=EOS)
        model = tiered.Seq2SeqTransformer(cfg)
        model.lm_head.weight.data = backend.asarray(np.zeros((8, 7)))
        model.lm_head.bias.data = backend.asarray(np.zeros(7))
        src = np.array([[4, 5, 6], [7, 8, PAD], [4, PAD, PAD]])
        for k in (1, 2, 3):
            for alpha in (0.0, 0.6):
                out = beam_search(model, dev(src), None, k, max_len=4, alpha=alpha)
                assert out == [[0, 0, 0, 0]] * 3
                assert out == _beam_search_reference(model, dev(src), None, k, max_len=4,
                                                     alpha=alpha)


@settings(max_examples=40)
@given(case=decoding_cases(), max_len=st.integers(0, 10), alpha=ALPHAS)
def test_beam_size_one_is_greedy(case, max_len, alpha):
    cfg, params, src, src_lens = case
    with using_backend("numpy", "float64"):
        model = build(cfg, params)
        lens = None if src_lens is None else dev(src_lens)
        assert beam_search(model, dev(src), lens, 1, max_len=max_len, alpha=alpha) == \
            greedy_decode(model, dev(src), lens, max_len=max_len)


@settings(max_examples=5)
@given(case=decoding_cases(), beam_size=st.integers(2, 4))
def test_strict_backend_gives_the_same_hypotheses(case, beam_size):
    cfg, params, src, src_lens = case
    with using_backend("numpy", "float64"):
        expected = _beam_search_reference(build(cfg, params), dev(src), None, beam_size,
                                          max_len=6)
    with using_backend("strict", "float64"):
        assert beam_search(build(cfg, params), dev(src), None, beam_size, max_len=6) == expected
