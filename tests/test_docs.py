"""docs/derivations.md quotes the code each step of a derivation becomes: every quoted
code block (and every code cell of its tables) must still appear, line for line, in the
source file named just before it, inside one of the functions (or classes, or module-level
names) that label names.  A change to an op that forgets the derivation fails here.

The doc's worked examples are recomputed with the real ops, and the script that draws its
figures must run."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "derivations.md"
PATH = re.compile(r"`(npformer/[\w/]+\.py)`")
NAME = re.compile(r"`([A-Za-z_][\w.]*)`")


def _stripped_lines(path: str) -> list[str]:
    return [line.strip() for line in (ROOT / path).read_text().splitlines()]


def _label(line: str) -> tuple[str, list[str]]:
    """(source path, names of the functions/classes/constants after it) of a label line;
    parenthesised remarks between the names are not part of the label."""
    matches = list(PATH.finditer(line))
    after, previous = line[matches[-1].end():], None
    while after != previous:  # drop (remarks), innermost first
        previous, after = after, re.sub(r"\([^()]*\)", "", after)
    return matches[-1].group(1), NAME.findall(after)


def _quotes(text: str | None = None):
    """(source path, label names, quoted lines) for every code block and code table cell
    of ``text`` (default: the whole doc)."""
    current, names, block, in_block = None, [], [], False
    for line in (DOC.read_text() if text is None else text).splitlines():
        if line.startswith("```"):
            if in_block and current:
                yield current, names, [b.strip() for b in block]
            in_block, block = not in_block, []
            continue
        if in_block:
            block.append(line)
            continue
        if PATH.search(line):
            current, names = _label(line)
        if line.startswith("|") and current:
            for cell in line.split("|"):
                match = re.fullmatch(r"\s*`([^`]+)`\s*", cell)
                if match and "=" in match.group(1):
                    yield current, names, [match.group(1).strip()]


def _definitions(path: str) -> dict[str, tuple[int, int]]:
    """name -> (first line, last line), 0-based, of every function, method (as Class.method,
    and nested functions by their own name), class and module-level assignment of a file."""
    tree = ast.parse((ROOT / path).read_text())
    spans: dict[str, tuple[int, int]] = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                span = (child.lineno - 1, child.end_lineno - 1)
                spans[prefix + child.name] = span
                spans.setdefault(child.name, span)
                inner = prefix + child.name + "." if isinstance(child, ast.ClassDef) else ""
                visit(child, inner)
            elif isinstance(child, (ast.Assign, ast.AnnAssign)) and node is tree:
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        spans[target.id] = (child.lineno - 1, child.end_lineno - 1)

    visit(tree, "")
    return spans


def _found_at(source: list[str], lines: list[str]) -> list[int]:
    return [i for i in range(len(source)) if source[i:i + len(lines)] == lines]


def test_every_quoted_line_of_code_is_in_its_source_file():
    quotes = list(_quotes())
    assert len(quotes) > 50  # the doc quotes every op
    stale = []
    for path, _, lines in quotes:
        if not (ROOT / path).is_file():
            stale.append(f"{path}: no such file (quoting {lines[:1]})")
        elif not _found_at(_stripped_lines(path), lines):
            stale.append(f"{path}: {lines[:3]}...")
    assert not stale, "docs/derivations.md quotes code that changed:\n" + "\n".join(stale)


def test_every_quote_sits_in_a_function_its_label_names():
    misplaced = []
    for path, names, lines in _quotes():
        if not (ROOT / path).is_file():
            continue  # reported by the test above
        if not names:
            misplaced.append(f"{path}: no function named before {lines[:1]}")
            continue
        spans = _definitions(path)
        unknown = [n for n in names if n not in spans]
        if unknown:
            misplaced.append(f"{path}: label names {unknown}, which the file does not define")
            continue
        starts = _found_at(_stripped_lines(path), lines)
        inside = any(all(any(spans[n][0] <= j <= spans[n][1] for n in names)
                         for j in range(i, i + len(lines))) for i in starts)
        if starts and not inside:
            misplaced.append(f"{path}: {lines[:2]}... is not inside {names}")
    assert not misplaced, "docs/derivations.md labels quotes wrongly:\n" + "\n".join(misplaced)


PART_II = "# Part II. The fast tier"


def test_each_part_quotes_its_own_tier():
    """Part I is the textbook: it never quotes npformer/fast/.  Part II derives the fast tier:
    every op it quotes is a fast one (it may quote the layers and models that use them, never
    npformer/ops/ as if it were fast).  No placeholder for code that does not exist is left."""
    text = DOC.read_text()
    assert "<!-- tiers:" not in text, "a <!-- tiers: ... --> placeholder is left in the doc"
    part_one, part_two = text.split(PART_II)
    wrong = [f"Part I quotes {path}" for path, _, _ in _quotes(part_one)
             if path.startswith("npformer/fast/")]
    wrong += [f"Part II quotes {path}" for path, _, _ in _quotes(part_two)
              if path.startswith("npformer/ops/")]
    assert not wrong, "docs/derivations.md quotes the wrong tier:\n" + "\n".join(wrong)


# ------------------------------------------------------------------ worked examples
def _worked_examples() -> dict[str, dict[str, list[float]]]:
    """{op: {row name: numbers}} from each '<!-- worked example OP: name, ... -->' marker
    and the table under it (the names give the table's rows, in order)."""
    lines = DOC.read_text().splitlines()
    examples = {}
    for i, line in enumerate(lines):
        match = re.fullmatch(r"<!-- worked example (\w+): (.*) -->", line.strip())
        if not match:
            continue
        names = [n.strip() for n in match.group(2).split(",")]
        rows = [row for row in lines[i + 1:i + 3 + len(names)] if row.startswith("|")][2:]
        assert len(rows) == len(names), f"the {match.group(1)} example's table has {len(rows)} rows"
        examples[match.group(1)] = {
            name: [float(cell) for cell in row.strip("|").split("|")[1:]]
            for name, row in zip(names, rows)}
    return examples


def _assert_printed(doc_numbers: dict, computed: dict) -> None:
    """Each number of the doc is the computed one rounded to 4 decimals."""
    for name, values in doc_numbers.items():
        np.testing.assert_allclose(values, computed[name], rtol=0, atol=0.5e-4 + 1e-12,
                                   err_msg=f"row {name!r} of the worked example")


def test_the_softmax_worked_example_is_what_the_ops_compute():
    from npformer import backend, ops
    doc = _worked_examples()["softmax"]
    x, dp = np.array(doc["x"]), np.array(doc["dp"])
    p, cache = ops.softmax_forward(backend.asarray(x))
    dx = ops.softmax_backward(backend.asarray(dp), cache)
    _assert_printed(doc, {"x": x, "exp": np.exp(x), "p": backend.to_numpy(p), "dp": dp,
                          "dx": backend.to_numpy(dx)})


def test_the_layernorm_worked_example_is_what_the_ops_compute():
    from npformer import backend, ops
    doc = _worked_examples()["layernorm"]
    x, dy = np.array(doc["x"]), np.array(doc["dy"])
    ones, zeros = backend.asarray(np.ones(3)), backend.asarray(np.zeros(3))
    _, cache = ops.layernorm_forward(backend.asarray(x), ones, zeros)
    dx, _, _ = ops.layernorm_backward(backend.asarray(dy), cache)
    _assert_printed(doc, {"x": x, "centred": x - x.mean(),
                          "x_hat": backend.to_numpy(cache.saved[0]),
                          "dy": dy, "dx": backend.to_numpy(dx)})


def _rows(prefix: str, array) -> dict[str, np.ndarray]:
    """{prefix1: row 0, prefix2: row 1, ...}: a matrix's rows as the doc's tables name them."""
    return {f"{prefix}{i + 1}": row for i, row in enumerate(np.asarray(array))}


def _tiers():
    from npformer import fast, ops
    return [("textbook", ops), ("fast", fast)]


@pytest.mark.parametrize("tier", ["textbook", "fast"])
def test_the_attention_worked_example_is_what_the_ops_compute(tier):
    """§9's example: the printed inputs give the printed scores, probabilities, output, and
    (from the printed upstream gradient) the printed gradients, in both tiers; §18's row sums
    are equal, as its identity says."""
    from npformer import backend, ops
    examples = _worked_examples()
    rows, scores = examples["attention_rows"], examples["attention_scores"]
    q = np.array([rows["q1"], rows["q2"]])
    k = np.array([rows["k1"], rows["k2"], rows["k3"]])
    v = np.array([rows["v1"], rows["v2"], rows["v3"]])
    dout = np.array([rows["do1"], rows["do2"]])
    mask = np.isfinite(np.array([scores["a1"], scores["a2"]]))  # -inf where the mask hides a key
    assert mask.sum() == 5, "the example hides exactly one key"
    op = dict(_tiers())[tier]
    as_ = backend.asarray
    out, cache = op.attention_forward(as_(q), as_(k), as_(v), as_(mask))
    dq, dk, dv = (backend.to_numpy(g) for g in op.attention_backward(as_(dout), cache))
    out = backend.to_numpy(out)
    scale = 1.0 / np.sqrt(q.shape[-1])
    a = np.where(mask, q @ k.T * scale, -np.inf)
    p = backend.to_numpy(ops.attention_weights(as_(q), as_(k), as_(mask)))
    dp = dout @ v.T
    _, softmax_cache = ops.softmax_forward(as_(q @ k.T * scale), axis=-1, mask=as_(mask))
    da = backend.to_numpy(ops.softmax_backward(as_(dp), softmax_cache))
    log_p = backend.to_numpy(ops.log_softmax_forward(as_(a))[0])
    _assert_printed(rows, {**_rows("q", q), **_rows("k", k), **_rows("v", v), **_rows("o", out),
                           **_rows("do", dout)})
    _assert_printed(examples["attention_gradients"],
                    {**_rows("dq", dq), **_rows("dk", dk), **_rows("dv", dv)})
    _assert_printed(scores, {**_rows("a", a), **_rows("p", p), **_rows("dp", dp),
                             **_rows("da", da)})
    _assert_printed(examples["attention_rowsums"],
                    {"rowsum_dp_p": np.sum(dp * p, axis=-1),
                     "rowsum_do_o": np.sum(dout * out, axis=-1),
                     "lse": a[:, 0] - log_p[:, 0]})  # lse = A - log P at any allowed key


@pytest.mark.parametrize("tier", ["textbook", "fast"])
def test_the_cross_entropy_worked_example_is_what_the_ops_compute(tier):
    """§13's example (label smoothing 0.1, one ignored row): the printed logits and targets
    give the printed probabilities, log-probabilities, target distributions, row losses,
    weights, loss and gradient, in both tiers."""
    from npformer import backend, ops
    examples = _worked_examples()
    rows, per_row = examples["cross_entropy_rows"], examples["cross_entropy_per_row"]
    z = np.array([rows["z0"], rows["z1"], rows["z2"]])
    targets = np.array(per_row["tau"]).astype(np.int64)
    ignored = targets == ops.IGNORE_INDEX
    assert ignored.sum() == 1, "the example ignores one row"
    op = dict(_tiers())[tier]
    loss, cache = op.cross_entropy_forward(backend.asarray(z), backend.asarray(targets),
                                           label_smoothing=0.1)
    dz = backend.to_numpy(op.cross_entropy_backward(1.0, cache))
    # the textbook pieces of the same loss (§13's formulas), to check the intermediate rows
    p = backend.to_numpy(ops.softmax_forward(backend.asarray(z), axis=-1)[0])
    log_p = backend.to_numpy(ops.log_softmax_forward(backend.asarray(z), axis=-1)[0])
    rho = backend.to_numpy(ops.losses.target_distribution(
        backend.asarray(targets), z.shape[-1], ops.IGNORE_INDEX, 0.1, np.float64))
    weight = (~ignored) / max((~ignored).sum(), 1)  # w_n = chi_n / max(N_chi, 1)
    computed = {**{f"z{i}": r for i, r in enumerate(z)}, **{f"p{i}": r for i, r in enumerate(p)},
                **{f"l{i}": r for i, r in enumerate(log_p)},
                **{f"rho{i}": r for i, r in enumerate(rho)},
                **{f"dz{i}": r for i, r in enumerate(dz)}}
    _assert_printed(rows, computed)
    _assert_printed(per_row, {"tau": targets, "chi": (~ignored).astype(float), "w": weight,
                              "loss_n": -np.sum(rho * log_p, axis=-1)})
    _assert_printed(examples["cross_entropy_total"],
                    {"n_counted": [float((~ignored).sum())],
                     "loss": [float(backend.to_numpy(loss))]})


# ------------------------------------------------------------------ figures
def test_the_figure_script_draws_every_figure_the_doc_shows(tmp_path):
    pytest.importorskip("matplotlib")
    import importlib.util
    spec = importlib.util.spec_from_file_location("figures", ROOT / "docs" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    drawn = {path.name for path in figures.main(tmp_path)}
    shown = set(re.findall(r"\]\(figures/([\w.]+)\)", DOC.read_text()))
    assert shown and shown <= drawn, f"the doc shows {sorted(shown - drawn)}, which no one draws"
    for name in drawn:
        assert (tmp_path / name).read_text().startswith("<?xml")
        assert (ROOT / "docs" / "figures" / name).exists(), f"docs/figures/{name} is not committed"
