"""Wrong inputs to the ops raise clear errors that name the problem (on both backends).

Each case checks the exception type and that the message names what is wrong
(:func:`tests.helpers.raises_naming`: substrings, not whole sentences): the argument,
the offending shape, width, dtype, id or value, and what was expected.
"""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend, ops

from .helpers import raises_naming


def arr(shape, dtype="float64"):
    return backend.asarray(np.random.default_rng(0).standard_normal(shape), dtype)


def ids(values):
    return backend.asarray(np.asarray(values, dtype=np.int64))


# =========================================================================== linear / layer norm
def test_linear_input_width_mismatch(xb):
    with raises_naming(ValueError, "linear input", "last dimension 4", "(2, 3, 5)"):
        ops.linear_forward(arr((2, 3, 5)), arr((4, 6)), arr((6,)))


def test_linear_integer_input(xb):
    with raises_naming(TypeError, "linear input", "floating-point", "int64"):
        ops.linear_forward(ids([[1, 2, 3, 4]]), arr((4, 6)))


def test_layernorm_width_mismatch(xb):
    with raises_naming(ValueError, "layer norm input", "last dimension 8", "(2, 3, 6)"):
        ops.layernorm_forward(arr((2, 3, 6)), arr((8,)), arr((8,)))


# =========================================================================== attention masks
@pytest.mark.parametrize("mask_shape", [(3, 1, 1, 5), (2, 1, 1, 4), (2, 3, 3, 5), (4, 5),
                                        (2, 1, 3, 5, 1)])
def test_attention_mask_does_not_broadcast(xb, mask_shape):
    q, k, v = arr((2, 2, 3, 4)), arr((2, 2, 5, 4)), arr((2, 2, 5, 6))
    mask = backend.asarray(np.ones(mask_shape, dtype=bool))
    with raises_naming(ValueError, "attention mask", str(mask_shape), "attention scores",
                       "(2, 2, 3, 5)", "(batch, heads, queries, keys)"):
        ops.attention_forward(q, k, v, mask)


def test_padding_mask_for_the_wrong_number_of_keys(xb):
    q, k, v = arr((2, 1, 3, 4)), arr((2, 1, 5, 4)), arr((2, 1, 5, 4))
    mask = ops.padding_mask(ids([2, 3]), 4)
    with raises_naming(ValueError, "attention mask", "(2, 1, 1, 4)", "(2, 1, 3, 5)"):
        ops.attention_forward(q, k, v, mask)


@pytest.mark.parametrize("dtype", ["float64", "int64"])
def test_attention_mask_must_be_boolean(xb, dtype):
    q = arr((1, 2, 3, 4))
    mask = backend.asarray(np.ones((3, 3)), dtype=dtype)
    with raises_naming(TypeError, "attention mask", "boolean", dtype):
        ops.attention_forward(q, q, q, mask)


def test_softmax_mask_errors(xb):
    with raises_naming(ValueError, "softmax mask", "(4,)", "softmax input", "(2, 3)"):
        ops.softmax_forward(arr((2, 3)), mask=backend.asarray(np.ones(4, bool)))
    with raises_naming(TypeError, "softmax mask", "boolean", "float64"):
        ops.softmax_forward(arr((2, 3)), mask=arr((2, 3)))


def test_attention_shapes_must_agree(xb):
    with raises_naming(ValueError, "queries (1, 2, 3, 4)", "keys (1, 2, 5, 3)", "width"):
        ops.attention_forward(arr((1, 2, 3, 4)), arr((1, 2, 5, 3)), arr((1, 2, 5, 3)))
    with raises_naming(ValueError, "keys (1, 2, 5, 4)", "values (1, 2, 6, 4)"):
        ops.attention_forward(arr((1, 2, 3, 4)), arr((1, 2, 5, 4)), arr((1, 2, 6, 4)))


def test_causal_mask_with_fewer_keys_than_queries(xb):
    with raises_naming(ValueError, "causal mask", "keys (3)", "queries (5)"):
        ops.causal_mask(5, 3)


def test_padding_mask_needs_integer_lengths(xb):
    with raises_naming(TypeError, "valid lengths", "integers", "float64"):
        ops.padding_mask(arr((2,)), 4)


# =========================================================================== embedding
@pytest.mark.parametrize("bad", [7, 10, -1])
def test_embedding_id_out_of_range(xb, bad):
    table = arr((7, 4))
    with raises_naming(IndexError, "token ids", f"id {bad}", "7 entries", "0..6"):
        ops.embedding_forward(ids([[0, 3, bad], [6, 6, 1]]), table)


def test_embedding_ids_must_be_integers(xb):
    with raises_naming(TypeError, "token ids", "integer", "float64"):
        ops.embedding_forward(backend.asarray(np.array([[0.0, 1.0]])), arr((7, 4)))


# =========================================================================== cross-entropy
def test_cross_entropy_targets_shape_mismatch(xb):
    with raises_naming(ValueError, "targets", "(2, 4)", "logits", "(2, 3, 5)", "(2, 3)"):
        ops.cross_entropy_forward(arr((2, 3, 5)), ids(np.zeros((2, 4))))


@pytest.mark.parametrize("bad", [5, 9, -1, -7])
def test_cross_entropy_target_out_of_range(xb, bad):
    with raises_naming(IndexError, "cross-entropy targets", f"id {bad}", "5 entries"):
        ops.cross_entropy_forward(arr((2, 3, 5)), ids([[0, 4, -100], [bad, 1, 2]]))


def test_cross_entropy_ignore_index_is_not_out_of_range(xb):
    loss, _ = ops.cross_entropy_forward(arr((2, 5)), ids([-100, 3]))  # accepted
    # ...unless another index is the ignored one
    with raises_naming(IndexError, "cross-entropy targets", "id -100"):
        ops.cross_entropy_forward(arr((2, 5)), ids([-100, 3]), ignore_index=-1)


def test_cross_entropy_targets_must_be_integers(xb):
    with raises_naming(TypeError, "cross-entropy targets", "integer", "float64"):
        ops.cross_entropy_forward(arr((2, 5)), backend.asarray(np.array([1.0, 2.0])))


@pytest.mark.parametrize("smoothing", [-0.1, 1.5])
def test_cross_entropy_label_smoothing_range(xb, smoothing):
    with raises_naming(ValueError, "label_smoothing", "[0, 1]", str(smoothing)):
        ops.cross_entropy_forward(arr((2, 5)), ids([1, 3]), label_smoothing=smoothing)


# =========================================================================== dropout
@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
@pytest.mark.parametrize("training", [True, False])
def test_dropout_probability_out_of_range(xb, p, training):
    with raises_naming(ValueError, "dropout probability", "[0, 1)", str(p)):
        ops.dropout_forward(arr((2, 3)), p, training=training)


# =========================================================================== positions
def test_sequence_longer_than_the_positional_table(xb):
    with raises_naming(ValueError, "length 9", "positional table", "8 positions"):
        ops.add_positions_forward(arr((2, 9, 4)), ops.sinusoidal_table(8, 4))


def test_positional_width_mismatch(xb):
    with raises_naming(ValueError, "input width 6", "positional table", "width 4"):
        ops.add_positions_forward(arr((2, 3, 6)), arr((8, 4)))


def test_positional_input_must_be_3d(xb):
    with raises_naming(ValueError, "positional encoding", "3 dimensions", "(3, 4)"):
        ops.add_positions_forward(arr((3, 4)), arr((8, 4)))


# =========================================================================== pooling
def test_unknown_pooling(xb):
    with raises_naming(ValueError, "pooling 'sum'", "'mean'", "'max'", "'first'"):
        ops.pool_forward(arr((2, 3, 4)), ids([3, 1]), "sum")


@pytest.mark.parametrize("valid", [[0, 2], [3, 4], [-1, 1]])
def test_pooling_valid_lengths_out_of_range(xb, valid):
    low, high = min(valid), max(valid)
    with raises_naming(ValueError, "valid lengths", "[1, 3]", f"[{low}, {high}]"):
        ops.pool_forward(arr((2, 3, 4)), ids(valid), "mean")


def test_pooling_valid_lengths_shape(xb):
    with raises_naming(ValueError, "valid lengths", "(3,)", "batch of 2"):
        ops.pool_forward(arr((2, 3, 4)), ids([1, 2, 3]), "max")


def test_pooling_input_rank(xb):
    with raises_naming(ValueError, "pooling input", "3 dimensions", "(3, 4)"):
        ops.pool_forward(arr((3, 4)), ids([1, 2, 3]), "mean")


# =========================================================================== activations
@pytest.mark.parametrize("name", ["swish", "ReLU", ""])
def test_unknown_activation(name):
    with raises_naming(ValueError, f"activation {name!r}", "'gelu'", "'gelu_tanh'", "'relu'"):
        ops.activation(name)


# =========================================================================== issue 10: sizes, kinds
@pytest.mark.parametrize("call,message", [
    (lambda: ops.causal_mask(-2), "num_queries must be at least 0, got -2"),
    (lambda: ops.causal_mask(2, -1), "num_keys must be at least 0, got -1"),
    (lambda: ops.padding_mask(ids([1, 2]), -3), "num_keys must be at least 0, got -3"),
    (lambda: ops.sinusoidal_table(-1, 4), "block_size must be at least 0, got -1"),
    (lambda: ops.sinusoidal_table(4, 0), "d_model must be at least 1, got 0"),
])
def test_negative_sizes_are_refused(xb, call, message):
    """causal_mask(-2) returned an empty (0, 0) mask (issue 10, item 2)."""
    with raises_naming(ValueError, *message.split(" must be ")):
        call()


@pytest.mark.parametrize("call,message", [
    (lambda: ops.causal_mask(2.5), "num_queries must be an integer, got 2.5"),
    (lambda: ops.causal_mask(True), "num_queries must be an integer, got True"),
    (lambda: ops.padding_mask(ids([1]), "3"), "num_keys must be an integer, got '3'"),
])
def test_sizes_must_be_integers(xb, call, message):
    with raises_naming(TypeError, *message.split(" must be ")):
        call()


@pytest.mark.parametrize("call,what", [
    (lambda: ops.linear_forward([[1.0, 2.0]], arr((2, 3))), "linear input"),
    (lambda: ops.layernorm_forward([[1.0, 2.0]], arr((2,)), arr((2,))), "layer norm input"),
    (lambda: ops.attention_forward([[1.0]], arr((1, 1)), arr((1, 1))), "attention queries"),
    (lambda: ops.softmax_forward([1.0, 2.0]), "softmax input"),
    (lambda: ops.log_softmax_forward([1.0, 2.0]), "log-softmax input"),
    (lambda: ops.cross_entropy_forward(arr((2, 3)), [0, 1]), "cross-entropy targets"),
    (lambda: ops.embedding_forward([[0, 1]], arr((3, 2))), "token ids"),
    (lambda: ops.pool_forward(arr((1, 2, 3)), [2], "mean"), "valid lengths"),
    (lambda: ops.padding_mask([2, 1], 3), "valid lengths"),
    (lambda: ops.dropout_forward([1.0], 0.5), "dropout input"),
    (lambda: ops.relu_forward([1.0]), "relu input"),
    (lambda: ops.attention_forward(arr((1, 2, 2)), arr((1, 2, 2)), arr((1, 2, 2)),
                                   [[True, True]]), "attention mask"),
])
def test_lists_are_refused_naming_the_argument(xb, call, what):
    """Python lists where the ops take arrays: named, never "'list' has no attribute"."""
    with raises_naming(TypeError, what, "array", "list", "npformer.backend.asarray"):
        call()


@pytest.mark.parametrize("op", ["linear", "layernorm", "softmax", "attention", "gelu", "relu"])
def test_float16_and_object_arrays_are_refused(op):
    """Only float32 and float64 are computed in (float16 overflowed to NaN in GELU)."""
    call = {"linear": lambda x: ops.linear_forward(x, np.ones((4, 3))),
            "layernorm": lambda x: ops.layernorm_forward(x, np.ones(4), np.ones(4)),
            "softmax": lambda x: ops.softmax_forward(x),
            "attention": lambda x: ops.attention_forward(x, x, x),
            "gelu": lambda x: ops.gelu_forward(x),
            "relu": lambda x: ops.relu_forward(x)}[op]
    for x in (np.ones((2, 4), np.float16), np.ones((2, 4), object)):
        with raises_naming(TypeError, "floating-point", "float32", "float64", str(x.dtype)):
            call(x)


def test_softmax_axis_out_of_range(xb):
    with raises_naming(ValueError, "softmax input", "axis 2", "(2, 3)"):
        ops.softmax_forward(arr((2, 3)), axis=2)
    with raises_naming(TypeError, "log-softmax input", "axis", "integer", "1.0"):
        ops.log_softmax_forward(arr((2, 3)), axis=1.0)


@pytest.mark.parametrize("w_shape", [(0, 3), (4, 0)])
def test_linear_weight_without_features(xb, w_shape):
    with raises_naming(ValueError, "linear weight", "one input and one output", str(w_shape)):
        ops.linear_forward(arr((2, w_shape[0])), arr(w_shape))


def test_linear_bias_shape(xb):
    with raises_naming(ValueError, "linear bias", "(3,)", "(4,)"):
        ops.linear_forward(arr((2, 4)), arr((4, 3)), arr((4,)))


def test_attention_needs_a_width_and_two_axes(xb):
    with raises_naming(ValueError, "queries and keys", "width (last axis)", "at least 1",
                       "(1, 2, 0)"):
        ops.attention_forward(arr((1, 2, 0)), arr((1, 2, 0)), arr((1, 2, 3)))
    with raises_naming(ValueError, "attention queries", "2 dimensions", "(positions, width)",
                       "(4,)"):
        ops.attention_forward(arr((4,)), arr((4,)), arr((4,)))


def test_pooling_valid_lengths_must_be_integers(xb):
    with raises_naming(TypeError, "valid lengths", "integers", "float64"):
        ops.pool_forward(arr((2, 3, 4)), arr((2,)), "mean")


def test_token_id_errors_are_value_errors_too(xb):
    """Out-of-vocabulary ids: IndexError (as PyTorch's embedding) and ValueError (as decoding)."""
    with raises_naming(ValueError, "token ids", "id 9", "3 entries"):
        ops.embedding_forward(ids([[9]]), arr((3, 2)))


@pytest.mark.parametrize("bad,error", [("0.1", TypeError), (True, TypeError)])
def test_dropout_and_smoothing_must_be_numbers(xb, bad, error):
    with raises_naming(error, "dropout probability", "number", repr(bad)):
        ops.dropout_forward(arr((2,)), bad)
    with raises_naming(error, "label_smoothing", "number", repr(bad)):
        ops.cross_entropy_forward(arr((2, 3)), ids([0, 1]), label_smoothing=bad)


# =========================================================================== Llama's ops
def test_rmsnorm_errors(xb):
    with raises_naming(ValueError, "RMS norm input", "last dimension 8", "(2, 3, 6)"):
        ops.rmsnorm_forward(arr((2, 3, 6)), arr((8,)))
    with raises_naming(ValueError, "RMS norm weight", "1 dimensions", "(4, 4)"):
        ops.rmsnorm_forward(arr((2, 4)), arr((4, 4)))
    with raises_naming(TypeError, "RMS norm input", "floating-point", "int64"):
        ops.rmsnorm_forward(ids([[1, 2, 3, 4]]), arr((4,)))
    with raises_naming(TypeError, "RMS norm", "one dtype", "input", "weight", "float32"):
        ops.rmsnorm_forward(arr((2, 4)), arr((4,), "float32"))


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan"), float("inf")])
def test_rmsnorm_eps_must_be_positive(xb, eps):
    with raises_naming(ValueError, "RMS norm eps", "> 0", str(eps)):
        ops.rmsnorm_forward(arr((2, 4)), arr((4,)), eps)


def test_rotary_table_errors(xb):
    with raises_naming(TypeError, "rotary positions", "integers", "float64"):
        ops.rotary_table(arr((2, 3)), 4)
    with raises_naming(ValueError, "rotary positions", "at least 1 dimensions", "()"):
        ops.rotary_table(ids(3), 4)
    with raises_naming(ValueError, "head_dim", "even", "5"):
        ops.rotary_table(ids([0, 1]), 5)
    with raises_naming(ValueError, "head_dim", "at least 2", "0"):
        ops.rotary_table(ids([0, 1]), 0)
    with raises_naming(ValueError, "rope_theta", "> 0", "-1"):
        ops.rotary_table(ids([0, 1]), 4, -1.0)
    with raises_naming(TypeError, "rotary table dtype", "float32 or float64"):
        ops.rotary_table(ids([0, 1]), 4, dtype=backend.xp().int64)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("change,error,named", [
    ({"rope_type": "yarn"}, ValueError, ["rope_scaling rope_type 'yarn'", "'llama3'"]),
    ({"factor": None}, TypeError, ["rope_scaling factor", "real number", "None"]),
    ({"factor": 0.0}, ValueError, ["rope_scaling factor", "> 0", "0.0"]),
    ({"high_freq_factor": 0.5}, ValueError, ["high_freq_factor", "above low_freq_factor 1",
                                             "0.5"]),
    ({"original_max_position_embeddings": 8.5}, TypeError,
     ["original_max_position_embeddings", "integer", "8.5"]),
])
def test_rope_scaling_errors(xb, change, error, named):
    with raises_naming(error, *named):
        ops.rotary_table(ids([0, 1]), 4, 10000.0, {**LLAMA3, **change})


def test_rope_scaling_missing_keys_and_kind(xb):
    partial = {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}
    with raises_naming(ValueError, "rope_scaling", "llama3", "low_freq_factor"):
        ops.rotary_table(ids([0, 1]), 4, 10000.0, partial)
    with raises_naming(TypeError, "rope_scaling", "None or a dict", "'llama3'"):
        ops.rotary_table(ids([0, 1]), 4, 10000.0, "llama3")


def test_rotary_errors(xb):
    cos, sin = ops.rotary_table(ids([0, 1, 2]), 4, dtype=backend.float_dtype("float64"))
    with raises_naming(ValueError, "rotary input", "4 dimensions", "(2, 3, 4)"):
        ops.rotary_forward(arr((2, 3, 4)), cos, sin)
    with raises_naming(ValueError, "rotary input", "even head_dim", "(1, 2, 3, 5)"):
        ops.rotary_forward(arr((1, 2, 3, 5)), arr((3, 5)), arr((3, 5)))
    with raises_naming(ValueError, "rotary cos", "(3, 4)", "(1, 2, 5, 4)", "(5, 4)"):
        ops.rotary_forward(arr((1, 2, 5, 4)), cos, sin)
    with raises_naming(ValueError, "rotary cos", "(3, 3, 4)", "(2 or 1, 3, 4)"):
        ops.rotary_forward(arr((2, 2, 3, 4)), arr((3, 3, 4)), arr((3, 3, 4)))
    with raises_naming(ValueError, "rotary cos (3, 4)", "sin (1, 3, 4)", "one shape"):
        ops.rotary_forward(arr((1, 2, 3, 4)), cos, arr((1, 3, 4)))
    with raises_naming(TypeError, "rotary", "one dtype", "cos", "float32"):
        ops.rotary_forward(arr((1, 2, 3, 4)), arr((3, 4), "float32"), arr((3, 4), "float32"))


def test_swiglu_errors(xb):
    with raises_naming(ValueError, "SwiGLU gate (2, 3)", "up projection (2, 4)", "one shape"):
        ops.swiglu_forward(arr((2, 3)), arr((2, 4)))
    with raises_naming(TypeError, "SwiGLU up projection", "floating-point", "int64"):
        ops.swiglu_forward(arr((1, 2)), ids([[1, 2]]))
    with raises_naming(TypeError, "SwiGLU", "one dtype", "gate", "up", "float32"):
        ops.swiglu_forward(arr((2,)), arr((2,), "float32"))
