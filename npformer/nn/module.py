"""Parameter and Module: the bookkeeping every layer shares.

A layer is a :class:`Module` that owns :class:`Parameter` objects (and other modules).
Its ``forward`` keeps exactly what its ``backward`` needs (:meth:`Module._save`); the
math is in the ops (:mod:`npformer.ops`; the fast tier's subclasses call
:mod:`npformer.fast`'s).  A layer that builds other layers names their classes as class
attributes (``EncoderBlock.FeedForward``), which the fast tier's layer replaces.

The layer contract: ``backward(dout)`` takes the gradient of forward's output,
*adds* the gradient of every parameter into ``param.grad`` (a parameter used twice, as
a tied embedding, receives both shares), and returns the gradients of forward's
floating-point array arguments in forward's order: the array (``dx``), a tuple for
several (cross-attention's ``(dx, dcontext)``), None for none (integer ids).  Masks,
valid lengths and caches describe the batch; they are not differentiated.

``dout`` must have exactly the shape and dtype forward returned: at the door, backward
checks it against what forward recorded (ValueError naming both shapes, TypeError for
a non-array or another dtype), and refuses a backward with no forward (RuntimeError).
:meth:`Module.__init_subclass__` wraps every subclass's ``forward`` and ``backward``.

Checked once, at the door (:mod:`npformer.ops.contracts`): the outermost module called
checks its inputs and runs everything inside it trusted.  A leaf layer's door is its
op's contract; a module of several layers (a block, a model) declares
``check_inputs(*args, **kwargs)``, called with forward's arguments.

Parameters are named by walking a module's attributes in the order they were assigned:
a child ``self.attn``'s ``weight`` is ``"attn.weight"``, a list ``self.layers`` gives
``"layers.0.attn.weight"``.
"""
from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from operator import attrgetter
from typing import Any

from .. import backend
from ..backend import Array
from ..ops.contracts import _state, check_flag, check_upstream, trusted, trusting
from .state import checked_weights

_local = threading.local()  # each thread its own switch, as each has its own generator


def grad_enabled() -> bool:
    """False inside :func:`no_grad` (in this thread): forwards then keep nothing for a backward."""
    return getattr(_local, "grad_enabled", True)


@contextmanager
def set_grad_enabled(enabled: bool) -> Iterator[None]:
    """Run a block with this thread's gradient switch set to ``enabled``, then restore it."""
    enabled = check_flag(enabled, "enabled")
    previous, _local.grad_enabled = grad_enabled(), enabled
    try:
        yield
    finally:
        _local.grad_enabled = previous


def no_grad() -> AbstractContextManager[None]:
    """Inference mode for this thread: layers keep no activations, so memory stays flat."""
    return set_grad_enabled(False)


@contextmanager
def evaluating(model: Module) -> Iterator[Module]:
    """Evaluation: ``model`` in eval mode (no dropout) under :func:`no_grad`; the model's
    previous mode is restored afterwards, whatever it was."""
    was_training = model.training
    model.eval()
    try:
        with no_grad():
            yield model
    finally:
        model.train(was_training)


class Parameter:
    """A trainable array and the gradient accumulated for it.

    ``data`` and ``grad`` are rebound, never written through, so the same code works on
    namespaces without in-place writes (the strict array API).  ``decay`` tells AdamW
    whether weight decay applies (False for biases, norms and embeddings).

    ``frozen`` (:meth:`freeze`, :meth:`Module.freeze`): not trained.  A frozen parameter
    holds no gradient (``grad`` is None, and a backward's share is dropped, not added),
    and the optimizers keep no state for it: the memory of a gradient and of Adam's two
    moments, three arrays of the parameter's size, is not spent on it.
    """

    __slots__ = ("data", "grad", "decay", "frozen")

    def __init__(self, data: Array, decay: bool = True):
        self.data = data
        self.grad = None
        self.decay = decay
        self.frozen = False
        self.zero_grad()

    def freeze(self) -> None:
        """Stop training this parameter: its gradient array is released."""
        self.frozen, self.grad = True, None

    def unfreeze(self) -> None:
        """Train this parameter again, from a zero gradient."""
        self.frozen = False
        self.zero_grad()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def zero_grad(self) -> None:
        """A zero gradient (none for a frozen parameter)."""
        self.grad = None if self.frozen else backend.namespace_of(self.data).zeros_like(self.data)

    def accumulate(self, grad: Array) -> None:
        """``grad`` += the gradient of one use of this parameter (dropped when frozen)."""
        if not self.frozen:
            self.grad = self.grad + grad

    def __repr__(self) -> str:
        return f"Parameter(shape={self.shape}, dtype={self.data.dtype})"


def flat_layout(shapes: Sequence[tuple[int, ...]]) -> tuple[list[tuple[int, int]], int]:
    """Arrays of ``shapes`` laid end to end in one flat buffer: ([(lo, hi)] of each, the
    buffer's length P).  The one layout of every flat buffer of parameters or gradients
    (the all-reduce's, the fast tier's)."""
    slices, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        slices.append((offset, offset + size))
        offset += size
    return slices, offset


class Module:
    """Base class of every layer and model."""

    training: bool = True
    check_inputs = None  # a module of several layers: its forward's contract (see above)

    def __init_subclass__(cls, **kwargs):
        """A subclass's own forward records its output's shape, and its own backward checks
        the upstream gradient against it (see the module docstring), at the door only:
        :class:`_Door` gives the method itself to a caller inside a door."""
        super().__init_subclass__(**kwargs)
        if "forward" in vars(cls):
            forward = vars(cls)["forward"]
            cls.forward = _Door(forward, _recording_output_shape(forward))
        if "backward" in vars(cls):
            backward = vars(cls)["backward"]
            cls.backward = _Door(backward, _checking_upstream(backward))

    # ------------------------------------------------------------ traversal
    def _children(self) -> Iterator[tuple[str, Module | Parameter]]:
        for name, value in vars(self).items():
            if name.startswith("_"):
                continue
            if isinstance(value, (Module, Parameter)):
                yield name, value
            elif isinstance(value, (list, tuple)) and value and all(isinstance(v, Module)
                                                                    for v in value):
                for i, child in enumerate(value):
                    yield f"{name}.{i}", child

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """(dotted name, Parameter) for every parameter, in definition order; a parameter
        two modules hold (LoRA adapters sharing one A) once, under its first name, as
        ``torch.nn.Module.named_parameters`` does."""
        seen: set[int] = set()
        for name, p in self._all_named_parameters(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def _all_named_parameters(self, prefix: str) -> Iterator[tuple[str, Parameter]]:
        for name, value in self._children():
            full = f"{prefix}{name}"
            if isinstance(value, Parameter):
                yield full, value
            else:
                yield from value._all_named_parameters(full + ".")

    def parameters(self) -> list[Parameter]:
        """Every parameter, frozen or not (what is saved and loaded)."""
        return [p for _, p in self.named_parameters()]

    def trainable_parameters(self) -> list[Parameter]:
        """The parameters that are not frozen: what an optimizer updates."""
        return [p for p in self.parameters() if not p.frozen]

    def freeze(self) -> Module:
        """Freeze every parameter of this module and its children (:meth:`Parameter.freeze`):
        no gradient arrays, no optimizer state.  Returns the module."""
        for p in self.parameters():
            p.freeze()
        return self

    def unfreeze(self) -> Module:
        """Train every parameter of this module again (zero gradients).  Returns it."""
        for p in self.parameters():
            p.unfreeze()
        return self

    def modules(self) -> Iterator[Module]:
        yield self
        for _, value in self._children():
            if isinstance(value, Module):
                yield from value.modules()

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """(dotted name, module) for this module ("" unless ``prefix``) and every module in
        it, named as :meth:`named_parameters` names their parameters' owners."""
        yield prefix.rstrip("."), self
        for name, value in self._children():
            if isinstance(value, Module):
                yield from value.named_modules(f"{prefix}{name}.")

    def num_parameters(self) -> int:
        return sum(math.prod(p.shape) for p in self.parameters())

    # ------------------------------------------------------------ modes
    def train(self, mode: bool = True) -> Module:
        mode = check_flag(mode, "mode")  # a str "False" would switch training on
        for m in self.modules():
            m.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.zero_grad()

    # ------------------------------------------------------------ forward / backward
    def forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, dout: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    _on_gradients_final = None  # who listens to _gradients_final (data parallelism), if any

    def _gradients_final(self, *modules: Module | None) -> None:
        """A model's backward calls this once ``modules``' gradients are whole (nothing
        later in the backward adds to them; None entries are skipped): data parallelism
        then sums them across the ranks while the backward goes on
        (:mod:`npformer.parallel.buckets`).  Nobody listening: nothing happens."""
        if self._on_gradients_final is not None:
            self._on_gradients_final(modules)


    def _save(self, saved, slot: str = "_saved") -> None:
        """Keep what backward needs, unless in inference mode (:func:`no_grad`).
        ``slot``: the attribute, for a module with a second forward (a tied projection)."""
        setattr(self, slot, saved if grad_enabled() else None)

    def _pop_saved(self, slot: str = "_saved"):
        """The saved values of the last forward (released), or a clear error if there is none."""
        saved = self._peek_saved(slot)
        setattr(self, slot, None)
        return saved

    def _peek_saved(self, slot: str = "_saved"):
        """The saved values of the last forward (kept for the backward), or a clear error."""
        saved = getattr(self, slot, None)
        if saved is None:
            raise RuntimeError(_no_forward_message(self))
        return saved

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """{dotted name: array} of every parameter: copies, a snapshot that later training
        does not change (``best = model.state_dict()`` keeps the weights of that moment,
        in either tier; unlike ``torch.nn.Module.state_dict``, which returns references)."""
        return {name: backend.copy_like(p.data, p.data) for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict) -> None:
        """Copy arrays into the parameters, checking names, shapes and values first
        (:func:`npformer.nn.state.checked_weights`: floating point, finite, exactly the
        parameters' names and shapes), each cast to its parameter's dtype.

        Every name and shape problem is reported at once, before anything is changed.
        """
        own = dict(self.named_parameters())
        host = checked_weights({name: p.shape for name, p in own.items()}, state,
                               type(self).__name__)
        for name, p in own.items():
            p.data = backend.copy_like(host[name], p.data)
            p.zero_grad()


_ANY_SHAPE = "any"  # a forward whose output is not one array: backward checks no shape


class _Door:
    """A module's own forward or backward, as its instances see it: inside a door (a call
    from another module's forward or backward, contracts already checked) the method itself,
    so that a debugger steps from the caller's line straight into it and no frame of this
    file is on the stack; outside, a user's call, the door (``door``: the inputs or the
    upstream gradient checked, the method run trusted, the output's shape recorded).  The
    lookup costs one call; the method runs with nothing around it."""

    __slots__ = ("method", "door")

    def __init__(self, method, door):
        self.method, self.door = method, door

    def __get__(self, instance, owner=None):  # one statement: a debugger's step passes it
        return (self.method if instance is None or _state.trusted else self.door).__get__(
            instance, owner)


# ``module(*args)`` is ``module.forward(*args)``, looked up as above: a property whose getter
# is C code, so no frame of its own (a ``def __call__`` would stand between the caller and
# every forward, as it does in PyTorch).
Module.__call__ = property(attrgetter("forward"), doc="module(*args): module.forward(*args)")


def _no_forward_message(module) -> str:
    return (f"{type(module).__name__}.backward called without a forward pass to "
            "differentiate (forward was not run, ran under no_grad(), or backward "
            "already consumed it)")


def _recording_output_shape(forward):
    """forward (its inputs checked at the door, see the module docstring), then the shape
    and dtype of its output kept for backward (None under no_grad)."""
    @functools.wraps(forward)
    def recorded(self, *args, **kwargs):
        if trusted() or self.check_inputs is None:
            out = forward(self, *args, **kwargs)
        else:
            self.check_inputs(*args, **kwargs)
            with trusting():  # a with block, not a call: no frame between this and forward
                out = forward(self, *args, **kwargs)
        output = (tuple(out.shape), out.dtype) if hasattr(out, "shape") else _ANY_SHAPE
        self._output_shape = output if grad_enabled() else None
        return out
    return recorded


def _checking_upstream(backward):
    """backward, after checking dout against the recorded output (at the door only); the
    record is released once backward has run (a second backward is refused)."""
    @functools.wraps(backward)
    def checked(self, dout, *args, **kwargs):
        expected = getattr(self, "_output_shape", None)
        if expected is None:
            raise RuntimeError(_no_forward_message(self))
        if trusted():
            grads = backward(self, dout, *args, **kwargs)
        else:
            if expected is not _ANY_SHAPE:
                check_upstream(dout, expected[0], f"{type(self).__name__}.backward",
                               expected[1], source="forward's output")
            with trusting():
                grads = backward(self, dout, *args, **kwargs)
        self._output_shape = None
        return grads
    return checked


