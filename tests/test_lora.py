"""LoRA (issue 49, item 4): the layer's hand-written backward, frozen weights, adapters on a
model, merging.

* Gradient checks (Hypothesis, float64, both backends, both tiers' Linear as the base):
  the input's, A's and B's gradients against central differences, with dropout too; W and b
  are frozen and take none; a broken backward term (the scale left off dB, the adapter's
  path to x dropped, dA from the input before dropout) fails the check, naming its culprit.
* Frozen parameters hold no gradient array and get no optimizer state (textbook and fast
  AdamW); an optimizer over a model all frozen is refused; one frozen after being built
  refuses to step, naming the cause.
* A fast model frozen lets its flat gradient buffer go (nothing refers to it after); one
  frozen layer by layer still loads and trains; the ranks' all-reduce sums the adapters'
  gradients and gives the frozen weights none.
* :func:`apply_lora` wraps the layers PEFT's ``target_modules`` would (names, or a regular
  expression); a model keeps its weights' names; its logits are the base model's at start;
  one training update moves only the adapters.
* merge / unmerge: the merged model's logits equal the adapted model's (to rounding: x (W +
  s A B) and x W + s (x A) B round differently); unmerge restores W bit for bit (the weight
  before merging is kept, since (W + D) - D is W only to rounding).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer import backend
from npformer.gradcheck import check_module
from npformer.models import CausalLMConfig
from npformer.nn import lora as lora_module
from npformer.nn.lora import LoRALinear, apply_lora, lora_layers, merge_lora, unmerge_lora
from npformer.ops.lora import lora_backward
from npformer.parallel.workers import DataParallel
from npformer.train.tasks import LanguageModeling

from .conftest import using_backend
from .helpers import GRADCHECK_TOL, rel_diff, tiered, tiny_llama
from .test_layers_gradcheck import Reseeded, arr, assert_gradcheck, randomize

SEEDS = st.integers(0, 2**32 - 1)
CAUGHT = 1e-2


def floats(host):
    """``host`` on the backend, in its default float dtype."""
    return backend.asarray(np.asarray(host), dtype=backend.default_float_name())


def lora_on(base, *args):
    """The tier's LoRALinear on ``base``, as apply_lora chooses it (the fast tier's Linear
    names its own)."""
    return getattr(base, "LoRALinear", LoRALinear)(base, *args)


def adapter(rng, d_in, d_out, r, alpha, dropout, bias=True):
    """A LoRALinear on the tier's Linear, every weight random (B too: at zero it would
    hide the gradient of A, which is then zero)."""
    layer = lora_on(tiered.Linear(d_in, d_out, bias=bias), r, alpha, dropout)
    randomize(layer, rng)
    return layer


# =========================================================================== gradient checks
@pytest.mark.usefixtures("tier")
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), d_in=st.integers(1, 4),
       d_out=st.integers(1, 4), r=st.integers(1, 3), alpha=st.floats(0.5, 16),
       bias=st.booleans(), seed=SEEDS)
def test_lora_gradcheck(xb, lead, d_in, d_out, r, alpha, bias, seed):
    rng = np.random.default_rng(seed)
    layer = adapter(rng, d_in, d_out, r, alpha, 0.0, bias)
    x = arr(rng.standard_normal((*lead, d_in)))
    result = check_module(layer, [x], seed=seed)
    assert_gradcheck(result)
    assert set(result.errors) == {"input0", "lora_A", "lora_B"}  # W, b frozen: none
    assert layer.weight.grad is None and (layer.bias is None or layer.bias.grad is None)


@pytest.mark.usefixtures("tier")
@given(batch=st.integers(1, 3), d_in=st.integers(1, 4), d_out=st.integers(1, 4),
       r=st.integers(1, 3), p=st.floats(0.1, 0.7), seed=SEEDS)
def test_lora_gradcheck_with_dropout(xb, batch, d_in, d_out, r, p, seed):
    rng = np.random.default_rng(seed)
    layer = adapter(rng, d_in, d_out, r, 2.0 * r, p)
    x = arr(rng.standard_normal((batch, d_in)))
    checked = Reseeded(layer)  # the same mask in every forward of the check
    assert_gradcheck(check_module(checked, [x], seed=seed))


def _broken(term: str):
    """lora_backward with one term wrong."""
    def backward(dy, cache):
        dx, dx_dropped, da, db = lora_backward(dy, cache)
        x_dropped, u, w, a, b, scale = cache.values
        if term == "dB without the scale":
            db = db / scale
        elif term == "the adapter's path to x dropped":
            dx_dropped = dx_dropped * 0.0
        elif term == "dA without the scale":
            da = da / scale
        return dx, dx_dropped, da, db
    return backward


@pytest.mark.parametrize("term, culprit", [("dB without the scale", "lora_B"),
                                           ("the adapter's path to x dropped", "input0"),
                                           ("dA without the scale", "lora_A")])
def test_a_broken_backward_term_fails_the_check(monkeypatch, term, culprit):
    rng = np.random.default_rng(3)
    layer = adapter(rng, 4, 3, 2, 7.0, 0.0)
    x = arr(rng.standard_normal((2, 3, 4)))
    assert check_module(layer, [x]).worst_error < GRADCHECK_TOL
    monkeypatch.setattr(lora_module, "lora_backward", _broken(term))
    bad = check_module(layer, [x])
    assert bad.worst_error > CAUGHT and bad.worst_name == culprit, str(bad)


def test_the_adapter_starts_as_the_base_map_and_a_is_drawn_as_peft_draws_it():
    rng = np.random.default_rng(0)
    base = tiered.Linear(64, 5)
    x = floats(rng.standard_normal((3, 64)))
    expected = backend.to_numpy(base(x))
    layer = LoRALinear(base, 8, 16)
    assert np.array_equal(backend.to_numpy(layer(x)), expected)  # B = 0
    a = backend.to_numpy(layer.lora_A.data)
    assert a.shape == (64, 8) and np.all(np.abs(a) <= 1 / 8) and np.abs(a).max() > 0.1
    assert not np.any(backend.to_numpy(layer.lora_B.data)) and layer.scale == 2.0


@pytest.mark.parametrize("kwargs, message", [
    ({"r": 0}, r"r \(the LoRA rank\) must be at least 1"), ({"r": 2, "alpha": -1.0}, "alpha"),
    ({"r": 2, "dropout": 1.5}, "ropout")])
def test_bad_adapter_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        LoRALinear(tiered.Linear(3, 2), **kwargs)


# =========================================================================== freezing
def tiny_config(**extra) -> CausalLMConfig:
    return CausalLMConfig(vocab_size=11, block_size=6, d_model=8, num_heads=2, num_layers=2,
                          d_ff=12, dropout=0.0, **extra)


@pytest.mark.usefixtures("tier")
def test_frozen_parameters_hold_no_gradient_and_no_optimizer_state():
    model = tiered.CausalLM(tiny_config())
    names = apply_lora(model, ["q_proj", "v_proj"], r=2)
    assert names == [f"blocks.{i}.self_attn.{p}_proj" for i in range(2) for p in "qv"]
    opt = tiered.AdamW(model.parameters(), lr=1e-3)
    trained = {name for name, p in model.named_parameters() if not p.frozen}
    assert trained == {f"{n}.lora_{m}" for n in names for m in "AB"}
    assert [id(p) for p in opt.params] == [id(p) for p in model.trainable_parameters()]
    ids = arr(np.random.default_rng(0).integers(0, 11, (2, 6)), "int64")
    logits = model(ids)
    model.backward(floats(np.ones(logits.shape)))
    for name, p in model.named_parameters():
        assert (p.grad is None) == p.frozen, name
    opt.step()
    state = opt.state_dict()
    assert state["params"] == len(trained)
    assert sorted(k for k in state if k.startswith(("m.", "v."))) == sorted(
        f"{s}.{i}" for s in "mv" for i in range(len(trained)))



def test_clipping_a_lora_model_s_parameters_skips_the_frozen_ones():
    """optimizer.clip_grad_norm(model.named_parameters(), ...) on an adapted model: the
    frozen weights, which have no gradient by design, are left out (they raised "has no
    gradient"), and the norm is the adapters' own."""
    model = tiered.CausalLM(tiny_config())
    apply_lora(model, ["q_proj", "v_proj"], r=2)
    opt = tiered.AdamW(model.parameters(), lr=1e-3)
    ids = arr(np.random.default_rng(0).integers(0, 11, (2, 6)), "int64")
    logits = model(ids)
    model.backward(floats(np.random.default_rng(1).standard_normal(logits.shape)))
    adapters = [(n, p) for n, p in model.named_parameters() if not p.frozen]
    expected = float(np.sqrt(sum(np.sum(backend.to_numpy(p.grad).astype(np.float64) ** 2)
                                 for _, p in adapters)))
    norm = opt.clip_grad_norm(model.named_parameters(), 1e9)
    assert norm == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("tier", ["textbook", "fast"])
def test_frozen_layers_compute_no_weight_gradient(tier, monkeypatch):
    """A frozen Linear (and a frozen table's tied projection) asks its op for dx alone:
    dW and db, which nothing would read, are not computed; dx is the trained layer's."""
    from npformer import fast, ops

    from .helpers import using_tier

    with using_tier(tier):
        model = tiered.CausalLM(tiny_config())
    target = fast.linear if tier == "fast" else ops  # where the layers look the op up
    asked = []
    real = target.linear_backward

    def spy(*args, **kwargs):
        asked.append(kwargs.get("weights", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(target, "linear_backward", spy)
    ids = arr(np.random.default_rng(0).integers(0, 11, (2, 6)), "int64")
    dlogits = floats(np.random.default_rng(1).standard_normal((2, 6, 11)))
    model(ids)
    model.backward(dlogits)
    assert asked and all(asked)
    asked.clear()
    model.freeze()
    model(ids)
    model.backward(dlogits)
    assert asked and not any(asked)  # every product asked for dx alone
    assert all(p.grad is None for p in model.parameters())

def test_an_optimizer_over_a_frozen_model_is_refused():
    model = tiered.CausalLM(tiny_config()).freeze()
    with pytest.raises(ValueError, match="all .* parameters are frozen"):
        tiered.AdamW(model.parameters())


def test_freezing_after_building_the_optimizer_is_named_at_the_step():
    model = tiered.CausalLM(tiny_config())
    opt = tiered.AdamW(model.parameters())
    model.freeze()
    with pytest.raises(RuntimeError, match="frozen after the optimizer was built"):
        opt.step()


# =========================================================================== on a model
@pytest.mark.usefixtures("tier")
def test_adapted_model_starts_as_the_base_and_one_update_moves_only_the_adapters():
    model = tiered.CausalLM(tiny_config())
    ids = arr(np.random.default_rng(0).integers(0, 11, (2, 6)), "int64")
    before = backend.to_numpy(model(ids))
    frozen = {k: backend.to_numpy(v) for k, v in model.state_dict().items()}
    apply_lora(model, r"blocks\.\d+\.ffn\.linear\d", r=3, alpha=6)
    assert list(lora_layers(model)) == [f"blocks.{i}.ffn.linear{j}" for i in (0, 1)
                                        for j in (1, 2)]
    assert np.array_equal(backend.to_numpy(model(ids)), before)
    opt = tiered.AdamW(model.parameters(), lr=1e-2)
    logits = model(ids)
    model.backward(floats(np.random.default_rng(1).standard_normal(logits.shape)))
    opt.step()
    after = model.state_dict()
    for name, value in frozen.items():
        assert np.array_equal(backend.to_numpy(after[name]), value), name
    assert any(np.any(backend.to_numpy(after[f"{n}.lora_B"])) for n in lora_layers(model))


def test_targets_that_match_nothing_are_refused_naming_the_layers():
    model = tiered.CausalLM(tiny_config())
    with pytest.raises(ValueError, match="match none of the model's Linear layers "
                                         r"\(blocks.0.self_attn.q_proj"):
        apply_lora(model, ["c_attn"], r=2)
    with pytest.raises(TypeError, match="targets must be"):
        apply_lora(model, [], r=2)


@pytest.mark.usefixtures("tier")
def test_merge_gives_the_adapted_outputs_and_unmerge_restores_w_bit_for_bit():
    with using_backend("numpy", "float64"):
        merge_and_unmerge(np.random.default_rng(0))


def merge_and_unmerge(rng):
    model = tiered.CausalLM(tiny_config())
    apply_lora(model, ["q_proj", "k_proj", "v_proj", "out_proj", "linear1"], r=2, alpha=5)
    for layer in lora_layers(model).values():
        layer.lora_B.data = floats(rng.standard_normal(layer.lora_B.shape))
    ids = arr(rng.integers(0, 11, (2, 6)), "int64")
    adapted = backend.to_numpy(model(ids))
    weights = {k: backend.to_numpy(v) for k, v in model.state_dict().items()}
    merge_lora(model)
    merged = backend.to_numpy(model(ids))
    assert rel_diff(merged, adapted) < 1e-12  # float64: equal to rounding
    assert not np.array_equal(backend.to_numpy(model.state_dict()["blocks.0.self_attn."
                                                                  "q_proj.weight"]),
                              weights["blocks.0.self_attn.q_proj.weight"])
    unmerge_lora(model)
    for name, value in model.state_dict().items():
        assert np.array_equal(backend.to_numpy(value), weights[name]), name
    assert np.array_equal(backend.to_numpy(model(ids)), adapted)


def test_the_textbook_adapter_takes_no_fast_tier_argument_and_each_tier_gets_its_own():
    """The textbook LoRALinear's forward and backward are the math's; a fast model's
    Linear layers get the fast tier's adapter, which takes that tier's keep_input."""
    import inspect

    from npformer import fast, models
    assert list(inspect.signature(LoRALinear.forward).parameters) == ["self", "x"]
    assert list(inspect.signature(LoRALinear.backward).parameters) == ["self", "dy"]
    for model_class, adapter_class in ((models.CausalLM, LoRALinear),
                                       (fast.CausalLM, fast.layers.LoRALinear)):
        model = model_class(tiny_config())
        apply_lora(model, ["q_proj", "linear1"], r=2)
        assert {type(layer) for layer in lora_layers(model).values()} == {adapter_class}


def test_a_merged_adapter_refuses_to_train_and_to_merge_twice():
    layer = lora_on(tiered.Linear(3, 2), 1)
    layer.merge()
    with pytest.raises(RuntimeError, match="already merged"):
        layer.merge()
    layer(floats(np.ones((1, 3))))
    with pytest.raises(RuntimeError, match="unmerge"):
        layer.backward(floats(np.ones((1, 2))))


class TwoEqualRanks:
    """A communicator of two ranks holding the same gradients: the all-reduce doubles."""

    rank, size = 0, 2

    def allreduce(self, buffer):
        buffer *= 2

    def allgather(self, value):
        return [value, value]

    def from_main(self, value):
        return value

    def check_same(self, **values):
        pass


@pytest.mark.usefixtures("tier")
def test_the_ranks_all_reduce_sums_the_adapters_and_leaves_frozen_weights_without_gradient():
    model = tiered.CausalLM(tiny_config())
    apply_lora(model, ["q_proj", "linear2"], r=2)
    for layer in lora_layers(model).values():
        layer.lora_B.data = floats(np.random.default_rng(0).standard_normal(layer.lora_B.shape))
    opt = tiered.AdamW(model.parameters())
    ids = np.random.default_rng(1).integers(0, 11, (2, 7))
    workers = DataParallel(model, 1, TwoEqualRanks())
    opt.zero_grad()
    loss, _ = workers.loss_and_grad(LanguageModeling(), (ids[:, :-1], ids[:, 1:]), 1.0, 0)
    mine = [backend.to_numpy(p.grad).copy() for p in opt.params]  # this rank's shard's
    assert all(np.any(grad) for grad in mine)
    workers.reduce_step(loss)
    for name, p in model.named_parameters():
        assert (p.grad is None) == p.frozen, name
    for p, grad in zip(opt.params, mine):
        np.testing.assert_array_equal(backend.to_numpy(p.grad), 2 * grad)


def test_freezing_a_fast_model_releases_its_flat_gradient_buffer():
    """A fast model keeps every gradient in one flat buffer from the start: freezing it
    frees that buffer (nothing refers to it any more), and the frozen model still loads
    its weights (its buffers skip frozen gradients)."""
    import gc
    import weakref

    from npformer import fast

    model = fast.CausalLM(tiny_config())
    state = model.state_dict()
    buffer = model.parameters()[0].grad.base  # the flat (P,) gradient buffer
    assert buffer is not None and buffer.size == model.num_parameters()
    released = weakref.ref(buffer)
    del buffer
    model.freeze()
    gc.collect()
    assert released() is None
    model.load_state_dict(state)
    assert all(p.grad is None for p in model.parameters())


def test_a_fast_model_with_one_layer_frozen_by_hand_still_loads_and_trains():
    """Parameters frozen one by one stay in the fast model's flat buffer: its sync skips
    their gradients (it refused a None gradient)."""
    from npformer import fast
    from npformer.nn.lora import replace_module

    model = fast.CausalLM(tiny_config())
    layer = lora_on(model.blocks[0].ffn.linear1, 2)
    replace_module(model, "blocks.0.ffn.linear1", layer)
    model.load_state_dict(model.state_dict())
    assert layer.weight.frozen and layer.weight.grad is None
    opt = fast.AdamW(model.parameters())
    ids = np.random.default_rng(0).integers(0, 11, (2, 7))
    opt.zero_grad()
    LanguageModeling().loss_and_grad(model, (ids[:, :-1], ids[:, 1:]))
    opt.step()
    assert layer.weight.grad is None and np.any(backend.to_numpy(layer.lora_B.data))


# =========================================================================== sweep 5
def test_a_target_in_the_list_that_matches_nothing_is_refused_naming_it():
    """sweep 5: ["q_proj", "qproj"] put adapters on q_proj and dropped the misspelt name
    silently; each name of a list must choose a layer, and the model is left unchanged."""
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"targets \['qproj'\] match none of the model's "
                                         r"Linear layers \(blocks.0.self_attn.q_proj"):
        apply_lora(model, ["q_proj", "qproj"], r=2)
    assert not lora_layers(model) and not any(p.frozen for _, p in model.named_parameters())


def test_adding_adapters_to_a_model_that_holds_some_is_refused():
    """sweep 5: a second apply_lora froze the model again, the first call's adapters
    with it (they trained no more, silently); targeting them again said their layers were
    none of the model's.  Both are refused, naming the adapters held."""
    model = tiny_llama()
    apply_lora(model, ["q_proj"], r=2)
    for targets in (["q_proj"], ["v_proj"]):
        with pytest.raises(ValueError, match=r"holds LoRA adapters already \(on "
                                             r"blocks.0.self_attn.q_proj\)"):
            apply_lora(model, targets, r=2)
    assert [n for n, p in model.named_parameters() if not p.frozen] == [
        "blocks.0.self_attn.q_proj.lora_A", "blocks.0.self_attn.q_proj.lora_B"]


@pytest.mark.parametrize("kwargs, message", [
    ({"alpha": float("nan")}, "alpha"), ({"dropout": 1.0}, "ropout"),
    ({"dropout": "0.1"}, "ropout")])
def test_bad_alpha_or_dropout_leaves_the_model_as_it_was(kwargs, message):
    """sweep 5: alpha and dropout were read by the first adapter, after the model was
    frozen: the call failed and left the model frozen without adapters (nothing left to
    train).  They are checked at the door, as r is."""
    model = tiny_llama()
    with pytest.raises((ValueError, TypeError), match=message):
        apply_lora(model, ["q_proj"], r=2, **kwargs)
    assert not any(p.frozen for _, p in model.named_parameters())


def test_a_checkpoint_of_merged_adapters_is_refused(tmp_path):
    """sweep 5: a checkpoint of a model with its adapters merged held W + s A B and A, B
    again: restored into the adapted model (unmerged), the update counted twice, silently."""
    from npformer.checkpoint import CheckpointError, save_checkpoint

    model = tiny_llama()
    apply_lora(model, ["q_proj"], r=2)
    merge_lora(model)
    with pytest.raises(CheckpointError, match=r"LoRA adapters merged into the weights "
                                              r"\(blocks.0.self_attn.q_proj\).*unmerge_lora"):
        save_checkpoint(tmp_path / "model.npz", model)
    assert not (tmp_path / "model.npz").exists()
    unmerge_lora(model)
    save_checkpoint(tmp_path / "model.npz", model)
