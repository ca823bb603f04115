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

safetensors, the no-pickle weight format PyTorch and Hugging Face users exchange, under
PyTorch's names and layouts: :func:`save_safetensors`, :func:`load_safetensors`.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .. import backend
from ..nn import (
    DecoderBlock,
    Embedding,
    EncoderBlock,
    FeedForward,
    LayerNorm,
    LearnedPositionalEmbedding,
    Linear,
    Module,
    MultiHeadAttention,
)
from ..nn.state import checked_weights, read_safetensors
from ..ops.contracts import check_path


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

    def __post_init__(self):
        if self.kind not in LAYOUTS:
            raise ValueError(f"unknown rule kind {self.kind!r}: one of {sorted(LAYOUTS)}")


class Layout(NamedTuple):
    """A rule kind's conversions: npformer arrays -> the torch tensor, (the tensor, how
    many npformer arrays) -> those arrays, npformer shapes -> the tensor's shape."""

    to_torch: Callable
    from_torch: Callable
    torch_shape: Callable


LAYOUTS = {
    "copy": Layout(lambda arrays: arrays[0], lambda tensor, count: [tensor],
                   lambda shapes: tuple(shapes[0])),
    "transpose": Layout(lambda arrays: arrays[0].T, lambda tensor, count: [tensor.T],
                        lambda shapes: tuple(reversed(shapes[0]))),
    "qkv_weight": Layout(  # 3 x (D, H*E) <-> (3*H*E, D)
        lambda arrays: np.concatenate([a.T for a in arrays], axis=0),
        lambda tensor, count: [block.T for block in np.split(tensor, count, axis=0)],
        lambda shapes: (sum(shape[1] for shape in shapes), shapes[0][0])),
    "qkv_bias": Layout(lambda arrays: np.concatenate(arrays, axis=0),
                       lambda tensor, count: np.split(tensor, count, axis=0),
                       lambda shapes: (sum(shape[0] for shape in shapes),)),
}


RuleFn = Callable[[object, str, str], Iterator[Rule]]
RULES: dict[type, RuleFn] = {}


def register(cls: type) -> Callable[[RuleFn], RuleFn]:
    """Decorator: ``fn(module, torch_prefix, npformer_prefix)`` yields the Rules of ``cls``."""
    def wrap(fn: RuleFn) -> RuleFn:
        RULES[cls] = fn
        return fn
    return wrap


def rules_for(module: Module, t: str = "", n: str = "") -> Iterator[Rule]:
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
    if m.narrow_heads or m.qk_norm:
        options = " and ".join(o for o, on in (("narrow heads", m.narrow_heads),
                                                ("qk_norm", m.qk_norm)) if on)
        raise ValueError(f"torch.nn.MultiheadAttention has no {options}: this attention "
                         "layer has no PyTorch equivalent (npformer.interop.torch_reference."
                         "TorchAttention computes it in torch)")
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
def to_torch_state_dict(module: Module) -> dict[str, np.ndarray]:
    """The state dict of the equivalent PyTorch module, as NumPy arrays (C-contiguous)."""
    if not isinstance(module, Module):
        raise TypeError(f"to_torch converts an npformer model or layer (an npformer.nn."
                        f"Module), got {type(module).__name__}")
    own = {name: backend.to_numpy(p.data) for name, p in module.named_parameters()}
    out, used = {}, set()
    for rule in rules_for(module):
        arrays = [own[k] for k in rule.npformer_keys]
        used.update(rule.npformer_keys)
        out[rule.torch_key] = np.ascontiguousarray(LAYOUTS[rule.kind].to_torch(arrays))
    unconverted = sorted(set(own) - used)
    if unconverted:
        raise ValueError(f"parameters with no PyTorch counterpart: {unconverted}")
    return out


def _check_head_counts(module, torch_module, rules: list[Rule]) -> None:
    """A torch module given (not only its state dict): its attention layers' head counts
    must be npformer's.  The state dict cannot tell (4 heads of 16 and 2 of 32 have the
    same in_proj_weight), and the outputs would differ."""
    torch_modules = dict(torch_module.named_modules())
    ours_by_name = dict(module.named_modules())
    differ = []
    for rule in rules:
        if rule.kind != "qkv_weight":
            continue
        torch_name = rule.torch_key[:-len(".in_proj_weight")] if "." in rule.torch_key else ""
        theirs = getattr(torch_modules.get(torch_name), "num_heads", None)
        path = rule.npformer_keys[0][:-len("q_proj.weight")].rstrip(".")
        ours = ours_by_name[path].num_heads
        if theirs is not None and theirs != ours:
            differ.append(f"{torch_name or 'the module'}: torch {theirs} heads, npformer {ours}")
    if differ:
        raise ValueError(f"the torch module's attention splits into other heads than "
                         f"{type(module).__name__}'s: {'; '.join(differ)} (the weights would "
                         "fit, the outputs would not): build it with the same number of heads")


def load_torch_state_dict(module: Module, torch_state: Mapping[str, Any]) -> None:
    """Load a PyTorch state dict (tensors or arrays) into ``module``, checking every key,
    shape and value (:func:`npformer.nn.state.checked_weights`: floating point, finite;
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
    shapes = {r.torch_key: LAYOUTS[r.kind].torch_shape([own[k] for k in r.npformer_keys])
              for r in rules}
    host = checked_weights(shapes, torch_state, owner, what="PyTorch state dict")
    state = {}
    for rule in rules:
        parts = LAYOUTS[rule.kind].from_torch(host[rule.torch_key], len(rule.npformer_keys))
        state.update(zip(rule.npformer_keys, parts))
    module.load_state_dict(state)


# --------------------------------------------------------------------------- safetensors
def save_safetensors(module: Module, path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> Path:
    """Write ``module``'s weights to ``path`` as safetensors, under PyTorch's names and
    layouts; ``metadata`` (str -> str) is stored in the header with ``format: pt``."""
    from safetensors.numpy import save_file

    header = {"format": "pt", **(metadata or {})}
    bad = [k for k, v in header.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise TypeError(f"safetensors metadata maps strings to strings; not so for {bad}")
    path = Path(check_path(path, "path"))
    if path.is_dir():
        raise IsADirectoryError(f"save_safetensors: path {path} is a folder; give a file name "
                                "such as model.safetensors")
    state = to_torch_state_dict(module)
    from ..hf.gpt2 import output_folder, write_files

    # its folder created if missing (a file in the way is refused, named); the file written
    # whole at a temporary name and renamed into place
    folder = output_folder(path.parent, "path's folder", create=False)
    write_files(folder, {path.name: lambda tmp: save_file(state, str(tmp), metadata=header)})
    return path


def load_safetensors(module: Module, path: str | Path) -> None:
    """Load a safetensors file holding the PyTorch state dict of ``module``'s equivalent
    (as :func:`save_safetensors` or ``safetensors.torch.save_file`` write it), through
    :func:`load_torch_state_dict`'s checks.  bfloat16 tensors (NumPy has no bfloat16) are
    converted to float32, with a warning saying so."""
    load_torch_state_dict(module, read_safetensors(path, stacklevel=3))


# --------------------------------------------------------------------------- models
# The PyTorch reference models' attribute names: npformer.interop.torch_reference's docstring
def _token_embedding(m, t_tok, t_pos, n):
    yield from _embedding(m.tokens, t_tok, n + "tokens.")
    if isinstance(m.positions, LearnedPositionalEmbedding):
        yield from _embedding(m.positions, t_pos, n + "positions.")


def _stack(blocks, rule, t, n):
    for i, block in enumerate(blocks):
        yield from rule(block, f"{t}{i}.", f"{n}{i}.")


def _register_models():
    from ..models import CausalLM, Seq2SeqTransformer, TransformerClassifier

    @register(TransformerClassifier)
    def _classifier(m, t, n):
        yield from _token_embedding(m.embed, t + "tok_emb.", t + "pos_emb.", n + "embed.")
        if m.bigrams is not None:
            yield from _embedding(m.bigrams, t + "bigram_emb.", n + "bigrams.")
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
        if m.lm_head is not None:
            yield from _linear(m.lm_head, t + "out_proj.", n + "lm_head.")


_register_models()


# --------------------------------------------------------------------------- whole modules
# to_torch / from_torch: the equivalent module itself, not only its weights.  torch is
# imported inside them; npformer's models map to npformer.interop.torch_reference's classes.
_TORCH_EQUIVALENTS = ("TransformerClassifier, CausalLM, Seq2SeqTransformer, EncoderBlock, "
                      "DecoderBlock, MultiHeadAttention, Linear, LayerNorm, Embedding, "
                      "LearnedPositionalEmbedding")


def to_torch(module: Any, device: Any = None) -> Any:
    """The ``torch.nn.Module`` equivalent of an npformer model or layer, holding the same
    weights: same outputs for the same inputs (in training too, up to the dropout masks
    drawn: the torch layers' attention dropout is set to 0, as npformer drops no
    attention probabilities).  The layers map as the module's table says; a model maps to
    its reference in ``torch_reference.torch_models()`` (``["classifier"]``,
    ``["causal_lm"]``, ``["seq2seq"]``, whose ``forward`` the classes' docstrings give),
    which keeps the npformer config as ``.c``.  The dtype is the module's (float32 or
    float64); ``device`` (e.g. ``"cuda"``) where the torch module goes (default: the CPU);
    the torch module is in the npformer module's mode (``training`` or eval).
    """
    import torch

    state = to_torch_state_dict(module)  # refuses what has no equivalent (wide heads ...)
    dtype = _one_float_dtype({array.dtype.name for array in state.values()}, "to_torch", module)
    twin = _torch_twin(module, torch, getattr(torch, dtype))
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    twin.train(bool(getattr(module, "training", True)))
    return twin if device is None else twin.to(device)


def _torch_twin(m: Any, torch: Any, dtype: Any) -> Any:
    """An empty torch module shaped like the npformer module ``m``."""
    from ..models import MODELS
    from .torch_reference import _without_attention_dropout, torch_activation, torch_models

    tnn = torch.nn
    kind = getattr(type(m), "kind", None)
    if kind in MODELS and isinstance(m, MODELS[kind]):
        return torch_models()[kind](m.config, dtype)
    if isinstance(m, (EncoderBlock, DecoderBlock)):
        layer = tnn.TransformerEncoderLayer if isinstance(m, EncoderBlock) else \
            tnn.TransformerDecoderLayer
        return _without_attention_dropout(layer(
            m.self_attn.d_model, m.self_attn.num_heads, m.ffn.linear1.out_features,
            dropout=m.ffn.dropout.p, activation=torch_activation(m.ffn.activation.name),
            layer_norm_eps=m.ffn_residual.norm.eps, batch_first=True, norm_first=m.norm_first,
            dtype=dtype))
    if isinstance(m, MultiHeadAttention):
        return tnn.MultiheadAttention(m.d_model, m.num_heads, bias=m.q_proj.bias is not None,
                                      batch_first=True, dtype=dtype)
    if isinstance(m, Linear):
        return tnn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=dtype)
    if isinstance(m, LayerNorm):
        return tnn.LayerNorm(m.weight.shape[0], eps=m.eps, dtype=dtype)
    if isinstance(m, (Embedding, LearnedPositionalEmbedding)):
        return tnn.Embedding(*m.weight.shape, dtype=dtype)
    raise TypeError(f"to_torch has no torch module for {type(m).__name__}; it converts "
                    f"{_TORCH_EQUIVALENTS}")


def from_torch(torch_module: Any, tier: str = "fast") -> Any:
    """The npformer model or layer equivalent to ``torch_module``, built from its
    configuration and holding its weights (the reverse of :func:`to_torch`): of the
    reference models of :mod:`npformer.interop.torch_reference` (config ``.c``) or the
    torch layers of the module's table.  An option npformer's layer does not implement
    (an activation but relu, gelu and tanh GELU, norms of different epsilons, no biases,
    kdim/vdim, bias_k/v, zero attention, dropout of the attention probabilities, an
    Embedding's padding_idx, max_norm, scale_grad_by_freq or sparse) is refused by name,
    never dropped: the two modules would compute, or train, differently.  npformer layers
    are batch-first whatever ``batch_first`` says.  The module is made on the current
    backend in the torch module's dtype (float32 or float64), of ``tier``: the fast tier's
    class (:mod:`npformer.fast`) or, with ``tier="textbook"``, the textbook's.
    """
    import torch

    from ..checkpoint import TIERS
    from ..ops.contracts import check_choice

    if not isinstance(torch_module, torch.nn.Module):
        raise TypeError(f"from_torch converts a torch.nn.Module, got "
                        f"{type(torch_module).__name__}")
    check_choice(tier, TIERS, "tier")

    params = list(torch_module.parameters())
    if not params:  # LayerNorm(elementwise_affine=False): refused by what it lacks, if so
        _npformer_twin(torch_module, torch, tier)
    dtype = _one_float_dtype({str(p.dtype).removeprefix("torch.") for p in params},
                             "from_torch", torch_module)
    ours = backend.built_in(dtype, _npformer_twin, torch_module, torch, tier)
    load_torch_state_dict(ours, {name: tensor.detach().cpu().numpy()
                                 for name, tensor in torch_module.state_dict().items()})
    ours.train(bool(torch_module.training))
    return ours


def _one_float_dtype(dtypes: set[str], caller: str, owner: Any) -> str:
    """The one float dtype of ``owner``'s parameters; a TypeError naming ``caller`` else."""
    shown = sorted(dtypes)
    if len(shown) != 1 or shown[0] not in backend.FLOAT_DTYPES:
        raise TypeError(f"{caller} needs parameters of one float dtype {backend.FLOAT_DTYPES}, "
                        f"got {shown or 'none'} in {type(owner).__name__}")
    return shown[0]


def _npformer_twin(t: Any, torch: Any, tier: str) -> Any:
    """An npformer module of ``tier`` shaped like the torch module ``t`` (weights not yet
    loaded)."""
    from .. import fast, models, nn
    from .torch_reference import torch_models

    MODELS = fast.MODELS if tier == "fast" else models.MODELS
    layers = fast.layers if tier == "fast" else nn  # Linear, LayerNorm, Embedding
    blocks = fast.blocks if tier == "fast" else nn  # MultiHeadAttention and the blocks

    tnn = torch.nn
    for kind, cls in torch_models().items():
        if isinstance(t, cls):
            return MODELS[kind](t.c)
    name = type(t).__name__
    if isinstance(t, (tnn.TransformerEncoderLayer, tnn.TransformerDecoderLayer)):
        attentions = [n for n in ("self_attn", "multihead_attn") if hasattr(t, n)]
        for attention in attentions:
            _check_torch_attention(getattr(t, attention), f"{name}.{attention}", in_layer=True)
        if t.linear1.bias is None or t.norm1.bias is None or t.self_attn.in_proj_bias is None:
            raise ValueError(f"{name} with bias=False has no npformer equivalent (npformer's "
                             "blocks have biases)")
        norms = {n: getattr(t, n).eps for n in ("norm1", "norm2", "norm3") if hasattr(t, n)}
        if len(set(norms.values())) > 1:
            raise ValueError(f"{name}'s layer norms have different epsilons ({norms}); an "
                             "npformer block has one norm_eps for all of them")
        block = blocks.EncoderBlock if isinstance(t, tnn.TransformerEncoderLayer) \
            else blocks.DecoderBlock
        return block(t.self_attn.embed_dim, t.self_attn.num_heads, t.linear1.out_features,
                     dropout=t.dropout.p, activation=_activation_name(t.activation, torch, name),
                     norm_first=t.norm_first, norm_eps=t.norm1.eps)
    if isinstance(t, tnn.MultiheadAttention):
        _check_torch_attention(t, name)
        return blocks.MultiHeadAttention(t.embed_dim, t.num_heads,
                                         bias=t.in_proj_bias is not None)
    if isinstance(t, tnn.Linear):
        return layers.Linear(t.in_features, t.out_features, bias=t.bias is not None)
    if isinstance(t, tnn.LayerNorm):
        if len(t.normalized_shape) != 1 or t.weight is None or t.bias is None:
            raise ValueError(f"LayerNorm over {tuple(t.normalized_shape)} with "
                             f"elementwise_affine={t.weight is not None}, bias="
                             f"{t.bias is not None} has no npformer equivalent (one axis, "
                             "weight and bias)")
        return layers.LayerNorm(t.normalized_shape[0], eps=t.eps)
    if isinstance(t, tnn.Embedding):
        _check_torch_embedding(t)
        return layers.Embedding(t.num_embeddings, t.embedding_dim)
    raise TypeError(f"from_torch has no npformer module for {name}; it converts "
                    "npformer.interop.torch_reference's models, nn.TransformerEncoderLayer, "
                    "nn.TransformerDecoderLayer, nn.MultiheadAttention, nn.Linear, "
                    "nn.LayerNorm and nn.Embedding")


def _check_torch_attention(attn: Any, name: str, in_layer: bool = False) -> None:
    """What npformer's MultiHeadAttention cannot hold: other key/value widths, bias_k/v,
    a zero attention row, dropout of the attention probabilities (npformer drops none:
    its blocks drop the residual branches and the feed-forward's hidden layer only)."""
    if not attn._qkv_same_embed_dim:
        raise ValueError(f"{name} has kdim {attn.kdim} / vdim {attn.vdim} other than "
                         f"embed_dim {attn.embed_dim}: npformer's attention has no "
                         "equivalent")
    if attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError(f"{name} has add_bias_kv or add_zero_attn: npformer's attention "
                         "has no equivalent")
    if attn.dropout:
        owner = f"layer.{name.rsplit('.', 1)[-1]}" if in_layer else "attention"
        raise ValueError(f"{name} has dropout={attn.dropout}: it drops attention "
                         "probabilities in training, which npformer's attention never does; "
                         f"set {owner}.dropout = 0.0 to convert it")


def _check_torch_embedding(embedding: Any) -> None:
    """What npformer's Embedding does not do: torch's padding_idx (that row gets no
    gradient), max_norm (rows renormalized in the forward), scale_grad_by_freq, sparse."""
    given = {option: getattr(embedding, option) for option, unset in
             (("padding_idx", None), ("max_norm", None), ("scale_grad_by_freq", False),
              ("sparse", False)) if getattr(embedding, option) != unset}
    if given:
        listed = ", ".join(f"{option}={value!r}" for option, value in given.items())
        raise ValueError(f"Embedding with {listed} has no npformer equivalent: npformer's "
                         "Embedding is a plain lookup table (every row looked up gets its "
                         "gradient, no row is renormalized, gradients are dense); build the "
                         "torch Embedding without " + ", ".join(given))


def _activation_name(fn: Any, torch: Any, name: str) -> str:
    """npformer's name of a torch Transformer layer's activation (a function, a partial
    of F.gelu, or an nn.ReLU / nn.GELU module)."""
    import functools

    F = torch.nn.functional
    if fn is F.relu or isinstance(fn, torch.nn.ReLU):
        return "relu"
    approximate = None
    if fn is F.gelu:
        approximate = "none"
    elif isinstance(fn, torch.nn.GELU):
        approximate = fn.approximate
    elif (isinstance(fn, functools.partial) and fn.func is F.gelu and not fn.args
          and set(fn.keywords) <= {"approximate"}):
        approximate = fn.keywords.get("approximate", "none")
    if approximate in ("none", "tanh"):
        return "gelu" if approximate == "none" else "gelu_tanh"
    raise ValueError(f"{name}'s activation {fn!r} has no npformer equivalent (relu, gelu, "
                     "gelu with approximate='tanh')")
