"""The compiled kernels' on-disk cache (npformer.fast.compiler): a kernel compiles once per
machine and version.

* Two fresh processes run every kernel in both dtypes against one empty cache
  (``NUMBA_CACHE_DIR``): the first compiles each, the second compiles none (numba's
  dispatcher statistics: no cache miss) and the cache holds the same files, of the same
  size.  (Kernels built inside a function missed the cache in every process: each
  process compiled them again and added a file.)
* An edit to the shared numerics that every kernel inlines (npformer/fast/numerics.py)
  makes the kernels compile again, though their own files did not change (numba
  stamps an entry with its own file only); with no edit, nothing compiles.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npformer.fast import compiler

ROOT = Path(__file__).resolve().parents[1]
needs_numba = pytest.mark.skipif(not compiler.COMPILED, reason="numba is not installed")

# Runs the ops of every kernel (both dtypes; or, with "gelu", the float32 GELU only) and
# prints each kernel's cache misses (compilations) and hits (loads) as JSON.
RUN_KERNELS = """
import json, sys, warnings
import numpy as np
from npformer import backend, fast, nn, ops
from npformer.fast import activations, adamw, compiled, compiler, streaming
from npformer.nn import Parameter
from npformer.parallel.sparse import changed_rows

rng = np.random.default_rng(0)
for dtype in (("float32",) if sys.argv[1] == "gelu" else ("float32", "float64")):
    x = rng.standard_normal((4, 8)).astype(dtype)
    y, c = fast.gelu_forward(x)
    fast.gelu_backward(x, c)
    if sys.argv[1] == "gelu":
        continue
    y, c = activations.gelu_tanh_forward(x)
    activations.gelu_tanh_backward(x, c)
    y, c = fast.layernorm_forward(x, x[0], x[0])
    fast.layernorm_backward(x, c)
    q = rng.standard_normal((2, 2, 9, 4)).astype(dtype)
    out, c = fast.attention_forward(q, q, q, ops.causal_mask(9, like=q))
    fast.attention_backward(out, c)
    loss, c = fast.cross_entropy_forward(x, np.array([1, 2, 3, 0]))
    fast.cross_entropy_backward(1.0, c)
    _, c = ops.embedding_forward(np.array([[1, 2]]), x)
    fast.embedding_backward(x[None, :2], c)
    p = Parameter(x.copy())
    p.grad = x.copy()
    fast.AdamW([p]).step()
    adamw.sum_of_squares(x.reshape(-1))
    changed_rows(x)
    y, c = fast.rmsnorm_forward(x, x[0])
    fast.rmsnorm_backward(x, c)
    h, c = fast.swiglu_forward(x, x)
    fast.swiglu_backward(x, c)
    cos, sin = ops.rotary_table(np.arange(9), 4, dtype=np.dtype(dtype))
    y, c = fast.rotary_forward(q, cos, sin)
    fast.rotary_backward(y, c)
    fast.rotary_forward(q.swapaxes(1, 2).copy().swapaxes(1, 2), cos, sin)  # heads as a view
    backend.set_default_float(dtype)  # the blocks' weights, for the forward compiled whole
    with nn.no_grad():
        xb, mask = rng.standard_normal((2, 9, 8)).astype(dtype), ops.causal_mask(9)
        block = fast.blocks.EncoderBlock(8, 2, 16, 0.0, "gelu", True)
        compiled.encoder_block_forward(block, xb, mask)
        compiled.encoder_stack_forward([block], None, xb, mask)
        compiled.llama_block_forward(fast.llama.LlamaBlock(8, 2, 16), xb, cos, sin, mask)
        rows = xb.reshape(-1, 8)  # the blocks' attention, run on its own (loaded on its own)
        compiled._attend(rows, rows, rows, np.array([0, 9, 18]), np.ones((1, 1, 1, 1), bool), 2, 2)
        none = np.empty((1, 2, 0, 4), dtype)  # and after no cached position
        compiled._attend_after(rows, rows, rows, none, none, np.array([0, 9, 18]),
                               np.ones((1, 1, 1, 1), bool), 2, 2)
    side = int(np.ceil(np.sqrt(streaming.PARALLEL_WEIGHTS)))  # a decoding step's products:
    for k in (64, side):  # on one thread, then on every core
        streaming.streamed_product(x[:2, :1].repeat(k, 1).copy(), np.ones((k, k), dtype))
kernels = [getattr(sys.modules[module], name) for module, name in compiler.KERNELS]
sparse = sys.modules["npformer.parallel.sparse"]  # its row scan: compiled there, when it runs
kernels += [sparse._rows_with_bits] if sparse._compiled else []
print(json.dumps({k.__name__: [sum(k.stats.cache_misses.values()),
                               sum(k.stats.cache_hits.values())] for k in kernels}))
"""


def run_kernels(root: Path, cache: Path, which: str = "all") -> dict:
    """{kernel: [compilations, loads]} of one fresh process on the package in ``root``."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(root),
           "PYTHONWARNINGS": "ignore"}
    env.pop("NUMBA_DISABLE_JIT", None)
    out = subprocess.run([sys.executable, "-c", RUN_KERNELS, which], env=env, cwd=root,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def files(cache: Path) -> dict:
    return {str(p.relative_to(cache)): p.stat().st_size for p in cache.rglob("*") if p.is_file()}


@needs_numba
def test_a_second_process_compiles_nothing_and_the_cache_does_not_grow(tmp_path):
    first = run_kernels(ROOT, tmp_path)
    assert all(compiled >= 1 for compiled, _ in first.values()), first  # every kernel ran
    after_first = files(tmp_path)
    second = run_kernels(ROOT, tmp_path)
    assert {name: compiled for name, (compiled, _) in second.items() if compiled} == {}
    assert all(loads == first[name][0] for name, (_, loads) in second.items()), second
    assert files(tmp_path) == after_first  # the same files, the same sizes


@needs_numba
def test_an_edit_to_the_shared_numerics_compiles_the_kernels_again(tmp_path):
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT / "npformer", copy / "npformer",
                    ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    assert run_kernels(copy, cache, "gelu")["gelu_forward32"] == [1, 0]
    assert run_kernels(copy, cache, "gelu")["gelu_forward32"] == [0, 1]  # no edit: loaded
    numerics = copy / "npformer" / "fast" / "numerics.py"
    numerics.write_text(numerics.read_text() + "\n# an edit\n")
    assert run_kernels(copy, cache, "gelu")["gelu_forward32"] == [1, 0]  # compiled again
