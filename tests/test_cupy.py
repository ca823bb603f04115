"""The ops on a real GPU through CuPy: gradient checks and parity with the NumPy backend.

Skipped (reason "needs CuPy and a GPU") where ``import cupy`` fails or no CUDA
device is visible.  On a GPU machine: ``python -m pytest -m gpu``.

* gradient checks in float64 of linear, layer norm, masked softmax, attention
  with a padding & causal mask (and a fully masked row), embedding with repeated
  ids (CuPy's scatter-add kernel), cross-entropy with ignored targets and label
  smoothing, and dropout with a mask repeated by reseeding CuPy's generator;
* every op run on the same host inputs on "numpy" and on "cupy" gives the same
  outputs and gradients (``PARITY_RTOL``), in float32 and float64, and the
  arrays really live on the GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend, ops
from npformer.gradcheck import check_op

from .conftest import GPU, using_backend
from .helpers import GRADCHECK_TOL, PARITY_RTOL, assert_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPU, reason="needs CuPy and a GPU"),
]


@pytest.fixture
def cupy_backend():
    with using_backend("cupy", "float64"):
        assert backend.backend_name() == "cupy"
        yield


def on_gpu(host, dtype=None):
    a = backend.asarray(host, dtype)
    assert type(a).__module__.startswith("cupy"), type(a)
    return a


def assert_passes(result):
    assert result.worst_error < GRADCHECK_TOL, f"gradient check failed:\n{result}"


# =========================================================================== gradient checks
def test_gradcheck_linear(cupy_backend):
    rng = np.random.default_rng(0)
    args = [on_gpu(rng.standard_normal(s)) for s in [(2, 3, 4), (4, 5), (5,)]]
    assert_passes(check_op(ops.linear_forward, ops.linear_backward, args, [0, 1, 2]))


def test_gradcheck_layernorm(cupy_backend):
    rng = np.random.default_rng(1)
    args = [on_gpu(rng.standard_normal(s)) for s in [(2, 3, 5), (5,), (5,)]]
    assert_passes(check_op(ops.layernorm_forward, ops.layernorm_backward, args, [0, 1, 2]))


def test_gradcheck_masked_softmax(cupy_backend):
    rng = np.random.default_rng(2)
    mask = rng.random((3, 4, 5)) < 0.6
    mask[0, 0] = False  # a fully masked row
    mask[1, 1] = False
    mask[1, 1, 2] = True  # a row with one key
    x = on_gpu(rng.standard_normal((3, 4, 5)))
    assert_passes(check_op(ops.softmax_forward, ops.softmax_backward, [x], [0],
                           {"axis": -1, "mask": on_gpu(mask)}))
    assert_passes(check_op(ops.log_softmax_forward, ops.log_softmax_backward, [x], [0]))


def test_gradcheck_attention(cupy_backend):
    rng = np.random.default_rng(3)
    q = on_gpu(rng.standard_normal((2, 2, 3, 3)))
    k = on_gpu(rng.standard_normal((2, 2, 4, 3)))
    v = on_gpu(rng.standard_normal((2, 2, 4, 5)))
    mask = ops.padding_mask(on_gpu(np.array([4, 0])), 4) & ops.causal_mask(3, 4)
    assert_passes(check_op(ops.attention_forward, ops.attention_backward, [q, k, v, mask],
                           [0, 1, 2]))
    out, _ = ops.attention_forward(q, k, v, mask)
    assert np.all(backend.to_numpy(out)[1] == 0.0)  # the fully masked sequence


def test_gradcheck_embedding(cupy_backend):
    rng = np.random.default_rng(4)
    ids = on_gpu(np.array([[1, 3, 1], [0, 1, 3]]))  # repeated ids accumulate
    table = on_gpu(rng.standard_normal((5, 4)))
    assert_passes(check_op(ops.embedding_forward, ops.embedding_backward, [ids, table], [1]))


def test_gradcheck_cross_entropy(cupy_backend):
    rng = np.random.default_rng(5)
    logits = on_gpu(rng.standard_normal((2, 3, 5)))
    targets = on_gpu(np.array([[1, -100, 4], [0, 2, -100]]))
    for smoothing in (0.0, 0.1):
        assert_passes(check_op(ops.cross_entropy_forward, ops.cross_entropy_backward,
                               [logits, targets], [0], {"label_smoothing": smoothing}))


def test_gradcheck_dropout_and_positions(cupy_backend):
    rng = np.random.default_rng(6)
    x = on_gpu(rng.standard_normal((2, 3, 4)))

    def forward(x):
        backend.seed(7)  # the same mask at every evaluation
        return ops.dropout_forward(x, 0.3, training=True)
    assert_passes(check_op(forward, ops.dropout_backward, [x], [0]))
    table = on_gpu(rng.standard_normal((5, 4)))
    assert_passes(check_op(ops.add_positions_forward, ops.add_positions_backward,
                           [x, table], [0, 1]))
    assert_passes(check_op(ops.gelu_forward, ops.gelu_backward, [x], [0]))


# =========================================================================== parity with numpy
def _run_ops(dtype):
    """Every op on fixed host inputs, on the current backend: {name: host array}."""
    rng = np.random.default_rng(42)

    def a(*shape):
        return backend.asarray(rng.standard_normal(shape), dtype)

    results = {}

    def record(name, *arrays):
        for i, x in enumerate(arrays):
            assert str(x.dtype).endswith(dtype), (name, x.dtype)
            results[f"{name}[{i}]"] = backend.to_numpy(x)

    x, w, b = a(2, 3, 4), a(4, 5), a(5,)
    y, c = ops.linear_forward(x, w, b)
    record("linear", y, *ops.linear_backward(a(2, 3, 5), c))
    for name in ("relu", "gelu"):
        forward, backward = ops.activation(name)
        y, c = forward(x)
        record(name, y, backward(a(2, 3, 4), c))
    y, c = ops.layernorm_forward(x, a(4), a(4))
    record("layernorm", y, *ops.layernorm_backward(a(2, 3, 4), c))
    mask = backend.asarray(rng.random((3, 4)) < 0.6)
    y, c = ops.softmax_forward(x, axis=-1, mask=mask)
    record("softmax", y, ops.softmax_backward(a(2, 3, 4), c))
    y, c = ops.log_softmax_forward(x, axis=1)
    record("log_softmax", y, ops.log_softmax_backward(a(2, 3, 4), c))
    q, k, v = a(2, 2, 3, 4), a(2, 2, 5, 4), a(2, 2, 5, 3)
    mask = ops.padding_mask(backend.asarray(np.array([5, 2])), 5) & ops.causal_mask(3, 5)
    y, c = ops.attention_forward(q, k, v, mask)
    record("attention", y, *ops.attention_backward(a(2, 2, 3, 3), c))
    y, c = ops.embedding_forward(backend.asarray(np.array([[1, 1, 5], [0, 2, 1]])), a(6, 4))
    record("embedding", y, ops.embedding_backward(a(2, 3, 4), c))
    table = ops.sinusoidal_table(5, 4, dtype=backend.float_dtype(dtype))
    y, c = ops.add_positions_forward(x, table)
    record("positions", table, y, *ops.add_positions_backward(a(2, 3, 4), c))
    targets = backend.asarray(np.array([[1, -100, 4], [0, 0, 2]]))
    loss, c = ops.cross_entropy_forward(a(2, 3, 5), targets, label_smoothing=0.1)
    record("cross_entropy", loss, ops.cross_entropy_backward(a(), c))
    y, c = ops.dropout_forward(x, 0.5, training=False)
    record("dropout_eval", y, ops.dropout_backward(a(2, 3, 4), c))
    return results


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cupy_matches_numpy(dtype):
    with using_backend("numpy", dtype):
        expected = _run_ops(dtype)
    with using_backend("cupy", dtype):
        actual = _run_ops(dtype)
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert_close(actual[name], value, PARITY_RTOL[dtype], name)


def test_cupy_dropout_training_is_seeded(cupy_backend):
    x = on_gpu(np.ones((1000,)))
    backend.seed(11)
    y1, _ = ops.dropout_forward(x, 0.5)
    backend.seed(11)
    y2, _ = ops.dropout_forward(x, 0.5)
    np.testing.assert_array_equal(backend.to_numpy(y1), backend.to_numpy(y2))
    dropped = np.mean(backend.to_numpy(y1) == 0.0)
    assert 0.4 < dropped < 0.6


# =========================================================================== fused kernels
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("optimizer", ["Adam", "AdamW"])
def test_fused_adam_equals_the_plain_update_bit_for_bit(dtype, optimizer):
    """The fast tier's one-kernel Adam (npformer.fast.fused) gives the textbook
    statements' parameters and moments exactly, over several updates with decay."""
    from npformer.nn.module import Parameter

    from .helpers import tiered, using_tier

    rng = np.random.default_rng(8)
    host = rng.standard_normal((3, 7))
    grads = [rng.standard_normal((3, 7)) for _ in range(4)]
    results = {}
    with using_backend("cupy", dtype):
        for tier in ("fast", "textbook"):
            with using_tier(tier):
                p = Parameter(backend.asarray(host, dtype))
                opt = getattr(tiered, optimizer)([p], lr=0.01, weight_decay=0.1)
                for g in grads:
                    p.grad = backend.asarray(g, dtype)
                    opt.step()
                m, v = (backend.to_numpy(opt.state[name][0]) for name in ("m", "v"))
                results[tier] = (backend.to_numpy(p.data), m, v)
    for fused, plain in zip(results["fast"], results["textbook"]):
        np.testing.assert_array_equal(fused, plain)
    assert not np.array_equal(results["fast"][0], host)  # the parameter did move
