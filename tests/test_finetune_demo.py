"""demos/finetune.py (issue 34, item 4), run as a user runs it, on a GPT-2 folder made here.

* ``--smoke`` loads the folder (written by transformers, its tokenizer trained here),
  reports the validation loss before and after, samples, and writes the fine-tuned model
  as a GPT-2 folder that transformers and npformer both load with the same logits;
  ``--sample-only`` samples from that folder;
* an interrupted run resumed with ``--resume`` ends with the uninterrupted run's
  metrics and weights;
* a user's mistakes are one ``error:`` line, exit status 2: a missing folder, a folder of
  another architecture, a prompt longer than the context, windows longer than it.

Nothing downloads: --model is always a folder here.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from .helpers import tiered
from .test_demos import check_the_textbook_run, run_demo, run_recording_modules
from .test_gpt2 import TEXT, hf_model, required, train_tokenizer, write_folder

required("transformers")
required("tokenizers")

SMOKE = ("--smoke", "--replicas", "2", "--no-progress")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("gpt2"), train_tokenizer(), scale=0.05)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "notes.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def smoke(checkpoint, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    result = run_demo("finetune.py", *SMOKE, "--model", str(checkpoint), "--data",
                      str(text_file), "--out", str(out), env_extra={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


def test_the_smoke_run_fine_tunes_reports_and_samples(smoke):
    out, result = smoke
    assert "validation loss before fine-tuning:" in result.stdout
    assert "validation loss after 4 updates:" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert np.isfinite(metrics["val_loss_before"]) and np.isfinite(metrics["val_loss"])
    assert metrics["updates"] == 4
    for name in ("model.npz", "last.npz", "sample.txt", "gpt2/config.json",
                 "gpt2/model.safetensors", "gpt2/tokenizer.json"):
        assert (out / name).is_file(), name


def test_the_textbook_tiers_run_is_one_process_of_plain_numpy(checkpoint, text_file, tmp_path):
    """--tier textbook, as a user starts it: one process, one replica, and no numba, no
    npformer.fast, no mpi4py imported."""
    out, modules = tmp_path / "run", tmp_path / "modules.json"
    result = run_recording_modules(
        "finetune.py", "--smoke", "--tier", "textbook", "--no-progress", "--model",
        str(checkpoint), "--data", str(text_file), "--out", str(out), modules=modules,
        env_extra={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_the_textbook_run(out, modules)


def test_the_fine_tuned_folder_loads_in_transformers_and_npformer(smoke):
    import torch

    from npformer import no_grad

    from .conftest import using_backend
    from .helpers import rel_diff

    out, _ = smoke
    with using_backend("numpy", "float32"):
        ours = tiered.CausalLM.from_pretrained(out / "gpt2")
        theirs = hf_model(out / "gpt2", "float32")
        ids = np.random.default_rng(0).integers(0, ours.config.vocab_size, (2, 10))
        with torch.no_grad():
            expected = theirs(torch.tensor(ids)).logits
        with no_grad():
            assert rel_diff(ours(ids), expected) <= 1e-5


def test_sample_only_samples_from_a_folder(smoke):
    out, _ = smoke
    result = run_demo("finetune.py", "--sample-only", "--model", str(out / "gpt2"),
                      "--prompt", "npformer", "--length", "5", "--out", str(out / "sampled"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("npformer")


def test_a_resumed_run_ends_as_the_uninterrupted_one(smoke, checkpoint, text_file, tmp_path):
    straight, _ = smoke
    args = (*SMOKE, "--model", str(checkpoint), "--data", str(text_file), "--out",
            str(tmp_path))
    stopped = run_demo("finetune.py", *args, "--stop-after", "3")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    resumed = run_demo("finetune.py", "--resume", "--out", str(tmp_path), "--no-progress")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    a, b = (json.loads((out / "metrics.json").read_text()) for out in (straight, tmp_path))
    for key in ("val_loss_before", "val_loss", "updates"):
        assert a[key] == b[key], key
    with np.load(straight / "model.npz") as x, np.load(tmp_path / "model.npz") as y:
        for key in x.files:
            if key != "meta":
                np.testing.assert_array_equal(x[key], y[key], err_msg=key)
    assert (straight / "sample.txt").read_text() == (tmp_path / "sample.txt").read_text()


def other_architecture(checkpoint: Path, folder: Path) -> Path:
    folder.mkdir()
    for path in checkpoint.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((checkpoint / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neo"}))
    return folder


@pytest.mark.parametrize("extra,message", [
    (["--model", "{tmp}/nowhere"], "error: --model {tmp}/nowhere: no folder at"),
    (["--model", "{other}"], "describes a 'gpt_neo' model (model_type)"),
    (["--model", "{gpt2}", "--prompt", "x" * 200], "--prompt holds"),
    (["--model", "{gpt2}", "--block-size", "25"], "--block-size 25 is longer than the "
                                                  "model's context of 24 tokens"),
])
def test_mistakes_are_one_error_line(checkpoint, text_file, tmp_path, extra, message):
    names = {"tmp": str(tmp_path), "gpt2": str(checkpoint),
             "other": str(other_architecture(checkpoint, tmp_path / "other"))}
    extra = [e.format(**names) for e in extra]
    result = run_demo("finetune.py", *SMOKE, "--data", str(text_file), "--out",
                      str(tmp_path / "out"), *extra, env_extra={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert lines[-1].startswith("error: ") and message.format(**names) in lines[-1], lines[-1]
    assert "Traceback" not in result.stderr
    assert not os.path.exists(tmp_path / "out" / "gpt2")


@pytest.mark.parametrize("option,value", [("--top-p", "0"), ("--top-p", "1.5"),
                                          ("--temperature", "0"), ("--max-iters", "0"),
                                          ("--weight-decay", "-1")])
def test_bad_option_values_are_refused_by_the_parser(option, value, tmp_path):
    result = run_demo("finetune.py", "--smoke", "--out", str(tmp_path), option, value)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"argument {option}: expected" in result.stderr and "Traceback" not in result.stderr


def copy_folder(source: Path, folder: Path) -> Path:
    folder.mkdir()
    for path in source.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return folder


def test_resume_refuses_a_changed_model_folder(checkpoint, text_file, tmp_path):
    """issue 47 case 1: a run records what it started from, the --model folder's files
    among them; --resume after its tokenizer.json was replaced by another of the same size
    is refused, naming the file (it ran on without a word)."""
    model = copy_folder(checkpoint, tmp_path / "model")
    out = tmp_path / "out"
    stopped = run_demo("finetune.py", *SMOKE, "--model", str(model), "--data", str(text_file),
                       "--out", str(out), "--stop-after", "2")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[-2:]  # two tokens' ids swapped: same size
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    resumed = run_demo("finetune.py", "--resume", "--out", str(out), "--no-progress")
    assert resumed.returncode == 2, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    last = resumed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "tokenizer.json has changed" in last, last
    assert str(model) in last and "Traceback" not in resumed.stderr


def test_overwrite_removes_the_fine_tuned_folder_too(checkpoint, text_file, tmp_path):
    """issue 47 case 2: --overwrite over a finished run removes everything the run wrote,
    OUT/gpt2 among them (it was left, and --sample-only then sampled the old run)."""
    out = tmp_path / "out"
    args = (*SMOKE, "--model", str(checkpoint), "--data", str(text_file), "--out", str(out))
    assert run_demo("finetune.py", *args).returncode == 0
    assert (out / "gpt2" / "model.safetensors").is_file()
    stopped = run_demo("finetune.py", *args, "--overwrite", "--stop-after", "1")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert not (out / "gpt2").exists() and not (out / "metrics.json").exists()
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["last.npz"]


def test_sample_only_without_model_samples_the_run_in_out(smoke):
    """issue 47 case 23: --sample-only without --model samples the model fine-tuned in
    --out (OUT/gpt2), not the Hub's GPT-2; a folder holding none is one error line."""
    out, _ = smoke
    common = ("--sample-only", "--prompt", "npformer", "--length", "5", "--seed", "3")
    offline = {"HF_HUB_OFFLINE": "1"}
    mine = run_demo("finetune.py", *common, "--out", str(out), env_extra=offline)
    named = run_demo("finetune.py", *common, "--model", str(out / "gpt2"), "--out", str(out),
                     env_extra=offline)
    assert mine.returncode == 0, mine.stderr[-3000:]
    assert mine.stdout == named.stdout and mine.stdout.startswith("npformer")
    empty = run_demo("finetune.py", *common, "--out", str(out / "empty"), env_extra=offline)
    assert empty.returncode == 2 and "Traceback" not in empty.stderr
    last = empty.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --sample-only samples the model fine-tuned in --out"), last
    assert "--model" in last


# --------------------------------------------------------------------------- --lora
LORA = ("--lora", "4", "--lora-alpha", "8", "--lora-targets", "c_attn,c_fc", "--lr", "0.05")


@pytest.fixture(scope="module")
def lora_smoke(checkpoint, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    result = run_demo("finetune.py", *SMOKE, *LORA, "--model", str(checkpoint), "--data",
                      str(text_file), "--out", str(out), env_extra={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


def test_lora_trains_only_the_adapters_and_writes_them_as_peft_does(lora_smoke, checkpoint):
    """issue 49, item 5: --lora R trains the adapters alone (the base weights in model.npz
    are the folder's, bit for bit); OUT/adapter loads in peft on the base model and gives
    the logits of OUT/gpt2 (the adapters merged), which transformers loads."""
    import peft
    import torch

    from npformer.hf import gpt2

    from .conftest import using_backend
    from .helpers import rel_diff

    out, result = lora_smoke
    metrics = json.loads((out / "metrics.json").read_text())
    # two blocks: c_attn's A (16 x 4), shared by q, k, v, and B (4 x 48); c_fc's A (16 x 4)
    # and B (4 x 20)
    assert metrics["trained_parameters"] == 2 * (16 * 4 + 4 * 48 + 16 * 4 + 4 * 20)
    assert "LoRA rank 4 on 4 projections" in result.stdout
    with np.load(out / "model.npz") as saved:
        params = {k.removeprefix("param/"): saved[k] for k in saved.files
                  if k.startswith("param/")}
    assert any(np.any(v) for k, v in params.items() if k.endswith("lora_B"))
    with using_backend("numpy", "float32"):
        base = tiered.CausalLM.from_pretrained(checkpoint)
        for name, value in base.state_dict().items():
            np.testing.assert_array_equal(params[name], value, err_msg=name)
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0,
                                                                            ["c_attn", "c_fc"])
    with_adapter = peft.PeftModel.from_pretrained(hf_model(checkpoint, "float32"),
                                                  out / "adapter").eval()
    merged = hf_model(out / "gpt2", "float32")
    ids = torch.tensor(np.random.default_rng(0).integers(0, 50, (2, 10)))
    with torch.no_grad():
        a, b = with_adapter(ids).logits.numpy(), merged(ids).logits.numpy()
        plain = hf_model(checkpoint, "float32")(ids).logits.numpy()
    assert rel_diff(a, b) <= 1e-5 and rel_diff(a, plain) > 1e-4
    assert gpt2.WEIGHTS_FILE in {p.name for p in (out / "gpt2").iterdir()}


def test_the_lora_run_s_model_npz_builds_with_its_adapters(lora_smoke):
    """issue 57, case 6: build_model of --lora's model.npz failed on "unexpected keys:
    ...lora_A"; it builds the model with its adapters (rank 4, alpha 8, c_attn and c_fc's
    projections), whose logits are those of the adapters merged (OUT/gpt2)."""
    from npformer.checkpoint import build_model, load_checkpoint
    from npformer.nn.lora import lora_layers

    from .conftest import using_backend
    from .helpers import rel_diff

    out, _ = lora_smoke
    with using_backend("numpy", "float32"):
        model = build_model(load_checkpoint(out / "model.npz"))
        adapters = lora_layers(model)
        assert {(a.r, a.alpha) for a in adapters.values()} == {(4, 8.0)}
        assert len(adapters) == 2 * 4  # q, k, v (c_attn) and linear1 (c_fc), two blocks
        ids = np.random.default_rng(0).integers(0, 50, (2, 10))
        merged = tiered.CausalLM.from_pretrained(out / "gpt2")
        assert rel_diff(model(ids), merged(ids)) <= 1e-5


def test_a_resumed_lora_run_ends_as_the_uninterrupted_one(lora_smoke, checkpoint, text_file,
                                                          tmp_path):
    straight, _ = lora_smoke
    args = (*SMOKE, *LORA, "--model", str(checkpoint), "--data", str(text_file), "--out",
            str(tmp_path))
    stopped = run_demo("finetune.py", *args, "--stop-after", "3")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    resumed = run_demo("finetune.py", "--resume", "--out", str(tmp_path), "--no-progress")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    a, b = (json.loads((out / "metrics.json").read_text()) for out in (straight, tmp_path))
    for key in ("val_loss_before", "val_loss", "updates", "trained_parameters"):
        assert a[key] == b[key], key
    with np.load(straight / "model.npz") as x, np.load(tmp_path / "model.npz") as y:
        assert x.files == y.files and any("lora_A" in k for k in x.files)
        for key in x.files:
            if key != "meta":
                np.testing.assert_array_equal(x[key], y[key], err_msg=key)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (straight / "adapter" / name).read_bytes() == \
            (tmp_path / "adapter" / name).read_bytes(), name


def test_lora_targets_that_match_nothing_are_one_error_line(checkpoint, text_file, tmp_path):
    result = run_demo("finetune.py", *SMOKE, "--lora", "2", "--lora-targets", "q_proj",
                      "--model", str(checkpoint), "--data", str(text_file), "--out",
                      str(tmp_path), env_extra={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --lora-targets q_proj: target_modules ['q_proj'] match "
                           "none of the model's projections (transformer.h.0.attn.c_attn"), last
    assert "Traceback" not in result.stderr
