"""Contracts checked once, at the door (issue 17), and caches that name their maker
(issue 18, item 3).

* A cache says which op and which tier made it; a backward refuses one that is not its
  own, naming both tiers.  Was: ``set_engine("textbook")``, an ``tiered.Activation("relu")``
  forward, ``set_engine("fast")``, then its backward read the textbook cache x as if it
  were y and gave dx = -dy at every negative input (relative error 0.79 for dx inside a
  FeedForward block), silently.
* A module checks its inputs once: the layers and ops inside it do not check again.
* ``tools/count_checks.py`` finds no check statement inside an op body, and flags one
  planted there.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from npformer import backend, fast, nn, ops
from npformer.models import CausalLMConfig
from npformer.ops import contracts

from .helpers import tiered, using_tier

ROOT = Path(__file__).resolve().parents[1]


def arr(shape, seed=0):
    return backend.asarray(np.random.default_rng(seed).standard_normal(shape), dtype="float64")


# =========================================================================== caches
@pytest.mark.parametrize("forward_tier,backward_tier", [("textbook", "fast"),
                                                         ("fast", "textbook")])
def test_a_layer_keeps_its_tier_whatever_the_engine_is_later(xb, forward_tier, backward_tier):
    """A layer's tier is chosen when it is made: switching the engine between its forward
    and its backward changes nothing (the backward is its own tier's, on its own cache)."""
    with using_tier(forward_tier):
        layer, reference = tiered.Activation("relu"), tiered.Activation("relu")
    x = arr((3, 4))
    dy = backend.namespace_of(x).ones_like(x)
    with using_tier(backward_tier):
        y = layer(x)
        dx = layer.backward(dy)
    assert type(layer) is type(reference)
    np.testing.assert_array_equal(backend.to_numpy(y), backend.to_numpy(reference(x)))
    np.testing.assert_array_equal(backend.to_numpy(dx), backend.to_numpy(reference.backward(dy)))


def test_a_feed_forward_block_keeps_its_tier_across_a_switch(xb):
    with using_tier("textbook"):
        block = tiered.FeedForward(4, 6, activation="relu")
    x = arr((2, 3, 4))
    y = block(x)
    with using_tier("fast"):
        assert block.backward(arr(tuple(y.shape), seed=1)).shape == (2, 3, 4)
    assert type(block) is nn.FeedForward


def test_the_same_tier_still_differentiates(xb, tier):
    block = tiered.FeedForward(4, 6, activation="relu")
    y = block(arr((2, 3, 4)))
    assert block.backward(arr(tuple(y.shape), seed=1)).shape == (2, 3, 4)


@pytest.mark.parametrize("name", ["relu", "gelu"])
def test_op_backward_refuses_the_other_tiers_activation_cache(xb, name):
    forward, _ = ops.activation(name)
    _, backward = fast.activation(name)
    y, cache = forward(arr((2, 3)))
    assert (cache.op, cache.tier, cache.shape) == (f"{name}_forward", "textbook", (2, 3))
    with pytest.raises(TypeError, match=rf"{name}_backward got saved values of another tier "
                                        rf"\(made by {name}_forward of the textbook tier\)"):
        backward(arr((2, 3)), cache)


def test_a_cache_of_another_op_is_named(xb):
    _, cache = ops.softmax_forward(arr((2, 3)))
    with pytest.raises(TypeError, match=r"log_softmax_backward got invalid saved values \(saved "
                                        r"values of softmax_forward, textbook tier\)"):
        ops.log_softmax_backward(arr((2, 3)), cache)


def test_a_textbook_op_bound_in_the_fast_tier_is_one_function():
    assert fast.embedding_forward is ops.embedding_forward  # no fast version: the same op
    assert fast.pool_backward is ops.pool_backward  # nor this one
    for name in ops.__all__:  # every op is the textbook one unless the tier lists it as fast
        if callable(getattr(ops, name)) and name not in fast.FAST_OPS:
            assert getattr(fast, name) is getattr(ops, name), name
    for name in ops.__all__:
        if not isinstance(getattr(ops, name), type(ops)):  # its ops and constants
            assert hasattr(fast, name), name


# =========================================================================== checked once
def count_calls(monkeypatch, name: str) -> list:
    calls = []
    original = getattr(contracts, name)

    def counting(*args, **kwargs):
        calls.append(args[-1] if args else None)
        return original(*args, **kwargs)
    monkeypatch.setattr(contracts, name, counting)
    return calls


def test_a_block_checks_its_input_once(monkeypatch, xb, tier):
    block = tiered.EncoderBlock(4, 2, 8, dropout=0.0)
    x = arr((2, 3, 4))
    mask = ops.causal_mask(3)
    calls = count_calls(monkeypatch, "check_array")  # every array check passes here
    y = block(x, mask=mask)
    # the door (MultiHeadAttention's contract); no layer or op inside checks again
    assert calls == ["attention input", "attention input (batch, positions, width)",
                     "attention mask"]
    del calls[:]
    block.backward(arr(tuple(y.shape), seed=1))
    assert calls == ["the upstream gradient of EncoderBlock.backward"]


def test_a_fast_contract_calls_the_textbook_one(monkeypatch, xb):
    """The fast tier's contracts (npformer/fast/contracts.py) check their own argument and
    call the textbook op's contract for the rest, not a copy of it."""
    from npformer.fast import contracts as fast_contracts

    x, w, q = arr((2, 3)), arr((3, 4), seed=1), arr((2, 3, 4), seed=2)
    for name, args in (("linear_inputs", (x, w, None, False)),
                       ("attention_inputs", (q, q, q, None, 7))):
        calls = count_calls(monkeypatch, name)
        getattr(fast_contracts, name)(*args)
        assert len(calls) == 1, name
    with pytest.raises(TypeError, match="keep_input"):
        fast_contracts.linear_inputs(x, w, keep_input="no")
    with pytest.raises(ValueError, match="block_scores"):
        fast_contracts.attention_inputs(q, q, q, block_scores=0)


def test_a_model_step_checks_at_its_doors_only(monkeypatch, xb, tier):
    model = tiered.CausalLM(CausalLMConfig(vocab_size=7, block_size=5, d_model=8, num_heads=2,
                                    num_layers=2, d_ff=16))
    ids = backend.asarray(np.array([[1, 2, 3, 4], [5, 6, 0, 1]]))
    calls = count_calls(monkeypatch, "check_array")
    logits = model(ids)
    loss, cache = fast.cross_entropy_forward(logits, ids)
    model.backward(fast.cross_entropy_backward(1.0, cache))
    # the model's door (its ids), the loss's, the model's upstream gradient: nothing from
    # inside the model (two blocks, four layer norms, a dozen linear maps)
    assert calls == ["token ids (batch, positions)", "token ids", "cross-entropy logits",
                     "cross-entropy targets", "cross-entropy targets",
                     "the upstream gradient of CausalLM.backward"]


def test_a_user_calling_an_op_still_gets_the_clear_error(xb):
    with pytest.raises(ValueError, match=r"layer norm input must have last dimension 4, got "
                                         r"shape \(2, 5\)"):
        ops.layernorm_forward(arr((2, 5)), arr((4,)), arr((4,)))


# =========================================================================== count_checks
def run_counter(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "count_checks.py"), *args],
                          capture_output=True, text=True)


def test_no_check_statement_sits_in_an_op_body():
    result = run_counter(str(ROOT / "npformer"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checks    0" in result.stdout.splitlines()[-1]


def test_the_counter_flags_a_planted_check(tmp_path):
    for folder in ("ops", "fast"):
        (tmp_path / folder).mkdir()
    (tmp_path / "ops" / "planted.py").write_text(
        "def layernorm_forward(x, gamma):\n"
        "    check_float(x, 'x')\n"
        "    if x.shape[-1] != gamma.shape[0]:\n"
        "        raise ValueError('width')\n"
        "    assert x.ndim > 0\n"
        "    return x * gamma\n")
    result = run_counter(str(tmp_path))
    assert result.returncode == 1
    assert "ops/planted.py:layernorm_forward: 4" in result.stdout
    assert "math    1   checks    4" in result.stdout
