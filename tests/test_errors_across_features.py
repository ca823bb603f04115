"""Errors where the library's own features meet (issue 18): MPI ranks, the demos' runs and
their folders, padded decoding inputs, settings that would do nothing, weights and optimizer
state of the wrong kind, torch modules and files, archives that are not archives.

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
JOIN = ("from npformer import parallel; ctx = parallel.setup(); ctx.barrier(); "
        "print('joined', ctx.rank, ctx.size)")


@pytest.mark.mpi
def test_case01_a_rank_with_mpi_turned_off_stops_every_rank_with_a_message():
    """mpiexec -n 1 env NPFORMER_MPI=0 python ... : -n 1 python ...: before, rank 0 ran
    alone and rank 1 waited in MPI_Init for ever.  Now rank 0 refuses (it is one of 2
    ranks) with a message, and ends rank 1 at once (issue 37 case 8, tests/test_runs.py;
    it stopped after NPFORMER_MPI_TIMEOUT seconds before)."""
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
import tests.test_demos as demo_tests  # noqa: E402
from tests.helpers import tiered  # noqa: E402
from tests.test_demos import load_demo, one_error_line, run_demo  # noqa: E402

data_dir = demo_tests.data_dir  # the demo tests' fixture, requested by name below


@pytest.mark.parametrize("extra", [["--max-iters", "1"], ["--max-iters", "5"],
                                   ["--max-minutes", "1e-9"]])
def test_case02_translate_after_a_short_training_writes_its_results(extra, data_dir, tmp_path):
    """Before: an untrained model's greedy translation runs to the length limit, and the
    cross-attention plot fed <bos> + all of it (block_size + 1 positions): ValueError after
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
        status = demo.main(["--smoke", "--max-iters", "2", "--replicas", "1", "--no-progress",
                            "--data", str(data_dir), "--out", str(out)])
    assert status == 0
    assert (out / "metrics.json").is_file() and (out / "model.npz").is_file()
    err = capsys.readouterr().err
    assert "warning: curves.png not written: RuntimeError: the plot broke" in err, err


# --------------------------------------------------------------------------- case 4
def _classifier():
    from npformer.models import ClassifierConfig
    from tests.conftest import using_backend

    with using_backend("numpy", "float64"):
        return tiered.TransformerClassifier(ClassifierConfig(vocab_size=12, d_model=8, num_heads=2,
                                                      num_layers=1, d_ff=16, block_size=8,
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
    from npformer.models import Seq2SeqConfig
    from tests.conftest import using_backend

    with using_backend("numpy", "float64"):
        model = tiered.Seq2SeqTransformer(Seq2SeqConfig(src_vocab_size=10, tgt_vocab_size=10,
                                                 d_model=8, num_heads=2, num_encoder_layers=1,
                                                 num_decoder_layers=1, d_ff=16, block_size=8,
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
    (dict(select_mode="maximum"), ValueError,
     "select_mode 'maximum'; choose one of ['max', 'min']"),
    (dict(select_metric="val_loss", checkpoint_path="best.npz"), ValueError,
     "select_metric='val_loss' keeps the best model by evaluation, but eval_every is None"),
    (dict(select_metric="val_loss", eval_every=2), ValueError,
     "select_metric='val_loss' keeps the best model by evaluation, but checkpoint_path is None"),
    (dict(clip_norm=0.0), ValueError, "clip_norm must be a finite number > 0 (None: no clipping)"),
    (dict(clip_norm=float("nan")), ValueError, "clip_norm must be a finite number"),
    (dict(max_iters=-5), ValueError, "max_iters must be at least 0, got -5"),
    (dict(grad_accum=2.0), TypeError, "grad_accum must be an integer, got 2.0"),
    (dict(eval_every=0), ValueError, "eval_every must be at least 1"),
    (dict(replicas=True), TypeError, "replicas must be an integer"),
    (dict(max_seconds=-1.0), ValueError, "max_seconds must be a finite number >= 0"),
    (dict(stop_after=0), ValueError, "stop_after must be at least 1"),
])
def test_case05_settings_that_would_do_nothing_are_refused_naming_the_field(settings, error,
                                                                             words):
    from npformer.train import TrainConfig

    settings = {"max_iters": 3, **settings}
    with pytest.raises(error, match="TrainConfig." + _escaped(words)):
        TrainConfig(**settings)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_case05_an_optimizer_over_another_models_parameters_is_refused():
    from npformer.train import TrainConfig, Trainer
    from npformer.train.tasks import Classification
    from tests.conftest import using_backend

    model, other = _classifier(), _classifier()
    with using_backend("numpy", "float64"):
        with pytest.raises(ValueError, match=r"the optimizer does not update this model: "
                                             r"\d+ of its \d+ parameters \(first: "
                                             r"optimizer.params\[0\]\) are not the model's"):
            Trainer(model, tiered.Adam(other.parameters()), Classification(), lambda rng: None,
                    TrainConfig(max_iters=1, progress=False))


def test_case05_a_select_metric_the_evaluation_does_not_return_is_named(tmp_path):
    from npformer.train import TrainConfig, Trainer
    from npformer.train.tasks import Classification
    from tests.conftest import using_backend

    model = _classifier()
    rows = np.array([[3, 4, 5, 0], [6, 7, 0, 0]])
    with using_backend("numpy", "float64"):
        trainer = Trainer(model, tiered.Adam(model.parameters()), Classification(),
                          lambda rng: (rows, np.array([3, 2]), np.array([0, 1])),
                          TrainConfig(max_iters=2, eval_every=1, select_metric="val_acc",
                                      checkpoint_path=tmp_path / "best.npz", progress=False),
                          eval_fn=lambda m: {"val_accuracy": 0.5, "val_loss": 1.0})
        with pytest.raises(ValueError, match=r"select_metric='val_acc' is not among the "
                                             r"metrics eval_fn returned: \['val_accuracy', "
                                             r"'val_loss'\]"):
            trainer.fit()


def test_case05_a_select_metric_without_an_eval_fn_is_named(tmp_path):
    from npformer.train import TrainConfig, Trainer
    from npformer.train.tasks import Classification
    from tests.conftest import using_backend

    model = _classifier()
    with using_backend("numpy", "float64"):
        with pytest.raises(ValueError, match=r"TrainConfig.select_metric='val_loss' needs an "
                                             r"eval_fn returning it: give the Trainer one"):
            Trainer(model, tiered.Adam(model.parameters()), Classification(),
                    lambda rng: None,
                    TrainConfig(max_iters=2, eval_every=1, select_metric="val_loss",
                                checkpoint_path=tmp_path / "best.npz", progress=False))


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
        result = run_demo("generate.py", "--smoke", "--max-iters", "2", "--no-progress",
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
@pytest.mark.parametrize("merges", ["0", "500"])
def test_case07_translate_refuses_a_sentence_longer_than_the_source_length(merges, data_dir,
                                                                          tmp_path):
    """Before: the sentence was cut to its first 17 tokens and translated, silently. With
    whole words (--bpe-merges 0) the limit is 15 words and <eos>; with subword pieces,
    twice as many pieces, and the message counts pieces."""
    from npformer.checkpoint import load_checkpoint
    from npformer.data import BPE

    out = tmp_path / "run"
    trained = run_demo("translate.py", "--smoke", "--max-iters", "1", "--replicas", "1",
                       "--no-progress", "--data", str(data_dir), "--out", str(out),
                       "--bpe-merges", merges)
    assert trained.returncode == 0, trained.stderr[-3000:]
    long = " ".join(["i am home ."] * 6) if merges == "0" else " ".join(["i am home ."] * 12)
    err = one_error_line(run_demo("translate.py", "--out", str(out), "--translate", long))
    if merges == "0":
        assert "has 24 tokens, more than the model's source length allows (16 tokens and " \
            "<eos>, block_size 17)" in err, err
    else:
        extra = load_checkpoint(out / "model.npz").extra
        pieces = len(BPE.from_json(extra["bpe"]).encode(long.split()))
        assert pieces >= 48  # at least the 48 words
        assert f"has {pieces} subword pieces, more than the model's source length allows " \
            "(31 subword pieces and <eos>, block_size 32)" in err, err
    short = run_demo("translate.py", "--out", str(out), "--translate", "i am home .")
    assert short.returncode == 0, short.stderr


# --------------------------------------------------------------------------- case 8
def _block(num_heads: int = 2):
    from tests.conftest import using_backend

    with using_backend("numpy", "float64"):
        return tiered.EncoderBlock(8, num_heads, 16, 0.0, "relu", False, None)


def _spoiled(state: dict, name: str, how: str) -> dict:
    state = {k: np.array(v, copy=True) for k, v in state.items()}
    value = state[name]
    if how == "int32":
        state[name] = np.ones(value.shape, dtype=np.int32)
    elif how == "bool":
        state[name] = np.ones(value.shape, dtype=bool)
    elif how == "complex":
        state[name] = value.astype(np.complex64)
    elif how == "nan":
        value.flat[0] = np.nan
    elif how == "inf":
        value.flat[-1] = np.inf
    return state


KINDS = [("int32", TypeError, "holds int32 values: weights must be floating point"),
         ("bool", TypeError, "holds bool values: weights must be floating point"),
         ("complex", TypeError, "holds complex64 values: weights must be floating point"),
         ("nan", ValueError, "holds 1 NaN or infinite values"),
         ("inf", ValueError, "holds 1 NaN or infinite values")]


@pytest.mark.parametrize("how, error, words", KINDS)
@pytest.mark.parametrize("loader", ["module", "torch", "safetensors", "checkpoint"])
def test_case08_every_loader_refuses_weights_of_the_wrong_kind(loader, how, error, words,
                                                               tmp_path):
    """One rule set (npformer.nn.state's weight rules) in every loader: before,
    load_safetensors took int32/bool/complex, Module.load_state_dict and
    load_torch_state_dict integers and NaN/inf, and load_checkpoint integers (cast silently)."""
    from npformer import checkpoint
    from npformer.interop.pytorch import (
        load_safetensors,
        load_torch_state_dict,
        to_torch_state_dict,
    )
    from tests.conftest import using_backend

    block = _block()
    with using_backend("numpy", "float64"):
        before = {k: np.array(v) for k, v in block.state_dict().items()}
        if loader == "module":
            load = lambda: block.load_state_dict(_spoiled(before, "ffn.linear1.weight", how))  # noqa: E731
        elif loader in ("torch", "safetensors"):
            state = _spoiled(to_torch_state_dict(block), "linear1.weight", how)
            if loader == "torch":
                load = lambda: load_torch_state_dict(block, state)  # noqa: E731
            else:
                from safetensors.numpy import save_file

                path = tmp_path / "w.safetensors"
                save_file(state, str(path))
                load = lambda: load_safetensors(block, path)  # noqa: E731
        else:
            from npformer.models import ClassifierConfig
            from tests.helpers import using_tier

            with using_tier("textbook"):  # per-tensor entries (flat files: test_checkpoint_flat)
                model = tiered.TransformerClassifier(ClassifierConfig(
                    vocab_size=5, d_model=8, num_heads=2, num_layers=1, d_ff=16, block_size=4))
                path = checkpoint.save_checkpoint(tmp_path / "c.npz", model)
            with np.load(path) as archive:
                contents = {k: archive[k] for k in archive.files}
            contents["param/head.weight"] = _spoiled(contents, "param/head.weight", how)[
                "param/head.weight"]
            np.savez(path, **contents)
            error = checkpoint.CheckpointError if error is ValueError else (
                checkpoint.CheckpointError, TypeError)
            load = lambda: checkpoint.load_checkpoint(path)  # noqa: E731
        with pytest.raises(error, match=words):
            load()
        for name, value in block.state_dict().items():  # nothing changed
            np.testing.assert_array_equal(value, before[name])


@pytest.mark.parametrize("key, value, words", [
    ("m.0", np.nan, "m.0 holds 1 NaN or infinite values"),
    ("v.1", -1.0, "v.1 holds negative values, but it is a mean of squared gradients"),
    ("v.0", np.inf, "v.0 holds 1 NaN or infinite values"),
])
def test_case08_optimizer_state_with_nan_or_negative_moments_is_refused(key, value, words):
    from tests.conftest import using_backend

    block = _block()
    with using_backend("numpy", "float64"):
        opt = tiered.Adam(block.parameters(), lr=1e-3)
        state = {k: (np.array(v, copy=True) if hasattr(v, "shape") else v)
                 for k, v in opt.state_dict().items()}
        state[key].flat[0] = value
        with pytest.raises(ValueError, match="does not fit Adam: .*" + _escaped(words)):
            opt.load_state_dict(state)


# --------------------------------------------------------------------------- case 9
def test_case09_a_torch_module_with_other_head_counts_is_refused():
    """Before: a 4-head torch layer's weights loaded into a 2-head block (same widths),
    and the outputs differed by 0.067."""
    torch = pytest.importorskip("torch")
    from npformer.interop.pytorch import load_torch_state_dict

    block = _block(num_heads=2)
    layer = torch.nn.TransformerEncoderLayer(8, 4, 16, 0.0, batch_first=True)
    with pytest.raises(ValueError, match=r"self_attn: torch 4 heads, npformer 2"):
        load_torch_state_dict(block, layer)
    same = torch.nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True)
    load_torch_state_dict(block, same)  # the module itself, with matching heads: loads
    np.testing.assert_array_equal(block.ffn.linear1.weight.data,
                                  same.linear1.weight.detach().numpy().T)


# --------------------------------------------------------------------------- case 10
def test_case10_a_temperature_so_small_the_probabilities_underflow_samples_the_argmax():
    """Before: 'Probabilities contain NaN' from NumPy; a temperature near 0 has the argmax
    as its limit, and that is what it now gives."""
    from npformer.decoding import generate
    from npformer.models import CausalLMConfig
    from tests.conftest import using_backend

    with using_backend("numpy", "float64"):
        model = tiered.CausalLM(CausalLMConfig(vocab_size=11, d_model=8, num_heads=2, num_layers=1,
                                        d_ff=16, block_size=8, dropout=0.0))
        for temperature in (1e-300, 5e-324):
            assert generate(model, [1, 2], 5, temperature=temperature) == \
                generate(model, [1, 2], 5, greedy=True)


def test_case10_torch_weights_of_the_wrong_shape_or_kind_name_the_mistake():
    torch = pytest.importorskip("torch")
    from npformer.interop.pytorch import load_torch_state_dict

    block = _block(num_heads=2)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True)
    state = layer.state_dict()
    rows = {**state, "self_attn.in_proj_weight": state["self_attn.in_proj_weight"][:20]}
    with pytest.raises(ValueError, match=r"self_attn.in_proj_weight: expected \(24, 8\), "
                                         r"got \(20, 8\)"):
        load_torch_state_dict(block, rows)
    scalar = {**state, "self_attn.in_proj_bias": torch.tensor(0.5)}
    with pytest.raises(ValueError, match=r"self_attn.in_proj_bias: expected \(24,\), got \(\)"):
        load_torch_state_dict(block, scalar)
    with pytest.raises(TypeError, match="needs a torch module or its state dict .* got list"):
        load_torch_state_dict(block, list(state.values()))
    with pytest.raises(TypeError, match="state_dict for EncoderBlock must be a dict .* got list"):
        block.load_state_dict(list(block.state_dict().values()))
    # Tensors that require grad are detached: their values load.
    load_torch_state_dict(block, layer.state_dict(keep_vars=True))
    np.testing.assert_array_equal(block.ffn.linear2.bias.data, layer.linear2.bias.detach().numpy())
    # bfloat16: converted to float32 with a warning naming it.
    halves = {k: v.to(torch.bfloat16) for k, v in state.items()}
    with pytest.warns(UserWarning, match="bfloat16 tensor .* converted to float32"):
        load_torch_state_dict(block, halves)
    np.testing.assert_array_equal(block.ffn.linear2.bias.data,
                                  halves["linear2.bias"].float().numpy())


def test_case10_a_bfloat16_safetensors_file_loads_as_float32_with_a_note(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from npformer.interop.pytorch import load_safetensors

    block = _block(num_heads=2)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True)
    halves = {k: v.to(torch.bfloat16).contiguous() for k, v in layer.state_dict().items()}
    save_file(halves, str(tmp_path / "w.safetensors"))
    with pytest.warns(UserWarning, match="holds bfloat16 tensors .* converted to float32"):
        load_safetensors(block, tmp_path / "w.safetensors")
    np.testing.assert_array_equal(block.ffn.linear1.weight.data,
                                  halves["linear1.weight"].float().numpy().T)


def test_case10_decoding_with_the_wrong_model_kind_names_it():
    from npformer.decoding import beam_search, generate, greedy_decode

    model = _classifier()
    for decode in (greedy_decode, beam_search):
        with pytest.raises(TypeError, match=rf"{decode.__name__} decodes with a 'seq2seq' "
                                            r"model \(Seq2SeqTransformer\), got a "
                                            r"'classifier' model"):
            decode(model, np.array([[3, 4]]))
    with pytest.raises(TypeError, match=r"generate decodes with a causal language model "
                                        r"\(CausalLM or LlamaCausalLM\), got a 'classifier' "
                                        r"model"):
        generate(model, [3, 4], 2)


# --------------------------------------------------------------------------- case 12
@pytest.mark.parametrize("content, looks", [(b"step,loss\n1,0.5\n", "a text file"),
                                            (b"", "an empty file"),
                                            (b"\x00\x01\x02\x03\x04\x05\x06", "a file starting")])
def test_case12_a_file_that_is_not_an_archive_says_what_it_is_not(content, looks, tmp_path):
    """Before: NumPy's hint about pickled data and allow_pickle."""
    from npformer.checkpoint import CheckpointError, load_checkpoint

    path = tmp_path / "model.npz"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=f"is not an npformer .npz checkpoint "
                                              rf"\(not a zip archive: {looks}") as caught:
        load_checkpoint(path)
    assert "pickle" not in str(caught.value)


# --------------------------------------------------------------------------- case 11
def _run_generate(argv, data_dir):
    from npformer import cli
    from tests.conftest import using_backend

    demo = load_demo("generate.py")
    with using_backend("numpy", "float32"):
        return cli.run_demo(demo.main, ["--smoke", "--replicas", "1", "--no-progress",
                                        "--data", str(data_dir), *argv])


@pytest.fixture
def stopped_run(data_dir, tmp_path):
    """A generate run stopped after 2 of 4 updates: OUT/last.npz is the run to keep."""
    from npformer import cli

    out = tmp_path / "run"
    assert _run_generate(["--max-iters", "4", "--stop-after", "2", "--out", str(out)],
                         data_dir) == 130
    yield out, (out / "last.npz").read_bytes()
    for lock in cli._held_outputs.values():
        lock.release()
    cli._held_outputs.clear()


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("failure, words", [
    (OSError(28, "No space left on device"), "could not save the checkpoint"),
    (OSError(30, "Read-only file system"), "could not save the checkpoint"),
])
def test_case11_a_full_disk_or_read_only_folder_is_one_error_line_last_npz_intact(
        failure, words, stopped_run, data_dir, monkeypatch, capsys):
    """Before: two or three chained tracebacks."""
    import numpy

    from npformer import checkpoint

    out, saved = stopped_run
    capsys.readouterr()

    def failing_savez(handle, **arrays):
        handle.write(b"PK\x03\x04 half a file")
        raise failure

    monkeypatch.setattr(checkpoint.np, "savez", failing_savez)
    status = _run_generate(["--out", str(out), "--resume"], data_dir)
    monkeypatch.setattr(checkpoint.np, "savez", numpy.savez)
    line = _one_error_line(capsys)
    assert status == 2
    assert words in line and failure.strerror in line and "unchanged" in line, line
    assert (out / "last.npz").read_bytes() == saved
    assert not list(out.glob(".last.npz.*.tmp"))


def test_case11_an_out_that_is_a_file_is_one_error_line(data_dir, tmp_path, capsys):
    out = tmp_path / "a-file"
    out.write_text("not a folder")
    assert _run_generate(["--out", str(out)], data_dir) == 2
    assert f"--out {out} is a file, not a folder" in _one_error_line(capsys)
    out2 = out / "below"  # a folder below a file cannot be created
    assert _run_generate(["--out", str(out2)], data_dir) == 2
    assert f"cannot create the --out folder {out2}: Not a directory" in _one_error_line(capsys)


def test_case11_a_read_only_out_folder_is_one_error_line(stopped_run, data_dir, monkeypatch,
                                                         capsys):
    """The tests run as root, whom permissions do not stop: the refusal is simulated."""
    from npformer import cli

    out, saved = stopped_run
    for lock in cli._held_outputs.values():
        lock.release()
    cli._held_outputs.clear()
    capsys.readouterr()
    real_write_text = Path.write_text

    def read_only(self, *args, **kwargs):
        if self.parent == out:
            raise OSError(30, "Read-only file system", str(self))
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", read_only)
    assert _run_generate(["--out", str(out), "--resume"], data_dir) == 2
    assert f"cannot write into the --out folder {out}: Read-only file system" in \
        _one_error_line(capsys)
    assert (out / "last.npz").read_bytes() == saved


def test_case11_ranks_started_with_different_data_is_one_error_line(capsys):
    from npformer import cli
    from npformer.parallel import RanksDiffer

    def main(argv):
        raise RanksDiffer("the ranks were not started alike, refusing to train: data differs")

    assert cli.run_demo(main, []) == 2
    assert _one_error_line(capsys) == ("error: the ranks were not started alike, refusing to "
                                       "train: data differs")
