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
from npformer.interop import hf_llama
from npformer.interop import peft as npeft
from npformer.nn.lora import lora_layers

from .conftest import using_backend
from .helpers import rel_diff, to_host
from .llama_reference import float64_reference
from .test_hf_llama import build
from .test_lora_peft import lm_adapter_gradients, randomize_adapters

RTOL = 1e-10
R, ALPHA = 3, 7.0
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES = ["llama_gqa_llama3_untied", "qwen3_tied"]


def test_llama_names_are_hugging_faces_less_model():
    from npformer.models.llama import LlamaConfig

    naming = npeft.llama_names(LlamaConfig(vocab_size=5, num_hidden_layers=2))
    assert len(naming.modules) == 2 * 7 and not naming.fan_in_fan_out
    assert naming.modules[0] == ("model.layers.0.self_attn.q_proj",
                                 ("layers.0.self_attn.q_proj",))
    assert naming.modules[-1] == ("model.layers.1.mlp.down_proj", ("layers.1.mlp.down_proj",))


@pytest.mark.parametrize("name", NAMES)
def test_peft_loads_our_llama_adapters_and_matches_them(torch, tmp_path, name):
    theirs, folder = build(torch, tmp_path, name)
    with using_backend("numpy", "float64"), float64_reference():
        ours = hf_llama.from_pretrained(folder, dtype="float64")
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
        ours = hf_llama.from_pretrained(folder, dtype="float64")
        names = npeft.load_adapter(ours, tmp_path / "adapter", npeft.llama_names(ours.config))
        assert sorted(lora_layers(ours)) == sorted(n.removeprefix("model.") for n in names)
        assert len(names) == 2 * 3
        ids = np.random.default_rng(5).integers(0, ours.config.vocab_size, (2, 6))
        with torch.no_grad():
            expected = theirs(torch.tensor(ids)).logits.numpy()
            with theirs.disable_adapter():
                plain = theirs(torch.tensor(ids)).logits.numpy()
        got = to_host(ours(backend.asarray(ids)))
    assert rel_diff(got, expected) <= RTOL and rel_diff(got, plain) > 1e-3
