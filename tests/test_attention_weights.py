"""The attention weights, the public way: ``MultiHeadAttention(...)(x, need_weights=True)``
and ``npformer.nn.record_attention(model)``.

* The weights are PyTorch's ``need_weights=True, average_attn_weights=False`` ones for
  the same weights and masks (self and cross, every mask kind of the parity tests),
  in both tiers and both float dtypes.
* Independently of PyTorch: they are softmax(Q K^T / sqrt(E)) over the allowed keys
  (computed here in float64 NumPy from the layer's own projections), every row sums
  to 1, and every masked key gets exactly 0.
* Asking for them changes nothing else: the output and the backward are those of a
  plain call.
* ``record_attention`` names and records every attention layer of the three models
  (encoder self-attention, decoder self- and cross-attention, cached decoding), padded
  keys at 0 and causal rows looking back only, and puts the layers back as they were.
"""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend, nn
from npformer.models import (
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
)
from npformer.nn import MultiHeadAttention, record_attention

from .conftest import using_backend
from .helpers import PARITY_RTOL, assert_close, load_from_torch, tiered, to_torch
from .test_layers_parity import B, D, H, S, T, host, masks_for, prepare_torch, torch_mask

# A behaviour test: it runs in both tiers (tests.helpers.tiered), which must behave the same.
pytestmark = pytest.mark.usefixtures("tier")

MASK_KINDS = ["none", "padding", "causal", "causal_padding", "random_heads"]


@pytest.fixture(params=["float32", "float64"])
def dtype(request, parity_backend):
    with using_backend(parity_backend, request.param):
        yield request.param


def key_count(cross: bool) -> int:
    return S + 1 if cross else T  # cross: more keys than queries


def numpy_weights(layer: MultiHeadAttention, x, keys_from, mask) -> np.ndarray:
    """softmax(Q K^T / sqrt(E)) over the allowed keys, in float64 NumPy from the layer's
    own projection weights: (B, H, T, S)."""
    def project(inputs, linear):  # (B, N, D) -> (B, H, N, E)
        out = inputs.astype(np.float64) @ backend.to_numpy(linear.weight.data).astype(np.float64)
        out = out + backend.to_numpy(linear.bias.data).astype(np.float64)
        b, n, _ = out.shape
        return out.reshape(b, n, H, -1).transpose(0, 2, 1, 3)

    q, k = project(x, layer.q_proj), project(keys_from, layer.k_proj)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])  # (B, H, T, S)
    allowed = np.ones(scores.shape, bool) if mask is None else np.broadcast_to(
        backend.to_numpy(mask), scores.shape)
    scores = np.where(allowed, scores, -np.inf)
    exp = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return exp / exp.sum(axis=-1, keepdims=True)


def layer_and_inputs(cross: bool, mask_kind: str, dtype: str, seed: int = 3):
    rng = np.random.default_rng(seed)
    s = key_count(cross)
    layer = tiered.MultiHeadAttention(D, H)
    for p in layer.parameters():  # weights away from the initialisation's small scale
        p.data = backend.asarray(rng.standard_normal(p.shape) * 0.5, dtype=dtype)
    ours, _, _ = masks_for(mask_kind, T, s, [3, 1], rng)
    x = host(rng, (B, T, D), dtype)
    memory = host(rng, (B, s, D), dtype) if cross else None
    return layer, x, memory, ours


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_weights_are_torchs_need_weights(torch, dtype, tier, cross, mask_kind):
    rng = np.random.default_rng(7)
    tm = prepare_torch(torch, torch.nn.MultiheadAttention(D, H, batch_first=True), dtype)
    layer = tiered.MultiHeadAttention(D, H)
    load_from_torch(layer, tm)
    s = key_count(cross)
    ours, attn_mask, kpm = masks_for(mask_kind, T, s, [3, 1], rng)
    x = host(rng, (B, T, D), dtype)
    memory = host(rng, (B, s, D), dtype) if cross else x
    tx, tmem = to_torch(torch, x), to_torch(torch, memory)
    _, theirs = tm(tx, tmem, tmem, attn_mask=torch_mask(torch, attn_mask),
                   key_padding_mask=torch_mask(torch, kpm), need_weights=True,
                   average_attn_weights=False)  # (B, H, T, S)
    context = None if not cross else backend.asarray(memory)
    _, weights = layer(backend.asarray(x), context, mask=ours, need_weights=True)
    assert tuple(weights.shape) == (B, H, T, s)
    assert_close(weights, theirs, PARITY_RTOL[dtype], "attention weights")


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_weights_are_the_softmax_of_the_scores(tier, cross, mask_kind):
    layer, x, memory, mask = layer_and_inputs(cross, mask_kind, "float64")
    context = None if memory is None else backend.asarray(memory)
    _, weights = layer(backend.asarray(x), context, mask=mask, need_weights=True)
    weights = backend.to_numpy(weights)
    expected = numpy_weights(layer, x, x if memory is None else memory, mask)
    np.testing.assert_allclose(weights, expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-12)
    if mask is not None:
        masked = ~np.broadcast_to(backend.to_numpy(mask), weights.shape)
        assert masked.any()
        assert np.all(weights[masked] == 0.0), "a masked key got a nonzero weight"


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_asking_for_weights_changes_neither_output_nor_backward(tier, cross):
    layer, x, memory, mask = layer_and_inputs(cross, "padding", "float64")
    context = None if memory is None else backend.asarray(memory)
    upstream = backend.asarray(np.random.default_rng(1).standard_normal((B, T, D)))

    def run(**kwargs):
        layer.zero_grad()
        out = layer(backend.asarray(x), context, mask=mask, **kwargs)
        y = out[0] if kwargs else out
        grads = layer.backward(upstream)
        return [backend.to_numpy(a) for a in (y, *np.atleast_1d(np.array(grads, dtype=object)))
                ] + [backend.to_numpy(p.grad) for p in layer.parameters()]

    plain, with_weights = run(), run(need_weights=True)
    for a, b in zip(plain, with_weights, strict=True):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- models
def padded_ids(rng, vocab: int, lens: list[int], width: int) -> np.ndarray:
    ids = rng.integers(1, vocab, size=(len(lens), width))
    ids[np.arange(width)[None, :] >= np.array(lens)[:, None]] = 0
    return ids


def assert_probabilities(weights, allowed) -> None:
    """Rows sum to 1 and keys that are not allowed get exactly 0."""
    weights = backend.to_numpy(weights)
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-5)
    assert np.all(weights[~np.broadcast_to(allowed, weights.shape)] == 0.0)


def test_record_attention_in_the_classifier(tier):
    model = tiered.TransformerClassifier(ClassifierConfig(vocab_size=11, d_model=8, num_heads=2,
                                                   num_layers=2, d_ff=16, block_size=8))
    ids = padded_ids(np.random.default_rng(0), 11, [6, 3], 6)
    with nn.evaluating(model), record_attention(model) as weights:
        model(backend.asarray(ids))
    assert sorted(weights) == ["blocks.0.self_attn", "blocks.1.self_attn"]
    keys = np.array([6, 3])[:, None, None, None] > np.arange(6)  # (B, 1, 1, S) valid keys
    for name in weights:
        assert tuple(weights[name].shape) == (2, 2, 6, 6)
        assert_probabilities(weights[name], keys)
    for _, layer in nn.attention_layers(model):  # put back as they were
        assert layer.keep_attention is False and layer.last_attention is None


def test_record_attention_in_the_encoder_decoder(tier):
    config = Seq2SeqConfig(src_vocab_size=9, tgt_vocab_size=10, d_model=8, num_heads=2,
                           num_encoder_layers=1, num_decoder_layers=2, d_ff=16, block_size=8)
    model = tiered.Seq2SeqTransformer(config)
    rng = np.random.default_rng(1)
    src, tgt = padded_ids(rng, 9, [5, 2], 5), padded_ids(rng, 10, [4, 4], 4)
    with nn.evaluating(model), record_attention(model) as weights:
        model(backend.asarray(src), backend.asarray(tgt))
    assert set(weights) == {"encoder.0.self_attn", "decoder.0.self_attn", "decoder.0.cross_attn",
                            "decoder.1.self_attn", "decoder.1.cross_attn"}
    source_keys = np.array([5, 2])[:, None, None, None] > np.arange(5)
    assert tuple(weights["decoder.1.cross_attn"].shape) == (2, 2, 4, 5)  # (B, H, T, S)
    assert_probabilities(weights["decoder.1.cross_attn"], source_keys)
    assert_probabilities(weights["encoder.0.self_attn"], source_keys)
    causal = np.tril(np.ones((4, 4), bool))
    assert_probabilities(weights["decoder.0.self_attn"], causal)


def test_record_attention_in_cached_decoding_and_after_the_block(tier):
    model = tiered.CausalLM(CausalLMConfig(vocab_size=7, block_size=8, d_model=8, num_heads=2,
                                    num_layers=1, d_ff=16, dropout=0.0))
    ids = backend.asarray(np.array([[1, 2, 3, 4]]))
    name = "blocks.0.self_attn"
    with nn.no_grad(), record_attention(model) as weights:
        model(ids)
        full = backend.to_numpy(weights[name])  # (1, H, 4, 4)
        cache = model.new_cache()
        model.forward_cached(ids[:, :3], cache)  # the prompt, then one step
        prefill = backend.to_numpy(weights[name])
        model.forward_cached(ids[:, 3:], cache)
    step = backend.to_numpy(weights[name])  # kept after the block
    assert_probabilities(full, np.tril(np.ones((4, 4), bool)))
    np.testing.assert_allclose(prefill, full[:, :, :3, :3], rtol=1e-5, atol=1e-7)
    assert step.shape == (1, 2, 1, 4)  # the new position against every cached key
    np.testing.assert_allclose(step, full[:, :, 3:], rtol=1e-5, atol=1e-7)
    with pytest.raises(KeyError, match="no attention layer"):
        weights["blocks.0.mlp"]


def test_record_attention_nested_in_another_keeps_both_records_right(tier):
    """issue 47 case 8: a record_attention nested in another of the same model left the
    outer record empty after the inner block ended.  The inner record holds the forwards
    of its block; the outer one every forward of its own block, the inner's included,
    before and after the inner block ends; leaving both puts the layers back."""
    model = tiered.CausalLM(CausalLMConfig(vocab_size=7, block_size=8, d_model=8, num_heads=2,
                                    num_layers=2, d_ff=16, dropout=0.0))
    long, short = backend.asarray(np.array([[1, 2, 3, 4]])), backend.asarray(np.array([[5, 6]]))
    names = ["blocks.0.self_attn", "blocks.1.self_attn"]
    with nn.no_grad(), record_attention(model) as outer:
        model(long)
        first = {name: backend.to_numpy(outer[name]) for name in names}
        with record_attention(model) as empty:
            pass
        assert len(empty) == 0  # the inner block ran no forward: it records none
        assert sorted(outer) == names  # and the outer record still holds its own
        with record_attention(model) as inner:
            model(short)
        assert sorted(inner) == names and tuple(inner[names[0]].shape) == (1, 2, 2, 2)
        assert sorted(outer) == names and tuple(outer[names[1]].shape) == (1, 2, 2, 2)
        model(long)
    assert sorted(outer) == names
    for name in names:
        np.testing.assert_array_equal(backend.to_numpy(outer[name]), first[name])
        assert tuple(inner[name].shape) == (1, 2, 2, 2)  # kept as it was on leaving
    with pytest.raises(TypeError, match="record_attention takes a Module .* got dict"):
        with record_attention({"blocks": []}):
            pass
    for _, layer in nn.attention_layers(model):  # put back as they were
        assert layer.keep_attention is False and layer.last_attention is None
