"""Llama, Qwen2 and Qwen3 checkpoints in Hugging Face's format: load one into a
:class:`npformer.models.LlamaCausalLM`, save one.

A folder is what ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``'s
``save_pretrained`` writes (Llama 3.x, SmolLM2, TinyLlama, Qwen2.5, Qwen3 on the Hub):

* ``config.json``: ``model_type`` ("llama", "qwen2", "qwen3"), the sizes
  (``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
  ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
  ``max_position_embeddings``), ``rms_norm_eps``, the rotary base and scaling (the older
  ``rope_theta`` and ``rope_scaling``, or transformers 5's ``rope_parameters``),
  ``tie_word_embeddings``, ``attention_bias``;
* ``model.safetensors``, or shards named by ``model.safetensors.index.json``;
* ``tokenizer.json``, read with the ``tokenizers`` library (:func:`load`; its end of text
  is config.json's ``eos_token_id``).

The weights map one to one: Hugging Face's names less ``model.`` are npformer's
(``model.layers.0.self_attn.q_proj.weight`` is ``layers.0.self_attn.q_proj.weight``), and
a ``torch.nn.Linear``'s weight (out, in) is npformer's :class:`Linear` weight (in, out)
transposed; the embedding and the norms are copied.  The families differ in their options:
Llama's ``attention_bias`` puts biases on q, k, v and the output projection; Qwen2 has
biases on q, k and v always (``qkv_bias``); Qwen3 has QK-norm (``qk_norm``) and Llama's
``attention_bias``.

Real checkpoints are stored in bfloat16, which NumPy has not: they are read exactly as
float32 and loaded into the model's float type, with a warning that says so.

Refused by name, never approximated: a ``model_type`` or architecture not listed, a
``rope_type`` other than the default and ``llama3``, sliding-window attention, mixture of
experts, an activation other than SiLU, biases in the feed-forward (``mlp_bias``), a
``rope_scaling`` without its type, a weight held under two names (with and without
``model.``).
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np

from .. import backend
from ..models.llama import LlamaCausalLM, LlamaConfig
from ..nn.lora import lora_layers
from ..ops.contracts import LLAMA3_KEYS, check_choice
from .gpt2 import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    PretrainedError,
    Tokenizer,
    _first,
    _json_object,
    _read_weights,
    _switch,
    _write_whole,
    architectures_of,
    check_tokenizer,
    output_folder,
    resolve,
)

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}  # model_type -> its causal LM's class
ARCHITECTURES = {name for arch in FAMILIES.values()
                 for name in (arch, arch.replace("ForCausalLM", "Model"))}
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")  # mixture of experts
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads")
BUFFERS = ("rotary_emb.inv_freq",)  # computed by older checkpoints' modules: not weights


# --------------------------------------------------------------------------- the config
def config_from_hf(values: dict, where: str = CONFIG_FILE) -> LlamaConfig:
    """The :class:`LlamaConfig` of a config.json's ``values``; what npformer cannot compute
    is refused naming the key (see the module docstring)."""
    model_type = values.get("model_type")
    if model_type not in FAMILIES:
        raise PretrainedError(f"{where} describes a {model_type!r} model (model_type): "
                              f"npformer loads {sorted(FAMILIES)} checkpoints here")
    other = [a for a in architectures_of(values, where, FAMILIES[model_type])
             if a not in ARCHITECTURES]
    if other:
        raise PretrainedError(f"{where} holds a {', '.join(map(str, other))} (architectures): "
                              f"npformer loads {', '.join(sorted(FAMILIES.values()))}")
    refuse_unsupported(values, where)
    missing = [key for key in SIZES if key not in values]
    if missing:
        raise PretrainedError(f"{where} has no {', '.join(map(repr, missing))}")
    theta, scaling = rope_from_hf(values, where)
    bias = _switch(values, "attention_bias", False, where)
    try:
        return LlamaConfig(
            **{key: values[key] for key in SIZES},
            num_key_value_heads=values.get("num_key_value_heads"),
            head_dim=values.get("head_dim"),
            max_position_embeddings=values.get("max_position_embeddings", 2048),
            rms_norm_eps=values.get("rms_norm_eps", 1e-6), rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=_switch(values, "tie_word_embeddings", False, where),
            attention_bias=bias and model_type != "qwen2", qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3")
    except ValueError as exc:
        raise PretrainedError(f"{where} does not make a model: {exc}") from None


def refuse_unsupported(values: dict, where: str) -> None:
    """Sliding windows, mixture of experts, another activation, feed-forward biases: refused
    naming the key."""
    if _switch(values, "use_sliding_window", False, where):
        raise PretrainedError(f"{where} sets use_sliding_window = true (sliding-window "
                              "attention): not implemented in npformer")
    layer_types = values.get("layer_types") or []
    windowed = sorted({t for t in layer_types if t != "full_attention"})
    if windowed:
        raise PretrainedError(f"{where} has layer_types {windowed} (sliding-window "
                              "attention): not implemented in npformer, whose layers attend "
                              "to every earlier position (full_attention)")
    experts = [key for key in EXPERTS if values.get(key)]
    if experts:
        raise PretrainedError(f"{where} sets {experts[0]} = {values[experts[0]]!r} (mixture "
                              "of experts): not implemented in npformer")
    activation = values.get("hidden_act", "silu")
    if activation != "silu":
        raise PretrainedError(f"{where} sets hidden_act = {activation!r}: npformer's "
                              "feed-forward is SwiGLU (hidden_act 'silu')")
    if _switch(values, "mlp_bias", False, where):
        raise PretrainedError(f"{where} sets mlp_bias = true (biases in the feed-forward): "
                              "not implemented in npformer")


def rope_from_hf(values: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, a llama3 rope_scaling or None) from config.json: the older keys
    (``rope_theta``, ``rope_scaling``) or transformers 5's ``rope_parameters``."""
    given = [v for v in (values.get("rope_parameters"), values.get("rope_scaling"))
             if v is not None and v != {}]
    params = given[0] if given else {}
    if not isinstance(params, dict):
        raise PretrainedError(f"{where}: rope_scaling must be an object or null, got "
                              f"{params!r}")
    theta = values.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type is None and set(params) - {"rope_theta"}:  # its numbers would be ignored
        raise PretrainedError(f"{where} sets rope_scaling {params!r} without a rope_type "
                              "(or type): name the scaling, 'llama3' or 'default'")
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise PretrainedError(f"{where} sets rope_type {rope_type!r}: not implemented in "
                              "npformer, which computes the default rotary positions and "
                              "'llama3' scaling")
    return theta, {"rope_type": "llama3", **{key: params[key] for key in LLAMA3_KEYS
                                             if key in params}}


def family_of(config: LlamaConfig) -> str:
    """The model_type whose options are the config's: Qwen3 (QK-norm), Qwen2 (q, k, v
    biases without the output's), else Llama; a mix no family has is refused."""
    if config.qk_norm and config.qkv_bias and not config.attention_bias:
        raise PretrainedError("no Hugging Face family has QK-norm with biases on q, k and v "
                              "only (Qwen3 has QK-norm and attention_bias on all four)")
    if config.qk_norm:
        return "qwen3"
    return "qwen2" if config.qkv_bias and not config.attention_bias else "llama"


def config_to_hf(config: LlamaConfig) -> dict:
    """The config.json of a :class:`LlamaConfig` (its family's model_type)."""
    c = config
    family = family_of(c)
    values = {"architectures": [FAMILIES[family]], "model_type": family,
              "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_hidden_layers,
              "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
              "max_position_embeddings": c.max_position_embeddings,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
              "rope_scaling": c.rope_scaling, "tie_word_embeddings": c.tie_word_embeddings,
              "hidden_act": "silu", "use_cache": True}
    if family == "qwen2":
        values["use_sliding_window"] = False
    else:
        values["attention_bias"] = c.attention_bias
    return values


# --------------------------------------------------------------------------- the weights
def is_linear_weight(name: str) -> bool:
    """A torch Linear's weight (transposed between the two layouts): every 2-D weight but
    the embedding table."""
    return name.endswith("proj.weight") or name == "lm_head.weight"


def to_hf(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """npformer's arrays by parameter name -> Hugging Face's (``model.`` before the body's
    names, Linear weights transposed), C-contiguous."""
    return {("" if name == "lm_head.weight" else "model.") + name:
            np.ascontiguousarray(array.T if is_linear_weight(name) else array)
            for name, array in arrays.items()}


def from_hf(state: dict[str, np.ndarray], model: LlamaCausalLM, where: str = WEIGHTS_FILE
            ) -> dict[str, np.ndarray]:
    """Hugging Face's arrays by name -> npformer's by parameter name, every name and shape
    checked against ``model``'s parameters first (a missing, unexpected or misshapen weight
    refused naming it)."""
    ours, given = {}, {}
    for name, array in state.items():
        if name.endswith(BUFFERS):
            continue
        own = name.removeprefix("model.")
        if own in given:  # which copy to load is not npformer's guess
            raise PretrainedError(f"{where} holds {own} twice, as {given[own]} and {name}: "
                                  "keep one")
        ours[own], given[own] = (array.T if is_linear_weight(own) else array), name
    if model.config.tie_word_embeddings and "lm_head.weight" in ours:  # the head saved too
        if not np.array_equal(ours.pop("lm_head.weight").T, ours.get("embed_tokens.weight")):
            raise PretrainedError(f"{where} holds an lm_head.weight other than the embedding, "
                                  "but config.json ties them (tie_word_embeddings): set it "
                                  "to false to load the head apart")
    expected = {name: p.shape for name, p in model.named_parameters()}
    missing = sorted(set(expected) - set(ours))
    unexpected = sorted(set(ours) - set(expected))
    wrong = [f"{n} {tuple(ours[n].shape)} (config.json's sizes give {expected[n]})"
             for n in sorted(set(expected) & set(ours)) if tuple(ours[n].shape) != expected[n]]
    if missing or unexpected or wrong:
        problems = ([f"missing {_first(missing)}"] if missing else []) + \
                   ([f"unexpected {_first(unexpected)}"] if unexpected else []) + \
                   ([f"shapes: {'; '.join(_first(wrong))}"] if wrong else [])
        raise PretrainedError(f"{where} does not hold the weights config.json describes "
                              f"(npformer's names, less 'model.'): {' | '.join(problems)}")
    return ours


# --------------------------------------------------------------------------- load and save
def from_pretrained(path: str | os.PathLike, dtype: str | None = None,
                    model_class: type = LlamaCausalLM) -> LlamaCausalLM:
    """A :class:`LlamaCausalLM` holding a Llama, Qwen2 or Qwen3 folder (or Hub name,
    downloaded into the user's cache where the network allows).  ``dtype``: "float32" or
    "float64" (default: the backend's default float); bfloat16 weights are converted to it,
    with a warning saying so.  The model is on the current backend, in training mode."""
    if dtype is not None:
        check_choice(dtype, backend.FLOAT_DTYPES, "dtype")
    folder = resolve(path)
    if not (folder / CONFIG_FILE).is_file():
        raise PretrainedError(f"{folder} has no {CONFIG_FILE}: a Llama or Qwen folder holds "
                              f"{CONFIG_FILE} and {WEIGHTS_FILE} (or its shards)")
    config = config_from_hf(_json_object(folder / CONFIG_FILE, "a model config"),
                            str(folder / CONFIG_FILE))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = _read_weights(folder)
    dtype = dtype or backend.default_float_name()
    bfloat16 = [w for w in caught if "bfloat16" in str(w.message)]
    for w in caught:
        if w not in bfloat16:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if bfloat16:
        warnings.warn(f"{folder} holds bfloat16 weights: converted exactly to {dtype}, the "
                      "model's float type (NumPy has no bfloat16)", UserWarning, stacklevel=2)
    previous = backend.default_float_name()
    backend.set_default_float(dtype)
    try:
        model = model_class(config)
    finally:
        backend.set_default_float(previous)
    model.load_state_dict(from_hf(state, model, str(folder / WEIGHTS_FILE)))
    return model


def save_pretrained(model: LlamaCausalLM, path: str | os.PathLike) -> Path:
    """Write ``model`` as a Hugging Face folder at ``path`` (created if needed):
    ``config.json`` (its family's, :func:`family_of`) and ``model.safetensors``, which
    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads with the same logits.
    The weights keep the model's dtype.  LoRA adapters (:mod:`npformer.nn.lora`) are saved
    merged into their weights (``merge_lora`` first; unmerged ones are refused), never as
    weights of their own, which the folder's model has not."""
    from safetensors.numpy import save_file

    if not isinstance(getattr(model, "config", None), LlamaConfig):
        raise TypeError(f"save_pretrained writes a LlamaCausalLM, got {type(model).__name__}")
    adapters = lora_layers(model)
    unmerged = [name for name, layer in adapters.items() if not layer.merged]
    if unmerged:
        raise ValueError(f"save_pretrained writes the model's weights, but its LoRA adapters "
                         f"on {_first(unmerged)} are not merged into them: merge_lora(model) "
                         "first (or save them with npformer.interop.peft.save_adapter)")
    adapter_names = {f"{name}.{part}" for name in adapters for part in ("lora_A", "lora_B")}
    weights = to_hf({name: backend.to_numpy(p.data) for name, p in model.named_parameters()
                     if name not in adapter_names})
    values = config_to_hf(model.config)
    folder = output_folder(path)
    values["torch_dtype"] = next(iter(weights.values())).dtype.name
    _write_whole(folder / WEIGHTS_FILE,
                 lambda tmp: save_file(weights, str(tmp), metadata={"format": "pt"}))
    _write_whole(folder / CONFIG_FILE, lambda tmp: tmp.write_text(
        json.dumps(values, indent=2) + "\n", encoding="utf-8"))
    return folder


def load(path: str | os.PathLike, dtype: str | None = None,
         model_class: type = LlamaCausalLM) -> tuple[LlamaCausalLM, Tokenizer]:
    """The model (of ``model_class``: ``npformer.fast.LlamaCausalLM`` for the fast tier) and
    the tokenizer (``tokenizer.json``, through ``tokenizers``) of a Llama, Qwen2 or Qwen3
    folder or Hub name (:func:`from_pretrained`), the tokenizer checked against the model:
    its ids index the model's embeddings."""
    folder = resolve(path)
    tokenizer = Tokenizer.from_pretrained(folder)
    model = from_pretrained(folder, dtype=dtype, model_class=model_class)
    check_tokenizer(tokenizer, model)
    return model, tokenizer
