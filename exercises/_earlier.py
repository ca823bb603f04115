"""The earlier exercises' functions, for an exercise built on them (multihead, blocks...).

``earlier("linear", "linear_forward", "linear_backward")`` gives those functions of
exercises/linear.py as the file is now (read afresh: your latest edits, in a notebook
too).  A backward you have not written yet raises an error that says which exercise to
do first, not the bare ``NotImplementedError`` that would make the checker call the
exercise you are on "not started".
"""
from __future__ import annotations

import functools
from collections.abc import Callable


class EarlierExerciseNotDone(RuntimeError):
    """A function of an earlier exercise, which this one calls, is not written yet."""


def earlier(name: str, *functions: str) -> tuple[Callable, ...]:
    """The functions ``functions`` of exercises/NAME.py, loaded afresh."""
    from exercises import check

    module = check.load_file(check.exercises()[name])
    return tuple(_first(getattr(module, f), name) for f in functions)


def _first(function: Callable, name: str) -> Callable:
    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except NotImplementedError:
            raise EarlierExerciseNotDone(
                f"{function.__name__} (exercises/{name}.py) is not written yet: do that "
                f"exercise first, python exercises/check.py {name}") from None
    return call
