"""Checkpoints of flat buffers (format version 4): the fast tier writes its parameter
buffer and its optimizer's moment buffers as they are, one array each.

* as it is: the arrays handed to ``np.savez`` are the buffers themselves (no copy, no
  ``to_numpy`` per tensor), and the archive holds ``flat/param``, ``flat/optim/m``,
  ``flat/optim/v`` and no ``param/`` or ``optim/m.<i>`` entry;
* the same checkpoint: a flat file and the per-tensor file of the same model and AdamW
  (a deep copy, which is not flat) load to equal parameters, moments, step and lr, and
  the flat file rebuilds a model (also in the textbook tier) with the same logits, and
  on the strict array-API backend with the same weights;
* exact resume: N updates, save, a fresh model and AdamW restored from the file, M
  updates give bit-identical losses and weights to N + M updates in one run; without
  the saved moments they do not (the test is sharp);
* the per-tensor layout where the buffer does not hold the model as it is: the textbook
  tier, an optimizer over some of the parameters, a rebound parameter; moments that
  a loader bound are put back in their buffers (a run resumed and saved at once writes
  the same layout and values as the run it resumed); a flat model with a per-tensor
  optimizer (Adam's L2 decay) writes ``flat/param`` and ``optim/m.<i>``, and loads the
  same;
* a malformed flat layout (overlapping, gapped or too-short offsets, a shape that does
  not match its slice, a buffer of the wrong dtype, rank or length, no layout, an
  unknown buffer, an entry held twice) is a CheckpointError naming the problem;
* version 3 files (per tensor) still load.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from npformer import backend, checkpoint, optim
from npformer.checkpoint import (
    CheckpointError,
    build_model,
    load_checkpoint,
    restore,
    save_checkpoint,
)
from npformer.tasks import LanguageModeling

from .conftest import using_backend
from .helpers import using_engine
from .test_checkpoint_train import lm, lm_batch, logits_of, weights

FLAT_MEMBERS = {"meta", "flat/param", "flat/optim/m", "flat/optim/v"}


def _trained(seed: int = 0, steps: int = 3):
    """A causal LM and its AdamW after ``steps`` updates (moments non-zero), with the
    losses of those updates."""
    backend.seed(seed)
    model = lm()
    opt = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = _train(model, opt, _batches(steps))
    return model, opt, losses


def _batches(count: int, seed: int = 7) -> list:
    rng = np.random.default_rng(seed)
    return [lm_batch(rng) for _ in range(count)]


def _train(model, opt, batches) -> list[float]:
    losses = []
    for batch in batches:
        opt.zero_grad()
        losses.append(LanguageModeling().loss_and_grad(model, batch))
        optim.clip_grad_norm(model.named_parameters(), 1.0)
        opt.step()
    return losses


def _members(path: Path) -> set[str]:
    with np.load(path) as archive:
        return set(archive.files)


def _assert_same_checkpoint(a: checkpoint.Checkpoint, b: checkpoint.Checkpoint) -> None:
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        assert a.params[name].dtype == b.params[name].dtype, name
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)
    assert a.optimizer.keys() == b.optimizer.keys()
    for key, value in a.optimizer.items():
        if isinstance(value, np.ndarray):
            assert value.dtype == b.optimizer[key].dtype, key
            np.testing.assert_array_equal(value, b.optimizer[key], err_msg=key)
        else:
            assert value == b.optimizer[key], key
    assert (a.kind, a.config, a.step, a.extra) == (b.kind, b.config, b.step, b.extra)


# =========================================================================== as it is
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_flat_buffers_are_written_as_they_are(tmp_path, monkeypatch, dtype):
    written, to_numpy_calls = {}, []
    real_savez, real_to_numpy = np.savez, backend.to_numpy

    def recording_savez(handle, **arrays):
        written.update(arrays)
        real_savez(handle, **arrays)

    def counting_to_numpy(x):
        to_numpy_calls.append(x)
        return real_to_numpy(x)

    with using_engine("fast"), using_backend("numpy", dtype):
        model, opt, _ = _trained()
        flat, moments = opt.flat_state()
        monkeypatch.setattr(np, "savez", recording_savez)
        monkeypatch.setattr(checkpoint.backend, "to_numpy", counting_to_numpy)
        path = save_checkpoint(tmp_path / "flat.npz", model, opt, step=3)
        monkeypatch.undo()
    assert written["flat/param"] is flat.data  # the buffer itself, not a copy
    assert written["flat/optim/m"] is moments["m"] and written["flat/optim/v"] is moments["v"]
    assert not [x for x in to_numpy_calls if isinstance(x, np.ndarray) and x.size > 1]
    members = _members(path)
    assert FLAT_MEMBERS <= members
    assert not {m for m in members - FLAT_MEMBERS if not m.startswith("optim/")}
    assert not {m for m in members if m.startswith(("optim/m.", "optim/v."))}
    loaded = load_checkpoint(path)
    assert loaded.params["embed.tokens.weight"].dtype == np.dtype(dtype)
    layout = json.loads(str(np.load(path)["meta"]))["flat_layout"]
    assert layout["names"] == [name for name, _ in model.named_parameters()]
    assert layout["offsets"] == [list(s) for s in flat.slices]


def test_the_textbook_tier_writes_tensor_by_tensor(tmp_path):
    with using_engine("textbook"), using_backend("numpy", "float64"):
        model, opt, _ = _trained()
        path = save_checkpoint(tmp_path / "t.npz", model, opt)
    members = _members(path)
    assert not {m for m in members if m.startswith("flat/")}
    assert {f"param/{name}" for name, _ in model.named_parameters()} <= members
    assert {f"optim/m.{i}" for i in range(len(opt.params))} <= members
    assert "flat_layout" not in json.loads(str(np.load(path)["meta"]))


# =========================================================================== same checkpoint
def test_flat_and_per_tensor_files_load_the_same(tmp_path):
    with using_engine("fast"), using_backend("numpy", "float64"):
        model, opt, _ = _trained()
        flat_path = save_checkpoint(tmp_path / "flat.npz", model, opt, step=3,
                                    extra={"note": "x"})
        model_copy, opt_copy = copy.deepcopy((model, opt))  # owns its arrays: not flat
        tensor_path = save_checkpoint(tmp_path / "tensors.npz", model_copy, opt_copy, step=3,
                                      extra={"note": "x"})
    assert "flat/param" in _members(flat_path)
    assert not {m for m in _members(tensor_path) if m.startswith("flat/")}
    flat, tensors = load_checkpoint(flat_path), load_checkpoint(tensor_path)
    _assert_same_checkpoint(flat, tensors)
    assert any(np.any(v != 0) for k, v in flat.optimizer.items() if k.startswith("m."))
    assert flat.optimizer["step"] == 3 and flat.optimizer["lr"] == opt.lr


@pytest.mark.parametrize("tier", ["fast", "textbook"])
def test_a_flat_file_rebuilds_the_model(tmp_path, tier):
    with using_backend("numpy", "float64"):
        with using_engine("fast"):
            model, _, _ = _trained()
            opt = optim.AdamW(model.parameters())
            path = save_checkpoint(tmp_path / "flat.npz", model, opt)
        assert "flat/param" in _members(path)
        batch = lm_batch(np.random.default_rng(3))
        with using_engine(tier):  # the same tier's logits: the tiers round differently
            rebuilt = build_model(load_checkpoint(path), expected_kind="causal_lm")
            np.testing.assert_array_equal(logits_of(rebuilt, batch), logits_of(model, batch))


def test_a_flat_file_loads_on_the_strict_backend(tmp_path):
    with using_engine("fast"), using_backend("numpy", "float64"):
        model, opt, _ = _trained()
        path = save_checkpoint(tmp_path / "flat.npz", model, opt)
        expected = weights(model)
    assert FLAT_MEMBERS <= _members(path)
    with using_backend("strict", "float64"):
        rebuilt = build_model(load_checkpoint(path))
        assert type(rebuilt.embed.tokens.weight.data).__module__.startswith("array_api_strict")
        got = weights(rebuilt)
    assert all(np.array_equal(got[k], v) for k, v in expected.items())


# =========================================================================== resume
def test_resume_from_a_flat_file_gives_the_same_losses(tmp_path):
    N, M = 3, 4
    batches = _batches(N + M)
    with using_engine("fast"), using_backend("numpy", "float64"):
        model, opt, straight = _trained(steps=0)
        straight = _train(model, opt, batches)
        straight_weights = weights(model)

        model, opt, _ = _trained(steps=0)
        _train(model, opt, batches[:N])
        path = save_checkpoint(tmp_path / "flat.npz", model, opt, step=N)
        assert FLAT_MEMBERS <= _members(path)

        resumed_model, resumed_opt, _ = _trained(seed=123, steps=0)  # other weights
        restore(resumed_model, load_checkpoint(path), resumed_opt)
        assert resumed_opt.step_count == N
        resumed = _train(resumed_model, resumed_opt, batches[N:])
        assert resumed == straight[N:]  # bit-identical losses
        assert all(np.array_equal(v, straight_weights[k])
                   for k, v in weights(resumed_model).items())

        fresh_model, fresh_opt, _ = _trained(seed=123, steps=0)  # control: no moments
        fresh_model.load_state_dict(load_checkpoint(path).params)
        fresh_opt.step_count = N
        assert _train(fresh_model, fresh_opt, batches[N:]) != straight[N:]


# =========================================================================== fallbacks
def test_an_optimizer_over_some_parameters_writes_its_moments_per_tensor(tmp_path):
    with using_engine("fast"), using_backend("numpy", "float64"):
        backend.seed(0)
        model = lm()
        opt = optim.AdamW(list(model.parameters())[1:])  # not the model's whole buffer
        _train(model, opt, _batches(2))
        path = save_checkpoint(tmp_path / "some.npz", model, opt)
        loaded = load_checkpoint(path)
        expected = weights(model)
    members = _members(path)
    assert not {m for m in members if m.startswith("flat/optim/")}
    assert {f"optim/m.{i}" for i in range(len(opt.params))} <= members
    assert all(np.array_equal(loaded.params[k], v) for k, v in expected.items())
    assert all(np.array_equal(loaded.optimizer[f"v.{i}"], v) for i, v in enumerate(opt.state["v"]))


def test_a_rebound_parameter_is_written_per_tensor(tmp_path):
    with using_engine("fast"), using_backend("numpy", "float64"):
        model, opt, _ = _trained()
        weight = model.embed.tokens.weight
        weight.data = weight.data + 1.0  # no longer the buffer's view: the buffer is stale
        path = save_checkpoint(tmp_path / "rebound.npz", model, opt)
        loaded = load_checkpoint(path)
    assert not {m for m in _members(path) if m.startswith("flat/")}
    np.testing.assert_array_equal(loaded.params["embed.tokens.weight"], weight.data)


def test_moments_a_loader_bound_go_back_into_their_buffers(tmp_path):
    """A resumed run that saves before its first update (a finished run resumed) writes
    the layout the uninterrupted run wrote, with the loaded moments."""
    with using_engine("fast"), using_backend("numpy", "float64"):
        model, opt, _ = _trained()
        first = load_checkpoint(save_checkpoint(tmp_path / "a.npz", model, opt))
        resumed_model, resumed_opt, _ = _trained(seed=123, steps=0)
        restore(resumed_model, first, resumed_opt)  # binds fresh moment arrays
        flat_m = resumed_opt._flat_state["m"]  # the premise: the loader bound other arrays
        assert not np.shares_memory(resumed_opt.state["m"][0], flat_m)
        path = save_checkpoint(tmp_path / "again.npz", resumed_model, resumed_opt)
        assert _members(path) == _members(tmp_path / "a.npz")
        _assert_same_checkpoint(load_checkpoint(path), first)


def test_a_flat_model_with_a_per_tensor_optimizer_writes_both_layouts(tmp_path):
    with using_engine("fast"), using_backend("numpy", "float64"):
        model, _, _ = _trained()  # its AdamW made the parameters one buffer's views
        l2_adam = optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)  # per tensor
        rng = np.random.default_rng(0)  # moments to tell apart (its update would rebind
        for name in ("m", "v"):         # the parameters, so that the model is not flat)
            l2_adam.state[name] = [rng.random(p.shape) for p in l2_adam.params]
        assert l2_adam.flat_state() is None
        path = save_checkpoint(tmp_path / "mixed.npz", model, l2_adam)
        model_copy, opt_copy = copy.deepcopy((model, l2_adam))
        tensors = save_checkpoint(tmp_path / "tensors.npz", model_copy, opt_copy)
    members = _members(path)
    assert "flat/param" in members and "optim/m.0" in members
    assert not {m for m in members if m.startswith(("param/", "flat/optim/"))}
    _assert_same_checkpoint(load_checkpoint(path), load_checkpoint(tensors))


# =========================================================================== old versions
def test_a_version_3_file_loads_the_same(tmp_path):
    with using_backend("numpy", "float64"):
        with using_engine("fast"):
            model, opt, _ = _trained()
            flat = load_checkpoint(save_checkpoint(tmp_path / "flat.npz", model, opt))
        with using_engine("textbook"):
            model_copy, opt_copy = copy.deepcopy((model, opt))
            tensors = save_checkpoint(tmp_path / "t.npz", model_copy, opt_copy)
    old = _rewritten(tensors, tmp_path / "v3.npz", lambda meta, arrays: meta.update(version=3))
    _assert_same_checkpoint(load_checkpoint(old), flat)


# =========================================================================== malformed
def _rewritten(path: Path, out: Path, change) -> Path:
    """A copy of the checkpoint at ``path`` after ``change(meta, arrays)``."""
    with np.load(path) as archive:
        arrays = {k: archive[k] for k in archive.files}
    meta = json.loads(str(arrays["meta"]))
    change(meta, arrays)
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(out, **arrays)
    return out


def _shift(index: int, by: int):
    def change(meta, arrays):
        lo, hi = meta["flat_layout"]["offsets"][index]
        meta["flat_layout"]["offsets"][index] = [lo + by, hi + by]
    return change


def _set(key: str, index: int, value):
    def change(meta, arrays):
        meta["flat_layout"][key][index] = value
    return change


def _array(key: str, how):
    def change(meta, arrays):
        arrays[key] = how(arrays[key])
    return change


MALFORMED = {
    "overlap": (_shift(1, -1), r"'embed\.positions\.weight' at \[71, 119\) overlaps "
                               r"'embed\.tokens\.weight', which ends at 72"),
    "gap": (_shift(1, +1), r"starts at 73, leaving \[72, 73\) of the buffer to no parameter"),
    "shape": (_set("shapes", 0, [9, 7]), r"'embed\.tokens\.weight' has shape \(9, 7\) \(63 "
                                         r"values\) but offsets \[0, 72\) \(72 values\)"),
    "past the end": (_array("flat/param", lambda a: a[:-1]),
                     r"runs past the end of flat/param: 'norm\.bias' ends at \d+, the "
                     r"buffer holds \d+ values"),
    "too long": (_array("flat/optim/v", lambda a: np.append(a, 0.0)),
                 r"flat/optim/v holds \d+ values but the flat layout covers \d+"),
    "dtype": (_array("flat/param", lambda a: a.astype(np.int64)),
              r"flat/param has dtype int64, not a floating-point type"),
    "rank": (_array("flat/optim/m", lambda a: a.reshape(1, -1)),
             r"flat/optim/m should be one flat array \(P,\), got shape \(1, \d+\)"),
    "no layout": (lambda meta, arrays: meta.pop("flat_layout"),
                  r"holds flat/\S+ but its 'meta' has no 'flat_layout'"),
    "lengths": (lambda meta, arrays: meta["flat_layout"]["names"].pop(),
                r"one entry per parameter, got \d+, \d+ and \d+"),
    "names": (_set("names", 1, "embed.tokens.weight"), r"'names' should be distinct strings"),
    "offsets": (_set("offsets", 0, [0, True]), r"offsets of 'embed\.tokens\.weight' are "
                                               r"\[0, True\], not \[lo, hi\]"),
    "negative size": (_set("shapes", 0, [-9, 6]), r"shape of 'embed\.tokens\.weight' is "
                                                  r"\[-9, 6\], not a list of sizes >= 0"),
    "layout keys": (lambda meta, arrays: meta["flat_layout"].pop("shapes"),
                    r"should hold exactly 'names', 'shapes' and 'offsets'"),
    "unknown buffer": (lambda meta, arrays: arrays.update({"flat/grad": arrays["flat/param"]}),
                       r"unknown flat buffer flat/grad"),
    "twice": (lambda meta, arrays: arrays.update({"param/embed.positions.weight":
                                                   np.zeros((6, 8))}),
              r"holds param/embed\.positions\.weight twice"),
    "nan moment": (_array("flat/optim/m", lambda a: np.where(np.arange(a.size) == 100, np.nan, a)),
                   r"optim/m\.1 holds 1 NaN"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_flat_layout_is_refused_naming_the_problem(tmp_path, case):
    change, message = MALFORMED[case]
    with using_engine("fast"), using_backend("numpy", "float64"):
        model, opt, _ = _trained(steps=1)
        path = save_checkpoint(tmp_path / "flat.npz", model, opt)
    layout = json.loads(str(np.load(path)["meta"]))["flat_layout"]
    assert layout["names"][:2] == ["embed.tokens.weight", "embed.positions.weight"]  # the
    assert layout["offsets"][:2] == [[0, 72], [72, 120]]                  # cases' premises
    assert layout["names"][-1] == "norm.bias"
    bad = _rewritten(path, tmp_path / "bad.npz", change)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(bad)
