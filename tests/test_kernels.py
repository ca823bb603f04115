"""The fast tier's compiled kernels (each beside its op in npformer/fast/) and the flat
parameter buffer.

* Every kernel is caught when broken on purpose: each is replaced by a copy that
  perturbs one element of its result by 1e-9 (relative; in float32 by more than the
  float32 tolerance), and the equality check its op is tested with
  (tests/test_fast_equals_textbook.py, or the optimizer check here) must fail: a kernel
  that was not on the tested path, or a check too loose to see it, fails this test.
  Every kernel :func:`npformer.fast.compiler.jit` compiled is in the list.
* AdamW over one flat buffer equals the textbook per-tensor update (float64, 1e-12)
  over several steps, with decayed and undecayed parameters, clipping, a schedule.
* The flat buffer: views of one buffer, gradients accumulated and zeroed in place,
  loads copy into the views, rebinding is absorbed, the state dicts keep their names,
  the all-reduce gets the flat gradient buffer itself.
* Without numba (or with numba's NUMBA_DISABLE_JIT=1) the tier runs and warns once.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer import backend, fast, nn, ops
from npformer.fast import activations as fast_activations
from npformer.fast import adamw, compiled, compiler
from npformer.fast import attention as fast_attention
from npformer.fast import embedding as fast_embedding
from npformer.fast import layernorm as fast_layernorm
from npformer.fast import losses as fast_losses
from npformer.fast import rmsnorm as fast_rmsnorm
from npformer.fast import rotary as fast_rotary
from npformer.fast import streaming as fast_streaming
from npformer.fast import swiglu as fast_swiglu
from npformer.nn import Parameter
from npformer.nn.flat import FlatParameters, flat_buffer_of
from npformer.optim import SGD, Adam, AdamW, warmup_cosine
from npformer.parallel import sparse as parallel_sparse

from .conftest import using_backend
from .helpers import assert_close, rel_diff, set_tier, tier_under_test, tiered
from .test_fast_equals_textbook import (
    assert_equal_to_terms,
    assert_layernorm_equal,
    attention_terms,
)

needs_numba = pytest.mark.skipif(not compiler.COMPILED, reason="numba is not installed")
TOL = 1e-12
seeds = st.integers(0, 2**32 - 1)


# =========================================================================== checks
def gelu_equal(x, dy, tol=TOL):
    (y_f, c_f), (y_t, c_t) = fast.gelu_forward(x), ops.gelu_forward(x)
    assert rel_diff(y_f, y_t) <= tol, "y"
    assert rel_diff(fast.gelu_backward(dy, c_f), ops.gelu_backward(dy, c_t)) <= tol, "dx"


def random_params(rng, shapes, dtype="float64"):
    """Parameters of the given shapes, every other one decayed."""
    return [Parameter(rng.standard_normal(shape).astype(dtype), decay=i % 2 == 0)
            for i, shape in enumerate(shapes)]


def trajectory(tier, shapes, seed, steps, optimizer, clip=None, **kw):
    """The parameters after ``steps`` updates on tier ``tier`` (same gradients each tier)."""
    rng = np.random.default_rng(seed)
    previous = tier_under_test()
    set_tier(tier)
    try:
        params = random_params(rng, shapes)
        opt = getattr(tiered, optimizer.__name__)(params, **kw)  # the tier's
        assert (getattr(opt, "_flat", None) is not None) == (tier == "fast"), \
            "the fast tier flattens"
        for _ in range(steps):
            opt.zero_grad()
            for p in params:
                p.accumulate(rng.standard_normal(p.shape) * 3.0)
            if clip is not None:
                tiered.clip_grad_norm(params, clip)  # the tier's
            opt.step()
        return [p.data.copy() for p in params] + [m.copy() for m in opt.state["m"]]
    finally:
        set_tier(previous)


def optimizer_equal(shapes, seed, steps=4, optimizer=AdamW, clip=1.0, tol=TOL, **kw):
    kw = {"lr": warmup_cosine(1e-2, 2, 10), "weight_decay": 0.1, **kw}
    flat = trajectory("fast", shapes, seed, steps, optimizer, clip, **kw)
    textbook = trajectory("textbook", shapes, seed, steps, optimizer, clip, **kw)
    for i, (a, b) in enumerate(zip(flat, textbook)):
        assert rel_diff(a, b) <= tol, f"array {i} differs by {rel_diff(a, b):.3e}"


SHAPES = [(3, 4), (4,), (2, 2, 3), (1,), (5, 2)]


# =========================================================================== equality
@given(seed=seeds, shapes=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3)
                                   .map(tuple), min_size=1, max_size=6),
       decoupled=st.booleans(), clip=st.sampled_from([None, 0.5, 1e6]))
def test_flat_adam_equals_the_per_tensor_textbook_update(seed, shapes, decoupled, clip):
    """N steps of (Adam)W over one flat buffer equal the textbook tier's update parameter
    by parameter (parameters and moments within 1e-12, float64), decay on every other
    parameter, clipping's one-pass norm and scaling included."""
    if decoupled:
        optimizer_equal(shapes, seed, clip=clip)
    else:
        optimizer_equal(shapes, seed, optimizer=Adam, clip=clip, weight_decay=0.0)


def test_flat_float32_update_is_the_per_tensor_update_bit_for_bit():
    """In float32 the kernel rounds each statement as NumPy does: identical numbers."""
    def run(tier):
        set_tier(tier)
        rng = np.random.default_rng(0)
        params = random_params(rng, SHAPES, "float32")
        opt = tiered.AdamW(params, lr=3e-3, weight_decay=0.1)
        for _ in range(3):
            for p in params:
                p.grad = rng.standard_normal(p.shape).astype(np.float32)
            opt.step()
        return [p.data.copy() for p in params]
    try:
        for a, b in zip(run("fast"), run("textbook")):
            np.testing.assert_array_equal(a, b)
    finally:
        set_tier("fast")


# =========================================================================== broken kernels
def perturbed(kernel, output_position, size=1e-9):
    """``kernel`` followed by a relative change ``size`` of one element of its output
    argument ``output_position`` (a kernel writes its results into its arguments)."""
    def broken(*args):
        result = kernel(*args)
        out = args[output_position].reshape(-1)
        if out.size:
            out[out.size // 2] += size * (abs(out[out.size // 2]) + 1.0)
        return result
    return broken


def perturbed_output(kernel, index=None, size=1e-9):
    """``kernel`` whose returned array (the ``index``-th of the tuple it returns, if given)
    has one element changed by a relative ``size`` (a kernel that returns its results)."""
    def broken(*args):
        result = kernel(*args)
        out = (result if index is None else result[index]).reshape(-1)
        out[out.size // 2] += size * (abs(out[out.size // 2]) + 1.0)
        return result
    return broken


def compiled_blocks_case():
    """An encoder block's kernel and a stack's (tests/test_compiled_forward.py's check: the
    textbook block's output within its float64 rounding), and a Llama block's."""
    from .test_compiled_forward import RTOL, inputs, pair
    with using_backend("numpy", "float64"), nn.no_grad():
        textbook, quick = pair(7, lambda: tiered.EncoderBlock(12, 3, 20, 0.0, "gelu", True))
        x, mask = inputs(7, 2, 5, 12), ops.causal_mask(5)
        expected = textbook(x, mask)
        assert_close(compiled.encoder_block_forward(quick, x, mask), expected, RTOL["float64"])
        assert_close(compiled.encoder_stack_forward([quick], None, x, mask), expected,
                     RTOL["float64"])
        textbook, quick = pair(5, lambda: tiered.LlamaBlock(16, 4, 24, num_kv_heads=2))
        x = inputs(5, 2, 5, 16)
        cos, sin = ops.rotary_table(np.arange(5), 4, dtype=x.dtype)  # (T, E)
        assert_close(compiled.llama_block_forward(quick, x, cos, sin, mask),
                     textbook(x, cos, sin, mask), RTOL["float64"])


def compiled_attend_case():
    """The kernels' attention on rows (grouped heads, a causal mask): the textbook op's."""
    rng = np.random.default_rng(3)
    batch, length, heads, kv_heads, width = 2, 4, 4, 2, 3
    q = rng.standard_normal((batch, heads, length, width))
    k, v = (rng.standard_normal((batch, kv_heads, length, width)) for _ in "kv")
    mask = ops.causal_mask(length)
    expected, _ = ops.grouped_attention_forward(q, k, v, mask)  # (B, H, T, E)

    def rows(t):  # (B, heads, T, E) -> (B T, heads E)
        return np.ascontiguousarray(t.transpose(0, 2, 1, 3)).reshape(batch * length, -1)
    got = compiled._attend(rows(q), rows(k), rows(v), np.arange(batch + 1) * length,
                           compiled._mask4(mask), heads, kv_heads)
    assert rel_diff(got, rows(expected)) <= 1e-13


def compiled_attend_after_case():
    """The kernels' attention of rows after cached positions (grouped heads; the causal
    mask's last two rows): the textbook op's last two positions."""
    rng = np.random.default_rng(4)
    batch, length, before, heads, kv_heads, width = 2, 4, 2, 4, 2, 3
    q = rng.standard_normal((batch, heads, length, width))
    k, v = (rng.standard_normal((batch, kv_heads, length, width)) for _ in "kv")
    mask = ops.causal_mask(length)
    expected, _ = ops.grouped_attention_forward(q, k, v, mask)  # (B, H, T, E)
    new = length - before

    def rows(t):  # the new positions (B, heads, T_new, E) -> (B T_new, heads E)
        return np.ascontiguousarray(t[:, :, before:].transpose(0, 2, 1, 3)).reshape(
            batch * new, -1)
    got = compiled._attend_after(rows(q), rows(k), rows(v), k[:, :, :before], v[:, :, :before],
                                 np.arange(batch + 1) * new, compiled._mask4(mask[before:]),
                                 heads, kv_heads)
    assert rel_diff(got, rows(expected)) <= 1e-13


def perturbed_sum(kernel):
    def broken(*args):
        return kernel(*args) * (1 + 1e-9)
    return broken


def gelu_case():
    rng = np.random.default_rng(1)
    gelu_equal(rng.standard_normal((4, 6)) * 3, rng.standard_normal((4, 6)))


def gelu32_case():
    rng = np.random.default_rng(1)
    x, dy = (rng.standard_normal((2, 4, 6)) * 3).astype(np.float32), rng.standard_normal(
        (2, 4, 6)).astype(np.float32)
    gelu_equal(x, dy, tol=1e-6)  # test_fast_equals_textbook.test_gelu's float32 tolerance


def gelu_tanh_equal(x, dy, tol=TOL):
    """GPT-2's tanh GELU, fast (one compiled pass each way) against the textbook's
    statements."""
    y_f, c_f = fast_activations.gelu_tanh_forward(x)
    y_t, c_t = ops.activations.gelu_tanh_forward(x)
    assert rel_diff(y_f, y_t) <= tol, "y"
    assert rel_diff(fast_activations.gelu_tanh_backward(dy, c_f),
                    ops.activations.gelu_tanh_backward(dy, c_t)) <= tol, "dx"


def gelu_tanh_case():
    rng = np.random.default_rng(1)
    gelu_tanh_equal(rng.standard_normal((4, 6)) * 3, rng.standard_normal((4, 6)))


def gelu_tanh32_case():
    rng = np.random.default_rng(1)
    x, dy = (rng.standard_normal((2, 4, 6)) * 3).astype(np.float32), rng.standard_normal(
        (2, 4, 6)).astype(np.float32)
    gelu_tanh_equal(x, dy, tol=1e-6)


def layernorm_case():
    rng = np.random.default_rng(2)
    assert_layernorm_equal(rng.standard_normal((3, 7)), rng.standard_normal(7),
                           rng.standard_normal(7), rng.standard_normal((3, 7)))


def rmsnorm_case():
    """The fast RMS norm's y, dx and dweight against the textbook's."""
    rng = np.random.default_rng(2)
    x, dy = rng.standard_normal((3, 7)), rng.standard_normal((3, 7))
    weight = rng.standard_normal(7)
    (y_f, c_f), (y_t, c_t) = fast.rmsnorm_forward(x, weight), ops.rmsnorm_forward(x, weight)
    assert rel_diff(y_f, y_t) <= TOL, "y"
    for name, a, b in zip(("dx", "dweight"), fast.rmsnorm_backward(dy, c_f),
                          ops.rmsnorm_backward(dy, c_t)):
        assert rel_diff(a, b) <= TOL, name


def swiglu_case():
    """The fast gated SiLU's h, da and db against the textbook's."""
    rng = np.random.default_rng(3)
    a, b, dh = rng.standard_normal((4, 6)) * 3, rng.standard_normal((4, 6)), \
        rng.standard_normal((4, 6))
    (h_f, c_f), (h_t, c_t) = fast.swiglu_forward(a, b), ops.swiglu_forward(a, b)
    assert rel_diff(h_f, h_t) <= TOL, "h"
    for name, got, want in zip(("da", "db"), fast.swiglu_backward(dh, c_f),
                               ops.swiglu_backward(dh, c_t)):
        assert rel_diff(got, want) <= TOL, name


def rotary_case():
    """The fast rotary op against the textbook's, bit for bit, on a projection's view."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 3, 8)).transpose(0, 2, 1, 3)  # (B, H, T, E) view
    cos, sin = ops.rotary_table(np.array([[0, 1, 2, 3, 4], [2, 3, 4, 5, 6]]), 8,
                                dtype=np.float64)
    dy = rng.standard_normal((2, 3, 5, 8))
    (y_f, c_f), (y_t, c_t) = fast.rotary_forward(x, cos, sin), ops.rotary_forward(x, cos, sin)
    np.testing.assert_array_equal(y_f, y_t)
    np.testing.assert_array_equal(fast.rotary_backward(dy, c_f), ops.rotary_backward(dy, c_t))


def streaming_case(dtype="float64"):
    """The streamed few-row product (tests/test_streaming.py's check: the terms in order
    to the bit, NumPy's product within rounding) on one thread (a small W) and on every
    core (a W of PARALLEL_WEIGHTS): the kernel of each path."""
    from .test_streaming import assert_streamed_equal
    rng = np.random.default_rng(9)
    side = int(np.ceil(np.sqrt(fast_streaming.PARALLEL_WEIGHTS)))
    for k, m in ((7, 5), (side, side)):
        assert_streamed_equal(rng.standard_normal((3, k)).astype(dtype),
                              rng.standard_normal((k, m)).astype(dtype))


def streaming32_case():
    streaming_case("float32")


def changed_rows_case():
    """The compiled row scan of the row-sparse sum against NumPy's any(): rows changed only
    in their last column, by -0.0 or by a subnormal count; +0.0 rows do not."""
    table = np.zeros((6, 5), dtype=np.float32)
    table[1, -1], table[3, 0], table[4, 2] = 1.0, -0.0, np.float32(1e-45)
    bits = table.view(np.uint32)
    np.testing.assert_array_equal(parallel_sparse.changed_rows(table), np.any(bits, axis=1))


def flipped_row(kernel):
    """``kernel`` with one row's answer (its output argument, index 1) turned over."""
    def broken(bits, out):
        result = kernel(bits, out)
        out[out.size // 2] = not out[out.size // 2]
        return result
    return broken


def attention_case(dtype="float64", tol=TOL):
    """Blocked attention (causal and padding masks, a fully masked query row) through the
    compiled softmax kernels, equal to the textbook's dense attention.  21 keys: the
    kernels' per-row cut (8, 16 or all 21 keys computed) takes effect."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(shape).astype(dtype)
               for shape in ((2, 3, 13, 4), (2, 3, 21, 4), (2, 3, 21, 4)))
    mask = np.tril(np.ones((13, 21), dtype=bool), k=1) & (
        np.arange(21) < np.array([[21], [11]]))[:, None, None, :]
    # (2, 1, 13, 21): causal with one key of lookahead, and padding
    mask[1, 0, 2] = False  # a query with every key masked
    dout = rng.standard_normal((2, 3, 13, 4)).astype(dtype)
    out_f, cache_f = fast.attention_forward(q, k, v, mask, block_scores=300)  # several blocks
    out_t, cache_t = ops.attention_forward(q, k, v, mask)
    assert rel_diff(out_f, out_t) <= tol, "out"
    for name, got, want in zip(("dq", "dk", "dv"), fast.attention_backward(dout, cache_f),
                               ops.attention_backward(dout, cache_t)):
        assert rel_diff(got, want) <= tol, name


def attention32_case():
    attention_case("float32", 1e-5)


def loss_case(dtype="float64", tol=TOL):
    """The fused loss (label smoothing, ignored rows) through the compiled kernels, equal
    to the textbook's log-softmax and NLL: the loss and dlogits."""
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal((2, 5, 7)) * 3).astype(dtype)
    targets = rng.integers(0, 7, size=(2, 5))
    targets[0, 1] = targets[1, 4] = ops.IGNORE_INDEX
    for smoothing in (0.0, 0.1):
        loss_f, cache_f = fast.cross_entropy_forward(logits, targets, label_smoothing=smoothing)
        loss_t, cache_t = ops.cross_entropy_forward(logits, targets, label_smoothing=smoothing)
        assert rel_diff(loss_f, loss_t) <= tol, "loss"
        assert rel_diff(fast.cross_entropy_backward(0.5, cache_f),
                        ops.cross_entropy_backward(0.5, cache_t)) <= tol, "dlogits"


def loss32_case():
    loss_case("float32", 1e-6)


@needs_numba
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@given(seed=st.integers(0, 2**16), length=st.integers(1, 70), block_scores=st.sampled_from(
    [64, 1000, fast.BLOCK_SCORES]))
def test_the_attention_kernels_cut_rows_without_changing_a_bit(dtype, seed, length,
                                                               block_scores):
    """Each row's masked tail (the causal future, padding), cut off by the kernels, gives
    the same output and gradients, bit for bit, as the whole rows (row_keys None): the
    cut, a multiple of 8, leaves every running max and sum its elements in their order."""
    from npformer.fast import attention as fast_attention

    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal((2, 3, length, 5)).astype(dtype) for _ in range(4))
    valid = rng.integers(0, length + 1, size=2)  # 0: a sequence with every key masked
    mask = ops.causal_mask(length, like=q) & ops.padding_mask(valid, length)

    def attention():
        out, cache = fast.attention_forward(q, k, v, mask, block_scores=block_scores)
        return (out, *fast.attention_backward(dout, cache))

    cut = attention()
    whole_rows = pytest.MonkeyPatch.context()
    with whole_rows as patch:
        patch.setattr(fast_attention, "_row_keys", lambda *args: None)
        whole = attention()
    for name, got, want in zip(("out", "dq", "dk", "dv"), cut, whole):
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_loss_gradient_written_over_the_logits_is_the_same_bits(dtype):
    """cross_entropy_grad into the logits' own buffer (the training step's call) gives
    exactly the gradient it writes into a new array: the in-place branch of the kernel
    (a loop over one array, so that it vectorizes) computes the same statements."""
    rng = np.random.default_rng(7)
    z = (rng.standard_normal((6, 37)) * 3).astype(dtype)
    targets = rng.integers(0, 37, size=6).astype(np.int64)
    weight = rng.random(6).astype(dtype)
    _, lse = fast_losses.cross_entropy_rows(z, targets, 0.1)
    fresh = fast_losses.cross_entropy_grad(z, lse, targets, weight, 0.1)
    own = z.copy()
    written = fast_losses.cross_entropy_grad(own, lse, targets, weight, 0.1, out=own)
    assert written is own
    np.testing.assert_array_equal(written, fresh)


def embedding_case():
    """The fast embedding backward (one compiled scatter-add) against the textbook's
    np.add.at: bit for bit, repeated ids included."""
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 4, size=(3, 5))
    _, cache = ops.embedding_forward(ids, rng.standard_normal((4, 6)))
    dy = rng.standard_normal((3, 5, 6))
    np.testing.assert_array_equal(fast.embedding_backward(dy, cache),
                                  ops.embedding_backward(dy, cache))


def adam_case():
    optimizer_equal(SHAPES, seed=3)


BROKEN = {  # kernel (its module, its name): [(its broken copy, the check that must catch it)]
    (fast_activations, "gelu_forward64"): [(lambda k: perturbed(k, 1), gelu_case)],
    (fast_activations, "gelu_backward64"): [(lambda k: perturbed(k, 2), gelu_case)],
    (fast_activations, "gelu_forward32"): [(lambda k: perturbed(k, 1, 1e-5), gelu32_case)],
    (fast_activations, "gelu_backward32"): [(lambda k: perturbed(k, 2, 1e-5), gelu32_case)],
    (fast_activations, "gelu_tanh_forward64"): [(lambda k: perturbed(k, 1), gelu_tanh_case)],
    (fast_activations, "gelu_tanh_backward64"): [(lambda k: perturbed(k, 3), gelu_tanh_case)],
    (fast_activations, "gelu_tanh_forward32"): [(lambda k: perturbed(k, 1, 1e-5),
                                                 gelu_tanh32_case)],
    (fast_activations, "gelu_tanh_backward32"): [(lambda k: perturbed(k, 3, 1e-5),
                                                  gelu_tanh32_case)],
    (fast_layernorm, "_layernorm_forward"): [(lambda k: perturbed(k, 4), layernorm_case)],
    (fast_layernorm, "_layernorm_backward"): [(lambda k: perturbed(k, 4), layernorm_case)],
    (fast_attention, "_softmax_lse"): [(lambda k: perturbed(k, 0), attention_case),
                                       (lambda k: perturbed(k, 0, 1e-3), attention32_case)],
    (fast_attention, "_probabilities"): [(lambda k: perturbed(k, 0), attention_case),
                                         (lambda k: perturbed(k, 0, 1e-3), attention32_case)],
    (fast_attention, "_softmax_backward"): [(lambda k: perturbed(k, 0), attention_case),
                                            (lambda k: perturbed(k, 0, 1e-3),
                                             attention32_case)],
    (fast_losses, "_cross_entropy_rows"): [(lambda k: perturbed(k, 3), loss_case),
                                           (lambda k: perturbed(k, 3, 1e-3), loss32_case)],
    (fast_losses, "_cross_entropy_grad"): [(lambda k: perturbed(k, 6), loss_case),
                                           (lambda k: perturbed(k, 6, 1e-3), loss32_case)],
    (adamw, "adamw_flat"): [(lambda k: perturbed(k, 0), adam_case)],
    (adamw, "_sum_of_squares"): [(perturbed_sum, adam_case)],
    (fast_embedding, "_scatter_add_rows"): [(lambda k: perturbed(k, 2), embedding_case)],
    (fast_rmsnorm, "_rmsnorm_forward"): [(lambda k: perturbed(k, 3), rmsnorm_case)],
    (fast_rmsnorm, "_rmsnorm_backward"): [(lambda k: perturbed(k, 4), rmsnorm_case)],
    (fast_swiglu, "_swiglu_forward"): [(lambda k: perturbed(k, 2), swiglu_case)],
    (fast_swiglu, "_swiglu_backward"): [(lambda k: perturbed(k, 4), swiglu_case)],
    (fast_rotary, "_rotate"): [(lambda k: perturbed(k, 3), rotary_case)],
    (fast_rotary, "_rotate_back"): [(lambda k: perturbed(k, 3), rotary_case)],
    (parallel_sparse, "_rows_with_bits"): [(flipped_row, changed_rows_case)],
    (compiled, "_encoder_block"): [(lambda k: perturbed_output(k, 0), compiled_blocks_case)],
    (compiled, "_encoder_stack"): [(lambda k: perturbed_output(k, 0), compiled_blocks_case)],
    (compiled, "_llama_block"): [(lambda k: perturbed_output(k, 0), compiled_blocks_case)],
    (compiled, "_attend"): [(perturbed_output, compiled_attend_case)],
    (compiled, "_attend_after"): [(perturbed_output, compiled_attend_after_case)],
    (fast_streaming, "_columns"): [(lambda k: perturbed(k, 2), streaming_case),
                                   (lambda k: perturbed(k, 2, 1e-5), streaming32_case)],
    (fast_streaming, "_parallel_product"): [(lambda k: perturbed(k, 2), streaming_case),
                                            (lambda k: perturbed(k, 2, 1e-5),
                                             streaming32_case)],
}
BROKEN_CASES = [(module, name, breaker, check) for (module, name), pairs in BROKEN.items()
                for breaker, check in pairs]


@needs_numba
@pytest.mark.parametrize("module,name,breaker,check", BROKEN_CASES,
                         ids=[f"{c[1]}-{c[3].__name__}" for c in BROKEN_CASES])
def test_each_kernel_broken_on_purpose_fails_its_equality_check(monkeypatch, module, name,
                                                                breaker, check):
    check()  # passes with the real kernel
    monkeypatch.setattr(module, name, breaker(getattr(module, name)))
    with pytest.raises(AssertionError):
        check()


@needs_numba
def test_every_kernel_has_a_broken_variant():
    """Every compiled loop (each kernel npformer.fast.compiler.jit compiled, not the
    scalar helpers numba inlines into them) is in BROKEN."""
    sparse_scan = ("npformer.parallel.sparse", "_rows_with_bits")  # compiled by its own module
    assert set(compiler.KERNELS) | {sparse_scan} == {(module.__name__, name)
                                                    for module, name in BROKEN}


@needs_numba
def test_float32_gelu_kernels_are_float32_accurate():
    """The float32 kernels (their own erfc, float32 arithmetic) against float64 truth.
    (Per element: tests/test_numerics.py.)"""
    rng = np.random.default_rng(4)
    for scale in (0.1, 1.0, 5.0, 40.0):
        x = (rng.standard_normal(5000) * scale).astype(np.float32)
        dy = rng.standard_normal(5000).astype(np.float32)
        y32 = fast_activations.gelu_kernel(x)
        y64, cache64 = ops.gelu_forward(x.astype(np.float64))
        assert y32.dtype == np.float32 and rel_diff(y32, y64) <= 3e-7
        dx64 = ops.gelu_backward(dy.astype(np.float64), cache64)
        assert rel_diff(fast_activations.gelu_backward_kernel(dy, x), dx64) <= 3e-7


# =========================================================================== flat buffer
def flat_model():
    set_tier("fast")
    model = tiered.Linear(3, 4)
    opt = tiered.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def test_parameters_and_gradients_are_views_of_one_buffer():
    model, opt = flat_model()
    flat = opt._flat
    assert isinstance(flat, FlatParameters) and flat.data.size == 3 * 4 + 4
    for p, (lo, hi) in zip(model.parameters(), flat.slices):
        assert np.shares_memory(p.data, flat.data) and np.shares_memory(p.grad, flat.grad)
        np.testing.assert_array_equal(p.data.reshape(-1), flat.data[lo:hi])
    grads = [p.grad for p in model.parameters()]
    model.forward(np.ones((2, 3), dtype=flat.data.dtype))
    model.backward(np.ones((2, 4), dtype=flat.data.dtype))
    assert all(p.grad is g for p, g in zip(model.parameters(), grads)), "accumulated in place"
    assert flat.grad.any()
    opt.zero_grad()
    assert not flat.grad.any() and all(p.grad is g for p, g in zip(model.parameters(), grads))


def test_loading_copies_into_the_views_and_names_are_unchanged():
    model, opt = flat_model()
    views = [p.data for p in model.parameters()]
    state = {k: np.full_like(v, 7.0) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert flat_buffer_of(model.parameters()) is opt._flat  # read through a sync
    assert all(p.data is v for p, v in zip(model.parameters(), views))
    assert (opt._flat.data == 7.0).all()
    assert set(model.state_dict()) == {"weight", "bias"}
    saved = opt.state_dict()
    assert {k for k in saved if "." in k} == {"m.0", "m.1", "v.0", "v.1"}


def test_rebound_data_grads_and_moments_go_back_into_the_buffer():
    """Code that rebinds p.data, p.grad or the moments (old loaders, tests) is absorbed."""
    model, opt = flat_model()
    w = model.weight
    w.data = np.full(w.shape, 2.0)
    w.grad = np.ones(w.shape)
    opt.load_state_dict({**opt.state_dict(), "m.0": np.full(w.shape, 0.5)})
    opt.step()
    assert np.shares_memory(w.data, opt._flat.data) and w.data[0, 0] != 2.0
    assert opt.state["m"][0] is opt._state_views["m"][0]
    np.testing.assert_allclose(opt.state["m"][0], 0.5 + 0.1 * (1.0 - 0.5))


def test_clipping_on_the_flat_buffer_equals_the_per_tensor_norm():
    with using_backend("numpy", "float64"):
        model, opt = flat_model()
    rng = np.random.default_rng(5)
    for p in model.parameters():
        p.accumulate(rng.standard_normal(p.shape).astype(p.data.dtype))
    per_tensor = float(np.sqrt(sum(np.sum(p.grad.astype(np.float64)**2)
                                   for p in model.parameters())))  # float64 sums
    assert abs(tiered.global_grad_norm(model.parameters()) - per_tensor) <= 1e-12 * per_tensor
    before = [p.grad.copy() for p in model.parameters()]
    total = tiered.clip_grad_norm(model.named_parameters(), 0.1)
    for b, p in zip(before, model.parameters()):  # each gradient scaled, in place
        np.testing.assert_array_equal(p.grad, b * (0.1 / (total + 1e-6)))


def test_what_cannot_be_flat_stays_per_tensor():
    set_tier("fast")
    mixed = [Parameter(np.ones(2)), Parameter(np.ones(2, dtype=np.float32))]
    assert tiered.AdamW(mixed)._flat is None
    assert tiered.Adam([Parameter(np.ones(2))], weight_decay=0.1)._flat is None  # L2 decay
    assert getattr(SGD([Parameter(np.ones(2))], lr=0.1), "_flat", None) is None
    set_tier("textbook")
    try:
        assert getattr(tiered.AdamW([Parameter(np.ones(2))]), "_flat", None) is None
    finally:
        set_tier("fast")


# =========================================================================== without numba
def test_without_numba_the_tier_runs_its_numpy_statements_and_warns_once(monkeypatch):
    monkeypatch.setattr(compiler, "COMPILED", False)
    monkeypatch.setattr(compiler, "_warned", False)
    with pytest.warns(RuntimeWarning, match="gelu_forward.*layernorm_forward.*adamw_flat"):
        gelu_case()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gelu_case()
        layernorm_case()
        adam_case()


def test_numba_disabled_falls_back_in_a_fresh_process():
    code = ("import warnings, numpy as np; warnings.simplefilter('always');"
            "from npformer import fast; from npformer.fast import compiler;"
            "assert not compiler.COMPILED;"
            "import warnings as w\n"
            "with w.catch_warnings(record=True) as seen:\n"
            "    w.simplefilter('always'); fast.gelu_forward(np.ones(3));"
            " fast.gelu_forward(np.ones(3))\n"
            "print(len(seen), seen[0].message)")
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("1 ") and "NUMBA_DISABLE_JIT" in out and "gelu_forward" in out


def test_strict_arrays_never_reach_a_kernel():
    import array_api_strict as xps

    x = xps.asarray(np.linspace(-3, 3, 7))
    assert not compiler.compilable(x)
    y, _ = fast.gelu_forward(x)
    assert rel_diff(backend.to_numpy(y), ops.gelu_forward(np.linspace(-3, 3, 7))[0]) <= TOL


@pytest.mark.parametrize("value,off", [("1", True), ("TRUE", True), (" yes ", True),
                                       ("on", True), ("0", False), ("false", False),
                                       ("No", False), ("off", False), ("", False)])
def test_an_environment_switch_is_read_as_a_boolean(value, off):
    assert backend.boolean_word(value) is off  # how env_flag reads NPFORMER_GPU_FUSED


# =========================================================================== odd inputs
def read_only(a):
    a = np.array(a)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("layout", ["read-only", "broadcast", "strided"])
def test_every_fast_op_takes_read_only_and_strided_input(dtype, layout):
    """Read-only arrays (``flags.writeable = False``), broadcast views (read-only and
    strided) and strided slices: every op equals its textbook op (numba's TypingError
    reached the caller of the loss's backward on read-only logits), and the loss's
    backward asked to write over read-only logits leaves them alone."""
    rng = np.random.default_rng(11)

    def arrange(a):
        a = np.asarray(a, dtype=dtype)
        if layout == "read-only":
            return read_only(a)
        if layout == "broadcast":
            return np.broadcast_to(a[:1], a.shape)  # every batch row the first
        return np.repeat(a, 2, axis=-1)[..., ::2]  # every other column of a wider array

    x, dy = arrange(rng.standard_normal((3, 5, 8))), arrange(rng.standard_normal((3, 5, 8)))
    gamma, beta = (arrange(rng.standard_normal((2, 8)))[0] for _ in range(2))
    tol = 1e-12 if dtype == "float64" else 1e-5
    for tier_pair in (("gelu_forward", "gelu_backward"), ("relu_forward", "relu_backward")):
        (y_f, c_f), (y_t, c_t) = (getattr(t, tier_pair[0])(x) for t in (fast, ops))
        assert rel_diff(y_f, y_t) <= tol
        assert rel_diff(getattr(fast, tier_pair[1])(dy, c_f),
                        getattr(ops, tier_pair[1])(dy, c_t)) <= tol
    assert_layernorm_equal(x, gamma, beta, dy, tol)
    before = x.copy()
    targets = rng.integers(0, 8, size=(3, 5))
    (loss_f, c_f), (loss_t, c_t) = (t.cross_entropy_forward(x, targets) for t in (fast, ops))
    assert rel_diff(loss_f, loss_t) <= tol
    dz = fast.cross_entropy_backward(0.5, c_f, overwrite_logits=True)
    assert rel_diff(dz, ops.cross_entropy_backward(0.5, c_t)) <= tol
    if not x.flags.writeable:
        np.testing.assert_array_equal(x, before)  # not written over
    q, mask = x[None], ops.causal_mask(5, like=x)  # (1, 3, 5, 8)
    (out_f, c_f), (out_t, c_t) = (t.attention_forward(q, q, q, mask) for t in (fast, ops))
    terms = attention_terms(q, q, q, mask, dy[None])
    assert_equal_to_terms(["out"], [out_f], [out_t], terms[:1], tol)
    assert_equal_to_terms(["dq", "dk", "dv"], fast.attention_backward(dy[None], c_f),
                          ops.attention_backward(dy[None], c_t), terms[1:], tol)
    _, cache = ops.embedding_forward(rng.integers(0, 4, size=(3, 5)), np.zeros((4, 8), dtype))
    np.testing.assert_allclose(fast.embedding_backward(dy, cache),
                               ops.embedding_backward(dy, cache), rtol=0, atol=tol)
    (y_f, c_f), (y_t, c_t) = (t.rmsnorm_forward(x, gamma) for t in (fast, ops))
    assert rel_diff(y_f, y_t) <= tol
    for got, want in zip(fast.rmsnorm_backward(dy, c_f), ops.rmsnorm_backward(dy, c_t)):
        assert rel_diff(got, want) <= tol
    (h_f, c_f), (h_t, c_t) = (t.swiglu_forward(x, dy) for t in (fast, ops))
    assert rel_diff(h_f, h_t) <= tol
    for got, want in zip(fast.swiglu_backward(dy, c_f), ops.swiglu_backward(dy, c_t)):
        assert rel_diff(got, want) <= tol
    cos, sin = ops.rotary_table(np.arange(5), 8, dtype=np.dtype(dtype))
    (y_f, c_f), (y_t, c_t) = (t.rotary_forward(x[None], cos, sin) for t in (fast, ops))
    np.testing.assert_array_equal(y_f, y_t)
    np.testing.assert_array_equal(fast.rotary_backward(dy[None], c_f),
                                  ops.rotary_backward(dy[None], c_t))


@needs_numba
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_every_kernel_entry_takes_read_only_and_strided_input(dtype):
    """The kernels' own entries (the ops call them; so do the benchmarks) give the same
    numbers on read-only and strided inputs as on contiguous ones."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((6, 8)).astype(dtype)
    gamma = rng.standard_normal(8).astype(dtype)
    strided = np.repeat(x, 2, axis=-1)[:, ::2]
    targets = rng.integers(0, 8, size=6)
    weight = rng.random(6).astype(dtype)
    runs = {
        "gelu": lambda a: fast_activations.gelu_kernel(a),
        "gelu backward": lambda a: fast_activations.gelu_backward_kernel(a, a),
        "layer norm": lambda a: fast_layernorm.layernorm_kernel(a, gamma, gamma, 1e-5)[0],
        "layer norm backward": lambda a: fast_layernorm.layernorm_backward_kernel(
            a, a, np.ones((6, 1), dtype), read_only(gamma))[0],
        "loss rows": lambda a: fast_losses.cross_entropy_rows(a, targets, 0.1)[0],
        "loss grad": lambda a: fast_losses.cross_entropy_grad(
            a, read_only(np.ones(6, dtype)), read_only(targets), read_only(weight), 0.1, out=a),
        "scatter": lambda a: _scattered(a, targets),
        "rms norm": lambda a: fast_rmsnorm.rmsnorm_kernel(a, gamma, 1e-6)[0],
        "rms norm backward": lambda a: fast_rmsnorm.rmsnorm_backward_kernel(
            a, a, np.ones((6, 1), dtype), read_only(gamma))[0],
    }
    for name, run in runs.items():
        want = run(x.copy())
        for odd in (read_only(x), strided):
            np.testing.assert_array_equal(run(odd), want, err_msg=name)


def _scattered(values, index):
    out = np.zeros((8, values.shape[1]), values.dtype)
    fast_embedding.scatter_add_rows(read_only(index), values, out)
    return out


@pytest.mark.parametrize("tier", [fast, ops])
@pytest.mark.parametrize("eps,error", [("1e-5", TypeError), (True, TypeError),
                                       (None, TypeError), (-1e-5, ValueError),
                                       (float("nan"), ValueError), (float("inf"), ValueError)])
def test_layer_norm_refuses_an_eps_that_is_not_a_real_number(tier, eps, error):
    """A string eps reached the compiled kernel, whose TypingError the caller saw; the
    op's contract refuses it (and a negative or non-finite one) naming eps."""
    with pytest.raises(error, match="layer norm eps"):
        tier.layernorm_forward(np.ones((2, 3)), np.ones(3), np.ones(3), eps)


@pytest.mark.parametrize("replicas", [2, 3])
def test_thread_replicas_sum_into_the_flat_buffer_as_per_tensor(replicas):
    """A flat model's replicas keep flat gradient buffers of their own, summed in one
    pass: the gradients equal the whole batch's, as the per-tensor sum's do."""
    from npformer.parallel import DataParallel

    from .parallel_cases import build

    with using_backend("numpy", "float64"):
        model, task, batch = build("lm")
        model.zero_grad()
        task.loss_and_grad(model, batch, 1.0)
        expected = [p.grad.copy() for p in model.parameters()]
        opt = tiered.AdamW(model.parameters())
        opt.zero_grad()
        parallel = DataParallel(model, replicas)
        for _ in range(2):  # the second step reuses the replicas' buffers
            opt.zero_grad()
            parallel.loss_and_grad(task, batch, 1.0, seed=0)
        assert set(parallel.replicas._replica_flats) == set(range(1, replicas))
        scale = max(float(np.max(np.abs(g))) for g in expected)
        for (name, p), g in zip(model.named_parameters(), expected):
            assert p.grad is opt._flat.grad_views[model.parameters().index(p)], name
            assert float(np.max(np.abs(p.grad - g))) <= 1e-12 * scale, name
