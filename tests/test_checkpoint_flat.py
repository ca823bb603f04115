"""Checkpoints in both tiers (format version 6): one file, whatever the tier keeps in memory.

* one format: the fast tier (weights in one flat buffer, AdamW's moments in two more) and
  the textbook tier write the same file for the same model and optimizer state: the same
  members, ``param/<name>`` and ``optim/<key>`` per tensor, the same values, dtypes and
  ``meta``; no ``flat/`` entry and no ``meta["flat_layout"]``; the values are the live
  model's and optimizer's (a rebound parameter's bound value, moments a loader bound);
* exact resume: N updates, save, a fresh model and optimizer restored from the file, M
  updates give bit-identical losses and weights to N + M updates in one run, in both
  tiers; without the saved moments they do not (the test is sharp);
* a file of an older format version (the previous release's flat files, written here by
  :func:`tests.legacy_checkpoints.save_flat_checkpoint`, or a version 1 to 4 file) is
  refused, naming its version and the one this release reads.  (The readers of versions
  1 to 4 went, with their tests: npformer is unreleased, no such file exists.)

How these tests fail (each checked by breaking the code under test in memory, in a
scratch pytest plugin, not in these files): a writer that reads the fast model's buffer
rather than each parameter's ``data`` fails the rebound-parameter test and the
same-file test of every optimizer that moves the parameters out of that buffer (Adam
L2, SGD, AdamW over some); the fast tier writing the old flat layout fails every
same-file case; a fast ``load_state_dict`` that leaves the loaded moments outside the
flat buffers fails the loader-bound test, and with the step's sync gone too, the
bound-by-hand and fast resume tests; a restore that drops the moments fails every
resume test.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from npformer import backend, checkpoint, fast, models, optim
from npformer.checkpoint import (
    CheckpointError,
    load_checkpoint,
    restore,
    save_checkpoint,
)
from npformer.nn.flat import flat_buffer_of
from npformer.train.tasks import LanguageModeling

from .conftest import using_backend
from .helpers import tier_under_test, tiered, using_tier
from .legacy_checkpoints import save_flat_checkpoint
from .test_checkpoint_train import lm, lm_batch, weights

TIERS = ["fast", "textbook"]
FLAT_MEMBERS = {"meta", "flat/param", "flat/optim/m", "flat/optim/v"}

OPTIMIZERS = {  # params -> an optimizer; each tier makes its own implementation
    "AdamW": lambda ps: tiered.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "Adam L2": lambda ps: tiered.Adam(ps, lr=1e-2, weight_decay=0.1),  # per tensor in both
    "SGD momentum": lambda ps: optim.SGD(ps, lr=1e-2, momentum=0.9),
    "AdamW over some": lambda ps: tiered.AdamW(list(ps)[1:], lr=1e-2),  # not the whole buffer
}


def _trained(tier: str, seed: int = 0, steps: int = 3, make=OPTIMIZERS["AdamW"]):
    """A causal LM of ``tier`` and its optimizer after ``steps`` updates (moments
    non-zero), with those updates' losses.  Call inside the tier's using_tier."""
    assert tier_under_test() == tier
    backend.seed(seed)
    model = lm()
    opt = make(model.parameters())
    return model, opt, _train(model, opt, _batches(steps))


def _batches(count: int, seed: int = 7) -> list:
    rng = np.random.default_rng(seed)
    return [lm_batch(rng) for _ in range(count)]


def _train(model, opt, batches) -> list[float]:
    clip = tiered.clip_grad_norm
    losses = []
    for batch in batches:
        opt.zero_grad()
        losses.append(LanguageModeling().loss_and_grad(model, batch))
        clip(model.named_parameters(), 1.0)
        opt.step()
    return losses


def _in_textbook_tier(model, opt, make):
    """A textbook model and optimizer (over the same parameters, by position) holding
    ``model``'s weights and ``opt``'s state."""
    with using_tier("textbook"):
        twin = lm()
        by_id = {id(p): i for i, p in enumerate(model.parameters())}
        chosen = [twin.parameters()[by_id[id(p)]] for p in opt.params]
        twin_opt = make(twin.parameters())
        assert [id(p) for p in twin_opt.params] == [id(p) for p in chosen]
    assert type(twin) is models.CausalLM and type(twin_opt) in (optim.AdamW, optim.Adam, optim.SGD)
    twin.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(opt.state_dict())
    return twin, twin_opt


def _contents(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as archive:
        return {key: archive[key] for key in archive.files}


def _meta(path: Path) -> dict:
    return json.loads(str(_contents(path)["meta"]))


def _assert_same_file(a: Path, b: Path) -> None:
    """The same members, each with the same dtype, shape and values (meta: the same text)."""
    x, y = _contents(a), _contents(b)
    assert x.keys() == y.keys(), sorted(set(x) ^ set(y))
    for key in x:
        assert (x[key].dtype, x[key].shape) == (y[key].dtype, y[key].shape), key
        np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def _assert_holds_the_live_state(loaded: checkpoint.Checkpoint, model, opt) -> None:
    """The checkpoint's weights and optimizer state are the model's and optimizer's now."""
    live = weights(model)
    assert loaded.params.keys() == live.keys()
    for name, value in live.items():
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)
    for name in opt._state_names:
        for i, value in enumerate(opt.state[name]):
            np.testing.assert_array_equal(loaded.optimizer[f"{name}.{i}"],
                                          backend.to_numpy(value), err_msg=f"{name}.{i}")
    assert (loaded.optimizer["step"], loaded.optimizer["lr"]) == (opt.updates, opt.lr)


# =========================================================================== one format
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS) + ["no optimizer"])
def test_both_tiers_write_the_same_file(tmp_path, dtype, kind):
    make = OPTIMIZERS.get(kind, OPTIMIZERS["AdamW"])
    saved = {"step": 3, "extra": {"note": "x"}, "rng_state": {"seed": 1}}
    with using_backend("numpy", dtype):
        with using_tier("fast"):
            model, opt, _ = _trained("fast", make=make)
        assert type(model) is fast.models.CausalLM and model._flat is not None  # premises
        twin, twin_opt = _in_textbook_tier(model, opt, make)
        keep = kind != "no optimizer"
        fast_path = save_checkpoint(tmp_path / "fast.npz", model, opt if keep else None, **saved)
        textbook_path = save_checkpoint(tmp_path / "textbook.npz", twin,
                                        twin_opt if keep else None, **saved)
        loaded = load_checkpoint(fast_path)
        if keep:
            _assert_holds_the_live_state(loaded, model, opt)
        else:
            assert loaded.optimizer == {}
            assert all(np.array_equal(loaded.params[k], v) for k, v in weights(model).items())
    _assert_same_file(fast_path, textbook_path)
    members = set(_contents(fast_path))
    expected = {"meta"} | {f"param/{name}" for name, _ in model.named_parameters()}
    if keep:
        expected |= {f"optim/{key}" for key in opt.state_dict()}
    assert members == expected  # per tensor: no flat/ entry
    assert "flat_layout" not in _meta(fast_path)
    assert _meta(fast_path)["version"] == checkpoint.FORMAT_VERSION == 6
    assert loaded.params["embed.tokens.weight"].dtype == np.dtype(dtype)
    if keep:
        assert any(np.any(v != 0) for k, v in loaded.optimizer.items() if "." in k)


def test_a_rebound_parameter_is_saved_with_its_bound_value(tmp_path):
    """A parameter rebound by any code (``p.data = ...``) is no longer its view of the
    fast model's buffer, which holds the old value until something syncs it: the file
    holds the value the parameter has."""
    with using_tier("fast"), using_backend("numpy", "float64"):
        model, opt, _ = _trained("fast")
        weight = model.embed.tokens.weight
        stale = model._flat.data.copy()
        weight.data = weight.data + 1.0  # a new array, bound
        assert np.array_equal(model._flat.data, stale)  # the premise: the buffer is stale
        loaded = load_checkpoint(save_checkpoint(tmp_path / "rebound.npz", model, opt))
    np.testing.assert_array_equal(loaded.params["embed.tokens.weight"], weight.data)
    _assert_holds_the_live_state(loaded, model, opt)


def test_moments_a_loader_bound_go_back_into_their_buffers(tmp_path):
    """A fast AdamW restored from a file keeps the loaded moments in its flat buffers
    (where its one-pass update reads them), and a run resumed and saved at once writes
    the file of the run it resumed."""
    with using_tier("fast"), using_backend("numpy", "float64"):
        model, opt, _ = _trained("fast")
        first = save_checkpoint(tmp_path / "a.npz", model, opt, step=3)
        resumed_model, resumed_opt, _ = _trained("fast", seed=123, steps=0)
        restore(resumed_model, load_checkpoint(first), resumed_opt)
        assert resumed_opt._flat is resumed_model._flat is flat_buffer_of(
            resumed_model.parameters())
        for name in ("m", "v"):
            buffer = resumed_opt._flat_state[name]  # (P,)
            for i, (lo, hi) in enumerate(resumed_opt._flat.slices):
                value = resumed_opt.state[name][i]
                assert np.shares_memory(value, buffer), f"{name}.{i} is not in the buffer"
                np.testing.assert_array_equal(buffer[lo:hi].reshape(value.shape),
                                              opt.state[name][i], err_msg=f"{name}.{i}")
        again = save_checkpoint(tmp_path / "again.npz", resumed_model, resumed_opt, step=3)
    _assert_same_file(again, first)


def test_a_moment_bound_by_hand_is_saved_and_updated(tmp_path):
    """``opt.state["m"][i] = array`` binds an array outside the flat buffer: the file holds
    it, and the next update starts from it (as the textbook AdamW's does)."""
    make = OPTIMIZERS["AdamW"]
    with using_backend("numpy", "float64"):
        with using_tier("fast"):
            model, opt, _ = _trained("fast")
        twin, twin_opt = _in_textbook_tier(model, opt, make)
        bound = np.full(opt.params[2].shape, 0.25)
        opt.state["m"][2], twin_opt.state["m"][2] = bound, bound.copy()
        loaded = load_checkpoint(save_checkpoint(tmp_path / "m.npz", model, opt))
        np.testing.assert_array_equal(loaded.optimizer["m.2"], bound)
        with using_tier("fast"):
            _train(model, opt, _batches(1, seed=8))
        assert np.shares_memory(opt.state["m"][2], opt._flat_state["m"])  # back in the buffer
        for p, q in zip(model.parameters(), twin.parameters()):  # the same gradients: the
            q.grad = p.grad.copy()                              # tiers' backwards round
        twin_opt.step()                                         # differently
    assert all(np.array_equal(a, b) for a, b in zip(opt.state["m"], twin_opt.state["m"]))
    assert all(np.array_equal(p.data, q.data)
               for p, q in zip(model.parameters(), twin.parameters()))


# =========================================================================== resume
@pytest.mark.parametrize("tier", TIERS)
def test_resume_gives_the_same_losses(tmp_path, tier):
    N, M = 3, 4
    batches = _batches(N + M)
    with using_tier(tier), using_backend("numpy", "float64"):
        model, opt, _ = _trained(tier, steps=0)
        straight = _train(model, opt, batches)
        straight_weights = weights(model)

        model, opt, _ = _trained(tier, steps=0)
        _train(model, opt, batches[:N])
        path = save_checkpoint(tmp_path / "run.npz", model, opt, step=N)

        resumed_model, resumed_opt, _ = _trained(tier, seed=123, steps=0)  # other weights
        restore(resumed_model, load_checkpoint(path), resumed_opt)
        assert resumed_opt.updates == N
        resumed = _train(resumed_model, resumed_opt, batches[N:])
        assert resumed == straight[N:]  # bit-identical losses
        assert all(np.array_equal(v, straight_weights[k])
                   for k, v in weights(resumed_model).items())

        fresh_model, fresh_opt, _ = _trained(tier, seed=123, steps=0)  # control: no moments
        fresh_model.load_state_dict(load_checkpoint(path).params)
        fresh_opt.updates = N
        assert _train(fresh_model, fresh_opt, batches[N:]) != straight[N:]


# =========================================================================== old versions
def _rewritten(path: Path, out: Path, change) -> Path:
    """A copy of the checkpoint at ``path`` after ``change(meta)``."""
    arrays = _contents(path)
    meta = json.loads(str(arrays["meta"]))
    change(meta)
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(out, **arrays)
    return out


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_a_file_of_an_older_version_is_refused_naming_it(tmp_path, version):
    with using_tier("fast"), using_backend("numpy", "float64"):
        model, opt, _ = _trained("fast", steps=1)
        if version == 4:  # the previous release's flat file
            old = save_flat_checkpoint(tmp_path / "old.npz", model, opt)
            assert FLAT_MEMBERS <= set(_contents(old))
        else:
            old = _rewritten(save_checkpoint(tmp_path / "t.npz", model, opt),
                             tmp_path / "old.npz", lambda meta: meta.update(version=version))
    assert _meta(old)["version"] == version
    with pytest.raises(CheckpointError, match=f"format version {version}; this release of "
                                              "npformer reads version 6 only"):
        load_checkpoint(old)
