"""LoRA adapters in PEFT's files: ``adapter_model.safetensors`` and ``adapter_config.json``.

PEFT (``peft.PeftModel.save_pretrained``) writes, for each adapted torch module ``NAME``,
``base_model.model.NAME.lora_A.weight`` (r, D_in) and ``...lora_B.weight`` (D_out, r),
the transposes of npformer's ``lora_A`` and ``lora_B`` (:mod:`npformer.nn.lora`), and the
config (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ...).

A :class:`Naming` says which npformer layers each torch module is: itself
(:func:`same_names`), GPT-2's (:func:`gpt2_names`: ``attn.c_proj`` is
``self_attn.out_proj``, ``mlp.c_fc`` and ``mlp.c_proj`` are ``ffn.linear1`` and
``ffn.linear2``, and the fused ``attn.c_attn`` (D -> 3D) is ``q_proj``, ``k_proj``,
``v_proj`` with one A shared, :func:`npformer.nn.lora.share_lora_a`, and B cut into its
column blocks), or Llama's, Qwen2's and Qwen3's (:func:`llama_names`: each projection
one layer, named by :func:`npformer.hf.llama.npformer_name`).

:func:`apply_adapters` puts adapters on the layers PEFT's ``target_modules`` choose;
:func:`save_adapter` and :func:`load_adapter` write and read the two files.  Refused by
name: what npformer's adapters do not compute (``use_rslora``, DoRA, ``rank_pattern``,
``alpha_pattern``, trained biases, another ``peft_type``); settings of the wrong kind;
``target_modules`` (less ``exclude_modules``) that do not choose the modules the weights
file adapts; A and B that are not finite floats of the layers' shapes; on saving, an
adapter the naming does not cover.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import backend
from ..hf import llama as hf_llama
from ..hf.gpt2 import _first, output_folder, write_weights_and_config
from ..models.llama import LlamaConfig
from ..models.lm import CausalLMConfig
from ..nn.layers import Embedding, Linear
from ..nn.lora import (
    LoRAEmbedding,
    LoRALinear,
    apply_lora,
    check_adapter_settings,
    check_every_target_matches,
    check_targets,
    lora_layers,
    matches,
    share_lora_a,
)
from ..nn.module import Module
from ..nn.state import read_safetensors, weight_array
from ..ops.contracts import check_path, check_size, read_json_object

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PREFIX = "base_model.model."  # PEFT's prefix of the base model's names
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's lora_alpha when a config leaves it out

# what a config may say and npformer computes: {key: the one value npformer supports}
_UNSUPPORTED = {"use_rslora": False, "use_dora": False, "rank_pattern": {},
                "alpha_pattern": {}, "bias": "none", "lora_bias": False,
                "layers_to_transform": None, "modules_to_save": None,
                "layer_replication": None, "target_parameters": None,
                "trainable_token_indices": None}


@dataclass(frozen=True)
class Naming:
    """The torch model's module names and the npformer Linears each one is, in order
    (several: the column blocks of one fused projection); ``fan_in_fan_out``: whether the
    torch modules store (D_in, D_out) weights (GPT-2's Conv1D), as PEFT's config says."""

    modules: tuple[tuple[str, tuple[str, ...]], ...]
    fan_in_fan_out: bool = False
    # torch modules PEFT may adapt that this model cannot hold an adapter of, each with why
    # (a tied lm_head): refused by name
    refused: tuple[tuple[str, str], ...] = ()
    # the torch embedding's padding_idx (the tokenizer's pad id): PEFT's embedding adapter
    # gives A's row of it no gradient (torch's F.embedding), and so do npformer's
    padding_idx: int | None = None

    def chosen(self, targets: str | Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
        """The (torch name, npformer names) that PEFT's ``target_modules`` choose."""
        return [(name, parts) for name, parts in self.modules if matches(name, targets)]


def same_names(model: Module) -> Naming:
    """Each Linear and token Embedding of ``model`` under its own name (a torch model
    named as npformer's)."""
    return Naming(tuple((name, (name,)) for name, m in model.named_modules()
                        if isinstance(m, (Linear, LoRALinear, Embedding, LoRAEmbedding))))


def gpt2_names(config: Any) -> Naming:
    """GPT2LMHeadModel's projections (see the module docstring) for a CausalLM of
    ``config``."""
    check_config_of(config, CausalLMConfig, "gpt2_names")
    modules = []
    for i in range(config.num_layers):
        h, n = f"transformer.h.{i}.", f"blocks.{i}."
        modules += [(h + "attn.c_attn", tuple(f"{n}self_attn.{p}_proj" for p in "qkv")),
                    (h + "attn.c_proj", (n + "self_attn.out_proj",)),
                    (h + "mlp.c_fc", (n + "ffn.linear1",)),
                    (h + "mlp.c_proj", (n + "ffn.linear2",))]
    modules.append(("transformer.wte", ("embed.tokens",)))  # the token table: an Embedding
    return Naming(tuple(modules), fan_in_fan_out=True,
                  refused=(("lm_head", "GPT-2's lm_head is tied to transformer.wte (the "
                                       "token table): adapt transformer.wte instead"),))


def check_config_of(config: Any, config_class: type, function: str) -> None:
    """``config`` is a ``config_class`` (the model's ``.config``, not the model)."""
    if not isinstance(config, config_class):
        raise TypeError(f"{function} takes a {config_class.__name__} (the model's .config), "
                        f"got {type(config).__name__}")


LLAMA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # under self_attn
LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")  # under mlp


def llama_names(config: Any, padding_idx: int | None = None) -> Naming:
    """LlamaForCausalLM's (Qwen2's, Qwen3's) projections for a LlamaCausalLM of ``config``:
    ``model.layers.{i}.self_attn.q_proj`` is ``blocks.{i}.self_attn.q_proj``
    (:func:`npformer.hf.llama.npformer_name`), and so for k, v, o (``out_proj``) and the
    feed-forward's ``mlp.gate_proj`` (``ffn.gate_proj``), ``up_proj``, ``down_proj``; torch
    Linears, (D_out, D_in) weights.
    Then ``model.embed_tokens`` (an Embedding: PEFT's ``lora_embedding_A`` / ``_B``) and,
    untied, ``lm_head`` (a Linear); a tied lm_head is refused by name.  ``padding_idx``:
    the folder's ``pad_token_id`` (config.json), whose row of the embedding adapter's A
    takes no gradient, as in torch (None: every row does)."""
    check_config_of(config, LlamaConfig, "llama_names")
    if padding_idx is not None:
        check_size(padding_idx, "padding_idx (the pad token id)", 0, config.vocab_size - 1)
    modules = []
    for i in range(config.num_layers):
        for group, names in (("self_attn", LLAMA_ATTENTION), ("mlp", LLAMA_MLP)):
            modules += [(torch_name, (hf_llama.npformer_name(torch_name),)) for torch_name
                        in (f"model.layers.{i}.{group}.{name}" for name in names)]
    modules.append(("model.embed_tokens", ("embed",)))  # an Embedding: its own adapter
    if not config.tie_weights:  # a Linear of its own
        return Naming((*modules, ("lm_head", ("lm_head",))), padding_idx=padding_idx)
    return Naming(tuple(modules), padding_idx=padding_idx,
                  refused=(("lm_head", "this model's lm_head is tied to model.embed_tokens "
                                       "(tie_word_embeddings): it is no layer of its own to "
                                       "adapt; adapt model.embed_tokens instead"),))


def apply_adapters(model: Module, naming: Naming, target_modules: str | Sequence[str], r: int,
                   alpha: float | None = None, dropout: float = 0.0) -> list[str]:
    """:func:`npformer.nn.lora.apply_lora` on the Linears of the torch modules that
    ``target_modules`` (PEFT's, in the torch model's names) choose; one A shared by the
    blocks of a fused one.  Returns the chosen torch modules' names."""
    named = [t for t in ([] if isinstance(target_modules, str) else target_modules)
             for refused, why in naming.refused if matches(refused, [t])]
    if named:
        why = next(why for refused, why in naming.refused if matches(refused, named))
        raise ValueError(f"target_modules {named[0]!r}: {why}")
    check_every_target_matches(target_modules, [name for name, _ in naming.modules],
                               "projections", "target_modules")
    chosen = naming.chosen(target_modules)
    apply_lora(model, [part for _, parts in chosen for part in parts], r, alpha, dropout)
    adapters = lora_layers(model)
    for layer in adapters.values():
        if isinstance(layer, LoRAEmbedding):
            layer.padding_idx = naming.padding_idx
    for _, parts in chosen:
        if len(parts) > 1:
            share_lora_a([adapters[part] for part in parts])
    return [name for name, _ in chosen]


# --------------------------------------------------------------------------- the files
def adapter_arrays(model: Module, naming: Naming) -> dict[str, np.ndarray]:
    """{PEFT key: array} of ``model``'s adapters (A^T (r, D_in), B^T (D_out, r)); an
    adapter on a layer ``naming`` does not name (an untied lm_head) is refused, not left
    out of the files."""
    adapters, out = lora_layers(model), {}
    named = {part for _, parts in naming.modules for part in parts}
    unnamed = [name for name in adapters if name not in named]
    if unnamed:
        raise ValueError(f"{type(model).__name__} holds LoRA adapters on {unnamed[:3]}, which "
                         "PEFT's names of this model do not cover (its projections: "
                         f"{', '.join(n for n, _ in naming.modules[:3])}, ...): the files "
                         "would leave them out")
    for name, parts in naming.modules:
        layers = [adapters.get(part) for part in parts]
        if all(layer is None for layer in layers):
            continue
        if any(layer is None for layer in layers) or len({id(lay.lora_A) for lay in layers}) > 1:
            raise ValueError(f"{name} is one projection in PEFT's model, but its npformer "
                             f"layers {list(parts)} do not hold one adapter (one A shared: "
                             "apply_adapters puts it there)")
        b = np.concatenate([backend.to_numpy(lay.lora_B.data) for lay in layers], axis=1)
        a_key, b_key = _KEYS[isinstance(layers[0], LoRAEmbedding)]
        out[f"{PREFIX}{name}.{a_key}"] = np.ascontiguousarray(
            backend.to_numpy(layers[0].lora_A.data).T)  # (r, D_in) or (r, V)
        out[f"{PREFIX}{name}.{b_key}"] = np.ascontiguousarray(b.T)  # (D_out, r) or (D, r)
    if not out:
        raise ValueError(f"{type(model).__name__} holds no LoRA adapters to save")
    return out


def adapter_config(model: Module, naming: Naming, base_model: str | os.PathLike | None = None,
                   task_type: str | None = None) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` of ``model``'s adapters (one rank, alpha, dropout).
    ``base_model``: the base model's Hub name or folder (a str or a path; None: unsaid);
    ``task_type``: PEFT's task type ("CAUSAL_LM") or None."""
    if isinstance(base_model, os.PathLike):
        base_model = os.fspath(base_model)
    if base_model is not None and not isinstance(base_model, str):
        raise TypeError(f"base_model must be the base model's Hub name or folder (a str or a "
                        f"path) or None, got {type(base_model).__name__}")
    if task_type is not None and not isinstance(task_type, str):
        raise TypeError(f"task_type must be PEFT's task type (a str, such as 'CAUSAL_LM') or "
                        f"None, got {type(task_type).__name__}")
    adapters = list(lora_layers(model).values())
    settings = {(a.r, a.alpha, a.dropout.p) for a in adapters}
    if len(settings) != 1:
        raise ValueError(f"PEFT's config holds one rank, alpha and dropout; the adapters have "
                         f"{sorted(settings)} (r, alpha, dropout)")
    (r, alpha, dropout), = settings
    targets = target_modules(sorted({_module_of(key)[0]
                                     for key in adapter_arrays(model, naming)}), naming)
    return {"peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model,
            "revision": None, "inference_mode": True, "r": r, "lora_alpha": alpha,
            "lora_dropout": dropout, "target_modules": targets,
            "fan_in_fan_out": naming.fan_in_fan_out, "init_lora_weights": True,
            **_UNSUPPORTED}


def target_modules(adapted: list[str], naming: Naming) -> list[str]:
    """PEFT's ``target_modules`` choosing exactly the modules ``adapted``: their last
    names ("c_attn") where those choose no other module, else their whole names."""
    short = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    exact = sorted(name for name, _ in naming.chosen(short)) == sorted(adapted)
    return short if exact else sorted(adapted)


def save_adapter(model: Module, folder: str | os.PathLike, naming: Naming,
                 base_model: str | os.PathLike | None = None,
                 task_type: str | None = None) -> Path:
    """Write ``folder``/adapter_model.safetensors and adapter_config.json (PEFT's layout:
    ``peft.PeftModel.from_pretrained(torch_model, folder)`` loads them).  Every argument is
    checked before anything is written, and the folder is written whole or not at all
    (:func:`npformer.hf.gpt2.write_files`)."""
    check_naming(naming)
    arrays = adapter_arrays(model, naming)  # refused before anything is written
    config = adapter_config(model, naming, base_model, task_type)
    folder = output_folder(folder, "folder", create=False)
    return write_weights_and_config(folder, arrays, config, weights_file=WEIGHTS_FILE,
                                    config_file=CONFIG_FILE)


def read_adapter_config(folder: Path) -> dict[str, Any]:
    """``folder``/adapter_config.json, refused unless npformer computes what it says."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: an adapter folder holds {CONFIG_FILE} "
                                f"and {WEIGHTS_FILE}")
    config = read_json_object(path.read_text(encoding="utf-8"), str(path),
                              expected="PEFT's adapter config")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type must be 'LORA', got {config.get('peft_type')!r}")
    for key, supported in _UNSUPPORTED.items():
        if config.get(key, supported) not in (supported, None) and not (
                supported == {} and not config.get(key)):
            raise ValueError(f"{path}: {key}={config[key]!r} is not implemented by npformer's "
                             f"LoRA (only {supported!r})")
    return config


def load_adapter(model: Module, folder: str | os.PathLike, naming: Naming) -> list[str]:
    """Put the adapters of a PEFT folder on ``model`` (its layers as the file names them,
    its rank, alpha and dropout; A and B from the file) and return their torch names.
    ``model`` must not hold adapters already."""
    folder = Path(check_path(folder, "folder"))
    check_naming(naming)
    config = read_adapter_config(folder)
    r, alpha, dropout = adapter_settings(config, folder / CONFIG_FILE)
    arrays = read_safetensors(folder / WEIGHTS_FILE, stacklevel=3)
    names = adapted_modules(arrays, folder / WEIGHTS_FILE)
    if lora_layers(model):
        raise ValueError(f"{type(model).__name__} holds adapters already: load {folder} into "
                         "the base model")
    known = dict(naming.modules)
    refused = [(name, why) for name, why in naming.refused if name in names]
    if refused:
        raise ValueError(f"{folder / WEIGHTS_FILE} adapts {refused[0][0]}: {refused[0][1]}")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"{folder / WEIGHTS_FILE} adapts {unknown[:3]}, which the model does "
                         "not have (another model's adapter?)")
    check_targets_are_the_file_s(config, names, naming, folder)
    _check_kinds(model, names, known, folder / WEIGHTS_FILE)
    apply_adapters(model, naming, list(names), r, alpha, dropout)
    adapters = lora_layers(model)
    for name in names:
        _set_adapter([adapters[part] for part in known[name]], arrays, name, names[name])
    return list(names)


def _check_kinds(model: Module, names: dict[str, str], known: dict, where: Path) -> None:
    """Each module's weights are of its kind: lora_embedding_A / _B on an Embedding,
    lora_A / lora_B on a Linear (another model's file, or a damaged one, otherwise)."""
    layers = dict(model.named_modules())
    for name, kind in names.items():
        is_table = isinstance(layers.get(known[name][0]), Embedding)
        if is_table != (kind == "embedding"):
            raise ValueError(f"{where}: {name} is {'an Embedding' if is_table else 'a Linear'} "
                             f"in the model, but the file holds "
                             f"{'lora_embedding_A/_B' if kind == 'embedding' else 'lora_A/lora_B'}"
                             f" for it ({'lora_embedding_A/_B' if is_table else 'lora_A/lora_B'}"
                             " expected)")


def adapter_settings(config: dict[str, Any], where: Path) -> tuple[int, float, float]:
    """(r, lora_alpha, lora_dropout) of an adapter config, each checked by kind and named
    with the file (a rank of 2.5 or "8", an alpha of "x" are refused, never rounded or
    parsed); lora_alpha absent is PEFT's default (null is refused), lora_dropout absent or
    null 0."""
    if "r" not in config:
        raise ValueError(f"{where} holds no rank r")
    alpha, dropout = config.get("lora_alpha", PEFT_DEFAULT_ALPHA), config.get("lora_dropout")
    if alpha is None:  # PEFT's scaling alpha / r would fail on it
        raise ValueError(f"{where}: lora_alpha is null: it must be a number > 0")
    try:
        return check_adapter_settings(config["r"], alpha, 0.0 if dropout is None else dropout)
    except ValueError as exc:  # a KindError too
        raise type(exc)(f"{where}: {exc}") from None


def check_targets_are_the_file_s(config: dict[str, Any], names: list[str], naming: Naming,
                                 folder: Path) -> None:
    """The modules the config's ``target_modules`` (less its ``exclude_modules``) choose in
    this model are the ones the weights file adapts (PEFT builds adapters on the first and
    fills them from the second): another model's folder (more layers, other targets) is
    refused naming the difference.  A config without target_modules is taken at the
    file's word."""
    targets, excluded = config.get("target_modules"), config.get("exclude_modules")
    if targets is None:
        return
    try:
        check_targets(targets)
        if excluded:
            check_targets(excluded)
    except TypeError as exc:
        raise ValueError(f"{folder / CONFIG_FILE}: target_modules / exclude_modules: "
                         f"{exc}") from None
    chosen = [name for name, _ in naming.chosen(targets)
              if not (excluded and matches(name, excluded))]
    if sorted(chosen) != sorted(names):
        only_config = [n for n in chosen if n not in names]
        only_file = [n for n in names if n not in chosen]
        raise ValueError(
            f"{folder / CONFIG_FILE}'s target_modules {targets!r} do not choose the modules "
            f"{folder / WEIGHTS_FILE} adapts: "
            + "; ".join(part for part in (
                f"chosen without weights: {_first(only_config)}" if only_config else "",
                f"weights not chosen: {_first(only_file)}" if only_file else "") if part)
            + " (another model's adapter, or one of other targets?)")


def check_naming(naming: Any) -> None:
    """``naming`` is a :class:`Naming` (:func:`llama_names`, :func:`gpt2_names`,
    :func:`same_names` make one)."""
    if not isinstance(naming, Naming):
        raise TypeError(f"naming must be a Naming (llama_names(config), gpt2_names(config) "
                        f"or same_names(model)), got {type(naming).__name__}")


# PEFT's keys of an adapter's A and B: a Linear's, an Embedding's (no ".weight")
_KEYS = {False: ("lora_A.weight", "lora_B.weight"),
         True: ("lora_embedding_A", "lora_embedding_B")}
BASE_WEIGHT = "base_layer.weight"  # an adapted embedding's (or lm_head's) whole table


def _module_of(key: str) -> tuple[str, str]:
    """(module, which) of a PEFT key ``PREFIX + module + "." + which``, which one of
    :data:`_KEYS`' or :data:`BASE_WEIGHT`; ("", "") for another key."""
    body = key[len(PREFIX):] if key.startswith(PREFIX) else ""
    for which in (*_KEYS[False], *_KEYS[True], BASE_WEIGHT):
        if body.endswith("." + which):
            return body[:-len(which) - 1], which
    return "", ""


def adapted_modules(arrays: dict[str, np.ndarray], where: Path) -> dict[str, str]:
    """{module name: "linear" or "embedding"} of a PEFT weights file, each module with
    exactly its A and B (PEFT's ``lora_A.weight`` / ``lora_B.weight``, or an Embedding's
    ``lora_embedding_A`` / ``lora_embedding_B``), and at most its ``base_layer.weight``
    (PEFT saves an adapted embedding's or lm_head's whole table too)."""
    names: dict[str, set[str]] = {}
    for key in arrays:
        module, which = _module_of(key)
        if not module:
            raise ValueError(f"{where}: {key!r} is not a LoRA weight in PEFT's names "
                             f"({PREFIX}NAME.lora_A.weight / .lora_B.weight, an embedding's "
                             f"NAME.lora_embedding_A / _B, NAME.{BASE_WEIGHT})")
        names.setdefault(module, set()).add(which)
    kinds = {}
    for name, held in names.items():
        pairs = [table for table, (a, b) in _KEYS.items() if a in held or b in held]
        if len(pairs) != 1 or not set(_KEYS[pairs[0]]) <= held:
            raise ValueError(f"{where}: {name} holds {sorted(held)}: an adapter holds its A "
                             "and its B (lora_A.weight and lora_B.weight, or an embedding's "
                             "lora_embedding_A and lora_embedding_B)")
        kinds[name] = "embedding" if pairs[0] else "linear"
    return kinds


def _set_adapter(layers: list[LoRALinear | LoRAEmbedding], arrays: dict[str, np.ndarray],
                 name: str, kind: str = "linear") -> None:
    """A and B of the torch module ``name`` into its npformer layers (B's column blocks);
    the module's ``base_layer.weight``, where the file holds one, into the frozen weight
    (as PEFT loads it)."""
    a_key, b_key = _KEYS[kind == "embedding"]
    a, b = (weight_array(arrays[key], key).T for key in (
        f"{PREFIX}{name}.{a_key}", f"{PREFIX}{name}.{b_key}"))  # (D_in, r), (r, D_out)
    widths = [getattr(layer, "out_features", None) or layer.embedding_dim for layer in layers]
    want_a, want_b = layers[0].lora_A.shape, (layers[0].r, sum(widths))
    if a.shape != want_a or b.shape != want_b:
        raise ValueError(f"{name}: {a_key} {a.shape[::-1]} and {b_key} "
                         f"{b.shape[::-1]} do not fit the model's layer: expected "
                         f"{want_a[::-1]} and {want_b[::-1]}")
    base_key = f"{PREFIX}{name}.{BASE_WEIGHT}"
    if base_key in arrays:
        if len(layers) != 1:
            raise ValueError(f"{base_key}: a fused projection's whole weight is not loaded "
                             "(npformer holds it as several layers)")
        table = weight_array(arrays[base_key], base_key)
        table = table if kind == "embedding" else table.T  # torch Linear: (D_out, D_in)
        if table.shape != tuple(layers[0].weight.shape):
            raise ValueError(f"{base_key} has shape {arrays[base_key].shape}, but the model's "
                             f"{name} weight is {tuple(layers[0].weight.shape)} in npformer's "
                             "layout (a resized vocabulary?)")
        weight = layers[0].weight.data
        weight[...] = backend.copy_like(np.ascontiguousarray(table), weight)  # in place
    layers[0].lora_A.data = backend.copy_like(np.ascontiguousarray(a), layers[0].lora_A.data)
    start = 0
    for layer, width in zip(layers, widths):
        block = np.ascontiguousarray(b[:, start:start + width])
        layer.lora_B.data = backend.copy_like(block, layer.lora_B.data)
        start += width

