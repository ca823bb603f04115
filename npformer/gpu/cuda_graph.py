r"""A training update captured once as a CUDA graph, then replayed with one launch (CuPy's
stream capture, as PyTorch's ``torch.cuda.graphs``): eagerly each of its hundreds of array
operations costs a launch on the host while the GPU waits (docs/guide.md, "CUDA graphs").
The update is the Trainer's: forward, loss, backward, clipping to the global norm,
Adam(W).  What a replay needs, and how :func:`device_update` gives it:

* **Nothing waits for the device inside it.**  The batch is checked on the host before
  it is copied (:meth:`npformer.train.tasks.Task.check_batch`: the model's door and the
  targets' range, on the NumPy batch) and the model then runs trusted; attention takes
  its dense statements (the blocked walk reads the mask's extents on the host); the
  loss stays on the device (:meth:`~npformer.train.tasks.Task.loss_and_grad_on_device`);
  the norm, the clipping factor and the finiteness test are device arrays.  Within
  :func:`graph_safe` any copy between host and device raises, on every backend, which
  the tests use to prove it on the CPU.
* **Static buffers.**  Each replay first copies the new batch into the arrays the graph
  reads; parameters, gradients and Adam's moments are updated in place, where the
  graph will read them next time.
* **Scalars on the device.**  The learning rate (written before each replay, from the
  schedule) and Adam's update count t (advanced by the graph itself) are 0-d device
  arrays; the bias corrections are computed from them on the device.
* **Divergence.**  A non-finite loss or gradient norm turns a device flag off, and the
  update is then skipped on the device.  The host reads (loss, norm, flag) after each
  replay, one copy, and the Trainer raises :class:`~npformer.train.TrainingDiverged`
  naming it, with nothing updated.
* **Memory.**  A capture allocates from a memory pool of its own, kept with its graph
  and used by nothing else: the graph reuses those addresses on every replay.
* **Dropout.**  CuPy's ``default_rng`` keeps its state on the device and its kernels
  advance it, so each replay draws new masks.  (The eager Trainer seeds a generator per
  batch on the host; a graph cannot, so its masks are other draws, as random.)
* **Shapes.**  The first update of a batch shape runs the same statements eagerly (it
  compiles the kernels and makes cuBLAS's handle, work a capture must not record);
  the second is captured and replayed, later ones replayed.  A run of a few shapes
  holds a few graphs; ``StepGraphs.capture_seconds`` is what capturing cost.
* **Products** go through cuBLAS directly (:mod:`npformer.gpu.gemm`): CuPy refuses cuBLAS while
  capturing.

Where capture cannot apply, :func:`unsupported` says why and the Trainer trains eagerly
(:class:`GraphedSteps`).  ``tests/test_graph.py``: on the CPU, :func:`device_update`
equals the eager update and reads nothing from the device; on a GPU, so does a replay.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import backend, optim
from ..backend import Array
from ..ops.contracts import run_trusted
from . import gemm


class CaptureFailed(RuntimeError):
    """Capturing an update failed (the message names why); nothing was updated."""


@contextmanager
def graph_safe() -> Iterator[None]:
    """Within the block: products through :mod:`npformer.gpu.gemm` (capturable),
    attention's dense statements, and any copy between host and device an error."""
    previous = gemm.set_routed(True)
    try:
        with backend.device_only("a step captured as a CUDA graph reads nothing from the "
                                 "device and copies nothing to it"):
            yield
    finally:
        gemm.set_routed(previous)


def wanted_by_environment() -> bool:
    """``NPFORMER_CUDA_GRAPH`` read as a boolean (unset: False); another value is a
    ValueError naming it."""
    return backend.switch("NPFORMER_CUDA_GRAPH")


def unsupported(optimizer: Any, task: Any, replicas: int = 1, grad_accum: int = 1,
                capture: bool = True) -> str | None:
    """Why this update cannot be captured, in one line, or None."""
    if capture and backend.backend_name() != "cupy":
        return f"CUDA graphs need the cupy backend (this run is on {backend.backend_name()})"
    if not isinstance(optimizer, optim.Adam):
        return f"the graph's update is Adam's or AdamW's, not {type(optimizer).__name__}'s"
    if not optimizer._decoupled and optimizer.weight_decay != 0:
        return "Adam with L2 decay (weight_decay on the gradient) is not captured; AdamW is"
    if not reads_its_loss_on_device(task):
        return (f"the task {type(task).__name__} defines loss_and_grad but not "
                "loss_and_grad_on_device")
    if replicas != 1 or grad_accum != 1:
        return (f"one replica and one batch an update are captured (replicas {replicas}, "
                f"grad_accum {grad_accum})")
    dtypes = {p.data.dtype for p in optimizer.params}
    if len(dtypes) != 1:
        return f"parameters of one floating dtype are captured, not {sorted(map(str, dtypes))}"
    return None


def reads_its_loss_on_device(task: Any) -> bool:
    """Whether ``task``'s ``loss_and_grad`` is its on-device one read back: the class that
    defines the ``loss_and_grad`` it runs defines ``loss_and_grad_on_device`` too, and is
    not the abstract :class:`npformer.train.Task` (a subclass that overrides loss_and_grad
    alone keeps its own)."""
    owner = next(c for c in type(task).__mro__ if "loss_and_grad" in vars(c))
    return "loss_and_grad_on_device" in vars(owner) and not getattr(
        vars(owner)["loss_and_grad"], "__isabstractmethod__", False)


# =========================================================================== the update
@dataclass
class DeviceScalars:
    """What the update reads and writes on the device besides the model: the learning
    rate and Adam's update count t (float64, 0-d), and the stable gradient arrays."""

    lr: Array
    t: Array
    grads: list[Array]

    @classmethod
    def of(cls, optimizer: optim.Adam) -> DeviceScalars:
        xp, dev = backend.namespace_of(optimizer.params[0].data), \
            backend.device_of(optimizer.params[0].data)
        grads = [p.grad if p.grad is not None else xp.zeros_like(p.data)
                 for p in optimizer.params]
        return cls(xp.asarray(float(optimizer.lr), dtype=xp.float64, device=dev),
                   xp.asarray(float(optimizer.updates), dtype=xp.float64, device=dev),
                   grads)


def device_update(model: Any, task: Any, optimizer: optim.Adam, clip_norm: float | None,
                  batch: Sequence[Array], scalars: DeviceScalars) -> Array:
    """One update on device arrays, reading nothing back: gradients zeroed, forward, loss
    and backward, the global norm, clipping, Adam(W), each gated by the loss and the norm
    being finite.  Returns (loss, norm, finite) as a float64 (3,) device array."""
    params = optimizer.params
    for p, g in zip(params, scalars.grads):
        g[...] = 0  # in place: the graph zeroes the arrays it accumulates into
        p.grad = g
    loss = run_trusted(task.loss_and_grad_on_device, model, tuple(batch), 1.0)  # (), checked
    for p, g in zip(params, scalars.grads):  # a layer that rebound its gradient: copied back
        if p.grad is not g:
            g[...] = p.grad
            p.grad = g
    xp = backend.namespace_of(loss)
    norm = optim.grad_norm_on_device(scalars.grads)  # (), in the gradients' dtype
    finite = xp.isfinite(norm) & xp.isfinite(loss)  # (), bool
    if clip_norm is not None:
        clip_gradients(scalars.grads, norm, finite, clip_norm)
    adam_update(optimizer, scalars, finite)
    return xp.stack([xp.astype(loss, xp.float64), xp.astype(norm, xp.float64),
                     xp.astype(finite, xp.float64)])


def clip_gradients(grads: Sequence[Array], norm: Array, finite: Array, max_norm: float) -> None:
    """g_i <- c g_i with c = min(max_norm / (norm + 1e-6), 1) (``optim.clip_grad_norm``'s
    factor, in float64 as the host computes it), in place; c = 1 where not finite."""
    xp = backend.namespace_of(norm)
    c = xp.minimum(max_norm / (xp.astype(norm, xp.float64) + 1e-6), 1.0)  # (), float64
    c = xp.where(finite, c, xp.ones_like(c))
    for g in grads:
        g *= xp.astype(c, g.dtype)


def adam_update(optimizer: optim.Adam, scalars: DeviceScalars, finite: Array) -> None:
    """Update t = t + 1 of Adam(W) on every parameter, in place, where ``finite``: the
    statements of :meth:`npformer.optim.Adam._update` (and AdamW's decay first), with the
    learning rate and t read from the device."""
    xp = backend.namespace_of(scalars.t)
    b1, b2, lr, t = optimizer.beta1, optimizer.beta2, scalars.lr, scalars.t + 1.0  # this update's t
    dtype = optimizer.params[0].data.dtype
    decaying = optimizer._decoupled and optimizer.weight_decay != 0
    coefficients = xp.astype(xp.stack([  # the factors that depend on lr and t, rounded
        1 - lr * optimizer.weight_decay,   # p (1 - lr lambda)
        xp.sqrt(1 - b2**t),                # sqrt(bc2), bc2 = 1 - beta2^t
        lr / (1 - b1**t),                  # step = lr / bc1, bc1 = 1 - beta1^t
    ]), dtype)  # (3,)
    scalars.t[...] = xp.where(finite, t, scalars.t)  # t counts the updates made
    ok = xp.reshape(finite, (1,))
    constants = _constants(optimizer, dtype)
    for i, p in enumerate(optimizer.params):
        _adam_in_place(p.data, scalars.grads[i], optimizer.state["m"][i],
                       optimizer.state["v"][i], coefficients, ok, constants,
                       decaying and p.decay)


def _constants(optimizer: optim.Adam, dtype) -> tuple:
    """(1 - beta1, 1 - beta2, beta2, eps) rounded to ``dtype`` (as the host update rounds
    them), as Python floats."""
    cast = np.dtype(str(dtype).rsplit(".", 1)[-1]).type  # numpy, cupy or strict dtype
    b1, b2 = optimizer.beta1, optimizer.beta2
    return tuple(float(cast(c)) for c in (1 - b1, 1 - b2, b2, optimizer.eps))


def _adam_in_place(p: Array, g: Array, m: Array, v: Array, coefficients: Array, ok: Array,
                   constants: tuple, decay: bool) -> None:
    one_minus_beta1, one_minus_beta2, beta2, eps = constants  # (:func:`_constants`)
    if type(p).__module__.startswith("cupy"):  # the constants cast to p's dtype
        _adam_kernel()(g, coefficients, ok, *map(p.dtype.type, constants), bool(decay), p, m, v)
        return
    xp = backend.namespace_of(p)  # the same statements as array operations
    kept = p * coefficients[0] if decay else p  # p (1 - lr lambda)
    m_new = m + (g - m) * one_minus_beta1  # m + (1 - beta1)(g - m)
    v_new = v * beta2 + (g * g) * one_minus_beta2  # beta2 v + (1 - beta2) g^2
    denom = xp.sqrt(v_new) / coefficients[1] + eps  # sqrt(v)/sqrt(bc2) + eps
    new_p = kept - (m_new / denom) * coefficients[2]  # p - step m / denom
    ok0 = ok[0]
    p[...] = xp.where(ok0, new_p, p)
    m[...] = xp.where(ok0, m_new, m)
    v[...] = xp.where(ok0, v_new, v)


_ADAM_IN_PLACE = """
if (ok[0]) {
    T kept = p;
    if (decay) kept = kept * coef[0];
    T delta = g - m;
    delta = delta * one_minus_beta1;
    T m_new = m + delta;
    T g_sq = g * g;
    g_sq = g_sq * one_minus_beta2;
    T v_new = v * beta2;
    v_new = v_new + g_sq;
    T denom = sqrt(v_new);
    denom = denom / coef[1];
    denom = denom + eps;
    T update = m_new / denom;
    update = update * coef[2];
    p = kept - update;
    m = m_new;
    v = v_new;
}
"""


@functools.cache
def _adam_kernel():
    """Adam(W)'s update of one parameter in place, its factors read from the device, one
    CuPy kernel (no multiply-add contraction: each statement rounded as written)."""
    import cupy

    return cupy.ElementwiseKernel(
        "T g, raw T coef, raw bool ok, T one_minus_beta1, T one_minus_beta2, T beta2, T eps, "
        "bool decay", "T p, T m, T v", _ADAM_IN_PLACE, name="npformer_adam_graph",
        options=("--fmad=false",))


# =========================================================================== the graphs
@dataclass
class _Shape:
    """What one batch shape holds: its static input buffers, and once captured, its graph,
    the graph's memory pool and its result array."""

    inputs: tuple
    graph: Any = None
    pool: Any = None
    results: Any = None


class StepGraphs:
    """The Trainer's updates as CUDA graphs, one per batch shape (``capture=False``: the
    same device statements run eagerly, on any backend: what the CPU tests check)."""

    def __init__(self, model: Any, optimizer: optim.Adam, task: Any,
                 clip_norm: float | None, capture: bool = True):
        self.model, self.optimizer, self.task, self.clip_norm = model, optimizer, task, clip_norm
        self.capture = capture
        self.scalars = DeviceScalars.of(optimizer)
        self.shapes: dict[tuple, _Shape] = {}
        self._captured_arrays = self._arrays()
        self._steps_seen = optimizer.updates
        self.captures = 0
        self.capture_seconds = 0.0
        self.stream = None
        if capture:
            import cupy

            self.stream = cupy.cuda.Stream(non_blocking=True)

    def update(self, batch: tuple) -> np.ndarray:
        """One update on ``batch`` (host arrays); returns (loss, norm, finite) on the host.
        The optimizer's step count and learning rate advance on the host with the graph's
        (a non-finite update is not counted: the Trainer then stops)."""
        batch = tuple(np.asarray(a) for a in batch)
        self.task.check_batch(self.model, batch)  # the door, on the host
        self._follow_the_optimizer()
        t = self.optimizer.updates + 1
        if self.optimizer.schedule is not None:
            self.optimizer.lr = optim.check_hyperparameter(self.optimizer.schedule(t), "lr")
        key = tuple((a.shape, a.dtype.str) for a in batch)
        with self._on_stream():
            self.scalars.lr[...] = float(self.optimizer.lr)
            shape = self.shapes.get(key)
            if shape is None:  # a new shape: its buffers, and an eager first update
                shape = self.shapes[key] = _Shape(tuple(backend.asarray(a) for a in batch))
                results = self._step(shape)
            else:
                self._copy_in(shape, batch)
                if self.capture and shape.graph is None:
                    self._capture(shape)
                if shape.graph is not None:
                    shape.graph.launch(self.stream)  # a replay: its results in shape.results
                results = self._step(shape) if shape.graph is None else shape.results
            host = backend.to_numpy(results) if self.stream is None else \
                results.get(stream=self.stream)
        if host[2] == 1.0:
            self.optimizer.updates = t
        self._steps_seen = self.optimizer.updates
        return host

    def _follow_the_optimizer(self) -> None:
        """Arrays rebound since the graphs were made (a loaded checkpoint) void them; a step
        count set from outside (a resume) is copied to the device's t."""
        arrays = self._arrays()
        if arrays != self._captured_arrays:
            self.shapes.clear()
            self.scalars = DeviceScalars.of(self.optimizer)
            self._captured_arrays = self._arrays()
        if self.optimizer.updates != self._steps_seen:
            self.scalars.t[...] = float(self.optimizer.updates)
            self._steps_seen = self.optimizer.updates

    def _arrays(self) -> tuple:
        """The identities of the arrays a graph reads and writes in place."""
        opt = self.optimizer
        return tuple((id(p.data), id(opt.state["m"][i]), id(opt.state["v"][i]))
                     for i, p in enumerate(opt.params))

    # ------------------------------------------------------------------ pieces
    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        """The graph's stream (after the work already queued on the current one), or
        nothing without capture."""
        if self.stream is None:
            yield
            return
        import cupy

        self.stream.wait_event(cupy.cuda.get_current_stream().record())
        with self.stream:
            yield

    def _copy_in(self, shape: _Shape, batch: tuple) -> None:
        for static, host in zip(shape.inputs, batch):
            if self.stream is not None:
                static.set(np.ascontiguousarray(host, dtype=static.dtype), stream=self.stream)
            else:
                static[...] = backend.asarray(host)

    def _step(self, shape: _Shape) -> Array:
        """The update on this shape's buffers (run, or recorded while capturing); a read
        from the device in it is :class:`CaptureFailed` (forward and backward come before
        any weight changes: nothing was updated)."""
        try:
            with graph_safe():
                return device_update(self.model, self.task, self.optimizer, self.clip_norm,
                                     shape.inputs, self.scalars)
        except backend.HostReadError as exc:
            raise CaptureFailed(f"the update cannot be captured: {exc}") from exc

    def _capture(self, shape: _Shape) -> None:
        """Record the update on this shape's buffers into a graph, its memory from a pool
        of its own.  A failure leaves no capture open and is raised, naming the cause."""
        import cupy

        started = time.perf_counter()
        pool = cupy.cuda.MemoryPool()
        with cupy.cuda.using_allocator(pool.malloc):
            self.stream.begin_capture()
            try:
                results = self._step(shape)
            except Exception as exc:
                try:
                    self.stream.end_capture()
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
                if isinstance(exc, CaptureFailed):
                    raise
                raise CaptureFailed(f"capturing the update failed: "
                                    f"{type(exc).__name__}: {exc}") from exc
            try:
                graph = self.stream.end_capture()
            except Exception as exc:  # noqa: BLE001 - an invalidated capture: say why
                raise CaptureFailed(f"the capture was invalidated: {exc}") from exc
        shape.graph, shape.pool, shape.results = graph, pool, results
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started


# =========================================================================== the Trainer's
class GraphedSteps:
    """Whether the Trainer's updates are replayed as CUDA graphs (:class:`StepGraphs`):
    where the run asks for them (``config.cuda_graph``, the Trainer's ``TrainConfig``;
    None: ``NPFORMER_CUDA_GRAPH``) and they apply on ``ranks`` MPI ranks, decided at the
    first update (:meth:`on`); eager from the first capture that fails.  ``log`` is told
    why they are off."""

    def __init__(self, model: Any, optimizer: Any, task: Any, config: Any, ranks: int,
                 log: Callable[[str], None]):
        self.model, self.optimizer, self.task, self.config = model, optimizer, task, config
        self.ranks, self.log = ranks, log
        self.wanted = config.cuda_graph if config.cuda_graph is not None else \
            wanted_by_environment()
        self.graphs: StepGraphs | bool | None = None  # None: not decided; False: eager

    def on(self) -> bool:
        """Whether this update is replayed (decided at the first)."""
        if self.graphs is None:
            self.graphs = self._new() or False
        return bool(self.graphs)

    def update(self, batch: tuple) -> np.ndarray | None:
        """(loss, norm, finite) of the update replayed on ``batch`` (:meth:`StepGraphs.update`),
        or None where capturing it failed: nothing was updated, and updates are eager from
        now on, this one included."""
        try:
            return self.graphs.update(batch)
        except CaptureFailed as exc:
            self.graphs = False
            self.log(f"CUDA graph: off ({exc}); training eagerly")
            return None

    def _new(self) -> StepGraphs | None:
        """CUDA graphs for this run, where they are wanted and apply; else None, the
        reason logged where they were wanted."""
        if not self.wanted:
            return None
        cfg = self.config
        reason = unsupported(self.optimizer, self.task, cfg.replicas, cfg.grad_accum)
        if reason is None and self.ranks > 1:
            reason = "several MPI ranks all-reduce between backward and update"
        if reason is not None:
            self.log(f"CUDA graph: off ({reason}); training eagerly")
            return None
        return StepGraphs(self.model, self.optimizer, self.task, cfg.clip_norm)
