"""Issue 57, cases 6 to 11: LoRA checkpoints keep their adapters' settings, PEFT folders
with lm_head / embedding adapters, whole-or-nothing writers, options given without the
option they need, environment settings read where they are used, and errors that name
the argument instead of a library's."""
from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import npformer

ROOT = Path(npformer.__file__).resolve().parents[1]  # the checkout whose package runs
GARBAGE = "maybe-not"


# --------------------------------------------------------------------------- case 10
def _environment_variables() -> list[str]:
    """Every NPFORMER_* variable the package's source names."""
    import re

    names = set()
    for path in Path(npformer.__file__).parent.rglob("*.py"):
        names.update(re.findall(r"\bNPFORMER_[A-Z_]*[A-Z]\b", path.read_text()))
    return sorted(names)


def _all_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(npformer.__path__, "npformer.")
                  if ".__main__" not in m.name)


def test_the_settings_variables_are_found():
    names = _environment_variables()
    for name in ("NPFORMER_BACKEND", "NPFORMER_GPU_FUSED", "NPFORMER_CUDA_GRAPH"):
        assert name in names


def test_no_module_refuses_the_environment_on_import():
    """Every module imports with every NPFORMER_* variable set to garbage: the settings
    are read where they are used, and reported there (case 10)."""
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError as exc:\n"
            "        if 'npformer' in str(exc): raise\n")  # an optional library: cupy
    env = {**os.environ, **{name: GARBAGE for name in _environment_variables()}}
    env.pop("NPFORMER_LAUNCHED", None)  # names a folder the launcher made
    proc = subprocess.run([sys.executable, "-c", code, *_all_modules()], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("name", ["NPFORMER_GPU_FUSED", "NPFORMER_BACKEND",
                                  "NPFORMER_CUDA_GRAPH"])
def test_a_demo_says_a_bad_setting_in_one_error_line(name, tmp_path):
    env = {**os.environ, name: GARBAGE}
    proc = subprocess.run([sys.executable, "demos/generate.py", "--smoke", "--procs", "1",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[-1].startswith("error: ") and name in lines[-1], lines


def test_the_backend_is_made_on_first_use(monkeypatch):
    from npformer import backend

    monkeypatch.setenv("NPFORMER_BACKEND", GARBAGE)
    monkeypatch.setattr(backend, "_current", None)
    with pytest.raises(ValueError, match="NPFORMER_BACKEND='maybe-not' is an unknown backend"):
        backend.backend_name()
    monkeypatch.setenv("NPFORMER_BACKEND", "")
    assert backend.backend_name() == "numpy"


# --------------------------------------------------------------------------- case 9
def _demo(script: str, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "demos" / script), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


@pytest.mark.parametrize("script,args,typed,needed", [
    ("finetune.py", ("--lora-alpha", "16"), "--lora-alpha 16", "--lora R"),  # the default
    ("finetune.py", ("--lora", "0", "--lora-dropout", "0"), "--lora-dropout 0", "--lora R"),
    ("finetune.py", ("--lora-targets", ""), "--lora-targets ''", "--lora R"),
    ("generate.py", ("--kv-heads", "2"), "--kv-heads 2", "--arch llama"),  # the default
    ("generate.py", ("--kv_heads=2",), "--kv_heads 2", "--arch llama"),
    ("imdb.py", ("--checkpoint", "x.npz"), "--checkpoint x.npz", "--predict TEXT"),
    ("imdb.py", ("--text-column", "text"), "--text-column text", "--data FILE.csv"),
])
def test_an_option_typed_without_the_one_it_needs_is_refused(script, args, typed, needed,
                                                             tmp_path):
    """Refused whatever its value, the default's too (case 9): the run would not read it."""
    result = _demo(script, "--smoke", "--procs", "1", *args, "--out", str(tmp_path / "run"))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f"error: {typed}" in last and needed in last, last
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_resumed_run_is_not_refused_for_its_saved_settings(tmp_path):
    """A resumed run reads --arch llama --kv-heads 1 back from its checkpoint: only what
    is typed on the resuming command line counts as given."""
    from .test_demos import SHARED_DATA, synthetic_data

    (tmp_path / "data").mkdir()
    data = SHARED_DATA if SHARED_DATA.is_dir() else synthetic_data(tmp_path / "data")
    out = str(tmp_path / "run")
    first = _demo("generate.py", "--smoke", "--procs", "1", "--replicas", "1", "--arch",
                  "llama", "--kv-heads", "1", "--max-iters", "3", "--stop-after", "1",
                  "--data", str(data), "--out", out, "--no-progress")
    assert first.returncode == 130, first.stderr[-3000:]
    resumed = _demo("generate.py", "--resume", "--procs", "1", "--out", out, "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = _demo("generate.py", "--resume", "--procs", "1", "--kv-heads", "1", "--out", out,
                  "--no-progress")  # finished: nothing to refuse but what a finished run is
    assert "is read only with" not in again.stderr


# --------------------------------------------------------------------------- case 8
def _adapted_llama():
    from npformer.interop import peft as npeft

    from .helpers import tiny_llama

    model = tiny_llama()
    naming = npeft.llama_names(model.config)
    npeft.apply_adapters(model, naming, ["q_proj", "v_proj"], r=2, alpha=4.0)
    return model, naming


def _entries(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_save_adapter_takes_a_path_as_base_model(tmp_path):
    import json

    from npformer.interop import peft as npeft

    model, naming = _adapted_llama()
    npeft.save_adapter(model, tmp_path / "adapter", naming, base_model=tmp_path / "base")
    config = json.loads((tmp_path / "adapter" / npeft.CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")


@pytest.mark.parametrize("keyword,value,named", [("base_model", 3, "base_model"),
                                                 ("task_type", ["CAUSAL_LM"], "task_type")])
def test_save_adapter_refuses_a_bad_argument_before_writing(keyword, value, named, tmp_path):
    from npformer.interop import peft as npeft

    model, naming = _adapted_llama()
    with pytest.raises(TypeError, match=named):
        npeft.save_adapter(model, tmp_path / "adapter", naming, **{keyword: value})
    assert list(tmp_path.iterdir()) == []  # not even the folder


def _failing_write_text(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_adapter_save_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    """The config's write fails after the weights were written: the folder keeps its
    previous files, bit for bit, and holds no temporary (a new folder is not made)."""
    from npformer.interop import peft as npeft

    model, naming = _adapted_llama()
    folder = npeft.save_adapter(model, tmp_path / "adapter", naming)
    before = _entries(folder)
    for layer in npeft.lora_layers(model).values():
        layer.lora_B.data = layer.lora_B.data + 1.0  # other weights: a different file
    monkeypatch.setattr(Path, "write_text", _failing_write_text)
    with pytest.raises(OSError, match="could not save into"):
        npeft.save_adapter(model, folder, naming)
    with pytest.raises(OSError):
        npeft.save_adapter(model, tmp_path / "new", naming)
    assert _entries(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_a_failed_gpt2_save_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    from npformer import models

    from .test_gpt2 import train_tokenizer, write_folder

    source = write_folder(tmp_path / "source", train_tokenizer())
    model = models.CausalLM.from_pretrained(source)
    folder = model.save_pretrained(tmp_path / "gpt2")
    before = _entries(folder)
    monkeypatch.setattr(Path, "write_text", _failing_write_text)
    with pytest.raises(OSError):
        model.save_pretrained(folder)
    with pytest.raises(OSError):
        model.save_pretrained(tmp_path / "new")
    assert _entries(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2", "source"]


# --------------------------------------------------------------------------- case 11
def _tiny_lm():
    from .helpers import tiny_llama

    return tiny_llama()


@pytest.mark.parametrize("extra,where", [({"x": np.arange(3)}, "extra['x']"),
                                         ({"x": [1, {"y": np.int64(2)}]}, "extra['x'][1]['y']"),
                                         ({"x": {1, 2}}, "extra['x']")])
def test_save_checkpoint_names_an_extra_that_is_not_json(extra, where, tmp_path):
    from npformer.checkpoint import save_checkpoint

    with pytest.raises(TypeError) as caught:
        save_checkpoint(tmp_path / "model.npz", _tiny_lm(), extra=extra)
    assert str(caught.value).startswith(f"{where} is a ") and "not a JSON value" in \
        str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_save_safetensors_makes_its_folder_and_names_a_bad_path(tmp_path):
    from npformer.interop.pytorch import save_safetensors

    from .test_safetensors import CONFIGS, KINDS

    model = KINDS["classifier"].model_cls(CONFIGS["classifier"]())
    path = save_safetensors(model, tmp_path / "missing" / "deeper" / "model.safetensors")
    assert path.is_file() and [p.name for p in path.parent.iterdir()] == ["model.safetensors"]
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(NotADirectoryError, match="a-file is a file, not a folder"):
        save_safetensors(model, tmp_path / "a-file" / "model.safetensors")
    with pytest.raises(IsADirectoryError, match="path .* is a folder"):
        save_safetensors(model, tmp_path / "missing")


@pytest.mark.parametrize("returned,message", [
    ("0.5", "must return a dict"),
    ({"val_loss": "0.5"}, "'val_loss': '0.5' (str); each metric must be a real number"),
    ({"val_loss": None}, "'val_loss': None"),
    ({3: 0.5}, "the metric name 3"),
])
def test_an_eval_fn_returning_what_is_not_metrics_is_named(returned, message):
    from npformer.train.evaluation import Evaluation

    with pytest.raises(TypeError, match="eval_fn") as caught:
        Evaluation(lambda model: returned).metrics(None, 4)
    assert message in str(caught.value)


def test_an_eval_fn_s_numpy_numbers_are_plain_numbers():
    import json

    from npformer.train.evaluation import Evaluation, describe

    metrics = Evaluation(lambda model: {"loss": np.float32(0.25), "n": np.int64(3),
                                        "acc": np.array(0.5)}).metrics(None, 2)
    assert metrics == {"loss": 0.25, "n": 3, "acc": 0.5, "update": 2}
    assert type(metrics["loss"]) is float and type(metrics["n"]) is int
    json.dumps(metrics)
    assert describe(metrics) == "update 2: loss 0.2500, n 3.0000, acc 0.5000"


# --------------------------------------------------------------------------- case 6
def _lora_llama(alpha=5.0, r=2, targets=("q_proj", "v_proj"), dropout=0.0, seed=0):
    from npformer import backend
    from npformer.nn.lora import apply_lora, lora_layers

    from .helpers import tiny_llama

    model = tiny_llama()
    apply_lora(model, list(targets), r=r, alpha=alpha, dropout=dropout)
    rng = np.random.default_rng(seed)
    for layer in lora_layers(model).values():  # B away from zero: the scale shows
        layer.lora_B.data = backend.asarray(rng.standard_normal(layer.lora_B.shape))
    return model


IDS = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])


def _logits(model) -> np.ndarray:
    from npformer import backend

    return backend.to_numpy(model(IDS))


@pytest.mark.parametrize("tier", ["textbook", "fast"])
def test_build_model_rebuilds_a_lora_checkpoint_s_adapters(tier, tmp_path):
    """What finetune.py --lora saves as model.npz builds with its adapters (it failed on
    "unexpected keys: ...lora_A"), computing what the saved model computed."""
    from npformer.checkpoint import build_model, load_checkpoint, save_checkpoint
    from npformer.nn.lora import lora_layers

    from .conftest import using_backend

    with using_backend("numpy", "float64"):
        model = _lora_llama(alpha=5.0)
        path = save_checkpoint(tmp_path / "model.npz", model)
        built = build_model(load_checkpoint(path), tier=tier)
        adapters = lora_layers(built)
        assert sorted(adapters) == sorted(lora_layers(model))
        assert {(a.r, a.alpha, a.dropout.p) for a in adapters.values()} == {(2, 5.0, 0.0)}
        np.testing.assert_allclose(_logits(built), _logits(model), rtol=1e-12, atol=1e-12)
        trainable = {name for name, p in built.named_parameters() if not p.frozen}
        assert trainable and all(".lora_" in name for name in trainable)


def test_build_model_keeps_one_a_shared_by_a_fused_projection(tmp_path):
    from npformer import models
    from npformer.checkpoint import build_model, load_checkpoint, save_checkpoint
    from npformer.interop import peft as npeft
    from npformer.nn.lora import lora_layers

    from .conftest import using_backend

    with using_backend("numpy", "float64"):
        config = models.CausalLMConfig(vocab_size=11, d_model=8, num_heads=2, num_layers=1,
                                       d_ff=16, block_size=8)
        model = models.CausalLM(config)
        npeft.apply_adapters(model, npeft.gpt2_names(config), ["c_attn"], r=2, alpha=3.0)
        built = build_model(load_checkpoint(save_checkpoint(tmp_path / "m.npz", model)))
        q, k, v = (lora_layers(built)[f"blocks.0.self_attn.{p}_proj"] for p in "qkv")
        assert q.lora_A is k.lora_A is v.lora_A


@pytest.mark.parametrize("other,named", [
    (dict(alpha=16.0), "alpha: checkpoint 5.0, model 16.0"),
    (dict(dropout=0.1), "dropout: checkpoint 0.0, model 0.1"),
    (dict(targets=("q_proj", "k_proj")), "targets"),
    (dict(r=3), "r: checkpoint 2, model 3"),
])
def test_restore_refuses_adapters_of_other_settings_by_name(other, named, tmp_path):
    """Restored into adapters of alpha 16, a checkpoint trained with alpha 5 loaded
    silently and computed another model (case 6)."""
    from npformer.checkpoint import CheckpointError, load_checkpoint, restore, save_checkpoint

    from .conftest import using_backend

    with using_backend("numpy", "float64"):
        checkpoint = load_checkpoint(save_checkpoint(tmp_path / "m.npz", _lora_llama()))
        with pytest.raises(CheckpointError, match="LoRA adapters differ") as caught:
            restore(_lora_llama(**{"alpha": 5.0, **other}), checkpoint)
    assert named in str(caught.value)


def test_restore_into_the_same_adapters_and_into_a_merged_model(tmp_path):
    from npformer.checkpoint import CheckpointError, load_checkpoint, restore, save_checkpoint
    from npformer.nn.lora import merge_lora

    from .conftest import using_backend

    with using_backend("numpy", "float64"):
        saved = _lora_llama(seed=0)
        checkpoint = load_checkpoint(save_checkpoint(tmp_path / "m.npz", saved))
        fresh = _lora_llama(seed=1)
        restore(fresh, checkpoint)
        np.testing.assert_allclose(_logits(fresh), _logits(saved), rtol=1e-12, atol=1e-12)
        merge_lora(fresh)
        with pytest.raises(CheckpointError, match="merged: checkpoint False, model True"):
            restore(fresh, checkpoint)


# --------------------------------------------------------------------------- case 7
PEFT_RTOL = 1e-10


def _peft_case(name):
    """The torch folder's name, and the adapted modules (lm_head only where untied)."""
    targets = ["q_proj", "embed_tokens"] + (["lm_head"] if "untied" in name else [])
    return targets


@pytest.mark.parametrize("name", ["llama_gqa_llama3_untied", "qwen3_tied"])
def test_peft_loads_our_embedding_and_lm_head_adapters_and_matches_them(torch, tmp_path,
                                                                         name):
    """Logits, and every adapter's gradient (the embedding's A and B too) against torch
    autograd on PEFT's model, float64, within 1e-10 (case 7)."""
    import json

    import peft

    from npformer.interop import peft as npeft
    from npformer.models import LlamaCausalLM

    from .conftest import using_backend
    from .helpers import rel_diff
    from .llama_reference import float64_reference
    from .test_hf_llama import PAD, build
    from .test_lora_peft import lm_adapter_gradients, randomize_adapters

    theirs, folder = build(torch, tmp_path, name)
    targets = _peft_case(name)
    with using_backend("numpy", "float64"), float64_reference():
        ours = LlamaCausalLM.from_pretrained(folder, dtype="float64")
        naming = npeft.llama_names(ours.config, padding_idx=PAD)
        npeft.apply_adapters(ours, naming, targets, 3, 7.0)
        randomize_adapters(ours)
        npeft.save_adapter(ours, tmp_path / "adapter", naming)
        config = json.loads((tmp_path / "adapter" / npeft.CONFIG_FILE).read_text())
        assert sorted(config["target_modules"]) == sorted(targets)
        theirs = peft.PeftModel.from_pretrained(theirs, tmp_path / "adapter", is_trainable=True)
        mine, expected = lm_adapter_gradients(ours, theirs, naming, seed=6)
    assert "base_model.model.model.embed_tokens.lora_embedding_A" in expected
    assert ("base_model.model.lm_head.lora_A.weight" in expected) == ("lm_head" in targets)
    assert set(mine) == set(expected)
    for key, grad in expected.items():
        assert rel_diff(mine[key], grad) <= PEFT_RTOL, key


@pytest.mark.parametrize("name", ["llama_gqa_llama3_untied", "qwen3_tied"])
def test_we_load_peft_s_embedding_and_lm_head_adapters(torch, tmp_path, name):
    """PEFT's folder with lora_embedding_A / _B and base_layer.weight (it saves the adapted
    embeddings' tables too) was refused: "'...base_layer.weight' is not a LoRA weight"."""
    import peft

    from npformer import backend
    from npformer.interop import peft as npeft
    from npformer.models import LlamaCausalLM
    from npformer.nn.lora import lora_layers

    from .conftest import using_backend
    from .helpers import rel_diff, to_host
    from .llama_reference import float64_reference
    from .test_hf_llama import build

    theirs, folder = build(torch, tmp_path, name)
    targets = _peft_case(name)
    with using_backend("numpy", "float64"), float64_reference():
        theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=2, lora_alpha=5,
                                                             target_modules=targets))
        with torch.no_grad():
            for key, p in theirs.named_parameters():
                if "lora_" in key:
                    p.normal_(0.0, 0.5)
        theirs.save_pretrained(tmp_path / "adapter")
        ours = LlamaCausalLM.from_pretrained(folder, dtype="float64")
        names = npeft.load_adapter(ours, tmp_path / "adapter", npeft.llama_names(ours.config))
        assert "model.embed_tokens" in names and "embed" in lora_layers(ours)
        ids = np.random.default_rng(5).integers(0, ours.config.vocab_size, (2, 6))
        with torch.no_grad():
            expected = theirs(torch.tensor(ids)).logits.numpy()
            with theirs.disable_adapter():
                plain = theirs(torch.tensor(ids)).logits.numpy()
        got = to_host(ours(backend.asarray(ids)))
    assert rel_diff(got, expected) <= PEFT_RTOL and rel_diff(got, plain) > 1e-3


def test_an_adapter_on_a_tied_lm_head_is_refused_by_name(tmp_path):
    from npformer.interop import peft as npeft

    from .helpers import tiny_llama

    untied = tiny_llama(tie_weights=False)
    naming = npeft.llama_names(untied.config)
    npeft.apply_adapters(untied, naming, ["q_proj", "lm_head"], 2, 4.0)
    npeft.save_adapter(untied, tmp_path / "adapter", naming)
    tied = tiny_llama()
    with pytest.raises(ValueError, match="adapts lm_head: this model's lm_head is tied to "
                                         "model.embed_tokens"):
        npeft.load_adapter(tied, tmp_path / "adapter", npeft.llama_names(tied.config))
    with pytest.raises(ValueError, match="target_modules 'lm_head': this model's lm_head is "
                                         "tied"):
        npeft.apply_adapters(tied, npeft.llama_names(tied.config), ["lm_head"], 2)


@pytest.mark.parametrize("tier", ["textbook", "fast"])
@pytest.mark.parametrize("shape", [(5,), (2, 3)])
def test_the_embedding_adapter_passes_gradcheck(tier, shape):
    from npformer import backend, fast, nn
    from npformer.gradcheck import check_module
    from npformer.nn.lora import LoRAEmbedding

    from .conftest import using_backend
    from .helpers import GRADCHECK_TOL

    table = {"textbook": nn.Embedding, "fast": fast.layers.Embedding}[tier]
    with using_backend("numpy", "float64"):
        rng = np.random.default_rng(3)
        layer = LoRAEmbedding(table(7, 4), 3, 5.0)
        layer.lora_A.data = backend.asarray(rng.standard_normal((7, 3)))  # A starts at 0
        ids = backend.asarray(rng.integers(0, 7, shape))
        assert check_module(layer, [ids]).worst_error < GRADCHECK_TOL


def test_the_embedding_adapter_merges_and_saves_its_settings(tmp_path):
    from npformer.checkpoint import build_model, load_checkpoint, save_checkpoint
    from npformer.nn.lora import LoRAEmbedding, lora_layers, merge_lora, unmerge_lora

    from .conftest import using_backend

    with using_backend("numpy", "float64"):
        model = _lora_llama(targets=("embed", "q_proj"))
        adapter = lora_layers(model)["embed"]
        assert isinstance(adapter, LoRAEmbedding)
        adapter.lora_A.data = adapter.lora_A.data + 0.5  # A starts at zero
        before = _logits(model)
        built = build_model(load_checkpoint(save_checkpoint(tmp_path / "m.npz", model)))
        assert isinstance(lora_layers(built)["embed"], LoRAEmbedding)
        np.testing.assert_allclose(_logits(built), before, rtol=1e-12, atol=1e-12)
        merge_lora(model)  # the one table of a tied model: the head's too, as PEFT's merge
        assert np.abs(_logits(model) - before).max() > 1e-6
        unmerge_lora(model)
        np.testing.assert_array_equal(_logits(model), before)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    from .test_gpt2 import train_tokenizer, write_folder

    return write_folder(tmp_path_factory.mktemp("gpt2"), train_tokenizer(), scale=0.3)


@pytest.mark.parametrize("tier", ["textbook", "fast"])
def test_gpt2_s_token_table_adapter_matches_peft(gpt2_folder, tmp_path, tier):
    import json

    import peft

    from npformer import fast, models
    from npformer.interop import peft as npeft

    from .conftest import using_backend
    from .helpers import rel_diff
    from .test_lora_peft import hf_model, lm_adapter_gradients, randomize_adapters

    cls = {"textbook": models.CausalLM, "fast": fast.CausalLM}[tier]
    with using_backend("numpy", "float64"):
        ours = cls.from_pretrained(gpt2_folder, dtype="float64")
        naming = npeft.gpt2_names(ours.config)
        npeft.apply_adapters(ours, naming, ["c_attn", "wte"], 2, 5.0)
        randomize_adapters(ours)
        npeft.save_adapter(ours, tmp_path, naming)
        assert json.loads((tmp_path / npeft.CONFIG_FILE).read_text())["target_modules"] == \
            ["c_attn", "wte"]
        theirs = peft.PeftModel.from_pretrained(hf_model(gpt2_folder), tmp_path,
                                                is_trainable=True)
        mine, expected = lm_adapter_gradients(ours, theirs, naming)
    assert "base_model.model.transformer.wte.lora_embedding_B" in expected
    assert set(mine) == set(expected)
    for key, grad in expected.items():
        assert rel_diff(mine[key], grad) <= PEFT_RTOL, key


def test_a_schedule_s_value_of_the_wrong_kind_names_the_schedule():
    from npformer import nn, optim

    layer = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"the schedule's value lr\(1\) must be a real number, "
                                        "got 'x'"):
        optim.AdamW(layer.parameters(), lr=lambda t: "x")


def test_the_tokenizer_saves_into_a_missing_folder(tmp_path):
    from npformer.hf.gpt2 import Tokenizer

    from .test_gpt2 import train_tokenizer

    tokenizer = Tokenizer(train_tokenizer(), None)
    tokenizer.save(tmp_path / "new" / "tokenizer.json")
    assert (tmp_path / "new" / "tokenizer.json").is_file()
    with pytest.raises(IsADirectoryError, match="path .* is a folder"):
        tokenizer.save(tmp_path / "new")


@pytest.mark.parametrize("script,use,args,typed", [
    ("generate.py", ("--sample-only",), ("--d-model", "32"), "--d-model 32"),
    ("generate.py", ("--sample-only",), ("--max-iters", "1800"), "--max-iters 1800"),
    ("generate.py", ("--sample-only",), ("--stop-after", "3"), "--stop-after 3"),
    ("translate.py", ("--translate", "go ."), ("--lr", "0.003"), "--lr 0.003"),
    ("imdb.py", ("--predict", "good"), ("--members", "3"), "--members 3"),
])
def test_a_setting_the_saved_model_mode_does_not_read_is_refused(script, use, args, typed,
                                                                 tmp_path):
    """--sample-only (--predict, --translate) uses the saved model: a size or a training
    setting typed with it was dropped silently (the same cause as case 9)."""
    result = _demo(script, *use, *args, "--out", str(tmp_path))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f"error: {typed} is not read with {use[0]}" in last, last


def _reads_of_the_environment_on_import(tree) -> list[int]:
    """Lines of a module's statements that run on import (outside every function body)
    and read the environment: os.environ[...], os.environ.get(...), os.getenv(...)."""
    import ast

    lines = []

    def visit(node, in_function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for default in node.args.defaults + node.args.kw_defaults:
                if default is not None:
                    visit(default, in_function)  # defaults run on import; binding a
            for child in node.body if not isinstance(node, ast.Lambda) else [node.body]:
                visit(child, True)  # mapping as a default is not reading it
            return
        if not in_function:
            read = (isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ"
                    or isinstance(node, ast.Call) and ast.unparse(node.func) in (
                        "os.environ.get", "os.getenv", "os.environ.__getitem__"))
            if read:
                lines.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(tree, False)
    return lines


def test_no_module_reads_the_environment_on_import():
    """Case 10's rule, read off the source: no statement that runs when a module is
    imported reads an environment variable (a setting is read where it is used)."""
    import ast

    found = []
    for path in sorted(Path(npformer.__file__).parent.rglob("*.py")):
        lines = _reads_of_the_environment_on_import(ast.parse(path.read_text()))
        found += [f"{path.relative_to(ROOT)}:{line}" for line in lines]
    assert not found, found


def test_the_import_time_reader_finds_a_read():
    import ast

    planted = ast.parse("import os\nX = os.environ.get('A', '')\n"
                        "def f():\n    return os.environ['B']\nY = os.getenv('C')\n")
    assert _reads_of_the_environment_on_import(planted) == [2, 5]
