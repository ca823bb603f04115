"""npformer.cli, the demos' shared command line, on its own: the option validators, the
preset mechanism (explicit options win, bad combinations refused naming the options),
the checkpoint guard, the resume command, and run_demo's exit statuses."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from npformer import cli
from npformer.checkpoint import save_checkpoint
from npformer.models import CausalLM, CausalLMConfig
from npformer.train import TrainingDiverged, TrainingInterrupted

from .conftest import using_backend


@pytest.mark.parametrize("validator, good, bad", [
    (cli.positive_int, ["1", "20000"], ["0", "-1", "1.5", "x", ""]),
    (cli.nonnegative_int, ["0", "7"], ["-1", "2.0", "nan"]),
    (cli.positive_float, ["1e-3", "4", "0.5"], ["0", "-1e-3", "nan", "inf", "-inf", "x"]),
    (cli.nonnegative_float, ["0", "0.01"], ["-0.1", "nan", "inf"]),
    (cli.probability, ["0", "0.1", "0.999"], ["1", "1.5", "-0.1", "nan"]),
])
def test_validators(validator, good, bad):
    for text in good:
        validator(text)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match="expected .*got " + repr(text)):
            validator(text)


@dataclass(frozen=True)
class Toy:
    width: int = cli.option(8, "width")
    heads: int = cli.option(2, "heads")
    rate: float = cli.option(0.1, "rate", cli.probability)
    how: str = cli.option("mean", "how", str, ("mean", "max"))

    def __post_init__(self):
        cli.check_divisible(self, "width", "heads")


TOYS = {"default": Toy(), "smoke": Toy(width=4, heads=1), "big": Toy(width=64, heads=8)}
DEMO = cli.Demo(tag="toy", title="toy", model_kind="causal_lm", script="demos/toy.py",
                out="runs/toy")


def parse(*argv):
    parser = cli.demo_parser(DEMO, "Toy.\n\nEpilog.", TOYS)
    args = parser.parse_args(list(argv))
    return cli.resolve_preset(parser, args, TOYS), args


def test_explicit_options_win_over_the_preset():
    assert parse()[0] == Toy()
    assert parse("--smoke")[0] == Toy(width=4, heads=1)
    preset, args = parse("--smoke", "--heads", "4", "--width", "16")
    assert preset == Toy(width=16, heads=4) and args.preset == "smoke"
    assert parse("--preset", "big", "--rate", "0")[0] == Toy(width=64, heads=8, rate=0.0)
    assert parse("--how", "max")[0].how == "max"


@pytest.mark.parametrize("argv, words", [
    (["--smoke", "--preset", "big"], ["--smoke", "--preset big"]),
    (["--smoke", "--heads", "3"], ["--width 4", "--heads 3"]),
    (["--rate", "1"], ["argument --rate"]),
    (["--how", "sum"], ["argument --how"]),
    (["--preset", "huge"], ["argument --preset"]),
])
def test_refused_settings_name_the_options(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


def test_help_lists_every_preset_value(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    out = " ".join(capsys.readouterr().out.split())
    assert "--width WIDTH width (default: 8; smoke: 4; big: 64)" in out
    assert "--how {mean,max} how (default: mean)" in out


def test_resume_command_drops_stop_after_and_adds_resume():
    command = cli.resume_command(["--smoke", "--stop-after", "5", "--out", "my runs",
                                  "--stop-after=7", "--resume"])
    assert command.endswith("--smoke --out 'my runs' --resume")


def _checkpoint(path, demo, finished=None):
    with using_backend("numpy", "float64"):
        model = CausalLM(CausalLMConfig(vocab_size=5, block_size=4, d_model=4, num_heads=1,
                                        num_layers=1, d_ff=4))
        extra = {"demo": demo}
        if finished is not None:
            extra["trainer"] = {"finished": finished}
        save_checkpoint(path, model, step=3, extra=extra)


def test_guard_refuses_another_demos_checkpoint_and_an_unfinished_run(tmp_path):
    cli.guard_output(tmp_path, DEMO)  # an empty folder
    _checkpoint(tmp_path / cli.MODEL_FILE, "toy")
    _checkpoint(tmp_path / cli.LAST_FILE, "toy", finished=True)
    cli.guard_output(tmp_path, DEMO)  # a finished run of this demo: a new run may replace it
    _checkpoint(tmp_path / cli.LAST_FILE, "toy", finished=False)
    with pytest.raises(cli.DemoError, match="unfinished run .*update 3.*--resume"):
        cli.guard_output(tmp_path, DEMO)
    _checkpoint(tmp_path / cli.LAST_FILE, "imdb", finished=True)
    with pytest.raises(cli.DemoError, match="not saved by the toy demo.*'imdb' demo.*--out"):
        cli.guard_output(tmp_path, DEMO)


def test_reading_a_missing_or_foreign_checkpoint(tmp_path):
    with pytest.raises(cli.DemoError, match="no checkpoint at .*demos/toy.py"):
        cli.read_demo_checkpoint(tmp_path / "model.npz", DEMO)
    _checkpoint(tmp_path / "model.npz", "shakespeare")
    with pytest.raises(cli.CheckpointError, match="not saved by the toy demo"):
        cli.read_demo_checkpoint(tmp_path / "model.npz", DEMO)


@pytest.mark.parametrize("raised, status, first_line", [
    (cli.DemoError("no GPU"), 2, "error: no GPU"),
    (TrainingDiverged("loss nan"), 2, "error: loss nan"),
    (TrainingInterrupted(4, "SIGINT", None), 130, "training stopped (SIGINT) after update 4"),
    (KeyboardInterrupt(), 130, "interrupted"),
])
def test_run_demo_turns_user_errors_into_one_line(raised, status, first_line, capsys):
    def main(argv):
        raise raised

    assert cli.run_demo(main, []) == status
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith(first_line) and "Traceback" not in err


def test_run_demo_lets_bugs_through():
    def main(argv):
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        cli.run_demo(main, [])
