"""docs/derivations.md quotes the code each step of a derivation becomes: every quoted
code block (and every code cell of its tables) must still appear, line for line, in the
source file named just before it, inside one of the functions (or classes, or module-level
names) that label names.  A change to an op that forgets the derivation fails here.

The doc's worked examples are recomputed with the real ops, the optimizer and the beam
search's stop rule, and the script that draws its figures must run.  Every size the doc
quotes (bytes of an array, packing ratios, block counts) is recomputed from the demo preset
or the benchmark configuration (bench/configs.py) the doc names before it, read from that
object, and a size the doc quotes with no such check, or under the name of another
configuration, fails; the doc quotes no timing and no date.  No Markdown file of
docs/ (nor README.md) holds a control character, every link to a section of the doc
leads to one of its headings, every file of the repository the doc names exists, and
every ``npformer.`` name it writes out resolves.  Every citation of one of its sections
("§6", "derivations.md, section 11"), in the documents and the code, names a section it
has, under the title the citation gives; and docs/llama.md's float64 table is what
tools/llama_float64_gap.py prints."""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import math
import re
from pathlib import Path

import numpy as np
import pytest

from .helpers import tiered

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "derivations.md"
PATH = re.compile(r"`(npformer/[\w/]+\.py)`")
NAME = re.compile(r"`([A-Za-z_][\w.]*)`")
FILE = re.compile(r"`((?:npformer|tests|bench|tools|demos|docs)/[\w/.*]*)`")  # path, folder, glob
DOTTED = re.compile(r"`(npformer(?:\.\w+)+)`")  # npformer.ops, npformer.optim.warmup_cosine


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
NONE = "–"  # a worked example's cell that holds no number (no such hypothesis)


def _example_tables() -> dict[str, dict[str, list[str]]]:
    """{op: {row name: the cells as printed}} from each '<!-- worked example OP: name, ... -->'
    marker and the table under it (the names give the table's rows, in order; the first
    column, the row's label for the reader, is left out)."""
    lines = DOC.read_text().splitlines()
    examples = {}
    for i, line in enumerate(lines):
        match = re.fullmatch(r"<!-- worked example (\w+): (.*) -->", line.strip())
        if not match:
            continue
        names = [n.strip() for n in match.group(2).split(",")]
        rows = [row for row in lines[i + 1:i + 3 + len(names)] if row.startswith("|")][2:]
        assert len(rows) == len(names), f"the {match.group(1)} example's table has {len(rows)} rows"
        examples[match.group(1)] = {name: [cell.strip() for cell in row.strip("|").split("|")[1:]]
                                    for name, row in zip(names, rows)}
    return examples


def _worked_examples() -> dict[str, dict[str, np.ndarray]]:
    """{op: {row name: the numbers}}; a cell printed as NONE is NaN."""
    return {op: {name: np.array([np.nan if c == NONE else float(c) for c in cells])
                 for name, cells in rows.items()}
            for op, rows in _example_tables().items()}


def _assert_printed(op: str, computed: dict) -> None:
    """Each number of example ``op`` is the computed one rounded to the decimals printed
    (an integer exactly); a NONE cell stands for no number and is not compared."""
    for name, cells in _example_tables()[op].items():
        want = np.broadcast_to(np.asarray(computed[name], dtype=np.float64), (len(cells),))
        for cell, value in zip(cells, want):
            if cell == NONE:
                continue
            printed = float(cell)
            decimals = len(cell.split(".")[1]) if "." in cell else 0
            half_unit = 0.5 * 10.0 ** -decimals if decimals else 0.0
            assert printed == value or abs(printed - value) <= half_unit + 1e-12, (
                f"{op} example, row {name!r}: printed {cell}, computed {value!r}")


def test_the_softmax_worked_example_is_what_the_ops_compute():
    from npformer import backend, ops
    doc = _worked_examples()["softmax"]
    x, dp = np.array(doc["x"]), np.array(doc["dp"])
    p, cache = ops.softmax_forward(backend.asarray(x))
    dx = ops.softmax_backward(backend.asarray(dp), cache)
    _assert_printed("softmax", {"x": x, "exp": np.exp(x), "p": backend.to_numpy(p), "dp": dp,
                                "dx": backend.to_numpy(dx)})


def test_the_layernorm_worked_example_is_what_the_ops_compute():
    from npformer import backend, ops
    doc = _worked_examples()["layernorm"]
    x, dy = np.array(doc["x"]), np.array(doc["dy"])
    ones, zeros = backend.asarray(np.ones(3)), backend.asarray(np.zeros(3))
    _, cache = ops.layernorm_forward(backend.asarray(x), ones, zeros)
    dx, _, _ = ops.layernorm_backward(backend.asarray(dy), cache)
    _assert_printed("layernorm", {"x": x, "centred": x - x.mean(),
                                  "x_hat": backend.to_numpy(cache.values[0]),
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
    _assert_printed("attention_rows", {**_rows("q", q), **_rows("k", k), **_rows("v", v),
                                       **_rows("o", out), **_rows("do", dout)})
    _assert_printed("attention_gradients",
                    {**_rows("dq", dq), **_rows("dk", dk), **_rows("dv", dv)})
    _assert_printed("attention_scores", {**_rows("a", a), **_rows("p", p), **_rows("dp", dp),
                                         **_rows("da", da)})
    _assert_printed("attention_rowsums",
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
    _assert_printed("cross_entropy_rows", computed)
    _assert_printed("cross_entropy_per_row", {"tau": targets, "chi": (~ignored).astype(float),
                                              "w": weight,
                                              "loss_n": -np.sum(rho * log_p, axis=-1)})
    _assert_printed("cross_entropy_total",
                    {"n_counted": [float((~ignored).sum())],
                     "loss": [float(backend.to_numpy(loss))]})


@pytest.mark.parametrize("tier", ["textbook", "fast"])
def test_the_gelu_worked_example_is_what_the_ops_compute(tier):
    """§4's example: Phi, phi, y and the derivative (upstream 1) at the printed inputs, by
    both tiers' exact GELU; Phi and phi from math.erfc and math.exp."""
    from npformer import backend
    x = _worked_examples()["gelu"]["x"]
    forward, backward = dict(_tiers())[tier].activation("gelu")
    y, cache = forward(backend.asarray(x))
    dx = backward(backend.asarray(np.ones_like(x)), cache)
    cdf = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in x])
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    _assert_printed("gelu", {"x": x, "cdf": cdf, "pdf": pdf, "y": backend.to_numpy(y),
                             "dx": backend.to_numpy(dx)})


def test_the_two_gelu_forms_differ_as_the_doc_says():
    """§4: the exact and the tanh GELU differ by at most the printed amount, where printed."""
    from npformer.ops import activations
    match = re.search(r"differ by at most about \$([\d.]+)\\times10\^\{(-\d+)\}\$ in \$y\$ "
                      r"\(near \$\|x\| \\approx ([\d.]+)\$\)", _prose())
    assert match, "§4 no longer states how far apart the two GELU forms are"
    x = np.linspace(-10.0, 10.0, 2_000_001)
    gap = np.abs(activations.gelu_forward(x)[0] - activations.gelu_tanh_forward(x)[0])
    assert _rounds_to(match.group(1), gap.max() / 10.0 ** int(match.group(2)))
    assert _rounds_to(match.group(3), abs(x[gap.argmax()]))


@pytest.mark.parametrize("tier", ["textbook", "fast"])
def test_the_adam_worked_example_is_adams_first_step(tier):
    """§17's example: one step of npformer.optim.Adam from the printed parameter and
    gradient, with the learning rate the text states and the default betas and eps (the
    text states those too), gives the printed moments and parameter; the corrected
    moments are the gradient and its square, as the text derives."""
    from npformer import backend
    from npformer.nn import Parameter

    from .helpers import using_tier
    doc = _worked_examples()["adam"]
    stated = re.search(r"\$\\eta_1 = ([\d.]+)\$, \$\\beta_1 = ([\d.]+)\$, \$\\beta_2 = ([\d.]+)\$, "
                       r"\$\\epsilon = 10\^\{(-\d+)\}\$, no weight decay", _prose())
    assert stated, "§17's Adam example no longer states its hyperparameters"
    lr = float(stated.group(1))
    with using_tier(tier):
        p = Parameter(backend.asarray(doc["theta0"]), decay=False)
        opt = tiered.Adam([p], lr=lr)
        assert (opt.beta1, opt.beta2, opt.eps) == (float(stated.group(2)), float(stated.group(3)),
                                                   10.0 ** int(stated.group(4)))
        opt.zero_grad()
        p.accumulate(backend.asarray(doc["g"]))
        opt.step()
        state = opt.state_dict()
        m, v, after = (backend.to_numpy(a).copy() for a in (state["m.0"], state["v.0"], p.data))
    before, g = doc["theta0"], doc["g"]
    m_hat, v_hat = m / (1.0 - opt.beta1), v / (1.0 - opt.beta2)
    np.testing.assert_allclose(m_hat, g, rtol=1e-12)  # the corrected moments at u = 1
    np.testing.assert_allclose(v_hat, g * g, rtol=1e-12)
    _assert_printed("adam", {"theta0": before, "g": g, "m1": m, "v1": v, "m_hat": m_hat,
                             "v_hat": v_hat, "step": before - after, "theta1": after,
                             "sgd_step": lr * g})
    uncorrected = re.search(r"\\approx ([\d.]+)\\,\\eta_1\\,\\text\{sign\}", _prose())
    assert uncorrected and _rounds_to(uncorrected.group(1),
                                      (1.0 - opt.beta1) / math.sqrt(1.0 - opt.beta2))


def test_the_beam_stop_worked_example_is_what_the_search_decides():
    """§25's example: for each search state of the table, the printed best scores and
    bounds are those of ``length_penalty`` at the alpha and limit the text states, and the
    printed decision is ``_search_done``'s."""
    from npformer.decoding import _Beam, _search_done, length_penalty
    text = _prose()
    stated = re.search(r"Two searches with \$\\alpha_\{\\text\{lp\}\} = ([\d.]+)\$ and "
                       r"\$\\text\{limit\} = (\d+)\$", text)
    assert stated, "§25's example no longer states its alpha and limit"
    alpha, limit = float(stated.group(1)), int(stated.group(2))
    penalties = re.findall(r"\\text\{lp\}\((\d+)\) = \((\d+)/6\)\^\{([\d.]+)\} = ([\d.]+)", text)
    assert len(penalties) == 4, penalties
    for length, five_plus, power, value in penalties:
        assert int(five_plus) == 5 + int(length) and float(power) == alpha
        assert _rounds_to(value, length_penalty(int(length), alpha))
    doc = _worked_examples()["beam_stop"]
    computed = {name: [] for name in ("best_ended", "bound_limit", "bound_length", "stops")}
    for c in range(len(doc["k"])):
        k, length, best_open = int(doc["k"][c]), int(doc["length"][c]), doc["best_open"][c]
        finished = [(doc[f"ended{i}_total"][c] / length_penalty(int(doc[f"ended{i}_tokens"][c]),
                                                                 alpha),
                     [0] * int(doc[f"ended{i}_tokens"][c]))
                    for i in (1, 2) if not np.isnan(doc[f"ended{i}_total"][c])]
        open_beams = [_Beam([0] * length, best_open), _Beam([1] * length, best_open - 1.0)]
        computed["best_ended"].append(max(score for score, _ in finished))
        computed["bound_limit"].append(best_open / length_penalty(limit, alpha))
        computed["bound_length"].append(best_open / length_penalty(length, alpha))
        computed["stops"].append(float(_search_done(finished, open_beams, k, length, limit,
                                                    alpha)))
    stops = computed["stops"]
    assert 0.0 in stops and 1.0 in stops, "the example shows a search going on and one stopping"
    _assert_printed("beam_stop", {**{name: doc[name] for name in doc}, **computed})


# ------------------------------------------------------------------ sizes
KIB, MIB = 2**10, 2**20
FLOAT32 = 4  # bytes
SIZE = re.compile(r"\d[\d,.]*\s*(?:MiB|KiB|GiB|MB|kB|KB|GB|bytes)\b")
TIME = re.compile(r"\b\d[\d,.]*\s*(?:ns|µs|us|ms|s|seconds|minutes|hours)\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# How the doc names the configuration its sizes are about: a benchmark's step (bench/configs.py's
# CONFIGS), one of bench/configs.py's larger configurations, or a demo's preset.
SOURCE = re.compile(r"the (imdb|translation) benchmark's|`bench/configs\.py`'s `(\w+)`"
                    r"|`demos/(\w+)\.py`'s (\w+) preset")
BENCHMARK = {"imdb": "imdb", "translation": "seq2seq"}  # the doc's name -> CONFIGS' key


def _source_named(match: re.Match) -> tuple[str, ...]:
    """The configuration a SOURCE match names: ("benchmark", name), ("large", name) or
    ("preset", demo script, preset)."""
    benchmark, large, script, preset = match.groups()
    if benchmark:
        return ("benchmark", benchmark)
    return ("large", large) if large else ("preset", script, preset)


def _config(source: tuple[str, ...]):
    """The configuration object itself (never a copy of its numbers) a source names."""
    from bench import configs
    kind, *names = source
    if kind == "benchmark":
        return configs.CONFIGS[BENCHMARK[names[0]]]
    if kind == "large":
        return configs.LARGE[names[0]]
    script, preset = names
    return configs.demo_module(script).PRESETS[preset]


def _prose() -> str:
    """The doc without its code blocks (quotes of the source, checked above), each run of
    whitespace as one space, so a phrase may be found across the doc's line breaks."""
    kept, in_block = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            in_block = not in_block
        elif not in_block:
            kept.append(line)
    return re.sub(r"\s+", " ", " ".join(kept))


def _rounds_to(printed: str, value: float) -> bool:
    """Whether ``printed`` (thousands separated by commas) is ``value`` rounded to the
    decimals printed."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    half_unit = 0.5 * 10.0 ** -decimals
    return abs(float(printed.replace(",", "")) - value) <= half_unit + 1e-9 * abs(value)


def _mean_of_largest(low: int, high: int, count: int) -> float:
    """E[max] of ``count`` independent uniform integers in [low, high]:
    high - sum over j in [low, high) of P(max <= j)."""
    n = high - low + 1
    return high - sum(((j - low + 1) / n) ** count for j in range(low, high))


def _blocks_of(shape, block_scores: int) -> list:
    """The blocks (rows, keys, ...) the fast attention walks for queries and keys of
    ``shape`` (B, H, T, E), unmasked (a view of one zero: no memory)."""
    from npformer.fast import attention as fast_attention
    q = np.broadcast_to(np.zeros((), np.float32), shape)
    return list(fast_attention._blocks(q, q, None, None, block_scores))


NUMBER = r"(\d(?:[\d.,]*\d)?(?:\{,\}\d+)*)"  # 2, 0.625, 8,388,608, or LaTeX's 49{,}152


def _phrase(template: str) -> str:
    """The pattern of a phrase of the doc: the text as _prose gives it, each number in it
    replaced by {} (one group each)."""
    return NUMBER.join(re.escape(part) for part in template.split("{}"))


IMDB_STEP, TRANSLATION_STEP = ("benchmark", "imdb"), ("benchmark", "translation")
LM_LARGE, LM_DEFAULT = ("large", "lm_large"), ("preset", "generate", "default")


@functools.cache
def _quoted_sizes() -> list[tuple[str, tuple | None, str, tuple]]:
    """(what, source, phrase, values): every size the doc quotes, found by the stable phrase
    around it (:func:`_phrase`), the configuration the doc says it is about (:data:`SOURCE`;
    None for a constant of the code, which the phrase names) and its values computed from
    that configuration (:func:`_config`)."""
    from bench import configs
    from npformer import fast

    imdb, seq2seq, lm_large = _config(IMDB_STEP), _config(TRANSLATION_STEP), _config(LM_LARGE)
    lm_preset = _config(LM_DEFAULT)
    lm_cfg = configs.demo_module("generate").model_config(lm_preset, configs.SHAKESPEARE_VOCAB)
    assert lm_cfg.norm_first and lm_cfg.activation == "gelu" and lm_cfg.dropout == 0.0

    # the imdb benchmark's step: a padding mask over (B, H, T, T) scores
    b, h, t, d, d_ff = (imdb[k] for k in ("batch", "num_heads", "seq_len", "d_model", "d_ff"))
    scores = b * h * t * t
    low = t // 4  # the shortest valid length configs.make_batch draws (tested below)
    mean_length = (low + t) / 2
    rows = _blocks_of((b, h, t, d // h), fast.BLOCK_SCORES)[0][0][0]
    sequences = rows.stop - rows.start  # per block
    mean_seen = _mean_of_largest(low, t, sequences)
    fraction = mean_length / t
    positionwise = 4 * d * d + 2 * d * d_ff  # four projections (HE = D), two FFN maps
    packed = fraction * positionwise
    attention = 2 * mean_seen * d  # QK^T and PV over a block's kept keys, per query row
    step = (3 * packed + 3.5 * attention) / (3 * positionwise + 3.5 * attention)
    imdb_sizes = [
        ("imdb's P", "the demo's batch of B {} reviews and its H {} heads, the batch padded to "
                     "T = S = {}) that is {} numbers, {} MiB in float32",
         (b, h, t, scores, scores * FLOAT32 / MIB)),
        ("P in §18's opening", "keeps it for the backward (at the imdb benchmark's step, §9: "
                               "{} MiB in float32)",
         (scores * FLOAT32 / MIB,)),
        ("the blocked cache", r"(B {}, H {}, T = S = {}, a padding mask $(B, 1, 1, S)$, "
                              r"float32) that is {} KiB of $\text{lse}$, {} KiB of bias and two "
                              r"tables of {} integers, against {} MiB for $P$",
         (b, h, t, b * h * t * FLOAT32 / KIB, b * t * FLOAT32 / KIB, b, scores * FLOAT32 / MIB)),
        ("imdb's shapes in §22", "the demo's B {}, D {} = HE with H {}, $D_{ff}$ {}, the batch "
                                 "padded to T {}", (b, d, h, d_ff, t)),
        ("imdb's lengths", r"uniform integers in $[T/4, T] = [{}, {}]$, so $\mathbb E[T_b] = {}$ "
                           r"and $N/(BT) \approx {}/{} = {}$",
         (low, t, mean_length, mean_length, t, fraction)),
        ("position-wise products", r"$4 \cdot {}^2 + 2 \cdot {} \cdot {} = {}$ multiply-adds per "
                                   r"position and block in the forward, and packing cuts them to "
                                   r"${} \times {} = {}$",
         (d, d, d_ff, positionwise, fraction, positionwise, packed)),
        ("sequences per block", "`BLOCK_SCORES`$/(H T S) = {}$ sequences here", (sequences,)),
        ("kept keys", r"\mathbb E[S_{\text{seen}}] \approx {}$ (the larger of two uniform lengths "
                      r"lies about two thirds of the way from {} to {})", (mean_seen, low, t)),
        ("attention's products", r"2\,\mathbb E[S_{\text{seen}}]\,HE \approx {}$ multiply-adds",
         (attention,)),
        ("the forward's ratio", r"$({} + {})/({} + {}) \approx {}$ of the padded run's",
         (packed, attention, positionwise, attention,
          (packed + attention) / (positionwise + attention))),
        ("the step's ratio", r"$(3 \cdot {} + 3.5 \cdot {})/(3 \cdot {} + 3.5 \cdot {}) "
                             r"\approx {}$", (packed, attention, positionwise, attention, step)),
    ]
    # the block sizes, and the GPU benchmark's large language model
    gpu_scores = fast.attention.GPU_BLOCK_SCORES
    big = (lm_large["batch"], lm_large["num_heads"], lm_large["seq_len"],
           lm_large["d_model"] // lm_large["num_heads"])
    block_sizes = [
        ("BLOCK_SCORES", "`BLOCK_SCORES`, is $2^{{}}$ scores, {} MiB in float32",
         (math.log2(fast.BLOCK_SCORES), fast.BLOCK_SCORES * FLOAT32 / MIB)),
        ("GPU_BLOCK_SCORES", "`GPU_BLOCK_SCORES`, is {} times larger ({} MiB in float32)",
         (gpu_scores / fast.BLOCK_SCORES, gpu_scores * FLOAT32 / MIB)),
        ("lm_large's blocks", "`lm_large`: B {}, H {}, T = S = {}) walks {} blocks instead of {}",
         (*big[:3], len(_blocks_of(big, gpu_scores)), len(_blocks_of(big, fast.BLOCK_SCORES)))),
    ]
    # the translation benchmark's logits
    n_rows, vocab = seq2seq["batch"] * seq2seq["seq_len"], seq2seq["tgt_vocab_size"]
    logits = n_rows * vocab * FLOAT32 / MIB
    loss_sizes = [
        ("the logits", r"B {} sentences padded to T {}, so $N \le$ {} target positions, and a "
                       r"French vocabulary of V {} subword pieces) each $(N, V)$ float32 array "
                       r"is up to {} MiB",
         (seq2seq["batch"], seq2seq["seq_len"], n_rows, vocab, logits)),
        ("the loss's peak", "instead of two (at the translation benchmark's step, at most {} MiB "
                            "less)",
         (logits,)),
    ]
    # the language model demo's batch: what the fast layers do not keep
    n, blocks = lm_preset.batch_size * lm_cfg.block_size, lm_cfg.num_layers
    width, hidden = lm_cfg.d_model, lm_cfg.d_ff
    hidden_mib = n * hidden * FLOAT32 / MIB
    normed_kib = 2 * n * width * FLOAT32 / KIB
    p_mib = lm_preset.batch_size * lm_cfg.num_heads * lm_cfg.block_size ** 2 * FLOAT32 / MIB
    recompute_sizes = [
        ("the lm batch", "B {} windows of T {} characters, so $N = {}$ positions; D {}, "
                         "$D_{ff} = {}D = {}$, {} pre-norm blocks of H {} heads",
         (lm_preset.batch_size, lm_cfg.block_size, n, width, hidden / width, hidden, blocks,
          lm_cfg.num_heads)),
        ("the hidden layer", "| the hidden layer, the second linear map's input | $(N, D_{ff})$ | "
                             "{} MiB | {} MiB |",
         (hidden_mib, blocks * hidden_mib)),
        ("GELU's Phi", r"| GELU's $\Phi(x)$ | $(N, D_{ff})$ | {} MiB | {} MiB |",
         (hidden_mib, blocks * hidden_mib)),
        ("the normed inputs", r"| the two sublayer inputs $\text{LN}(x)$ | $2 \times (N, D)$ | "
                              r"{} KiB | {} MiB |", (normed_kib, blocks * normed_kib / KIB)),
        ("attention's P", r"| attention's $P$, for $\text{lse}$ ({} KiB a block) | $(B, H, T, T)$ "
                          r"| {} MiB | {} MiB |",
         (n * lm_cfg.num_heads * FLOAT32 / KIB, p_mib, blocks * p_mib)),
        ("the head's input", "the head's input, $(N, D)$, {} KiB once",
         (n * width * FLOAT32 / KIB,)),
    ]
    groups = [(IMDB_STEP, imdb_sizes), (None, block_sizes[:2]), (LM_LARGE, block_sizes[2:]),
              (TRANSLATION_STEP, loss_sizes), (LM_DEFAULT, recompute_sizes)]
    return [(what, source, _phrase(template), values)
            for source, sizes in groups for what, template, values in sizes]


def test_the_imdb_benchmarks_lengths_are_as_the_doc_says():
    """The valid lengths §22's arithmetic assumes: uniform integers in [T/4, T]."""
    from bench import configs
    imdb = configs.CONFIGS["imdb"]
    t = imdb["seq_len"]
    lengths = np.concatenate([configs.make_batch(imdb, seed)[1] for seed in range(40)])
    assert lengths.min() == t // 4 and lengths.max() == t
    counts = np.bincount(lengths - t // 4, minlength=t - t // 4 + 1)
    assert counts.min() > 0 and len(counts) == t - t // 4 + 1  # every length in the range drawn


@pytest.mark.parametrize("what", [what for what, _, _, _ in _quoted_sizes()])
def test_each_quoted_size_is_what_the_presets_give(what):
    """The size is found once, the configuration the doc names last before it is the one its
    values are computed from, and each printed number is that configuration's."""
    source, phrase, values = next((s, p, v) for w, s, p, v in _quoted_sizes() if w == what)
    text = _prose()
    matches = list(re.finditer(phrase, text))
    assert len(matches) == 1, f"{what}: the phrase is found {len(matches)} times, not once"
    if source is not None:
        named = [_source_named(m) for m in SOURCE.finditer(text) if m.start() < matches[0].start()]
        assert named and named[-1] == source, (
            f"{what}: the doc says it is about {named[-1] if named else 'no configuration'}, "
            f"the test computes it from {source}")
    printed = [g.replace("{,}", ",") for g in matches[0].groups()]
    assert len(printed) == len(values), what
    wrong = [(p, v) for p, v in zip(printed, values) if not _rounds_to(p, v)]
    assert not wrong, f"{what}: the doc prints {wrong[0][0]}, the presets give {wrong[0][1]!r}"


def test_every_size_the_doc_quotes_is_checked():
    """A size (a number of bytes, KiB, MiB, ...) outside every phrase _quoted_sizes finds is
    a size nobody recomputes: it fails here, naming it."""
    text = _prose()
    covered = [m.span() for _, _, phrase, _ in _quoted_sizes() for m in re.finditer(phrase, text)]
    unchecked = [f"{m.group()!r} in ...{text[max(0, m.start() - 60):m.end()]}"
                 for m in SIZE.finditer(text)
                 if not any(start <= m.start() and m.end() <= end for start, end in covered)]
    assert not unchecked, "sizes the doc quotes with no test:\n" + "\n".join(unchecked)


def test_the_doc_quotes_no_timing_and_no_date():
    """Timings and the dates they were measured on live in bench/README.md, with their
    commands; the derivations hold what the tests hold."""
    text = _prose()
    found = [m.group() for m in TIME.finditer(text)] + [m.group() for m in DATE.finditer(text)]
    assert not found, f"docs/derivations.md quotes timings or dates: {found}"


# ------------------------------------------------------------------ the Markdown itself
def _markdown_files() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


def test_no_markdown_file_holds_a_control_character():
    """Below 0x20 only the newline belongs in Markdown: a tab or a backspace inside LaTeX is a
    swallowed backslash (\\t of \\text, \\b of \\beta), which renders as nonsense."""
    found = []
    for path in _markdown_files():
        for number, line in enumerate(path.read_text().split("\n"), 1):
            found += [f"{path.relative_to(ROOT)}:{number}:{column}: {char!r}"
                      for column, char in enumerate(line, 1) if ord(char) < 0x20]
    assert not found, "control characters:\n" + "\n".join(found)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_to_a_section_leads_to_a_heading():
    text = DOC.read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}
    broken = sorted(set(re.findall(r"\]\(#([^)]+)\)", text)) - anchors)
    assert not broken, f"links to no heading: {broken}"


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


# ------------------------------------------------------------------ names in the prose
def _is_module(parts: list[str]) -> bool:
    """Whether this checkout has the module ``parts`` (a file or a package): asked of the
    files, not of the import system, which an installed copy elsewhere may answer."""
    path = ROOT.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module of npformer, or a name (a chain of attributes) in one."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        if not _is_module(parts[:split]):
            continue
        found = importlib.import_module(".".join(parts[:split]))
        for name in parts[split:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def test_every_file_and_module_the_doc_names_exists():
    """The prose's file paths (`npformer/ops/contracts.py`, a folder as `npformer/fast/`, a
    glob as `docs/figures/*.svg`) and its dotted names (`npformer.optim.warmup_cosine`) are
    checked as the quotes are: a file moved or a module removed fails here, naming it."""
    text = DOC.read_text()
    missing = [f"no file {path}" for path in sorted(set(FILE.findall(text)))
               if not any(ROOT.glob(path.rstrip("/")))]
    missing += [f"no module or name {name}" for name in sorted(set(DOTTED.findall(text)))
                if not _resolves(name)]
    assert not missing, "docs/derivations.md names what does not exist:\n" + "\n".join(missing)


# ------------------------------------------------------------------ what a user's clone holds
OUTSIDE = re.compile(r"\.\./shared\b")  # the development machine's neighbour of the checkout
DOCUMENTS = ["README.md", "docs/*.md", "demos/README.md", "bench/README.md", "tests/README.md"]
CODE = ["npformer/**/*.py", "demos/*.py", "bench/*.py", "tools/*.py", "tests/*.py"]


def test_nothing_names_a_path_outside_the_repository():
    """A user's clone has no neighbour folder of the development machine: no document and no
    code names one (the tests find that machine's data through conftest's SHARED_DATA and
    $NPFORMER_DATA)."""
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for pattern in DOCUMENTS + CODE for path in sorted(ROOT.glob(pattern))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if OUTSIDE.search(line)]
    assert not found, "paths outside the repository:\n" + "\n".join(found)


def test_no_docstring_or_comment_of_the_library_or_the_demos_holds_a_date():
    """Dated measurements live in bench/README.md and demos/README.md, with their commands;
    the code says why, not what a machine measured on a day."""
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for pattern in ("npformer/**/*.py", "demos/*.py")
             for path in sorted(ROOT.glob(pattern))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if DATE.search(line)]
    assert not found, "dates in the code:\n" + "\n".join(found)


# ------------------------------------------------------------------ the tests' index
TESTS_INDEX = ROOT / "tests" / "README.md"
TEST_FILE = re.compile(r"\b(test_\w+\.py)\b")
TEST_REFERENCE = re.compile(r"`(test_\w+\.py)::([\w*]+)`((?:,\s*`[\w*]+`)*)")


def test_the_tests_index_names_every_test_file_and_only_those():
    """tests/README.md maps each subject to its tests: every test file of tests/ is in it,
    and every file it names exists."""
    named = set(TEST_FILE.findall(TESTS_INDEX.read_text(encoding="utf-8")))
    present = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    assert not present - named, f"missing from tests/README.md: {sorted(present - named)}"
    assert not named - present, f"tests/README.md names no such file: {sorted(named - present)}"


def test_every_test_function_the_index_names_exists():
    """`test_x.py::test_name` (a `*` for any ending), and the names listed after it, are
    test functions of that file."""
    import fnmatch
    missing = []
    for match in TEST_REFERENCE.finditer(TESTS_INDEX.read_text(encoding="utf-8")):
        file, first, rest = match.groups()
        tree = ast.parse((ROOT / "tests" / file).read_text(encoding="utf-8"))
        defined = [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
        for name in [first] + re.findall(r"`([\w*]+)`", rest):
            if not fnmatch.filter(defined, name):
                missing.append(f"{file}::{name}")
    assert not missing, "tests/README.md names tests that do not exist:\n" + "\n".join(missing)


def test_the_guides_layout_is_the_tree():
    """docs/guide.md's "What is inside" names every folder and module at the top of
    npformer/ (not __init__.py), and nothing that is not there."""
    guide = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    block = guide.split("## What is inside", 1)[1].split("```", 2)[1]
    package = block.split("npformer/\n", 1)[1].split("\ndemos/", 1)[0]
    named = set(re.findall(r"^  (\w+(?:\.py|/))", package, flags=re.M))
    tree = {p.name + ("/" if p.is_dir() else "") for p in (ROOT / "npformer").iterdir()
            if (p.is_dir() and (p / "__init__.py").exists())
            or (p.suffix == ".py" and p.name != "__init__.py")}
    assert named == tree, (f"the guide names {sorted(named - tree)} that npformer/ lacks, and "
                           f"lacks {sorted(tree - named)}")


@pytest.mark.parametrize("argv", [[], ["--backward"]], ids=["forward", "backward"])
def test_the_reading_paths_match_the_code(argv, capsys):
    """tools/reading_path.py's stops (the README's reading path, forward and backward) are
    still definitions holding the lines that lead on."""
    spec = importlib.util.spec_from_file_location("reading_path",
                                                  ROOT / "tools" / "reading_path.py")
    reading_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reading_path)
    assert reading_path.main(argv) == 0, capsys.readouterr().err


def _collected(*args: str) -> set[str]:
    """The test ids pytest collects with ``args``."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "-p", "no:cacheprovider", *args], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    return {line for line in result.stdout.splitlines() if "::" in line}


def test_the_gradient_checks_give_their_time_and_a_one_minute_subset():
    """issue 47 case 25: the gradient-check command ran 446 tests with no time given
    (more than 6 minutes on a loaded machine).  docs/guide.md gives the time and a
    subset, which still checks every op and layer (each test function keeps a case)."""
    import shlex

    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("## Gradient checks", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^python -m pytest (.*?)\s+# (\d+)$", section, re.MULTILINE)
    assert len(commands) == 2, commands
    (files, whole), (subset_args, part) = commands
    assert re.search(r"\d+ min \d+ s", section) and "one-minute subset" in section
    everything = _collected(*shlex.split(files))
    subset = _collected(*shlex.split(subset_args))
    assert len(everything) == int(whole) and len(subset) == int(part), (len(everything),
                                                                        len(subset))
    assert subset < everything
    assert {t.split("[")[0] for t in subset} == {t.split("[")[0] for t in everything}


# ------------------------------------------------------------------ citations of the doc's sections
CITED_IN = ["README.md", "docs/*.md", "demos/README.md", "bench/README.md", "tests/README.md",
            "exercises/README.md", "npformer/**/*.py", "demos/*.py", "tools/*.py",
            "tests/*.py", "docs/*.py", "exercises/*.py"]
# §12, §12's, (§12); "derivations.md §1", "derivations.md`, section 11"; never a paper's §5.4,
# nor a section of a paper cited by author and year just before it.
SECTION_SIGN = re.compile(r"§\s*(\d+)(?![.\d]\d)")
SECTION_WORD = re.compile(r"derivations\.md`?,?\s+(?:section|§)\s*(\d+)(?![.\d]\d)", re.IGNORECASE)
PAPER = re.compile(r"(?:et al\.|\b(?:19|20)\d\d|the paper),?\s*$")


def _sections() -> dict[int, list[str]]:
    """{number: [the section's title, then the titles of its subsections]} of the doc."""
    sections, current = {}, None
    for line in DOC.read_text().splitlines():
        top = re.match(r"^## (\d+)\. (.+)$", line)
        if top:
            current = int(top.group(1))
            sections[current] = [top.group(2).strip()]
        elif line.startswith("## ") or line.startswith("# "):
            current = None
        elif line.startswith("### ") and current is not None:
            sections[current].append(line[4:].strip())
    return sections


def _names(title: str) -> set[str]:
    """The names a heading gives its subject: the title, the part before its colon, and a
    parenthesised abbreviation (``Low-rank adapters (LoRA)`` gives LoRA too)."""
    names = {title, title.split(":")[0].strip()}
    names |= {m.group(1) for m in re.finditer(r"\(([^()]+)\)", title)}
    names |= {re.sub(r"\s*\([^()]*\)", "", name).strip() for name in list(names)}
    return {name for name in names if len(name) >= 4 and "$" not in name}


def _citations():
    """(file:line, number, the text before the citation, the text after it) of every
    citation of a section of docs/derivations.md in the repository's documents and code."""
    for pattern in CITED_IN:
        for path in sorted(ROOT.glob(pattern)):
            if path.name == "test_docs.py":
                continue
            text = path.read_text(encoding="utf-8")
            own = path == DOC
            for regex in (SECTION_SIGN,) + (() if own else (SECTION_WORD,)):
                for match in regex.finditer(text):
                    just_before = text[max(0, match.start() - 20):match.start()]
                    if regex is SECTION_SIGN and "derivations.md" in just_before:
                        continue  # found by SECTION_WORD
                    before = text[max(0, match.start() - 60):match.start()]
                    if regex is SECTION_SIGN and PAPER.search(before):
                        continue
                    line = text.count("\n", 0, match.start()) + 1
                    yield (f"{path.relative_to(ROOT)}:{line}", int(match.group(1)), before,
                           text[match.end():match.end() + 60])


def test_every_cited_section_exists_under_the_title_the_citation_gives():
    """Every "§N" (and "derivations.md, section N") in the documents and the code is a
    section of docs/derivations.md.  Where the citation names a heading's subject (a
    section's or a subsection's: "RMSNorm (§6)", "§12's rotary positions", "§6 Layer norm",
    "[§9](#9-scaled-dot-product-attention)"), that subject is in section N: a subsection
    moved to another section, or a section renumbered, fails here, naming the citation."""
    sections = _sections()
    assert sections and sorted(sections) == list(range(len(sections))), sorted(sections)
    owner: dict[str, set[int]] = {}
    for number, titles in sections.items():
        for title in titles:
            for name in _names(title):
                owner.setdefault(name.lower(), set()).add(number)
    unique = {name: numbers.pop() for name, numbers in owner.items() if len(numbers) == 1}
    wrong, count = [], 0
    for where, number, before, after in _citations():
        count += 1
        if number not in sections:
            wrong.append(f"{where}: §{number}, which the doc does not have")
            continue
        link = re.match(r"\]\(#([^)]+)\)", after)
        if link and link.group(1).split("-")[0].isdigit():
            if link.group(1) != _slug(f"{number}. {sections[number][0]}"):
                wrong.append(f"{where}: [§{number}](#{link.group(1)}), whose heading is "
                             f"'{number}. {sections[number][0]}'")
            continue
        # the subject named just before "(§6)", or just after "§6's" or "§6 " (a title)
        before = " ".join(before.split())
        after = " ".join(after.split())
        for name, home in unique.items():
            word = re.escape(name)
            here = any(re.search(rf"(?<!\w){word}(?!\w)", title, re.I)
                       for title in sections[number])
            if not here and (
                    (after.startswith(")") and re.search(rf"(?<!\w){word} \($", before, re.I))
                    or re.match(rf"'s {word}(?!\w)", after, re.I)
                    or re.match(rf" {word}(?!\w)", after)):
                wrong.append(f"{where}: {name} cited as §{number}; the doc has it in "
                             f"§{home}, {sections[home][0]!r}")
    assert count > 100, count  # the doc cites itself, and the README and the code cite it
    assert not wrong, "citations of docs/derivations.md's sections:\n" + "\n".join(wrong)


# ------------------------------------------------------------------ docs/llama.md's float64 table
LLAMA_DOC = ROOT / "docs" / "llama.md"
GAP_ROWS = {"plain float64": "plain", "RMS norms in float64": "norms64",
            "rotary tables in float64": "rotary64",
            "both in float64 (the tests' reference)": "patched"}
GAP_COLUMNS = ["default rotary", "llama3 rotary"]


def test_the_llama_float64_table_is_what_the_tool_prints(capsys):
    """docs/llama.md's differences between npformer's float64 Llama and transformers' (plain,
    and with its RMS norms and/or rotary tables in float64) are tools/llama_float64_gap.py's
    output; a difference at rounding (below 1e-12) is held to that only."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    lines = LLAMA_DOC.read_text().splitlines()
    start = lines.index("<!-- llama_float64_gap -->")
    rows = [line.strip("|").split("|") for line in lines[start + 3:start + 3 + len(GAP_ROWS)]]
    printed = {(GAP_ROWS[cells[0].strip()], column): cells[i + 1].strip()
               for cells in rows for i, column in enumerate(GAP_COLUMNS)}
    assert len(printed) == len(GAP_ROWS) * len(GAP_COLUMNS), printed
    spec = importlib.util.spec_from_file_location("llama_float64_gap",
                                                  ROOT / "tools" / "llama_float64_gap.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    from npformer import backend
    previous = backend.backend_name(), backend.default_float_name()
    try:
        tool.main()
    finally:
        backend.set_backend(previous[0])
        backend.set_default_float(previous[1])
    measured = {}
    for line in capsys.readouterr().out.splitlines()[1:]:
        *model, kind, gap, _ = line.split()
        measured[(kind, "default rotary" if model[0] == "default" else "llama3 rotary")] = gap
    for key, cell in printed.items():
        gap = measured[key]
        if float(cell) < 1e-12:
            assert float(gap) < 1e-12, f"{key}: the doc says {cell}, the tool prints {gap}"
        else:
            assert cell == gap, f"{key}: the doc says {cell}, the tool prints {gap}"
