"""Every public function and method of npformer is annotated (the package ships ``py.typed``).

Public: a module-level function, or a method of a class, whose name has no leading
underscore (``__init__`` included), in a class whose name has none either; nested
functions are not walked.  Fully annotated: every parameter (``*args`` and ``**kwargs``
too; ``self`` and ``cls`` exempt) and the return (``__init__`` exempt).  The walk reads
the source (AST), so nothing is imported and decorated functions count by their body.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "npformer"
Function = ast.FunctionDef | ast.AsyncFunctionDef


def public_functions(tree: ast.Module) -> Iterator[tuple[str, Function]]:
    """(qualified name, node) of every public function and public class's method."""
    def walk(nodes: list[ast.stmt], prefix: str) -> Iterator[tuple[str, Function]]:
        for node in nodes:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                yield from walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, Function):
                if not node.name.startswith("_") or node.name == "__init__":
                    yield prefix + node.name, node
    yield from walk(tree.body, "")


def unannotated_parts(node: Function) -> list[str]:
    """The parameters (and ``return``) of ``node`` without an annotation."""
    a = node.args
    params = [p for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
    params += [p for p in (a.vararg, a.kwarg) if p is not None]
    missing = [p.arg for p in params if p.annotation is None]
    if node.returns is None and node.name != "__init__":
        missing.append("return")
    return missing


def unannotated(source: str, where: str = "<source>") -> list[str]:
    """'where: name (parts)' for every public function of ``source`` not fully annotated."""
    return [f"{where}: {name} ({', '.join(parts)})"
            for name, node in public_functions(ast.parse(source))
            if (parts := unannotated_parts(node))]


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_rule_catches_each_kind_of_gap():
    source = '''
def ok(x: int, *args: int, y: str = "", **kwargs: float) -> None: ...
def no_return(x: int): ...
def bare_param(x) -> int: ...
def bare_varargs(*args) -> int: ...
def bare_kwonly(*, y=1) -> int: ...
def bare_kwargs(**kwargs) -> int: ...
def _private(x): ...
class Public:
    def __init__(self, x: int): ...
    @classmethod
    def make(cls, x: int) -> "Public": ...
    def method(self, x): ...
    def _helper(self, x): ...
    def outer(self) -> None:
        def nested(y): ...
class _Private:
    def method(self, x): ...
'''
    assert unannotated(source) == [
        "<source>: no_return (return)", "<source>: bare_param (x)",
        "<source>: bare_varargs (args)", "<source>: bare_kwonly (y)",
        "<source>: bare_kwargs (kwargs)", "<source>: Public.method (x, return)"]


def test_the_walk_finds_the_functions_a_user_meets():
    names = {f"{path.relative_to(PACKAGE)}:{name}" for path in package_files()
             for name, _ in public_functions(ast.parse(path.read_text()))}
    for expected in ("ops/linear.py:linear_forward", "fast/activations.py:gelu_kernel",
                     "nn/attention.py:MultiHeadAttention.forward",
                     "nn/module.py:Parameter.__init__", "ops/contracts.py:forward_op",
                     "train/loop.py:Trainer.fit", "decoding.py:beam_search"):
        assert expected in names, f"{expected} was not found among the public functions"
    assert len(names) > 400


def test_every_public_function_is_annotated():
    missing = [line for path in package_files()
               for line in unannotated(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not missing, (f"{len(missing)} public functions or methods not fully annotated "
                         "(parameters and return):\n" + "\n".join(missing))
