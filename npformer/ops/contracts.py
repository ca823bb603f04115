"""The contracts of the ops, declared once and checked at the door.

An op in :mod:`npformer.ops` or :mod:`npformer.fast` is its derivation and nothing
else.  Its contract (what its arguments must be) is named on the decorator beside its
signature and written here, once, for both tiers:

    @forward_op(linear_inputs)            # x (..., D_in), w (D_in, D_out), b (D_out,)
    def linear_forward(x, w, b=None): ...

    @backward_op(linear_forward)          # dy of the forward's output shape and dtype
    def linear_backward(dy, values): ...

:func:`forward_op` checks the contract and wraps what the body keeps for its backward in
a :class:`Saved` naming the op, its tier and the output's shape and dtype;
:func:`backward_op` refuses saved values that are not its forward's (None, another op's,
the other tier's) and checks the upstream gradient; :func:`checked_op` checks the
contract of an op without a backward (masks, tables).

Checked once, at the door.  The first public entry a call passes (an op called by a
user, a :class:`npformer.nn.Module`'s forward or backward) checks its contract and runs
everything inside it *trusted*: the ops and modules it calls skip their contracts.  A
module whose inputs are more than one op's (a block, a model) declares
``check_inputs``.  The owner of saved values is checked on every backward (O(1)).

Why not shape annotations checked at run time (jaxtyping with beartype): checking them
at every op of a training step costs many times the call itself (``bench/README.md``
has the measurement), where a contract costs one attribute read inside the door; and
the errors the suite requires (which argument, which axis, the sizes, the token id out
of range) need the checks below anyway.

The exceptions: TypeError for the wrong kind (not an array, wrong dtype, not this op's
saved values), ValueError for a wrong shape or value, RuntimeError for a backward with
no forward, :class:`TokenIdError` (an IndexError and a ValueError) for a token id
outside the vocabulary, :class:`KindError` (a TypeError and a ValueError) for a value of
the wrong kind.  Every check is O(1) except the token-id range scan, one per door.

This module imports only :mod:`npformer.backend`, so every module may use its converters,
one per kind of argument: a switch (:func:`check_flag`: a bool, never "no" or 0/1), a count
(:func:`check_size`: an integer, not a bool or 5.0), a real number in a range
(:func:`check_real`, :func:`check_probability`), a path (:func:`check_path`: never ""), a
list of words (:func:`check_strings`, :func:`check_string_lists`: a str refused by name, an
item by its position), a JSON document (:func:`read_json_object`).  The rules of other
owners live with them (configs, optimizers, weight loaders, decoders, the command line).
"""
from __future__ import annotations

import functools
import json
import math
import numbers
import os
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy

from .. import backend
from ..backend import Array

ACTIVATION_NAMES = ("relu", "gelu", "gelu_tanh")  # every tier's table has exactly these
FLOAT_DTYPES = ("float32", "float64")  # what the ops compute in
POOLINGS = ("mean", "max", "first")


class KindError(TypeError, ValueError):
    """An argument of the wrong kind (a str where a switch or a list of words is meant, a
    float where a count is): a TypeError, and a ValueError as the configs and the data's
    readers have always raised for a value they cannot take."""


class TokenIdError(IndexError, ValueError):
    """A token id outside the vocabulary: an IndexError, as PyTorch's embedding raises, and a
    ValueError, as :mod:`npformer.decoding` raises for the same mistake."""


# =========================================================================== the door
class _State(threading.local):
    trusted = False  # inside a door: contracts already checked (each thread its own)


state = _state = _State()  # ``state.trusted``: the test an op's first statement makes


def trusted() -> bool:
    """Whether this call is inside a door that has checked its contract."""
    return _state.trusted


@contextmanager
def trusting() -> Iterator[None]:
    """A block run trusted (``with trusting(): model.backward(dlogits)``): for code of the
    package that calls a door with values it computed itself.  A ``with`` block adds no
    frame to the stack of what runs inside it, as :func:`run_trusted` would."""
    if _state.trusted:
        yield
        return
    _state.trusted = True
    try:
        yield
    finally:
        _state.trusted = False


def run_trusted(body: Callable, *args: Any, **kwargs: Any) -> Any:
    """body(*args, **kwargs) with every contract inside it skipped (the door checked)."""
    with trusting():
        return body(*args, **kwargs)


class Saved(NamedTuple):
    """What a forward keeps for its backward, and who made it."""

    op: str  # the forward's name, e.g. "relu_forward"
    tier: str  # "textbook" or "fast"
    shape: tuple  # the forward's output's shape
    dtype: Any  # the forward's output's dtype
    values: Any  # what the backward's derivation reads


ForwardOp = Callable[..., tuple[Array, Saved]]  # returns (output, with_saved(...)'s Saved)
UpstreamCheck = Callable[[Any, Saved, str], None]  # upstream(dy, saved, what) raises if wrong


def tier_of(function: Callable) -> str:
    return "fast" if function.__module__.startswith("npformer.fast") else "textbook"


# An op is its own function, with no wrapper: a debugger stepping into
# ``ops.attention_forward(...)`` lands on its first line, the door's test
# ``if not state.trusted: return door(attention_forward, q, k, v, mask)`` (inside a door,
# one attribute read; outside, door() checks the decorator's contract and calls it again).
def door(op: Callable, *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)`` called from outside a door: its contract checked (a
    backward's: its saved values' owner, then the upstream gradient), then ``op`` run trusted."""
    op.contract(*args, **kwargs)
    return run_trusted(op, *args, **kwargs)


def with_saved(forward: Callable, out: Array, values: Any) -> tuple[Array, Saved]:
    """(out, the :class:`Saved` of ``values`` made by ``forward``): a forward's return."""
    return out, Saved(forward.op_name, forward.tier, tuple(out.shape), out.dtype, values)


def opened(forward: ForwardOp, saved: Any) -> Any:
    """The saved values of ``saved`` if ``forward`` made it (same op, same tier): a
    backward's first read; otherwise the error naming the backward and what was passed.
    (The backward names its forward, not itself: a test's spy may stand in its place.)"""
    if type(saved) is Saved and saved.op == forward.op_name and saved.tier == forward.tier:
        return saved.values
    refuse_saved(saved, forward.op_name.replace("_forward", "_backward"), forward)


def checked_op(contract: Callable[..., None]) -> Callable[[Callable], Callable]:
    """An op without a backward: ``contract(*args)`` checked at the door (the op's first
    statement calls :func:`door` outside one)."""
    def decorate(op):
        op.contract = contract
        op.unchecked = functools.partial(run_trusted, op)
        return op
    return decorate


def forward_op(contract: Callable[..., None],
               tier: str | None = None) -> Callable[[ForwardOp], ForwardOp]:
    """A forward ``op(*args) -> (output, Saved)``: the contract checked at the door (its
    first statement), its saved values returned by :func:`with_saved` in a :class:`Saved`
    naming this op and tier (``tier``: default the op's package).  ``op.unchecked(*args)``:
    (output, values), run trusted."""
    def decorate(op):
        op.contract, op.op_name, op.tier = contract, op.__name__, tier or tier_of(op)

        def unchecked(*args, **kwargs):
            out, saved = op(*args, **kwargs) if _state.trusted else run_trusted(op, *args,
                                                                                **kwargs)
            return out, saved.values
        op.unchecked = unchecked
        return op
    return decorate


def backward_op(forward: ForwardOp,
                upstream: UpstreamCheck | None = None) -> Callable[[Callable], Callable]:
    """A backward ``op(d_output, saved, ...)`` of ``forward``: the saved values must be that
    forward's (same op, same tier; :func:`opened`, on every call) and, at the door, the
    upstream gradient of its output's shape and dtype (``upstream(dy, saved, what)``:
    another rule, e.g. the scalar gradient of a loss).  ``op.unchecked(dy, values, ...)``:
    the derivation on saved values, run trusted."""
    upstream = upstream or check_upstream_of

    def decorate(op):
        name = forward.op_name.replace("_forward", "_backward")

        def contract(dy, saved, *args, **kwargs):
            opened(forward, saved)
            upstream(dy, saved, name)

        def unchecked(dy, values, *args, **kwargs):
            saved = Saved(forward.op_name, forward.tier, (), None, values)
            if _state.trusted:
                return op(dy, saved, *args, **kwargs)
            return run_trusted(op, dy, saved, *args, **kwargs)
        op.contract, op.op_name, op.tier, op.forward = contract, name, forward.tier, forward
        op.unchecked = unchecked
        return op
    return decorate


def refuse_saved(saved: Any, backward: str, forward: Callable) -> None:
    """The error for saved values that are not ``forward``'s (raised; never returns)."""
    made_by = forward.op_name
    if saved is None:
        raise RuntimeError(f"{backward} got no saved values (None): run {made_by} first and "
                           "pass the saved values it returned")
    if type(saved) is Saved and saved.op == made_by:
        raise TypeError(f"{backward} got saved values of another tier (made by {saved.op} of "
                        f"the {saved.tier} tier): pass the saved values that {made_by} of the "
                        f"{forward.tier} tier returned; do not mix the tiers' ops between a "
                        "forward and its backward")
    what = (f"saved values of {saved.op}, {saved.tier} tier" if type(saved) is Saved
            else type(saved).__name__)
    raise TypeError(f"{backward} got invalid saved values ({what}): pass the saved values "
                    f"that {made_by} of the same tier returned")


def check_upstream_of(dy: Array, saved: Saved, what: str) -> None:
    """The default backward contract: dy of the forward's output shape and dtype."""
    check_upstream(dy, saved.shape, what, saved.dtype)


# =========================================================================== arrays
def check_array(x: Any, what: str) -> None:
    """x must be an array of some array library (not a list, a number or None)."""
    import array_api_compat

    if not array_api_compat.is_array_api_obj(x):
        raise TypeError(f"{what} must be an array, got {type(x).__name__}: convert host data "
                        "with npformer.backend.asarray(...)")


def check_float(x: Any, what: str) -> None:
    check_array(x, what)
    xp = backend.namespace_of(x)
    if x.dtype not in tuple(getattr(xp, name) for name in FLOAT_DTYPES):
        raise TypeError(f"{what} must be a floating-point array ({' or '.join(FLOAT_DTYPES)}), "
                        f"got dtype {x.dtype}")


def check_integers(x: Any, what: str) -> None:
    check_array(x, what)
    if not backend.is_integer_array(x):
        raise TypeError(f"{what} must be integers, got dtype {x.dtype}")


def check_rank(x: Any, ranks: int | tuple[int, ...], what: str) -> None:
    check_array(x, what)
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if x.ndim not in ranks:
        expected = " or ".join(str(r) for r in ranks)
        raise ValueError(f"{what} must have {expected} dimensions, got shape {tuple(x.shape)}")


def check_min_rank(x: Any, rank: int, what: str, axes: str) -> None:
    if x.ndim < rank:
        raise ValueError(f"{what} must have at least {rank} dimensions ({axes}), got shape "
                         f"{tuple(x.shape)}")


def check_last_dim(x: Any, width: int, what: str) -> None:
    check_array(x, what)
    if x.ndim == 0 or x.shape[-1] != width:
        raise ValueError(f"{what} must have last dimension {width}, got shape {tuple(x.shape)}")


def broadcast_shape(a: tuple, b: tuple) -> tuple | None:
    """NumPy broadcasting of two shapes, or None if they do not broadcast."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da != db and 1 not in (da, db):
            return None
        out.append(db if da == 1 else da)  # a 1 takes the other's size, 0 included
    return tuple(reversed(out))


def check_mask(mask: Any, scores_shape: tuple, what: str = "attention mask",
               target: str = "the attention scores") -> None:
    """A mask must be boolean (True = may attend) and broadcast to the scores
    (``target`` names what it must broadcast to, for the message)."""
    check_array(mask, what)
    xp = backend.namespace_of(mask)
    if mask.dtype != xp.bool:
        raise TypeError(f"{what} must be a boolean array (True = may attend), got dtype "
                        f"{mask.dtype}")
    if broadcast_shape(tuple(mask.shape), tuple(scores_shape)) != tuple(scores_shape):
        legend = (" (batch, heads, queries, keys)"
                  if target == "the attention scores" and len(scores_shape) == 4 else "")
        raise ValueError(f"{what} of shape {tuple(mask.shape)} does not broadcast to {target} "
                         f"of shape {tuple(scores_shape)}{legend}")


def check_token_ids(ids: Any, vocab_size: int, what: str = "token ids",
                    allowed_extra: Collection[int] | None = None) -> None:
    """Ids must be integers in [0, vocab_size) (``allowed_extra``, e.g. an ignore index,
    passes too)."""
    check_array(ids, what)
    if not backend.is_integer_array(ids):
        raise TypeError(f"{what} must be an integer array, got dtype {ids.dtype}")
    if math.prod(ids.shape) == 0:
        return
    xp = backend.namespace_of(ids)
    checked = ids
    if allowed_extra is not None:
        checked = xp.where(ids == allowed_extra, xp.zeros_like(ids), ids)
    low, high = backend.host_range(checked)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise TokenIdError(f"{what} out of range: found id {bad}, but the vocabulary has "
                           f"{vocab_size} entries (valid ids are 0..{vocab_size - 1})")


def check_size(value: Any, what: str, minimum: int = 0, optional: bool = False) -> int | None:
    """A count or size (an integer, Python's or NumPy's, not a bool or a float) of at least
    ``minimum``; returned as an int (None passes when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, numbers.Integral):
        raise KindError(f"{what} must be an integer{' or None' if optional else ''}, got "
                        f"{value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum}, got {value}")
    return int(value)


def check_real(value: Any, what: str, minimum: float = -math.inf, inclusive: bool = True,
               optional: bool = False, hint: str = "", maximum: float = math.inf,
               max_inclusive: bool = False) -> float | None:
    """A finite real number (not a bool) >= ``minimum`` (> it when not ``inclusive``) and,
    given a finite ``maximum``, < it (<= it when ``max_inclusive``); returned as a float
    (None passes when ``optional``).  ``hint`` ends the message."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, numbers.Real):
        raise KindError(f"{what} must be a real number{' or None' if optional else ''}, got "
                        f"{value!r} ({type(value).__name__}){hint}")
    value = float(value)
    above = value >= minimum if inclusive else value > minimum
    below = value <= maximum if max_inclusive else value < maximum
    if not (math.isfinite(value) and above and below):  # NaN fails every comparison
        if maximum != math.inf:
            bound = (f" in {'[' if inclusive else '('}{minimum:g}, {maximum:g}"
                     f"{']' if max_inclusive else ')'}")
        else:
            bound = "" if minimum == -math.inf else f" {'>=' if inclusive else '>'} {minimum:g}"
        raise ValueError(f"{what} must be a finite number{bound}{hint}, got {value}")
    return value


def check_axis(x: Any, axis: Any, what: str) -> None:
    """``axis`` must be an integer naming an axis of x."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{what} axis must be an integer, got {axis!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{what} has no axis {axis}: its shape is {tuple(x.shape)}")


def check_same_dtype(what: str, **arrays: Any) -> None:
    """The floating-point inputs of one op share one dtype (none is silently cast)."""
    present = {name: a for name, a in arrays.items() if a is not None}
    backend.check_one_library(what, **present)  # arrays of two libraries: named first
    dtypes = {name: a.dtype for name, a in present.items()}
    if len(set(map(str, dtypes.values()))) > 1:
        listed = ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        raise TypeError(f"{what} inputs must share one dtype, got {listed}")


def check_choice(value: Any, choices: Collection, what: str, label: str = "") -> None:
    """``value`` must be one of ``choices`` (the message lists them)."""
    try:
        known = value in choices
    except TypeError:  # an unhashable value
        known = False
    if not known:
        raise ValueError(f"unknown {what} {value!r}; choose one of {label or sorted(choices)}")


def check_probability(p: Any, what: str = "dropout probability") -> float:
    """A number in [0, 1), returned as a float."""
    if isinstance(p, (bool, numpy.bool_)) or not isinstance(p, numbers.Real):
        raise KindError(f"{what} must be a number in [0, 1), got {p!r}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{what} must be in [0, 1), got {p}")
    return float(p)


def shown(value: Any) -> str:
    """A refused value as a message shows it: a NumPy scalar as its Python value and type
    (``-1 (int64)``, not ``np.int64(-1)``), anything else as its repr, cut short."""
    if isinstance(value, numpy.generic):
        return f"{value.item()!r} ({type(value).__name__})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_path(value: Any, what: str, optional: bool = False) -> str | None:
    """A file or folder's path: a non-empty str or os.PathLike (never "", which would
    name the current folder, nor bytes or a number); returned as a str (None passes
    when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise KindError(f"{what} must be a path (a str or os.PathLike), got {shown(value)} "
                        f"({type(value).__name__})")
    if not value.strip():
        raise ValueError(f"{what} must be a path, got the empty name {value!r}")
    return value


def _as_list(values: Any, what: str, kind: str, hint: str = "") -> list:
    """``values`` as a list; a str or bytes (one text, whose characters would be taken for
    its items; ``hint``, its message's end, ``{}`` the text) or a value that is no
    iterable refused naming ``what``."""
    if isinstance(values, (str, bytes)):
        raise KindError(f"{what} must be a list of {kind}, got a {type(values).__name__} "
                        f"({shown(values)}){hint.format(shown(values))}")
    try:
        return list(values)
    except TypeError:
        raise KindError(f"{what} must be a list of {kind}, got {shown(values)} "
                        f"({type(values).__name__})") from None


def check_strings(values: Any, what: str, item: str = "word") -> list[str]:
    """A list of strings (words, pieces, tokens): any iterable of str but a str itself;
    an element that is not a str is refused naming its position.  Returned as a list."""
    values = _as_list(values, what, f"{item}s", f": pass [{{}}] for one {item}, or split "
                      f"the text into {item}s")
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise KindError(f"{what}[{i}] must be a {item} (a str), got {shown(value)} "
                            f"({type(value).__name__})")
    return values


def check_string_lists(values: Any, what: str, item: str = "word") -> list[list[str]]:
    """A corpus: a list of lists of strings (each a sentence's words), as
    :func:`check_strings` checks each; a str, or a list of str where lists are meant,
    refused by name."""
    rows = _as_list(values, what, f"{item} lists")
    return [check_strings(row, f"{what}[{i}]", item) for i, row in enumerate(rows)]


def read_json_object(text: Any, what: str, required: Collection[str] = (),
                     expected: str = "a JSON object", kind: str | None = None) -> dict:
    """The JSON object (a dict) a document holds, refused naming the document (``what``,
    e.g. "the checkpoint's BPE") as not ``expected`` and why: not a str (or a 0-d array
    of one), not JSON, not an object, without a ``required`` key, or (``kind``: a
    serialised object's class) whose "type" is not ``kind``."""
    if getattr(text, "shape", None) == ():  # a string saved in an .npz: a 0-d array
        text = text.item()
    if not isinstance(text, (str, bytes)):
        raise KindError(f"{what} must be a JSON document (a str), got {shown(text)} "
                        f"({type(text).__name__})")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} is not {expected}: it is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} is not {expected}: it holds a JSON "
                         f"{type(data).__name__}, not an object {{...}}")
    missing = [key for key in required if key not in data]
    if missing:
        raise ValueError(f"{what} is not {expected}: it has no "
                         f"{', '.join(repr(k) for k in missing)} (its keys: {sorted(data)})")
    if kind is not None and data.get("type") != kind:
        raise ValueError(f"{what} is not {expected}: its \"type\" is {shown(data.get('type'))}, "
                         f"not \"{kind}\"")
    return data


def check_upstream(dy: Any, expected: tuple, what: str, dtype: Any = None,
                   source: str = "the forward's output") -> None:
    """The upstream gradient must be a floating-point array of the forward's output shape
    (and, given ``dtype``, of the output's dtype: the fast tier writes into its buffers)."""
    check_float(dy, f"the upstream gradient of {what}")
    if tuple(dy.shape) != tuple(expected):
        raise ValueError(f"the upstream gradient of {what} has shape {tuple(dy.shape)}, but "
                         f"{source} had shape {tuple(expected)}")
    if dtype is not None and dy.dtype != dtype:
        raise TypeError(f"the upstream gradient of {what} has dtype {dy.dtype}, but "
                        f"{source} had dtype {dtype}")


def check_loss_gradient(dloss: Any, saved: Saved, what: str) -> None:
    """The gradient of the (scalar) loss: a real number or a 0-d floating-point array."""
    if isinstance(dloss, numbers.Real) and not isinstance(dloss, bool):
        return
    check_float(dloss, f"the upstream gradient of {what} (of the scalar loss)")
    if tuple(dloss.shape) != ():
        raise ValueError(f"the upstream gradient of {what} must be a scalar (the loss is one "
                         f"number), got shape {tuple(dloss.shape)}")


# =========================================================================== op contracts
# Each takes its op's arguments (same names, same defaults).  Shape letters as in
# npformer.ops: B batch, T queries, S keys, E query/key width, F value width,
# D width, V vocabulary, L table length.
def check_flag(value: Any, what: str, optional: bool = False, hint: str = "") -> bool | None:
    """A switch: True or False (Python's or NumPy's bool), never a truthy string or number
    (``"no"``, ``0``, ``1``); returned as Python's bool (None passes when ``optional``;
    ``hint`` says what None means)."""
    if value is None and optional:
        return None
    if not isinstance(value, (bool, numpy.bool_)):
        allowed = "True, False or None" + hint if optional else "True or False"
        raise KindError(f"{what} must be {allowed}, got {shown(value)}")
    return bool(value)


def linear_inputs(x: Array, w: Array, b: Array | None = None) -> None:
    """x (..., D_in) floats, W (D_in, D_out) floats with D_in, D_out >= 1, b None or
    (D_out,), all of one dtype."""
    check_float(x, "linear input")
    check_float(w, "linear weight")
    check_rank(w, 2, "linear weight (in_features, out_features)")
    if 0 in tuple(w.shape):
        raise ValueError(f"linear weight must have at least one input and one output feature, "
                         f"got shape {tuple(w.shape)}")
    if b is not None:
        check_float(b, "linear bias")
        if tuple(b.shape) != (w.shape[1],):
            raise ValueError(f"linear bias must have shape ({w.shape[1]},), got "
                             f"{tuple(b.shape)}")
    check_same_dtype("linear", input=x, weight=w, bias=b)
    check_last_dim(x, w.shape[0], "linear input")


def lora_inputs(x: Array, x_dropped: Array, w: Array, b: Array | None, lora_a: Array,
                lora_b: Array, scale: float) -> None:
    """The frozen map's x, W, b as :func:`linear_inputs`'; x_dropped of x's shape;
    lora_a (D_in, r) and lora_b (r, D_out) floats of x's dtype with r >= 1; scale a finite
    real number."""
    linear_inputs(x, w, b)
    check_real(scale, "LoRA scale (alpha / r)")
    check_float(x_dropped, "LoRA adapter input")
    if tuple(x_dropped.shape) != tuple(x.shape):
        raise ValueError(f"LoRA adapter input (dropout of x) must have x's shape "
                         f"{tuple(x.shape)}, got {tuple(x_dropped.shape)}")
    for name, matrix in (("LoRA A", lora_a), ("LoRA B", lora_b)):
        check_float(matrix, name)
        check_rank(matrix, 2, name)
    d_in, d_out = w.shape
    if lora_a.shape[0] != d_in or lora_a.shape[1] < 1 or tuple(lora_b.shape) != (
            lora_a.shape[1], d_out):
        raise ValueError(f"LoRA A must have shape (D_in, r) = ({d_in}, r) with r >= 1 and B "
                         f"(r, D_out) = (r, {d_out}), got A {tuple(lora_a.shape)} and B "
                         f"{tuple(lora_b.shape)}")
    check_same_dtype("LoRA", input=x, adapter_input=x_dropped, A=lora_a, B=lora_b)


def _norm_operands(x: Array, what: str, **parameters: Array) -> None:
    """The rules the layer norm and the RMS norm share: x (..., D) and each of
    ``parameters`` (D,) with D >= 1, floats of one dtype (and one library)."""
    check_array(x, f"{what} input")
    for name, parameter in parameters.items():
        check_float(parameter, f"{what} {name}")
        check_rank(parameter, 1, f"{what} {name}")
    shapes = [tuple(parameter.shape) for parameter in parameters.values()]
    if shapes[0][0] == 0 or len(set(shapes)) > 1:
        both = "both " if len(shapes) > 1 else ""
        raise ValueError(f"{what} {' and '.join(parameters)} must {both}have shape (D,) with "
                         f"D >= 1, got {' and '.join(map(str, shapes))}")
    check_float(x, f"{what} input")
    check_last_dim(x, shapes[0][0], f"{what} input")
    check_same_dtype(what, input=x, **parameters)


def layernorm_inputs(x: Array, gamma: Array, beta: Array, eps: float = 1e-5) -> None:
    """x (..., D), gamma (D,), beta (D,) with D >= 1, floats of one dtype; eps a finite
    real number >= 0."""
    check_real(eps, "layer norm eps", minimum=0.0)
    _norm_operands(x, "layer norm", weight=gamma, bias=beta)


def rmsnorm_inputs(x: Array, weight: Array, eps: float = 1e-6) -> None:
    """x (..., D), weight (D,) with D >= 1, floats of one dtype; eps a finite real > 0."""
    check_real(eps, "RMS norm eps", minimum=0.0, inclusive=False)
    _norm_operands(x, "RMS norm", weight=weight)


ROPE_TYPES = ("llama3",)  # the rope_scaling types of rotary_table (None: no scaling)
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")


def check_rope_scaling(scaling: Any) -> None:
    """``scaling``: None, or a ``rope_scaling`` dict as Hugging Face's configs hold it, of
    ``rope_type`` (or the older ``type``) "llama3" with its four numbers: factor > 0,
    0 < low_freq_factor < high_freq_factor, original_max_position_embeddings >= 1."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise KindError(f"rope_scaling must be None or a dict, got {shown(scaling)} "
                        f"({type(scaling).__name__})")
    rope_type = scaling.get("rope_type", scaling.get("type"))
    check_choice(rope_type, ROPE_TYPES, "rope_scaling rope_type")
    missing = [key for key in LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of rope_type 'llama3' needs {', '.join(missing)} "
                         f"(its keys: {sorted(scaling)})")
    check_real(scaling["factor"], "rope_scaling factor", minimum=0.0, inclusive=False)
    low = check_real(scaling["low_freq_factor"], "rope_scaling low_freq_factor", minimum=0.0,
                     inclusive=False)
    check_real(scaling["high_freq_factor"], "rope_scaling high_freq_factor", minimum=low,
               inclusive=False, hint=f" (above low_freq_factor {low:g})")
    check_size(scaling["original_max_position_embeddings"],
               "rope_scaling original_max_position_embeddings", 1)


def check_rotary_width(head_dim: Any, what: str = "head_dim") -> int:
    """A rotated head's width E: an even integer >= 2, the rotation turning pairs of
    features (i, i + E/2) (one place for the rule: the op, the layer, the config, the
    demo's options); returned as an int."""
    width = check_size(head_dim, what, 2)
    if width % 2:
        raise ValueError(f"{what} must be even (the rotation turns pairs of features "
                         f"(i, i + E/2)), got {width}")
    return width


def rotary_table_inputs(positions: Array, head_dim: int, theta: float = 10000.0,
                        scaling: dict | None = None, dtype: Any = None) -> None:
    """positions (..., T) integers; head_dim an even integer >= 2; theta a finite real > 0;
    scaling None or a llama3 ``rope_scaling``; dtype None or a float dtype."""
    check_integers(positions, "rotary positions")
    check_min_rank(positions, 1, "rotary positions", "..., positions")
    check_rotary_width(head_dim)
    check_real(theta, "rope_theta", minimum=0.0, inclusive=False)
    check_rope_scaling(scaling)
    xp = backend.namespace_of(positions)
    if dtype is not None and dtype not in tuple(getattr(xp, name) for name in FLOAT_DTYPES):
        raise TypeError(f"rotary table dtype must be {' or '.join(FLOAT_DTYPES)} (of the "
                        f"positions' library), got {dtype}")


def rotary_inputs(x: Array, cos: Array, sin: Array) -> None:
    """x (B, H, T, E) floats with E even >= 2; cos and sin (T, E) or (B or 1, T, E) of x's
    dtype (the tables of :func:`npformer.ops.rotary_table`)."""
    check_float(x, "rotary input")
    check_rank(x, 4, "rotary input (batch, heads, positions, head_dim)")
    batch, _, length, width = x.shape
    if width == 0 or width % 2:
        raise ValueError(f"rotary input must have an even head_dim (last axis) of at least 2, "
                         f"got shape {tuple(x.shape)}")
    for name, table in (("rotary cos", cos), ("rotary sin", sin)):
        check_float(table, name)
        check_rank(table, (2, 3), f"{name} (positions, head_dim) or (batch, positions, "
                                  "head_dim)")
        if tuple(table.shape[-2:]) != (length, width) or (
                table.ndim == 3 and table.shape[0] not in (1, batch)):
            raise ValueError(f"{name} of shape {tuple(table.shape)} does not fit the rotary "
                             f"input of shape {tuple(x.shape)}: expected ({length}, {width}) "
                             f"or ({batch} or 1, {length}, {width})")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"rotary cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must "
                         "have one shape")
    check_same_dtype("rotary", input=x, cos=cos, sin=sin)


def swiglu_inputs(a: Array, b: Array) -> None:
    """a (the gate) and b (the up projection) floats of one shape and dtype."""
    check_float(a, "SwiGLU gate")
    check_float(b, "SwiGLU up projection")
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"SwiGLU gate {tuple(a.shape)} and up projection {tuple(b.shape)} "
                         "must have one shape")
    check_same_dtype("SwiGLU", gate=a, up=b)


def _attention_operands(q: Array, k: Array, v: Array, mask: Array | None, what: str,
                        rank: int, axes: str) -> None:
    """The rules attention and grouped attention share: q (..., T, E), k (..., S, E),
    v (..., S, F) floats of one dtype with at least ``rank`` axes (``axes`` names the last
    ones), E >= 1; k and v agree on every axis but the last, q and k on the last and on
    those before the last ``rank`` (grouped attention's head counts differ: its contract
    checks them); mask boolean broadcasting to (..., T, S)."""
    for name, a in (("queries", q), ("keys", k), ("values", v)):
        check_array(a, f"{what} {name}")
    for name, a in (("queries", q), ("keys", k), ("values", v)):
        check_float(a, f"{what} {name}")
        check_min_rank(a, rank, f"{what} {name}", axes)
    if q.shape[-1] == 0:
        raise ValueError(f"{what} queries and keys must have a width (last axis) of at "
                         f"least 1, got queries of shape {tuple(q.shape)}")
    check_same_dtype(what, queries=q, keys=k, values=v)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{what} keys {tuple(k.shape)} and values {tuple(v.shape)} "
                         "must agree on every axis but the last")
    if q.shape[:-rank] != k.shape[:-rank] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{what} queries {tuple(q.shape)} and keys {tuple(k.shape)} "
                         "must agree on the leading axes and the last (width) axis")
    if mask is not None:  # named as the caller knows it, before any work is done
        check_mask(mask, tuple(q.shape[:-1]) + (k.shape[-2],), "attention mask")


def attention_inputs(q: Array, k: Array, v: Array, mask: Array | None = None) -> None:
    """q (..., T, E), k (..., S, E), v (..., S, F) floats of one dtype, E >= 1, mask
    boolean broadcasting to (..., T, S)."""
    _attention_operands(q, k, v, mask, "attention", 2, "positions, width")


def grouped_attention_inputs(q: Array, k: Array, v: Array, mask: Array | None = None) -> None:
    """q (..., H, T, E), k (..., Hkv, S, E), v (..., Hkv, S, F) floats of one dtype, E >= 1,
    H a multiple of Hkv (each key/value head serves H / Hkv query heads); mask boolean
    broadcasting to (..., H, T, S)."""
    _attention_operands(q, k, v, mask, "grouped attention", 3, "heads, positions, width")
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"grouped attention: the queries' {heads} heads (axis -3 of "
                         f"{tuple(q.shape)}) must be a multiple of the keys' and values' "
                         f"{kv_heads} heads (axis -3 of {tuple(k.shape)}): each key/value head "
                         "serves a group of query heads; num_heads must be a "
                         "multiple of num_kv_heads")


def attention_weights_inputs(q: Array, k: Array, mask: Array | None = None) -> None:
    attention_inputs(q, k, k, mask)


def softmax_inputs(x: Array, axis: int = -1, mask: Array | None = None,
                   overwrite_input: bool = False) -> None:
    """x (...) floats, axis one of its axes, mask boolean broadcasting to x."""
    check_float(x, "softmax input")
    check_axis(x, axis, "softmax input")
    if mask is not None:
        check_mask(mask, tuple(x.shape), "softmax mask", target="the softmax input")


def log_softmax_inputs(x: Array, axis: int = -1) -> None:
    check_float(x, "log-softmax input")
    check_axis(x, axis, "log-softmax input")


def activation_input(name: str) -> Callable[[Any], None]:
    """The contract of an element-wise activation called ``name``: x (...) floats."""
    def contract(x) -> None:
        check_float(x, f"{name} input")
    return contract


def activation_choice(name: str, activations: Collection | None = None) -> None:
    """``name`` is in the tier's table of activations (default: every tier's names)."""
    check_choice(name, ACTIVATION_NAMES if activations is None else activations, "activation")


def dropout_inputs(x: Array, p: float, training: bool = True) -> None:
    check_float(x, "dropout input")
    check_probability(p)
    check_flag(training, "training")


def embedding_inputs(ids: Array, table: Array) -> None:
    """ids (...) integers in [0, V), table (V, D) floats with V, D >= 1."""
    check_array(ids, "token ids")
    check_float(table, "embedding table")
    check_rank(table, 2, "embedding table (vocabulary, width)")
    if 0 in tuple(table.shape):
        raise ValueError(f"embedding table must have at least one entry and a width of at "
                         f"least 1, got shape {tuple(table.shape)}")
    backend.check_one_library("embedding", ids=ids, table=table)
    check_token_ids(ids, table.shape[0])


def positions_inputs(x: Array, table: Array) -> None:
    """x (B, T, D), table (L, D) floats of one dtype, T <= L."""
    check_float(x, "input to the positional encoding")
    check_rank(x, 3, "input to the positional encoding")
    check_float(table, "positional table")
    check_rank(table, 2, "positional table (block_size, d_model)")
    check_same_dtype("positional encoding", input=x, table=table)
    _, seq_len, d_model = x.shape
    block_size = table.shape[0]
    if seq_len > block_size:
        raise ValueError(f"sequence of length {seq_len} is longer than the positional "
                         f"table ({block_size} positions); raise block_size in the config")
    if d_model != table.shape[1]:
        raise ValueError(f"input width {d_model} does not match the positional table "
                         f"width {table.shape[1]}")


def sinusoidal_inputs(block_size: int, d_model: int, dtype: Any = None,
                      like: Array | None = None) -> None:
    check_size(block_size, "block_size")
    check_size(d_model, "d_model", 1)


def pool_inputs(h: Array, valid_lens: Array, how: str = "mean") -> None:
    """h (B, T, D) floats, valid_lens (B,) integers in [1, T] (T >= 1 unless B = 0)."""
    check_float(h, "pooling input")
    check_rank(valid_lens, 1, "valid lengths")
    check_integers(valid_lens, "valid lengths")
    backend.check_one_library("pooling", input=h, valid_lengths=valid_lens)
    check_rank(h, 3, "pooling input (batch, positions, width)")
    if how not in POOLINGS:
        raise ValueError(f"unknown pooling {how!r}; choose one of {POOLINGS}")
    batch, length, _ = h.shape
    if tuple(valid_lens.shape) != (batch,):
        raise ValueError(f"valid lengths of shape {tuple(valid_lens.shape)} do not match "
                         f"the batch of {batch} sequences")
    if batch == 0:  # no sequences: nothing to pool
        return
    if length == 0:
        raise ValueError(f"pooling needs at least one position per sequence, but the input "
                         f"of shape {tuple(h.shape)} has none (axis 1, the positions, is empty)")
    low, high = backend.host_range(valid_lens)
    if low < 1 or high > length:
        raise ValueError(f"valid lengths must be in [1, {length}] (every sequence needs at "
                         f"least one token), got values in [{low}, {high}]")


def valid_rows_inputs(h: Array, valid_lens: Array) -> None:
    """h (B, T, ...) floats, valid_lens (B,) integers in [0, T]."""
    check_float(h, "input to valid_rows")
    check_min_rank(h, 2, "input to valid_rows", "(batch, positions, ...)")
    check_rank(valid_lens, 1, "valid lengths")
    check_integers(valid_lens, "valid lengths")
    if valid_lens.shape[0] != h.shape[0]:
        raise ValueError(f"{valid_lens.shape[0]} valid lengths for a batch of {h.shape[0]}")
    check_valid_lengths(valid_lens, h.shape[1])


def cross_entropy_inputs(logits: Array, targets: Array, ignore_index: int = -100,
                         label_smoothing: float = 0.0) -> None:
    """logits (..., V) floats with V >= 1, targets (...) integers in [0, V) or
    ignore_index, label_smoothing in [0, 1]."""
    check_float(logits, "cross-entropy logits")
    check_array(targets, "cross-entropy targets")
    backend.check_one_library("cross-entropy", logits=logits, targets=targets)
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise ValueError(f"cross-entropy logits need a class axis (last) of at least one "
                         f"class, got shape {tuple(logits.shape)}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an integer, got {ignore_index!r}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"cross-entropy targets of shape {tuple(targets.shape)} do not "
                         f"match logits of shape {tuple(logits.shape)} (expected "
                         f"{tuple(logits.shape[:-1])})")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    check_token_ids(targets, logits.shape[-1], "cross-entropy targets",
                    allowed_extra=ignore_index)


def padding_mask_inputs(valid_lens: Array, num_keys: int) -> None:
    check_rank(valid_lens, 1, "valid lengths")
    check_size(num_keys, "num_keys")
    check_integers(valid_lens, "valid lengths")


def causal_mask_inputs(num_queries: int, num_keys: int | None = None,
                       like: Array | None = None) -> None:
    check_size(num_queries, "num_queries")
    if num_keys is not None:
        check_size(num_keys, "num_keys")
        if num_keys < num_queries:
            raise ValueError(f"causal mask needs at least as many keys ({num_keys}) "
                             f"as queries ({num_queries})")


# =========================================================================== layers, configs
def check_valid_lengths(valid_lens: Array, length: int, minimum: int = 0) -> None:
    """Every valid length in [minimum, length] (one min and max over the B lengths, once a
    batch); ``minimum`` 1 where every sequence needs a token (pooling)."""
    if valid_lens.shape[0] == 0:
        return
    low, high = backend.host_range(valid_lens)
    if low < minimum or high > length:
        need = " (every sequence needs at least one token)" if minimum else ""
        raise ValueError(f"valid lengths must be in [{minimum}, {length}] (the batch's "
                         f"positions){need}, got values in [{low}, {high}]")


def check_heads_divide(d_model: int, num_heads: int, d_model_name: str = "d_model",
                       num_heads_name: str = "num_heads",
                       hint: str = "or set head_dim explicitly") -> None:
    """Heads of width D / H split the width: num_heads must divide d_model (one place for
    the rule; ``d_model_name`` and ``num_heads_name`` name the two values as the caller's
    user knows them, e.g. the demos' options ``--d-model`` and ``--num-heads``)."""
    if d_model % num_heads != 0:
        raise ValueError(
            f"{d_model_name} {d_model} is not divisible by {num_heads_name} {num_heads}: each "
            f"head gets {d_model_name} / {num_heads_name} columns; choose a head count that "
            "divides the width" + (f", {hint}" if hint else ""))


def check_narrow_heads(d_model: int, num_heads: int, head_dim: int | None = None,
                       owner: str = "") -> None:
    """Narrow heads (Bloem's ``SelfAttentionNarrow``) cut the width into the heads' slices:
    num_heads must divide d_model, and a head_dim given must be that slice's width."""
    prefix = f"{owner}." if owner else ""
    check_heads_divide(d_model, num_heads, f"{prefix}d_model", f"{prefix}num_heads",
                       hint="" if not owner else "or turn narrow_heads off")
    if head_dim is not None and head_dim * num_heads != d_model:
        raise ValueError(f"narrow heads are the {num_heads} slices of width "
                         f"{d_model // num_heads} of d_model {d_model}: {prefix}head_dim must "
                         f"be None or {d_model // num_heads}, got {head_dim}")


def check_sequence_input(x: Array, width: int, what: str) -> None:
    """x must be (B, T, width)."""
    check_rank(x, 3, what + " (batch, positions, width)")
    if x.shape[-1] != width:
        raise ValueError(f"{what} has width {x.shape[-1]}, but the layer was built for "
                         f"width {width}; got shape {tuple(x.shape)}")
