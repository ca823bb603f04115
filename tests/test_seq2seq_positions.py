"""Logits at the non-padding target positions only: the same loss and gradients as full
logits with padding ignored, for less work."""
from __future__ import annotations

import numpy as np

from npformer import backend, gradcheck, ops
from npformer.models import Seq2SeqConfig, Seq2SeqTransformer
from npformer.tasks import Translation
from tests.conftest import using_backend
from tests.helpers import GRADCHECK_TOL, rel_diff


def _model_and_batch(seed=0):
    rng = np.random.default_rng(seed)
    model = Seq2SeqTransformer(Seq2SeqConfig(src_vocab_size=9, tgt_vocab_size=11, d_model=4,
                                             num_heads=2, num_encoder_layers=1,
                                             num_decoder_layers=1, d_ff=6, max_len=6,
                                             dropout=0.0))
    src = rng.integers(4, 9, (3, 4))
    src[2, 2:] = 0
    tgt_out = rng.integers(4, 11, (3, 5))
    tgt_out[0, 3:] = 0
    tgt_out[1, 1:] = 0
    tgt_in = np.concatenate([np.full((3, 1), 2), tgt_out[:, :-1]], axis=1)
    return model, (src, (src != 0).sum(1), tgt_in, tgt_out, (tgt_out != 0).sum(1))


def test_selected_positions_match_the_full_logits_and_loss():
    with using_backend("numpy", "float64"):
        model, (src, src_lens, tgt_in, tgt_out, tgt_lens) = _model_and_batch()
        positions = np.flatnonzero(tgt_out != 0)
        full = model(src, tgt_in, src_lens, tgt_lens)  # (B, T, V)
        picked = model(src, tgt_in, src_lens, tgt_lens, positions=positions)  # (N, V)
        # the same numbers, computed on packed rows (other BLAS shapes: rounding only)
        assert rel_diff(picked, full.reshape(-1, full.shape[-1])[positions]) <= 1e-13
        # the training step's loss and gradients equal those of full logits + ignore_index
        model.zero_grad()
        task = Translation(label_smoothing=0.1)
        batch = (src, src_lens, tgt_in, tgt_out, tgt_lens)
        loss, count = task.loss_and_grad(model, batch), task.count(batch)
        grads = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad()
        logits = model(src, tgt_in, src_lens, tgt_lens)
        targets = np.where(tgt_out == 0, ops.IGNORE_INDEX, tgt_out)
        full_loss, cache = ops.cross_entropy_forward(logits, targets, label_smoothing=0.1)
        model.backward(ops.cross_entropy_backward(1.0, cache))
        assert count == len(positions)
        assert abs(loss - float(full_loss)) <= 1e-12
        scale = max(float(np.max(np.abs(g))) for g in grads.values())
        for name, p in model.named_parameters():
            assert float(np.max(np.abs(p.grad - grads[name]))) <= 1e-12 * scale, name


def test_gradient_check_with_selected_positions(xb):
    model, (src, src_lens, tgt_in, tgt_out, tgt_lens) = _model_and_batch(seed=1)
    positions = backend.asarray(np.flatnonzero(tgt_out != 0))
    args = [backend.asarray(a) for a in (src, tgt_in, src_lens, tgt_lens)]
    result = gradcheck.check_module(model, args, wrt_inputs=[],
                                    kwargs={"positions": positions})
    assert result.worst_error < GRADCHECK_TOL, str(result)


def test_positions_at_padding_or_out_of_range_are_refused():
    import pytest

    with using_backend("numpy", "float64"):
        model, (src, src_lens, tgt_in, tgt_out, tgt_lens) = _model_and_batch()
        padding = int(np.flatnonzero(tgt_out == 0)[0])
        with pytest.raises(ValueError, match="real \\(non-padding\\) targets"):
            model(src, tgt_in, src_lens, tgt_lens, positions=np.array([0, padding]))
        with pytest.raises(ValueError, match=r"in \[0, B \* T\)"):
            model(src, tgt_in, src_lens, tgt_lens, positions=np.array([tgt_out.size]))
