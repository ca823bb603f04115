"""A debugger reaches the math: the stack a learner steps through, from a demo's ``main``
to an op of the textbook tier, run as the README starts it (``--tier textbook``).

Each run is the demo's --smoke run in a subprocess with a profile hook that, at the first
call of the op, writes the Python stack and exits: the op must run in the main thread of
the process the command started (a breakpoint in it fires there), and the stack from
``main`` to ``ops.attention_backward`` must stay short: no wrapper of the checks on it
(they sit in the op's first statement and at the modules' doors, and add no frame).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SHARED_DATA
from tests.test_demos import synthetic_data

ROOT = Path(__file__).resolve().parents[1]

# At ops.attention_backward, counting from the demo's main: at most this many frames of the
# project's files, in at most this many files (README, "Reading the code").
MAX_FRAMES, MAX_FILES = 12, 7

# Runs a demo (argv: the op "path:function", the JSON to write, the script and its options)
# with a profile hook; at the op's first call: the stack, whether in the main thread of this
# process.  os._exit ends the run there (nothing more of it is needed).
STOP_AT_THE_OP = r"""
import json, os, runpy, sys, threading
(op_path, op_name), report = sys.argv[1].split(":"), sys.argv[2]
sys.argv = sys.argv[3:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
started_in = os.getpid()


def at_the_op(frame, event, arg):
    code = frame.f_code
    if event != "call" or code.co_name != op_name or not code.co_filename.endswith(op_path):
        return
    stack = []
    while frame is not None:
        stack.append((frame.f_code.co_filename, frame.f_code.co_name, frame.f_lineno))
        frame = frame.f_back
    with open(report, "w") as file:
        json.dump({"stack": stack[::-1], "main_process": os.getpid() == started_in,
                   "main_thread": threading.current_thread() is threading.main_thread()},
                  file)
    os._exit(0)


sys.setprofile(at_the_op)
threading.setprofile(at_the_op)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    if SHARED_DATA.is_dir():
        return SHARED_DATA
    return synthetic_data(tmp_path_factory.mktemp("data"))


def stack_at(op: str, script: str, data: Path, out: Path) -> dict:
    """Run ``demos/<script> --smoke --tier textbook`` (the README's command, no other
    option) until ``op`` ("path:function") is first called: the report written there."""
    report = out / "stack.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", STOP_AT_THE_OP, op, str(report), str(ROOT / "demos" / script),
         "--smoke", "--tier", "textbook", "--no-progress", "--data", str(data),
         "--out", str(out / "run")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert report.is_file(), (f"{op} never ran in the process {script} started (it ran in "
                              "another, or not at all)\n" + result.stdout[-2000:]
                              + result.stderr[-2000:])
    return json.loads(report.read_text())


def project_frames(stack: list, script: str) -> list[tuple[str, str]]:
    """(file relative to the project, function) of every project frame from the demo's main."""
    demo = str(ROOT / "demos" / script)
    first = next(i for i, (file, name, _) in enumerate(stack) if file == demo and name == "main")
    return [(os.path.relpath(file, ROOT), name) for file, name, _ in stack[first:]
            if file.startswith(str(ROOT) + os.sep)]


def reading_path_stops(path: str) -> list[tuple[str, str]]:
    """(file, function) of each stop of tools/reading_path.py's ``path`` ("textbook_path",
    "textbook_backward_path") for the branch imdb's config takes."""
    spec = importlib.util.spec_from_file_location("reading_path",
                                                  ROOT / "tools" / "reading_path.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    stops = getattr(tool, path)(tool.demo_norm_first())
    return [(file, qualname.split(".")[-1]) for file, qualname, _ in stops
            if qualname != "implementations"]  # a lookup of the class, not a call on the way


def test_the_imdb_demo_reaches_the_attention_backward_in_a_few_frames(data_dir, tmp_path):
    report = stack_at("npformer/ops/attention.py:attention_backward", "imdb.py", data_dir,
                      tmp_path)
    assert report["main_process"] and report["main_thread"]
    frames = project_frames(report["stack"], "imdb.py")
    files = {file for file, _ in frames}
    listing = "\n".join(f"  {file}:{name}" for file, name in frames)
    assert frames[-1] == ("npformer/ops/attention.py", "attention_backward"), listing
    assert len(frames) <= MAX_FRAMES and len(files) <= MAX_FILES, (
        f"{len(frames)} frames in {len(files)} files from main to the op:\n{listing}")
    # no wrapper of the checks between the demo and the math
    assert not files & {"npformer/nn/module.py", "npformer/ops/contracts.py"}, listing
    # tools/reading_path.py's backward path is this stack, stop by stop
    assert frames[1:] == reading_path_stops("textbook_backward_path"), listing


@pytest.mark.parametrize("script", ["imdb.py", "translate.py", "generate.py"])
@pytest.mark.parametrize("op", ["npformer/ops/attention.py:attention_forward",
                                "npformer/ops/attention.py:attention_backward"])
def test_a_breakpoint_in_an_op_fires_in_the_main_thread(script, op, data_dir, tmp_path):
    """The README's textbook command runs its ops in the process it started, in its main
    thread: a breakpoint() set in one stops there, with the stack from main above it."""
    report = stack_at(op, script, data_dir, tmp_path)
    assert report["main_process"] and report["main_thread"]
    frames = project_frames(report["stack"], script)
    assert frames[0] == (f"demos/{script}", "main")
    assert "npformer/ops/contracts.py" not in {file for file, _ in frames}
    if (script, op) == ("imdb.py", "npformer/ops/attention.py:attention_forward"):
        # tools/reading_path.py's forward path is this stack from the model's forward down
        # (above it: the update's path, and the model's door, which checks the batch)
        model = frames.index(("npformer/models/classifier.py", "forward"))
        assert frames[model:] == reading_path_stops("textbook_path")[1:], frames
