"""The optimizers of the fast tier (docs/derivations.md §23): the textbook update rules
(:mod:`npformer.optim`) over one flat buffer, tested equal update for update in
``tests/test_optim.py``.

* :class:`Adam`, :class:`AdamW`: NumPy parameters of one floating dtype live in one
  :class:`~npformer.nn.flat.FlatParameters` (the model's, or a new one) and the moments in
  two more; one update is one pass (:func:`npformer.fast.adamw.adamw_flat_update`).  On
  CuPy one fused kernel a parameter; Adam with L2 decay keeps the textbook's update.
* :func:`clip_grad_norm`, :func:`global_grad_norm`: one pass over the flat gradient
  buffer where there is one, else the textbook functions.

``state_dict`` and ``load_state_dict`` mean the textbook's; a loaded state is copied into
the flat buffers.
"""
from __future__ import annotations

import math
from typing import Any

from .. import backend, optim
from ..nn.flat import FlatParameters, flat_buffer, flat_buffer_of
from ..ops.contracts import check_flag, check_real
from ..optim import (
    NonFiniteGradientError,
    ParamsOrNamed,
    _named,
    _nonfinite_report,
    check_gradients,
    check_hyperparameter,
)
from .adamw import adam_update_cupy, adamw_flat_update, fuses, sum_of_squares


class _FlatAdam:
    """What :class:`Adam` and :class:`AdamW` of this tier add to their textbook classes."""

    _flat: FlatParameters | None = None

    def _zero_state(self) -> dict[str, list[Any]]:
        """The parameters into one flat buffer and the moments made flat (``state[name][i]``
        a view of ``_flat_state[name]``), never per parameter first: the moments are twice
        the model's size.  L2 decay changes g tensor by tensor: Adam with it stays per
        parameter, as does anything but NumPy floats of one dtype."""
        if not (self._decoupled or self.weight_decay == 0):
            return super()._zero_state()
        self._flat = flat_buffer(self.params)
        if self._flat is None:
            return super()._zero_state()
        self._flat_state = {name: backend.namespace_of(self._flat.data).zeros_like(self._flat.data)
                            for name in self._state_names}  # (P,) each
        self._state_views = {name: [buffer[lo:hi].reshape(p.shape)
                                    for p, (lo, hi) in zip(self.params, self._flat.slices)]
                             for name, buffer in self._flat_state.items()}
        return {name: list(views) for name, views in self._state_views.items()}

    def zero_grad(self) -> None:
        if self._flat is None:
            return super().zero_grad()
        self._flat.sync()  # parameters rebound since (a loader) go back into the buffer
        self._flat.zero_grad()  # one fill of the flat gradient buffer

    def step(self) -> None:
        if self._flat is None:
            return super().step()
        t = self.updates + 1
        if self.schedule is not None:
            self.lr = check_hyperparameter(self.schedule(t), "lr")
        check_gradients(self.params)  # all checks first: no half-done update
        self._flat.sync()
        self._sync_flat_state()
        b1, b2 = self.beta1, self.beta2
        decay = self._decoupled and self.weight_decay != 0
        segments = self._flat.decay_segments if decay else self._flat.decay_segments[:0]
        adamw_flat_update(self._flat.data, self._flat.grad, self._flat_state["m"],
                          self._flat_state["v"], segments, 1 - self.lr * self.weight_decay,
                          b1, b2, self.eps, self.lr / (1 - b1**t), 1 - b2**t)
        self.updates = t

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        if self._flat is not None:
            self._sync_flat_state()

    def _sync_flat_state(self) -> None:
        """Moments rebound by a loader copied back into their flat views."""
        for name in self._state_names:
            for i, view in enumerate(self._state_views[name]):
                value = self.state[name][i]
                if value is not view:
                    view[...] = backend.to_numpy(value)
                    self.state[name][i] = view

    def clip_grad_norm(self, named: ParamsOrNamed, max_norm: float) -> float:
        return clip_grad_norm(named, max_norm)  # this tier's: one pass over the flat buffer

    def grad_norm(self, named: ParamsOrNamed) -> float:
        return global_grad_norm(named, error_if_nonfinite=True)

    def _update(self, p, g, state, t):
        """One parameter's update (parameters that are not one buffer's): on CuPy one fused
        kernel (the textbook statements, bit for bit), else the textbook's."""
        (m, v), b1 = state, self.beta1
        if not fuses(p.data, g, m, v):
            return super()._update(p, g, state, t)
        data, g = self._decay(p, g)
        return adam_update_cupy(data, g, m, v, b1, self.beta2, self.eps,
                                self.lr / (1 - b1**t), 1 - self.beta2**t), (m, v)


class Adam(_FlatAdam, optim.Adam):
    __doc__ = optim.Adam.__doc__


class AdamW(_FlatAdam, optim.AdamW):
    __doc__ = optim.AdamW.__doc__


# =========================================================================== clipping
def global_grad_norm(params: ParamsOrNamed, error_if_nonfinite: bool = False) -> float:
    """:func:`npformer.optim.global_grad_norm`, in one pass where every gradient lives in
    one flat buffer."""
    error_if_nonfinite = check_flag(error_if_nonfinite, "error_if_nonfinite")
    named = _named(params)
    flat = flat_buffer_of(p for _, p in named)
    if flat is None:
        return optim.global_grad_norm(named, error_if_nonfinite)
    total = math.sqrt(sum_of_squares(flat.grad))
    if error_if_nonfinite and not math.isfinite(total):
        raise NonFiniteGradientError(_nonfinite_report(named, total))
    return total


def clip_grad_norm(params: ParamsOrNamed, max_norm: float,
                   error_if_nonfinite: bool = True) -> float:
    """:func:`npformer.optim.clip_grad_norm`: where every gradient lives in one flat buffer,
    the norm in one pass and every gradient scaled in place in one more."""
    max_norm = check_real(max_norm, "max_norm", 0.0, inclusive=False)
    named = _named(params)
    flat = flat_buffer_of(p for _, p in named)
    if flat is None:
        return optim.clip_grad_norm(named, max_norm, error_if_nonfinite)
    total = global_grad_norm(named, error_if_nonfinite)
    if math.isfinite(total):
        flat.grad *= min(max_norm / (total + 1e-6), 1.0)
    return total
