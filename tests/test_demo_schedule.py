"""Issue 37, case 6: a run of one update (``--max-iters 1``, ``imdb.py --epochs 0.01``)
ended in a traceback, "warmup (1) must be shorter than total_steps (1)".  The demos'
cosine schedule (:class:`npformer.optim.warmup_cosine`) is legal for any number
of updates from 1: a run that ends within its warmup only warms up.
"""
from __future__ import annotations

import numpy as np
import pytest

from npformer.nn import Parameter
from npformer.optim import warmup_cosine
from tests.test_demos import SMOKE, data_dir, load_demo, run_demo  # noqa: F401 (data_dir: a fixture)


@pytest.mark.parametrize("warmup, total", [(1, 1), (3, 1), (3, 2), (3, 3)])
def test_a_run_no_longer_than_its_warmup_only_warms_up(warmup, total):
    schedule = warmup_cosine(1e-3, warmup, total)
    lrs = [schedule(t) for t in range(1, total + 1)]
    assert lrs == pytest.approx([1e-3 * t / warmup for t in range(1, total + 1)])
    assert warmup_cosine(1e-3, 1, 1)(1) == 1e-3  # the one update at the peak


@pytest.mark.parametrize("warmup, total, min_lr", [(1, 2, 0.0), (5, 100, 1e-4), (99, 100, 0.0)])
def test_a_longer_run_peaks_after_its_warmup_and_ends_at_min_lr(warmup, total, min_lr):
    schedule = warmup_cosine(1e-3, warmup, total, min_lr)
    assert schedule.end == total
    assert schedule(warmup) == pytest.approx(1e-3) and schedule(total) == pytest.approx(min_lr)


@pytest.mark.parametrize("warmup, total, error", [(-1, 5, ValueError), (2, 0, ValueError),
                                                  (1.5, 5, TypeError), (2, True, TypeError)])
def test_bad_lengths_are_refused_by_name(warmup, total, error):
    with pytest.raises(error, match="warmup|total_updates"):
        warmup_cosine(1e-3, warmup, total)


def test_each_demos_optimizer_takes_a_one_update_run():
    params = [Parameter(np.zeros((2, 2), dtype=np.float32))]
    imdb, generate = load_demo("imdb.py"), load_demo("generate.py")
    assert imdb.make_optimizer(params, imdb.PRESETS["smoke"], 1).schedule(1) == \
        imdb.PRESETS["smoke"].lr
    one = generate.Preset(max_iters=1)
    assert generate.make_optimizer(params, one).schedule(1) == one.lr


@pytest.mark.parametrize("script, option", [("generate.py", ["--max-iters", "1"]),
                                            ("imdb.py", ["--epochs", "0.01", "--members", "1"])])
def test_a_one_update_demo_run_trains_and_saves(script, option, data_dir, tmp_path):  # noqa: F811
    result = run_demo(script, *SMOKE, "--no-progress", "--data", str(data_dir), "--out",
                      str(tmp_path), *option)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert (tmp_path / "model.npz").is_file() and (tmp_path / "last.npz").is_file()
