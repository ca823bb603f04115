"""Checkpoints as the previous release wrote them: the flat layout (format version 4).

That release's ``save_checkpoint`` (commit 8f514f9, ``npformer/checkpoint.py``: itself and
``_optimizer_arrays``) wrote a fast-tier model whose parameters were one flat buffer's
views as that buffer, and the moments of an optimizer flat over the same buffer as theirs:

* ``flat/param`` (P,): every parameter, raveled, end to end in ``named_parameters`` order;
* ``flat/optim/<state>`` (P,): each state array (AdamW's ``m``, ``v``) in the same layout,
  in place of its ``optim/<state>.<i>`` entries; an optimizer not flat over the model's
  buffer (Adam with L2 decay) wrote ``optim/<state>.<i>`` beside ``flat/param``;
* ``optim/<key>`` for every other entry of ``optimizer.state_dict()``;
* ``meta``: the usual fields and ``flat_layout``: ``names``, ``shapes`` and ``offsets``
  ([lo, hi) of each parameter, from ``flat_layout`` of the shapes, end to end from 0).

This release reads version 6 only: such a file is refused, naming its version; the
refusal's test writes one with :func:`save_flat_checkpoint`, from any model (of either
tier) and optimizer.  Checked
once against that writer itself (run from a copy of commit 8f514f9): for a fast LM with
AdamW, with Adam and L2 decay, and with no optimizer, in float32 and float64, both
write the same members, dtypes and values, and the same ``meta`` text.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from npformer import backend
from npformer.models.common import config_to_dict
from npformer.nn.module import flat_layout


def save_flat_checkpoint(path: str | Path, model, optimizer=None, step: int = 0,
                         extra: dict | None = None, rng_state: dict | None = None,
                         flat_moments: bool = True) -> Path:
    """Write ``model`` (and ``optimizer``) to ``path`` as the previous release did for a
    flat model: its parameters as ``flat/param``, and with ``flat_moments`` the
    optimizer's state arrays as ``flat/optim/<state>`` (an optimizer over exactly the
    model's parameters, in order), else as ``optim/<state>.<i>`` (a per-tensor optimizer:
    Adam with L2 decay)."""
    path = Path(path)
    named = list(model.named_parameters())
    offsets, _ = flat_layout([p.shape for _, p in named])
    meta = {
        "format": "npformer-checkpoint",
        "version": 4,
        "kind": model.kind,
        "config": config_to_dict(model.config),
        "step": int(step),
        "rng_state": rng_state,
        "extra": extra or {},
        "flat_layout": {"names": [name for name, _ in named],
                        "shapes": [list(p.shape) for _, p in named],
                        "offsets": [list(lo_hi) for lo_hi in offsets]},
    }
    arrays = {"flat/param": _raveled(p.data for _, p in named)}  # (P,)
    if optimizer is not None:
        arrays.update(_optimizer_arrays(optimizer, [p for _, p in named], flat_moments))
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(path, **arrays)
    return path


def _optimizer_arrays(optimizer, params: list, flat_moments: bool) -> dict:
    """``flat/optim/<state>`` (P,) for each state name where ``flat_moments``, and
    ``optim/<key>`` for every other entry of the optimizer's state dict."""
    state = optimizer.state_dict()
    flat_states = optimizer._state_names if flat_moments else ()
    if flat_states and [id(p) for p in optimizer.params] != [id(p) for p in params]:
        raise ValueError("flat moments need an optimizer over exactly the model's parameters, "
                         "in order (the previous release wrote no others)")
    arrays = {f"flat/optim/{name}": _raveled(state[f"{name}.{i}"] for i in range(len(params)))
              for name in flat_states}
    for key, value in state.items():
        if key.partition(".")[0] in flat_states:  # "m.3": in flat/optim/m
            continue
        arrays[f"optim/{key}"] = (np.array(value) if isinstance(value, (str, int, float))
                                  else backend.to_numpy(value))
    return arrays


def _raveled(arrays) -> np.ndarray:
    """The arrays on the host, raveled and laid end to end: (P,)."""
    return np.concatenate([backend.to_numpy(a).reshape(-1) for a in arrays])
