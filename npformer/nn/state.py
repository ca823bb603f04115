"""The rules every weight loader applies, written once, and the reader of safetensors files
(``Module.load_state_dict``, checkpoints, interop.pytorch, hf, ``Optimizer.load_state_dict``).
"""
from __future__ import annotations

import json
import os
import struct
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy

from .. import backend
from ..ops.contracts import check_path


# =========================================================================== weights
# A weight array must be floating point (an integer, boolean or complex one is refused; a
# float of another width is cast to the parameter's dtype, as PyTorch's load_state_dict
# does), finite, and named and shaped exactly as the parameters are.  A torch tensor is
# detached, a bfloat16 one converted to float32 with a warning; nothing here imports torch.
def _host_weight(value: Any, name: str) -> numpy.ndarray:
    """A weight of any kind (NumPy or backend array, torch tensor, nested list) on the host."""
    if type(value).__module__.split(".")[0] == "torch":  # a torch tensor
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


# =========================================================================== safetensors files
def read_safetensors(path: str | Path, stacklevel: int = 2) -> dict[str, numpy.ndarray]:
    """Every tensor of a safetensors file, as NumPy arrays by name; bfloat16 ones (NumPy
    has no bfloat16) converted to float32, with a warning saying so.  A missing or
    unreadable file is refused naming it."""
    from safetensors.numpy import load_file

    path = check_path(path, "path")
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
                      "bfloat16, converted to float32 to load them", UserWarning,
                      stacklevel=stacklevel)
    return state


def _safetensors_header(path) -> dict:
    """The JSON header of a safetensors file: {name: {dtype, shape, data_offsets}}."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        if size > os.path.getsize(path) - 8:
            raise ValueError(f"header of {size} bytes is longer than the file")
        return json.loads(f.read(size))


def _read_bfloat16_as_float32(path, header: dict) -> dict[str, numpy.ndarray]:
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
            half = numpy.frombuffer(raw, dtype="<u2").astype(numpy.uint32) << 16
            array = half.view(numpy.float32)
        else:
            dtype = numpy.dtype(_TYPES[entry["dtype"]]).newbyteorder("<")
            array = numpy.frombuffer(raw, dtype=dtype)
        state[name] = array.reshape(entry["shape"]).copy()
    return state
