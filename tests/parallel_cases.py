"""Tiny models, batches and training runs shared by the data-parallel tests: the thread
replicas (tests/test_parallel.py) and the MPI ranks (tests/test_distributed.py, whose
ranks run tests/mpi_worker.py).  Everything is seeded: the same call builds the same
model and data in any process."""
from __future__ import annotations

import numpy as np

from npformer import backend
from npformer.models import (
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
)
from npformer.parallel.buckets import BUCKET_BYTES
from npformer.train import TrainConfig, Trainer
from npformer.train.tasks import Classification, LanguageModeling, Translation
from tests.helpers import tiered


def classifier_case(rng, rows: int = 7, dropout: float = 0.0):
    model = tiered.TransformerClassifier(ClassifierConfig(vocab_size=30, d_model=8, num_heads=2,
                                                   num_layers=1, d_ff=12, block_size=10,
                                                   dropout=dropout))
    ids = rng.integers(1, 30, (rows, 10))
    lens = rng.integers(1, 11, rows)
    return model, Classification(), (ids, lens, rng.integers(0, 2, rows))


def lm_case(rng, rows: int = 5, dropout: float = 0.0):
    model = tiered.CausalLM(CausalLMConfig(vocab_size=11, block_size=6, d_model=8, num_heads=2,
                                    num_layers=1, d_ff=12, dropout=dropout))
    x = rng.integers(0, 11, (rows, 6))
    return model, LanguageModeling(), (x, rng.integers(0, 11, (rows, 6)))


def seq2seq_case(rng, rows: int = 6, dropout: float = 0.0):
    model = tiered.Seq2SeqTransformer(Seq2SeqConfig(src_vocab_size=12, tgt_vocab_size=13, d_model=8,
                                             num_heads=2, num_encoder_layers=1,
                                             num_decoder_layers=1, d_ff=12, block_size=8,
                                             dropout=dropout))
    src = rng.integers(4, 12, (rows, 5))
    src_lens = rng.integers(1, 6, rows)
    tgt_out = rng.integers(4, 13, (rows, 4))
    tgt_lens = rng.integers(1, 5, rows)
    for row, n in enumerate(tgt_lens):  # padding after the valid tokens: shards differ in count
        tgt_out[row, n:] = 0
    tgt_in = np.concatenate([np.full((rows, 1), 2), tgt_out[:, :-1]], axis=1)
    return model, Translation(label_smoothing=0.1), (src, src_lens, tgt_in, tgt_out,
                                                     tgt_lens)


def sparse_classifier_case(rng, rows: int = 6, dropout: float = 0.0):
    """A classifier whose lookup tables (400 tokens, 1,024 hashed word pairs) a batch touches
    in few rows: their gradients are row-sparse (npformer.parallel.sparse)."""
    model = tiered.TransformerClassifier(ClassifierConfig(
        vocab_size=400, d_model=8, num_heads=2, num_layers=1, d_ff=12, block_size=10,
        dropout=dropout, bigram_buckets=1024))
    ids = rng.integers(1, 400, (rows, 10))
    lens = rng.integers(1, 11, rows)
    return model, Classification(), (ids, lens, rng.integers(0, 2, rows))


CASES = {"classifier": classifier_case, "lm": lm_case, "seq2seq": seq2seq_case,
         "sparse": sparse_classifier_case}
# global batches of 7, 5 and 6 rows: uneven shards on 2 ranks (7, 5) and on 3 (7, 5), and
# on 3 ranks seq2seq's equal row shards hold different numbers of target tokens
GRADIENT_CASES = {"classifier": 7, "lm": 5, "seq2seq": 6, "lm_fewer_rows_than_ranks": 2}
# the gradient sum's bucket sizes the ranks' runs try, and their files' suffixes: the default,
# and 64 bytes (a bucket a parameter or two: many non-blocking all-reduces at once)
BUCKET_SIZES = {BUCKET_BYTES: "", 64: "_buckets64"}


def build(kind: str, rows: int | None = None, dropout: float = 0.0, seed: int = 0):
    """(model, task, batch) of a case, the model initialised from ``backend.seed(seed)``."""
    backend.seed(seed)
    make = CASES[kind.split("_")[0]]
    rng = np.random.default_rng(seed + 1)
    return make(rng, dropout=dropout) if rows is None else make(rng, rows, dropout=dropout)


def whole_batch_gradients(kind: str, rows: int):
    """(loss, {name: grad}) of one process on the whole batch of a gradient case."""
    model, task, batch = build(kind, rows)
    model.zero_grad()
    loss = task.loss_and_grad(model, batch, 1.0)
    return loss, {name: backend.to_numpy(p.grad) for name, p in model.named_parameters()}


def reduced_gradients(ranks, replicas: int, row_sparse: bool, rows: int = 6):
    """({name: grad}, bytes the sum carried) of the sparse case's batch on ``ranks`` (a
    communicator) of ``replicas`` thread replicas, its tables summed by row (``row_sparse``)
    or whole."""
    from npformer.parallel import DataParallel

    model, task, batch = build("sparse", rows)
    engine = DataParallel(model, replicas, ranks, row_sparse=row_sparse)
    model.zero_grad()
    engine.reduce_step(engine.loss_and_grad(task, batch, 1.0, seed=0)[0])
    return ({name: backend.to_numpy(p.grad) for name, p in model.named_parameters()},
            engine.reduced_bytes)


def train(kind: str, steps: int, replicas: int = 1, dropout: float = 0.0, grad_accum: int = 1,
          clip_norm: float | None = None, batch_rows: int = 7, save_to=None, resume_from=None,
          **config):
    """A Trainer with Adam on batches drawn from a fixed pool of 40 rows of ``kind``'s data;
    returns (the losses of this run's steps, the final parameters as {name: array})."""
    model, task, pool = build(kind, rows=40, dropout=dropout)
    optimizer = tiered.Adam(model.parameters(), lr=1e-2)

    def next_batch(rng):
        rows = rng.integers(0, 40, batch_rows)
        return tuple(a[rows] for a in pool)

    trainer = Trainer(model, optimizer, task, next_batch,
                      TrainConfig(max_iters=steps, replicas=replicas, grad_accum=grad_accum,
                                  clip_norm=clip_norm, progress=False, **config))
    if resume_from:
        trainer.resume(resume_from)
    history = trainer.fit()
    if save_to:
        trainer.save(save_to)
    return (np.array(history.losses),
            {name: backend.to_numpy(p.data) for name, p in model.named_parameters()})


# the Adam trajectories compared across process counts: one per model, with gradient
# accumulation, clipping and uneven shards among them
TRAJECTORIES = {
    "classifier": dict(kind="classifier", grad_accum=2, batch_rows=7),
    "lm": dict(kind="lm", clip_norm=0.5, batch_rows=5),
    "seq2seq": dict(kind="seq2seq", batch_rows=8),
}
