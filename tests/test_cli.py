"""npformer.cli, the demos' shared command line, on its own: the option validators (one
rule with the Python-side checks), the preset mechanism (explicit options win, bad
combinations refused naming the options), the start-up, the checkpoint guard, the resume
command, and run_demo's exit statuses."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

import pytest

from npformer import cli
from npformer.checkpoint import save_checkpoint
from npformer.cli import options, runs
from npformer.models import CausalLMConfig
from npformer.ops import contracts
from npformer.train import TrainingDiverged, TrainingInterrupted
from tests.helpers import tiered

from .conftest import using_backend


@pytest.mark.parametrize("validator, good, bad", [
    (cli.positive_int, ["1", "20000"], ["0", "-1", "1.5", "x", ""]),
    (cli.nonnegative_int, ["0", "7"], ["-1", "2.0", "nan"]),
    (cli.positive_float, ["1e-3", "4", "0.5"], ["0", "-1e-3", "nan", "inf", "-inf", "x"]),
    (cli.nonnegative_float, ["0", "0.01"], ["-0.1", "nan", "inf"]),
    (cli.probability, ["0", "0.1", "0.999"], ["1", "1.5", "-0.1", "nan"]),
    (cli.yes_no, ["yes", "No", " true ", "off", "1", "0"], ["", "maybe", "2", "y"]),
])
def test_validators(validator, good, bad):
    for text in good:
        validator(text)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match="expected .*got " + repr(text)):
            validator(text)


def test_a_switch_reads_yes_and_no():
    assert [cli.yes_no(w) for w in ("yes", "NO", " 1 ", "off")] == [True, False, True, False]


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


@dataclass(frozen=True)
class Spelled:
    d_model: int = cli.option(8, "width")
    num_heads: int = cli.option(2, "heads")


SPELLED = {"default": Spelled(), "smoke": Spelled(d_model=4)}


def parse_spelled(*argv):
    parser = cli.demo_parser(DEMO, "Toy.\n\nEpilog.", SPELLED)
    return cli.resolve_preset(parser, parser.parse_args(list(argv)), SPELLED)


@pytest.mark.parametrize("argv, value", [
    (["--n_embd", "16"], 16), (["--d-model", "16"], 16),
    (["--n_embd", "16", "--d-model", "16"], 16), (["--d-model=16", "--d_model", "16"], 16),
    (["--d-model", "16", "--d-model", "32"], 32),  # one name repeated: argparse's last wins
    (["--smoke", "--d_model", "12"], 12),
])
def test_another_spelling_sets_its_setting(argv, value):
    assert parse_spelled(*argv).d_model == value


@pytest.mark.parametrize("argv, message", [
    (["--n_embd", "48", "--d-model", "16"], "--n_embd 48 and --d-model 16 set the same setting: "
                                            "--n_embd is another spelling of --d-model; give "
                                            "--d-model once"),
    (["--d-model=16", "--d_model=48"], "--d-model 16 and --d_model 48 set the same setting: "
                                       "--d_model is another spelling of --d-model; give "
                                       "--d-model once"),
    (["--n_embd", "4", "--d_model", "8"], "--n_embd 4 and --d_model 8 set the same setting: "
                                          "--n_embd and --d_model are other spellings of "
                                          "--d-model"),
    (["--n_head", "1", "--num-heads", "2"], "--n_head 1 and --num-heads 2 set the same setting"),
])
def test_two_spellings_with_different_values_are_refused(argv, message, capsys):
    """Issue 37, case 19: the last one won silently."""
    with pytest.raises(SystemExit) as exit_info:
        parse_spelled(*argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("script, argv, names", [
    ("generate.py", ["--n_embd", "48", "--d-model", "16"], "--n_embd 48 and --d-model 16"),
    ("generate.py", ["--max-iters", "5", "--max_iters", "3"], "--max-iters 5 and --max_iters 3"),
    ("translate.py", ["--n_layer", "2", "--num-layers", "3"], "--n_layer 2 and --num-layers 3"),
    ("imdb.py", ["--block_size", "256", "--block-size", "128"],
     "--block_size 256 and --block-size 128"),
])
def test_the_demos_refuse_two_spellings_with_different_values(script, argv, names, capsys):
    from tests.test_demos import load_demo

    demo = load_demo(script)
    parser = demo.build_parser()
    with pytest.raises(SystemExit):
        cli.resolve_preset(parser, parser.parse_args(argv), demo.PRESETS)
    assert f"{names} set the same setting" in capsys.readouterr().err
    same = parser.parse_args(argv[:2] + [argv[2], argv[1]])  # the same value twice is fine
    assert cli.resolve_preset(parser, same, demo.PRESETS) is not None


def test_resume_command_drops_stop_after_and_adds_resume():
    command = cli.resume_command(["--smoke", "--stop-after", "5", "--out", "my runs",
                                  "--stop-after=7", "--resume"])
    assert command.endswith("--smoke --out 'my runs' --resume")


def _checkpoint(path, demo, finished=None):
    with using_backend("numpy", "float64"):
        model = tiered.CausalLM(CausalLMConfig(vocab_size=5, block_size=4, d_model=4, num_heads=1,
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


# --------------------------------------------------------------------------- one rule per value
NUMBERS = [-2, -1, 0, 1, 7, -0.5, 0.0, 0.5, 0.999, 1.0, 1.5, 1e-3, float("nan"), float("inf"),
           float("-inf")]


@pytest.mark.parametrize("converter, check", [
    (options.positive_int, lambda v: contracts.check_size(v, "n", 1)),
    (options.nonnegative_int, lambda v: contracts.check_size(v, "n", 0)),
    (options.positive_float, lambda v: contracts.check_real(v, "x", 0, inclusive=False)),
    (options.nonnegative_float, lambda v: contracts.check_real(v, "x", 0)),
    (options.probability, contracts.check_probability),
])
def test_a_command_line_value_meets_the_rule_of_a_python_argument(converter, check):
    """The option types live in npformer.cli.options and accept exactly the numbers the
    Python-side check of the same kind accepts (ints: only the integers among them)."""
    integers = converter in (options.positive_int, options.nonnegative_int)
    for number in NUMBERS:
        if integers and not (isinstance(number, int) or number.is_integer()):
            continue
        value = int(number) if integers else number
        try:
            check(value)
            accepted = True
        except (TypeError, ValueError):
            accepted = False
        if accepted:
            assert converter(str(value)) == value
        else:
            with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(str(value)))):
                converter(str(value))
    assert getattr(cli, converter.__name__) is converter  # the demos import it from cli


def test_a_refused_value_names_the_option_and_the_value(capsys):
    with pytest.raises(SystemExit):
        parse("--rate", "1")
    assert "argument --rate: expected a probability in [0, 1), got '1'" in capsys.readouterr().err


# --------------------------------------------------------------------------- the start-up
def start(argv, monkeypatch, relaunched=None, check_options=None):
    """cli.start_demo on the toy demo, which has a --sample-only mode; -> (run, the
    ``training`` relaunch was asked about)."""
    asked = []

    def relaunch(args, argv, training):
        asked.append(training)
        return relaunched

    monkeypatch.setattr(runs, "relaunch", relaunch)
    parser = cli.demo_parser(DEMO, "Toy.\n\nEpilog.", TOYS)
    parser.add_argument("--sample-only", action="store_true")
    with using_backend("numpy", "float64"):
        try:
            return cli.start_demo(DEMO, parser, TOYS, argv, use_saved="sample_only",
                                  check_options=check_options), asked
        finally:
            for lock in cli._held_outputs.values():
                lock.release()
            cli._held_outputs.clear()


def test_start_demo_settles_sets_up_and_holds_the_run(tmp_path, monkeypatch):
    out = tmp_path / "run"
    (args, preset, folder), asked = start(["--smoke", "--heads", "2", "--out", str(out)],
                                          monkeypatch)
    assert preset == Toy(width=4, heads=2) and folder == out and out.is_dir()
    assert (args.preset, args.seed, args.dtype, args.procs) == ("smoke", 0, "float32", 1)
    assert asked == [True]
    assert (out / cli.HOLDER_FILE).is_file()  # training: the folder was held


def test_start_demo_with_a_saved_model_trains_nothing(tmp_path, monkeypatch):
    out = tmp_path / "run"
    run, asked = start(["--sample-only", "--out", str(out)], monkeypatch)
    assert asked == [False] and run.preset == Toy()
    assert not (out / cli.HOLDER_FILE).exists()  # not held, not guarded


def test_start_demo_refuses_resume_with_the_saved_model_option(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        start(["--sample-only", "--resume", "--out", str(tmp_path)], monkeypatch)
    assert exit_info.value.code == 2
    assert "--resume continues training: it cannot be combined with --sample-only" in \
        capsys.readouterr().err


def test_start_demo_checks_the_demos_own_options_before_relaunching(tmp_path, monkeypatch,
                                                                   capsys):
    def check_options(parser, args):
        parser.error("--width goes with --heads")

    with pytest.raises(SystemExit) as exit_info:
        start(["--out", str(tmp_path / "run")], monkeypatch, check_options=check_options)
    assert exit_info.value.code == 2 and "--width goes with --heads" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_start_demo_ends_with_the_relaunched_ranks_status(tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as exit_info:
        start(["--out", str(tmp_path / "run")], monkeypatch, relaunched=130)
    assert exit_info.value.code == 130
    assert (tmp_path / "run" / cli.HOLDER_FILE).is_file()  # held by the ranks' launcher


# --------------------------------------------------------------------------- issue 47
def settled(argv, presets=TOYS):
    parser = cli.demo_parser(DEMO, "Toy.\n\nEpilog.", presets)
    args = parser.parse_args(argv)
    return runs.resolve_settings(parser, args, DEMO, presets), args


@pytest.mark.parametrize("argv, out", [
    ([], "runs/toy"), (["--smoke"], "runs/toy-smoke"), (["--preset", "smoke"], "runs/toy-smoke"),
    (["--preset", "big"], "runs/toy-big"), (["--preset", "default"], "runs/toy"),
    (["--smoke", "--out", "mine"], "mine"),
])
def test_a_smoke_run_has_its_own_default_folder(argv, out):
    """issue 47 case 19: --smoke wrote into the demo's default folder, so the next default
    run was refused ("holds a finished run of other settings"); each preset but the
    default now has its own (runs/NAME-smoke)."""
    assert settled(argv)[1].out == out


def test_overwrite_removes_the_runs_folders_and_a_folder_is_written_whole(tmp_path):
    """issue 47 case 2: --overwrite removed the run's files but left OUT/gpt2 (the
    fine-tuned model); a folder is now written beside its place, then renamed, so a stop
    mid-write never leaves half of one."""
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text("{}")
    (tmp_path / "mine").mkdir()
    (tmp_path / "metrics.json").write_text("{}")
    removed = cli.remove_run_files(tmp_path)
    assert sorted(p.name for p in removed) == ["gpt2", "metrics.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]

    def write(folder, fail=False):
        folder.mkdir()
        (folder / "config.json").write_text("new")
        if fail:
            raise OSError("disk full")

    target = tmp_path / "gpt2"
    cli.write_folder(target, write)
    assert (target / "config.json").read_text() == "new"
    (target / "config.json").write_text("whole")
    with pytest.raises(OSError):
        cli.write_folder(target, lambda folder: write(folder, fail=True))
    assert (target / "config.json").read_text() == "whole"  # the previous folder, untouched
    cli.remove_run_files(tmp_path)  # the failed write's temporary goes with the run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


@dataclass(frozen=True)
class Nano:
    max_iters: int = cli.option(10, "updates")
    num_layers: int = cli.option(2, "layers")
    d_model: int = cli.option(8, "width")
    num_heads: int = cli.option(2, "heads")
    lr: float = cli.option(0.1, "rate", cli.positive_float)
    block_size: int = cli.option(4, "context")


NANOS = {"default": Nano(), "smoke": Nano(max_iters=2)}


@pytest.mark.parametrize("argv, expected", [
    (["--max_iters", "7", "--block_size", "3"], Nano(max_iters=7, block_size=3)),
    (["--n_layer", "3", "--n_embd", "12", "--n_head", "3"], Nano(num_layers=3, d_model=12,
                                                                 num_heads=3)),
    (["--learning_rate", "0.5", "--d_model", "4"], Nano(lr=0.5, d_model=4)),
    (["--n_embd", "12", "--d-model", "12"], Nano(d_model=12)),
])
def test_nanogpt_spellings_set_the_demos_settings(argv, expected):
    """issue 47 case 21: demos/README.md says the names are nanoGPT's, but --max_iters,
    --n_layer and --n_embd were refused with no hint; nanoGPT's names and the underscore
    spellings are read as the demo's options."""
    parser = cli.demo_parser(DEMO, "Toy.\n\nEpilog.", NANOS)
    assert cli.resolve_preset(parser, parser.parse_args(argv), NANOS) == expected


@pytest.mark.parametrize("presets, argv, message", [
    (NANOS, ["--n_embd", "12", "--d-model", "8"],
     "--n_embd 12 and --d-model 8 set the same setting: --n_embd is another spelling of "
     "--d-model; give --d-model once"),
    (TOYS, ["--n_layer", "2"], "unrecognized arguments: --n_layer 2 (nanoGPT's --n_layer "
                               "(--num-layers) is not a setting of this demo"),
    (TOYS, ["--out_dir", "x"], "(nanoGPT's --out_dir is --out here)"),
    (TOYS, ["--stop_after=3"], "(--stop_after is spelled --stop-after here)"),
    (TOYS, ["--widht", "3"], "(did you mean --width?)"),
])
def test_an_option_not_read_says_what_to_type(presets, argv, message, capsys):
    """issue 47 case 21: an option the demo does not read says what to type instead."""
    parser = cli.demo_parser(DEMO, "Toy.\n\nEpilog.", presets)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
