"""The three demos, run as a user runs them.

* every demo's --smoke runs the whole real pipeline (data -> train -> evaluate ->
  checkpoint -> plots) in both engines, with readable output in a pipe;
* an interrupted smoke run resumed with --resume ends with exactly the metrics and
  weights of an uninterrupted one;
* every invalid option value is refused by the parser naming the option (status 2,
  no traceback), options given with --smoke win over the preset, and the errors a
  user can cause at run time are one ``error:`` line.

Data: the real datasets when present (conftest's SHARED_DATA), otherwise small synthetic
archives in the canonical layouts, built here.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from npformer.checkpoint import load_checkpoint
from tests.conftest import GPU, SHARED_DATA
from tests.test_data import make_fra_zip, make_imdb_tar

ROOT = Path(__file__).resolve().parents[1]
DEMOS = ROOT / "demos"
WORDS_POS = "great superb wonderful moving brilliant".split()
WORDS_NEG = "awful boring terrible dull worst".split()
FILLER = "the film a was of and it plot actor scene".split()


def synthetic_data(folder: Path) -> Path:
    """Canonical-layout stand-ins: enough rows for every smoke run."""
    rng = np.random.default_rng(0)

    def review(words):
        return " ".join(rng.choice(FILLER + words, size=int(rng.integers(8, 40))))

    reviews = {(split, label): [(i, 8 if label == "pos" else 2,
                                 review(WORDS_POS if label == "pos" else WORDS_NEG))
                                for i in range(200)]
               for split in ("train", "test") for label in ("pos", "neg")}
    make_imdb_tar(folder / "aclImdb_v1.tar.gz", reviews)
    english = "i you he she we they see eat like have want the a cat dog house car".split()
    french = ("je tu il elle nous ils vois mange aime ai veux le la chat chien maison "
              "voiture").split()
    lines = []
    for _ in range(4000):
        idx = rng.integers(0, len(english), size=int(rng.integers(2, 7)))
        lines.append(" ".join(english[i] for i in idx).capitalize() + ".\t"
                     + " ".join(french[i] for i in idx).capitalize() + ".")
    make_fra_zip(folder / "fra-eng.zip", lines)
    (folder / "tinyshakespeare").mkdir()
    text = "\n".join("ROMEO: " + " ".join(rng.choice(FILLER, size=8)) for _ in range(2000))
    (folder / "tinyshakespeare" / "input.txt").write_text(text)
    return folder


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    if SHARED_DATA.is_dir():
        return SHARED_DATA
    return synthetic_data(tmp_path_factory.mktemp("data"))


def run_demo(script: str, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, str(DEMOS / script), *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)


@functools.cache
def load_demo(script: str):
    """The demo script as a module (its main and build_parser, without running it)."""
    name = f"npformer_demo_{Path(script).stem}"
    spec = importlib.util.spec_from_file_location(name, DEMOS / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


SCRIPTS = ["imdb.py", "translate.py", "generate.py"]
OUTPUTS = {"imdb.py": ["model.npz", "curves.png", "attention.png"],
           "translate.py": ["model.npz", "curves.png", "cross_attention.png"],
           "generate.py": ["model.npz", "curves.png", "sample.txt"]}
METRIC = {"imdb.py": "test_accuracy", "translate.py": "bleu_greedy", "generate.py": "val_loss"}
# Two replicas whatever the machine: the runs below must repeat exactly.
SMOKE = ("--smoke", "--replicas", "2")
# Mid-epoch and between evaluations (smoke: imdb 16 updates, 8 a half-epoch; translate
# 30, evaluating every 7, ~90 a epoch; generate 20, evaluating every 10).
STOP_AFTER = {"imdb.py": 5, "translate.py": 10, "generate.py": 7}


def smoke_run(script: str, out: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    result = run_demo(script, *SMOKE, "--data", str(data), "--out", str(out), *extra)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def fast_smoke_runs(data_dir, tmp_path_factory) -> dict:
    """One uninterrupted smoke run per demo in the default tier (progress on, stdout a
    pipe): {script: (output folder, completed process)}."""
    runs = {}
    for script in SCRIPTS:
        out = tmp_path_factory.mktemp(Path(script).stem)
        runs[script] = out, smoke_run(script, out, data_dir)
    return runs


def check_smoke_outputs(script: str, out: Path, result, tier: str) -> None:
    for name in OUTPUTS[script] + ["metrics.json", "last.npz"]:
        assert (out / name).is_file(), f"{script} did not write {name}"
    metrics = json.loads((out / "metrics.json").read_text())
    assert np.isfinite(metrics[METRIC[script]])
    assert metrics["tier"] == tier
    # Not a terminal: no bar redrawn with carriage returns, whole progress lines only.
    assert "\r" not in result.stdout + result.stderr
    assert re.search(r"^\S+: update \d+/\d+, loss ", result.stdout, re.MULTILINE)


@pytest.mark.parametrize("script", SCRIPTS)
def test_demo_smoke_runs_end_to_end_fast_tier(script, fast_smoke_runs):
    out, result = fast_smoke_runs[script]
    check_smoke_outputs(script, out, result, "fast")


# Runs a demo as its command line does (the script, then its options: re-launching itself
# as MPI ranks where it would) and writes, when it ends, the names of every module it
# imported to the file $NPFORMER_TEST_MODULES (JSON).
RECORDING_MODULES = """
import json, os, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    with open(os.environ["NPFORMER_TEST_MODULES"], "w") as modules:
        json.dump(sorted(sys.modules), modules)
"""
# What a run of the textbook tier never loads: a compiler, the fast tier, MPI.
NOT_TEXTBOOK = ("numba", "npformer.fast", "mpi4py")


def run_recording_modules(script: str, *args: str, modules: Path,
                          env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """``script`` run with ``args`` as :func:`run_demo` runs it, its modules' names written
    to ``modules``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NPFORMER_TEST_MODULES": str(modules),
           **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", RECORDING_MODULES, str(DEMOS / script),
                           *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)


def check_the_textbook_run(out: Path, modules: Path) -> None:
    """A run of --tier textbook without --procs or --replicas: one process, one replica,
    and no numba, no npformer.fast (nor any of its modules), no mpi4py imported."""
    loaded = [name for name in json.loads(modules.read_text())
              if any(name == top or name.startswith(top + ".") for top in NOT_TEXTBOOK)]
    assert loaded == [], loaded
    assert json.loads((out / "metrics.json").read_text())["machine"].endswith(
        "1 process, 1 replica")


@pytest.mark.parametrize("script", SCRIPTS)
def test_demo_smoke_runs_end_to_end_textbook_tier(script, data_dir, tmp_path):
    """The textbook tier's run, as a user starts it: one process, one thread, plain NumPy."""
    out, modules = tmp_path / "run", tmp_path / "modules.json"
    result = run_recording_modules(script, "--smoke", "--tier", "textbook", "--data",
                                   str(data_dir), "--out", str(out), modules=modules)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_smoke_outputs(script, out, result, "textbook")
    check_the_textbook_run(out, modules)


# =========================================================================== --resume
def same_results(script: str, straight: Path, resumed: Path) -> None:
    """Every metric but the timings, and every weight of both checkpoints, exactly."""
    timing = ("minutes", "seconds", "ms_per")
    a, b = (json.loads((out / "metrics.json").read_text()) for out in (straight, resumed))
    assert {k: v for k, v in a.items() if not any(t in k for t in timing)} == \
        {k: v for k, v in b.items() if not any(t in k for t in timing)}
    names = sorted(p.name for p in straight.glob("*.npz"))  # an ensemble's members too
    assert names == sorted(p.name for p in resumed.glob("*.npz"))
    for name in names:
        with np.load(straight / name) as x, np.load(resumed / name) as y:
            assert x.files == y.files
            for key in x.files:
                if key != "meta":
                    np.testing.assert_array_equal(x[key], y[key], err_msg=f"{name}: {key}")
    if script == "generate.py":
        assert (straight / "sample.txt").read_text() == (resumed / "sample.txt").read_text()


@pytest.mark.parametrize("script", SCRIPTS)
def test_interrupted_run_resumes_to_the_same_figures(script, fast_smoke_runs, data_dir,
                                                     tmp_path):
    stopped = run_demo(script, *SMOKE, "--no-progress", "--data", str(data_dir),
                       "--out", str(tmp_path), "--stop-after", str(STOP_AFTER[script]))
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert f"after update {STOP_AFTER[script]}" in stopped.stderr
    assert "--resume" in stopped.stderr and "Traceback" not in stopped.stderr
    assert not (tmp_path / "metrics.json").exists()
    # A new run into the folder would lose the interrupted one: refused.
    fresh = run_demo(script, *SMOKE, "--data", str(data_dir), "--out", str(tmp_path))
    assert fresh.returncode == 2 and "--resume" in fresh.stderr
    # The saved settings come back: --resume alone is enough.
    resumed = run_demo(script, "--resume", "--no-progress", "--data", str(data_dir),
                       "--out", str(tmp_path))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    same_results(script, fast_smoke_runs[script][0], tmp_path)


def test_imdb_ensemble_interrupted_in_its_second_member_resumes_to_the_same_figures(
        fast_smoke_runs, data_dir, tmp_path):
    """--stop-after counts every member's updates: 20 stops the smoke ensemble (2 members
    of 16 updates) in its second member, after the first has finished."""
    stopped = run_demo("imdb.py", *SMOKE, "--no-progress", "--data", str(data_dir),
                       "--out", str(tmp_path), "--stop-after", "20")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "last-2.npz" in stopped.stderr and "--resume" in stopped.stderr
    # The unfinished second member is guarded like the first one's last.npz.
    fresh = run_demo("imdb.py", *SMOKE, "--data", str(data_dir), "--out", str(tmp_path))
    assert fresh.returncode == 2 and "last-2.npz" in fresh.stderr and "--resume" in fresh.stderr
    resumed = run_demo("imdb.py", "--resume", "--no-progress", "--data", str(data_dir),
                       "--out", str(tmp_path))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    same_results("imdb.py", fast_smoke_runs["imdb.py"][0], tmp_path)


def test_imdb_ensemble_averages_the_members_probabilities():
    imdb = load_demo("imdb.py")
    rng = np.random.default_rng(0)
    probs = [rng.dirichlet(np.ones(2), size=5) for _ in range(3)]  # 3 members, (5, 2)
    expected = np.log(sum(probs) / 3)
    np.testing.assert_allclose(imdb.ensemble([np.log(p) for p in probs]), expected, rtol=1e-12)
    labels = np.array([0, 1, 1, 0, 1])
    got = imdb.scores(expected, labels)
    assert got["accuracy"] == np.mean(np.argmax(expected, axis=-1) == labels)
    assert np.isclose(got["loss"], -np.mean(expected[np.arange(5), labels]))


def test_resume_refuses_other_settings_naming_the_option(fast_smoke_runs):
    out = fast_smoke_runs["generate.py"][0]
    for args, option in [(["--num-heads", "4"], "--num-heads"), (["--seed", "3"], "--seed"),
                         (["--preset", "default"], "--preset")]:
        result = run_demo("generate.py", "--resume", "--out", str(out), *args)
        assert result.returncode == 2 and option in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_resume_without_a_saved_run_is_one_clear_error(tmp_path):
    result = run_demo("imdb.py", "--resume", "--out", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: no checkpoint at") and "last.npz" in result.stderr


# =========================================================================== using a checkpoint
def test_imdb_predict_uses_the_saved_checkpoint_and_rejects_empty_text(fast_smoke_runs):
    out = fast_smoke_runs["imdb.py"][0]
    ok = run_demo("imdb.py", "--out", str(out), "--predict", "A wonderful, moving film.")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split()[0] in ("positive", "negative")
    empty = run_demo("imdb.py", "--out", str(out), "--predict", "  ")
    assert empty.returncode == 2 and "empty" in empty.stderr


def test_checkpoint_from_another_demo_is_refused(fast_smoke_runs, data_dir):
    out = fast_smoke_runs["generate.py"][0]
    wrong = run_demo("imdb.py", "--out", str(out), "--predict", "good film")
    assert wrong.returncode == 2
    assert "not saved by the IMDB demo" in wrong.stderr
    wrong = run_demo("translate.py", "--out", str(out), "--translate", "go .")
    assert wrong.returncode == 2 and "translation demo" in wrong.stderr
    # ... and a new run never overwrites another demo's checkpoint
    wrong = run_demo("imdb.py", *SMOKE, "--data", str(data_dir), "--out", str(out))
    assert wrong.returncode == 2 and "not saved by the IMDB demo" in wrong.stderr
    assert "--out" in wrong.stderr


# =========================================================================== the command line
def test_smoke_keeps_the_options_the_user_gave(data_dir, tmp_path):
    """`--smoke --heads 4 --width 16` trains a width-16, 4-head model (the options win)."""
    smoke_run("generate.py", tmp_path, data_dir, "--num-heads", "4", "--d-model", "16",
              "--max-iters", "2", "--no-progress")
    config = load_checkpoint(tmp_path / "model.npz").config
    assert (config["num_heads"], config["d_model"]) == (4, 16)
    assert json.loads((tmp_path / "metrics.json").read_text())["updates"] == 2


def test_shakespeare_trains_and_samples_with_llama_blocks(data_dir, tmp_path):
    """`--arch llama`: the run trains a LlamaCausalLM (RMS norms, gated SiLU, rotary, two
    key/value heads), its checkpoint names the kind, and --sample-only builds it again.
    Llama's blocks have no dropout: --dropout with them is refused."""
    smoke_run("generate.py", tmp_path, data_dir, "--arch", "llama", "--max-iters", "2",
              "--no-progress")
    checkpoint = load_checkpoint(tmp_path / "model.npz")
    assert checkpoint.kind == "llama"
    assert (checkpoint.config["num_heads"],
            checkpoint.config["num_kv_heads"]) == (2, 2)
    sampled = run_demo("generate.py", "--sample-only", "--out", str(tmp_path), "--length", "5")
    assert sampled.returncode == 0, sampled.stderr
    refused = run_demo("generate.py", "--smoke", "--arch", "llama", "--dropout", "0.1",
                       "--data", str(data_dir), "--out", str(tmp_path / "other"))
    assert refused.returncode != 0 and "--arch llama has no dropout" in refused.stderr


def test_translation_ties_its_output_layer_when_asked(data_dir, tmp_path):
    """`--tie-weights yes`: the French table is the output layer (no lm_head is saved),
    and the saved model translates."""
    smoke_run("translate.py", tmp_path, data_dir, "--tie-weights", "yes", "--max-iters", "2",
              "--no-progress")
    checkpoint = load_checkpoint(tmp_path / "model.npz")
    assert checkpoint.config["tie_weights"] is True
    assert not any(name.startswith("lm_head") for name in checkpoint.params)
    translated = run_demo("translate.py", "--out", str(tmp_path), "--translate", "go .")
    assert translated.returncode == 0, translated.stderr


def test_translation_reads_subword_pieces_when_asked(data_dir, tmp_path):
    """`--bpe-merges N`: both vocabularies hold pieces of N learned merges, the checkpoint
    keeps the merges, and the saved model translates with them."""
    smoke_run("translate.py", tmp_path, data_dir, "--bpe-merges", "300", "--max-iters", "2",
              "--no-progress")
    checkpoint = load_checkpoint(tmp_path / "model.npz")
    demo = load_demo("translate.py")
    bpe = demo.BPE.from_json(checkpoint.extra["bpe"])
    assert 0 < len(bpe) <= 300  # fewer where no pair is left twice (small test data)
    train, _, _ = demo.split_pairs(demo.PRESETS["smoke"], data_dir, 0)  # the run's seed 0
    assert bpe == demo.BPE.learn([e for e, _ in train] + [f for _, f in train], 300)
    french = demo.Vocab.from_json(checkpoint.extra["tgt_vocab"])
    assert french == demo.Vocab.build([bpe.encode(f) for _, f in train], bos=True, eos=True)
    assert checkpoint.config["block_size"] == 2 * demo.PRESETS["smoke"].max_tokens + 2
    translated = run_demo("translate.py", "--out", str(tmp_path), "--translate", "go .")
    assert translated.returncode == 0, translated.stderr


def test_a_checkpoint_whose_saved_bpe_is_damaged_is_one_error_line(data_dir, tmp_path):
    """issue 47 case 9: --translate with a model whose saved BPE is damaged JSON ended in
    a JSONDecodeError traceback; it is one error line naming the checkpoint's BPE."""
    smoke_run("translate.py", tmp_path, data_dir, "--bpe-merges", "50", "--max-iters", "1",
              "--no-progress")
    path = tmp_path / "model.npz"
    with np.load(path) as archive:
        arrays = dict(archive)
    meta = json.loads(str(arrays["meta"]))
    meta["extra"]["bpe"] = meta["extra"]["bpe"][:40]  # cut short: no longer JSON
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(path, **arrays)
    err = one_error_line(run_demo("translate.py", "--out", str(tmp_path), "--translate",
                                  "go ."))
    assert "model.npz's BPE is not a serialised BPE: it is not valid JSON" in err, err


def test_translation_with_few_merges_makes_room_for_its_longest_sentence(data_dir, tmp_path):
    """One merge spells 4 words in more than 8 pieces: the model's length follows the
    longest sentence of the run (before: a training batch too long for the positional
    table, a traceback from inside the model)."""
    smoke_run("translate.py", tmp_path, data_dir, "--bpe-merges", "1", "--max-tokens", "4",
              "--max-iters", "1", "--no-progress")
    checkpoint = load_checkpoint(tmp_path / "model.npz")
    demo = load_demo("translate.py")
    preset = replace(demo.PRESETS["smoke"], bpe_merges=1, max_tokens=4)
    train, validation, heldout = demo.split_pairs(preset, data_dir, 0)
    bpe, src_vocab, tgt_vocab = demo.build_vocabs(train, preset)
    src, tgt = demo.encode_pairs(train + demo.as_pairs(validation), src_vocab, tgt_vocab, bpe)
    longest = max(max(map(len, src + tgt)) - 1,
                  max(len(bpe.encode(english.split())) for english in heldout))
    assert longest > 2 * preset.max_tokens
    assert checkpoint.config["block_size"] == longest + 2


@pytest.mark.parametrize("merges", [0, 400])
def test_translation_pieces_join_back_into_the_words(merges, data_dir):
    """Encoded with the demo's vocabularies and decoded again, every training pair comes
    back word for word (with pieces: no word is lost to <unk>)."""
    demo = load_demo("translate.py")
    preset = replace(demo.PRESETS["smoke"], bpe_merges=merges)
    train, _, _ = demo.split_pairs(preset, data_dir, 0)
    bpe, src_vocab, tgt_vocab = demo.build_vocabs(train, preset)
    assert (bpe is None) == (merges == 0)
    src, tgt = demo.encode_pairs(train, src_vocab, tgt_vocab, bpe)
    for (english, french), source, target in zip(train, src, tgt):
        assert source[-1] == src_vocab.eos_id and target[-1] == tgt_vocab.eos_id
        words = demo.words_of(tgt_vocab.decode(target[:-1]), bpe)
        if bpe is None:  # rare words are <unk>
            assert len(words) == len(french)
        else:
            assert words == french
            assert demo.words_of(src_vocab.decode(source[:-1]), bpe) == english


COMMON_BAD = [("--replicas", "0"), ("--replicas", "-2"), ("--seed", "-1"),
              ("--stop-after", "0"), ("--dropout", "1"), ("--dropout", "-0.1"),
              ("--dropout", "nan"), ("--lr", "0"), ("--lr", "-1e-3"), ("--lr", "inf"),
              ("--batch-size", "0"), ("--num-heads", "0"), ("--num-layers", "-1"),
              ("--backend", "tpu"), ("--tier", "slow"), ("--dtype", "float16"),
              ("--preset", "huge"), ("--seed", "x")]
DEMO_BAD = {
    "imdb.py": [("--epochs", "0"), ("--epochs", "-1"), ("--max-minutes", "0"),
                ("--max-minutes", "-5"), ("--d-model", "0"), ("--block-size", "0"),
                ("--head-tokens", "-1"), ("--vocab-size", "0"), ("--weight-decay", "-1"),
                ("--warmup", "0"), ("--pooling", "sum"), ("--validation", "0"),
                ("--train-reviews", "0"), ("--test-reviews", "-3"), ("--members", "0"),
                ("--members", "-2")],
    "translate.py": [("--max-iters", "0"), ("--max-minutes", "0"), ("--max-minutes", "-1"),
                     ("--beam-size", "0"), ("--max-tokens", "0"), ("--heldout", "0"),
                     ("--validation", "0"), ("--target-min-count", "0"),
                     ("--max-pairs", "0"), ("--warmup", "-5"), ("--d-ff", "0"),
                     ("--tie-weights", "maybe"), ("--bpe-merges", "-1"),
                     ("--bpe-merges", "1.5")],
    "generate.py": [("--max-iters", "0"), ("--block-size", "0"), ("--length", "-1"),
                    ("--eval-every", "0"), ("--eval-batches", "0"), ("--temperature", "0"),
                    ("--temperature", "-1"), ("--top-k", "0"), ("--d-model", "0"),
                    ("--arch", "gpt3"), ("--kv-heads", "0")],
}
BAD_VALUES = [(script, option, value) for script in SCRIPTS
              for option, value in COMMON_BAD + DEMO_BAD[script]]
# Values each valid alone, refused together (the error names both options).
BAD_COMBINATIONS = [
    ("imdb.py", ["--smoke", "--preset", "large"], ["--smoke", "--preset"]),
    ("imdb.py", ["--d-model", "30", "--num-heads", "4"], ["--d-model", "--num-heads"]),
    ("imdb.py", ["--block-size", "50", "--head-tokens", "60"], ["--block-size", "--head-tokens"]),
    ("translate.py", ["--smoke", "--d-model", "31"], ["--d-model", "--num-heads"]),
    ("generate.py", ["--smoke", "--num-heads", "3", "--d-model", "16"],
     ["--d-model", "--num-heads"]),
    ("generate.py", ["--sample-only", "--resume"], ["--resume", "--sample-only"]),
    ("generate.py", ["--smoke", "--arch", "llama", "--kv-heads", "3"],
     ["--num-heads", "--kv-heads"]),
    ("generate.py", ["--smoke", "--kv-heads", "1"], ["--kv-heads", "--arch llama"]),
]


def parse_error(script: str, argv: list[str], capsys) -> str:
    """Run the demo's main(argv) in this process; it must exit with status 2 before it
    touches any data; returns its stderr."""
    with pytest.raises(SystemExit) as exit_info:
        load_demo(script).main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("script, option, value", BAD_VALUES)
def test_invalid_option_value_is_refused_naming_the_option(script, option, value, capsys,
                                                           tmp_path):
    err = parse_error(script, [f"{option}={value}", "--out", str(tmp_path)], capsys)
    assert f"argument {option}: " in err and repr(value) in err, err


@pytest.mark.parametrize("script, argv, options", BAD_COMBINATIONS)
def test_invalid_combination_is_refused_naming_the_options(script, argv, options, capsys,
                                                           tmp_path):
    err = parse_error(script, argv + ["--out", str(tmp_path)], capsys)
    for option in options:
        assert option in err, err


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_has_a_help_text(script):
    parser = load_demo(script).build_parser()
    for action in parser._actions:
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"
    result = run_demo(script, "--help")
    assert result.returncode == 0
    for option in ("--seed", "--backend", "--dtype", "--tier", "--replicas", "--smoke",
                   "--preset", "--resume", "--data"):
        assert option in result.stdout


# =========================================================================== run-time errors
def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith("error: "), result.stderr
    return result.stderr


def test_missing_data_without_network_gives_one_clear_message(tmp_path):
    env = {"NPFORMER_DATA": "", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           # no network: any download fails at once
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}
    result = run_demo("generate.py", "--smoke", "--out", str(tmp_path), env_extra=env)
    assert result.returncode == 2
    err = one_error_line(result)
    assert "input.txt" in err and "https://" in err
    assert "NPFORMER_DATA" in err


def test_explicit_data_folder_without_the_file_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"NPFORMER_DATA": "", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}
    result = run_demo("imdb.py", "--smoke", "--data", str(empty), "--out",
                      str(tmp_path / "out"), env_extra=env)
    err = one_error_line(result)
    assert str(empty) in err and "aclImdb_v1.tar.gz" in err


def test_corrupt_archive_gives_a_clear_error(tmp_path):
    archive = tmp_path / "aclImdb_v1.tar.gz"
    archive.write_bytes(b"\x1f\x8b\x08 definitely not a tarball")
    result = run_demo("imdb.py", "--smoke", "--data", str(archive), "--out", str(tmp_path))
    assert result.returncode == 2
    assert "aclImdb_v1.tar.gz" in one_error_line(result)


@pytest.mark.parametrize("script, args, env, words", [
    ("imdb.py", ["--out", "{tmp}", "--predict", "good"], {}, ["no checkpoint", "model.npz"]),
    ("translate.py", ["--out", "{tmp}", "--translate", "go ."], {}, ["no checkpoint"]),
    ("generate.py", ["--out", "{tmp}", "--sample-only"], {}, ["no checkpoint"]),
    ("generate.py", ["--smoke", "--out", "{tmp}"], {"NPFORMER_BACKEND": "gpu"},
     ["unknown backend", "gpu"]),
    ("generate.py", ["--smoke", "--block-size", "100000000", "--data", "{data}", "--out", "{tmp}"],
     {}, ["too short", "--block-size"]),
    ("translate.py", ["--smoke", "--heldout", "100000000", "--data", "{data}", "--out",
                      "{tmp}"], {}, ["--heldout"]),
    ("translate.py", ["--smoke", "--validation", "100000000", "--data", "{data}", "--out",
                      "{tmp}"], {}, ["--validation"]),
    ("imdb.py", ["--smoke", "--validation", "100000000", "--data", "{data}", "--out",
                 "{tmp}"], {}, ["--validation"]),
])
def test_user_errors_are_one_line(script, args, env, words, data_dir, tmp_path):
    args = [a.format(tmp=tmp_path, data=data_dir) for a in args]
    err = one_error_line(run_demo(script, *args, env_extra=env))
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("seed", [0, 1])
def test_translation_chooses_its_model_without_reading_the_test_set(seed, data_dir):
    """Training, validation (which selects the checkpoint) and the BLEU test set hold
    disjoint English sentences, each source with all its translations, every pair used once."""
    demo = load_demo("translate.py")
    preset = demo.PRESETS["smoke"]
    train, validation, test = demo.split_pairs(preset, data_dir, seed)
    trained = {" ".join(english) for english, _ in train}
    assert trained.isdisjoint(validation) and trained.isdisjoint(test)
    assert set(validation).isdisjoint(test)
    assert (len(validation), len(test)) == (preset.validation, preset.heldout)
    everything = demo.load_fra_eng(data_dir, max_len=preset.max_tokens)[:preset.max_pairs]
    held = sum(len(translations) for part in (validation, test) for translations in part.values())
    assert len(train) + held == len(everything)
    assert len(demo.as_pairs(validation)) == sum(map(len, validation.values()))


@pytest.mark.parametrize("script", SCRIPTS)
def test_backend_cupy(script, data_dir, tmp_path):
    """``--backend cupy``: on a GPU the smoke run trains, evaluates and saves; without
    one it is a one-line error naming CuPy."""
    result = run_demo(script, "--smoke", "--backend", "cupy", "--data", str(data_dir),
                      "--out", str(tmp_path))
    if not GPU:
        assert "cupy" in one_error_line(result).lower()
        return
    assert result.returncode == 0, result.stderr[-3000:]
    for name in OUTPUTS[script]:
        assert (tmp_path / name).is_file(), name


# =========================================================================== under mpiexec
@pytest.mark.mpi
@pytest.mark.parametrize("script", SCRIPTS)
def test_demo_under_mpiexec_equals_one_process(script, data_dir, fast_smoke_runs, tmp_path):
    """`mpiexec -n 2 python demos/X.py` with no other flag (one thread per rank) gives the
    figures of one process with two thread replicas (the same shards, the same dropout
    streams; float32 sums in another order), prints once, and writes its files once."""
    from tests.test_distributed import mpiexec

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1"}
    for name in ("NPFORMER_MPI", "PMI_SIZE", "PMI_RANK"):
        env.pop(name, None)
    result = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(DEMOS / script),
                             "--smoke", "--replicas", "1", "--data", str(data_dir),
                             "--out", str(tmp_path), "--no-progress"],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ours = json.loads((tmp_path / "metrics.json").read_text())
    single_out, _ = fast_smoke_runs[script]
    single = json.loads((single_out / "metrics.json").read_text())
    assert ours["updates"] == single["updates"]
    assert ours[METRIC[script]] == pytest.approx(single[METRIC[script]], rel=1e-4, abs=1e-6)
    assert result.stdout.count("wrote") <= 1 and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_cuda_graph_option_off_a_gpu_says_why_and_trains_eagerly(data_dir, tmp_path):
    """--cuda-graph asks the Trainer for CUDA graphs (NPFORMER_CUDA_GRAPH=1); on NumPy it
    says in one line why there are none, and the run trains as without the option."""
    result = smoke_run("generate.py", tmp_path, data_dir, "--cuda-graph")
    assert ("CUDA graph: off (CUDA graphs need the cupy backend (this run is on numpy)); "
            "training eagerly") in result.stdout
    check_smoke_outputs("generate.py", tmp_path, result, "fast")


def test_a_cuda_graph_switch_that_is_not_a_boolean_is_one_line(data_dir, tmp_path):
    result = run_demo("generate.py", *SMOKE, "--data", str(data_dir), "--out", str(tmp_path),
                      env_extra={"NPFORMER_CUDA_GRAPH": "maybe"})
    assert "NPFORMER_CUDA_GRAPH='maybe' is not a boolean" in one_error_line(result)


def test_translation_pairs_all_longer_than_max_tokens_name_it(tmp_path):
    """issue 47 case 10: every pair of --data longer than --max-tokens: the error named
    --heldout and --validation only, never --max-tokens, the option to change."""
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"we see the {i} red cars today .\tnous voyons les {i} "
                             f"voitures rouges .\n" for i in range(60)))
    err = one_error_line(run_demo("translate.py", "--smoke", "--procs", "1", "--data",
                                  str(pairs), "--max-tokens", "4", "--out", str(tmp_path / "o")))
    assert "--max-tokens 4" in err and "60 of its 60 pairs are longer" in err, err
    assert "raise --max-tokens" in err, err


def test_curves_draw_each_quantity_on_its_own_axis(tmp_path, monkeypatch):
    """issue 47 case 24: curves.png drew accuracy and loss on one axis, and a short run's
    validation loss was one dot alone.  Now one axis per quantity, the loss's holding the
    training loss of every update beside the evaluations."""
    import matplotlib
    from matplotlib.figure import Figure

    from npformer.cli.plots import curve_panels, plot_curves
    from npformer.train import History

    matplotlib.use("Agg")
    assert curve_panels(["val_accuracy", "val_loss"]) == [("loss", ["val_loss"]),
                                                          ("accuracy", ["val_accuracy"])]
    assert curve_panels(["train_loss", "val_loss"]) == [("loss", ["train_loss", "val_loss"])]
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, *a, **k: drawn.append(figure))
    history = History(updates=list(range(1, 9)), losses=[2.0 - 0.1 * i for i in range(8)],
                      evals=[{"update": 8, "val_loss": 1.5, "val_accuracy": 0.75}])
    plot_curves(tmp_path / "curves.png", history, ["val_accuracy", "val_loss"], "run")
    (figure,) = drawn
    assert [ax.get_ylabel() for ax in figure.axes] == ["loss", "accuracy"]
    loss, accuracy = ([line.get_label() for line in ax.get_lines()] for ax in figure.axes)
    assert loss == ["training loss per update", "val_loss (1 evaluations)"]
    assert accuracy == ["val_accuracy (1 evaluations)"]


def test_translation_says_how_each_text_was_decoded(fast_smoke_runs, monkeypatch):
    """issue 47 case 24: cross_attention.png is decoded greedily while the printed probes
    are beam 4, and neither said so: each now names its decoding."""
    out, result = fast_smoke_runs["translate.py"]
    assert "probes, decoded by beam search (beam 4):" in result.stdout
    demo = load_demo("translate.py")
    titles = []
    monkeypatch.setattr(demo, "plot_attention", lambda *args: titles.append(args[-1]))
    model, src_vocab, tgt_vocab, bpe = demo.load_for_translation(out / "model.npz")
    demo.draw_cross_attention(model, src_vocab, tgt_vocab, bpe, "go .", out / "x.png")
    assert titles == ["cross-attention, last decoder layer, decoded by greedy search: go ."]


@pytest.mark.parametrize("d_model, num_heads, fragment", [(6, 2, "must be even"),
                                                          (4, 4, "must be at least 2")])
def test_llama_heads_of_an_odd_width_are_refused_naming_the_options(
        d_model, num_heads, fragment, capsys, tmp_path):
    """sweep 5: generate.py --arch llama with --d-model / --num-heads odd (or 1) built the
    model after loading the data and died in LlamaConfig's traceback (under MPI: an
    MPI_Abort per rank); the options are refused before anything runs."""
    err = parse_error("generate.py", ["--smoke", "--arch", "llama", "--kv-heads", "1",
                                      "--d-model", str(d_model), "--num-heads",
                                      str(num_heads), "--out", str(tmp_path)], capsys)
    assert f"--d-model {d_model} / --num-heads {num_heads} {fragment}" in err, err
