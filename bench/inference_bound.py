#!/usr/bin/env python
"""The ceiling of npformer's lm inference on this CPU: the benchmark's lm forward with
no Python between its operations, so that two thread replicas never wait on the GIL.

    python bench/inference_bound.py              # 5 rounds of 20 timed forwards, 2 threads
    python bench/inference_bound.py --smoke      # tiny, 1 round of 1: a check that it runs

Issue 19 asks for npformer's inference at 0.8x PyTorch's on the demos' configurations.
On lm, npformer's forward runs its matrix products at the core's peak (as fast as
PyTorch's), and two thread replicas lose time waiting for the GIL between NumPy calls.
This script measures how far removing all of that could go: the lm configuration's
model (bench/configs.py, the demo's own initial weights), its whole forward compiled
as one numba kernel per block (``nogil``: products through BLAS from inside the kernel,
the fast tier's layer norm, GELU and exp kernels, a causal softmax that skips the
masked half, Q, K and V as one product), checked equal to the model's own forward, and
timed on the benchmark's batch in 2 thread replicas, each with single-threaded BLAS.

It is a measurement, not a code path: nothing in npformer uses it.  Three sides, each in
a fresh process (``--worker``), the rounds taking turns as in bench/bench.py:

* ``pytorch``: bench/bench.py's PyTorch reference, 2 threads, ``inference_mode``;
* ``npformer``: bench/bench.py's npformer inference (2 thread replicas, fast tier);
* ``compiled``: the compiled forward, 2 threads (a kept pool, each on half the batch).

The compiled forward is faster than anything npformer's layers could run (no
validation, no allocation between ops, one product for Q, K and V); if it does not
reach 0.8x PyTorch, npformer's forward cannot either on this machine.  It needs numba
and SciPy (numba's ``np.dot`` calls SciPy's BLAS).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:  # `python bench/inference_bound.py`: the bench package
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench import runner  # noqa: E402
from bench.configs import CONFIGS, SEED, SMOKE, make_batch  # noqa: E402
from bench.measure import RESULT_PREFIX, prepare_npformer, side_library, timed, warm_up  # noqa: E402
from bench.report import cpu_model  # noqa: E402

SIDES = ("pytorch", "npformer", "compiled")
THREADS = 2


# =========================================================================== the kernels
def compiled_kernels():
    """(block, norm): one pre-norm GELU block's forward and the layer norm (the final one),
    compiled without the GIL."""
    import numba

    from npformer.fast import activations, compiler, numerics
    from npformer.fast import layernorm as fast_layernorm

    if not compiler.COMPILED:
        raise SystemExit("inference_bound.py needs numba (the fast tier's compiler)")
    layernorm = fast_layernorm._layernorm_forward  # (x, gamma, beta, eps, y, x_hat, r), in place
    gelu, exp, max8, sum4 = (activations.gelu_forward32, numerics.exp32, numerics.max8,
                             numerics.sum4)
    jit = numba.njit(nogil=True, cache=False, fastmath={"contract"})

    @jit
    def norm(x, gamma, beta, eps):
        """x (N, D) -> LN(x) (N, D)."""
        y, x_hat = np.empty_like(x), np.empty_like(x)
        r = np.empty((x.shape[0], 1), x.dtype)
        layernorm(x, gamma, beta, eps, y, x_hat, r)
        return y

    @jit
    def add_bias(y, bias):
        """y (N, F) += bias (F,), in place."""
        for i in range(y.shape[0]):
            for j in range(y.shape[1]):
                y[i, j] += bias[j]

    @jit
    def causal_attention(qkv, batch, length, heads, out):
        """qkv (B T, 3 D) -> out (B T, D): softmax(Q K^T / sqrt(E), causal) V per head."""
        width = out.shape[1]
        e = width // heads
        scale = np.float32(1.0 / math.sqrt(e))
        q = np.empty((length, e), np.float32)   # (T, E), scaled
        kt = np.empty((e, length), np.float32)  # (E, T)
        v = np.empty((length, e), np.float32)   # (T, E)
        for b in range(batch):
            for h in range(heads):
                for t in range(length):
                    row = b * length + t
                    for j in range(e):
                        q[t, j] = qkv[row, h * e + j] * scale
                        kt[j, t] = qkv[row, width + h * e + j]
                        v[t, j] = qkv[row, 2 * width + h * e + j]
                p = np.dot(q, kt)  # (T, T) scores
                for t in range(length):
                    keys = p[t, :t + 1]  # the causal past; the rest gets probability 0
                    top = max8(keys, np.float32(-np.inf))
                    for j in range(t + 1):
                        keys[j] = exp(keys[j] - top)
                    inverse = np.float32(1.0) / np.float32(sum4(keys, keys, 0))
                    for j in range(t + 1):
                        keys[j] *= inverse
                    p[t, t + 1:] = 0
                o = np.dot(p, v)  # (T, E)
                for t in range(length):
                    for j in range(e):
                        out[b * length + t, h * e + j] = o[t, j]

    @jit
    def block(x, batch, length, heads, eps, g1, b1, w_qkv, b_qkv, w_o, b_o, g2, b2, w1, c1,
              w2, c2):
        """x (B T, D) -> x + attn(LN1 x), then + FFN(LN2 .) (B T, D)."""
        qkv = np.dot(norm(x, g1, b1, eps), w_qkv)  # (B T, 3 D)
        add_bias(qkv, b_qkv)
        heads_out = np.empty_like(x)
        causal_attention(qkv, batch, length, heads, heads_out)
        y = np.dot(heads_out, w_o)
        add_bias(y, b_o)
        y += x
        hidden = np.dot(norm(y, g2, b2, eps), w1)  # (B T, D_ff)
        add_bias(hidden, c1)
        activated = np.empty_like(hidden)
        gelu(hidden.reshape(-1), activated.reshape(-1))
        z = np.dot(activated, w2)
        add_bias(z, c2)
        z += y
        return z

    return block, norm


def compiled_forward(model):
    """ids (B, T) -> logits (B, T, V): ``model`` (the lm: pre-norm GELU blocks, learned
    positions, tied embedding) as the compiled kernels, from its weights."""
    block, norm = compiled_kernels()
    w = {name: np.ascontiguousarray(p.data) for name, p in model.named_parameters()}
    heads, eps = model.blocks[0].self_attn.num_heads, float(model.norm.eps)
    layers = []
    for i in range(len(model.blocks)):
        def get(suffix, i=i):
            return w[f"blocks.{i}.{suffix}"]
        qkv = [get(f"self_attn.{n}_proj.weight") for n in "qkv"]
        qkv_bias = [get(f"self_attn.{n}_proj.bias") for n in "qkv"]
        layers.append((get("attn_residual.norm.weight"), get("attn_residual.norm.bias"),
                       np.concatenate(qkv, axis=1), np.concatenate(qkv_bias),
                       get("self_attn.out_proj.weight"), get("self_attn.out_proj.bias"),
                       get("ffn_residual.norm.weight"), get("ffn_residual.norm.bias"),
                       get("ffn.linear1.weight"), get("ffn.linear1.bias"),
                       get("ffn.linear2.weight"), get("ffn.linear2.bias")))
    tokens, positions = w["embed.tokens.weight"], w["embed.positions.weight"]
    tokens_t = np.ascontiguousarray(tokens.T)  # (D, V)

    def forward(ids):
        b, t = ids.shape
        x = np.ascontiguousarray((tokens[ids] + positions[:t]).reshape(b * t, -1))
        for weights in layers:
            x = block(x, b, t, heads, eps, *weights)
        h = norm(x, w["norm.weight"], w["norm.bias"], eps)
        return np.dot(h, tokens_t).reshape(b, t, -1)

    return forward


# =========================================================================== the worker
def compiled_side(cfg: dict, weights: str, warmup: int, steps: int) -> dict:
    """The compiled forward on the benchmark's batch, checked against the model's."""
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_limits

    from npformer import no_grad
    from npformer.nn import evaluating

    run = prepare_npformer(cfg, SEED, weights, THREADS)
    model = run.model
    forward = compiled_forward(model)
    ids = np.asarray(make_batch(cfg, SEED + 1)[0])  # (B, T), the benchmark's batch
    shards = np.array_split(ids, THREADS)
    with evaluating(model), no_grad():
        expected = np.asarray(model(ids))
    got = np.concatenate([forward(s) for s in shards])  # compiles; loads SciPy's BLAS
    threadpool_limits(1)  # every BLAS now loaded, SciPy's included: one thread each
    difference = float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))
    pool = ThreadPoolExecutor(THREADS)
    times = timed(lambda: list(pool.map(forward, shards)), warmup, steps)
    return dict(infer_times=times, max_relative_difference=difference)


def worker(spec: dict) -> int:
    side, cfg = spec["side"], spec["config"]
    if side == "compiled":
        result = compiled_side(cfg, spec["weights"], spec["warmup"], spec["steps"])
    else:
        prepare, _ = side_library(side, THREADS)
        warm_up(prepare, cfg["kind"], SEED)
        run = prepare(cfg, SEED, spec["weights"])
        run.model.eval()
        result = dict(infer_times=timed(run.infer, spec["warmup"], spec["steps"]))
    sys.stdout.write(RESULT_PREFIX + json.dumps(dict(result, side=side)) + "\n")
    return 0


# =========================================================================== the runs
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5; smoke 1)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed forwards per side and round (default 20; smoke 1)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed forwards before them (default 3; smoke 0)")
    p.add_argument("--smoke", action="store_true", help="the lm smoke preset, 1 round of 1")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    defaults = (1, 1, 0) if args.smoke else (5, 20, 3)
    rounds, steps, warmup = (default if given is None else given for given, default in
                             zip((args.rounds, args.steps, args.warmup), defaults))
    if rounds < 1 or steps < 1 or warmup < 0:
        p.error(f"--rounds and --steps must be at least 1 and --warmup at least 0, got "
                f"{rounds}, {steps} and {warmup}")
    cfg = SMOKE["lm"] if args.smoke else CONFIGS["lm"]
    env = runner.worker_env(THREADS)
    times = {side: [] for side in SIDES}
    difference = None
    with tempfile.TemporaryDirectory(prefix="npformer-bound-") as tmp:
        weights = str(Path(tmp) / "init.npz")
        for _ in range(rounds):
            for side in SIDES:  # PyTorch first: it writes the weights the others load
                spec = dict(side=side, config=cfg, weights=weights, warmup=warmup, steps=steps)
                result = runner.run_worker(Path(__file__).resolve(), spec, env)
                if "error" in result:
                    print(f"{side}: {result['error']}")
                    return 1
                times[side] += result["infer_times"]
                difference = result.get("max_relative_difference", difference)
    median = {side: statistics.median(t) for side, t in times.items()}
    print(f"machine: {cpu_model()}; lm inference, batch {cfg['batch']} x {cfg['seq_len']}, "
          f"{THREADS} threads, {rounds} rounds of {steps} forwards, the sides taking turns")
    print(f"compiled forward = model's forward within {difference:.1e} (max |difference| / "
          "max |logit|)")
    for side in SIDES:
        print(f"  {side:<9} {median[side] * 1e3:7.2f} ms   "
              f"{median[side] / median['pytorch']:.2f}x PyTorch")
    return 0 if difference < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
