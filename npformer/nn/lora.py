"""LoRA adapters on any model made of npformer :class:`~npformer.nn.Linear` layers.

:class:`LoRALinear` is a frozen Linear plus a trained low-rank update (the op and its
derivation: :mod:`npformer.ops.lora`), :class:`LoRAEmbedding` the same for a token table;
``merge()`` folds the update into the weight, ``unmerge()`` restores it bit for bit.
:func:`apply_lora` freezes a model and wraps the layers whose names match ``targets``
(as PEFT's ``target_modules``); :func:`merge_lora`, :func:`unmerge_lora` and
:func:`lora_layers` act on all of them.  PEFT's files: :mod:`npformer.interop.peft`.

An adapter keeps the layer's parameters under their names (``weight``, ``bias``: the
model's checkpoints and Hugging Face exports still find them) and adds ``lora_A`` (D_in, r)
and ``lora_B`` (r, D_out) in the math's orientation (PEFT stores their transposes).
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from .. import backend, ops
from ..backend import Array
from ..ops.contracts import check_probability, check_real, check_size
from ..ops.lora import lora_backward, lora_forward
from .layers import Dropout, Embedding, Linear
from .module import Module, Parameter


def kaiming_uniform_a(d_in: int, r: int, like: Array) -> Array:
    """A (D_in, r) as PEFT draws ``lora_A.weight`` (r, D_in): kaiming-uniform with
    a = sqrt(5), i.e. U(-b, b) with b = gain sqrt(3 / fan_in), gain = sqrt(2 / (1 + a^2)),
    fan_in = D_in: b = 1 / sqrt(D_in).  In ``like``'s dtype and backend."""
    a = math.sqrt(5.0)
    bound = math.sqrt(2.0 / (1.0 + a * a)) * math.sqrt(3.0 / d_in)  # = 1 / sqrt(D_in)
    draw = (backend.random_uniform((d_in, r)) * 2.0 - 1.0) * bound
    return backend.copy_like(draw, like)


class Adapter(Module):
    """What :class:`LoRALinear` and :class:`LoRAEmbedding` share: the settings (r, alpha,
    dropout) checked and kept, the scale s = alpha / r, the update s A B of
    ``self.weight``, and merge / unmerge."""

    def _settings(self, base: Module, kind: type, r: int, alpha: float | None,
                  dropout: float) -> None:
        if not isinstance(base, kind):
            raise TypeError(f"{type(self).__name__} adapts {'an' if kind is Embedding else 'a'} "
                            f"{kind.__name__} layer, got {type(base).__name__}")
        self.r, alpha, dropout = check_adapter_settings(r, alpha, dropout)
        self.alpha = float(self.r) if alpha is None else alpha
        self.dropout = Dropout(dropout)
        self.merged = False
        self._unmerged_weight: Array | None = None
        base.freeze()

    @property
    def scale(self) -> float:
        """alpha / r: the update's scale (PEFT's ``scaling``)."""
        return self.alpha / self.r

    def delta_weight(self) -> Array:
        """s A B, of the weight's shape: what the adapter adds to it."""
        return self.scale * (self.lora_A.data @ self.lora_B.data)

    def merge(self) -> None:
        """W <- W + s A B: the adapted map in the weight alone (inference, export; the
        forward is then the base layer's, equal to the adapter's to rounding).  The weight
        before is kept, so :meth:`unmerge` restores it bit for bit (W + D - D rounds)."""
        if self.merged:
            raise RuntimeError(f"{type(self).__name__} is already merged")
        self._unmerged_weight = backend.copy_like(self.weight.data, self.weight.data)
        self.weight.data = self.weight.data + self.delta_weight()
        self.merged = True

    def unmerge(self) -> None:
        """The weight before :meth:`merge`, exactly."""
        if not self.merged:
            raise RuntimeError(f"{type(self).__name__} is not merged: there is nothing to "
                               "unmerge")
        self.weight.data, self._unmerged_weight = self._unmerged_weight, None
        self.merged = False


class LoRALinear(Adapter):
    """y = x W + b + (alpha / r) dropout(x) A B, with W and b a Linear's (frozen) and A
    (D_in, r), B (r, D_out) trained; B starts at zero, A as PEFT draws it."""

    def __init__(self, base: Linear, r: int, alpha: float | None = None, dropout: float = 0.0):
        self._settings(base, Linear, r, alpha, dropout)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the frozen map, its own names
        w = base.weight.data
        zeros = backend.namespace_of(w).zeros((self.r, self.out_features), dtype=w.dtype,
                                              device=getattr(w, "device", None))
        self.lora_A = Parameter(kaiming_uniform_a(self.in_features, self.r, w))
        self.lora_B = Parameter(zeros)

    def forward(self, x: Array) -> Array:
        """x (..., D_in) -> (..., D_out)."""
        bias = None if self.bias is None else self.bias.data
        if self.merged:  # x (W + s A B) + b: the base map alone, for inference
            y, saved = ops.linear_forward(x, self.weight.data, bias)
            self._save(saved)
            return y
        x_dropped = self.dropout(x)  # (..., D_in)
        y, saved = lora_forward(x, x_dropped, self.weight.data, bias, self.lora_A.data,
                                self.lora_B.data, self.scale)
        self._save(saved)
        return y

    def backward(self, dy: Array) -> Array:
        """dy (..., D_out) -> dx (..., D_in); adds the gradients of A and B (not W's, b's)."""
        if self.merged:
            raise RuntimeError("LoRALinear is merged (its update is in the frozen weight): "
                               "unmerge() it to train the adapter")
        dx, dx_dropped, da, db = lora_backward(dy, self._pop_saved())
        self.lora_A.accumulate(da)
        self.lora_B.accumulate(db)
        return dx + self.dropout.backward(dx_dropped)  # x reaches y both ways

    def __repr__(self) -> str:
        return (f"LoRALinear({self.in_features}, {self.out_features}, r={self.r}, "
                f"alpha={self.alpha}, dropout={self.dropout.p})")


class LoRAEmbedding(Adapter):
    """A frozen token Embedding plus a trained low-rank update of its table, as PEFT's
    ``lora.Embedding``: y = E[ids] + s A[ids] B, with E (V, D) frozen, A (V, r) and B
    (r, D) trained, s = alpha / r; A starts at zero and B standard normal (PEFT's draws).
    PEFT stores A^T and B^T (``lora_embedding_A`` / ``_B``) and applies no dropout here:
    ``dropout`` is kept, not applied.  ``padding_idx``: a token whose row of A takes no
    gradient (torch's; None: every row does).

    Backward, for dy (..., D) and u = A[ids] (..., r): du = s dy B^T (..., r); dA adds
    du's rows into the rows of ids; dB = s u^T dy.  A tied output projection is the
    frozen table's alone, as in PEFT (:meth:`merge` changes the one table, so both)."""

    def __init__(self, base: Module, r: int, alpha: float | None = None, dropout: float = 0.0,
                 padding_idx: int | None = None):
        self._settings(base, Embedding, r, alpha, dropout)
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        if padding_idx is not None:
            check_size(padding_idx, "padding_idx", 0, self.num_embeddings - 1)
        self.padding_idx = padding_idx
        self._base_class = type(base)  # its tied projection, run on this layer's table
        self.weight = base.weight  # the frozen table, its own name
        w = base.weight.data
        xp = backend.namespace_of(w)
        self.lora_A = Parameter(xp.zeros((self.num_embeddings, self.r), dtype=w.dtype,
                                         device=getattr(w, "device", None)))
        self.lora_B = Parameter(backend.copy_like(
            backend.random_normal((self.r, self.embedding_dim)), w))

    def forward(self, ids: Array) -> Array:
        """ids (...) -> (..., D)."""
        y, table_saved = ops.embedding_forward(ids, self.weight.data)  # (..., D)
        if self.merged:
            self._save(None)
            return y
        u, saved = ops.embedding_forward(ids, self.lora_A.data)  # A[ids] (..., r)
        self._save((saved, u))
        return y + self.scale * (u @ self.lora_B.data)

    def backward(self, dy: Array) -> None:
        """dy (..., D) -> None; adds the gradients of A and B (not the table's)."""
        values = self._pop_saved()
        if self.merged:
            raise RuntimeError("LoRAEmbedding is merged (its update is in the frozen table): "
                               "unmerge() it to train the adapter")
        saved, u = values
        xp = backend.namespace_of(dy)
        du = self.scale * (dy @ self.lora_B.data.mT)  # (..., D) @ (D, r) -> (..., r)
        da = ops.embedding_backward(du, saved)  # (V, r): du's rows added at their ids
        if self.padding_idx is not None:
            da[self.padding_idx] = 0
        u_rows = xp.reshape(u, (-1, self.r))  # (N, r)
        dy_rows = xp.reshape(dy, (-1, self.embedding_dim))  # (N, D)
        self.lora_A.accumulate(da)
        self.lora_B.accumulate(self.scale * (u_rows.mT @ dy_rows))  # (r, D)
        return None

    def project(self, h: Array, *args: Any) -> Array:
        """The tied output projection h W^T, W the frozen table (the adapter is not in it
        unless merged)."""
        return self._base_class.project(self, h, *args)

    def project_backward(self, dlogits: Array, *args: Any) -> Array:
        return self._base_class.project_backward(self, dlogits, *args)

    def __repr__(self) -> str:
        return (f"LoRAEmbedding({self.num_embeddings}, {self.embedding_dim}, r={self.r}, "
                f"alpha={self.alpha})")


# --------------------------------------------------------------------------- on a model
def matches(name: str, targets: str | Sequence[str]) -> bool:
    """Whether the module ``name`` is a target, as PEFT's ``target_modules`` says: a string
    is a regular expression the whole name must match; a list holds names the module's
    name is, or ends with after a dot ("q_proj" matches "blocks.0.self_attn.q_proj")."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def apply_lora(model: Module, targets: str | Sequence[str], r: int,
               alpha: float | None = None, dropout: float = 0.0) -> list[str]:
    """Freeze ``model`` and put a :class:`LoRALinear` (rank ``r``, ``alpha``, ``dropout``)
    in place of each Linear layer whose name matches ``targets`` (:func:`matches`), and a
    :class:`LoRAEmbedding` in place of each token Embedding it matches (PEFT's too).
    Returns the adapted layers' names.  Afterwards only the adapters train:
    ``AdamW(model.parameters())`` keeps state for them alone."""
    check_targets(targets)
    check_adapter_settings(r, alpha, dropout)
    adapted = lora_layers(model)
    if adapted:  # freezing the model again would freeze them, and they would train no more
        raise ValueError(f"{type(model).__name__} holds LoRA adapters already (on "
                         f"{', '.join(list(adapted)[:3])}{', ...' if len(adapted) > 3 else ''}"
                         "): apply_lora once, with every target, on the base model")
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    tables = [(name, m) for name, m in model.named_modules() if isinstance(m, Embedding)]
    check_every_target_matches(targets, [name for name, _ in linears + tables],
                               "Linear layers")
    chosen = [(name, m) for name, m in linears + tables if matches(name, targets)]
    model.freeze()
    for name, layer in chosen:
        replace_module(model, name, adapter_class(layer)(layer, r, alpha, dropout))
    return [name for name, _ in chosen]


def adapter_class(layer: Module) -> type:
    """The adapter that takes ``layer``'s place: LoRAEmbedding for a table; for a Linear,
    the adapter its class names (the fast tier's, which takes keep_input), else LoRALinear."""
    if isinstance(layer, Linear):
        return getattr(layer, "LoRALinear", LoRALinear)
    return LoRAEmbedding


def check_adapter_settings(r: Any, alpha: Any, dropout: Any) -> tuple[int, float | None, float]:
    """An adapter's rank r (an integer >= 1), alpha (None or a finite real > 0) and dropout
    (in [0, 1)), checked by kind and returned: one place for the rules, read before a
    model is changed."""
    return (check_size(r, "r (the LoRA rank)", 1),
            check_real(alpha, "alpha (lora_alpha)", 0.0, inclusive=False, optional=True),
            check_probability(dropout))


def check_every_target_matches(targets: str | Sequence[str], names: Sequence[str],
                               what: str, label: str = "targets") -> None:
    """Each of ``targets`` (:func:`matches`) chooses at least one of ``names`` (the
    layers, ``what``): a regular expression some name, a list each of its names (one
    misspelt would leave its layers without an adapter, silently); those that choose
    nothing are refused, named (as ``label``) beside the first few layers."""
    def chooses(target: str) -> bool:
        one = target if isinstance(targets, str) else [target]
        return any(matches(name, one) for name in names)

    unmatched = [t for t in ([targets] if isinstance(targets, str) else targets)
                 if not chooses(t)]
    if unmatched:
        listed = ", ".join(names[:6]) or "none"
        shown_targets = targets if isinstance(targets, str) else unmatched
        raise ValueError(f"{label} {shown_targets!r} match none of the model's {what} "
                         f"({listed}{', ...' if len(names) > 6 else ''})")


def check_targets(targets: Any) -> None:
    """``targets``: a regular expression, or a non-empty list of module names."""
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise ValueError(f"targets {targets!r} is not a regular expression: {exc}") from None
        return
    if isinstance(targets, (list, tuple)) and targets and all(
            isinstance(t, str) and t for t in targets):
        return
    raise TypeError(f"targets must be a regular expression (str) or a non-empty list of module "
                    f"names, got {targets!r}")


def replace_module(model: Module, name: str, new: Module) -> None:
    """Put ``new`` where the module ``name`` ("blocks.0.ffn.linear1") is in ``model``."""
    *path, last = name.split(".")
    parent = model
    for part in path:
        parent = parent[int(part)] if isinstance(parent, (list, tuple)) else getattr(parent, part)
    if isinstance(parent, list):
        parent[int(last)] = new
    elif isinstance(parent, tuple):
        raise TypeError(f"cannot replace {name}: its owner holds its layers in a tuple")
    else:
        setattr(parent, last, new)


def share_lora_a(layers: Sequence[LoRALinear]) -> None:
    """One A for ``layers`` (the first's), each keeping its own B: the adapter of one
    fused projection split into several Linears (GPT-2's ``c_attn``, npformer's q, k and
    v), x A B_q, x A B_k, x A B_v being the columns of x A [B_q B_k B_v].  A's gradient
    is the sum of the layers' shares (each adds its own); it is one parameter, named
    once (the first layer's ``lora_A``).  Each layer draws its own dropout mask."""
    first = layers[0]
    for layer in layers[1:]:
        if (layer.in_features, layer.r, layer.alpha) != (first.in_features, first.r,
                                                          first.alpha):
            raise ValueError(f"adapters sharing one A need one input width, rank and alpha: "
                             f"got {first!r} and {layer!r}")
        layer.lora_A = first.lora_A


def lora_layers(model: Module) -> dict[str, LoRALinear | LoRAEmbedding]:
    """{name: LoRALinear or LoRAEmbedding} of every adapter in ``model``, in the model's
    order."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (LoRALinear, LoRAEmbedding))}


def merge_lora(model: Module) -> None:
    """:meth:`LoRALinear.merge` every adapter of ``model``."""
    for layer in _adapters(model).values():
        layer.merge()


def unmerge_lora(model: Module) -> None:
    """:meth:`LoRALinear.unmerge` every adapter of ``model``: the weights before, exactly."""
    for layer in _adapters(model).values():
        layer.unmerge()


def _adapters(model: Module) -> dict[str, LoRALinear]:
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} holds no LoRA adapters (apply_lora first)")
    return layers


# --------------------------------------------------------------------------- saved settings
def adapter_settings(model: Module) -> dict[str, Any] | None:
    """What ``model``'s adapters compute besides their weights, JSON-able (a checkpoint
    keeps it, :mod:`npformer.checkpoint`): ``{"layers": {name: {"r", "alpha", "dropout",
    "merged"}}, "shared_a": [[names], ...]}`` (the groups of layers sharing one A,
    :func:`share_lora_a`); None for a model without adapters."""
    layers = lora_layers(model)
    if not layers:
        return None
    groups: dict[int, list[str]] = {}
    for name, layer in layers.items():
        groups.setdefault(id(layer.lora_A), []).append(name)
    return {"layers": {name: {"r": layer.r, "alpha": float(layer.alpha),
                              "dropout": float(layer.dropout.p), "merged": bool(layer.merged),
                              **({"padding_idx": layer.padding_idx}
                                 if getattr(layer, "padding_idx", None) is not None else {})}
                       for name, layer in layers.items()},
            "shared_a": [names for names in groups.values() if len(names) > 1]}


def check_saved_adapter_settings(settings: Any, where: str) -> dict[str, Any]:
    """``settings`` as :func:`adapter_settings` writes them, checked (a ValueError naming
    ``where`` and the field for anything else)."""
    if not isinstance(settings, dict) or set(settings) != {"layers", "shared_a"} or \
            not isinstance(settings["layers"], dict) or not settings["layers"] or \
            not isinstance(settings["shared_a"], list):
        raise ValueError(f"{where} should be {{'layers': {{name: settings}}, 'shared_a': "
                         f"[[names], ...]}}, got {settings!r:.120}")
    for name, layer in settings["layers"].items():
        if not isinstance(layer, dict) or \
                set(layer) - {"padding_idx"} != {"r", "alpha", "dropout", "merged"} \
                or not isinstance(layer["merged"], bool) or not (
                    layer.get("padding_idx") is None or _is_index(layer["padding_idx"])):
            raise ValueError(f"{where}: the adapter {name!r} should hold r, alpha, dropout and "
                             f"merged, got {layer!r:.120}")
        try:
            check_adapter_settings(layer["r"], layer["alpha"], layer["dropout"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: the adapter {name!r}: {exc}") from None
    for group in settings["shared_a"]:
        if not isinstance(group, list) or len(group) < 2 or \
                any(name not in settings["layers"] for name in group):
            raise ValueError(f"{where}: 'shared_a' should list groups of the adapters' names, "
                             f"got {group!r:.120}")
    return settings


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def apply_adapter_settings(model: Module, settings: dict[str, Any]) -> None:
    """Put on ``model`` (frozen, as :func:`apply_lora` does) the adapters ``settings``
    (:func:`adapter_settings`) describe: each named Linear wrapped with its rank, alpha
    and dropout, the groups of ``shared_a`` given one A, the merged ones merged.  A name
    that is not a Linear of ``model`` is a ValueError naming it."""
    if lora_layers(model):
        raise ValueError(f"{type(model).__name__} holds LoRA adapters already: the saved ones "
                         "go on the base model")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, (Linear,
                                                                               Embedding))}
    missing = [name for name in settings["layers"] if name not in linears]
    if missing:
        raise ValueError(f"the saved LoRA adapters are on {missing[:3]}, which are not Linear "
                         f"or Embedding layers of {type(model).__name__}")
    model.freeze()
    for name, layer in settings["layers"].items():
        base = linears[name]
        extra = () if isinstance(base, Linear) else (layer.get("padding_idx"),)
        adapter = adapter_class(base)(base, layer["r"], layer["alpha"], layer["dropout"], *extra)
        replace_module(model, name, adapter)
    adapters = lora_layers(model)
    for group in settings["shared_a"]:
        share_lora_a([adapters[name] for name in group])


def merge_saved_adapters(model: Module, settings: dict[str, Any]) -> None:
    """Merge the adapters ``settings`` say were merged (after their weights are loaded)."""
    adapters = lora_layers(model)
    for name, layer in settings["layers"].items():
        if layer["merged"]:
            adapters[name].merge()


def adapter_differences(values: dict[str, Any] | None, own: dict[str, Any] | None) -> list[str]:
    """How the adapters of two :func:`adapter_settings` differ, one line per difference,
    naming the layer and the setting (``values``: the checkpoint's, ``own``: the model's)."""
    saved_layers = (values or {}).get("layers", {})
    own_layers = (own or {}).get("layers", {})
    lines = []
    for here, there, mine, theirs in (("checkpoint", "model", saved_layers, own_layers),
                                      ("model", "checkpoint", own_layers, saved_layers)):
        only = [n for n in mine if n not in theirs]
        if only:
            lines.append(f"adapters on {only[:3]}{' ...' if len(only) > 3 else ''} in the "
                         f"{here}, not in the {there} (targets)")
    for name in saved_layers:
        if name in own_layers:
            for key in ("r", "alpha", "dropout", "merged", "padding_idx"):
                a, b = saved_layers[name].get(key), own_layers[name].get(key)
                if a != b:
                    lines.append(f"{name} {key}: checkpoint {a!r}, model {b!r}")
    saved_groups = sorted(map(sorted, (values or {}).get("shared_a", [])))
    own_groups = sorted(map(sorted, (own or {}).get("shared_a", [])))
    if not lines and saved_groups != own_groups:
        lines.append(f"adapters sharing one A: checkpoint {saved_groups}, model {own_groups}")
    return lines
