"""Tasks: what one training batch means for each model.

A :class:`Task` knows, for one kind of batch (host NumPy arrays), two things:

* ``count(batch)``: how many items the batch's mean loss averages over (sequences,
  tokens, or real target tokens).  Data parallelism weights each shard's loss by its
  share of these, so the summed gradient equals the whole batch's.
* ``loss_and_grad(model, batch, grad_scale)``: the forward pass, the loss, and the
  backward pass of ``loss * grad_scale`` through the model (gradients accumulate into
  the parameters); returns the batch's mean loss as a Python float.

The three tasks of the demos: :class:`Classification` (IMDB), :class:`LanguageModeling`
(tiny Shakespeare) and :class:`Translation` (English-French).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from . import backend, engine
from .backend import Array
from .nn import Module


class Task(ABC):
    """One kind of training batch: its item count, and its loss with the backward pass."""

    @abstractmethod
    def count(self, batch: tuple) -> int:
        """The number of items the batch's mean loss averages over."""

    @abstractmethod
    def loss_and_grad(self, model: Module, batch: tuple, grad_scale: float = 1.0) -> float:
        """Forward, loss and backward of ``loss * grad_scale``; returns the mean loss."""


def cross_entropy_and_backward(model: Module, logits: Array, targets: Array, grad_scale: float,
                               **loss_kwargs: Any) -> float:
    """Loss on ``logits``, then the backward pass of loss * grad_scale through ``model``.

    The loss is the current tier's (:func:`npformer.engine.ops`).  Callers pass the
    model's output straight in, unnamed, so that this frame holds the only reference to
    the logits: the fast tier writes their gradient over them, and they are freed as soon
    as the model's backward pass has read the gradient.
    """
    loss, dlogits = engine.ops().cross_entropy_with_gradient(
        logits, backend.asarray(targets), grad_scale, **loss_kwargs)  # dlogits: (..., V)
    del logits  # this frame's reference: the gradient may live in the same buffer
    model.backward(dlogits)
    return backend.to_float(loss)


class Classification(Task):
    """batch = (ids (B, T), valid_lens (B,), labels (B,)); the loss averages over sequences."""

    def count(self, batch: tuple) -> int:
        return batch[0].shape[0]

    def loss_and_grad(self, model: Module, batch: tuple, grad_scale: float = 1.0) -> float:
        ids, valid_lens, labels = batch
        logits = model(backend.asarray(ids), backend.asarray(valid_lens))  # (B, C), small
        return cross_entropy_and_backward(model, logits, labels, grad_scale)


class LanguageModeling(Task):
    """batch = (x (B, T), y (B, T)) next-token targets; the loss averages over all B*T tokens."""

    def count(self, batch: tuple) -> int:
        return batch[0].size

    def loss_and_grad(self, model: Module, batch: tuple, grad_scale: float = 1.0) -> float:
        x, y = batch
        return cross_entropy_and_backward(model, model(backend.asarray(x)), y,
                                          grad_scale)  # (B, T, V) logits


class Translation(Task):
    """batch = (src, src_lens, tgt_in, tgt_out, tgt_lens); padding targets do not count:
    the model gives the logits at the valid target positions only (``valid_only``), and
    the loss averages over those real target tokens."""

    def __init__(self, label_smoothing: float = 0.0, pad_id: int = 0):
        self.label_smoothing, self.pad_id = label_smoothing, pad_id

    def count(self, batch: tuple) -> int:
        return int(np.sum(batch[3] != self.pad_id))

    def loss_and_grad(self, model: Module, batch: tuple, grad_scale: float = 1.0) -> float:
        src, src_lens, tgt_in, tgt_out, tgt_lens = batch
        valid = np.arange(tgt_out.shape[1])[None, :] < np.asarray(tgt_lens)[:, None]  # (B, T)
        targets = np.asarray(tgt_out)[valid]  # (N,): the valid positions, in row order
        return cross_entropy_and_backward(
            model, model(backend.asarray(src), backend.asarray(tgt_in), backend.asarray(src_lens),
                         backend.asarray(tgt_lens), valid_only=True),
            targets, grad_scale, label_smoothing=self.label_smoothing)
