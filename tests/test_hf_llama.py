"""Hugging Face Llama, Qwen2 and Qwen3 folders in and out (npformer.hf.llama),
without the network: tiny models with random weights that transformers builds and saves.

Loaded in float64, each gives transformers' float64 logits, loss and every parameter's
gradient within 1e-10 (transformers' RMS norms and rotary tables computed in float64 on
its side, :mod:`tests.llama_reference`), on a left-padded batch; batched greedy generation
is transformers' ``generate`` token for token.  Folders: sharded weights, tied and untied
heads, bfloat16 weights (converted, with a warning naming the dtype), and what npformer
writes loads in transformers with equal logits.  Refused by name: another rope_type,
sliding windows, mixture of experts, an unlisted model_type.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from npformer import backend, ops
from npformer.decoding import generate
from npformer.hf import llama as hf_llama
from npformer.hf.gpt2 import PretrainedError
from npformer.interop import auto
from npformer.models import LlamaCausalLM
from npformer.models.lm import positions_of

from .conftest import using_backend
from .helpers import PARITY_RTOL, assert_close, raises_naming, to_host
from .llama_reference import float64_reference, hf_classes, ours_from_hf

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FOLDERS = {  # name -> (family, config fields)
    "llama_gqa_llama3_untied": ("llama", dict(num_key_value_heads=1, rope_theta=500000.0,
                                              rope_scaling=LLAMA3, tie_word_embeddings=False)),
    "llama_bias_tied": ("llama", dict(num_key_value_heads=4, attention_bias=True,
                                      tie_word_embeddings=True)),
    "qwen2_untied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3_tied": ("qwen3", dict(num_key_value_heads=2, head_dim=6, tie_word_embeddings=True)),
}
PAD = 0


def build(torch, tmp_path, name, dtype=None, **save):
    """transformers' model of FOLDERS[name] with random weights (float64), saved at
    tmp_path / name -> (the torch model, the folder)."""
    family, fields = FOLDERS[name]
    config_class, _ = hf_classes(family)
    config = config_class(vocab_size=13, hidden_size=16, intermediate_size=14,
                          num_hidden_layers=2, num_attention_heads=4,
                          max_position_embeddings=64, rms_norm_eps=1e-6,
                          attn_implementation="sdpa", pad_token_id=PAD, **fields)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float64)
    with torch.no_grad():  # norms and biases away from their 1s and 0s
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path / name
    (model.to(dtype) if dtype is not None else model).save_pretrained(folder, **save)
    model = model.to(torch.float64)
    model.config._attn_implementation = "sdpa"
    return model, folder


def padded_batch():
    rows = [[3, 7, 1, 9, 4, 2], [5, 8, 8], [11, 2, 6, 1]]
    width = max(map(len, rows))
    ids = np.array([[PAD] * (width - len(r)) + r for r in rows])
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return rows, ids, mask


def torch_forward(torch, model, ids, mask):
    positions = backend.to_numpy(positions_of(backend.asarray(mask.astype(bool))))
    return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(positions)).logits


def check_logits_loss_and_gradients(torch, theirs, ours):
    """Logits at the tokens, the loss over the real next tokens and every parameter's
    gradient: npformer's and transformers' within PARITY_RTOL["float64"]."""
    rtol = PARITY_RTOL["float64"]
    rows, ids, mask = padded_batch()
    targets = np.where(mask[:, :-1] == 1, ids[:, 1:], ops.IGNORE_INDEX)  # from the tokens
    logits = ours(backend.asarray(ids), attention_mask=backend.asarray(mask))
    loss, cache = ops.cross_entropy_forward(logits[:, :-1, :], backend.asarray(targets))
    dlogits_head = ops.cross_entropy_backward(backend.asarray(np.array(1.0)), cache)
    xp = backend.namespace_of(dlogits_head)
    dlogits = xp.concat([dlogits_head, xp.zeros_like(logits[:, -1:, :])], axis=1)
    ours.backward(dlogits)
    theirs.zero_grad()
    t_logits = torch_forward(torch, theirs, ids, mask)
    t_loss = torch.nn.functional.cross_entropy(t_logits[:, :-1].reshape(-1, 13),
                                               torch.tensor(targets).reshape(-1),
                                               ignore_index=ops.IGNORE_INDEX)
    t_loss.backward()
    real = mask.astype(bool)
    assert_close(to_host(logits)[real], to_host(t_logits)[real], rtol, "logits")
    assert_close(loss, to_host(t_loss), rtol, "loss")
    expected = ours_from_hf({n.removeprefix("model."): p.grad
                             for n, p in theirs.named_parameters()})
    grads = dict(ours.named_parameters())
    assert set(expected) == set(grads), (set(expected) ^ set(grads))
    for name, p in grads.items():
        assert_close(p.grad, expected[name], rtol, f"gradient of {name}")


# =========================================================================== loading
@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_load_gives_transformers_logits_loss_and_gradients(torch, tmp_path, name):
    theirs, folder = build(torch, tmp_path, name)
    with using_backend("numpy", "float64"), float64_reference():
        ours = LlamaCausalLM.from_pretrained(folder, dtype="float64")
        assert ours.config.tie_weights == name.endswith("_tied")
        assert ours.config.qk_norm == name.startswith("qwen3")
        check_logits_loss_and_gradients(torch, theirs, ours)


@pytest.mark.parametrize("name", ["llama_gqa_llama3_untied", "qwen3_tied"])
def test_batched_greedy_generation_is_transformers(torch, tmp_path, name):
    theirs, folder = build(torch, tmp_path, name)
    rows, ids, mask = padded_batch()
    with using_backend("numpy", "float64"), float64_reference():
        ours = LlamaCausalLM.from_pretrained(folder, dtype="float64")
        mine = generate(ours, rows, 8, greedy=True)
        with torch.no_grad():
            out = theirs.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                                  max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                                  eos_token_id=None)
    for row, prompt, expected in zip(mine, rows, out.tolist()):
        assert row == prompt + expected[ids.shape[1]:]


def test_sharded_folder(torch, tmp_path):
    theirs, folder = build(torch, tmp_path, "qwen2_untied", max_shard_size="3KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert not (folder / "model.safetensors").exists()
    with using_backend("numpy", "float64"), float64_reference():
        check_logits_loss_and_gradients(torch, theirs,
                                        LlamaCausalLM.from_pretrained(folder, dtype="float64"))


def test_bfloat16_weights_are_converted_and_said(torch, tmp_path):
    from transformers import AutoModelForCausalLM

    _, folder = build(torch, tmp_path, "llama_bias_tied", dtype=torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                                  attn_implementation="sdpa")
    with using_backend("numpy", "float64"), float64_reference():
        with pytest.warns(UserWarning, match="bfloat16 weights: converted exactly to float64"):
            ours = LlamaCausalLM.from_pretrained(folder, dtype="float64")
        assert ours.norm.weight.data.dtype == np.float64
        check_logits_loss_and_gradients(torch, theirs, ours)


# =========================================================================== saving
@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_saved_folder_loads_in_transformers_with_equal_logits(torch, tmp_path, name):
    from transformers import AutoModelForCausalLM

    _, folder = build(torch, tmp_path, name)
    _, ids, mask = padded_batch()
    with using_backend("numpy", "float64"), float64_reference():
        ours = LlamaCausalLM.from_pretrained(folder, dtype="float64")
        for p in ours.parameters():  # other weights than the folder's
            p.data = p.data + 0.01
        saved = ours.save_pretrained(tmp_path / "saved")
        values = json.loads((saved / "config.json").read_text())
        assert values["model_type"] == FOLDERS[name][0]
        theirs = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float64,
                                                      attn_implementation="sdpa")
        with torch.no_grad():
            t_logits = to_host(torch_forward(torch, theirs, ids, mask))
        logits = to_host(ours(backend.asarray(ids), attention_mask=backend.asarray(mask)))
    real = mask.astype(bool)
    assert_close(logits[real], t_logits[real], PARITY_RTOL["float64"], "logits")


# =========================================================================== refused
def edited(folder, **changes):
    values = json.loads((folder / "config.json").read_text())
    values.update(changes)
    (folder / "config.json").write_text(json.dumps(values))
    return folder


@pytest.mark.parametrize("changes, fragments", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
          rope_scaling=None), ["rope_type 'yarn'", "not implemented"]),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}, rope_parameters=None),
     ["rope_type 'dynamic'"]),
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1,  # layer 1 on
          layer_types=None), ["use_sliding_window", "sliding-window"]),  # slides (Qwen2)
    (dict(layer_types=["sliding_attention", "full_attention"]), ["sliding_attention",
                                                                "sliding-window"]),
    (dict(num_experts=8), ["num_experts", "mixture of experts"]),
    (dict(model_type="mistral"), ["'mistral'", "model_type", "llama"]),
    (dict(architectures=["LlamaForSequenceClassification"]),
     ["LlamaForSequenceClassification", "architectures"]),
    (dict(hidden_act="gelu"), ["hidden_act", "gelu", "silu"]),
    (dict(num_key_value_heads=3), ["num_key_value_heads 3", "num_attention_heads 4"]),
])
def test_refused_by_name(torch, tmp_path, changes, fragments):
    _, folder = build(torch, tmp_path, "qwen2_untied")
    with raises_naming(PretrainedError, "config.json", *fragments):
        LlamaCausalLM.from_pretrained(edited(folder, **changes))


def test_missing_and_misshapen_weights_are_named(torch, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, folder = build(torch, tmp_path, "llama_gqa_llama3_untied")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with raises_naming(PretrainedError, "missing", "lm_head.weight"):
        LlamaCausalLM.from_pretrained(folder)
    edited(folder, tie_word_embeddings=True, intermediate_size=15)
    with raises_naming(PretrainedError, "shapes", "mlp.down_proj.weight", "(14, 16)",
                       "(15, 16)"):
        LlamaCausalLM.from_pretrained(folder)


def test_save_refuses_another_model(tmp_path):
    with raises_naming(TypeError, "LlamaCausalLM", "str"):
        hf_llama.save_folder("model", tmp_path)


def test_load_reads_the_tokenizer(torch, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    _, folder = build(torch, tmp_path, "qwen3_tied")
    words = ["<pad>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "it",
             "</s>", "."]
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.save(str(folder / "tokenizer.json"))
    edited(folder, eos_token_id=11)
    with using_backend("numpy", "float64"):
        model, tokenizer = auto.load(folder)
    assert tokenizer.eos_id == 11 and model.config.vocab_size == 13
    assert tokenizer.encode("the cat sat .") == [1, 2, 3, 12]
    words.append("extra")  # a vocabulary larger than the model's is refused
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    inner.save(str(folder / "tokenizer.json"))
    with raises_naming(PretrainedError, "14 tokens", "13 token embeddings"):
        auto.load(folder)


def test_save_into_a_path_that_is_a_file_is_refused_naming_it(tmp_path):
    """sweep 5: a path that was a file (or under one) gave mkdir's FileExistsError or
    NotADirectoryError ([Errno 17] File exists: ...); the file is named, and left alone."""
    from npformer.models.llama import LlamaCausalLM, LlamaConfig

    model = LlamaCausalLM(LlamaConfig(vocab_size=7, d_model=8, d_ff=8, num_layers=1,
                                      num_heads=2))
    (tmp_path / "notes").write_text("mine")
    for path in (tmp_path / "notes", tmp_path / "notes" / "model"):
        with raises_naming(NotADirectoryError, f"{tmp_path / 'notes'} is a file, not a "
                                               "folder"):
            model.save_pretrained(path)
    assert (tmp_path / "notes").read_text() == "mine"


@pytest.mark.parametrize("changes, fragments", [
    (dict(rope_scaling={"factor": 4.0}, rope_parameters=None),
     ["rope_scaling {'factor': 4.0} without a rope_type"]),
    (dict(rope_scaling=[], rope_parameters=None), ["rope_scaling must be an object", "[]"]),
    (dict(architectures="Qwen2ForCausalLM"), ["architectures = 'Qwen2ForCausalLM'",
                                              "list of class names"]),
])
def test_a_config_field_of_the_wrong_shape_is_refused_not_read_as_default(
        torch, tmp_path, changes, fragments):
    """sweep 5: a rope_scaling without its type loaded as no scaling (its factor
    ignored), rope_scaling [] as none, and an architectures string was read letter by
    letter ("holds a L, l, a, ..."); each is refused, naming the field."""
    _, folder = build(torch, tmp_path, "qwen2_untied")
    with raises_naming(PretrainedError, "config.json", *fragments):
        LlamaCausalLM.from_pretrained(edited(folder, **changes))


def test_a_weight_held_under_two_names_is_refused_naming_both(torch, tmp_path):
    """sweep 5: model.norm.weight and norm.weight (one name with and one without
    ``model.``) both loaded into norm.weight, the last one read winning, silently."""
    from safetensors.numpy import load_file, save_file

    _, folder = build(torch, tmp_path, "qwen3_tied")
    weights = load_file(str(folder / "model.safetensors"))
    weights["norm.weight"] = weights["model.norm.weight"] + 1
    save_file(weights, str(folder / "model.safetensors"))
    with raises_naming(PretrainedError, "norm.weight twice", "model.norm.weight and "
                                        "norm.weight"):
        LlamaCausalLM.from_pretrained(folder)
