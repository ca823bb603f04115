"""Tasks: what one training batch means for each model.

A :class:`Task` knows, for one kind of batch (host NumPy arrays), ``count(batch)``: how
many items its mean loss averages over (sequences, tokens, or real target tokens; data
parallelism weights each shard's loss by its share, so the summed gradient is the whole
batch's); ``loss_and_grad(model, batch, grad_scale)``: forward, loss and the backward of
``loss * grad_scale`` (the gradients accumulate), the mean loss a Python float; and
``loss_and_grad_on_device`` (the three tasks): the mean loss left on the device, so that
nothing waits for it (the step a CUDA graph captures, :mod:`npformer.gpu.cuda_graph`).

The three tasks of the demos: :class:`Classification` (IMDB), :class:`LanguageModeling`
(tiny Shakespeare) and :class:`Translation` (English-French).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from .. import backend, ops
from ..backend import Array
from ..nn import Module
from ..ops.contracts import check_token_ids, trusting
from ..ops.masks import real_positions


class Task(ABC):
    """One kind of training batch: its item count, and its loss with the backward pass."""

    @abstractmethod
    def count(self, batch: tuple) -> int:
        """The number of items the batch's mean loss averages over."""

    def loss_and_grad(self, model: Module, batch: tuple, grad_scale: float = 1.0) -> float:
        """Forward, loss and backward of ``loss * grad_scale``; returns the mean loss (by
        default :meth:`loss_and_grad_on_device`'s, brought to the host)."""
        return backend.to_float(self.loss_and_grad_on_device(model, batch, grad_scale))

    def loss_and_grad_on_device(self, model: Module, batch: tuple,
                                grad_scale: float = 1.0) -> Array:
        """As :meth:`loss_and_grad`, the mean loss a 0-d array on the device (the batch's
        arrays may already be there).  A task that does not define it trains eagerly."""
        raise NotImplementedError(f"{type(self).__name__} has no loss_and_grad_on_device")

    def check_batch(self, model: Module, batch: tuple) -> None:
        """On the host batch, what :meth:`loss_and_grad_on_device`'s model and loss would
        check: the door of a step that checks nothing itself (a CUDA graph's)."""
        raise NotImplementedError(f"{type(self).__name__} has no check_batch")


def cross_entropy_and_backward(model: Module, logits: Array, targets: Array, grad_scale: float,
                               **loss_kwargs: Any) -> Array:
    """Loss on ``logits``, then the backward pass of loss * grad_scale through ``model``;
    returns the mean loss, a 0-d array on the device.

    The loss is the one the model's class names (a fast model's writes the gradient over
    the logits), else the textbook's.  Callers pass the model's output straight in,
    unnamed, so that this frame holds the only reference to the logits: they are freed as
    soon as the model's backward pass has read the gradient.
    """
    loss_with_gradient = getattr(type(model), "cross_entropy_with_gradient",
                                 ops.cross_entropy_with_gradient)
    loss, dlogits = loss_with_gradient(logits, backend.asarray(targets), grad_scale,
                                       **loss_kwargs)  # dlogits: (..., V)
    del logits  # this frame's reference: the gradient may live in the same buffer
    with trusting():  # the loss's gradient of the model's output: its door checks nothing
        model.backward(dlogits)
    return loss


class Classification(Task):
    """batch = (ids (B, T), valid_lens (B,), labels (B,)); the loss averages over sequences."""

    def count(self, batch: tuple) -> int:
        return batch[0].shape[0]

    def loss_and_grad_on_device(self, model: Module, batch: tuple,
                                grad_scale: float = 1.0) -> Array:
        ids, valid_lens, labels = batch
        logits = model(backend.asarray(ids), backend.asarray(valid_lens))  # (B, C), small
        return cross_entropy_and_backward(model, logits, labels, grad_scale)

    def check_batch(self, model: Module, batch: tuple) -> None:
        ids, valid_lens, labels = batch
        model.check_inputs(ids, valid_lens)
        check_targets(labels, tuple(ids.shape[:1]), model.config.num_classes, "labels")


class LanguageModeling(Task):
    """batch = (x (B, T), y (B, T)) next-token targets; the loss averages over all B*T tokens."""

    def count(self, batch: tuple) -> int:
        return batch[0].size

    def loss_and_grad_on_device(self, model: Module, batch: tuple,
                                grad_scale: float = 1.0) -> Array:
        x, y = batch
        return cross_entropy_and_backward(model, model(backend.asarray(x)), y,
                                          grad_scale)  # (B, T, V) logits

    def check_batch(self, model: Module, batch: tuple) -> None:
        x, y = batch
        model.check_inputs(x)
        check_targets(y, tuple(x.shape), model.config.vocab_size, "next-token targets")


def check_targets(targets: Any, shape: tuple, num_classes: int, what: str) -> None:
    """Targets of ``shape``, integers in [0, num_classes) (or the loss's ignore index)."""
    if tuple(np.shape(targets)) != shape:
        raise ValueError(f"{what} must have shape {shape}, got {tuple(np.shape(targets))}")
    check_token_ids(targets, num_classes, what, allowed_extra=ops.IGNORE_INDEX)


class Translation(Task):
    """batch = (src, src_lens, tgt_in, tgt_out, tgt_lens); padding targets do not count:
    the model gives the logits at the valid target positions only (``valid_only``), and
    the loss averages over those real target tokens."""

    def __init__(self, label_smoothing: float = 0.0, pad_id: int = 0):
        self.label_smoothing, self.pad_id = label_smoothing, pad_id

    def count(self, batch: tuple) -> int:
        return int(np.sum(batch[3] != self.pad_id))

    def costs(self, batch: tuple) -> np.ndarray:
        """(B,): what each row costs to compute, its source and target tokens (the fast
        tier computes the valid positions only).  Data parallelism shares the rows out by
        it (:func:`npformer.parallel.shards.balanced_bounds`): sentences differ in length,
        so equal numbers of rows would leave the ranks of the longer ones waited for."""
        return np.asarray(batch[1]) + np.asarray(batch[4])

    def loss_and_grad_on_device(self, model: Module, batch: tuple,
                                grad_scale: float = 1.0) -> Array:
        """The logits of every target position, padding's ignored by the loss (the same
        mean over real tokens: ``valid_only`` would count them on the host)."""
        src, src_lens, tgt_in, tgt_out, tgt_lens = (backend.asarray(a) for a in batch)
        xp = backend.namespace_of(tgt_out)
        targets = xp.where(real_positions(tgt_lens, tgt_out.shape[1]), tgt_out,
                           xp.full_like(tgt_out, ops.IGNORE_INDEX))  # (B, T)
        return cross_entropy_and_backward(
            model, model(src, tgt_in, src_lens, tgt_lens), targets, grad_scale,
            label_smoothing=self.label_smoothing)  # (B, T, V) logits

    def check_batch(self, model: Module, batch: tuple) -> None:
        src, src_lens, tgt_in, tgt_out, tgt_lens = batch
        model.check_inputs(src, tgt_in, src_lens, tgt_lens)
        valid = real_positions(np.asarray(tgt_lens), tgt_out.shape[1])  # (B, T)
        check_targets(np.where(valid, tgt_out, ops.IGNORE_INDEX), tuple(np.shape(tgt_in)),
                      model.config.tgt_vocab_size, "target ids (tgt_out)")

    def loss_and_grad(self, model: Module, batch: tuple, grad_scale: float = 1.0) -> float:
        src, src_lens, tgt_in, tgt_out, tgt_lens = batch
        valid = real_positions(np.asarray(tgt_lens), tgt_out.shape[1])  # (B, T)
        targets = np.asarray(tgt_out)[valid]  # (N,): the valid positions, in row order
        return backend.to_float(cross_entropy_and_backward(
            model, model(backend.asarray(src), backend.asarray(tgt_in), backend.asarray(src_lens),
                         backend.asarray(tgt_lens), valid_only=True),
            targets, grad_scale, label_smoothing=self.label_smoothing))


# --------------------------------------------------------------------------- metrics
def accuracy(logits: Array, labels: Array) -> float:
    """Fraction of rows whose argmax equals the label."""
    predicted = np.argmax(backend.to_numpy(logits), axis=-1)
    return float(np.mean(predicted == np.asarray(labels)))


def perplexity(mean_token_loss: float) -> float:
    return math.exp(mean_token_loss)
