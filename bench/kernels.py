"""Each compiled kernel of the fast tier checked against its textbook op and timed.

One row per case, on one thread (BLAS and torch limited to one):

* ``error``: the fast op's result against the textbook op's on the case's inputs, by the
  rule its test in tests/ uses (tests/test_fast_equals_textbook.py, tests/test_kernels.py):
  the largest difference relative to the size of the terms the formula adds (GELU,
  layer norm, attention) or to the largest element (the loss), at the float32
  tolerance of that test; 0 where the test asks for the same bits (the embedding's
  backward, AdamW).  The script exits 1 if any case exceeds its tolerance, naming it
  on stderr;
* the best of ``--repeat`` timings in ms of ``kernel`` (the numba kernel as the fast
  tier calls it), ``numpy`` (the NumPy statements it replaced: the fast tier's
  SciPy-erfc GELU, the textbook layer norm, loss and ``np.add.at``, the blocked
  attention's uncompiled softmax statements, AdamW parameter by parameter) and
  ``torch`` (PyTorch's op on the same data: ``torch.nn.functional``, ``index_add_``,
  ``torch.optim.AdamW`` with its default implementation), and the ratios kernel/numpy
  and kernel/torch.

Sizes are the lm demo's (``demos/generate.py``: B 12, T 64, D 128, MLP 512, 4 layers,
vocabulary 65): GELU on (768, 512), layer norm on (768, 128), the causal attention's
masked softmax on one replica's half batch of scores (6, 4, 64, 64), with each row cut
where its masked keys begin and over whole rows, the loss on (768, 65) logits, the
embedding's backward (and on the imdb demo's 8,192 positions of 64), AdamW over the
model's parameters.  ``--compile`` also times the first call of every kernel in a fresh
process with an empty numba cache (the compile) and again with that cache filled (the
load).

    python bench/kernels.py [--repeat 50] [--compile]
    python bench/kernels.py --op layernorm   # one op: gelu, layernorm, attention,
                                             # cross_entropy, embedding, adamw,
                                             # rmsnorm, swiglu, rotary
    python bench/kernels.py --ops            # where one rank's lm update goes, op by op

Prints the CPU model and NumPy's BLAS first.  On a shared machine, compare ratios taken
in one run, not absolute times across runs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

if __name__ == "__main__":  # this run's BLAS on one thread; an import changes nothing
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path[:1]:  # `python bench/kernels.py`: the bench package, not this file
    sys.path.insert(0, ROOT)
from bench.report import cpu_model  # noqa: E402  (the one CPU-name reader of the bench)


def blas_name() -> str:
    try:
        from threadpoolctl import threadpool_info

        infos = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        return ", ".join(f"{i['internal_api']} {i.get('version')}" for i in infos) or "unknown"
    except ImportError:
        return "unknown (threadpoolctl missing)"


def best_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


class Case(NamedTuple):
    """One row: what is timed, and the fast op checked against the textbook op."""

    name: str
    kernel: Callable
    numpy: Callable
    torch: Callable
    check: Callable[[], float]  # -> the error by the tests' rule
    tolerance: float  # the tests' float32 tolerance (0: the same bits)


def against_terms(tolerance, fast_values, textbook_values, terms) -> float:
    """The largest of tests.test_fast_equals_textbook.terms_diff over the outputs, with the
    floor that test's assert_equal_to_terms uses at ``tolerance``."""
    from tests.test_fast_equals_textbook import terms_diff

    return max(terms_diff(a, b, t, floor=float(np.finfo(b.dtype).tiny) / tolerance)
               for a, b, t in zip(fast_values, textbook_values, terms))


def same_bits(a: np.ndarray, b: np.ndarray) -> float:
    """0 where a and b are the same bits (NaN included), else their largest difference."""
    return 0.0 if np.array_equal(a, b, equal_nan=True) else float(np.max(np.abs(a - b)))


def gelu_cases(rng):
    import scipy.special
    import torch

    from npformer import fast, ops
    from npformer.fast.activations import gelu_backward_kernel, gelu_kernel
    from tests.test_fast_equals_textbook import gelu_terms

    x = rng.standard_normal((768, 512)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    phi = np.float32(0.5) * scipy.special.erfc(-np.float32(np.sqrt(0.5)) * x)
    tx = torch.from_numpy(x).requires_grad_(True)
    ty = torch.nn.functional.gelu(tx)
    tdy = torch.from_numpy(dy)

    def numpy_forward():  # the fast tier without numba: SciPy's erfc, then the product
        p = scipy.special.erfc(-np.float32(np.sqrt(0.5)) * x)
        p *= 0.5
        return x * p

    def numpy_backward():  # the textbook backward
        pdf = np.float32(1 / np.sqrt(2 * np.pi)) * np.exp(-0.5 * x * x)
        return dy * (phi + x * pdf)

    def check():
        (y_f, c_f), (y_t, c_t) = fast.gelu_forward(x), ops.gelu_forward(x)
        return against_terms(1e-6, [y_f, fast.gelu_backward(dy, c_f)],
                             [y_t, ops.gelu_backward(dy, c_t)], gelu_terms(x, dy))

    yield Case("gelu forward (768, 512) f32", lambda: gelu_kernel(x), numpy_forward,
               lambda: torch.nn.functional.gelu(tx.detach()), check, 1e-6)
    yield Case("gelu backward (768, 512) f32", lambda: gelu_backward_kernel(dy, x),
               numpy_backward, lambda: torch.autograd.grad(ty, tx, tdy, retain_graph=True),
               check, 1e-6)


def layernorm_cases(rng):
    import torch

    from npformer import fast, ops
    from npformer.fast.layernorm import layernorm_backward_kernel, layernorm_kernel
    from tests.test_fast_equals_textbook import layernorm_terms

    x = rng.standard_normal((768, 128)).astype(np.float32)
    gamma, beta = (rng.standard_normal(128).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal(x.shape).astype(np.float32)
    _, x_hat, r = layernorm_kernel(x, gamma, beta, 1e-5)
    _, cache = ops.layernorm_forward(x, gamma, beta)
    tx, tg, tb = (torch.from_numpy(a).requires_grad_(True) for a in (x, gamma, beta))
    ty = torch.nn.functional.layer_norm(tx, (128,), tg, tb)
    tdy = torch.from_numpy(dy)

    def check():
        (y_f, c_f), (y_t, c_t) = (tier.layernorm_forward(x, gamma, beta) for tier in (fast, ops))
        return against_terms(1e-5, [y_f, *fast.layernorm_backward(dy, c_f)],
                             [y_t, *ops.layernorm_backward(dy, c_t)],
                             layernorm_terms(x, gamma, beta, dy))

    yield Case("layernorm forward (768, 128) f32",
               lambda: layernorm_kernel(x, gamma, beta, 1e-5),
               lambda: ops.layernorm_forward(x, gamma, beta),
               lambda: torch.nn.functional.layer_norm(tx.detach(), (128,), tg.detach(),
                                                      tb.detach()), check, 1e-5)
    yield Case("layernorm backward (768, 128) f32",
               lambda: layernorm_backward_kernel(dy, x_hat, r, gamma),
               lambda: ops.layernorm_backward(dy, cache),
               lambda: torch.autograd.grad(ty, (tx, tg, tb), tdy, retain_graph=True), check,
               1e-5)


def rmsnorm_cases(rng):
    import torch

    from npformer import fast, ops
    from npformer.fast.rmsnorm import rmsnorm_backward_kernel, rmsnorm_kernel
    from tests.test_fast_equals_textbook import rmsnorm_terms

    x = rng.standard_normal((768, 576)).astype(np.float32)  # SmolLM2-135M's width
    weight = rng.standard_normal(576).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    _, x_hat, r = rmsnorm_kernel(x, weight, 1e-6)
    _, cache = ops.rmsnorm_forward(x, weight)
    tx, tw = (torch.from_numpy(a).requires_grad_(True) for a in (x, weight))
    ty = torch.nn.functional.rms_norm(tx, (576,), tw, 1e-6)
    tdy = torch.from_numpy(dy)

    def check():
        (y_f, c_f), (y_t, c_t) = (tier.rmsnorm_forward(x, weight) for tier in (fast, ops))
        return against_terms(1e-5, [y_f, *fast.rmsnorm_backward(dy, c_f)],
                             [y_t, *ops.rmsnorm_backward(dy, c_t)],
                             rmsnorm_terms(x, weight, dy))

    yield Case("rmsnorm forward (768, 576) f32", lambda: rmsnorm_kernel(x, weight, 1e-6),
               lambda: ops.rmsnorm_forward(x, weight),
               lambda: torch.nn.functional.rms_norm(tx.detach(), (576,), tw.detach(), 1e-6),
               check, 1e-5)
    yield Case("rmsnorm backward (768, 576) f32",
               lambda: rmsnorm_backward_kernel(dy, x_hat, r, weight),
               lambda: ops.rmsnorm_backward(dy, cache),
               lambda: torch.autograd.grad(ty, (tx, tw), tdy, retain_graph=True), check, 1e-5)


def swiglu_cases(rng):
    import torch

    from npformer import fast, ops

    a, b, dh = (rng.standard_normal((768, 1536)).astype(np.float32) for _ in range(3))
    _, cache_f = fast.swiglu_forward(a, b)
    _, cache_t = ops.swiglu_forward(a, b)
    ta, tb = (torch.from_numpy(v).requires_grad_(True) for v in (a, b))
    th = torch.nn.functional.silu(ta) * tb
    tdh = torch.from_numpy(dh)

    def check():
        (h_f, c_f), (h_t, c_t) = (tier.swiglu_forward(a, b) for tier in (fast, ops))
        return max(float(np.max(np.abs(got - want) / (np.abs(want) + 1.0)))
                   for got, want in zip([h_f, *fast.swiglu_backward(dh, c_f)],
                                        [h_t, *ops.swiglu_backward(dh, c_t)]))

    yield Case("swiglu forward (768, 1536) f32", lambda: fast.swiglu_forward(a, b),
               lambda: ops.swiglu_forward(a, b),
               lambda: torch.nn.functional.silu(ta.detach()) * tb.detach(), check, 1e-6)
    yield Case("swiglu backward (768, 1536) f32", lambda: fast.swiglu_backward(dh, cache_f),
               lambda: ops.swiglu_backward(dh, cache_t),
               lambda: torch.autograd.grad(th, (ta, tb), tdh, retain_graph=True), check, 1e-6)


def rotary_cases(rng):
    import torch

    from npformer import fast, ops

    x = rng.standard_normal((12, 64, 9, 64)).astype(np.float32).transpose(0, 2, 1, 3)
    dy = rng.standard_normal(x.shape).astype(np.float32)  # (B, H, T, E): 9 heads of 64
    cos, sin = ops.rotary_table(np.arange(64), 64, dtype=np.float32)
    _, cache_f = fast.rotary_forward(x, cos, sin)
    _, cache_t = ops.rotary_forward(x, cos, sin)
    tx, tcos, tsin = torch.from_numpy(x).requires_grad_(True), torch.from_numpy(cos), \
        torch.from_numpy(sin)

    def torch_forward(t):  # transformers' apply_rotary_pos_emb
        return t * tcos + torch.cat((-t[..., 32:], t[..., :32]), dim=-1) * tsin

    ty = torch_forward(tx)
    tdy = torch.from_numpy(dy)

    def check():
        (y_f, c_f), (y_t, c_t) = (tier.rotary_forward(x, cos, sin) for tier in (fast, ops))
        return max(same_bits(y_f, y_t),
                   same_bits(fast.rotary_backward(dy, c_f), ops.rotary_backward(dy, c_t)))

    yield Case("rotary forward (12,9,64,64) f32", lambda: fast.rotary_forward(x, cos, sin),
               lambda: ops.rotary_forward(x, cos, sin), lambda: torch_forward(tx.detach()),
               check, 0.0)
    yield Case("rotary backward (12,9,64,64) f32", lambda: fast.rotary_backward(dy, cache_f),
               lambda: ops.rotary_backward(dy, cache_t),
               lambda: torch.autograd.grad(ty, tx, tdy, retain_graph=True), check, 0.0)


def attention_cases(rng):
    """The masked softmax of the lm demo's causal attention, on one replica's half batch
    of scores (6, 4, 64, 64): the compiled kernel with each row cut where its masked
    keys begin (as the fast tier calls it), the same kernel over whole rows, the NumPy
    statements of the tier's uncompiled path, and torch's softmax of the masked scores.
    Checked: the fast attention op (forward and backward) against the textbook's."""
    import torch

    from npformer import fast, ops
    from npformer.fast import attention as fast_attention
    from npformer.ops.masks import align_mask
    from tests.test_fast_equals_textbook import attention_terms

    q = rng.standard_normal((6, 4, 64, 32)).astype(np.float32)
    k, v, dout = (rng.standard_normal(q.shape).astype(np.float32) for _ in range(3))
    mask = align_mask(ops.causal_mask(64, like=q[0, 0]), 4)
    bias = ops.softmax.mask_bias(mask, np.float32)
    extents = fast_attention._key_extents(mask)
    (_, _, block_bias, row_keys), = fast_attention._blocks(q, q, extents, bias, 1 << 19)
    scores = q @ q.mT
    work, lse = scores.copy(), np.empty((6, 4, 64, 1), np.float32)
    scale = np.float32(1 / np.sqrt(32))
    tscores, tbias = torch.from_numpy(scores), torch.from_numpy(bias)

    def compiled(keys):
        work[...] = scores
        fast_attention.attention_softmax(work, block_bias, scale, lse, keys)

    def numpy_statements():
        work[...] = scores
        np.multiply(work, scale, out=work)
        e, _, total = fast_attention._stable_exp(work, block_bias)
        return e / total

    def check():
        (out_f, c_f), (out_t, c_t) = (tier.attention_forward(q, k, v, mask)
                                      for tier in (fast, ops))
        return against_terms(1e-5, [out_f, *fast.attention_backward(dout, c_f)],
                             [out_t, *ops.attention_backward(dout, c_t)],
                             attention_terms(q, k, v, mask, dout))

    label = "attn softmax (6,4,64,64) f32"
    yield Case(label, lambda: compiled(row_keys), numpy_statements,
               lambda: torch.softmax(tscores * scale + tbias, dim=-1), check, 1e-5)
    yield Case(f"{label} whole rows", lambda: compiled(None), numpy_statements,
               lambda: torch.softmax(tscores * scale + tbias, dim=-1), check, 1e-5)


def cross_entropy_cases(rng):
    """The loss on the lm demo's (768, 65) logits: the compiled rows (forward) and
    gradient (backward) against the textbook op and torch's cross_entropy."""
    import torch

    from npformer import fast, ops
    from npformer.fast.losses import cross_entropy_grad, cross_entropy_rows
    from tests.helpers import rel_diff

    z = (rng.standard_normal((768, 65)) * 3).astype(np.float32)
    targets = rng.integers(0, 65, size=768)
    targets64 = targets.astype(np.int64)
    _, lse = cross_entropy_rows(z, targets64, 0.0)
    weight = np.full(768, 1 / 768, np.float32)
    _, cache = ops.cross_entropy_forward(z, targets)
    tz, tt = torch.from_numpy(z).requires_grad_(True), torch.from_numpy(targets)
    tloss = torch.nn.functional.cross_entropy(tz, tt)

    def check():
        (loss_f, c_f), (loss_t, c_t) = (tier.cross_entropy_forward(z, targets)
                                        for tier in (fast, ops))
        return max(rel_diff(loss_f, loss_t), rel_diff(fast.cross_entropy_backward(1.0, c_f),
                                                      ops.cross_entropy_backward(1.0, c_t)))

    yield Case("cross-entropy forward (768, 65) f32",
               lambda: cross_entropy_rows(z, targets64, 0.0),
               lambda: ops.cross_entropy_forward(z, targets),
               lambda: torch.nn.functional.cross_entropy(tz.detach(), tt), check, 1e-6)
    yield Case("cross-entropy backward (768, 65) f32",
               lambda: cross_entropy_grad(z, lse, targets64, weight, 0.0),
               lambda: ops.cross_entropy_backward(1.0, cache),
               lambda: torch.autograd.grad(tloss, tz, retain_graph=True), check, 1e-6)


def embedding_cases(rng):
    """The embedding's backward on the lm demo's batch (768 positions of 128, 65 tokens)
    and the imdb demo's (8,192 positions of 64, 20,002 words): the compiled scatter-add,
    the textbook's ``np.add.at``, and torch's ``index_add_``."""
    import torch

    from npformer import fast, ops
    from npformer.fast.embedding import scatter_add_rows

    for rows, width, vocab in ((768, 128, 65), (8192, 64, 20_002)):
        ids = rng.integers(0, vocab, size=rows)
        dy = rng.standard_normal((rows, width)).astype(np.float32)
        _, cache = ops.embedding_forward(ids, np.zeros((vocab, width), np.float32))
        tids, tdy = torch.from_numpy(ids), torch.from_numpy(dy)

        def compiled(ids=ids, dy=dy, vocab=vocab, width=width):
            scatter_add_rows(ids, dy, np.zeros((vocab, width), np.float32))

        def with_torch(tids=tids, tdy=tdy, vocab=vocab, width=width):
            torch.zeros(vocab, width).index_add_(0, tids, tdy)

        def check(dy=dy, cache=cache):
            return same_bits(fast.embedding_backward(dy, cache), ops.embedding_backward(dy, cache))

        yield Case(f"embedding backward ({rows}, {width}) V {vocab}", compiled,
                   lambda dy=dy, cache=cache: ops.embedding_backward(dy, cache), with_torch,
                   check, 0.0)


def adamw_cases(rng):
    import torch

    from npformer import fast, models, optim
    from npformer.nn import Parameter

    tiers = {"fast": (fast.CausalLM, fast.AdamW),  # one flat buffer
             "textbook": (models.CausalLM, optim.AdamW)}  # per tensor
    config = models.CausalLMConfig(vocab_size=65)  # the demo's d128, 4 heads, 4 layers

    optimizers = {}
    for tier, (model_class, adamw) in tiers.items():
        params = model_class(config).parameters()
        for p in params:
            p.grad = rng.standard_normal(p.shape).astype(p.data.dtype)
        optimizers[tier] = adamw(params, lr=1e-3, weight_decay=0.1)
    tparams = [torch.nn.Parameter(torch.from_numpy(p.data.copy()))
               for p in optimizers["fast"].params]
    for t in tparams:
        t.grad = torch.randn_like(t)
    topt = torch.optim.AdamW(tparams, lr=1e-3, weight_decay=0.1)
    count = sum(p.data.size for p in optimizers["fast"].params)

    def check():  # three steps from the same weights and gradients, one buffer and per tensor
        runs = []
        for _, adamw in tiers.values():
            params = [Parameter(p.data.copy(), decay=p.decay) for p in optimizers["fast"].params]
            opt = adamw(params, lr=1e-3, weight_decay=0.1)
            for step in range(3):
                for p, source in zip(params, optimizers["fast"].params):
                    p.grad = source.grad * (step + 1)
                opt.step()
            runs.append(np.concatenate([p.data.reshape(-1) for p in params]))
        return same_bits(*runs)

    yield Case(f"adamw, {len(tparams)} tensors, {count} values", optimizers["fast"].step,
               optimizers["textbook"].step, topt.step, check, 0.0)


OPS = {"gelu": gelu_cases, "layernorm": layernorm_cases, "attention": attention_cases,
       "cross_entropy": cross_entropy_cases, "embedding": embedding_cases,
       "adamw": adamw_cases, "rmsnorm": rmsnorm_cases, "swiglu": swiglu_cases,
       "rotary": rotary_cases}


def report(cases, repeat: int) -> list[str]:
    """Print one row per case; -> the cases whose error exceeds their tolerance."""
    print(f"{'op':<40} {'error':>9} {'kernel':>8} {'numpy':>8} {'torch':>8} {'k/numpy':>8} "
          f"{'k/torch':>8}")
    failed = []
    for case in cases:
        error = case.check()
        if not error <= case.tolerance:  # NaN fails too
            failed.append(f"{case.name}: error {error:.2e} exceeds {case.tolerance:.0e}")
        k, n, t = (best_ms(fn, repeat) for fn in (case.kernel, case.numpy, case.torch))
        # significant digits, not decimals: a kernel 1000x faster shows its ratio, not 0.00
        print(f"{case.name:<40} {error:9.2e} {k:8.4g} {n:8.4g} {t:8.4g} {k / n:8.3g} "
              f"{k / t:8.3g}")
    return failed


FIRST_CALLS = """
import time, numpy as np
start = time.perf_counter()
from npformer.fast.activations import gelu_backward_kernel, gelu_kernel
from npformer.fast.adamw import adamw_flat_update, sum_of_squares
from npformer.fast.attention import (attention_probabilities, attention_softmax,
                                     attention_softmax_backward)
from npformer.fast.embedding import scatter_add_rows
from npformer.fast.layernorm import layernorm_backward_kernel, layernorm_kernel
from npformer.fast.losses import cross_entropy_grad, cross_entropy_rows
imported = time.perf_counter()
for dtype in (np.float32, np.float64):
    x = np.ones((4, 8), dtype)
    gelu_kernel(x); gelu_backward_kernel(x, x)
    _, xh, r = layernorm_kernel(x, x[0], x[0], 1e-5)
    layernorm_backward_kernel(x, xh, r, x[0])
    f = x.reshape(-1)
    adamw_flat_update(f, f.copy(), f.copy(), f.copy(), np.zeros((0, 2), np.int64), 1.0, 0.9,
                      0.999, 1e-8, 1e-3, 0.5)
    sum_of_squares(f)
    scores = np.ones((1, 2, 3, 4), dtype)
    attention_softmax(scores, None, 0.5, np.ones((1, 2, 3, 1), dtype))
    attention_softmax(scores, scores[0, 0], 0.5, np.ones((1, 2, 3, 1), dtype))
    attention_probabilities(scores, scores[0, 0], 0.5, np.ones((1, 2, 3, 1), dtype))
    attention_softmax_backward(scores, scores, 0.5)
    _, lse = cross_entropy_rows(x, np.zeros(4, np.int64), 0.1)
    cross_entropy_grad(x, lse, np.zeros(4, np.int64), lse, 0.1)
    scatter_add_rows(np.zeros(4, np.int64), x, np.zeros((2, 8), dtype))
print(f"{imported - start:.2f} {time.perf_counter() - imported:.2f}")
"""


def compile_times() -> None:
    """First calls of every kernel (both dtypes) in fresh processes: empty cache, then filled."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache,
               "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for label in ("cold cache (compile)", "warm cache (load)"):
            out = subprocess.run([sys.executable, "-c", FIRST_CALLS], env=env, check=True,
                                 capture_output=True, text=True).stdout.split()
            print(f"first calls, {label}: import {out[0]} s, all kernels' first calls {out[1]} s")


def lm_step_ms(replicas: int, steps: int) -> float:
    """Median ms of the lm demo's update (B 12, T 64, the demo's model and optimizer, on
    the fast tier as the demo runs them)."""
    from npformer import fast
    from npformer.models import CausalLMConfig
    from npformer.optim import warmup_cosine
    from npformer.parallel import DataParallel
    from npformer.train.tasks import LanguageModeling

    rng = np.random.default_rng(0)
    model = fast.CausalLM(CausalLMConfig(vocab_size=65))
    opt = fast.AdamW(model.parameters(), lr=warmup_cosine(1e-3, 100, 2000, min_lr=1e-4),
                     betas=(0.9, 0.99), weight_decay=0.1)
    workers, task = DataParallel(model, replicas), LanguageModeling()
    times = []
    for i in range(steps + 3):
        ids = rng.integers(0, 65, size=(12, 65))
        start = time.perf_counter()
        opt.zero_grad()
        workers.loss_and_grad(task, (ids[:, :-1], ids[:, 1:]), 1.0, seed=i)
        opt.clip_grad_norm(model.named_parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times[3:]))


def linear_flops(name: str, args: tuple) -> int:
    """Floating-point operations of the matrix products of one linear op call: forward
    x (N, D_in) @ w (D_in, D_out), 2 N D_in D_out; backward twice that (dx and dw)."""
    if name == "linear_forward":
        x, w = args[0], args[1]
        return 2 * x.size * w.shape[1]
    if name == "linear_backward":  # dy (N, D_out): the input may not be in the cache
        dy, w = args[0], args[1].values[1]
        return 4 * dy.size * w.shape[0]
    return 0


def op_times(steps: int) -> tuple[float, dict, int]:
    """(median ms of a step, {op: mean ms a step}, the linear layers' products' floating-
    point operations a step) of the lm demo's update on one rank's share of its batch
    (B 6: the demo runs 2 ranks), one thread: the demo's own ``Trainer.update()``
    (bench.measure), every op of the fast tier and the optimizer's kernels timed where
    the layers call them (an op inside another counts as its caller's)."""
    import collections
    import functools

    from bench.configs import CONFIGS
    from bench.measure import prepare_npformer
    from npformer import fast

    spent, depth, flops = collections.Counter(), [0], collections.Counter()

    def timed_op(module, name, op=None):
        op = getattr(module, name) if op is None else op

        @functools.wraps(op)  # its op_name, tier and contract: an op names itself by them
        def wrapper(*args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return op(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[name] += time.perf_counter() - start
                    flops["linear"] += linear_flops(name, args)
        return wrapper

    # each op where the fast layers look it up: in the module that defines it (the layers
    # call fast.linear.linear_forward ...), the optimizer's pass in fast.optim's namespace
    op_modules = (fast.activations, fast.attention, fast.dropout, fast.embedding,
                  fast.layernorm, fast.linear, fast.losses, fast.softmax)
    names = [(module, n) for module in op_modules for n in dir(module)
             if n.endswith(("_forward", "_backward")) and callable(getattr(module, n))]
    names += [(fast, "cross_entropy_with_gradient"), (fast.optim, "adamw_flat_update"),
              (fast.optim, "sum_of_squares")]
    # the ops a layer names as its class attribute `ops` (MultiHeadAttention's namespace)
    names += [(fast.blocks.attention_ops, n) for n in vars(fast.blocks.attention_ops)]
    originals = [(module, name, getattr(module, name)) for module, name in names]
    for module, name in names:
        setattr(module, name, timed_op(module, name))
    table = fast.activations.ACTIVATIONS  # the layers reach ReLU and GELU through it
    saved_table = dict(table)
    table.update({key: tuple(timed_op(None, op.__name__, op) for op in pair)
                  for key, pair in saved_table.items()})
    try:
        run = prepare_npformer(dict(CONFIGS["lm"], batch=CONFIGS["lm"]["batch"] // 2), 0, None)
        trainer = run.make_optimizer()
        for _ in range(3):
            run.step(trainer)
        spent.clear()
        flops.clear()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            run.step(trainer)
            times.append(time.perf_counter() - start)
    finally:
        for module, name, op in originals:
            setattr(module, name, op)
        table.update(saved_table)
    return (1e3 * float(np.median(times)), {name: 1e3 * t / steps for name, t in spent.items()},
            flops["linear"] // steps)


def gemm_gflops(repeat: int) -> float:
    """GFLOP/s of one bare (384, 128) @ (128, 512) float32 product (the lm demo's first
    feed-forward layer on one rank's half batch), best of ``repeat`` timings (at least
    20): the rate the linear layers' products can reach on this core."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((384, 128), dtype=np.float32)
    b = rng.standard_normal((128, 512), dtype=np.float32)
    return 2 * 384 * 128 * 512 / best_ms(lambda: a @ b, max(repeat, 20)) / 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=50, help="timings per op (best kept)")
    parser.add_argument("--compile", action="store_true", help="also time the compile")
    parser.add_argument("--step", action="store_true", help="time the lm demo's update")
    parser.add_argument("--ops", action="store_true",
                        help="where one rank's lm update goes, op by op")
    parser.add_argument("--op", choices=sorted(OPS),
                        help="check and time this op's kernels only")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.ops:
        step, ops, flops = op_times(args.repeat)
        print(f"CPU: {cpu_model()}; BLAS {blas_name()}; one thread; the lm demo's update on "
              f"one rank's half batch (B 6, T 64): {step:.2f} ms (median of {args.repeat})")
        for name, ms in sorted(ops.items(), key=lambda item: -item[1]):
            print(f"  {name:<28} {ms:7.3f} ms")
        print(f"  {'the rest (layers, Python)':<28} {step - sum(ops.values()):7.3f} ms "
              "(against the median step)")
        linear_ms = ops.get("linear_forward", 0.0) + ops.get("linear_backward", 0.0)
        print(f"linear layers: {flops / 1e9:.3f} GFLOP a step in their products, "
              f"{flops / linear_ms / 1e6:.1f} GFLOP/s with the ops' own work; one bare "
              f"(384, 128) @ (128, 512) product: {gemm_gflops(args.repeat):.1f} GFLOP/s")
        return
    if args.step:
        import npformer

        print(f"CPU: {cpu_model()}; BLAS {blas_name()}; npformer from {npformer.__file__}")
        for replicas in (1, 2):
            print(f"lm demo update, {replicas} replica(s): "
                  f"{lm_step_ms(replicas, args.repeat):.2f} ms (median of {args.repeat})")
        return
    import numba
    import torch

    torch.set_num_threads(1)
    print(f"CPU: {cpu_model()}; NumPy {np.__version__} with BLAS {blas_name()}; "
          f"numba {numba.__version__}; torch {torch.__version__}; one thread")
    rng = np.random.default_rng(0)
    chosen = [OPS[args.op]] if args.op else list(OPS.values())
    failed = report([case for cases in chosen for case in cases(rng)], args.repeat)
    if args.compile:
        compile_times()
    for line in failed:
        print(f"error: {line}", file=sys.stderr)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
