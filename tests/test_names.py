"""One name per idea (issue 17 item 7): PyTorch's and nanoGPT's, everywhere.

* model width ``d_model``, head count ``num_heads``, context length ``block_size``, updates
  of a run ``max_iters``: no model config, ``TrainConfig`` or demo preset spells one of
  them another way;
* the old names still work for one release, through one helper
  (:func:`npformer.models.configs.renamed_fields`): the old keyword with a DeprecationWarning
  naming the new one, a checkpoint saved with the old config names loads and restores,
  a demo's run record with the old preset names reads as the new ones;
* the demos' ``--help`` shows the new option names; the old option names still parse,
  and a run saved with the old preset names resumes (``npformer.cli`` reads each preset's
  ``old_field_names``).
"""
from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import pytest

from npformer.checkpoint import build_model, load_checkpoint, restore, save_checkpoint
from npformer.models import (
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
)
from npformer.models.common import config_from_dict
from npformer.models.configs import new_field_names
from npformer.nn import no_grad
from npformer.optim import warmup_cosine
from npformer.train import TrainConfig
from tests.helpers import tier_under_test, tiered

from .conftest import using_backend
from .test_demos import data_dir, load_demo, run_demo  # noqa: F401 (data_dir: a fixture)

OLD_NAMES = {"width", "heads", "max_len", "block", "iters", "steps", "max_steps", "layers",
             "total_steps"}
SCRIPTS = ("imdb.py", "translate.py", "generate.py")


def presets():
    return [load_demo(script).Preset for script in SCRIPTS]


def renamed_classes():
    return [ClassifierConfig, Seq2SeqConfig, TrainConfig, warmup_cosine] + presets()


# =========================================================================== one name
@pytest.mark.parametrize("cls", [ClassifierConfig, CausalLMConfig, Seq2SeqConfig, TrainConfig],
                         ids=lambda c: c.__name__)
def test_no_config_field_has_an_old_name(cls):
    assert not {f.name for f in dataclasses.fields(cls)} & OLD_NAMES


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_preset_field_has_an_old_name(script):
    names = {f.name for f in dataclasses.fields(load_demo(script).Preset)}
    assert not names & OLD_NAMES, names & OLD_NAMES


def test_each_old_name_maps_to_a_field_of_its_class():
    for cls in renamed_classes():
        names = {f.name for f in dataclasses.fields(cls)}
        assert cls.old_field_names, cls
        for old, new in cls.old_field_names.items():
            assert old in OLD_NAMES and old not in names and new in names, (cls, old, new)


# =========================================================================== old keywords
@pytest.mark.parametrize("make,old,new,value", [
    (lambda: TrainConfig(max_steps=7), "max_steps", "max_iters", 7),
    (lambda: ClassifierConfig(vocab_size=10, max_len=9), "max_len", "block_size", 9),
    (lambda: Seq2SeqConfig(10, 11, max_len=9), "max_len", "block_size", 9),
    (lambda: warmup_cosine(1e-3, 2, total_steps=9), "total_steps", "total_updates", 9),
])
def test_an_old_keyword_warns_naming_the_new_one(make, old, new, value):
    with pytest.warns(DeprecationWarning, match=f"{old}.*'{new}'") as caught:
        config = make()
    assert getattr(config, new) == value
    assert caught[0].filename == __file__  # points at the caller, not at the helper


def test_an_old_keyword_beside_its_new_one_is_refused():
    with pytest.raises(TypeError, match="max_steps.*max_iters"):
        TrainConfig(max_iters=3, max_steps=4)


def test_an_old_preset_keyword_warns():
    Preset = load_demo("generate.py").Preset
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        preset = Preset(iters=5, width=16, heads=2, block=8)
    assert sorted(str(w.message).split("'")[1] for w in caught
                  if w.category is DeprecationWarning) == ["block_size", "d_model", "max_iters",
                                                           "num_heads"]
    assert (preset.max_iters, preset.d_model, preset.num_heads, preset.block_size) == (5, 16, 2, 8)


# =========================================================================== saved records
def test_a_config_dict_with_old_names_builds_the_config_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a saved record is not the user's code: no warning
        config = config_from_dict(ClassifierConfig, {"vocab_size": 10, "max_len": 9})
    assert config == ClassifierConfig(vocab_size=10, block_size=9)
    with pytest.raises(ValueError, match="no fields"):
        config_from_dict(ClassifierConfig, {"vocab_size": 10, "length": 9})


def _with_old_config_names(path, out):
    """A copy of the checkpoint at ``path`` as an npformer before the rename wrote it."""
    with np.load(path) as archive:
        contents = {k: archive[k] for k in archive.files}
    meta = json.loads(str(contents["meta"]))
    meta["config"]["max_len"] = meta["config"].pop("block_size")
    meta["version"] = 2  # the format before the rename
    contents["meta"] = np.array(json.dumps(meta))
    np.savez(out, **contents)
    return out


@pytest.mark.parametrize("make", [
    lambda: tiered.TransformerClassifier(ClassifierConfig(vocab_size=12, d_model=8, num_heads=2,
                                                   num_layers=1, d_ff=16, block_size=6,
                                                   dropout=0.0)),
    lambda: tiered.Seq2SeqTransformer(Seq2SeqConfig(11, 12, d_model=8, num_heads=2,
                                             num_encoder_layers=1, num_decoder_layers=1,
                                             d_ff=16, block_size=6, dropout=0.0)),
], ids=["classifier", "seq2seq"])
def test_a_checkpoint_with_old_config_names_loads_and_restores(make, tmp_path):
    with using_backend("numpy", "float64", seed=3):
        model = make()
        old = _with_old_config_names(save_checkpoint(tmp_path / "new.npz", model),
                                     tmp_path / "old.npz")
        assert "max_len" in json.loads(str(np.load(old)["meta"]))["config"]
        loaded = build_model(load_checkpoint(old), tier=tier_under_test())
        assert loaded.config == model.config
        ids = np.array([[1, 4, 5, 0], [3, 2, 0, 0]])
        with no_grad():
            args = (ids,) if model.kind == "classifier" else (ids, ids)
            np.testing.assert_array_equal(loaded(*args), model(*args))
        restore(make(), load_checkpoint(old))  # the same architecture: no error


@pytest.mark.parametrize("script,old,new", [
    ("generate.py", {"iters": 3, "block": 8, "heads": 2, "width": 16},
     {"max_iters": 3, "block_size": 8, "num_heads": 2, "d_model": 16}),
    ("imdb.py", {"heads": 2, "max_len": 64}, {"num_heads": 2, "block_size": 64}),
    ("translate.py", {"heads": 2, "steps": 30}, {"num_heads": 2, "max_iters": 30}),
])
def test_a_run_record_with_old_preset_names_reads_as_the_new_ones(script, old, new):
    """A demo's run record (run.json, a checkpoint's extra["run"]["preset"]) saved before
    the rename: the old names read as the new ones, values unchanged."""
    Preset = load_demo(script).Preset
    record = {**dataclasses.asdict(Preset()), **new}
    for name in new:
        del record[name]
    record.update(old)
    assert new_field_names(Preset, record) == {**dataclasses.asdict(Preset()), **new}


# =========================================================================== the options
@pytest.mark.parametrize("script,options", [
    ("generate.py", ["--max-iters", "--block-size", "--num-heads", "--d-model"]),
    ("imdb.py", ["--num-heads", "--block-size", "--d-model"]),
    ("translate.py", ["--num-heads", "--max-iters", "--d-model"]),
])
def test_help_shows_the_new_option_names(script, options):
    text = load_demo(script).build_parser().format_help()
    for option in options:
        assert option in text, option


@pytest.mark.parametrize("script,argv,expected", [
    ("generate.py", ["--iters", "3", "--block", "8", "--heads", "2", "--width", "16"],
     {"max_iters": 3, "block_size": 8, "num_heads": 2, "d_model": 16}),
    ("imdb.py", ["--heads", "2", "--max-len", "64", "--head-tokens", "16"],
     {"num_heads": 2, "block_size": 64}),
    ("translate.py", ["--heads", "2", "--steps", "30"], {"num_heads": 2, "max_iters": 30}),
])
def test_the_old_option_names_still_parse(script, argv, expected):
    args = load_demo(script).build_parser().parse_args(argv)
    assert {name: getattr(args, name) for name in expected} == expected


def test_a_run_saved_with_the_old_preset_names_resumes(data_dir, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    stopped = run_demo("generate.py", "--smoke", "--replicas", "1", "--no-progress",
                       "--max-iters", "4", "--stop-after", "2", "--data", str(data_dir),
                       "--out", str(out))
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    last = out / "last.npz"
    with np.load(last) as archive:
        contents = {k: archive[k] for k in archive.files}
    meta = json.loads(str(contents["meta"]))
    preset = meta["extra"]["run"]["preset"]
    for old, new in load_demo("generate.py").Preset.old_field_names.items():
        preset[old] = preset.pop(new)  # as a run saved before the rename
    contents["meta"] = np.array(json.dumps(meta))
    np.savez(last, **contents)
    resumed = run_demo("generate.py", "--resume", "--no-progress", "--data", str(data_dir),
                       "--out", str(out))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((out / "metrics.json").read_text())["updates"] == 4  # max_iters kept
