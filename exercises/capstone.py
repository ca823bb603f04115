"""The capstone: your backwards train the IMDB classifier, update for update as the textbook.

    python exercises/capstone.py                  # IMDB (--data, $NPFORMER_DATA, the saved values)
    python exercises/capstone.py --data PATH      # aclImdb_v1.tar.gz, or a folder holding it
    python exercises/capstone.py --textbook       # npformer's backwards in place of yours

npformer's TransformerClassifier calls its ops through ``npformer.ops`` (``ops.linear_forward``,
``ops.attention_backward``...).  Here each op the classifier's training uses is replaced by
your forward and backward from the exercise files (their tuple caches wrapped in the
``Saved`` the layers keep), and AdamW's update by your ``adam_step``: linear, ReLU,
dropout, layer norm, attention, embedding, positions, pooling, cross-entropy, Adam.  Then
the demo's smoke configuration (``python demos/imdb.py --smoke --tier textbook``: its
preset, data, vocabulary, model, AdamW with warmup and cosine decay, clipping at 1.0) is
trained twice on a fixed seed, in float64, one process and one replica: once with the
textbook's ops and once with yours, and the two loss curves are compared update by update.
They must agree to float64 rounding; where they do not, the first update that differs is
reported.  (Splitting and merging the heads are reshapes inside the attention layer, not
ops it calls: they stay the textbook's.)

It runs once every exercise it needs is started; ``python exercises/check.py`` says which
are done.  From Python: ``curves(prepare(data), modules={"linear": my_module})``.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: the exercises and the demo by their paths
    sys.path.insert(0, str(ROOT))

# The exercises whose functions the classifier's training runs, with those functions.
NEEDED = {
    "linear": ("linear_forward", "linear_backward"),
    "relu": ("relu_forward", "relu_backward"),
    "dropout": ("dropout_forward", "dropout_backward"),
    "layernorm": ("layernorm_forward", "layernorm_backward"),
    "attention": ("attention_forward", "attention_backward"),
    "embedding": ("embedding_forward", "embedding_backward"),
    "positions": ("add_positions_forward", "add_positions_backward"),
    "pooling": ("pool_forward", "pool_backward"),
    "cross_entropy": ("cross_entropy_forward", "cross_entropy_backward"),
    "adam": ("adam_init", "adam_step"),
}
RELATIVE = 1e-9  # float64 rounding, grown over a few updates: a wrong backward is ~1e-2


# =========================================================================== your ops
def reader_functions(modules: dict | None = None) -> dict[str, Any]:
    """{exercise: its functions}: ``modules[name]`` where given (any object with the
    exercise's function names; those it lacks come from the file), else the file."""
    from exercises import check as course

    modules = modules or {}
    found = {}
    for name in NEEDED:
        exercise = course.exercises()[name]
        fallback = course.load_file(exercise)
        found[name] = fallback if name not in modules else course._Overlay(modules[name],
                                                                           fallback)
    return found


def statuses(modules: dict | None = None) -> dict[str, Any]:
    """{exercise: the checker's Report} of every exercise the capstone needs (edge cases
    only: a quick look)."""
    from exercises import check as course

    modules = modules or {}
    return {name: course.check(name, modules.get(name), examples=0) for name in NEEDED}


def _cache(op: str, y, saved):
    from npformer.ops.contracts import Saved

    return Saved(op, "exercise", tuple(getattr(y, "shape", ())), getattr(y, "dtype", None), saved)


def _ops(r: dict[str, Any]) -> dict[str, Any]:
    """npformer.ops' functions the classifier calls, as adapters around your functions."""
    lin, act, drop, norm = r["linear"], r["relu"], r["dropout"], r["layernorm"]
    att, emb, pos, pool, ce = (r["attention"], r["embedding"], r["positions"], r["pooling"],
                               r["cross_entropy"])

    def linear_forward(x, w, b=None):
        bias = np.zeros(w.shape[1], dtype=w.dtype) if b is None else b
        y, c = lin.linear_forward(x, w, bias)
        return y, _cache("linear_forward", y, (c, b is None))

    def linear_backward(dy, saved, weights=True):
        c, no_bias = saved.values
        dx, dw, db = lin.linear_backward(dy, c)
        return dx, dw, None if no_bias else db

    def relu_forward(x):
        y, c = act.relu_forward(x)
        return y, _cache("relu_forward", y, c)

    def relu_backward(dy, saved):
        return act.relu_backward(dy, saved.values)

    def activation(name, *args, **kwargs):
        if name != "relu":
            raise NotImplementedError(f"the capstone trains with ReLU, not {name}")
        return relu_forward, relu_backward

    def dropout_forward(x, p, training=True):
        y, c = drop.dropout_forward(x, p, training)
        return y, _cache("dropout_forward", y, c)

    def dropout_backward(dy, saved):
        return drop.dropout_backward(dy, saved.values)

    def layernorm_forward(x, gamma, beta, eps=1e-5):
        y, c = norm.layernorm_forward(x, gamma, beta, eps)
        return y, _cache("layernorm_forward", y, c)

    def layernorm_backward(dy, saved):
        return norm.layernorm_backward(dy, saved.values)

    def attention_forward(q, k, v, mask=None):
        y, c = att.attention_forward(q, k, v, mask)
        return y, _cache("attention_forward", y, c)

    def attention_backward(dout, saved):
        return att.attention_backward(dout, saved.values)

    def embedding_forward(ids, table):
        y, c = emb.embedding_forward(ids, table)
        return y, _cache("embedding_forward", y, c)

    def embedding_backward(dy, saved):
        return emb.embedding_backward(dy, saved.values)

    def add_positions_forward(x, table):
        y, c = pos.add_positions_forward(x, table)
        return y, _cache("add_positions_forward", y, c)

    def add_positions_backward(dy, saved):
        return pos.add_positions_backward(dy, saved.values)

    def pool_forward(h, valid_lens, how="mean"):
        y, c = pool.pool_forward(h, valid_lens, how)
        return y, _cache("pool_forward", y, c)

    def pool_backward(dy, saved):
        return pool.pool_backward(dy, saved.values)

    def cross_entropy_with_gradient(logits, targets, dloss=1.0, **options):
        loss, c = ce.cross_entropy_forward(logits, targets, **options)
        return np.asarray(loss), ce.cross_entropy_backward(np.asarray(dloss), c)

    return {f.__name__: f for f in (
        linear_forward, linear_backward, activation, dropout_forward, dropout_backward,
        layernorm_forward, layernorm_backward, attention_forward, attention_backward,
        embedding_forward, embedding_backward, add_positions_forward, add_positions_backward,
        pool_forward, pool_backward, cross_entropy_with_gradient)}


@contextmanager
def your_ops(functions: dict[str, Any]) -> Iterator[None]:
    """npformer.ops' functions replaced by the adapters of your functions, then restored."""
    from npformer import ops

    replaced = _ops(functions)
    before = {name: getattr(ops, name) for name in replaced}
    try:
        for name, function in replaced.items():
            setattr(ops, name, function)
        yield
    finally:
        for name, function in before.items():
            setattr(ops, name, function)


def your_adamw(adam: Any) -> type:
    """npformer.optim.AdamW whose update of each parameter is your ``adam_step`` (weight
    decay only where the parameter decays, as AdamW's)."""
    from npformer.optim import AdamW

    class YourAdamW(AdamW):
        def _update(self, p, g, state, t):
            m, v = state
            data, m, v = adam.adam_step(p.data, g, m, v, t, lr=self.lr, beta1=self.beta1,
                                        beta2=self.beta2, eps=self.eps,
                                        weight_decay=self.weight_decay if p.decay else 0.0)
            return data, (m, v)
    return YourAdamW


# =========================================================================== the run
def _demo():
    """demos/imdb.py as a module: its preset, data, vocabulary, model and batches."""
    name = "_npformer_demo_imdb"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "demos" / "imdb.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass
class Prepared:
    """The smoke run's data as the demo encodes it, read once for both runs."""

    demo: Any
    preset: Any
    config: Any
    train_ids: list
    train_y: np.ndarray
    seed: int
    data: Any = None  # as --data: the archive or its folder (None: the demo's default)


def prepare(data=None, seed: int = 0, preset: str = "smoke") -> Prepared:
    """The demo's ``--smoke`` data (``data``: as ``--data``; None: $NPFORMER_DATA or the
    user saved, as the demo reads it), vocabulary and encoded training reviews."""
    from npformer.data import Vocab, tokenize_imdb

    demo = _demo()
    chosen = demo.PRESETS[preset]
    args = SimpleNamespace(data=None if data is None else str(data), seed=seed,
                           validation_data=None, test_data=None, text_column="text",
                           label_column="label")
    train, _, _, labels = demo.load_data(chosen, args)
    vocab = Vocab.build([tokenize_imdb(t) for t, _ in train], min_freq=2,
                        max_size=chosen.vocab_size)
    train_ids, train_y = demo.encode_reviews(train, vocab, chosen.block_size,
                                             chosen.head_tokens)
    config = demo.model_config(chosen, len(vocab), vocab.pad_id, num_classes=len(labels))
    return Prepared(demo, chosen, config, train_ids, train_y, seed, data)


def curve(prepared: Prepared, functions: dict[str, Any] | None = None) -> list[float]:
    """The loss of every update of the demo's first member (seed ``prepared.seed``), in
    float64, with the textbook's ops (``functions`` None) or yours."""
    from npformer import backend
    from npformer.models import TransformerClassifier
    from npformer.optim import AdamW, warmup_cosine
    from npformer.train import TrainConfig, Trainer
    from npformer.train.tasks import Classification

    p, demo = prepared.preset, prepared.demo
    previous = backend.backend_name(), backend.default_float_name()
    backend.set_backend("numpy")
    backend.set_default_float("float64")
    try:
        with your_ops(functions) if functions is not None else _nothing():
            backend.seed(prepared.seed)  # the member's seed: weights, dropout, batch order
            model = TransformerClassifier(prepared.config)
            updates_per_epoch = int(np.ceil(len(prepared.train_ids) / p.batch_size))
            total = max(1, int(p.epochs * updates_per_epoch))
            warmup = min(p.warmup, max(1, total // 10))
            optimizer_class = AdamW if functions is None else your_adamw(functions["adam"])
            optimizer = optimizer_class(model.parameters(), lr=warmup_cosine(p.lr, warmup, total),
                                        weight_decay=p.weight_decay)
            trainer = Trainer(model, optimizer, Classification(),
                              demo.batch_stream(prepared.train_ids, prepared.train_y,
                                                p.batch_size, prepared.config.pad_id),
                              TrainConfig(max_iters=total, replicas=1, clip_norm=demo.CLIP_NORM,
                                          progress=False),
                              seed=prepared.seed)
            return [float(loss) for loss in trainer.fit().losses]
    finally:
        backend.set_backend(previous[0])
        backend.set_default_float(previous[1])


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def compare(textbook: list[float], yours: list[float]) -> tuple[bool, int | None, float]:
    """(equal to float64 rounding, the first update that differs or None, the largest
    relative difference)."""
    if len(textbook) != len(yours):
        return False, min(len(textbook), len(yours)) + 1, float("inf")
    worst, first = 0.0, None
    for update, (a, b) in enumerate(zip(textbook, yours), start=1):
        difference = abs(a - b) / max(abs(a), 1e-300) if np.isfinite(b) else float("inf")
        worst = max(worst, difference)
        if first is None and not difference <= RELATIVE:
            first = update
    return first is None, first, worst


def report(textbook: list[float], yours: list[float]) -> str:
    """The two curves side by side, and whether they agree."""
    equal, first, worst = compare(textbook, yours)
    lines = [f"{'update':>6}  {'textbook':>20}  {'yours':>20}  {'relative difference':>19}"]
    for update, (a, b) in enumerate(zip(textbook, yours), start=1):
        mark = "  <- first difference" if update == first else ""
        lines.append(f"{update:>6}  {a:>20.15f}  {b:>20.15f}  {abs(a - b) / abs(a):>19.1e}{mark}")
    if equal:
        lines.append(f"equal: the {len(textbook)} updates' losses agree to float64 rounding "
                     f"(largest relative difference {worst:.1e}, within {RELATIVE:.0e})")
    else:
        lines.append(f"different: the curves first differ at update {first} (relative "
                     f"difference above {RELATIVE:.0e}; largest {worst:.1e}); your backwards "
                     f"up to that update's loss are in question: python exercises/check.py")
    return "\n".join(lines)


def run(data=None, seed: int = 0, modules: dict | None = None,
        prepared: Prepared | None = None) -> tuple[str, bool | None]:
    """The capstone's text and its verdict (None: exercises not started)."""
    from exercises.check import DONE, NOT_STARTED

    found = statuses(modules)
    waiting = [name for name, r in found.items() if r.status == NOT_STARTED]
    if waiting:
        return (f"not started yet: {', '.join(waiting)}.  The capstone runs once every "
                f"exercise it needs is started: {', '.join(NEEDED)}; "
                f"python exercises/check.py says which are done."), None
    lines = []
    wrong = [name for name, r in found.items() if r.status != DONE]
    if wrong:
        lines.append(f"(the checker finds these wrong: {', '.join(wrong)}; the curves will "
                     f"likely differ)")
    prepared = prepared or prepare(data, seed)
    textbook = curve(prepared)
    yours = curve(prepared, reader_functions(modules))
    lines.append(f"IMDB, the demo's smoke configuration (seed {prepared.seed}, float64, one "
                 f"process, one replica): {len(textbook)} updates")
    lines.append(report(textbook, yours))
    return "\n".join(lines), compare(textbook, yours)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python exercises/capstone.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="aclImdb_v1.tar.gz or a folder holding it (default: "
                                       "$NPFORMER_DATA, then the user saved, as the demo)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    parser.add_argument("--textbook", action="store_true",
                        help="npformer's own forwards and backwards in place of yours (the "
                             "capstone's own check: the curves must be equal)")
    options = parser.parse_args(argv)
    modules = None
    if options.textbook:
        from exercises import check as course

        modules = {name: course.textbook(course.exercises()[name]) for name in NEEDED}
    text, verdict = run(options.data, options.seed, modules)
    print(text)
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
