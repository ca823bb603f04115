"""Every demo's --smoke mode runs the whole real pipeline (data -> train -> evaluate ->
checkpoint -> plots), and the demos' error paths give one clear message.

Data: ../shared/data when present (the real datasets), otherwise small synthetic
archives in the canonical layouts, built here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SHARED_DATA
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
    french = "je tu il elle nous ils vois mange aime ai veux le la chat chien maison voiture".split()
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


@pytest.mark.parametrize("script, outputs, metric", [
    ("imdb.py", ["model.npz", "curves.png", "attention.png"], "test_accuracy"),
    ("translate.py", ["model.npz", "curves.png", "cross_attention.png"], "bleu_greedy"),
    ("generate.py", ["model.npz", "curves.png", "sample.txt"], "val_loss"),
])
def test_demo_smoke_runs_end_to_end(script, outputs, metric, data_dir, tmp_path):
    result = run_demo(script, "--smoke", "--no-progress", "--data", str(data_dir),
                      "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name in outputs + ["metrics.json"]:
        assert (tmp_path / name).is_file(), f"{script} did not write {name}"
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert np.isfinite(metrics[metric])


def test_imdb_predict_uses_the_saved_checkpoint_and_rejects_empty_text(data_dir, tmp_path):
    assert run_demo("imdb.py", "--smoke", "--no-progress", "--data", str(data_dir),
                    "--out", str(tmp_path)).returncode == 0
    ok = run_demo("imdb.py", "--out", str(tmp_path), "--predict", "A wonderful, moving film.")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split()[0] in ("positive", "negative")
    empty = run_demo("imdb.py", "--out", str(tmp_path), "--predict", "  ")
    assert empty.returncode == 2 and "empty" in empty.stderr


def test_checkpoint_from_another_demo_is_refused(data_dir, tmp_path):
    assert run_demo("generate.py", "--smoke", "--no-progress", "--data", str(data_dir),
                    "--out", str(tmp_path)).returncode == 0
    wrong = run_demo("imdb.py", "--out", str(tmp_path), "--predict", "good film")
    assert wrong.returncode == 2
    assert "not saved by the IMDB demo" in wrong.stderr
    wrong = run_demo("translate.py", "--out", str(tmp_path), "--translate", "go .")
    assert wrong.returncode == 2 and "translation demo" in wrong.stderr


def test_missing_data_without_network_gives_one_clear_message(tmp_path):
    env = {"NPFORMER_DATA": "", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           # no network: any download fails at once
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}
    result = run_demo("generate.py", "--smoke", "--out", str(tmp_path), env_extra=env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "input.txt" in result.stderr and "https://" in result.stderr
    assert "NPFORMER_DATA" in result.stderr


def test_corrupt_archive_gives_a_clear_error(tmp_path):
    archive = tmp_path / "aclImdb_v1.tar.gz"
    archive.write_bytes(b"\x1f\x8b\x08 definitely not a tarball")
    result = run_demo("imdb.py", "--smoke", "--data", str(archive), "--out", str(tmp_path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "aclImdb_v1.tar.gz" in result.stderr


@pytest.mark.parametrize("script", ["imdb.py", "translate.py", "generate.py"])
def test_demo_help(script):
    result = run_demo(script, "--help")
    assert result.returncode == 0
    for option in ("--seed", "--backend", "--dtype", "--smoke", "--data"):
        assert option in result.stdout
