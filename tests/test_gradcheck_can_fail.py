"""The gradient checker catches broken backward passes (a check that cannot fail proves nothing).

Each test runs the checker twice on the same inputs: on the correct backward
(error below ``GRADCHECK_TOL``) and on a deliberately broken one (error above
1e-2, i.e. of order 1).  The broken backwards are the classic mistakes:

* linear: dW divided by the batch size (a "mean instead of sum" slip);
* multi-head attention: heads merged in the wrong order, (B, T, E, H) instead
  of (B, T, H, E), in the backward;
* softmax: the ``- sum(dp * p)`` term dropped;
* layer norm: the mean-subtraction term dropped (and the variance term, which
  shows why the upstream gradient must be random: with an all-ones upstream
  gradient and gamma = 1 that bug is invisible);
* a Module (``npformer.nn.Linear``) whose weight gradient is scaled by 1/B,
  caught by :func:`npformer.gradcheck.check_module`.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer import backend, nn, ops
from npformer.gradcheck import check_module, check_op
from npformer.nn.attention import merge_heads, split_heads

from .helpers import GRADCHECK_TOL, tiered

CAUGHT = 1e-2
seeds = st.integers(0, 2**32 - 1)


def randn(rng, shape, on_device):
    return on_device(rng.standard_normal(tuple(shape)))


def assert_correct_passes_broken_fails(forward, correct, broken, args, wrt, kwargs=None,
                                       culprit=None, caught=CAUGHT):
    good = check_op(forward, correct, args, wrt, kwargs)
    assert good.worst_error < GRADCHECK_TOL, f"the correct backward should pass:\n{good}"
    bad = check_op(forward, broken, args, wrt, kwargs)
    assert bad.worst_error > caught, f"the broken backward was not caught:\n{bad}"
    assert not bad.passed(GRADCHECK_TOL)
    if culprit is not None:
        assert bad.worst_name == culprit, str(bad)
    assert "worst relative error" in str(bad)
    return bad


# =========================================================================== (a) linear, dW / B
@given(seed=seeds, b=st.integers(2, 4), t=st.integers(1, 3), d_in=st.integers(1, 4),
       d_out=st.integers(1, 4))
def test_linear_dw_divided_by_batch_is_caught(xb, on_device, seed, b, t, d_in, d_out):
    rng = np.random.default_rng(seed)
    x = randn(rng, (b, t, d_in), on_device)
    w = randn(rng, (d_in, d_out), on_device)
    bias = randn(rng, (d_out,), on_device)

    def broken(dy, cache):
        dx, dw, db = ops.linear_backward(dy, cache)
        return dx, dw / b, db  # "averaged" over the batch

    bad = assert_correct_passes_broken_fails(ops.linear_forward, ops.linear_backward, broken,
                                             [x, w, bias], [0, 1, 2], culprit="arg1")
    assert bad.errors["arg0"] < GRADCHECK_TOL and bad.errors["arg2"] < GRADCHECK_TOL
    assert bad.errors["arg1"] == pytest.approx(1.0 - 1.0 / b, rel=1e-6)


# ========================================================================= (b) heads merged wrongly
def mha_forward(q_in, k_in, v_in, num_heads):
    """(B, T, H*E) inputs -> per-head attention -> (B, T, H*F) output."""
    q, k, v = (split_heads(a, num_heads) for a in (q_in, k_in, v_in))  # (B, H, T, E)
    heads, cache = ops.attention_forward(q, k, v)  # (B, H, T, F)
    return merge_heads(heads), (cache, num_heads)


def mha_backward(dout, cache):
    attn_cache, num_heads = cache
    dq, dk, dv = ops.attention_backward(split_heads(dout, num_heads), attn_cache)
    return merge_heads(dq), merge_heads(dk), merge_heads(dv)


def merge_heads_swapped(x):
    """The bug: (B, H, T, E) -> (B, T, E, H) -> (B, T, E*H), columns interleaved."""
    xp = backend.namespace_of(x)
    b, h, t, e = x.shape
    return xp.reshape(xp.permute_dims(x, (0, 2, 3, 1)), (b, t, e * h))


def mha_backward_swapped(dout, cache):
    attn_cache, num_heads = cache
    dq, dk, dv = ops.attention_backward(split_heads(dout, num_heads), attn_cache)
    return merge_heads_swapped(dq), merge_heads_swapped(dk), merge_heads_swapped(dv)


@given(seed=seeds, b=st.integers(1, 2), h=st.integers(2, 3), t=st.integers(1, 3),
       s=st.integers(2, 3), e=st.integers(2, 3))
def test_heads_merged_in_wrong_order_are_caught(xb, on_device, seed, b, h, t, s, e):
    rng = np.random.default_rng(seed)
    q = randn(rng, (b, t, h * e), on_device)
    k = randn(rng, (b, s, h * e), on_device)
    v = randn(rng, (b, s, h * e), on_device)
    # Sanity: split/merge are inverses, the swapped merge is not (for H, E > 1).
    assert np.array_equal(backend.to_numpy(merge_heads(split_heads(q, h))), backend.to_numpy(q))
    assert not np.array_equal(backend.to_numpy(merge_heads_swapped(split_heads(q, h))),
                              backend.to_numpy(q))
    assert_correct_passes_broken_fails(mha_forward, mha_backward, mha_backward_swapped,
                                       [q, k, v], [0, 1, 2], {"num_heads": h})


# =========================================================================== (c) softmax
@pytest.mark.parametrize("masked", [False, True])
@given(seed=seeds, rows=st.integers(3, 4), cols=st.integers(2, 5))
def test_softmax_without_the_inner_product_term_is_caught(xb, on_device, masked, seed, rows,
                                                          cols):
    rng = np.random.default_rng(seed)
    x = randn(rng, (rows, cols), on_device)
    kwargs = {}
    if masked:
        m = rng.random((rows, cols)) < 0.7
        m[:, :2] = True  # two keys per row at least: a one-key row has no gradient at all
        kwargs["mask"] = on_device(m)

    def broken(dp, cache):
        p, _ = cache.values
        return p * dp  # missing "- sum(dp * p)"

    assert_correct_passes_broken_fails(ops.softmax_forward, ops.softmax_backward, broken,
                                       [x], [0], kwargs)


# =========================================================================== (d) layer norm
def layernorm_backward_no_mean(dy, cache):
    """Missing the mean-subtraction term: dx = r (g - x_hat mean(g x_hat))."""
    x_hat, r, gamma = cache.values
    xp = backend.namespace_of(dy)
    dx, dgamma, dbeta = ops.layernorm_backward(dy, cache)
    g = dy * gamma
    return dx + r * xp.mean(g, axis=-1, keepdims=True), dgamma, dbeta


def layernorm_backward_no_variance(dy, cache):
    """Missing the variance term: dx = r (g - mean(g))."""
    x_hat, r, gamma = cache.values
    xp = backend.namespace_of(dy)
    dx, dgamma, dbeta = ops.layernorm_backward(dy, cache)
    g = dy * gamma
    return dx + r * x_hat * xp.mean(g * x_hat, axis=-1, keepdims=True), dgamma, dbeta


def layernorm_args(rng, on_device, rows, d, unit_gamma=False):
    x = randn(rng, (rows, d), on_device)
    gamma = on_device(np.ones(d)) if unit_gamma else randn(rng, (d,), on_device)
    return [x, gamma, randn(rng, (d,), on_device)]


@pytest.mark.parametrize("broken", [layernorm_backward_no_mean, layernorm_backward_no_variance],
                         ids=["no_mean", "no_variance"])
@given(seed=seeds, rows=st.integers(3, 4), d=st.integers(3, 6))
def test_layernorm_missing_terms_are_caught(xb, on_device, broken, seed, rows, d):
    """The missing term's size depends on the draw: r mean(g) is small where gamma is
    nearly orthogonal to every row of the upstream gradient (Hypothesis finds such seeds:
    an error of 4e-3), so the bar here is 100 times the tolerance, not 1e-2."""
    rng = np.random.default_rng(seed)
    assert_correct_passes_broken_fails(ops.layernorm_forward, ops.layernorm_backward, broken,
                                       layernorm_args(rng, on_device, rows, d), [0, 1, 2],
                                       culprit="arg0", caught=100 * GRADCHECK_TOL)


# ------------------------------------------- (e) why the upstream gradient must be random
def summed(forward):
    """L = sum(f(x)): check_op's random upstream gradient becomes one number c, so
    the backward sees the constant upstream gradient c * ones."""
    def forward_sum(*args, **kwargs):
        y, cache = forward(*args, **kwargs)
        return backend.namespace_of(y).sum(y), (cache, y)
    return forward_sum


def backward_of_summed(backward):
    def backward_sum(dloss, cache):
        inner, y = cache
        xp = backend.namespace_of(y)
        return backward(dloss * xp.ones_like(y), inner)
    return backward_sum


@given(seed=seeds, rows=st.integers(3, 4), d=st.integers(3, 6))
def test_constant_upstream_gradient_hides_a_broken_layernorm(xb, on_device, seed, rows, d):
    rng = np.random.default_rng(seed)
    args = layernorm_args(rng, on_device, rows, d, unit_gamma=True)  # gamma = 1, as at init
    # With a constant upstream gradient and gamma = 1, g = c is constant, so
    # mean(g * x_hat) = c mean(x_hat) = 0: the variance term vanishes and the broken
    # backward agrees with the numerical gradient (both are 0: sum(y) = sum(beta)).
    blind = check_op(summed(ops.layernorm_forward),
                     backward_of_summed(layernorm_backward_no_variance), args, [0, 1, 2])
    assert blind.worst_error < GRADCHECK_TOL, str(blind)
    # The random upstream gradient of check_op exposes the very same backward.
    seen = check_op(ops.layernorm_forward, layernorm_backward_no_variance, args, [0, 1, 2])
    assert seen.worst_error > CAUGHT, str(seen)
    # (A missing mean term is visible even with a constant upstream gradient: it
    # adds r * c to every entry of dx, and the true dx is 0.)
    plain = check_op(summed(ops.layernorm_forward),
                     backward_of_summed(layernorm_backward_no_mean), args, [0, 1, 2])
    assert plain.worst_error > CAUGHT, str(plain)


# =========================================================================== check_module
class LinearWithAveragedWeightGrad(nn.Linear):
    """Broken: the weight gradient is divided by the batch size."""

    def backward(self, dy):
        dx, dw, db = ops.linear_backward(dy, self._pop_saved())  # a subclass: textbook
        self.weight.accumulate(dw / dy.shape[0])
        self.bias.accumulate(db)
        return dx


@given(seed=seeds, b=st.integers(2, 4), t=st.integers(1, 3), d_in=st.integers(1, 4),
       d_out=st.integers(1, 4))
def test_check_module_catches_a_broken_layer(xb, on_device, seed, b, t, d_in, d_out):
    rng = np.random.default_rng(seed)
    x = randn(rng, (b, t, d_in), on_device)
    backend.seed(seed)
    good = check_module(tiered.Linear(d_in, d_out), [x])
    assert good.worst_error < GRADCHECK_TOL, str(good)
    assert set(good.errors) == {"input0", "weight", "bias"}
    backend.seed(seed)
    bad = check_module(LinearWithAveragedWeightGrad(d_in, d_out), [x])
    assert bad.worst_error > CAUGHT, str(bad)
    assert bad.worst_name == "weight", str(bad)
    assert bad.errors["input0"] < GRADCHECK_TOL and bad.errors["bias"] < GRADCHECK_TOL


# =========================================================================== the messages
def test_the_message_names_the_gradient_its_shape_and_index(xb, on_device):
    """A result speaks of ``dgamma`` (the forward's parameter names), never ``arg1``: its
    message names the worst gradient, its shape, its largest error and its index."""
    rng = np.random.default_rng(0)
    x, gamma, beta = (randn(rng, shape, on_device) for shape in ((3, 4), (4,), (4,)))

    def doubled_dgamma(dy, cache):
        dx, dgamma, dbeta = ops.layernorm_backward(dy, cache)
        return dx, dgamma * 2.0, dbeta

    bad = check_op(ops.layernorm_forward, doubled_dgamma, [x, gamma, beta], [0, 1, 2])
    assert bad.worst_name == "arg1" and bad.worst_label == "dgamma"  # keys as before
    assert bad.labels == {"arg0": "dx", "arg1": "dgamma", "arg2": "dbeta"}
    message = bad.message(GRADCHECK_TOL)
    assert "dgamma (shape (4,))" in message and f"at index {bad.worst_index}" in message
    assert f"{bad.worst_error:.1e}" in message
    assert not re.search(r"\barg\d", message + str(bad)), str(bad)
    named = check_op(ops.layernorm_forward, doubled_dgamma, [x, gamma, beta], [0, 1, 2],
                     names=("dx", "dg", "db"))
    assert set(named.errors) == {"dx", "dg", "db"} and named.worst_name == "dg"
    assert "dg (shape (4,))" in str(named)


def test_check_module_names_inputs_and_parameters(xb, on_device):
    x = randn(np.random.default_rng(1), (2, 3, 4), on_device)
    backend.seed(0)
    bad = check_module(LinearWithAveragedWeightGrad(4, 2), [x])
    assert bad.labels == {"input0": "dx", "weight": "weight.grad", "bias": "bias.grad"}
    assert "weight.grad (shape (4, 2))" in bad.message(GRADCHECK_TOL), str(bad)
    assert "input0" not in str(bad)
