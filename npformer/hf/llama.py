"""Llama, Qwen2 and Qwen3 checkpoints in Hugging Face's format: load one into a
:class:`npformer.models.LlamaCausalLM`, save one.

The entries are :meth:`LlamaCausalLM.from_pretrained` and
:meth:`LlamaCausalLM.save_pretrained` (and :func:`npformer.interop.auto.from_pretrained`),
which pass their class to :func:`load_folder` and :func:`save_folder`: this module
imports no model.

A folder is what ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``'s
``save_pretrained`` writes (Llama 3.x, SmolLM2, TinyLlama, Qwen2.5, Qwen3 on the Hub):
``config.json`` (``model_type`` "llama", "qwen2" or "qwen3", the sizes, ``rms_norm_eps``,
the rotary base and scaling, ``tie_word_embeddings``, ``attention_bias``),
``model.safetensors`` or the shards its index names, and ``tokenizer.json``
(:meth:`Tokenizer.from_pretrained`; the end of text where transformers' ``generate``
takes it, :func:`npformer.hf.gpt2.eos_of`).

The weights map one to one, their names part by part (:data:`PART_NAMES`:
``model.layers.0.self_attn.o_proj.weight`` is ``blocks.0.self_attn.out_proj.weight``;
:func:`npformer_name`, :func:`hf_name`); a ``torch.nn.Linear``'s weight (out, in) is
npformer's :class:`Linear` weight (in, out) transposed.  The families differ in their
options: Llama's ``attention_bias`` puts biases on q, k, v and the output projection;
Qwen2 has biases on q, k and v always (``qkv_bias``); Qwen3 has QK-norm (``qk_norm``)
and Llama's ``attention_bias``.  bfloat16 checkpoints are read exactly as float32 and
loaded into the model's float type, with a warning (NumPy has no bfloat16).

Each field is read as transformers reads it for the family (:func:`config_from_hf`,
:func:`rope_from_hf`; docs/llama.md, "How config.json is read"; :data:`DEFAULTS`,
:data:`FIELD_TYPES`).  Refused by name, never approximated: another ``model_type`` or
architecture, a ``rope_type`` other than the default and ``llama3``, a partial rotation with
``llama3``, sliding-window attention, mixture of experts, an activation other than SiLU
(``silu``, ``swish``), ``mlp_bias``, a ``rope_scaling`` without its type, a weight held
under two names.
"""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .. import backend
from ..nn.lora import lora_layers
from ..ops.contracts import LLAMA3_KEYS, check_choice, shown
from .gpt2 import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    PretrainedError,
    _first,
    _is_eos,
    _json_object,
    _read_weights,
    architectures_of,
    check_weights_match,
    output_folder,
    resolve,
    write_weights_and_config,
)

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}  # model_type -> its causal LM's class
ARCHITECTURES = {name for arch in FAMILIES.values()
                 for name in (arch, arch.replace("ForCausalLM", "Model"))}
# Each family's defaults, as transformers' LlamaConfig, Qwen2Config and Qwen3Config hold
# them; a field missing from a family's table is one its model does not read (Qwen2's
# attention_bias: it has q, k, v biases always; Qwen3's mlp_bias).
_SHARED = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "rope_theta": 10000.0, "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32}
_QWEN = {**_SHARED, "vocab_size": 151936, "intermediate_size": 22016,
         "num_key_value_heads": 32, "max_position_embeddings": 32768,
         "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
         "layer_types": None, "bos_token_id": None, "eos_token_id": None}
DEFAULTS = {
    "llama": {**_SHARED, "vocab_size": 32000, "intermediate_size": 11008,
              "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048,
              "attention_bias": False, "mlp_bias": False, "bos_token_id": 1,
              "eos_token_id": 2},
    "qwen2": {**_QWEN, "head_dim": None},  # not a Qwen2Config field: read where given
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
}
# What each field takes (as transformers' strict config classes check them): "int",
# "float" (a number), "bool", "str", "int list" (int, a list of ints or null), "str list"
# (a list of strs or null); "?" after it: null allowed (null is then the field's None).
FIELD_TYPES = {
    "vocab_size": "int", "hidden_size": "int", "intermediate_size": "int",
    "num_hidden_layers": "int", "num_attention_heads": "int",
    "num_key_value_heads": "int?", "head_dim": "int?", "max_position_embeddings": "int",
    "rms_norm_eps": "float", "rope_theta": "float", "tie_word_embeddings": "bool",
    "attention_bias": "bool", "mlp_bias": "bool", "hidden_act": "str",
    "use_sliding_window": "bool", "sliding_window": "int?", "max_window_layers": "int",
    "layer_types": "str list?", "bos_token_id": "int?", "eos_token_id": "int list?",
    "pad_token_id": "int?", "partial_rotary_factor": "float",
    "original_max_position_embeddings": "int", "attention_dropout": "float",
    "initializer_range": "float", "use_cache": "bool",
}
# fields npformer does not read (training settings, generation's): their types checked
CHECKED_ONLY = ("pad_token_id", "attention_dropout", "initializer_range", "use_cache")
NOT_NULL = {("qwen3", "head_dim"), ("qwen2", "head_dim")}  # an int where given
_TAKES = {"int": "an integer", "float": "a number", "bool": "true or false (JSON)",
          "str": "a string", "int list": "an integer or a list of integers",
          "str list": "a list of strings, one per layer"}
# transformers' ACT2FN names of the one activation npformer's SwiGLU computes, SiLU
SILU_NAMES = ("silu", "swish")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")  # mixture of experts
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads")
# config.json's keys -> LlamaConfig's fields (npformer's one vocabulary, docs/guide.md)
FIELDS = {"vocab_size": "vocab_size", "hidden_size": "d_model", "intermediate_size": "d_ff",
          "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
          "head_dim": "head_dim", "max_position_embeddings": "block_size",
          "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_weights"}
BUFFERS = ("rotary_emb.inv_freq",)  # computed by older checkpoints' modules: not weights
# transformers' ALLOWED_ATTN_LAYER_TYPES and _LEGACY_LAYER_TYPE_REMAP (configuration_utils):
# the names a config's layer_types may hold; npformer computes full_attention alone
ATTENTION_LAYER_TYPES = (
    "full_attention", "sliding_attention", "chunked_attention", "window_attention",
    "indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
    "minimax_m3_sparse", "conv", "moe", "hybrid", "hybrid_sliding",
    "reference_sliding_attention", "linear_attention")
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention",
                      "deepseek_sparse_attention": "indexed_attention",
                      "qwen_sparse_attention": "indexed_attention"}
KIND = "Llama or Qwen"  # the checkpoints read here, as the shared messages name them


_FITS = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
         "bool": lambda v: isinstance(v, bool),
         "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
         "str": lambda v: isinstance(v, str), "int list": _is_eos,
         "str list": lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v)}


def check_field(value: Any, key: str, where: str, family: str | None = None) -> Any:
    """``value`` of config.json's ``key`` if it is of the field's type (FIELD_TYPES), else a
    PretrainedError naming the field, what it takes and what it holds: never a str read
    letter by letter, a float or bool read as an integer, a string as a number."""
    kind = FIELD_TYPES[key]
    nullable = kind.endswith("?") and (family, key) not in NOT_NULL
    kind = kind.rstrip("?")
    if (value is None and nullable) or (value is not None and _FITS[kind](value)):
        return value
    takes = _TAKES[kind] + (" or null" if nullable else "")
    raise PretrainedError(f"{where} sets {key} = {shown(value)}: {key} takes {takes}"
                          + (f", not a {type(value).__name__}" if value is not None else ""))


def hf_field(values: dict, key: str, family: str, where: str) -> Any:
    """config.json's ``key``, or its family's default where absent (DEFAULTS), of the
    field's type (:func:`check_field`)."""
    if key not in values:
        return DEFAULTS[family][key]
    return check_field(values[key], key, where, family)


def config_from_hf(values: dict, config_class: type, where: str = CONFIG_FILE) -> Any:
    """The ``config_class`` (:class:`npformer.models.LlamaConfig`) of a config.json's
    ``values``, each field read as
    transformers reads it for the family (its defaults, DEFAULTS; its types, FIELD_TYPES);
    what npformer cannot compute is refused naming the key (see the module docstring)."""
    family = values.get("model_type")
    if not isinstance(family, str) or family not in FAMILIES:
        raise PretrainedError(f"{where} describes a {family!r} model (model_type): "
                              f"npformer loads {sorted(FAMILIES)} checkpoints here")
    other = [a for a in architectures_of(values, where, FAMILIES[family])
             if a not in ARCHITECTURES]
    if other:
        raise PretrainedError(f"{where} holds a {', '.join(map(str, other))} (architectures): "
                              f"npformer loads {', '.join(sorted(FAMILIES.values()))}")
    field = {key: hf_field(values, key, family, where) for key in DEFAULTS[family]}
    for key in CHECKED_ONLY:  # not read, but refused by transformers when of another type
        if key in values:
            check_field(values[key], key, where, family)
    refuse_unsupported(values, field, family, where)
    heads = field["num_attention_heads"]
    kv_heads = heads if field["num_key_value_heads"] is None else field["num_key_value_heads"]
    theta, scaling = rope_from_hf(values, where, field["max_position_embeddings"])
    try:
        return config_class(
            **{ours: field[theirs] for theirs, ours in FIELDS.items()}, num_kv_heads=kv_heads,
            rope_theta=theta, rope_scaling=scaling,
            attention_bias=family != "qwen2" and field["attention_bias"],
            qkv_bias=family == "qwen2", qk_norm=family == "qwen3")
    except ValueError as exc:
        message = in_hf_names(str(exc))
        absent = [key for key in ("num_key_value_heads", "head_dim", *SIZES)
                  if key not in values and key in message]
        hint = "".join(f"; {key} is absent: {FAMILIES[family].replace('ForCausalLM', '')}"
                       f"Config's default is {DEFAULTS[family][key]!r}" for key in absent)
        raise PretrainedError(f"{where} does not make a model: {message}{hint}") from None


def in_hf_names(message: str) -> str:
    """A LlamaConfig's message, its fields named as config.json names them (FIELDS)."""
    for theirs, ours in {**FIELDS, "num_key_value_heads": "num_kv_heads"}.items():
        message = re.sub(rf"\bLlamaConfig\.{ours}\b", theirs, message)
    return message


def given_layer_types(values: dict, field: dict, where: str) -> list[str] | None:
    """config.json's ``layer_types`` as every transformers config checks it (its
    ``validate_layer_type``): a list of strings (FIELD_TYPES), one per layer, the older
    names renamed (``"attention"`` is ``"full_attention"``), each a layer type transformers
    knows; None where config.json gives none."""
    given = field.get("layer_types", values.get("layer_types"))
    if given is None:
        return None
    check_field(given, "layer_types", where)
    given = [LEGACY_LAYER_TYPES.get(t, t) for t in given]
    unknown = sorted({t for t in given if t not in ATTENTION_LAYER_TYPES})
    if unknown:
        raise PretrainedError(f"{where} has layer_types {unknown}: not layer types "
                              f"transformers knows ({', '.join(ATTENTION_LAYER_TYPES[:3])}, "
                              "...)")
    layers = field["num_hidden_layers"]
    if len(given) != layers:
        raise PretrainedError(f"{where} has {len(given)} layer_types for {layers} layers "
                              "(num_hidden_layers): one per layer")
    return given


def layer_types_of(values: dict, field: dict, where: str) -> set[str]:
    """The kinds of attention of the layers, as Qwen2Config and Qwen3Config make them:
    config.json's ``layer_types`` (:func:`given_layer_types`), else "sliding_attention"
    from layer ``max_window_layers`` on where ``use_sliding_window`` (and a sliding_window)
    is set, "full_attention" before."""
    given = given_layer_types(values, field, where)
    if given is not None:
        return set(given)
    window = field["sliding_window"] if field["use_sliding_window"] else None
    start, layers = field["max_window_layers"], field["num_hidden_layers"]
    sliding = {"sliding_attention"} if window is not None and start < layers else set()
    return sliding | ({"full_attention"} if min(start, layers) > 0 else set())


def refuse_unsupported(values: dict, field: dict, family: str, where: str) -> None:
    """Sliding windows, mixture of experts, another activation, feed-forward biases: refused
    naming the key.  Llama's layers all attend in full in transformers (LlamaForCausalLM
    reads no layer_types nor sliding window): its layer_types are only checked as every
    transformers config checks them."""
    if family == "llama":
        given_layer_types(values, field, where)
    else:
        other = sorted(layer_types_of(values, field, where) - {"full_attention"})
        if other:
            why = "" if field["layer_types"] is not None else (
                f" (use_sliding_window = true from layer max_window_layers = "
                f"{field['max_window_layers']} on)")
            raise PretrainedError(f"{where} has layer_types {other}{why} (sliding-window "
                                  "or other attention): not implemented in npformer, whose "
                                  "layers attend to every earlier position "
                                  "(full_attention)")
    experts = [key for key in EXPERTS if values.get(key)]
    if experts:
        raise PretrainedError(f"{where} sets {experts[0]} = {values[experts[0]]!r} (mixture "
                              "of experts): not implemented in npformer")
    if field["hidden_act"] not in SILU_NAMES:
        raise PretrainedError(f"{where} sets hidden_act = {field['hidden_act']!r}: npformer's "
                              "feed-forward is SwiGLU (hidden_act 'silu', or 'swish', "
                              "transformers' other name for it)")
    if field.get("mlp_bias"):
        raise PretrainedError(f"{where} sets mlp_bias = true (biases in the feed-forward): "
                              "not implemented in npformer")


def _rope_number(params: dict, key: str, where: str, source: str):
    value = params[key]
    try:
        return check_field(value, key if key in FIELD_TYPES else "rope_theta", where)
    except PretrainedError:
        kind = "an integer" if key == "original_max_position_embeddings" else "a number"
        raise PretrainedError(f"{where} sets {source}.{key} = {shown(value)}: it takes "
                              f"{kind}") from None


def rope_parameters_of(values: dict, where: str) -> tuple[str | None, dict]:
    """(the key, the dict) transformers takes its rotary parameters from: ``rope_scaling``
    where it is a non-empty object (it replaces ``rope_parameters`` whole), else
    ``rope_parameters``, else none (None, {})."""
    for key in ("rope_scaling", "rope_parameters"):
        value = values.get(key)
        if value is not None and not isinstance(value, dict):
            raise PretrainedError(f"{where}: {key} must be an object or null, got "
                                  f"{shown(value)}")
    for key in ("rope_scaling", "rope_parameters"):
        if values.get(key):
            return key, values[key]
    return None, {}


def rope_from_hf(values: dict, where: str, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, a llama3 rope_scaling or None) from config.json, every field taken where
    transformers (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`` and
    ``standardize_rope_params``) takes it, in the order docs/llama.md ("How config.json is
    read", the rotary fields) lists."""
    source, params = rope_parameters_of(values, where)
    key = next((key for key in ("rope_type", "type") if key in params), None)
    rope_type, named = (params[key], f"{source}.{key}") if key else (None, "rope_type")
    if rope_type is not None and not isinstance(rope_type, str):
        raise PretrainedError(f"{where} sets {named} = {shown(rope_type)}: it takes a string "
                              "('default' or 'llama3')")
    if "rope_theta" in params:
        theta = _rope_number(params, "rope_theta", where, source)
    else:
        theta = check_field(values.get("rope_theta", 10000.0), "rope_theta", where)
    if rope_type is None and set(params) - {"rope_theta", "partial_rotary_factor"}:
        raise PretrainedError(f"{where} sets {source} {params!r} without a rope_type "
                              "(or type): name the scaling, 'llama3' or 'default'")
    if "partial_rotary_factor" in params:
        partial = _rope_number(params, "partial_rotary_factor", where, source)
    else:
        partial = values.get("partial_rotary_factor")
        if partial is not None:
            check_field(partial, "partial_rotary_factor", where)
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise PretrainedError(f"{where} sets rope_type {rope_type!r}: not implemented in "
                              "npformer, which computes the default rotary positions and "
                              "'llama3' scaling")
    if partial is not None and partial != 1:
        raise PretrainedError(f"{where} sets partial_rotary_factor = {shown(partial)} with "
                              "rope_type 'llama3' (a rotation of part of each head): not "
                              "implemented in npformer (nor run by transformers' Llama)")
    scaling = {"rope_type": "llama3"}
    for key in LLAMA3_KEYS:
        if key == "original_max_position_embeddings" and key in values:
            scaling[key] = check_field(values[key], key, where)
        elif key in params:
            scaling[key] = _rope_number(params, key, where, source)
        elif key == "original_max_position_embeddings":
            scaling[key] = max_positions
        else:
            raise PretrainedError(f"{where}'s {source} of rope_type 'llama3' has no {key} "
                                  f"(it needs {', '.join(LLAMA3_KEYS[:3])})")
    return theta, scaling


def family_of(config: Any) -> str:
    """The model_type whose options are the config's: Qwen3 (QK-norm), Qwen2 (q, k, v
    biases without the output's), else Llama; a mix no family has is refused."""
    if config.qk_norm and config.qkv_bias and not config.attention_bias:
        raise PretrainedError("no Hugging Face family has QK-norm with biases on q, k and v "
                              "only (Qwen3 has QK-norm and attention_bias on all four)")
    if config.qk_norm:
        return "qwen3"
    return "qwen2" if config.qkv_bias and not config.attention_bias else "llama"


def config_to_hf(config: Any) -> dict:
    """The config.json of a :class:`npformer.models.LlamaConfig` (its family's model_type)."""
    c = config
    family = family_of(c)
    values = {"architectures": [FAMILIES[family]], "model_type": family,
              "vocab_size": c.vocab_size, "hidden_size": c.d_model,
              "intermediate_size": c.d_ff, "num_hidden_layers": c.num_layers,
              "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
              "head_dim": c.head_dim, "max_position_embeddings": c.block_size,
              "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta,
              "rope_scaling": c.rope_scaling, "tie_word_embeddings": c.tie_weights,
              "hidden_act": "silu", "use_cache": True}
    if family == "qwen2":
        values["use_sliding_window"] = False
    else:
        values["attention_bias"] = c.attention_bias
    return values


# --------------------------------------------------------------------------- the weights
# Hugging Face's names of a Llama's parts -> npformer's (the one vocabulary, docs/guide.md)
PART_NAMES = {"embed_tokens": "embed", "layers": "blocks", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm", "mlp": "ffn", "o_proj": "out_proj"}
HF_PART_NAMES = {ours: theirs for theirs, ours in PART_NAMES.items()}


def npformer_name(name: str) -> str:
    """A weight's (or module's) name in a Hugging Face Llama -> its name in npformer's
    LlamaCausalLM, part by part: ``model.layers.0.mlp.up_proj.weight`` ->
    ``blocks.0.ffn.up_proj.weight`` (a layer's own names too: ``o_proj.weight`` ->
    ``out_proj.weight``)."""
    return ".".join(PART_NAMES.get(part, part) for part in name.removeprefix("model.").split("."))


def hf_name(name: str) -> str:
    """npformer's name of a weight -> Hugging Face's (:func:`npformer_name` undone): the
    body's under ``model.``, ``lm_head`` at the top."""
    theirs = ".".join(HF_PART_NAMES.get(part, part) for part in name.split("."))
    return theirs if name.startswith("lm_head.") else "model." + theirs


def is_linear_weight(name: str) -> bool:
    """A torch Linear's weight (transposed between the two layouts): every 2-D weight but
    the embedding table."""
    return name.endswith("proj.weight") or name == "lm_head.weight"


def to_hf(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """npformer's arrays by parameter name -> Hugging Face's (:func:`hf_name`, Linear weights
    transposed), C-contiguous."""
    return {hf_name(name): np.ascontiguousarray(array.T if is_linear_weight(name) else array)
            for name, array in arrays.items()}


def from_hf(state: dict[str, np.ndarray], model: Any, where: str = WEIGHTS_FILE
            ) -> dict[str, np.ndarray]:
    """Hugging Face's arrays by name -> npformer's by parameter name, every name and shape
    checked against ``model``'s parameters first (a missing, unexpected or misshapen weight
    refused naming it)."""
    ours, given = {}, {}
    for name, array in state.items():
        if name.endswith(BUFFERS):
            continue
        own = npformer_name(name)
        if own in given:  # which copy to load is not npformer's guess
            raise PretrainedError(f"{where} holds {own} twice, as {given[own]} and {name}: "
                                  "keep one")
        ours[own], given[own] = (array.T if is_linear_weight(own) else array), name
    if model.config.tie_weights and "lm_head.weight" in ours:  # the head saved too
        if not np.array_equal(ours.pop("lm_head.weight").T, ours.get("embed.weight")):
            raise PretrainedError(f"{where} holds an lm_head.weight other than the embedding, "
                                  "but config.json ties them (tie_word_embeddings): set it "
                                  "to false to load the head apart")
    check_weights_match({hf_name(name): array for name, array in ours.items()},
                        {hf_name(name): p.shape for name, p in model.named_parameters()},
                        f"{where} does not hold the weights config.json describes "
                        "(a Linear's weight as npformer holds it, (in, out))")
    return ours


# --------------------------------------------------------------------------- load and save
def load_folder(model_class: type, path: str | os.PathLike, dtype: str | None = None) -> Any:
    """A ``model_class`` (either tier's :class:`npformer.models.LlamaCausalLM`, on the
    current backend, in training mode) holding a Llama, Qwen2 or Qwen3 folder or Hub name.
    ``dtype``: "float32" or "float64" (default: the backend's default float); bfloat16
    weights are converted to it, with a warning saying so."""
    if dtype is not None:
        check_choice(dtype, backend.FLOAT_DTYPES, "dtype")
    folder = resolve(path, KIND)
    if not (folder / CONFIG_FILE).is_file():
        raise PretrainedError(f"{folder} has no {CONFIG_FILE}: a Llama or Qwen folder holds "
                              f"{CONFIG_FILE} and {WEIGHTS_FILE} (or its shards)")
    values = _json_object(folder / CONFIG_FILE, "a model config")
    config = config_from_hf(values, model_class.config_class, str(folder / CONFIG_FILE))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = _read_weights(folder, FAMILIES[values["model_type"]])
    dtype = dtype or backend.default_float_name()
    bfloat16 = [w for w in caught if "bfloat16" in str(w.message)]
    for w in caught:
        if w not in bfloat16:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if bfloat16:
        warnings.warn(f"{folder} holds bfloat16 weights: converted exactly to {dtype}, the "
                      "model's float type (NumPy has no bfloat16)", UserWarning, stacklevel=2)
    model = backend.built_in(dtype, model_class, config)
    model.load_state_dict(from_hf(state, model, str(folder / WEIGHTS_FILE)))
    return model


def save_folder(model: Any, path: str | os.PathLike) -> Path:
    """Write ``model`` as a Hugging Face folder at ``path`` (created if needed):
    ``config.json`` (its family's, :func:`family_of`) and ``model.safetensors``, which
    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads with the same logits.
    The weights keep the model's dtype.  LoRA adapters (:mod:`npformer.nn.lora`) are saved
    merged into their weights (``merge_lora`` first; unmerged ones are refused), never as
    weights of their own, which the folder's model has not."""
    if getattr(model, "kind", None) != "llama":
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
    return write_weights_and_config(folder, weights, values)
