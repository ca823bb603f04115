"""Checkpoints and the training loop.

* save/load round trip gives identical logits, for every model kind, also when
  a checkpoint saved from NumPy is loaded on the strict array-API backend;
* exact resume: N + M steps in one run equal N steps, save, a fresh model /
  optimizer / Trainer, resume, M steps (``np.array_equal`` on every weight and
  optimizer moment), with dropout > 0, gradient accumulation, clipping and an
  LR schedule, so the backend RNG, the data RNG and the step count must all be
  restored (and without the RNG restore the weights differ: the test is sharp);
* atomic writes: an exception during ``np.savez`` leaves the previous
  checkpoint byte-for-byte intact and no temporary file behind;
* errors: another architecture (kind), another vocabulary size or width
  (CheckpointError naming the field), truncated / garbage / meta-less files
  (CheckpointError), a missing file (FileNotFoundError), no optimizer state;
* the Trainer stops with TrainingDiverged on a NaN loss or NaN gradients, or
  after a huge learning rate blows the weights up, without updating the
  weights and without writing a checkpoint;
* grad_accum=2 over batches b1, b2 is the update of the single batch b1 + b2
  (classifier and LM mean losses);
* the Trainer's AdamW + clipping on a whole model equals torch.optim.AdamW
  with the decay split by ``Parameter.decay`` and clip_grad_norm_;
* bad inputs: sequences longer than the positional table raise ValueError
  naming the length; a seq2seq target batch of another size raises;
* ``no_grad()`` inference keeps no caches, training forwards keep them only
  until the backward.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from npformer import backend, optim
from npformer.checkpoint import (
    CheckpointError,
    build_model,
    load_checkpoint,
    restore,
    save_checkpoint,
)
from npformer.interop.pytorch import rules_for, to_torch_state_dict
from npformer.models import (
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
)
from npformer.nn import no_grad
from npformer.train import TrainConfig, Trainer, TrainingDiverged, accuracy, perplexity
from npformer.train.tasks import Classification, LanguageModeling, Translation

from .conftest import using_backend
from .helpers import rel_diff, tier_under_test, tiered

# A behaviour test: it runs in both tiers (tests.helpers.tiered), which must behave the same.
pytestmark = pytest.mark.usefixtures("tier")

PAD, BOS, EOS = 0, 2, 3
TRAJECTORY_RTOL = 1e-8


# =========================================================================== builders
def classifier(vocab=9, dropout=0.0, d_model=8, **kw):
    return tiered.TransformerClassifier(ClassifierConfig(
        vocab_size=vocab, num_classes=3, d_model=d_model, num_heads=2, num_layers=2, d_ff=12,
        block_size=6, dropout=dropout, pad_id=PAD, **kw))


def lm(vocab=9, dropout=0.0, tie=True, **kw):
    return tiered.CausalLM(CausalLMConfig(vocab_size=vocab, block_size=6, d_model=8, num_heads=2,
                                   num_layers=2, d_ff=12, dropout=dropout, tie_weights=tie,
                                   **kw))


def seq2seq(dropout=0.0):
    return tiered.Seq2SeqTransformer(Seq2SeqConfig(
        src_vocab_size=9, tgt_vocab_size=10, d_model=8, num_heads=2, num_encoder_layers=1,
        num_decoder_layers=1, d_ff=12, block_size=6, dropout=dropout, pad_id=PAD, bos_id=BOS,
        eos_id=EOS))


def classifier_batch(rng, batch=4, length=6, vocab=9):
    lens = rng.integers(1, length + 1, size=batch)
    ids = np.full((batch, length), PAD, dtype=np.int64)
    for b, n in enumerate(lens):
        ids[b, :n] = rng.integers(1, vocab, size=n)
    return ids, lens, rng.integers(0, 3, size=batch)


def lm_batch(rng, batch=3, length=6, vocab=9):
    x = rng.integers(0, vocab, size=(batch, length))
    return x, rng.integers(0, vocab, size=(batch, length))


def seq2seq_batch(rng, batch=3):
    src_lens = rng.integers(1, 6, size=batch)
    tgt_lens = rng.integers(1, 6, size=batch)
    src = np.full((batch, 5), PAD, dtype=np.int64)
    tgt_in = np.full((batch, 5), PAD, dtype=np.int64)
    tgt_out = np.full((batch, 5), PAD, dtype=np.int64)
    for b in range(batch):
        src[b, :src_lens[b]] = rng.integers(4, 9, size=src_lens[b])
        body = list(rng.integers(4, 10, size=tgt_lens[b] - 1))
        tgt_in[b, :tgt_lens[b]] = [BOS, *body]
        tgt_out[b, :tgt_lens[b]] = [*body, EOS]
    return src, src_lens, tgt_in, tgt_out, tgt_lens


def dev(host):
    return backend.asarray(np.asarray(host))


def logits_of(model, batch):
    """Eval-mode logits (host) of ``batch`` (host arrays) on the current backend."""
    model.eval()
    with no_grad():
        if model.kind == "classifier":
            out = model(dev(batch[0]), dev(batch[1]))
        elif model.kind == "causal_lm":
            out = model(dev(batch[0]))
        else:
            out = model(dev(batch[0]), dev(batch[2]), dev(batch[1]), dev(batch[4]))
    model.train()
    return backend.to_numpy(out)


def weights(model) -> dict[str, np.ndarray]:
    return {name: backend.to_numpy(p.data).copy() for name, p in model.named_parameters()}


def assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    different = [name for name in a if not np.array_equal(a[name], b[name])]
    assert not different, f"weights differ: {different}"


BUILDERS = {"classifier": (classifier, classifier_batch), "causal_lm": (lm, lm_batch),
            "seq2seq": (seq2seq, seq2seq_batch)}


# =========================================================================== round trip
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_round_trip_gives_identical_logits(kind, tmp_path):
    build, make_batch = BUILDERS[kind]
    with using_backend("numpy", "float64", seed=1):
        model = build(dropout=0.1)
        batch = make_batch(np.random.default_rng(0))
        expected = logits_of(model, batch)
        opt = tiered.Adam(model.parameters(), lr=1e-3)
        path = save_checkpoint(tmp_path / "sub" / "model.npz", model, opt, step=7,
                               extra={"vocab": ["a", "b"]})
        checkpoint = load_checkpoint(path)
        assert checkpoint.kind == kind and checkpoint.step == 7
        assert checkpoint.extra == {"vocab": ["a", "b"]}
        rebuilt = build_model(checkpoint, expected_kind=kind, tier=tier_under_test())
        assert type(rebuilt) is type(model) and rebuilt.config == model.config
        np.testing.assert_array_equal(logits_of(rebuilt, batch), expected)
        # restore() into an existing model of the same architecture (other weights)
        backend.seed(99)
        other = build(dropout=0.1)
        assert not np.array_equal(logits_of(other, batch), expected)
        restore(other, checkpoint)
        np.testing.assert_array_equal(logits_of(other, batch), expected)


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_checkpoint_from_numpy_loads_on_strict_backend(kind, tmp_path):
    build, make_batch = BUILDERS[kind]
    batch = make_batch(np.random.default_rng(0))
    with using_backend("numpy", "float64", seed=2):
        model = build()
        expected = logits_of(model, batch)
        save_checkpoint(tmp_path / "m.npz", model)
    with using_backend("strict", "float64"):
        rebuilt = build_model(load_checkpoint(tmp_path / "m.npz"), tier=tier_under_test())
        p = next(iter(rebuilt.parameters()))
        assert type(p.data).__module__.startswith("array_api_strict")
        got = logits_of(rebuilt, batch)
    assert rel_diff(got, expected) <= 1e-12


# =========================================================================== exact resume
def _resume_setup(seed_model: int):
    """A classifier with dropout, AdamW on a warmup-cosine schedule, and a Trainer that
    accumulates two batches and clips: every piece of state matters for resuming."""
    backend.seed(seed_model)
    model = classifier(dropout=0.3)
    opt = tiered.AdamW(model.parameters(),
                      lr=optim.warmup_cosine(peak_lr=3e-2, warmup=2, total_updates=6,
                                             min_lr=1e-3), weight_decay=0.1)
    return model, opt


def _trainer(model, opt, max_iters, path=None):
    return Trainer(model, opt, Classification(), classifier_batch,
                   TrainConfig(max_iters=max_iters, grad_accum=2, clip_norm=0.5,
                               checkpoint_path=path, progress=False), seed=5)


def test_resume_is_exact(tmp_path):
    N, M = 3, 3
    path = tmp_path / "resume.npz"
    with using_backend("numpy", "float64"):
        model, opt = _resume_setup(0)
        _trainer(model, opt, N + M).fit()
        straight = weights(model)
        straight_opt = {k: backend.to_numpy(v).copy() for k, v in opt.state_dict().items()
                        if "." in k}

        model, opt = _resume_setup(0)
        _trainer(model, opt, N, path).fit()  # saves at the end
        assert path.is_file()
        model, opt = _resume_setup(123)  # other initial weights, other RNG position
        trainer = _trainer(model, opt, N + M)
        trainer.resume(path)
        assert trainer.updates == N
        trainer.fit()
        assert trainer.updates == N + M
        assert_same_weights(weights(model), straight)
        for k, v in opt.state_dict().items():
            if "." in k:
                np.testing.assert_array_equal(backend.to_numpy(v), straight_opt[k], err_msg=k)


def test_resume_without_rng_state_diverges(tmp_path):
    """Control: restoring only weights and optimizer (not the RNG states) gives other
    weights, so the equality above really depends on the dropout / data RNG restore."""
    N, M = 3, 3
    path = tmp_path / "resume.npz"
    with using_backend("numpy", "float64"):
        model, opt = _resume_setup(0)
        _trainer(model, opt, N + M).fit()
        straight = weights(model)
        model, opt = _resume_setup(0)
        _trainer(model, opt, N, path).fit()
        model, opt = _resume_setup(123)
        trainer = _trainer(model, opt, N + M)
        restore(model, load_checkpoint(path), opt)
        trainer.fit()
        assert any(not np.array_equal(v, straight[k]) for k, v in weights(model).items())


# =========================================================================== atomic writes
@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch, error):
    path = tmp_path / "model.npz"
    with using_backend("numpy", "float64", seed=3):
        model = lm()
        opt = tiered.Adam(model.parameters(), lr=1e-3)
        save_checkpoint(path, model, opt, step=1)
        before = path.read_bytes()
        real_savez = np.savez

        def failing_savez(handle, **arrays):
            real_savez(handle, **dict(list(arrays.items())[:2]))  # a partial file...
            raise error  # ...then the failure

        monkeypatch.setattr(np, "savez", failing_savez)
        model.embed.tokens.weight.data = model.embed.tokens.weight.data + 1.0
        with pytest.raises(type(error)):
            save_checkpoint(path, model, opt, step=2)
        monkeypatch.undo()
        assert path.read_bytes() == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.npz"]  # no temp file
        checkpoint = load_checkpoint(path)
        assert checkpoint.step == 1


# =========================================================================== errors
def test_wrong_kind_is_refused(tmp_path):
    with using_backend("numpy", "float64"):
        path = save_checkpoint(tmp_path / "c.npz", classifier())
        checkpoint = load_checkpoint(path)
        with pytest.raises(CheckpointError, match="classifier.*causal_lm"):
            restore(lm(), checkpoint)
        with pytest.raises(CheckpointError, match="classifier"):
            build_model(checkpoint, expected_kind="causal_lm", tier=tier_under_test())
        model = lm()
        trainer = Trainer(model, tiered.Adam(model.parameters()), LanguageModeling(), lm_batch,
                          TrainConfig(max_iters=1, progress=False))
        with pytest.raises(CheckpointError, match="classifier"):
            trainer.resume(path)


@pytest.mark.parametrize("field,other", [("vocab_size", dict(vocab=11)),
                                         ("d_model", dict(d_model=4)),
                                         ("pooling", dict(pooling="max"))])
def test_other_architecture_is_refused_naming_the_field(tmp_path, field, other):
    with using_backend("numpy", "float64"):
        model = classifier()
        path = save_checkpoint(tmp_path / "c.npz", model, tiered.Adam(model.parameters()))
        target = classifier(**other)
        before = weights(target)
        with pytest.raises(CheckpointError, match=field):
            restore(target, load_checkpoint(path))
        assert_same_weights(weights(target), before)  # nothing changed


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_truncated_file_is_refused(tmp_path, fraction):
    with using_backend("numpy", "float64"):
        model = lm()
        data = save_checkpoint(tmp_path / "m.npz", model, tiered.Adam(model.parameters())
                               ).read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(data[:int(len(data) * fraction)])
    with pytest.raises(CheckpointError, match="cut.npz"):
        load_checkpoint(cut)


def test_garbage_and_foreign_files_are_refused(tmp_path):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a checkpoint at all" * 10)
    with pytest.raises(CheckpointError, match="garbage.npz"):
        load_checkpoint(garbage)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, weights=np.ones(3))
    with pytest.raises(CheckpointError, match="meta"):
        load_checkpoint(foreign)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        load_checkpoint(tmp_path / "nope.npz")
    with using_backend("numpy", "float64"):
        model = lm()
        trainer = Trainer(model, tiered.Adam(model.parameters()), LanguageModeling(), lm_batch,
                          TrainConfig(max_iters=1, progress=False))
        with pytest.raises(FileNotFoundError):
            trainer.resume(tmp_path / "nope.npz")


def test_resume_needs_optimizer_state(tmp_path):
    with using_backend("numpy", "float64"):
        model = lm()
        path = save_checkpoint(tmp_path / "m.npz", model)  # weights only
        fresh = lm()
        with pytest.raises(CheckpointError, match="optimizer"):
            restore(fresh, load_checkpoint(path), tiered.Adam(fresh.parameters()))


# =========================================================================== divergence
class _NanLoss(LanguageModeling):
    def loss_and_grad(self, model, batch, grad_scale=1.0):
        super().loss_and_grad(model, batch, grad_scale)  # a real backward: gradients are finite
        return math.nan


class _NanGrad(LanguageModeling):
    def loss_and_grad(self, model, batch, grad_scale=1.0):
        loss = super().loss_and_grad(model, batch, grad_scale)
        p = model.embed.tokens.weight
        xp = backend.namespace_of(p.grad)
        p.grad = p.grad * xp.asarray(math.nan, dtype=p.grad.dtype)
        return loss


@pytest.mark.parametrize("clip_norm", [None, 1.0])
@pytest.mark.parametrize("task, named", [(_NanLoss(), "loss nan"),
                                         (_NanGrad(), "embed.tokens.weight")])
def test_nan_stops_training_without_update_or_checkpoint(tmp_path, task, named, clip_norm):
    """A NaN loss, or a NaN gradient (with or without clipping, which refuses to clip it),
    stops training as TrainingDiverged naming what went wrong: the loss, or the parameter."""
    path = tmp_path / "never.npz"
    with using_backend("numpy", "float64"):
        model = lm()
        before = weights(model)
        opt = tiered.Adam(model.parameters(), lr=1e-3)
        trainer = Trainer(model, opt, task, lm_batch,
                          TrainConfig(max_iters=3, checkpoint_path=path, progress=False,
                                      clip_norm=clip_norm))
        with pytest.raises(TrainingDiverged, match="update 1") as caught:
            trainer.fit()
        assert named in str(caught.value)
        assert_same_weights(weights(model), before)
        assert opt.updates == 0
        assert not path.exists()
        assert list(tmp_path.iterdir()) == []


def test_huge_learning_rate_diverges_cleanly(tmp_path):
    path = tmp_path / "never.npz"
    with using_backend("numpy", "float64"):
        model = classifier()
        opt = optim.SGD(model.parameters(), lr=1e300)
        trainer = Trainer(model, opt, Classification(), classifier_batch,
                          TrainConfig(max_iters=10, checkpoint_path=path, progress=False))
        with np.errstate(all="ignore"):
            trainer.update()  # one finite update with an absurd step size
            after_first = weights(model)
            with pytest.raises(TrainingDiverged, match="learning rate"):
                trainer.fit()
        assert trainer.updates == 1
        assert_same_weights(weights(model), after_first)
        assert not path.exists()


# =========================================================================== gradient accumulation
@pytest.mark.parametrize("kind", ["classifier", "causal_lm"])
def test_grad_accumulation_equals_one_big_batch(kind):
    build, make_batch = BUILDERS[kind]
    task = Classification() if kind == "classifier" else LanguageModeling()
    rng = np.random.default_rng(6)
    b1, b2 = make_batch(rng), make_batch(rng)
    both = tuple(np.concatenate([x, y]) for x, y in zip(b1, b2))

    def run(batches, accum):
        with using_backend("numpy", "float64", seed=4):
            model = build()
            feed = iter(batches)
            trainer = Trainer(model, optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                              task, lambda _rng: next(feed),
                              TrainConfig(max_iters=1, grad_accum=accum, progress=False))
            loss = trainer.update()
            return loss, weights(model)

    loss_accum, w_accum = run([b1, b2], 2)
    loss_big, w_big = run([both], 1)
    _, w_first = run([b1], 1)
    assert loss_accum == pytest.approx(loss_big, rel=1e-12)
    for name in w_big:
        assert rel_diff(w_accum[name], w_big[name]) <= 1e-12, name
    assert any(rel_diff(w_first[n], w_big[n]) > 1e-6 for n in w_big)  # b2 mattered


# =========================================================================== optimizer vs torch
def test_trainer_adamw_with_clipping_matches_torch(torch):
    from .test_models_parity import build_pair, lm_config
    from .test_models_parity import lm_batch as parity_lm_batch

    lr, wd, clip, steps = 2e-2, 0.1, 0.5, 4
    config = lm_config(tie=False)
    with using_backend("numpy", "float64"):
        model, ref = build_pair("causal_lm", config, "float64", seed=8)
        decay = {}
        params = dict(model.named_parameters())
        for rule in rules_for(model):
            flags = {params[k].decay for k in rule.npformer_keys}
            assert len(flags) == 1
            decay[rule.torch_key] = flags.pop()
        assert any(decay.values()) and not all(decay.values())
        named = dict(ref.named_parameters())
        ref_opt = torch.optim.AdamW(
            [{"params": [p for n, p in named.items() if decay[n]], "weight_decay": wd},
             {"params": [p for n, p in named.items() if not decay[n]], "weight_decay": 0.0}],
            lr=lr)
        rng = np.random.default_rng(9)
        batches = [parity_lm_batch(rng, config) for _ in range(steps)]
        feed = iter(batches)
        trainer = Trainer(model, tiered.AdamW(model.parameters(), lr=lr, weight_decay=wd),
                          LanguageModeling(), lambda _rng: next(feed),
                          TrainConfig(max_iters=steps, clip_norm=clip, progress=False))
        history = trainer.fit()
        F = torch.nn.functional
        theirs = []
        for x, y in batches:
            ref_opt.zero_grad()
            logits = ref(torch.from_numpy(x))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   torch.from_numpy(y).reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            ref_opt.step()
            theirs.append(loss.item())
        # the optimizer-trajectory tolerance of the parity tests (float64): Adam divides
        # by sqrt(v), which amplifies last-bit differences of the gradients a little
        np.testing.assert_allclose(history.losses, theirs, rtol=TRAJECTORY_RTOL)
        ours = to_torch_state_dict(model)
        for name, p in named.items():
            assert rel_diff(ours[name], p.detach().numpy()) <= TRAJECTORY_RTOL, name


# =========================================================================== bad inputs
def test_too_long_sequences_raise_naming_the_length():
    with using_backend("numpy", "float64"):
        too_long = np.ones((2, 7), dtype=np.int64)  # tables hold 6 positions
        with pytest.raises(ValueError, match="7 is longer than block_size 6"):
            classifier()(dev(too_long))
        with pytest.raises(ValueError, match="7 is longer than block_size 6"):
            lm()(dev(too_long))
        model = seq2seq()
        fine = np.ones((2, 3), dtype=np.int64)
        with pytest.raises(ValueError, match="7"):
            model(dev(too_long), dev(fine))
        with pytest.raises(ValueError, match="7"):
            model(dev(fine), dev(too_long))


def test_seq2seq_batch_mismatch_raises():
    with using_backend("numpy", "float64"):
        model = seq2seq()
        with pytest.raises(ValueError, match="batch"):
            model(dev(np.ones((3, 4), dtype=np.int64)), dev(np.ones((2, 4), dtype=np.int64)))


def test_fully_padded_sequence_is_refused_by_pooling():
    with using_backend("numpy", "float64"):
        ids = np.array([[4, 5, 0], [0, 0, 0]])
        with pytest.raises(ValueError, match="at least one token"):
            classifier()(dev(ids))


# =========================================================================== caches
def _cached(model):
    return [type(m).__name__ for m in model.modules() if getattr(m, "_saved", None) is not None]


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_no_grad_keeps_no_caches(kind):
    build, make_batch = BUILDERS[kind]
    with using_backend("numpy", "float64"):
        model = build(dropout=0.1)
        batch = make_batch(np.random.default_rng(0))
        with no_grad():
            out = (model(dev(batch[0]), dev(batch[1])) if kind == "classifier" else
                   model(dev(batch[0])) if kind == "causal_lm" else
                   model(dev(batch[0]), dev(batch[2]), dev(batch[1]), dev(batch[4])))
        assert _cached(model) == []
        with pytest.raises(RuntimeError, match="without a forward"):
            model.backward(backend.xp().ones_like(out))
        # a training forward keeps caches, and its backward releases all of them
        task = {"classifier": Classification(), "causal_lm": LanguageModeling(),
                "seq2seq": Translation()}[kind]
        if kind == "classifier":
            model(dev(batch[0]), dev(batch[1]))
            assert _cached(model)
            model.zero_grad()
        task.loss_and_grad(model, batch)
        assert _cached(model) == []


def test_classifier_predict_keeps_no_caches_and_restores_mode():
    with using_backend("numpy", "float64"):
        model = classifier(dropout=0.2)
        ids, lens, _ = classifier_batch(np.random.default_rng(0))
        probs = backend.to_numpy(model.predict(dev(ids), dev(lens)))
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-12)
        assert _cached(model) == [] and model.training
        # eval mode: no dropout, so predictions repeat exactly
        np.testing.assert_array_equal(backend.to_numpy(model.predict(dev(ids), dev(lens))),
                                      probs)


# =========================================================================== selection and metrics
def test_best_checkpoint_selection(tmp_path):
    path = tmp_path / "best.npz"
    scores = iter([0.2, 0.5, 0.4, 0.45])
    with using_backend("numpy", "float64"):
        model = classifier()
        snapshots = {}

        def eval_fn(m):
            value = next(scores)
            snapshots[value] = weights(m)
            return {"val_accuracy": value}

        Trainer(model, tiered.Adam(model.parameters(), lr=1e-2), Classification(),
                classifier_batch, TrainConfig(max_iters=4, eval_every=1, checkpoint_path=path,
                                              select_metric="val_accuracy", progress=False),
                eval_fn=eval_fn).fit()
        checkpoint = load_checkpoint(path)
        assert checkpoint.step == 2
        assert checkpoint.extra["selected_on"] == {"val_accuracy": 0.5}
        for name, value in checkpoint.params.items():
            np.testing.assert_array_equal(value, snapshots[0.5][name])


def test_best_checkpoint_selection_by_the_lowest_value(tmp_path):
    """select_mode="min": the lowest value is kept, the first of equal ones (a later tie is
    no improvement), and ``trainer.best`` is it."""
    path = tmp_path / "best.npz"
    scores = iter([0.5, 0.3, 0.3, 0.4])
    with using_backend("numpy", "float64"):
        model = classifier()
        trainer = Trainer(model, tiered.Adam(model.parameters(), lr=1e-2), Classification(),
                          classifier_batch,
                          TrainConfig(max_iters=4, eval_every=1, checkpoint_path=path,
                                      select_metric="val_loss", select_mode="min",
                                      progress=False),
                          eval_fn=lambda m: {"val_loss": next(scores)})
        trainer.fit()
        checkpoint = load_checkpoint(path)
    assert checkpoint.step == 2 and trainer.best == 0.3
    assert checkpoint.extra["selected_on"] == {"val_loss": 0.3}
    assert [e["val_loss"] for e in trainer.history.evals] == [0.5, 0.3, 0.3, 0.4]


def test_accuracy_and_perplexity():
    logits = np.array([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    assert accuracy(logits, [1, 0, 0, 1]) == 0.5
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(7.0)) == pytest.approx(7.0, rel=1e-12)


# =========================================================================== the allocator
def test_a_trainer_keeps_freed_memory_in_the_process(monkeypatch):
    """Training allocates the same arrays every step: the Trainer tells glibc to keep
    them (npformer.backend.keep_freed_memory) rather than page-fault them back in every step."""
    import npformer.train.loop

    calls = []
    monkeypatch.setattr(npformer.train.loop, "keep_freed_memory", lambda: calls.append(1) or True)
    with using_backend("numpy", "float64"):
        model, opt = _resume_setup(0)
        _trainer(model, opt, max_iters=1)
    assert calls == [1]


def test_keep_freed_memory_sets_glibcs_thresholds(monkeypatch):
    """keep_freed_memory sets glibc's mmap and trim thresholds through mallopt (and says
    False, changing nothing, where there is no glibc)."""
    import ctypes

    class FakeLibc:
        def __init__(self):
            self.calls = []
            self.mallopt = lambda option, value: self.calls.append((option, value)) or 1

    fake = FakeLibc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    assert backend.keep_freed_memory() is True
    assert {option for option, _ in fake.calls} == {-3, -1}  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert all(value >= 2**30 for _, value in fake.calls)

    def no_libc(name):
        raise OSError(name)

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert backend.keep_freed_memory() is False
