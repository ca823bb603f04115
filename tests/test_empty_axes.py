"""Empty axes (issue 10, item 1): a batch of 0 sequences and sequences of length 0.

Every op (both tiers), layer, model forward/backward and ``predict`` either gives the
correctly shaped empty (or zero) result, or a ValueError naming the empty axis where the
math is not defined:

* defined: linear, layer norm, RMS norm, rotary positions, SwiGLU, embedding, positions,
  dropout, activations, softmax and log-softmax (over an empty axis: the empty result),
  cross-entropy over no rows (loss 0),
  attention with no queries or no batch (empty output) and with no keys (zero output and
  zero gradients, as for fully masked queries), masks of size 0, every layer on B = 0 or
  T = 0, the LM and the seq2seq model on B = 0 or T = 0, seq2seq on a source of length 0
  (cross-attention gives zero, as for an all-padding source), pooling and the classifier
  on B = 0 (logits and probabilities (0, C));
* refused: pooling over sequences of length 0 and the classifier on length-0 sequences
  (no pooling over no positions), logits with no classes (V = 0).

Run on NumPy and the strict backend, in both engines.
"""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend, fast, nn, ops
from npformer.models import (
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
)

from .helpers import tiered, using_tier

TIERS = {"textbook": ops, "fast": fast}


@pytest.fixture(params=list(TIERS))
def op(request):
    return TIERS[request.param]


def arr(shape, seed=0):
    return backend.asarray(np.random.default_rng(seed).standard_normal(shape), dtype="float64")


def ids(shape, high=5, seed=0):
    return backend.asarray(np.random.default_rng(seed).integers(1, high, size=shape),
                           dtype="int64")


def host(x):
    return backend.to_numpy(x)


def assert_shape(x, shape, zero=False):
    """x has ``shape``, is finite, and (``zero``) is all zeros."""
    x = host(x)
    assert x.shape == tuple(shape)
    assert np.all(np.isfinite(x))
    if zero:
        assert not np.any(x)


# =========================================================================== ops
@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
def test_linear_on_no_rows(xb, op, lead):
    x, w, b = arr(lead + (4,)), arr((4, 3)), arr((3,))
    y, cache = op.linear_forward(x, w, b)
    assert_shape(y, lead + (3,))
    dx, dw, db = op.linear_backward(arr(lead + (3,)), cache)
    assert_shape(dx, lead + (4,))
    assert_shape(dw, (4, 3), zero=True)  # no row used W
    assert_shape(db, (3,), zero=True)


@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_layernorm_on_no_rows(xb, op, lead):
    y, cache = op.layernorm_forward(arr(lead + (4,)), arr((4,)), arr((4,)))
    assert_shape(y, lead + (4,))
    dx, dgamma, dbeta = op.layernorm_backward(arr(lead + (4,)), cache)
    assert_shape(dx, lead + (4,))
    assert_shape(dgamma, (4,), zero=True)
    assert_shape(dbeta, (4,), zero=True)


@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_rmsnorm_on_no_rows(xb, op, lead):
    y, cache = op.rmsnorm_forward(arr(lead + (4,)), arr((4,)))
    assert_shape(y, lead + (4,))
    dx, dweight = op.rmsnorm_backward(arr(lead + (4,)), cache)
    assert_shape(dx, lead + (4,))
    assert_shape(dweight, (4,), zero=True)


@pytest.mark.parametrize("b,t", [(0, 3), (2, 0), (0, 0)])
def test_rotary_on_no_positions_or_batch(xb, op, b, t):
    positions = backend.asarray(np.zeros((b, t), np.int64))
    cos, sin = op.rotary_table(positions, 4, dtype=backend.float_dtype("float64"))
    assert_shape(cos, (b, t, 4))
    y, cache = op.rotary_forward(arr((b, 2, t, 4)), cos, sin)
    assert_shape(y, (b, 2, t, 4))
    assert_shape(op.rotary_backward(arr((b, 2, t, 4)), cache), (b, 2, t, 4))


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)])
def test_swiglu_on_nothing(xb, op, shape):
    h, cache = op.swiglu_forward(arr(shape), arr(shape))
    assert_shape(h, shape)
    for grad in op.swiglu_backward(arr(shape), cache):
        assert_shape(grad, shape)


@pytest.mark.parametrize("b,t,s", [(2, 0, 3), (0, 3, 3), (2, 0, 0), (0, 0, 0)])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_without_queries_or_batch(xb, op, b, t, s, masked):
    q, k, v = arr((b, 2, t, 4)), arr((b, 2, s, 4)), arr((b, 2, s, 5))
    mask = ops.padding_mask(backend.asarray(np.full(b, s, np.int64)), s) if masked else None
    out, cache = op.attention_forward(q, k, v, mask)
    assert_shape(out, (b, 2, t, 5))
    dq, dk, dv = op.attention_backward(arr((b, 2, t, 5)), cache)
    assert_shape(dq, (b, 2, t, 4))
    assert_shape(dk, (b, 2, s, 4), zero=True)  # no query used a key
    assert_shape(dv, (b, 2, s, 5), zero=True)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_without_keys_is_zero(xb, op, masked):
    """No keys (S = 0): each query's output and gradients are 0, as when all its keys are
    masked (the ZeroDivisionError of the blocked op, the empty max of the dense one)."""
    q, k, v = arr((2, 2, 3, 4)), arr((2, 2, 0, 4)), arr((2, 2, 0, 5))
    mask = ops.causal_mask(3, 3)[:, :0] if masked else None  # (3, 0)
    out, cache = op.attention_forward(q, k, v, mask)
    assert_shape(out, (2, 2, 3, 5), zero=True)
    dq, dk, dv = op.attention_backward(arr((2, 2, 3, 5)), cache)
    assert_shape(dq, (2, 2, 3, 4), zero=True)
    assert_shape(dk, (2, 2, 0, 4))
    assert_shape(dv, (2, 2, 0, 5))


def test_fully_masked_and_no_keys_agree(xb, op):
    q, k, v = arr((1, 1, 3, 4)), arr((1, 1, 2, 4)), arr((1, 1, 2, 4))
    masked, _ = op.attention_forward(q, k, v, backend.asarray(np.zeros((3, 2), bool)))
    empty, _ = op.attention_forward(q, k[:, :, :0, :], v[:, :, :0, :])
    np.testing.assert_array_equal(host(masked), host(empty))


@pytest.mark.parametrize("shape,axis", [((2, 0), -1), ((0, 3), -1), ((0, 3), 0), ((3, 0, 2), 1)])
def test_softmax_over_an_empty_axis(xb, op, shape, axis):
    p, cache = op.softmax_forward(arr(shape), axis=axis)
    assert_shape(p, shape)
    assert_shape(op.softmax_backward(arr(shape), cache), shape)
    y, cache = ops.log_softmax_forward(arr(shape), axis=axis)
    assert_shape(y, shape)
    assert_shape(ops.log_softmax_backward(arr(shape), cache), shape)


def test_masked_softmax_over_an_empty_axis(xb, op):
    p, _ = op.softmax_forward(arr((3, 0)), mask=backend.asarray(np.ones((1, 0), bool)))
    assert_shape(p, (3, 0))


@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_cross_entropy_over_no_rows_is_zero(xb, op, lead):
    loss, cache = op.cross_entropy_forward(arr(lead + (5,)), ids(lead), label_smoothing=0.1)
    assert float(host(loss)) == 0.0
    assert_shape(op.cross_entropy_backward(1.0, cache), lead + (5,))


def test_cross_entropy_needs_a_class(xb, op):
    with pytest.raises(ValueError, match=r"cross-entropy logits need a class axis \(last\) "
                                         r"of at least one class, got shape \(2, 0\)"):
        op.cross_entropy_forward(arr((2, 0)), ids((2,)))


@pytest.mark.parametrize("shape", [(0, 3), (2, 0), (0,)])
def test_embedding_of_no_ids(xb, shape):
    y, cache = ops.embedding_forward(ids(shape), arr((5, 4)))
    assert_shape(y, shape + (4,))
    assert_shape(ops.embedding_backward(arr(shape + (4,)), cache), (5, 4), zero=True)


@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 0, 4)])
def test_positions_dropout_activations_on_empty(xb, op, shape):
    y, cache = ops.add_positions_forward(arr(shape), ops.sinusoidal_table(5, 4))
    assert_shape(y, shape)
    dx, dtable = ops.add_positions_backward(arr(shape), cache)
    assert_shape(dx, shape)
    assert_shape(dtable, (5, 4), zero=True)
    y, cache = ops.dropout_forward(arr(shape), 0.5)
    assert_shape(ops.dropout_backward(arr(shape), cache), shape)
    for name in ("relu", "gelu", "gelu_tanh"):
        forward, backward = op.activation(name)
        y, cache = forward(arr(shape))
        assert_shape(y, shape)
        assert_shape(backward(arr(shape), cache), shape)


@pytest.mark.parametrize("how", ops.POOLINGS)
def test_pooling_an_empty_batch(xb, how):
    y, cache = ops.pool_forward(arr((0, 3, 4)), ids((0,)), how)
    assert_shape(y, (0, 4))
    assert_shape(ops.pool_backward(arr((0, 4)), cache), (0, 3, 4))


@pytest.mark.parametrize("how", ops.POOLINGS)
def test_pooling_over_no_positions_is_refused(xb, how):
    with pytest.raises(ValueError, match=r"pooling needs at least one position per sequence, "
                                         r"but the input of shape \(2, 0, 4\) has none "
                                         r"\(axis 1, the positions, is empty\)"):
        ops.pool_forward(arr((2, 0, 4)), ids((2,)) * 0, how)


def test_masks_of_size_zero(xb):
    assert host(ops.causal_mask(0)).shape == (0, 0)
    assert host(ops.causal_mask(0, 3)).shape == (0, 3)
    assert host(ops.padding_mask(ids((0,)), 3)).shape == (0, 1, 1, 3)
    assert host(ops.padding_mask(ids((2,)) * 0, 0)).shape == (2, 1, 1, 0)


# =========================================================================== layers
def run_layer(layer, inputs, out_shape, **kwargs):
    """forward and backward of a layer: the output's shape, and the input gradients'."""
    y = layer(*inputs, **kwargs)
    assert_shape(y, out_shape)
    grads = layer.backward(arr(out_shape))
    grads = grads if isinstance(grads, tuple) else (grads,)
    for g, x in zip(grads, inputs):
        if g is not None:
            assert_shape(g, x.shape)
    for p in layer.parameters():
        assert_shape(p.grad, p.shape)


EMPTY = [(0, 3), (2, 0), (0, 0)]


@pytest.mark.parametrize("b,t", EMPTY)
def test_position_wise_layers(xb, tier, b, t):
    run_layer(tiered.Linear(4, 3), [arr((b, t, 4))], (b, t, 3))
    run_layer(tiered.LayerNorm(4), [arr((b, t, 4))], (b, t, 4))
    run_layer(tiered.Embedding(5, 4), [ids((b, t))], (b, t, 4))
    run_layer(tiered.LearnedPositionalEmbedding(4, 4), [arr((b, t, 4))], (b, t, 4))
    run_layer(nn.SinusoidalPositionalEncoding(4, 4), [arr((b, t, 4))], (b, t, 4))
    run_layer(tiered.Dropout(0.5), [arr((b, t, 4))], (b, t, 4))
    run_layer(tiered.Activation("relu"), [arr((b, t, 4))], (b, t, 4))
    run_layer(tiered.FeedForward(4, 6), [arr((b, t, 4))], (b, t, 4))


@pytest.mark.parametrize("b,t", EMPTY)
@pytest.mark.parametrize("norm_first", [False, True])
def test_attention_and_blocks(xb, tier, b, t, norm_first):
    """The issue's ZeroDivisionError: EncoderBlock(8, 2, 16) on (2, 0, 8)."""
    mask = ops.padding_mask(backend.asarray(np.full(b, t, np.int64)), t)
    run_layer(tiered.MultiHeadAttention(8, 2), [arr((b, t, 8))], (b, t, 8), mask=mask)
    run_layer(tiered.EncoderBlock(8, 2, 16, norm_first=norm_first), [arr((b, t, 8))], (b, t, 8),
              mask=mask)
    run_layer(tiered.DecoderBlock(8, 2, 16, norm_first=norm_first), [arr((b, t, 8)),
              arr((b, 3, 8))], (b, t, 8), self_mask=ops.causal_mask(t))


@pytest.mark.parametrize("b,t", EMPTY)
def test_fast_blocks_on_packed_rows(xb, b, t):
    """The fast block on packed rows (npformer.fast.Packing): empty batches and lengths."""
    with using_tier("fast"):
        block = tiered.EncoderBlock(8, 2, 16)
    packing = fast.Packing.from_lengths(backend.asarray(np.full(b, t, np.int64)), t)
    x = packing.pack(arr((b, t, 8)))
    mask = ops.padding_mask(backend.asarray(np.full(b, t, np.int64)), t)
    y = block(x, mask=mask, packing=packing)
    assert_shape(packing.unpack(y), (b, t, 8))
    assert_shape(block.backward(arr(tuple(y.shape))), tuple(x.shape))


def test_cross_attention_over_an_empty_context_is_zero(xb, tier):
    layer = tiered.MultiHeadAttention(8, 2, bias=False)
    y = layer(arr((2, 3, 8)), context=arr((2, 0, 8)))
    assert_shape(y, (2, 3, 8), zero=True)
    dx, dcontext = layer.backward(arr((2, 3, 8)))
    assert_shape(dx, (2, 3, 8), zero=True)
    assert_shape(dcontext, (2, 0, 8))


# =========================================================================== models
def classifier(pooling="mean"):
    return tiered.TransformerClassifier(ClassifierConfig(vocab_size=7, d_model=8, num_heads=2,
                                                  num_layers=1, d_ff=16, block_size=6,
                                                  dropout=0.0, pooling=pooling))


def lm():
    return tiered.CausalLM(CausalLMConfig(vocab_size=7, block_size=6, d_model=8, num_heads=2,
                                   num_layers=1, d_ff=16))


def seq2seq():
    return tiered.Seq2SeqTransformer(Seq2SeqConfig(src_vocab_size=7, tgt_vocab_size=9, d_model=8,
                                            num_heads=2, num_encoder_layers=1,
                                            num_decoder_layers=1, d_ff=16, block_size=6,
                                            dropout=0.0))


@pytest.mark.parametrize("t", [0, 4])
@pytest.mark.parametrize("pooling", ops.POOLINGS)
def test_classifier_on_an_empty_batch(xb, tier, t, pooling):
    model = classifier(pooling)
    logits = model(ids((0, t)))
    assert_shape(logits, (0, 2))
    assert model.backward(arr((0, 2))) is None
    assert_shape(model.predict(ids((0, t))), (0, 2))
    assert_shape(model.predict([]), (0, 2))  # an empty list: no sequences


@pytest.mark.parametrize("call", ["forward", "predict"])
def test_classifier_refuses_sequences_of_length_zero(xb, tier, call):
    """predict on length 0 blamed the mask's shape; now the positions axis is named."""
    model = classifier()
    with pytest.raises(ValueError, match=r"TransformerClassifier needs at least one position "
                                         r"per sequence, got token ids of shape \(2, 0\) "
                                         r"\(axis 1, the positions, is empty\)"):
        getattr(model, call)(ids((2, 0)))


@pytest.mark.parametrize("b,t", EMPTY)
def test_lm_on_empty_axes(xb, tier, b, t):
    model = lm()
    assert_shape(model(ids((b, t))), (b, t, 7))
    assert model.backward(arr((b, t, 7))) is None
    for p in model.parameters():
        assert_shape(p.grad, p.shape)


@pytest.mark.parametrize("b,s,t", [(0, 3, 2), (2, 3, 0), (2, 0, 3), (0, 0, 0)])
def test_seq2seq_on_empty_axes(xb, tier, b, s, t):
    model = seq2seq()
    logits = model(ids((b, s)), ids((b, t)))
    assert_shape(logits, (b, t, 9))
    assert model.backward(arr((b, t, 9))) is None
    for p in model.parameters():
        assert_shape(p.grad, p.shape)


def test_seq2seq_source_of_length_zero_is_an_all_padding_source(xb, tier):
    """S = 0 means what a source of padding only means: nothing to attend to."""
    model = seq2seq()
    tgt = ids((2, 3))
    empty = model(ids((2, 0)), tgt)
    padded = model(backend.asarray(np.zeros((2, 4), np.int64)), tgt)
    np.testing.assert_allclose(host(empty), host(padded), rtol=1e-12, atol=1e-12)
