"""The equivalent PyTorch module in one call: ``to_torch`` and ``from_torch``.

* ``to_torch(model)`` for each model kind and a spread of configurations (post- and
  pre-norm, relu / gelu / gelu_tanh, learned and sinusoidal positions, tied and untied
  LM heads, the three poolings, dropout in the config) is a ``torch.nn.Module`` whose
  eval-mode outputs on a padded batch equal npformer's: float32 within 1e-6 and float64
  within 1e-12, relative to the largest logit, in both tiers;
* ``from_torch`` of a torch reference gives an npformer model of the same config whose
  outputs equal torch's, and ``to_torch(from_torch(ref))`` has ref's tensors bit for bit;
* the supported layers (Linear, LayerNorm, Embedding, LearnedPositionalEmbedding,
  MultiHeadAttention, EncoderBlock, DecoderBlock) go both ways with equal outputs;
* what has no equivalent is refused naming it; ``import npformer`` and the interop modules
  do not import torch.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from npformer import backend
from npformer.interop.pytorch import from_torch, to_torch
from npformer.interop.torch_reference import torch_models
from npformer.models import CausalLMConfig
from npformer.nn import LayerNorm

from .conftest import using_backend
from .helpers import assert_close, tier_under_test, tiered
from .test_models_parity import CONFIGS, KINDS

RTOL = {"float32": 1e-6, "float64": 1e-12}

MODEL_CASES = [
    ("classifier", dict(pooling="mean", norm_first=False, positional="learned")),
    ("classifier", dict(pooling="max", norm_first=True, positional="sinusoidal",
                        activation="gelu")),
    ("classifier", dict(pooling="first", positional="sinusoidal", activation="gelu_tanh")),
    ("causal_lm", dict(tie=True, norm_first=True, positional="learned", activation="gelu")),
    ("causal_lm", dict(tie=False, norm_first=False, positional="sinusoidal", activation="relu")),
    ("causal_lm", dict(tie=True, positional="sinusoidal", activation="gelu_tanh")),
    ("seq2seq", dict(norm_first=False, positional="sinusoidal", activation="relu")),
    ("seq2seq", dict(norm_first=True, positional="learned", activation="gelu")),
    ("seq2seq", dict(norm_first=True, positional="sinusoidal", activation="gelu_tanh")),
]
MODEL_IDS = [f"{kind}-{i}" for i, (kind, _) in enumerate(MODEL_CASES)]


def _config(kind: str, kw: dict):
    """The case's config, with dropout (eval mode turns it off on both sides) and, for the
    last seq2seq case, unscaled embeddings."""
    config = replace(CONFIGS[kind](**kw), dropout=0.1)
    if kind == "seq2seq" and kw.get("activation") == "gelu_tanh":
        config = replace(config, scale_embeddings=False)
    return config


def _randomize(module, seed: int = 3):
    """Every parameter drawn afresh (layer norms' 1 and 0 would hide a swapped gain)."""
    rng = np.random.default_rng(seed)
    for _, p in module.named_parameters():
        p.data = backend.asarray(rng.standard_normal(p.shape) * 0.5,
                                 dtype=backend.default_float_name())
    return module


def _torch_outputs(torch, glue, ref, batch):
    with torch.no_grad():
        return glue.torch_logits(torch, ref, batch).numpy()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", MODEL_CASES, ids=MODEL_IDS)
def test_to_torch_gives_npformers_outputs(case, dtype, torch, tier):
    kind, kw = case
    glue = KINDS[kind]
    config = _config(kind, kw)
    with using_backend("numpy", dtype):
        model = _randomize(glue.build(config)).eval()
        batch = glue.batch_fn(np.random.default_rng(1), config)
        ref = to_torch(model)
        assert isinstance(ref, torch.nn.Module) and not ref.training
        assert isinstance(ref, torch_models()[kind])
        assert {p.dtype for p in ref.parameters()} == {getattr(torch, dtype)}
        ours = glue.our_logits(model, batch)
    assert_close(ours, _torch_outputs(torch, glue, ref, batch), RTOL[dtype],
                 f"to_torch({kind}) {dtype}")


def test_to_torch_keeps_the_mode_and_takes_a_device(torch):
    config = CONFIGS["classifier"]()
    with using_backend("numpy", "float32"):
        model = KINDS["classifier"].build(config)
        assert to_torch(model).training
        assert not to_torch(model.eval(), device="cpu").training


def test_padded_lengths_default_to_the_non_pad_count(torch):
    """The torch classifier and seq2seq count valid positions as npformer does when no
    lengths are given."""
    kind = "classifier"
    glue, config = KINDS[kind], CONFIGS[kind]()
    with using_backend("numpy", "float64"):
        model = _randomize(glue.build(config)).eval()
        ids, lens, _ = glue.batch_fn(np.random.default_rng(1), config)
        ours = backend.to_numpy(model(ids))
        with torch.no_grad():
            theirs = to_torch(model)(torch.tensor(ids)).numpy()
    assert_close(ours, theirs, RTOL["float64"], "lengths from the padding")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", MODEL_CASES, ids=MODEL_IDS)
def test_from_torch_round_trip(case, dtype, torch):
    kind, kw = case
    glue = KINDS[kind]
    config = _config(kind, kw)
    torch.manual_seed(0)
    ref = torch_models()[kind](config, getattr(torch, dtype)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.5 * torch.randn_like(p))
    with using_backend("numpy", "float32"):  # the torch module's dtype wins
        ours = from_torch(ref, tier=tier_under_test())
        assert isinstance(ours, glue.model_cls) and ours.config == config
        assert not ours.training
        batch = glue.batch_fn(np.random.default_rng(1), config)
        logits = glue.our_logits(ours, batch)
        assert backend.to_numpy(logits).dtype == np.dtype(dtype)
        again = to_torch(ours)
    assert_close(logits, _torch_outputs(torch, glue, ref, batch), RTOL[dtype],
                 f"from_torch({kind}) {dtype}")
    expected, got = ref.state_dict(), again.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


# =========================================================================== layers
D, H, D_FF, B, T, S = 8, 2, 12, 3, 5, 4
LENS = np.array([5, 2, 4])  # valid positions per row (keys beyond are padding)


def _host(rng, *shape):
    return rng.standard_normal(shape)


def _valid(y):
    """The valid positions of (B, T, D) outputs (torch's fast path leaves padding 0)."""
    return np.concatenate([np.asarray(y)[b, :n] for b, n in enumerate(LENS)])


def _layer_case(name, torch, rng, norm_first=False, activation="relu"):
    """(npformer layer, call on npformer, call on torch) for a layer kind."""
    ignore = np.arange(T)[None, :] >= LENS[:, None]  # (B, T) torch's True = ignore
    keep = backend.asarray(~ignore)[:, None, None, :]  # (B, 1, 1, T) npformer's True = attend
    x, memory = _host(rng, B, T, D), _host(rng, B, S, D)
    tx, tm = torch.tensor(x), torch.tensor(memory)
    causal = np.tril(np.ones((T, T), dtype=bool))
    if name == "encoder":
        layer = tiered.EncoderBlock(D, H, D_FF, 0.1, activation, norm_first)
        return (layer, lambda: _valid(backend.to_numpy(layer(backend.asarray(x), mask=keep))),
                lambda t: _valid(t(tx, src_key_padding_mask=torch.tensor(ignore)).numpy()))
    if name == "decoder":
        layer = tiered.DecoderBlock(D, H, D_FF, 0.1, activation, norm_first)
        mem_keep = backend.asarray(np.ones((B, 1, 1, S), dtype=bool))
        return (layer, lambda: backend.to_numpy(layer(backend.asarray(x), backend.asarray(memory),
                                                      self_mask=backend.asarray(causal),
                                                      memory_mask=mem_keep)),
                lambda t: t(tx, tm, tgt_mask=torch.tensor(~causal)).numpy())
    if name == "attention":
        layer = tiered.MultiHeadAttention(D, H)
        return (layer, lambda: _valid(backend.to_numpy(layer(backend.asarray(x), mask=keep))),
                lambda t: _valid(t(tx, tx, tx, key_padding_mask=torch.tensor(ignore),
                                   need_weights=False)[0].numpy()))
    if name == "linear":
        layer = tiered.Linear(D, D_FF)
        return (layer, lambda: backend.to_numpy(layer(backend.asarray(x))),
                lambda t: t(tx).numpy())
    if name == "layernorm":
        layer = tiered.LayerNorm(D)
        return (layer, lambda: backend.to_numpy(layer(backend.asarray(x))),
                lambda t: t(tx).numpy())
    ids = rng.integers(0, 7, size=(B, T))
    if name == "embedding":
        layer = tiered.Embedding(7, D)
        return (layer, lambda: backend.to_numpy(layer(backend.asarray(ids))),
                lambda t: t(torch.tensor(ids)).numpy())
    layer = tiered.LearnedPositionalEmbedding(T + 2, D)  # x + P[:T]
    return (layer, lambda: backend.to_numpy(layer(backend.asarray(x))),
            lambda t: (tx + t.weight[:T][None]).numpy())


LAYER_CASES = [("encoder", dict(norm_first=False, activation="relu")),
               ("encoder", dict(norm_first=True, activation="gelu_tanh")),
               ("decoder", dict(norm_first=False, activation="gelu")),
               ("decoder", dict(norm_first=True, activation="relu")),
               ("attention", {}), ("linear", {}), ("layernorm", {}), ("embedding", {}),
               ("positions", {})]
TORCH_CLASS = {"encoder": "TransformerEncoderLayer", "decoder": "TransformerDecoderLayer",
               "attention": "MultiheadAttention", "linear": "Linear", "layernorm": "LayerNorm",
               "embedding": "Embedding", "positions": "Embedding"}


@pytest.mark.parametrize("case", LAYER_CASES,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(LAYER_CASES)])
def test_layers_both_ways(case, torch):
    name, kw = case
    with using_backend("numpy", "float64"):
        layer, ours, theirs = _layer_case(name, torch, np.random.default_rng(2), **kw)
        _randomize(layer).eval()
        ref = to_torch(layer)
        assert type(ref) is getattr(torch.nn, TORCH_CLASS[name])
        with torch.no_grad():
            assert_close(ours(), theirs(ref), RTOL["float64"], f"to_torch({name})")
        back = from_torch(ref, tier=tier_under_test())
    assert type(back) is (tiered.Embedding if name == "positions"
                          else type(layer))
    if name in ("encoder", "decoder"):
        assert back.norm_first == layer.norm_first
        assert back.ffn.activation.name == layer.ffn.activation.name
        assert back.ffn.dropout.p == layer.ffn.dropout.p == ref.dropout.p
    for (key, p), (key2, q) in zip(sorted(layer.state_dict().items()),
                                   sorted(back.state_dict().items())):
        assert key == key2 and np.array_equal(backend.to_numpy(p), backend.to_numpy(q)), key


def test_from_torch_reads_each_way_torch_names_an_activation(torch):
    F = torch.nn.functional
    import functools

    for given, name in [("relu", "relu"), ("gelu", "gelu"), (torch.nn.ReLU(), "relu"),
                        (torch.nn.GELU(approximate="tanh"), "gelu_tanh"),
                        (functools.partial(F.gelu, approximate="tanh"), "gelu_tanh")]:
        layer = torch.nn.TransformerEncoderLayer(D, H, D_FF, dropout=0.0, activation=given,
                                                 batch_first=True, dtype=torch.float64)
        assert from_torch(layer).ffn.activation.name == name, given


# =========================================================================== refusals
def test_what_has_no_equivalent_is_refused(torch):
    with using_backend("numpy", "float32"):
        wide = tiered.CausalLM(CausalLMConfig(vocab_size=9, block_size=4, d_model=8, num_heads=2,
                                       num_layers=1, d_ff=8, head_dim=6))
        with pytest.raises(ValueError, match="wide heads"):
            to_torch(wide)
        with pytest.raises(TypeError, match="FeedForward"):
            to_torch(tiered.FeedForward(4, 8))
        with pytest.raises(TypeError, match="Conv1d"):
            from_torch(torch.nn.Conv1d(2, 2, 3))
        mixed = torch.nn.TransformerEncoderLayer(D, H, D_FF, 0.0, layer_norm_eps=1e-6)
        mixed.norm2.eps = 1e-3  # an npformer block has one epsilon for all its norms
        with pytest.raises(ValueError, match="layer norms have different epsilons"):
            from_torch(mixed)
        with pytest.raises(ValueError, match="activation"):
            from_torch(torch.nn.TransformerEncoderLayer(D, H, D_FF, 0.0,
                                                   activation=torch.nn.SiLU()))
        with pytest.raises(ValueError, match="bias=False"):
            from_torch(torch.nn.TransformerEncoderLayer(D, H, D_FF, 0.0, bias=False))
        with pytest.raises(ValueError, match="kdim"):
            from_torch(torch.nn.MultiheadAttention(D, H, kdim=3, vdim=3))
        with pytest.raises(TypeError, match="float16"):
            from_torch(torch.nn.Linear(3, 2, dtype=torch.float16))


@pytest.mark.parametrize("make, message", [
    # issue 37, case 18: max_norm and padding_idx were dropped (row 0 then got a gradient)
    (lambda t: t.nn.Embedding(7, D, max_norm=0.5), r"Embedding with max_norm=0\.5 has no "
                                                   r"npformer equivalent"),
    (lambda t: t.nn.Embedding(7, D, padding_idx=0), r"Embedding with padding_idx=0 has no "
                                                    r"npformer equivalent.*without padding_idx"),
    (lambda t: t.nn.Embedding(7, D, scale_grad_by_freq=True, sparse=True),
     r"scale_grad_by_freq=True, sparse=True .*without scale_grad_by_freq, sparse"),
    (lambda t: t.nn.MultiheadAttention(D, H, dropout=0.1), r"MultiheadAttention has "
                                                           r"dropout=0\.1: it drops attention "
                                                           r"probabilities.*attention\.dropout"),
    (lambda t: t.nn.MultiheadAttention(D, H, add_zero_attn=True), "add_zero_attn"),
    (lambda t: t.nn.MultiheadAttention(D, H, add_bias_kv=True), "add_bias_kv"),
    (lambda t: t.nn.TransformerEncoderLayer(D, H, D_FF), r"TransformerEncoderLayer\.self_attn "
                                                         r"has dropout=0\.1.*layer\.self_attn"
                                                         r"\.dropout = 0\.0"),
    (lambda t: _no_self_attention_dropout(t.nn.TransformerDecoderLayer(D, H, D_FF)),
     r"TransformerDecoderLayer\.multihead_attn has dropout=0\.1"),
    (lambda t: t.nn.TransformerDecoderLayer(D, H, D_FF, dropout=0.0, bias=False), "bias=False"),
    (lambda t: t.nn.LayerNorm(D, elementwise_affine=False), "elementwise_affine=False"),
    (lambda t: t.nn.LayerNorm(D, bias=False), "bias=False"),
])
def test_an_option_npformer_does_not_implement_is_refused_by_name(make, message, torch):
    with using_backend("numpy", "float32"), pytest.raises(ValueError, match=message):
        from_torch(make(torch))


def _no_self_attention_dropout(layer):
    layer.self_attn.dropout = 0.0
    return layer


def test_a_layer_with_its_attention_dropout_turned_off_converts_with_its_dropout(torch):
    layer = torch.nn.TransformerDecoderLayer(D, H, D_FF, dropout=0.2, batch_first=True)
    layer.self_attn.dropout = layer.multihead_attn.dropout = 0.0
    with using_backend("numpy", "float32"):
        block = from_torch(layer)
        assert block.ffn.dropout.p == 0.2
        back = to_torch(block)  # and back: npformer's block drops no attention probabilities
    assert (back.self_attn.dropout, back.multihead_attn.dropout, back.dropout.p) == (0.0, 0.0,
                                                                                     0.2)


def test_interop_does_not_import_torch():
    code = ("import sys, npformer, npformer.interop.pytorch, npformer.interop.torch_reference; "
            "npformer.models; assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("block", ["encoder", "decoder"])
def test_a_block_with_another_epsilon_round_trips(torch, block):
    """issue 47 case 12: from_torch(to_torch(EncoderBlock(norm_eps=1e-3))) was refused with
    "npformer's blocks use 1e-05", no longer true: the epsilon goes both ways, and the
    block computes what it did."""
    with using_backend("numpy", "float64"):
        make = tiered.EncoderBlock if block == "encoder" else tiered.DecoderBlock
        ours = _randomize(make(D, H, D_FF, 0.0, "relu", True, norm_eps=1e-3))
        theirs = to_torch(ours)
        assert {theirs.norm1.eps, theirs.norm2.eps} == {1e-3}
        back = from_torch(theirs, tier=tier_under_test())
        epsilons = {m.eps for m in back.modules() if isinstance(m, LayerNorm)}
        assert epsilons == {1e-3}
        rng = np.random.default_rng(5)
        x = backend.asarray(rng.standard_normal((2, 3, D)))
        if block == "encoder":
            assert_close(back(x), ours(x), rtol=0.0)
        else:
            memory = backend.asarray(rng.standard_normal((2, 4, D)))
            assert_close(back(x, memory), ours(x, memory), rtol=0.0)


def test_what_is_not_a_module_is_refused_naming_what_is_expected(torch):
    """issue 47 (the kinds at torch_interop's doors): to_torch(5) and from_torch(5) ended
    in AttributeError; a path of '' named the current folder."""
    with pytest.raises(TypeError, match="to_torch converts an npformer model or layer .* "
                                        "got int"):
        to_torch(5)
    with pytest.raises(TypeError, match="from_torch converts a torch.nn.Module, got dict"):
        from_torch({})
    from npformer.interop.pytorch import load_safetensors, save_safetensors

    with pytest.raises(ValueError, match="path must be a path, got the empty name ''"):
        save_safetensors(tiered.Linear(2, 3), "")
    with pytest.raises(TypeError, match="path must be a path .* got None"):
        load_safetensors(tiered.Linear(2, 3), None)
