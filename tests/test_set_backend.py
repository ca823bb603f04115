"""``backend.set_backend`` and ``backend.seed`` refuse a bad argument naming it (issue 37,
case 23: ``set_backend(None)`` raised ``AttributeError: 'NoneType' object has no
attribute 'lower'``)."""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend


@pytest.fixture(autouse=True)
def _restore_backend():
    name, dtype = backend.backend_name(), backend.default_float_name()
    yield
    backend.set_backend(name)
    backend.set_default_float(dtype)


@pytest.mark.parametrize("args, error, message", [
    ((None,), TypeError, r"the backend must be named by a string, one of \('numpy', 'cupy', "
                         r"'strict'\); got None"),
    ((np,), TypeError, r"named by a string.*got <module 'numpy'"),
    (("torch",), ValueError, r"unknown backend 'torch'; choose one of"),
    (("numpy", -1), ValueError, r"seed must be at least 0, got -1"),
    (("numpy", 1.5), TypeError, r"seed must be an integer or None, got 1\.5 \(float\)"),
    (("numpy", "0"), TypeError, r"seed must be an integer or None, got '0' \(str\)"),
])
def test_set_backend_refuses_a_bad_argument_by_name(args, error, message):
    before = backend.xp()
    with pytest.raises(error, match=message):
        backend.set_backend(*args)
    assert backend.xp() is before  # nothing changed


def test_set_backend_takes_any_case_and_numpy_seeds():
    backend.set_backend("NumPy", seed=np.int64(3))
    first = backend.random_normal((3,), std=1.0)
    backend.set_backend("numpy", seed=3)
    np.testing.assert_array_equal(backend.to_numpy(first),
                                  backend.to_numpy(backend.random_normal((3,), std=1.0)))
    backend.set_backend("numpy", seed=None)  # the OS's entropy


@pytest.mark.parametrize("value, error", [(-1, ValueError), (0.5, TypeError), (True, TypeError)])
def test_seed_refuses_a_bad_seed_by_name(value, error):
    with pytest.raises(error, match="seed must be"):
        backend.seed(value)
