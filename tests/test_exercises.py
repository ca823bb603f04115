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

from exercises import check as course

EXAMPLES = 2  # drawn cases per part (the edge cases run as well)
NAMES = list(course.exercises())
ROOT = Path(course.__file__).resolve().parents[1]


def _functions(name: str, **functions) -> SimpleNamespace:
    return SimpleNamespace(**functions)


def _textbook(name: str) -> SimpleNamespace:
    parts = course.exercises()[name].parts
    return SimpleNamespace(**{k: v for part in parts
                              for k, v in zip((part.forward, part.backward), part.textbook)})


# =========================================================================== the wrong backwards
def _linear_wrongs():
    def no_transpose(dy, cache):
        x, w = cache
        dx = dy @ w
        rows = x.reshape(-1, w.shape[0])
        return dx, rows.T @ dy.reshape(-1, w.shape[1]), dy.reshape(-1, w.shape[1]).sum(0)

    def db_wrong_axis(dy, cache):
        x, w = cache
        rows, drows = x.reshape(-1, w.shape[0]), dy.reshape(-1, w.shape[1])
        return dy @ w.T, rows.T @ drows, dy.sum(axis=-1).sum() * np.ones(w.shape[1])

    def dw_averaged(dy, cache):
        x, w = cache
        rows, drows = x.reshape(-1, w.shape[0]), dy.reshape(-1, w.shape[1])
        return dy @ w.T, rows.T @ drows / rows.shape[0], drows.sum(0)

    def dw_reversed(dy, cache):
        x, w = cache
        rows, drows = x.reshape(-1, w.shape[0]), dy.reshape(-1, w.shape[1])
        return dy @ w.T, drows.T @ rows, drows.sum(0)
    return [("dx = dy W, the transpose missing", "dx", no_transpose),
            ("db summed over the features", "db", db_wrong_axis),
            ("dW averaged over the rows", "dw", dw_averaged),
            ("dW = dy^T x, transposed", "dw", dw_reversed)]


def _layernorm_wrongs():
    def no_mean_term(dy, cache):
        x_hat, r, gamma = cache
        d = x_hat.shape[-1]
        g = dy * gamma
        dx = r * (g - x_hat * (g * x_hat).mean(-1, keepdims=True))
        return dx, (dy * x_hat).reshape(-1, d).sum(0), dy.reshape(-1, d).sum(0)

    def no_variance_term(dy, cache):
        x_hat, r, gamma = cache
        d = x_hat.shape[-1]
        g = dy * gamma
        dx = r * (g - g.mean(-1, keepdims=True))
        return dx, (dy * x_hat).reshape(-1, d).sum(0), dy.reshape(-1, d).sum(0)

    def gamma_forgotten(dy, cache):
        x_hat, r, gamma = cache
        d = x_hat.shape[-1]
        g = dy
        dx = r * (g - g.mean(-1, keepdims=True) - x_hat * (g * x_hat).mean(-1, keepdims=True))
        return dx, (dy * x_hat).reshape(-1, d).sum(0), dy.reshape(-1, d).sum(0)

    def dgamma_of_dy(dy, cache):
        x_hat, r, gamma = cache
        d = x_hat.shape[-1]
        g = dy * gamma
        dx = r * (g - g.mean(-1, keepdims=True) - x_hat * (g * x_hat).mean(-1, keepdims=True))
        return dx, dy.reshape(-1, d).sum(0), dy.reshape(-1, d).sum(0)
    return [("layer norm's mean term forgotten", "dx", no_mean_term),
            ("the variance term forgotten", "dx", no_variance_term),
            ("g = dy, gamma forgotten", "dx", gamma_forgotten),
            ("dgamma without x_hat", "dgamma", dgamma_of_dy)]


WRONGS = {
    "linear": _linear_wrongs(),
    "layernorm": _layernorm_wrongs(),
}
BACKWARD_OF = {name: [p.backward for p in ex.parts] for name, ex in course.exercises().items()}
WRONG_CASES = [pytest.param(name, *wrong, id=f"{name}: {wrong[0]}")
               for name, wrongs in WRONGS.items() for wrong in wrongs]


def _section_number(name: str) -> str:
    return course.section_label(course.exercises()[name]).split()[0]  # "§6"


# =========================================================================== the tests
@pytest.mark.parametrize("name", NAMES)
def test_the_textbook_backward_passes(name):
    report = course.check(name, module=_textbook(name), examples=EXAMPLES)
    assert report.status == course.DONE, report.message


@pytest.mark.parametrize("name, what, gradient, backward", WRONG_CASES)
def test_a_wrong_backward_is_named(name, what, gradient, backward):
    part = next(p for p in course.exercises()[name].parts
                if getattr(backward, "part", p.backward) == p.backward)
    report = course.check(name, module=SimpleNamespace(**{part.backward: backward}),
                          examples=EXAMPLES)
    assert report.status == course.WRONG, f"{what} passed:\n{report}"
    assert report.gradient == gradient, f"{what}: expected {gradient}:\n{report}"
    assert re.search(rf"\b{gradient}\b", report.message), report.message
    assert _section_number(name) in report.message, report.message
    assert "arg0" not in report.message and "Traceback" not in report.message


@pytest.mark.parametrize("name", NAMES)
def test_every_exercise_has_three_wrong_backwards(name):
    assert len(WRONGS.get(name, [])) >= 3, f"{name}: give its checker three wrong backwards"


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
