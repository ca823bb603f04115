"""Backward misuse is named (issue 10, item 4), on NumPy and strict, in both tiers.

* an op's backward before its forward (no saved values: None) is a RuntimeError saying which
  forward to run first (was ``cannot unpack non-iterable NoneType object``); a cache
  that is not the forward's (another op's, the other tier's) is a TypeError;
* an upstream gradient whose shape is not the forward's output's is a ValueError naming
  both shapes, at the op (was a NumPy broadcast, reshape or matmul error), at the layer
  and at the model (naming the module); a list or an integer array is a TypeError;
* a model's backward without a forward, or twice after one, names the model.
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

from .helpers import raises_naming, tiered

# A behaviour test: it runs in both tiers (tests.helpers.tiered), which must behave the same.
pytestmark = pytest.mark.usefixtures("tier")

TIERS = {"textbook": ops, "fast": fast}


def arr(shape, seed=0):
    return backend.asarray(np.random.default_rng(seed).standard_normal(shape), dtype="float64")


def ids(values):
    return backend.asarray(np.asarray(values), dtype="int64")


def op_cases(tier):
    """(op name, forward() -> (out, cache), backward(dy, cache)) of every op with a backward."""
    t = TIERS[tier]
    relu, gelu, gelu_tanh = (t.activation(n) for n in ("relu", "gelu", "gelu_tanh"))
    return {
        "linear": (lambda: t.linear_forward(arr((2, 3, 4)), arr((4, 5)), arr((5,))),
                   t.linear_backward),
        "layernorm": (lambda: t.layernorm_forward(arr((2, 3, 4)), arr((4,)), arr((4,))),
                      t.layernorm_backward),
        "attention": (lambda: t.attention_forward(arr((2, 2, 3, 4)), arr((2, 2, 5, 4)),
                                                  arr((2, 2, 5, 6))), t.attention_backward),
        "softmax": (lambda: t.softmax_forward(arr((2, 3))), t.softmax_backward),
        "log_softmax": (lambda: t.log_softmax_forward(arr((2, 3))), t.log_softmax_backward),
        "embedding": (lambda: t.embedding_forward(ids([[1, 2, 3]]), arr((5, 4))),
                      t.embedding_backward),
        "add_positions": (lambda: t.add_positions_forward(arr((2, 3, 4)),
                                                          t.sinusoidal_table(5, 4)),
                          t.add_positions_backward),
        "pool": (lambda: t.pool_forward(arr((2, 3, 4)), ids([1, 3]), "max"), t.pool_backward),
        "dropout": (lambda: t.dropout_forward(arr((2, 3)), 0.5), t.dropout_backward),
        "relu": (lambda: relu[0](arr((2, 3))), relu[1]),
        "gelu": (lambda: gelu[0](arr((2, 3))), gelu[1]),
        "gelu_tanh": (lambda: gelu_tanh[0](arr((2, 3))), gelu_tanh[1]),
        "cross_entropy": (lambda: t.cross_entropy_forward(arr((2, 5)), ids([1, 4])),
                          t.cross_entropy_backward),
        "rmsnorm": (lambda: t.rmsnorm_forward(arr((2, 3, 4)), arr((4,))), t.rmsnorm_backward),
        "rotary": (lambda: t.rotary_forward(arr((2, 2, 3, 4)), *t.rotary_table(
            ids([0, 1, 2]), 4, dtype=backend.float_dtype("float64"))), t.rotary_backward),
        "swiglu": (lambda: t.swiglu_forward(arr((2, 3)), arr((2, 3), seed=1)),
                   t.swiglu_backward),
    }


OPS = list(op_cases("textbook"))
NEEDS_A_CACHE = [n for n in OPS if n != "dropout"]  # dropout's None cache: the identity


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("name", NEEDS_A_CACHE)
def test_op_backward_before_forward(xb, tier, name):
    forward, backward = op_cases(tier)[name]
    out, _ = forward()
    dy = 1.0 if name == "cross_entropy" else backend.asarray(np.ones(tuple(out.shape)))
    with raises_naming(RuntimeError, f"{name}_backward", "no saved values (None)",
                       f"{name}_forward first"):
        backward(dy, None)


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("name", [n for n in NEEDS_A_CACHE if n not in ("relu",)])
def test_op_backward_with_a_foreign_cache(xb, tier, name):
    forward, backward = op_cases(tier)[name]
    out, _ = forward()
    dy = 1.0 if name == "cross_entropy" else backend.asarray(np.ones(tuple(out.shape)))
    with raises_naming(TypeError, f"{name}_backward", "invalid saved values (tuple)",
                       f"{name}_forward of the same tier"):
        backward(dy, (1, 2, 3, 4, 5, 6, 7, 8, 9))


def test_a_cache_of_the_other_tier_is_refused(xb):
    _, cache = ops.attention_forward(arr((1, 1, 2, 4)), arr((1, 1, 2, 4)), arr((1, 1, 2, 4)))
    with raises_naming(TypeError, "attention_backward", "another tier",
                       "attention_forward of the textbook tier", "of the fast tier"):
        fast.attention_backward(arr((1, 1, 2, 4)), cache)


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("name", [n for n in OPS if n != "cross_entropy"])
def test_op_backward_with_a_gradient_of_the_wrong_shape(xb, tier, name):
    forward, backward = op_cases(tier)[name]
    out, cache = forward()
    shape = tuple(out.shape)
    wrong = shape[:-1] + (shape[-1] + 1,)
    if name in ("embedding", "add_positions"):  # their caches hold the positions, not D
        wrong = shape[:-2] + (shape[-2] + 1, shape[-1])
    with raises_naming(ValueError, f"upstream gradient of {name}_backward", str(wrong),
                       f"forward's output had shape {shape}"):
        backward(arr(wrong), cache)


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("name", ["linear", "attention", "softmax", "relu", "layernorm"])
def test_op_backward_names_the_expected_shape(xb, tier, name):
    forward, backward = op_cases(tier)[name]
    out, cache = forward()
    shape = tuple(out.shape)
    with raises_naming(ValueError, f"upstream gradient of {name}_backward",
                       str(shape + (1,)), f"output had shape {shape}"):
        backward(arr(shape + (1,)), cache)


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("name", ["linear", "attention", "gelu", "pool"])
@pytest.mark.parametrize("bad", ["list", "int"])
def test_op_backward_with_a_list_or_integers(xb, tier, name, bad):
    forward, backward = op_cases(tier)[name]
    out, cache = forward()
    dy = np.ones(tuple(out.shape), np.int64)
    dy = dy.tolist() if bad == "list" else backend.asarray(dy)
    with pytest.raises(TypeError, match=rf"the upstream gradient of {name}_backward must be "
                                        r"(an array, got list|a floating-point array)"):
        backward(dy, cache)


@pytest.mark.parametrize("tier", list(TIERS))
def test_cross_entropy_gradient_must_be_a_scalar(xb, tier):
    _, backward = op_cases(tier)["cross_entropy"]
    _, cache = op_cases(tier)["cross_entropy"][0]()
    with raises_naming(ValueError, "upstream gradient of cross_entropy_backward", "scalar",
                       "(2,)"):
        backward(arr((2,)), cache)
    assert backward(backend.asarray(np.float64(0.5)), cache).shape == (2, 5)  # 0-d: fine


# =========================================================================== layers, models
def layer_cases():
    x = lambda: arr((2, 3, 4))  # noqa: E731
    return {
        "Linear": (lambda: tiered.Linear(4, 3), lambda m: m(x())),
        "LayerNorm": (lambda: tiered.LayerNorm(4), lambda m: m(x())),
        "Embedding": (lambda: tiered.Embedding(5, 4), lambda m: m(ids([[1, 2]]))),
        "Dropout": (lambda: tiered.Dropout(0.5), lambda m: m(x())),
        "Activation": (lambda: tiered.Activation("relu"), lambda m: m(x())),
        "MultiHeadAttention": (lambda: tiered.MultiHeadAttention(4, 2), lambda m: m(x())),
        "FeedForward": (lambda: tiered.FeedForward(4, 6), lambda m: m(x())),
        "EncoderBlock": (lambda: tiered.EncoderBlock(4, 2, 6), lambda m: m(x())),
        "DecoderBlock": (lambda: tiered.DecoderBlock(4, 2, 6), lambda m: m(x(), arr((2, 5, 4)))),
        "TransformerClassifier": (lambda: tiered.TransformerClassifier(ClassifierConfig(
            vocab_size=6, d_model=4, num_heads=2, num_layers=1, d_ff=6, block_size=4)),
            lambda m: m(ids([[1, 2, 3], [4, 5, 0]]))),
        "CausalLM": (lambda: tiered.CausalLM(CausalLMConfig(vocab_size=6, block_size=4, d_model=4,
                                                     num_heads=2, num_layers=1, d_ff=6)),
                     lambda m: m(ids([[1, 2, 3]]))),
        "Seq2SeqTransformer": (lambda: tiered.Seq2SeqTransformer(Seq2SeqConfig(
            src_vocab_size=6, tgt_vocab_size=7, d_model=4, num_heads=2, num_encoder_layers=1,
            num_decoder_layers=1, d_ff=6, block_size=4)),
            lambda m: m(ids([[1, 2, 3]]), ids([[2, 4]]))),
    }


LAYERS = list(layer_cases())


@pytest.mark.parametrize("name", LAYERS)
def test_module_backward_with_a_gradient_of_the_wrong_shape(xb, tier, name):
    make, forward = layer_cases()[name]
    module = make()
    shape = tuple(forward(module).shape)
    wrong = shape[:-1] + (shape[-1] + 2,)
    with raises_naming(ValueError, f"upstream gradient of {name}.backward", str(wrong),
                       f"output had shape {shape}"):
        module.backward(arr(wrong))
    module.backward(arr(shape))  # the refused gradient consumed nothing


@pytest.mark.parametrize("name", LAYERS)
def test_module_backward_with_a_list(xb, tier, name):
    make, forward = layer_cases()[name]
    module = make()
    shape = tuple(forward(module).shape)
    with raises_naming(TypeError, f"upstream gradient of {name}.backward", "array", "list"):
        module.backward(np.zeros(shape).tolist())


@pytest.mark.parametrize("name", LAYERS)
def test_module_backward_without_forward_or_twice_names_the_module(xb, tier, name):
    make, forward = layer_cases()[name]
    module = make()
    with pytest.raises(RuntimeError, match=rf"^{name}\.backward called without a forward pass"):
        module.backward(arr((2, 3, 4)))
    dy = arr(tuple(forward(module).shape))
    module.backward(dy)
    with pytest.raises(RuntimeError, match=rf"^{name}\.backward called without a forward pass"
                                           r".*already consumed it"):
        module.backward(dy)


def test_a_forward_under_no_grad_leaves_nothing_to_differentiate(xb):
    layer = tiered.Linear(4, 3)
    with nn.no_grad():
        y = layer(arr((2, 4)))
    with pytest.raises(RuntimeError, match=r"Linear\.backward called without a forward pass "
                                           r".*no_grad"):
        layer.backward(backend.asarray(np.ones(tuple(y.shape))))


@pytest.mark.parametrize("name", ["Linear", "LayerNorm", "EncoderBlock"])
def test_module_backward_with_a_gradient_of_another_dtype(xb, tier, name):
    make, forward = layer_cases()[name]
    module = make()
    out = forward(module)
    other = "float32" if str(out.dtype).endswith("float64") else "float64"
    dy = backend.asarray(np.ones(tuple(out.shape)), dtype=other)
    with raises_naming(TypeError, f"upstream gradient of {name}.backward", other,
                       "forward's output"):
        module.backward(dy)
