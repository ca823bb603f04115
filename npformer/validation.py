"""Validation: every contract of the package, declared once and checked at the door.

An op in :mod:`npformer.ops` or :mod:`npformer.fast` is its derivation and nothing
else.  Its contract (what its arguments must be) is named on the decorator beside its
signature and written here, once, for both tiers:

    @forward_op(linear_inputs)            # x (..., D_in), w (D_in, D_out), b (D_out,)
    def linear_forward(x, w, b=None): ...

    @backward_op(linear_forward)          # dy of the forward's output shape and dtype
    def linear_backward(dy, saved): ...

* :func:`forward_op` checks the contract, runs the body, and wraps what the body keeps
  for its backward in a :class:`Cache` that says which op and which tier made it, with
  the output's shape and dtype.
* :func:`backward_op` refuses a cache that is not its forward's (None, another op's, the
  other tier's: switching engines between a forward and its backward), checks the
  upstream gradient against the output's shape and dtype, and hands the body the saved
  values.
* :func:`checked_op`: an op without a backward (masks, tables), its contract checked.

Checked once, at the door.  The first public entry a call passes (an op called by a
user, a :class:`npformer.nn.Module`'s forward or backward) checks its contract and runs
everything inside it *trusted*: the ops and modules it calls skip their contracts, since
their arguments are the door's (already checked) or values the package computed.  A
module whose inputs are more than one op's (a block, a model) declares
``check_inputs``; a leaf layer's door is its op's contract.  A cache's owner is checked
on every backward (an O(1) comparison): it is what a module cannot know.

Why a named contract per op and not shape annotations checked at run time (jaxtyping
with beartype).  The annotations would document the shapes well, but checking them costs
about 22 us a call against about 1 us for the bare op (measured for ANCHORS), and a
training step of the lm makes hundreds of op calls: milliseconds a step, where the
contract here costs one attribute read inside the door.  jaxtyping also names the
axes only: the errors the suite requires (which argument, which axis, the sizes, the
token id out of range and the vocabulary, the mask and the scores it must broadcast to)
need the checks below anyway.  So each op names its contract on its decorator, and the
shapes are the comments of the contract and of the body.

The documented exceptions: TypeError for something of the wrong kind (not an array,
wrong dtype, not this op's cache), ValueError for a wrong shape or value (an upstream
gradient whose shape is not the forward's output's, a size below its minimum),
RuntimeError for a backward with no forward to differentiate, and :class:`TokenIdError`
(an IndexError and a ValueError) for a token id outside the vocabulary.  Every check is
O(1) except the token-id range scan, one per door.

Also here: the configs' validation (:func:`check_config`) and the head-count rule
(:func:`check_heads_divide`), shared by the models and the layers; the demos' option
types (:func:`positive_int` and its kin), held to the same rules as Python arguments;
the old names of renamed fields (:func:`renamed_fields`, :func:`new_field_names`); the
optimizers' arguments (:data:`HYPERPARAMETER_RANGES`, :func:`check_parameters`,
:func:`check_gradients`); the rules every weight loader applies
(:func:`weight_array`, :func:`checked_weights`); and the models' and decoders' token
batches (:func:`model_input`, :func:`valid_lengths_from`, :func:`source_ids`).
"""
from __future__ import annotations

import functools
import math
import numbers
import sys
import threading
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy

from . import backend
from .backend import Array

if TYPE_CHECKING:  # annotations only: importing these here would be circular
    from .nn import Module

FLOAT_DTYPES = ("float32", "float64")  # what the ops compute in
POOLINGS = ("mean", "max", "first")


class TokenIdError(IndexError, ValueError):
    """A token id outside the vocabulary: an IndexError, as PyTorch's embedding raises, and a
    ValueError, as :mod:`npformer.decoding` raises for the same mistake."""


# =========================================================================== the door
class _State(threading.local):
    trusted = False  # inside a door: contracts already checked (each thread its own)


_state = _State()


def trusted() -> bool:
    """Whether this call is inside a door that has checked its contract."""
    return _state.trusted


def run_trusted(body: Callable, *args: Any, **kwargs: Any) -> Any:
    """body(*args, **kwargs) with every contract inside it skipped (the door checked)."""
    if _state.trusted:
        return body(*args, **kwargs)
    _state.trusted = True
    try:
        return body(*args, **kwargs)
    finally:
        _state.trusted = False


class Cache(NamedTuple):
    """What a forward keeps for its backward, and who made it."""

    op: str  # the forward's name, e.g. "relu_forward"
    tier: str  # "textbook" or "fast"
    shape: tuple  # the forward's output's shape
    dtype: Any  # the forward's output's dtype
    saved: Any  # what the backward's derivation reads


# The decorators' types: a forward's body returns (output, saved), the op made of it
# returns (output, Cache); a backward's body reads ``saved``, the op made of it a Cache.
ForwardBody = Callable[..., tuple[Array, Any]]
ForwardOp = Callable[..., tuple[Array, Cache]]
UpstreamCheck = Callable[[Any, Cache, str], None]  # upstream(dy, cache, what) raises if wrong


def tier_of(function: Callable) -> str:
    return "fast" if function.__module__.startswith("npformer.fast") else "textbook"


def checked_op(contract: Callable[..., None]) -> Callable[[Callable], Callable]:
    """An op without a backward: ``contract(*args)`` checked at the door."""
    def decorate(body):
        @functools.wraps(body)
        def op(*args, **kwargs):
            if _state.trusted:
                return body(*args, **kwargs)
            contract(*args, **kwargs)
            return run_trusted(body, *args, **kwargs)
        op.unchecked = body
        return op
    return decorate


def forward_op(contract: Callable[..., None],
               tier: str | None = None) -> Callable[[ForwardBody], ForwardOp]:
    """A forward ``body(*args) -> (output, saved)``: the contract checked at the door, and
    ``saved`` returned in a :class:`Cache` naming this op and tier (``tier``: default
    the body's package)."""
    def decorate(body):
        name, made_in = body.__name__, tier or tier_of(body)

        @functools.wraps(body)
        def op(*args, **kwargs):
            if _state.trusted:
                out, saved = body(*args, **kwargs)
            else:
                contract(*args, **kwargs)
                out, saved = run_trusted(body, *args, **kwargs)
            return out, Cache(name, made_in, tuple(out.shape), out.dtype, saved)
        op.unchecked, op.op_name, op.tier = body, name, made_in
        return op
    return decorate


def backward_op(forward: ForwardOp,
                upstream: UpstreamCheck | None = None) -> Callable[[Callable], Callable]:
    """A backward ``body(d_output, saved, ...)`` of ``forward``: the cache must be that
    forward's (same op, same tier) and, at the door, the upstream gradient of its
    output's shape and dtype (``upstream(dy, cache, what)``: another rule, e.g. the
    scalar gradient of a loss)."""
    upstream = upstream or check_upstream_of

    def decorate(body):
        name = forward.op_name.replace("_forward", "_backward")

        @functools.wraps(body)
        def op(dy, cache, *args, **kwargs):
            if not (type(cache) is Cache and cache.op == forward.op_name
                    and cache.tier == forward.tier):
                refuse_cache(cache, name, forward)
            if _state.trusted:
                return body(dy, cache.saved, *args, **kwargs)
            upstream(dy, cache, name)
            return run_trusted(body, dy, cache.saved, *args, **kwargs)
        op.unchecked = body
        return op
    return decorate


def forward_input(saved: tuple, x: Any) -> tuple:
    """``saved`` = (input, ...) of a forward that may not have kept its input (None
    there): the tuple with the input the backward's caller passed in its place.  Exactly
    one of the two must be given (it is the forward's input, recomputed by the caller)."""
    kept = saved[0]
    if kept is None and x is None:
        raise RuntimeError("the forward did not keep its input (keep_input=False): pass "
                           "it to the backward as x")
    if kept is not None and x is not None:
        raise RuntimeError("the forward kept its input: the backward takes no x")
    return (x if kept is None else kept,) + tuple(saved[1:])


def refuse_cache(cache: Any, backward: str, forward: Callable) -> None:
    """The error for a cache that is not ``forward``'s (raised; never returns)."""
    made_by = forward.op_name
    if cache is None:
        raise RuntimeError(f"{backward} got no cache (None): run {made_by} first and pass "
                           "the cache it returned")
    if type(cache) is Cache and cache.op == made_by:
        raise TypeError(f"{backward} got an invalid cache (made by {cache.op} of the "
                        f"{cache.tier} tier): pass the cache that {made_by} of the "
                        f"{forward.tier} tier returned; do not switch engines between a "
                        "forward and its backward")
    what = (f"a cache of {cache.op}, {cache.tier} tier" if type(cache) is Cache
            else type(cache).__name__)
    raise TypeError(f"{backward} got an invalid cache ({what}): pass the cache that "
                    f"{made_by} of the same tier returned")


def check_upstream_of(dy: Array, cache: Cache, what: str) -> None:
    """The default backward contract: dy of the forward's output shape and dtype."""
    check_upstream(dy, cache.shape, what, cache.dtype)


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
        raise ValueError(
            f"{what} must have {expected} dimensions, got shape {tuple(x.shape)}"
        )


def check_min_rank(x: Any, rank: int, what: str, axes: str) -> None:
    if x.ndim < rank:
        raise ValueError(f"{what} must have at least {rank} dimensions ({axes}), got shape "
                         f"{tuple(x.shape)}")


def check_last_dim(x: Any, width: int, what: str) -> None:
    check_array(x, what)
    if x.ndim == 0 or x.shape[-1] != width:
        raise ValueError(
            f"{what} must have last dimension {width}, got shape {tuple(x.shape)}"
        )


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
        raise TypeError(
            f"{what} must be a boolean array (True = may attend), got dtype {mask.dtype}"
        )
    if broadcast_shape(tuple(mask.shape), tuple(scores_shape)) != tuple(scores_shape):
        legend = (" (batch, heads, queries, keys)"
                  if target == "the attention scores" and len(scores_shape) == 4 else "")
        raise ValueError(
            f"{what} of shape {tuple(mask.shape)} does not broadcast to {target} "
            f"of shape {tuple(scores_shape)}{legend}"
        )


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
        raise TokenIdError(
            f"{what} out of range: found id {bad}, but the vocabulary has {vocab_size} "
            f"entries (valid ids are 0..{vocab_size - 1})"
        )


def check_size(value: Any, what: str, minimum: int = 0, optional: bool = False) -> int | None:
    """A count or size (an integer, Python's or NumPy's, not a bool or a float) of at least
    ``minimum``; returned as an int (None passes when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an integer{' or None' if optional else ''}, got "
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
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number{' or None' if optional else ''}, got "
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


def check_probability(p: Any, what: str = "dropout probability") -> None:
    """A number in [0, 1)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{what} must be a number in [0, 1), got {p!r}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{what} must be in [0, 1), got {p}")


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


def check_loss_gradient(dloss: Any, cache: Cache, what: str) -> None:
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
def check_flag(value: Any, what: str) -> None:
    """A switch: True or False (Python's or NumPy's bool), never a truthy string or number."""
    if not isinstance(value, (bool, numpy.bool_)):
        raise TypeError(f"{what} must be True or False, got {value!r}")


def check_keep_input(keep_input: Any) -> None:
    """``keep_input`` (whether a forward keeps its input for the backward): True or False."""
    check_flag(keep_input, "keep_input")


def linear_inputs(x: Array, w: Array, b: Array | None = None, keep_input: bool = True) -> None:
    """x (..., D_in) floats, W (D_in, D_out) floats with D_in, D_out >= 1, b None or
    (D_out,), all of one dtype; keep_input True or False."""
    check_keep_input(keep_input)
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


def layernorm_inputs(x: Array, gamma: Array, beta: Array, eps: float = 1e-5) -> None:
    """x (..., D), gamma (D,), beta (D,) with D >= 1, floats of one dtype."""
    check_array(x, "layer norm input")
    for name, parameter in (("layer norm weight", gamma), ("layer norm bias", beta)):
        check_float(parameter, name)
        check_rank(parameter, 1, name)
    if gamma.shape[0] == 0 or tuple(beta.shape) != tuple(gamma.shape):
        raise ValueError(f"layer norm weight and bias must both have shape (D,) with D >= 1, "
                         f"got {tuple(gamma.shape)} and {tuple(beta.shape)}")
    check_float(x, "layer norm input")
    check_last_dim(x, gamma.shape[0], "layer norm input")
    check_same_dtype("layer norm", input=x, weight=gamma, bias=beta)  # and one library


def attention_inputs(q: Array, k: Array, v: Array, mask: Array | None = None,
                     block_scores: int | None = None) -> None:
    """q (..., T, E), k (..., S, E), v (..., S, F) floats of one dtype, E >= 1, mask
    boolean broadcasting to (..., T, S); ``block_scores`` (fast tier) None or >= 1."""
    for name, a in (("queries", q), ("keys", k), ("values", v)):
        check_array(a, f"attention {name}")
    for name, a in (("queries", q), ("keys", k), ("values", v)):
        check_float(a, f"attention {name}")
        check_min_rank(a, 2, f"attention {name}", "positions, width")
    if q.shape[-1] == 0:
        raise ValueError(f"attention queries and keys must have a width (last axis) of at "
                         f"least 1, got queries of shape {tuple(q.shape)}")
    check_same_dtype("attention", queries=q, keys=k, values=v)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"attention keys {tuple(k.shape)} and values {tuple(v.shape)} "
                         "must agree on every axis but the last")
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention queries {tuple(q.shape)} and keys {tuple(k.shape)} "
                         "must agree on the leading axes and the last (width) axis")
    if mask is not None:  # named as the caller knows it, before any work is done
        check_mask(mask, tuple(q.shape[:-1]) + (k.shape[-2],), "attention mask")
    if block_scores is not None:
        check_size(block_scores, "block_scores", 1)


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


def activation_choice(name: str, activations: dict | None = None) -> None:
    """``name`` is in the tier's table of activations (default: the textbook's)."""
    if activations is None:
        from .ops.activations import ACTIVATIONS as activations
    check_choice(name, activations, "activation")


def dropout_inputs(x: Array, p: float, training: bool = True) -> None:
    check_float(x, "dropout input")
    check_probability(p)


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
    if not backend.is_integer_array(valid_lens):
        raise TypeError(f"valid lengths must be integers, got dtype {valid_lens.dtype}")
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
    if not backend.is_integer_array(valid_lens):
        raise TypeError(f"valid lengths must be integers, got dtype {valid_lens.dtype}")
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
    if not backend.is_integer_array(valid_lens):
        raise TypeError(f"valid lengths must be integers, got dtype {valid_lens.dtype}")


def causal_mask_inputs(num_queries: int, num_keys: int | None = None,
                       like: Array | None = None) -> None:
    check_size(num_queries, "num_queries")
    if num_keys is not None:
        check_size(num_keys, "num_keys")
        if num_keys < num_queries:
            raise ValueError(f"causal mask needs at least as many keys ({num_keys}) "
                             f"as queries ({num_queries})")


def packing_inputs(valid_lens: Array, length: int) -> None:
    check_rank(valid_lens, 1, "valid lengths")


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


# Every field with a range, wherever a config has it (the three configs share names).
_POSITIVE_INT_FIELDS = ("vocab_size", "src_vocab_size", "tgt_vocab_size", "num_classes",
                        "d_model", "num_heads", "d_ff", "num_layers", "num_encoder_layers",
                        "num_decoder_layers", "block_size")
_BOOL_FIELDS = ("norm_first", "tie_weights", "scale_embeddings", "narrow_heads",
                "kqnorm")
# token id field -> the vocabulary sizes it must index
_TOKEN_ID_FIELDS = {"pad_id": ("vocab_size", "src_vocab_size", "tgt_vocab_size"),
                    "bos_id": ("tgt_vocab_size",), "eos_id": ("tgt_vocab_size",)}
POSITIONALS = ("learned", "sinusoidal")


def _is_int(value) -> bool:
    """An integer, Python's or NumPy's (``ids.max() + 1``), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, numpy.bool_))


def _shown(value: Any) -> str:
    """A refused config value as a message shows it: a NumPy scalar as its Python value
    and type (``-1 (int64)``, not ``np.int64(-1)``)."""
    if isinstance(value, numpy.generic):
        return f"{value.item()!r} ({type(value).__name__})"
    return repr(value)


def _set_field(config: Any, field: str, value: Any) -> None:
    """Store a checked value back as Python's own type (a NumPy int64 as int), so the
    config compares, prints and saves to JSON as one built from Python numbers."""
    if type(getattr(config, field)) is not type(value):
        object.__setattr__(config, field, value)  # frozen or not


def check_config(config: Any) -> None:
    """Validate the fields every model config shares, with messages that name the field:
    sizes and counts are positive integers, token ids index every vocabulary they are
    used in, dropout is in [0, 1), and the names are among the known ones.  NumPy
    integers, floats and bools are accepted where Python's are, and stored as Python's."""
    from .ops.activations import ACTIVATIONS as activations

    name = type(config).__name__
    for field in _POSITIVE_INT_FIELDS:
        value = getattr(config, field, 1)
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name}.{field} must be a positive integer, got {_shown(value)}")
        if hasattr(config, field):
            _set_field(config, field, int(value))
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None:
        if not _is_int(head_dim) or head_dim < 1:
            raise ValueError(f"{name}.head_dim must be None or a positive integer, got "
                             f"{_shown(head_dim)}")
        _set_field(config, "head_dim", int(head_dim))
    if head_dim is None:
        check_heads_divide(config.d_model, config.num_heads)
    for field, vocabularies in _TOKEN_ID_FIELDS.items():
        if not hasattr(config, field):
            continue
        value = getattr(config, field)
        limit = min(getattr(config, v) for v in vocabularies if hasattr(config, v))
        if not _is_int(value) or not 0 <= value < limit:
            sizes = ", ".join(f"{v}={getattr(config, v)}" for v in vocabularies
                              if hasattr(config, v))
            raise ValueError(f"{name}.{field} must be a token id in [0, {limit}) ({sizes}), "
                             f"got {_shown(value)}")
        _set_field(config, field, int(value))
    for field in _BOOL_FIELDS:
        if not hasattr(config, field):
            continue
        value = getattr(config, field)
        if not isinstance(value, (bool, numpy.bool_)):
            raise ValueError(f"{name}.{field} must be True or False, got {_shown(value)}")
        _set_field(config, field, bool(value))
    if getattr(config, "narrow_heads", False):
        check_narrow_heads(config.d_model, config.num_heads, head_dim, name)
    if hasattr(config, "layer_norm_eps"):
        eps = config.layer_norm_eps
        if isinstance(eps, (bool, numpy.bool_)) or not isinstance(eps, numbers.Real) \
                or not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"{name}.layer_norm_eps must be a finite number > 0, got "
                             f"{_shown(eps)}")
        _set_field(config, "layer_norm_eps", float(eps))
    if getattr(config, "positional", "learned") not in POSITIONALS:
        raise ValueError(f"{name}.positional must be one of {POSITIONALS}, got "
                         f"{_shown(config.positional)}")
    activation = getattr(config, "activation", "relu")
    if not isinstance(activation, str) or activation not in activations:
        raise ValueError(f"{name}.activation must be one of {sorted(activations)}, got "
                         f"{_shown(config.activation)}")
    dropout = config.dropout
    if isinstance(dropout, (bool, numpy.bool_)) or not isinstance(dropout, numbers.Real) or not (
            0.0 <= dropout < 1.0):
        raise ValueError(f"{name}.dropout must be in [0, 1), got {_shown(dropout)}")
    _set_field(config, "dropout", float(dropout))
    if hasattr(config, "pooling") and config.pooling not in POOLINGS:
        raise ValueError(f"{name}.pooling must be one of {POOLINGS}, got "
                         f"{_shown(config.pooling)}")
    if getattr(config, "num_classes", 2) < 2:
        raise ValueError(f"{name}.num_classes must be at least 2, got {config.num_classes}")


# --------------------------------------------------------------------------- decoding
def check_model_kind(model: Module, kind: str, function: str) -> None:
    """The model ``function`` decodes with must be of ``kind`` (seq2seq or lm)."""
    given = getattr(model, "kind", None)
    if given != kind:
        what = f"a {given!r} model" if given else f"a {type(model).__name__}"
        use = {"seq2seq": "greedy_decode or beam_search", "causal_lm": "generate"}.get(given)
        raise TypeError(f"{function} decodes with a {kind!r} model "
                        f"({'Seq2SeqTransformer' if kind == 'seq2seq' else 'CausalLM'}), got "
                        f"{what}" + (f" (use {use} for it)" if use else ""))


def host_token_ids(ids: Any, name: str, rank: int, shape_words: str) -> numpy.ndarray:
    """``ids`` (an array of any backend, a NumPy array, nested lists) as a host int64 array
    of rank ``rank``; refused naming ``name`` if ragged, of another rank or not integers."""
    try:
        host = backend.to_numpy(ids)
        host = numpy.asarray(host)
    except (ValueError, TypeError) as exc:  # ragged lists, objects
        raise ValueError(f"{name} must be {shape_words} of integer token ids: {exc}") from None
    if host.ndim == 1 and host.size == 0 and rank == 2:  # [] : a batch of no sequences
        host = host.reshape(0, 0)
    if host.ndim != rank:
        raise ValueError(f"{name} must be {shape_words} of integer token ids, got an array of "
                         f"shape {host.shape}")
    if host.size and host.dtype.kind not in "iu":  # an empty list arrives as float64
        raise TypeError(f"{name} must hold integer token ids, got dtype {host.dtype}")
    return host.astype(numpy.int64)


# =========================================================================== command-line values
# The demos' option types (argparse's ``type=``): the text read as a number, then held to
# the rule a Python argument of that kind meets (check_size, check_real, check_probability).
# argparse puts the option before the message: "argument --lr: expected a positive number,
# got '0'" (exit status 2).
def _option_value(text: str, read: Callable[[str], Any], check: Callable[[Any], Any],
                  expected: str) -> Any:
    """``read(text)``, refused unless ``check`` passes it, naming ``expected`` and the text."""
    import argparse  # only where a command line is parsed

    try:
        value = read(text)
        check(value)
    except (TypeError, ValueError):  # not a number, or outside the rule
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    return value


def positive_int(text: str) -> int:
    """An option's integer >= 1 (a count, a size)."""
    return _option_value(text, int, lambda v: check_size(v, "value", 1), "a positive integer")


def nonnegative_int(text: str) -> int:
    """An option's integer >= 0."""
    return _option_value(text, int, lambda v: check_size(v, "value", 0), "an integer >= 0")


def positive_float(text: str) -> float:
    """An option's finite number > 0 (a learning rate, a temperature)."""
    return _option_value(text, float, lambda v: check_real(v, "value", 0, inclusive=False),
                         "a positive number")


def nonnegative_float(text: str) -> float:
    """An option's finite number >= 0."""
    return _option_value(text, float, lambda v: check_real(v, "value", 0), "a number >= 0")


def probability(text: str) -> float:
    """An option's probability in [0, 1) (a dropout rate)."""
    return _option_value(text, float, check_probability, "a probability in [0, 1)")


# =========================================================================== renamed fields
# One name per idea, PyTorch's or nanoGPT's: d_model (model width), num_heads (head count),
# block_size (context length), max_iters (updates in a run).  A class that renamed a field
# declares its old names with @renamed_fields(old="new"); the old keyword still works for
# one release (with a DeprecationWarning naming the new one), and a saved record of its
# values (a checkpoint's config, a demo's run record) is read with :func:`new_field_names`.
def new_field_names(cls: type, values: Mapping[str, Any], warn: bool = False,
                    stacklevel: int = 3) -> dict[str, Any]:
    """``values`` ({field: value}) with each old field name of ``cls`` replaced by its new
    one (``cls.old_field_names``: {old: new}); given both, a TypeError names the two.
    ``warn``: a DeprecationWarning for each old name (the Python API, not saved records),
    pointing ``stacklevel`` frames up (3: the caller of the function calling this one)."""
    renamed = getattr(cls, "old_field_names", {})
    values = dict(values)
    for old, new in renamed.items():
        if old not in values:
            continue
        if new in values:
            raise TypeError(f"{cls.__name__} got both {old!r} and {new!r}: {old} is the old "
                            f"name of {new}; give {new} only")
        if warn:
            warnings.warn(f"{cls.__name__}({old}=...) is deprecated: the field is now called "
                          f"{new!r}", DeprecationWarning, stacklevel=stacklevel)
        values[new] = values.pop(old)
    return values


def renamed_fields(**old_to_new: str) -> Callable[[type], type]:
    """Class decorator (above ``@dataclass``): the constructor also takes each old keyword
    (``old="new"``), with a DeprecationWarning naming the new one.

    ``dataclasses.replace(config, old=value)`` works too: replace passes every field
    of ``config`` besides the change, the new name's current value among them, and that
    value gives way to the old name's (given both with another value, replace is refused
    like the constructor)."""
    def decorate(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            source = _instance_being_replaced(sys._getframe(1))
            if source is not None:
                kwargs = _without_filled_in_names(cls, kwargs, source)
            init(self, *args, **new_field_names(cls, kwargs, warn=True,
                                                stacklevel=3 if source is None else 4))
        cls.__init__ = __init__
        cls.old_field_names = {**getattr(cls, "old_field_names", {}), **old_to_new}
        return cls
    return decorate


def _instance_being_replaced(caller: Any) -> Any:
    """The instance ``dataclasses.replace`` copies when the frame ``caller`` (the one
    calling a constructor) is replace's own, else None.  replace calls ``cls(**changes)``
    with every field filled in; its argument is ``obj`` (Python 3.11, 3.12) or ``self``
    (3.13's ``_replace``)."""
    if caller.f_globals.get("__name__") != "dataclasses":
        return None
    return caller.f_locals.get("obj", caller.f_locals.get("self"))


def _without_filled_in_names(cls: type, kwargs: dict, source: Any) -> dict:
    """replace's keywords less each new name that only carries ``source``'s value beside
    its old name: the old name is the change the user asked for."""
    kwargs = dict(kwargs)
    for old, new in getattr(cls, "old_field_names", {}).items():
        if old in kwargs and new in kwargs and kwargs[new] == getattr(source, new, object()):
            del kwargs[new]
    return kwargs


# =========================================================================== optimizers
# The range of each optimizer hyperparameter, written once: the constructors, set_lr, the
# schedules and Optimizer.load_state_dict all check by it.  (low, high, high included)
HYPERPARAMETER_RANGES = {"lr": (0.0, math.inf, False), "beta1": (0.0, 1.0, False),
                         "beta2": (0.0, 1.0, False), "eps": (0.0, math.inf, False),
                         "weight_decay": (0.0, math.inf, False),
                         "momentum": (0.0, 1.0, True)}


def check_hyperparameter(value: Any, kind: str, what: str | None = None) -> float:
    """``value`` (named ``what``, default ``kind``) in the range of hyperparameter ``kind``
    (:data:`HYPERPARAMETER_RANGES`); returned as a float."""
    low, high, high_included = HYPERPARAMETER_RANGES[kind]
    return check_real(value, what or kind, low, maximum=high, max_inclusive=high_included)


def check_update_number(t: Any) -> int:
    """A schedule's update number: an integer from 1 (the first update is 1)."""
    return check_size(t, "the update number t (schedules count updates from 1)", 1)


def check_parameters(params: Any, owner: str) -> list:
    """``params``: a non-empty iterable of distinct :class:`~npformer.nn.Parameter`\\ s (what
    ``owner``, an optimizer, updates); returned as a list."""
    from .nn.module import Parameter  # the layers import this module: imported when used

    try:
        params = list(params)
    except TypeError:
        raise TypeError(f"{owner}: params must be an iterable of Parameters "
                        f"(model.parameters()), got {type(params).__name__}") from None
    if not params:
        raise ValueError(f"{owner} got an empty parameter list")
    for i, p in enumerate(params):
        if not isinstance(p, Parameter):
            raise TypeError(f"{owner}: params[{i}] is a {type(p).__name__}, "
                            "not a Parameter (pass model.parameters())")
    if len({id(p) for p in params}) != len(params):
        raise ValueError(f"{owner}: a parameter appears more than once")
    return params


def check_gradients(params: Sequence) -> None:
    """Every parameter has a gradient of its own shape, dtype and array library (checked
    before an update changes anything: no half-done update)."""
    for i, p in enumerate(params):
        if p.grad is None:
            raise RuntimeError(f"params[{i}] has no gradient (grad is None)")
        backend.namespace_of(p.data, p.grad)  # one array library (TypeError naming both)
        if tuple(p.grad.shape) != p.shape:
            raise RuntimeError(f"params[{i}]: gradient shape {tuple(p.grad.shape)} != "
                               f"parameter shape {p.shape}")
        if p.grad.dtype != p.data.dtype:
            raise RuntimeError(f"params[{i}]: gradient dtype {p.grad.dtype} != "
                               f"parameter dtype {p.data.dtype}")


# =========================================================================== weights
# The one set of rules every weight loader applies (``Module.load_state_dict``, a
# checkpoint, ``load_torch_state_dict``, ``load_safetensors``, ``Optimizer.load_state_dict``).
# A weight array must be:
#
# * floating point: an integer, boolean or complex array is refused (cast it on purpose,
#   ``.astype(np.float32)``, if it really holds weights); a float array of another width is
#   cast to the parameter's dtype on purpose, as PyTorch's ``load_state_dict`` copies into
#   the parameter's dtype;
# * finite: NaN or inf would make every prediction NaN;
# * named and shaped exactly as the parameters are: every name, no other, each shape.
#
# PyTorch tensors are read as what they hold: a tensor that requires grad is detached (the
# values are what is loaded), a bfloat16 tensor (NumPy has no bfloat16) is converted to
# float32 with a warning saying so.  Nothing here imports torch.
def _is_torch_tensor(value: Any) -> bool:
    return type(value).__module__.split(".")[0] == "torch"


def _host_weight(value: Any, name: str) -> numpy.ndarray:
    """A weight of any kind (NumPy or backend array, torch tensor, nested list) on the host."""
    if _is_torch_tensor(value):
        value = value.detach()  # requires_grad or not: the values are what is loaded
        if str(value.dtype) == "torch.bfloat16":
            warnings.warn(f"{name} is a bfloat16 tensor (NumPy has no bfloat16): converted "
                          "to float32 to load it", UserWarning, stacklevel=4)
            value = value.float()
        return value.cpu().numpy()
    try:
        return numpy.asarray(backend.to_numpy(value))
    except (TypeError, ValueError) as exc:  # ragged lists, objects
        raise TypeError(f"{name} is not an array of numbers: {exc}") from None


def _shape_of(value: Any) -> tuple:
    shape = getattr(value, "shape", None)
    if shape is None:
        try:
            return tuple(numpy.shape(value))
        except ValueError:  # a ragged list: its values are refused by name later
            return ()
    return tuple(int(n) for n in shape)


def weight_array(value: Any, name: str) -> numpy.ndarray:
    """``value`` as a host floating-point array of finite numbers; refused naming ``name``
    (TypeError for the kind of number, ValueError for NaN/inf)."""
    host = _host_weight(value, name)
    if host.dtype.kind != "f":
        kind = "bfloat16" if "bfloat16" in str(host.dtype) else str(host.dtype)
        raise TypeError(f"{name} holds {kind} values: weights must be floating point "
                        "(cast it on purpose, e.g. .astype(np.float32), if it holds weights)")
    finite = numpy.isfinite(host)
    if not finite.all():
        bad = int(host.size - numpy.count_nonzero(finite))
        raise ValueError(f"{name} holds {bad} NaN or infinite values; refusing to load "
                         "weights that would predict NaN (saved after training diverged?)")
    return host


def mismatch_report(missing: list, extra: list, wrong_shapes: list[str]) -> list[str]:
    """The ways a saved state does not fit, one phrase each (empty when it fits)."""
    problems = []
    if missing:
        problems.append(f"missing keys: {missing}")
    if extra:
        problems.append(f"unexpected keys: {extra}")
    if wrong_shapes:
        problems.append("wrong shapes: " + "; ".join(wrong_shapes))
    return problems


def checked_weights(expected: Mapping[str, tuple], state: Mapping[str, Any], owner: str,
                    what: str = "state_dict") -> dict[str, numpy.ndarray]:
    """``state`` ({name: array}) checked against ``expected`` ({name: shape}): a dict,
    exactly the expected names, each of its shape, every array floating point and
    finite.  Every name and shape problem is reported at once ("<what> does not fit
    <owner>: ..."), before any value is looked at; returns {name: host float array}."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{what} for {owner} must be a dict of name -> array (as "
                        f"state_dict() returns), got {type(state).__name__}")
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = [f"{name}: expected {tuple(shape)}, got {_shape_of(state[name])}"
             for name, shape in expected.items()
             if name in state and _shape_of(state[name]) != tuple(shape)]
    problems = mismatch_report(missing, extra, wrong)
    if problems:
        raise ValueError(f"{what} does not fit {owner}: " + " | ".join(problems))
    return {name: weight_array(state[name], f"{what}[{name!r}]") for name in expected}


# =========================================================================== token batches
# The integer inputs of the models' and the decoders' public entries: ids and lengths
# as arrays, padding only at the end of a row, a Padding that matches its ids, and the
# decoders' source batch.
def model_input(data: Any, what: str, rank: int = 2) -> Array:
    """An integer argument (ids, lengths) of a model's public entry point (forward, predict)
    as a backend array: integer arrays pass as they are; array-likes (nested lists or
    tuples of numbers) are copied onto the backend, an empty one as int64 of the expected
    ``rank`` (``[]`` is a batch of no sequences)."""
    import array_api_compat  # here: validation is imported before the backends settle

    if data is None:
        return data
    if array_api_compat.is_array_api_obj(data):
        if not backend.is_integer_array(data):  # ids and lengths: integers
            raise TypeError(f"{what} must be an integer array, got dtype {data.dtype}")
        return data
    try:
        host = numpy.asarray(data)
    except (ValueError, TypeError) as exc:  # ragged lists
        raise ValueError(f"{what} must be an array or a rectangular nested list of numbers: "
                         f"{exc}") from None
    if host.dtype.kind not in "biuf":
        raise TypeError(f"{what} must hold numbers, got {type(data).__name__} of dtype "
                        f"{host.dtype}")
    if host.size == 0:
        host = host.astype(numpy.int64)
        if host.ndim == 1 and rank == 2:
            host = host.reshape(0, 0)
    if host.dtype.kind not in "iu":
        raise TypeError(f"{what} must be an integer array, got dtype {host.dtype}")
    return backend.asarray(host)


def attention_mask_input(mask: Any, shape: tuple[int, int],
                         what: str = "attention_mask") -> Array:
    """A causal LM's ``attention_mask`` as Hugging Face passes it, (B, S): 1 (or True) at
    every token, 0 (False) at padding, anywhere in a row -> a backend bool array (True at
    the tokens).  An array of any backend, a NumPy array or nested lists; refused naming
    ``what`` if of another shape, or not of 0s and 1s."""
    import array_api_compat  # here: validation is imported before the backends settle

    if array_api_compat.is_array_api_obj(mask):
        given = mask
    else:
        try:
            host = numpy.asarray(mask)
        except (ValueError, TypeError) as exc:  # ragged lists
            raise ValueError(f"{what} must be an array or a rectangular nested list of 0s "
                             f"and 1s: {exc}") from None
        given = backend.asarray(host.astype(numpy.int64) if host.size == 0 else host)
    xp = backend.namespace_of(given)
    if given.dtype != xp.bool and not backend.is_integer_array(given):
        raise TypeError(f"{what} must hold 0 and 1 (integers or booleans), got dtype "
                        f"{given.dtype}")
    if tuple(given.shape) != tuple(shape):
        raise ValueError(f"{what} must have shape {tuple(shape)} (batch, positions), got "
                         f"{tuple(given.shape)}")
    if given.dtype == xp.bool:
        return given
    if math.prod(given.shape):
        low, high = backend.host_range(given)
        if low < 0 or high > 1:
            raise ValueError(f"{what} must hold 0 (padding) and 1 (a token) only, found "
                             f"{low if low < 0 else high}")
    return given != 0


def position_ids_input(position_ids: Any, shape: tuple[int, int], block_size: int,
                       what: str = "position_ids") -> Array:
    """A causal LM's ``position_ids``: integers in [0, block_size), (B, T), or (T,) or
    (1, T) for every row -> a backend integer array (B, T)."""
    ids = model_input(position_ids, what)
    if ids.ndim == 1:
        ids = backend.namespace_of(ids).reshape(ids, (1, ids.shape[0]))
    if ids.ndim != 2 or ids.shape[1] != shape[1] or ids.shape[0] not in (1, shape[0]):
        raise ValueError(f"{what} must have shape {tuple(shape)} (batch, positions), or "
                         f"({shape[1]},) for every row, got {tuple(ids.shape)}")
    check_positions(ids, block_size, what)
    return backend.namespace_of(ids).broadcast_to(ids, tuple(shape))


def check_positions(position_ids: Array, block_size: int, what: str = "position_ids") -> None:
    """Positions must index the positional table: integers in [0, block_size)."""
    if not math.prod(position_ids.shape):
        return
    low, high = backend.host_range(position_ids)
    if low < 0:
        raise ValueError(f"{what} hold position {low}: positions count from 0")
    if high >= block_size:
        raise ValueError(f"{what} reach position {high}, but the positional table has "
                         f"{block_size} rows (block_size {block_size}): a sequence of more "
                         f"than {block_size} tokens is longer than the model's context")


def valid_lengths_from(ids: Array, pad_id: int, what: str = "token ids") -> Array:
    """ids (B, T) -> (B,) number of non-padding tokens per row, padding at the end only.

    The layers read a row's valid positions as its first ``valid_lens[b]`` (the packing,
    pooling, masks and positions): padding anywhere else, left padding or a pad between
    tokens, would be read as tokens while the row's last tokens were dropped.  It is
    refused, naming the row and the positions (move the padding to the end)."""
    xp = backend.namespace_of(ids)
    real = ids != pad_id  # (B, T)
    lengths = xp.sum(xp.astype(real, xp.int64), axis=1)  # (B,)
    if ids.shape[0] and ids.shape[1]:
        positions = xp.arange(ids.shape[1], dtype=xp.int64, device=backend.device_of(ids))
        if bool(xp.any(real != (positions[None, :] < lengths[:, None]))):
            _refuse_padding_before_a_token(backend.to_numpy(real), pad_id, what)
    return lengths


def _refuse_padding_before_a_token(real: numpy.ndarray, pad_id: int, what: str) -> None:
    """real (B, T) bools with a pad before a real token in some row: raise naming where."""
    for row, tokens in enumerate(real):
        pads = numpy.flatnonzero(~tokens)
        later = numpy.flatnonzero(tokens[pads[0]:]) if pads.size else numpy.empty(0)
        if later.size:
            raise ValueError(
                f"{what} row {row} has padding (pad_id {pad_id}) at position {pads[0]}, "
                f"before a real token at position {pads[0] + later[0]}: padding must come "
                "at the end of a row (right padding), where it is masked; padding elsewhere "
                "would be read as tokens and the row's last tokens dropped. Move the "
                "padding to the end of the row")


def check_padding_matches(ids: Array, valid_lens: Array | None, padding: Any) -> None:
    """A :class:`npformer.nn.Padding` handed with ids (B, T): no valid lengths beside it
    (it holds them), and its batch and length are the ids'."""
    if valid_lens is not None:
        raise ValueError("pass the valid lengths or a padding, not both (the padding "
                         "holds the valid lengths)")
    if (padding.batch, padding.length) != tuple(ids.shape):
        raise ValueError(f"padding describes a ({padding.batch}, {padding.length}) batch, "
                         f"but the ids have shape {tuple(ids.shape)}")


def source_ids(src: Any, src_lens: Any, vocab_size: int, pad_id: int) -> tuple[Any, Any]:
    """A decoder's source batch, checked -> (src (B, S) int64, src_lens (B,) int64 or
    None), on the host.

    src: integer ids in [0, vocab_size), padding at the end; src_lens: the number of real
    tokens of each row, in [1, S] (without it, the non-padding tokens are counted).  Every
    source needs at least one token."""
    host = host_token_ids(src, "src", 2, "a (batch, positions) array")
    check_token_ids(host, vocab_size, "src")
    batch, positions = host.shape
    if src_lens is None:  # padding at the end only (refused elsewhere, naming where)
        lengths, given = valid_lengths_from(host, pad_id, "src"), None
        where = "src row {row} is all padding"
    else:
        lengths = given = host_token_ids(src_lens, "src_lens", 1, "a (batch,) array")
        if lengths.shape[0] != batch:
            raise ValueError(f"src_lens has {lengths.shape[0]} lengths for a batch of {batch} "
                             "source rows")
        if lengths.size and lengths.max() > positions:
            raise ValueError(f"src_lens holds length {lengths.max()}, longer than the "
                             f"{positions} positions of src")
        where = "src_lens[{row}] is 0"
    if batch and positions == 0:
        raise ValueError("src has 0 positions (axis 1): every source needs at least one token")
    empty = numpy.flatnonzero(lengths < 1)
    if empty.size:
        raise ValueError(where.format(row=int(empty[0])) + ": every source needs at least "
                         "one token (lengths must be in [1, positions])")
    return host, given
