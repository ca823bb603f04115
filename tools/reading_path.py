"""Count what a student reads from a demo to the first formula of the textbook attention,
forward and backward.

    python tools/reading_path.py                 # npformer: demos/imdb.py -> ops/attention.py
    python tools/reading_path.py --backward      # the update: imdb.py -> attention_backward
    python tools/reading_path.py --nanogpt DIR   # the same count on nanoGPT's train.py/model.py

A path is a list of stops, each a definition (a function or a method) the reader opens by
go-to-definition from the stop before, and the line in it that leads on.  The script
checks every stop against the code (the definition exists and holds that line; the last
stop's line is the formula) and prints two counts of the lines read:

    files: distinct files opened        hops: go-to-definition jumps into another file
    definitions: the lines of each stop's definition, from its first line to the line
        that leads on (a reader who jumps straight to the definition)
    from the top: the lines of each file from its first line to the last line that leads
        on in it (a reader who opens a file and reads it down to where it leads on)

Exits 1 if a stop no longer matches the code (the path must be updated with it).
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (file, definition "Class.method" or "function", the text on the line that leads on)
NPFORMER_PATH = [
    ("demos/imdb.py", "train_member", "implementations(args.tier)[0](config)"),
    ("demos/imdb.py", "implementations", "return TransformerClassifier, AdamW"),  # textbook
    ("npformer/models/classifier.py", "TransformerClassifier.forward", "x = block(x, mask)"),
    ("npformer/nn/blocks.py", "EncoderBlock.forward", "self.self_attn(a.norm(x)"),
    ("npformer/nn/attention.py", "MultiHeadAttention.forward", "ops.attention_forward("),
    ("npformer/ops/attention.py", "attention_forward", "softmax_forward(scaled_scores(q, k)"),
]
# One update, from the demo's fit() to the attention's backward (the textbook tier, one
# process: the step runs the task itself).
NPFORMER_BACKWARD_PATH = [
    ("demos/imdb.py", "train_member", "trainer.fit()"),
    ("npformer/train/loop.py", "Trainer.fit", "self._train_one_update(cfg)"),
    ("npformer/train/loop.py", "Trainer._train_one_update", "loss = self.update()"),
    ("npformer/train/loop.py", "Trainer.update", "return self.train_step()"),
    ("npformer/train/loop.py", "Trainer.train_step", "self._forward_backward(batch,"),
    ("npformer/train/loop.py", "Trainer._forward_backward",
     "return self.task.loss_and_grad(self.model, batch, grad_scale)"),
    ("npformer/train/tasks.py", "Classification.loss_and_grad",
     "self.loss_and_grad_on_device(model, batch, grad_scale)"),
    ("npformer/train/tasks.py", "Classification.loss_and_grad_on_device",
     "return cross_entropy_and_backward(model, logits, labels, grad_scale)"),
    ("npformer/train/tasks.py", "cross_entropy_and_backward", "model.backward(dlogits)"),
    ("npformer/models/classifier.py", "TransformerClassifier.backward",
     "dx = block.backward(dx)"),
    ("npformer/nn/blocks.py", "EncoderBlock.backward", "self.self_attn.backward("),
    ("npformer/nn/attention.py", "MultiHeadAttention.backward", "ops.attention_backward("),
    ("npformer/ops/attention.py", "attention_backward", "dscores = softmax_backward(dp"),
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


def count(root: Path, path: list) -> int:
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
                        help="the update's path, from fit() to the attention's backward")
    args = parser.parse_args(argv)
    if args.nanogpt:
        return count(args.nanogpt, NANOGPT_BACKWARD_PATH if args.backward else NANOGPT_PATH)
    return count(ROOT, NPFORMER_BACKWARD_PATH if args.backward else NPFORMER_PATH)


if __name__ == "__main__":
    sys.exit(main())
