"""Evaluation while training: ``eval_fn``'s metrics at an update, and whether they are the
best so far by ``TrainConfig.select_metric`` (the Trainer then keeps that checkpoint)."""
from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any


class Evaluation:
    """Runs ``eval_fn(model)`` (a dict ``{name: number}``) and keeps ``best``, the best
    value of ``select_metric`` so far (``select_mode`` "max" or "min"; None: nothing is
    selected)."""

    def __init__(self, eval_fn: Callable | None, select_metric: str | None = None,
                 select_mode: str = "max"):
        if select_metric is not None and eval_fn is None:
            raise ValueError(f"TrainConfig.select_metric={select_metric!r} needs an "
                             "eval_fn returning it: give the Trainer one")
        self.eval_fn, self.select_metric, self.select_mode = eval_fn, select_metric, select_mode
        self.best: float | None = None

    def metrics(self, model: Any, update: int) -> dict:
        """``eval_fn(model)``'s metrics, with the key ``"update"``: a dict of names (str) and
        real numbers (Python's, NumPy's, 0-d arrays: held as Python numbers, which the
        log's format and a checkpoint's JSON take); anything else is a TypeError naming
        eval_fn, the metric and what it returned."""
        return dict(checked_metrics(self.eval_fn(model)), update=update)

    def is_best(self, metrics: dict) -> bool:
        """Whether ``metrics`` hold the best value of ``select_metric`` so far (it is then
        ``best``); False where nothing is selected."""
        if self.select_metric is None:
            return False
        if self.select_metric not in metrics:
            raise ValueError(f"TrainConfig.select_metric={self.select_metric!r} is not among "
                             f"the metrics eval_fn returned: "
                             f"{sorted(k for k in metrics if k != 'update')}")
        value = metrics[self.select_metric]
        better = (self.best is None or (value > self.best if self.select_mode == "max"
                                        else value < self.best))
        if better:
            self.best = value
        return better


def checked_metrics(returned: Any) -> dict[str, float | int]:
    """What ``eval_fn`` returned, checked: a dict {name (str): real number}, the numbers as
    Python ints and floats."""
    if not isinstance(returned, Mapping):
        raise TypeError(f"eval_fn(model) must return a dict of metrics {{name: number}}, "
                        f"got {type(returned).__name__} {returned!r:.80}")
    metrics = {}
    for name, value in returned.items():
        if not isinstance(name, str) or name == "update":
            raise TypeError(f"eval_fn(model) returned the metric name {name!r}: names are "
                            "strings, and not 'update' (the Trainer adds that one)")
        if getattr(value, "shape", None) == () and hasattr(value, "item"):
            value = value.item()  # a 0-d array, a NumPy scalar
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"eval_fn(model) returned {name!r}: {value!r:.80} "
                            f"({type(value).__name__}); each metric must be a real number")
        metrics[name] = int(value) if isinstance(value, numbers.Integral) else float(value)
    return metrics


def describe(metrics: dict) -> str:
    """The line an evaluation logs: ``update 40: val_loss 0.4100, val_accuracy 0.8700``."""
    return "update {update}: ".format(**metrics) + ", ".join(
        f"{k} {v:.4f}" for k, v in metrics.items() if k != "update")
