"""The contracts of the fast tier's own arguments: each is the textbook op's contract
(:mod:`npformer.ops.contracts`), called, and the check of what this tier adds.

* ``keep_input`` (:func:`.linear.linear_forward`): whether the forward keeps its input for
  the backward; :func:`forward_input` is where a backward gets it back.
* ``block_scores`` (:func:`.attention.attention_forward`): the scores per block.
"""
from __future__ import annotations

from typing import Any

from ..backend import Array
from ..ops import contracts
from ..ops.contracts import check_flag, check_size


def check_keep_input(keep_input: Any) -> None:
    """``keep_input`` (whether a forward keeps its input for the backward): True or False."""
    check_flag(keep_input, "keep_input")


def linear_inputs(x: Array, w: Array, b: Array | None = None, keep_input: bool = True) -> None:
    """The textbook's :func:`~npformer.ops.contracts.linear_inputs`; keep_input True or False."""
    check_keep_input(keep_input)
    contracts.linear_inputs(x, w, b)


def attention_inputs(q: Array, k: Array, v: Array, mask: Array | None = None,
                     block_scores: int | None = None) -> None:
    """The textbook's :func:`~npformer.ops.contracts.attention_inputs`; ``block_scores``
    None or >= 1."""
    contracts.attention_inputs(q, k, v, mask)
    if block_scores is not None:
        check_size(block_scores, "block_scores", 1)


def forward_input(values: tuple, x: Any) -> tuple:
    """``values`` = (input, ...) of a forward that may not have kept its input (None
    there): the tuple with the input the backward's caller passed in its place.  Exactly
    one of the two must be given (it is the forward's input, recomputed by the caller)."""
    kept = values[0]
    if kept is None and x is None:
        raise RuntimeError("the forward did not keep its input (keep_input=False): pass "
                           "it to the backward as x")
    if kept is not None and x is not None:
        raise RuntimeError("the forward kept its input: the backward takes no x")
    return (x if kept is None else kept,) + tuple(values[1:])
