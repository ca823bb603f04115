"""The demos' command line: the options every demo shares, and its presets.

*Presets.*  Each demo's settings are one dataclass whose fields are declared with
:func:`option` (default, help text, type).  ``PRESETS`` names instances of it (always
``"default"`` and ``"smoke"``; ``--smoke`` is short for ``--preset smoke``).  Every field
is also a command-line option (``d_model`` -> ``--d-model``); an option the user gives wins
over the preset's value (:func:`resolve_preset`).  An option's value is checked by its type
(``positive_int``, ``probability``...), the rule a Python argument of the same kind meets.
"""
from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Collection
from dataclasses import Field, field, fields, replace
from typing import Any

from ..backend import boolean_word
from ..checkpoint import TIERS
from ..ops.contracts import check_heads_divide, check_probability, check_real, check_size
from .demo import LAST_FILE, Demo

MPI_EPILOG = """
Across processes: where mpi4py and mpiexec are installed (pip install -e ".[mpi]"), the
demo re-launches itself as one MPI rank per core (--procs N sets the count, --procs 1
runs one process); `mpiexec -n N python {script}` starts N ranks by hand.  The global
batch is --batch-size whatever N is: the ranks split its rows and sum their gradients,
so the learning rate (and its schedule) and the results stay those of one process, and a
run resumes on any number of ranks.  Only rank 0 prints and writes files."""


def default_out(demo: Demo, preset: str) -> str:
    """The run's folder when --out is not given: the demo's (``runs/imdb``) for the default
    preset, its own for each other (``runs/imdb-smoke``), so that a smoke run never leaves
    what a default run would stumble on."""
    return demo.out if preset == "default" else f"{demo.out}-{preset}"


# nanoGPT's names of the settings the demos share (its train.py and sample.py): each is
# read as the demo's option where the demo has that setting, as is every option's
# underscore spelling (--max_iters, --block_size, --batch_size); the command-line parser
# says what to type for one it does not read
NANOGPT_NAMES = {"n_layer": "num_layers", "n_embd": "d_model", "n_head": "num_heads",
                 "learning_rate": "lr", "eval_interval": "eval_every",
                 "eval_iters": "eval_batches", "warmup_iters": "warmup",
                 "max_new_tokens": "length", "out_dir": "out"}


def flag(name: str) -> str:
    """A preset field's command-line option: ``d_model`` -> ``--d-model``."""
    return "--" + name.replace("_", "-")


# =========================================================================== command-line values
# The demos' option types (argparse's ``type=``); argparse puts the option before the
# message: "argument --lr: expected a positive number, got '0'" (exit status 2).
def _option_value(text: str, read: Callable[[str], Any], check: Callable[[Any], Any],
                  expected: str) -> Any:
    """``read(text)``, refused unless ``check`` passes it, naming ``expected`` and the text."""
    try:
        value = read(text)
        check(value)
    except (TypeError, ValueError):  # not a number, or outside the rule
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    return value


def positive_int(text: str) -> int:
    """An option's integer >= 1 (a count, a size)."""
    return _option_value(text, int, lambda v: check_size(v, "value", 1), "a positive integer")


def nonnegative_int(text: str) -> int:
    """An option's integer >= 0."""
    return _option_value(text, int, lambda v: check_size(v, "value", 0), "an integer >= 0")


def positive_float(text: str) -> float:
    """An option's finite number > 0 (a learning rate, a temperature)."""
    return _option_value(text, float, lambda v: check_real(v, "value", 0, inclusive=False),
                         "a positive number")


def nonnegative_float(text: str) -> float:
    """An option's finite number >= 0."""
    return _option_value(text, float, lambda v: check_real(v, "value", 0), "a number >= 0")


def probability(text: str) -> float:
    """An option's probability in [0, 1) (a dropout rate)."""
    return _option_value(text, float, check_probability, "a probability in [0, 1)")


def nucleus(text: str) -> float:
    """An option's probability in (0, 1] (top-p sampling's nucleus: it keeps at least the
    likeliest token)."""
    return _option_value(text, float, lambda v: check_real(v, "value", 0, inclusive=False,
                                                           maximum=1, max_inclusive=True),
                         "a probability in (0, 1]")


def yes_no(text: str) -> bool:
    """An option's switch: yes or no (or the other words an environment switch takes,
    ``backend.boolean_word``: true/false, on/off, 1/0; any case) -> True or False."""
    def is_a_switch(value: bool | None) -> None:
        if value is None or not text.strip():
            raise ValueError(text)

    return _option_value(text, boolean_word, is_a_switch, "yes or no")


# --------------------------------------------------------------------------- presets
def option(default: Any, help: str, type: Callable[[str], Any] = positive_int,
           choices: Collection | None = None,
           needs: tuple[Callable[[Any], bool], str] | None = None) -> Field:
    """A preset field that is also a command-line option (validated by ``type``).
    ``needs``: (test of the settled preset, the option it needs, e.g. ``"--lora R"``) for
    an option read only with another: given on the command line while the test fails, it
    is refused whatever its value (:func:`resolve_preset`)."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices,
                                            "needs": needs})


def needs(parser: argparse.ArgumentParser, dest: str, test: Callable[[Any, Any], bool],
          what: str) -> None:
    """Declare that the demo's option ``dest`` (not a preset field) is read only when
    ``test(args, preset)`` holds, i.e. with ``what`` (``"--predict TEXT"``): typed without
    it, it is refused whatever its value (:func:`resolve_preset`)."""
    parser.needed = {**getattr(parser, "needed", {}), dest: (test, what)}


def typed_options(args: argparse.Namespace) -> set[str]:
    """The destinations of the options typed on this command line (not their defaults, not
    what a resumed run read back from its saved settings)."""
    return set(getattr(args, _TYPED, ()))


# the shared options a run that only uses its saved model (--sample-only, --predict,
# --translate) does not read: they set training
TRAINING_ONLY = ("data", "stop_after", "cuda_graph")


def _as_typed(args: argparse.Namespace, dest: str) -> tuple[str, str]:
    """(the option ``dest`` as typed, with its value as typed: ``--lora-alpha 16``)."""
    typed_as, value = getattr(args, _GIVEN_AS, {}).get(dest, (flag(dest),
                                                              getattr(args, dest, None)))
    return typed_as, typed_as if value is True else f"{typed_as} {shlex.quote(str(value))}"


def refuse_unread_with_saved_model(parser: argparse.ArgumentParser, args: argparse.Namespace,
                                   preset: Any, use_only: str | None) -> None:
    """With ``use_only`` (the option that uses the saved model, ``--sample-only``), an
    option typed that it does not read is refused, named, whatever its value: the preset
    fields but those the preset class lists in ``read_with_saved_model`` (the saved model
    has its own sizes; ``--length`` is read), and :data:`TRAINING_ONLY`."""
    if not use_only:
        return
    read = set(getattr(type(preset), "read_with_saved_model", ()))
    settings = {f.name for f in fields(preset)}
    for dest in sorted(typed_options(args)):
        if (dest in settings and dest not in read) or dest in TRAINING_ONLY:
            typed_as, shown = _as_typed(args, dest)
            parser.error(f"{shown} is not read with {use_only}, which uses the saved model "
                         f"(it sets training or the model's sizes): leave {typed_as} out")


def _refuse_unread_options(parser: argparse.ArgumentParser, args: argparse.Namespace,
                           preset: Any) -> None:
    """An option typed without the option it needs (:func:`option`'s and :func:`needs`'s
    ``needs``) is refused, naming both, whatever its value: a value equal to the default
    would otherwise be dropped silently (``--lora-alpha 16`` without ``--lora R``)."""
    typed = typed_options(args)
    checks = [(f.name, lambda test=f.metadata["needs"][0]: test(preset),
               f.metadata["needs"][1]) for f in fields(preset)
              if f.metadata.get("needs") is not None]
    checks += [(dest, lambda test=test: test(args, preset), what)
               for dest, (test, what) in getattr(parser, "needed", {}).items()]
    for dest, holds, what in checks:
        if dest in typed and not holds():
            typed_as, shown = _as_typed(args, dest)
            parser.error(f"{shown} is read only with {what}: add {what}, or leave "
                         f"{typed_as} out")


def check_divisible(preset: Any, d_model: str, num_heads: str) -> None:
    """Refuse a model width the number of heads does not divide, naming both options."""
    check_heads_divide(getattr(preset, d_model), getattr(preset, num_heads), flag(d_model),
                       flag(num_heads), hint="")


def _add_preset_options(parser: argparse.ArgumentParser, presets: dict) -> None:
    group = parser.add_argument_group(
        "settings", "each has a value in every preset; an option given here overrides it")
    group.add_argument("--preset", choices=sorted(presets), default=None,
                       help="named settings (default: default)")
    group.add_argument("--smoke", action="store_true",
                       help="short for --preset smoke: a few seconds on a tiny subset, "
                            "checks the whole pipeline runs (CI)")
    base = presets["default"]
    for f in fields(base):
        nanogpt = [name for name, ours in NANOGPT_NAMES.items() if ours == f.name]
        values = "; ".join([f"default: {getattr(base, f.name)}"] + [
            f"{name}: {getattr(p, f.name)}" for name, p in presets.items()
            if name != "default" and getattr(p, f.name) != getattr(base, f.name)])
        read = dict(type=f.metadata["type"], default=None, choices=f.metadata["choices"],
                    action=_OneSetting)
        group.add_argument(flag(f.name), metavar=None if f.metadata["choices"] else
                           f.name.upper(), help=f"{f.metadata['help']} ({values})"
                           .replace("%", "%%"), **read)
        # nanoGPT's name and the underscore spelling: read as the option itself, hidden
        for alias in dict.fromkeys(f"--{name}" for name in (f.name, *nanogpt)):
            if alias != flag(f.name):
                group.add_argument(alias, dest=f.name, help=argparse.SUPPRESS, **read)


class _OneSetting(argparse.Action):
    """A preset field's option, under its name or another spelling (``--d-model``,
    ``--n-embd``, ``--d_model``): two of them with different values are refused, naming
    both (which one would win is not the user's intent to guess); the same value twice,
    or one name repeated, is accepted (argparse's rule: the last one wins)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 value: Any, option_string: str | None = None) -> None:
        given = getattr(namespace, _GIVEN_AS, {})
        earlier = given.get(self.dest)
        if earlier is not None and earlier[0] != option_string and earlier[1] != value:
            name = flag(self.dest)
            other = [o for o in (earlier[0], option_string) if o != name]
            kind = "is another spelling" if len(other) == 1 else "are other spellings"
            parser.error(f"{earlier[0]} {earlier[1]} and {option_string} {value} set the same "
                         f"setting: {' and '.join(other)} {kind} of {name}; give {name} once")
        given[self.dest] = (option_string, value)
        setattr(namespace, _GIVEN_AS, given)
        setattr(namespace, self.dest, value)


_GIVEN_AS = "_preset_options_given_as"  # {field: (option string, value)} while parsing
_TYPED = "_options_typed"  # the destinations of the options typed (:func:`typed_options`)


def resolve_preset(parser: argparse.ArgumentParser, args: argparse.Namespace, presets: dict) -> Any:
    """The chosen preset with every option the user gave put in its place."""
    if args.smoke and args.preset not in (None, "smoke"):
        parser.error(f"--smoke is short for --preset smoke: it cannot be combined with "
                     f"--preset {args.preset}")
    args.preset = "smoke" if args.smoke else (args.preset or "default")
    given = {f.name: getattr(args, f.name) for f in fields(presets["default"])
             if getattr(args, f.name) is not None}
    try:
        preset = replace(presets[args.preset], **given)  # the preset's __post_init__ checks
    except ValueError as exc:
        parser.error(str(exc))
    _refuse_unread_options(parser, args, preset)
    return preset


# --------------------------------------------------------------------------- the parser
class _DemoParser(argparse.ArgumentParser):
    """argparse's parser, whose error for an option it does not know says what to type
    (:func:`what_to_type`)."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        hints = [hint for hint in (what_to_type(self, text) for text in extras) if hint]
        if hints:
            self.error(f"unrecognized arguments: {' '.join(extras)} ({'; '.join(hints)})")
        setattr(parsed, _TYPED, self._typed(args))
        return parsed, extras

    def _typed(self, args) -> list[str]:
        """The destinations of the options on the command line: the same line parsed
        again with every default suppressed holds those alone."""
        defaults = [(action, action.default) for action in self._actions]
        try:
            for action, _ in defaults:
                action.default = argparse.SUPPRESS
            typed, _ = super().parse_known_args(args, None)
        finally:
            for action, default in defaults:
                action.default = default
        return sorted(name for name in vars(typed) if not name.startswith("_"))


def what_to_type(parser: argparse.ArgumentParser, text: str) -> str | None:
    """For an option ``parser`` does not know: the option to type instead (its dashed
    spelling, the demo's name of a nanoGPT setting, a close match), or what is missing
    (a nanoGPT setting the demo does not have); None for anything else."""
    import difflib

    if not text.startswith("--"):
        return None
    given = text.split("=", 1)[0]
    known = [o for action in parser._actions for o in action.option_strings]
    name = given[2:]
    dashed = "--" + name.replace("_", "-")
    if dashed in known:
        return f"{given} is spelled {dashed} here"
    if name in NANOGPT_NAMES:
        ours = flag(NANOGPT_NAMES[name])
        return (f"nanoGPT's {given} is {ours} here" if ours in known else
                f"nanoGPT's {given} ({ours}) is not a setting of this demo: --help lists "
                f"its options")
    close = difflib.get_close_matches(dashed, known, n=1)
    return f"did you mean {close[0]}?" if close else None


def demo_parser(demo: Demo, doc: str, presets: dict) -> argparse.ArgumentParser:
    """The command line every demo shares: data, output, run settings, resuming, and one
    option per preset field.  The demo adds its own options to it."""
    parser = _DemoParser(description=doc.split("\n\n")[0],
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog=doc.split("\n\n", 1)[1] + MPI_EPILOG.format(script=demo.script))
    parser.add_argument("--data", default=None,
                        help="dataset file or folder (default: $NPFORMER_DATA, then the user "
                             "cache, downloading there if needed)")
    parser.add_argument("--out", default=None,
                        help=f"folder for the checkpoints, plots and metrics (default: "
                             f"{demo.out}; {default_out(demo, 'smoke')} for --smoke, and "
                             f"{default_out(demo, 'PRESET')} for another --preset)")
    parser.add_argument("--seed", type=nonnegative_int, default=None,
                        help="random seed (default: 0)")
    parser.add_argument("--backend", choices=["numpy", "cupy"], default=None,
                        help="array backend: numpy (CPU) or cupy (GPU) "
                             "(default: $NPFORMER_BACKEND, else numpy)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default=None,
                        help="float dtype of parameters and activations (default: float32)")
    parser.add_argument("--tier", choices=TIERS, default=None,
                        help="which implementation trains: fast (npformer.fast, the default) "
                             "or textbook (the plain derivations: npformer.models, "
                             "npformer.optim; one process, one replica unless --procs or "
                             "--replicas ask for more); both give the same numbers up to "
                             "rounding")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="with --backend cupy: each training update captured once as a "
                             "CUDA graph and replayed (npformer.gpu.cuda_graph; the same as "
                             "NPFORMER_CUDA_GRAPH=1); where it cannot apply the run says why "
                             "and trains eagerly")
    parser.add_argument("--replicas", type=positive_int, default=None,
                        help="data-parallel replicas, one thread each with single-threaded "
                             "BLAS, for training and evaluation (default: one per CPU core "
                             "with numpy, shared among the MPI ranks on the machine; 1 with "
                             "cupy or --tier textbook)")
    parser.add_argument(
        "--procs", type=positive_int, default=None, metavar="N",
        help="processes to train in: the demo re-launches itself as N MPI ranks (one "
             "process per core by default, when mpi4py and mpiexec are installed, except "
             "with --tier textbook; the results are one process's, up to rounding); "
             "--procs 1 runs in this process")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (on a terminal) or progress lines (elsewhere)")
    parser.add_argument("--resume", action="store_true",
                        help=f"continue the run saved in OUT/{LAST_FILE} (after an interruption) "
                             "exactly, with its saved settings; options given again must "
                             "match them")
    parser.add_argument("--stop-after", type=positive_int, default=None, metavar="UPDATES",
                        help=f"stop after this many updates as if interrupted (the run is saved "
                             f"in OUT/{LAST_FILE}: continue it with --resume)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start a new run in OUT even though it holds another run: every "
                             "file of that run is removed first")
    _add_preset_options(parser, presets)
    return parser
