"""Parity with PyTorch: same weights, same inputs -> same outputs and gradients.

Each test builds the PyTorch module (parameters re-drawn at random, so zero
biases and LayerNorm's gamma = 1 / beta = 0 hide nothing), copies its weights
into the npformer layer with ``load_torch_state_dict`` (``helpers.load_from_torch``),
runs both on identical inputs and pulls a RANDOM upstream gradient back through
both (torch by autograd, npformer by its hand-written backward): npformer on NumPy
with torch on the CPU and, where a GPU is there, npformer on CuPy with torch on
CUDA.  Compared, within
``PARITY_RTOL[dtype]`` (float32 1e-5, float64 1e-10, norm-wise relative):

* the output;
* the gradient of every floating-point input;
* the gradient of EVERY torch parameter: npformer's gradients are converted to
  torch's names and layouts by the same rules as the weights (``to_torch_state_dict``
  applied to the gradients), and the key sets must be identical.

Modules: Linear, LayerNorm, Embedding, learned positions (= torch Embedding of
positions), MultiheadAttention (batch_first) self and cross with key padding,
causal, causal + padding and per-head random masks, TransformerEncoderLayer and
TransformerDecoderLayer (post-/pre-norm, relu as the string "relu", the exact GELU as
the string "gelu" and npformer's "gelu_tanh" as ``partial(F.gelu, approximate="tanh")``)
with key-padding and causal masks.  PyTorch's masks mean the opposite of npformer's
(True = NOT allowed / padding) and are converted.  No row is fully masked here:
PyTorch gives NaN there.  Torch modules run in train mode with dropout 0 and
inputs that require grad, so no inference fast path changes the numerics.

Export: ``to_torch_state_dict(layer)`` loaded (strict) into a fresh torch module
reproduces npformer's outputs, and loading it back gives bit-identical weights.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from npformer import backend
from npformer.interop.pytorch import to_torch_state_dict
from npformer.ops import causal_mask, padding_mask

from .conftest import using_backend
from .helpers import (
    PARITY_RTOL,
    assert_close,
    load_from_torch,
    tiered,
    to_torch,
    torch_device,
    using_tier,
)


@pytest.fixture(autouse=True, params=["fast", "textbook"])
def each_tier(request):
    """Every test of this file runs in both tiers (tests.helpers.tiered), then restores it."""
    with using_tier(request.param):
        yield request.param

B, T, S, D, H, F, V = 2, 5, 4, 8, 2, 12, 7
TGT_LENS = [T, 1]  # second element: a single valid position (length 1)
SRC_LENS = [2, S]


@pytest.fixture(params=["float32", "float64"])
def dtype(request, parity_backend):
    """Run on each parity backend (NumPy, and CuPy on a GPU) with this float dtype."""
    with using_backend(parity_backend, request.param):
        yield request.param


# =========================================================================== helpers
def torch_dtype(torch, dtype):
    return getattr(torch, dtype)


def randomize_torch(torch, module, seed: int = 0, std: float = 0.5):
    """Every parameter re-drawn on the CPU (the same values whatever the device), copied in."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * std)
    return module


def prepare_torch(torch, module, dtype):
    module = module.to(device=torch_device(), dtype=torch_dtype(torch, dtype))
    randomize_torch(torch, module)
    return module.train()


def host(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def npformer_grads_as_torch(layer) -> dict:
    """npformer's parameter gradients under torch's names and layouts: the gradients
    are put in the parameters' place and converted by the weight rules."""
    params = [p for _, p in layer.named_parameters()]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad
        return to_torch_state_dict(layer)
    finally:
        for p, data in zip(params, saved):
            p.data = data


def assert_parameter_grads(torch_module, layer, dtype):
    ours = npformer_grads_as_torch(layer)
    theirs = {name: p.grad for name, p in torch_module.named_parameters()}
    assert set(ours) == set(theirs), f"parameter names differ: {set(ours) ^ set(theirs)}"
    for name, grad in theirs.items():
        assert grad is not None, f"torch produced no gradient for {name}"
        assert_close(ours[name], grad, PARITY_RTOL[dtype], f"grad of {name}")


def run_both(torch, torch_module, torch_call, layer, npf_call, inputs, dtype, seed=1):
    """Forward and backward on both sides; compare outputs and every input gradient.

    inputs: host arrays (floating ones get gradients compared).
    torch_call(*tensors) -> output tensor; npf_call(*backend arrays) -> output.
    Returns npformer's backward result.
    """
    rng = np.random.default_rng(seed)
    float_idx = [i for i, a in enumerate(inputs) if np.issubdtype(a.dtype, np.floating)]
    t_inputs = [to_torch(torch, a, requires_grad=i in float_idx)
                for i, a in enumerate(inputs)]
    t_out = torch_call(*t_inputs)
    upstream = host(rng, tuple(t_out.shape), dtype)
    (t_out * to_torch(torch, upstream)).sum().backward()

    out = npf_call(*[backend.asarray(a) for a in inputs])
    assert backend.to_numpy(out).dtype == np.dtype(dtype)
    assert_close(out, t_out, PARITY_RTOL[dtype], "output")
    grads = layer.backward(backend.asarray(upstream))  # the layer contract (nn/module.py):
    grads = (() if grads is None  # None: no float inputs (ids)
             else grads if isinstance(grads, tuple) else (grads,))  # one array, or a tuple
    assert len(grads) == len(float_idx)
    for i, g in zip(float_idx, grads):
        assert_close(g, t_inputs[i].grad, PARITY_RTOL[dtype], f"grad of input {i}")
    assert_parameter_grads(torch_module, layer, dtype)
    return grads


# --------------------------------------------------------------------------- masks
def np_padding(lens, n):
    """(B, n) bool, True at valid positions."""
    return np.arange(n)[None, :] < np.asarray(lens)[:, None]


def masks_for(kind: str, t: int, s: int, lens, rng):
    """(npformer mask or None, torch attn_mask or None, torch key_padding_mask or None)."""
    if kind == "none":
        return None, None, None
    if kind == "padding":
        return (padding_mask(backend.asarray(np.asarray(lens)), s), None,
                ~np_padding(lens, s))
    if kind == "causal":
        causal = backend.to_numpy(causal_mask(t, s))
        return causal_mask(t, s), ~causal, None
    if kind == "causal_padding":
        causal = backend.to_numpy(causal_mask(t, s))
        ours = causal_mask(t, s) & padding_mask(backend.asarray(np.asarray(lens)), s)
        return ours, ~causal, ~np_padding(lens, s)
    if kind == "random_heads":  # per-(batch, head) masks; key 0 always allowed (no NaN rows)
        keep = rng.random((B, H, t, s)) < 0.5
        keep[..., 0] = True
        return backend.asarray(keep), ~keep.reshape(B * H, t, s), None
    raise AssertionError(kind)


def torch_mask(torch, array):
    return None if array is None else to_torch(torch, array)


# =========================================================================== basic layers
@pytest.mark.parametrize("bias", [True, False])
def test_linear(torch, dtype, bias):
    tm = prepare_torch(torch, torch.nn.Linear(5, 4, bias=bias), dtype)
    layer = tiered.Linear(5, 4, bias=bias)
    load_from_torch(layer, tm)
    x = host(np.random.default_rng(0), (B, 3, 5), dtype)
    run_both(torch, tm, tm, layer, layer, [x], dtype)


def test_layernorm(torch, dtype):
    tm = prepare_torch(torch, torch.nn.LayerNorm(D), dtype)
    layer = tiered.LayerNorm(D)
    load_from_torch(layer, tm)
    x = host(np.random.default_rng(0), (B, T, D), dtype, scale=3.0) + 1.5
    run_both(torch, tm, tm, layer, layer, [x], dtype)


def test_embedding(torch, dtype):
    tm = prepare_torch(torch, torch.nn.Embedding(V, D), dtype)
    layer = tiered.Embedding(V, D)
    load_from_torch(layer, tm)
    ids = np.array([[0, 3, 3, 6, 1], [3, 3, 3, 2, 0]])  # repeated ids accumulate
    run_both(torch, tm, tm, layer, layer, [ids], dtype)


def test_learned_positions(torch, dtype):
    """LearnedPositionalEmbedding is x + torch.nn.Embedding(block_size, D)(arange(T))."""
    tm = prepare_torch(torch, torch.nn.Embedding(T + 2, D), dtype)
    layer = tiered.LearnedPositionalEmbedding(T + 2, D)
    load_from_torch(layer, tm)
    x = host(np.random.default_rng(0), (B, T, D), dtype)
    run_both(torch, tm, lambda x: x + tm(torch.arange(T, device=torch_device()))[None],
             layer, layer, [x], dtype)


# =========================================================================== attention
@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal", "causal_padding",
                                       "random_heads"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_multi_head_attention(torch, dtype, cross, mask_kind):
    rng = np.random.default_rng(7)
    tm = prepare_torch(torch, torch.nn.MultiheadAttention(D, H, batch_first=True), dtype)
    layer = tiered.MultiHeadAttention(D, H)
    load_from_torch(layer, tm)
    s = S + 1 if cross else T  # cross: more keys than queries (causal shifts)
    ours, attn_mask, kpm = masks_for(mask_kind, T, s, [3, 1], rng)
    am, kp = torch_mask(torch, attn_mask), torch_mask(torch, kpm)
    x = host(rng, (B, T, D), dtype)
    if cross:
        memory = host(rng, (B, s, D), dtype)
        run_both(torch, tm,
                 lambda q, m: tm(q, m, m, attn_mask=am, key_padding_mask=kp)[0],
                 layer, lambda q, m: layer(q, m, mask=ours), [x, memory], dtype)
    else:
        run_both(torch, tm,
                 lambda q: tm(q, q, q, attn_mask=am, key_padding_mask=kp)[0],
                 layer, lambda q: layer(q, mask=ours), [x], dtype)


def test_multi_head_attention_more_heads(torch, dtype):
    """4 heads of width 2: head h is column block h of the fused projection."""
    rng = np.random.default_rng(8)
    tm = prepare_torch(torch, torch.nn.MultiheadAttention(D, 4, batch_first=True), dtype)
    layer = tiered.MultiHeadAttention(D, 4)
    load_from_torch(layer, tm)
    x = host(rng, (B, T, D), dtype)
    run_both(torch, tm, lambda q: tm(q, q, q)[0], layer, layer, [x], dtype)


# =========================================================================== blocks
def torch_activation(torch, name):
    if name == "gelu_tanh":  # torch has no string for the tanh form
        return functools.partial(torch.nn.functional.gelu, approximate="tanh")
    return name  # the strings "relu" and "gelu" (exact, erf) mean the same in both


@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal", "causal_padding"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_encoder_layer(torch, dtype, norm_first, activation, mask_kind):
    rng = np.random.default_rng(11)
    tm = prepare_torch(torch, torch.nn.TransformerEncoderLayer(
        D, H, F, dropout=0.0, activation=torch_activation(torch, activation),
        batch_first=True, norm_first=norm_first), dtype)
    block = tiered.EncoderBlock(D, H, F, dropout=0.0, activation=activation,
                            norm_first=norm_first)
    load_from_torch(block, tm)
    ours, attn_mask, kpm = masks_for(mask_kind, T, T, TGT_LENS, rng)
    am, kp = torch_mask(torch, attn_mask), torch_mask(torch, kpm)
    x = host(rng, (B, T, D), dtype)
    run_both(torch, tm, lambda src: tm(src, src_mask=am, src_key_padding_mask=kp),
             block, lambda src: block(src, mask=ours), [x], dtype)


@pytest.mark.parametrize("masks", ["none", "causal_and_padding"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_decoder_layer(torch, dtype, norm_first, activation, masks):
    rng = np.random.default_rng(12)
    tm = prepare_torch(torch, torch.nn.TransformerDecoderLayer(
        D, H, F, dropout=0.0, activation=torch_activation(torch, activation),
        batch_first=True, norm_first=norm_first), dtype)
    block = tiered.DecoderBlock(D, H, F, dropout=0.0, activation=activation,
                            norm_first=norm_first)
    load_from_torch(block, tm)
    if masks == "none":
        self_mask = memory_mask = None
        t_kwargs = {}
    else:  # causal target mask + target key padding + memory key padding
        self_mask, tgt_mask, tgt_kpm = masks_for("causal_padding", T, T, TGT_LENS, rng)
        memory_mask, _, mem_kpm = masks_for("padding", T, S, SRC_LENS, rng)
        t_kwargs = dict(tgt_mask=torch_mask(torch, tgt_mask),
                        tgt_key_padding_mask=torch_mask(torch, tgt_kpm),
                        memory_key_padding_mask=torch_mask(torch, mem_kpm))
    x = host(rng, (B, T, D), dtype)
    memory = host(rng, (B, S, D), dtype)
    run_both(torch, tm, lambda tgt, mem: tm(tgt, mem, **t_kwargs),
             block, lambda tgt, mem: block(tgt, mem, self_mask=self_mask,
                                           memory_mask=memory_mask),
             [x, memory], dtype)


def test_decoder_layer_memory_attn_mask(torch, dtype):
    """A (T, S) memory attention mask on top of memory key padding."""
    rng = np.random.default_rng(13)
    tm = prepare_torch(torch, torch.nn.TransformerDecoderLayer(
        D, H, F, dropout=0.0, batch_first=True), dtype)
    block = tiered.DecoderBlock(D, H, F, dropout=0.0)
    load_from_torch(block, tm)
    keep = rng.random((T, S)) < 0.5
    keep[:, 0] = True  # never a fully masked row
    pad, _, mem_kpm = masks_for("padding", T, S, SRC_LENS, rng)
    memory_mask = backend.asarray(keep) & pad
    x, memory = host(rng, (B, T, D), dtype), host(rng, (B, S, D), dtype)
    run_both(torch, tm,
             lambda tgt, mem: tm(tgt, mem, memory_mask=torch_mask(torch, ~keep),
                                 memory_key_padding_mask=torch_mask(torch, mem_kpm)),
             block, lambda tgt, mem: block(tgt, mem, memory_mask=memory_mask),
             [x, memory], dtype)


# =========================================================================== export
def _randomize_npformer(layer, seed=5):
    rng = np.random.default_rng(seed)
    for _, p in layer.named_parameters():
        p.data = backend.asarray(rng.standard_normal(p.shape) * 0.5,
                                 dtype=backend.default_float_name())


EXPORT_CASES = ["linear", "layernorm", "embedding", "mha_self", "mha_cross",
                "encoder_post", "encoder_pre_gelu", "encoder_pre_gelu_tanh", "decoder_post",
                "decoder_pre_gelu", "decoder_post_gelu_tanh"]


def _export_pair(torch, kind):
    """(npformer layer, fresh torch module, torch call, npformer call, inputs)."""
    rng = np.random.default_rng(21)
    dt = backend.default_float_name()
    x = host(rng, (B, T, D), dt)
    memory = host(rng, (B, S, D), dt)
    act = "gelu_tanh" if kind.endswith("gelu_tanh") else "gelu" if kind.endswith("gelu") else "relu"
    norm_first = "_pre" in kind
    if kind == "linear":
        return tiered.Linear(D, 3), torch.nn.Linear(D, 3), None, None, [x]
    if kind == "layernorm":
        return tiered.LayerNorm(D), torch.nn.LayerNorm(D), None, None, [x]
    if kind == "embedding":
        return tiered.Embedding(V, D), torch.nn.Embedding(V, D), None, None, [
            rng.integers(0, V, size=(B, T))]
    if kind == "mha_self":
        ours, am, kp = masks_for("causal_padding", T, T, TGT_LENS, rng)
        return (tiered.MultiHeadAttention(D, H),
                torch.nn.MultiheadAttention(D, H, batch_first=True),
                lambda tm, q: tm(q, q, q, attn_mask=torch_mask(torch, am),
                                 key_padding_mask=torch_mask(torch, kp))[0],
                lambda layer, q: layer(q, mask=ours), [x])
    if kind == "mha_cross":
        ours, _, kp = masks_for("padding", T, S, SRC_LENS, rng)
        return (tiered.MultiHeadAttention(D, H),
                torch.nn.MultiheadAttention(D, H, batch_first=True),
                lambda tm, q, m: tm(q, m, m, key_padding_mask=torch_mask(torch, kp))[0],
                lambda layer, q, m: layer(q, m, mask=ours), [x, memory])
    if kind.startswith("encoder"):
        ours, am, kp = masks_for("causal_padding", T, T, TGT_LENS, rng)
        return (tiered.EncoderBlock(D, H, F, dropout=0.0, activation=act, norm_first=norm_first),
                torch.nn.TransformerEncoderLayer(D, H, F, dropout=0.0,
                                                 activation=torch_activation(torch, act),
                                                 batch_first=True, norm_first=norm_first),
                lambda tm, src: tm(src, src_mask=torch_mask(torch, am),
                                   src_key_padding_mask=torch_mask(torch, kp)),
                lambda layer, src: layer(src, mask=ours), [x])
    if kind.startswith("decoder"):
        self_mask, am, tkp = masks_for("causal_padding", T, T, TGT_LENS, rng)
        mem_mask, _, mkp = masks_for("padding", T, S, SRC_LENS, rng)
        return (tiered.DecoderBlock(D, H, F, dropout=0.0, activation=act, norm_first=norm_first),
                torch.nn.TransformerDecoderLayer(D, H, F, dropout=0.0,
                                                 activation=torch_activation(torch, act),
                                                 batch_first=True, norm_first=norm_first),
                lambda tm, tgt, mem: tm(tgt, mem, tgt_mask=torch_mask(torch, am),
                                        tgt_key_padding_mask=torch_mask(torch, tkp),
                                        memory_key_padding_mask=torch_mask(torch, mkp)),
                lambda layer, tgt, mem: layer(tgt, mem, self_mask=self_mask,
                                              memory_mask=mem_mask),
                [x, memory])
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", EXPORT_CASES)
def test_export_to_torch(torch, dtype, kind):
    layer, tm, torch_call, npf_call, inputs = _export_pair(torch, kind)
    _randomize_npformer(layer)
    state = to_torch_state_dict(layer)
    assert all(a.flags.c_contiguous for a in state.values())
    tm = tm.to(device=torch_device(), dtype=torch_dtype(torch, dtype)).train()
    result = tm.load_state_dict({k: to_torch(torch, v) for k, v in state.items()}, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    torch_call = torch_call or (lambda m, *a: m(*a))
    npf_call = npf_call or (lambda m, *a: m(*a))
    with torch.no_grad():
        expected = torch_call(tm, *[to_torch(torch, a) for a in inputs])
    out = npf_call(layer, *[backend.asarray(a) for a in inputs])
    assert_close(out, expected, PARITY_RTOL[dtype], f"{kind} output after export")

    # and back: the weights survive the round trip bit for bit
    fresh, *_ = _export_pair(torch, kind)
    load_from_torch(fresh, tm)
    for (name, p), (_, q) in zip(layer.named_parameters(), fresh.named_parameters()):
        np.testing.assert_array_equal(backend.to_numpy(q.data), backend.to_numpy(p.data),
                                      err_msg=name)
