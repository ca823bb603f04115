"""Per-op micro-benchmark of the fast tier's compiled kernels (npformer.fast.kernels).

For each op, on one thread (BLAS and torch limited to one), the best of ``--repeat``
timings in ms of:

* ``kernel``: the numba kernel as the fast tier calls it;
* ``numpy``: the NumPy statements it replaced (the fast tier's SciPy-erfc GELU, the
  textbook layer norm, the blocked attention's uncompiled softmax statements, the
  textbook's ``np.add.at``, AdamW parameter by parameter);
* ``torch``: PyTorch's op on the same data (``torch.nn.functional``, ``torch.optim.AdamW``
  with its default implementation),

and the ratios kernel/numpy and kernel/torch.  Sizes are the lm demo's
(``demos/generate.py``: B 12, T 64, D 128, MLP 512, 4 layers): GELU on (768, 512), layer
norm on (768, 128), the causal attention's masked softmax on one replica's half batch
of scores (6, 4, 64, 64), with each row cut where its masked keys begin and over whole
rows, the embedding's backward (and on the imdb demo's 8,192 positions of 64), AdamW
over the model's parameters.  ``--compile`` also times the
first call of every kernel in a fresh process with an empty numba cache (the compile)
and again with that cache filled (the load).

    python bench/kernels.py [--repeat 50] [--compile]
    python bench/kernels.py --ops     # where one rank's lm update goes, op by op

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


def gelu_cases(rng):
    import scipy.special
    import torch

    from npformer.fast import kernels

    x = rng.standard_normal((768, 512)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    phi = np.float32(0.5) * scipy.special.erfc(-np.float32(np.sqrt(0.5)) * x)
    tx = torch.from_numpy(x).requires_grad_(True)
    ty = torch.nn.functional.gelu(tx)
    tdy = torch.from_numpy(dy)

    def numpy_forward():  # the fast tier before: SciPy's erfc, then the product
        p = scipy.special.erfc(-np.float32(np.sqrt(0.5)) * x)
        p *= 0.5
        return x * p

    def numpy_backward():  # the textbook backward
        pdf = np.float32(1 / np.sqrt(2 * np.pi)) * np.exp(-0.5 * x * x)
        return dy * (phi + x * pdf)

    yield ("gelu forward (768, 512) f32", lambda: kernels.gelu_forward(x), numpy_forward,
           lambda: torch.nn.functional.gelu(tx.detach()))
    yield ("gelu backward (768, 512) f32", lambda: kernels.gelu_backward(dy, x),
           numpy_backward, lambda: torch.autograd.grad(ty, tx, tdy, retain_graph=True))


def layernorm_cases(rng):
    import torch

    from npformer import ops
    from npformer.fast import kernels

    x = rng.standard_normal((768, 128)).astype(np.float32)
    gamma, beta = (rng.standard_normal(128).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal(x.shape).astype(np.float32)
    _, x_hat, r = kernels.layernorm_forward(x, gamma, beta, 1e-5)
    _, cache = ops.layernorm_forward(x, gamma, beta)
    tx, tg, tb = (torch.from_numpy(a).requires_grad_(True) for a in (x, gamma, beta))
    ty = torch.nn.functional.layer_norm(tx, (128,), tg, tb)
    tdy = torch.from_numpy(dy)
    yield ("layernorm forward (768, 128) f32", lambda: kernels.layernorm_forward(
        x, gamma, beta, 1e-5), lambda: ops.layernorm_forward(x, gamma, beta),
        lambda: torch.nn.functional.layer_norm(tx.detach(), (128,), tg.detach(), tb.detach()))
    yield ("layernorm backward (768, 128) f32", lambda: kernels.layernorm_backward(
        dy, x_hat, r, gamma), lambda: ops.layernorm_backward(dy, cache),
        lambda: torch.autograd.grad(ty, (tx, tg, tb), tdy, retain_graph=True))


def embedding_cases(rng):
    """The embedding's backward on the lm demo's batch (768 positions of 128, 65 tokens)
    and the imdb demo's (8,192 positions of 64, 20,002 words): the compiled scatter-add,
    the textbook's ``np.add.at``, and torch's ``index_add_``."""
    import torch

    from npformer import ops
    from npformer.fast import kernels

    for rows, width, vocab in ((768, 128, 65), (8192, 64, 20_002)):
        ids = rng.integers(0, vocab, size=rows)
        dy = rng.standard_normal((rows, width)).astype(np.float32)
        _, cache = ops.embedding_forward(ids, np.zeros((vocab, width), np.float32))
        tids, tdy = torch.from_numpy(ids), torch.from_numpy(dy)

        def compiled(ids=ids, dy=dy, vocab=vocab, width=width):
            kernels.scatter_add_rows(ids, dy, np.zeros((vocab, width), np.float32))

        def with_torch(tids=tids, tdy=tdy, vocab=vocab, width=width):
            torch.zeros(vocab, width).index_add_(0, tids, tdy)

        yield (f"embedding backward ({rows}, {width}) V {vocab}", compiled,
               lambda dy=dy, cache=cache: ops.embedding_backward(dy, cache), with_torch)


def attention_cases(rng):
    """The masked softmax of the lm demo's causal attention, on one replica's half batch
    of scores (6, 4, 64, 64): the compiled kernel with each row cut where its masked
    keys begin (as the fast tier calls it), the same kernel over whole rows, the NumPy
    statements of the tier's uncompiled path, and torch's softmax of the masked scores."""
    import torch

    from npformer import ops
    from npformer.fast import attention as fast_attention
    from npformer.fast import kernels

    q = rng.standard_normal((6, 4, 64, 32)).astype(np.float32)
    mask = fast_attention._align(ops.causal_mask(64, like=q[0, 0]), 4)
    bias = ops.softmax.mask_bias(mask, np.float32)
    extents = fast_attention._key_extents(mask)
    (_, _, block_bias, row_keys), = fast_attention._blocks(q, q, extents, bias, 1 << 19)
    scores = q @ q.mT
    work, lse = scores.copy(), np.empty((6, 4, 64, 1), np.float32)
    scale = np.float32(1 / np.sqrt(32))
    tscores, tbias = torch.from_numpy(scores), torch.from_numpy(bias)

    def compiled(keys):
        work[...] = scores
        kernels.attention_softmax(work, block_bias, scale, lse, keys)

    def numpy_statements():
        work[...] = scores
        np.multiply(work, scale, out=work)
        e, _, total = fast_attention._stable_exp(work, block_bias)
        return e / total

    label = "attn softmax (6,4,64,64) f32"
    yield (label, lambda: compiled(row_keys), numpy_statements,
           lambda: torch.softmax(tscores * scale + tbias, dim=-1))
    yield (f"{label} whole rows", lambda: compiled(None), numpy_statements,
           lambda: torch.softmax(tscores * scale + tbias, dim=-1))


def adamw_cases(rng):
    import torch

    from npformer import engine
    from npformer.models import CausalLM, CausalLMConfig
    from npformer.optim import AdamW

    def model():
        return CausalLM(CausalLMConfig(vocab_size=65))  # the demo's d128, 4 heads, 4 layers

    optimizers = {}
    for tier in ("fast", "textbook"):
        engine.set_engine(tier)
        params = model().parameters()
        for p in params:
            p.grad = rng.standard_normal(p.shape).astype(p.data.dtype)
        optimizers[tier] = AdamW(params, lr=1e-3, weight_decay=0.1)
    engine.set_engine("fast")
    tparams = [torch.nn.Parameter(torch.from_numpy(p.data.copy()))
               for p in optimizers["fast"].params]
    for t in tparams:
        t.grad = torch.randn_like(t)
    topt = torch.optim.AdamW(tparams, lr=1e-3, weight_decay=0.1)
    count = sum(p.data.size for p in optimizers["fast"].params)
    yield (f"adamw, {len(tparams)} tensors, {count} values", optimizers["fast"].step,
           optimizers["textbook"].step, topt.step)


def report(cases, repeat: int) -> None:
    print(f"{'op':<40} {'kernel':>8} {'numpy':>8} {'torch':>8} {'k/numpy':>8} {'k/torch':>8}")
    for name, kernel, numpy_version, torch_version in cases:
        k, n, t = (best_ms(fn, repeat) for fn in (kernel, numpy_version, torch_version))
        print(f"{name:<40} {k:8.3f} {n:8.3f} {t:8.3f} {k / n:8.2f} {k / t:8.2f}")


FIRST_CALLS = """
import time, numpy as np
start = time.perf_counter()
from npformer.fast import kernels
from npformer.optim import adam_flat_update
imported = time.perf_counter()
for dtype in (np.float32, np.float64):
    x = np.ones((4, 8), dtype)
    kernels.gelu_forward(x); kernels.gelu_backward(x, x)
    _, xh, r = kernels.layernorm_forward(x, x[0], x[0], 1e-5)
    kernels.layernorm_backward(x, xh, r, x[0])
    f = x.reshape(-1)
    adam_flat_update(f, f.copy(), f.copy(), f.copy(), np.zeros((0, 2), np.int64), 1.0, 0.9,
                     0.999, 1e-8, 1e-3, 0.5)
    kernels.sum_of_squares(f)
    scores = np.ones((1, 2, 3, 4), dtype)
    kernels.attention_softmax(scores, None, 0.5, np.ones((1, 2, 3, 1), dtype))
    kernels.attention_softmax(scores, scores[0, 0], 0.5, np.ones((1, 2, 3, 1), dtype))
    kernels.attention_probabilities(scores, scores[0, 0], 0.5, np.ones((1, 2, 3, 1), dtype))
    kernels.attention_softmax_backward(scores, scores, 0.5)
    _, lse = kernels.cross_entropy_rows(x, np.zeros(4, np.int64), 0.1)
    kernels.cross_entropy_grad(x, lse, np.zeros(4, np.int64), lse, 0.1)
    kernels.scatter_add_rows(np.zeros(4, np.int64), x, np.zeros((2, 8), dtype))
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
    """Median ms of the lm demo's update (B 12, T 64, the demo's model and optimizer)."""
    from npformer.models import CausalLM, CausalLMConfig
    from npformer.optim import AdamW, clip_grad_norm, warmup_cosine
    from npformer.parallel import DataParallel
    from npformer.tasks import LanguageModeling

    rng = np.random.default_rng(0)
    model = CausalLM(CausalLMConfig(vocab_size=65))
    opt = AdamW(model.parameters(), lr=warmup_cosine(1e-3, 100, 2000, min_lr=1e-4),
                betas=(0.9, 0.99), weight_decay=0.1)
    engine, task = DataParallel(model, replicas), LanguageModeling()
    times = []
    for i in range(steps + 3):
        ids = rng.integers(0, 65, size=(12, 65))
        start = time.perf_counter()
        opt.zero_grad()
        engine.loss_and_grad(task, (ids[:, :-1], ids[:, 1:]), 1.0, seed=i)
        clip_grad_norm(model.named_parameters(), 1.0)
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
        dy, w = args[0], args[1].saved[1]
        return 4 * dy.size * w.shape[0]
    return 0


def op_times(steps: int) -> tuple[float, dict, int]:
    """(median ms of a step, {op: mean ms a step}, the linear layers' products' floating-
    point operations a step) of the lm demo's update on one rank's share of its batch
    (B 6: the demo runs 2 ranks), one thread: the demo's own ``Trainer.update()``
    (bench.measure), every op of the fast tier and the optimizer's kernels timed where
    the layers call them (an op inside another counts as its caller's)."""
    import collections

    from bench.configs import CONFIGS
    from bench.measure import prepare_npformer
    from npformer import engine, fast

    spent, depth, flops = collections.Counter(), [0], collections.Counter()

    def timed_op(module, name):
        op = getattr(module, name)

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

    names = [(fast, n) for n in dir(fast) if n.endswith(("_forward", "_backward"))]
    names += [(engine, n) for n in ("loss_backward_over_logits", "adamw_flat",
                                    "sum_of_squares")]
    originals = [(module, name, getattr(module, name)) for module, name in names]
    for module, name in names:
        setattr(module, name, timed_op(module, name))
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
    report([*gelu_cases(rng), *layernorm_cases(rng), *attention_cases(rng),
            *embedding_cases(rng), *adamw_cases(rng)],
           args.repeat)
    if args.compile:
        compile_times()


if __name__ == "__main__":
    main()
