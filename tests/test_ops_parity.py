"""Every op against its PyTorch equivalent: outputs and the gradients of every input.

Same inputs go to npformer and to ``torch.nn.functional``: npformer on NumPy with torch
on the CPU and, where a GPU is there, npformer on CuPy with torch on CUDA; torch's
gradients come from autograd with a *random* upstream gradient ``out.backward(g)``
(the same g is fed to npformer's backward).  Outputs and gradients must agree to
``PARITY_RTOL[dtype]`` (norm-wise relative, see ``tests.helpers.rel_diff``), in
float32 and float64, for random tiny shapes drawn by Hypothesis.

Torch equivalents: linear (torch stores W transposed), relu, gelu (exact, erf) and
gelu(approximate="tanh") (npformer's "gelu_tanh"),
layer_norm (eps 1e-5), softmax (a mask via masked_fill(-inf)), log_softmax,
scaled_dot_product_attention with a boolean attn_mask (True = attend), embedding,
cross_entropy (ignore_index, label_smoothing), dropout (eval: identity; training:
the same keep mask applied by hand), the positional adds (the sinusoidal table
rebuilt from the paper's formula in torch) and pooling over valid positions
(masked sum / count, masked max, first token).  Llama's pieces: RMS norm
(transformers' LlamaRMSNorm, and torch's rms_norm in float64, where LlamaRMSNorm computes
in float32), the rotary tables (LlamaRotaryEmbedding, default and llama3 rope_scaling,
and its formulas in float64), the rotation (apply_rotary_pos_emb) and SwiGLU
(silu(a) * b).  Fully masked attention rows are left
out (torch returns NaN there); the property tests cover them.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer import backend, ops

from .conftest import using_backend
from .helpers import (
    ATTENTION_OPS,
    PARITY_RTOL,
    assert_close,
    to_host,
    to_torch,
    torch_device,
)

seeds = st.integers(0, 2**32 - 1)
batch = st.integers(1, 3)
length = st.integers(1, 5)
width = st.integers(1, 6)


def bulk(dtype, n, floor):
    """``n``, raised to ``floor`` in float32.

    The comparison is norm-wise (max error / max |expected| over the tensor).  A
    tensor of one or two entries can be small by accidental cancellation (gelu' at
    its zero near x = -0.75, dk = sum_t dA[t] q_t with terms of opposite sign); its
    few correct float32 digits then differ between libraries even though both are
    right to float32 rounding.  More entries make the tensor's scale meaningful;
    float64 (1e-10 against rounding of 1e-16) keeps every size, 1 included."""
    return max(n, floor) if dtype == "float32" else n


@pytest.fixture(params=["float32", "float64"])
def dtype(request, parity_backend):
    """Run on each parity backend (NumPy, and CuPy on a GPU) with this float dtype."""
    with using_backend(parity_backend, request.param):
        yield request.param


class Pair:
    """Host data of one dtype, handed out as npformer arrays (current backend) and as
    torch leaves (on helpers.torch_device)."""

    def __init__(self, torch, dtype, seed):
        self.torch, self.dtype = torch, dtype
        self.rng = np.random.default_rng(seed)
        self.leaves = {}

    def randn(self, shape, scale=1.0):
        return (self.rng.standard_normal(tuple(shape)) * scale).astype(self.dtype)

    def tensor(self, host):
        """Host data as a torch tensor (no gradient) beside the leaves."""
        return to_torch(self.torch, host)

    def leaf(self, name, host):
        """(npformer array, torch tensor requiring grad) holding ``host``."""
        t = to_torch(self.torch, host, requires_grad=True)
        self.leaves[name] = t
        return backend.asarray(host.copy()), t

    def check(self, ours_out, theirs_out, ours_backward, grads_map, what, zero=()):
        """Compare outputs, then push the same random g through both backwards.

        ours_backward(g) -> {name: npformer gradient}; grads_map: {name: f(torch_grad)}
        turning a torch leaf's grad into npformer's layout (identity by default).
        ``zero``: gradients that are exactly zero in theory (a relative comparison
        with torch's rounding noise would be meaningless): npformer's must be exactly
        zero and torch's at rounding level.
        """
        rtol = PARITY_RTOL[self.dtype]
        assert tuple(ours_out.shape) == tuple(theirs_out.shape), what
        assert_close(ours_out, theirs_out, rtol, f"{what} output")
        g = self.randn(tuple(theirs_out.shape))
        theirs_out.backward(self.tensor(g))
        ours = ours_backward(backend.asarray(g))
        assert set(ours) == set(self.leaves), (set(ours), set(self.leaves))
        expected = {}
        for name in ours:
            grad = self.leaves[name].grad
            assert grad is not None, f"{what}: torch gave no gradient for {name}"
            expected[name] = grads_map.get(name, lambda a: a)(to_host(grad))
        scale = max(float(np.max(np.abs(e), initial=0.0)) for e in expected.values())
        for name, grad in ours.items():
            assert grad.dtype == backend.float_dtype(self.dtype), f"{what} d{name} dtype"
            if name in zero:
                assert np.all(backend.to_numpy(grad) == 0.0), f"{what}: d{name} is not zero"
                noise = 100 * np.finfo(self.dtype).eps * max(scale, 1.0)
                assert np.max(np.abs(expected[name]), initial=0.0) <= noise, what
            else:
                assert_close(grad, expected[name], rtol, f"{what} gradient of {name}")


# =========================================================================== linear
@given(seed=seeds, lead=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       d_in=width, d_out=width, bias=st.booleans())
def test_linear(dtype, torch, seed, lead, d_in, d_out, bias):
    F = torch.nn.functional
    pair = Pair(torch, dtype, seed)
    x, tx = pair.leaf("x", pair.randn(lead + [d_in]))
    w_host = pair.randn((d_in, d_out))
    w, tw = pair.leaf("w", w_host.T.copy())  # torch's (out, in) layout as the leaf...
    w = backend.asarray(w_host)  # ...npformer's (in, out)
    b, tb = pair.leaf("b", pair.randn((d_out,))) if bias else (None, None)
    y, cache = ops.linear_forward(x, w, b)

    def backward(g):
        dx, dw, db = ops.linear_backward(g, cache)
        return {"x": dx, "w": dw, **({"b": db} if bias else {})}
    pair.check(y, F.linear(tx, tw, tb), backward, {"w": lambda a: a.T}, "linear")


# =========================================================================== activations
@pytest.mark.parametrize("name", ["relu", "gelu", "gelu_tanh"])
@given(seed=seeds, shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       scale=st.sampled_from([0.5, 1.0, 4.0]))
def test_activation(dtype, torch, name, seed, shape, scale):
    F = torch.nn.functional
    pair = Pair(torch, dtype, seed)
    shape = shape[:-1] + [bulk(dtype, shape[-1], 4)]
    # Clipped at -2: in GELU's far tail gelu'(x) comes from 1 + tanh(u) with u << 0,
    # a cancellation both libraries share (one ulp of tanh is 1e-3 of the result at
    # x = -4 in float32), so a tensor lying entirely there would compare rounding noise.
    x, tx = pair.leaf("x", np.maximum(pair.randn(shape, scale), np.asarray(-2.0, dtype)))
    forward, backward = ops.activation(name)
    y, cache = forward(x)
    ty = {"relu": F.relu, "gelu": F.gelu,
          "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[name](tx)
    pair.check(y, ty, lambda g: {"x": backward(g, cache)}, {}, name)


# =========================================================================== dropout
@given(seed=seeds, shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       p=st.floats(0.05, 0.9), training=st.booleans())
def test_dropout(dtype, torch, seed, shape, p, training):
    F = torch.nn.functional
    pair = Pair(torch, dtype, seed)
    x, tx = pair.leaf("x", pair.randn(shape))
    backend.seed(seed)
    y, cache = ops.dropout_forward(x, p, training=training)
    if training:  # torch's own mask is random: apply npformer's keep mask the torch way
        keep = pair.tensor(backend.to_numpy(cache.values) != 0)  # the scaled keep mask
        ty = tx * keep / (1.0 - p)
    else:
        ty = F.dropout(tx, p, training=False)
    pair.check(y, ty, lambda g: {"x": ops.dropout_backward(g, cache)}, {}, "dropout")


# =========================================================================== layer norm
@given(seed=seeds, lead=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       extra_width=st.integers(0, 6), offset=st.sampled_from([0.0, 5.0]))
def test_layernorm(dtype, torch, seed, lead, extra_width, offset):
    # dx is r (g - mean(g) - x_hat mean(g x_hat)): g projected off two directions.
    # For D = 2 nothing is left but the eps term (|dx| ~ 1e-5 |g|) and for D = 3 a
    # single direction, so in float32 the cancellation leaves only a few correct
    # digits in *both* libraries (torch's float32 dx is off from the float64 truth by
    # more than npformer's).  float32 parity therefore starts at D = 4; D = 2 and 3
    # are gradient-checked in test_ops_gradcheck.py (D = 2 also defeats float64's
    # 1e-10: |dx| ~ 1e-5 |g| leaves 1e-11 relative rounding at best).
    d = (4 if dtype == "float32" else 3) + extra_width
    F = torch.nn.functional
    pair = Pair(torch, dtype, seed)
    x, tx = pair.leaf("x", pair.randn(lead + [d]) + np.asarray(offset, dtype))
    gamma, tgamma = pair.leaf("gamma", pair.randn((d,)))
    beta, tbeta = pair.leaf("beta", pair.randn((d,)))
    y, cache = ops.layernorm_forward(x, gamma, beta)

    def backward(g):
        dx, dgamma, dbeta = ops.layernorm_backward(g, cache)
        return {"x": dx, "gamma": dgamma, "beta": dbeta}
    ty = F.layer_norm(tx, (d,), tgamma, tbeta, eps=1e-5)
    pair.check(y, ty, backward, {}, "layer_norm")


# =========================================================================== RMS norm
def llama_rms_norm(torch, x, weight, eps):
    """transformers' LlamaRMSNorm on x with ``weight`` (a leaf) as its parameter."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(weight.shape[0], eps=eps).to(device=x.device, dtype=x.dtype)
    return torch.func.functional_call(norm, {"weight": weight}, (x,))


@given(seed=seeds, lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), d=width,
       eps=st.sampled_from([1e-6, 1e-5, 0.1]), scale=st.sampled_from([0.1, 1.0, 10.0]))
def test_rmsnorm(dtype, torch, seed, lead, d, eps, scale):
    """float32: transformers' LlamaRMSNorm (which computes in float32).  float64:
    LlamaRMSNorm rounds its input to float32, so it is float32-accurate only (see
    test_rmsnorm_is_llamas_in_float64); torch's rms_norm computes in float64 and is the
    reference at 1e-10.  dx = r (g - x_hat mean(g x_hat)) has g's component along x_hat
    projected off: for D = 1 only the eps term is left (|dx| ~ eps/x^2 |g|, 1e-10
    relative rounding in float64 at best), and for D < 4 the cancellation leaves few
    float32 digits in both libraries.  So float64 starts at D = 2 and float32 at D = 4
    (the gradient checks cover D = 1 to 3)."""
    d = max(d, 4 if dtype == "float32" else 2)
    pair = Pair(torch, dtype, seed)
    x, tx = pair.leaf("x", pair.randn(lead + [d], scale))
    weight, tweight = pair.leaf("weight", pair.randn((d,)))
    y, cache = ops.rmsnorm_forward(x, weight, eps)
    if dtype == "float32":
        ty = llama_rms_norm(torch, tx, tweight, eps)
    else:
        ty = torch.nn.functional.rms_norm(tx, (d,), tweight, eps)

    def backward(g):
        dx, dweight = ops.rmsnorm_backward(g, cache)
        return {"x": dx, "weight": dweight}
    pair.check(y, ty, backward, {}, "rms_norm")


@given(seed=seeds, lead=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       d=st.integers(4, 9))
def test_rmsnorm_is_llamas_in_float64(torch, seed, lead, d):
    """In float64 LlamaRMSNorm's output and gradients are ours to float32's tolerance (it
    computes in float32): the same formula, Hugging Face's rounding."""
    with using_backend("numpy", "float64"):
        pair = Pair(torch, "float64", seed)
        x, tx = pair.leaf("x", pair.randn(lead + [d]))
        weight, tweight = pair.leaf("weight", pair.randn((d,)))
        y, cache = ops.rmsnorm_forward(x, weight, 1e-6)
        ty = llama_rms_norm(torch, tx, tweight, 1e-6)
        assert ty.dtype == torch.float64
        g = pair.randn(tuple(ty.shape))
        ty.backward(pair.tensor(g))
        dx, dweight = ops.rmsnorm_backward(backend.asarray(g), cache)
        rtol = PARITY_RTOL["float32"]
        assert_close(y, to_host(ty.detach()), rtol, "LlamaRMSNorm in float64")
        assert_close(dx, to_host(tx.grad), rtol, "LlamaRMSNorm in float64, dx")
        assert_close(dweight, to_host(tweight.grad), rtol, "LlamaRMSNorm in float64, dweight")


# =========================================================================== rotary
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def llama_rotary(torch, head_dim, theta, scaling, positions):
    """transformers' (cos, sin) for ``positions`` (B, T), from LlamaRotaryEmbedding of a
    small LlamaConfig whose head_dim is not d_model / num_heads."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(d_model=3 * head_dim + 3, num_heads=3, head_dim=head_dim,
                         rope_theta=theta, rope_scaling=dict(scaling) if scaling else None,
                         block_size=128)
    assert config.head_dim == head_dim != config.d_model // config.num_heads
    rope = LlamaRotaryEmbedding(config).to(torch_device())
    dummy = torch.zeros(1, dtype=torch.float32, device=torch_device())
    return rope(dummy, torch.tensor(positions, device=torch_device()))


def reference_table(torch, head_dim, theta, scaling, positions):
    """(cos, sin) in float64, transformers' formulas (the default inverse frequencies and
    _compute_llama3_parameters) transcribed with float64 tensors."""
    import math

    on = dict(dtype=torch.float64, device=torch_device())
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, **on) / head_dim))
    if scaling:
        factor, low, high = (scaling[k] for k in ("factor", "low_freq_factor",
                                                  "high_freq_factor"))
        old_context_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > old_context_len / low, inv_freq / factor,
                                     inv_freq)
        smooth_factor = (old_context_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < old_context_len / high) * ~(wavelen > old_context_len / low)
        inv_freq = torch.where(is_medium, smoothed, inv_freq_llama)
    freqs = torch.tensor(positions, **on)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


rotary_cases = dict(seed=seeds, b=st.integers(1, 3), t=st.integers(1, 5),
                    half=st.integers(1, 5), theta=st.sampled_from([10000.0, 500000.0, 50.0]),
                    scaled=st.booleans())


def rotary_positions(rng, b, t, top=32):
    """Positions (B, T), each row from its own start: left padding, a cache's offset."""
    return rng.integers(0, top, size=(b, 1)) + np.arange(t)[None, :]


@given(**rotary_cases)
def test_rotary_table(dtype, torch, seed, b, t, half, theta, scaled):
    """The tables: against the formulas in float64 (to PARITY_RTOL[dtype]) and against
    LlamaRotaryEmbedding, which computes in float32 whatever the model's dtype (to
    float32's tolerance, on positions below 64 where float32 angles keep 1e-5)."""
    e, scaling = 2 * half, LLAMA3 if scaled else None
    positions = rotary_positions(np.random.default_rng(seed), b, t)
    cos, sin = ops.rotary_table(backend.asarray(positions), e, theta, scaling,
                                dtype=backend.float_dtype(dtype))
    assert tuple(cos.shape) == tuple(sin.shape) == (b, t, e)
    assert cos.dtype == sin.dtype == backend.float_dtype(dtype)
    ref_cos, ref_sin = reference_table(torch, e, theta, scaling, positions)
    assert_close(cos, ref_cos, PARITY_RTOL[dtype], "rotary cos")
    assert_close(sin, ref_sin, PARITY_RTOL[dtype], "rotary sin")
    hf_cos, hf_sin = llama_rotary(torch, e, theta, scaling, positions)
    assert_close(cos, hf_cos, PARITY_RTOL["float32"], "rotary cos vs LlamaRotaryEmbedding")
    assert_close(sin, hf_sin, PARITY_RTOL["float32"], "rotary sin vs LlamaRotaryEmbedding")


@given(h=st.integers(1, 3), **rotary_cases)
def test_rotary(dtype, torch, seed, b, h, t, half, theta, scaled):
    """rotary_forward is transformers' apply_rotary_pos_emb (on the same tables), its
    backward autograd's through it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    e, scaling = 2 * half, LLAMA3 if scaled else None
    h, t, e = bulk(dtype, h, 2), bulk(dtype, t, 2), bulk(dtype, e, 4)
    pair = Pair(torch, dtype, seed)
    positions = rotary_positions(pair.rng, b, t, top=10_000)
    cos, sin = ops.rotary_table(backend.asarray(positions), e, theta, scaling,
                                dtype=backend.float_dtype(dtype))
    q, tq = pair.leaf("q", pair.randn((b, h, t, e)))
    k_host = pair.randn((b, h, t, e))
    tcos, tsin = (pair.tensor(backend.to_numpy(a)) for a in (cos, sin))
    tq_rot, tk_rot = apply_rotary_pos_emb(tq, pair.tensor(k_host), tcos, tsin)
    k_rot, _ = ops.rotary_forward(backend.asarray(k_host), cos, sin)
    assert_close(k_rot, to_host(tk_rot), PARITY_RTOL[dtype], "rotary keys")
    q_rot, cache = ops.rotary_forward(q, cos, sin)
    pair.check(q_rot, tq_rot, lambda g: {"q": ops.rotary_backward(g, cache)}, {}, "rotary")


# =========================================================================== SwiGLU
@given(seed=seeds, shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       scale=st.sampled_from([0.5, 1.0, 4.0, 30.0]))
def test_swiglu(dtype, torch, seed, shape, scale):
    F = torch.nn.functional
    pair = Pair(torch, dtype, seed)
    shape = shape[:-1] + [bulk(dtype, shape[-1], 4)]
    a, ta = pair.leaf("a", pair.randn(shape, scale))
    b, tb = pair.leaf("b", pair.randn(shape))
    h, cache = ops.swiglu_forward(a, b)

    def backward(g):
        da, db = ops.swiglu_backward(g, cache)
        return {"a": da, "b": db}
    pair.check(h, F.silu(ta) * tb, backward, {}, "swiglu")


# =========================================================================== softmax
@pytest.mark.parametrize("axis", [-1, 0])
@given(seed=seeds, shape=st.lists(st.integers(1, 5), min_size=2, max_size=3),
       masked=st.booleans())
def test_softmax(dtype, torch, axis, seed, shape, masked):
    pair = Pair(torch, dtype, seed)
    # Unit-scale inputs: a saturated softmax (p ~ 1e-3 for some allowed entry) leaves
    # p * (dp - <dp, p>) to cancellation, and float32 then keeps ~4 digits in torch
    # as in npformer (both equally far from the float64 truth); the gradient checks
    # cover large scores in float64.
    x, tx = pair.leaf("x", pair.randn(shape))
    if masked:
        m = pair.rng.random(shape) < 0.6
        idx = [slice(None)] * len(shape)
        idx[axis] = 0
        m[tuple(idx)] = True  # no fully masked row: torch would give NaN
        y, cache = ops.softmax_forward(x, axis=axis, mask=backend.asarray(m))
        ty = tx.masked_fill(~pair.tensor(m), float("-inf")).softmax(dim=axis)
    else:
        y, cache = ops.softmax_forward(x, axis=axis)
        ty = torch.softmax(tx, dim=axis)
    pair.check(y, ty, lambda g: {"x": ops.softmax_backward(g, cache)}, {}, "softmax")


@pytest.mark.parametrize("axis", [-1, 0])
@given(seed=seeds, shape=st.lists(st.integers(1, 5), min_size=2, max_size=3))
def test_log_softmax(dtype, torch, axis, seed, shape):
    pair = Pair(torch, dtype, seed)
    x, tx = pair.leaf("x", pair.randn(shape, 3.0))
    y, cache = ops.log_softmax_forward(x, axis=axis)
    ty = torch.log_softmax(tx, dim=axis)
    pair.check(y, ty, lambda g: {"x": ops.log_softmax_backward(g, cache)}, {}, "log_softmax")


# =========================================================================== attention
@pytest.mark.parametrize("kind", ["none", "padding", "causal", "padding&causal", "random_B1TS",
                                  "random_11TS", "random_TS"])
@pytest.mark.parametrize("op", sorted(ATTENTION_OPS))
@given(seed=seeds, b=st.integers(1, 3), h=st.integers(1, 3), t=st.integers(1, 5),
       s=st.integers(1, 5), e=st.integers(1, 5), f=st.integers(1, 5))
def test_attention(dtype, torch, kind, op, seed, b, h, t, s, e, f):
    F = torch.nn.functional
    pair = Pair(torch, dtype, seed)
    h, t, s, e, f = bulk(dtype, h, 2), bulk(dtype, t, 3), bulk(dtype, s, 3), \
        bulk(dtype, e, 2), bulk(dtype, f, 2)
    if "causal" in kind:
        s = t + s - 1
    # Moderate scores (std ~0.25): a saturated softmax makes dk = dA^T q / sqrt(E)
    # tiny, and p * (dp - <dp, p>) then cancels to a few float32 digits in torch as
    # in npformer; saturated rows are gradient-checked in float64 instead.
    q, tq = pair.leaf("q", pair.randn((b, h, t, e), 0.5))
    k, tk = pair.leaf("k", pair.randn((b, h, s, e), 0.5))
    v, tv = pair.leaf("v", pair.randn((b, h, s, f)))
    mask = None
    if kind.startswith("random"):
        shape = {"random_B1TS": (b, 1, t, s), "random_11TS": (1, 1, t, s),
                 "random_TS": (t, s)}[kind]
        m = pair.rng.random(shape) < 0.5
        m[..., pair.rng.integers(s)] = True  # every query keeps a key: no NaN in torch
        mask = backend.asarray(m)
    else:
        if "padding" in kind:
            mask = ops.padding_mask(backend.asarray(pair.rng.integers(1, s + 1, size=b)), s)
        if "causal" in kind:
            causal = ops.causal_mask(t, s)
            mask = causal if mask is None else mask & causal
    # A query with a single allowed key has softmax weights (0, .., 1, .., 0) whatever
    # its scores: no gradient reaches q, nor k through it.  If every query is such,
    # dq and dk are exactly zero (npformer computes exact zeros, torch rounding noise).
    allowed = np.broadcast_to(np.ones((t, s), bool) if mask is None
                              else backend.to_numpy(mask), (b, h, t, s))
    zero = ("q", "k") if np.all(allowed.sum(-1) == 1) else ()
    forward, backward_op = ATTENTION_OPS[op]
    y, cache = forward(q, k, v, mask)
    tmask = None if mask is None else pair.tensor(backend.to_numpy(mask))
    ty = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask)

    def backward(g):
        dq, dk, dv = backward_op(g, cache)
        return {"q": dq, "k": dk, "v": dv}
    pair.check(y, ty, backward, {}, f"attention ({kind}, {op})", zero)


@given(seed=seeds, b=st.integers(1, 2), h=st.integers(1, 3), t=st.integers(1, 6),
       e=st.integers(2, 5))
def test_causal_attention_matches_is_causal(dtype, torch, seed, b, h, t, e):
    """ops.causal_mask(T) is torch's ``is_causal=True`` (for S == T, where both agree)."""
    F = torch.nn.functional
    pair = Pair(torch, dtype, seed)
    t = bulk(dtype, t, 3)
    q, tq = pair.leaf("q", pair.randn((b, h, t, e), 0.5))
    k, tk = pair.leaf("k", pair.randn((b, h, t, e), 0.5))
    v, tv = pair.leaf("v", pair.randn((b, h, t, e)))
    y, cache = ops.attention_forward(q, k, v, ops.causal_mask(t))
    ty = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    def backward(g):
        dq, dk, dv = ops.attention_backward(g, cache)
        return {"q": dq, "k": dk, "v": dv}
    pair.check(y, ty, backward, {}, "causal attention", ("q", "k") if t == 1 else ())


# =========================================================================== embedding
@given(seed=seeds, vocab=st.integers(1, 6), lead=st.lists(st.integers(1, 4), min_size=1,
                                                          max_size=2), d=width)
def test_embedding(dtype, torch, seed, vocab, lead, d):
    F = torch.nn.functional
    pair = Pair(torch, dtype, seed)
    ids = pair.rng.integers(0, vocab, size=lead)
    ids.reshape(-1)[-1] = ids.reshape(-1)[0]  # a repeated id (when there are two)
    table, ttable = pair.leaf("table", pair.randn((vocab, d)))
    y, cache = ops.embedding_forward(backend.asarray(ids), table)
    ty = F.embedding(pair.tensor(ids), ttable)
    pair.check(y, ty, lambda g: {"table": ops.embedding_backward(g, cache)}, {}, "embedding")


# =========================================================================== positions
@given(seed=seeds, b=batch, t=length, d=st.integers(1, 9), extra=st.integers(0, 4))
def test_sinusoidal_positions(dtype, torch, seed, b, t, d, extra):
    pair = Pair(torch, dtype, seed)
    x, tx = pair.leaf("x", pair.randn((b, t, d)))
    table = ops.sinusoidal_table(t + extra, d)
    # The paper's formula, independently: PE[pos, 2i] = sin(pos / 10000^(2i/d)), 2i+1: cos.
    on = dict(dtype=torch.float64, device=torch_device())
    pos = torch.arange(t + extra, **on)[:, None]
    two_i = torch.arange(0, d, 2, **on)
    angle = pos / torch.pow(10000.0, two_i / d)
    reference = torch.zeros(t + extra, d, **on)
    reference[:, 0::2] = torch.sin(angle)
    reference[:, 1::2] = torch.cos(angle[:, : d // 2])
    reference = reference.to(getattr(torch, dtype))
    assert_close(table, reference, PARITY_RTOL[dtype], "sinusoidal table")
    y, cache = ops.add_positions_forward(x, table)
    ty = tx + reference[:t][None]
    pair.check(y, ty, lambda g: {"x": ops.add_positions_backward(g, cache)[0]}, {},
               "sinusoidal positions")


@given(seed=seeds, b=batch, t=length, d=width, extra=st.integers(0, 4))
def test_learned_positions(dtype, torch, seed, b, t, d, extra):
    pair = Pair(torch, dtype, seed)
    x, tx = pair.leaf("x", pair.randn((b, t, d)))
    table, ttable = pair.leaf("table", pair.randn((t + extra, d), 0.1))
    y, cache = ops.add_positions_forward(x, table)
    ty = tx + ttable[:t][None]  # tiered.Embedding(arange(T)) added to x, as in GPT-2

    def backward(g):
        dx, dtable = ops.add_positions_backward(g, cache)
        return {"x": dx, "table": dtable}
    pair.check(y, ty, backward, {}, "learned positions")


# =========================================================================== cross-entropy
@pytest.mark.parametrize("rank", [2, 3])
@given(seed=seeds, b=batch, t=length, v=st.integers(2, 7),
       smoothing=st.sampled_from([0.0, 0.1, 0.37]),
       ignore_index=st.sampled_from([ops.IGNORE_INDEX, -1, 0]), n_ignored=st.integers(0, 4))
def test_cross_entropy(dtype, torch, rank, seed, b, t, v, smoothing, ignore_index, n_ignored):
    F = torch.nn.functional
    pair = Pair(torch, dtype, seed)
    b, t, v = bulk(dtype, b, 2), bulk(dtype, t, 2), bulk(dtype, v, 4)  # p - q can cancel
    lead = (b, t) if rank == 3 else (b * t,)
    logits, tlogits = pair.leaf("logits", pair.randn(lead + (v,), 2.0))
    targets = pair.rng.integers(0, v, size=lead)
    flat = targets.reshape(-1)
    n_ignored = min(n_ignored, flat.size - bulk(dtype, 1, 2))  # rows left to count
    flat[pair.rng.permutation(flat.size)[:n_ignored]] = ignore_index
    if np.all(flat == ignore_index):
        flat[0] = 1  # torch's mean over zero counted rows is NaN
    loss, cache = ops.cross_entropy_forward(logits, backend.asarray(targets),
                                            ignore_index=ignore_index,
                                            label_smoothing=smoothing)
    tloss = F.cross_entropy(tlogits.reshape(-1, v), pair.tensor(flat),
                            ignore_index=ignore_index, label_smoothing=smoothing)
    pair.check(loss, tloss, lambda g: {"logits": ops.cross_entropy_backward(g, cache)}, {},
               "cross_entropy")


# =========================================================================== pooling
@pytest.mark.parametrize("how", ["mean", "max", "first"])
@given(seed=seeds, b=batch, t=length, d=width)
def test_pooling(dtype, torch, how, seed, b, t, d):
    pair = Pair(torch, dtype, seed)
    b, t, d = bulk(dtype, b, 2), bulk(dtype, t, 2), bulk(dtype, d, 3)
    h, th = pair.leaf("h", pair.randn((b, t, d)))
    valid = pair.rng.integers(1, t + 1, size=b)
    y, cache = ops.pool_forward(h, backend.asarray(valid), how)
    keep = (torch.arange(t, device=torch_device())[None, :, None]
            < pair.tensor(valid)[:, None, None])  # (B, T, 1)
    if how == "mean":
        ty = (th * keep).sum(1) / pair.tensor(valid).to(th.dtype)[:, None]
    elif how == "max":
        ty = th.masked_fill(~keep, float("-inf")).max(dim=1).values
    else:
        ty = th[:, 0, :]
    pair.check(y, ty, lambda g: {"h": ops.pool_backward(g, cache)}, {}, f"{how} pooling")
