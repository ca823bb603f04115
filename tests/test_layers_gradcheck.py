"""Gradient checks of every layer: hand-written backward vs central differences.

For any (tiny) shapes, weights and inputs drawn by Hypothesis, on NumPy and on
the strict array-API namespace, in float64, ``check_module`` compares the
gradient of every input and EVERY parameter with central differences; the
worst relative error must be below ``GRADCHECK_TOL`` (1e-6; a correct backward
gives about 1e-9, a wrong one about 1).

Covered: Linear (with/without bias, any leading shape), LayerNorm, Embedding
(repeated ids), learned and sinusoidal positions, Dropout (p > 0, training:
the backend is reseeded before every forward so the numerical forwards see the
same mask), ReLU/GELU, MultiHeadAttention self and cross in three head
layouts (heads of width d_model/H with odd width 6 / 3 heads, wide head_dim=d_model,
odd head_dim=5) under six mask kinds (none, key padding with lengths down to
1, causal, causal & padding, random boolean, fully masked query rows),
FeedForward (relu/gelu, with dropout), EncoderBlock and DecoderBlock in post-
and pre-norm under the same mask kinds (the residual connections are covered through them).
Batch and sequence lengths include 1.  Fully masked rows must give finite,
correct gradients (zero attention output), never NaN.

Every parameter is re-drawn at random before the check (LayerNorm's
gamma = 1, beta = 0 and zero biases would hide errors), and ReLU inputs are
kept away from the kink, where central differences are meaningless.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from npformer import backend, nn
from npformer.gradcheck import check_module
from npformer.ops import causal_mask, padding_mask

from .helpers import GRADCHECK_TOL, tiered

SEEDS = st.integers(0, 2**32 - 1)
MASK_KINDS = ["none", "padding", "causal", "causal_padding", "random", "fully_masked"]
# (d_model, num_heads, head_dim): heads of width d_model / H (an odd model width), wide heads,
# an odd head width.  (Bloem's narrow heads and qk_norm: tests/test_attention_options.py.)
LAYOUTS = {"split_6x3": (6, 3, None), "wide": (4, 2, 4), "head_dim_5": (4, 2, 5)}
RELU_MARGIN = 1e-3  # |pre-activation| below this: a +-h step could cross the kink


# =========================================================================== helpers
class Reseeded(nn.Module):
    """Runs ``inner`` with the backend reseeded first, so every forward of the
    gradient check draws the same dropout masks."""

    def __init__(self, inner, seed: int = 7):
        self.inner = inner
        self._seed = seed

    def forward(self, *args, **kwargs):
        backend.seed(self._seed)
        return self.inner(*args, **kwargs)

    def backward(self, dy):
        return self.inner.backward(dy)


# Every layer's gradient check runs in both tiers (the fast tier's layers are its own
# classes, tests/test_fast_layers.py holds them equal to the textbook's).
pytestmark = pytest.mark.usefixtures("tier")


def record_margin(activation) -> None:
    """Make ``activation`` (a layer of either tier) remember, in ``margin``, the smallest
    |input| of its last forward (its class's forward wrapped on this instance only)."""
    forward = activation.forward

    def recording(x):
        xp = backend.namespace_of(x)
        activation.margin = backend.to_float(xp.min(xp.abs(x))) if math.prod(x.shape) \
            else math.inf
        return forward(x)

    activation.margin = math.inf
    activation.forward = recording


def randomize(module, rng: np.random.Generator, std: float = 0.7) -> None:
    """Every parameter re-drawn N(0, std^2) (in its own dtype, on the backend)."""
    for _, p in module.named_parameters():
        p.data = backend.asarray(rng.standard_normal(p.shape) * std, dtype="float64")


def arr(host, dtype="float64"):
    return backend.asarray(np.asarray(host), dtype=dtype)


def assert_gradcheck(result) -> None:
    # NaN must fail loudly: max() over errors can silently drop a NaN.
    assert result.errors, "nothing was checked"
    for name, err in result.errors.items():
        assert math.isfinite(err), f"non-finite gradient error in {name!r}\n{result}"
    assert result.worst_error < GRADCHECK_TOL, str(result)


def assert_finite(y) -> None:
    assert np.all(np.isfinite(backend.to_numpy(y))), "forward produced non-finite values"


def check(module, inputs, wrt_inputs=None, kwargs=None, seed=0):
    """Gradient-check ``module`` and also require finite outputs and parameter grads."""
    result = check_module(module, inputs, wrt_inputs=wrt_inputs, kwargs=kwargs, seed=seed)
    assert_gradcheck(result)
    for name, p in module.named_parameters():
        assert np.all(np.isfinite(backend.to_numpy(p.grad))), f"non-finite grad of {name}"
    return result


def use_recording_relu(ffn):
    """A FeedForward's relu, made to record its margin (None for another activation)."""
    if ffn.activation.name != "relu":
        return None
    record_margin(ffn.activation)
    return ffn.activation


# --------------------------------------------------------------------------- masks
@st.composite
def attention_case(draw, mask_kind: str, cross: bool, max_len: int = 3):
    """Shapes, seeds and valid lengths for one attention / block check."""
    batch = draw(st.integers(1, 2))
    t = draw(st.integers(1, max_len))
    if not cross:
        s = t
    elif mask_kind in ("causal", "causal_padding"):
        s = draw(st.integers(t, max_len))  # a causal (T, S) mask needs S >= T
    else:
        s = draw(st.integers(1, max_len))
    case = dict(batch=batch, t=t, s=s, seed=draw(SEEDS), lens=None, random_shape=None)
    if mask_kind in ("padding", "causal_padding"):
        case["lens"] = draw(st.lists(st.integers(1, s), min_size=batch, max_size=batch))
    elif mask_kind == "fully_masked":
        lens = draw(st.lists(st.integers(0, s), min_size=batch, max_size=batch))
        lens[draw(st.integers(0, batch - 1))] = 0  # one batch element has no valid key
        case["lens"] = lens
        case["dead_row"] = (draw(st.integers(0, batch - 1)), draw(st.integers(0, t - 1)))
    if mask_kind == "random":
        case["random_shape"] = draw(st.sampled_from(["bhts", "b1ts", "ts", "1h1s"]))
    return case


def build_mask(kind: str, case: dict, heads: int, t: int, s: int, rng):
    """A boolean backend mask (True = may attend) broadcasting to (B, H, t, s)."""
    batch = case["batch"]
    if kind == "none":
        return None
    if kind == "padding":
        return padding_mask(arr(case["lens"], "int64"), s)  # (B, 1, 1, s)
    if kind == "causal":
        return causal_mask(t, s)  # (t, s)
    if kind == "causal_padding":
        return causal_mask(t, s) & padding_mask(arr(case["lens"], "int64"), s)  # (B, 1, t, s)
    if kind == "random":
        shape = {"bhts": (batch, heads, t, s), "b1ts": (batch, 1, t, s), "ts": (t, s),
                 "1h1s": (1, heads, 1, s)}[case["random_shape"]]
        return arr(rng.random(shape) < 0.6, "bool")
    if kind == "fully_masked":
        # a batch element with valid length 0 (every one of its rows masked) AND a random
        # mask with one query row of another element switched off entirely
        keep = rng.random((batch, heads, t, s)) < 0.7
        b, row = case["dead_row"]
        keep[b, :, row, :] = False
        pad = padding_mask(arr(case["lens"], "int64"), s)
        return pad & arr(keep, "bool")
    raise AssertionError(kind)


# =========================================================================== basic layers
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
       d_in=st.integers(1, 5), d_out=st.integers(1, 5), bias=st.booleans(), seed=SEEDS)
def test_linear(xb, lead, d_in, d_out, bias, seed):
    rng = np.random.default_rng(seed)
    layer = tiered.Linear(d_in, d_out, bias=bias)
    randomize(layer, rng)
    x = arr(rng.standard_normal((*lead, d_in)))
    result = check(layer, [x], seed=seed)
    assert set(result.errors) == {"input0", "weight"} | ({"bias"} if bias else set())


@given(batch=st.integers(1, 2), t=st.integers(1, 3), width=st.integers(1, 6), seed=SEEDS)
def test_layernorm(xb, batch, t, width, seed):
    rng = np.random.default_rng(seed)
    layer = tiered.LayerNorm(width)
    randomize(layer, rng)
    x = arr(rng.standard_normal((batch, t, width)) * rng.uniform(0.5, 3.0) + rng.normal())
    result = check(layer, [x], seed=seed)
    assert set(result.errors) == {"input0", "weight", "bias"}


@given(id_shape=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       vocab=st.integers(1, 5), width=st.integers(1, 4), seed=SEEDS)
def test_embedding(xb, id_shape, vocab, width, seed):
    rng = np.random.default_rng(seed)
    layer = tiered.Embedding(vocab, width)
    randomize(layer, rng)
    ids = arr(rng.integers(0, vocab, size=id_shape), "int64")  # repeats when vocab is small
    result = check(layer, [ids], wrt_inputs=[], seed=seed)
    assert set(result.errors) == {"weight"}


@given(batch=st.integers(1, 2), t=st.integers(1, 3), extra=st.integers(0, 2),
       width=st.integers(1, 4), seed=SEEDS)
def test_learned_positions(xb, batch, t, extra, width, seed):
    rng = np.random.default_rng(seed)
    layer = tiered.LearnedPositionalEmbedding(t + extra, width)  # unused rows get zero gradient
    randomize(layer, rng)
    x = arr(rng.standard_normal((batch, t, width)))
    result = check(layer, [x], seed=seed)
    assert set(result.errors) == {"input0", "weight"}


@given(batch=st.integers(1, 2), t=st.integers(1, 3), extra=st.integers(0, 2),
       width=st.integers(1, 5), seed=SEEDS)
def test_sinusoidal_positions(xb, batch, t, extra, width, seed):
    rng = np.random.default_rng(seed)
    layer = nn.SinusoidalPositionalEncoding(t + extra, width)
    x = arr(rng.standard_normal((batch, t, width)))
    result = check(layer, [x], seed=seed)
    assert set(result.errors) == {"input0"}


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       p=st.floats(0.1, 0.8), seed=SEEDS)
def test_dropout_training(xb, shape, p, seed):
    rng = np.random.default_rng(seed)
    dropout = tiered.Dropout(p)
    layer = Reseeded(dropout)
    x = arr(rng.standard_normal(shape))
    y = layer(x)
    # the check is only meaningful if the mask really is the same each time
    assert np.array_equal(backend.to_numpy(layer(x)), backend.to_numpy(y))
    assert dropout.training
    check(layer, [x], seed=seed)


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), seed=SEEDS)
def test_dropout_eval_is_identity(xb, shape, seed):
    rng = np.random.default_rng(seed)
    layer = tiered.Dropout(0.5).eval()
    x = arr(rng.standard_normal(shape))
    assert np.array_equal(backend.to_numpy(layer(x)), backend.to_numpy(x))
    check(layer, [x], seed=seed)


@pytest.mark.parametrize("name", ["relu", "gelu"])
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), seed=SEEDS)
def test_activation(xb, name, shape, seed):
    rng = np.random.default_rng(seed)
    layer = tiered.Activation(name)
    # |x| <= 3: further out GELU's slope vanishes (~1e-7 at -5) and its forward loses
    # the digits (1 + tanh u cancels) that central differences would need
    x = rng.uniform(-3.0, 3.0, size=shape)
    if name == "relu":
        x = np.sign(x) * (np.abs(x) + 0.05)  # away from the kink at 0
    check(layer, [arr(x)], seed=seed)


# =========================================================================== attention
# Every (mask kind, head layout) pair once, self- and cross-attention alternating so that
# each mask kind and each layout meets both (the full product would triple the run time).
MHA_CASES = [(kind, layout, (i + j) % 2 == 1)
             for i, kind in enumerate(MASK_KINDS) for j, layout in enumerate(LAYOUTS)]


@pytest.mark.parametrize(
    "mask_kind,layout,cross", MHA_CASES,
    ids=[f"{k}-{lay}-{'cross' if c else 'self'}" for k, lay, c in MHA_CASES])
@settings(max_examples=3)
@given(data=st.data())
def test_multi_head_attention(xb, mask_kind, layout, cross, data):
    d_model, heads, head_dim = LAYOUTS[layout]
    case = data.draw(attention_case(mask_kind, cross), label="case")
    rng = np.random.default_rng(case["seed"])
    layer = tiered.MultiHeadAttention(d_model, heads, head_dim)
    assert layer.head_dim == (d_model // heads if head_dim is None else head_dim)
    randomize(layer, rng)
    batch, t, s = case["batch"], case["t"], case["s"]
    mask = build_mask(mask_kind, case, heads, t, s, rng)
    x = arr(rng.standard_normal((batch, t, d_model)))
    if cross:
        memory = arr(rng.standard_normal((batch, s, d_model)))
        assert_finite(layer(x, memory, mask=mask))
        result = check(layer, [x, memory], kwargs={"mask": mask}, seed=case["seed"])
        assert {"input0", "input1"} <= set(result.errors)
    else:
        assert_finite(layer(x, mask=mask))
        result = check(layer, [x], kwargs={"mask": mask}, seed=case["seed"])
        assert "input0" in result.errors
    assert len(result.errors) == len(layer.parameters()) + (2 if cross else 1)


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_attention_fully_masked_rows_are_zero_and_finite(xb, cross):
    """A query row with no allowed key gets exactly the output projection's bias,
    and receives exactly zero input gradient through the attention."""
    rng = np.random.default_rng(3)
    layer = tiered.MultiHeadAttention(4, 2)
    randomize(layer, rng)
    x = arr(rng.standard_normal((2, 3, 4)))
    memory = arr(rng.standard_normal((2, 3, 4))) if cross else None
    keep = np.ones((2, 1, 3, 3), dtype=bool)
    keep[0] = False  # batch element 0: nothing may be attended
    keep[1, :, 1, :] = False  # batch element 1: query row 1 sees nothing
    y = layer(x, memory, mask=arr(keep, "bool"))
    y_host = backend.to_numpy(y)
    bias = backend.to_numpy(layer.out_proj.bias.data)
    np.testing.assert_array_equal(y_host[0], np.broadcast_to(bias, (3, 4)))
    np.testing.assert_array_equal(y_host[1, 1], bias)
    grads = layer.backward(arr(rng.standard_normal((2, 3, 4))))
    dx = backend.to_numpy(grads[0] if cross else grads)
    assert np.all(np.isfinite(dx))
    if cross:
        np.testing.assert_array_equal(dx[0], 0.0)  # queries of a dead element: no gradient
        np.testing.assert_array_equal(dx[1, 1], 0.0)
        np.testing.assert_array_equal(backend.to_numpy(grads[1])[0], 0.0)  # nor its memory
    for name, p in layer.named_parameters():
        assert np.all(np.isfinite(backend.to_numpy(p.grad))), name


# =========================================================================== blocks
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@given(batch=st.integers(1, 2), t=st.integers(1, 3), d_model=st.integers(1, 5),
       d_ff=st.integers(1, 8), dropout=st.sampled_from([0.0, 0.4]), seed=SEEDS)
def test_feed_forward(xb, activation, batch, t, d_model, d_ff, dropout, seed):
    rng = np.random.default_rng(seed)
    ffn = tiered.FeedForward(d_model, d_ff, activation, dropout)
    randomize(ffn, rng)
    recorder = use_recording_relu(ffn)
    layer = Reseeded(ffn)
    x = arr(rng.standard_normal((batch, t, d_model)))
    layer(x)
    if recorder is not None:
        assume(recorder.margin > RELU_MARGIN)
    result = check(layer, [x], seed=seed)
    assert len(result.errors) == 5  # input, linear1.{weight,bias}, linear2.{weight,bias}


def _block_dims(data, layout_choice):
    """Tiny blocks (every parameter element costs two forwards): d_model 4, 2 heads."""
    d_model, heads = 4, 2
    head_dim = d_model if layout_choice == "wide" else None
    d_ff = data.draw(st.integers(5, 6), label="d_ff")
    activation = data.draw(st.sampled_from(["relu", "gelu"]), label="activation")
    return d_model, heads, head_dim, d_ff, activation


# Each mask kind once per block type, the norm arrangement alternating, and opposite
# between encoder and decoder: every mask kind meets post- and pre-norm.
ENCODER_CASES = [(kind, i % 2 == 0) for i, kind in enumerate(MASK_KINDS)]
DECODER_CASES = [(kind, i % 2 == 1) for i, kind in enumerate(MASK_KINDS)]


def _block_ids(cases):
    return [f"{k}-{'pre_norm' if nf else 'post_norm'}" for k, nf in cases]


@pytest.mark.parametrize("mask_kind,norm_first", ENCODER_CASES, ids=_block_ids(ENCODER_CASES))
@settings(max_examples=3)
@given(data=st.data())
def test_encoder_block(xb, mask_kind, norm_first, data):
    layout = data.draw(st.sampled_from(["split", "wide"]), label="layout")
    d_model, heads, head_dim, d_ff, activation = _block_dims(data, layout)
    case = data.draw(attention_case(mask_kind, cross=False), label="case")
    rng = np.random.default_rng(case["seed"])
    block = tiered.EncoderBlock(d_model, heads, d_ff, dropout=0.0, activation=activation,
                            norm_first=norm_first, head_dim=head_dim)
    randomize(block, rng)
    recorder = use_recording_relu(block.ffn)
    t = case["t"]
    mask = build_mask(mask_kind, case, heads, t, t, rng)
    x = arr(rng.standard_normal((case["batch"], t, d_model)))
    assert_finite(block(x, mask=mask))
    if recorder is not None:
        assume(recorder.margin > RELU_MARGIN)
    result = check(block, [x], kwargs={"mask": mask}, seed=case["seed"])
    assert len(result.errors) == 1 + 16  # input + 8 attention + 4 ffn + 2 x 2 norm


@pytest.mark.parametrize("mask_kind,norm_first", DECODER_CASES, ids=_block_ids(DECODER_CASES))
@settings(max_examples=3)
@given(data=st.data())
def test_decoder_block(xb, mask_kind, norm_first, data):
    layout = data.draw(st.sampled_from(["split", "wide"]), label="layout")
    d_model, heads, head_dim, d_ff, activation = _block_dims(data, layout)
    # self-attention masks on (T, T); the memory mask of the same kind on (T, S)
    case = data.draw(attention_case(mask_kind, cross=True), label="case")
    rng = np.random.default_rng(case["seed"])
    block = tiered.DecoderBlock(d_model, heads, d_ff, dropout=0.0, activation=activation,
                            norm_first=norm_first, head_dim=head_dim)
    randomize(block, rng)
    recorder = use_recording_relu(block.ffn)
    batch, t, s = case["batch"], case["t"], case["s"]
    self_case = dict(case, s=t)
    if case["lens"] is not None:  # target key padding: lengths over T
        self_case["lens"] = [min(n, t) for n in case["lens"]]
    self_mask = build_mask(mask_kind, self_case, heads, t, t, rng)
    memory_mask = build_mask(mask_kind, case, heads, t, s, rng)
    x = arr(rng.standard_normal((batch, t, d_model)))
    memory = arr(rng.standard_normal((batch, s, d_model)))
    kwargs = {"self_mask": self_mask, "memory_mask": memory_mask}
    assert_finite(block(x, memory, **kwargs))
    if recorder is not None:
        assume(recorder.margin > RELU_MARGIN)
    result = check(block, [x, memory], kwargs=kwargs, seed=case["seed"])
    assert len(result.errors) == 2 + 26  # x, memory + 2 x 8 attention + 4 ffn + 3 x 2 norm
