"""The course's checker: is the backward you wrote right, and if not, where is it wrong?

    python exercises/check.py              the course as a table: done / wrong / not started
    python exercises/check.py layernorm    one exercise, checked harder, with what is wrong

Each exercise is a file of this folder (``layernorm.py``) that gives an op's forward and
leaves its backward to you, and a spec in ``exercises/course/`` (``course/layernorm.py``)
that says how to check it: the textbook op of :mod:`npformer.ops` it must agree with,
the names of its gradients, the inputs to draw and the hints.  For every part of an
exercise (a forward and its backward), on the edge cases first and then on shapes and
values drawn by Hypothesis (float64, derandomized: the same cases every run):

1. your forward's output is compared with the textbook's (the forward is given: a
   forward that differs is reported as the forward);
2. your backward runs (``NotImplementedError`` is "not started"; another exception is
   reported in one line, with the line of your file that raised it);
3. its gradients are compared, by name and shape, with the textbook backward's on the
   same inputs and the same upstream gradient;
4. and with central differences of your forward (:func:`npformer.gradcheck.check_op`).

The first problem found is reported in your terms: which gradient, its shape, its largest
error and where it sits, and the step of the derivation (docs/derivations.md) to revisit.

From Python (a notebook, a test): ``check("layernorm")`` checks the exercise file,
``check("layernorm", module=m)`` the functions ``m`` provides (any object with the
exercise's function names as attributes; the names it lacks come from the exercise file).
"""
from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import linecache
import pkgutil
import re
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DERIVATIONS = ROOT / "docs" / "derivations.md"

TOLERANCE = 1e-6  # the test suite's GRADCHECK_TOL: right is ~1e-9, wrong is ~1e-1
FORWARD_TOLERANCE = 1e-9  # the forward is given: yours must be the textbook's to rounding
QUICK_EXAMPLES = 3  # drawn cases per part in the table (the edge cases run as well)
FULL_EXAMPLES = 25  # drawn cases per part when one exercise is checked

DONE, WRONG, NOT_STARTED = "done", "wrong", "not started"


# =========================================================================== the registry
@dataclass
class Case:
    """One set of inputs of a forward: host NumPy arrays (float64) and other values."""

    args: list  # the forward's positional arguments
    kwargs: dict = field(default_factory=dict)  # and its keyword arguments
    seed: int | None = None  # a random forward (dropout): backend.seed(seed) before each call


@dataclass
class Part:
    """A forward the exercise file gives and the backward the reader writes.

    ``make(rng, **sizes) -> Case`` builds the inputs from sizes drawn from ``sizes`` (a
    dict of Hypothesis strategies; a size may also be a switch, such as a fully masked
    row); ``edge_cases`` are (what, sizes) run before any drawn case.  ``textbook`` is
    npformer's (forward, backward), which must return the gradients ``grads`` in that
    order (adapt it with a small function where npformer's returns more or fewer).
    ``hints`` maps a gradient's name to the step of the derivation to revisit.
    """

    forward: str  # the forward's name in the exercise file
    backward: str  # the backward's name in the exercise file
    textbook: tuple[Callable, Callable]  # npformer's forward and backward
    grads: tuple[str, ...]  # the names of the backward's gradients, in its order
    wrt: tuple[int, ...]  # the forward's positional arguments they are the gradients of
    make: Callable[..., Case]
    sizes: dict  # name -> Hypothesis strategy
    edge_cases: list = field(default_factory=list)  # (what, sizes)
    hints: dict = field(default_factory=dict)  # gradient name -> what to revisit


@dataclass
class Mistake:
    """A wrong backward learners write, which the checker must report as wrong, naming
    ``gradient`` (the checker's own test, tests/test_exercises.py, runs every one).
    ``backward`` is written against the exercise file's saved values; ``part``: the backward's
    name where the exercise has several parts (default: the first)."""

    what: str
    gradient: str
    backward: Callable
    part: str = ""


@dataclass
class Exercise:
    """An exercise file (``file``, in exercises/) and its parts.

    ``section`` is the start of the title of its section of docs/derivations.md
    ("Layer norm"): the section's number and full title are read from the document, so
    the course follows the document's order and numbering.  ``order`` sorts exercises
    of the same section.  ``mistakes``: at least three wrong backwards learners write.
    """

    name: str
    file: str
    section: str
    parts: list
    order: float = 0.0
    mistakes: list = field(default_factory=list)


def exercises() -> dict[str, Exercise]:
    """Every exercise, in the order of docs/derivations.md: each module of
    exercises/course/ defines ``EXERCISE`` (or a list, ``EXERCISES``)."""
    from exercises import course

    found = []
    for info in pkgutil.iter_modules(course.__path__):
        if info.name.startswith("_"):
            continue
        spec = importlib.import_module(f"exercises.course.{info.name}")
        found += list(getattr(spec, "EXERCISES", [])) + (
            [spec.EXERCISE] if hasattr(spec, "EXERCISE") else [])
    sections = _sections()

    def key(ex: Exercise):
        number = section_of(ex, sections)[0]
        return (number if number is not None else 10**6, ex.order, ex.name)
    return {ex.name: ex for ex in sorted(found, key=key)}


# =========================================================================== the document
def _sections() -> list[tuple[int, str, list[str]]]:
    """(number, title, [subsection titles]) of every numbered section of the derivations."""
    sections: list[tuple[int, str, list[str]]] = []
    if not DERIVATIONS.is_file():
        return sections
    for line in DERIVATIONS.read_text(encoding="utf-8").splitlines():
        numbered = re.match(r"## (\d+)\.\s+(.+?)\s*$", line)
        if numbered:
            sections.append((int(numbered.group(1)), numbered.group(2), []))
        elif line.startswith("### ") and sections:
            sections[-1][2].append(line[4:].strip())
    return sections


def section_of(exercise: Exercise, sections=None) -> tuple[int | None, str]:
    """(number, title) of the exercise's section, read from docs/derivations.md: the first
    section whose title starts with ``exercise.section``, else the section holding a
    subsection that does (then the subsection's title); (None, the key) if none."""
    sections = _sections() if sections is None else sections
    key = exercise.section.lower()
    for number, title, _ in sections:
        if title.lower().startswith(key):
            return number, title
    for number, _, subsections in sections:
        for sub in subsections:
            if sub.lower().startswith(key):
                return number, sub
    return None, exercise.section


def section_label(exercise: Exercise) -> str:
    """"§6 Layer norm": how the exercise file and the messages name the section."""
    number, title = section_of(exercise)
    return f"§{number if number is not None else '?'} {title}"


HEADER = re.compile(r"^(# Derivation: docs/derivations\.md, )(.*)$", re.MULTILINE)


def sync_sections() -> list[str]:
    """Rewrite each exercise file's ``# Derivation: docs/derivations.md, §N Title`` line
    from the document (after a renumbering); returns the files changed."""
    changed = []
    for ex in exercises().values():
        path = HERE / ex.file
        text = path.read_text(encoding="utf-8")
        new = HEADER.sub(lambda m, ex=ex: m.group(1) + section_label(ex), text, count=1)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(ex.file)
    return changed


# =========================================================================== the report
@dataclass
class Report:
    """What the checker found: ``status`` (done, wrong, not started), the gradient at
    fault (its name, or the forward's, or ""), and ``message`` for the reader."""

    name: str
    section: str
    status: str
    message: str
    gradient: str = ""
    seconds: float = 0.0
    wrong: tuple = ()  # every gradient found wrong on that case, the worst first

    def __str__(self) -> str:
        return self.message


class _Found(Exception):
    """Raised inside a Hypothesis property to stop at the first problem."""

    def __init__(self, problem: dict):
        super().__init__(problem.get("headline", ""))
        self.problem = problem


def load_file(exercise: Exercise) -> ModuleType:
    """The exercise file, loaded afresh (your latest edits)."""
    path = HERE / exercise.file
    spec = importlib.util.spec_from_file_location(f"_npformer_exercise_{exercise.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Overlay:
    """``module``'s attributes, then the exercise file's."""

    def __init__(self, module: Any, fallback: ModuleType | None):
        self._module, self._fallback = module, fallback

    def __getattr__(self, name: str):
        if hasattr(self._module, name):
            return getattr(self._module, name)
        if self._fallback is None:
            raise AttributeError(name)
        return getattr(self._fallback, name)


@contextmanager
def _float64_numpy():
    """The checks run on NumPy in float64 (the backend's settings restored afterwards)."""
    from npformer import backend

    previous_name, previous_dtype = backend.backend_name(), backend.default_float_name()
    if previous_name != "numpy":
        backend.set_backend("numpy")
    backend.set_default_float("float64")
    try:
        yield
    finally:
        if previous_name != "numpy":
            backend.set_backend(previous_name)
        backend.set_default_float(previous_dtype)


def _shown(filename: str) -> str:
    """A file's path from the repository's root (exercises/linear.py), else its name."""
    path = Path(filename).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _raised(error: BaseException, source_file: str | None) -> tuple[str, str]:
    """(``ValueError: ...`` with the line of the reader's file that raised it and the
    shapes of the arrays there, the name the line assigns to or "")."""
    text = str(error).strip().splitlines()
    what = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    mine = [f for f in frames if source_file and Path(f[0].f_code.co_filename) == Path(source_file)]
    if not mine:
        mine = [f for f in frames
                if Path(f[0].f_code.co_filename).resolve() != Path(__file__).resolve()]
    assigned = ""
    if mine:
        frame, lineno = mine[-1]
        line = linecache.getline(frame.f_code.co_filename, lineno).strip()
        what += f"\n    at {_shown(frame.f_code.co_filename)}, line {lineno}: {line}"
        shapes = [f"{k} {tuple(v.shape)}" for k, v in frame.f_locals.items()
                  if isinstance(v, np.ndarray) and v.ndim > 0]
        if shapes:
            what += f"\n    the arrays there: {', '.join(shapes)}"
        target = re.match(r"(\w+)\s*=[^=]", line)
        assigned = target.group(1) if target else ""
    return what, assigned


def _source_of(function: Callable) -> str | None:
    code = getattr(function, "__code__", None)
    return code.co_filename if code is not None else None


def _describe(case: Case, forward: Callable) -> str:
    from npformer.gradcheck import argument_names

    names = argument_names(forward, len(case.args))
    shown = []
    for i, (name, value) in enumerate(zip(names, case.args)):
        label = name or f"argument {i}"
        if isinstance(value, np.ndarray):
            kind = "" if value.dtype.kind == "f" else f" {value.dtype}"
            shown.append(f"{label} {tuple(value.shape)}{kind}")
        elif value is not None:
            shown.append(f"{label}={value!r}")
    shown += [f"{k}={v!r}" for k, v in case.kwargs.items()
              if not isinstance(v, np.ndarray)]
    shown += [f"{k} {tuple(v.shape)} {v.dtype}" for k, v in case.kwargs.items()
              if isinstance(v, np.ndarray)]
    return ", ".join(shown)


def _as_tuple(grads) -> tuple:
    return grads if isinstance(grads, tuple | list) else (grads,)


def _diagnosis(yours: np.ndarray, expected: np.ndarray) -> str:
    """What the difference looks like: a sign, a constant factor, a transpose, zeros, NaN."""
    if not np.all(np.isfinite(yours)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(yours))[0])
        return f"yours holds NaN or inf (first at index {bad}): a division by zero?"
    scale = float(np.max(np.abs(expected), initial=0.0))
    if scale == 0.0:
        return "the textbook's is zero everywhere here"
    if not np.any(yours):
        return "yours is zero everywhere"
    big = np.abs(expected) > 1e-3 * scale
    ratios = yours[big] / expected[big]
    if ratios.size > 1 and np.allclose(ratios, ratios[0], rtol=1e-6, atol=0.0):
        factor = float(ratios[0])
        if np.allclose(yours, factor * expected, rtol=1e-6, atol=1e-9 * scale):
            if abs(factor + 1.0) < 1e-6:
                return "yours is the textbook's with the opposite sign"
            return f"yours is the textbook's times {factor:.6g}: a factor missing or extra"
    if yours.ndim >= 2 and yours.shape[-1] == yours.shape[-2] and np.allclose(
            np.swapaxes(yours, -1, -2), expected, rtol=1e-6, atol=1e-9 * scale):
        return "yours is the textbook's transposed"
    return ""


def _hint(exercise: Exercise, part: Part, gradient: str) -> str:
    hint = part.hints.get(gradient) or part.hints.get("*", "")
    if not hint and gradient == part.backward:  # no one gradient at fault: every hint
        hint = "; ".join(f"{name}: {part.hints[name]}" for name in part.grads
                         if name in part.hints)
    number, title = section_of(exercise)
    where = f'revisit §{number if number is not None else "?"} "{title}"'
    return f"{where}: {hint}" if hint else where


def _check_case(exercise: Exercise, part: Part, impl: Any, case: Case) -> dict | None:
    """The first problem of ``impl`` on one case, or None."""
    from npformer import backend
    from npformer.gradcheck import check_op, compare

    forward, backward = getattr(impl, part.forward), getattr(impl, part.backward)
    book_forward, book_backward = part.textbook
    inputs = f"inputs: {_describe(case, book_forward)}"

    def fresh_args():
        return [backend.asarray(a.copy()) if isinstance(a, np.ndarray) else copy.copy(a)
                for a in case.args]

    def run_forward(function, *args, **kwargs):
        if case.seed is not None:
            backend.seed(case.seed)
        return function(*args, **kwargs)

    book_out, book_cache = run_forward(book_forward, *fresh_args(), **case.kwargs)
    book_out = backend.to_numpy(book_out)
    try:
        out, saved = run_forward(forward, *fresh_args(), **case.kwargs)
        out = np.asarray(backend.to_numpy(out), dtype=np.float64)
    except Exception as error:  # the forward is given: the reader changed it
        return dict(status=WRONG, gradient=part.forward,
                    headline=f"{part.forward} (the forward) raised",
                    lines=[_raised(error, _source_of(forward))[0], inputs,
                           "the forward is given: restore it from the exercise's original"])
    if out.shape != book_out.shape or not np.allclose(
            out, book_out, rtol=FORWARD_TOLERANCE,
            atol=FORWARD_TOLERANCE * max(1.0, float(np.max(np.abs(book_out), initial=0.0)))):
        detail = (f"its output has shape {out.shape}, the textbook's {book_out.shape}"
                  if out.shape != book_out.shape else
                  f"its output differs from the textbook's by up to "
                  f"{float(np.max(np.abs(out - book_out))):.3g}")
        return dict(status=WRONG, gradient=part.forward,
                    headline=f"{part.forward} (the forward) is not the textbook's",
                    lines=[detail, inputs, "the backward is checked once the forward is "
                           "right: restore the forward the exercise gives"])

    upstream = np.random.default_rng(1234).standard_normal(book_out.shape)
    try:
        grads = _as_tuple(backward(backend.asarray(upstream.copy()), saved))
    except NotImplementedError:
        return dict(status=NOT_STARTED, gradient=part.backward,
                    headline=f"{part.backward} not started", lines=[])
    except Exception as error:
        what, assigned = _raised(error, _source_of(backward))
        gradient = assigned if assigned in part.grads else part.backward
        headline = f"{part.backward} raised" + (
            f" computing {gradient}" if gradient != part.backward else "")
        return dict(status=WRONG, gradient=gradient, headline=headline,
                    lines=[what, inputs, _hint(exercise, part, gradient)])
    book_grads = _as_tuple(book_backward(backend.asarray(upstream.copy()), book_cache))
    expected_names = ", ".join(part.grads)
    if len(grads) != len(part.grads):
        return dict(status=WRONG, gradient=part.backward,
                    headline=f"{part.backward} returned {len(grads)} gradient(s), "
                             f"expected {len(part.grads)}: {expected_names}, in that order",
                    lines=[inputs, _hint(exercise, part, "*")])
    yours, book = {}, {}
    shapes = [tuple(np.shape(backend.to_numpy(g))) if g is not None else None for g in grads]
    book_shapes = [tuple(np.shape(backend.to_numpy(b))) for b in book_grads]
    reordered = (None not in shapes and shapes != book_shapes
                 and sorted(shapes) == sorted(book_shapes))
    for name, g, b in zip(part.grads, grads, book_grads):
        b = np.asarray(backend.to_numpy(b), dtype=np.float64)
        if g is None:
            return dict(status=WRONG, gradient=name, headline=f"{name} is None",
                        lines=[f"expected shape {b.shape}", inputs, _hint(exercise, part, name)])
        g = np.asarray(backend.to_numpy(g), dtype=np.float64)
        if g.shape != b.shape:
            transposed = g.shape == b.shape[::-1] and g.ndim >= 2
            why = ("a transpose missing?" if transposed else
                   "a gradient has the shape of what it is the gradient of")
            if reordered:
                why = (f"the gradients returned in another order? {part.backward} returns "
                       f"{expected_names}, in that order")
            return dict(status=WRONG, gradient=name,
                        headline=f"{name} has shape {g.shape}, expected {b.shape}",
                        lines=[why, inputs, _hint(exercise, part, name)])
        yours[name], book[name] = g, b
    result = compare(yours, book)
    if not result.passed(TOLERANCE):
        name = result.worst_name
        where = f"at index {result.worst_index}" if result.worst_index else "(a scalar)"
        right = [n for n in part.grads if result.errors[n] < TOLERANCE]
        lines = [f"largest error {result.worst_error:.1e} (relative to its scale) {where}: "
                 f"yours {result.worst_analytic:.6g}, the textbook's {result.worst_numeric:.6g}"]
        diagnosis = _diagnosis(yours[name], book[name])
        if diagnosis:
            lines.append(diagnosis)
        also = [n for n in part.grads if n != name and result.errors[n] >= TOLERANCE]
        if also:
            lines.append(f"also wrong: {', '.join(also)}")
        if right:
            lines.append(f"right: {', '.join(right)}")
        lines += [inputs, _hint(exercise, part, name)]
        return dict(status=WRONG, gradient=name, wrong=(name, *also),
                    headline=f"{name} (shape {yours[name].shape}) differs from the textbook's",
                    lines=lines)

    def reseeded(*args, **kwargs):
        return run_forward(forward, *args, **kwargs)
    numeric = check_op(reseeded, backward, fresh_args(), list(part.wrt), case.kwargs,
                       names=part.grads)
    if not numeric.passed(TOLERANCE):
        name = numeric.worst_name
        return dict(status=WRONG, gradient=name,
                    headline=f"{name} disagrees with central differences of your forward",
                    lines=[numeric.message(TOLERANCE), inputs, _hint(exercise, part, name)])
    return None


def _check_part(exercise: Exercise, part: Part, impl: Any, examples: int) -> dict | None:
    """The first problem over the edge cases, then Hypothesis's drawn cases."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    def run(sizes: dict, seed: int, what: str) -> None:
        case = part.make(np.random.default_rng(seed), **sizes)
        own = getattr(part, "check_case", None)  # a part that is no backward (_step.py)
        problem = own(exercise, impl, case) if own else _check_case(exercise, part, impl, case)
        if problem is not None:
            problem["case"] = what
            raise _Found(problem)

    try:
        for what, sizes in part.edge_cases:
            run(dict(sizes), 0, f"the edge case: {what}")
        if examples <= 0:
            return None

        @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck),
                  phases=(Phase.explicit, Phase.generate, Phase.shrink))
        @given(sizes=st.fixed_dictionaries(part.sizes), seed=st.integers(0, 2**32 - 1))
        def drawn(sizes, seed):
            run(sizes, seed, "a case drawn by Hypothesis")

        from hypothesis.reporting import with_reporter

        with with_reporter(lambda _: None):
            drawn()
    except _Found as found:
        return found.problem
    except BaseExceptionGroup as group:  # several distinct problems: the first
        for error in group.exceptions:
            if isinstance(error, _Found):
                return error.problem
        raise
    return None


def check(name: str, module: Any = None, examples: int = FULL_EXAMPLES) -> Report:
    """Check exercise ``name``: its file's backward, or the functions ``module`` provides
    (the names it lacks come from the file).  ``examples``: drawn cases per part."""
    all_exercises = exercises()
    if name not in all_exercises:
        raise KeyError(f"no exercise {name!r}; the course: {', '.join(all_exercises)}")
    exercise = all_exercises[name]
    started = time.perf_counter()
    try:
        fallback = load_file(exercise)
    except Exception as error:  # a syntax error, a name that does not exist...
        where = ""
        if isinstance(error, SyntaxError) and error.lineno:
            where = (f"\n    at exercises/{exercise.file}, line {error.lineno}: "
                     f"{(error.text or '').strip()}")
            error.__traceback__ = None
        what, _ = _raised(error, str(HERE / exercise.file))
        message = f"{name}: wrong. exercises/{exercise.file} does not load\n  {what}{where}"
        return Report(name, section_label(exercise), WRONG, message, exercise.file,
                      time.perf_counter() - started, (exercise.file,))
    impl = fallback if module is None else _Overlay(module, fallback)
    problems = []
    with _float64_numpy(), np.errstate(all="ignore"):  # a NaN is reported, not warned
        for part in exercise.parts:
            problem = _check_part(exercise, part, impl, examples)
            problems.append(problem)
            if problem is not None and problem["status"] == WRONG:
                break
    section = section_label(exercise)
    seconds = time.perf_counter() - started
    wrong = [p for p in problems if p is not None and p["status"] == WRONG]
    waiting = [p for p in problems if p is not None and p["status"] == NOT_STARTED]
    if wrong:
        p = wrong[0]
        lines = [f"{name}: wrong. {p['headline']}", *[f"  {line}" for line in p["lines"]],
                 f"  (found on {p['case']})"]
        return Report(name, section, WRONG, "\n".join(lines), p["gradient"], seconds,
                      p.get("wrong", (p["gradient"],)))
    if waiting:
        done = [part.backward for part, p in zip(exercise.parts, problems) if p is None]
        todo = ", ".join(p["gradient"] for p in waiting)
        more = f" ({', '.join(done)} done)" if done else ""
        verb = "raises" if len(waiting) == 1 else "raise"
        message = (f"{name}: not started: {todo} still {verb} NotImplementedError{more}.\n"
                   f"  Read docs/derivations.md {section}, write the backward where "
                   f"exercises/{exercise.file} says \"your code here\", then run "
                   f"python exercises/check.py {name}")
        return Report(name, section, NOT_STARTED, message, waiting[0]["gradient"], seconds)
    backwards = [part.backward for part in exercise.parts]
    which = (f"{backwards[0]} agrees" if len(backwards) == 1 else
             f"{', '.join(backwards[:-1])} and {backwards[-1]} agree")
    message = (f"{name}: done. {which} with the textbook's and with central differences "
               f"on every case (the edge cases and {examples} drawn by Hypothesis).")
    return Report(name, section, DONE, message, "", seconds)


def textbook(exercise: Exercise) -> SimpleNamespace:
    """npformer's own forwards and backwards under the exercise's names: what every
    exercise must call done (``python exercises/check.py --textbook``)."""
    return SimpleNamespace(**{name: function for part in exercise.parts
                              for name, function in zip((part.forward, part.backward),
                                                        part.textbook)})


def table(examples: int = QUICK_EXAMPLES, modules: dict | None = None) -> list[Report]:
    """Every exercise checked quickly, in the derivations' order; ``modules``: name ->
    module to check instead of the file."""
    modules = modules or {}
    return [check(name, modules.get(name), examples) for name in exercises()]


def format_table(reports: list[Report]) -> str:
    rows = [("exercise", "section", "status")]
    for r in reports:
        status = r.status if r.status != WRONG else f"{WRONG}: {r.gradient}"
        rows.append((r.name, r.section, status))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python exercises/check.py",
        description="Check the backward you wrote in an exercise of exercises/.")
    parser.add_argument("name", nargs="?", help="the exercise (none: the course as a table)")
    parser.add_argument("--examples", type=int, default=None,
                        help=f"drawn cases per part (default {FULL_EXAMPLES} for one "
                             f"exercise, {QUICK_EXAMPLES} for the table)")
    parser.add_argument("--textbook", action="store_true",
                        help="check npformer's own backwards instead of the files "
                             "(every exercise must be done)")
    parser.add_argument("--sync-sections", action="store_true",
                        help="rewrite each file's section line from docs/derivations.md")
    options = parser.parse_args(argv)
    if options.sync_sections:
        changed = sync_sections()
        print("updated: " + ", ".join(changed) if changed else "every section line is current")
        return 0
    modules = {}
    if options.textbook:
        modules = {name: textbook(ex) for name, ex in exercises().items()}
    if options.name is None:
        reports = table(QUICK_EXAMPLES if options.examples is None else options.examples,
                        modules)
        print(format_table(reports))
        done = sum(r.status == DONE for r in reports)
        print(f"\n{done} of {len(reports)} done.  One exercise: python exercises/check.py NAME")
        return 0
    try:
        report = check(options.name, modules.get(options.name),
                       FULL_EXAMPLES if options.examples is None else options.examples)
    except KeyError as error:
        print(f"error: {error.args[0]}", file=sys.stderr)
        return 2
    print(report.message)
    return 0 if report.status == DONE else 1


if __name__ == "__main__":
    # Run as a script: use the package's copy of this module (exercises.check), whose
    # classes are those the specs in exercises/course/ import.
    if sys.path and Path(sys.path[0]).resolve() == HERE:
        sys.path[0] = str(ROOT)  # the exercise files are not modules to import by name
    else:
        sys.path.insert(0, str(ROOT))
    from exercises.check import main as _main

    sys.exit(_main())
