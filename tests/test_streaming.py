"""The few-row product streamed (npformer/fast/streaming.py): a decoding step's x W.

* It adds the terms x[r, p] W[p] in the order of p, as its docstring says: equal to the
  bit to that sum written out in NumPy (:func:`in_order`), for both dtypes, every row
  count up to MAX_ROWS, inner sizes with and without a remainder of four, on one thread
  and on every core (the columns cut into chunks change nothing).
* So it equals NumPy's product to rounding: within the error bound of a sum of K
  products, 2 gamma_K |x| |W| (gamma_K = K u / (1 - K u), u the dtype's unit roundoff),
  which bounds both sides' distance to the exact product.
* Each row's result is the row's alone: a row decoded in a batch gets what it gets alone.
* :func:`takes` picks it only for what it computes: few rows, a large enough W, NumPy
  float arrays of one dtype, C-contiguous, numba present.

The kernels broken on purpose (one element of the result changed) are caught by these
checks: tests/test_kernels.py's BROKEN.
"""
from __future__ import annotations

import numpy as np
import pytest

from npformer.fast import compiler, streaming

from .conftest import using_backend

needs_numba = pytest.mark.skipif(not compiler.COMPILED, reason="numba is not installed")
DTYPES = (np.float64, np.float32)
ROWS = (1, 2, 3, 8, streaming.MAX_ROWS)
INNER = (1, 3, 4, 7, 130)  # K mod 4: every remainder
OUTER = (1, 5, 300)


def in_order(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (N, K) @ w (K, M) as the kernel sums it: y = (((x_0 W_0) + x_1 W_1) + ...), each
    product rounded, then each sum (NumPy's element-wise operations: no fused
    multiply-add)."""
    y = np.zeros((x.shape[0], w.shape[1]), dtype=x.dtype)
    for p in range(x.shape[1]):
        y = y + x[:, p:p + 1] * w[p]
    return y


def rounding_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """2 gamma_K |x| |W| (N, M): two computations of a sum of K products in any order
    differ by at most this (each is within gamma_K |x| |W| of the exact sum)."""
    u = np.finfo(x.dtype).eps / 2
    k = x.shape[1]
    gamma = k * u / (1 - k * u)
    return 2 * gamma * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))


def operands(rng, n: int, k: int, m: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((n, k)).astype(dtype),
            rng.standard_normal((k, m)).astype(dtype))


def assert_streamed_equal(x: np.ndarray, w: np.ndarray) -> None:
    """The check every streamed product is held to: the terms in order to the bit, and
    NumPy's product within rounding."""
    y = streaming.streamed_product(x, w)
    assert y.shape == (x.shape[0], w.shape[1]) and y.dtype == x.dtype
    np.testing.assert_array_equal(y, in_order(x, w))
    distance = np.abs(y.astype(np.float64) - (x @ w).astype(np.float64))
    assert (distance <= rounding_bound(x, w)).all(), \
        f"farther from NumPy's product than rounding allows: {distance.max()}"


def both_paths(monkeypatch, parallel: bool) -> None:
    """One thread (every W below PARALLEL_WEIGHTS) or every core's chunks (every W above)."""
    monkeypatch.setattr(streaming, "PARALLEL_WEIGHTS", 0 if parallel else 1 << 62)


# =========================================================================== the sum
@needs_numba
@pytest.mark.parametrize("parallel", [False, True], ids=["one thread", "every core"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_the_terms_are_added_in_order_and_equal_numpys_product(monkeypatch, dtype, parallel):
    both_paths(monkeypatch, parallel)
    rng = np.random.default_rng(0)
    for n in ROWS:
        for k in INNER:
            for m in OUTER:
                assert_streamed_equal(*operands(rng, n, k, m, dtype))


@needs_numba
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_a_decoding_steps_shapes(dtype):
    """GPT-2 small's projections (D 768) at batch 1 and 8: the parallel path."""
    rng = np.random.default_rng(1)
    for n in (1, 8):
        for k, m in ((768, 2304), (3072, 768)):
            assert k * m >= streaming.PARALLEL_WEIGHTS
            assert_streamed_equal(*operands(rng, n, k, m, dtype))


@needs_numba
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_a_row_gets_what_it_gets_alone(dtype):
    rng = np.random.default_rng(2)
    x, w = operands(rng, 7, 300, 900, dtype)
    together = streaming.streamed_product(x, w)
    for r in range(x.shape[0]):
        np.testing.assert_array_equal(streaming.streamed_product(x[r:r + 1], w)[0],
                                      together[r])


@needs_numba
def test_one_thread_and_every_core_agree_to_the_bit(monkeypatch):
    rng = np.random.default_rng(3)
    x, w = operands(rng, 5, 771, 613, np.float32)
    both_paths(monkeypatch, parallel=False)
    alone = streaming.streamed_product(x, w)
    both_paths(monkeypatch, parallel=True)
    np.testing.assert_array_equal(streaming.streamed_product(x, w), alone)


# =========================================================================== when it runs
@needs_numba
def test_it_takes_few_rows_of_a_large_weight():
    side = int(np.ceil(np.sqrt(streaming.MIN_WEIGHTS)))
    w = np.ones((side, side), dtype=np.float32)
    assert streaming.takes(np.ones((1, side), np.float32), w)
    assert streaming.takes(np.ones((streaming.MAX_ROWS, side), np.float32), w)
    assert not streaming.takes(np.ones((streaming.MAX_ROWS + 1, side), np.float32), w), \
        "many rows: the library's blocked product"
    assert not streaming.takes(np.ones((0, side), np.float32), w), "no rows"
    small = np.ones((4, 4), np.float32)
    assert not streaming.takes(np.ones((1, 4), np.float32), small), "a W that fits a cache"


@needs_numba
def test_it_takes_only_what_its_kernel_reads():
    side = int(np.ceil(np.sqrt(streaming.MIN_WEIGHTS)))
    x, w = np.ones((2, side), np.float32), np.ones((side, side), np.float32)
    assert not streaming.takes(x, w.astype(np.float64)), "two dtypes"
    assert not streaming.takes(x.astype(np.int64), w.astype(np.int64)), "integers"
    assert not streaming.takes(x, np.asfortranarray(w)), "W not C-contiguous (a transpose)"
    assert not streaming.takes(np.ones((side, 2), np.float32).T, w), "x not C-contiguous"


def test_without_numba_it_takes_nothing(monkeypatch):
    monkeypatch.setattr(compiler, "COMPILED", False)
    monkeypatch.setattr(compiler, "_warned", True)  # the fallback's one warning: not here
    side = int(np.ceil(np.sqrt(streaming.MIN_WEIGHTS)))
    assert not streaming.takes(np.ones((2, side), np.float32), np.ones((side, side), np.float32))


# =========================================================================== in the Linear
@needs_numba
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_the_fast_linear_streams_a_decoding_steps_rows(monkeypatch, dtype):
    """The fast tier's linear op streams a few rows (B, 1, D_in) and gives the textbook op's
    output within rounding; many rows go to the library's product."""
    from npformer import fast, ops
    from npformer.fast import compiled as fast_compiled
    from npformer.fast import linear as fast_linear

    streamed = []
    monkeypatch.setattr(fast_compiled, "CACHED_STEP_WEIGHTS", 0)  # the steps run the layers
    real = fast_linear.streamed_product
    monkeypatch.setattr(fast_linear, "STREAM_FEW_ROWS", True)
    monkeypatch.setattr(fast_linear, "streamed_product",
                        lambda x, w: streamed.append(x.shape) or real(x, w))
    rng = np.random.default_rng(5)
    w = rng.standard_normal((256, 300)).astype(dtype)
    b = rng.standard_normal(300).astype(dtype)
    x = rng.standard_normal((3, 1, 256)).astype(dtype)
    y, _ = fast.linear_forward(x, w, b)
    assert streamed == [(3, 256)]
    y_textbook, _ = ops.linear_forward(x, w, b)
    distance = np.abs(y.astype(np.float64) - y_textbook.astype(np.float64)).reshape(3, 300)
    bias_rounding = np.finfo(dtype).eps * np.abs(y_textbook.astype(np.float64)).reshape(3, 300)
    assert (distance <= rounding_bound(x.reshape(3, 256), w) + bias_rounding).all()
    fast.linear_forward(rng.standard_normal((3, 6, 256)).astype(dtype), w, b)
    assert streamed == [(3, 256)], "18 rows: the library's product"


# =========================================================================== in decoding
def uncached_greedy(model, prompt: list, n: int) -> list:
    """Argmax continuation, each step a full forward over every token so far (no cache)."""
    from npformer import backend, no_grad

    ids = list(prompt)
    with no_grad():
        for _ in range(n):
            logits = backend.to_numpy(model(backend.asarray(np.array([ids]))))
            ids.append(int(np.argmax(logits[0, -1])))
    return ids


@pytest.mark.parametrize("tier", ["textbook", "fast"])
def test_greedy_generation_with_streamed_steps_equals_the_uncached_decode(monkeypatch, tier):
    """A model wide enough for the streamed product (each projection of 64 x 64 or more):
    a batch of prompts decoded with the cache (in the fast tier its steps' products
    streamed) gives every row the tokens of the uncached greedy decode, in both tiers."""
    from npformer import fast, models
    from npformer.decoding import generate
    from npformer.fast import compiled as fast_compiled
    from npformer.fast import linear as fast_linear

    streamed = []
    monkeypatch.setattr(fast_compiled, "CACHED_STEP_WEIGHTS", 0)  # the steps run the layers
    real = fast_linear.streamed_product
    monkeypatch.setattr(fast_linear, "STREAM_FEW_ROWS", True)
    monkeypatch.setattr(fast_linear, "streamed_product",
                        lambda x, w: streamed.append(x.shape[0]) or real(x, w))
    config = models.CausalLMConfig(vocab_size=50, block_size=16, d_model=64, num_heads=4,
                                   num_layers=2, d_ff=256, dropout=0.0)
    with using_backend("numpy", "float64"):
        model = (fast.CausalLM if tier == "fast" else models.CausalLM)(config)
        model.eval()
        rng = np.random.default_rng(6)
        prompts = [list(rng.integers(0, 50, size=n)) for n in (3, 5, 1)]
        out = generate(model, prompts, 8, greedy=True)
        for prompt, row in zip(prompts, out):
            assert row == uncached_greedy(model, prompt, 8)
    assert (len(streamed) > 0) == (tier == "fast" and compiler.COMPILED), \
        "the fast tier's cached steps stream their products; the textbook's never"
