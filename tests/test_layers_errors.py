"""Misuse of the layers fails at once, with a message that names the problem.

Each case checks the exception type and that the message names what is wrong (the
argument, the offending numbers or shapes: fragments, not whole sentences), on NumPy and
on the strict namespace: construction (head count, dropout rate, activation), inputs of
the wrong rank or width (Linear, LayerNorm, attention, blocks), a context whose batch
differs, masks that do not broadcast or are not boolean, token ids out of range or not
integers, sequences longer than the positional table, backward without (or twice after)
a forward, ``load_state_dict`` with missing / extra / misshapen entries (reported
together, nothing changed), ``load_torch_state_dict`` with missing or extra keys, and
exporting wide-head attention (no torch equivalent).
"""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend, nn, ops
from npformer.interop.pytorch import load_torch_state_dict, to_torch_state_dict
from npformer.ops import causal_mask, padding_mask

from .helpers import raises_naming, tiered

# A behaviour test: it runs in both tiers (tests.helpers.tiered), which must behave the same.
pytestmark = pytest.mark.usefixtures("tier")


def arr(shape, dtype="float64", seed=0):
    return backend.asarray(np.random.default_rng(seed).standard_normal(shape), dtype=dtype)


def ids(values):
    return backend.asarray(np.asarray(values), dtype="int64")


# =========================================================================== construction
@pytest.mark.parametrize("d_model,heads", [(6, 4), (10, 3), (5, 2)])
def test_heads_must_divide_width(xb, d_model, heads):
    with pytest.raises(ValueError, match=rf"d_model {d_model}.*num_heads {heads}"):
        tiered.MultiHeadAttention(d_model, heads)
    with pytest.raises(ValueError, match=rf"d_model {d_model}.*num_heads {heads}"):
        tiered.EncoderBlock(d_model, heads, 8)
    tiered.MultiHeadAttention(d_model, heads, head_dim=3)  # explicit head width: allowed


def test_head_count_must_be_positive(xb):
    with pytest.raises(ValueError, match="num_heads must be at least 1, got 0"):
        tiered.MultiHeadAttention(4, 0)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_rate_range(xb, p):
    with pytest.raises(ValueError, match=rf"dropout probability must be in \[0, 1\), got {p}"):
        tiered.Dropout(p)


def test_unknown_activation(xb):
    with pytest.raises(ValueError, match=r"unknown activation 'swish'.*gelu.*relu"):
        tiered.Activation("swish")
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        tiered.FeedForward(4, 8, activation="tanh")


# =========================================================================== shapes
def test_linear_wrong_width(xb):
    layer = tiered.Linear(4, 3)
    with raises_naming(ValueError, "linear input", "last dimension 4", "(2, 5)"):
        layer(arr((2, 5)))


def test_linear_scalar_input(xb):
    with raises_naming(ValueError, "linear input", "last dimension 4", "()"):
        tiered.Linear(4, 3)(arr(()))


def test_linear_integer_input(xb):
    with pytest.raises(TypeError, match="linear input must be a floating-point array"):
        tiered.Linear(4, 3)(ids([[1, 2, 3, 4]]))


@pytest.mark.parametrize("shape", [(2, 3, 5), (4, 3), ()])
def test_layernorm_wrong_width_or_rank(xb, shape):
    with raises_naming(ValueError, "layer norm input", "last dimension 4", str(shape)):
        tiered.LayerNorm(4)(arr(shape))


@pytest.mark.parametrize("shape", [(3, 4), (2, 1, 3, 4), (4,)])
def test_attention_wrong_rank(xb, shape):
    layer = tiered.MultiHeadAttention(4, 2)
    with raises_naming(ValueError, "attention input", "(batch, positions, width)",
                       "3 dimensions", str(shape)):
        layer(arr(shape))


def test_attention_wrong_width(xb):
    layer = tiered.MultiHeadAttention(4, 2)
    with raises_naming(ValueError, "attention input", "width 6", "width 4", "(2, 3, 6)"):
        layer(arr((2, 3, 6)))
    with pytest.raises(ValueError, match=r"attention context has width 5.*width 4"):
        layer(arr((2, 3, 4)), context=arr((2, 3, 5)))
    with pytest.raises(ValueError, match=r"attention context .*3 dimensions.*\(2, 4\)"):
        layer(arr((2, 3, 4)), context=arr((2, 4)))


def test_attention_context_batch_mismatch(xb):
    layer = tiered.MultiHeadAttention(4, 2)
    with raises_naming(ValueError, "attention context", "batch 3", "batch 2"):
        layer(arr((2, 3, 4)), context=arr((3, 5, 4)))


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_encoder_block_wrong_input(xb, norm_first):
    block = tiered.EncoderBlock(4, 2, 8, dropout=0.0, norm_first=norm_first)
    with pytest.raises(ValueError, match=r"(attention input has width 6|"
                                         r"layer norm input must have last dimension 4).*"
                                         r"\(2, 3, 6\)"):
        block(arr((2, 3, 6)))
    with pytest.raises(ValueError, match=r"must have 3 dimensions, got shape \(3, 4\)"):
        block(arr((3, 4)))


def test_decoder_block_wrong_memory(xb):
    block = tiered.DecoderBlock(4, 2, 8, dropout=0.0)
    with pytest.raises(ValueError, match=r"attention context has width 6"):
        block(arr((2, 3, 4)), arr((2, 5, 6)))
    with pytest.raises(ValueError, match="attention context has batch 1 but the queries "
                                         "have batch 2"):
        block(arr((2, 3, 4)), arr((1, 5, 4)))


# =========================================================================== masks
@pytest.mark.parametrize("mask_shape", [
    (3, 1, 1, 5),  # wrong batch (2)
    (2, 1, 1, 4),  # wrong key length (5)
    (2, 3, 3, 5),  # wrong head count (2)
    (3, 5),        # 2-D mask with wrong query length
])
def test_cross_attention_mask_does_not_broadcast(xb, mask_shape):
    layer = tiered.MultiHeadAttention(4, 2)
    mask = backend.asarray(np.ones(mask_shape, dtype=bool))
    with raises_naming(ValueError, "attention mask", str(mask_shape), "attention scores",
                       "(2, 2, 4, 5)"):
        layer(arr((2, 4, 4)), context=arr((2, 5, 4)), mask=mask)


def test_padding_mask_for_wrong_length(xb):
    layer = tiered.EncoderBlock(4, 2, 8, dropout=0.0)
    mask = padding_mask(ids([2, 3]), 5)  # built for 5 keys, the input has 3 positions
    with pytest.raises(ValueError, match=r"\(2, 1, 1, 5\) does not broadcast .*\(2, 2, 3, 3\)"):
        layer(arr((2, 3, 4)), mask=mask)


def test_decoder_memory_mask_wrong_shape(xb):
    block = tiered.DecoderBlock(4, 2, 8, dropout=0.0)
    with pytest.raises(ValueError, match=r"\(3, 3\) does not broadcast .*\(2, 2, 3, 5\)"):
        block(arr((2, 3, 4)), arr((2, 5, 4)), self_mask=causal_mask(3),
              memory_mask=causal_mask(3))


def test_mask_must_be_boolean(xb):
    layer = tiered.MultiHeadAttention(4, 2)
    with pytest.raises(TypeError, match="mask must be a boolean array .True = may attend., "
                                        "got dtype"):
        layer(arr((2, 3, 4)), mask=backend.asarray(np.ones((3, 3)), dtype="float64"))


# =========================================================================== ids and positions
@pytest.mark.parametrize("bad", [5, 9, -1])
def test_token_id_out_of_range(xb, bad):
    layer = tiered.Embedding(5, 3)
    with raises_naming(IndexError, "token ids", f"id {bad}", "5 entries", "0..4"):
        layer(ids([[0, 1, bad], [2, 2, 2]]))


def test_token_ids_must_be_integers(xb):
    layer = tiered.Embedding(5, 3)
    with pytest.raises(TypeError, match="token ids must be an integer array, got dtype "
                                        ".*float"):
        layer(backend.asarray(np.array([[0.0, 1.0]])))


@pytest.mark.parametrize("kind", ["learned", "sinusoidal"])
def test_sequence_longer_than_positional_table(xb, kind):
    cls = nn.LearnedPositionalEmbedding if kind == "learned" else nn.SinusoidalPositionalEncoding
    layer = cls(4, 3)
    layer(arr((2, 4, 3)))  # exactly block_size is fine
    with raises_naming(ValueError, "length 5", "positional table", "4 positions"):
        layer(arr((2, 5, 3)))


@pytest.mark.parametrize("kind", ["learned", "sinusoidal"])
def test_positional_wrong_width_or_rank(xb, kind):
    cls = nn.LearnedPositionalEmbedding if kind == "learned" else nn.SinusoidalPositionalEncoding
    layer = cls(4, 3)
    with pytest.raises(ValueError, match="input width 5 does not match the positional table "
                                         "width 3"):
        layer(arr((2, 4, 5)))
    with pytest.raises(ValueError, match=r"must have 3 dimensions, got shape \(4, 3\)"):
        layer(arr((4, 3)))


# =========================================================================== backward
def _layers_and_inputs():
    """(name, layer factory, forward) for every layer type."""
    x = lambda: arr((2, 3, 4))  # noqa: E731
    return [
        ("Linear", lambda: tiered.Linear(4, 3), lambda m: m(x())),
        ("LayerNorm", lambda: tiered.LayerNorm(4), lambda m: m(x())),
        ("Embedding", lambda: tiered.Embedding(5, 4), lambda m: m(ids([[1, 2]]))),
        ("LearnedPositionalEmbedding", lambda: tiered.LearnedPositionalEmbedding(3, 4),
         lambda m: m(x())),
        ("SinusoidalPositionalEncoding", lambda: nn.SinusoidalPositionalEncoding(3, 4),
         lambda m: m(x())),
        ("Dropout", lambda: tiered.Dropout(0.5), lambda m: m(x())),
        ("Activation", lambda: tiered.Activation("gelu"), lambda m: m(x())),
        ("MultiHeadAttention", lambda: tiered.MultiHeadAttention(4, 2), lambda m: m(x())),
        ("FeedForward", lambda: tiered.FeedForward(4, 6), lambda m: m(x())),
        ("EncoderBlock", lambda: tiered.EncoderBlock(4, 2, 6), lambda m: m(x())),
        ("DecoderBlock", lambda: tiered.DecoderBlock(4, 2, 6), lambda m: m(x(), x())),
    ]


LAYERS = _layers_and_inputs()


@pytest.mark.parametrize("name,make,forward", LAYERS, ids=[n for n, *_ in LAYERS])
def test_backward_without_forward(xb, name, make, forward):
    layer = make()
    dy = arr((2, 3, 4))
    with pytest.raises(RuntimeError, match="backward called without a forward pass"):
        layer.backward(dy)


@pytest.mark.parametrize("name,make,forward", LAYERS, ids=[n for n, *_ in LAYERS])
def test_backward_twice_after_one_forward(xb, name, make, forward):
    layer = make()
    y = forward(layer)
    dy = backend.asarray(np.ones(tuple(y.shape)), dtype="float64")
    layer.backward(dy)
    with pytest.raises(RuntimeError, match="without a forward pass .*already consumed it"):
        layer.backward(dy)


def test_backward_error_names_the_layer(xb):
    with pytest.raises(RuntimeError, match=r"^LayerNorm\.backward called without"):
        tiered.LayerNorm(4).backward(arr((2, 3, 4)))


# =========================================================================== state dicts
def test_load_state_dict_reports_every_problem_at_once(xb):
    layer = tiered.FeedForward(4, 6)
    before = {k: backend.to_numpy(v).copy() for k, v in layer.state_dict().items()}
    state = dict(layer.state_dict())
    del state["linear2.bias"]  # missing
    state["linear3.weight"] = arr((6, 4))  # extra
    state["linear1.weight"] = arr((6, 4))  # transposed: wrong shape
    with pytest.raises(ValueError) as info:
        layer.load_state_dict(state)
    message = str(info.value)
    assert "state_dict does not fit FeedForward" in message
    assert "missing keys: ['linear2.bias']" in message
    assert "unexpected keys: ['linear3.weight']" in message
    assert "linear1.weight: expected (4, 6), got (6, 4)" in message
    for k, v in layer.state_dict().items():  # nothing was changed
        np.testing.assert_array_equal(backend.to_numpy(v), before[k])


def test_load_state_dict_only_wrong_shape(xb):
    layer = tiered.LayerNorm(4)
    with pytest.raises(ValueError, match=r"wrong shapes: weight: expected \(4,\), got \(5,\)"):
        layer.load_state_dict({"weight": arr((5,)), "bias": arr((4,))})


def _torch_encoder_state(d=4, heads=2, d_ff=6):
    """A state dict with torch's names and layouts (NumPy arrays: no torch needed)."""
    block = tiered.EncoderBlock(d, heads, d_ff)
    return to_torch_state_dict(block)


def test_load_torch_state_dict_missing_and_extra_keys(xb):
    state = _torch_encoder_state()
    del state["norm2.bias"]
    state["norm3.weight"] = np.ones(4)
    target = tiered.EncoderBlock(4, 2, 6)
    with pytest.raises(ValueError, match=r"PyTorch state dict does not fit EncoderBlock: "
                                         r"missing keys \['norm2.bias'\], "
                                         r"unexpected keys \['norm3.weight'\]"):
        load_torch_state_dict(target, state)


def test_load_torch_state_dict_missing_key_only(xb):
    state = _torch_encoder_state()
    del state["self_attn.in_proj_bias"]
    with pytest.raises(ValueError, match=r"missing keys \['self_attn.in_proj_bias'\], "
                                         r"unexpected keys \[\]"):
        load_torch_state_dict(tiered.EncoderBlock(4, 2, 6), state)


def test_load_torch_state_dict_wrong_shape(xb):
    state = _torch_encoder_state(d_ff=6)
    # named and shaped as the torch state dict holds them (torch's (out, in) layout)
    with pytest.raises(ValueError, match=r"linear1.weight: expected \(7, 4\), got \(6, 4\)"):
        load_torch_state_dict(tiered.EncoderBlock(4, 2, 7), state)


@pytest.mark.parametrize("make", [
    lambda: tiered.MultiHeadAttention(4, 2, head_dim=4),
    lambda: tiered.EncoderBlock(4, 2, 6, head_dim=4),
    lambda: tiered.DecoderBlock(4, 2, 6, head_dim=3),
], ids=["mha", "encoder", "decoder"])
def test_wide_heads_have_no_torch_equivalent(xb, make):
    layer = make()
    with pytest.raises(ValueError, match=r"num_heads \* head_dim == embed_dim.*"
                                         r"2 heads of width \d for d_model 4.*"
                                         r"wide heads have no PyTorch equivalent"):
        to_torch_state_dict(layer)
    with pytest.raises(ValueError, match="wide heads have no PyTorch equivalent"):
        load_torch_state_dict(layer, {})


def test_unregistered_module_has_no_torch_rules(xb):
    with pytest.raises(TypeError, match="no PyTorch equivalent is registered for Dropout"):
        to_torch_state_dict(tiered.Dropout(0.1))


# ================================================================== issue 10: sizes, lists, lengths
@pytest.mark.parametrize("make,message", [
    (lambda: tiered.Linear(0, 3), "in_features must be at least 1, got 0"),
    (lambda: tiered.Linear(3, -1), "out_features must be at least 1, got -1"),
    (lambda: tiered.LayerNorm(0), "layer norm width must be at least 1, got 0"),
    (lambda: tiered.Embedding(0, 4), "num_embeddings must be at least 1, got 0"),
    (lambda: tiered.LearnedPositionalEmbedding(0, 4), "block_size must be at least 1, got 0"),
    (lambda: nn.SinusoidalPositionalEncoding(4, 0), "d_model must be at least 1, got 0"),
    (lambda: tiered.MultiHeadAttention(0, 1), "d_model must be at least 1, got 0"),
    (lambda: tiered.MultiHeadAttention(4, 2, head_dim=0), "head_dim must be at least 1, got 0"),
    (lambda: tiered.FeedForward(4, 0), "d_ff must be at least 1, got 0"),
])
def test_layer_sizes_must_be_positive(xb, make, message):
    """Linear(0, 3) raised ZeroDivisionError (1 / sqrt(0))."""
    with raises_naming(ValueError, *message.split(" must be ")):
        make()


@pytest.mark.parametrize("eps,error", [(-1.0, ValueError), (0.0, ValueError),
                                       (float("nan"), ValueError), ("1e-5", TypeError)])
def test_layer_norm_eps_must_be_a_positive_number(xb, eps, error):
    """Issue 37 case 17: eps=-1.0 was taken and gave NaN rows; "1e-5" reached numba."""
    with raises_naming(error, "layer norm eps", repr(eps) if error is TypeError else ""):
        tiered.LayerNorm(4, eps=eps)


def test_layer_sizes_must_be_integers(xb):
    with raises_naming(TypeError, "num_heads", "integer", "2.0"):
        tiered.MultiHeadAttention(4, 2.0)
    with raises_naming(TypeError, "in_features", "integer", "'4'"):
        tiered.Linear("4", 3)


@pytest.mark.parametrize("valid,length", [([0, 5], 4), ([-1, 2], 4)])
def test_valid_lengths_out_of_range(xb, valid, length):
    with raises_naming(ValueError, "valid lengths", f"[0, {length}]",
                       f"[{min(valid)}, {max(valid)}]"):
        ops.valid_rows_forward(backend.asarray(np.zeros((2, length, 3))),
                               backend.asarray(np.array(valid)))


def test_valid_lengths_must_be_one_per_row(xb):
    with raises_naming(ValueError, "3 valid lengths", "batch of 2"):
        ops.valid_rows_forward(backend.asarray(np.zeros((2, 4, 3))),
                               backend.asarray(np.array([1, 2, 3])))


@pytest.mark.parametrize("layer,args", [
    (lambda: tiered.Linear(2, 3), ([[1.0, 2.0]],)),
    (lambda: tiered.MultiHeadAttention(2, 1), ([[[1.0, 2.0]]],)),
    (lambda: tiered.EncoderBlock(2, 1, 4), ([[[1.0, 2.0]]],)),
    (lambda: tiered.Embedding(3, 2), ([[0, 1]],)),
])
def test_layers_refuse_lists_naming_the_input(xb, layer, args):
    with pytest.raises(TypeError, match=r"must be an array, got list: convert host data with "
                                        r"npformer.backend.asarray"):
        layer()(*args)


def _models():
    from npformer.models import (
        CausalLMConfig,
        ClassifierConfig,
        Seq2SeqConfig,
    )
    return {
        "classifier": tiered.TransformerClassifier(ClassifierConfig(
            vocab_size=6, d_model=4, num_heads=2, num_layers=1, d_ff=6, block_size=4)),
        "lm": tiered.CausalLM(CausalLMConfig(vocab_size=6, block_size=4, d_model=4, num_heads=2,
                                      num_layers=1, d_ff=6)),
        "seq2seq": tiered.Seq2SeqTransformer(Seq2SeqConfig(
            src_vocab_size=6, tgt_vocab_size=7, d_model=4, num_heads=2, num_encoder_layers=1,
            num_decoder_layers=1, d_ff=6, block_size=4)),
    }


def _call(kind, model, src, tgt=None):
    return model(src, tgt) if kind == "seq2seq" else model(src)


@pytest.mark.parametrize("kind", ["classifier", "lm", "seq2seq"])
def test_models_accept_nested_lists(xb, tier, kind):
    """The models' public entry points take array-likes ('list' has no attribute 'ndim')."""
    model = _models()[kind]
    rows = [[1, 2, 3], [4, 5, 0]]
    with nn.evaluating(model):
        from_lists = _call(kind, model, rows, [[2, 3], [4, 1]])
        from_arrays = _call(kind, model, ids(rows), ids([[2, 3], [4, 1]]))
    np.testing.assert_array_equal(backend.to_numpy(from_lists), backend.to_numpy(from_arrays))
    if kind == "classifier":
        np.testing.assert_array_equal(backend.to_numpy(model.predict(rows, [3, 2])),
                                      backend.to_numpy(model.predict(ids(rows), ids([3, 2]))))


@pytest.mark.parametrize("kind", ["classifier", "lm", "seq2seq"])
def test_models_refuse_ragged_or_float_ids(xb, kind):
    model = _models()[kind]
    with pytest.raises(ValueError, match=r"ids must be an array or a rectangular nested list "
                                         r"of numbers"):
        _call(kind, model, [[1, 2], [3]], [[1], [2]])
    with pytest.raises(TypeError, match=r"ids must be an integer array, got dtype .*float64"):
        _call(kind, model, [[1.0, 2.0]], [[1, 2]])
    with pytest.raises(TypeError, match=r"ids must hold numbers, got list of dtype <U1"):
        _call(kind, model, [["a", "b"]], [[1, 2]])


@pytest.mark.parametrize("kind", ["classifier", "lm", "seq2seq"])
def test_models_refuse_ids_outside_the_vocabulary(xb, kind):
    model = _models()[kind]
    with pytest.raises(ValueError, match=r"token ids out of range: found id 6, but the "
                                         r"vocabulary has 6 entries"):
        _call(kind, model, [[1, 6]], [[1, 2]])


@pytest.mark.parametrize("bad", ["no", 0, None])
def test_need_weights_must_be_true_or_false(xb, bad):
    """Issue 37 case 22: need_weights="no" returned the weights (a truthy string)."""
    layer = tiered.MultiHeadAttention(4, 2)
    x = backend.asarray(np.zeros((1, 3, 4)), dtype="float64")
    with raises_naming(TypeError, "need_weights", repr(bad)):
        layer(x, need_weights=bad)
