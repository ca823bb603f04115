"""Comparison helpers shared by the test files."""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import numpy as np
import pytest

from npformer import backend, fast, models, nn, ops, optim
from npformer.interop.pytorch import load_torch_state_dict


def to_host(x) -> np.ndarray:
    """A NumPy copy of ``x``: an array of any npformer backend (NumPy, strict, CuPy) or a
    torch tensor on any device (detached, brought to the CPU).  torch is recognised by its
    module name, so this file never imports it."""
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().cpu().numpy()
    return backend.to_numpy(x)


def rel_diff(actual, expected, at_least: float = 0.0) -> float:
    """max |actual - expected| / max |expected| (norm-wise relative difference).

    Element-wise relative error is meaningless for entries near zero, so the
    difference is measured against the size of the whole expected tensor, or
    ``at_least`` where that is larger.
    Either side may be an array of any backend or a torch tensor on any device.
    """
    a = np.asarray(to_host(actual), dtype=np.float64)
    e = np.asarray(to_host(expected), dtype=np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != expected {e.shape}"
    scale = max(float(np.max(np.abs(e), initial=0.0)), at_least)
    diff = float(np.max(np.abs(a - e), initial=0.0))
    return diff if scale == 0.0 else diff / scale


def assert_close(actual, expected, rtol: float, what: str = "") -> None:
    d = rel_diff(actual, expected)
    assert d <= rtol, f"{what}: relative difference {d:.3e} exceeds {rtol:.1e}"


# Tolerances of the PyTorch parity tests (issue: 1e-5 float32, 1e-10 float64).
PARITY_RTOL = {"float32": 1e-5, "float64": 1e-10}
GRADCHECK_TOL = 1e-6


# --------------------------------------------------------------------------- torch's device
def torch_device() -> str:
    """The torch device of the PyTorch parity tests, following npformer's current backend:
    "cuda" while npformer runs on CuPy, "cpu" otherwise.  The one place that knows it."""
    return "cuda" if backend.backend_name() == "cupy" else "cpu"


def to_torch(torch, host, **kwargs):
    """Host data as a torch tensor on :func:`torch_device`.  Made there, not moved there:
    ``to_torch(torch, a, requires_grad=True)`` is a leaf whose ``.grad`` autograd fills
    (``torch.tensor(a, requires_grad=True).to("cuda")`` would not be)."""
    return torch.tensor(np.asarray(host), device=torch_device(), **kwargs)


def load_from_torch(module, torch_module) -> None:
    """``torch_module``'s weights into the npformer ``module`` by
    ``npformer.interop.pytorch.load_torch_state_dict``, through the host: the torch state
    dict may live on CUDA, and npformer reads it as NumPy arrays without importing torch."""
    load_torch_state_dict(module, {name: to_host(tensor)
                                   for name, tensor in torch_module.state_dict().items()})


@contextmanager
def torch_in_true_float32(torch):
    """torch's CUDA float32 as plain IEEE float32, the arithmetic of npformer's CuPy side:
    no TF32 in cuBLAS matmuls or cuDNN, and scaled_dot_product_attention on its math
    kernel (its fused memory-efficient kernel multiplies float32 as 3xTF32 on the tensor
    cores of compute capability 8.0 and up).  The settings are global and restored
    afterwards.  Only for tests whose torch side is on CUDA: the SDPA kernel choice on
    the CPU reads the same flags."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# The attention op of each tier: the textbook dense op, the fast blocked op at its default
# block size (one block at test sizes), and the fast op in blocks of 5 scores, which at
# test sizes gives blocks of single queries, of query ranges and of whole rows, with the
# keys a block cannot see cut off.
ATTENTION_OPS = {
    "textbook": (ops.attention_forward, ops.attention_backward),
    "fast": (fast.attention_forward, fast.attention_backward),
    "fast_blocks5": (partial(fast.attention_forward, block_scores=5), fast.attention_backward),
}


# --------------------------------------------------------------------------- the tiers
# The library has no global tier: a program names the class it runs (npformer.models.CausalLM
# or npformer.fast.CausalLM).  A behaviour test runs in both tiers by naming the class of the
# tier under test, ``tiered.CausalLM(config)``: the fixture ``tier`` (tests/conftest.py) or
# ``using_tier(name)`` sets which, for this test process only.
TIER_MODULES = {"fast": (fast.layers, fast.blocks, fast.llama, fast.models, fast.optim),
                "textbook": (nn, models, optim)}


class Tier:
    """The classes and functions of one tier by their textbook names: ``Tier("fast").CausalLM``
    is :class:`npformer.fast.CausalLM`, ``Tier("textbook").CausalLM`` is
    :class:`npformer.models.CausalLM`; a name the fast tier does not reimplement (SGD,
    Module) is the textbook's in both.  ``.ops``: :mod:`npformer.fast` or :mod:`npformer.ops`."""

    def __init__(self, name: str):
        assert name in TIER_MODULES, name
        self.name = name
        self.ops = fast if name == "fast" else ops

    def __getattr__(self, attr: str):
        for module in TIER_MODULES[self.name] + TIER_MODULES["textbook"]:
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"neither tier has {attr!r}")


_under_test = ["fast"]  # the tier a test's ``tiered.X`` names (one test at a time a process)


def tier_under_test() -> str:
    return _under_test[0]


class _TierUnderTest:
    """``tiered.X``: the class X of the tier under test (see above)."""

    def __getattr__(self, attr: str):
        return getattr(Tier(_under_test[0]), attr)


tiered = _TierUnderTest()


def set_tier(name: str) -> None:
    """From now on ``tiered`` names tier ``name``'s classes (prefer :func:`using_tier`)."""
    _under_test[0] = Tier(name).name


@contextmanager
def using_tier(name: str):
    """Name the classes of tier ``name`` ("fast" or "textbook") through ``tiered`` in a
    block, then restore the previous tier."""
    previous = _under_test[0]
    _under_test[0] = Tier(name).name
    try:
        yield
    finally:
        _under_test[0] = previous


@contextmanager
def raises_naming(error, *fragments: str):
    """pytest.raises(error), then every fragment (the argument's name, the axis, the
    sizes: plain substrings, not patterns) must appear in the message.  Tests state what
    the message names, not its whole sentence."""
    with pytest.raises(error) as caught:
        yield caught
    message = str(caught.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"{error.__name__} message {message!r} does not name {missing}"


def tiny_llama(**fields) -> models.LlamaCausalLM:
    """A one-layer Llama of width 8 (two heads, vocabulary 11, feed-forward 12): the small
    model the LoRA and PEFT tests adapt; ``fields`` change its LlamaConfig."""
    sizes = dict(vocab_size=11, d_model=8, d_ff=12, num_layers=1,
                 num_heads=2)
    return models.LlamaCausalLM(models.LlamaConfig(**{**sizes, **fields}))
