"""config.json read as transformers reads it (issue 57): the rotary fields in transformers'
order of priority, an eos_token_id list, each family's defaults and activation names, the
fields' types, and the class a pytorch_model.bin is converted with.

Each folder is written by transformers (a tiny model, random weights), edited, then loaded
by both sides: where transformers loads it, npformer gives its logits; where transformers
cannot run it, npformer refuses it naming the field.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from npformer import backend
from npformer.decoding import generate
from npformer.hf import gpt2
from npformer.hf import llama as hf_llama
from npformer.hf.gpt2 import PretrainedError
from npformer.interop import auto
from npformer.models import LlamaCausalLM, LlamaConfig

from .conftest import using_backend
from .helpers import raises_naming, to_host

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
SIZES = dict(vocab_size=13, hidden_size=16, intermediate_size=14, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64)
IDS = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4,
                 3, 3, 8, 3, 2, 7, 9, 5]])


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def hf_config_class(family):
    import transformers

    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
            "qwen3": transformers.Qwen3Config}[family]


def build(torch, tmp_path, family="llama", name="model", **fields):
    """transformers' ``family`` model (SIZES and ``fields``), weights drawn large enough
    that the rotary positions move the logits, saved in float64 at tmp_path / name."""
    from transformers import AutoModelForCausalLM

    config = hf_config_class(family)(**{**SIZES, "num_key_value_heads": 2, **fields})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.ndim > 1 else 0.3).add_(1.0 if p.ndim == 1 else 0.0)
    folder = tmp_path / name
    model.save_pretrained(folder)
    return folder


def edit(folder, drop=(), **changes):
    """config.json of ``folder`` with the keys ``drop`` removed and ``changes`` set."""
    path = folder / "config.json"
    values = json.loads(path.read_text())
    for key in drop:
        values.pop(key, None)
    values.update(changes)
    path.write_text(json.dumps(values))
    return folder


def theirs(torch, folder):
    """transformers' logits of IDS for the folder (float64 weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def ours(folder):
    with using_backend("numpy", "float64"):
        model = LlamaCausalLM.from_pretrained(folder)
        model.eval()
        return to_host(model(backend.asarray(IDS)))


def assert_same_logits(torch, folder):
    """npformer's logits are transformers' (to transformers' float32 rotary tables)."""
    expected, got = theirs(torch, folder), ours(folder)
    error = np.abs(got - expected).max() / np.abs(expected).max()
    assert error < 1e-5, f"npformer's logits differ from transformers' by {error:.2%}"


# =========================================================================== case 1: rope
@pytest.mark.parametrize("changes", [
    # the issue's case: rope_parameters' theta before the top-level one
    dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
         rope_theta=10000.0),
    # the case: a rope_scaling (llama3) replaces rope_parameters (default) whole
    dict(rope_parameters={"rope_type": "default"}, rope_scaling=LLAMA3),
    # ... its theta too: the replaced rope_parameters' theta is not read, the top-level is
    dict(rope_parameters={"rope_type": "default", "rope_theta": 5.0},
         rope_scaling={**LLAMA3, "rope_type": "default"}, rope_theta=50.0),
    # ... or, without one, transformers' default 10000
    dict(rope_parameters={"rope_type": "default", "rope_theta": 5.0},
         rope_scaling={**LLAMA3, "rope_type": "default"}),
    # rope_type before the older type
    dict(rope_parameters={**LLAMA3, "type": "default", "rope_theta": 30.0}),
    dict(rope_parameters={**{k: v for k, v in LLAMA3.items() if k != "rope_type"},
                          "type": "llama3", "rope_theta": 30.0}),
    # original_max_position_embeddings: the top-level one overrides the parameters'
    dict(rope_parameters={**LLAMA3, "rope_theta": 30.0}, original_max_position_embeddings=4),
    # ... and is max_position_embeddings where neither gives it
    dict(rope_parameters={k: v for k, v in LLAMA3.items()
                          if k != "original_max_position_embeddings"}),
    # an empty rope_scaling is none: rope_parameters is read
    dict(rope_scaling={}, rope_parameters={"rope_type": "default", "rope_theta": 40.0}),
    # the default rotation ignores partial_rotary_factor (transformers rotates all of it)
    dict(rope_parameters={"rope_type": "default", "rope_theta": 40.0,
                          "partial_rotary_factor": 0.5}),
])
def test_rope_fields_are_read_in_transformers_order(torch, tmp_path, changes):
    """issue 57 case 1: rope_parameters.rope_theta 500000 beside rope_theta 10000 loaded
    with 10000 (transformers: 500000; the logits differed by 26%), a llama3 rope_scaling
    beside a default rope_parameters was dropped; each rope field is now taken where
    transformers takes it, and the logits are transformers'."""
    folder = edit(build(torch, tmp_path), drop=("rope_parameters", "rope_scaling",
                                                "rope_theta"), **changes)
    assert_same_logits(torch, folder)


def test_rope_without_top_level_theta_and_qwen_defaults(torch, tmp_path):
    """Where no field sets the base, it is transformers' default 10000; Qwen's rope_scaling
    beside rope_parameters follows the same order."""
    folder = edit(build(torch, tmp_path, "qwen2"), drop=("rope_theta",),
                  rope_parameters={"rope_type": "default", "rope_theta": 7.0},
                  rope_scaling={**LLAMA3})
    assert_same_logits(torch, folder)


@pytest.mark.parametrize("changes, fragments", [
    (dict(rope_parameters={**LLAMA3, "partial_rotary_factor": 0.5}),
     ["partial_rotary_factor = 0.5", "llama3"]),
    (dict(rope_parameters=LLAMA3, partial_rotary_factor=0.5),
     ["partial_rotary_factor = 0.5", "llama3"]),
    (dict(rope_parameters={k: v for k, v in LLAMA3.items() if k != "factor"}),
     ["rope_parameters", "no factor"]),
    (dict(rope_parameters={"rope_type": 3}), ["rope_parameters.rope_type = 3", "string"]),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}),
     ["rope_parameters.rope_theta = '1e4'", "a number"]),
    (dict(rope_parameters=None, rope_theta=None), ["rope_theta = None", "a number"]),
    (dict(rope_scaling="llama3"), ["rope_scaling must be an object", "'llama3'"]),
])
def test_rope_fields_transformers_cannot_run_are_refused_by_name(torch, tmp_path, changes,
                                                                  fragments):
    folder = edit(build(torch, tmp_path), drop=("rope_parameters", "rope_scaling"),
                  **changes)
    with raises_naming(PretrainedError, "config.json", *fragments):
        LlamaCausalLM.from_pretrained(folder)


# =========================================================================== case 2: eos
def word_tokenizer(folder, words=13):
    from tokenizers import Tokenizer, models, pre_tokenizers

    inner = Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.save(str(folder / "tokenizer.json"))


def test_an_eos_token_id_list_is_kept_whole_and_every_id_ends_a_row(torch, tmp_path):
    """issue 57 case 2: eos_token_id [a, b] (Llama 3's configs) was dropped: load gave the
    tokenizer's end of text, and generation never stopped at the listed ids."""
    folder = build(torch, tmp_path)
    word_tokenizer(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    with using_backend("numpy", "float64"):
        model, _ = auto.load(folder)
        free = generate(model, [1, 2, 3], 8, greedy=True)[3:]  # the tokens without an eos
        second = next(t for t in free[1:] if t != free[0])  # a token it produces later
        edit(folder, eos_token_id=[12 if second != 12 else 11, second])
        model, tokenizer = auto.load(folder)
        assert tokenizer.eos_id == [12 if second != 12 else 11, second]
        assert tokenizer.eos_ids == tuple(tokenizer.eos_id)
        row = generate(model, [1, 2, 3], 8, greedy=True, eos_id=tokenizer.eos_id)
        assert row[3:] == free[:free.index(second) + 1]  # ended at the list's second id
        assert generate(model, [1, 2, 3], 8, greedy=True, eos_id=second) == row  # one id
        batch = generate(model, [[1, 2, 3], [4]], 8, greedy=True, eos_id=(second, 12))
        assert batch[0] == row


def test_eos_is_where_transformers_generate_takes_it(torch, tmp_path):
    """transformers' generation_config: generation_config.json's eos_token_id where it sets
    one, else config.json's as written (no family default: LlamaConfig's 2 is not read);
    none leaves the tokenizer's own end of text.  (Where generation_config.json sets none,
    transformers stops at no id; npformer at config.json's, as before.)"""
    from transformers import AutoModelForCausalLM

    folder = build(torch, tmp_path)
    word_tokenizer(folder)

    def both():
        theirs = AutoModelForCausalLM.from_pretrained(folder).generation_config.eos_token_id
        with using_backend("numpy", "float64"):
            return auto.load(folder)[1].eos_id, theirs

    edit(folder, eos_token_id=[6, 7])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 5]}))
    assert both() == ([4, 5], [4, 5])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert both() == (3, 3)
    (folder / "generation_config.json").write_text(json.dumps({"max_length": 9}))
    assert both() == ([6, 7], None)
    (folder / "generation_config.json").unlink()
    assert both() == ([6, 7], [6, 7])
    edit(folder, drop=("eos_token_id",))
    assert both() == (None, None)  # not LlamaConfig's default 2


@pytest.mark.parametrize("eos, error, fragments", [
    ([], ValueError, ["eos_id", "non-empty"]),
    ([1, "2"], TypeError, ["eos_id[1]", "integer"]),
    ([1, 13], ValueError, ["eos_id 13", "vocabulary of 13"]),
    (2.0, TypeError, ["eos_id", "integer"]),
])
def test_generate_refuses_eos_ids_by_name(eos, error, fragments):
    from npformer.models.llama import LlamaCausalLM, LlamaConfig

    model = LlamaCausalLM(LlamaConfig(vocab_size=13, d_model=8, d_ff=8, num_layers=1,
                                      num_heads=2))
    with raises_naming(error, *fragments):
        generate(model, [1, 2], 3, greedy=True, eos_id=eos)


def test_a_config_eos_token_id_of_another_type_is_refused_by_name(torch, tmp_path):
    folder = build(torch, tmp_path)
    word_tokenizer(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    with raises_naming(PretrainedError, "eos_token_id = '2'", "an integer or a list"):
        auto.load(edit(folder, eos_token_id="2"))
    with raises_naming(PretrainedError, "config.json sets eos_token_id = [2, -1]", ">= 0"):
        auto.load(edit(folder, eos_token_id=[2, -1]))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1.5]}))
    with raises_naming(PretrainedError, "generation_config.json sets eos_token_id = [1.5]"):
        auto.load(folder)


# =========================================================================== case 3: defaults
def test_qwen3_without_head_dim_takes_qwen3configs_128(torch, tmp_path):
    """issue 57 case 3: a Qwen3 config.json without head_dim loads in transformers
    (Qwen3Config's head_dim is 128); npformer read hidden_size / heads and blamed the
    weights' shapes."""
    folder = edit(build(torch, tmp_path, "qwen3"), drop=("head_dim",))
    assert hf_llama.config_from_hf(json.loads((folder / "config.json").read_text()),
                                   LlamaConfig).head_dim == 128
    assert_same_logits(torch, folder)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_swish_is_silu(torch, tmp_path, family):
    """issue 57 case 3: hidden_act "swish", transformers' other name for SiLU (ACT2FN), was
    refused."""
    from transformers.activations import ACT2FN

    folder = edit(build(torch, tmp_path, family), hidden_act="swish")
    assert_same_logits(torch, folder)
    x = torch.linspace(-6.0, 6.0, 101)
    silu = [name for name in ACT2FN if torch.allclose(ACT2FN[name](x), x * torch.sigmoid(x),
                                                       rtol=0, atol=1e-6)]
    assert sorted(silu) == sorted(hf_llama.SILU_NAMES)  # ACT2FN's names of SiLU, all of them


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_defaults_table_is_transformers(family):
    """Every default npformer takes for a field config.json leaves out is the field's
    default in the family's transformers config class."""
    fields = {f.name: f.default for f in dataclasses.fields(hf_config_class(family))}
    for key, value in hf_llama.DEFAULTS[family].items():
        if key == "rope_theta":
            assert value == hf_config_class(family).default_theta
        elif key == "head_dim" and family == "qwen2":  # not a field: hidden / heads
            assert key not in fields and value is None
        else:
            assert fields[key] == value, (family, key)
    unread = {"llama": set(), "qwen2": {"attention_bias", "mlp_bias"},
              "qwen3": {"mlp_bias"}}[family]
    assert not unread & set(hf_llama.DEFAULTS[family]) and not unread & set(fields)


def test_qwen_defaults_differ_from_llamas(torch, tmp_path):
    """max_position_embeddings absent: Qwen's 32768 (Llama's 2048); num_key_value_heads
    absent: Qwen's 32 (not num_attention_heads, Llama's), named when it cannot be."""
    values = json.loads((build(torch, tmp_path, "qwen2") / "config.json").read_text())
    for key in ("max_position_embeddings", "num_key_value_heads"):
        values.pop(key)
    with raises_naming(PretrainedError, "num_key_value_heads", "absent", "default is 32"):
        hf_llama.config_from_hf(values, LlamaConfig)
    values["num_attention_heads"], values["hidden_size"] = 32, 64
    config = hf_llama.config_from_hf(values, LlamaConfig)
    assert (config.block_size, config.num_kv_heads) == (32768, 32)
    llama = {**values, "model_type": "llama", "architectures": None}
    config = hf_llama.config_from_hf(llama, LlamaConfig)
    assert (config.block_size, config.num_kv_heads) == (2048, 32 // 1)
    assert hf_llama.config_from_hf({"model_type": "llama"}, LlamaConfig).vocab_size == 32000
    values.update(num_key_value_heads=None, num_attention_heads=16)  # null: the heads
    assert hf_llama.config_from_hf(values, LlamaConfig).num_kv_heads == 16


def test_fields_a_family_does_not_read_are_not_read(torch, tmp_path):
    """Qwen2 has biases on q, k, v and none in its feed-forward whatever attention_bias and
    mlp_bias say (they are not Qwen2Config's); Qwen3 reads no mlp_bias; Llama reads no
    sliding window: transformers loads each as it would without, and so does npformer."""
    for family, changes in (("qwen2", dict(mlp_bias=True, attention_bias=True)),
                            ("qwen3", dict(mlp_bias=True)),
                            ("llama", dict(use_sliding_window=True, sliding_window=2,
                                           layer_types=["full_attention",
                                                        "sliding_attention"]))):
        assert_same_logits(torch, edit(build(torch, tmp_path, family, name=family),
                                       **changes))


def test_qwen_use_sliding_window_whose_layers_all_attend_in_full_loads(torch, tmp_path):
    """use_sliding_window with max_window_layers at or past the last layer: Qwen2Config
    makes every layer full_attention, the model npformer computes."""
    folder = edit(build(torch, tmp_path, "qwen2"), drop=("layer_types",),
                  use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert_same_logits(torch, folder)


# =========================================================================== case 4: types
@pytest.mark.parametrize("changes, fragments", [
    (dict(layer_types="full_attention"), ["layer_types = 'full_attention'",
                                          "a list of strings"]),
    (dict(layer_types=["full_attention"]), ["1 layer_types for 2 layers"]),
    (dict(num_hidden_layers=2.0), ["num_hidden_layers = 2.0", "an integer", "float"]),
    (dict(num_attention_heads=True), ["num_attention_heads = True", "an integer", "bool"]),
    (dict(vocab_size="13"), ["vocab_size = '13'", "an integer", "str"]),
    (dict(head_dim=None), ["head_dim = None", "an integer"]),
    (dict(rms_norm_eps="1e-6"), ["rms_norm_eps = '1e-6'", "a number"]),
    (dict(tie_word_embeddings="false"), ["tie_word_embeddings = 'false'", "true or false"]),
    (dict(hidden_act=["silu"]), ["hidden_act = ['silu']", "a string"]),
    (dict(max_window_layers=1.5), ["max_window_layers = 1.5", "an integer"]),
    (dict(pad_token_id="0"), ["pad_token_id = '0'", "an integer"]),
    (dict(attention_dropout="0.1"), ["attention_dropout = '0.1'", "a number"]),
    (dict(use_cache="yes"), ["use_cache = 'yes'", "true or false"]),
    (dict(model_type=["qwen3"]), ["['qwen3']", "model_type"]),
])
def test_a_field_of_another_type_is_refused_naming_it(torch, tmp_path, changes, fragments):
    """issue 57 case 4: layer_types "full_attention" was read letter by letter
    ("layer_types ['_', 'a', 'e', ...]"); transformers refuses it (list[str]), and so does
    npformer, naming the field and what it takes, as for every field's type."""
    folder = edit(build(torch, tmp_path, "qwen3"), **changes)
    with raises_naming(PretrainedError, "config.json", *fragments):
        LlamaCausalLM.from_pretrained(folder)


def test_a_llama_layer_types_string_is_refused_too(torch, tmp_path):
    folder = edit(build(torch, tmp_path), layer_types="full_attention")
    with raises_naming(PretrainedError, "layer_types = 'full_attention'", "list of strings"):
        LlamaCausalLM.from_pretrained(folder)


# =========================================================================== case 5: .bin
@pytest.mark.parametrize("family, name", [("llama", "LlamaForCausalLM"),
                                          ("qwen2", "Qwen2ForCausalLM"),
                                          ("qwen3", "Qwen3ForCausalLM")])
def test_a_pytorch_model_bin_is_converted_with_the_familys_class(torch, tmp_path, family,
                                                                 name):
    """issue 57 case 5: a Llama folder holding only pytorch_model.bin was told to convert
    it with GPT2LMHeadModel.from_pretrained, which cannot load a Llama."""
    folder = build(torch, tmp_path, family)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(PretrainedError) as caught:
        LlamaCausalLM.from_pretrained(folder)
    message = str(caught.value)
    assert f"{name}.from_pretrained(folder)" in message and "pytorch_model.bin" in message
    assert "GPT2" not in message


def test_a_gpt2_folder_still_names_gpt2s_class(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with raises_naming(PretrainedError, "GPT2LMHeadModel.from_pretrained(folder)"):
        gpt2._read_weights(tmp_path)


@pytest.mark.parametrize("held, call", [
    ("pytorch_model.bin.index.json", "LlamaForCausalLM.from_pretrained(folder)"),
    ("tf_model.h5", "LlamaForCausalLM.from_pretrained(folder, from_tf=True)"),
    ("flax_model.msgpack", "LlamaForCausalLM.from_pretrained(folder, from_flax=True)")])
def test_other_formats_name_the_familys_class_and_how_it_reads_them(torch, tmp_path, held,
                                                                    call):
    folder = build(torch, tmp_path)
    (folder / "model.safetensors").rename(folder / held)
    with raises_naming(PretrainedError, held, call):
        LlamaCausalLM.from_pretrained(folder)


def test_a_file_given_as_the_folder_is_named_as_a_llama_or_qwen_checkpoint(tmp_path):
    """The shared messages of the folder's resolution named GPT-2 for a Llama folder."""
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(PretrainedError) as caught:
        LlamaCausalLM.from_pretrained(tmp_path / "model.bin")
    assert "a Llama or Qwen checkpoint is a folder" in str(caught.value)
    assert "GPT-2" not in str(caught.value)
    with raises_naming(PretrainedError, "a GPT-2 checkpoint is a folder"):
        gpt2.resolve(tmp_path / "model.bin")


def test_layer_types_as_every_transformers_config_checks_them(torch, tmp_path):
    """The older name "attention" is full_attention (transformers renames it); a name
    transformers does not know, or one entry per layer too few, is refused, Llama's too
    (whose model reads no layer_types, but whose config checks them)."""
    folder = edit(build(torch, tmp_path, "qwen2"), layer_types=["attention", "full_attention"])
    assert_same_logits(torch, folder)
    for family in ("llama", "qwen3"):
        folder = build(torch, tmp_path, family, name=family)
        with raises_naming(PretrainedError, "layer_types ['dense_attention']",
                           "not layer types transformers knows"):
            LlamaCausalLM.from_pretrained(edit(folder, layer_types=["full_attention",
                                                               "dense_attention"]))
        with raises_naming(PretrainedError, "3 layer_types for 2 layers"):
            LlamaCausalLM.from_pretrained(edit(folder, layer_types=["full_attention"] * 3))


BAD = [None, "x", "2", 1.5, 2.0, True, False, [], [1], ["full_attention"], {}, {"a": 1}, -1,
       0, 10**30, float("nan"), float("inf")]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_any_value_of_any_field_gives_a_config_or_an_error_naming_it(family):
    """Every field config.json's reader takes, and every rotary parameter, set to values of
    every JSON type: a config, or a PretrainedError (never a TypeError from inside, a
    NumPy error, or a list of num_hidden_layers entries built for 10**30 layers)."""
    values = {**SIZES, "num_key_value_heads": 2, "model_type": family}
    cases = [{key: value} for key in [*hf_llama.FIELD_TYPES, "rope_scaling", "rope_parameters",
                                      "architectures", "model_type"] for value in BAD]
    cases += [{where: {**LLAMA3, key: value}} for where in ("rope_parameters", "rope_scaling")
              for key in [*LLAMA3, "type", "rope_theta", "partial_rotary_factor"]
              for value in BAD]
    for case in cases:
        try:
            hf_llama.config_from_hf({**values, **case}, LlamaConfig)
        except PretrainedError as exc:
            assert "config.json" in str(exc), (case, exc)
    with raises_naming(PretrainedError, "partial_rotary_factor = 'x'", "a number"):
        hf_llama.config_from_hf({**values, "partial_rotary_factor": "x"}, LlamaConfig)
    with raises_naming(PretrainedError, "rope_parameters.partial_rotary_factor = None"):
        hf_llama.config_from_hf({**values, "rope_parameters": {"rope_type": "default",
                                                               "partial_rotary_factor": None}},
                                LlamaConfig)
