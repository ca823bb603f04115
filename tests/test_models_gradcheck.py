"""Whole-model gradient checks: the hand-written backward of each complete model
(embeddings, every block, final norm, pooling / LM head / output projection)
against central differences of the model's forward.

Tiny float64 models (d_model 4, 2 heads, 1-2 layers, d_ff 5-6, vocabularies of
5-9 tokens, batch 2, 3-4 positions), EVERY parameter re-drawn at random (so
LayerNorm's gamma = 1 / beta = 0 and zero biases hide nothing), and the masks
that matter active:

* classifier: a right-padded sequence (padding keys masked, pooling over the
  valid positions only) with each pooling (mean / max / first), post-norm and
  pre-norm, learned and sinusoidal positions, lengths from the pad id or given;
* causal LM: the causal mask, tied (logits = h E^T, E gets gradient from both
  ends) and untied heads, pre- and post-norm, both position kinds;
* seq2seq: padded source (encoder and cross-attention masks) and padded target
  (causal & padding self-attention mask), post- and pre-norm.

``check_module(model, [ids...]).worst_error`` must be below GRADCHECK_TOL
(1e-6; a correct backward gives ~1e-9, a wrong one ~1).  Every config runs on
NumPy; one per model also runs on the strict array-API backend (``xb``).  A
last group sabotages each model's backward slightly and checks that the
gradient check notices, so these tests can fail.
"""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend, fast, ops
from npformer.fast import layers as fast_layers
from npformer.gradcheck import check_module
from npformer.models import (
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
)

from .conftest import using_backend
from .helpers import GRADCHECK_TOL, tiered, using_tier


@pytest.fixture(autouse=True, params=["fast", "textbook"])
def each_tier(request):
    """Every test of this file runs in both tiers (tests.helpers.tiered), then restores it."""
    with using_tier(request.param):
        yield request.param

PAD = 0


# =========================================================================== helpers
def randomize(model, seed: int, std: float = 0.6) -> None:
    """Every parameter re-drawn N(0, std^2) in float64 on the current backend."""
    rng = np.random.default_rng(seed)
    for _, p in model.named_parameters():
        p.data = backend.asarray(rng.standard_normal(p.shape) * std, dtype="float64")


def padded_ids(rng, lengths, width, vocab, pad=PAD):
    """(B, width) ids: row b has lengths[b] tokens drawn from 1..vocab-1, then padding."""
    ids = np.full((len(lengths), width), pad, dtype=np.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(1, vocab, size=n)
    return ids


def dev(host):
    return backend.asarray(host)


def assert_gradcheck(model, inputs, **kw):
    result = check_module(model, inputs, **kw)
    # every parameter was checked, and the worst error is small
    assert set(result.errors) == {name for name, _ in model.named_parameters()}
    assert result.worst_error < GRADCHECK_TOL, str(result)
    return result


# =========================================================================== configs
# (pooling, norm_first, positional, activation, num_layers, explicit valid_lens)
# the last field: hashed word-pair rows (0: none; 3 rows for up to 16 pairs: shared rows)
CLASSIFIER_CASES = [
    ("mean", False, "learned", "gelu", 1, False, 0),
    ("mean", True, "sinusoidal", "relu", 2, True, 3),
    ("max", False, "sinusoidal", "gelu", 2, False, 0),
    ("max", True, "learned", "gelu", 1, True, 0),
    ("first", False, "learned", "relu", 1, False, 3),
    ("first", True, "sinusoidal", "gelu", 2, False, 0),
    ("mean", False, "learned", "relu", 1, True, 5),
]


def make_classifier(pooling, norm_first, positional, activation, num_layers, seed=0,
                    bigram_buckets=0):
    cfg = ClassifierConfig(vocab_size=7, num_classes=3, d_model=4, num_heads=2,
                           num_layers=num_layers, d_ff=5, block_size=5, dropout=0.0,
                           activation=activation, norm_first=norm_first,
                           positional=positional, pooling=pooling, pad_id=PAD,
                           bigram_buckets=bigram_buckets)
    model = tiered.TransformerClassifier(cfg)
    randomize(model, seed)
    return model


@pytest.mark.parametrize("pooling,norm_first,positional,activation,num_layers,explicit,"
                         "bigram_buckets", CLASSIFIER_CASES)
def test_classifier_gradcheck(pooling, norm_first, positional, activation, num_layers,
                              explicit, bigram_buckets):
    with using_backend("numpy"):
        rng = np.random.default_rng(11)
        model = make_classifier(pooling, norm_first, positional, activation, num_layers,
                                bigram_buckets=bigram_buckets)
        ids = padded_ids(rng, [4, 2], 4, 7)  # second sequence padded
        inputs = [dev(ids)]
        if explicit:
            inputs.append(dev(np.array([4, 2])))
        assert_gradcheck(model, inputs)


def test_classifier_padding_really_masked():
    """Changing the padding tokens changes nothing: the checks above ran with masks on."""
    with using_backend("numpy"):
        model = make_classifier("max", False, "learned", "gelu", 2)
        ids = padded_ids(np.random.default_rng(3), [4, 2], 4, 7)
        out = backend.to_numpy(model(dev(ids), dev(np.array([4, 2]))))
        other = ids.copy()
        other[1, 2:] = [5, 6]  # garbage where the padding was
        out2 = backend.to_numpy(model(dev(other), dev(np.array([4, 2]))))
        np.testing.assert_allclose(out2, out, rtol=0, atol=1e-13)


# (tie_weights, norm_first, positional, num_layers)
LM_CASES = [
    (True, True, "learned", 2),
    (False, True, "learned", 1),
    (True, False, "sinusoidal", 1),
    (False, False, "sinusoidal", 2),
]


def make_lm(tie, norm_first, positional, num_layers, seed=0):
    cfg = CausalLMConfig(vocab_size=6, block_size=4, d_model=4, num_heads=2,
                         num_layers=num_layers, d_ff=6, dropout=0.0, activation="gelu",
                         norm_first=norm_first, positional=positional, tie_weights=tie)
    model = tiered.CausalLM(cfg)
    randomize(model, seed)
    return model


@pytest.mark.parametrize("tie,norm_first,positional,num_layers", LM_CASES)
def test_lm_gradcheck(tie, norm_first, positional, num_layers):
    with using_backend("numpy"):
        model = make_lm(tie, norm_first, positional, num_layers)
        ids = np.random.default_rng(5).integers(0, 6, size=(2, 4))
        assert_gradcheck(model, [dev(ids)])
        names = {name for name, _ in model.named_parameters()}
        assert ("lm_head.weight" in names) == (not tie)


# (norm_first, positional, encoder layers, decoder layers, tie_weights)
SEQ2SEQ_CASES = [
    (False, "sinusoidal", 1, 1, False),
    (True, "sinusoidal", 2, 1, False),
    (False, "learned", 1, 2, False),
    (False, "sinusoidal", 1, 2, True),
    (True, "learned", 1, 1, True),
]


def make_seq2seq(norm_first, positional, n_enc, n_dec, seed=0, tie=False):
    cfg = Seq2SeqConfig(src_vocab_size=7, tgt_vocab_size=8, d_model=4, num_heads=2,
                        num_encoder_layers=n_enc, num_decoder_layers=n_dec, d_ff=5,
                        block_size=5, dropout=0.0, activation="gelu", norm_first=norm_first,
                        positional=positional, tie_weights=tie, pad_id=PAD, bos_id=2, eos_id=3)
    model = tiered.Seq2SeqTransformer(cfg)
    randomize(model, seed)
    return model


@pytest.mark.parametrize("norm_first,positional,n_enc,n_dec,tie", SEQ2SEQ_CASES)
def test_seq2seq_gradcheck(norm_first, positional, n_enc, n_dec, tie):
    with using_backend("numpy"):
        rng = np.random.default_rng(17)
        model = make_seq2seq(norm_first, positional, n_enc, n_dec, tie=tie)
        src = padded_ids(rng, [4, 2], 4, 7)  # padded source
        tgt = padded_ids(rng, [3, 1], 3, 8)  # padded target (T = 3, S = 4)
        assert_gradcheck(model, [dev(src), dev(tgt)])
        names = {name for name, _ in model.named_parameters()}
        assert ("lm_head.weight" in names) == (not tie)


def test_seq2seq_gradcheck_explicit_lengths():
    """Lengths given explicitly (the training path) instead of derived from the pad id."""
    with using_backend("numpy"):
        rng = np.random.default_rng(23)
        model = make_seq2seq(True, "learned", 1, 1, seed=4)
        src = padded_ids(rng, [3, 4], 4, 7)
        tgt = padded_ids(rng, [2, 3], 3, 8)
        assert_gradcheck(model, [dev(src), dev(tgt)],
                         kwargs={"src_lens": dev(np.array([3, 4])),
                                 "tgt_lens": dev(np.array([2, 3]))})


# =========================================================================== strict backend
def test_classifier_gradcheck_backend(xb):
    rng = np.random.default_rng(2)
    model = make_classifier("mean", True, "sinusoidal", "gelu", 1, seed=1)
    ids = padded_ids(rng, [2, 4], 4, 7)
    assert_gradcheck(model, [dev(ids)])


def test_lm_gradcheck_backend(xb):
    model = make_lm(True, True, "learned", 1, seed=1)
    ids = np.random.default_rng(2).integers(0, 6, size=(2, 3))
    assert_gradcheck(model, [dev(ids)])


def test_seq2seq_gradcheck_backend(xb):
    rng = np.random.default_rng(2)
    model = make_seq2seq(False, "sinusoidal", 1, 1, seed=1)
    src = padded_ids(rng, [4, 3], 4, 7)
    tgt = padded_ids(rng, [3, 2], 3, 8)
    assert_gradcheck(model, [dev(src), dev(tgt)])


# =========================================================================== the checks can fail
def _scaled(fn, factor):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(o * factor for o in out)
        return out * factor
    return wrapped


def test_gradcheck_catches_wrong_classifier_pooling(monkeypatch):
    """A pooling backward off by 1% must fail the check."""
    wrong = _scaled(ops.pool_backward, 1.01)
    monkeypatch.setattr(ops, "pool_backward", wrong)
    monkeypatch.setattr(fast, "pool_backward", wrong)  # the fast tier binds it by name
    with using_backend("numpy"):
        model = make_classifier("mean", False, "learned", "gelu", 1)
        ids = padded_ids(np.random.default_rng(11), [4, 2], 4, 7)
        assert check_module(model, [dev(ids)]).worst_error > 1e-3


def test_gradcheck_catches_missing_tied_gradient(monkeypatch):
    """Tied LM: dropping the head's contribution to the embedding must fail the check."""
    with using_backend("numpy"):
        model = make_lm(True, True, "learned", 1)
        ids = np.random.default_rng(5).integers(0, 6, size=(2, 4))
        table = model.embed.tokens.weight
        calls = []

        def first_use_only(add):
            def accumulate(p, grad, *rows):
                if p is table:
                    calls.append(1)
                    if len(calls) == 1:  # the tied head's share arrives first: drop it
                        return
                add(p, grad, *rows)
            return accumulate

        # the textbook layers add through Parameter.accumulate, the fast ones through
        # npformer.nn.flat.accumulate (in place): both are made to drop that share
        monkeypatch.setattr(type(table), "accumulate", first_use_only(type(table).accumulate))
        monkeypatch.setattr(fast_layers, "accumulate", first_use_only(fast_layers.accumulate))
        result = check_module(model, [dev(ids)])
        assert result.errors["embed.tokens.weight"] > 1e-3


def test_gradcheck_catches_lost_memory_gradient(monkeypatch):
    """seq2seq: a decoder block that halves the gradient of the encoder memory must fail."""
    block_class = tiered.DecoderBlock  # the tier's
    original = block_class.backward

    def halved(self, dy):
        dx, dmemory = original(self, dy)
        return dx, dmemory * 0.5

    monkeypatch.setattr(block_class, "backward", halved)
    with using_backend("numpy"):
        rng = np.random.default_rng(17)
        model = make_seq2seq(False, "sinusoidal", 1, 1)
        src = padded_ids(rng, [4, 2], 4, 7)
        tgt = padded_ids(rng, [3, 1], 3, 8)
        result = check_module(model, [dev(src), dev(tgt)])
        assert result.errors["encoder.0.self_attn.q_proj.weight"] > 1e-3


def test_gradcheck_catches_wrong_block_backward(monkeypatch):
    block_class = tiered.EncoderBlock  # the tier's
    monkeypatch.setattr(block_class, "backward", _scaled(block_class.backward, 0.99))
    with using_backend("numpy"):
        model = make_lm(False, False, "learned", 2)
        ids = np.random.default_rng(5).integers(0, 6, size=(2, 4))
        assert check_module(model, [dev(ids)]).worst_error > 1e-3
