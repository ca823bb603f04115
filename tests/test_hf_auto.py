"""One way to load and one way to save, for every family in either tier (issue 58, item 1).

Each family's class loads its folders (``CausalLM.from_pretrained(folder)``,
``LlamaCausalLM.from_pretrained(folder)``) and the class named is the class built: the fast
tier's class gives the fast tier's model.  ``model.save_pretrained(folder)`` writes a
folder its class loads again, weight for weight.  ``npformer.interop.auto`` reads a
folder's ``model_type`` (gpt2, llama, qwen2, qwen3) and gives the class of the tier asked,
as transformers' ``AutoModelForCausalLM`` does; another family is refused naming the
known ones.  ``Tokenizer.from_pretrained(folder)`` reads the tokenizer of every family.
The folders are tiny ones transformers builds with random weights, without the network.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from npformer import fast, models
from npformer.hf import gpt2
from npformer.hf.gpt2 import PretrainedError, Tokenizer
from npformer.interop import auto

from .conftest import require_torch, using_backend
from .helpers import raises_naming, to_host
from .test_hf_llama import FOLDERS, build

FAMILY_OF = {name: family for name, (family, _) in FOLDERS.items()}
LLAMA_FOLDERS = {"llama": "llama_bias_tied", "qwen2": "qwen2_untied", "qwen3": "qwen3_tied"}
CLASS_OF = {"gpt2": "CausalLM", "llama": "LlamaCausalLM", "qwen2": "LlamaCausalLM",
            "qwen3": "LlamaCausalLM"}
TIERS = {"textbook": models, "fast": fast}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{model_type: a folder of that family, with a tokenizer.json}."""
    from .test_gpt2 import train_tokenizer, write_folder

    torch = require_torch()
    root = tmp_path_factory.mktemp("families")
    tokenizer = train_tokenizer()
    found = {"gpt2": write_folder(root / "gpt2", tokenizer)}
    from tokenizers import Tokenizer as Tokenizers
    from tokenizers import models as tokenizer_models
    from tokenizers import pre_tokenizers

    inner = Tokenizers(tokenizer_models.WordLevel(
        {w: i for i, w in enumerate(["<pad>", "the", "cat", "sat", "on", "mat", "a", "dog",
                                      "ran", "to", "it", "</s>", "."])}, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    for family, name in LLAMA_FOLDERS.items():
        _, folder = build(torch, root, name)
        inner.save(str(folder / gpt2.TOKENIZER_FILE))
        found[family] = folder
    return found


def weights(model) -> dict[str, np.ndarray]:
    return {name: to_host(value) for name, value in model.state_dict().items()}


@pytest.mark.parametrize("family", list(CLASS_OF))
@pytest.mark.parametrize("tier", list(TIERS))
def test_each_class_loads_and_saves_its_family_in_its_tier(folders, family, tier, tmp_path):
    """X.from_pretrained(folder) is an X (the fast class: the fast model), auto's entry
    gives the same class and weights, and save_pretrained writes a folder X loads again."""
    cls = getattr(TIERS[tier], CLASS_OF[family])
    with using_backend("numpy", "float64"):
        model = cls.from_pretrained(folders[family])
        assert type(model) is cls
        auto_model = auto.from_pretrained(folders[family], tier=tier)
        assert type(auto_model) is cls and auto.model_class(family, tier) is cls
        expected = weights(model)
        assert weights(auto_model).keys() == expected.keys()
        assert all(np.array_equal(weights(auto_model)[k], v) for k, v in expected.items())
        saved = model.save_pretrained(tmp_path / "saved")
        assert json.loads((saved / gpt2.CONFIG_FILE).read_text())["model_type"] == family
        again = cls.from_pretrained(saved)
        assert type(again) is cls
        assert all(np.array_equal(weights(again)[k], v) for k, v in expected.items())


@pytest.mark.parametrize("family", list(CLASS_OF))
def test_load_gives_the_model_and_the_tokenizer_of_every_family(folders, family):
    with using_backend("numpy", "float64"):
        model, tokenizer = auto.load(folders[family], tier="textbook")
    assert type(model) is getattr(models, CLASS_OF[family])
    alone = Tokenizer.from_pretrained(folders[family])
    assert (alone.eos_id, alone.vocab_size) == (tokenizer.eos_id, tokenizer.vocab_size)
    assert tokenizer.vocab_size <= model.config.vocab_size


def test_a_family_not_known_is_refused_naming_the_known_ones(folders, tmp_path):
    folder = tmp_path / "mistral"
    folder.mkdir()
    values = json.loads((folders["llama"] / gpt2.CONFIG_FILE).read_text())
    (folder / gpt2.CONFIG_FILE).write_text(json.dumps({**values, "model_type": "mistral"}))
    with raises_naming(PretrainedError, "'mistral'", "gpt2, llama, qwen2, qwen3"):
        auto.from_pretrained(folder)
    with raises_naming(PretrainedError, "'mistral'", "gpt2, llama, qwen2, qwen3"):
        auto.model_class("mistral", "fast")
    with raises_naming(PretrainedError, "has no config.json"):
        auto.from_pretrained(tmp_path)
    with raises_naming(ValueError, "tier", "'gpu'"):
        auto.from_pretrained(folders["gpt2"], tier="gpu")


def test_a_class_refuses_another_family_s_folder(folders):
    """A family's class reads its own folders: another's is refused naming its
    model_type (the auto entry picks the class)."""
    with raises_naming(PretrainedError, "'gpt2'", "model_type"):
        models.LlamaCausalLM.from_pretrained(folders["gpt2"])
    with raises_naming(PretrainedError, "qwen3"):
        fast.CausalLM.from_pretrained(folders["qwen3"])
