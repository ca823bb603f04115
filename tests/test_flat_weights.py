"""Where the fast tier keeps the weights: in one flat buffer from the moment a model is
built (:func:`npformer.nn.flat.flat_buffer_of` finds it), adopted (not copied) by the
optimizer, kept in step with parameters rebound by any code, shared (not copied) by
thread replicas; the textbook tier's models keep their own arrays.  And the training
step's loss gradient, which the fast tier writes over the logits' own buffer.

How these tests fail (each checked by breaking the code under test in memory, in a
scratch pytest plugin): a fast AdamW step that does not sync its buffer first fails the
rebound-weight test; an optimizer that copies the parameters into a buffer of its own
fails the adoption, rebound and replica tests; replicas given copies of the weights fail
the replica test; the fast loss computed without ``overwrite_logits`` fails the
fast-tier logits tests.
"""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend, fast, models, ops, optim
from npformer.checkpoint import load_checkpoint, save_checkpoint
from npformer.fast import compiler
from npformer.models import CausalLM, CausalLMConfig
from npformer.nn.flat import flat_buffer_of
from npformer.parallel.replicas import ThreadReplicas
from npformer.train.tasks import LanguageModeling

from .conftest import using_backend
from .helpers import rel_diff, tiered, using_tier
from .test_checkpoint_train import classifier, seq2seq

CONFIG = CausalLMConfig(vocab_size=11, block_size=8, d_model=8, num_heads=2, num_layers=2,
                        d_ff=16, dropout=0.0)
BUILDERS = {"causal_lm": lambda: tiered.CausalLM(CONFIG), "classifier": classifier,
            "seq2seq": seq2seq}
COMPILED_ONLY = pytest.mark.skipif(
    not compiler.COMPILED, reason="without numba the fast loss writes its gradient over its "
    "own softmax buffer, not the logits'")


def lm(seed: int = 0) -> CausalLM:
    backend.set_backend("numpy", seed=seed)
    return tiered.CausalLM(CONFIG)


def batch(seed: int = 1):
    tokens = np.random.default_rng(seed).integers(0, CONFIG.vocab_size, size=(3, 9))
    return tokens[:, :-1], tokens[:, 1:]  # (3, 8) each


def _no_two_share_memory(arrays) -> bool:
    arrays = list(arrays)
    return not any(np.shares_memory(a, b) for i, a in enumerate(arrays) for b in arrays[i + 1:])


# =========================================================================== born flat
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_a_fast_model_keeps_freed_memory_for_its_next_call(kind, monkeypatch):
    """A fast model asks glibc to keep freed memory (``keep_freed_memory``), as the Trainer
    does, so each call's arrays are reused, not page-faulted in again; a textbook model
    leaves the allocator alone."""
    from npformer.fast import models as fast_models

    calls = []
    monkeypatch.setattr(fast_models, "keep_freed_memory", lambda: calls.append(1))
    for tier, expected in (("textbook", []), ("fast", [1])):
        calls.clear()
        with using_tier(tier):
            backend.set_backend("numpy", seed=0)
            BUILDERS[kind]()
        assert calls == expected, tier


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_a_fast_model_is_born_with_its_weights_in_one_buffer(kind):
    with using_tier("fast"):
        backend.set_backend("numpy", seed=0)
        model = BUILDERS[kind]()
    assert type(model) is getattr(tiered, models.MODELS[kind].__name__)
    params = model.parameters()
    flat = flat_buffer_of(params)
    assert flat is not None and flat is model._flat and flat.holds(params)
    assert flat.slices[0][0] == 0 and flat.slices[-1][1] == flat.data.size == flat.grad.size
    for p, (lo, hi) in zip(params, flat.slices):
        assert p.data.base is not None and np.shares_memory(p.data, flat.data[lo:hi])
        assert np.shares_memory(p.grad, flat.grad[lo:hi])


def test_a_textbook_model_keeps_its_own_arrays():
    with using_tier("textbook"):
        model = lm()
        opt = tiered.AdamW(model.parameters(), lr=1e-2)
        assert type(model) is models.CausalLM and type(opt) is optim.AdamW
        assert getattr(model, "_flat", None) is None and getattr(opt, "_flat", None) is None
        assert flat_buffer_of(model.parameters()) is None
        assert _no_two_share_memory(p.data for p in model.parameters())
        opt.zero_grad()
        LanguageModeling().loss_and_grad(model, batch())
        opt.step()
        assert flat_buffer_of(model.parameters()) is None
        assert _no_two_share_memory(p.data for p in model.parameters())
        assert _no_two_share_memory(opt.state["m"] + opt.state["v"])


# =========================================================================== the optimizer
@pytest.mark.parametrize("make", [lambda ps: tiered.AdamW(ps, lr=1e-2, weight_decay=0.1),
                                  lambda ps: tiered.Adam(ps, lr=1e-2)], ids=["AdamW", "Adam"])
def test_the_optimizer_adopts_the_models_buffer_instead_of_copying(make):
    with using_tier("fast"):
        model = lm()
        born = model._flat
        buffer = born.data
        opt = make(model.parameters())
    assert opt._flat is model._flat is born and born.data is buffer  # the same memory
    for name in ("m", "v"):
        assert opt._flat_state[name].shape == buffer.shape
        assert all(np.shares_memory(s, opt._flat_state[name]) for s in opt.state[name])


def test_adam_with_l2_decay_stays_per_tensor_and_leaves_the_buffer_alone():
    with using_tier("fast"):
        model = lm()
        buffer = model._flat.data
        opt = tiered.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
    assert opt._flat is None and model._flat.data is buffer
    assert not any(np.shares_memory(s, buffer) for s in opt.state["m"] + opt.state["v"])


def test_a_weight_rebound_before_the_optimizer_is_made_goes_into_the_buffer():
    """A loader that binds new arrays (not copies into the views) leaves the born buffer
    stale until it is synced: the optimizer adopts it synced, with the bound values."""
    with using_tier("fast"):
        model = lm()
        first = model.parameters()[0]
        first.data = first.data * 0 + 0.5  # a new array, bound
        assert not np.shares_memory(first.data, model._flat.data)  # the premise
        opt = tiered.AdamW(model.parameters(), lr=1e-2)
    assert opt._flat is model._flat
    assert np.shares_memory(first.data, model._flat.data) and np.all(first.data == 0.5)
    lo, hi = model._flat.slices[0]
    assert np.all(model._flat.data[lo:hi] == 0.5)


def test_a_rebound_weight_is_synced_before_the_step_and_every_parameter_is_updated():
    """Between the backward and the step: a weight rebound (``p.data = ...``) and every
    gradient rebound (the textbook clip, ``p.grad = p.grad * c``).  The fast AdamW's step
    starts from the bound values, as the textbook AdamW's does, update for update, and
    leaves every parameter a view of its buffer again."""
    with using_tier("fast"):
        model = lm()
        opt = tiered.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        opt.zero_grad()
        LanguageModeling().loss_and_grad(model, batch())
    with using_tier("textbook"):
        twin = tiered.CausalLM(CONFIG)
        twin_opt = tiered.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    twin.load_state_dict(model.state_dict())
    first = model.parameters()[0]
    first.data = first.data * 0 + 0.5  # a new array, bound
    optim.clip_grad_norm(model.named_parameters(), 0.1)  # the textbook's: rebinds the grads
    assert not np.shares_memory(first.data, model._flat.data)  # the premises
    assert not any(np.shares_memory(p.grad, model._flat.grad) for p in model.parameters())
    for p, q in zip(model.parameters(), twin.parameters()):
        q.data, q.grad = p.data.copy(), p.grad.copy()
    before = [p.data.copy() for p in model.parameters()]
    opt.step()
    twin_opt.step()
    for (name, p), q, old in zip(model.named_parameters(), twin.parameters(), before):
        np.testing.assert_array_equal(p.data, q.data, err_msg=name)
        assert not np.array_equal(p.data, old), f"{name} was not updated"
        assert np.shares_memory(p.data, model._flat.data), name
    lo, hi = model._flat.slices[0]
    np.testing.assert_array_equal(model._flat.data[lo:hi].reshape(first.shape), first.data)


# =========================================================================== thread replicas
def test_thread_replicas_share_the_models_weights_and_keep_gradients_only():
    x, y = batch()
    with using_tier("fast"), using_backend("numpy", "float64"):
        alone = lm()
        LanguageModeling().loss_and_grad(alone, (x, y))  # the whole batch's gradient
        model = lm()
        tiered.AdamW(model.parameters(), lr=1e-2)
        replicas = ThreadReplicas(model, 2)
        replicas.run(LanguageModeling(), [((x[:2], y[:2]), 2 / 3, 1),
                                          ((x[2:], y[2:]), 1 / 3, 2)])
    replica = replicas.models[1]
    flat = replicas._replica_flats[1]
    assert flat.data is None  # gradients only: its data are the model's
    assert replica._flat is None and flat_buffer_of(replica.parameters()) is None
    assert flat_buffer_of(model.parameters()) is model._flat
    for p, q in zip(model.parameters(), replica.parameters()):
        assert q.data is p.data and np.shares_memory(p.data, model._flat.data)  # not a copy
        assert np.shares_memory(q.grad, flat.grad)  # its own gradient, in its buffer
        assert not np.shares_memory(q.grad, model._flat.grad)
    assert model._flat.data.dtype == np.float64
    summed, whole = flat_buffer_of(model.parameters()), flat_buffer_of(alone.parameters())
    assert rel_diff(summed.grad, whole.grad) < 1e-12  # the shards' gradients, summed


def test_a_replica_is_saved_with_the_models_weights(tmp_path):
    """A thread replica's buffer holds gradients only: its checkpoint holds the weights
    (the model's arrays), not that buffer."""
    with using_tier("fast"):
        model = lm()
        replicas = ThreadReplicas(model, 2)
        replica = replicas.models[1]
        replicas._prepare_flat_gradients(2)
        replicas._replica_flats[1].grad[...] = 7.0  # a buffer to tell apart from the weights
        path = save_checkpoint(tmp_path / "replica.npz", replica)
    loaded = load_checkpoint(path)
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(loaded.params[name], p.data, err_msg=name)


# =========================================================================== the logits
@COMPILED_ONLY
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_fast_loss_writes_its_gradient_over_the_logits(dtype):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(dtype)  # (B, T, V)
    targets = rng.integers(0, 7, size=(2, 5))
    kept = logits.copy()
    loss, dlogits = fast.cross_entropy_with_gradient(logits, targets, 0.5)
    assert np.shares_memory(dlogits, logits) and dlogits.shape == logits.shape
    loss_ref, dlogits_ref = ops.cross_entropy_with_gradient(kept.copy(), targets, 0.5)
    tolerance = 1e-6 if dtype == np.float32 else 1e-14
    assert rel_diff(loss, loss_ref) < tolerance and rel_diff(dlogits, dlogits_ref) < tolerance


def test_the_textbook_loss_leaves_the_logits_alone():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7))
    kept = logits.copy()
    _, dlogits = ops.cross_entropy_with_gradient(logits, rng.integers(0, 7, size=(2, 5)))
    assert not np.shares_memory(dlogits, logits)
    np.testing.assert_array_equal(logits, kept)


@pytest.mark.parametrize("tier", [pytest.param("fast", marks=COMPILED_ONLY), "textbook"])
def test_the_training_steps_loss_gradient_is_written_over_the_logits_in_the_fast_tier(tier):
    """The task hands the tier's loss the model's logits: the gradient the model's
    backward receives is the logits' own buffer in the fast tier, its own array in the
    textbook tier."""
    with using_tier(tier):
        model = lm()
        received = {}
        forward, backward = model.forward, model.backward

        def spy_forward(*args, **kwargs):
            received["logits"] = forward(*args, **kwargs)
            return received["logits"]

        def spy_backward(dlogits):
            received["dlogits"] = dlogits
            return backward(dlogits)

        model.forward, model.backward = spy_forward, spy_backward
        LanguageModeling().loss_and_grad(model, batch())
    assert np.shares_memory(received["dlogits"], received["logits"]) == (tier == "fast")
