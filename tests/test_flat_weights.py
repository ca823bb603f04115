"""Where the fast tier keeps the weights: in one flat buffer from the moment a model is
built, adopted (not copied) by the optimizer, shared (not copied) by thread replicas;
and the training step's loss gradient written over the logits' own buffer."""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend, engine
from npformer.models import CausalLM, CausalLMConfig
from npformer.nn.module import flat_parameters_of
from npformer.optim import Adam, AdamW
from npformer.replicas import ThreadReplicas
from npformer.tasks import LanguageModeling

from .helpers import using_engine

CONFIG = CausalLMConfig(vocab_size=11, block_size=8, d_model=8, num_heads=2, num_layers=2,
                        d_ff=16, dropout=0.0)


def lm(seed: int = 0) -> CausalLM:
    backend.set_backend("numpy", seed=seed)
    return CausalLM(CONFIG)


def batch(seed: int = 1):
    tokens = np.random.default_rng(seed).integers(0, CONFIG.vocab_size, size=(3, 7))
    return tokens[:, :-1], tokens[:, 1:]


def test_a_fast_model_is_born_with_its_weights_in_one_buffer():
    with using_engine("fast"):
        model = lm()
    params = model.parameters()
    flat = flat_parameters_of(params)
    assert flat is not None and flat.holds(params)
    for p, (lo, hi) in zip(params, flat.slices):
        assert np.shares_memory(p.data, flat.data[lo:hi]) and p.data.base is not None


def test_a_textbook_model_keeps_its_own_arrays():
    with using_engine("textbook"):
        model = lm()
        assert flat_parameters_of(model.parameters()) is None
        assert AdamW(model.parameters(), lr=1e-3)._flat is None


@pytest.mark.parametrize("make", [lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1),
                                  lambda ps: Adam(ps, lr=1e-2)])
def test_the_optimizer_adopts_the_models_buffer_instead_of_copying(make):
    with using_engine("fast"):
        model = lm()
        born = flat_parameters_of(model.parameters())
        buffer = born.data
        optimizer = make(model.parameters())
        assert optimizer._flat is born and born.data is buffer  # the same memory, no copy


def test_a_rebound_weight_makes_the_optimizer_build_a_new_buffer():
    """A loader that binds new arrays (not copies into the views) leaves the born buffer
    stale: the optimizer must not adopt it, or its update would run on the old values."""
    with using_engine("fast"):
        model = lm()
        born = flat_parameters_of(model.parameters())
        first = model.parameters()[0]
        first.data = first.data * 0 + 0.5  # a new array, bound
        assert not born.holds(model.parameters())
        AdamW(model.parameters(), lr=1e-2)  # flattens anew, copying the bound array
        assert np.all(first.data == 0.5) and flat_parameters_of(model.parameters()) is not born


def test_thread_replicas_share_the_models_weights_and_keep_gradients_only():
    with using_engine("fast"):
        model = lm()
        AdamW(model.parameters(), lr=1e-2)
        replicas = ThreadReplicas(model, 2)
        replica = replicas.models[1]
        for p, q in zip(model.parameters(), replica.parameters()):
            assert q.data is p.data  # the same array, not a copy
            assert not np.shares_memory(q.grad, p.grad)  # its own gradient
        x, y = batch()
        replicas.run(LanguageModeling(), [((x[:2], y[:2]), 0.5, 1), ((x[2:], y[2:]), 0.5, 2)])
        flat = replicas._replica_flats[1]
        assert flat.data is None and flat.grads_intact(replica.parameters())


def test_the_training_steps_loss_gradient_is_written_over_the_logits():
    """The fast tier hands the loss's backward the logits to overwrite: the gradient the
    model's backward receives is the logits' own buffer."""
    with using_engine("fast"):
        model = lm()
        received = {}
        backward = model.backward

        def spy_backward(dlogits):
            received["dlogits"] = dlogits
            return backward(dlogits)

        forward = model.forward

        def spy_forward(*args, **kwargs):
            received["logits"] = forward(*args, **kwargs)
            return received["logits"]

        model.backward, model.forward = spy_backward, spy_forward
        LanguageModeling().loss_and_grad(model, batch())
        if engine.compiled(received["logits"]):
            assert np.shares_memory(received["dlogits"], received["logits"])


def test_a_replica_whose_gradients_only_are_flat_is_saved_tensor_by_tensor(tmp_path):
    """A thread replica's buffer holds gradients only (its data are the model's arrays):
    a checkpoint of it must not take that buffer for the weights."""
    from npformer.checkpoint import load_checkpoint, save_checkpoint

    with using_engine("fast"):
        model = lm()
        replicas = ThreadReplicas(model, 2)
        replica = replicas.models[1]
        replicas._replica_flat(1)
        path = save_checkpoint(tmp_path / "replica.npz", replica)
    assert "flat/param" not in np.load(path).files
    loaded = load_checkpoint(path)
    for name, p in replica.named_parameters():
        np.testing.assert_array_equal(loaded.params[name], p.data)
