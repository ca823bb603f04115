"""The course (exercises/): its checker passes the textbook's backwards, fails the wrong
backwards learners actually write, and says what is wrong in the learner's terms.

For every exercise: npformer's own forward and backward pass; at least three wrong
backwards (a missing transpose, a sum over the wrong axis, a forgotten term, a factor
left out...) are reported "wrong" with the gradient at fault and the derivation's
section named; the fresh file is "not started", and a broken forward is reported as the
forward.  The course's table on the files as cloned: every exercise "not started".
Each wrong backward is written against the exercise file's cache, as a learner would.
"""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exercises import check as course
from npformer import backend

EXAMPLES = 2  # drawn cases per part (the edge cases run as well)
NAMES = list(course.exercises())
ROOT = Path(course.__file__).resolve().parents[1]


def _textbook(name: str) -> SimpleNamespace:
    return course.textbook(course.exercises()[name])


# Every exercise's mistakes (exercises/course/NAME.py, ``mistakes``): the wrong backwards
# learners write, each with the gradient the checker must name.
MISTAKES = [pytest.param(name, mistake, id=f"{name}: {mistake.what}")
            for name, ex in course.exercises().items() for mistake in ex.mistakes]


def _section_number(name: str) -> str:
    return course.section_label(course.exercises()[name]).split()[0]  # "§6"


# =========================================================================== the tests
@pytest.mark.parametrize("name", NAMES)
def test_the_textbook_backward_passes(name):
    report = course.check(name, module=_textbook(name), examples=EXAMPLES)
    assert report.status == course.DONE, report.message


@pytest.mark.parametrize("name, mistake", MISTAKES)
def test_a_wrong_backward_is_named(name, mistake):
    exercise = course.exercises()[name]
    backward = mistake.part or exercise.parts[0].backward
    assert backward in [p.backward for p in exercise.parts], mistake.part
    report = course.check(name, module=SimpleNamespace(**{backward: mistake.backward}),
                          examples=EXAMPLES)
    gradient = mistake.gradient
    assert report.status == course.WRONG, f"{mistake.what} passed:\n{report}"
    # The worst gradient leads the message; a mistake upstream of several gradients (a
    # shared intermediate) may name another first, and this one as "also wrong".
    assert gradient in report.wrong, f"{mistake.what}: expected {gradient}:\n{report}"
    assert re.search(rf"\b{gradient}\b", report.message), report.message
    assert _section_number(name) in report.message, report.message
    assert "arg0" not in report.message and "Traceback" not in report.message


@pytest.mark.parametrize("name", NAMES)
def test_every_exercise_has_three_wrong_backwards(name):
    assert len(course.exercises()[name].mistakes) >= 3, (
        f"{name}: give its checker three wrong backwards (mistakes=)")


@pytest.mark.parametrize("name", NAMES)
def test_a_fresh_file_is_not_started(name):
    report = course.check(name, examples=EXAMPLES)
    assert report.status == course.NOT_STARTED, report.message
    assert "not started" in report.message and "Traceback" not in report.message


@pytest.mark.parametrize("name", NAMES)
def test_a_broken_forward_is_reported_as_the_forward(name):
    part = course.exercises()[name].parts[0]
    fresh = course.load_file(course.exercises()[name])
    given = getattr(fresh, part.forward)

    def broken(*args, **kwargs):
        out, cache = given(*args, **kwargs)
        return out * 1.5 + 0.25, cache
    module = _textbook(name)
    setattr(module, part.forward, broken)
    report = course.check(name, module=module, examples=EXAMPLES)
    assert report.status == course.WRONG, report.message
    assert report.gradient == part.forward and "forward" in report.message, report.message


FORWARDS = [pytest.param(name, i, id=f"{name}: {part.forward}")
            for name, ex in course.exercises().items() for i, part in enumerate(ex.parts)]


@pytest.mark.parametrize("name, index", FORWARDS)
def test_the_exercise_files_forward_is_the_textbooks(name, index):
    """On the edge cases and on drawn cases, the forward the file gives computes the
    textbook's output (the checker would call a learner's right backward wrong otherwise)."""
    exercise = course.exercises()[name]
    part = exercise.parts[index]
    forward = getattr(course.load_file(exercise), part.forward)
    book = part.textbook[0]

    def same(sizes, seed):
        case = part.make(np.random.default_rng(seed), **sizes)
        outs = []
        for function in (forward, book):
            if case.seed is not None:
                backend.seed(case.seed)
            outs.append(backend.to_numpy(function(*case.args, **case.kwargs)[0]))
        np.testing.assert_allclose(outs[0], outs[1], rtol=1e-10, atol=1e-12)

    with course._float64_numpy():
        for _, sizes in part.edge_cases:
            same(dict(sizes), 0)
        settings(max_examples=10, derandomize=True, database=None, deadline=None)(
            given(sizes=st.fixed_dictionaries(part.sizes), seed=st.integers(0, 2**32 - 1))(
                same))()


def test_a_backward_that_raises_is_one_line_and_the_files_line():
    def backward(dy, cache):
        x, w = cache
        dw = dy @ x  # shapes that do not multiply
        return None, dw, None
    report = course.check("linear", module=SimpleNamespace(linear_backward=backward),
                          examples=EXAMPLES)
    assert report.status == course.WRONG and report.gradient == "dw"
    assert "ValueError" in report.message and "Traceback" not in report.message
    assert "line" in report.message and "dw = dy @ x" in report.message, report.message
    assert "dy (1, 2), x (1, 3), w (3, 2)" in report.message, report.message


def test_the_fresh_clone_table_is_all_not_started():
    reports = course.table(examples=1)
    assert [r.name for r in reports] == NAMES
    assert {r.status for r in reports} == {course.NOT_STARTED}, course.format_table(reports)
    text = course.format_table(reports)
    assert all(r.section in text for r in reports)


@pytest.mark.parametrize("name", NAMES)
def test_each_file_is_a_percent_notebook_naming_its_section(name):
    exercise = course.exercises()[name]
    text = (ROOT / "exercises" / exercise.file).read_text(encoding="utf-8")
    assert text.startswith("# %% [markdown]\n"), "the first cell is the exercise's text"
    assert "\n# %%\n" in text, "code cells: # %%"
    label = course.section_label(exercise)
    assert f"# Derivation: docs/derivations.md, {label}\n" in text, (
        f"{exercise.file} must name {label}: python exercises/check.py --sync-sections")
    assert "your code here" in text
    for part in exercise.parts:
        assert f"def {part.forward}(" in text and f"def {part.backward}(" in text


def test_gradients_in_another_order_are_named_so():
    def backward(dy, cache):
        x, w = cache
        dx = dy @ w.T
        dw = x.reshape(-1, w.shape[0]).T @ dy.reshape(-1, w.shape[1])
        return dw, dx, dy.reshape(-1, w.shape[1]).sum(0)
    report = course.check("linear", module=SimpleNamespace(linear_backward=backward),
                          examples=EXAMPLES)
    assert report.status == course.WRONG and report.gradient == "dx"
    assert "another order" in report.message and "dx, dw, db" in report.message
