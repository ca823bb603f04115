"""A run's figures: training curves and attention heat-maps (PNG, drawn by rank 0), each
drawn as an extra (:func:`extra_output`) whose failure never ends a run.  matplotlib is
imported only when a plot is drawn (``pip install -e .[demos]``)."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..train.config import History
from .ranks import is_main


def extra_output(name: str, draw: Callable, *args: Any, **kwargs: Any) -> bool:
    """Draw an extra (a plot, a sample) after the run's results are saved: a failure is
    one ``warning:`` line, never the end of a run whose checkpoints and metrics.json are
    already written.  Returns whether it was written."""
    try:
        draw(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of an extra: reported, not fatal
        print(f"warning: {name} not written: {type(exc).__name__}: {exc}", file=sys.stderr)
        return False
    return True


def curve_panels(eval_keys: list[str]) -> list[tuple[str, list[str]]]:
    """The panels of :func:`plot_curves`: one per quantity, the last word of a metric's
    name (``val_accuracy`` -> ``accuracy``), each ``(quantity, the metrics drawn on it)``;
    the first is the loss, where the per-update training loss is drawn too (a short run's
    few evaluations then stand beside a whole curve)."""
    panels: dict[str, list[str]] = {"loss": []}
    for key in eval_keys:
        panels.setdefault(key.rsplit("_", 1)[-1], []).append(key)
    return list(panels.items())


def plot_curves(path: Path, history: History, eval_keys: list[str], title: str) -> None:
    """Training curves to a PNG: one panel per quantity (:func:`curve_panels`), the loss
    first, with the training loss per update and the evaluations' losses; each other
    quantity (accuracy) on its own axis."""
    if not is_main():
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = curve_panels(eval_keys)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (measured, keys) in zip(axes[0], panels):
        if measured == "loss":
            _plot_training_loss(ax, history)
        for key in keys:
            points = [(e["update"], e[key]) for e in history.evals if key in e]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=f"{key} ({len(points)} evaluations)")
        ax.set_xlabel("update")
        ax.set_ylabel(measured)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_training_loss(ax: Any, history: History) -> None:
    """The training loss of every update, and its running mean once there are enough."""
    losses = np.asarray(history.losses)
    ax.plot(history.updates, losses, alpha=0.3, label="training loss per update")
    if len(losses) >= 20:
        window = max(len(losses) // 50, 5)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(history.updates[window - 1:], smooth, label=f"mean of {window}")


def plot_attention(path: Path, weights: np.ndarray, query_tokens: list[str],
                   key_tokens: list[str], title: str) -> None:
    """A (T, S) attention matrix as a heat-map with token labels."""
    if not is_main():
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height = max(3.0, 0.25 * len(query_tokens) + 1.5)
    width = max(4.0, 0.25 * len(key_tokens) + 2.0)
    fig, ax = plt.subplots(figsize=(min(width, 30), min(height, 30)))
    image = ax.imshow(weights, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(key_tokens)), key_tokens, rotation=90, fontsize=7)
    ax.set_yticks(range(len(query_tokens)), query_tokens, fontsize=7)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    fig.colorbar(image, ax=ax)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
