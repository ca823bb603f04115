"""The README as a user follows it: every Python block runs as written, and the install
commands agree with setup.cfg, .ci/run and the messages that point at them.

* every ```python block of README.md, docs/guide.md and demos/README.md runs in a fresh interpreter
  in a temporary directory (so a block's files and global settings stay there); a block
  with the comment "needs a GPU" runs only where CuPy sees a GPU;
* the extras the README, the CuPy error message and bench/gpu.py name exist in
  setup.cfg, the GPU extras install the CuPy of the CUDA version they are named after,
  the test extra has what the README's commands use (the torch pin, pytest-xdist for
  ``-n``), and .ci/run runs the README's test command verbatim, then ruff;
* packaging: the LICENSE, ``py.typed`` shipped as package data, the sdist's manifest
  (bench/ and tests/), the subpackages as attributes of ``import npformer``.

Nothing is installed from a network here: the commands are checked against the files.
"""
from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import GPU, require_torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/guide.md", "demos/README.md")
GUIDE = "docs/guide.md"  # the README's details: GPUs and backends, own data, PyTorch, MPI
GPU_MARK = "needs a GPU"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def python_blocks(relative: str) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block of a Markdown file."""
    blocks, code, start = [], None, 0
    for number, line in enumerate((ROOT / relative).read_text(encoding="utf-8").splitlines(), 1):
        if code is None and line.strip() == "```python":
            code, start = [], number
        elif code is not None and line.strip() == "```":
            blocks.append((start, "\n".join(code) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    assert code is None, f"{relative}: the ```python block of line {start} is not closed"
    return blocks


def _block_params():
    params = []
    for relative in DOCS:
        for line, code in python_blocks(relative):
            marks = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs CuPy and a GPU")
                     ] if GPU_MARK in code else []
            params.append(pytest.param(code, id=f"{relative}:{line}", marks=marks))
    return params


def test_the_readme_has_its_python_blocks():
    """The extraction finds the blocks (a fence typo would silently test nothing)."""
    assert len(python_blocks("README.md")) >= 2
    assert len(python_blocks(GUIDE)) >= 6
    assert sum(GPU_MARK in code for _, code in python_blocks(GUIDE)) == 1


@pytest.mark.parametrize("code", _block_params())
def test_python_block_runs_as_written(code, tmp_path):
    if re.search(r"^\s*import torch|^\s*from torch", code, re.M):
        require_torch()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("NPFORMER_BACKEND", None)  # the block says which backend it wants
    (tmp_path / "block.py").write_text(code, encoding="utf-8")
    result = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"the block failed:\n{code}\n{result.stderr[-3000:]}"


# =========================================================================== install commands
def _extras() -> dict[str, list[str]]:
    """setup.cfg's extras: name -> requirement lines."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    return {name: [line.strip() for line in value.splitlines() if line.strip()]
            for name, value in config["options.extras_require"].items()}


def _named_extras(text: str) -> set[str]:
    """Every extra an install command in ``text`` names: ``.[a,b]`` and ``".[a]"``."""
    return {name.strip() for group in re.findall(r"\.\[([\w,\- ]+)\]", text)
            for name in group.split(",")}


def _readme_setup_commands() -> list[str]:
    """The commands of the README's "Set up" block (comment lines left out)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Set up\n[^`#]*```bash\n(.*?)```", text, re.S)  # a line may lead in
    assert block, "README.md has no ```bash block under '## Set up'"
    return [line for line in block.group(1).splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_every_extra_named_exists_in_setup_cfg():
    extras = set(_extras())
    for relative in (*DOCS, "npformer/backend.py", "bench/gpu.py", "tests/test_bench.py",
                     "tests/test_distributed.py"):
        named = _named_extras((ROOT / relative).read_text(encoding="utf-8"))
        assert named <= extras, f"{relative} names extras {sorted(named - extras)} that " \
                                f"setup.cfg does not define ({sorted(extras)})"
    assert _named_extras((ROOT / "README.md").read_text(encoding="utf-8")
                         + (ROOT / GUIDE).read_text(encoding="utf-8")) >= {
        "demos", "test", "mpi", "gpu-cuda12", "gpu-cuda13"}


def test_the_gpu_extras_install_the_cupy_of_their_cuda():
    extras = _extras()
    gpu = {name for name in extras if name.startswith("gpu")}
    assert gpu == {"gpu-cuda12", "gpu-cuda13"}, "one GPU extra per CUDA version, no other"
    for name in gpu:
        version = name.removeprefix("gpu-cuda")
        assert [r.split(">")[0] for r in extras[name]] == [f"cupy-cuda{version}x"], name
    guide = (ROOT / GUIDE).read_text(encoding="utf-8")
    for version in ("12", "13"):
        row = re.search(rf"^\| CUDA Version {version}\.x .*$", guide, re.M)
        assert row and f'.[gpu-cuda{version}]' in row.group(0) \
            and f"cupy-cuda{version}x" in row.group(0), f"the guide's row for CUDA {version}"
    for relative in ("npformer/backend.py", "bench/gpu.py"):
        text = (ROOT / relative).read_text(encoding="utf-8")
        assert "On a GPU: install" in text, f"{relative}'s CuPy message points to the guide"
    assert "## On a GPU: install" in guide
    assert "docs/guide.md#on-a-gpu-install" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_setup_commands_fit_setup_cfg_and_ci():
    demo_command, test_command = _readme_setup_commands()
    assert _named_extras(demo_command) == {"demos"}
    assert _named_extras(test_command) == {"test", "demos"}
    assert f"--extra-index-url {CPU_TORCH_INDEX}" in test_command  # torch's CPU wheel
    assert "python -m pytest" in test_command
    test_extra = _extras()["test"]
    assert any(re.fullmatch(r"torch==[\d.]+", r) for r in test_extra), "torch is pinned"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    if re.search(r"pytest -n ", readme):
        assert any(r.startswith("pytest-xdist") for r in test_extra), "-n needs pytest-xdist"
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert test_command.strip() in ci_lines, ".ci/run runs the README's test command verbatim"
    assert any(re.search(r"(^|&& )ruff check \.$", line) for line in ci_lines), "CI lints"


# =========================================================================== packaging
def test_license_and_type_information_ship():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    assert config["metadata"]["license"] == "MIT"
    assert config["metadata"]["license_files"].strip() == "LICENSE"
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert license_text.startswith("MIT License") and "the npformer authors" in license_text
    assert (ROOT / "npformer" / "py.typed").is_file()
    assert "py.typed" in config["options.package_data"]["npformer"]


def test_the_sdist_manifest_carries_what_the_tests_import():
    """tests/ import bench/ (and run demos/, read docs/): MANIFEST.in grafts them."""
    grafted = set(re.findall(r"^graft (\S+)", (ROOT / "MANIFEST.in").read_text(), re.M))
    assert {"tests", "bench", "demos", "docs"} <= grafted


def test_subpackages_are_attributes_and_torch_stays_out():
    code = ("import sys, npformer\n"
            "for name in ('models', 'optim', 'train', 'decoding', 'data', 'checkpoint', "
            "'fast', 'gpu', 'hf', 'interop', 'parallel'):\n"
            "    assert getattr(npformer, name).__name__ == 'npformer.' + name, name\n"
            "assert 'torch' not in sys.modules, 'import npformer imported torch'\n"
            "try:\n    npformer.no_such_thing\nexcept AttributeError:\n    pass\n"
            "else:\n    raise AssertionError('no AttributeError')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
