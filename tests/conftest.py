"""Shared test set-up: Hypothesis profiles, the backend under test, PyTorch, data."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from npformer import backend

# Deterministic in CI (derandomize: the same examples every run, no flakes),
# random locally so development keeps exploring.  Select with HYPOTHESIS_PROFILE.
settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=25, print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "dev", deadline=None, max_examples=25,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

SHARED = Path(__file__).resolve().parents[2] / "shared"  # a checkout's optional neighbour
SHARED_DATA = SHARED / "data"  # the real datasets, where they are
# nanoGPT's model.py for the benchmark's comparison tests, unless the environment names one
if (SHARED / "anchors" / "nanogpt" / "model.py").is_file():
    os.environ.setdefault("NPFORMER_NANOGPT", str(SHARED / "anchors" / "nanogpt"))


def gpu_available() -> bool:
    """Whether CuPy imports and sees a CUDA device (the ``gpu`` tests run only then)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or a CUDA runtime/driver error
        return False


GPU = gpu_available()
# CuPy, on a machine with a GPU (its cases carry the ``gpu`` mark); nothing elsewhere.
GPU_BACKENDS = [pytest.param("cupy", marks=pytest.mark.gpu)] if GPU else []
# The backends every op and layer test runs on: NumPy, the strict array-API namespace
# and, on a machine with a GPU, CuPy.
BACKENDS_UNDER_TEST = ["numpy", "strict"] + GPU_BACKENDS
# The backends of the PyTorch parity tests: npformer on NumPy against torch on the CPU
# and, on a machine with a GPU, npformer on CuPy against torch on CUDA
# (tests.helpers.torch_device says which device follows which backend).
PARITY_BACKENDS = ["numpy"] + GPU_BACKENDS


@contextmanager
def using_backend(name: str, dtype: str = "float64", seed: int = 0):
    """Run a block on backend ``name`` with default float ``dtype``, then restore."""
    previous_name, previous_dtype = backend.backend_name(), backend.default_float_name()
    backend.set_backend(name, seed=seed)
    backend.set_default_float(dtype)
    try:
        yield
    finally:
        backend.set_backend(previous_name)
        backend.set_default_float(previous_dtype)


@pytest.fixture(params=BACKENDS_UNDER_TEST)
def xb(request):
    """The backend under test: every op and layer test runs on NumPy, on the strict
    array-API namespace (whose arrays live on a non-CPU device and refuse NumPy calls)
    and, where a GPU is there, on CuPy."""
    with using_backend(request.param):
        yield request.param


@pytest.fixture(params=PARITY_BACKENDS)
def parity_backend(request):
    """The npformer backend of a PyTorch parity test (the test enters it, with its dtype;
    torch's device follows it).  On CuPy, torch's CUDA float32 is kept plain IEEE float32
    for the test (tests.helpers.torch_in_true_float32)."""
    if request.param != "cupy":
        yield request.param
        return
    from .helpers import torch_in_true_float32

    with torch_in_true_float32(require_torch()):
        yield request.param


@pytest.fixture(params=["fast", "textbook"])
def tier(request):
    """The tier under test: model and layer tests run in both, naming its classes as
    ``tests.helpers.tiered.X``; the previous tier is restored afterwards."""
    from .helpers import using_tier

    with using_tier(request.param):
        yield request.param


@pytest.fixture
def host_rng():
    return np.random.default_rng(12345)


def require_torch():
    """torch, or a skip outside CI; in CI a missing torch is an error, never a silent skip."""
    if os.environ.get("CI"):
        import torch  # noqa: F401  (must be installed by .ci/run)
        return torch
    return pytest.importorskip("torch")


@pytest.fixture
def torch():
    t = require_torch()
    t.manual_seed(0)
    return t


@pytest.fixture
def on_device():
    """Copy host arrays onto the current backend: on_device(np_array, dtype=None)."""
    return backend.asarray
