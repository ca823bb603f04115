"""Arrays of two libraries (NumPy and array-api-strict) mixed in one call give a
TypeError that names both libraries and the fix, wherever the namespace is looked up
(backend.namespace_of is the one place): ops, layers, optimizers."""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend, ops, optim
from tests.helpers import tiered

from .conftest import using_backend

MIXED = r"arrays from different array libraries were mixed: array_api_strict, numpy"


def test_namespace_of_names_both_libraries():
    with using_backend("strict"):
        strict = backend.asarray(np.ones(3))
        with pytest.raises(TypeError, match=MIXED + r".*backend is 'strict'.*asarray"):
            backend.namespace_of(strict, np.ones(3))


def test_a_layer_fed_a_numpy_array_on_the_strict_backend():
    with using_backend("strict"):
        layer = tiered.Linear(3, 2)
        with pytest.raises(TypeError, match=MIXED):
            layer(np.ones((2, 3)))


def test_an_op_with_mixed_inputs():
    with using_backend("strict"):
        w = backend.asarray(np.ones((3, 2)))
        with pytest.raises(TypeError, match=MIXED):
            ops.linear_forward(np.ones((2, 3)), w)


def test_an_optimizer_given_a_numpy_gradient_for_a_strict_parameter():
    with using_backend("strict"):
        p = tiered.Linear(2, 2).weight
        opt = optim.SGD([p], lr=0.1)
        p.grad = np.ones((2, 2))
        with pytest.raises(TypeError, match=MIXED):
            opt.step()


def test_a_list_is_named_as_not_an_array():
    with pytest.raises(TypeError, match="expected arrays, got list"):
        backend.namespace_of([1.0, 2.0])


@pytest.mark.parametrize("op", ["attention", "layernorm", "linear"])
def test_mixed_inputs_name_each_argument_and_its_library(op):
    """A NumPy array among strict ones is named, with its library, before any lookup."""
    with using_backend("strict"):
        a = backend.asarray(np.ones((2, 3, 4)))
        host = np.ones((2, 3, 4))
        call, named = {
            "attention": (lambda: ops.attention_forward(a, a, host), "values numpy"),
            "layernorm": (lambda: ops.layernorm_forward(
                host, backend.asarray(np.ones(4)), backend.asarray(np.zeros(4))), "input numpy"),
            "linear": (lambda: ops.linear_forward(a, np.ones((4, 2))), "weight numpy"),
        }[op]
        with pytest.raises(TypeError, match=MIXED) as error:
            call()
        assert named in str(error.value)


@pytest.mark.parametrize("name", ["numpy", "strict"])
def test_asarray_of_an_array_already_on_the_backend(name):
    """Data already on the backend passes through (cast if asked), on every backend: the
    strict namespace refuses conversion to NumPy, so a round trip through the host fails."""
    with using_backend(name):
        a = backend.asarray(np.arange(3))
        assert backend.asarray(a) is a
        cast = backend.asarray(a, "float64")
        np.testing.assert_array_equal(backend.to_numpy(cast), [0.0, 1.0, 2.0])


def test_overlapping_one_thread_blas_blocks_give_the_threads_back():
    """single_threaded_blas in two threads whose blocks overlap, the first opened closing
    first: every BLAS stays on one thread while either is open, and the last to close
    gives back the count each had (a block restoring what it found on entry left BLAS on
    one thread for good)."""
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def counts() -> list:
        return [lib["num_threads"] for lib in threadpoolctl.threadpool_info()
                if lib["user_api"] == "blas"]

    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        before = counts()
        assert before and all(n == 2 for n in before)
        first, second = backend.single_threaded_blas(), backend.single_threaded_blas()
        first.__enter__()
        second.__enter__()
        assert counts() == [1] * len(before) and backend.blas_on_one_thread()
        first.__exit__(None, None, None)
        assert counts() == [1] * len(before) and backend.blas_on_one_thread()
        second.__exit__(None, None, None)
        assert counts() == before and not backend.blas_on_one_thread()


def test_one_thread_blas_looks_for_libraries_loaded_since(monkeypatch):
    """The libraries single_threaded_blas limits are looked up again where a module was
    imported since the last look: a BLAS loaded later (SciPy's, with the fast tier, after
    a textbook run's replicas first asked) is limited too."""
    import sys
    import types

    threadpoolctl = pytest.importorskip("threadpoolctl")
    monkeypatch.setattr(backend, "_blas_libraries", (len(sys.modules), []))  # found none
    monkeypatch.setitem(sys.modules, "npformer_test_newly_imported",
                        types.ModuleType("npformer_test_newly_imported"))
    with threadpoolctl.threadpool_limits(2, user_api="blas"), backend.single_threaded_blas():
        assert all(lib["num_threads"] == 1 for lib in threadpoolctl.threadpool_info()
                   if lib["user_api"] == "blas")
