"""The rules every weight loader applies, written once.

Used by :meth:`npformer.nn.Module.load_state_dict`, :mod:`npformer.checkpoint`,
:mod:`npformer.torch_interop` and :meth:`npformer.optim.Optimizer.load_state_dict`.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy

from .. import backend


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
