r"""Numerical gradient checking: the proof that a hand-written backward is right.

For a function $y = f(x_1, \dots)$ and a *random* upstream gradient $g$
(never all ones: a constant g hides errors such as dropping layer norm's
$\hat x \cdot \text{mean}(g \odot \hat x)$ term, because such terms sum to zero against
it) define the scalar $L = \langle g, f(x) \rangle$.  The analytic backward, fed $g$, claims
$\partial L / \partial x$.  Central differences measure it:

    $\frac{\partial L}{\partial x_i} \approx \frac{L(x + h e_i) - L(x - h e_i)}{2h}$

with error $O(h^2)$ from truncation plus $O(\epsilon_{mach} |L| / h)$ from
rounding, so everything runs in float64 (h = 1e-5 balances the two near 1e-10).

The error reported for each tensor is
$\max_i |a_i - n_i| / \max(s_t, 10^{-2} s)$, where $s_t = \max_i \max(|a_i|, |n_i|)$
is the tensor's own scale and $s$ the largest scale of all tensors in the check.  The floor
is there for gradients that are exactly zero in theory (the key-projection bias of
attention: softmax ignores a shift shared by all keys), where the numerical estimate is
pure rounding noise; it also measures any tensor smaller than 1% of the largest against
that 1%, which still exposes every wrong factor or misrouted element.  A gradient off by a
factor (1/B, say) or routed to the wrong element (heads merged in the wrong order) gives an
error of order 1; a correct one gives about 1e-9.

:func:`check_op` checks a forward/backward pair of :mod:`npformer.ops`;
:func:`check_module` any :class:`npformer.nn.Module`, its inputs and every parameter (the
way to check a layer of your own).  The result's message names the worst gradient
(``dx``, ``dgamma``, ``weight.grad``: the names are the functions' docstrings'), its
shape, its largest error and the index where it sits::

    worst relative error 5.000e-01 in dw (shape (4, 3)) at index (2, 1): analytic 0.4, ...
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from . import backend

if TYPE_CHECKING:  # annotations only
    from .nn import Module


@dataclass
class GradCheckResult:
    """Per-tensor relative errors and where the worst one is: ``errors`` is keyed as the
    check named the tensors (``names`` given to :func:`check_op`; otherwise ``arg0``,
    ``input0`` or the parameter's name); ``labels`` gives each key's name in messages
    (``dx``, ``dgamma``, ``weight.grad``), ``shapes`` each gradient's shape."""

    errors: dict[str, float] = field(default_factory=dict)
    worst_name: str = ""
    worst_index: tuple = ()
    worst_analytic: float = 0.0
    worst_numeric: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple] = field(default_factory=dict)

    @property
    def worst_error(self) -> float:
        return max(self.errors.values(), default=0.0)

    @property
    def worst_label(self) -> str:
        """The worst gradient's name in messages (``dgamma``; ``worst_name`` is its key)."""
        return self.label(self.worst_name)

    def label(self, key: str) -> str:
        return self.labels.get(key, key)

    def passed(self, tolerance: float = 1e-6) -> bool:
        return self.worst_error < tolerance

    def message(self, tolerance: float = 1e-6) -> str:
        """One line: which gradient is wrong, its shape, its largest error and where."""
        if self.passed(tolerance):
            return (f"every gradient agrees with central differences "
                    f"(worst relative error {self.worst_error:.1e})")
        shape = self.shapes.get(self.worst_name)
        where = f"at index {self.worst_index}" if self.worst_index else "(a scalar)"
        if not np.isfinite(self.worst_error):
            return (f"{self.worst_label} (shape {shape}) holds NaN or inf "
                    f"{where}: analytic {self.worst_analytic:.6g}")
        return (f"{self.worst_label} (shape {shape}) is wrong: largest error "
                f"{self.worst_error:.1e} of its scale {where}: analytic "
                f"{self.worst_analytic:.6g}, numeric {self.worst_numeric:.6g}")

    def __str__(self) -> str:
        shape = self.shapes.get(self.worst_name)
        shown = f" (shape {shape})" if shape is not None else ""
        lines = [f"worst relative error {self.worst_error:.3e} in {self.worst_label}{shown} "
                 f"at index {self.worst_index}: analytic {self.worst_analytic:.10g}, "
                 f"numeric {self.worst_numeric:.10g}"]
        lines += [f"  {self.label(name)}: {err:.3e}" for name, err in self.errors.items()]
        return "\n".join(lines)


FLOOR = 1e-2  # fraction of the largest gradient scale below which scales are floored


def scale_of(analytic: np.ndarray, numeric: np.ndarray) -> float:
    """max(max |a|, max |n|): the size of a gradient tensor."""
    return max(float(np.max(np.abs(analytic), initial=0.0)),
               float(np.max(np.abs(numeric), initial=0.0)))


def relative_error(analytic: np.ndarray, numeric: np.ndarray, floor: float = 0.0) -> float:
    """max |a - n| / max(scale, floor); 0 when both are exactly zero; inf if any is NaN/inf."""
    if not (np.all(np.isfinite(analytic)) and np.all(np.isfinite(numeric))):
        return float("inf")  # a NaN must never compare as "small enough"
    scale = max(scale_of(analytic, numeric), floor)
    if scale == 0.0:
        return 0.0
    return float(np.max(np.abs(analytic - numeric), initial=0.0)) / scale


def numerical_gradient(loss: Callable[[], float], value: np.ndarray,
                       set_value: Callable[[np.ndarray], None], h: float) -> np.ndarray:
    """Central-difference gradient of ``loss()`` w.r.t. the host array ``value``.

    ``set_value(array)`` installs a perturbed copy where ``loss`` reads it.
    """
    grad = np.zeros_like(value)
    work = value.copy()
    for i in np.ndindex(*value.shape):
        original = work[i]
        work[i] = original + h
        set_value(work)
        plus = loss()
        work[i] = original - h
        set_value(work)
        minus = loss()
        work[i] = original
        grad[i] = (plus - minus) / (2.0 * h)
    set_value(value)
    return grad


def compare(analytic: dict[str, np.ndarray], numeric: dict[str, np.ndarray],
            labels: dict[str, str] | None = None) -> GradCheckResult:
    """Each analytic gradient against its numerical estimate (dicts keyed alike);
    ``labels``: each key's name in messages."""
    labels = dict(labels or {})
    result = GradCheckResult(labels=labels)
    worst = -1.0
    pairs = {}
    for name, num in numeric.items():
        ana = np.asarray(analytic[name], dtype=np.float64)
        if ana.shape != num.shape:
            raise ValueError(f"the gradient {labels.get(name, name)} has shape {ana.shape}, "
                             f"expected {num.shape}")
        pairs[name] = (ana, num)
        result.shapes[name] = tuple(num.shape)
    finite = [scale_of(a, n) for a, n in pairs.values() if np.all(np.isfinite(a))]
    floor = FLOOR * max((s for s in finite if np.isfinite(s)), default=0.0)
    for name, (ana, num) in pairs.items():
        err = relative_error(ana, num, floor)
        result.errors[name] = err
        if err > worst:
            worst = err
            idx = np.unravel_index(int(np.argmax(np.abs(ana - num))), num.shape) if num.size else ()
            result.worst_name = name
            result.worst_index = tuple(int(i) for i in idx)
            result.worst_analytic = float(ana[idx]) if num.size else 0.0
            result.worst_numeric = float(num[idx]) if num.size else 0.0
    return result


def argument_names(function: Callable, count: int) -> list[str | None]:
    """The names of ``function``'s first ``count`` positional parameters (None where it
    has none to tell: ``*args``, or no signature)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return [None] * count
    names: list[str | None] = []
    for p in parameters:
        if p.kind is p.VAR_POSITIONAL:
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return (names + [None] * count)[:count]


def gradient_labels(function: Callable, positions: Sequence[int],
                    names: Sequence[str] | None = None) -> list[str]:
    """The names of the gradients of ``function``'s arguments at ``positions``: ``names``
    where given, else ``d`` and the parameter's name (``dx``, ``dgamma``), else
    ``d(argument i)``."""
    if names is not None:
        names = list(names)
        if len(names) != len(positions):
            raise ValueError(f"names {names} name {len(names)} gradients, but "
                             f"{len(positions)} arguments are checked")
        return names
    known = argument_names(function, max(positions, default=-1) + 1)
    return [f"d{known[i]}" if known[i] else f"d(argument {i})" for i in positions]


def _upstream_like(out, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(tuple(out.shape))  # random, never all ones


def _as_tuple(grads) -> tuple:
    """A backward's return value as a tuple (None, from a module with integer inputs: ())."""
    return () if grads is None else grads if isinstance(grads, tuple) else (grads,)


def _require_float64(array, what: str) -> None:
    xp = backend.namespace_of(array)
    if array.dtype != xp.float64:
        raise TypeError(f"gradient checks run in float64, but {what} is {array.dtype}: "
                        "call npformer.backend.set_default_float('float64') before "
                        "building it, or pass float64 arrays")


def check_op(forward: Callable, backward: Callable, args: Sequence, wrt: Sequence[int],
             kwargs: dict | None = None, h: float = 1e-5, seed: int = 0,
             names: Sequence[str] | None = None) -> GradCheckResult:
    """Check ``backward`` of an op against central differences of ``forward``.

    forward(*args, **kwargs) -> (out, saved); backward(dout, saved) -> the
    gradients of ``args[i]`` for i in ``wrt``, in that order (one array or a tuple).
    ``args`` are backend arrays (or anything else for non-differentiated ones).
    ``names``: the gradients' names, in ``wrt``'s order (``("dx", "dgamma", "dbeta")``),
    which also key ``errors``; by default ``d`` and the forward's parameter names name
    them in messages, and ``errors`` is keyed ``arg0``, ``arg1``...
    """
    kwargs = kwargs or {}
    args = list(args)
    labels = gradient_labels(forward, wrt, names)
    keys = list(names) if names is not None else [f"arg{i}" for i in wrt]
    for i, label in zip(wrt, labels):
        _require_float64(args[i], f"the argument of {label}")
    out, saved = forward(*args, **kwargs)
    upstream_host = _upstream_like(out, seed)
    upstream = backend.asarray(upstream_host)
    grads = _as_tuple(backward(upstream, saved))
    if len(grads) != len(wrt):
        raise ValueError(f"backward returned {len(grads)} gradients for {len(wrt)} inputs "
                         f"({', '.join(labels)})")
    analytic = {key: backend.to_numpy(g) for key, g in zip(keys, grads)}

    def loss() -> float:
        value, _ = forward(*args, **kwargs)
        return float(np.sum(backend.to_numpy(value) * upstream_host))

    numeric = {}
    for key, i in zip(keys, wrt):
        def set_arg(host, i=i):
            args[i] = backend.asarray(host)
        numeric[key] = numerical_gradient(loss, backend.to_numpy(args[i]).copy(), set_arg, h)
    return compare(analytic, numeric, dict(zip(keys, labels)))


def check_module(module: Module, inputs: Sequence, wrt_inputs: Sequence[int] | None = None,
                 kwargs: dict | None = None, h: float = 1e-5, seed: int = 0) -> GradCheckResult:
    """Check ``module.backward`` for its inputs and every parameter.

    module.forward(*inputs, **kwargs) must return one array; module.backward(dout) must
    return the gradients of ``inputs[i]`` for i in ``wrt_inputs`` (default: every
    floating-point input), one array or a tuple.  Parameter gradients are read from
    ``param.grad`` after a ``zero_grad``; frozen parameters
    (:meth:`npformer.nn.Module.freeze`) have none and are not checked.  ``errors`` is keyed
    ``input0``... and by the parameters' names; messages name an input's gradient ``d`` and
    the forward's parameter name (``dx``), a parameter's ``weight.grad``.
    """
    kwargs = kwargs or {}
    inputs = list(inputs)
    if wrt_inputs is None:
        wrt_inputs = [i for i, a in enumerate(inputs)
                      if hasattr(a, "dtype") and backend.is_float_array(a)]
    input_labels = dict(zip(wrt_inputs, gradient_labels(module.forward, wrt_inputs)))
    for i in wrt_inputs:
        _require_float64(inputs[i], f"input {i} (of {input_labels[i]})")
    named = [(name, p) for name, p in module.named_parameters() if not p.frozen]
    for name, p in named:
        _require_float64(p.data, f"parameter {name!r}")
    module.zero_grad()
    out = module.forward(*inputs, **kwargs)
    upstream_host = _upstream_like(out, seed)
    grads = _as_tuple(module.backward(backend.asarray(upstream_host)))
    if len(grads) != len(wrt_inputs):
        raise ValueError(f"backward returned {len(grads)} input gradients for "
                         f"{len(wrt_inputs)} inputs")
    analytic = {f"input{i}": backend.to_numpy(g) for i, g in zip(wrt_inputs, grads)}
    analytic.update({name: backend.to_numpy(p.grad) for name, p in named})

    def loss() -> float:
        value = module.forward(*inputs, **kwargs)
        return float(np.sum(backend.to_numpy(value) * upstream_host))

    labels = {f"input{i}": input_labels[i] for i in wrt_inputs}
    labels.update({name: f"{name}.grad" for name, _ in named})
    numeric = {}
    for i in wrt_inputs:
        def set_input(host, i=i):
            inputs[i] = backend.asarray(host)
        numeric[f"input{i}"] = numerical_gradient(loss, backend.to_numpy(inputs[i]).copy(),
                                                  set_input, h)
    for name, p in named:
        def set_param(host, p=p):
            p.data = backend.asarray(host)
        numeric[name] = numerical_gradient(loss, backend.to_numpy(p.data).copy(), set_param, h)
    return compare(analytic, numeric, labels)
