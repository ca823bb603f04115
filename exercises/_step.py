"""A part of an exercise that is an update, not a backward: the reader writes an
optimizer's step, ``step(param, grad, state..., t, hyperparameters) -> (param, state...)``,
checked against the textbook's step over several updates, output by output.

:class:`StepPart` is a :class:`exercises.check.Part` whose ``check_case`` the checker
calls in place of its forward/backward comparison (a case is then an initial parameter
and the gradients of several updates).  Its ``forward`` is the function that makes the
state before the first update (``adam_init``: zero moments), given in the file and
compared with the textbook's as a forward is; its ``backward`` is the step the reader
writes; ``grads`` names the step's outputs (``("param", "m", "v")``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from exercises import check as course
from exercises.check import NOT_STARTED, TOLERANCE, WRONG, Case, Exercise, Part


@dataclass
class StepCase(Case):
    """A step's case: ``args`` the init's (``[param]``), ``grads`` the gradients of the
    updates (updates, *shape), ``hyper`` the step's keyword arguments."""

    grads: Any = None
    hyper: dict = field(default_factory=dict)


@dataclass
class StepPart(Part):
    """``make(rng, **sizes) -> StepCase([param], grads=..., hyper=...)``;
    ``textbook = (init, step)`` with the exercise's signatures."""

    def check_case(self, exercise: Exercise, impl: Any, case: Case) -> dict | None:
        from npformer.gradcheck import compare

        param = np.asarray(case.args[0], dtype=np.float64)
        grads, hyper = np.asarray(case.grads, dtype=np.float64), dict(case.hyper)
        init, step = getattr(impl, self.forward), getattr(impl, self.backward)
        book_init, book_step = self.textbook
        inputs = (f"inputs: param {param.shape}, {len(grads)} update(s), "
                  + ", ".join(f"{k}={v!r}" for k, v in hyper.items()))
        book_state = tuple(np.asarray(s, dtype=np.float64)
                           for s in book_init(param.copy(), *case.args[1:], **case.kwargs))
        try:
            state = tuple(np.asarray(s, dtype=np.float64)
                          for s in init(param.copy(), *case.args[1:], **case.kwargs))
        except Exception as error:
            return dict(status=WRONG, gradient=self.forward,
                        headline=f"{self.forward} (given) raised",
                        lines=[course._raised(error, course._source_of(init))[0], inputs,
                               "it is given: restore it from the exercise's original"])
        if len(state) != len(book_state) or any(
                s.shape != b.shape or not np.allclose(s, b, rtol=0.0, atol=1e-12)
                for s, b in zip(state, book_state)):
            return dict(status=WRONG, gradient=self.forward,
                        headline=f"{self.forward} (the forward: the state before the first "
                                 f"update) is not the textbook's",
                        lines=[inputs, "the step is checked once it is right: restore the "
                                       "function the exercise gives"])
        yours_p, book_p = param.copy(), param.copy()
        for t, g in enumerate(grads, start=1):
            try:
                out = step(yours_p.copy(), g.copy(), *(s.copy() for s in state), t, **hyper)
            except NotImplementedError:
                return dict(status=NOT_STARTED, gradient=self.backward,
                            headline=f"{self.backward} not started", lines=[])
            except Exception as error:
                what, assigned = course._raised(error, course._source_of(step))
                name = assigned if assigned in self.grads else self.backward
                return dict(status=WRONG, gradient=name,
                            headline=f"{self.backward} raised at update {t}",
                            lines=[what, inputs, course._hint(exercise, self, name)])
            book = book_step(book_p.copy(), g.copy(), *(s.copy() for s in book_state), t,
                             **hyper)
            out = tuple(out) if isinstance(out, tuple | list) else (out,)
            if len(out) != len(self.grads):
                return dict(status=WRONG, gradient=self.backward,
                            headline=f"{self.backward} returned {len(out)} value(s), expected "
                                     f"{len(self.grads)}: {', '.join(self.grads)}, in that order",
                            lines=[inputs, course._hint(exercise, self, "*")])
            yours, books = {}, {}
            for name, a, b in zip(self.grads, out, book):
                a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
                if a.shape != b.shape:
                    return dict(status=WRONG, gradient=name,
                                headline=f"{name} has shape {a.shape} after update {t}, "
                                         f"expected {b.shape}",
                                lines=[inputs, course._hint(exercise, self, name)])
                yours[name], books[name] = a, b
            result = compare(yours, books)
            if not result.passed(TOLERANCE):
                name = result.worst_name
                where = f"at index {result.worst_index}" if result.worst_index else "(a scalar)"
                lines = [f"largest error {result.worst_error:.1e} (relative to its scale) "
                         f"{where}: yours {result.worst_analytic:.10g}, the textbook's "
                         f"{result.worst_numeric:.10g}"]
                diagnosis = course._diagnosis(yours[name], books[name])
                if diagnosis:
                    lines.append(diagnosis)
                right = [n for n in self.grads if result.errors[n] < TOLERANCE]
                if right:
                    lines.append(f"right: {', '.join(right)}")
                lines += [inputs, course._hint(exercise, self, name)]
                return dict(status=WRONG, gradient=name,
                            headline=f"{name} (shape {yours[name].shape}) differs from the "
                                     f"textbook's after update {t}", lines=lines)
            yours_p, state = yours[self.grads[0]], tuple(yours[n] for n in self.grads[1:])
            book_p, book_state = books[self.grads[0]], tuple(books[n] for n in self.grads[1:])
        return None
