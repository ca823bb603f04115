"""Data-parallel replicas: the summed shard gradients equal the whole batch's, exactly
enough to train the same model, and runs with dropout repeat exactly."""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend
from npformer.models import (CausalLM, CausalLMConfig, ClassifierConfig, Seq2SeqConfig,
                             Seq2SeqTransformer, TransformerClassifier)
from npformer.optim import AdamW
from npformer.parallel import DataParallel, split_batch
from npformer.tasks import Classification, LanguageModeling, Translation
from npformer.train import Trainer, TrainConfig
from tests.conftest import using_backend
from tests.helpers import rel_diff


def _classifier_case(rng):
    model = TransformerClassifier(ClassifierConfig(vocab_size=30, d_model=8, num_heads=2,
                                                   num_layers=1, d_ff=12, max_len=10,
                                                   dropout=0.0))
    ids = rng.integers(1, 30, (7, 10))
    lens = rng.integers(1, 11, 7)
    return model, Classification(), (ids, lens, rng.integers(0, 2, 7))


def _lm_case(rng):
    model = CausalLM(CausalLMConfig(vocab_size=11, block_size=6, d_model=8, num_heads=2,
                                    num_layers=1, d_ff=12))
    x = rng.integers(0, 11, (5, 6))
    return model, LanguageModeling(), (x, rng.integers(0, 11, (5, 6)))


def _seq2seq_case(rng):
    model = Seq2SeqTransformer(Seq2SeqConfig(src_vocab_size=12, tgt_vocab_size=13, d_model=8,
                                             num_heads=2, num_encoder_layers=1,
                                             num_decoder_layers=1, d_ff=12, max_len=8,
                                             dropout=0.0))
    src = rng.integers(4, 12, (6, 5))
    src_lens = rng.integers(1, 6, 6)
    tgt_out = rng.integers(4, 13, (6, 4))
    tgt_lens = rng.integers(1, 5, 6)
    for row, n in enumerate(tgt_lens):  # padding after the valid tokens: shards differ in count
        tgt_out[row, n:] = 0
    tgt_in = np.concatenate([np.full((6, 1), 2), tgt_out[:, :-1]], axis=1)
    return model, Translation(label_smoothing=0.1), (src, src_lens, tgt_in, tgt_out,
                                                           tgt_lens)


@pytest.mark.parametrize("case", [_classifier_case, _lm_case, _seq2seq_case])
@pytest.mark.parametrize("replicas", [2, 3])
def test_sharded_gradients_equal_the_whole_batch(case, replicas):
    with using_backend("numpy", "float64"):
        model, task, batch = case(np.random.default_rng(0))
        model.zero_grad()
        whole_loss = task.loss_and_grad(model, batch, 1.0)
        expected = [p.grad for p in model.parameters()]
        model.zero_grad()
        loss, _ = DataParallel(model, replicas).loss_and_grad(task, batch, 1.0, seed=0)
        assert abs(loss - whole_loss) <= 1e-12 * abs(whole_loss)
        # measured against the largest gradient: some (the key bias) are zero in theory
        scale = max(float(np.max(np.abs(g))) for g in expected)
        for (name, p), g in zip(model.named_parameters(), expected):
            assert float(np.max(np.abs(p.grad - g))) <= 1e-12 * scale, name


def test_split_batch_covers_every_row_once():
    batch = (np.arange(7)[:, None], np.arange(7))
    shards = split_batch(batch, 3)
    assert [len(s[1]) for s in shards] == [2, 2, 3]
    assert np.array_equal(np.concatenate([s[1] for s in shards]), np.arange(7))
    assert len(split_batch((np.arange(1),), 2)) == 1  # never an empty shard


def _train(steps, replicas, dropout, save_to=None, resume_from=None):
    backend.seed(0)
    model = TransformerClassifier(ClassifierConfig(vocab_size=30, d_model=8, num_heads=2,
                                                   num_layers=1, d_ff=12, max_len=10,
                                                   dropout=dropout))
    optimizer = AdamW(model.parameters(), lr=1e-2)
    data = np.random.default_rng(1)
    ids, lens, labels = data.integers(1, 30, (64, 10)), data.integers(1, 11, 64), \
        data.integers(0, 2, 64)

    def next_batch(rng):
        rows = rng.integers(0, 64, 8)
        return ids[rows], lens[rows], labels[rows]

    trainer = Trainer(model, optimizer, Classification(), next_batch,
                      TrainConfig(max_steps=steps, replicas=replicas, progress=False))
    if resume_from:
        trainer.resume(resume_from)
    trainer.fit()
    if save_to:
        trainer.save(save_to)
    return [p.data for p in model.parameters()]


def test_parallel_training_with_dropout_repeats_and_resumes_exactly(tmp_path):
    with using_backend("numpy", "float64"):
        first = _train(6, 2, dropout=0.3)
        again = _train(6, 2, dropout=0.3)
        assert all(np.array_equal(a, b) for a, b in zip(first, again))
        _train(3, 2, dropout=0.3, save_to=tmp_path / "half.npz")
        resumed = _train(6, 2, dropout=0.3, resume_from=tmp_path / "half.npz")
        assert all(np.array_equal(a, b) for a, b in zip(first, resumed))


def test_parallel_training_without_dropout_follows_the_single_replica_run():
    with using_backend("numpy", "float64"):
        one_replica = _train(5, 1, dropout=0.0)
        two_replicas = _train(5, 2, dropout=0.0)
        # the same batches (DataParallel with one shard takes the same path): the updates
        # differ only by the order of the gradient sums
        assert all(rel_diff(a, b) <= 1e-9 for a, b in zip(one_replica, two_replicas))
