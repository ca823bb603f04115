"""Logits at the valid target positions only: ``model(..., valid_only=True)`` gives the
(N, V) rows of the valid targets, in both tiers (the fast tier computes only those, on
packed rows), and the training loss on them equals the loss on full logits with padding
ignored, with the same gradients."""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend, gradcheck, ops
from npformer.models import Seq2SeqConfig
from npformer.train.tasks import Translation
from tests.conftest import using_backend
from tests.helpers import GRADCHECK_TOL, rel_diff, tiered


def _model_and_batch(seed=0):
    rng = np.random.default_rng(seed)
    model = tiered.Seq2SeqTransformer(Seq2SeqConfig(src_vocab_size=9, tgt_vocab_size=11, d_model=4,
                                             num_heads=2, num_encoder_layers=1,
                                             num_decoder_layers=1, d_ff=6, block_size=6,
                                             dropout=0.0))
    src = rng.integers(4, 9, (3, 4))
    src[2, 2:] = 0
    tgt_out = rng.integers(4, 11, (3, 5))
    tgt_out[0, 3:] = 0
    tgt_out[1, 1:] = 0
    tgt_in = np.concatenate([np.full((3, 1), 2), tgt_out[:, :-1]], axis=1)
    return model, (src, (src != 0).sum(1), tgt_in, tgt_out, (tgt_out != 0).sum(1))


def test_logits_in_the_target_layout_match_the_full_logits_and_loss(tier):
    with using_backend("numpy", "float64"):
        model, (src, src_lens, tgt_in, tgt_out, tgt_lens) = _model_and_batch()
        valid = tgt_out != 0
        full = model(src, tgt_in, src_lens, tgt_lens)  # (B, T, V): every position
        picked = model(src, tgt_in, src_lens, tgt_lens, valid_only=True)  # (N, V)
        assert picked.shape == (int(valid.sum()), full.shape[-1])
        assert rel_diff(picked, full[valid]) <= 1e-13
        # the training step's loss and gradients equal those of full logits + ignore_index
        model.zero_grad()
        task = Translation(label_smoothing=0.1)
        batch = (src, src_lens, tgt_in, tgt_out, tgt_lens)
        loss, count = task.loss_and_grad(model, batch), task.count(batch)
        grads = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad()
        logits = model(src, tgt_in, src_lens, tgt_lens)
        full_loss, cache = ops.cross_entropy_forward(
            logits, np.where(valid, tgt_out, ops.IGNORE_INDEX), label_smoothing=0.1)
        model.backward(ops.cross_entropy_backward(1.0, cache))
        assert count == int(valid.sum())
        assert abs(loss - float(full_loss)) <= 1e-12
        scale = max(float(np.max(np.abs(g))) for g in grads.values())
        for name, p in model.named_parameters():
            assert float(np.max(np.abs(p.grad - grads[name]))) <= 1e-12 * scale, name


def test_gradient_check_of_the_valid_logits(xb, tier):
    model, (src, src_lens, tgt_in, tgt_out, tgt_lens) = _model_and_batch(seed=1)
    args = [backend.asarray(a) for a in (src, tgt_in, src_lens, tgt_lens)]
    result = gradcheck.check_module(model, args, wrt_inputs=[], kwargs={"valid_only": True})
    assert result.worst_error < GRADCHECK_TOL, str(result)


def test_valid_only_must_be_true_or_false(tier):
    with using_backend("numpy", "float64"):
        model, (src, src_lens, tgt_in, tgt_out, tgt_lens) = _model_and_batch()
        with pytest.raises(TypeError, match="valid_only must be True or False, got 'yes'"):
            model(src, tgt_in, src_lens, tgt_lens, valid_only="yes")
