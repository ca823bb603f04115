"""The one module that knows which array library does the math.

npformer computes with whatever array namespace this module hands out:

* ``"numpy"``  (default) NumPy on the CPU, through ``array_api_compat.numpy``;
* ``"cupy"``   CuPy on an NVIDIA GPU, through ``array_api_compat.cupy``;
* ``"strict"`` ``array_api_strict`` on a pretend accelerator (``device1``).  It exists to
  *prove* portability on a machine without a GPU: its arrays refuse implicit conversion to
  NumPy, refuse to mix with NumPy arrays and offer only the functions of the array API
  standard, so any stray ``np.`` call in the math fails loudly, as it would on CuPy.

Choose with the environment variable ``NPFORMER_BACKEND`` or with :func:`set_backend`.
Everything that has to differ between libraries lives here and nowhere else: the namespace,
the device, host <-> device copies, the seeded random generator, the dtype policy and the
one scatter-add kernel (embedding backward) the standard lacks.

dtype policy: parameters and activations are ``float32`` for training (:func:`default_float`),
gradient checks run in ``float64``.  Ops never change the dtype of what they are given.
"""
from __future__ import annotations

import math
import numbers
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

BACKENDS = ("numpy", "cupy", "strict")
_LIBRARY = {"numpy": "numpy", "cupy": "cupy", "strict": "array_api_strict"}  # backend -> module
FLOAT_DTYPES = ("float32", "float64")
# An array of any backend (numpy.ndarray, cupy.ndarray, array_api_strict Array): the
# libraries share no base class, so the annotations name it for the reader.
Array = Any


@dataclass
class _Backend:
    name: str
    xp: Any  # the array namespace
    device: Any  # where new arrays live
    rng: np.random.Generator | Any  # numpy Generator, or cupy's
    default_float: str = "float32"


def _make_backend(name: str, seed: int | None) -> _Backend:
    if name == "numpy":
        import array_api_compat.numpy as xp

        return _Backend("numpy", xp, "cpu", np.random.default_rng(seed))
    if name == "cupy":
        try:
            import array_api_compat.cupy as xp
            import cupy
        except ImportError as exc:
            raise RuntimeError(
                "backend 'cupy' needs CuPy: install the extra of your CUDA driver, "
                "`pip install -e \".[gpu-cuda13]\"` (cupy-cuda13x) or `.[gpu-cuda12]` "
                "(cupy-cuda12x); docs/guide.md, \"On a GPU: install\", says which") from exc
        try:
            n_gpus = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # CUDA driver missing or broken
            raise RuntimeError(f"backend 'cupy' found no usable GPU: {exc}") from exc
        if n_gpus == 0:
            raise RuntimeError("backend 'cupy' found no GPU on this machine")
        return _Backend("cupy", xp, cupy.cuda.Device(), cupy.random.default_rng(seed))
    if name == "strict":
        try:
            import array_api_strict as xp
        except ImportError as exc:
            raise RuntimeError(
                "backend 'strict' needs array-api-strict: `pip install -e .[test]`") from exc
        # Host-side generator: the standard has no random module.
        return _Backend("strict", xp, xp.Device("device1"), np.random.default_rng(seed))
    raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")


_thread_local = threading.local()  # this thread's generator, and its shapes-only backend

# The backend in use: made on first use from NPFORMER_BACKEND (numpy where unset), not
# when npformer is imported, so that a bad value is reported where the program can say so
# (a demo's one ``error:`` line), not as a traceback from an import.
_current: _Backend | None = None
BACKEND_VARIABLE = "NPFORMER_BACKEND"


def environment_backend() -> str:
    """The backend NPFORMER_BACKEND names ("numpy" where unset or empty); another value is
    a ValueError naming the variable and the backends."""
    value = os.environ.get(BACKEND_VARIABLE, "")
    name = value.strip().lower() or "numpy"
    if name not in BACKENDS:
        raise ValueError(f"{BACKEND_VARIABLE}={value!r} is an unknown backend: use one of "
                         f"{', '.join(BACKENDS)} (or leave it unset: numpy)")
    return name


def _now() -> _Backend:
    """The current backend (this thread's shapes within :func:`shapes_only`), made from the
    environment (:func:`environment_backend`) the first time one is needed."""
    global _current
    shapes = getattr(_thread_local, "shapes", None)
    if shapes is not None:
        return shapes
    if _current is None:
        name = environment_backend()
        try:
            made = _make_backend(name, 0)
        except RuntimeError as exc:
            raise RuntimeError(f"{BACKEND_VARIABLE}={name}: {exc}") from None
        if _current is None:  # another thread may have made it meanwhile
            _current = made
    return _current


# --------------------------------------------------------------------------- switches
TRUE_WORDS = ("1", "true", "yes", "on")  # an environment switch set (any case)
FALSE_WORDS = ("0", "false", "no", "off")


def boolean_word(value: str) -> bool | None:
    """An environment switch's value read as a boolean (case and surrounding spaces
    ignored): True, False, or None where it is neither ("" is False)."""
    word = value.strip().lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS + ("",) else None


def env_flag(name: str, meaning: str, default: bool = False) -> bool:
    """The environment switch ``name`` (``default`` where unset or empty); a value that is
    not a boolean is a ValueError naming it, the value, the accepted words and what the
    switch does (``meaning``, e.g. "turn numba off")."""
    value = os.environ.get(name, "")
    if not value.strip():
        return default
    flag = boolean_word(value)
    if flag is None:
        raise ValueError(f"{name}={value!r} is not a boolean: use one of "
                         f"{', '.join(TRUE_WORDS)} to {meaning}, or one of "
                         f"{', '.join(repr(w) for w in FALSE_WORDS + ('',))} not to")
    return flag


# The boolean switches npformer reads, each where it is used (never on import):
# {variable: (what setting it does, its value where unset)}
SWITCHES = {"NPFORMER_GPU_FUSED": ("run the fused GPU kernels", True),
            "NPFORMER_CUDA_GRAPH": ("capture each update as a CUDA graph", False)}


def switch(name: str) -> bool:
    """The switch ``name`` of :data:`SWITCHES`, read now (:func:`env_flag`)."""
    meaning, default = SWITCHES[name]
    return env_flag(name, meaning, default)


def check_environment() -> None:
    """Every NPFORMER_* setting of this module read now: NPFORMER_BACKEND and the
    :data:`SWITCHES`; the first bad one is a ValueError naming the variable (a program's
    option check calls this, to report it in one line before anything runs)."""
    environment_backend()
    for name in SWITCHES:
        switch(name)


# --------------------------------------------------------------------------- selection
def set_backend(name: str, seed: int | None = 0) -> None:
    """Switch every later computation to backend ``name`` ("numpy", "cupy" or "strict"),
    its generator seeded with ``seed`` (an integer >= 0; None: from the OS's entropy).

    Raises:
        TypeError: ``name`` is not a string, or ``seed`` not an integer or None.
        ValueError: an unknown backend, or a negative seed.
        RuntimeError: the backend's library (or a GPU) is missing.
    """
    global _current
    if not isinstance(name, str):
        raise TypeError(f"the backend must be named by a string, one of {BACKENDS}; got "
                        f"{name!r}")
    seed = _checked_seed(seed)
    default_float = "float32" if _current is None else _current.default_float
    _current = _make_backend(name.lower(), seed)
    _current.default_float = default_float


def _checked_seed(value: Any) -> int | None:
    """A generator's seed: an integer >= 0 (Python's or NumPy's, not a bool), or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"seed must be an integer or None, got {value!r} "
                        f"({type(value).__name__})")
    if value < 0:
        raise ValueError(f"seed must be at least 0, got {value}")
    return int(value)


def backend_name() -> str:
    return _now().name


def xp() -> Any:
    """The array namespace of the current backend."""
    return _now().xp


def device() -> Any:
    """The device new arrays are created on."""
    return _now().device


_NAMESPACE_OF_TYPE: dict[type, Any] = {}  # array type -> its namespace, filled on first use


def namespace_of(*arrays: Array) -> Any:
    """The array namespace the given arrays belong to (they must agree), from a table by
    their type after the first lookup (a training step asks hundreds of times).  Arrays of
    two libraries are a TypeError that names the libraries and the fix."""
    kind = type(arrays[0]) if arrays else None
    one_type = kind is not None and all(type(a) is kind for a in arrays[1:])
    if one_type and kind in _NAMESPACE_OF_TYPE:
        return _NAMESPACE_OF_TYPE[kind]
    import array_api_compat

    try:
        xp_ = array_api_compat.array_namespace(*arrays)
        if one_type:
            _NAMESPACE_OF_TYPE[kind] = xp_
        return xp_
    except TypeError:
        not_arrays = [type(a).__name__ for a in arrays
                      if not array_api_compat.is_array_api_obj(a)]
        if not_arrays:
            raise TypeError(f"expected arrays, got {', '.join(not_arrays)}: convert host data "
                            "with npformer.backend.asarray(...)") from None
        libraries = {_library_of(a) for a in arrays}
        if len(libraries) > 1:
            raise TypeError(_mixed_libraries(libraries)) from None
        raise


def check_one_library(what: str, **arrays: Array) -> None:
    """The named arrays come from one array library; otherwise a TypeError naming each
    argument's library, raised before a namespace lookup would give the message without
    the names.  Arguments that are not arrays (None, lists) are left to the callers' checks."""
    import array_api_compat

    libraries = {name: _library_of(a) for name, a in arrays.items()
                 if array_api_compat.is_array_api_obj(a)}
    if len(set(libraries.values())) > 1:
        named = ", ".join(f"{name} {library}" for name, library in libraries.items())
        raise TypeError(_mixed_libraries(set(libraries.values()), f"{what} {named}; "))


def _mixed_libraries(libraries: set, named: str = "") -> str:
    return (f"arrays from different array libraries were mixed: {', '.join(sorted(libraries))} "
            f"({named}the current backend is {_now().name!r}). Move host data onto the "
            "backend with npformer.backend.asarray(...) and results back with "
            "npformer.backend.to_numpy(...)")


def _library_of(x) -> str:
    """The library an array belongs to, for messages ("numpy", "array_api_strict")."""
    return type(x).__module__.split(".")[0]


def device_of(x: Array) -> Any:
    import array_api_compat

    return array_api_compat.device(x)


# --------------------------------------------------------------------------- memory
def machine_memory() -> tuple[int, str]:
    """(bytes, where) of the memory a run can use: the GPU's on the cupy backend; else
    the machine's physical memory, or the container's limit (cgroup) when lower."""
    if backend_name() == "cupy":
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[1]), "this GPU has"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as limit_file:
            limit = limit_file.read().strip()
    except OSError:
        limit = "max"
    if limit.isdigit() and int(limit) < total:
        return int(limit), "this container may use"
    return total, "this machine has"


def byte_size(count: int) -> str:
    """Bytes in binary units: ``125.7 GiB``; past YiB, a power of ten."""
    value = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"):
        if value < 1024 or unit == "YiB":
            break
        value /= 1024
    if value >= 1024:
        return f"{count:.2g} bytes"
    return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_KEEP_BYTES = 2**31 - 1  # mallopt takes an int: 2 GiB, far above any one activation


def keep_freed_memory() -> bool:
    """Keep freed memory in the process instead of handing it back to the OS (glibc).

    glibc serves allocations above a dynamic threshold (up to 32 MiB) with ``mmap`` and
    returns them at ``free``, and trims the heap top above 128 KiB: a training step that
    frees and re-allocates its activations then page-faults them back in, every step, and
    those faults do not scale across cores (``bench/README.md``, "The allocator").  The
    Trainer, :func:`npformer.parallel.setup` and the fast tier's models call it: they
    allocate the same arrays every step, so keeping them costs no more than the peak.
    It is ``GLIBC_TUNABLES``' mmap_threshold and trim_threshold, set with ``mallopt``
    from inside the process.  Returns False where there is no glibc (nothing changed).
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) and mallopt(_M_TRIM_THRESHOLD,
                                                                       _KEEP_BYTES))

_blas_libraries: tuple = (-1, [])  # (how many modules were imported when they were found,
#   threadpoolctl's controllers of the BLAS libraries loaded then): looking them up reads /proc
_one_thread: dict = {"holders": 0, "restore": []}  # open single_threaded_blas blocks, all
#   threads, and each library's thread count before the first of them
_one_thread_lock = threading.Lock()


def _loaded_blas() -> list:
    """threadpoolctl's controller of every loaded BLAS library (NumPy's, and SciPy's once
    the fast tier has loaded it), or none without threadpoolctl; looked up again only
    where modules were imported since the last look (one may have loaded a BLAS)."""
    global _blas_libraries
    modules, libraries = _blas_libraries
    if modules != len(sys.modules):
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # pragma: no cover - threadpoolctl is a dependency
            libraries = []
        else:
            libraries = ThreadpoolController().select(user_api="blas").lib_controllers
        _blas_libraries = (len(sys.modules), libraries)
    return libraries


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """A block in which every loaded BLAS runs on one thread: NumPy's, and SciPy's, which
    the fast tier's compiled kernels call.  Thread replicas run in it (their threads share
    the cores), and so do the compiled kernels: two BLAS libraries, each with a thread per
    core that spins for a while after its call, would take the cores from each other.

    The limit is the process's, so the blocks are counted across threads: the first to
    open sets every library to one thread, the last to close gives each back the count
    it had.  (Each block restoring what it found would leave one thread for good where
    two threads' blocks overlap and the first to open closes first.)"""
    with _one_thread_lock:
        if _one_thread["holders"] == 0:
            _one_thread["restore"] = [(lib, lib.get_num_threads()) for lib in _loaded_blas()]
            for lib, _ in _one_thread["restore"]:
                lib.set_num_threads(1)
        _one_thread["holders"] += 1
    try:
        yield
    finally:
        with _one_thread_lock:
            _one_thread["holders"] -= 1
            if _one_thread["holders"] == 0:
                for lib, threads in _one_thread["restore"]:
                    lib.set_num_threads(threads)


def blas_on_one_thread() -> bool:
    """Whether some thread is inside :func:`single_threaded_blas` (the limit is the
    process's: every thread's BLAS is on one thread then)."""
    return _one_thread["holders"] > 0


# --------------------------------------------------------------------------- dtypes
def set_default_float(name: str) -> None:
    """Set the float dtype new parameters get: "float32" (training) or "float64" (checks)."""
    if name not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {name!r}")
    _now().default_float = name


def default_float() -> Any:
    """The current backend's default float dtype object."""
    return getattr(_now().xp, _now().default_float)


def default_float_name() -> str:
    return _now().default_float


def built_in(dtype: str | None, build: Callable[..., Any], *args: Any) -> Any:
    """``build(*args)`` with new parameters in ``dtype`` (None: the default float), the
    default float restored after."""
    previous = _now().default_float
    set_default_float(dtype or previous)
    try:
        return build(*args)
    finally:
        set_default_float(previous)


def float_dtype(name: str | None = None) -> Any:
    """Dtype object for "float32"/"float64" (default: the policy's) in the current namespace."""
    name = name or _now().default_float
    if name not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {name!r}")
    return getattr(_now().xp, name)


def is_integer_array(x: Array) -> bool:
    return namespace_of(x).isdtype(x.dtype, "integral")


def is_float_array(x: Array) -> bool:
    return namespace_of(x).isdtype(x.dtype, "real floating")


# --------------------------------------------------------------------------- host <-> device
class HostReadError(RuntimeError):
    """A copy between host and device where none may happen (:func:`device_only`)."""


_host_reads = threading.local()  # .forbidden: why no device array may be read now


@contextmanager
def device_only(reason: str) -> Iterator[None]:
    """Within the block, a copy of a device array to the host (:func:`to_numpy`, and so
    :func:`host_range` and :func:`to_float`), or of host data to the device
    (:func:`asarray`), raises :class:`HostReadError` naming ``reason``: a step captured as
    a CUDA graph must never wait for the device, nor bake host values into the graph
    (:mod:`npformer.gpu.cuda_graph`); the tests prove that on any backend."""
    previous = getattr(_host_reads, "forbidden", None)
    _host_reads.forbidden = reason
    try:
        yield
    finally:
        _host_reads.forbidden = previous


def asarray(data: Any, dtype: Any = None) -> Array:
    """Copy host data (NumPy array, list, scalar) onto the current backend.

    ``dtype`` may be a name ("float32", "int64", "bool") or None (keep the data's).
    """
    xp_ = _now().xp
    if isinstance(dtype, str):
        dtype = getattr(xp_, dtype)
    if _library_of(data) == _LIBRARY[_now().name]:  # already on the backend: no copy
        return data if dtype is None else xp_.astype(data, dtype)
    reason = getattr(_host_reads, "forbidden", None)
    if reason is not None and _now().name != "numpy":
        raise HostReadError(f"{reason}: host data of type {type(data).__name__} was to be "
                            "copied to the device")
    if _now().name == "numpy":
        return xp_.asarray(data, dtype=dtype)
    arr = xp_.asarray(data if _now().name == "cupy" else np.asarray(data))
    if _now().name == "strict":  # built on the CPU device, then moved like a real transfer
        arr = arr.to_device(_now().device)
    return arr if dtype is None else xp_.astype(arr, dtype)


def to_numpy(x: Array) -> np.ndarray:
    """Copy a backend array (of any backend) to a NumPy array on the host."""
    if isinstance(x, np.ndarray):
        return x
    reason = getattr(_host_reads, "forbidden", None)
    if reason is not None:
        raise HostReadError(f"{reason}: a {type(x).__module__.split('.')[0]} array of shape "
                            f"{tuple(x.shape)} was to be copied to the host")
    module = type(x).__module__
    if module.startswith("cupy"):
        return x.get()
    if module.startswith("array_api_strict"):
        import array_api_strict

        return np.asarray(x.to_device(array_api_strict.Device("CPU_DEVICE")))
    return np.asarray(x)


def copy_like(value: Any, like: Array) -> Array:
    """``value`` (a NumPy array or an array of any backend) as a fresh array on ``like``'s
    backend with ``like``'s dtype: how saved state is loaded into live parameters."""
    xp_ = namespace_of(like)
    if _library_of(value) != _library_of(like):
        value = asarray(to_numpy(value))
    return xp_.astype(value, like.dtype, copy=True)


def host_range(x: Array) -> tuple[int, int]:
    """(min, max) of a non-empty integer array as Python ints, read from the device in one
    copy (each copy waits for the device: one wait per check, not two)."""
    xp_ = namespace_of(x)
    low, high = to_numpy(xp_.stack([xp_.min(x), xp_.max(x)]))
    return int(low), int(high)


def to_float(x: Array) -> float:
    """A 0-d backend array (or a Python number) as a Python float, on the host."""
    return float(to_numpy(x)) if not isinstance(x, (int, float)) else float(x)


# --------------------------------------------------------------------------- random numbers


def _rng():
    """The generator of this thread: its own inside :func:`thread_generator`, else the backend's."""
    return getattr(_thread_local, "rng", None) or _now().rng


def _new_generator(seed_value: int | None) -> Any:
    """A generator of the current backend's library (CuPy's on cupy, else NumPy's)."""
    if _now().name == "cupy":
        import cupy

        return cupy.random.default_rng(seed_value)
    return np.random.default_rng(seed_value)


@contextmanager
def thread_generator(seed_value: int) -> Iterator[None]:
    """Within the block, this thread draws from its own generator seeded with ``seed_value``
    (data-parallel replicas: reproducible dropout masks whatever the thread timing)."""
    previous = getattr(_thread_local, "rng", None)
    _thread_local.rng = _new_generator(seed_value)
    try:
        yield
    finally:
        _thread_local.rng = previous


def seed(value: int) -> None:
    """Reseed the backend's generator: dropout masks and initialisations repeat exactly.
    ``value``: an integer >= 0 (None: from the OS's entropy)."""
    _now().rng = _new_generator(_checked_seed(value))


def get_rng_state() -> dict | None:
    """The generator's state (JSON-able), or None where the library cannot export it (CuPy)."""
    if _now().name == "cupy":
        return None
    return _now().rng.bit_generator.state


def set_rng_state(state: dict | None) -> None:
    """Restore a state from :func:`get_rng_state` (None: leave the generator as it is)."""
    if state is not None and _now().name != "cupy":
        _now().rng.bit_generator.state = state


def _from_generator(sample, dtype):
    if _now().name == "cupy":
        return _now().xp.astype(sample, dtype)
    if _now().name == "strict":
        return asarray(sample, dtype=dtype)
    return sample.astype(dtype, copy=False)


def random_uniform(shape: tuple[int, ...], dtype: Any = None) -> Array:
    """Uniform [0, 1) samples of ``shape`` on the current backend."""
    dtype = dtype or default_float()
    return _from_generator(_rng().random(tuple(shape)), dtype)


def random_normal(shape: tuple[int, ...], std: float = 1.0, dtype: Any = None) -> Array:
    """Normal(0, std^2) samples of ``shape`` on the current backend."""
    dtype = dtype or default_float()
    return _from_generator(_rng().standard_normal(tuple(shape)) * std, dtype)


# --------------------------------------------------------------------------- scatter-add
def scatter_add_rows(index: Array, values: Array, num_rows: int) -> Array:
    """``out[index[n], :] += values[n, :]`` for every n, repeated indices accumulating.

    index: (N,) integers in [0, num_rows); values: (N, D).  Returns (num_rows, D).
    The array API standard has no scatter-add, so each library gets its kernel.
    """
    xp_ = namespace_of(values)
    n_cols = values.shape[1]
    out = xp_.zeros((num_rows, n_cols), dtype=values.dtype, device=device_of(values))
    module = type(values).__module__
    if module.startswith("numpy"):
        np.add.at(out, index, values)
        return out
    if module.startswith("cupy"):
        import cupy

        cupy.add.at(out, index, values)  # (cupyx.scatter_add is deprecated for this)
        return out
    # Portable fallback (array_api_strict and any other namespace): a one-hot
    # matrix product, out = onehot(index)^T @ values.  Fine for test sizes.
    rows = xp_.arange(num_rows, dtype=index.dtype, device=device_of(values))
    onehot = xp_.astype(index[:, None] == rows[None, :], values.dtype)  # (N, num_rows)
    return xp_.matmul(xp_.matrix_transpose(onehot), values)


# --------------------------------------------------------------------------- shapes only
class Shape:
    """An array made within :func:`shapes_only`: its shape, no values, no memory.  What is
    computed from it is a Shape too (its shape is kept only where it was made)."""

    def __init__(self, shape: Any = (), dtype: Any = None):
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __array_namespace__(self, api_version: Any = None) -> Any:
        return _SHAPES

    def _same(self, *args: Any, **kwargs: Any) -> Shape:
        return self

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = \
        __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = \
        __rpow__ = __matmul__ = __rmatmul__ = __lt__ = __le__ = __gt__ = __ge__ = \
        __and__ = __rand__ = __or__ = __ror__ = __neg__ = __invert__ = __abs__ = \
        __getitem__ = astype = reshape = _same
    T = mT = property(_same)


class _ShapeNamespace:
    """The namespace of :class:`Shape`: ``zeros``, ``ones``, ``empty``, ``full`` (and their
    ``_like``) keep the shape asked for, every other function gives a Shape, the dtypes are
    NumPy's."""

    def __getattr__(self, name: str) -> Any:
        if name in ("zeros", "ones", "empty", "full"):
            return lambda shape, *args, **kwargs: Shape(shape, kwargs.get("dtype"))
        if name in ("zeros_like", "ones_like", "empty_like", "full_like"):
            return lambda x, *args, **kwargs: Shape(x.shape, x.dtype)
        if hasattr(np, name) and isinstance(getattr(np, name), type) \
                and issubclass(getattr(np, name), np.generic):
            return np.dtype(name)
        return lambda *args, **kwargs: Shape()


class _ShapeGenerator:
    """A generator that draws nothing: the samples' shapes."""

    def random(self, shape: Any) -> Shape:
        return Shape(shape)

    standard_normal = random


_SHAPES = _ShapeNamespace()
_NAMESPACE_OF_TYPE[Shape] = _SHAPES


@contextmanager
def shapes_only() -> Iterator[None]:
    """Within the block, this thread's backend makes no array and draws no random number:
    each array it would make is a :class:`Shape`.  A model built within holds its
    parameters' shapes, no weight: its size, from its own definition, before one weight is
    allocated (:func:`npformer.models.common.parameter_count`); the generators' states are
    as they were."""
    previous = getattr(_thread_local, "shapes", None), getattr(_thread_local, "rng", None)
    _thread_local.shapes = _Backend("shapes", _SHAPES, "cpu", _ShapeGenerator(),
                                    _now().default_float)
    _thread_local.rng = None
    try:
        yield
    finally:
        _thread_local.shapes, _thread_local.rng = previous


def making_shapes() -> bool:
    """Whether this thread is within :func:`shapes_only`."""
    return getattr(_thread_local, "shapes", None) is not None
