"""Reliability, second round (issue 18): where the library's own features meet.

One test per numbered case of the issue (case 3, the caches of the two tiers, lives with
the op contracts); each failed on the code before the fix.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for name in ("NPFORMER_MPI", "PMI_SIZE", "PMI_RANK"):
        env.pop(name, None)
    env.update(extra)
    return env


# --------------------------------------------------------------------------- case 1
JOIN = "from npformer import distributed; ctx = distributed.setup(); ctx.barrier(); print('joined', ctx.rank, ctx.size)"


@pytest.mark.mpi
def test_case01_a_rank_with_mpi_turned_off_stops_every_rank_with_a_message():
    """mpiexec -n 1 env NPFORMER_MPI=0 python ... : -n 1 python ...: before, rank 0 ran
    alone and rank 1 waited in MPI_Init for ever.  Now rank 0 refuses (it is one of 2
    ranks) and rank 1 stops after NPFORMER_MPI_TIMEOUT seconds, each with a message."""
    from tests.test_distributed import mpiexec

    started = time.perf_counter()
    proc = subprocess.run([mpiexec(), "-n", "1", "env", "NPFORMER_MPI=0", sys.executable,
                           "-c", JOIN, ":", "-n", "1", sys.executable, "-c", JOIN],
                          env=_env(NPFORMER_MPI_TIMEOUT="5"), capture_output=True, text=True,
                          timeout=90)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "NPFORMER_MPI=0 turns MPI off, but an MPI launcher started this process as one " \
        "of 2 ranks (PMI_SIZE=2)" in output, output
    assert "rank 1 waited 5 s for the other MPI ranks to join" in output, output
    assert "joined" not in output
    assert time.perf_counter() - started < 60


@pytest.mark.mpi
def test_case01_ranks_that_all_join_are_not_stopped():
    from tests.test_distributed import mpiexec

    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c", JOIN],
                          env=_env(NPFORMER_MPI_TIMEOUT="30"), capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "joined 0 2" in proc.stdout


# --------------------------------------------------------------------------- case 2
from tests.test_demos import data_dir, load_demo, one_error_line, run_demo  # noqa: E402,F401


@pytest.mark.parametrize("extra", [["--steps", "1"], ["--steps", "5"],
                                   ["--max-minutes", "1e-9"]])
def test_case02_translate_after_a_short_training_writes_its_results(extra, data_dir, tmp_path):
    """Before: an untrained model's greedy translation runs to the length limit, and the
    cross-attention plot fed <bos> + all of it (max_len + 1 positions): ValueError after
    training, no metrics.json."""
    out = tmp_path / "run"
    result = run_demo("translate.py", "--smoke", "--replicas", "1", "--no-progress",
                      "--data", str(data_dir), "--out", str(out), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("model.npz", "last.npz", "metrics.json", "curves.png", "cross_attention.png"):
        assert (out / name).is_file(), name


def test_case02_a_failing_plot_is_a_warning_after_the_results_are_written(
        data_dir, tmp_path, monkeypatch, capsys):
    demo = load_demo("generate.py")

    def broken(*args, **kwargs):
        raise RuntimeError("the plot broke")

    monkeypatch.setattr(demo, "plot_curves", broken)
    out = tmp_path / "run"
    from tests.conftest import using_backend

    with using_backend("numpy", "float32"):
        status = demo.main(["--smoke", "--iters", "2", "--replicas", "1", "--no-progress",
                            "--data", str(data_dir), "--out", str(out)])
    assert status == 0
    assert (out / "metrics.json").is_file() and (out / "model.npz").is_file()
    err = capsys.readouterr().err
    assert "warning: curves.png not written: RuntimeError: the plot broke" in err, err


# --------------------------------------------------------------------------- case 4
def _classifier():
    from npformer.models import ClassifierConfig, TransformerClassifier
    from tests.conftest import using_backend

    with using_backend("numpy", "float64"):
        return TransformerClassifier(ClassifierConfig(vocab_size=12, d_model=8, num_heads=2,
                                                      num_layers=1, d_ff=16, max_len=8,
                                                      dropout=0.0))


@pytest.mark.parametrize("ids, row, pad_at, token_at", [
    ([[0, 0, 5, 6, 7]], 0, 0, 2),  # left padding
    ([[5, 0, 7, 8]], 0, 1, 2),  # a pad in the middle: the 8 was dropped
    ([[5, 6, 7, 0], [4, 0, 0, 3]], 1, 1, 3),
])
def test_case04_padding_before_a_token_is_refused_naming_the_position(ids, row, pad_at, token_at):
    """Padding is read at the end of a row only (the layers' packing, pooling and
    positions count valid tokens from the start): padding anywhere else, which was
    misread as real tokens while the last tokens were dropped, is refused naming where."""
    from tests.conftest import using_backend

    model = _classifier()
    with using_backend("numpy", "float64"):
        with pytest.raises(ValueError, match=rf"row {row} has padding \(pad_id 0\) at position "
                                             rf"{pad_at}, before a real token at position "
                                             rf"{token_at}"):
            model.predict(ids)
        right = model.predict([[5, 6, 7, 0, 0]])  # right padding: the same as no padding
        np.testing.assert_allclose(right, model.predict([[5, 6, 7]]), rtol=1e-12)


def test_case04_a_left_padded_source_is_refused_by_the_decoders():
    from npformer.decoding import beam_search, greedy_decode
    from npformer.models import Seq2SeqConfig, Seq2SeqTransformer
    from tests.conftest import using_backend

    with using_backend("numpy", "float64"):
        model = Seq2SeqTransformer(Seq2SeqConfig(src_vocab_size=10, tgt_vocab_size=10,
                                                 d_model=8, num_heads=2, num_encoder_layers=1,
                                                 num_decoder_layers=1, d_ff=16, max_len=8,
                                                 dropout=0.0, pad_id=0, bos_id=1, eos_id=2))
        for decode in (greedy_decode, beam_search):
            with pytest.raises(ValueError, match=r"src row 0 has padding \(pad_id 0\) at "
                                                 r"position 0, before a real token at "
                                                 r"position 1"):
                decode(model, np.array([[0, 5, 6, 2]]), max_len=4)
        with pytest.raises(ValueError, match="position 0, before a real token at position 2"):
            model(np.array([[0, 0, 5, 2]]), np.array([[1, 5]]))
        # The decoder's input is all tokens (it may emit pad_id): [bos, pad, 5] keeps the 5,
        # which the old count of non-pad ids dropped (the last query's own key was masked).
        src = np.array([[5, 6, 2]])
        full = model(src, np.array([[1, 0, 5]]))
        step = model(src, np.array([[1, 0, 5]]), tgt_lens=np.array([3]))
        np.testing.assert_allclose(full, step, rtol=1e-12)


# --------------------------------------------------------------------------- case 5
@pytest.mark.parametrize("settings, error, words", [
    (dict(select_mode="maximum"), ValueError, "select_mode must be 'max' or 'min', got 'maximum'"),
    (dict(select_metric="val_loss", checkpoint_path="best.npz"), ValueError,
     "select_metric='val_loss' keeps the best model by evaluation, but eval_every is None"),
    (dict(select_metric="val_loss", eval_every=2), ValueError,
     "select_metric='val_loss' keeps the best model by evaluation, but checkpoint_path is None"),
    (dict(clip_norm=0.0), ValueError, "clip_norm must be a finite number > 0 (None: no clipping)"),
    (dict(clip_norm=float("nan")), ValueError, "clip_norm must be a finite number"),
    (dict(max_steps=-5), ValueError, "max_steps must be at least 0, got -5"),
    (dict(grad_accum=2.0), TypeError, "grad_accum must be an integer, got 2.0"),
    (dict(eval_every=0), ValueError, "eval_every must be at least 1"),
    (dict(replicas=True), TypeError, "replicas must be an integer"),
    (dict(max_seconds=-1.0), ValueError, "max_seconds must be a finite number >= 0"),
    (dict(stop_after=0), ValueError, "stop_after must be at least 1"),
])
def test_case05_settings_that_would_do_nothing_are_refused_naming_the_field(settings, error,
                                                                             words):
    from npformer.train import TrainConfig

    settings = {"max_steps": 3, **settings}
    with pytest.raises(error, match="TrainConfig." + _escaped(words)):
        TrainConfig(**settings)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_case05_an_optimizer_over_another_models_parameters_is_refused():
    from npformer.optim import Adam
    from npformer.tasks import Classification
    from npformer.train import TrainConfig, Trainer
    from tests.conftest import using_backend

    model, other = _classifier(), _classifier()
    with using_backend("numpy", "float64"):
        with pytest.raises(ValueError, match=r"the optimizer does not update this model: "
                                             r"\d+ of its \d+ parameters \(first: "
                                             r"optimizer.params\[0\]\) are not the model's"):
            Trainer(model, Adam(other.parameters()), Classification(), lambda rng: None,
                    TrainConfig(max_steps=1, progress=False))


def test_case05_a_select_metric_the_evaluation_does_not_return_is_named(tmp_path):
    from npformer.optim import Adam
    from npformer.tasks import Classification
    from npformer.train import TrainConfig, Trainer
    from tests.conftest import using_backend

    model = _classifier()
    rows = np.array([[3, 4, 5, 0], [6, 7, 0, 0]])
    with using_backend("numpy", "float64"):
        trainer = Trainer(model, Adam(model.parameters()), Classification(),
                          lambda rng: (rows, np.array([3, 2]), np.array([0, 1])),
                          TrainConfig(max_steps=2, eval_every=1, select_metric="val_acc",
                                      checkpoint_path=tmp_path / "best.npz", progress=False),
                          eval_fn=lambda m: {"val_accuracy": 0.5, "val_loss": 1.0})
        with pytest.raises(ValueError, match=r"select_metric='val_acc' is not among the "
                                             r"metrics eval_fn returned: \['val_accuracy', "
                                             r"'val_loss'\]"):
            trainer.fit()


# --------------------------------------------------------------------------- case 6
HOLD = ("import sys, time; from pathlib import Path; from npformer import cli; "
        "cli.hold_output(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)")


def _holder_process(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env=_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_case06_a_second_run_into_a_held_folder_is_refused_naming_the_holder(data_dir,
                                                                              tmp_path):
    """Before: two runs into one --out both exited 0, the folder holding a mix."""
    out = tmp_path / "run"
    holder = _holder_process(out)
    try:
        result = run_demo("generate.py", "--smoke", "--iters", "2", "--no-progress",
                          "--data", str(data_dir), "--out", str(out))
        err = one_error_line(result)
        assert f"{out} is in use by another run (pid {holder.pid} on host " in err, err
        assert not (out / "model.npz").exists()
    finally:
        holder.kill()
        holder.wait()


def test_case06_a_killed_runs_lock_does_not_block_the_next_run(tmp_path):
    from npformer import cli

    out = tmp_path / "run"
    holder = _holder_process(out)
    with pytest.raises(cli.DemoError, match=rf"pid {holder.pid} on host"):
        cli.hold_output(out)
    holder.kill()  # SIGKILL: no clean-up in the holder, the system drops its lock
    holder.wait()
    lock = cli.hold_output(out)
    try:
        assert lock.is_locked
        assert f"pid {os.getpid()} " in (out / cli.HOLDER_FILE).read_text()
    finally:
        lock.release()
        cli._held_outputs.clear()


# --------------------------------------------------------------------------- case 7
def test_case07_translate_refuses_a_sentence_longer_than_the_source_length(data_dir, tmp_path):
    """Before: the sentence was cut to its first 17 tokens and translated, silently."""
    out = tmp_path / "run"
    trained = run_demo("translate.py", "--smoke", "--steps", "1", "--replicas", "1",
                       "--no-progress", "--data", str(data_dir), "--out", str(out))
    assert trained.returncode == 0, trained.stderr[-3000:]
    long = " ".join(["i am home ."] * 6)  # 24 tokens
    err = one_error_line(run_demo("translate.py", "--out", str(out), "--translate", long))
    assert "has 24 tokens, more than the model's source length allows (16 tokens and <eos>, " \
        "max_len 17)" in err, err
    short = run_demo("translate.py", "--out", str(out), "--translate", "i am home .")
    assert short.returncode == 0, short.stderr
