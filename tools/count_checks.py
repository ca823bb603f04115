"""Count the math and the check statements of every function of the ops, in
``npformer/ops`` and ``npformer/fast`` (issue 17: an op body is its derivation and
nothing else; the fast tier's class modules are not ops: :data:`NOT_OPS`).

    python tools/count_checks.py [PACKAGE_DIR]      # default: the npformer next to tools/

The rule, statement by statement (an AST walk; docstrings are not counted):

* a **check** is an ``assert``, a ``raise``, an ``if`` whose branches raise (the ``if``
  and every statement under it), a ``try`` whose handler raises (the handler), or a
  call (alone, or as an assignment's value) to a function named ``check_*`` or
  reached through the contracts module (``contracts.x(...)``; ``validation.x(...)``,
  ``_checks.x(...)`` in older layouts);
* every other simple statement is **math** (assignments, returns, calls, loops'
  headers and ``if`` tests count one each; a compound statement counts its header and
  then its children, each by the same rule).

Each function is counted on its own (a nested function's statements are its own, not
its parent's).  The script prints the counts per file and the totals, lists every
function holding a check, and exits 1 if any does: contracts are declared on the
op's decorator and checked by :mod:`npformer.ops.contracts`, never inside the body.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

FOLDERS = ("ops", "fast")
# The fast tier's classes (layers, blocks, models, optimizers and their buffers) are not
# ops: their contracts sit in their check_inputs, as the textbook layers' do in npformer/nn;
# compiled.py's whole-block kernels run behind the blocks' check_inputs (its one raise is
# the stub numba's overload replaces).
# The contracts modules (the textbook's, the fast tier's) hold the checks themselves, not
# ops; gemm.py binds cuBLAS (its raises report the library's failures, not an input's
# contract).
NOT_OPS = {"ops": ("contracts.py",),
           "fast": ("contracts.py", "layers.py", "blocks.py", "models.py", "optim.py",
                    "flat.py", "packing.py", "recompute.py", "gemm.py", "compiled.py")}
VALIDATION_MODULES = ("contracts", "validation", "_checks")


def is_check_call(node) -> bool:
    """A call to check_*(...), or to anything reached through the contracts module."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id.startswith("check_")
    if isinstance(func, ast.Attribute):
        base = func.value
        return func.attr.startswith("check_") or (
            isinstance(base, ast.Name) and base.id in VALIDATION_MODULES)
    return False


def raises(statements) -> bool:
    return any(isinstance(node, ast.Raise) for s in statements for node in ast.walk(s))


def count_block(statements) -> tuple[int, int]:
    """(math, checks) of a list of statements, nested function definitions excluded."""
    math = checks = 0
    for s in statements:
        m, c = count_statement(s)
        math, checks = math + m, checks + c
    return math, checks


def size(statements) -> int:
    """Every statement under these ones, headers included (nested functions excluded)."""
    total = 0
    for s in statements:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        total += 1 + sum(size(getattr(s, field, [])) for field in ("body", "orelse", "finalbody"))
        total += sum(size(h.body) + 1 for h in getattr(s, "handlers", []))
    return total


def count_statement(s) -> tuple[int, int]:
    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return 0, 0  # counted on their own
    if isinstance(s, (ast.Assert, ast.Raise)):
        return 0, 1
    if isinstance(s, ast.If) and (raises(s.body) or raises(s.orelse)):
        return 0, size([s])
    if isinstance(s, ast.Expr) and is_check_call(s.value):
        return 0, 1
    if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and is_check_call(s.value):
        return 0, 1
    if isinstance(s, ast.Try):
        math, checks = count_block(s.body)
        for handler in s.handlers:
            m, c = ((0, size(handler.body) + 1) if raises(handler.body)
                    else count_block(handler.body))
            math, checks = math + m, checks + c
        for block in (s.orelse, s.finalbody):
            m, c = count_block(block)
            math, checks = math + m, checks + c
        return math + 1, checks
    if isinstance(s, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith)):
        m, c = count_block(s.body + getattr(s, "orelse", []))
        return m + 1, c
    return 1, 0


def body_without_docstring(fn) -> list:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def functions(tree):
    """(qualified name, node) of every function, methods and nested ones included."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def count_file(path: Path) -> list[tuple[str, int, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(name, *count_block(body_without_docstring(fn))) for name, fn in functions(tree)]


def main(argv: list[str]) -> int:
    package = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "npformer"
    if (package / "npformer").is_dir():  # a checkout's root was given
        package = package / "npformer"
    total_math = total_checks = 0
    offenders = []
    for folder in FOLDERS:
        for path in sorted((package / folder).glob("*.py")):
            if path.name in NOT_OPS.get(folder, ()):
                continue
            rows = count_file(path)
            math = sum(r[1] for r in rows)
            checks = sum(r[2] for r in rows)
            total_math, total_checks = total_math + math, total_checks + checks
            print(f"{folder}/{path.name:<16} math {math:4d}   checks {checks:4d}")
            offenders += [(f"{folder}/{path.name}", name, c) for name, _, c in rows if c]
    print(f"{'total':<21} math {total_math:4d}   checks {total_checks:4d}")
    for where, name, checks in offenders:
        print(f"  check statements in {where}:{name}: {checks}")
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
