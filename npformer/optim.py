"""Optimizers, gradient clipping and learning-rate schedules.

Everything here updates :class:`~npformer.nn.module.Parameter` objects by
*rebinding* ``p.data`` (``p.data = p.data - ...``), so the same code runs on NumPy,
CuPy and ``array_api_strict`` (which has no in-place writes into parameters).  All
array math goes through the namespace of the parameter and uses only functions of
the array API standard.  Hyperparameters are Python floats, which the standard's
promotion rules fold into the array's dtype: a float32 parameter keeps float32
moments and float32 updates, with no float64 temporaries.

Each optimizer reproduces its PyTorch counterpart (CPU, single-tensor path) operation
for operation, so trajectories agree to rounding.

Frozen parameters (:meth:`npformer.nn.Module.freeze`) are left out when an optimizer is
built: ``AdamW(model.parameters())`` updates the trainable ones only and keeps no state,
not even zero moments, for the others.

Weight decay, of either kind, only touches parameters with ``p.decay == True``;
biases, norm gains and embeddings are built with ``decay=False``.  (In PyTorch
that is two parameter groups, one with ``weight_decay=wd`` and one with 0.)

Counting: ``opt.updates`` is the number of updates done so far.  The
update :meth:`Optimizer.step` performs is number ``t = updates + 1``, so
``t`` counts from 1, as in the Adam paper's bias correction.  Schedules use the
same convention: ``schedule(t)`` is the learning rate of update ``t``.  Give a
schedule as ``lr`` and the optimizer calls it itself before every update; or give
a float and assign ``opt.lr`` / call :meth:`Optimizer.set_lr` from the training loop.

The fast tier (:mod:`npformer.fast.optim`) runs the same algorithms over one flat
buffer of every parameter (one compiled pass per update) and, on CuPy, as one fused
kernel per parameter; it is tested equal to this file, update for update.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from . import backend
from .backend import Array
from .nn.module import Parameter
from .nn.state import mismatch_report, weight_array
from .ops.contracts import check_flag, check_real, check_size

Schedule = Callable[[int], float]

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "NonFiniteGradientError", "clip_grad_norm",
           "global_grad_norm", "constant", "warmup_inverse_sqrt", "warmup_cosine"]


# =========================================================================== base class
class Optimizer:
    """Holds the parameters, the learning rate, the step counter and per-parameter state.

    Subclasses name their per-parameter state arrays in ``_state_names`` (``("m", "v")``)
    and their scalar hyperparameters in ``_hyper_names``, and implement :meth:`_update`,
    which returns one parameter's new ``(data, state arrays)``.  State arrays start as
    ``zeros_like(p.data)`` (the parameter's shape, dtype and device).
    """

    _state_names: tuple[str, ...] = ()
    _hyper_names: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Parameter], lr: float | Schedule):
        self.params: list[Parameter] = trainable(check_parameters(params, type(self).__name__),
                                                 type(self).__name__)
        self.updates: int = 0
        self.schedule: Schedule | None = lr if callable(lr) else None
        self.lr: float = (check_hyperparameter(lr(1), "lr", "the schedule's value lr(1)")
                          if callable(lr) else check_hyperparameter(lr, "lr"))
        # state[name][i] is the state array `name` of params[i]
        self.state: dict[str, list[Any]] = self._zero_state()

    def _zero_state(self) -> dict[str, list[Any]]:
        """{state name: [zeros like params[i].data]}: the state before the first update."""
        return {name: [backend.namespace_of(p.data).zeros_like(p.data) for p in self.params]
                for name in self._state_names}

    def set_lr(self, lr: float) -> None:
        """Use ``lr`` from the next update on (a schedule, if any, overrides it again)."""
        self.lr = check_hyperparameter(lr, "lr")

    def zero_grad(self) -> None:
        """Reset every parameter's gradient to zeros (the layers *add* into ``p.grad``)."""
        for p in self.params:
            p.zero_grad()

    def step(self) -> None:
        """Perform update ``t = updates + 1`` on every parameter, then count it."""
        t = self.updates + 1
        if self.schedule is not None:
            self.lr = check_hyperparameter(self.schedule(t), "lr",
                                           f"the schedule's value lr({t})")
        check_gradients(self.params)  # all checks first: no half-done update
        for i, p in enumerate(self.params):
            old = tuple(self.state[name][i] for name in self._state_names)
            p.data, new = self._update(p, p.grad, old, t)
            for name, value in zip(self._state_names, new):
                self.state[name][i] = value
        self.updates = t

    def clip_grad_norm(self, named: ParamsOrNamed, max_norm: float) -> float:
        """:func:`clip_grad_norm` of ``named`` (this optimizer's parameters, with their
        names for the error), as the Trainer clips before :meth:`step`."""
        return clip_grad_norm(named, max_norm)

    def grad_norm(self, named: ParamsOrNamed) -> float:
        """:func:`global_grad_norm` of ``named``; NonFiniteGradientError naming a
        parameter whose gradient is NaN or inf (the Trainer's check without clipping)."""
        return global_grad_norm(named, error_if_nonfinite=True)

    def _update(self, p: Parameter, g, state: tuple, t: int):  # pragma: no cover - abstract
        """Return ``(new p.data, new state arrays)`` for update ``t`` with gradient ``g``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state as a flat dict, ready for ``np.savez``.

        Keys: ``"optimizer"`` (the class name), ``"step"`` (updates done),
        ``"params"`` (how many parameters), ``"lr"`` and the hyperparameters
        (``"beta1"``, ``"eps"``, ...) as Python numbers, and ``"<state>.<i>"``
        (``"m.3"``, ``"v.3"``, ``"momentum.3"``) for parameter ``i``, as backend arrays:
        copies, a snapshot that later updates do not change (``torch.optim`` returns
        references), as :meth:`npformer.nn.Module.state_dict` does.
        """
        d: dict[str, Any] = {"optimizer": type(self).__name__, "step": self.updates,
                             "lr": self.lr, "params": len(self.params)}
        d.update({name: getattr(self, name) for name in self._hyper_names})
        for name in self._state_names:
            d.update({f"{name}.{i}": backend.copy_like(value, value)
                      for i, value in enumerate(self.state[name])})
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (from this process or read back from an ``.npz``).

        As ``torch.optim.Optimizer.load_state_dict``: the step count, the learning rate,
        the hyperparameters and the state arrays (copied onto the parameters' backend, in
        each parameter's dtype).  Every mismatch (optimizer type, number of parameters,
        keys, shapes, values) is reported in one ``ValueError`` before anything changes.
        """
        step, lr, hyper = _checked_state(self, d)
        self.updates, self.lr = step, lr
        for name, value in hyper.items():
            setattr(self, name, value)
        for name in self._state_names:
            self.state[name] = [backend.copy_like(d[f"{name}.{i}"], p.data)
                                for i, p in enumerate(self.params)]

    def __repr__(self) -> str:
        hyper = ", ".join(f"{k}={getattr(self, k)}" for k in self._hyper_names)
        return (f"{type(self).__name__}({len(self.params)} params, lr={self.lr}, {hyper}, "
                f"updates={self.updates})")


# =========================================================================== SGD
class SGD(Optimizer):
    r"""Stochastic gradient descent with momentum, as ``torch.optim.SGD`` (dampening 0, no
    Nesterov).

    For update t, gradient g, parameter p (lr = learning rate, mu = momentum,
    lambda = weight_decay, b = momentum buffer, b_0 = 0)::

        g   <- g + lambda * p           (only if lambda != 0 and p.decay)
        b_t  = mu * b_{t-1} + g         (only if mu != 0; then g <- b_t)
        p   <- p - lr * g

    PyTorch starts the buffer as a copy of the first gradient; starting from
    zeros gives exactly the same numbers, since mu * 0 + g == g in floating point.
    """

    _hyper_names = ("momentum", "weight_decay")

    def __init__(self, params: Sequence[Parameter], lr: float | Schedule, momentum: float = 0.0,
                 weight_decay: float = 0.0):
        self.momentum = check_hyperparameter(momentum, "momentum")
        self.weight_decay = check_hyperparameter(weight_decay, "weight_decay")
        self._state_names = ("momentum",) if self.momentum != 0 else ()
        super().__init__(params, lr)

    def _update(self, p, g, state, t):
        if self.weight_decay != 0 and p.decay:
            g = g + self.weight_decay * p.data            # g <- g + lambda p
        if self.momentum != 0:
            (buf,) = state
            buf = self.momentum * buf + g                 # b_t = mu b_{t-1} + g
            g = buf                                       # g <- b_t
            state = (buf,)
        return p.data - self.lr * g, state                # p <- p - lr g


# =========================================================================== Adam / AdamW
class Adam(Optimizer):
    r"""Adam (Kingma & Ba, 2015) exactly as ``torch.optim.Adam``.

    For update t = 1, 2, ..., gradient g, parameter p, with m_0 = v_0 = 0::

        g    <- g + lambda * p                        (L2 decay; only if p.decay)
        m_t   = m_{t-1} + (1 - beta1) * (g - m_{t-1})  (= beta1 m_{t-1} + (1-beta1) g)
        v_t   = beta2 * v_{t-1} + (1 - beta2) * g^2
        bc1   = 1 - beta1^t ;  bc2 = 1 - beta2^t
        step  = lr / bc1
        denom = sqrt(v_t) / sqrt(bc2) + eps
        p    <- p - step * m_t / denom

    This is the paper's p <- p - lr * m_hat / (sqrt(v_hat) + eps), m_hat = m_t / bc1 and
    v_hat = v_t / bc2, arranged as PyTorch rounds it (m_t in the form of its ``lerp``); the
    moments are the optimizer's own arrays, updated in place operation for operation as
    written (so the rounding matches torch).
    """

    _state_names = ("m", "v")
    _hyper_names = ("beta1", "beta2", "eps", "weight_decay")

    def __init__(self, params: Sequence[Parameter], lr: float | Schedule = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        self.beta1, self.beta2 = _check_betas(betas)
        self.eps = check_hyperparameter(eps, "eps")
        self.weight_decay = check_hyperparameter(weight_decay, "weight_decay")
        super().__init__(params, lr)

    _decoupled = False  # AdamW's decay shrinks the weights; Adam's joins the gradient

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)

    def _decay(self, p, g):
        """L2 decay: the gradient of (lambda/2) ||p||^2 joins g. Returns (data, g)."""
        if self.weight_decay != 0 and p.decay:
            g = g + self.weight_decay * p.data            # g <- g + lambda p
        return p.data, g

    def _update(self, p, g, state, t):
        (m, v), b1, b2 = state, self.beta1, self.beta2
        data, g = self._decay(p, g)
        bias_correction1 = 1 - b1**t                      # bc1 = 1 - beta1^t
        bias_correction2 = 1 - b2**t                      # bc2 = 1 - beta2^t
        step_size = self.lr / bias_correction1            # step = lr / bc1
        return adam_step(data, g, m, v, b1, b2, self.eps, step_size,
                         bias_correction2), (m, v)


def adam_step(data: Array, g: Array, m: Array, v: Array, beta1: float, beta2: float,
              eps: float, step_size: float, bias_correction2: float) -> Array:
    """Adam's statements on arrays of one shape (a parameter, or the fast tier's flat
    buffer of all of them): m and v updated in place, the new data returned."""
    xp = backend.namespace_of(data)
    delta = g - m
    delta *= 1 - beta1
    m += delta                                            # m_t = m + (1-beta1)(g - m)
    g_sq = g * g
    g_sq *= 1 - beta2
    v *= beta2
    v += g_sq                                             # v_t = beta2 v + (1-beta2) g^2
    denom = xp.sqrt(v)
    denom /= bias_correction2**0.5
    denom += eps                                          # sqrt(v)/sqrt(bc2) + eps
    update = m / denom
    update *= step_size
    return data - update                                  # p <- p - step m / denom


class AdamW(Adam):
    r"""AdamW (Loshchilov & Hutter, 2019) exactly as ``torch.optim.AdamW``.

    Adam without L2 in the gradient; instead, before the Adam update, the
    weights themselves shrink (only those with ``p.decay``)::

        p    <- p * (1 - lr * lambda)                 (only if p.decay)
        then Adam's update of m, v and p with the gradient g unchanged.
    """

    _decoupled = True

    def __init__(self, params: Sequence[Parameter], lr: float | Schedule = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        super().__init__(params, lr, betas, eps, weight_decay)

    def _decay(self, p, g):
        """Decoupled decay: the weights shrink, the gradient is left alone."""
        if self.weight_decay != 0 and p.decay:
            return p.data * (1 - self.lr * self.weight_decay), g  # p <- p (1 - lr lambda)
        return p.data, g


# =========================================================================== clipping
class NonFiniteGradientError(ValueError):
    """A gradient holds NaN or inf (raised by the norm functions; the message names it)."""


ParamsOrNamed = Iterable["Parameter | tuple[str, Parameter]"]


def global_grad_norm(params: ParamsOrNamed, error_if_nonfinite: bool = False) -> float:
    """sqrt(sum over params of sum(g^2)): the L2 norm of all gradients as one vector.

    ``params``: Parameters, or ``(name, Parameter)`` pairs (``model.named_parameters()``)
    so that errors can name them.  Computed on the device in the gradients' dtype; one
    transfer of the result.  A NaN or infinite norm is returned as is, unless
    ``error_if_nonfinite``: then :class:`NonFiniteGradientError` names the first
    parameter whose gradient holds NaN or inf.
    """
    error_if_nonfinite = check_flag(error_if_nonfinite, "error_if_nonfinite")
    named = _named(params)
    if not named:
        return 0.0
    total = backend.to_float(grad_norm_on_device([p.grad for _, p in named]))
    if error_if_nonfinite and not math.isfinite(total):
        raise NonFiniteGradientError(_nonfinite_report(named, total))
    return total


def grad_norm_on_device(grads: Sequence[Array]) -> Array:
    """sqrt(sum over the arrays of sum(g^2)), a 0-d array on their device, in their dtype
    (nothing read back: :func:`global_grad_norm` reads it, a CUDA graph keeps it)."""
    total_sq = None
    for g in grads:
        xp = backend.namespace_of(g)
        sq = xp.sum(g * g)                                # ||g_i||^2, a 0-d array
        total_sq = sq if total_sq is None else total_sq + sq
    return backend.namespace_of(total_sq).sqrt(total_sq)


def clip_grad_norm(params: ParamsOrNamed, max_norm: float,
                   error_if_nonfinite: bool = True) -> float:
    """Scale all gradients together so their global L2 norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_``::

        total = sqrt(sum_i ||g_i||^2)
        c     = min(max_norm / (total + 1e-6), 1)
        g_i  <- c * g_i           (for every i; c = 1 leaves them unchanged)

    Returns ``total``, the norm *before* clipping (log it: spikes show up here).
    A gradient holding NaN or inf raises :class:`NonFiniteGradientError` naming the
    first such parameter, before any gradient changes (torch's ``error_if_nonfinite=True``;
    a norm that overflows only in the sum of squares raises too).  With
    ``error_if_nonfinite=False`` the non-finite total is returned and, unlike torch,
    the gradients are left as they are rather than all turned NaN or zero.
    """
    max_norm = check_real(max_norm, "max_norm", 0.0, inclusive=False)
    named = _named(params)
    total = global_grad_norm(named, error_if_nonfinite)
    if not math.isfinite(total):
        return total
    coef = min(max_norm / (total + 1e-6), 1.0)
    for _, p in named:
        p.grad = p.grad * coef
    return total


def _named(params) -> list[tuple[str, Parameter]]:
    """(name, Parameter) pairs from Parameters (named params[i]) or pairs; frozen ones
    left out (they take no gradient: a LoRA model's base weights)."""
    named = []
    for i, item in enumerate(params):
        name, p = item if isinstance(item, tuple) and len(item) == 2 else (f"params[{i}]", item)
        if not isinstance(p, Parameter):
            raise TypeError(f"{name} is a {type(p).__name__}, not a Parameter "
                            "(pass model.parameters() or model.named_parameters())")
        if p.frozen:
            continue
        if p.grad is None:
            raise ValueError(f"{name} has no gradient (grad is None)")
        named.append((name, p))
    return named


def _nonfinite_report(named, total: float) -> str:
    for name, p in named:
        xp = backend.namespace_of(p.grad)
        finite = xp.isfinite(p.grad)
        if not backend.to_float(xp.sum(xp.astype(finite, xp.int64))) == p.grad.size:
            return (f"the gradient of {name} (shape {p.shape}) holds NaN or inf: the total "
                    f"gradient norm is {total}. Lower the learning rate, or find where the "
                    "backward pass overflowed (pass error_if_nonfinite=False to get the norm)")
    return (f"the total gradient norm overflows to {total} although every gradient is "
            "finite (gradients near the float range limit); lower the learning rate or "
            "the loss scale")


# =========================================================================== schedules
@dataclass(frozen=True)
class constant:
    """lr(t) = lr for every update t >= 1."""

    lr: float

    def __post_init__(self):
        check_hyperparameter(self.lr, "lr")

    def __call__(self, step: int) -> float:
        check_update_number(step)
        return float(self.lr)


@dataclass(frozen=True)
class warmup_inverse_sqrt:
    """The schedule of "Attention is all you need" (section 5.3), t counted from 1::

        lr(t) = scale * d_model^-0.5 * min(t^-0.5, t * warmup^-1.5)

    Linear growth for ``warmup`` updates, peak at t = warmup, then decay as
    1/sqrt(t).  Give ``peak_lr`` instead of ``d_model`` to get the same shape
    normalized so that lr(warmup) == peak_lr::

        lr(t) = peak_lr * warmup^0.5 * min(t^-0.5, t * warmup^-1.5)

    (the paper: d_model=512, warmup=4000, scale=1; ``scale`` is the "factor" of
    the Annotated Transformer and applies only to the d_model form).
    """

    d_model: int | None = None
    warmup: int = 4000
    peak_lr: float | None = None
    scale: float = 1.0

    def __post_init__(self):
        if (self.d_model is None) == (self.peak_lr is None):
            raise ValueError("warmup_inverse_sqrt needs exactly one of d_model and peak_lr")
        check_size(self.d_model, "d_model", 1, optional=True)
        if self.peak_lr is not None:
            check_hyperparameter(self.peak_lr, "lr", "peak_lr")
            if self.scale != 1.0:
                raise ValueError(
                    "scale applies only with d_model; with peak_lr give the peak itself")
        check_size(self.warmup, "warmup", 1)
        check_hyperparameter(self.scale, "lr", "scale")

    def __call__(self, step: int) -> float:
        check_update_number(step)
        shape = min(step**-0.5, step * self.warmup**-1.5)
        if self.peak_lr is not None:
            return self.peak_lr * self.warmup**0.5 * shape
        return self.scale * self.d_model**-0.5 * shape


@dataclass(frozen=True)
class warmup_cosine:
    """Linear warmup, then cosine decay to ``min_lr`` (nanoGPT's ``get_lr``), t from 1::

        lr(t) = peak_lr * t / warmup                              for t <= warmup
        r     = (t - warmup) / (end - warmup)                     for warmup < t <= end
        lr(t) = min_lr + 0.5 * (1 + cos(pi * r)) * (peak_lr - min_lr)
        lr(t) = min_lr                                            for t > end

    where ``end = total_updates``, the run's last update: lr(warmup) == peak_lr,
    lr(end) == min_lr, and lr never increases after the warmup.  ``warmup=0`` decays
    from the first update.  A run of any length is legal: one that ends within its warmup
    (``total_updates <= warmup``) never decays, its updates are the warmup line's
    (``end = warmup + 1``), so a one-update run with a warmup of one takes ``peak_lr``.

    The Trainer fits a run's length to a time budget with :meth:`of_length`
    (``TrainConfig(schedule_for=warmup_cosine(...).of_length)``).

    >>> warmup_cosine(1e-3, warmup=1, total_updates=1)(1)
    0.001
    """

    peak_lr: float
    warmup: int
    total_updates: int
    min_lr: float = 0.0

    def __post_init__(self):
        check_hyperparameter(self.peak_lr, "lr", "peak_lr")
        check_hyperparameter(self.min_lr, "lr", "min_lr")
        if self.min_lr > self.peak_lr:
            raise ValueError(f"min_lr ({self.min_lr}) is above peak_lr ({self.peak_lr})")
        check_size(self.warmup, "warmup", 0)
        check_size(self.total_updates, "total_updates", 1)

    @property
    def end(self) -> int:
        """The update at which the decay reaches ``min_lr``: the run's last, or the first
        after the warmup for a run that ends within it."""
        return max(self.total_updates, self.warmup + 1)

    def __call__(self, step: int) -> float:
        check_update_number(step)
        if step <= self.warmup:
            return self.peak_lr * step / self.warmup
        if step > self.end:
            return float(self.min_lr)
        ratio = (step - self.warmup) / (self.end - self.warmup)
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return self.min_lr + coeff * (self.peak_lr - self.min_lr)

    def of_length(self, updates: int) -> warmup_cosine:
        """The same schedule for a run of ``updates`` updates (its ``total_updates``)."""
        return replace(self, total_updates=updates)


# =========================================================================== whose parameters
def check_optimizer_of(optimizer: Any, model: Any, what: str) -> None:
    """``optimizer`` must be an npformer optimizer whose parameters are all ``model``'s (the
    same objects; some of them, for a model partly frozen): one over another model's copy
    would train, save or restore nothing of this one, silently.  ``what`` names the
    caller in the message."""
    params = getattr(optimizer, "params", None)
    if not isinstance(optimizer, Optimizer) or params is None:
        raise TypeError(f"{what}: optimizer must be an npformer optimizer (with .params), got "
                        f"{type(optimizer).__name__}")
    mine = {id(p) for p in model.parameters()}
    foreign = [i for i, p in enumerate(params) if id(p) not in mine]
    if foreign:
        raise ValueError(f"{what}: the optimizer does not update this model: {len(foreign)} of "
                         f"its {len(params)} parameters (first: optimizer.params[{foreign[0]}]) "
                         "are not the model's. Build it from model.parameters() of this model")


# =========================================================================== saved state checks
def _checked_state(opt: Optimizer, d: dict) -> tuple[int, float, dict[str, float]]:
    """Check a state dict against ``opt``: every problem in one ValueError, nothing
    changed.  Returns (step, lr, {hyperparameter: value})."""
    owner = type(opt).__name__
    if not isinstance(d, dict):
        raise TypeError(f"optimizer state must be a dict (from state_dict()), got "
                        f"{type(d).__name__}")
    problems: list[str] = []
    kind = d.get("optimizer")
    if kind is None:
        problems.append("missing key 'optimizer'")
    elif str(_scalar(kind, "optimizer")) != owner:
        problems.append(f"it was saved by {_scalar(kind, 'optimizer')}, not {owner}")
    scalar_keys = ("step", "lr", "params") + opt._hyper_names
    missing_scalars = [k for k in scalar_keys if k not in d]
    if missing_scalars:
        problems.append(f"missing keys: {missing_scalars}")
    saved = {k: _scalar(d[k], k) for k in scalar_keys if k in d}
    problems += _scalar_problems(opt, saved)
    if "params" in saved and saved["params"] != len(opt.params):
        problems.append(f"it holds state for {saved['params']} parameters, this optimizer "
                        f"has {len(opt.params)}")
    else:
        problems += _array_problems(opt, d, set(scalar_keys) | {"optimizer"})
    if problems:
        raise ValueError(f"optimizer state does not fit {owner}: " + " | ".join(problems))
    return (int(saved["step"]), float(saved["lr"]),
            {name: float(saved[name]) for name in opt._hyper_names})


def _scalar_problems(opt: Optimizer, saved: dict) -> list[str]:
    """Values the constructor would refuse (a negative step, a NaN lr, beta1 >= 1, ...):
    the hyperparameters checked by their one range (HYPERPARAMETER_RANGES)."""
    problems = []
    for key, value in saved.items():
        if key in HYPERPARAMETER_RANGES:
            refused = _refused(check_hyperparameter, value, key)
        elif key in ("step", "params"):
            refused = _refused(check_size, value, key)
        else:
            continue
        if refused:
            problems.append(f"{key} is {value!r}" + (" (a negative step count)"
                                                      if key == "step" else ""))
    if "momentum" in saved and isinstance(saved["momentum"], (int, float)) and (
            (saved["momentum"] != 0) != (getattr(opt, "momentum", 0) != 0)):
        problems.append(f"it was saved with momentum={saved['momentum']}, this optimizer has "
                        f"momentum={opt.momentum} (one of them keeps no momentum buffer)")
    return problems


def _refused(check: Callable, *args: Any) -> bool:
    try:
        check(*args)
    except (TypeError, ValueError):
        return True
    return False


def _array_problems(opt: Optimizer, d: dict, scalar_keys: set) -> list[str]:
    """Missing, unexpected and wrongly shaped ``<state>.<i>`` arrays."""
    expected = {f"{name}.{i}" for name in opt._state_names for i in range(len(opt.params))}
    array_keys = {k for k in d if k not in scalar_keys}
    missing = sorted(expected - array_keys, key=_key_order)
    extra = sorted(array_keys - expected, key=_key_order)
    wrong, values = [], []
    for key in sorted(expected & array_keys, key=_key_order):
        i = int(key.rsplit(".", 1)[1])
        got = tuple(getattr(d[key], "shape", ()))
        if got != opt.params[i].shape:
            wrong.append(f"{key}: expected {opt.params[i].shape}, got {got}")
            continue
        try:  # the rules every weight loader applies: floating point, finite
            host = weight_array(d[key], key)
        except (TypeError, ValueError) as exc:
            values.append(str(exc))
            continue
        if key.rsplit(".", 1)[0] in _NONNEGATIVE_STATES and bool((host < 0).any()):
            values.append(f"{key} holds negative values, but it is a mean of squared "
                          "gradients (>= 0): the state is corrupt")
    return mismatch_report(missing, extra, wrong) + values


_NONNEGATIVE_STATES = ("v",)  # Adam's second moments: running means of g^2


def _scalar(value, key: str = "value"):
    """A Python number/str from a Python scalar or a 0-d array (as ``np.load`` returns)."""
    if isinstance(value, (int, float, str)):
        return value
    host = backend.to_numpy(value)
    if getattr(host, "ndim", 0) != 0:
        raise ValueError(f"optimizer state {key!r} should be a scalar, got shape {host.shape}")
    return host.item()


def _key_order(key: str):
    name, _, idx = key.rpartition(".")
    return (name, int(idx)) if idx.isdigit() else (key, -1)


# =========================================================================== argument checks
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


def _check_betas(betas: Any) -> tuple[float, float]:
    """Adam's ``betas``: a pair, each in [0, 1)."""
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
    return check_hyperparameter(beta1, "beta1"), check_hyperparameter(beta2, "beta2")


def check_update_number(t: Any) -> int:
    """A schedule's update number: an integer from 1 (the first update is 1)."""
    return check_size(t, "the update number t (schedules count updates from 1)", 1)


def check_parameters(params: Any, owner: str) -> list:
    """``params``: a non-empty iterable of distinct :class:`~npformer.nn.Parameter`\\ s (what
    ``owner``, an optimizer, updates); returned as a list."""
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


def trainable(params: list, owner: str) -> list:
    """The parameters of ``params`` that are not frozen (what ``owner``, an optimizer,
    updates); refused when every one is frozen."""
    kept = [p for p in params if not p.frozen]
    if not kept:
        raise ValueError(f"{owner}: all {len(params)} parameters are frozen: there is nothing "
                         "to train (unfreeze some, or add adapters: npformer.nn.lora)")
    return kept


def check_gradients(params: Sequence) -> None:
    """Every parameter has a gradient of its own shape, dtype and array library (checked
    before an update changes anything: no half-done update)."""
    for i, p in enumerate(params):
        if p.frozen:
            raise RuntimeError(f"params[{i}] was frozen after the optimizer was built: build "
                               "the optimizer after freezing (it keeps state for it)")
        if p.grad is None:
            raise RuntimeError(f"params[{i}] has no gradient (grad is None)")
        backend.namespace_of(p.data, p.grad)  # one array library (TypeError naming both)
        if tuple(p.grad.shape) != p.shape:
            raise RuntimeError(f"params[{i}]: gradient shape {tuple(p.grad.shape)} != "
                               f"parameter shape {p.shape}")
        if p.grad.dtype != p.data.dtype:
            raise RuntimeError(f"params[{i}]: gradient dtype {p.grad.dtype} != "
                               f"parameter dtype {p.data.dtype}")
