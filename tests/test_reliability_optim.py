"""Optimizers, clipping and model configs refuse bad values by name, and never give a
silent wrong answer; a Hypothesis fuzz over the optimizers' surface.

* hyperparameters (lr, betas, eps, weight_decay, momentum, max_norm): NaN, infinities,
  negative values, out-of-range values and non-numbers are refused naming the argument;
  NumPy scalars are accepted as the numbers they are;
* a saved optimizer state with a NaN lr or an out-of-range beta is refused on load;
* ``clip_grad_norm`` with a NaN or inf gradient raises NonFiniteGradientError naming
  the first such parameter (its name with ``named_parameters()``), changing nothing;
  ``error_if_nonfinite=False`` returns the norm and leaves the gradients alone;
* configs: every sized field, layer count, length and token id out of range is refused
  naming the field;
* fuzz: for random parameters, gradients and hyperparameters, every optimizer either
  takes a finite step of the right shape and dtype or raises ValueError/TypeError
  naming the argument.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from npformer import optim
from npformer.models import CausalLMConfig, ClassifierConfig, Seq2SeqConfig
from npformer.nn.module import Parameter
from tests.helpers import tiered

from .conftest import using_backend

# A behaviour test: it runs in both tiers (tests.helpers.tiered), which must behave the same.
pytestmark = pytest.mark.usefixtures("tier")

BAD_NUMBERS = [math.nan, math.inf, -math.inf, -1e-3]


def _params(n=2, dtype=np.float64):
    return [Parameter(np.ones((2, 3), dtype)), Parameter(np.ones((3,), dtype), decay=False)][:n]


# =========================================================================== hyperparameters
@pytest.mark.parametrize("bad", BAD_NUMBERS)
@pytest.mark.parametrize("make,name", [
    (lambda ps, v: tiered.Adam(ps, lr=v), "lr"),
    (lambda ps, v: tiered.Adam(ps, betas=(v, 0.999)), "beta1"),
    (lambda ps, v: tiered.AdamW(ps, betas=(0.9, v)), "beta2"),
    (lambda ps, v: tiered.Adam(ps, eps=v), "eps"),
    (lambda ps, v: tiered.AdamW(ps, weight_decay=v), "weight_decay"),
    (lambda ps, v: optim.SGD(ps, lr=0.1, momentum=v), "momentum"),
    (lambda ps, v: optim.SGD(ps, lr=0.1, weight_decay=v), "weight_decay"),
    (lambda ps, v: optim.SGD(ps, lr=v), "lr"),
])
def test_bad_hyperparameters_are_refused_by_name(make, name, bad):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        make(_params(), bad)


@pytest.mark.parametrize("make,name", [
    (lambda ps: tiered.Adam(ps, lr="fast"), "lr"),
    (lambda ps: tiered.Adam(ps, eps=None), "eps"),
    (lambda ps: optim.SGD(ps, lr=0.1, momentum=True), "momentum"),
    (lambda ps: tiered.Adam(ps, betas=0.9), "betas"),
    (lambda ps: tiered.Adam(ps, betas=(0.9, 0.99, 0.9)), "betas"),
    (lambda ps: tiered.Adam(5), "params"),
])
def test_non_numbers_are_refused_by_name(make, name):
    with pytest.raises((TypeError, ValueError), match=name):
        make(_params())


def test_numpy_scalars_are_numbers():
    opt = tiered.Adam(_params(), lr=np.float32(1e-3), betas=(np.float64(0.9), np.float32(0.99)),
                     eps=np.float64(1e-8))
    assert opt.beta1 == 0.9 and isinstance(opt.lr, float)


@pytest.mark.parametrize("key,value", [("lr", math.nan), ("beta1", 1.0), ("eps", -1.0),
                                       ("weight_decay", math.inf), ("step", -3)])
def test_a_saved_state_with_bad_values_is_refused_on_load(key, value):
    opt = tiered.AdamW(_params())
    state = opt.state_dict()
    state[key] = value
    with pytest.raises(ValueError, match=rf"does not fit AdamW: .*{key} is"):
        tiered.AdamW(_params()).load_state_dict(state)


# =========================================================================== clipping
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_clip_grad_norm_names_the_first_non_finite_gradient(bad):
    params = _params()
    params[0].grad = np.ones((2, 3))
    params[1].grad = np.array([1.0, bad, 2.0])
    before = [p.grad.copy() for p in params]
    with pytest.raises(optim.NonFiniteGradientError, match=r"params\[1\] \(shape \(3,\)\)"):
        optim.clip_grad_norm(params, 1.0)
    for p, g in zip(params, before):  # nothing changed
        np.testing.assert_array_equal(p.grad, g)
    with pytest.raises(optim.NonFiniteGradientError, match=r"gradient of bias"):
        optim.clip_grad_norm([("weight", params[0]), ("bias", params[1])], 1.0)
    with pytest.raises(optim.NonFiniteGradientError, match=r"params\[1\]"):
        optim.global_grad_norm(params, error_if_nonfinite=True)


def test_clip_grad_norm_can_allow_non_finite_gradients():
    params = _params()
    params[1].grad = np.array([1.0, math.nan, 2.0])
    total = optim.clip_grad_norm(params, 1.0, error_if_nonfinite=False)
    assert math.isnan(total)
    np.testing.assert_array_equal(params[0].grad, np.zeros((2, 3)))  # not turned NaN
    assert math.isnan(optim.global_grad_norm(params))  # measuring alone does not raise


def test_clip_grad_norm_names_a_model_parameter():
    with using_backend("numpy", "float64"):
        model = tiered.CausalLM(CausalLMConfig(vocab_size=5, block_size=4, d_model=4, num_heads=2,
                                        num_layers=1, d_ff=8))
        p = dict(model.named_parameters())["blocks.0.ffn.linear2.bias"]
        p.grad = p.grad + math.inf
        with pytest.raises(optim.NonFiniteGradientError, match=r"blocks\.0\.ffn\.linear2\.bias"):
            optim.clip_grad_norm(model.named_parameters(), 1.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, "1"])
def test_clip_grad_norm_refuses_bad_max_norm(bad):
    with pytest.raises((ValueError, TypeError), match="max_norm"):
        optim.clip_grad_norm(_params(), bad)


# =========================================================================== configs
CONFIGS = {
    "classifier": (ClassifierConfig, dict(vocab_size=10)),
    "lm": (CausalLMConfig, dict(vocab_size=10)),
    "seq2seq": (Seq2SeqConfig, dict(src_vocab_size=10, tgt_vocab_size=12)),
}


@pytest.mark.parametrize("kind,field,value", [
    ("classifier", "vocab_size", 0), ("lm", "vocab_size", -5), ("seq2seq", "src_vocab_size", 0),
    ("seq2seq", "tgt_vocab_size", 0), ("classifier", "num_layers", -1), ("lm", "num_layers", 0),
    ("seq2seq", "num_encoder_layers", -1), ("seq2seq", "num_decoder_layers", 0),
    ("classifier", "block_size", 0), ("lm", "block_size", -3), ("seq2seq", "block_size", -1),
    ("classifier", "num_classes", 0), ("classifier", "d_model", 0), ("lm", "num_heads", 0),
    ("lm", "d_ff", -1), ("lm", "head_dim", 0), ("classifier", "vocab_size", 10.0),
    ("lm", "num_layers", True), ("classifier", "pad_id", 10), ("classifier", "pad_id", -1),
    ("seq2seq", "pad_id", 10), ("seq2seq", "bos_id", 12), ("seq2seq", "eos_id", -1),
    ("lm", "tie_weights", "yes"), ("lm", "activation", "swish"), ("lm", "dropout", math.nan),
])
def test_config_fields_out_of_range_are_refused_by_name(kind, field, value):
    cls, required = CONFIGS[kind]
    with pytest.raises(ValueError, match=field):
        cls(**{**required, field: value})


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_default_configs_still_pass(kind):
    cls, required = CONFIGS[kind]
    cls(**required)


# =========================================================================== fuzz
finite_or_not = st.one_of(st.floats(-1e3, 1e3), st.sampled_from([math.nan, math.inf, -math.inf]))
hyper = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3),
                  st.none(), st.text(max_size=2))


@given(kind=st.sampled_from(["SGD", "Adam", "AdamW"]), lr=hyper, b1=hyper, b2=hyper,
       eps=hyper, wd=hyper, momentum=hyper, dtype=st.sampled_from([np.float32, np.float64]),
       shape=st.lists(st.integers(1, 3), max_size=2), seed=st.integers(0, 2**16),
       grad_scale=st.sampled_from([0.0, 1e-30, 1.0, 1e30]))
@example(kind="Adam", lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, momentum=0.0,
         dtype=np.float32, shape=[3], seed=0, grad_scale=1e30)
def test_fuzz_optimizer_construction_and_step(kind, lr, b1, b2, eps, wd, momentum, dtype,
                                              shape, seed, grad_scale):
    rng = np.random.default_rng(seed)
    p = Parameter(rng.standard_normal(shape).astype(dtype))
    try:
        if kind == "SGD":
            opt = optim.SGD([p], lr=lr, momentum=momentum, weight_decay=wd)
        else:
            opt = getattr(tiered, kind)([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    except (ValueError, TypeError) as exc:
        names = ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "betas")
        assert any(n in str(exc) for n in names), str(exc)
        return
    for value in (opt.lr, getattr(opt, "eps", 0.0), opt.weight_decay):
        assert math.isfinite(value) and value >= 0  # accepted means in range
    p.grad = (rng.standard_normal(shape) * grad_scale).astype(dtype)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        try:
            norm = optim.clip_grad_norm([p], 1.0)
        except optim.NonFiniteGradientError as exc:  # float32 squares of 1e30 overflow
            assert dtype == np.float32 and grad_scale == 1e30 and "overflows" in str(exc)
            return
        opt.step()
    assert math.isfinite(norm)
    assert p.data.shape == tuple(shape) and p.data.dtype == dtype
