"""Each fast op (npformer.fast) equals its textbook op (npformer.ops): outputs and every
gradient, in float64, to 1e-12 relative, on NumPy and the strict backend.

Shapes and masks are drawn by Hypothesis: padding (valid lengths down to 0: fully
masked query rows), causal (with a cached prefix, S > T), padding and causal together,
random masks of every broadcast shape with a fully masked row, cross-attention
(S != T), queries without leading axes; block sizes from one score per block up to
the default.  ``test_blocked_attention_paths`` checks by construction that the block
sizes used reach every path of the blocked op (single query rows, query ranges,
multi-row blocks, cut-off keys, skipped bias).

Where a formula subtracts (attention's dP - <dP, P>, layer norm's x - mu, GELU's
Phi(x) + x phi(x) at negative x), the difference is measured against the size of the
terms the formula adds, not of its result: :func:`assert_equal_to_terms`.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer import backend, fast, ops
from npformer.fast import attention as fast_attention
from npformer.ops.masks import align_mask

from .helpers import rel_diff

TOL = 1e-12
seeds = st.integers(0, 2**32 - 1)


def host(x):
    return backend.to_numpy(x)


def randn(rng, shape, scale=1.0):
    return backend.asarray(rng.standard_normal(tuple(shape)) * scale, dtype="float64")


def terms_diff(actual, expected, terms, floor: float = 0.0) -> float:
    """max |actual - expected| / max(terms): the difference of two evaluations of one
    formula relative to the magnitude of the terms it adds (at least ``floor``).

    ``terms`` is the formula evaluated with every operand replaced by its absolute value
    and every subtraction by an addition (host float64, broadcasting to ``expected``).
    The tiers evaluate the same formula in different orders (fused passes, blocked sums,
    their own exp), so each term is rounded differently, and their difference is a few
    roundings of the terms: bounded by the terms' size, not by the result's.  Where
    nothing cancels, terms = |expected| and this is :func:`rel_diff`.  Where terms
    cancel, the result can be any amount smaller than its terms, and no evaluation in
    this precision, the textbook's included, is closer to the truth than the terms'
    rounding (e.g. dk of a softmax row [2.8e-5, 0.99997]: the textbook op is 3.2e-12
    from a long-double reference, the fast one 1.2e-12)."""
    largest_term = float(np.max(np.asarray(terms, dtype=np.float64), initial=0.0))
    return rel_diff(actual, expected, at_least=max(largest_term, floor))


def assert_equal_to_terms(names, fast_values, textbook_values, terms, tol=TOL):
    """Each fast value equals the textbook's within ``tol`` of its terms' magnitude
    (:func:`terms_diff`), or within the dtype's smallest normal number: below it a
    result is subnormal (or flushed to 0) and has no relative precision left."""
    for name, a, b, t in zip(names, fast_values, textbook_values, terms):
        assert tuple(a.shape) == tuple(b.shape), f"{name}: shape {a.shape} != {b.shape}"
        d = terms_diff(a, b, t, floor=float(np.finfo(host(b).dtype).tiny) / tol)
        assert d <= tol, (f"{name}: fast differs from textbook by {d:.3e} relative to the "
                          "magnitude of the terms it adds")


def assert_equal_arrays(fast_values, textbook_values, names):
    for name, a, b in zip(names, fast_values, textbook_values):
        if b is None:
            assert a is None, f"{name}: fast gave an array where textbook gave None"
            continue
        assert tuple(a.shape) == tuple(b.shape), f"{name}: shape {a.shape} != {b.shape}"
        d = rel_diff(a, b)
        assert d <= TOL, f"{name}: fast differs from textbook by {d:.3e} (relative)"


# =========================================================================== attention
MASKS = ["none", "padding", "causal", "padding&causal", "random_BHTS", "random_B1TS",
         "random_11TS", "random_TS", "random_T1"]


def draw_mask(kind, rng, b, h, t, s):
    if kind == "none":
        return None
    if kind.startswith("random"):
        shape = {"random_BHTS": (b, h, t, s), "random_B1TS": (b, 1, t, s),
                 "random_11TS": (1, 1, t, s), "random_TS": (t, s), "random_T1": (t, 1)}[kind]
        m = rng.random(shape) < 0.6
        m[..., rng.integers(t), :] = False  # a fully masked query row
        return backend.asarray(m)
    mask = None
    if "padding" in kind:
        valid = rng.integers(0, s + 1, size=b)  # 0: a sequence with every key masked
        mask = ops.padding_mask(backend.asarray(valid), s)
    if "causal" in kind:
        causal = ops.causal_mask(t, s)
        mask = causal if mask is None else mask & causal
    return mask


def check_attention(rng, q, k, v, mask, block_scores):
    out_t, cache_t = ops.attention_forward(q, k, v, mask)
    out_f, cache_f = fast.attention_forward(q, k, v, mask, block_scores=block_scores)
    dout = randn(rng, out_t.shape)
    terms = attention_terms(q, k, v, mask, dout)
    assert_equal_to_terms(["out"], [out_f], [out_t], terms[:1])
    assert_equal_to_terms(["dq", "dk", "dv"], fast.attention_backward(dout, cache_f),
                          ops.attention_backward(dout, cache_t), terms[1:])


def attention_terms(q, k, v, mask, dout) -> tuple:
    """The magnitudes of the terms of out, dq, dk, dv (host float64; see
    :func:`terms_diff`), from the probabilities P >= 0 (0 where masked):
        out: P |V|        dP: |dO| |V|^T        dA: P (|dP| + rowsum(|dP| P))
        dq: alpha |dA| |K|     dk: alpha |dA|^T |Q|     dv: P^T |dO|"""
    p = host(ops.attention_weights(q, k, mask))  # (..., T, S)
    q_, k_, v_, do = (np.abs(host(a)) for a in (q, k, v, dout))
    alpha = 1.0 / np.sqrt(q_.shape[-1])
    mT = lambda a: np.swapaxes(a, -1, -2)  # noqa: E731
    dp = do @ mT(v_)  # (..., T, S)
    da = p * (dp + np.sum(dp * p, axis=-1, keepdims=True))
    return p @ v_, alpha * (da @ k_), alpha * (mT(da) @ q_), mT(p) @ do


@given(seed=seeds, kind=st.sampled_from(MASKS), cross=st.booleans(), b=st.integers(1, 3),
       h=st.integers(1, 3), t=st.integers(1, 5), s=st.integers(1, 5), e=st.integers(1, 4),
       f=st.integers(1, 4), block_scores=st.one_of(st.integers(1, 150),
                                                  st.just(fast.BLOCK_SCORES)))
def test_attention(xb, seed, kind, cross, b, h, t, s, e, f, block_scores):
    rng = np.random.default_rng(seed)
    if not cross:
        s = t  # self-attention
    if "causal" in kind:
        s = max(s, t)  # a causal mask needs S >= T (S > T: a cached prefix)
    q = randn(rng, (b, h, t, e), scale=2.0)
    k, v = randn(rng, (b, h, s, e), scale=2.0), randn(rng, (b, h, s, f))
    check_attention(rng, q, k, v, draw_mask(kind, rng, b, h, t, s), block_scores)


@given(seed=seeds, t=st.integers(1, 5), extra=st.integers(0, 3), e=st.integers(1, 4),
       causal=st.booleans(), block_scores=st.integers(1, 40))
def test_attention_without_leading_axes(xb, seed, t, extra, e, causal, block_scores):
    """Queries (T, E): one row of blocks, cut by queries only."""
    rng = np.random.default_rng(seed)
    s = t + extra
    q, k, v = randn(rng, (t, e)), randn(rng, (s, e)), randn(rng, (s, e))
    check_attention(rng, q, k, v, ops.causal_mask(t, s) if causal else None, block_scores)


def _paths(q, k, mask, block_scores):
    """Which paths of the blocked op a call takes (from its block walk)."""
    bias = None if mask is None else ops.softmax.mask_bias(mask, q.dtype)
    mask = align_mask(mask, q.ndim)
    bias = align_mask(bias, q.ndim)
    seen = set()
    extents = fast_attention._key_extents(mask)
    for rows, keys, block_bias, _ in fast_attention._blocks(q, k, extents, bias, block_scores):
        row, query = rows[0], rows[-2]
        queries = query.stop - query.start
        if queries == 1 and q.shape[-2] > 1:
            seen.add("single query rows")
        elif queries < q.shape[-2]:
            seen.add("query ranges")
        if row.stop - row.start > 1:
            seen.add("multi-row blocks")
        if keys[-2].stop < k.shape[-2]:
            seen.add("cut-off keys")
        if mask is not None and block_bias is None:
            seen.add("skipped bias")
        if block_bias is not None:
            seen.add("bias")
    return seen


PATH_CASES = [  # (B, H, T, S, mask kind, block_scores, the paths it must take)
    (2, 2, 4, 4, "padding", 1, {"single query rows", "cut-off keys", "skipped bias"}),
    (2, 2, 4, 4, "padding&causal", 16, {"query ranges", "cut-off keys", "bias"}),
    (3, 2, 3, 3, "padding", 1 << 19, {"multi-row blocks", "cut-off keys", "bias"}),
    (3, 2, 3, 5, "causal", 60, {"multi-row blocks", "bias"}),
    (2, 1, 4, 4, "causal", 4, {"single query rows", "cut-off keys", "skipped bias"}),
]


@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: f"{c[4]}-{c[5]}")
def test_blocked_attention_paths(xb, case):
    """Each case takes the paths it names, and the fast op equals the textbook op on it."""
    b, h, t, s, kind, block_scores, paths = case
    rng = np.random.default_rng(7)
    q, k, v = randn(rng, (b, h, t, 3)), randn(rng, (b, h, s, 3)), randn(rng, (b, h, s, 2))
    if "padding" in kind:
        lens = np.array([s - 1, 1, 2][:b])  # every row padded: keys past the longest are cut
        mask = ops.padding_mask(backend.asarray(lens), s)
        if "causal" in kind:
            mask = mask & ops.causal_mask(t, s)
    else:
        mask = ops.causal_mask(t, s)
    assert paths <= _paths(q, k, mask, block_scores), _paths(q, k, mask, block_scores)
    check_attention(rng, q, k, v, mask, block_scores)


def test_block_scores_must_be_positive(xb):
    q = randn(np.random.default_rng(0), (1, 1, 2, 2))
    with pytest.raises(ValueError, match="block_scores must be at least 1, got 0"):
        fast.attention_forward(q, q, q, block_scores=0)

@given(seed=seeds, kind=st.sampled_from(["none", "causal", "padding&causal", "random_B1TS"]),
       b=st.integers(1, 2), kv_heads=st.integers(1, 2), groups=st.integers(1, 3),
       t=st.integers(1, 5), e=st.integers(1, 4))
def test_grouped_attention(xb, seed, kind, b, kv_heads, groups, t, e):
    """The fast grouped-query attention (blocked attention over the repeated heads) equals
    the textbook op: out, dq, and the group sums dk, dv, within 1e-12 of their terms."""
    from npformer.ops.grouped_attention import repeat_heads

    rng = np.random.default_rng(seed)
    h = kv_heads * groups
    q, k, v = randn(rng, (b, h, t, e)), randn(rng, (b, kv_heads, t, e)), \
        randn(rng, (b, kv_heads, t, e))
    mask = draw_mask(kind, rng, b, h, t, t)
    out_t, cache_t = ops.grouped_attention_forward(q, k, v, mask)
    out_f, cache_f = fast.grouped_attention_forward(q, k, v, mask)
    dout = randn(rng, out_t.shape)
    terms = attention_terms(q, repeat_heads(k, groups), repeat_heads(v, groups), mask, dout)
    grouped = [terms[0], terms[1]] + [np.sum(np.reshape(a, (b, kv_heads, groups, t, e)), axis=2)
                                      for a in terms[2:]]
    assert_equal_to_terms(["out"], [out_f], [out_t], grouped[:1])
    assert_equal_to_terms(["dq", "dk", "dv"], fast.grouped_attention_backward(dout, cache_f),
                          ops.grouped_attention_backward(dout, cache_t), grouped[1:])



# =========================================================================== softmax
@given(seed=seeds, shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       masked=st.booleans(), overwrite=st.booleans(), scale=st.sampled_from([1.0, 30.0]))
def test_softmax(xb, seed, shape, masked, overwrite, scale):
    rng = np.random.default_rng(seed)
    x = randn(rng, shape, scale)
    mask = None
    if masked:
        m = rng.random(shape) < 0.6
        m[..., 0] = False if len(shape) > 1 else m[..., 0]
        mask = backend.asarray(m)
    p_t, cache_t = ops.softmax_forward(x, axis=-1, mask=mask)
    x_copy = backend.asarray(host(x))  # the fast op may overwrite its own copy
    p_f, cache_f = fast.softmax_forward(x_copy, axis=-1, mask=mask, overwrite_input=overwrite)
    assert_equal_arrays([p_f], [p_t], ["p"])
    dp = randn(rng, shape)
    dx_t = ops.softmax_backward(dp, cache_t)
    dx_f = fast.softmax_backward(backend.asarray(host(dp)), cache_f, overwrite_input=overwrite)
    assert_equal_arrays([dx_f], [dx_t], ["dx"])


# =========================================================================== cross-entropy
@given(seed=seeds, lead=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       vocab=st.integers(1, 7), smoothing=st.sampled_from([0.0, 0.1, 1.0]),
       ignored=st.floats(0.0, 1.0), ignore_index=st.sampled_from([-100, 0]),
       dloss=st.sampled_from([1.0, 0.25]), overwrite=st.booleans())
def test_cross_entropy(xb, seed, lead, vocab, smoothing, ignored, ignore_index, dloss,
                       overwrite):
    """Loss and gradient equal the textbook op's; with ``overwrite_logits`` the gradient
    is the same numbers, written over the fast forward's own (N, V) array."""
    rng = np.random.default_rng(seed)
    logits = randn(rng, lead + [vocab], scale=3.0)
    targets = rng.integers(0, vocab, size=lead)
    targets = np.where(rng.random(lead) < ignored, ignore_index, targets)  # some (or all) ignored
    targets = backend.asarray(targets)
    logits_copy = backend.asarray(host(logits))  # the fast backward may overwrite its copy
    loss_t, cache_t = ops.cross_entropy_forward(logits, targets, ignore_index, smoothing)
    loss_f, cache_f = fast.cross_entropy_forward(logits_copy, targets, ignore_index, smoothing)
    assert_equal_arrays([loss_f], [loss_t], ["loss"])
    kept = cache_f.values[0]  # the (N, V) array the forward kept: the logits, or p
    kept = getattr(kept, "logits", kept)
    dz_f = fast.cross_entropy_backward(dloss, cache_f, overwrite_logits=overwrite)
    assert_equal_arrays([dz_f], [ops.cross_entropy_backward(dloss, cache_t)], ["dlogits"])
    if type(dz_f) is np.ndarray:  # NumPy: written over the kept buffer exactly when asked
        assert np.shares_memory(dz_f, kept) == overwrite


@given(seed=seeds, lead=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       vocab=st.integers(1, 7), smoothing=st.sampled_from([0.0, 0.1]))
def test_cross_entropy_with_gradient(xb, seed, lead, vocab, smoothing):
    """A training step's loss and gradient: the fast tier's is the textbook's, the gradient
    written over the logits' own buffer (NumPy)."""
    rng = np.random.default_rng(seed)
    logits = randn(rng, lead + [vocab], scale=3.0)
    targets = backend.asarray(rng.integers(0, vocab, size=lead))
    loss_t, dz_t = ops.cross_entropy_with_gradient(logits, targets, 0.5,
                                                   label_smoothing=smoothing)
    mine = backend.asarray(host(logits))
    loss_f, dz_f = fast.cross_entropy_with_gradient(mine, targets, 0.5,
                                                    label_smoothing=smoothing)
    assert_equal_arrays([loss_f, dz_f], [loss_t, dz_t], ["loss", "dlogits"])
    if type(dz_f) is np.ndarray:
        assert np.shares_memory(dz_f, mine) and not np.shares_memory(dz_t, logits)


# =========================================================================== linear
@given(seed=seeds, lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
       d_in=st.integers(1, 5), d_out=st.integers(1, 5), bias=st.booleans())
def test_linear(xb, seed, lead, d_in, d_out, bias):
    rng = np.random.default_rng(seed)
    x, w = randn(rng, lead + [d_in]), randn(rng, (d_in, d_out))
    b = randn(rng, (d_out,)) if bias else None
    y_t, cache_t = ops.linear_forward(x, w, b)
    y_f, cache_f = fast.linear_forward(x, w, b)
    assert_equal_arrays([y_f], [y_t], ["y"])
    dy = randn(rng, lead + [d_out])
    assert_equal_arrays(fast.linear_backward(dy, cache_f), ops.linear_backward(dy, cache_t),
                        ["dx", "dw", "db"])


# =========================================================================== relu
@given(seed=seeds, shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
       zeros=st.floats(0.0, 1.0), via_activation=st.booleans())
def test_relu(xb, seed, shape, zeros, via_activation):
    """The fast ReLU (sign(y) from the output, in place) equals the plain textbook one,
    outputs and gradients, with exact zeros (the kink, gradient 0 in both) and -0.0."""
    rng = np.random.default_rng(seed)
    x_host = rng.standard_normal(tuple(shape))
    x_host[rng.random(tuple(shape)) < zeros / 2] = 0.0
    x_host[rng.random(tuple(shape)) < zeros / 4] = -0.0
    x = backend.asarray(x_host, dtype="float64")
    pairs = {tier: (tier.activation("relu") if via_activation
                    else (tier.relu_forward, tier.relu_backward)) for tier in (fast, ops)}
    y_f, cache_f = pairs[fast][0](x)
    y_t, cache_t = pairs[ops][0](x)
    assert_equal_arrays([y_f], [y_t], ["y"])
    dy = randn(rng, shape)
    assert_equal_arrays([pairs[fast][1](dy, cache_f)], [pairs[ops][1](dy, cache_t)], ["dx"])


def test_each_tier_has_its_relu_and_gelu():
    assert fast.activation("relu") == (fast.relu_forward, fast.relu_backward)
    assert ops.activation("relu") == (ops.relu_forward, ops.relu_backward)
    assert fast.activation("gelu") == (fast.gelu_forward, fast.gelu_backward)
    assert fast.activation("gelu_tanh") == (fast.activations.gelu_tanh_forward,
                                            fast.activations.gelu_tanh_backward)
    assert ops.activation("gelu_tanh") == (ops.activations.gelu_tanh_forward,
                                           ops.activations.gelu_tanh_backward)


# =========================================================================== gelu (exact)
@given(seed=seeds, shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
       scale=st.sampled_from([1e-3, 1.0, 4.0, 40.0]), dtype=st.sampled_from(["float64",
                                                                             "float32"]))
def test_gelu(xb, seed, shape, scale, dtype):
    """The fast exact GELU (numba kernels on NumPy, erfc from CuPy's special functions on
    CuPy) equals the textbook one (the array-API rational erfc, a few ulps from the true
    value): outputs and gradients within 1e-12 in float64 (1e-6 in float32), over small,
    ordinary and large inputs (both tails) and exact zeros."""
    rng = np.random.default_rng(seed)
    x_host = np.asarray(scale * rng.standard_normal(tuple(shape)))
    x_host[rng.random(tuple(shape)) < 0.1] = 0.0
    x = backend.asarray(x_host, dtype=dtype)
    (f_fwd, f_bwd), (t_fwd, t_bwd) = fast.activation("gelu"), ops.activation("gelu")
    (y_f, cache_f), (y_t, cache_t) = f_fwd(x), t_fwd(x)
    dy = backend.asarray(rng.standard_normal(tuple(shape)), dtype=dtype)
    tol = 1e-12 if dtype == "float64" else 1e-6
    dx_f, dx_t = f_bwd(dy, cache_f), t_bwd(dy, cache_t)
    assert y_f.dtype == y_t.dtype and dx_f.dtype == dx_t.dtype
    assert_equal_to_terms(["y", "dx"], [y_f, dx_f], [y_t, dx_t], gelu_terms(x, dy), tol)


def gelu_terms(x, dy) -> tuple:
    """The magnitudes of the terms of y = x Phi(x) and dx = dy (Phi(x) + x phi(x)) (host
    float64; see :func:`terms_diff`).  Both exponentials, exp(-x^2/2) in phi and in the
    tail 1 - Phi(|x|) = Phi(-|x|), have an exponent rounded at the size of x^2/2: the
    tail's terms are Phi(-|x|) (1 + x^2/2), and phi's phi(x) (1 + x^2/2).  So
        y: |x| (Phi(x) + Phi(-|x|) x^2/2)
        dx: |dy| (Phi(x) + Phi(-|x|) x^2/2 + |x| phi(x) (1 + x^2/2))
    The two terms of dx cancel near x = -0.75 (Phi = 0.227, x phi = -0.226); at x = -10
    the exponent's rounding alone moves float32's y by 3e-6 of itself, in both tiers."""
    x_, dy_ = (np.asarray(host(a), dtype=np.float64) for a in (x, dy))
    erfc = np.vectorize(math.erfc, otypes=[np.float64])
    cdf, tail = 0.5 * erfc(-x_ / math.sqrt(2.0)), 0.5 * erfc(np.abs(x_) / math.sqrt(2.0))
    exponent = 0.5 * x_ * x_
    pdf = np.exp(-exponent) / math.sqrt(2.0 * math.pi)
    cdf_terms = cdf + tail * exponent
    return (np.abs(x_) * cdf_terms,
            np.abs(dy_) * (cdf_terms + np.abs(x_) * pdf * (1.0 + exponent)))


# =========================================================================== gelu (tanh form)
@given(seed=seeds, shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
       scale=st.sampled_from([1e-6, 1e-3, 1.0, 4.0, 40.0]),
       dtype=st.sampled_from(["float64", "float32"]))
def test_gelu_tanh(xb, seed, shape, scale, dtype):
    """The fast tanh GELU (one compiled pass each way on NumPy, tanh from its exp) equals
    the textbook op (NumPy's tanh): y, its cache's t and dx within 1e-12 in float64 (1e-6
    in float32) of their terms' magnitude, over tiny, ordinary and large inputs (both
    tails: t = -1 and 1) and exact zeros; the recomputed output is the forward's, bit for
    bit."""
    from npformer.fast.recompute import activation_output

    rng = np.random.default_rng(seed)
    x_host = np.asarray(scale * rng.standard_normal(tuple(shape)))
    x_host[rng.random(tuple(shape)) < 0.1] = 0.0
    x = backend.asarray(x_host, dtype=dtype)
    (f_fwd, f_bwd), (t_fwd, t_bwd) = fast.activation("gelu_tanh"), ops.activation("gelu_tanh")
    (y_f, cache_f), (y_t, cache_t) = f_fwd(x), t_fwd(x)
    dy = backend.asarray(rng.standard_normal(tuple(shape)), dtype=dtype)
    tol = 1e-12 if dtype == "float64" else 1e-6
    dx_f, dx_t = f_bwd(dy, cache_f), t_bwd(dy, cache_t)
    assert y_f.dtype == y_t.dtype and dx_f.dtype == dx_t.dtype
    x_, dy_ = (np.abs(np.asarray(host(a), dtype=np.float64)) for a in (x, dy))
    t_ = np.abs(np.asarray(host(cache_t.values[1]), dtype=np.float64))
    c, a = ops.activations.GELU_C, ops.activations.GELU_A
    terms = (0.5 * x_ * (1 + t_), np.ones_like(t_),  # y; t (its absolute error: of 1)
             dy_ * (0.5 * (1 + t_) + 0.5 * x_ * (1 + t_ * t_) * c * (1 + 3 * a * x_ * x_)))
    assert_equal_to_terms(["y", "t", "dx"], [y_f, cache_f.values[1], dx_f],
                          [y_t, cache_t.values[1], dx_t], terms, tol)
    np.testing.assert_array_equal(host(activation_output("gelu_tanh")(cache_f.values)),
                                  host(y_f))


# =========================================================================== layer norm
@given(seed=seeds, lead=st.lists(st.integers(0, 4), min_size=0, max_size=2),
       d=st.integers(1, 40), scale=st.sampled_from([1e-3, 1.0, 30.0]),
       offset=st.sampled_from([0.0, 5.0]), dtype=st.sampled_from(["float64", "float32"]))
def test_layernorm(xb, seed, lead, d, scale, offset, dtype):
    """The fast layer norm (one compiled kernel each way on NumPy) equals the textbook
    op: y and dx, dgamma, dbeta within 1e-12 in float64 (1e-5 in float32, whose
    textbook op rounds every pass) of their terms' magnitude, for rows of any width,
    shifted and scaled rows (rows of spread 1e-3 around 5 lose a third of their digits to
    the mean in both ops: x - mu cancels, see :func:`layernorm_terms`), and no rows."""
    rng = np.random.default_rng(seed)
    as_dtype = lambda a: backend.asarray(a, dtype=dtype)  # noqa: E731
    x = as_dtype(offset + scale * rng.standard_normal(tuple(lead) + (d,)))
    gamma, beta = as_dtype(rng.standard_normal(d)), as_dtype(rng.standard_normal(d))
    dy = as_dtype(rng.standard_normal(tuple(lead) + (d,)))
    assert_layernorm_equal(x, gamma, beta, dy, 1e-12 if dtype == "float64" else 1e-5)


def assert_layernorm_equal(x, gamma, beta, dy, tol=TOL):
    """The fast layer norm's y, dx, dgamma, dbeta equal the textbook's within ``tol``."""
    y_t, cache_t = ops.layernorm_forward(x, gamma, beta)
    y_f, cache_f = fast.layernorm_forward(x, gamma, beta)
    names = ["y", "dx", "dgamma", "dbeta"]
    got = [y_f, *fast.layernorm_backward(dy, cache_f)]
    want = [y_t, *ops.layernorm_backward(dy, cache_t)]
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype, name
    assert_equal_to_terms(names, got, want, layernorm_terms(x, gamma, beta, dy), tol)


def layernorm_terms(x, gamma, beta, dy) -> tuple:
    """The magnitudes of the terms of y, dx, dgamma, dbeta (host float64; see
    :func:`terms_diff`).  The centred row x - mu is rounded at the size of |x| + |mu|,
    so x-hat's terms are X = (|x| + |mu|) r (r = 1 / sqrt(var + eps)); with
    G = |dy gamma|:
        y: |gamma| X + |beta|      dgamma: sum |dy| X      dbeta: sum |dy|
        dx: r (G + mean(G) + X mean(G X))
    For rows of spread 1e-3 around 5, X is 5,000 times x-hat: x - mu cancels."""
    x_, g_, b_, dy_ = (np.asarray(host(a), dtype=np.float64) for a in (x, gamma, beta, dy))
    d = x_.shape[-1]
    mu = np.mean(x_, axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(np.var(x_, axis=-1, keepdims=True) + ops.layernorm.EPS)
    big_x = (np.abs(x_) + np.abs(mu)) * r  # (..., D)
    big_g = np.abs(dy_ * g_)
    dx = r * (big_g + np.mean(big_g, axis=-1, keepdims=True)
              + big_x * np.mean(big_g * big_x, axis=-1, keepdims=True))
    rows = lambda a: a.reshape(-1, d)  # noqa: E731
    return (np.abs(g_) * big_x + np.abs(b_), dx, np.sum(rows(np.abs(dy_) * big_x), axis=0),
            np.sum(rows(np.abs(dy_)), axis=0))


def test_layernorm_refuses_what_the_textbook_refuses():
    """Bad shapes reach the textbook op's checks (not a kernel's index error)."""
    x = np.ones((2, 3))
    with pytest.raises(ValueError, match="last"):
        fast.layernorm_forward(x, np.ones(4), np.ones(4))
    with pytest.raises(ValueError, match="weight and bias"):
        fast.layernorm_forward(x, np.ones(3), np.ones(2))


# =========================================================================== dropout
@given(seed=seeds, shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
       p=st.sampled_from([0.0, 0.1, 0.5, 0.9]), training=st.booleans(),
       dtype=st.sampled_from(["float64", "float32"]))
def test_dropout(xb, seed, shape, p, training, dtype):
    """The fast dropout (the keep mask cached as booleans) equals the textbook op drawn
    from the same generator state: output and gradient bit for bit, in either dtype."""
    rng = np.random.default_rng(seed)
    x = backend.asarray(rng.standard_normal(tuple(shape)), dtype=dtype)
    dy = backend.asarray(rng.standard_normal(tuple(shape)), dtype=dtype)
    results = []
    for tier in (fast, ops):
        backend.seed(seed)
        y, cache = tier.dropout_forward(x, p, training)
        results.append((host(y), host(tier.dropout_backward(dy, cache)), cache.values))
    (y_f, dx_f, saved_f), (y_t, dx_t, _) = results
    for name, got, want in (("y", y_f, y_t), ("dx", dx_f, dx_t)):
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    if training and p > 0.0:
        assert host(saved_f[0]).dtype == np.bool_  # one byte an element, not a float mask


# =========================================================================== embedding
@given(seed=seeds, lead=st.lists(st.integers(0, 4), min_size=0, max_size=2),
       vocab=st.integers(1, 6), d=st.integers(1, 9), contiguous=st.booleans(),
       dtype=st.sampled_from(["float64", "float32"]))
def test_embedding(xb, seed, lead, vocab, d, contiguous, dtype):
    """The fast embedding backward (the scatter-add as one compiled loop on NumPy) equals
    the textbook's bit for bit: the same additions in the same order, repeated ids (a
    small vocabulary makes them common) and no positions at all included, from a
    contiguous upstream gradient or a strided one (the textbook path)."""
    rng = np.random.default_rng(seed)
    ids = backend.asarray(rng.integers(0, vocab, size=tuple(lead)))
    table = backend.asarray(rng.standard_normal((vocab, d)), dtype=dtype)
    _, cache = ops.embedding_forward(ids, table)
    dy = backend.asarray(rng.standard_normal(tuple(lead) + (d if contiguous else 2 * d,)),
                         dtype=dtype)
    dy = dy if contiguous else dy[..., ::2]
    got, want = host(fast.embedding_backward(dy, cache)), host(ops.embedding_backward(dy, cache))
    assert got.dtype == want.dtype and got.shape == (vocab, d)
    np.testing.assert_array_equal(got, want)


# ============================================================== RMS norm, SwiGLU, rotary
@given(seed=seeds, lead=st.lists(st.integers(0, 4), min_size=0, max_size=2),
       d=st.integers(1, 40), scale=st.sampled_from([1e-3, 1.0, 30.0]),
       dtype=st.sampled_from(["float64", "float32"]))
def test_rmsnorm(xb, seed, lead, d, scale, dtype):
    """The fast RMS norm (one compiled kernel each way on NumPy) equals the textbook op:
    y, dx and dweight within 1e-12 in float64 (1e-5 in float32) of their terms'
    magnitude, for rows of any width and scale, and no rows."""
    rng = np.random.default_rng(seed)
    as_dtype = lambda a: backend.asarray(a, dtype=dtype)  # noqa: E731
    x = as_dtype(scale * rng.standard_normal(tuple(lead) + (d,)))
    weight, dy = as_dtype(rng.standard_normal(d)), as_dtype(rng.standard_normal(x.shape))
    y_t, cache_t = ops.rmsnorm_forward(x, weight)
    y_f, cache_f = fast.rmsnorm_forward(x, weight)
    names = ["y", "dx", "dweight"]
    got = [y_f, *fast.rmsnorm_backward(dy, cache_f)]
    want = [y_t, *ops.rmsnorm_backward(dy, cache_t)]
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype, name
    assert_equal_to_terms(names, got, want, rmsnorm_terms(x, weight, dy),
                          1e-12 if dtype == "float64" else 1e-5)


def rmsnorm_terms(x, weight, dy) -> tuple:
    """The magnitudes of the terms of y, dx, dweight (host float64; see :func:`terms_diff`):
    with X = |x-hat| and G = |dy weight|, y: |weight| X; dx: r (G + X mean(G X));
    dweight: sum |dy| X."""
    x_, w_, dy_ = (np.asarray(host(a), dtype=np.float64) for a in (x, weight, dy))
    d = x_.shape[-1]
    r = 1.0 / np.sqrt(np.mean(x_ * x_, axis=-1, keepdims=True) + ops.rmsnorm.EPS)
    big_x, big_g = np.abs(x_) * r, np.abs(dy_ * w_)
    dx = r * (big_g + big_x * np.mean(big_g * big_x, axis=-1, keepdims=True))
    return (np.abs(w_) * big_x, dx, np.sum((np.abs(dy_) * big_x).reshape(-1, d), axis=0))


@given(seed=seeds, shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
       scale=st.sampled_from([1.0, 30.0, 800.0]), dtype=st.sampled_from(["float64", "float32"]))
def test_swiglu(xb, seed, shape, scale, dtype):
    """The fast gated SiLU (one compiled pass each way) equals the textbook op: h, da, db
    within 1e-12 in float64 (1e-6 in float32) of their terms, gates far out in both
    tails included (scale 800: e^{-a} would overflow there)."""
    rng = np.random.default_rng(seed)
    a, b, dh = (backend.asarray(rng.standard_normal(tuple(shape)) * k, dtype=dtype)
                for k in (scale, 1.0, 1.0))
    h_t, cache_t = ops.swiglu_forward(a, b)
    h_f, cache_f = fast.swiglu_forward(a, b)
    s = np.asarray(host(cache_t.values[2]), dtype=np.float64)
    a_, b_, dh_ = (np.abs(np.asarray(host(v), dtype=np.float64)) for v in (a, b, dh))
    terms = (a_ * s * b_, dh_ * b_ * s * (1.0 + a_ * (1.0 - s)), dh_ * a_ * s)
    assert_equal_to_terms(["h", "da", "db"], [h_f, *fast.swiglu_backward(dh, cache_f)],
                          [h_t, *ops.swiglu_backward(dh, cache_t)], terms,
                          1e-12 if dtype == "float64" else 1e-6)


def test_swiglu_nan_and_inf_as_the_textbook():
    """Infinite and NaN gates and inputs give the textbook's values, NaN where it has NaN."""
    a = np.array([np.inf, -np.inf, np.nan, 0.0, 1.0, -1.0])
    b = np.array([1.0, 1.0, 1.0, np.inf, np.nan, -np.inf])
    dh = np.ones(6)
    h_t, cache_t = ops.swiglu_forward(a, b)
    h_f, cache_f = fast.swiglu_forward(a, b)
    for got, want in zip([h_f, *fast.swiglu_backward(dh, cache_f)],
                         [h_t, *ops.swiglu_backward(dh, cache_t)]):
        np.testing.assert_array_equal(got, want)


@given(seed=seeds, b=st.integers(1, 3), h=st.integers(1, 3), t=st.integers(0, 5),
       half=st.integers(1, 4), per_row=st.booleans(), view=st.booleans(),
       dtype=st.sampled_from(["float64", "float32"]))
def test_rotary(xb, seed, b, h, t, half, per_row, view, dtype):
    """The fast rotary op (each pair turned in one compiled pass) equals the textbook op
    bit for bit, the same two products summed in the same order: tables shared by the
    batch or one per row (left padding, a cache's offset), on contiguous heads or on the
    (B, T, H, E) view a projection's heads are."""
    rng = np.random.default_rng(seed)
    e = 2 * half
    raw = rng.standard_normal((b, t, h, e) if view else (b, h, t, e))
    x = backend.asarray(raw, dtype=dtype)
    x = backend.namespace_of(x).permute_dims(x, (0, 2, 1, 3)) if view else x  # (B, H, T, E)
    positions = rng.integers(0, 50, size=(b, t) if per_row else (t,))
    xp = backend.namespace_of(x)
    cos, sin = ops.rotary_table(backend.asarray(positions), e, dtype=getattr(xp, dtype))
    dy = backend.asarray(rng.standard_normal((b, h, t, e)), dtype=dtype)
    y_t, cache_t = ops.rotary_forward(x, cos, sin)
    y_f, cache_f = fast.rotary_forward(x, cos, sin)
    for name, got, want in (("y", y_f, y_t), ("dx", fast.rotary_backward(dy, cache_f),
                                              ops.rotary_backward(dy, cache_t))):
        assert host(got).dtype == host(want).dtype, name
        np.testing.assert_array_equal(host(got), host(want), err_msg=name)


# =========================================================================== the tier's namespace
def test_every_fast_op_is_tested_and_the_rest_are_the_textbook_ops():
    tested = {"attention", "softmax", "cross_entropy", "cross_entropy_with", "linear", "relu",
              "gelu", "layernorm", "activation", "dropout", "embedding", "rmsnorm", "swiglu",
              "rotary", "grouped_attention"}
    assert {name.rsplit("_", 1)[0] for name in fast.FAST_OPS} == tested
    for name in fast.FAST_OPS:
        assert getattr(fast, name) is not getattr(ops, name), name
    for name in set(ops.__all__) - set(fast.FAST_OPS):  # every other name of the textbook's
        if not isinstance(getattr(ops, name), type(ops)):  # its submodules aside
            assert getattr(fast, name) is getattr(ops, name), name
