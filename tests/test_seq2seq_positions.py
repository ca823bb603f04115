"""The target padding, described once: with the paddings the task builds, the seq2seq
model gives logits in the target padding's layout (fast tier: the valid target
positions only, computed on the packed rows) and the loss takes its targets in the
same layout.  The same loss and gradients as full logits with padding ignored, in
both tiers, for less work in the fast one."""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend, gradcheck, ops
from npformer.models import Seq2SeqConfig, Seq2SeqTransformer
from npformer.nn import Padding
from npformer.tasks import Translation
from tests.conftest import using_backend
from tests.helpers import GRADCHECK_TOL, rel_diff


def _model_and_batch(seed=0):
    rng = np.random.default_rng(seed)
    model = Seq2SeqTransformer(Seq2SeqConfig(src_vocab_size=9, tgt_vocab_size=11, d_model=4,
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


def _paddings(src, src_lens, tgt_in, tgt_lens):
    return {"src_padding": Padding.of(src_lens, src.shape[1]),
            "tgt_padding": Padding.of(tgt_lens, tgt_in.shape[1])}


def test_logits_in_the_target_layout_match_the_full_logits_and_loss(tier):
    with using_backend("numpy", "float64"):
        model, (src, src_lens, tgt_in, tgt_out, tgt_lens) = _model_and_batch()
        valid = tgt_out != 0
        full = model(src, tgt_in, src_lens, tgt_lens)  # (B, T, V): every position
        paddings = _paddings(src, src_lens, tgt_in, tgt_lens)
        picked = model(src, tgt_in, **paddings)
        if tier == "fast":  # (N, V): the valid positions only, on the packed rows
            assert picked.shape == (int(valid.sum()), full.shape[-1])
            assert rel_diff(picked, full[valid]) <= 1e-13
        else:  # (B, T, V): the padded arrays (the valid positions are what counts)
            assert rel_diff(picked[valid], full[valid]) <= 1e-13
        targets = backend.to_numpy(paddings["tgt_padding"].targets(tgt_out))
        expected = tgt_out[valid] if tier == "fast" else np.where(valid, tgt_out,
                                                                  ops.IGNORE_INDEX)
        np.testing.assert_array_equal(targets, expected)
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


def test_gradient_check_with_the_task_paddings(xb, tier):
    model, (src, src_lens, tgt_in, tgt_out, tgt_lens) = _model_and_batch(seed=1)
    args = [backend.asarray(a) for a in (src, tgt_in)]
    result = gradcheck.check_module(model, args, wrt_inputs=[],
                                    kwargs=_paddings(src, src_lens, tgt_in, tgt_lens))
    assert result.worst_error < GRADCHECK_TOL, str(result)


def test_a_padding_that_does_not_fit_is_refused():
    with using_backend("numpy", "float64"):
        model, (src, src_lens, tgt_in, tgt_out, tgt_lens) = _model_and_batch()
        paddings = _paddings(src, src_lens, tgt_in, tgt_lens)
        with pytest.raises(ValueError, match=r"padding describes a \(3, 5\) batch, but the "
                                             r"ids have shape \(3, 4\)"):
            model(src, tgt_in[:, :4], **paddings)
        with pytest.raises(ValueError, match="pass the valid lengths or a padding, not both"):
            model(src, tgt_in, src_lens, **paddings)
