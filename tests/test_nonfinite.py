"""NaN and inf go through every fast op (npformer.fast) exactly as through its textbook op
(npformer.ops): inputs with NaN, +inf and -inf at random positions (Hypothesis draws how
many and where), and the fast result must agree with the textbook's element for element:
NaN where it is NaN, +inf and -inf where they are, and the same finite values elsewhere
(within the tiers' usual tolerance of the largest finite value: 1e-10 in float64, 1e-5
in float32).  Each test runs on both of the fast tier's paths: the compiled kernels
("compiled") and the NumPy statements they fall back to without numba ("numpy").

Where the tiers used to part: the compiled float32 cross-entropy gave a NaN logit that
is not the target a finite loss and a zero gradient (its exp made exp(NaN) 0, so the
NaN counted as masked), and the fast attention treated a NaN key as masked (the textbook
makes every query of that batch row and head NaN: NaN + -inf is NaN); the fast ReLU's
gradient at a NaN input was NaN where the textbook's was 0 (the textbook now gives NaN,
a NaN propagating both ways).  The cross-entropy of a -inf logit that q does not
weight: the textbook's sum of q log p made it 0 * -inf = NaN where PyTorch and the fast
tier give a finite loss; the textbook now sums PyTorch's two terms.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer import fast, ops
from npformer.fast import compiler
from npformer.nn import Parameter

from .helpers import tier_under_test, tiered, using_tier

pytestmark = pytest.mark.filterwarnings(  # NumPy's warnings of arithmetic on NaN and inf
    "ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning",
    "ignore:divide by zero:RuntimeWarning")
SPECIALS = (np.nan, np.inf, -np.inf)
TOL = {"float64": 1e-10, "float32": 1e-5}
seeds = st.integers(0, 2**32 - 1)
dtypes = st.sampled_from(["float64", "float32"])
fractions = st.sampled_from([0.0, 0.04, 0.3])  # 0: clean inputs, the same test


@pytest.fixture(params=["compiled", "numpy"])
def path(request, monkeypatch):
    """The fast tier's compiled kernels, or its NumPy statements (numba switched off)."""
    if request.param == "compiled" and not compiler.COMPILED:
        pytest.skip("numba is not installed")
    if request.param == "numpy":
        monkeypatch.setattr(compiler, "COMPILED", False)
        monkeypatch.setattr(compiler, "_warned", True)  # that warning: tests/test_kernels.py
    return request.param


def poisoned(rng, shape, dtype, fraction: float) -> np.ndarray:
    """Standard normal values with about ``fraction`` of them NaN, +inf or -inf."""
    a = rng.standard_normal(tuple(shape))
    hit = rng.random(tuple(shape)) < fraction
    a[hit] = rng.choice(SPECIALS, size=int(hit.sum()))
    return a.astype(dtype)


def assert_same(name: str, got, want, dtype: str) -> None:
    """NaN, +inf and -inf at the same places, the finite values equal within TOL."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    for what, where in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        differ = where(got) != where(want)
        assert not differ.any(), (f"{name}: {what} in one tier only, at "
                                  f"{np.argwhere(differ)[:4].tolist()}")
    finite = np.isfinite(want)
    scale = max(float(np.abs(want[finite]).max(initial=0.0)), float(np.finfo(dtype).tiny))
    diff = float(np.abs(got[finite] - want[finite]).max(initial=0.0))
    assert diff <= TOL[dtype] * scale, f"{name}: finite values differ by {diff / scale:.2e}"


def assert_all_same(names, got, want, dtype):
    for name, a, b in zip(names, got, want):
        assert_same(name, a, b, dtype)


# =========================================================================== softmax
@given(seed=seeds, dtype=dtypes, fraction=fractions, masked=st.booleans())
def test_softmax_and_log_softmax(path, seed, dtype, fraction, masked):
    rng = np.random.default_rng(seed)
    x, dp = poisoned(rng, (4, 9), dtype, fraction), poisoned(rng, (4, 9), dtype, fraction)
    mask = rng.random((4, 9)) < 0.7 if masked else None
    (p_f, c_f), (p_t, c_t) = fast.softmax_forward(x.copy(), mask=mask), \
        ops.softmax_forward(x, mask=mask)
    assert_all_same(["p", "dx"], [p_f, fast.softmax_backward(dp, c_f)],
                    [p_t, ops.softmax_backward(dp, c_t)], dtype)
    (y_f, c_f), (y_t, c_t) = fast.log_softmax_forward(x), ops.log_softmax_forward(x)
    assert_all_same(["log p", "log dx"], [y_f, fast.log_softmax_backward(dp, c_f)],
                    [y_t, ops.log_softmax_backward(dp, c_t)], dtype)


# =========================================================================== attention
@given(seed=seeds, dtype=dtypes, fraction=fractions,
       which=st.sets(st.sampled_from(["q", "k", "v", "dout"]), min_size=1),
       mask_kind=st.sampled_from(["none", "causal", "padding", "padding&causal"]),
       block_scores=st.sampled_from([7, 40, fast.BLOCK_SCORES]))
def test_attention(path, seed, dtype, fraction, which, mask_kind, block_scores):
    """Small blocks cut keys off (the padding a block cannot see, the causal future): a
    NaN there must still reach every query the textbook reaches with it."""
    rng = np.random.default_rng(seed)
    b, h, t, e = 2, 2, 6, 3

    def inputs(name):
        return poisoned(rng, (b, h, t, e), dtype, fraction if name in which else 0.0)

    q, k, v, dout = (inputs(name) for name in ("q", "k", "v", "dout"))
    mask = None
    if "padding" in mask_kind:
        mask = ops.padding_mask(np.array([t - 2, 2]), t)
    if "causal" in mask_kind:
        causal = ops.causal_mask(t, like=q)
        mask = causal if mask is None else mask & causal
    (out_f, c_f) = fast.attention_forward(q, k, v, mask, block_scores=block_scores)
    (out_t, c_t) = ops.attention_forward(q, k, v, mask)
    assert_same("out", out_f, out_t, dtype)
    assert_all_same(["dq", "dk", "dv"], fast.attention_backward(dout, c_f),
                    ops.attention_backward(dout, c_t), dtype)


# =========================================================================== cross-entropy
@given(seed=seeds, dtype=dtypes, fraction=fractions, smoothing=st.sampled_from([0.0, 0.1, 1.0]),
       dloss=st.sampled_from([0.5, np.nan, np.inf, -np.inf]), overwrite=st.booleans())
def test_cross_entropy(path, seed, dtype, fraction, smoothing, dloss, overwrite):
    """Ignored rows included (their NaN logits still make the loss NaN, as 0 * NaN does in
    the textbook's weighted sum); a NaN or infinite upstream gradient too."""
    rng = np.random.default_rng(seed)
    logits = poisoned(rng, (5, 7), dtype, fraction)
    targets = rng.integers(0, 7, size=5)
    targets[rng.random(5) < 0.3] = ops.IGNORE_INDEX
    (loss_f, c_f) = fast.cross_entropy_forward(logits.copy(), targets, label_smoothing=smoothing)
    (loss_t, c_t) = ops.cross_entropy_forward(logits, targets, label_smoothing=smoothing)
    assert_same("loss", loss_f, loss_t, dtype)
    assert_same("dlogits", fast.cross_entropy_backward(dloss, c_f, overwrite_logits=overwrite),
                ops.cross_entropy_backward(dloss, c_t), dtype)


# =========================================================================== layer norm
@given(seed=seeds, dtype=dtypes, fraction=fractions,
       which=st.sets(st.sampled_from(["x", "gamma", "beta", "dy"]), min_size=1))
def test_layernorm(path, seed, dtype, fraction, which):
    rng = np.random.default_rng(seed)
    x, dy = (poisoned(rng, (3, 4, 9), dtype, fraction if name in which else 0.0)
             for name in ("x", "dy"))
    gamma, beta = (poisoned(rng, (9,), dtype, fraction if name in which else 0.0)
                   for name in ("gamma", "beta"))
    (y_f, c_f), (y_t, c_t) = (tier.layernorm_forward(x, gamma, beta) for tier in (fast, ops))
    assert_all_same(["y", "dx", "dgamma", "dbeta"], [y_f, *fast.layernorm_backward(dy, c_f)],
                    [y_t, *ops.layernorm_backward(dy, c_t)], dtype)


# =========================================================================== activations
@given(seed=seeds, dtype=dtypes, fraction=fractions, name=st.sampled_from(["relu", "gelu"]),
       poison_dy=st.booleans())
def test_activations(path, seed, dtype, fraction, name, poison_dy):
    rng = np.random.default_rng(seed)
    x = poisoned(rng, (5, 8), dtype, fraction)
    dy = poisoned(rng, (5, 8), dtype, fraction if poison_dy else 0.0)
    (f_fwd, f_bwd), (t_fwd, t_bwd) = fast.activation(name), ops.activation(name)
    (y_f, c_f), (y_t, c_t) = f_fwd(x), t_fwd(x)
    assert_all_same(["y", "dx"], [y_f, f_bwd(dy, c_f)], [y_t, t_bwd(dy, c_t)], dtype)


def test_relu_of_nan_is_nan_both_ways():
    """Forward NaN in both tiers (as PyTorch's); the gradient at a NaN input is NaN in
    both (it was 0 in the textbook; PyTorch passes the upstream gradient through)."""
    x, dy = np.array([np.nan, 1.0, -1.0, 0.0]), np.ones(4)
    for tier in (fast, ops):
        y, cache = tier.relu_forward(x)
        np.testing.assert_array_equal(y, [np.nan, 1.0, 0.0, 0.0])
        np.testing.assert_array_equal(tier.relu_backward(dy, cache), [np.nan, 1.0, 0.0, 0.0])


# =========================================================================== embedding
@given(seed=seeds, dtype=dtypes, fraction=fractions)
def test_embedding_backward(path, seed, dtype, fraction):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 4, size=(3, 5))
    _, cache = ops.embedding_forward(ids, np.zeros((4, 6), dtype))
    dy = poisoned(rng, (3, 5, 6), dtype, fraction)
    assert_same("dtable", fast.embedding_backward(dy, cache), ops.embedding_backward(dy, cache),
                dtype)


# =========================================================================== AdamW
@given(seed=seeds, dtype=dtypes, fraction=fractions, decoupled=st.booleans())
def test_adamw(path, seed, dtype, fraction, decoupled):
    """Two steps of (Adam)W over one flat buffer (fast) and parameter by parameter
    (textbook), with NaN and inf in the gradients and the weights: the parameters and
    both moments."""
    shapes = [(3, 4), (4,), (2, 3)]

    def run(tier):
        rng = np.random.default_rng(seed)
        with using_tier(tier):
            params = [Parameter(poisoned(rng, shape, dtype, fraction / 4), decay=i != 1)
                      for i, shape in enumerate(shapes)]
            opt = tiered.AdamW(params, lr=1e-2, weight_decay=0.1) if decoupled else \
                tiered.Adam(params, lr=1e-2)
            assert (getattr(opt, "_flat", None) is not None) == (tier == "fast")
            for _ in range(2):
                for p in params:
                    p.grad = poisoned(rng, p.shape, dtype, fraction)
                opt.step()
            return [p.data.copy() for p in params] + [m.copy() for m in opt.state["m"]] + \
                [v.copy() for v in opt.state["v"]]

    assert tier_under_test() == "fast"
    for i, (a, b) in enumerate(zip(run("fast"), run("textbook"))):
        assert_same(f"array {i}", a, b, dtype)
