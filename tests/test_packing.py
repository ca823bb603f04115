"""Packing: running the position-wise layers on the valid positions only.

``fast.Packing`` packs the valid positions of a padded (B, T, D) batch into rows
(N, D) and unpacks them back, zeros at padding; each is the other's backward.
Checked here, on NumPy and on the strict namespace, in float64:

* pack and unpack pass gradient checks (lengths include 0 and the full length);
* the fast EncoderBlock on packed rows (``packing=``) gives, at every valid position, the
  output and the input gradient of the same block on the padded batch, and the same
  gradient for every parameter; and it passes a gradient check itself;
* packed input of the wrong shape, and a context of another batch size, are refused.

The fast classifier and seq2seq model run packed; their gradient checks, PyTorch parity
(test_models_*) and equality with the textbook models (test_fast_layers) cover them.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npformer import backend, fast, ops
from npformer.gradcheck import check_module, check_op

from .helpers import GRADCHECK_TOL

SEEDS = st.integers(0, 2**32 - 1)


def _lengths(rng, batch, length):
    lens = rng.integers(0, length + 1, size=batch)
    lens[rng.integers(batch)] = length  # one full sequence, so N > 0
    return backend.asarray(lens)


def _without_cache(forward, backward):
    """``forward`` and ``backward`` as the (forward, backward) pair check_op takes."""
    return (lambda a: (forward(a), None)), (lambda d, _: backward(d))


@given(seed=SEEDS, batch=st.integers(1, 3), length=st.integers(1, 4), width=st.integers(1, 3))
def test_pack_and_unpack_gradients(xb, seed, batch, length, width):
    rng = np.random.default_rng(seed)
    packing = fast.Packing.from_lengths(_lengths(rng, batch, length), length)
    x = backend.asarray(rng.standard_normal((batch, length, width)), dtype="float64")
    rows = packing.pack(x)
    for forward, backward, arg in ((packing.pack, packing.unpack, x),
                                   (packing.unpack, packing.pack, rows)):
        result = check_op(*_without_cache(forward, backward), [arg], [0])
        assert result.worst_error < GRADCHECK_TOL, result


def test_pack_picks_the_valid_positions_in_order(xb):
    packing = fast.Packing.from_lengths(backend.asarray(np.array([2, 0, 3])), 3)
    x = backend.asarray(np.arange(9.0).reshape(3, 3, 1))
    np.testing.assert_array_equal(backend.to_numpy(packing.pack(x))[:, 0], [0, 1, 6, 7, 8])
    padded = backend.to_numpy(packing.unpack(packing.pack(x)))[..., 0]
    np.testing.assert_array_equal(padded, [[0, 1, 0], [0, 0, 0], [6, 7, 8]])


def _block(rng, norm_first):
    block = fast.blocks.EncoderBlock(6, 3, 7, dropout=0.0, activation="gelu",
                                     norm_first=norm_first)
    for _, p in block.named_parameters():
        p.data = backend.asarray(rng.standard_normal(p.shape) * 0.7, dtype="float64")
    return block


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@settings(max_examples=10)
@given(seed=SEEDS, batch=st.integers(1, 3), length=st.integers(1, 5))
def test_packed_encoder_block_equals_padded(xb, norm_first, seed, batch, length):
    rng = np.random.default_rng(seed)
    lens = _lengths(rng, batch, length)
    packing, mask = fast.Packing.from_lengths(lens, length), ops.padding_mask(lens, length)
    valid = backend.to_numpy(packing.unpack(backend.asarray(
        np.ones((int(packing.index.shape[0]), 1)), dtype="float64")))[..., 0] > 0  # (B, T)
    block = _block(rng, norm_first)
    x = rng.standard_normal((batch, length, 6))
    dy = rng.standard_normal((batch, length, 6)) * valid[..., None]  # no gradient at padding

    block.zero_grad()
    y = block(backend.asarray(x, dtype="float64"), mask=mask)
    dx = backend.to_numpy(block.backward(backend.asarray(dy, dtype="float64")))
    grads = {name: backend.to_numpy(p.grad) for name, p in block.named_parameters()}

    block.zero_grad()
    rows = packing.pack(backend.asarray(x, dtype="float64"))
    y_rows = block(rows, mask=mask, packing=packing)
    dx_rows = block.backward(packing.pack(backend.asarray(dy, dtype="float64")))

    np.testing.assert_allclose(backend.to_numpy(packing.unpack(y_rows))[valid],
                               backend.to_numpy(y)[valid], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(packing.unpack(dx_rows))[valid], dx[valid],
                               rtol=1e-12, atol=1e-12)
    for name, p in block.named_parameters():
        np.testing.assert_allclose(backend.to_numpy(p.grad), grads[name], rtol=1e-10,
                                   atol=1e-12, err_msg=name)


@settings(max_examples=5)
@given(seed=SEEDS)
def test_packed_encoder_block_gradcheck(xb, seed):
    rng = np.random.default_rng(seed)
    lens = _lengths(rng, 2, 3)
    packing = fast.Packing.from_lengths(lens, 3)
    block = _block(rng, norm_first=False)
    rows = backend.asarray(rng.standard_normal((int(packing.index.shape[0]), 6)),
                           dtype="float64")
    result = check_module(block, [rows], kwargs={"mask": ops.padding_mask(lens, 3),
                                                 "packing": packing}, seed=seed)
    assert result.errors and result.worst_error < GRADCHECK_TOL, result


def test_packed_input_errors(xb):
    packing = fast.Packing.from_lengths(backend.asarray(np.array([1, 2])), 2)
    attention = fast.blocks.MultiHeadAttention(4, 2)
    with pytest.raises(ValueError, match=r"attention input must be the packed rows \(N, D\) = "
                                         r"\(3, 4\), got shape \(2, 2, 4\)"):
        attention(backend.asarray(np.zeros((2, 2, 4))), packing=packing)
    with pytest.raises(ValueError, match="context has batch 3 but the queries have batch 2"):
        attention(backend.asarray(np.zeros((3, 4))), context=backend.asarray(np.zeros((3, 2, 4))),
                  packing=packing)
    with pytest.raises(ValueError, match=r"attention input \(batch, positions, width\)"):
        attention(backend.asarray(np.zeros((3, 4))))  # rows, but no packing: (B, T, D) expected
