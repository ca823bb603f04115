"""LoRA adapters in PEFT's files: ``adapter_model.safetensors`` and ``adapter_config.json``.

PEFT (``peft.PeftModel.save_pretrained``) writes, for each adapted module ``NAME`` of the
torch model, ``base_model.model.NAME.lora_A.weight`` (r, D_in) and
``base_model.model.NAME.lora_B.weight`` (D_out, r): the transposes of npformer's
``lora_A`` (D_in, r) and ``lora_B`` (r, D_out) (:mod:`npformer.nn.lora`), and the
config (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ...).

The names are the torch model's.  A :class:`Naming` says which npformer Linears each
torch module is: itself (:func:`same_names`: a model whose torch twin names its layers as
npformer does), or, for GPT-2 (:func:`gpt2_names`), ``transformer.h.{i}.attn.c_proj`` is
``blocks.{i}.self_attn.out_proj``, ``mlp.c_fc`` is ``ffn.linear1``, ``mlp.c_proj`` is
``ffn.linear2``, and the fused ``attn.c_attn`` (D -> 3D) is the three ``q_proj``,
``k_proj``, ``v_proj``: its adapter x A [B_q B_k B_v] is theirs with one A shared
(:func:`npformer.nn.lora.share_lora_a`) and B cut into its column blocks.
For Llama, Qwen2 and Qwen3 (:func:`llama_names`) each torch projection is one npformer
Linear, named as there less ``model.``: ``model.layers.{i}.self_attn.q_proj`` (PEFT's key
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``) is
``layers.{i}.self_attn.q_proj``.

* :func:`apply_adapters`: adapters on the layers PEFT's ``target_modules`` names choose;
* :func:`save_adapter` / :func:`load_adapter`: the two files, written and read (a folder
  PEFT wrote: adapters put on the layers it names, with its rank, alpha and dropout).

Refused by name: what npformer's adapters do not compute (``use_rslora``, DoRA, per-layer
``rank_pattern`` / ``alpha_pattern``, trained biases, another ``peft_type``); ``r``,
``lora_alpha``, ``lora_dropout`` of the wrong kind; ``target_modules`` (less
``exclude_modules``) that do not choose the modules the weights file adapts; A and B that
are not finite floats of the layers' shapes; on saving, an adapter the naming does not
cover.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import backend
from ..models.llama import LlamaConfig
from ..models.lm import CausalLMConfig
from ..nn.layers import Linear
from ..nn.lora import (
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
from ..ops.contracts import check_path, read_json_object
from .gpt2 import _first, output_folder, write_files

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

    def chosen(self, targets: str | Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
        """The (torch name, npformer names) that PEFT's ``target_modules`` choose."""
        return [(name, parts) for name, parts in self.modules if matches(name, targets)]


def same_names(model: Module) -> Naming:
    """Each Linear of ``model`` under its own name (a torch model named as npformer's)."""
    return Naming(tuple((name, (name,)) for name, m in model.named_modules()
                        if isinstance(m, (Linear, LoRALinear))))


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
    return Naming(tuple(modules), fan_in_fan_out=True)


def check_config_of(config: Any, config_class: type, function: str) -> None:
    """``config`` is a ``config_class`` (the model's ``.config``, not the model)."""
    if not isinstance(config, config_class):
        raise TypeError(f"{function} takes a {config_class.__name__} (the model's .config), "
                        f"got {type(config).__name__}")


LLAMA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # under self_attn
LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")  # under mlp


def llama_names(config: Any) -> Naming:
    """LlamaForCausalLM's (Qwen2's, Qwen3's) projections for a LlamaCausalLM of ``config``:
    ``model.layers.{i}.self_attn.q_proj`` is ``layers.{i}.self_attn.q_proj`` (npformer's
    names are Hugging Face's less ``model.``), and so for k, v, o and the feed-forward's
    ``mlp.gate_proj``, ``up_proj``, ``down_proj``; torch Linears, (D_out, D_in) weights."""
    check_config_of(config, LlamaConfig, "llama_names")
    modules = []
    for i in range(config.num_hidden_layers):
        for group, names in (("self_attn", LLAMA_ATTENTION), ("mlp", LLAMA_MLP)):
            modules += [(f"model.layers.{i}.{group}.{name}", (f"layers.{i}.{group}.{name}",))
                        for name in names]
    return Naming(tuple(modules), fan_in_fan_out=False)


def apply_adapters(model: Module, naming: Naming, target_modules: str | Sequence[str], r: int,
                   alpha: float | None = None, dropout: float = 0.0) -> list[str]:
    """:func:`npformer.nn.lora.apply_lora` on the Linears of the torch modules that
    ``target_modules`` (PEFT's, in the torch model's names) choose; one A shared by the
    blocks of a fused one.  Returns the chosen torch modules' names."""
    check_every_target_matches(target_modules, [name for name, _ in naming.modules],
                               "projections", "target_modules")
    chosen = naming.chosen(target_modules)
    apply_lora(model, [part for _, parts in chosen for part in parts], r, alpha, dropout)
    adapters = lora_layers(model)
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
        out[f"{PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(
            backend.to_numpy(layers[0].lora_A.data).T)  # (r, D_in)
        out[f"{PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(b.T)  # (D_out, r)
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
    targets = target_modules(sorted({key[len(PREFIX):].rsplit(".lora_", 1)[0]
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
    (:func:`npformer.interop.gpt2.write_files`)."""
    from safetensors.numpy import save_file

    check_naming(naming)
    arrays = adapter_arrays(model, naming)  # refused before anything is written
    config = adapter_config(model, naming, base_model, task_type)
    config_text = json.dumps(config, indent=2) + "\n"
    folder = output_folder(folder, "folder", create=False)
    return write_files(folder, {  # the config last
        WEIGHTS_FILE: lambda tmp: save_file(arrays, str(tmp), metadata={"format": "pt"}),
        CONFIG_FILE: lambda tmp: tmp.write_text(config_text, encoding="utf-8")})


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
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"{folder / WEIGHTS_FILE} adapts {unknown[:3]}, which the model does "
                         "not have (another model's adapter?)")
    check_targets_are_the_file_s(config, names, naming, folder)
    apply_adapters(model, naming, list(names), r, alpha, dropout)
    adapters = lora_layers(model)
    for name in names:
        _set_adapter([adapters[part] for part in known[name]], arrays, name)
    return list(names)


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


def adapted_modules(arrays: dict[str, np.ndarray], where: Path) -> list[str]:
    """The module names of a PEFT weights file, each with exactly its A and B."""
    names: dict[str, set[str]] = {}
    for key in arrays:
        body = key[len(PREFIX):] if key.startswith(PREFIX) else None
        module, _, which = (body or "").rpartition(".lora_")
        if body is None or which not in ("A.weight", "B.weight"):
            raise ValueError(f"{where}: {key!r} is not a LoRA weight in PEFT's names "
                             f"({PREFIX}NAME.lora_A.weight / .lora_B.weight)")
        names.setdefault(module, set()).add(which)
    incomplete = [n for n, kinds in names.items() if len(kinds) != 2]
    if incomplete:
        raise ValueError(f"{where}: {incomplete[:3]} hold lora_A or lora_B without the other")
    return list(names)


def _set_adapter(layers: list[LoRALinear], arrays: dict[str, np.ndarray], name: str) -> None:
    """A and B of the torch module ``name`` into its npformer layers (B's column blocks)."""
    a, b = (weight_array(arrays[key], key).T for key in (
        f"{PREFIX}{name}.lora_A.weight", f"{PREFIX}{name}.lora_B.weight"))  # (D_in, r), (r, D_out)
    widths = [layer.out_features for layer in layers]
    want_a, want_b = layers[0].lora_A.shape, (layers[0].r, sum(widths))
    if a.shape != want_a or b.shape != want_b:
        raise ValueError(f"{name}: lora_A.weight {a.shape[::-1]} and lora_B.weight "
                         f"{b.shape[::-1]} do not fit the model's projection: expected "
                         f"{want_a[::-1]} and {want_b[::-1]}")
    layers[0].lora_A.data = backend.copy_like(np.ascontiguousarray(a), layers[0].lora_A.data)
    start = 0
    for layer, width in zip(layers, widths):
        block = np.ascontiguousarray(b[:, start:start + width])
        layer.lora_B.data = backend.copy_like(block, layer.lora_B.data)
        start += width

