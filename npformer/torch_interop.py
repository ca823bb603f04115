"""Weights to and from PyTorch, without importing PyTorch.

npformer layers have the same computations as these PyTorch modules, so their
weights move across unchanged apart from layout:

| npformer                         | PyTorch                                               |
|----------------------------------|-------------------------------------------------------|
| ``nn.Linear``                    | ``torch.nn.Linear`` (weight transposed)               |
| ``nn.LayerNorm``                 | ``torch.nn.LayerNorm``                                |
| ``nn.Embedding``                 | ``torch.nn.Embedding``                                |
| ``nn.LearnedPositionalEmbedding``| ``torch.nn.Embedding(max_len, d_model)``              |
| ``nn.MultiHeadAttention``        | ``torch.nn.MultiheadAttention(batch_first=True)``     |
| ``nn.EncoderBlock``              | ``torch.nn.TransformerEncoderLayer(batch_first=True)``|
| ``nn.DecoderBlock``              | ``torch.nn.TransformerDecoderLayer(batch_first=True)``|

Usage::

    torch_state = torch_module.state_dict()              # tensors or NumPy arrays
    load_torch_state_dict(npformer_layer, torch_state)   # shape-checked
    torch_module.load_state_dict({k: torch.from_numpy(v)
                                  for k, v in to_torch_state_dict(npformer_layer).items()})

Conversion rules per layer type live in :data:`RULES`; models register theirs
there too, so one mechanism serves every module.

safetensors, the no-pickle weight format PyTorch and Hugging Face users exchange:
:func:`save_safetensors` writes ``to_torch_state_dict(module)`` (PyTorch's names and
layouts) with ``safetensors.numpy``, so ``safetensors.torch.load_file(path)`` loads
straight into the equivalent torch module; :func:`load_safetensors` reads such a file
(written by npformer or by ``safetensors.torch.save_file(torch_module.state_dict())``)
into a module, checking every key and shape first.
"""
from __future__ import annotations

import json
import os
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from . import backend
from .weights import checked_weights
from .nn import (DecoderBlock, Embedding, EncoderBlock, FeedForward, LayerNorm,
                 LearnedPositionalEmbedding, Linear, MultiHeadAttention)


@dataclass(frozen=True)
class Rule:
    """One PyTorch tensor made from (or split into) npformer parameters.

    kind: "copy" (same layout), "transpose" (Linear weight: torch stores (out, in)),
    "qkv_weight" (torch's fused in_proj_weight: q, k, v weights stacked by rows,
    each transposed), "qkv_bias" (the three biases concatenated).
    """

    torch_key: str
    npformer_keys: tuple[str, ...]
    kind: str = "copy"


RuleFn = Callable[[object, str, str], Iterator[Rule]]
RULES: dict[type, RuleFn] = {}


def register(cls: type):
    """Decorator: ``fn(module, torch_prefix, npformer_prefix)`` yields the Rules of ``cls``."""
    def wrap(fn: RuleFn) -> RuleFn:
        RULES[cls] = fn
        return fn
    return wrap


def rules_for(module, t: str = "", n: str = "") -> Iterator[Rule]:
    """Rules of ``module`` with torch names prefixed by ``t`` and npformer names by ``n``."""
    for cls in type(module).__mro__:
        if cls in RULES:
            return RULES[cls](module, t, n)
    raise TypeError(f"no PyTorch equivalent is registered for {type(module).__name__}")


@register(Linear)
def _linear(m, t, n):
    yield Rule(t + "weight", (n + "weight",), "transpose")
    if m.bias is not None:
        yield Rule(t + "bias", (n + "bias",))


@register(LayerNorm)
def _layernorm(m, t, n):
    yield Rule(t + "weight", (n + "weight",))
    yield Rule(t + "bias", (n + "bias",))


@register(Embedding)
@register(LearnedPositionalEmbedding)
def _embedding(m, t, n):
    yield Rule(t + "weight", (n + "weight",))


@register(MultiHeadAttention)
def _mha(m, t, n):
    if m.num_heads * m.head_dim != m.d_model:
        raise ValueError(
            f"torch.nn.MultiheadAttention needs num_heads * head_dim == embed_dim, but this "
            f"layer has {m.num_heads} heads of width {m.head_dim} for d_model {m.d_model} "
            "(wide heads have no PyTorch equivalent)")
    qkv = tuple(n + f"{p}_proj." for p in "qkv")
    yield Rule(t + "in_proj_weight", tuple(p + "weight" for p in qkv), "qkv_weight")
    if m.q_proj.bias is not None:
        yield Rule(t + "in_proj_bias", tuple(p + "bias" for p in qkv), "qkv_bias")
    yield from _linear(m.out_proj, t + "out_proj.", n + "out_proj.")


@register(FeedForward)
def _ffn(m, t, n):
    yield from _linear(m.linear1, t + "linear1.", n + "linear1.")
    yield from _linear(m.linear2, t + "linear2.", n + "linear2.")


@register(EncoderBlock)
def _encoder_block(m, t, n):
    yield from _mha(m.self_attn, t + "self_attn.", n + "self_attn.")
    yield from _ffn(m.ffn, t, n + "ffn.")
    yield from _layernorm(m.attn_residual.norm, t + "norm1.", n + "attn_residual.norm.")
    yield from _layernorm(m.ffn_residual.norm, t + "norm2.", n + "ffn_residual.norm.")


@register(DecoderBlock)
def _decoder_block(m, t, n):
    yield from _mha(m.self_attn, t + "self_attn.", n + "self_attn.")
    yield from _mha(m.cross_attn, t + "multihead_attn.", n + "cross_attn.")
    yield from _ffn(m.ffn, t, n + "ffn.")
    yield from _layernorm(m.self_attn_residual.norm, t + "norm1.", n + "self_attn_residual.norm.")
    yield from _layernorm(m.cross_attn_residual.norm, t + "norm2.", n + "cross_attn_residual.norm.")
    yield from _layernorm(m.ffn_residual.norm, t + "norm3.", n + "ffn_residual.norm.")


# --------------------------------------------------------------------------- conversion
def _to_torch_layout(kind: str, arrays: list[np.ndarray]) -> np.ndarray:
    if kind == "copy":
        return arrays[0]
    if kind == "transpose":
        return arrays[0].T
    if kind == "qkv_weight":
        return np.concatenate([a.T for a in arrays], axis=0)  # 3 x (D, E*H) -> (3*H*E, D)
    if kind == "qkv_bias":
        return np.concatenate(arrays, axis=0)
    raise ValueError(f"unknown rule kind {kind!r}")


def _from_torch_layout(kind: str, tensor: np.ndarray, count: int) -> list[np.ndarray]:
    if kind == "copy":
        return [tensor]
    if kind == "transpose":
        return [tensor.T]
    if kind == "qkv_weight":
        return [block.T for block in np.split(tensor, count, axis=0)]
    if kind == "qkv_bias":
        return np.split(tensor, count, axis=0)
    raise ValueError(f"unknown rule kind {kind!r}")


def to_torch_state_dict(module) -> dict[str, np.ndarray]:
    """The state dict of the equivalent PyTorch module, as NumPy arrays (C-contiguous)."""
    own = {name: backend.to_numpy(p.data) for name, p in module.named_parameters()}
    out, used = {}, set()
    for rule in rules_for(module):
        arrays = [own[k] for k in rule.npformer_keys]
        used.update(rule.npformer_keys)
        out[rule.torch_key] = np.ascontiguousarray(_to_torch_layout(rule.kind, arrays))
    unconverted = sorted(set(own) - used)
    if unconverted:
        raise ValueError(f"parameters with no PyTorch counterpart: {unconverted}")
    return out


def _torch_shape(kind: str, shapes: list[tuple]) -> tuple:
    """The shape of the torch tensor a rule makes from npformer arrays of ``shapes``."""
    if kind == "copy":
        return tuple(shapes[0])
    if kind == "transpose":
        return tuple(reversed(shapes[0]))
    if kind == "qkv_weight":  # 3 x (D, H*E) -> (3*H*E, D)
        return (sum(shape[1] for shape in shapes), shapes[0][0])
    if kind == "qkv_bias":
        return (sum(shape[0] for shape in shapes),)
    raise ValueError(f"unknown rule kind {kind!r}")


def _npformer_submodule(module, path: str):
    """The submodule at a dotted npformer path ("blocks.0.self_attn")."""
    for part in filter(None, path.split(".")):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def _check_head_counts(module, torch_module, rules: list[Rule]) -> None:
    """A torch module given (not only its state dict): its attention layers' head counts
    must be npformer's.  The state dict cannot tell (4 heads of 16 and 2 of 32 have the
    same in_proj_weight), and the outputs would differ."""
    torch_modules = dict(torch_module.named_modules())
    differ = []
    for rule in rules:
        if rule.kind != "qkv_weight":
            continue
        torch_name = rule.torch_key[:-len(".in_proj_weight")] if "." in rule.torch_key else ""
        theirs = getattr(torch_modules.get(torch_name), "num_heads", None)
        path = rule.npformer_keys[0][:-len("q_proj.weight")].rstrip(".")
        ours = _npformer_submodule(module, path).num_heads
        if theirs is not None and theirs != ours:
            differ.append(f"{torch_name or 'the module'}: torch {theirs} heads, npformer {ours}")
    if differ:
        raise ValueError(f"the torch module's attention splits into other heads than "
                         f"{type(module).__name__}'s: {'; '.join(differ)} (the weights would "
                         "fit, the outputs would not): build it with the same number of heads")


def load_torch_state_dict(module, torch_state) -> None:
    """Load a PyTorch state dict (tensors or arrays) into ``module``, checking every key,
    shape and value (:func:`npformer.weights.checked_weights`: floating point, finite;
    tensors that require grad are detached, bfloat16 ones converted to float32 with a
    warning) before anything changes.

    ``torch_state`` may also be the torch module itself: then its attention layers' head
    counts are compared with npformer's too (a state dict does not hold them)."""
    rules = list(rules_for(module))
    owner = type(module).__name__
    if not isinstance(torch_state, Mapping) and callable(getattr(torch_state, "state_dict",
                                                                  None)):
        _check_head_counts(module, torch_state, rules)
        torch_state = torch_state.state_dict()
    if not isinstance(torch_state, Mapping):
        raise TypeError(f"load_torch_state_dict needs a torch module or its state dict (a "
                        f"dict of name -> tensor), got {type(torch_state).__name__}")
    expected = {r.torch_key for r in rules}
    missing, extra = sorted(expected - set(torch_state)), sorted(set(torch_state) - expected)
    if missing or extra:
        raise ValueError(f"PyTorch state dict does not fit {owner}: "
                         f"missing keys {missing}, unexpected keys {extra}")
    own = {name: tuple(p.shape) for name, p in module.named_parameters()}
    shapes = {r.torch_key: _torch_shape(r.kind, [own[k] for k in r.npformer_keys])
              for r in rules}
    host = checked_weights(shapes, torch_state, owner, what="PyTorch state dict")
    state = {}
    for rule in rules:
        parts = _from_torch_layout(rule.kind, host[rule.torch_key], len(rule.npformer_keys))
        state.update(zip(rule.npformer_keys, parts))
    module.load_state_dict(state)


# --------------------------------------------------------------------------- safetensors
def save_safetensors(module, path, metadata: dict[str, str] | None = None):
    """Write ``module``'s weights to ``path`` as safetensors, under PyTorch's names and
    layouts; ``metadata`` (str -> str) is stored in the header with ``format: pt``."""
    from pathlib import Path

    from safetensors.numpy import save_file

    header = {"format": "pt", **(metadata or {})}
    bad = [k for k, v in header.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise TypeError(f"safetensors metadata maps strings to strings; not so for {bad}")
    path = Path(path)
    save_file(to_torch_state_dict(module), str(path), metadata=header)
    return path


def load_safetensors(module, path) -> None:
    """Load a safetensors file holding the PyTorch state dict of ``module``'s equivalent
    (as :func:`save_safetensors` or ``safetensors.torch.save_file`` write it), through
    :func:`load_torch_state_dict`'s checks.  bfloat16 tensors (NumPy has no bfloat16) are
    converted to float32, with a warning saying so."""
    from safetensors.numpy import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no safetensors file at {path}")
    try:
        header = _safetensors_header(path)
        bfloat16 = sorted(k for k, v in header.items()
                          if isinstance(v, dict) and v.get("dtype") == "BF16")
        state = _read_bfloat16_as_float32(path, header) if bfloat16 else load_file(str(path))
    except Exception as exc:  # SafetensorError, or a header that is not JSON
        raise ValueError(f"{path} is not a readable safetensors file: "
                         f"{type(exc).__name__}: {exc}") from exc
    if bfloat16:
        warnings.warn(f"{path} holds bfloat16 tensors ({', '.join(bfloat16)}): NumPy has no "
                      "bfloat16, converted to float32 to load them", UserWarning, stacklevel=2)
    load_torch_state_dict(module, state)


def _safetensors_header(path) -> dict:
    """The JSON header of a safetensors file: {name: {dtype, shape, data_offsets}}."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        if size > os.path.getsize(path) - 8:
            raise ValueError(f"header of {size} bytes is longer than the file")
        return json.loads(f.read(size))


def _read_bfloat16_as_float32(path, header: dict) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file that holds bfloat16 ones: bfloat16 is the top
    half of a float32, so each becomes exact float32 (the others are read as they are)."""
    from safetensors.numpy import _TYPES  # safetensors dtype name -> NumPy dtype

    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        data = f.read()[size:]
    state = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        raw = data[start:end]
        if entry["dtype"] == "BF16":
            half = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            array = half.view(np.float32)
        else:
            array = np.frombuffer(raw, dtype=np.dtype(_TYPES[entry["dtype"]]).newbyteorder("<"))
        state[name] = array.reshape(entry["shape"]).copy()
    return state


# --------------------------------------------------------------------------- models
# The PyTorch reference of each model is a plain torch.nn module with these
# attribute names (the tests assemble exactly that):
#   classifier: tok_emb, pos_emb (learned positions only), layers.<i> (TransformerEncoderLayer),
#               norm (pre-norm only), head
#   causal LM:  tok_emb, pos_emb, layers.<i>, norm (pre-norm only), lm_head (untied only)
#   seq2seq:    src_tok_emb, tgt_tok_emb, src_pos_emb/tgt_pos_emb (learned only),
#               encoder.layers.<i>, encoder.norm (pre-norm only), decoder.layers.<i>,
#               decoder.norm (pre-norm only), out_proj   (torch.nn.Transformer's names)
def _token_embedding(m, t_tok, t_pos, n):
    yield from _embedding(m.tokens, t_tok, n + "tokens.")
    if isinstance(m.positions, LearnedPositionalEmbedding):
        yield from _embedding(m.positions, t_pos, n + "positions.")


def _stack(blocks, rule, t, n):
    for i, block in enumerate(blocks):
        yield from rule(block, f"{t}{i}.", f"{n}{i}.")


def _register_models():
    from .models import CausalLM, Seq2SeqTransformer, TransformerClassifier

    @register(TransformerClassifier)
    def _classifier(m, t, n):
        yield from _token_embedding(m.embed, t + "tok_emb.", t + "pos_emb.", n + "embed.")
        yield from _stack(m.blocks, _encoder_block, t + "layers.", n + "blocks.")
        if m.norm is not None:
            yield from _layernorm(m.norm, t + "norm.", n + "norm.")
        yield from _linear(m.head, t + "head.", n + "head.")

    @register(CausalLM)
    def _causal_lm(m, t, n):
        yield from _token_embedding(m.embed, t + "tok_emb.", t + "pos_emb.", n + "embed.")
        yield from _stack(m.blocks, _encoder_block, t + "layers.", n + "blocks.")
        if m.norm is not None:
            yield from _layernorm(m.norm, t + "norm.", n + "norm.")
        if m.lm_head is not None:
            yield from _linear(m.lm_head, t + "lm_head.", n + "lm_head.")

    @register(Seq2SeqTransformer)
    def _seq2seq(m, t, n):
        yield from _token_embedding(m.src_embed, t + "src_tok_emb.", t + "src_pos_emb.",
                                    n + "src_embed.")
        yield from _token_embedding(m.tgt_embed, t + "tgt_tok_emb.", t + "tgt_pos_emb.",
                                    n + "tgt_embed.")
        yield from _stack(m.encoder, _encoder_block, t + "encoder.layers.", n + "encoder.")
        if m.encoder_norm is not None:
            yield from _layernorm(m.encoder_norm, t + "encoder.norm.", n + "encoder_norm.")
        yield from _stack(m.decoder, _decoder_block, t + "decoder.layers.", n + "decoder.")
        if m.decoder_norm is not None:
            yield from _layernorm(m.decoder_norm, t + "decoder.norm.", n + "decoder_norm.")
        yield from _linear(m.out_proj, t + "out_proj.", n + "out_proj.")


_register_models()
