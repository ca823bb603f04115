"""A run's figures: training curves and attention heat-maps (PNG, drawn by rank 0), each
drawn as an extra (:func:`extra_output`) whose failure never ends a run.  matplotlib is
imported only when a plot is drawn (``pip install -e .[demos]``)."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..train.loop import History
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


def plot_curves(path: Path, history: History, eval_keys: list[str], title: str) -> None:
    """Training loss per update (left) and evaluation metrics (right) to a PNG."""
    if not is_main():
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    losses = np.asarray(history.losses)
    left.plot(history.updates, losses, alpha=0.3, label="loss per update")
    if len(losses) >= 20:
        window = max(len(losses) // 50, 5)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        left.plot(history.updates[window - 1:], smooth, label=f"mean of {window}")
    left.set_xlabel("update")
    left.set_ylabel("training loss")
    left.legend()
    for key in eval_keys:
        points = [(e["update"], e[key]) for e in history.evals if key in e]
        if points:
            xs, ys = zip(*points)
            right.plot(xs, ys, marker="o", label=key)
    right.set_xlabel("update")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
