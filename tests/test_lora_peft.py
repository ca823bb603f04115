"""LoRA against PEFT (issue 49, item 4), float64, within 1e-10 (norm-wise relative):

* a torch MLP of nn.Linear layers under PEFT's LoraModel, mirrored by npformer Linears of
  the same names: outputs, the input's gradient and every adapter's A and B gradients;
* GPT-2 through npformer's interop (a tiny folder transformers writes, nothing
  downloads): PEFT's ``c_attn`` (q, k, v fused) is npformer's q_proj, k_proj and v_proj
  with one A shared; logits and every adapter gradient match, on ``c_attn``, ``c_proj``
  and ``c_fc`` together;
* the files both ways: PEFT loads the adapter_model.safetensors and adapter_config.json
  npformer writes (the outputs above are PEFT's on those files), and npformer loads what
  PEFT's save_pretrained writes (then the outputs and gradients match again);
* a config npformer does not compute (rsLoRA, DoRA, rank patterns, trained biases) and
  a file of another model's modules are refused, naming the key.
"""
from __future__ import annotations

import json

import numpy as np
import peft
import pytest
import torch

from npformer import backend, nn
from npformer.interop import peft as npeft
from npformer.nn.lora import lora_layers

from .conftest import using_backend
from .helpers import rel_diff, to_host
from .test_gpt2 import hf_model, train_tokenizer, write_folder

RTOL = 1e-10
D_IN, HIDDEN, D_OUT, R, ALPHA = 6, 9, 5, 3, 7.0


# =========================================================================== the MLP
class TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, D_OUT)

    def forward(self, x):
        gelu = torch.nn.functional.gelu
        return self.head(gelu(self.fc2(gelu(self.fc1(x)))))


class MLP(nn.Module):
    """TorchMLP on npformer's Linears, the same names."""

    def __init__(self):
        self.fc1, self.act1 = nn.Linear(D_IN, HIDDEN), nn.Activation("gelu")
        self.fc2, self.act2 = nn.Linear(HIDDEN, HIDDEN), nn.Activation("gelu")
        self.head = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x):
        return self.head(self.act2(self.fc2(self.act1(self.fc1(x)))))

    def backward(self, dy):
        return self.fc1.backward(self.act1.backward(self.fc2.backward(
            self.act2.backward(self.head.backward(dy)))))


def mirrored_mlps():
    """(torch MLP in float64, npformer MLP with its weights)."""
    torch.manual_seed(0)
    theirs = TorchMLP().double()
    ours = MLP()
    for name, module in theirs.named_children():
        getattr(ours, name).weight.data = backend.asarray(module.weight.detach().numpy().T)
        getattr(ours, name).bias.data = backend.asarray(module.bias.detach().numpy())
    return theirs, ours


def randomize_adapters(model, seed: int = 1) -> None:
    """A and B random (B at zero would hide A's gradient)."""
    rng = np.random.default_rng(seed)
    for layer in lora_layers(model).values():
        layer.lora_A.data = backend.asarray(rng.standard_normal(layer.lora_A.shape) * 0.5)
        layer.lora_B.data = backend.asarray(rng.standard_normal(layer.lora_B.shape) * 0.5)


def peft_gradients(peft_model) -> dict[str, np.ndarray]:
    """{PEFT key: gradient} of every adapter weight (the adapter's name taken out)."""
    return {"base_model.model." + name.replace(".default", "").removeprefix(
        "base_model.model."): p.grad.numpy() for name, p in peft_model.named_parameters()
        if "lora_" in name}


def our_gradients(model, naming) -> dict[str, np.ndarray]:
    """Our adapter gradients as PEFT's arrays: saved as the weights are saved."""
    saved = {}
    for layer in lora_layers(model).values():
        saved[id(layer)] = (layer.lora_A.data, layer.lora_B.data)
        layer.lora_A.data, layer.lora_B.data = layer.lora_A.grad, layer.lora_B.grad
    try:
        return npeft.adapter_arrays(model, naming)
    finally:
        for layer in lora_layers(model).values():
            layer.lora_A.data, layer.lora_B.data = saved[id(layer)]


def assert_outputs_and_gradients_match(ours, theirs, naming, x, upstream, out=None):
    """Forward both, pull ``upstream`` back through both; compare."""
    x_torch = torch.tensor(x, requires_grad=True)
    expected = theirs(x_torch)
    (expected * torch.tensor(upstream)).sum().backward()
    got = ours(backend.asarray(x))
    assert rel_diff(to_host(got), expected.detach().numpy()) <= RTOL
    dx = ours.backward(backend.asarray(upstream))
    assert rel_diff(to_host(dx), x_torch.grad.numpy()) <= RTOL
    mine, peft_grads = our_gradients(ours, naming), peft_gradients(theirs)
    assert set(mine) == set(peft_grads) and mine
    for key, grad in peft_grads.items():
        assert rel_diff(mine[key], grad) <= RTOL, key


def test_a_linear_stack_matches_peft_and_peft_loads_our_files(tmp_path):
    with using_backend("numpy", "float64"):
        theirs, ours = mirrored_mlps()
        naming = npeft.same_names(ours)
        chosen = npeft.apply_adapters(ours, naming, ["fc1", "head"], R, ALPHA)
        assert chosen == ["fc1", "head"]
        randomize_adapters(ours)
        npeft.save_adapter(ours, tmp_path, naming)
        theirs = peft.PeftModel.from_pretrained(theirs, tmp_path, is_trainable=True)
        assert theirs.peft_config["default"].r == R
        rng = np.random.default_rng(2)
        assert_outputs_and_gradients_match(ours, theirs, naming,
                                           rng.standard_normal((4, 3, D_IN)),
                                           rng.standard_normal((4, 3, D_OUT)))


def test_we_load_what_peft_saves_and_match_it(tmp_path):
    with using_backend("numpy", "float64"):
        theirs, ours = mirrored_mlps()
        config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["fc2", "head"])
        theirs = peft.get_peft_model(theirs, config)
        with torch.no_grad():  # B random: at zero it would hide A's gradient
            for name, p in theirs.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.5)
        theirs.save_pretrained(tmp_path)
        names = npeft.load_adapter(ours, tmp_path, npeft.same_names(ours))
        assert sorted(names) == ["fc2", "head"]
        assert sorted(lora_layers(ours)) == ["fc2", "head"]
        rng = np.random.default_rng(3)
        assert_outputs_and_gradients_match(ours, theirs, npeft.same_names(ours),
                                           rng.standard_normal((2, D_IN)),
                                           rng.standard_normal((2, D_OUT)))


# =========================================================================== GPT-2
@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("gpt2"), train_tokenizer(), scale=0.3)


class Logits(torch.nn.Module):
    """A causal LM's logits as one tensor (what the comparison pulls back through)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


def lm_adapter_gradients(ours, theirs, naming, seed: int = 4) -> tuple[dict, dict]:
    """Both language models' logits of the same ids, compared; then ours and PEFT's
    adapter gradients of the same random upstream gradient, as {PEFT key: array} each."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, ours.config.vocab_size, (2, 7))
    logits = Logits(theirs)(torch.tensor(ids))
    upstream = rng.standard_normal(tuple(logits.shape))
    (logits * torch.tensor(upstream)).sum().backward()
    got = ours(backend.asarray(ids))
    assert rel_diff(to_host(got), logits.detach().numpy()) <= RTOL
    ours.backward(backend.asarray(upstream))
    return our_gradients(ours, naming), peft_gradients(theirs)


def test_gpt2_adapters_on_c_attn_c_proj_c_fc_match_peft(gpt2_folder, tmp_path):
    from npformer.models import CausalLM

    with using_backend("numpy", "float64"):
        ours = CausalLM.from_pretrained(gpt2_folder, dtype="float64")
        naming = npeft.gpt2_names(ours.config)
        chosen = npeft.apply_adapters(ours, naming, ["c_attn", "c_proj", "c_fc"], R, ALPHA)
        assert len(chosen) == 2 * 4  # every projection of both blocks (c_proj: both)
        q = lora_layers(ours)["blocks.0.self_attn.q_proj"]
        assert lora_layers(ours)["blocks.0.self_attn.v_proj"].lora_A is q.lora_A
        randomize_adapters(ours)
        npeft.save_adapter(ours, tmp_path, naming)
        config = json.loads((tmp_path / npeft.CONFIG_FILE).read_text())
        assert config["target_modules"] == ["c_attn", "c_fc", "c_proj"]
        theirs = peft.PeftModel.from_pretrained(hf_model(gpt2_folder), tmp_path,
                                                is_trainable=True)
        mine, expected = lm_adapter_gradients(ours, theirs, naming)
        assert set(mine) == set(expected) and len(mine) == 16
        for key, grad in expected.items():
            assert rel_diff(mine[key], grad) <= RTOL, key


def test_gpt2_loads_what_peft_saves(gpt2_folder, tmp_path):
    from npformer.models import CausalLM

    with using_backend("numpy", "float64"):
        config = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["c_attn"],
                                 fan_in_fan_out=True)
        theirs = peft.get_peft_model(hf_model(gpt2_folder), config)
        with torch.no_grad():
            for name, p in theirs.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.5)
        theirs.save_pretrained(tmp_path)
        ours = CausalLM.from_pretrained(gpt2_folder, dtype="float64")
        npeft.load_adapter(ours, tmp_path, npeft.gpt2_names(ours.config))
        ids = np.random.default_rng(5).integers(0, ours.config.vocab_size, (2, 6))
        with torch.no_grad():
            expected = theirs(torch.tensor(ids)).logits.numpy()
        assert rel_diff(to_host(ours(backend.asarray(ids))), expected) <= RTOL


# =========================================================================== refusals
@pytest.mark.parametrize("key, value", [("use_rslora", True), ("use_dora", True),
                                        ("rank_pattern", {"fc1": 4}), ("bias", "all"),
                                        ("peft_type", "IA3")])
def test_a_config_npformer_does_not_compute_is_refused_naming_it(tmp_path, key, value):
    with using_backend("numpy", "float64"):
        _, ours = mirrored_mlps()
        naming = npeft.same_names(ours)
        npeft.apply_adapters(ours, naming, ["fc1"], 2)
        npeft.save_adapter(ours, tmp_path, naming)
        path = tmp_path / npeft.CONFIG_FILE
        config = json.loads(path.read_text())
        config[key] = value
        path.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=key):
            npeft.load_adapter(mirrored_mlps()[1], tmp_path, naming)


def test_another_models_adapter_is_refused_naming_its_modules(tmp_path):
    with using_backend("numpy", "float64"):
        _, ours = mirrored_mlps()
        naming = npeft.same_names(ours)
        npeft.apply_adapters(ours, naming, ["fc1"], 2)
        npeft.save_adapter(ours, tmp_path, naming)
        other = npeft.Naming((("encoder.fc1", ("fc1",)),))
        with pytest.raises(ValueError, match=r"adapts \['fc1'\], which the model does not"):
            npeft.load_adapter(mirrored_mlps()[1], tmp_path, other)


def test_target_modules_name_exactly_the_adapted_modules(tmp_path):
    """PEFT's target_modules choose by a name's end: "c_proj" would put adapters on both
    GPT-2's attn.c_proj and mlp.c_proj, so adapters on one of them are named in full."""
    from npformer.models import CausalLM, CausalLMConfig

    with using_backend("numpy", "float64"):
        model = CausalLM(CausalLMConfig(vocab_size=11, block_size=6, d_model=8, num_heads=2,
                                        num_layers=2, d_ff=12))
        naming = npeft.gpt2_names(model.config)
        npeft.apply_adapters(model, naming, ["attn.c_proj", "c_fc"], 2)
        config = npeft.adapter_config(model, naming)
        assert config["target_modules"] == ["transformer.h.0.attn.c_proj",
                                            "transformer.h.0.mlp.c_fc",
                                            "transformer.h.1.attn.c_proj",
                                            "transformer.h.1.mlp.c_fc"]
        assert [name for name, _ in naming.chosen(config["target_modules"])] == [
            f"transformer.h.{i}.{m}" for i in (0, 1) for m in ("attn.c_proj", "mlp.c_fc")]
