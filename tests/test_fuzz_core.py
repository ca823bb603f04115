"""Fuzzing the core as a test (issue 10, item 8): ops (both tiers), layers, the three models
(forward, backward, predict), masks, and gradcheck's check_op/check_module, on NumPy and
strict, with random shapes (0 and 1 included), dtypes (int, bool, float16/32/64, object),
NaN/inf values, wrong ranks, masks of wrong shapes and Python lists.

The contract: every call either returns results of the documented shape (finite, for
finite floating inputs), or raises one of the library's documented exceptions (ValueError,
TypeError, RuntimeError for backward without forward; a token id outside the vocabulary is
:class:`npformer.ops.contracts.TokenIdError`, an IndexError and a ValueError) raised by
npformer's own code (the innermost frame is in the package, not in NumPy or the array
library) with a message naming an npformer argument.  Never ZeroDivisionError,
IndexError, AttributeError, KeyError or an error from inside the array library.
"""
from __future__ import annotations

import math
import re
import traceback
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npformer
from npformer import backend, fast, gradcheck, nn, ops
from npformer.models import (
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
)
from npformer.ops.contracts import TokenIdError
from tests.helpers import tiered

# A behaviour test: it runs in both tiers (tests.helpers.tiered), which must behave the same.
pytestmark = pytest.mark.usefixtures("tier")

PACKAGE = str(Path(npformer.__file__).resolve().parent)
DOCUMENTED = (ValueError, TypeError, RuntimeError)
NEVER = (ZeroDivisionError, IndexError, AttributeError, KeyError)
# Words an npformer message uses for the argument it refuses.
ARGUMENT = re.compile(
    r"input|weight|bias|queries|keys|values|mask|logits|targets|token ids|ids|valid lengths|"
    r"gradient|cache|axis|num_queries|num_keys|width|max_len|block_size|length|dropout|label_smoothing|"
    r"probability|block_scores|features|d_model|d_ff|num_heads|head_dim|num_embeddings|"
    r"positions|sequence|argument|input \d|pooling|table|context|batch|float64|backward",
    re.IGNORECASE)

TIERS = {"textbook": ops, "fast": fast}
SIZES = st.integers(0, 3)


def assert_documented(exc: BaseException) -> None:
    """exc is one of npformer's documented errors, raised by npformer, naming an argument."""
    if isinstance(exc, TokenIdError):
        assert "out of range" in str(exc)
    else:
        assert not isinstance(exc, NEVER), f"{type(exc).__name__}: {exc}"
    assert isinstance(exc, DOCUMENTED), f"undocumented {type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    innermost = str(Path(frames[-1].filename).resolve())
    assert innermost.startswith(PACKAGE), (
        f"{type(exc).__name__} raised inside {frames[-1].filename}, not by npformer: {exc}")
    assert ARGUMENT.search(str(exc)), f"message names no argument: {exc}"


def attempt(fn):
    """fn() -> (result, None), or (None, exc) for a documented error (checked)."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - the point is to inspect every exception
        assert_documented(exc)
        return None, exc


def host(x):
    return np.asarray(backend.to_numpy(x))


def finite(x) -> bool:
    return bool(np.all(np.isfinite(host(x).astype(np.float64))))


# =========================================================================== input strategies
@st.composite
def arrays(draw, shape=None, kinds=("float64", "float32", "float16", "int64", "bool",
                                    "object", "list"), special=True, rank=(0, 4)):
    """A random array on the current backend (or a list): dtype, shape and NaN/inf drawn."""
    shape = tuple(draw(st.lists(SIZES, min_size=rank[0], max_size=rank[1]))) \
        if shape is None else tuple(shape)
    kind = draw(st.sampled_from(kinds))
    if backend.backend_name() == "strict" and kind in ("float16", "object"):
        kind = "float64"  # the strict namespace has neither
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    values = rng.standard_normal(shape) * 2.0
    if special and draw(st.booleans()) and values.size:
        values.flat[draw(st.integers(0, values.size - 1))] = draw(
            st.sampled_from([np.nan, np.inf, -np.inf]))
    if kind == "list":
        return values.tolist()
    if kind == "object":
        return values.astype(object)
    if kind == "int64":
        return backend.asarray(np.nan_to_num(values).astype(np.int64))
    if kind == "bool":
        return backend.asarray(values > 0)
    if kind == "float16":
        return values.astype(np.float16)
    return backend.asarray(values, dtype=kind)


def floats_ok(*xs) -> bool:
    """Every x a float32/float64 backend array (the inputs the ops compute on)."""
    for x in xs:
        if not hasattr(x, "dtype") or isinstance(x, np.ndarray) and x.dtype.kind != "f":
            return False
        if str(x.dtype).rsplit(".", 1)[-1] not in ("float32", "float64"):
            return False
    return True


def id_array(draw, shape, vocab):
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    high = vocab + draw(st.sampled_from([0, 0, 0, 2]))  # sometimes outside the vocabulary
    values = rng.integers(-draw(st.sampled_from([0, 0, 0, 1])), max(high, 1), size=shape)
    kind = draw(st.sampled_from(["int64", "int64", "int64", "float64", "bool", "list"]))
    if kind == "list":
        return values.tolist()
    return backend.asarray(values.astype(kind))


# =========================================================================== ops
def op_call(name, t, draw):
    """(forward thunk, expected output shape or None, backward) for op ``name`` of tier t."""
    a = lambda **kw: draw(arrays(**kw))  # noqa: E731
    lead = tuple(draw(st.lists(SIZES, max_size=2)))
    d_in, d_out = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    if name == "linear":
        x, w = a(shape=lead + (d_in,)), a(shape=(d_in, d_out))
        b = draw(st.sampled_from([None, "ok", "wrong"]))
        b = None if b is None else a(shape=(d_out,) if b == "ok" else (d_out + 1,))
        return lambda: t.linear_forward(x, w, b), lead + (d_out,), t.linear_backward, (x, w, b)
    if name == "layernorm":
        x, g = a(shape=lead + (d_in,)), a(shape=(d_in,))
        return (lambda: t.layernorm_forward(x, g, g), lead + (d_in,), t.layernorm_backward,
                (x, g))
    if name in ("softmax", "log_softmax"):
        x = a()
        axis = draw(st.integers(-3, 2))
        mask = draw(st.sampled_from([None, "mask"])) if name == "softmax" else None
        mask = None if mask is None else a(kinds=("bool", "int64", "list"), special=False)
        forward = getattr(t, f"{name}_forward")
        call = (lambda: forward(x, axis=axis, mask=mask)) if name == "softmax" else \
            (lambda: forward(x, axis=axis))
        shape = tuple(np.shape(x)) if hasattr(x, "shape") else None
        return call, shape, getattr(t, f"{name}_backward"), (x,)
    if name == "attention":
        b, h, tq, s = (draw(SIZES) for _ in range(4))
        e, f = draw(st.integers(0, 3)), draw(st.integers(0, 3))
        q, k, v = a(shape=(b, h, tq, e)), a(shape=(b, h, s, e)), a(shape=(b, h, s, f))
        mask = None
        if draw(st.booleans()):
            mask = a(kinds=("bool", "bool", "int64", "list"), special=False, rank=(0, 5))
        kwargs = {"block_scores": draw(st.integers(1, 40))} if t is fast else {}
        return (lambda: t.attention_forward(q, k, v, mask, **kwargs), (b, h, tq, f),
                t.attention_backward, (q, k, v))
    if name == "cross_entropy":
        v = draw(st.integers(0, 4))
        logits, targets = a(shape=lead + (v,)), id_array(draw, lead, v)
        smoothing = draw(st.sampled_from([0.0, 0.1, 1.0, -0.5, float("nan")]))
        return (lambda: t.cross_entropy_forward(logits, targets, label_smoothing=smoothing),
                (), t.cross_entropy_backward, (logits,))
    if name == "embedding":
        table = a(shape=(draw(st.integers(1, 4)), d_in))
        token_ids = id_array(draw, lead, table.shape[0] if hasattr(table, "shape") else 1)
        return (lambda: t.embedding_forward(token_ids, table), lead + (d_in,),
                t.embedding_backward, (table,))
    if name == "pool":
        b, tq = draw(SIZES), draw(SIZES)
        h = a(shape=(b, tq, d_in))
        lens = id_array(draw, (draw(st.sampled_from([b, b, b + 1])),), tq + 1)
        how = draw(st.sampled_from(ops.POOLINGS + ("sum",)))
        return lambda: t.pool_forward(h, lens, how), (b, d_in), t.pool_backward, (h,)
    if name == "positions":
        x = a()
        table = t.sinusoidal_table(draw(st.integers(0, 4)), draw(st.integers(1, 3)))
        shape = tuple(x.shape) if hasattr(x, "shape") else None
        return (lambda: t.add_positions_forward(x, table), shape, t.add_positions_backward,
                (x,))
    if name == "dropout":
        x = a()
        p = draw(st.sampled_from([0.0, 0.5, 1.0, -0.1, float("nan")]))
        shape = tuple(x.shape) if hasattr(x, "shape") else None
        return lambda: t.dropout_forward(x, p), shape, t.dropout_backward, (x,)
    forward, backward = t.activation(name)
    x = a()
    return lambda: forward(x), (tuple(x.shape) if hasattr(x, "shape") else None), backward, (x,)


OP_NAMES = ["linear", "layernorm", "softmax", "log_softmax", "attention", "cross_entropy",
            "embedding", "pool", "positions", "dropout", "relu", "gelu", "gelu_tanh"]


@pytest.mark.parametrize("tier_name", list(TIERS))
@pytest.mark.parametrize("name", OP_NAMES)
@given(data=st.data())
def test_ops(xb, tier_name, name, data):
    t = TIERS[tier_name]
    forward, shape, backward, inputs = op_call(name, t, data.draw)
    result, exc = attempt(forward)
    if exc is not None:
        return
    out, cache = result
    assert tuple(out.shape) == shape
    clean = floats_ok(*[x for x in inputs if x is not None]) and all(
        finite(x) for x in inputs if x is not None)
    if clean:
        assert finite(out), f"{name}: non-finite output for finite inputs"
    dtype = str(out.dtype).rsplit(".", 1)[-1]  # the gradient has the output's dtype
    dy = 1.0 if name == "cross_entropy" else backend.asarray(
        np.random.default_rng(0).standard_normal(shape), dtype=dtype)
    grads, exc = attempt(lambda: backward(dy, cache))
    assert exc is None, f"{name}: backward refused a gradient of the output's shape: {exc}"
    if clean:
        for g in grads if isinstance(grads, tuple) else (grads,):
            assert g is None or finite(g)
    # a gradient of the wrong shape, a list, and no saved values: named errors
    if name != "cross_entropy" and not (name == "dropout" and cache is None):
        wrong_shape = shape + (1,)
        if name == "embedding":  # its cache holds the number of positions, not the width
            wrong_shape = (math.prod(shape[:-1]) + 1, shape[-1])
        if name == "positions":  # its cache holds the positions T of (B, T, D)
            wrong_shape = (shape[0], shape[1] + 1, shape[2])
        wrong = backend.asarray(np.zeros(wrong_shape), dtype="float64")
        _, exc = attempt(lambda: backward(wrong, cache))
        assert isinstance(exc, ValueError)
        _, exc = attempt(lambda: backward(np.zeros(shape).tolist(), cache))
        assert isinstance(exc, TypeError)
        if name != "dropout":  # dropout's None cache is the identity (eval, p = 0)
            _, exc = attempt(lambda: backward(dy, None))
            assert isinstance(exc, RuntimeError)


# =========================================================================== masks
@given(data=st.data())
def test_masks(xb, data):
    size = st.one_of(st.integers(-3, 4), st.sampled_from([2.5, True, "3", None]))
    num_queries, num_keys = data.draw(size), data.draw(size)
    mask, exc = attempt(lambda: ops.causal_mask(num_queries, num_keys))
    if exc is None:
        keys = num_queries if num_keys is None else num_keys
        assert tuple(mask.shape) == (num_queries, keys)
    lens = data.draw(arrays(kinds=("int64", "float64", "bool", "list"), special=False))
    mask, exc = attempt(lambda: ops.padding_mask(lens, num_keys))
    if exc is None:
        assert tuple(mask.shape) == (lens.shape[0], 1, 1, num_keys)


# =========================================================================== layers
LAYERS = {
    "Linear": lambda d, n: (tiered.Linear(d, n), 3),
    "LayerNorm": lambda d, n: (tiered.LayerNorm(d), 3),
    "Activation": lambda d, n: (tiered.Activation("relu"), 3),
    "Dropout": lambda d, n: (tiered.Dropout(0.5), 3),
    "LearnedPositionalEmbedding": lambda d, n: (tiered.LearnedPositionalEmbedding(n, d), 3),
    "SinusoidalPositionalEncoding": lambda d, n: (nn.SinusoidalPositionalEncoding(n, d), 3),
    "MultiHeadAttention": lambda d, n: (tiered.MultiHeadAttention(d, n), 3),
    "FeedForward": lambda d, n: (tiered.FeedForward(d, n), 3),
    "EncoderBlock": lambda d, n: (tiered.EncoderBlock(d, n, 4), 3),
    "DecoderBlock": lambda d, n: (tiered.DecoderBlock(d, n, 4), 3),
}


def out_shape(name, layer, x) -> tuple:
    """Every layer keeps its input's shape, but Linear, which maps the last axis."""
    return tuple(x.shape[:-1]) + (layer.out_features,) if name == "Linear" else tuple(x.shape)


@pytest.mark.parametrize("name", list(LAYERS))
@given(data=st.data())
def test_layers(xb, tier, name, data):
    d, n = data.draw(st.integers(-1, 4)), data.draw(st.integers(-1, 3))
    made, exc = attempt(lambda: LAYERS[name](d, n))
    if exc is not None:
        return
    layer, _ = made
    x = data.draw(arrays(kinds=("float64", "float64", "float32", "int64", "list")))
    args = [x]
    kwargs = {}
    if name == "DecoderBlock":
        args.append(data.draw(arrays(kinds=("float64",), special=False)))
    if name in ("MultiHeadAttention", "EncoderBlock") and data.draw(st.booleans()):
        kwargs["mask"] = data.draw(arrays(kinds=("bool", "int64"), special=False, rank=(0, 5)))
    y, exc = attempt(lambda: layer(*args, **kwargs))
    if exc is not None:
        return
    assert tuple(y.shape) == out_shape(name, layer, x)
    if floats_ok(*args) and all(finite(a) for a in args):
        assert finite(y)
    wrong = backend.asarray(np.zeros(tuple(y.shape) + (1,)))
    _, exc = attempt(lambda: layer.backward(wrong))
    assert isinstance(exc, ValueError)
    dtype = str(y.dtype).rsplit(".", 1)[-1]
    grads, exc = attempt(lambda: layer.backward(backend.asarray(np.ones(tuple(y.shape)),
                                                                dtype=dtype)))
    assert exc is None, exc
    for g, a in zip(grads if isinstance(grads, tuple) else (grads,), args):
        assert tuple(g.shape) == tuple(a.shape)


# =========================================================================== models
def make_model(kind, vocab):
    small = dict(d_model=4, num_heads=2, d_ff=6, dropout=0.0)
    if kind == "classifier":
        return tiered.TransformerClassifier(ClassifierConfig(vocab_size=vocab, num_layers=1,
                                                      block_size=4, **small))
    if kind == "lm":
        return tiered.CausalLM(CausalLMConfig(vocab_size=vocab, block_size=4, num_layers=1,
                                              **small))
    return tiered.Seq2SeqTransformer(Seq2SeqConfig(src_vocab_size=vocab, tgt_vocab_size=vocab + 1,
                                            num_encoder_layers=1, num_decoder_layers=1,
                                            block_size=4, **small))


def seen_shape(ids, drawn: tuple) -> tuple:
    """The shape a model sees: a list keeps only its non-empty nesting ([[]] is (1, 0)), and
    [] is a batch of no sequences, (0, 0)."""
    if not isinstance(ids, list):
        return drawn
    shape = np.asarray(ids).shape
    return (0, 0) if shape == (0,) else shape


@pytest.mark.parametrize("kind", ["classifier", "lm", "seq2seq"])
@given(data=st.data())
def test_models(xb, tier, kind, data):
    vocab = 5
    model = make_model(kind, vocab)
    shape = (data.draw(SIZES), data.draw(st.integers(0, 5)))
    if data.draw(st.booleans()):
        shape = tuple(data.draw(st.lists(SIZES, max_size=3)))  # any rank
    src = id_array(data.draw, shape, vocab)
    tgt_shape = (shape[0] if shape else 1, data.draw(st.integers(0, 5)))
    tgt = id_array(data.draw, tgt_shape, vocab)
    shape, tgt_shape = seen_shape(src, shape), seen_shape(tgt, tgt_shape)
    forward = (lambda: model(src, tgt)) if kind == "seq2seq" else (lambda: model(src))
    logits, exc = attempt(forward)
    if exc is None:
        expected = {"classifier": (shape[0], 2), "lm": shape + (vocab,),  # the drawn shapes
                    "seq2seq": tgt_shape + (vocab + 1,)}[kind]
        assert tuple(logits.shape) == expected
        assert finite(logits)
        _, exc = attempt(lambda: model.backward(backend.asarray(np.zeros(expected + (1,)))))
        assert isinstance(exc, ValueError)
        assert model.backward(backend.asarray(np.ones(expected))) is None
        for p in model.parameters():
            assert finite(p.grad)
        _, exc = attempt(lambda: model.backward(backend.asarray(np.ones(expected))))
        assert isinstance(exc, RuntimeError)
    if kind == "classifier":
        probs, exc = attempt(lambda: model.predict(src))
        if exc is None:
            assert finite(probs) and tuple(probs.shape) == (shape[0], 2)


# =========================================================================== gradcheck
@given(data=st.data())
def test_gradcheck_entry_points(xb, data):
    lead = tuple(data.draw(st.lists(st.integers(0, 2), max_size=2)))
    kinds = ("float64", "float64", "float32", "int64")
    x = data.draw(arrays(shape=lead + (2,), kinds=kinds, special=False))
    w = data.draw(arrays(shape=(2, 3), kinds=kinds, special=False))
    result, exc = attempt(lambda: gradcheck.check_op(ops.linear_forward, ops.linear_backward,
                                                     [x, w], wrt=[0, 1]))
    if exc is None:
        assert result.passed(), str(result)
    layer = tiered.Linear(2, 3)
    result, exc = attempt(lambda: gradcheck.check_module(layer, [x]))
    if exc is None:
        assert result.passed(), str(result)
