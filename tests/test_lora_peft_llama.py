"""LoRA on Llama and Qwen against PEFT (issue 49, items 4 and 5), float64, within 1e-10
(norm-wise relative), on tiny folders transformers writes (nothing downloads).

npformer's Llama names are Hugging Face's less ``model.`` (:func:`npformer.interop.peft.
llama_names`): PEFT's ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``
is npformer's ``layers.N.self_attn.q_proj`` adapter.  Both directions, on every projection
(q, k, v, o, gate, up, down):

* PEFT loads the adapter files npformer writes, on the base folder: logits and every
  adapter's gradients match;
* npformer loads what PEFT's save_pretrained writes: the logits match.
"""
from __future__ import annotations

import json

import numpy as np
import peft
import pytest

from npformer import backend
from npformer.hf import llama as hf_llama
from npformer.interop import peft as npeft
from npformer.models import LlamaCausalLM
from npformer.nn.lora import lora_layers

from .conftest import using_backend
from .helpers import rel_diff, tiny_llama, to_host
from .llama_reference import float64_reference
from .test_hf_llama import build
from .test_lora_peft import lm_adapter_gradients, randomize_adapters

RTOL = 1e-10
R, ALPHA = 3, 7.0
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES = ["llama_gqa_llama3_untied", "qwen3_tied"]


def test_llama_names_are_hugging_faces_less_model():
    from npformer.models.llama import LlamaConfig

    naming = npeft.llama_names(LlamaConfig(vocab_size=5, num_layers=2))
    assert len(naming.modules) == 2 * 7 + 1 and not naming.fan_in_fan_out
    assert naming.modules[0] == ("model.layers.0.self_attn.q_proj",
                                 ("blocks.0.self_attn.q_proj",))
    assert naming.modules[-2] == ("model.layers.1.mlp.down_proj", ("blocks.1.ffn.down_proj",))
    # issue 57 case 7: the token table (PEFT's lora_embedding_A / _B), and lm_head untied
    assert naming.modules[-1] == ("model.embed_tokens", ("embed",))
    untied = npeft.llama_names(LlamaConfig(vocab_size=5, tie_weights=False))
    assert untied.modules[-1] == ("lm_head", ("lm_head",))


@pytest.mark.parametrize("name", NAMES)
def test_peft_loads_our_llama_adapters_and_matches_them(torch, tmp_path, name):
    theirs, folder = build(torch, tmp_path, name)
    with using_backend("numpy", "float64"), float64_reference():
        ours = LlamaCausalLM.from_pretrained(folder, dtype="float64")
        naming = npeft.llama_names(ours.config)
        chosen = npeft.apply_adapters(ours, naming, ALL, R, ALPHA)
        assert len(chosen) == 2 * 7
        randomize_adapters(ours)
        npeft.save_adapter(ours, tmp_path / "adapter", naming)
        config = json.loads((tmp_path / "adapter" / npeft.CONFIG_FILE).read_text())
        assert config["target_modules"] == sorted(ALL) and config["fan_in_fan_out"] is False
        theirs = peft.PeftModel.from_pretrained(theirs, tmp_path / "adapter", is_trainable=True)
        mine, expected = lm_adapter_gradients(ours, theirs, naming)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in expected
    assert set(mine) == set(expected) and len(mine) == 2 * 2 * 7
    for key, grad in expected.items():
        assert rel_diff(mine[key], grad) <= RTOL, key


@pytest.mark.parametrize("name", NAMES)
def test_we_load_llama_adapters_peft_saves(torch, tmp_path, name):
    theirs, folder = build(torch, tmp_path, name)
    with using_backend("numpy", "float64"), float64_reference():
        config = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["k_proj", "o_proj",
                                                                    "up_proj"])
        theirs = peft.get_peft_model(theirs, config)
        with torch.no_grad():
            for key, p in theirs.named_parameters():
                if "lora_B" in key:
                    p.normal_(0.0, 0.5)
        theirs.save_pretrained(tmp_path / "adapter")
        ours = LlamaCausalLM.from_pretrained(folder, dtype="float64")
        names = npeft.load_adapter(ours, tmp_path / "adapter", npeft.llama_names(ours.config))
        assert sorted(lora_layers(ours)) == sorted(hf_llama.npformer_name(n) for n in names)
        assert len(names) == 2 * 3
        ids = np.random.default_rng(5).integers(0, ours.config.vocab_size, (2, 6))
        with torch.no_grad():
            expected = theirs(torch.tensor(ids)).logits.numpy()
            with theirs.disable_adapter():
                plain = theirs(torch.tensor(ids)).logits.numpy()
        got = to_host(ours(backend.asarray(ids)))
    assert rel_diff(got, expected) <= RTOL and rel_diff(got, plain) > 1e-3


# =========================================================================== sweep 5
def saved_adapter(folder, edit=None):
    """A folder of q_proj and v_proj adapters on a one-layer model, its config edited."""
    model = tiny_llama()
    naming = npeft.llama_names(model.config)
    npeft.apply_adapters(model, naming, ["q_proj", "v_proj"], 2, 4.0)
    npeft.save_adapter(model, folder, naming)
    if edit:
        path = folder / npeft.CONFIG_FILE
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("key, value, message", [
    ("r", 2.5, r"r \(the LoRA rank\) must be an integer, got 2.5"),
    ("r", "2", r"r \(the LoRA rank\) must be an integer, got '2'"),
    ("lora_alpha", "x", r"alpha \(lora_alpha\) must be a real number"),
    ("lora_alpha", None, "lora_alpha is null"),
    ("lora_dropout", "0.1", "dropout probability must be a number")])
def test_an_adapter_config_value_of_the_wrong_kind_is_refused_naming_the_file(
        tmp_path, key, value, message):
    """sweep 5: r 2.5 was cut to 2 (and "2" parsed) by int(), alpha "x" failed inside
    float(), dropout "0.1" was parsed: each is now refused by kind, with the file."""
    folder = saved_adapter(tmp_path, lambda config: config.update({key: value}))
    with pytest.raises(ValueError, match=f"{npeft.CONFIG_FILE}: {message}"):
        npeft.load_adapter(tiny_llama(), folder, npeft.llama_names(tiny_llama().config))


def test_an_adapter_whose_target_modules_are_not_its_weights_is_refused(tmp_path):
    """sweep 5: target_modules were not read: a folder saying k_proj while holding q_proj
    and v_proj loaded, and a one-layer model's adapter loaded into a two-layer model (its
    second layer left without the adapters PEFT would put there).  Refused, naming both."""
    folder = saved_adapter(tmp_path / "k", lambda config: config.update(
        target_modules=["k_proj"]))
    with pytest.raises(ValueError, match=r"target_modules \['k_proj'\] do not choose the "
                                         r"modules .* chosen without weights: "
                                         r"\['model.layers.0.self_attn.k_proj'\]; weights "
                                         r"not chosen: \['model.layers.0.self_attn.q_proj'"):
        npeft.load_adapter(tiny_llama(), folder, npeft.llama_names(tiny_llama().config))
    two = tiny_llama(num_layers=2)
    with pytest.raises(ValueError, match=r"chosen without weights: "
                                         r"\['model.layers.1.self_attn.q_proj'"):
        npeft.load_adapter(two, saved_adapter(tmp_path / "one"), npeft.llama_names(two.config))
    assert not lora_layers(two)
    excluding = saved_adapter(tmp_path / "excluding", lambda config: config.update(
        exclude_modules=["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]))
    assert npeft.load_adapter(two, excluding, npeft.llama_names(two.config)) == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]  # PEFT's choice


def test_adapter_weights_that_are_not_finite_floats_are_refused_naming_the_tensor(tmp_path):
    """sweep 5: NaN adapters loaded (the model then predicts NaN), integer ones were cast;
    each is refused as a model's weights are, naming the tensor."""
    from safetensors.numpy import load_file, save_file

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    for bad, message in ((np.nan, "NaN or infinite"), (None, "int32 values")):
        folder = saved_adapter(tmp_path / str(bad))
        path = folder / npeft.WEIGHTS_FILE
        arrays = load_file(str(path))
        arrays[key] = np.full_like(arrays[key], bad) if bad is not None else \
            arrays[key].astype(np.int32)
        save_file(arrays, str(path))
        with pytest.raises((ValueError, TypeError), match=f"{key} holds .*{message}"):
            npeft.load_adapter(tiny_llama(), folder, npeft.llama_names(tiny_llama().config))


def test_a_misspelt_target_module_is_refused_among_good_ones():
    """sweep 5: apply_adapters (finetune.py's --lora-targets) dropped a name that chose
    nothing when another did."""
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"target_modules \['vproj'\] match none of the "
                                         r"model's projections"):
        npeft.apply_adapters(model, npeft.llama_names(model.config), ["q_proj", "vproj"], 2)


def test_saving_adapters_refuses_bad_folders_before_writing_and_writes_whole(
        tmp_path, monkeypatch):
    """sweep 5: save_adapter("") wrote into the current folder, a file's path gave
    FileExistsError from mkdir, a model without adapters left an empty folder behind, and
    the files were written in place: a save stopped midway left a half-written file over
    the user's.  Paths are checked first, and each file replaces the old one whole."""
    model = tiny_llama()
    naming = npeft.llama_names(model.config)
    with pytest.raises(ValueError, match="holds no LoRA adapters to save"):
        npeft.save_adapter(model, tmp_path / "none", naming)
    assert not (tmp_path / "none").exists()
    npeft.apply_adapters(model, naming, ["q_proj"], 2)
    with pytest.raises(ValueError, match="folder must be a path, got the empty name"):
        npeft.save_adapter(model, "", naming)
    (tmp_path / "file").write_text("mine")
    with pytest.raises(NotADirectoryError, match=r"file is a file, not a folder"):
        npeft.save_adapter(model, tmp_path / "file" / "adapter", naming)
    folder = npeft.save_adapter(model, tmp_path / "adapter", naming)
    before = (folder / npeft.WEIGHTS_FILE).read_bytes()

    def stopped(arrays, path, metadata=None):
        with open(path, "wb") as handle:
            handle.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr("safetensors.numpy.save_file", stopped)
    with pytest.raises(KeyboardInterrupt):
        npeft.save_adapter(model, folder, naming)
    assert (folder / npeft.WEIGHTS_FILE).read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == [npeft.CONFIG_FILE, npeft.WEIGHTS_FILE]


def test_saving_an_adapter_the_naming_does_not_cover_is_refused(tmp_path):
    """sweep 5: an adapter on a layer the naming leaves out (an untied lm_head, before
    llama_names named it: issue 57 case 7) was left out of adapter_model.safetensors,
    silently."""
    from npformer.nn.lora import apply_lora

    model = tiny_llama(tie_weights=False)
    apply_lora(model, ["q_proj", "lm_head"], 2)
    naming = npeft.llama_names(model.config)
    without_head = npeft.Naming(tuple(m for m in naming.modules if m[0] != "lm_head"))
    with pytest.raises(ValueError, match=r"adapters on \['lm_head'\], which PEFT's names of "
                                         "this model do not cover"):
        npeft.save_adapter(model, tmp_path / "adapter", without_head)
    assert not (tmp_path / "adapter").exists()


def test_a_naming_of_another_models_config_is_refused_naming_the_class():
    """sweep 5: llama_names(a CausalLMConfig or the model itself), gpt2_names(a
    LlamaConfig) failed with AttributeError ('... has no attribute num_layers')."""
    from npformer.models import CausalLMConfig, LlamaCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=5)
    for function, wrong, wanted in ((npeft.llama_names, CausalLMConfig(vocab_size=5),
                                     "LlamaConfig"),
                                    (npeft.llama_names, LlamaCausalLM(config), "LlamaConfig"),
                                    (npeft.gpt2_names, config, "CausalLMConfig")):
        with pytest.raises(TypeError, match=f"takes a {wanted} \\(the model's .config\\), "
                                            f"got {type(wrong).__name__}"):
            function(wrong)
