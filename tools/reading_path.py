"""Count what a student reads from a demo to the first formula of the attention, forward
and backward, in both tiers.

    python tools/reading_path.py                 # demos/imdb.py -> the attention, both tiers
    python tools/reading_path.py --backward      # the update's paths only: -> attention_backward
    python tools/reading_path.py --tier textbook # one tier (textbook or fast)
    python tools/reading_path.py --nanogpt DIR   # the same count on nanoGPT's train.py/model.py

A path is a list of stops, each a definition (a function or a method) the reader opens by
go-to-definition from the stop before, and the line in it that leads on: the path the
demo runs (``python demos/imdb.py --tier textbook`` for the textbook's; for the fast
tier's, ``--procs 1 --replicas 1``: by default it runs on MPI ranks or thread replicas, and
the step reaches its task through :mod:`npformer.parallel`), which is also the Python
stack a debugger shows at the formula, from the demo's ``main`` down
(``tests/test_reading_path.py`` records that stack).  The block's
branch is the one the demo's config takes: ``norm_first`` of ``demos/imdb.py``'s model
config, read here, picks the pre-norm or the post-norm lines.  The script checks every stop
against the code (the definition exists and holds that line; the last stop's line is the
formula) and prints two counts of the lines read:

    files: distinct files opened        hops: go-to-definition jumps into another file
    definitions: the lines of each stop's definition, from its first line to the line
        that leads on (a reader who jumps straight to the definition)
    from the top: the lines of each file from its first line to the last line that leads
        on in it (a reader who opens a file and reads it down to where it leads on)

Exits 1 if a stop no longer matches the code (the path must be updated with it), or if
the demo's block branch is not the one the paths read.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (file, definition "Class.method" or "function", the text on the line that leads on).
# The block's lines for each branch of its norm_first (imdb's config: post-norm).
TEXTBOOK_BLOCK = {
    False: ("npformer/nn/blocks.py", "EncoderBlock.forward",
            "x = a.norm(x + a.dropout(self._attention(self.self_attn, x, mask=mask"),
    True: ("npformer/nn/blocks.py", "EncoderBlock.forward",
           "self._attention(self.self_attn, a.norm(x)"),
}
TEXTBOOK_BLOCK_BACKWARD = {
    False: ("npformer/nn/blocks.py", "EncoderBlock.backward",
            "return dz + self.self_attn.backward("),
    True: ("npformer/nn/blocks.py", "EncoderBlock.backward",
           "a.norm.backward(self.self_attn.backward("),
}
FAST_BLOCK = ("npformer/fast/blocks.py", "EncoderBlock.forward",
              "return super().forward(x, mask, kv_cache)")


def textbook_path(norm_first: bool) -> list:
    """demos/imdb.py --tier textbook: the model's forward down to the attention's formula."""
    return [
        ("demos/imdb.py", "train_member", "implementations(args.tier)[0](config)"),
        ("demos/imdb.py", "implementations", "return TransformerClassifier, AdamW"),
        ("npformer/models/classifier.py", "TransformerClassifier.forward", "x = block(x, mask)"),
        TEXTBOOK_BLOCK[norm_first],
        ("npformer/nn/blocks.py", "EncoderBlock._attention", "return layer(x, *args, **kwargs)"),
        ("npformer/nn/attention.py", "MultiHeadAttention.forward", "ops.attention_forward("),
        ("npformer/ops/attention.py", "attention_forward", "softmax_forward(scaled_scores(q, k)"),
    ]


def update_path() -> list:
    """One update, from the demo's fit() to the model's backward (one process: the step
    runs the task itself); the same in both tiers."""
    return [
        ("demos/imdb.py", "train_member", "trainer.fit()"),
        ("npformer/train/loop.py", "Trainer.fit", "self._record_update(cfg, self.update())"),
        ("npformer/train/loop.py", "Trainer.update", "return self._eager_update()"),
        ("npformer/train/loop.py", "Trainer._eager_update",
         "self.task.loss_and_grad(self.model, batch, scale)"),
        ("npformer/train/tasks.py", "Task.loss_and_grad",
         "self.loss_and_grad_on_device(model, batch, grad_scale)"),
        ("npformer/train/tasks.py", "Classification.loss_and_grad_on_device",
         "return cross_entropy_and_backward(model, logits, labels, grad_scale)"),
        ("npformer/train/tasks.py", "cross_entropy_and_backward", "model.backward(dlogits)"),
    ]


def textbook_backward_path(norm_first: bool) -> list:
    return update_path() + [
        ("npformer/models/classifier.py", "TransformerClassifier.backward",
         "dx = block.backward(dx)"),
        TEXTBOOK_BLOCK_BACKWARD[norm_first],
        ("npformer/nn/attention.py", "MultiHeadAttention.backward", "ops.attention_backward("),
        ("npformer/ops/attention.py", "attention_backward", "dscores = softmax_backward(dp"),
    ]


def fast_path(norm_first: bool) -> list:
    """demos/imdb.py (the fast tier, its default tier): the valid positions packed as rows,
    the attention in blocks of scores."""
    return [
        ("demos/imdb.py", "train_member", "implementations(args.tier)[0](config)"),
        ("demos/imdb.py", "implementations", "return fast.TransformerClassifier, fast.AdamW"),
        ("npformer/fast/models.py", "TransformerClassifier.forward",
         "x = packed_blocks(self._embedded(ids), self.blocks"),
        ("npformer/fast/models.py", "packed_blocks", "x = block(x, mask, packing=packing)"),
        FAST_BLOCK,
        TEXTBOOK_BLOCK[norm_first],
        ("npformer/fast/blocks.py", "EncoderBlock._attention",
         "return layer(x, *args, packing=self._packing"),
        ("npformer/fast/blocks.py", "MultiHeadAttention.forward",
         "self.ops.attention_forward(q, k, v, mask)"),
        ("npformer/fast/attention.py", "attention_forward", "scores = q[rows] @ k[keys].mT"),
    ]


def fast_backward_path(norm_first: bool) -> list:
    return update_path() + [
        ("npformer/fast/models.py", "TransformerClassifier.backward",
         "self._embedded_backward(packed_blocks_backward(dx, self.blocks"),
        ("npformer/fast/models.py", "packed_blocks_backward", "dx = block.backward(dx)"),
        TEXTBOOK_BLOCK_BACKWARD[norm_first],
        ("npformer/fast/blocks.py", "MultiHeadAttention.backward",
         "self.ops.attention_backward(dheads, attention_saved)"),
        ("npformer/fast/attention.py", "attention_backward", "dv[keys] += p.mT @ dout[rows]"),
    ]


NANOGPT_BACKWARD_PATH = [  # autograd: the backward is one call
    ("train.py", None, "scaler.scale(loss).backward()"),
]
NANOGPT_PATH = [
    ("train.py", None, "model = GPT(gptconf)"),
    ("model.py", "GPT.forward", "x = block(x)"),
    ("model.py", "Block.forward", "x = x + self.attn(self.ln_1(x))"),
    ("model.py", "CausalSelfAttention.forward", "att = (q @ k.transpose(-2, -1))"),
]


def demo_norm_first() -> bool:
    """norm_first of the model demos/imdb.py trains (its default preset's config)."""
    spec = importlib.util.spec_from_file_location("reading_path_imdb", ROOT / "demos" / "imdb.py")
    demo = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = demo  # dataclasses look their module up
    spec.loader.exec_module(demo)
    return bool(demo.model_config(demo.PRESETS["default"], vocab_size=100, pad_id=0).norm_first)


def definition(tree: ast.Module, qualname: str) -> ast.AST:
    """The function or method ``qualname`` ("Class.method" or "function") of a module."""
    node: ast.AST = tree
    for part in qualname.split("."):
        found = [child for child in ast.iter_child_nodes(node)
                 if isinstance(child, (ast.FunctionDef, ast.ClassDef)) and child.name == part]
        if not found:
            raise LookupError(f"no definition {qualname!r}")
        node = found[0]
    return node


def lines_read(source: str, qualname: str | None, leads_on: str) -> tuple[int, int]:
    """(first, last) line read of a stop: the definition's first line (the file's first
    for module-level code) to the first line holding ``leads_on`` inside it."""
    lines = source.splitlines()
    if qualname is None:
        first, end = 1, len(lines)
    else:
        node = definition(ast.parse(source), qualname)
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        end = node.end_lineno
    for number in range(first, end + 1):
        if leads_on in lines[number - 1]:
            return first, number
    raise LookupError(f"{qualname or 'the module'} holds no line with {leads_on!r}")


def count(root: Path, path: list, title: str) -> int:
    print(title)
    definitions, reached = 0, {}  # reached: file -> the last line read in it
    for file, qualname, leads_on in path:
        try:
            first, last = lines_read((root / file).read_text(), qualname, leads_on)
        except (OSError, LookupError) as exc:
            print(f"error: {file}: {exc}: the path no longer matches the code", file=sys.stderr)
            return 1
        definitions += last - first + 1
        reached[file] = max(reached.get(file, 0), last)
        print(f"  {file}:{first}-{last}  {qualname or '(module)'}  -> {leads_on}")
    hops = sum(1 for (a, *_), (b, *_) in zip(path, path[1:]) if a != b)
    print(f"files: {len(reached)}, hops: {hops}, lines: {definitions} in the definitions, "
          f"{sum(reached.values())} from the top of each file")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, metavar="DIR",
                        help="count nanoGPT's path instead (its train.py and model.py in DIR)")
    parser.add_argument("--backward", action="store_true",
                        help="the update's paths only, from fit() to the attention's backward")
    parser.add_argument("--tier", choices=("textbook", "fast"),
                        help="one tier's paths (default: both)")
    args = parser.parse_args(argv)
    if args.nanogpt:
        paths = [] if args.backward else [("nanoGPT, forward", NANOGPT_PATH)]
        paths.append(("nanoGPT, backward", NANOGPT_BACKWARD_PATH))
        return max(count(args.nanogpt, path, title) for title, path in paths)
    try:
        norm_first = demo_norm_first()
    except Exception as exc:  # the demo must import for its config to be read
        print(f"error: demos/imdb.py: {type(exc).__name__}: {exc}: its model config could not "
              "be read", file=sys.stderr)
        return 1
    branch = "pre-norm" if norm_first else "post-norm"
    paths = []
    for tier, forward, backward in (("textbook", textbook_path, textbook_backward_path),
                                    ("fast", fast_path, fast_backward_path)):
        if args.tier in (None, tier):
            command = "python demos/imdb.py " + ("--tier textbook" if tier == "textbook" else
                                                 "--procs 1 --replicas 1")
            if not args.backward:
                paths.append((f"{tier} tier, forward ({command}; its blocks {branch})",
                              forward(norm_first)))
            paths.append((f"{tier} tier, backward ({command}; one update)", backward(norm_first)))
    status = 0
    for title, path in paths:
        status = max(status, count(ROOT, path, title))
    # the other branch's lines, kept true for the other demos
    for file, qualname, leads_on in (TEXTBOOK_BLOCK[not norm_first],
                                     TEXTBOOK_BLOCK_BACKWARD[not norm_first]):
        try:
            lines_read((ROOT / file).read_text(), qualname, leads_on)
        except (OSError, LookupError) as exc:
            print(f"error: {file}: {exc}: the path no longer matches the code", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
