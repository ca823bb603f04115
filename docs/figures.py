"""Draw the figures of docs/derivations.md into docs/figures/ (deterministic SVG).

    python docs/figures.py            # rewrites docs/figures/*.svg
    python docs/figures.py OUT_DIR    # writes them elsewhere (the test does)

attention_graph.svg  the attention forward (§9) as a computation graph, with the backward's
                     gradients flowing the other way
block_tiling.svg     the score matrix of a padded, causal batch cut into blocks of query rows,
                     with each block's cut-off keys (§18)
packing.svg          a padded batch's valid positions gathered as rows and scattered back,
                     zeros at padding (§22)
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

FIGURES = Path(__file__).resolve().parent / "figures"
FORWARD, BACKWARD = "black", "#c0392b"


def _deterministic() -> None:
    """Same bytes on every run: fixed ids, no date, text as paths."""
    plt.rcParams.update({"svg.hashsalt": "npformer", "svg.fonttype": "path",
                         "font.family": "DejaVu Sans", "font.size": 10})


def _node(ax, x, y, text, width=1.5, color="#eef3fb"):
    ax.add_patch(FancyBboxPatch((x - width / 2, y - 0.3), width, 0.6,
                                boxstyle="round,pad=0.05", fc=color, ec="#34495e"))
    ax.text(x, y, text, ha="center", va="center")


def _arrow(ax, start, end, color, text=None, side=1, rad=0.0):
    """An arrow from start to end; its label sits on the arrow: centred on its middle, turned
    to its direction, just beside it (``side`` 1: to the left of the direction of travel,
    -1: to the right), so each label reads along the edge it names."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color=color,
                                 connectionstyle=f"arc3,rad={rad}", lw=1.3, shrinkA=0, shrinkB=0))
    if not text:
        return
    (x0, y0), (x1, y1) = start, end
    dx, dy = x1 - x0, y1 - y0
    length = math.hypot(dx, dy)
    nx, ny = -dy / length, dx / length  # the left normal of the direction of travel
    bulge = -rad * length / 2  # an arc3 edge's middle lies this far along the left normal
    gap = side * 0.3
    x, y = x0 + dx / 2 + nx * (bulge + gap), y0 + dy / 2 + ny * (bulge + gap)
    angle = math.degrees(math.atan2(dy, dx))
    if angle > 90 or angle < -90:  # keep the text upright
        angle -= 180 if angle > 0 else -180
    ax.text(x, y, text, ha="center", va="center", color=color, fontsize=9, rotation=angle,
            rotation_mode="anchor")


def _edge(ax, start, end, backward_label, side=1, offset=0.12, forward_label=None):
    """A forward arrow start -> end (black) and, beside it, the backward arrow end -> start
    (red) carrying ``backward_label``; ``side`` picks the side the red arrow runs on."""
    (x0, y0), (x1, y1) = start, end
    length = math.hypot(x1 - x0, y1 - y0)
    nx, ny = -(y1 - y0) / length * offset * side, (x1 - x0) / length * offset * side
    _arrow(ax, (x0 - nx, y0 - ny), (x1 - nx, y1 - ny), FORWARD, forward_label, side=-side)
    if backward_label is not None:
        _arrow(ax, (x1 + nx, y1 + ny), (x0 + nx, y0 + ny), BACKWARD, backward_label, side=-side)


def attention_graph(path: Path) -> None:
    """Q, K -> A = alpha Q K^T + M -> P = softmax(A) -> O = P V <- V, and the gradients back,
    each gradient written on the red arrow that carries it."""
    fig, ax = plt.subplots(figsize=(13.0, 5.2))
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 6.2)
    ax.set_aspect("equal")
    ax.axis("off")
    q, k, m = (1.1, 5.2), (1.1, 3.2), (1.1, 1.2)
    a, p, o, v = (5.0, 3.2), (10.2, 3.2), (14.0, 3.2), (10.2, 0.9)
    _node(ax, *q, r"$Q$  (T, E)")
    _node(ax, *k, r"$K$  (S, E)")
    _node(ax, *m, r"mask $\to M$", color="#f4f4f4")
    _node(ax, *a, r"$A = \alpha QK^\top + M$", width=2.3)
    _node(ax, *p, r"$P = \mathrm{softmax}(A)$", width=2.3)
    _node(ax, *o, r"$O = PV$  (T, F)", width=2.0)
    _node(ax, *v, r"$V$  (S, F)")
    # each edge: the forward arrow (black) and the backward one beside it (red), labelled
    _edge(ax, (1.9, 4.95), (4.0, 3.55), r"$\bar Q = \alpha \bar A K$")
    _edge(ax, (1.9, 3.2), (3.75, 3.2), r"$\bar K = \alpha \bar A^\top Q$")
    _edge(ax, (1.9, 1.45), (4.0, 2.85), None, forward_label="+ M (no gradient)")
    _edge(ax, (6.25, 3.2), (8.95, 3.2),
          r"$\bar A = P \odot (\bar P - \mathrm{rowsum}(\bar P \odot P))$")
    _edge(ax, (11.45, 3.2), (12.9, 3.2), r"$\bar P = \bar O V^\top$")
    _edge(ax, (11.0, 1.15), (13.3, 2.85), r"$\bar V = P^\top \bar O$", side=-1)
    ax.text(0.2, 0.05, "black: forward (§9).  red: backward, from " r"$\bar O$"
            " right to left; each gradient is written on the arrow that carries it.  "
            "The mask bias M is a constant: no gradient.", fontsize=9, color="#555555")
    fig.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


def block_tiling(path: Path) -> None:
    """Scores of 2 sequences (valid lengths 6 and 4 of T = S = 8) under a causal + padding mask,
    cut into blocks of 4 query rows; each block keeps only keys up to the last one it may see."""
    T = S = 8
    lengths = (6, 4)
    block_rows = 4
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 4.8))
    for b, (ax, valid) in enumerate(zip(axes, lengths)):
        ax.set_xlim(0, S)
        ax.set_ylim(T, 0)
        ax.set_aspect("equal")
        ax.set_xticks(range(S + 1))
        ax.set_yticks(range(T + 1))
        ax.tick_params(labelsize=8)
        ax.set_xlabel("key s")
        ax.set_ylabel("query t")
        ax.set_title(f"sequence {b}: valid length {valid}", fontsize=10)
        for t in range(T):
            for s in range(S):
                allowed = s <= t and s < valid
                ax.add_patch(Rectangle((s, t), 1, 1, fc="#5b8cc8" if allowed else "white",
                                       ec="#cccccc", lw=0.5))
        for start in range(0, T, block_rows):
            seen = max([s + 1 for t in range(start, start + block_rows) for s in range(S)
                        if s <= t and s < valid] or [1])
            ax.add_patch(Rectangle((seen, start), S - seen, block_rows, fc="#999999",
                                   alpha=0.35, ec="none", hatch="//"))
            ax.add_patch(Rectangle((0, start), seen, block_rows, fill=False, ec="#c0392b", lw=2))
            ax.text(seen - 0.1, start + 0.45, f"{seen} keys", ha="right", va="center",
                    fontsize=8, color="#c0392b")
    fig.text(0.5, -0.04, "blue: allowed (causal and padding mask).  "
             "red boxes: blocks of query rows, each with the keys it keeps.  "
             "grey hatch: cut-off keys (masked for every query of the block).",
             ha="center", fontsize=8.5, wrap=True)
    fig.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


def packing(path: Path) -> None:
    """A padded batch (B = 3, T = 6, valid lengths 4, 2, 5), flattened to its BT = 18 positions:
    pack gathers the N = 11 valid ones, in order of their flat position bT + t, as rows; unpack
    scatters the rows back, zeros at padding."""
    lengths, T = (4, 2, 5), 6
    index = [b * T + t for b, n in enumerate(lengths) for t in range(n)]  # flat positions
    fig, ax = plt.subplots(figsize=(11.0, 4.6))
    ax.set_xlim(-0.2, 25.0)
    ax.set_ylim(-1.2, 8.6)
    ax.set_aspect("equal")
    ax.axis("off")
    top, middle, bottom = 6.0, 3.0, 0.0  # y of the three strips' lower edges
    shift = (len(lengths) * T - len(index)) / 2  # centre the packed rows under the batch

    def strip(y, label, zeros):
        for flat in range(len(lengths) * T):
            b, t = divmod(flat, T)
            valid = t < lengths[b]
            ax.add_patch(Rectangle((flat, y), 1, 1, ec="#555555", lw=0.6,
                                   fc="#5b8cc8" if valid else ("white" if zeros else "#dddddd"),
                                   hatch=None if valid or zeros else "//"))
            text = f"{flat}" if valid else ("0" if zeros else "pad")
            ax.text(flat + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7.5,
                    color="white" if valid else "#555555")
        for b in range(1, len(lengths)):  # where one sequence ends and the next begins
            ax.plot([b * T, b * T], [y - 0.15, y + 1.15], color="black", lw=1.6)
        ax.text(len(lengths) * T + 0.4, y + 0.5, label, va="center", fontsize=9)

    strip(top, "X: the padded batch, flattened\n(BT, D)", zeros=False)
    for b, n in enumerate(lengths):
        ax.text(b * T + T / 2, top + 1.35, f"sequence b = {b}, $T_b$ = {n}", ha="center",
                fontsize=8.5)
    strip(bottom, "unpack(R) = $G^\\top R$\n(BT, D), 0 at padding", zeros=True)
    for n, flat in enumerate(index):
        x = shift + n
        ax.add_patch(Rectangle((x, middle), 1, 1, fc="#5b8cc8", ec="#555555", lw=0.6))
        ax.text(x + 0.5, middle + 0.5, f"{flat}", ha="center", va="center", fontsize=7.5,
                color="white")
        for start, end in (((flat + 0.5, top), (x + 0.5, middle + 1.0)),
                           ((x + 0.5, middle), (flat + 0.5, bottom + 1.0))):
            ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=7, lw=0.6,
                                         color="#888888", shrinkA=1, shrinkB=1))
    right = len(lengths) * T + 0.4  # the labels' column, clear of the arrows
    ax.text(right, middle + 0.5, "R = pack(X) = GX: the valid rows\n(N, D), N = 11", va="center",
            fontsize=9)
    ax.text(right, (top + middle + 1) / 2, "pack: gather the rows at index\n(its backward: unpack)",
            ha="left", va="center", fontsize=8.5, color="#c0392b")
    ax.text(right, (middle + bottom + 1) / 2, "unpack: scatter them back\n(its backward: pack)",
            ha="left", va="center", fontsize=8.5, color="#c0392b")
    ax.text(0, -0.9, "each number is a position's flat index bT + t; index lists the valid ones in "
            "increasing order, and row n of R is position index[n]", fontsize=8.5, color="#555555")
    fig.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


def main(out_dir: Path = FIGURES) -> list[Path]:
    _deterministic()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "attention_graph.svg", out_dir / "block_tiling.svg",
             out_dir / "packing.svg"]
    attention_graph(paths[0])
    block_tiling(paths[1])
    packing(paths[2])
    return paths


if __name__ == "__main__":
    for written in main(Path(sys.argv[1]) if len(sys.argv) > 1 else FIGURES):
        print(written)
