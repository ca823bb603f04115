"""Module / Parameter bookkeeping: names, counts, gradients, modes, state.

* ``named_parameters`` walks attributes in definition order with dotted names
  (lists of modules as ``name.<i>``), skipping absent biases and private state;
* ``num_parameters`` equals PyTorch's count for the equivalent
  TransformerEncoderLayer / DecoderLayer;
* ``zero_grad`` zeroes every gradient (shape and dtype kept); gradients
  ACCUMULATE: two backward passes give exactly the sum of the two separately;
* ``train()`` / ``eval()`` reach every submodule: dropout is active in training
  and the identity in evaluation;
* ``no_grad()`` gives the same output, keeps no saved values (a backward afterwards
  raises) and restores the previous mode, even after an exception;
* ``state_dict`` / ``load_state_dict`` copy weights: two modules with different
  initialisations give identical outputs after the copy, also across backends,
  and later changes to the source do not leak into the copy;
* parameters take the dtype of ``backend.set_default_float``; ``decay`` is False
  for biases, LayerNorm and embeddings and True for Linear weights.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npformer import backend, nn
from npformer.nn.module import grad_enabled, no_grad
from npformer.ops import causal_mask

from .conftest import using_backend
from .helpers import assert_close, tiered

# A behaviour test: it runs in both tiers (tests.helpers.tiered), which must behave the same.
pytestmark = pytest.mark.usefixtures("tier")

D, H, F = 4, 2, 6

ATTN_NAMES = [f"{proj}.{kind}" for proj in ("q_proj", "k_proj", "v_proj", "out_proj")
              for kind in ("weight", "bias")]
FFN_NAMES = ["ffn.linear1.weight", "ffn.linear1.bias", "ffn.linear2.weight", "ffn.linear2.bias"]
ENCODER_NAMES = ([f"self_attn.{n}" for n in ATTN_NAMES]
                 + ["attn_residual.norm.weight", "attn_residual.norm.bias"]
                 + FFN_NAMES + ["ffn_residual.norm.weight", "ffn_residual.norm.bias"])
DECODER_NAMES = ([f"self_attn.{n}" for n in ATTN_NAMES]
                 + ["self_attn_residual.norm.weight", "self_attn_residual.norm.bias"]
                 + [f"cross_attn.{n}" for n in ATTN_NAMES]
                 + ["cross_attn_residual.norm.weight", "cross_attn_residual.norm.bias"]
                 + FFN_NAMES + ["ffn_residual.norm.weight", "ffn_residual.norm.bias"])


def x_like(shape, seed=0):
    return backend.asarray(np.random.default_rng(seed).standard_normal(shape),
                           dtype=backend.default_float_name())


def host(a):
    return backend.to_numpy(a).copy()


class Stack(nn.Module):
    """A module with a list of children, a private attribute and a plain attribute."""

    def __init__(self):
        self.embed = tiered.Embedding(5, D)
        self.layers = [tiered.Linear(D, D), tiered.Linear(D, D, bias=False)]
        self._scratch = tiered.Linear(D, D)  # private: not a parameter of the module
        self.width = D
        self.norm = tiered.LayerNorm(D)


# =========================================================================== names & counts
def test_encoder_parameter_names_and_order(xb):
    block = tiered.EncoderBlock(D, H, F)
    assert [n for n, _ in block.named_parameters()] == ENCODER_NAMES
    assert list(block.state_dict()) == ENCODER_NAMES
    params = dict(block.named_parameters())
    assert params["self_attn.q_proj.weight"] is block.self_attn.q_proj.weight
    assert params["attn_residual.norm.weight"] is block.attn_residual.norm.weight
    assert block.parameters() == [p for _, p in block.named_parameters()]


def test_decoder_parameter_names_and_order(xb):
    block = tiered.DecoderBlock(D, H, F)
    assert [n for n, _ in block.named_parameters()] == DECODER_NAMES


def test_list_children_private_attributes_and_missing_bias(xb):
    stack = Stack()
    assert [n for n, _ in stack.named_parameters()] == [
        "embed.weight", "layers.0.weight", "layers.0.bias", "layers.1.weight",
        "norm.weight", "norm.bias"]
    assert [n for n, _ in stack.named_parameters("model.")][0] == "model.embed.weight"
    modules = list(stack.modules())
    assert modules[0] is stack and stack.layers[1] in modules and stack._scratch not in modules


def test_parameter_shapes(xb):
    block = tiered.EncoderBlock(D, H, F)
    shapes = {n: p.shape for n, p in block.named_parameters()}
    assert shapes["self_attn.q_proj.weight"] == (D, D)  # (in, out)
    assert shapes["ffn.linear1.weight"] == (D, F)
    assert shapes["ffn.linear2.weight"] == (F, D)
    assert shapes["ffn.linear1.bias"] == (F,)
    wide = tiered.MultiHeadAttention(D, H, head_dim=3)
    assert wide.q_proj.weight.shape == (D, H * 3) and wide.out_proj.weight.shape == (H * 3, D)


@pytest.mark.parametrize("d_model,heads,d_ff", [(4, 2, 6), (8, 4, 16), (6, 3, 5)])
def test_num_parameters_matches_torch(xb, torch, d_model, heads, d_ff):
    enc = torch.nn.TransformerEncoderLayer(d_model, heads, d_ff, batch_first=True)
    dec = torch.nn.TransformerDecoderLayer(d_model, heads, d_ff, batch_first=True)
    assert tiered.EncoderBlock(d_model, heads, d_ff).num_parameters() == sum(
        p.numel() for p in enc.parameters())
    assert tiered.DecoderBlock(d_model, heads, d_ff).num_parameters() == sum(
        p.numel() for p in dec.parameters())
    assert tiered.MultiHeadAttention(d_model, heads).num_parameters() == sum(
        p.numel() for p in torch.nn.MultiheadAttention(d_model, heads).parameters())


def test_num_parameters_by_hand(xb):
    assert tiered.Linear(3, 5).num_parameters() == 3 * 5 + 5
    assert tiered.Linear(3, 5, bias=False).num_parameters() == 15
    assert tiered.LayerNorm(7).num_parameters() == 14
    assert tiered.Embedding(11, 3).num_parameters() == 33
    assert nn.SinusoidalPositionalEncoding(10, 4).num_parameters() == 0
    assert tiered.Dropout(0.1).num_parameters() == 0
    attention = tiered.MultiHeadAttention(4, 2, head_dim=3)
    assert attention.num_parameters() == 3 * (4 * 6 + 6) + 6 * 4 + 4


# =========================================================================== gradients
def _encoder_step(block, x, dy, mask=None):
    block(x, mask=mask)
    return block.backward(dy)


def test_fresh_parameters_have_zero_grads(xb):
    for _, p in tiered.DecoderBlock(D, H, F).named_parameters():
        assert p.grad.shape == p.data.shape and p.grad.dtype == p.data.dtype
        assert not np.any(host(p.grad))


def test_zero_grad(xb):
    block = tiered.EncoderBlock(D, H, F, dropout=0.0)
    _encoder_step(block, x_like((2, 3, D)), x_like((2, 3, D), seed=1))
    nonzero = [n for n, p in block.named_parameters() if np.any(host(p.grad))]
    assert len(nonzero) >= len(ENCODER_NAMES) - 1  # all but (maybe) the key bias
    block.zero_grad()
    for name, p in block.named_parameters():
        assert p.grad.shape == p.data.shape and p.grad.dtype == p.data.dtype, name
        assert not np.any(host(p.grad)), name


@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 3), t=st.integers(2, 4))
@settings(max_examples=10)
def test_gradients_accumulate_over_backward_passes(xb, seed, batch, t):
    rng = np.random.default_rng(seed)
    block = tiered.EncoderBlock(D, H, F, dropout=0.0, activation="gelu")
    mask = causal_mask(t)
    x1, x2 = (backend.asarray(rng.standard_normal((batch, t, D))) for _ in range(2))
    g1, g2 = (backend.asarray(rng.standard_normal((batch, t, D))) for _ in range(2))

    _encoder_step(block, x1, g1, mask)
    first = {n: host(p.grad) for n, p in block.named_parameters()}
    block.zero_grad()
    _encoder_step(block, x2, g2, mask)
    second = {n: host(p.grad) for n, p in block.named_parameters()}

    block.zero_grad()
    _encoder_step(block, x1, g1, mask)
    _encoder_step(block, x2, g2, mask)  # no zero_grad in between
    for name, p in block.named_parameters():
        assert np.any(first[name] != 0) or name == "self_attn.k_proj.bias"
        assert_close(p.grad, first[name] + second[name], 1e-12, f"accumulated grad of {name}")


def test_shared_parameter_use_accumulates(xb):
    """One Linear applied twice (two forwards, two backwards) sums both uses."""
    layer = tiered.Linear(D, 3)
    x1, x2 = x_like((2, D)), x_like((5, D), seed=1)
    d1, d2 = x_like((2, 3), seed=2), x_like((5, 3), seed=3)
    layer(x1)
    layer.backward(d1)
    layer(x2)
    layer.backward(d2)
    expected = host(x1).T @ host(d1) + host(x2).T @ host(d2)
    assert_close(layer.weight.grad, expected, 1e-12, "weight grad")
    assert_close(layer.bias.grad, host(d1).sum(0) + host(d2).sum(0), 1e-12, "bias grad")


# =========================================================================== modes
def test_train_eval_propagate(xb):
    block = tiered.DecoderBlock(D, H, F, dropout=0.5)
    assert all(m.training for m in block.modules())
    assert block.eval() is block
    assert not any(m.training for m in block.modules())
    assert len(list(block.modules())) > 10  # really reached the nested modules
    assert block.train() is block
    assert all(m.training for m in block.modules())
    block.train(False)
    assert not block.ffn.dropout.training and not block.cross_attn_residual.dropout.training


def test_dropout_active_in_training_identity_in_eval(xb):
    block = tiered.EncoderBlock(D, H, F, dropout=0.5)
    reference = tiered.EncoderBlock(D, H, F, dropout=0.0)
    reference.load_state_dict(block.state_dict())
    x = x_like((2, 5, D))
    expected = host(reference(x))

    block.eval()
    backend.seed(1)
    a = host(block(x))
    backend.seed(2)
    b = host(block(x))
    np.testing.assert_array_equal(a, b)  # no randomness in eval
    assert_close(a, expected, 1e-12, "eval output vs dropout-free block")

    block.train()
    backend.seed(1)
    c = host(block(x))
    backend.seed(2)
    d = host(block(x))
    assert not np.allclose(c, expected) and not np.allclose(c, d)
    backend.seed(1)
    np.testing.assert_array_equal(host(block(x)), c)  # the seed fixes the masks


def test_dropout_layer_modes(xb):
    layer = tiered.Dropout(0.5)
    x = x_like((50, 40))
    y = host(layer(x))
    dropped = y == 0
    assert 0.3 < dropped.mean() < 0.7
    np.testing.assert_allclose(y[~dropped], 2.0 * host(x)[~dropped], rtol=1e-15)
    layer.eval()
    np.testing.assert_array_equal(host(layer(x)), host(x))
    np.testing.assert_array_equal(host(layer.backward(x)), host(x))


def test_no_grad_same_output_and_no_cache(xb):
    block = tiered.DecoderBlock(D, H, F, dropout=0.0)
    x, memory = x_like((2, 3, D)), x_like((2, 4, D), seed=1)
    with_grad = host(block(x, memory, self_mask=causal_mask(3)))
    assert grad_enabled()
    with no_grad():
        assert not grad_enabled()
        without = host(block(x, memory, self_mask=causal_mask(3)))
    assert grad_enabled()
    np.testing.assert_array_equal(without, with_grad)
    caches = [m for m in block.modules() if getattr(m, "_saved", None) is not None]
    assert caches == [], f"modules kept a cache under no_grad: {caches}"
    with pytest.raises(RuntimeError, match="backward called without a forward pass"):
        block.backward(x_like((2, 3, D)))


def test_no_grad_restores_after_exception(xb):
    with pytest.raises(ZeroDivisionError):
        with no_grad():
            _ = 1 / 0
    assert grad_enabled()
    with no_grad():
        with no_grad():
            pass
        assert not grad_enabled()  # the inner context restores the outer state
    assert grad_enabled()


def test_no_grad_forward_then_backward_after_grad_forward(xb):
    """A forward with gradients works again after no_grad."""
    layer = tiered.MultiHeadAttention(D, H)
    x = x_like((2, 3, D))
    with no_grad():
        layer(x)
    layer(x)
    dx = layer.backward(x_like((2, 3, D), seed=1))
    assert dx.shape == x.shape


# =========================================================================== state
def test_state_dict_round_trip(xb):
    backend.seed(1)
    a = tiered.DecoderBlock(D, H, F, dropout=0.0, norm_first=True)
    backend.seed(2)
    b = tiered.DecoderBlock(D, H, F, dropout=0.0, norm_first=True)
    x, memory = x_like((2, 3, D)), x_like((2, 5, D), seed=1)
    for seed, mod in enumerate((a, b)):  # LayerNorm starts at (1, 0): make the norms differ too
        for name, p in mod.named_parameters():
            if "norm" in name:
                p.data = p.data + x_like(p.shape, seed=seed)
    assert not np.array_equal(host(a(x, memory)), host(b(x, memory)))
    b.backward(x_like((2, 3, D), seed=2))  # b now holds gradients of its old weights

    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(host(b(x, memory)), host(a(x, memory)))
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and pa.data is not pb.data, na  # copied, not shared
        assert not np.any(host(pb.grad)), nb  # fresh gradients


def test_load_state_dict_copies(xb):
    a, b = tiered.Linear(D, 3), tiered.Linear(D, 3)
    state = {k: host(v) for k, v in a.state_dict().items()}  # host NumPy arrays
    b.load_state_dict(state)
    state["weight"][...] = 0.0  # changing the source afterwards changes nothing
    np.testing.assert_array_equal(host(b.weight.data), host(a.weight.data))
    assert b.weight.data.dtype == a.weight.data.dtype
    assert backend.device_of(b.weight.data) == backend.device()


def test_state_dict_across_backends():
    """Weights saved on NumPy load into a strict-backend module and compute the same."""
    with using_backend("numpy", "float64"):
        src = tiered.EncoderBlock(D, H, F, dropout=0.0)
        state = {k: host(v) for k, v in src.state_dict().items()}
        x = np.random.default_rng(0).standard_normal((2, 3, D))
        expected = host(src(backend.asarray(x)))
    with using_backend("strict", "float64", seed=9):
        dst = tiered.EncoderBlock(D, H, F, dropout=0.0)
        dst.load_state_dict(state)
        assert type(dst.ffn.linear1.weight.data).__module__.startswith("array_api_strict")
        assert_close(dst(backend.asarray(x)), expected, 1e-13, "strict vs numpy output")


def test_load_state_dict_casts_to_parameter_dtype(xb):
    layer = tiered.LayerNorm(D)
    layer.load_state_dict({"weight": np.full(D, 2.0, dtype=np.float32),
                           "bias": np.zeros(D, dtype=np.float32)})
    assert layer.weight.data.dtype == backend.default_float()


# =========================================================================== dtype & decay
@pytest.mark.parametrize("backend_name", ["numpy", "strict"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_parameter_dtype_follows_default_float(backend_name, dtype):
    with using_backend(backend_name, dtype):
        model = [tiered.DecoderBlock(D, H, F), tiered.Embedding(5, D),
                 tiered.LearnedPositionalEmbedding(4, D),
                 tiered.MultiHeadAttention(D, H, head_dim=3)]
        for module in model:
            for name, p in module.named_parameters():
                assert p.data.dtype == backend.float_dtype(dtype), name
                assert p.grad.dtype == backend.float_dtype(dtype), name
        x = x_like((2, 3, D))
        assert x.dtype == backend.float_dtype(dtype)
        assert model[0](x, x).dtype == backend.float_dtype(dtype)  # activations keep it
        assert nn.SinusoidalPositionalEncoding(4, D)(x).dtype == backend.float_dtype(dtype)


def test_default_float_switch_changes_new_parameters_only():
    with using_backend("numpy", "float32"):
        before = tiered.Linear(2, 2)
        backend.set_default_float("float64")
        after = tiered.Linear(2, 2)
        assert before.weight.data.dtype == np.float32
        assert after.weight.data.dtype == np.float64


def test_decay_flags(xb):
    block = tiered.DecoderBlock(D, H, F)
    for name, p in block.named_parameters():
        is_linear_weight = name.endswith("weight") and "norm" not in name
        assert p.decay is is_linear_weight, name
    assert tiered.Linear(2, 3).weight.decay is True
    assert tiered.Linear(2, 3).bias.decay is False
    assert tiered.LayerNorm(3).weight.decay is False and tiered.LayerNorm(3).bias.decay is False
    assert tiered.Embedding(4, 3).weight.decay is False
    assert tiered.LearnedPositionalEmbedding(4, 3).weight.decay is False
    assert nn.Parameter(backend.asarray(np.zeros(2))).decay is True  # the default


def test_a_state_dict_is_a_snapshot_training_does_not_change():
    """Issue 37 case 14: ``best = model.state_dict()``, train on, ``load_state_dict(best)``
    restores the weights of that moment, in both tiers (the fast tier's optimizer updates
    the flat buffer in place: a state dict of views would have moved with it)."""
    from npformer.models import CausalLMConfig
    from npformer.train.tasks import LanguageModeling

    with using_backend("numpy", "float32"):
        model = tiered.CausalLM(CausalLMConfig(vocab_size=11, block_size=8, d_model=8, num_heads=2,
                                        num_layers=1, d_ff=16))
        opt = tiered.AdamW(model.parameters(), lr=1e-2)
        batch = np.arange(14).reshape(2, 7) % 11
        best = model.state_dict()
        kept = {name: value.copy() for name, value in best.items()}
        for _ in range(3):
            opt.zero_grad()
            LanguageModeling().loss_and_grad(model, (batch[:, :-1], batch[:, 1:]))
            opt.step()
        assert any(not np.array_equal(p.data, kept[n]) for n, p in model.named_parameters())
        for name, value in best.items():  # the snapshot itself did not move
            np.testing.assert_array_equal(value, kept[name], err_msg=name)
        model.load_state_dict(best)
        for name, p in model.named_parameters():
            np.testing.assert_array_equal(backend.to_numpy(p.data), kept[name], err_msg=name)
        optimizer_state = opt.state_dict()
        opt.zero_grad()
        LanguageModeling().loss_and_grad(model, (batch[:, :-1], batch[:, 1:]))
        opt.step()
        assert not np.array_equal(optimizer_state["m.0"], opt.state_dict()["m.0"])
