"""Every op's hand-written backward against central differences, plus the ops' invariants.

Each gradient check is a Hypothesis property run on both backends of the ``xb``
fixture (NumPy and the strict array-API namespace) in float64: for random tiny
shapes (batch and sequence lengths including 1, odd widths), random values and a
random upstream gradient (drawn by :func:`npformer.gradcheck.check_op`), the
analytic gradients agree with the numerical ones to ``GRADCHECK_TOL``.

Covered: linear (with/without bias, 2-D and 3-D inputs), relu, gelu, dropout
(training with a mask that repeats between evaluations, and evaluation mode),
layernorm, RMS norm, rotary positions (arbitrary integer positions, shared or per
sequence, with and without the llama3 scaling, and tables that are not rotations),
SwiGLU (gates up to |a| ~ 100), softmax (two axes, random masks with fully masked rows
and rows with one valid key), log-softmax, attention (H > 1, S = 1 included, masks: none,
padding, causal, padding & causal, random masks of shapes (B,1,T,S), (1,1,T,S)
and (T,S) with fully masked query rows), embedding (repeated ids), positional
adds (sinusoidal and learned tables), cross-entropy (ignored targets, label
smoothing 0 and > 0, 2-D and 3-D logits), pooling (mean, max, first token over
valid positions).

Invariants: a fully masked attention row gives exactly zero output and zero
gradient contributions, never NaN; softmax rows sum to 1 where a key is allowed;
dropout in evaluation is the identity and in training keeps the mean; the mask
builders are the shifted lower triangle and the first valid keys; rotary scores depend
on the distance of positions only; SwiGLU never overflows; every op keeps
its input dtype, forward and backward, and never writes into its inputs.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer import backend, fast, ops
from npformer.gradcheck import check_op

from .helpers import ATTENTION_OPS, GRADCHECK_TOL

seeds = st.integers(0, 2**32 - 1)
batch = st.integers(1, 3)
length = st.integers(1, 4)
width = st.integers(1, 5)


def assert_passes(result) -> None:
    assert result.worst_error < GRADCHECK_TOL, f"gradient check failed:\n{result}"


def randn(rng, shape, on_device, scale=1.0):
    return on_device(rng.standard_normal(tuple(shape)) * scale)


def away_from_zero(rng, shape, margin=0.1):
    """Normal samples pushed at least ``margin`` away from 0 (relu's kink)."""
    x = rng.standard_normal(tuple(shape))
    return np.where(x >= 0, x + margin, x - margin)


def host(x) -> np.ndarray:
    return backend.to_numpy(x)


# =========================================================================== linear
@pytest.mark.parametrize("T", [ops, fast], ids=["textbook", "fast"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("rank", [2, 3])
@given(seed=seeds, b=batch, t=length, d_in=width, d_out=width)
def test_linear(xb, on_device, T, bias, rank, seed, b, t, d_in, d_out):
    rng = np.random.default_rng(seed)
    lead = (b, t) if rank == 3 else (b,)
    x = randn(rng, lead + (d_in,), on_device)
    w = randn(rng, (d_in, d_out), on_device)
    if bias:
        args, wrt = [x, w, randn(rng, (d_out,), on_device)], [0, 1, 2]
        backward = T.linear_backward
    else:
        args, wrt = [x, w], [0, 1]

        def backward(dy, cache):
            dx, dw, db = T.linear_backward(dy, cache)
            assert db is None
            return dx, dw
    assert_passes(check_op(T.linear_forward, backward, args, wrt))


# =========================================================================== activations
@given(seed=seeds, shape=st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_relu(xb, on_device, seed, shape):
    rng = np.random.default_rng(seed)
    x = on_device(away_from_zero(rng, shape))  # central differences need |x| > h
    assert_passes(check_op(ops.relu_forward, ops.relu_backward, [x], [0]))


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh"])
@given(seed=seeds, shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       scale=st.sampled_from([0.3, 1.0, 3.0]))
def test_gelu(xb, on_device, name, seed, shape, scale):
    rng = np.random.default_rng(seed)
    # Clipped at -3.5: further out gelu'(x) < 1e-3 shrinks to ~1e-13 at x = -7, below
    # what central differences resolve, and a tensor lying entirely there would
    # compare rounding noise with rounding noise.
    x = on_device(np.maximum(rng.standard_normal(tuple(shape)) * scale, -3.5))
    assert_passes(check_op(*ops.activation(name), [x], [0]))


# =========================================================================== dropout
@given(seed=seeds, mask_seed=seeds, shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       p=st.floats(0.05, 0.9))
def test_dropout_training(xb, on_device, seed, mask_seed, shape, p):
    rng = np.random.default_rng(seed)
    x = randn(rng, shape, on_device)

    def forward(x):
        backend.seed(mask_seed)  # every evaluation draws the same mask
        return ops.dropout_forward(x, p, training=True)

    y1, cache = forward(x)
    y2, _ = forward(x)
    np.testing.assert_array_equal(host(y1), host(y2))  # the wrapper really repeats the mask
    kept = host(cache.values) != 0
    np.testing.assert_allclose(host(cache.values)[kept], 1.0 / (1.0 - p), rtol=1e-15)
    np.testing.assert_allclose(host(y1), np.where(kept, host(x) / (1.0 - p), 0.0), rtol=1e-15)
    assert_passes(check_op(forward, ops.dropout_backward, [x], [0]))


@given(seed=seeds, shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       p=st.floats(0.0, 0.9))
def test_dropout_eval(xb, on_device, seed, shape, p):
    rng = np.random.default_rng(seed)
    x = randn(rng, shape, on_device)
    result = check_op(ops.dropout_forward, ops.dropout_backward, [x, p], [0],
                      kwargs={"training": False})
    assert_passes(result)


# =========================================================================== layer norm
def layernorm_input(rng, lead, d):
    """Rows with a random mean and a standard deviation in [0.5, 2] (never nearly
    constant: there 1/sqrt(var + eps) varies on a scale close to h)."""
    z = rng.standard_normal(tuple(lead) + (d,))
    if d > 1:
        z = (z - z.mean(-1, keepdims=True)) / z.std(-1, keepdims=True)
        z = z * rng.uniform(0.5, 2.0, size=tuple(lead) + (1,))
    return z + rng.normal(0.0, 3.0, size=tuple(lead) + (1,))


@given(seed=seeds, lead=st.lists(st.integers(1, 3), min_size=1, max_size=2), d=width)
def test_layernorm(xb, on_device, seed, lead, d):
    rng = np.random.default_rng(seed)
    x = on_device(layernorm_input(rng, lead, d))
    gamma = randn(rng, (d,), on_device)
    beta = randn(rng, (d,), on_device)
    assert_passes(check_op(ops.layernorm_forward, ops.layernorm_backward,
                           [x, gamma, beta], [0, 1, 2]))


# =========================================================================== RMS norm
@given(seed=seeds, lead=st.lists(st.integers(1, 3), min_size=1, max_size=2), d=width,
       scale=st.sampled_from([0.3, 1.0, 5.0]))
def test_rmsnorm(xb, on_device, seed, lead, d, scale):
    rng = np.random.default_rng(seed)
    # Rows of rms in [0.5, 2] * scale, never near sqrt(eps) ~ 1e-3: there r = (m + eps)^-1/2
    # bends on a scale close to h (D = 1 leaves only that eps term in dx).
    z = rng.standard_normal(tuple(lead) + (d,))
    z = z / np.sqrt(np.mean(z * z, axis=-1, keepdims=True))
    x = on_device(z * rng.uniform(0.5, 2.0, size=tuple(lead) + (1,)) * scale)
    weight = randn(rng, (d,), on_device)
    assert_passes(check_op(ops.rmsnorm_forward, ops.rmsnorm_backward, [x, weight], [0, 1]))


# =========================================================================== rotary
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@given(seed=seeds, b=batch, h=st.integers(1, 3), t=length, half=st.integers(1, 4),
       theta=st.sampled_from([10000.0, 500000.0, 7.0]), scaled=st.booleans(),
       per_sequence=st.booleans(), offset=st.integers(-5, 10_000))
def test_rotary(xb, on_device, seed, b, h, t, half, theta, scaled, per_sequence, offset):
    """Arbitrary integer positions (per sequence: left padding, a KV cache's offset)."""
    rng = np.random.default_rng(seed)
    e = 2 * half
    shape = (b, t) if per_sequence else (t,)
    positions = on_device(offset + rng.integers(0, 100, size=shape))
    cos, sin = ops.rotary_table(positions, e, theta, LLAMA3_SCALING if scaled else None,
                                dtype=backend.float_dtype("float64"))
    x = randn(rng, (b, h, t, e), on_device)
    assert_passes(check_op(ops.rotary_forward, ops.rotary_backward, [x, cos, sin], [0]))


@given(seed=seeds, b=batch, h=st.integers(1, 3), t=length, half=st.integers(1, 4))
def test_rotary_backward_is_the_transpose_for_any_table(xb, on_device, seed, b, h, t, half):
    """Tables whose halves differ (not a rotation): the backward is still the forward's
    transpose, never the rotation by -angle where that is not it."""
    rng = np.random.default_rng(seed)
    e = 2 * half
    x = randn(rng, (b, h, t, e), on_device)
    cos, sin = randn(rng, (b, t, e), on_device), randn(rng, (b, t, e), on_device)
    assert_passes(check_op(ops.rotary_forward, ops.rotary_backward, [x, cos, sin], [0]))


@given(seed=seeds, t=length, half=st.integers(1, 4), m=st.integers(-50, 5000),
       shift=st.integers(-1000, 1000), scaled=st.booleans())
def test_rotary_scores_depend_on_the_distance_only(xb, on_device, seed, t, half, m, shift,
                                                    scaled):
    """q'.k' for positions (m, n) equals that for (m + shift, n + shift); the backward
    undoes the forward (the rotation is orthogonal)."""
    rng = np.random.default_rng(seed)
    e = 2 * half
    q, k = randn(rng, (1, 1, t, e), on_device), randn(rng, (1, 1, t, e), on_device)
    n = rng.integers(-50, 5000, size=t)

    def scores(first, second):
        dtype = backend.float_dtype("float64")
        scaling = LLAMA3_SCALING if scaled else None
        cq, sq = ops.rotary_table(on_device(np.full(t, first)), e, 10000.0, scaling, dtype)
        ck, sk = ops.rotary_table(on_device(second), e, 10000.0, scaling, dtype)
        q_rot, cache = ops.rotary_forward(q, cq, sq)
        k_rot, _ = ops.rotary_forward(k, ck, sk)
        back = host(ops.rotary_backward(q_rot, cache))
        np.testing.assert_allclose(back, host(q), rtol=1e-12, atol=1e-12)
        return np.sum(host(q_rot) * host(k_rot), axis=-1)
    np.testing.assert_allclose(scores(m, n), scores(m + shift, n + shift), rtol=1e-9,
                               atol=1e-9)


# =========================================================================== SwiGLU
@given(seed=seeds, shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       scale=st.sampled_from([0.3, 1.0, 4.0, 40.0]))
def test_swiglu(xb, on_device, seed, shape, scale):
    rng = np.random.default_rng(seed)
    a = randn(rng, shape, on_device, scale)  # |a| up to ~100: sigma(a) is 0 or 1 there
    b = randn(rng, shape, on_device)
    assert_passes(check_op(ops.swiglu_forward, ops.swiglu_backward, [a, b], [0, 1]))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_swiglu_does_not_overflow(xb, on_device, dtype):
    a = on_device(np.array([-1e4, -800.0, -90.0, 0.0, 90.0, 800.0, 1e4]), dtype)
    b = on_device(np.ones(7), dtype)
    h, cache = ops.swiglu_forward(a, b)
    da, db = ops.swiglu_backward(on_device(np.ones(7), dtype), cache)
    np.testing.assert_array_equal(host(h)[[0, 1, 3, 5, 6]], [0.0, 0.0, 0.0, 800.0, 1e4])
    np.testing.assert_array_equal(host(da)[[0, 1, 3, 5, 6]], [0.0, 0.0, 0.5, 1.0, 1.0])
    assert np.all(np.isfinite(host(da))) and np.all(np.isfinite(host(db)))


# =========================================================================== softmax
def random_mask(rng, shape, axis, broadcast):
    """Boolean mask broadcasting to ``shape`` (full along ``axis``) with at least one
    fully masked row and, where the axis is longer than 1, one row with a single key."""
    ndim = len(shape)
    axis = axis % ndim
    mshape = [n if (i == axis or not b) else 1 for i, (n, b) in enumerate(zip(shape, broadcast))]
    mask = rng.random(mshape) < 0.6
    moved = np.moveaxis(mask, axis, -1).copy()  # rows along the last axis
    flat = moved.reshape(-1, moved.shape[-1])  # a view of ``moved``
    order = rng.permutation(flat.shape[0])
    flat[order[0]] = False  # a fully masked row
    if flat.shape[0] > 1 and flat.shape[1] > 1:
        flat[order[1]] = False
        flat[order[1], rng.integers(flat.shape[1])] = True  # a row with one valid key
    mask = np.moveaxis(moved, -1, axis)
    return mask


@pytest.mark.parametrize("T", [ops, fast], ids=["textbook", "fast"])
@pytest.mark.parametrize("axis", [-1, 0])
@given(seed=seeds, shape=st.lists(st.integers(1, 4), min_size=2, max_size=3),
       masked=st.booleans(), broadcast=st.lists(st.booleans(), min_size=3, max_size=3))
def test_softmax(xb, on_device, T, axis, seed, shape, masked, broadcast):
    rng = np.random.default_rng(seed)
    x = randn(rng, shape, on_device, 2.0)
    kwargs = {"axis": axis}
    if masked:
        kwargs["mask"] = on_device(random_mask(rng, shape, axis, broadcast[:len(shape)]))
    assert_passes(check_op(T.softmax_forward, T.softmax_backward, [x], [0], kwargs))


@pytest.mark.parametrize("axis", [-1, 1])
@given(seed=seeds, shape=st.lists(st.integers(1, 4), min_size=2, max_size=3))
def test_log_softmax(xb, on_device, axis, seed, shape):
    rng = np.random.default_rng(seed)
    x = randn(rng, shape, on_device, 2.0)
    assert_passes(check_op(ops.log_softmax_forward, ops.log_softmax_backward, [x], [0],
                           {"axis": axis}))


# =========================================================================== attention
MASK_KINDS = ["none", "padding", "causal", "padding&causal", "random_B1TS", "random_11TS",
              "random_TS"]


def attention_mask(kind, rng, b, h, t, s, on_device, dead_sequence=False):
    """(backend mask or None, host mask broadcast to (B, H, T, S)).

    Random masks always have a fully masked query row; padding masks have one
    when a valid length is 0 (random, or forced by ``dead_sequence``)."""
    if kind == "none":
        return None, np.ones((b, h, t, s), bool)
    if kind.startswith("random"):
        shape = {"random_B1TS": (b, 1, t, s), "random_11TS": (1, 1, t, s),
                 "random_TS": (t, s)}[kind]
        m = rng.random(shape) < 0.6
        m[..., rng.integers(t), :] = False  # a fully masked query row
        mask = on_device(m)
    else:
        mask = None
        if "padding" in kind:
            valid = rng.integers(0, s + 1, size=b)  # 0: every query of that sequence masked
            valid[rng.integers(b)] = 0 if dead_sequence else rng.integers(1, s + 1)
            mask = ops.padding_mask(on_device(valid), s)
        if "causal" in kind:
            causal = ops.causal_mask(t, s)
            mask = causal if mask is None else mask & causal
    return mask, np.broadcast_to(host(mask), (b, h, t, s))


attention_shapes = dict(b=st.integers(1, 2), h=st.integers(2, 3), t=st.integers(1, 4),
                        s=st.integers(1, 4), e=st.integers(1, 4), f=st.integers(1, 3))


def attention_inputs(rng, kind, b, h, t, s, e, f, on_device, dead_sequence=False):
    if "causal" in kind:
        s = t + s - 1  # a causal mask needs S >= T (S > T: a cached prefix)
    q = randn(rng, (b, h, t, e), on_device)
    k = randn(rng, (b, h, s, e), on_device)
    v = randn(rng, (b, h, s, f), on_device)
    mask, full = attention_mask(kind, rng, b, h, t, s, on_device, dead_sequence)
    return q, k, v, mask, full


@pytest.mark.parametrize("op", sorted(ATTENTION_OPS))
@pytest.mark.parametrize("kind", MASK_KINDS)
@given(seed=seeds, **attention_shapes)
def test_attention(xb, on_device, kind, op, seed, b, h, t, s, e, f):
    rng = np.random.default_rng(seed)
    q, k, v, mask, _ = attention_inputs(rng, kind, b, h, t, s, e, f, on_device)
    forward, backward = ATTENTION_OPS[op]
    assert_passes(check_op(forward, backward, [q, k, v, mask], [0, 1, 2]))


@pytest.mark.parametrize("op", sorted(ATTENTION_OPS))
@given(seed=seeds, b=st.integers(1, 3), h=st.integers(1, 3), t=st.integers(1, 4),
       s=st.integers(1, 4), e=st.integers(1, 4),
       kind=st.sampled_from([k for k in MASK_KINDS if k not in ("none", "causal")]))
def test_attention_fully_masked_rows_are_zero(xb, on_device, op, seed, b, h, t, s, e, kind):
    rng = np.random.default_rng(seed)
    q, k, v, mask, full = attention_inputs(rng, kind, b, h, t, s, e, e, on_device,
                                           dead_sequence=True)
    dead = ~full.any(-1)  # (B, H, T): queries with no key to attend to
    assert dead.any()
    q, k, v = (on_device(host(a) * 50.0) for a in (q, k, v))  # large scores: still no NaN
    forward, backward = ATTENTION_OPS[op]
    out, cache = forward(q, k, v, mask)
    dout_host = rng.standard_normal(tuple(out.shape))
    dq, dk, dv = backward(on_device(dout_host), cache)
    p = host(ops.attention_weights(q, k, mask))  # what the op applied, built whole
    for name, a in (("out", out), ("p", p), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.all(np.isfinite(host(a))), f"{name} has NaN or inf"
    assert np.all(host(out)[dead] == 0.0)
    assert np.all(p[dead] == 0.0)
    assert np.all(host(dq)[dead] == 0.0)
    assert np.all(p[~full] == 0.0)  # masked keys get no weight anywhere
    # The upstream gradient of a dead row contributes nothing to dk and dv.
    changed = dout_host.copy()
    changed[dead] = rng.standard_normal(changed[dead].shape) * 1e3
    dq2, dk2, dv2 = backward(on_device(changed), cache)
    np.testing.assert_array_equal(host(dk2), host(dk))
    np.testing.assert_array_equal(host(dv2), host(dv))
    np.testing.assert_array_equal(host(dq2)[~dead], host(dq)[~dead])
    assert np.all(host(dq2)[dead] == 0.0)


# =========================================================================== mask builders
@given(t=st.integers(1, 6), extra=st.integers(0, 4))
def test_causal_mask_is_the_shifted_lower_triangle(xb, t, extra):
    s = t + extra
    mask = ops.causal_mask(t, s)
    assert mask.dtype == backend.xp().bool and tuple(mask.shape) == (t, s)
    # Query i is position i + (S - T) of the sequence: it sees keys 0 .. i + S - T.
    expected = np.tril(np.ones((t, s), bool), k=s - t)
    np.testing.assert_array_equal(host(mask), expected)
    assert np.all(host(mask)[:, 0]) and np.all(host(mask)[-1])  # nobody is fully masked
    np.testing.assert_array_equal(host(ops.causal_mask(t)), np.tril(np.ones((t, t), bool)))


@given(seed=seeds, b=st.integers(1, 4), s=st.integers(1, 6))
def test_padding_mask_keeps_the_first_valid_keys(xb, on_device, seed, b, s):
    valid = np.random.default_rng(seed).integers(0, s + 1, size=b)
    mask = ops.padding_mask(on_device(valid), s)
    assert mask.dtype == backend.xp().bool and tuple(mask.shape) == (b, 1, 1, s)
    expected = np.arange(s)[None, :] < valid[:, None]
    np.testing.assert_array_equal(host(mask)[:, 0, 0, :], expected)


# =========================================================================== softmax invariants
@pytest.mark.parametrize("axis", [-1, 0])
@given(seed=seeds, shape=st.lists(st.integers(1, 5), min_size=2, max_size=3),
       masked=st.booleans(), broadcast=st.lists(st.booleans(), min_size=3, max_size=3),
       scale=st.sampled_from([1.0, 30.0, 1e3]))
def test_softmax_rows_sum_to_one(xb, on_device, axis, seed, shape, masked, broadcast, scale):
    rng = np.random.default_rng(seed)
    x = randn(rng, shape, on_device, scale)
    if masked:
        m = random_mask(rng, shape, axis, broadcast[:len(shape)])
        p = host(ops.softmax_forward(x, axis=axis, mask=on_device(m))[0])
        allowed = np.broadcast_to(m, tuple(shape))
    else:
        p = host(ops.softmax_forward(x, axis=axis)[0])
        allowed = np.ones(tuple(shape), bool)
    assert np.all(np.isfinite(p)) and np.all(p >= 0.0)
    assert np.all(p[~allowed] == 0.0)
    any_allowed = allowed.any(axis=axis)
    sums = p.sum(axis=axis)
    np.testing.assert_allclose(sums[any_allowed], 1.0, rtol=1e-12)
    assert np.all(sums[~any_allowed] == 0.0)


# =========================================================================== dropout invariants
@given(seed=seeds, shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       p=st.floats(0.0, 0.99))
def test_dropout_eval_is_identity(xb, on_device, seed, shape, p):
    rng = np.random.default_rng(seed)
    x = randn(rng, shape, on_device)
    dy = randn(rng, shape, on_device)
    y, cache = ops.dropout_forward(x, p, training=False)
    np.testing.assert_array_equal(host(y), host(x))
    np.testing.assert_array_equal(host(ops.dropout_backward(dy, cache)), host(dy))
    y0, cache0 = ops.dropout_forward(x, 0.0, training=True)  # p = 0 drops nothing
    np.testing.assert_array_equal(host(y0), host(x))
    np.testing.assert_array_equal(host(ops.dropout_backward(dy, cache0)), host(dy))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_training_keeps_the_mean(xb, on_device, p):
    n = 200_000
    backend.seed(1234)
    x = on_device(np.full((n,), 2.0))
    y, cache = ops.dropout_forward(x, p, training=True)
    y = host(y)
    # Each y_i is 2/(1-p) with probability 1-p, else 0: mean 2, std 2 sqrt(p/(1-p)).
    sigma = 2.0 * math.sqrt(p / (1.0 - p) / n)
    assert abs(y.mean() - 2.0) < 5 * sigma, (y.mean(), sigma)
    dropped = np.mean(y == 0.0)
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n), dropped
    assert set(np.unique(y)) <= {0.0, 2.0 / (1.0 - p)}
    # The backward uses the forward's mask: dx = dy * m / (1 - p).
    dx = host(ops.dropout_backward(on_device(np.ones(n)), cache))
    np.testing.assert_array_equal(dx * 2.0, y)


# =========================================================================== embedding
@given(seed=seeds, vocab=st.integers(1, 5), b=batch, t=length, d=width,
       rank=st.sampled_from([1, 2]))
def test_embedding(xb, on_device, seed, vocab, b, t, d, rank):
    rng = np.random.default_rng(seed)
    shape = (b, t) if rank == 2 else (b * t,)
    ids = rng.integers(0, vocab, size=shape)
    flat = ids.reshape(-1)
    if flat.size > 1:
        flat[-1] = flat[0]  # at least one repeated id
    table = randn(rng, (vocab, d), on_device)
    ids_dev = on_device(ids)
    assert_passes(check_op(ops.embedding_forward, ops.embedding_backward,
                           [ids_dev, table], [1]))
    # And explicitly: repeated ids accumulate.
    y, cache = ops.embedding_forward(ids_dev, table)
    dy = rng.standard_normal(tuple(y.shape))
    expected = np.zeros((vocab, d))
    for n, i in enumerate(flat):
        expected[i] += dy.reshape(-1, d)[n]
    np.testing.assert_allclose(host(ops.embedding_backward(on_device(dy), cache)), expected,
                               rtol=1e-12, atol=1e-12)


@given(seed=seeds, vocab=st.integers(1, 30_000), b=batch, t=length,
       buckets=st.sampled_from([1, 2, 7, 131_072]))
def test_hashed_bigrams_follow_the_formula(xb, on_device, seed, vocab, b, t, buckets):
    """Each position's pair id is the docstring's formula of (previous id, id), the row's
    first with previous id -1, computed here one position at a time in Python's integers."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(b, t))
    pairs = host(ops.hashed_bigrams(on_device(ids), buckets))
    p1, p2 = ops.embedding.BIGRAM_PRIMES
    expected = [[((int(ids[r, i - 1]) if i else -1) + 1) * p1 + int(ids[r, i]) * p2
                 for i in range(t)] for r in range(b)]
    np.testing.assert_array_equal(pairs, np.array(expected, dtype=object) % buckets)
    assert pairs.shape == (b, t) and 0 <= pairs.min() and pairs.max() < buckets


def test_hashed_bigrams_tell_word_order_apart(xb, on_device):
    """The pairs depend on order and on the start: "not good" and "good not" differ, and so
    do a word first in its row and the same word after another."""
    pairs = host(ops.hashed_bigrams(on_device(np.array([[5, 9], [9, 5]])), 131_072))
    assert pairs[0, 1] != pairs[1, 1] and pairs[0, 0] != pairs[1, 1] and pairs[0, 0] != pairs[0, 1]


# =========================================================================== positions
@given(seed=seeds, b=batch, t=length, d=width, extra=st.integers(0, 3))
def test_add_positions_sinusoidal(xb, on_device, seed, b, t, d, extra):
    rng = np.random.default_rng(seed)
    x = randn(rng, (b, t, d), on_device)
    table = ops.sinusoidal_table(t + extra, d)

    def backward(dy, cache):
        dx, _ = ops.add_positions_backward(dy, cache)  # a fixed table has no gradient
        return dx
    assert_passes(check_op(ops.add_positions_forward, backward, [x, table], [0]))


@given(seed=seeds, b=batch, t=length, d=width, extra=st.integers(0, 3))
def test_add_positions_learned(xb, on_device, seed, b, t, d, extra):
    rng = np.random.default_rng(seed)
    x = randn(rng, (b, t, d), on_device)
    table = randn(rng, (t + extra, d), on_device, 0.02)
    assert_passes(check_op(ops.add_positions_forward, ops.add_positions_backward,
                           [x, table], [0, 1]))


# =========================================================================== cross-entropy
@pytest.mark.parametrize("T", [ops, fast], ids=["textbook", "fast"])
@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("smoothing", ["none", "some"])
@given(seed=seeds, b=batch, t=length, v=st.integers(1, 5), eps=st.floats(0.01, 1.0),
       ignore_index=st.sampled_from([ops.IGNORE_INDEX, -1]), n_ignored=st.integers(0, 12))
def test_cross_entropy(xb, on_device, T, rank, smoothing, seed, b, t, v, eps, ignore_index,
                       n_ignored):
    rng = np.random.default_rng(seed)
    lead = (b, t) if rank == 3 else (b * t,)
    logits = randn(rng, lead + (v,), on_device, 2.0)
    targets = rng.integers(0, v, size=lead)
    flat = targets.reshape(-1)
    ignored = rng.permutation(flat.size)[:min(n_ignored, flat.size)]
    flat[ignored] = ignore_index  # possibly none, possibly every row
    kwargs = {"ignore_index": ignore_index,
              "label_smoothing": 0.0 if smoothing == "none" else eps}
    assert_passes(check_op(T.cross_entropy_forward, T.cross_entropy_backward,
                           [logits, on_device(targets)], [0], kwargs))


# =========================================================================== pooling
def distinct_values(rng, shape):
    """Random values at least 0.05 apart: max pooling's winner never changes under +-h."""
    n = int(np.prod(shape))
    return (rng.permutation(n) * 0.05 + rng.uniform(0, 0.01, n)).reshape(shape) - 0.025 * n


@pytest.mark.parametrize("how", ["mean", "max", "first"])
@given(seed=seeds, b=batch, t=length, d=width)
def test_pooling(xb, on_device, how, seed, b, t, d):
    rng = np.random.default_rng(seed)
    h = on_device(distinct_values(rng, (b, t, d)))
    valid = rng.integers(1, t + 1, size=b)  # 1 (a single token) up to t (no padding)
    valid[0] = t
    valid_dev = on_device(valid)
    assert_passes(check_op(ops.pool_forward, ops.pool_backward, [h, valid_dev], [0],
                           {"how": how}))
    # Padding positions get exactly zero gradient.
    y, cache = ops.pool_forward(h, valid_dev, how)
    dh = host(ops.pool_backward(on_device(rng.standard_normal(tuple(y.shape))), cache))
    padding = np.arange(t)[None, :] >= valid[:, None]
    assert np.all(dh[padding] == 0.0)


# =========================================================================== dtypes
def _dtype_cases(ops):
    """name -> f(rng, on_device, dtype) returning (outputs, gradients) of one op of the
    tier ``ops`` (npformer.ops or npformer.fast).

    Every input (upstream gradients included) goes through the ``on_device``
    argument ``od``, so a recording ``od`` sees them all."""
    def arr(rng, shape, on_device, dtype, scale=1.0):
        return on_device(rng.standard_normal(shape) * scale, dtype)

    def linear(rng, od, dt):
        x, w, b = arr(rng, (2, 3, 4), od, dt), arr(rng, (4, 5), od, dt), arr(rng, (5,), od, dt)
        y, c = ops.linear_forward(x, w, b)
        return [y], list(ops.linear_backward(arr(rng, (2, 3, 5), od, dt), c))

    def unary(fwd, bwd, **kw):
        def case(rng, od, dt):
            x = arr(rng, (2, 3, 4), od, dt)
            y, c = fwd(x, **kw)
            return [y], [bwd(arr(rng, (2, 3, 4), od, dt), c)]
        return case

    def dropout_train(rng, od, dt):
        backend.seed(3)
        return unary(ops.dropout_forward, ops.dropout_backward, p=0.4)(rng, od, dt)

    def layernorm(rng, od, dt):
        x, g, b = arr(rng, (2, 3, 4), od, dt), arr(rng, (4,), od, dt), arr(rng, (4,), od, dt)
        y, c = ops.layernorm_forward(x, g, b)
        return [y], list(ops.layernorm_backward(arr(rng, (2, 3, 4), od, dt), c))

    def rmsnorm(rng, od, dt):
        x, w = arr(rng, (2, 3, 4), od, dt), arr(rng, (4,), od, dt)
        y, c = ops.rmsnorm_forward(x, w)
        return [y], list(ops.rmsnorm_backward(arr(rng, (2, 3, 4), od, dt), c))

    def rotary(rng, od, dt):
        cos, sin = ops.rotary_table(od(np.array([[0, 1, 2], [7, 8, 9]])), 4,
                                    dtype=backend.float_dtype(dt))
        x = arr(rng, (2, 2, 3, 4), od, dt)
        y, c = ops.rotary_forward(x, cos, sin)
        return [y, cos, sin], [ops.rotary_backward(arr(rng, (2, 2, 3, 4), od, dt), c)]

    def swiglu(rng, od, dt):
        a, b = arr(rng, (2, 3, 4), od, dt, 3.0), arr(rng, (2, 3, 4), od, dt)
        h, c = ops.swiglu_forward(a, b)
        return [h], list(ops.swiglu_backward(arr(rng, (2, 3, 4), od, dt), c))

    def masked_softmax(rng, od, dt):
        x = arr(rng, (2, 3, 4), od, dt)
        m = rng.random((3, 4)) < 0.5
        m[0] = False
        y, c = ops.softmax_forward(x, axis=-1, mask=od(m))
        return [y], [ops.softmax_backward(arr(rng, (2, 3, 4), od, dt), c)]

    def attention(rng, od, dt):
        q, k, v = arr(rng, (2, 2, 3, 4), od, dt), arr(rng, (2, 2, 5, 4), od, dt), \
            arr(rng, (2, 2, 5, 3), od, dt)
        mask = ops.padding_mask(od(np.array([5, 2])), 5) & ops.causal_mask(3, 5)
        y, c = ops.attention_forward(q, k, v, mask)
        return [y], list(ops.attention_backward(arr(rng, (2, 2, 3, 3), od, dt), c))

    def embedding(rng, od, dt):
        table = arr(rng, (6, 4), od, dt)
        y, c = ops.embedding_forward(od(np.array([[1, 1, 5], [0, 2, 1]])), table)
        return [y], [ops.embedding_backward(arr(rng, (2, 3, 4), od, dt), c)]

    def positions(learned):
        def case(rng, od, dt):
            x = arr(rng, (2, 3, 4), od, dt)
            table = (arr(rng, (5, 4), od, dt) if learned
                     else ops.sinusoidal_table(5, 4, dtype=backend.float_dtype(dt)))
            y, c = ops.add_positions_forward(x, table)
            outs = [y] if learned else [y, table]
            return outs, list(ops.add_positions_backward(arr(rng, (2, 3, 4), od, dt), c))
        return case

    def cross_entropy(rng, od, dt):
        logits = arr(rng, (2, 3, 5), od, dt)
        targets = od(np.array([[1, -100, 4], [0, 0, 2]]))
        loss, c = ops.cross_entropy_forward(logits, targets, label_smoothing=0.1)
        return [loss], [ops.cross_entropy_backward(arr(rng, (), od, dt), c)]

    def pooling(how):
        def case(rng, od, dt):
            y, c = ops.pool_forward(arr(rng, (2, 3, 4), od, dt), od(np.array([3, 1])), how)
            return [y], [ops.pool_backward(arr(rng, (2, 4), od, dt), c)]
        return case

    return {
        "pool_mean": pooling("mean"),
        "pool_max": pooling("max"),
        "pool_first": pooling("first"),
        "linear": linear,
        "relu": unary(ops.relu_forward, ops.relu_backward),
        "gelu": unary(ops.gelu_forward, ops.gelu_backward),
        "gelu_tanh": unary(*ops.activation("gelu_tanh")),
        "dropout_train": dropout_train,
        "dropout_eval": unary(ops.dropout_forward, ops.dropout_backward, p=0.4, training=False),
        "layernorm": layernorm,
        "rmsnorm": rmsnorm,
        "rotary": rotary,
        "swiglu": swiglu,
        "softmax": unary(ops.softmax_forward, ops.softmax_backward, axis=1),
        "softmax_masked": masked_softmax,
        "log_softmax": unary(ops.log_softmax_forward, ops.log_softmax_backward),
        "attention": attention,
        "embedding": embedding,
        "positions_sinusoidal": positions(False),
        "positions_learned": positions(True),
        "cross_entropy": cross_entropy,
    }


DTYPE_CASES = {**_dtype_cases(ops),
               **{f"fast_{name}": case for name, case in _dtype_cases(fast).items()
                  if name in ("linear", "softmax", "softmax_masked", "attention",
                              "cross_entropy")}}


@pytest.mark.parametrize("op", sorted(DTYPE_CASES))
def test_ops_leave_their_inputs_untouched(xb, on_device, op):
    """Forward and backward never write into what they are given (in-place work is
    only for buffers an op allocated itself)."""
    created = []  # (backend array, host copy) of every input

    def od(host_data, dtype=None):
        a = on_device(host_data, dtype)
        created.append((a, host(a).copy()))
        return a
    outs, grads = DTYPE_CASES[op](np.random.default_rng(0), od, "float64")
    assert created
    for i, (a, before) in enumerate(created):
        np.testing.assert_array_equal(host(a), before, err_msg=f"{op} modified input {i}")
    # And a second run on the same inputs gives the same results.
    outs2, grads2 = DTYPE_CASES[op](np.random.default_rng(0), od, "float64")
    for a, b in zip(outs + grads, outs2 + grads2):
        np.testing.assert_array_equal(host(a), host(b))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", sorted(DTYPE_CASES))
def test_ops_keep_the_input_dtype(xb, on_device, op, dtype):
    # The default float is set to the *other* dtype: an op that builds arrays with
    # the default instead of its input's dtype is caught.
    backend.set_default_float("float64" if dtype == "float32" else "float32")
    expected = backend.float_dtype(dtype)
    outs, grads = DTYPE_CASES[op](np.random.default_rng(0), on_device, dtype)
    for i, a in enumerate(outs + grads):
        kind = "output" if i < len(outs) else "gradient"
        assert a.dtype == expected, f"{op}: {kind} {i} is {a.dtype}, expected {dtype}"
        assert np.all(np.isfinite(host(a))), f"{op}: {kind} {i} is not finite"
