"""Bloem's narrow heads and qk_norm (issue 34, item 6): gradients, PyTorch parity, models.

* gradient checks (central differences, float64, NumPy and the strict namespace, both
  tiers) of ``tiered.MultiHeadAttention(narrow_heads=..., qk_norm=...)``, self- and cross-attention,
  under causal, padding and fully masked rows: every input and every parameter;
* parity with ``npformer.interop.torch_reference.torch_attention()``, the same layer written in
  torch as Bloem's ``former`` writes it: outputs, input gradients and every parameter's
  gradient within 1e-10 (float64) and 1e-5 (float32), in both tiers;
* the narrow maps really are shared: (E, E) weights, and a layer whose slices are
  permuted gives the heads' outputs permuted alike;
* the models' configs take the options (``narrow_heads``, ``qk_norm``), count their
  parameters (``cli.memory.parameter_count``), save and load them, decode with the KV
  cache as their full forward, and refuse what does not fit (narrow heads with another
  head width; a PyTorch conversion, which has no such layer), naming it.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npformer import backend, nn, no_grad
from npformer.checkpoint import build_model, load_checkpoint, save_checkpoint
from npformer.cli.memory import parameter_count
from npformer.gradcheck import check_module
from npformer.interop.pytorch import to_torch
from npformer.interop.torch_reference import torch_attention
from npformer.models import (
    CausalLM,
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
    TransformerClassifier,
)
from npformer.ops import causal_mask, padding_mask

from .conftest import using_backend
from .helpers import GRADCHECK_TOL, PARITY_RTOL, rel_diff, tier_under_test, tiered, to_host
from .helpers import to_torch as to_torch_tensor

pytestmark = pytest.mark.usefixtures("tier")

OPTIONS = [(True, False), (False, True), (True, True)]  # (narrow, qk_norm)
OPTION_IDS = ["narrow", "qk_norm", "narrow_qk_norm"]


def randomize(module, rng, std: float = 0.7) -> None:
    for _, p in module.named_parameters():
        p.data = backend.asarray(rng.standard_normal(p.shape) * std, dtype="float64")


def arr(host, dtype="float64"):
    return backend.asarray(np.asarray(host), dtype=dtype)


def mask_of(kind: str, batch: int, t: int, s: int, rng):
    if kind == "causal":
        return causal_mask(t, s)
    lens = rng.integers(0 if kind == "fully_masked" else 1, s + 1, size=batch)
    if kind == "fully_masked":
        lens[0] = 0  # every query of row 0 sees nothing
    return padding_mask(arr(lens, "int64"), s)


# --------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("narrow_heads,qk_norm", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("kind,cross", [("causal", False), ("padding", True),
                                        ("fully_masked", False)])
@settings(max_examples=4)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 2), t=st.integers(1, 3),
       heads=st.sampled_from([1, 2, 3]), width=st.integers(1, 2))
def test_gradient_check(xb, narrow_heads, qk_norm, kind, cross, seed, batch, t, heads, width):
    rng = np.random.default_rng(seed)
    d_model = heads * width
    layer = tiered.MultiHeadAttention(d_model, heads, narrow_heads=narrow_heads, qk_norm=qk_norm)
    randomize(layer, rng)
    s = t + 1 if cross else t
    x = arr(rng.standard_normal((batch, t, d_model)))
    inputs = [x, arr(rng.standard_normal((batch, s, d_model)))] if cross else [x]
    mask = mask_of(kind, batch, t, s, rng)
    out = layer(*inputs, mask=mask)
    assert np.all(np.isfinite(to_host(out)))
    # h 1e-6, not the default 1e-5: the layer norm of a 1- or 2-wide head (qk_norm) curves
    # sharply, and central differences err by O(h^2): one draw (seed 52, B 2, T 3, 2 heads
    # of 2, causal) read 1.8e-4, 1.8e-6 and 1.8e-8 at h = 1e-4, 1e-5, 1e-6 against the same
    # analytic gradient.  The smaller step makes the numerical side sharper, not the test looser.
    result = check_module(layer, inputs, kwargs={"mask": mask}, seed=seed, h=1e-6)
    assert result.errors and all(np.isfinite(e) for e in result.errors.values())
    assert result.worst_error < GRADCHECK_TOL, str(result)
    assert len(result.errors) == len(inputs) + len(layer.parameters())


# --------------------------------------------------------------------------- PyTorch
def load_torch_attention(layer, twin) -> None:
    """The torch twin's weights into the npformer layer (Linear weights transposed)."""
    names = {"q_proj": "toqueries", "k_proj": "tokeys", "v_proj": "tovalues",
             "out_proj": "unifyheads", "q_norm": "qln", "k_norm": "kln"}
    state = {k: to_host(v) for k, v in twin.state_dict().items()}
    assert len(state) == len(layer.parameters())
    for name, p in layer.named_parameters():
        module, kind = name.split(".")
        value = state[f"{names[module]}.{kind}"]
        p.data = backend.asarray(value.T if value.ndim == 2 else value)


def torch_grad_of(twin, name: str):
    names = {"q_proj": "toqueries", "k_proj": "tokeys", "v_proj": "tovalues",
             "out_proj": "unifyheads", "q_norm": "qln", "k_norm": "kln"}
    module, kind = name.split(".")
    grad = to_host(getattr(getattr(twin, names[module]), kind).grad)
    return grad.T if grad.ndim == 2 else grad


@pytest.mark.parametrize("narrow_heads,qk_norm", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_parity_with_the_torch_module(torch, narrow_heads, qk_norm, dtype, cross):
    with using_backend("numpy", dtype):
        d_model, heads, batch, t, s = 12, 3, 2, 5, 4 if cross else 5
        twin = torch_attention()(d_model, heads, narrow_heads=narrow_heads, qk_norm=qk_norm,
                                 dtype=getattr(torch, dtype))
        with torch.no_grad():  # norms away from their initial 1 and 0
            for p in twin.parameters():
                p.normal_(0.0, 0.5)
        layer = tiered.MultiHeadAttention(d_model, heads, narrow_heads=narrow_heads,
                                          qk_norm=qk_norm)
        load_torch_attention(layer, twin)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, t, d_model))
        context = rng.standard_normal((batch, s, d_model)) if cross else None
        keep = causal_mask(t, s) if not cross else padding_mask(arr([s, 2], "int64"), s)
        dy = rng.standard_normal((batch, t, d_model))
        tx = to_torch_tensor(torch, x, dtype=getattr(torch, dtype), requires_grad=True)
        tc = None if context is None else to_torch_tensor(torch, context,
                                                          dtype=getattr(torch, dtype),
                                                          requires_grad=True)
        expected = twin(tx, tc, mask=torch.from_numpy(to_host(keep)))
        (expected * torch.from_numpy(dy.astype(dtype))).sum().backward()
        got = layer(arr(x, dtype), None if context is None else arr(context, dtype), mask=keep)
        grads = layer.backward(arr(dy, dtype))
        rtol = PARITY_RTOL[dtype]
        assert rel_diff(got, expected) <= rtol
        dx = grads[0] if cross else grads
        assert rel_diff(dx, tx.grad) <= rtol
        if cross:
            assert rel_diff(grads[1], tc.grad) <= rtol
        # measured against the largest gradient entry: the key bias's is 0 in exact
        # arithmetic (softmax ignores a constant added to a row's scores), rounding is left
        expected = {name: torch_grad_of(twin, name) for name, _ in layer.named_parameters()}
        scale = max(float(np.max(np.abs(g))) for g in expected.values())
        for name, p in layer.named_parameters():
            assert rel_diff(p.grad, expected[name], at_least=scale) <= rtol, name


def test_the_narrow_maps_are_shared_by_the_heads():
    """(E, E) maps; permuting the input's slices permutes the heads' outputs alike (one
    map for all of them), which a layer with a map per head would not do."""
    with using_backend("numpy", "float64"):
        d_model, heads = 6, 3
        layer = tiered.MultiHeadAttention(d_model, heads, narrow_heads=True)
        assert layer.q_proj.weight.shape == (2, 2) and layer.out_proj.weight.shape == (6, 6)
        layer.out_proj.weight.data = np.eye(6)
        layer.out_proj.bias.data = np.zeros(6)
        x = np.random.default_rng(1).standard_normal((1, 4, d_model))
        perm = np.array([4, 5, 0, 1, 2, 3])  # slice 2 first, then slices 0 and 1
        with no_grad():
            np.testing.assert_allclose(layer(x[..., perm]), layer(x)[..., perm], rtol=1e-14,
                                       atol=1e-14)


# --------------------------------------------------------------------------- the models
def configs(**options):
    return [ClassifierConfig(vocab_size=11, d_model=6, num_heads=3, num_layers=2, d_ff=7,
                             block_size=6, **options),
            CausalLMConfig(vocab_size=11, d_model=6, num_heads=3, num_layers=2, d_ff=7,
                           block_size=6, **options),
            Seq2SeqConfig(11, 12, d_model=6, num_heads=3, num_encoder_layers=1,
                          num_decoder_layers=2, d_ff=7, block_size=6, **options)]


MODELS = (TransformerClassifier, CausalLM, Seq2SeqTransformer)


@pytest.mark.parametrize("narrow_heads,qk_norm", OPTIONS, ids=OPTION_IDS)
def test_models_take_the_options_and_count_their_parameters(narrow_heads, qk_norm, tmp_path):
    with using_backend("numpy", "float64"):
        for config, cls in zip(configs(narrow_heads=narrow_heads, qk_norm=qk_norm), MODELS):
            model = getattr(tiered, cls.__name__)(config)
            attentions = [m for m in model.modules() if isinstance(m, nn.MultiHeadAttention)]
            assert attentions and all(a.narrow_heads == narrow_heads and a.qk_norm == qk_norm
                                      for a in attentions)
            assert parameter_count(config) == model.num_parameters(), config
            randomize(model, np.random.default_rng(2))
            save_checkpoint(tmp_path / "m.npz", model)
            again = build_model(load_checkpoint(tmp_path / "m.npz"), tier=tier_under_test())
            assert again.config == config
            for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
                np.testing.assert_array_equal(to_host(p.data), to_host(q.data), err_msg=name)


@pytest.mark.parametrize("narrow_heads,qk_norm", OPTIONS, ids=OPTION_IDS)
def test_cached_decoding_equals_the_full_forward(narrow_heads, qk_norm):
    with using_backend("numpy", "float64"):
        model = tiered.CausalLM(configs(narrow_heads=narrow_heads, qk_norm=qk_norm)[1])
        randomize(model, np.random.default_rng(3))
        ids = backend.asarray(np.random.default_rng(4).integers(0, 11, (2, 6)))
        model.eval()
        with no_grad():
            full = model(ids)
            cache = model.new_cache()
            pieces = [model.forward_cached(ids[:, a:b], cache) for a, b in ((0, 2), (2, 3),
                                                                            (3, 6))]
        assert rel_diff(np.concatenate([to_host(p) for p in pieces], axis=1), full) <= 1e-12


def test_narrow_heads_with_another_head_width_are_refused_by_name():
    with pytest.raises(ValueError, match="CausalLMConfig.head_dim must be None or 2"):
        CausalLMConfig(vocab_size=5, d_model=6, num_heads=3, head_dim=4, narrow_heads=True)
    with pytest.raises(ValueError, match="d_model 7 is not divisible by num_heads 2"):
        tiered.MultiHeadAttention(7, 2, narrow_heads=True)
    with pytest.raises(ValueError, match="narrow heads are the 3 slices of width 2"):
        tiered.MultiHeadAttention(6, 3, head_dim=3, narrow_heads=True)
    with pytest.raises(ValueError, match="CausalLMConfig.qk_norm must be True or False"):
        CausalLMConfig(vocab_size=5, qk_norm="yes")


@pytest.mark.parametrize("narrow_heads,qk_norm", OPTIONS, ids=OPTION_IDS)
def test_torch_conversion_is_refused_naming_the_option(narrow_heads, qk_norm):
    with using_backend("numpy", "float32"):
        model = tiered.CausalLM(configs(narrow_heads=narrow_heads, qk_norm=qk_norm)[1])
        named = "narrow heads" if narrow_heads else "qk_norm"
        with pytest.raises(ValueError, match=f"MultiheadAttention has no {named}"):
            to_torch(model)


def test_qk_norm_uses_the_configs_norm_epsilon(torch):
    """issue 47 case 3: CausalLMConfig(norm_eps=0.5, qk_norm=True) built q_norm and
    k_norm with 1e-5 while the docstring says "every layer norm's epsilon" (logits 6% off).
    Every layer norm of the model takes the config's epsilon, in both tiers, and the
    attention layer computes torch's (torch_reference's, given that epsilon)."""
    with using_backend("numpy", "float64"):
        config = CausalLMConfig(vocab_size=11, d_model=12, num_heads=3, num_layers=2, d_ff=16,
                                block_size=6, norm_eps=0.5, qk_norm=True)
        model = CausalLM(config)
        epsilons = [m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)]
        assert len(epsilons) == 2 * 4 + 1  # per block: two residual norms, q_norm, k_norm
        assert set(epsilons) == {0.5}, epsilons
        layer = model.blocks[0].self_attn
        twin = torch_attention()(12, 3, qk_norm=True, eps=0.5, dtype=torch.float64)
        with torch.no_grad():
            for p in twin.parameters():
                p.normal_(0.0, 0.5)
        load_torch_attention(layer, twin)
        x = np.random.default_rng(0).standard_normal((2, 5, 12))
        keep = causal_mask(5, 5)
        expected = twin(to_torch_tensor(torch, x, dtype=torch.float64),
                        mask=torch.from_numpy(to_host(keep)))
        assert rel_diff(layer(arr(x), mask=keep), expected) <= PARITY_RTOL["float64"]
