"""The package's layers import one way: down.

Every import statement of every module is read (at module level, inside a function,
under ``TYPE_CHECKING``: all of them) and resolved to the npformer module it names.  Each
module belongs to a layer of :data:`LAYERS`, lowest first; an import may reach a module of
its own layer or a lower one, never a higher one, and no modules may import each other
in a circle (which a layer alone would allow).  The checker must be able to fail: an
upward import planted in a copy of the package, in a function body or under
TYPE_CHECKING, and a circle, are each found.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first.  A name ends with ".*" for a package and all its modules.
LAYERS = [
    ["npformer.backend", "npformer.parallel.allocator", "npformer.gpu.gemm"],  # arrays, memory
    ["npformer.ops.contracts"],                 # the door and every op's contract
    ["npformer.ops.*"],                         # the textbook's mathematics
    ["npformer.gpu.attention"],                 # attention as a CUDA graph captures it
    ["npformer.nn.*"],                          # the textbook layers
    ["npformer.interop.gpt2"],                  # GPT-2 folders <-> a module's weights
    ["npformer.models.*"],                      # the textbook models and their configs
    ["npformer.optim"],                         # the textbook update rules and schedules
    ["npformer.fast.*"],                        # the fast tier: whole implementations
    ["npformer.data.*", "npformer.gradcheck", "npformer.interop.torch_reference"],
    ["npformer.train.tasks", "npformer.decoding", "npformer.checkpoint", "npformer.interop.*"],
    ["npformer.parallel.*", "npformer.gpu.*"],  # processes; the CUDA-graph step
    ["npformer.train.*"],                       # the loop, its progress
    ["npformer.cli.*"],                         # what the demos share
    ["npformer"],                               # the package: imports what it offers
]


def module_name(package_root: Path, path: Path) -> str:
    parts = list(path.relative_to(package_root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    for rank, members in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".*") and (
                    module == member[:-2] or module.startswith(member[:-1]))):
                return rank
    raise LookupError(f"{module} is in no layer of tests/test_imports.py: give it one")


def import_graph(package_root: Path) -> dict[str, set[str]]:
    """{module: the npformer modules it imports}, from every import statement in it."""
    paths = {module_name(package_root, p): p for p in package_root.rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                elif (node.module or "").split(".")[0] == "npformer":
                    source = node.module
                else:
                    continue
                for alias in node.names:  # a submodule by name, else the module itself
                    submodule = f"{source}.{alias.name}"
                    targets.add(submodule if submodule in paths else source)
        graph[module] = targets - {module}
    return graph


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
            for a, targets in sorted(graph.items()) for b in sorted(targets)
            if layer_of(b) > layer_of(a)]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_import_goes_down_and_none_goes_round():
    graph = import_graph(ROOT / "npformer")
    assert not upward_edges(graph), "\n".join(upward_edges(graph))
    assert not circles(graph), circles(graph)


def test_parallel_and_distributed_import_one_way():
    graph = import_graph(ROOT / "npformer")
    distributed = {m for m in graph if m.startswith("npformer.parallel")}
    assert any(t in distributed for t in graph["npformer.parallel"])
    assert not any("npformer.parallel" in graph[m] for m in distributed)


@pytest.mark.parametrize("planted", [
    "def later():\n    from ..train import Trainer  # noqa\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..cli import demo  # noqa\n",
    "import npformer.parallel  # noqa\n",
])
def test_an_upward_import_is_found(tmp_path, planted):
    """The checker is sharp: one upward import planted in the textbook layers (in a
    function, under TYPE_CHECKING, at module level) is reported."""
    copy = tmp_path / "npformer"
    shutil.copytree(ROOT / "npformer", copy, ignore=shutil.ignore_patterns("__pycache__"))
    layers = copy / "nn" / "layers.py"
    layers.write_text(layers.read_text(encoding="utf-8") + "\n" + planted, encoding="utf-8")
    edges = upward_edges(import_graph(copy))
    assert len(edges) == 1 and edges[0].startswith("npformer.nn.layers"), edges


def test_a_circle_is_found(tmp_path):
    copy = tmp_path / "npformer"
    shutil.copytree(ROOT / "npformer", copy, ignore=shutil.ignore_patterns("__pycache__"))
    data = copy / "data" / "batching.py"
    data.write_text(data.read_text(encoding="utf-8") + "\nfrom . import vocab  # noqa\n",
                    encoding="utf-8")
    vocab = copy / "data" / "vocab.py"
    vocab.write_text(vocab.read_text(encoding="utf-8") + "\nfrom . import batching  # noqa\n",
                     encoding="utf-8")
    assert circles(import_graph(copy)) == [["npformer.data.batching", "npformer.data.vocab"]]
