"""What the demo scripts share: common options, set-up, plots and reports.

The demos stay thin: they parse arguments, call the package, and print.
matplotlib is imported only when a plot is drawn (``pip install -e .[demos]``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from . import backend


def add_common_args(parser: argparse.ArgumentParser, out_default: str) -> None:
    parser.add_argument("--data", default=None,
                        help="dataset file or folder (default: $NPFORMER_DATA, then the user "
                             "cache, downloading there if needed)")
    parser.add_argument("--out", default=out_default,
                        help="folder for the checkpoint, plots and metrics (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--backend", choices=["numpy", "cupy"], default="numpy",
                        help="array backend: numpy (CPU) or cupy (GPU)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="float dtype of parameters and activations (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true",
                        help="a few seconds on a tiny subset: checks the whole pipeline runs")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--replicas", type=int, default=None,
                        help="data-parallel replicas, one thread each, single-threaded BLAS "
                             "(default: one per CPU core with numpy, 1 with cupy)")


def setup(args) -> Path:
    """Apply --backend, --dtype and --seed; create and return the output folder."""
    backend.set_backend(args.backend, seed=args.seed)
    backend.set_default_float(args.dtype)
    if args.replicas is None:
        args.replicas = (os.cpu_count() or 1) if args.backend == "numpy" else 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def machine_description() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, backend {backend.backend_name()}"


class Stopwatch:
    def __init__(self):
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def write_json(path: Path, values: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(values, indent=2))
    os.replace(tmp, path)


def plot_curves(path: Path, history, eval_keys: list[str], title: str) -> None:
    """Training loss per step (left) and evaluation metrics (right) to a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    losses = np.asarray(history.losses)
    left.plot(history.steps, losses, alpha=0.3, label="loss per step")
    if len(losses) >= 20:
        window = max(len(losses) // 50, 5)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        left.plot(history.steps[window - 1:], smooth, label=f"mean of {window}")
    left.set_xlabel("step")
    left.set_ylabel("training loss")
    left.legend()
    for key in eval_keys:
        points = [(e["step"], e[key]) for e in history.evals if key in e]
        if points:
            xs, ys = zip(*points)
            right.plot(xs, ys, marker="o", label=key)
    right.set_xlabel("step")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_attention(path: Path, weights: np.ndarray, query_tokens: list[str],
                   key_tokens: list[str], title: str) -> None:
    """A (T, S) attention matrix as a heat-map with token labels."""
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


def run_demo(main) -> int:
    """Run a demo's ``main``; expected failures become one clear line and exit status 2."""
    from .checkpoint import CheckpointError
    from .data import DatasetFormatError, DatasetNotFoundError
    from .train import TrainingDiverged

    try:
        return main()
    except (DatasetNotFoundError, DatasetFormatError, CheckpointError, TrainingDiverged) as exc:
        import sys

        print(f"error: {exc}", file=sys.stderr)
        return 2
