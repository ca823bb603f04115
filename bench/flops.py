"""The floating-point work of one step of a benchmark configuration, counted from the
configuration alone: the matrix products of one forward, 2·m·k·n each (a multiply and
an add per term), the formula bench/README.md writes out ("FLOPs and the share of the
peak").

What counts: per block the q, k, v and output projections, the attention's scores
(Q K^T) and weighted values (P V), dense as they are computed (a causal mask hides half
the scores but they are still computed), the feed-forward's two products; the output
projection over the vocabulary (the lm's tied head) and the classifier's head.  Element-wise
work (norms, softmax, activations, the loss, the optimizer) and embedding look-ups are
not products and are not counted.  A training step is 3x the forward's products: each
product has two of the same size in the backward (the input's gradient and the
weight's), the convention of PaLM's model FLOPs utilisation and PyTorch's FLOP counter.

The count is the same for every side: it is the model's work, not any one library's.
The blocks run over the padded batch (B x T positions), so a side that packs padding
out (npformer's fast tier on imdb and seq2seq) does less than counted, and its share of
the peak is an effective one.  The seq2seq logits are the exception the demo makes: its
update (``Translation``, ``valid_only``) computes them at the valid target positions only,
so a training step counts those; its inference (the bench's forward) computes them at
every position.
"""
from __future__ import annotations

from dataclasses import dataclass

from bench.configs import SEED, make_batch

TRAIN_FACTOR = 3  # forward + the two backward products of each forward product


@dataclass(frozen=True)
class Product:
    """``count`` products of an (m, k) matrix by a (k, n) one."""

    name: str
    m: int
    k: int
    n: int
    count: int = 1
    per_head: bool = False  # attention's batched products, one (sequence, head) each

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n * self.count


def attention(prefix: str, batch: int, heads: int, width: int, queries: int, keys: int,
              layers: int, cross: bool = False) -> list[Product]:
    """One attention of ``layers`` blocks on ``batch`` sequences: ``queries`` positions
    attend to ``keys`` (the source's, ``cross``: k and v projected from it)."""
    head = width // heads
    q_rows, k_rows = batch * queries, batch * keys
    projections = ([Product(f"{prefix} q", q_rows, width, width, layers),
                    Product(f"{prefix} k, v", k_rows, width, 2 * width, layers)] if cross
                   else [Product(f"{prefix} q, k, v", q_rows, width, 3 * width, layers)])
    pairs = batch * heads * layers
    return projections + [
        Product(f"{prefix} scores QK^T", queries, head, keys, pairs, per_head=True),
        Product(f"{prefix} weighted values PV", queries, keys, head, pairs, per_head=True),
        Product(f"{prefix} output", q_rows, width, width, layers)]


def feed_forward(prefix: str, rows: int, width: int, hidden: int, layers: int) -> list[Product]:
    return [Product(f"{prefix} FFN in", rows, width, hidden, layers),
            Product(f"{prefix} FFN out", rows, hidden, width, layers)]


def valid_targets(cfg: dict) -> int:
    """The seq2seq batch's valid target positions (its tgt_lens summed: the batch every side
    trains on, ``make_batch(cfg, SEED + 1)``)."""
    return int(make_batch(cfg, SEED + 1)[4].sum())


def forward_products(cfg: dict, training: bool = False) -> list[Product]:
    """The matrix products of one forward of ``cfg`` on its batch; ``training``: the
    forward of the demo's update (seq2seq: logits at the valid targets only)."""
    kind, B, T, D = cfg["kind"], cfg["batch"], cfg["seq_len"], cfg["d_model"]
    H, F = cfg["num_heads"], cfg["d_ff"]
    if kind in ("classifier", "causal_lm"):
        L = cfg["num_layers"]
        blocks = attention("self", B, H, D, T, T, L) + feed_forward("", B * T, D, F, L)
        if kind == "classifier":
            return blocks + [Product("classifier head", B, D, cfg["num_classes"])]
        return blocks + [Product("logits", B * T, D, cfg["vocab_size"])]
    if kind != "seq2seq":
        raise ValueError(f"cfg['kind'] must be classifier, causal_lm or seq2seq, got {kind!r}")
    S, Le, Ld = cfg["src_len"], cfg["num_encoder_layers"], cfg["num_decoder_layers"]
    logit_rows = valid_targets(cfg) if training else B * T
    return (attention("encoder self", B, H, D, S, S, Le)
            + feed_forward("encoder", B * S, D, F, Le)
            + attention("decoder self", B, H, D, T, T, Ld)
            + attention("decoder cross", B, H, D, T, S, Ld, cross=True)
            + feed_forward("decoder", B * T, D, F, Ld)
            + [Product("logits", logit_rows, D, cfg["tgt_vocab_size"])])


def forward_flops(cfg: dict, training: bool = False) -> int:
    return sum(p.flops for p in forward_products(cfg, training))


def step_flops(cfg: dict) -> dict:
    """{"train": FLOPs of one training step (3x its forward), "infer": of one forward}."""
    return {"train": TRAIN_FACTOR * forward_flops(cfg, training=True),
            "infer": forward_flops(cfg)}


def layer_shapes(cfg: dict) -> list[tuple[int, int, int]]:
    """The distinct (m, k, n) of ``cfg``'s projections, feed-forward and heads (not the
    per-head attention products): the shapes the peak is also measured on."""
    shapes = {(p.m, p.k, p.n) for training in (False, True)
              for p in forward_products(cfg, training) if not p.per_head}
    return sorted(shapes)


def share_of_peak(flops: float, seconds: float, peak_gflops: float) -> float:
    """The fraction of the peak a step of ``flops`` in ``seconds`` ran at."""
    if seconds <= 0 or peak_gflops <= 0:
        raise ValueError(f"seconds and peak_gflops must be positive, got {seconds} and "
                         f"{peak_gflops}")
    return flops / seconds / (peak_gflops * 1e9)
