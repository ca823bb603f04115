"""Grouped-query attention (npformer.ops.grouped_attention): gradient checks, PyTorch parity
and errors.

Gradient checks (Hypothesis, float64, both backends of ``xb``): H query heads over Hkv
key/value heads for every divisor Hkv of H (1: multi-query; H: multi-head), masks none,
causal, padding & causal and random with fully masked rows.  Invariants: Hkv = H is plain
attention; the forward equals attention over the keys and values repeated per group.
Parity: torch's scaled_dot_product_attention over ``repeat_interleave``d keys and values
(Hugging Face's ``repeat_kv``), autograd summing each group's gradient, float32 and
float64 (1e-10).  Errors: H not a multiple of Hkv, and the shapes, named.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer import backend, ops
from npformer.gradcheck import check_op
from npformer.ops.grouped_attention import grouped_attention_backward, grouped_attention_forward

from .conftest import using_backend
from .helpers import GRADCHECK_TOL, PARITY_RTOL, assert_close, raises_naming, to_host, to_torch

seeds = st.integers(0, 2**32 - 1)
MASKS = ["none", "causal", "padding&causal", "random"]


def heads_and_kv_heads():
    """(H, Hkv) with Hkv dividing H: every grouping from multi-query to multi-head."""
    return st.integers(1, 6).flatmap(lambda h: st.tuples(
        st.just(h), st.sampled_from([g for g in range(1, h + 1) if h % g == 0])))


def make_mask(kind, rng, b, t, s):
    """A host boolean mask broadcasting to (B, H, T, S), or None."""
    if kind == "none":
        return None
    if kind == "random":
        m = rng.random((b, 1, t, s)) < 0.6
        m[..., rng.integers(t), :] = False  # a fully masked query row
        return m
    causal = np.tril(np.ones((t, s), bool), k=s - t)
    if kind == "causal":
        return causal
    valid = rng.integers(1, s + 1, size=b)
    return causal[None, None] & (np.arange(s)[None, :] < valid[:, None])[:, None, None, :]


def inputs(rng, b, h, kv, t, s, e, f, kind):
    s = s + t - 1 if "causal" in kind else s  # a causal mask needs S >= T
    q = rng.standard_normal((b, h, t, e))
    k = rng.standard_normal((b, kv, s, e))
    v = rng.standard_normal((b, kv, s, f))
    return q, k, v, make_mask(kind, rng, b, t, s)


shapes = dict(seed=seeds, b=st.integers(1, 2), heads=heads_and_kv_heads(),
              t=st.integers(1, 4), s=st.integers(1, 4), e=st.integers(1, 4),
              f=st.integers(1, 3))


# =========================================================================== gradient checks
@pytest.mark.parametrize("kind", MASKS)
@given(**shapes)
def test_gradcheck(xb, on_device, kind, seed, b, heads, t, s, e, f):
    h, kv = heads
    q, k, v, mask = inputs(np.random.default_rng(seed), b, h, kv, t, s, e, f, kind)
    mask = None if mask is None else on_device(mask)
    result = check_op(grouped_attention_forward, grouped_attention_backward,
                      [on_device(q), on_device(k), on_device(v), mask], [0, 1, 2])
    assert result.worst_error < GRADCHECK_TOL, f"gradient check failed:\n{result}"


@given(**shapes)
def test_equals_attention_over_repeated_heads(xb, on_device, seed, b, heads, t, s, e, f):
    """Forward: attention over each kv head repeated over its group; backward: attention's
    key/value gradients summed over each group (one kv head per group of G query heads)."""
    h, kv = heads
    rng = np.random.default_rng(seed)
    q, k, v, mask = inputs(rng, b, h, kv, t, s, e, f, "padding&causal")
    groups = h // kv
    out, cache = grouped_attention_forward(on_device(q), on_device(k), on_device(v),
                                               on_device(mask))
    ref, ref_cache = ops.attention_forward(on_device(q), on_device(np.repeat(k, groups, 1)),
                                           on_device(np.repeat(v, groups, 1)), on_device(mask))
    np.testing.assert_allclose(to_host(out), to_host(ref), rtol=1e-13, atol=1e-13)
    dout = on_device(rng.standard_normal(tuple(out.shape)))
    dq, dk, dv = grouped_attention_backward(dout, cache)
    rq, rk, rv = (to_host(g) for g in ops.attention_backward(dout, ref_cache))
    assert tuple(dk.shape) == k.shape and tuple(dv.shape) == v.shape
    np.testing.assert_allclose(to_host(dq), rq, rtol=1e-13, atol=1e-13)
    for ours, theirs in ((dk, rk), (dv, rv)):
        summed = theirs.reshape(b, kv, groups, *theirs.shape[2:]).sum(axis=2)
        np.testing.assert_allclose(to_host(ours), summed, rtol=1e-12, atol=1e-12)


# =========================================================================== PyTorch parity
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", MASKS[:3])
@given(**shapes)
def test_parity(torch, dtype, kind, seed, b, heads, t, s, e, f):
    """torch: scaled_dot_product_attention over repeat_interleave(k, G, dim=1) (Hugging
    Face's repeat_kv); autograd sums the repeated heads' gradients onto the leaves."""
    h, kv = heads
    if dtype == "float32":  # a few entries keep the scale (tests/test_ops_parity.py: bulk)
        t, s, e, f = max(t, 3), max(s, 3), max(e, 2), max(f, 2)
    q, k, v, mask = inputs(np.random.default_rng(seed), b, h, kv, t, s, e, f, kind)
    # moderate scores (std ~0.25), as test_ops_parity's attention: a saturated softmax
    # cancels to a few float32 digits in both libraries (float64 gradient checks cover it)
    q, k, v = (a.astype(dtype) for a in (q * 0.5, k * 0.5, v))
    tq, tk, tv = (to_torch(torch, a, requires_grad=True) for a in (q, k, v))
    groups = h // kv
    tmask = None if mask is None else to_torch(torch, mask)
    ty = torch.nn.functional.scaled_dot_product_attention(
        tq, tk.repeat_interleave(groups, dim=1), tv.repeat_interleave(groups, dim=1),
        attn_mask=tmask)
    g = np.random.default_rng(seed + 1).standard_normal(tuple(ty.shape)).astype(dtype)
    ty.backward(to_torch(torch, g))
    with using_backend("numpy", dtype):
        out, cache = grouped_attention_forward(
            backend.asarray(q), backend.asarray(k), backend.asarray(v),
            None if mask is None else backend.asarray(mask))
        grads = grouped_attention_backward(backend.asarray(g), cache)
        rtol = PARITY_RTOL[dtype]
        assert_close(out, to_host(ty), rtol, "grouped attention output")
        for name, ours, theirs in zip("qkv", grads, (tq, tk, tv)):
            assert tuple(ours.shape) == tuple(theirs.shape), name
            assert_close(ours, to_host(theirs.grad), rtol, f"grouped attention d{name}")


# =========================================================================== errors
def arr(shape, dtype="float64"):
    return backend.asarray(np.random.default_rng(0).standard_normal(shape), dtype)


@pytest.mark.parametrize("heads, kv_heads", [(3, 2), (4, 3), (2, 4), (6, 4)])
def test_heads_not_a_multiple_of_kv_heads(xb, heads, kv_heads):
    with raises_naming(ValueError, "grouped attention", f"{heads} heads", f"{kv_heads} heads",
                       "multiple of num_kv_heads"):
        grouped_attention_forward(arr((1, heads, 2, 4)), arr((1, kv_heads, 3, 4)),
                                      arr((1, kv_heads, 3, 4)))


def test_shapes_must_agree(xb):
    with raises_naming(ValueError, "grouped attention keys", "(1, 2, 3, 4)", "(1, 2, 5, 4)"):
        grouped_attention_forward(arr((1, 4, 2, 4)), arr((1, 2, 3, 4)), arr((1, 2, 5, 4)))
    with raises_naming(ValueError, "grouped attention queries", "(1, 4, 2, 5)", "width"):
        grouped_attention_forward(arr((1, 4, 2, 5)), arr((1, 2, 3, 4)), arr((1, 2, 3, 4)))
    with raises_naming(ValueError, "grouped attention queries", "3 dimensions"):
        grouped_attention_forward(arr((2, 4)), arr((1, 3, 4)), arr((1, 3, 4)))


def test_mask_must_fit(xb):
    mask = backend.asarray(np.ones((1, 1, 2, 4), bool))
    with raises_naming(ValueError, "attention mask", "(1, 1, 2, 4)", "(1, 4, 2, 3)"):
        grouped_attention_forward(arr((1, 4, 2, 4)), arr((1, 2, 3, 4)), arr((1, 2, 3, 4)),
                                      mask)


def test_dtypes_must_agree(xb):
    with raises_naming(TypeError, "grouped attention", "float32", "float64"):
        grouped_attention_forward(arr((1, 4, 2, 4)), arr((1, 2, 3, 4), "float32"),
                                      arr((1, 2, 3, 4), "float32"))


def test_backward_takes_its_own_cache(xb):
    _, cache = ops.attention_forward(arr((1, 2, 2, 4)), arr((1, 2, 3, 4)), arr((1, 2, 3, 4)))
    with raises_naming(TypeError, "grouped_attention_backward", "attention_forward"):
        grouped_attention_backward(arr((1, 2, 2, 4)), cache)
