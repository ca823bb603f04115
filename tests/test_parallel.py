"""Data-parallel replicas: the summed shard gradients equal the whole batch's, exactly
enough to train the same model, and runs with dropout repeat exactly."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from npformer.parallel import DataParallel, shard_bounds, split_batch
from npformer.parallel.replicas import ThreadReplicas
from tests.conftest import using_backend
from tests.helpers import rel_diff, using_tier
from tests.parallel_cases import build, train

# A behaviour test: it runs in both tiers (tests.helpers.tiered), which must behave the same.
pytestmark = pytest.mark.usefixtures("tier")


@pytest.mark.parametrize("kind", ["classifier", "lm", "seq2seq"])
@pytest.mark.parametrize("replicas", [2, 3])
def test_sharded_gradients_equal_the_whole_batch(kind, replicas):
    with using_backend("numpy", "float64"):
        model, task, batch = build(kind)
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


@pytest.mark.parametrize("tier", ["fast"])  # the tier of flat gradient buffers
def test_no_replica_thread_syncs_the_models_flat_buffer(monkeypatch, tier):
    """After ``model.zero_grad()`` (fresh arrays, not the flat buffer's views) the buffer is
    synced in the caller's thread, before the replicas start.  A sync from a replica's
    thread copied the model's gradient while the model's thread was still adding into it
    (that shard's token-table gradient lost, one run in four; found by CI)."""
    from npformer.nn.flat import FlatParameters
    synced_in, sync = [], FlatParameters.sync

    def recording_sync(flat):
        synced_in.append(threading.get_ident())
        return sync(flat)

    monkeypatch.setattr(FlatParameters, "sync", recording_sync)
    with using_backend("numpy", "float64"):
        model, task, batch = build("sparse", 6)
        engine = DataParallel(model, 2)
        for _ in range(2):
            model.zero_grad()
            engine.loss_and_grad(task, batch, 1.0, seed=0)
    assert synced_in and set(synced_in) == {threading.get_ident()}


@pytest.mark.parametrize("tier", ["fast"])
def test_replicas_keep_every_shards_gradient_run_after_run(tier):
    """The summed gradients equal one process's in each of 30 first batches of new
    replicas (the race above lost a shard's table gradient in about one of four)."""
    with using_backend("numpy", "float64"):
        model, task, batch = build("sparse", 6)
        model.zero_grad()
        task.loss_and_grad(model, batch, 1.0)
        alone = [p.grad.copy() for p in model.parameters()]
        for run in range(30):  # a new engine each time: its replicas' first batch
            model.zero_grad()
            DataParallel(model, 2).loss_and_grad(task, batch, 1.0, seed=0)
            for (name, p), g in zip(model.named_parameters(), alone):
                assert np.allclose(p.grad, g, rtol=1e-12, atol=1e-15), (run, name)


@pytest.mark.parametrize("tier", ["fast", "textbook"])  # a flat gradient buffer, or not
def test_every_batch_starts_each_replica_from_zero_gradients(tier):
    """A replica's gradients from an earlier batch never leak into a later one, also when
    it sat out a batch in between (a batch of fewer rows than replicas)."""
    with using_tier(tier), using_backend("numpy", "float64"):
        model, task, batch = build("lm", rows=5)
        parallel = DataParallel(model, 3)
        for rows in (5, 1, 4):
            shard = tuple(a[:rows] for a in batch)
            model.zero_grad()
            task.loss_and_grad(model, shard, 1.0)
            expected = [p.grad.copy() for p in model.parameters()]
            model.zero_grad()
            parallel.loss_and_grad(task, shard, 1.0, seed=0)
            scale = max(float(np.max(np.abs(g))) for g in expected)
            for (name, p), g in zip(model.named_parameters(), expected):
                assert float(np.max(np.abs(p.grad - g))) <= 1e-12 * scale, (rows, name)


def test_a_replica_shares_the_models_weights_and_copies_none_of_its_gradients():
    """The replicas read the model's weight arrays, and make their own gradients before
    their first shard: a copy of the model's would be memory freed at once."""
    model, _, _ = build("lm")
    replicas = ThreadReplicas(model, 2)
    for p, q in zip(*replicas.parameter_lists):
        assert q.data is p.data
        assert q.grad is None


def test_split_batch_covers_every_row_once():
    batch = (np.arange(7)[:, None], np.arange(7))
    shards = split_batch(batch, 3)
    assert [len(s[1]) for s in shards] == [2, 2, 3]
    assert np.array_equal(np.concatenate([s[1] for s in shards]), np.arange(7))
    assert len(split_batch((np.arange(1),), 2)) == 1  # never an empty shard
    assert shard_bounds(2, 3) == [(0, 0), (0, 1), (1, 2)]  # the bounds keep empty ones
    with pytest.raises(ValueError, match="parts must be at least 1"):
        shard_bounds(4, 0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_replicas_must_be_a_positive_integer(bad):
    model, _, _ = build("lm")
    with pytest.raises(ValueError, match="replicas must be an integer of at least 1"):
        DataParallel(model, replicas=bad)


def _train(steps, replicas, dropout, save_to=None, resume_from=None):
    return list(train("classifier", steps, replicas=replicas, dropout=0.3 if dropout else 0.0,
                      batch_rows=8, save_to=save_to, resume_from=resume_from)[1].values())


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


@pytest.mark.parametrize("tier", ["fast"])  # a behaviour of the threads, not of a tier
@pytest.mark.parametrize("count", [2, 3, 5])
def test_parallel_map_keeps_order_and_runs_on_the_callers_thread_and_kept_helpers(tier, count):
    from npformer.nn import grad_enabled, no_grad
    from npformer.parallel import parallel_map

    def where(item):
        return item, threading.get_ident(), grad_enabled()

    with no_grad():  # the caller's switch reaches the helpers
        first = parallel_map(where, range(count), 2)
        second = parallel_map(where, range(count), 2)
    assert [item for item, _, _ in first] == list(range(count))
    assert not any(grad for _, _, grad in first)
    me = threading.get_ident()
    assert first[0][1] == me and {t for _, t, _ in first} != {me}  # the caller and a helper
    helpers = {t for _, t, _ in first} - {me}
    assert helpers == {t for _, t, _ in second} - {me}  # the same helper, kept
    # a map inside a mapped function runs in its thread; an error reaches the caller
    nested = parallel_map(lambda k: parallel_map(lambda j: (k, j), range(3), 2), range(3), 2)
    assert nested == [[(k, j) for j in range(3)] for k in range(3)]

    def fails_on_the_last(item):
        if item == count - 1:
            raise ValueError("the last item")
        return item
    with pytest.raises(ValueError, match="the last item"):
        parallel_map(fails_on_the_last, range(count), 2)


@pytest.mark.parametrize("tier", ["fast"])  # a behaviour of the threads, not of a tier
def test_each_replica_runs_in_its_own_thread_every_step(tier):
    """Job 0 (the model's) runs in the caller's thread and job k in replica k's thread, the
    same thread every step: each thread's allocator serves one replica's arrays (with
    shards of changing sizes, a job landing on either thread grew both threads' heaps:
    seq2seq's peak memory went from 520 to 600-655 MiB).  An error in a replica reaches
    the caller after every job has finished."""
    with using_backend("numpy", "float64"):
        model, task, batch = build("lm")
        replicas = ThreadReplicas(model, 3)
        seen = []
        loss_and_grad = task.loss_and_grad

        def recording(m, shard, scale):
            seen.append((replicas.models.index(m), threading.get_ident()))
            return loss_and_grad(m, shard, scale)

        task.loss_and_grad = recording
        shards = split_batch(batch, 3)
        steps = []
        for step in range(3):
            seen.clear()
            model.zero_grad()
            replicas.run(task, [(shard, 1.0, step) for shard in shards])
            steps.append(dict(seen))
        assert steps[0][0] == threading.get_ident()
        assert len(set(steps[0].values())) == 3  # three threads
        assert steps[0] == steps[1] == steps[2]

        def failing(m, shard, scale):
            if m is replicas.models[2]:
                raise ValueError("replica 2 failed")
            return loss_and_grad(m, shard, scale)

        task.loss_and_grad = failing
        with pytest.raises(ValueError, match="replica 2 failed"):
            replicas.run(task, [(shard, 1.0, 0) for shard in shards])
