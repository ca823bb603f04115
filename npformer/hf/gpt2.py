"""GPT-2 checkpoints in Hugging Face's format: load one into a :class:`CausalLM`, save one.

A GPT-2 folder is what ``GPT2LMHeadModel.save_pretrained`` writes (the Hub's ``gpt2``...):

* ``config.json``: the sizes (``vocab_size``, ``n_positions``, ``n_embd``, ``n_layer``,
  ``n_head``, ``n_inner``), ``activation_function``, ``layer_norm_epsilon``,
  ``tie_word_embeddings``;
* ``model.safetensors`` (or shards named by ``model.safetensors.index.json``): the
  weights, under ``GPT2LMHeadModel``'s names (``transformer.h.0.attn.c_attn.weight``) or
  ``GPT2Model``'s (without ``transformer.``, as the Hub's ``gpt2`` holds them);
* ``tokenizer.json``: GPT-2's byte-level BPE, read with the ``tokenizers`` library
  (:class:`Tokenizer`).

The weights map one to one onto :class:`npformer.models.CausalLM` (heads are the same
column blocks on both sides):

| Hugging Face (``transformer.`` dropped) | npformer (``blocks.i.`` as ``b.``)          |
|-----------------------------------------|---------------------------------------------|
| ``wte.weight`` (V, D)                   | ``embed.tokens.weight``                     |
| ``wpe.weight`` (T, D)                   | ``embed.positions.weight``                  |
| ``h.i.ln_1``, ``h.i.ln_2``              | ``b.attn_residual.norm``, ``b.ffn_residual.norm`` |
| ``h.i.attn.c_attn.weight`` (D, 3D)      | ``b.self_attn.{q,k,v}_proj.weight``: columns |
| ``h.i.attn.c_attn.bias`` (3D,)          | ``b.self_attn.{q,k,v}_proj.bias``           |
| ``h.i.attn.c_proj``                     | ``b.self_attn.out_proj``                    |
| ``h.i.mlp.c_fc``, ``h.i.mlp.c_proj``    | ``b.ffn.linear1``, ``b.ffn.linear2``        |
| ``ln_f``                                | ``norm``                                    |
| ``lm_head.weight`` (V, D), untied only  | ``lm_head.weight`` (D, V): transposed       |

GPT-2's ``Conv1D`` layers hold their weights as (in, out), npformer's :class:`Linear`
layout: only the untied head (a ``torch.nn.Linear``) is transposed.  The causal-mask
buffers of older checkpoints (``attn.bias``, ``attn.masked_bias``) are skipped.

Refused by name, never approximated (docs/gpt2.md, "What is refused"): another
``model_type`` or architecture (:data:`ARCHITECTURES`), the options of
:data:`REFUSED_OPTIONS`, an activation not in :data:`ACTIVATIONS`.  Not read: Hugging
Face's dropout probabilities (training settings: pass ``dropout=``) and
``reorder_and_upcast_attn`` (float16 arithmetic only).

A name that is not a folder (``"gpt2"``) is downloaded from the Hub into the user's cache
(``huggingface_hub`` and ``tokenizers``: the ``hf`` extra, imported only when used).  The
entries, :meth:`CausalLM.from_pretrained` and :meth:`CausalLM.save_pretrained` (and
:func:`npformer.interop.auto.from_pretrained`), pass their class to :func:`load_folder`
and :func:`save_folder`: this module imports no model.
"""
from __future__ import annotations

import json
import numbers
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import backend
from ..nn import Module
from ..nn.state import read_safetensors
from ..ops.contracts import (
    check_choice,
    check_flag,
    check_heads_divide,
    check_path,
    check_probability,
    check_size,
    read_json_object,
    shown,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded weights: {"weight_map": {name: file}}
TOKENIZER_FILE = "tokenizer.json"
GENERATION_FILE = "generation_config.json"  # generate's settings: its eos_token_id first
HUB_FILES = [CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX, "model-*.safetensors", TOKENIZER_FILE,
             GENERATION_FILE]  # generate's settings (its eos_token_id)
HUB_EXAMPLES = {"GPT-2": "gpt2",  # a kind of checkpoint -> a Hub name of one
                "Llama or Qwen": "HuggingFaceTB/SmolLM2-135M",
                "GPT-2, Llama or Qwen": "gpt2"}
# weights npformer does not read -> from_pretrained's argument that reads them
OTHER_FORMATS = {"pytorch_model.bin": "", "pytorch_model.bin.index.json": "",
                 "tf_model.h5": ", from_tf=True", "flax_model.msgpack": ", from_flax=True"}

# Hugging Face's activation_function -> npformer's (the same function); save writes the
# first name of each.
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu": "gelu", "gelu_python": "gelu",
               "relu": "relu"}
ACTIVATION_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")  # the language model, or its body alone
BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")  # causal masks, not weights
REFUSED_OPTIONS = {  # config.json key: (the value npformer computes, what it means)
    "add_cross_attention": (False, "cross-attention over an encoder's output"),
    "scale_attn_by_inverse_layer_idx": (False, "scores scaled by 1 / (layer index + 1)"),
    "scale_attn_weights": (True, "unscaled attention scores (no 1 / sqrt(head width))"),
}


class PretrainedError(ValueError):
    """A folder, config, weights file or tokenizer that is not a GPT-2 checkpoint npformer
    can load, or a model that GPT-2's format cannot hold: the message names it."""


# --------------------------------------------------------------------------- the folder
def resolve(name_or_path: str | os.PathLike, kind: str = "GPT-2") -> Path:
    """The folder of a checkpoint: ``name_or_path`` itself when it is a folder, else a
    Hub name (``"gpt2"``, ``"openai-community/gpt2"``) downloaded into the user's cache;
    ``kind``: the checkpoints the caller loads, as its messages name them."""
    path = Path(check_path(name_or_path, "name_or_path")).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise PretrainedError(f"{path} is a file: a {kind} checkpoint is a folder holding "
                              f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    name = str(name_or_path)
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) or name.startswith((".", "-")):
        raise FileNotFoundError(f"no folder at {name} (and it is not a Hugging Face Hub "
                                f"name such as {HUB_EXAMPLES.get(kind, 'gpt2')!r})")
    return _download(name, kind)


def _download(name: str, kind: str = "GPT-2") -> Path:
    """The Hub repository ``name``'s checkpoint files, fetched into the user's cache."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise PretrainedError(f"{name!r} is not a folder here, and downloading it from the "
                              "Hugging Face Hub needs huggingface_hub: pip install "
                              f"\"npformer[hf]\" (or give the path of a {kind} folder)"
                              ) from None
    try:
        return Path(snapshot_download(repo_id=name, allow_patterns=HUB_FILES))
    except Exception as exc:  # no network, an unknown repository, a refused download
        raise PretrainedError(f"could not download {name!r} from the Hugging Face Hub "
                              f"({type(exc).__name__}: {exc}); without the network, give the "
                              f"path of a {kind} folder") from None


def read_config(folder: Path) -> dict:
    """config.json of a GPT-2 folder, refused naming the folder if missing or not JSON."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise PretrainedError(f"{folder} has no {CONFIG_FILE}: a GPT-2 folder holds "
                              f"{CONFIG_FILE} and {WEIGHTS_FILE} (as "
                              "GPT2LMHeadModel.save_pretrained writes them)")
    return _json_object(path, "a GPT-2 config")


def _json_object(path: Path, expected: str, required: tuple[str, ...] = ()) -> dict:
    """The JSON object of the file ``path`` (:func:`read_json_object`), its faults a
    PretrainedError naming the file."""
    try:
        return read_json_object(path.read_text(encoding="utf-8"), str(path), required,
                                expected)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PretrainedError(f"{path} is not readable: {exc}" if isinstance(
            exc, (OSError, UnicodeDecodeError)) else str(exc)) from None


# --------------------------------------------------------------------------- the config
def config_from_hf(values: dict, config_class: type, dropout: float = 0.0,
                   where: str = CONFIG_FILE) -> Any:
    """The ``config_class`` (:class:`CausalLMConfig`) of a GPT-2 config.json's ``values``;
    what npformer cannot compute is refused naming the key (see the module docstring)."""
    model_type = values.get("model_type")
    if model_type != "gpt2":
        raise PretrainedError(f"{where} describes a {model_type!r} model (model_type): "
                              "npformer loads GPT-2 checkpoints (model_type 'gpt2')")
    architectures = architectures_of(values, where, "GPT2LMHeadModel") or ["GPT2LMHeadModel"]
    other = [a for a in architectures if a not in ARCHITECTURES]
    if other:
        raise PretrainedError(f"{where} holds a {', '.join(other)} (architectures): npformer "
                              f"loads GPT-2's language model ({', '.join(ARCHITECTURES)})")
    for key, (computed, meaning) in REFUSED_OPTIONS.items():
        if key in values and _switch(values, key, computed, where) != computed:
            raise PretrainedError(f"{where} sets {key} = {values[key]!r} ({meaning}): "
                                  "npformer's CausalLM has no equivalent")
    activation = values.get("activation_function", "gelu_new")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise PretrainedError(f"{where} sets activation_function = {activation!r}: npformer "
                              f"computes {sorted(ACTIVATIONS)}")
    sizes = {}
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        if key not in values:
            raise PretrainedError(f"{where} has no {key!r}")
        sizes[key] = values[key]
    d_model = sizes["n_embd"]
    d_ff = values.get("n_inner")  # None: 4 n_embd (as transformers reads it; 0 is not None)
    if d_ff is None:
        d_ff = 4 * d_model if isinstance(d_model, int) else d_model
    try:
        if isinstance(d_model, int) and isinstance(sizes["n_head"], int) and sizes["n_head"]:
            check_heads_divide(d_model, sizes["n_head"], "n_embd", "n_head", hint="")
        return config_class(vocab_size=sizes["vocab_size"], block_size=sizes["n_positions"],
                              d_model=d_model, num_heads=sizes["n_head"],
                              num_layers=sizes["n_layer"], d_ff=d_ff, dropout=dropout,
                              activation=ACTIVATIONS[activation], norm_first=True,
                              positional="learned",
                              tie_weights=_switch(values, "tie_word_embeddings", True, where),
                              norm_eps=values.get("layer_norm_epsilon", 1e-5))
    except ValueError as exc:
        raise PretrainedError(f"{where} does not make a model: {exc}") from None


def architectures_of(values: dict, where: str, example: str) -> list[str]:
    """config.json's ``architectures``: a list of class names (``example`` one), [] where
    absent or null; anything else (a str, whose letters would be read as the names) is
    refused."""
    architectures = values.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str)
                                                      for a in architectures):
        raise PretrainedError(f"{where} sets architectures = {architectures!r}: it must be a "
                              f"list of class names, e.g. [\"{example}\"]")
    return architectures


def _switch(values: dict, key: str, default: bool, where: str) -> bool:
    """config.json's boolean ``key`` (``default`` where absent): a JSON true or false, never
    a string ("false") or a number read for its truth."""
    try:
        return check_flag(values.get(key, default), key)
    except TypeError as exc:
        raise PretrainedError(f"{where}: {exc} (JSON true or false)") from None


def config_to_hf(config: Any) -> dict:
    """The GPT-2 config.json of a :class:`CausalLMConfig`; a model GPT-2 cannot be (post-norm,
    sinusoidal positions, heads of another width, narrow heads, qk_norm) is refused by
    name."""
    c = config
    cannot = [what for what, yes in (
        ("post-norm blocks (norm_first=False)", not c.norm_first),
        ("sinusoidal positions", c.positional != "learned"),
        (f"heads of width {c.head_dim} (GPT-2's are n_embd / n_head)",
         c.head_dim not in (None, c.d_model // c.num_heads)
         or c.d_model % c.num_heads != 0),
        ("narrow heads", c.narrow_heads), ("qk_norm", c.qk_norm)) if yes]
    if cannot:
        raise PretrainedError(f"GPT-2's format cannot hold a model with {', '.join(cannot)}")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": c.vocab_size, "n_positions": c.block_size, "n_embd": c.d_model,
            "n_layer": c.num_layers, "n_head": c.num_heads, "n_inner": c.d_ff,
            "activation_function": ACTIVATION_NAMES[c.activation],
            "layer_norm_epsilon": c.norm_eps, "tie_word_embeddings": c.tie_weights,
            "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "add_cross_attention": False, "use_cache": True}


# --------------------------------------------------------------------------- the weights
def weight_map(config: Any) -> list[tuple[str, tuple, tuple[str, ...], str]]:
    """(Hugging Face name, its shape, npformer names, kind) of every GPT-2 weight: kind
    "copy" (the same array), "columns" (the npformer arrays are the Hugging Face one's
    column blocks: q, k, v) or "transpose" (the untied head, a torch Linear)."""
    v, t, d, f = config.vocab_size, config.block_size, config.d_model, config.d_ff
    rows = [("transformer.wte.weight", (v, d), ("embed.tokens.weight",), "copy"),
            ("transformer.wpe.weight", (t, d), ("embed.positions.weight",), "copy")]
    for i in range(config.num_layers):
        h, n = f"transformer.h.{i}.", f"blocks.{i}."
        qkv = tuple(f"{n}self_attn.{p}_proj." for p in "qkv")
        rows += [
            (h + "ln_1.weight", (d,), (n + "attn_residual.norm.weight",), "copy"),
            (h + "ln_1.bias", (d,), (n + "attn_residual.norm.bias",), "copy"),
            (h + "attn.c_attn.weight", (d, 3 * d), tuple(p + "weight" for p in qkv), "columns"),
            (h + "attn.c_attn.bias", (3 * d,), tuple(p + "bias" for p in qkv), "columns"),
            (h + "attn.c_proj.weight", (d, d), (n + "self_attn.out_proj.weight",), "copy"),
            (h + "attn.c_proj.bias", (d,), (n + "self_attn.out_proj.bias",), "copy"),
            (h + "ln_2.weight", (d,), (n + "ffn_residual.norm.weight",), "copy"),
            (h + "ln_2.bias", (d,), (n + "ffn_residual.norm.bias",), "copy"),
            (h + "mlp.c_fc.weight", (d, f), (n + "ffn.linear1.weight",), "copy"),
            (h + "mlp.c_fc.bias", (f,), (n + "ffn.linear1.bias",), "copy"),
            (h + "mlp.c_proj.weight", (f, d), (n + "ffn.linear2.weight",), "copy"),
            (h + "mlp.c_proj.bias", (d,), (n + "ffn.linear2.bias",), "copy")]
    rows += [("transformer.ln_f.weight", (d,), ("norm.weight",), "copy"),
             ("transformer.ln_f.bias", (d,), ("norm.bias",), "copy")]
    if not config.tie_weights:
        rows.append(("lm_head.weight", (v, d), ("lm_head.weight",), "transpose"))
    return rows


def _first(names: list[str], shown: int = 3) -> list[str]:
    """The first few of a long list of problems, and how many more there are."""
    return names if len(names) <= shown else names[:shown] + [f"and {len(names) - shown} more"]


def to_hf(arrays: dict[str, np.ndarray], config: Any) -> dict[str, np.ndarray]:
    """npformer's arrays by parameter name (the weights, or their gradients) -> GPT-2's
    by Hugging Face name (GPT2LMHeadModel's), C-contiguous."""
    out = {}
    for hf_name, _, names, kind in weight_map(config):
        parts = [np.asarray(arrays[n]) for n in names]
        joined = np.concatenate(parts, axis=-1) if kind == "columns" else \
            parts[0].T if kind == "transpose" else parts[0]
        out[hf_name] = np.ascontiguousarray(joined)
    return out


def _with_prefix(state: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """``state`` under GPT2LMHeadModel's names (``transformer.`` before the body's); a
    weight held under both names (``ln_f.bias`` and ``transformer.ln_f.bias``) is refused
    naming both: which copy to load is not npformer's guess."""
    out: dict[str, np.ndarray] = {}
    given: dict[str, str] = {}
    for name, array in state.items():
        full = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
        if full in out:
            first, second = sorted((given[full], name))
            raise PretrainedError(f"{where} holds one weight under two names, {first!r} and "
                                  f"{second!r}: keep one of them")
        out[full], given[full] = array, name
    return out


def from_hf(state: dict[str, np.ndarray], config: Any, where: str = WEIGHTS_FILE
            ) -> dict[str, np.ndarray]:
    """GPT-2's arrays by Hugging Face name (with or without ``transformer.``) ->
    npformer's by parameter name.  Every name and shape is checked against the config
    first; a missing or unexpected weight, or one of another shape, is refused naming it."""
    state = _with_prefix(state, where)
    for name in [n for n in state if BUFFERS.fullmatch(n.removeprefix("transformer."))]:
        del state[name]  # the causal mask of older checkpoints: computed, not loaded
    if config.tie_weights and "lm_head.weight" in state:  # the tied head, saved twice
        if not np.array_equal(state["lm_head.weight"], state["transformer.wte.weight"]):
            raise PretrainedError(f"{where} holds an lm_head.weight other than wte.weight, "
                                  "but config.json ties them (tie_word_embeddings): set "
                                  "tie_word_embeddings to false to load the head apart")
        del state["lm_head.weight"]
    check_weights_match(state, {hf_name: shape for hf_name, shape, _, _ in weight_map(config)},
                        f"{where} does not hold the GPT-2 weights config.json describes")
    out = {}
    for hf_name, _, names, kind in weight_map(config):
        array = state[hf_name]
        if kind == "copy":
            out[names[0]] = array
        elif kind == "transpose":
            out[names[0]] = array.T
        else:
            out.update(zip(names, np.split(array, len(names), axis=-1)))
    return out


# --------------------------------------------------------------------------- load and save
def load_folder(model_class: type, name_or_path: str | os.PathLike,
                dtype: str | None = None, dropout: float = 0.0) -> Module:
    """A ``model_class`` (either tier's :class:`CausalLM`, on the current backend, in
    training mode) holding a GPT-2 folder or Hub name (``"gpt2"``).  ``dtype``: "float32"
    or "float64" (default: the backend's default float); ``dropout``: npformer's, for
    fine-tuning (Hugging Face's probabilities are not read)."""
    if dtype is not None:
        check_choice(dtype, backend.FLOAT_DTYPES, "dtype")
    dropout = check_probability(dropout, "dropout")  # the caller's, not config.json's
    folder = resolve(name_or_path)
    config = config_from_hf(read_config(folder), model_class.config_class, dropout,
                            str(folder / CONFIG_FILE))
    state = from_hf(_read_weights(folder), config, str(folder / WEIGHTS_FILE))
    model = backend.built_in(dtype, model_class, config)
    model.load_state_dict(state)
    return model


def _read_weights(folder: Path, model_class: str = "GPT2LMHeadModel") -> dict[str, np.ndarray]:
    """Every tensor of the folder's model.safetensors, or of the shards its index names;
    ``model_class``: the transformers class that reads the folder's other formats (a
    ``pytorch_model.bin``), which the message tells to convert them."""
    index = folder / WEIGHTS_INDEX
    if not (folder / WEIGHTS_FILE).is_file() and index.is_file():
        weight_map = _json_object(index, "a safetensors index", ("weight_map",))["weight_map"]
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and v for v in weight_map.values()):
            raise PretrainedError(f"{index} is not a safetensors index: its \"weight_map\" "
                                  "must map each weight's name to a file's name")
        shards = sorted(set(weight_map.values()))
        state, held_by = {}, {}
        for shard in shards:
            for name, array in _read_file(folder / shard).items():
                if name in state:
                    raise PretrainedError(f"{name} is in two shards, {held_by[name]} and "
                                          f"{shard} (of {index}): keep one")
                state[name], held_by[name] = array, shard
        return state
    if not (folder / WEIGHTS_FILE).is_file():
        others = [name for name in OTHER_FORMATS if (folder / name).is_file()]
        hint = (f"; it holds {others[0]}, which npformer does not read (no pickles): "
                f"convert it with transformers ({model_class}.from_pretrained(folder"
                f"{OTHER_FORMATS[others[0]]}).save_pretrained(folder) writes "
                "model.safetensors)") if others else ""
        raise PretrainedError(f"{folder} has no {WEIGHTS_FILE}{hint}")
    return _read_file(folder / WEIGHTS_FILE)


def _read_file(path: Path) -> dict[str, np.ndarray]:
    try:
        return read_safetensors(path, stacklevel=5)
    except (FileNotFoundError, ValueError) as exc:
        raise PretrainedError(str(exc)) from None


def save_folder(model: Module, path: str | os.PathLike, tokenizer: Tokenizer | None = None
                ) -> Path:
    """Write ``model`` as a Hugging Face GPT-2 folder at ``path`` (created if needed):
    ``config.json`` and ``model.safetensors`` (and ``tokenizer.json`` given a
    :class:`Tokenizer`), which ``transformers.GPT2LMHeadModel.from_pretrained(path)``
    loads with the same logits.  The weights keep the model's dtype."""
    if getattr(model, "kind", None) != "causal_lm":
        raise TypeError(f"save_pretrained writes a CausalLM, got {type(model).__name__}")
    hf_config = config_to_hf(model.config)
    if tokenizer is not None:
        tokenizer = as_tokenizer(tokenizer)
        check_tokenizer(tokenizer, model)
    weights = to_hf({name: backend.to_numpy(p.data) for name, p in model.named_parameters()},
                    model.config)
    folder = output_folder(path, create=False)
    hf_config["torch_dtype"] = next(iter(weights.values())).dtype.name
    if tokenizer is not None and tokenizer.eos_id is not None:
        hf_config["bos_token_id"] = tokenizer.eos_ids[0]
        hf_config["eos_token_id"] = tokenizer.eos_id
    extra = {} if tokenizer is None else {TOKENIZER_FILE: tokenizer.save}
    return write_weights_and_config(folder, weights, hf_config, extra)


def output_folder(path: Any, what: str = "path", create: bool = True) -> Path:
    """The folder a save writes into (``path``, a non-empty path; ``what``: the argument's
    name), created if needed (``create``); a path that is a file, or lies under one, is
    refused naming the file."""
    folder = Path(check_path(path, what))
    for place in (folder, *folder.parents):
        if place.exists():
            if not place.is_dir():
                raise NotADirectoryError(f"cannot save into the folder {folder} ({what}): "
                                         f"{place} is a file, not a folder")
            break
    if create:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_files(folder: Path, files: dict[str, Callable[[Path], Any]]) -> Path:
    """Write a folder's files whole or not at all: each ``write(tmp)`` of ``files`` ({file
    name: write}) into a temporary folder beside ``folder``; then a new folder is renamed
    into place in one step, or, into an existing one, each file replaces its namesake in
    one step (in ``files``' order: the config last).  A write that fails (a value JSON
    refuses, a full disk) leaves ``folder`` as it was, without a temporary in it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name or 'folder'}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        for name, write in files.items():
            write(staging / name)
        if not folder.exists():
            os.rename(staging, folder)
        else:
            for name in files:
                os.replace(staging / name, folder / name)
    except Exception as exc:
        if not is_write_error(exc):
            raise
        raise OSError(getattr(exc, "errno", None), f"could not save into {folder}: "
                      f"{getattr(exc, 'strerror', None) or exc} (the folder is as it was)"
                      ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def write_weights_and_config(folder: Path, weights: dict[str, np.ndarray], config: dict,
                             extra: dict[str, Callable[[Path], Any]] | None = None,
                             weights_file: str = WEIGHTS_FILE,
                             config_file: str = CONFIG_FILE) -> Path:
    """``weights`` as safetensors (PyTorch's metadata), ``extra`` ({file name: write}),
    then ``config`` as JSON, last, into ``folder`` whole or not at all (:func:`write_files`)."""
    from safetensors.numpy import save_file

    text = json.dumps(config, indent=2) + "\n"
    return write_files(folder, {
        weights_file: lambda tmp: save_file(weights, str(tmp), metadata={"format": "pt"}),
        **(extra or {}), config_file: lambda tmp: tmp.write_text(text, encoding="utf-8")})


def check_weights_match(state: dict, expected: dict, refusal: str) -> None:
    """A PretrainedError (``refusal``: the message's start) where ``state`` ({name: array})
    lacks a weight of ``expected`` ({name: shape}), holds one it does not name, or one of
    another shape: the first few of each named."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{n} {tuple(state[n].shape)} (config.json's sizes give {expected[n]})"
             for n in sorted(set(expected) & set(state)) if tuple(state[n].shape) != expected[n]]
    if missing or unexpected or wrong:
        problems = ([f"missing {_first(missing)}"] if missing else []) + \
                   ([f"unexpected {_first(unexpected)}"] if unexpected else []) + \
                   ([f"shapes: {'; '.join(_first(wrong))}"] if wrong else [])
        raise PretrainedError(f"{refusal}: {' | '.join(problems)}")


def is_write_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the file system refusing a write (a full disk, a read-only
    folder): an OSError, or safetensors' SafetensorError saying so."""
    return isinstance(exc, OSError) or type(exc).__name__ == "SafetensorError"


# --------------------------------------------------------------------------- the tokenizer
class Tokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library:
    ``encode(text) -> ids``, ``decode(ids) -> text``; ``eos_id``, the end of a text
    (config.json's ``eos_token_id``, else the ``<|endoftext|>`` token, else None): an id,
    or a list of ids as transformers' ``eos_token_id`` (Llama 3's); ``eos_ids``, the tuple
    of them.  :func:`npformer.decoding.generate` takes either as its ``eos_id``."""

    def __init__(self, tokenizer: Any, eos_id: int | list[int] | None = None):
        self._tokenizer = tokenizer
        self.eos_id = check_eos_ids(eos_id, "eos_id")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every end-of-text id: (eos_id,), the listed ones, or () for None."""
        eos = self.eos_id
        return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)

    @classmethod
    def from_file(cls, path: str | os.PathLike, eos_id: int | list[int] | None = None
                  ) -> Tokenizer:
        """A tokenizer.json file; ``eos_id`` (default: its ``<|endoftext|>`` token)."""
        try:
            from tokenizers import Tokenizer as Tokenizers
        except ImportError:
            raise PretrainedError("reading tokenizer.json needs the tokenizers library: pip "
                                  "install \"npformer[hf]\"") from None
        path = Path(check_path(path, "path"))
        if not path.is_file():
            raise PretrainedError(f"no {TOKENIZER_FILE} at {path}")
        try:
            inner = Tokenizers.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception subclasses
            raise PretrainedError(f"{path} is not a readable tokenizer.json: {exc}") from None
        if eos_id is None:
            eos_id = inner.token_to_id("<|endoftext|>")
        return cls(inner, eos_id)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike) -> Tokenizer:
        """The tokenizer.json of a folder or Hub name of any family; its end of text:
        GPT-2's config.json's ``eos_token_id`` or, for the others, :func:`eos_of`'s."""
        folder = resolve(name_or_path)
        if not (folder / TOKENIZER_FILE).is_file():
            raise PretrainedError(f"{folder} has no {TOKENIZER_FILE} (the tokenizer): "
                                  "tokenize the text yourself (from_pretrained loads the "
                                  "model alone), or add the checkpoint's tokenizer.json")
        values = read_config(folder) if (folder / CONFIG_FILE).is_file() else {}
        if values.get("model_type", "gpt2") != "gpt2":
            return cls.from_file(folder / TOKENIZER_FILE, eos_of(folder))
        eos = values.get("eos_token_id")
        return cls.from_file(folder / TOKENIZER_FILE, eos if _is_eos(eos) else None)

    @property
    def vocab_size(self) -> int:
        """The number of ids, special tokens included: every id is below it."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return list(self._tokenizer.encode(text).ids)

    def decode(self, ids: Any) -> str:
        """Token ids (integers in [0, vocab_size)) -> the text."""
        if isinstance(ids, (str, bytes)):
            raise TypeError(f"decode takes token ids (integers), got a {type(ids).__name__}")
        ids = [check_size(i, f"ids[{n}]", 0) for n, i in enumerate(ids)]
        bad = next((n for n, i in enumerate(ids) if i >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"ids[{bad}] = {ids[bad]} is outside the tokenizer's vocabulary "
                             f"of {self.vocab_size}")
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` at ``path`` (a file name; its folder is created)."""
        path = Path(check_path(path, "path"))
        if path.is_dir():
            raise IsADirectoryError(f"Tokenizer.save: path {path} is a folder; give a file "
                                    "name such as tokenizer.json")
        output_folder(path.parent, "path's folder")  # created; a file in the way refused
        self._tokenizer.save(str(path))


def as_tokenizer(tokenizer: Any) -> Tokenizer:
    """A :class:`Tokenizer` of ``tokenizer``: itself, a transformers "fast" tokenizer
    (its ``backend_tokenizer``, its ``eos_token_id`` kept) or a ``tokenizers.Tokenizer``;
    anything else is refused naming what is expected."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    inner = getattr(tokenizer, "backend_tokenizer", None)
    if inner is not None:  # transformers' PreTrainedTokenizerFast
        eos = getattr(tokenizer, "eos_token_id", None)
        return Tokenizer(inner, eos if isinstance(eos, int) else inner.token_to_id(
            "<|endoftext|>"))
    if type(tokenizer).__module__.split(".")[0] == "tokenizers" and \
            hasattr(tokenizer, "token_to_id"):
        return Tokenizer(tokenizer, tokenizer.token_to_id("<|endoftext|>"))
    raise TypeError(f"tokenizer must be an npformer.hf.gpt2.Tokenizer (Tokenizer.from_file "
                    "or Tokenizer.from_pretrained), a tokenizers.Tokenizer or a transformers "
                    f"fast tokenizer, got {type(tokenizer).__name__}; a slow transformers "
                    "tokenizer has no tokenizer.json: load it with use_fast=True")


def check_tokenizer(tokenizer: Tokenizer, model: Module) -> None:
    """Every id the tokenizer gives must be one of the model's: its vocabulary must fit
    in the model's (a model may have more rows, as GPT-2 models padded to 50304 do)."""
    vocab = model.config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise PretrainedError(f"the tokenizer's vocabulary ({tokenizer.vocab_size} tokens) is "
                              f"not the model's ({vocab} token embeddings): its ids up to "
                              f"{tokenizer.vocab_size - 1} would have no embedding; use the "
                              "tokenizer the model was trained with")
    outside = [i for i in tokenizer.eos_ids if not 0 <= i < vocab]
    if outside:
        raise PretrainedError(f"the end-of-text id {outside[0]} is outside the model's "
                              f"vocabulary of {vocab}")


def _is_eos(value: Any) -> bool:
    """An end-of-text id as config.json holds it: an integer or a non-empty list of them."""
    def integer(v):
        return isinstance(v, int) and not isinstance(v, bool)
    return integer(value) or (isinstance(value, list) and bool(value)
                              and all(integer(v) for v in value))


def eos_of(folder: Path) -> int | list[int] | None:
    """The ids that end a text, where transformers' ``generate`` takes them:
    generation_config.json's ``eos_token_id`` where it sets one, else config.json's as the
    file holds it (no family default).  None (neither sets one) leaves the tokenizer's
    ``<|endoftext|>``.  A list (Llama 3's ``[128001, 128009]``) is kept whole."""
    generation = folder / GENERATION_FILE
    settings = _json_object(generation, "a generation config") if generation.is_file() \
        else {}
    path = generation if settings.get("eos_token_id") is not None else folder / CONFIG_FILE
    if path != generation:
        settings = _json_object(path, "a model config")
    eos = settings.get("eos_token_id")
    if eos is not None and not _is_eos(eos):  # as transformers' config classes check it
        raise PretrainedError(f"{path} sets eos_token_id = {shown(eos)}: eos_token_id takes "
                              f"an integer or a list of integers or null, not a "
                              f"{type(eos).__name__}")
    if any(i < 0 for i in (eos if isinstance(eos, list) else [] if eos is None else [eos])):
        raise PretrainedError(f"{path} sets eos_token_id = {shown(eos)}: token ids are >= 0")
    return eos


def check_eos_ids(value: Any, what: str) -> int | list[int] | None:
    """None, an id >= 0, or a non-empty list (or tuple) of them, returned as a list: the
    end-of-text ids of a tokenizer or of generation; anything else a TypeError or
    ValueError naming ``what``."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{what} must be an id or a non-empty list of ids, got "
                             f"{value!r}")
        return [check_size(v, f"{what}[{n}]", 0) for n, v in enumerate(value)]
    if value is not None and (isinstance(value, (bool, np.bool_, str))
                              or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{what} must be an id (an integer), a list of ids or None, got "
                        f"{value!r} ({type(value).__name__})")
    return check_size(value, what, 0, optional=True)


__all__ = ["load_folder", "save_folder", "Tokenizer", "eos_of", "check_tokenizer",
           "config_from_hf", "config_to_hf", "from_hf", "to_hf", "weight_map", "resolve",
           "read_config", "PretrainedError", "as_tokenizer"]
