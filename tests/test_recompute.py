"""Activations computed again instead of kept (the memory of a training step).

The feed-forward network does not keep its second linear map's input, and a pre-norm
block does not keep its sublayers' input LN(x): the backward computes each again from
what other layers keep anyway.  This is the fast tier's (npformer.fast.layers and
.blocks); the textbook layers keep what their backward needs.  These tests hold (1) that
each recomputation is the forward's own output bit for bit, for every activation, so no
gradient changes (the gradient checks, tests/test_fast_layers.py and the PyTorch parity
tests hold the gradients themselves); (2) that the fast forward really does not keep
those arrays, and the textbook one does; (3) the fast linear op's contract for an input
it did not keep.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npformer import backend, ops
from npformer.models import CausalLMConfig
from tests.conftest import using_backend
from tests.helpers import raises_naming, tiered, using_tier

TIERS = ["fast"]  # the recomputation is the fast tier's
FLOATS = ["float32", "float64"]
ACTIVATIONS = ["relu", "gelu", "gelu_tanh"]

shapes = st.tuples(st.integers(1, 4), st.integers(1, 9), st.integers(1, 33))


def _random(shape, seed):
    """Normal samples of standard deviation 3, in the default float dtype."""
    values = np.random.default_rng(seed).standard_normal(shape) * 3
    return backend.asarray(values.astype(backend.default_float_name()))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", ACTIVATIONS)
@settings(max_examples=10, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_an_activations_output_again_is_its_forward_output(tier, dtype, name, shape, seed):
    with using_backend("numpy", dtype), using_tier(tier):
        layer = tiered.Activation(name)
        y = layer(_random(shape, seed))
        again = layer.output_again()
        assert again.dtype == y.dtype
        np.testing.assert_array_equal(backend.to_numpy(again), backend.to_numpy(y))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", FLOATS)
@settings(max_examples=10, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_a_layer_norms_output_again_is_its_forward_output(tier, dtype, shape, seed):
    with using_backend("numpy", dtype), using_tier(tier):
        layer = tiered.LayerNorm(shape[-1])
        layer.weight.data = _random(shape[-1:], seed + 1)
        layer.bias.data = _random(shape[-1:], seed + 2)
        y = layer(_random(shape, seed))
        np.testing.assert_array_equal(backend.to_numpy(layer.output_again()),
                                      backend.to_numpy(y))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_dropout_again_applies_the_forwards_mask(tier, p):
    with using_backend("numpy", "float32", seed=3), using_tier(tier):
        layer = tiered.Dropout(p)
        x = _random((4, 7, 16), 0)
        y = layer(x)
        np.testing.assert_array_equal(backend.to_numpy(layer.mask_again(x)), backend.to_numpy(y))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_the_feed_forward_gradients_equal_those_of_its_layers_with_every_input_kept(tier, name):
    """The FFN's backward (linear2's input computed again) against the same layers run
    by hand with every input kept: the same numbers, bit for bit."""
    with using_backend("numpy", "float32", seed=5), using_tier(tier):
        ffn = tiered.FeedForward(8, 24, name, dropout=0.25)
        x, dy = _random((3, 5, 8), 1), _random((3, 5, 8), 2)
        with backend.thread_generator(7):
            y = ffn(x)
        dx = ffn.backward(dy)
        grads = [backend.to_numpy(p.grad).copy() for p in ffn.parameters()]

        ffn.zero_grad()
        with backend.thread_generator(7):  # the same dropout mask again
            h = ffn.activation(ffn.linear1(x))
            y_kept = ffn.linear2(ffn.dropout(h))  # kept: linear2 holds its input
        dh = ffn.dropout.backward(ffn.linear2.backward(dy))
        dx_kept = ffn.linear1.backward(ffn.activation.backward(dh))
        np.testing.assert_array_equal(backend.to_numpy(y), backend.to_numpy(y_kept))
        np.testing.assert_array_equal(backend.to_numpy(dx), backend.to_numpy(dx_kept))
        for got, p in zip(grads, ffn.parameters()):
            np.testing.assert_array_equal(got, backend.to_numpy(p.grad))


@pytest.mark.parametrize("tier", TIERS)
def test_a_pre_norm_step_keeps_no_normed_input_and_no_hidden_layer(tier):
    with using_backend("numpy", "float32"), using_tier(tier):
        model = tiered.CausalLM(CausalLMConfig(vocab_size=11, block_size=8, d_model=16, num_heads=2,
                                        num_layers=2, d_ff=32))
        model(np.arange(16).reshape(2, 8) % 11)
        for block in model.blocks:
            attn = block.self_attn
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, block.ffn.linear1,
                           block.ffn.linear2):
                assert linear._saved.values[0] is None
            assert attn.out_proj._saved.values[0] is not None  # the heads: no one else keeps them
        assert model.embed.tokens._project_saved.values[0] is None


def test_the_textbook_layers_keep_every_input_their_backward_reads():
    with using_backend("numpy", "float32"), using_tier("textbook"):
        model = tiered.CausalLM(CausalLMConfig(vocab_size=11, block_size=8, d_model=16, num_heads=2,
                                        num_layers=2, d_ff=32))
        model(np.arange(16).reshape(2, 8) % 11)
        for block in model.blocks:
            attn = block.self_attn
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj,
                           block.ffn.linear1, block.ffn.linear2):
                assert linear._saved.values[0] is not None
        assert model.embed.tokens._project_saved.values[0] is not None


@pytest.mark.parametrize("tier", TIERS)
def test_a_post_norm_block_keeps_its_sublayers_inputs(tier):
    """Post-norm: a sublayer's input is the residual stream, which no norm keeps, so it
    is kept; only the feed-forward hidden layer is computed again."""
    with using_backend("numpy", "float32"), using_tier(tier):
        block = tiered.EncoderBlock(16, 2, 32, dropout=0.0, norm_first=False)
        block(_random((2, 5, 16), 0))
        assert block.self_attn.q_proj._saved.values[0] is not None
        assert block.ffn.linear1._saved.values[0] is not None
        assert block.ffn.linear2._saved.values[0] is None


@pytest.mark.parametrize("tier", TIERS)
def test_keep_input_other_than_true_or_false_is_refused_naming_it(tier):
    """Every layer that takes keep_input refuses anything but a bool at the door (a
    truthy string would otherwise keep the input silently)."""

    with using_backend("numpy", "float64"), using_tier(tier):
        x = _random((2, 3, 4), 0)
        calls = [lambda k: tiered.Linear(4, 5)(x, k), lambda k: tiered.FeedForward(4, 8)(x, k),
                 lambda k: tiered.MultiHeadAttention(4, 2)(x, keep_input=k),
                 lambda k: tiered.Embedding(7, 4).project(x, k),
                 lambda k: tiered.ops.linear_forward(x, _random((4, 5), 1), None, k)]
        for call in calls:
            for bad in ("no", 0, None):
                with raises_naming(TypeError, "keep_input", repr(bad)):
                    call(bad)
            call(False)  # a bool is taken


@pytest.mark.parametrize("tier", TIERS)
def test_the_linear_backward_needs_the_input_exactly_once(tier):
    with using_backend("numpy", "float64"), using_tier(tier):
        tier_ops = tiered.ops
        x, w, dy = _random((3, 4), 0), _random((4, 2), 1), _random((3, 2), 2)
        _, not_kept = tier_ops.linear_forward(x, w, None, False)
        with raises_naming(RuntimeError, "keep_input=False", "x"):
            tier_ops.linear_backward(dy, not_kept)
        _, kept = tier_ops.linear_forward(x, w)
        with raises_naming(RuntimeError, "kept its input"):
            tier_ops.linear_backward(dy, kept, x)
        expected = ops.linear_backward(dy, ops.linear_forward(x, w)[1])
        got = tier_ops.linear_backward(dy, not_kept, x)
        for a, b in zip(got[:2], expected[:2]):
            np.testing.assert_allclose(backend.to_numpy(a), backend.to_numpy(b), rtol=1e-12)
