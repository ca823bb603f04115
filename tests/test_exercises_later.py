"""The course's later exercises (exercises/: multihead, grouped_attention, blocks, lora,
adam, model) and the capstone (exercises/capstone.py).

Each exercise: the checker passes the textbook's own backward (npformer's layer with the
same weights), fails the wrong backwards learners write, naming the gradient and the
derivation's section, and calls the fresh file "not started".  Adam's exercise is an
update, not a backward (exercises/_step.py): its outputs are named after the update that
first differs.  The capstone: with npformer's own functions standing in for the
reader's, its IMDB smoke run's loss curve equals the textbook's; with one wrong backward
planted, the curves differ and the first update that differs is named.

Data for the capstone: the real IMDB archive where the checkout has it (conftest's
SHARED_DATA), else a small generated one in the same layout.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from exercises import capstone
from exercises import check as course
from exercises.course import _later
from tests.conftest import SHARED_DATA

LATER = ["multihead", "grouped_attention", "blocks", "lora", "adam", "model"]
EXAMPLES = 2


def _label(name: str) -> str:
    return course.section_label(course.exercises()[name]).split()[0]  # "§10"


def test_the_later_exercises_are_in_the_course_in_the_derivations_order():
    names = list(course.exercises())
    assert set(LATER) <= set(names)
    numbers = [course.section_of(course.exercises()[n])[0] for n in names]
    assert numbers == sorted(numbers)
    assert {n: _label(n) for n in LATER} == {
        "multihead": "§10", "grouped_attention": "§10", "blocks": "§15", "lora": "§2",
        "adam": "§17", "model": "§16"}


@pytest.mark.parametrize("name", LATER)
def test_the_textbook_passes(name):
    exercise = course.exercises()[name]
    report = course.check(name, module=course.textbook(exercise), examples=EXAMPLES)
    assert report.status == course.DONE, report.message


MISTAKES = [pytest.param(name, mistake, id=f"{name}: {mistake.what}")
            for name in LATER for mistake in course.exercises()[name].mistakes]


@pytest.mark.parametrize("name, mistake", MISTAKES)
def test_a_wrong_backward_names_its_gradient_and_the_section(name, mistake):
    exercise = course.exercises()[name]
    backward = mistake.part or exercise.parts[0].backward
    report = course.check(name, module=SimpleNamespace(**{backward: mistake.backward}),
                          examples=EXAMPLES)
    assert report.status == course.WRONG, f"{mistake.what} passed:\n{report}"
    assert report.gradient == mistake.gradient, report.message
    assert re.search(rf"\b{mistake.gradient}\b", report.message), report.message
    assert _label(name) in report.message and "revisit" in report.message, report.message
    assert "Traceback" not in report.message


@pytest.mark.parametrize("name", LATER)
def test_three_wrong_backwards_each_and_a_fresh_file_not_started(name):
    assert len(course.exercises()[name].mistakes) >= 3
    report = course.check(name, examples=EXAMPLES)
    assert report.status == course.NOT_STARTED, report.message


def test_the_mistakes_asked_for_are_there():
    """The wrong backwards the course must catch, by exercise."""
    whats = {name: " / ".join(m.what for m in course.exercises()[name].mistakes)
             for name in LATER}
    assert "residual" in whats["blocks"] and "norm's gradient on the" in whats["blocks"]
    assert "wrong order" in whats["multihead"] and "1/sqrt(E)" in whats["multihead"]
    assert "not summed" in whats["grouped_attention"]
    assert "bias correction forgotten" in whats["adam"]
    assert "decay added to the gradient" in whats["adam"]
    assert "scale left out" in whats["lora"] and "frozen W" in whats["lora"]


def test_adams_step_is_checked_update_by_update():
    """A step right at the first update and wrong later is reported at that update, with
    the output at fault; a step that raises is one line with its file's line."""
    def late(param, grad, m, v, t, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
             weight_decay=0.01):
        book = course.exercises()["adam"].parts[0].textbook[1]
        param, m, v = book(param, grad, m, v, t if t < 3 else 1, lr, beta1, beta2, eps,
                           weight_decay)  # t reset: the bias correction of update 1
        return param, m, v
    report = course.check("adam", module=SimpleNamespace(adam_step=late), examples=EXAMPLES)
    assert report.status == course.WRONG and report.gradient == "param", report.message
    assert "after update 3" in report.message, report.message

    def raises(param, grad, m, v, t, **hyper):
        v = v @ np.ones((7, 7))  # shapes that do not multiply
        return param, m, v
    report = course.check("adam", module=SimpleNamespace(adam_step=raises), examples=EXAMPLES)
    assert report.status == course.WRONG and report.gradient == "v", report.message
    assert "ValueError" in report.message and "v = v @ np.ones" in report.message


# =========================================================================== the capstone
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The demo's smoke data, read once: the real archive, else a generated one."""
    if SHARED_DATA.is_dir():
        data = SHARED_DATA
    else:
        from tests.test_data import make_imdb_tar

        data = tmp_path_factory.mktemp("imdb")
        rng = np.random.default_rng(0)
        good = "great superb wonderful moving brilliant".split()
        bad = "awful boring terrible dull worst".split()
        filler = "the film a was of and it plot actor scene".split()

        def review(words):
            return " ".join(rng.choice(filler + words, size=int(rng.integers(8, 40))))
        reviews = {(split, label): [(i, 8 if label == "pos" else 2,
                                     review(good if label == "pos" else bad))
                                    for i in range(200)]
                   for split in ("train", "test") for label in ("pos", "neg")}
        make_imdb_tar(data / "aclImdb_v1.tar.gz", reviews)
    return capstone.prepare(data)


def _textbooks() -> dict:
    return {name: course.textbook(course.exercises()[name]) for name in capstone.NEEDED}


def test_the_capstone_with_the_textbooks_backwards_is_the_textbooks_curve(smoke):
    text, verdict = capstone.run(modules=_textbooks(), prepared=smoke)
    assert verdict is True, text
    assert "equal" in text and "different" not in text
    rows = [line for line in text.splitlines() if re.match(r"\s+\d+\s", line)]
    assert len(rows) == 16  # the smoke preset: 256 reviews, batches of 16, one epoch
    from npformer import ops
    assert ops.linear_forward.__module__.startswith("npformer.ops")  # restored


def test_the_capstone_agrees_to_rounding_with_backwards_written_otherwise(smoke):
    """Plain-NumPy backwards (not npformer's statements) round differently: still equal."""
    modules = _textbooks()
    modules["linear"] = SimpleNamespace(linear_backward=_later.linear_bw)
    modules["layernorm"] = SimpleNamespace(layernorm_backward=_later.layernorm_bw)
    modules["attention"] = SimpleNamespace(attention_backward=_later.attention_bw)
    text, verdict = capstone.run(modules=modules, prepared=smoke)
    assert verdict is True, text


@pytest.mark.parametrize("name", ["layernorm", "attention", "adam"])
def test_the_capstone_fails_with_one_wrong_backward(smoke, name):
    modules = _textbooks()
    mistake = course.exercises()[name].mistakes[0]
    backward = mistake.part or course.exercises()[name].parts[0].backward
    modules[name] = SimpleNamespace(**{backward: mistake.backward})
    text, verdict = capstone.run(modules=modules, prepared=smoke)
    assert verdict is False, text
    assert "first differ at update" in text and "<- first difference" in text, text
    assert f"wrong: {name}" in text, text


def test_the_capstone_says_which_exercises_are_not_started():
    text, verdict = capstone.run()
    assert verdict is None
    assert text.startswith("not started yet: ") and "linear" in text and "adam" in text


def test_the_capstones_textbook_curve_is_the_demos_own(smoke, tmp_path):
    """``python demos/imdb.py --smoke --tier textbook --dtype float64 --members 1`` trains
    the curve the capstone compares with, update for update."""
    from npformer import backend
    from npformer.checkpoint import load_checkpoint

    previous = backend.backend_name(), backend.default_float_name()
    try:
        code = smoke.demo.main(["--smoke", "--tier", "textbook", "--dtype", "float64",
                                "--members", "1", "--no-progress", "--data", str(smoke.data),
                                "--out", str(tmp_path / "run")])
    finally:
        backend.set_backend(previous[0])
        backend.set_default_float(previous[1])
    assert code == 0
    history = load_checkpoint(tmp_path / "run" / "last.npz").extra["trainer"]["history"]
    assert history["losses"] == capstone.curve(smoke)


def test_an_earlier_exercise_not_done_is_named_not_this_one_not_started():
    """multihead's backward written, calling the linear exercise's backward, not written
    yet: the report names the exercise to do first."""
    fresh = course.load_file(course.exercises()["multihead"])

    def backward(dy, cache):
        q_cache, k_cache, v_cache, attention_cache, out_cache, num_heads = cache
        dmerged, dwo, dbo = fresh.linear_backward(dy, out_cache)
        raise AssertionError("not reached")
    report = course.check("multihead", module=SimpleNamespace(multihead_backward=backward),
                          examples=EXAMPLES)
    assert report.status == course.WRONG, report.message
    assert "exercises/linear.py) is not written yet" in report.message, report.message
    assert "python exercises/check.py linear" in report.message, report.message
