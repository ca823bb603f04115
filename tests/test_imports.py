"""The package's layers import one way: down.

Every import statement of every module is read (at module level, inside a function,
under ``TYPE_CHECKING``: all of them) and resolved to the npformer module it names.  Each
module belongs to the layer of its folder (or, for a module beside the folders, its own
name) in :data:`LAYERS`, lowest first; an import may reach a module of
its own layer or a lower one, never a higher one, and no modules may import each other
in a circle (which a layer alone would allow).  docs/guide.md states the same order.  The
checker must be able to fail: an upward import planted in a copy of the package, in a
function body or under TYPE_CHECKING, and a circle, are each found.

And at run time: importing the training package, as the textbook tier's run does, loads
no compiler, no fast tier and no MPI.
"""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first: each layer the folders (and top-level modules) of npformer/ in it, by name.
# docs/guide.md's "What is inside" states the same chain (test_the_guide_states_the_layers).
LAYERS = [
    ["backend"],      # the array namespace, dtypes, random numbers, memory
    ["ops"],          # the textbook's mathematics, and every op's contract
    ["nn"],           # the textbook layers, the parameters' flat buffers
    ["hf"],           # Hugging Face folders, read and written on the class given
    ["models"],       # the textbook models and their configs
    ["optim"],        # the textbook update rules and schedules
    ["gpu"],          # CuPy only: cuBLAS products, fused kernels, CUDA graphs
    ["fast"],         # the fast tier: whole implementations
    ["data", "decoding", "gradcheck", "checkpoint"],
    ["interop"],      # PyTorch modules, PEFT adapters, a folder of any family
    ["parallel"],     # processes, thread replicas, the gradient sum
    ["train"],        # the loop, its tasks and progress
    ["cli"],          # what the demos share
]
PACKAGE = "npformer"  # its __init__: imports what it offers, above every layer
# Imports tolerated going up: none (CausalLM.from_pretrained's went when the Hugging Face
# files moved below the models, to npformer/hf/); none may join.
KNOWN_UPWARD: set = set()


def module_name(package_root: Path, path: Path) -> str:
    parts = list(path.relative_to(package_root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The rank in :data:`LAYERS` of the folder (or top-level module) holding ``module``."""
    if module == PACKAGE:
        return len(LAYERS)
    part = module.split(".")[1]
    for rank, members in enumerate(LAYERS):
        if part in members:
            return rank
    raise LookupError(f"{module}: {part} is in no layer of tests/test_imports.py: give it one")


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


def upward_edges(graph: dict[str, set[str]], known: set = frozenset()) -> list[str]:
    """Every import that goes up a layer, but the ``known`` (importer, imported) pairs."""
    return [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
            for a, targets in sorted(graph.items()) for b in sorted(targets)
            if layer_of(b) > layer_of(a) and (a, b) not in known]


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
    assert not upward_edges(graph, KNOWN_UPWARD), "\n".join(upward_edges(graph, KNOWN_UPWARD))
    assert not circles(graph), circles(graph)


def test_every_import_names_a_module_of_the_package():
    """A module moved or renamed leaves no import of its old name (one inside a function
    fails only when the function runs)."""
    graph = import_graph(ROOT / "npformer")
    missing = sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets
                     if b not in graph)
    assert not missing, "\n".join(missing)


def test_the_known_upward_import_is_still_there():
    graph = import_graph(ROOT / "npformer")
    assert {(a, b) for a, b in KNOWN_UPWARD if b in graph.get(a, ())} == KNOWN_UPWARD


def test_every_folder_and_module_of_the_package_has_a_layer():
    parts = {p.stem for p in (ROOT / "npformer").glob("*.py") if p.name != "__init__.py"}
    parts |= {p.name for p in (ROOT / "npformer").iterdir() if (p / "__init__.py").is_file()}
    assert parts == {part for members in LAYERS for part in members}


def guide_layers() -> list[list[str]]:
    """The order docs/guide.md states ("The parts import one way, down: `a <- b, c <- ...`"),
    as lists of names, lowest first."""
    text = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    found = re.search(r"The parts import one way, down: `([^`]+)`", text)
    assert found, "docs/guide.md no longer states the order of the package's parts"
    return [[name.strip() for name in layer.split(",")]
            for layer in " ".join(found.group(1).split()).split("<-")]


def test_the_guide_states_the_layers():
    """docs/guide.md's chain is LAYERS, then the demos on top."""
    assert guide_layers() == LAYERS + [["demos"]]


def test_importing_the_training_package_loads_no_compiler_fast_tier_or_mpi():
    """What a run of the textbook tier imports (the package, its training loop, data
    parallelism, the demos' shared code, checkpoints) leaves numba, npformer.fast and
    mpi4py unloaded: they come with the fast tier, and with MPI ranks, only."""
    code = ("import json, sys, npformer, npformer.train, npformer.parallel, npformer.cli, "
            "npformer.checkpoint, npformer.decoding; print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    loaded = [name for name in json.loads(out.splitlines()[-1])
              if name.split(".")[0] in ("numba", "mpi4py") or name == "npformer.fast"
              or name.startswith("npformer.fast.")]
    assert loaded == [], loaded


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
    edges = upward_edges(import_graph(copy), KNOWN_UPWARD)
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
