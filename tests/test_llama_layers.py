"""The Llama-family layers (npformer.nn.RMSNorm, SwiGLUFeedForward, GroupedQueryAttention,
LlamaBlock): gradient checks, transformers parity, the KV cache, errors.

Gradient checks (Hypothesis, float64, both backends of ``xb``): every parameter and the
input, for key/value heads from 1 to H, q/k/v and output biases, QK-norm, head_dim other
than D / H, per-sequence positions (left padding) and causal & padding masks.
Parity (float64, 1e-10): the same weights in transformers' LlamaRMSNorm, LlamaMLP,
LlamaAttention / Qwen2Attention / Qwen3Attention and their decoder layers (``sdpa``; the
norms and the rotary tables in float64, :mod:`tests.llama_reference`): outputs and every
gradient.  The cache: it holds Hkv heads only, and decoding through it one position at a
time gives the full forward's outputs.  Errors: key/value heads that do not divide the
query heads, an odd head_dim, tables of another shape, a cache with gradients on.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer import backend, nn, ops
from npformer.gradcheck import check_module

from .conftest import using_backend
from .helpers import GRADCHECK_TOL, PARITY_RTOL, assert_close, raises_naming, to_host
from .llama_reference import float64_reference, hf_classes, hf_state

seeds = st.integers(0, 2**32 - 1)


def heads_and_kv_heads():
    return st.integers(1, 4).flatmap(lambda h: st.tuples(
        st.just(h), st.sampled_from([g for g in range(1, h + 1) if h % g == 0])))


def positions_and_mask(rng, b, t, min_tokens=1):
    """Left-padded rows of at least ``min_tokens`` tokens: positions (B, T) counted over
    each row's tokens, and the causal & padding mask (B, 1, T, T); every query keeps
    itself."""
    pad = rng.integers(0, t - min_tokens + 1, size=b)  # padding before each row's tokens
    keep = np.arange(t)[None, :] >= pad[:, None]  # (B, T)
    positions = np.maximum(np.cumsum(keep, axis=1) - 1, 0)
    mask = np.tril(np.ones((t, t), bool))[None, None] & keep[:, None, None, :]
    mask = mask | np.eye(t, dtype=bool)[None, None]  # a padding query sees itself: no NaN
    return positions, mask


def tables(positions, head_dim, theta=10000.0, scaling=None):
    return ops.rotary_table(backend.asarray(positions), head_dim, theta, scaling,
                            dtype=backend.default_float())


attention_cases = dict(seed=seeds, b=st.integers(1, 2), t=st.integers(1, 4),
                       heads=heads_and_kv_heads(), half=st.integers(1, 3),
                       qkv_bias=st.booleans(), output_bias=st.booleans(),
                       qk_norm=st.booleans())


def assert_passes(result):
    assert result.worst_error < GRADCHECK_TOL, f"gradient check failed:\n{result}"


# =========================================================================== gradient checks
@given(seed=seeds, lead=st.lists(st.integers(1, 3), min_size=1, max_size=2),
       d=st.integers(1, 5))
def test_rmsnorm_gradcheck(xb, on_device, seed, lead, d):
    rng = np.random.default_rng(seed)
    norm = nn.RMSNorm(d, eps=1e-6)
    norm.weight.data = on_device(rng.standard_normal(d))
    z = rng.standard_normal((*lead, d))
    x = z / np.sqrt(np.mean(z * z, axis=-1, keepdims=True))  # rms 1: far from sqrt(eps)
    assert_passes(check_module(norm, [on_device(x)]))


@given(seed=seeds, lead=st.lists(st.integers(1, 3), min_size=1, max_size=2),
       d=st.integers(1, 4), d_ff=st.integers(1, 5))
def test_swiglu_feed_forward_gradcheck(xb, on_device, seed, lead, d, d_ff):
    backend.seed(seed % 1000)
    ffn = nn.SwiGLUFeedForward(d, d_ff)
    x = on_device(np.random.default_rng(seed).standard_normal((*lead, d)))
    assert_passes(check_module(ffn, [x]))


@given(**attention_cases)
def test_attention_gradcheck(xb, on_device, seed, b, t, heads, half, qkv_bias, output_bias,
                             qk_norm):
    h, kv = heads
    rng = np.random.default_rng(seed)
    backend.seed(seed % 1000)
    d, e = 5, 2 * half  # head_dim E not D / H
    attention = nn.GroupedQueryAttention(d, h, kv, e, qkv_bias, output_bias, qk_norm)
    positions, mask = positions_and_mask(rng, b, t)
    cos, sin = tables(positions, e, scaling=None)
    x = on_device(rng.standard_normal((b, t, d)))
    assert_passes(check_module(attention, [x, cos, sin], [0], {"mask": on_device(mask)},
                               h=1e-6))


@given(seed=seeds, b=st.integers(1, 2), t=st.integers(1, 3), heads=heads_and_kv_heads(),
       qk_norm=st.booleans())
def test_block_gradcheck(xb, on_device, seed, b, t, heads, qk_norm):
    h, kv = heads
    rng = np.random.default_rng(seed)
    backend.seed(seed % 1000)
    block = nn.LlamaBlock(6, h, 7, kv, 4, qkv_bias=True, qk_norm=qk_norm)
    positions, mask = positions_and_mask(rng, b, t)
    cos, sin = tables(positions, 4)
    x = on_device(rng.standard_normal((b, t, 6)))
    assert_passes(check_module(block, [x, cos, sin], [0], {"mask": on_device(mask)}, h=1e-6))


# =========================================================================== transformers
FAMILY_OPTIONS = {  # family -> our layer's options as that family's config sets them
    "llama": dict(qkv_bias=True, output_bias=True, qk_norm=False),  # attention_bias=True
    "qwen2": dict(qkv_bias=True, output_bias=False, qk_norm=False),
    "qwen3": dict(qkv_bias=False, output_bias=False, qk_norm=True),
}


def hf_config(family, d, h, kv, e, d_ff=7, theta=10000.0):
    config_class, _ = hf_classes(family)
    extra = {"attention_bias": True} if family == "llama" else {}
    return config_class(hidden_size=d, num_attention_heads=h, num_key_value_heads=kv,
                        head_dim=e, intermediate_size=d_ff, rms_norm_eps=1e-6,
                        rope_theta=theta, vocab_size=11, num_hidden_layers=1,
                        attn_implementation="sdpa", **extra)


def run_torch(module, state, x, g, **inputs):
    """Load ``state`` into ``module`` (float64), run it on x (a leaf) and ``inputs``,
    backpropagate g -> (output, {name: gradient} of the parameters and of the input "x")."""
    import torch

    module = module.to(torch.float64)
    module.load_state_dict(state, strict=True)
    out = module(x, **inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.tensor(g))
    grads = {name: p.grad for name, p in module.named_parameters()}
    grads["x"] = x.grad
    return out, grads


def compare(ours_out, ours_grads, theirs_out, theirs_grads, what):
    from .llama_reference import ours_from_hf

    rtol = PARITY_RTOL["float64"]
    assert_close(ours_out, to_host(theirs_out), rtol, f"{what} output")
    expected = ours_from_hf({k: v for k, v in theirs_grads.items() if k != "x"})
    assert set(expected) == set(ours_grads) - {"x"}, (set(expected), set(ours_grads))
    for name, grad in ours_grads.items():
        reference = to_host(theirs_grads["x"]) if name == "x" else expected[name]
        assert_close(grad, reference, rtol, f"{what} gradient of {name}")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("layer", ["attention", "block"])
@given(seed=seeds, b=st.integers(1, 3), t=st.integers(2, 5), heads=heads_and_kv_heads(),
       half=st.integers(1, 4))
def test_parity(torch, family, layer, seed, b, t, heads, half):
    h, kv = heads
    d, e = 12, 2 * half  # transformers asks hidden_size % heads == 0 (head_dim its own)
    rng = np.random.default_rng(seed)
    config = hf_config(family, d, h, kv, e)
    _, modeling = hf_classes(family)
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    with using_backend("numpy", "float64", seed=seed % 1000), float64_reference():
        options = FAMILY_OPTIONS[family]
        if layer == "attention":
            ours = nn.GroupedQueryAttention(d, h, kv, e, norm_eps=1e-6, **options)
            theirs = getattr(modeling, f"{prefix}Attention")(config, layer_idx=0)
        else:
            ours = nn.LlamaBlock(d, h, 7, kv, e, norm_eps=1e-6, **options)
            theirs = getattr(modeling, f"{prefix}DecoderLayer")(config, layer_idx=0)
        for _, p in ours.named_parameters():  # weights of scale 1/sqrt(in), norms' near 1:
            p.data = backend.asarray(  # moderate scores (a saturated softmax cancels)
                rng.standard_normal(p.shape) / np.sqrt(p.shape[0]) + (len(p.shape) == 1))
        # two tokens a row at least: a query with one key to see has dq = 0 in theory,
        # which a relative comparison cannot judge
        positions, mask = positions_and_mask(rng, b, t, min_tokens=2)
        cos, sin = tables(positions, e)
        x_host = rng.standard_normal((b, t, d))
        y = ours(backend.asarray(x_host), cos, sin, backend.asarray(mask))
        g = rng.standard_normal(tuple(y.shape))
        dx = ours.backward(backend.asarray(g))
        ours_grads = {name: p.grad for name, p in ours.named_parameters()} | {"x": dx}
        x = torch.tensor(x_host, requires_grad=True)
        tcos, tsin = (torch.tensor(backend.to_numpy(a)) for a in (cos, sin))
        ty, tgrads = run_torch(theirs, hf_state(ours.state_dict()), x, g,
                               position_embeddings=(tcos, tsin),
                               attention_mask=torch.tensor(mask))
        compare(y, ours_grads, ty, tgrads, f"{family} {layer}")


@pytest.mark.parametrize("shape", [(2, 3, 8), (5, 8)])
def test_norm_and_feed_forward_parity(torch, shape):
    """RMSNorm and SwiGLUFeedForward as LlamaRMSNorm (in float64) and LlamaMLP."""
    _, modeling = hf_classes("llama")
    rng = np.random.default_rng(0)
    config = hf_config("llama", 8, 2, 1, 4, d_ff=6)
    with using_backend("numpy", "float64"), float64_reference():
        for ours, theirs in ((nn.RMSNorm(8, 1e-6), modeling.LlamaRMSNorm(8, 1e-6)),
                             (nn.SwiGLUFeedForward(8, 6), modeling.LlamaMLP(config))):
            for _, p in ours.named_parameters():
                p.data = backend.asarray(rng.standard_normal(p.shape))
            x_host = rng.standard_normal(shape)
            y = ours(backend.asarray(x_host))
            g = rng.standard_normal(shape)
            dx = ours.backward(backend.asarray(g))
            grads = {name: p.grad for name, p in ours.named_parameters()} | {"x": dx}
            x = torch.tensor(x_host, requires_grad=True)
            ty, tgrads = run_torch(theirs, hf_state(ours.state_dict()), x, g)
            compare(y, grads, ty, tgrads, type(ours).__name__)


# =========================================================================== the KV cache
@pytest.mark.parametrize("heads, kv_heads", [(4, 1), (4, 2), (4, 4)])
def test_cache_holds_the_kv_heads_and_decodes_as_the_full_forward(xb, on_device, heads,
                                                                   kv_heads):
    rng = np.random.default_rng(0)
    e, t = 6, 5
    attention = nn.GroupedQueryAttention(8, heads, kv_heads, e, qk_norm=True)
    positions, mask = positions_and_mask(rng, 2, t)
    cos, sin = tables(positions, e)
    x = on_device(rng.standard_normal((2, t, 8)))
    with nn.no_grad():
        full = to_host(attention(x, cos, sin, on_device(mask)))
        cache = nn.KVCache()
        steps = []
        for i in range(t):  # one position at a time, its row of the mask
            steps.append(to_host(attention(x[:, i:i + 1, :], cos[:, i:i + 1, :], sin[:, i:i + 1, :],
                                           on_device(mask[:, :, i:i + 1, :i + 1]), cache)))
    assert tuple(cache.keys.shape) == tuple(cache.values.shape) == (2, kv_heads, t, e)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-12, atol=1e-12)


# =========================================================================== errors
def test_kv_heads_must_divide_the_heads(xb):
    with raises_naming(ValueError, "num_heads 6", "num_kv_heads 4",
                       "[1, 2, 3, 6]"):
        nn.GroupedQueryAttention(12, 6, 4)
    with raises_naming(ValueError, "num_kv_heads", "0"):
        nn.GroupedQueryAttention(12, 6, 0)


def test_head_dim_must_be_even(xb):
    with raises_naming(ValueError, "head_dim", "even", "5"):
        nn.GroupedQueryAttention(10, 2, 1, head_dim=5)
    with raises_naming(ValueError, "d_model 10", "num_heads 3"):
        nn.GroupedQueryAttention(10, 3)


def test_tables_must_fit(xb, on_device):
    attention = nn.GroupedQueryAttention(8, 2, 1, 4)
    x = on_device(np.zeros((2, 3, 8)))
    cos, sin = tables(np.arange(4), 4)  # 4 positions for 3
    with raises_naming(ValueError, "rotary cos", "(4, 4)", "(3, 4)"):
        attention(x, cos, sin)
    cos, sin = tables(np.arange(3), 6)  # another head_dim
    with raises_naming(ValueError, "rotary cos", "(3, 6)"):
        attention(x, cos, sin)


def test_cache_needs_no_grad(xb, on_device):
    attention = nn.GroupedQueryAttention(8, 2, 1, 4)
    cos, sin = tables(np.arange(3), 4)
    with raises_naming(RuntimeError, "KVCache", "no_grad"):
        attention(on_device(np.zeros((1, 3, 8))), cos, sin, kv_cache=nn.KVCache())


def test_mask_must_fit(xb, on_device):
    attention = nn.GroupedQueryAttention(8, 2, 1, 4)
    cos, sin = tables(np.arange(3), 4)
    with raises_naming(ValueError, "attention mask", "(1, 2, 3, 3)"):
        attention(on_device(np.zeros((1, 3, 8))), cos, sin, on_device(np.ones((1, 1, 3, 4),
                                                                                bool)))
