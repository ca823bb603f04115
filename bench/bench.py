#!/usr/bin/env python
"""npformer against a plain PyTorch reference: training step, inference, memory.

    python bench/bench.py                       # imdb, lm, seq2seq; 10 steps after 2 warmup
    python bench/bench.py --sweeps              # + sequence-length and batch-size sweeps (imdb)
    python bench/bench.py --smoke               # tiny sizes, 1 step: a CI check that it all runs
    python bench/bench.py --markdown            # + README-ready tables

Every (configuration, side) runs in a fresh subprocess (``--worker``, JSON on
stdout), one after the other, with the same environment (thread variables,
``GLIBC_TUNABLES``) on both sides.  The PyTorch side is a plain torch.nn model
written here (nn.Embedding, nn.TransformerEncoderLayer / DecoderLayer with
batch_first=True, norm_first=False, dropout 0, nn.Linear); it is built first, from
``torch.manual_seed(seed)``, and its initial weights are handed to the npformer
side (an .npz file, loaded with ``npformer.torch_interop.load_torch_state_dict``),
so both sides train the same model on the same batch and their first-step losses
must agree.  The npformer worker never imports torch.  Before anything is measured,
each worker runs one training step and one inference of a tiny model of the same
kind, so code loaded on first use (PyTorch imports ~800 modules, ~70 MiB, at its
first Adam step) is neither timed nor counted.

Memory: peak RSS growth during the measured steps, the same way on both sides:
``ru_maxrss`` after the steps minus the current RSS (``/proc/self/statm``) taken
right before the first step, once model and batch are built.  The optimizer is
built after that baseline on both sides (npformer allocates Adam's moments in its
constructor, PyTorch at its first step), so optimizer state is in the growth.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "BENCH_RESULT "
LOSS_RTOL = 1e-3
BUSY_LOAD = 0.5  # 1-minute load average above which the header warns that timings are noisy
NO_TRIM_TUNABLE = "glibc.malloc.mmap_threshold=4294967296"
PAD, BOS, EOS = 0, 2, 3
SEED = 0
LR = 1e-3

# --------------------------------------------------------------------------- configurations
# kind: which model; every size named the way the npformer configs name it.
CONFIGS = {
    "imdb": dict(kind="classifier", vocab_size=20_000, num_classes=2, d_model=128, num_heads=8,
                 num_layers=4, d_ff=512, seq_len=256, batch=32),
    "lm": dict(kind="causal_lm", vocab_size=65, d_model=128, num_heads=4, num_layers=4,
               d_ff=512, seq_len=64, batch=12),
    "seq2seq": dict(kind="seq2seq", src_vocab_size=8_000, tgt_vocab_size=8_000, d_model=256,
                    num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=1024,
                    src_len=16, seq_len=16, batch=128),
}
SMOKE = {
    "imdb": dict(CONFIGS["imdb"], vocab_size=200, d_model=16, num_heads=2, num_layers=1, d_ff=32,
                 seq_len=16, batch=4),
    "lm": dict(CONFIGS["lm"], d_model=16, num_heads=2, num_layers=1, d_ff=32, seq_len=16,
               batch=2),
    "seq2seq": dict(CONFIGS["seq2seq"], src_vocab_size=100, tgt_vocab_size=100, d_model=16,
                    num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=32, src_len=8,
                    seq_len=8, batch=4),
}
WARMUP_CONFIGS = {c["kind"]: c for c in SMOKE.values()}  # library warm-up, per model kind
SWEEP_TOKENS = 8192
SWEEP_LENGTHS = (64, 128, 256, 512, 1024)
SWEEP_BATCHES = (8, 16, 32, 64)
SMOKE_SWEEP_TOKENS = 64
SMOKE_SWEEP_LENGTHS = (8, 16)
SMOKE_SWEEP_BATCHES = (2, 4)

SIDES = ("pytorch", "npformer")  # PyTorch first: it writes the shared initial weights


def tokens_per_step(cfg: dict) -> int:
    """Token positions one step processes, padding included (seq2seq: source + target)."""
    return cfg["batch"] * (cfg["seq_len"] + cfg.get("src_len", 0))


# =========================================================================== worker side
def make_batch(cfg: dict, seed: int):
    """The same host NumPy batch on both sides (a fixed batch, reused every step)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    B, T = cfg["batch"], cfg["seq_len"]

    def padded(lengths, width, vocab, low):
        ids = np.full((len(lengths), width), PAD, dtype=np.int64)
        for b, n in enumerate(lengths):
            ids[b, :n] = rng.integers(low, vocab, size=n)
        return ids

    if cfg["kind"] == "classifier":
        lens = rng.integers(max(1, T // 4), T + 1, size=B).astype(np.int64)  # none fully padded
        return padded(lens, T, cfg["vocab_size"], 1), lens, rng.integers(0, cfg["num_classes"], B)
    if cfg["kind"] == "causal_lm":
        x = rng.integers(0, cfg["vocab_size"], size=(B, T + 1))
        return np.ascontiguousarray(x[:, :-1]), np.ascontiguousarray(x[:, 1:])
    S = cfg["src_len"]
    src_lens = rng.integers(max(1, S // 2), S + 1, size=B).astype(np.int64)
    tgt_lens = rng.integers(max(1, T // 2), T + 1, size=B).astype(np.int64)  # incl. <eos>
    src = padded(src_lens, S, cfg["src_vocab_size"], 4)
    body = padded(tgt_lens - 1, T, cfg["tgt_vocab_size"], 4)
    tgt_in = np.full((B, T), PAD, dtype=np.int64)
    tgt_out = np.full((B, T), PAD, dtype=np.int64)
    for b, n in enumerate(tgt_lens):
        tgt_in[b, :n] = [BOS, *body[b, :n - 1]]
        tgt_out[b, :n] = [*body[b, :n - 1], EOS]
    return src, src_lens, tgt_in, tgt_out, tgt_lens


def sinusoidal_table(max_len: int, width: int):
    """Sines in even columns, cosines in odd ones (the paper's table, npformer's layout)."""
    import numpy as np

    position = np.arange(max_len, dtype=np.float64)[:, None]
    column = np.arange(width)
    angle = position / (10000.0 ** ((column - column % 2) / width))[None, :]
    return np.where(column % 2 == 0, np.sin(angle), np.cos(angle)).astype(np.float32)


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure_training(make_optimizer, step, warmup: int, steps: int) -> dict:
    """Baseline RSS, optimizer, warmup + timed training steps, peak RSS."""
    import gc

    gc.collect()
    baseline = current_rss()
    optimizer = make_optimizer()
    losses, times = [], []
    for i in range(warmup + steps):
        started = time.perf_counter()
        losses.append(step(optimizer))
        elapsed = time.perf_counter() - started
        if i >= warmup:
            times.append(elapsed)
    peak = peak_rss()
    return dict(baseline_rss=baseline, peak_rss=peak, mem_growth=peak - baseline,
                losses=losses, train_times=times)


def timed(fn, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        started = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - started
        if i >= warmup:
            times.append(elapsed)
    return times


def torch_reference(cfg: dict):
    """The plain torch.nn model of ``cfg``, with npformer.torch_interop's attribute names."""
    import math

    import torch
    from torch import nn

    def encoder_layer():
        return nn.TransformerEncoderLayer(cfg["d_model"], cfg["num_heads"], cfg["d_ff"],
                                          dropout=0.0, activation="relu", layer_norm_eps=1e-5,
                                          batch_first=True, norm_first=False)

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["d_model"])
            self.pos_emb = nn.Embedding(cfg["seq_len"], cfg["d_model"])
            self.layers = nn.ModuleList(encoder_layer() for _ in range(cfg["num_layers"]))
            self.head = nn.Linear(cfg["d_model"], cfg["num_classes"])

        def forward(self, ids, valid_lens):
            x = self.tok_emb(ids) + self.pos_emb.weight[:ids.shape[1]][None]
            ignore = torch.arange(ids.shape[1])[None, :] >= valid_lens[:, None]  # True = pad
            for layer in self.layers:
                x = layer(x, src_key_padding_mask=ignore)
            valid = (~ignore)[:, :, None].to(x.dtype)
            pooled = (x * valid).sum(1) / valid_lens[:, None].to(x.dtype)  # mean over valid
            return self.head(pooled)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["d_model"])
            self.pos_emb = nn.Embedding(cfg["seq_len"], cfg["d_model"])
            self.layers = nn.ModuleList(encoder_layer() for _ in range(cfg["num_layers"]))
            self.lm_head = nn.Linear(cfg["d_model"], cfg["vocab_size"], bias=False)

        def forward(self, ids):
            T = ids.shape[1]
            x = self.tok_emb(ids) + self.pos_emb.weight[:T][None]
            causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)  # True = hidden
            for layer in self.layers:
                x = layer(x, src_mask=causal, is_causal=True)
            return self.lm_head(x)

    class Stack(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = nn.ModuleList(layers)

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg["d_model"]
            self.scale = math.sqrt(d)
            self.src_tok_emb = nn.Embedding(cfg["src_vocab_size"], d)
            self.tgt_tok_emb = nn.Embedding(cfg["tgt_vocab_size"], d)
            self.register_buffer("pe", torch.from_numpy(
                sinusoidal_table(max(cfg["src_len"], cfg["seq_len"]), d)), persistent=False)
            self.encoder = Stack(encoder_layer() for _ in range(cfg["num_encoder_layers"]))
            self.decoder = Stack(nn.TransformerDecoderLayer(
                d, cfg["num_heads"], cfg["d_ff"], dropout=0.0, activation="relu",
                layer_norm_eps=1e-5, batch_first=True, norm_first=False)
                for _ in range(cfg["num_decoder_layers"]))
            self.out_proj = nn.Linear(d, cfg["tgt_vocab_size"])

        def forward(self, src, tgt_in, src_lens, tgt_lens):
            S, T = src.shape[1], tgt_in.shape[1]
            src_ignore = torch.arange(S)[None, :] >= src_lens[:, None]
            tgt_ignore = torch.arange(T)[None, :] >= tgt_lens[:, None]
            causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
            x = self.src_tok_emb(src) * self.scale + self.pe[:S][None]
            for layer in self.encoder.layers:
                x = layer(x, src_key_padding_mask=src_ignore)
            y = self.tgt_tok_emb(tgt_in) * self.scale + self.pe[:T][None]
            for layer in self.decoder.layers:
                y = layer(y, x, tgt_mask=causal, tgt_key_padding_mask=tgt_ignore,
                          memory_key_padding_mask=src_ignore)
            return self.out_proj(y)

    return {"classifier": Classifier, "causal_lm": LM, "seq2seq": Seq2Seq}[cfg["kind"]]()


class Prepared:
    """One side's model on one batch: ``step(optimizer) -> loss`` and ``infer()``."""

    def __init__(self, model, make_optimizer, step, infer):
        self.model, self.make_optimizer, self.step, self.infer = (model, make_optimizer, step,
                                                                  infer)


def prepare_pytorch(cfg: dict, seed: int, weights: str | None) -> Prepared:
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    model = torch_reference(cfg).train()  # train(): dropout is 0 anyway
    if weights:
        np.savez(weights, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    batch = [torch.from_numpy(np.asarray(a)) for a in make_batch(cfg, seed + 1)]
    kind = cfg["kind"]

    def forward():
        if kind == "classifier":
            return model(batch[0], batch[1])
        if kind == "causal_lm":
            return model(batch[0])
        return model(batch[0], batch[2], batch[1], batch[4])

    def loss_fn(logits):
        if kind == "classifier":
            return F.cross_entropy(logits, batch[2])
        if kind == "causal_lm":
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))
        targets = torch.where(batch[3] == PAD, -100, batch[3])  # padding targets ignored
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100, label_smoothing=0.0)

    def step(optimizer):
        optimizer.zero_grad()
        loss = loss_fn(forward())
        loss.backward()
        optimizer.step()
        return loss.item()

    def infer():
        with torch.inference_mode():
            forward()

    return Prepared(model, lambda: torch.optim.Adam(model.parameters(), lr=LR), step, infer)


def prepare_npformer(cfg: dict, seed: int, weights: str | None, threads: int = 1) -> Prepared:
    """npformer's CPU path with ``threads`` cores: that many data-parallel replicas in
    threads, each with single-threaded BLAS (training), and the batch split the same way
    for inference."""
    import numpy as np

    from npformer import backend, no_grad, optim
    from npformer.parallel import DataParallel, parallel_map, split_batch
    from npformer.models import (CausalLM, CausalLMConfig, ClassifierConfig, Seq2SeqConfig,
                                 Seq2SeqTransformer, TransformerClassifier)
    from npformer.torch_interop import load_torch_state_dict
    from npformer.tasks import Classification, LanguageModeling, Translation

    backend.set_backend("numpy", seed=seed)
    backend.set_default_float("float32")
    kind = cfg["kind"]
    common = dict(d_model=cfg["d_model"], num_heads=cfg["num_heads"], d_ff=cfg["d_ff"],
                  dropout=0.0, activation="relu", norm_first=False)
    if kind == "classifier":
        model = TransformerClassifier(ClassifierConfig(
            vocab_size=cfg["vocab_size"], num_classes=cfg["num_classes"],
            num_layers=cfg["num_layers"], max_len=cfg["seq_len"], positional="learned",
            pooling="mean", pad_id=PAD, **common))
        task = Classification()
    elif kind == "causal_lm":
        model = CausalLM(CausalLMConfig(vocab_size=cfg["vocab_size"], block_size=cfg["seq_len"],
                                        num_layers=cfg["num_layers"], positional="learned",
                                        tie_weights=False, **common))
        task = LanguageModeling()
    else:
        model = Seq2SeqTransformer(Seq2SeqConfig(
            src_vocab_size=cfg["src_vocab_size"], tgt_vocab_size=cfg["tgt_vocab_size"],
            num_encoder_layers=cfg["num_encoder_layers"],
            num_decoder_layers=cfg["num_decoder_layers"],
            max_len=max(cfg["src_len"], cfg["seq_len"]), positional="sinusoidal",
            scale_embeddings=True, pad_id=PAD, bos_id=BOS, eos_id=EOS, **common))
        task = Translation(label_smoothing=0.0, pad_id=PAD)
    if weights:
        with np.load(weights) as f:
            load_torch_state_dict(model, {k: f[k] for k in f.files})
    model.train()
    batch = make_batch(cfg, seed + 1)
    parallel = DataParallel(model, threads)
    shards = [[backend.asarray(a) for a in shard] for shard in split_batch(tuple(batch), threads)]

    def step(optimizer):
        optimizer.zero_grad()
        loss, _ = parallel.loss_and_grad(task, batch, 1.0, seed=0)
        optimizer.step()
        return loss

    def forward(inputs):
        if kind == "classifier":
            return model(inputs[0], inputs[1])
        if kind == "causal_lm":
            return model(inputs[0])
        return model(inputs[0], inputs[2], inputs[1], inputs[4])

    def infer():
        with no_grad():
            parallel_map(forward, shards, threads)

    return Prepared(model, lambda: optim.Adam(model.parameters(), lr=LR), step, infer)


def run_side(spec: dict) -> dict:
    """Library warm-up on a tiny model, then the measured model: training, then inference."""
    import gc

    import numpy as np

    side, cfg, seed = spec["side"], spec["config"], spec["seed"]
    if side == "pytorch":
        import torch

        torch.set_num_threads(spec["threads"])
        prepare = prepare_pytorch
        info = dict(threads=torch.get_num_threads(), version=torch.__version__,
                    blas=_torch_blas(torch))
        weights = spec.get("weights")  # PyTorch writes the initial weights ...
        loaded = False
    else:
        try:  # the *_NUM_THREADS variables set by the parent already limit OpenBLAS
            from threadpoolctl import threadpool_limits

            threadpool_limits(spec["threads"])
        except ImportError:
            pass
        threads = spec["threads"]

        def prepare(cfg_, seed_, weights_):
            return prepare_npformer(cfg_, seed_, weights_, threads)
        info = dict(threads=threads, version=np.__version__, blas=_numpy_blas(np))
        weights = spec.get("weights")  # ... and npformer reads them, if they are there
        loaded = bool(weights) and os.path.exists(weights)
        weights = weights if loaded else None

    # One step and one inference of a tiny model of the same kind, so that code the
    # libraries load on first use (PyTorch imports ~800 modules, ~70 MiB, at its first
    # Adam step) is neither timed nor counted as step memory.
    tiny = prepare(WARMUP_CONFIGS[cfg["kind"]], seed, None)
    tiny.step(tiny.make_optimizer())
    tiny.model.eval()
    tiny.infer()
    del tiny
    gc.collect()

    run = prepare(cfg, seed, weights)
    result = measure_training(run.make_optimizer, run.step, spec["warmup"], spec["steps"])
    run.model.eval()  # npformer: no dropout masks; PyTorch: eval mode (may take fast paths)
    result["infer_times"] = timed(run.infer, spec["warmup"], spec["steps"])
    if side == "pytorch":
        params = sum(p.numel() for p in run.model.parameters())
    else:
        params = sum(int(np.prod(p.shape)) for p in run.model.parameters())
    result.update(info, params=params, weights_loaded=loaded)
    return result


def _torch_blas(torch) -> str:
    info = torch.__config__.show()
    m = re.search(r"BLAS_INFO=(\w+)", info)
    return m.group(1) if m else "?"


def _numpy_blas(np) -> str:
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # noqa: BLE001 - informational only
        return "?"


def worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    sys.path.insert(0, str(ROOT))
    result = run_side(spec)
    result["side"] = spec["side"]
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


# =========================================================================== parent side
def worker_env(args) -> dict:
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(args.threads)
    if args.allocator == "glibc-default":
        env.pop("GLIBC_TUNABLES", None)
    elif args.allocator == "keep-heap":
        env["GLIBC_TUNABLES"] = NO_TRIM_TUNABLE
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_worker(side: str, cfg: dict, args, weights: str | None) -> dict:
    spec = dict(side=side, config=cfg, steps=args.steps, warmup=args.warmup,
                threads=args.threads, seed=SEED, weights=weights)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker",
                           json.dumps(spec)], env=args.env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return dict(side=side, error=f"worker exited {proc.returncode}: {tail}")


def run_pair(cfg: dict, args) -> dict:
    """Both sides of one configuration, PyTorch first (it writes the initial weights)."""
    with tempfile.TemporaryDirectory(prefix="npformer-bench-") as tmp:
        weights = os.path.join(tmp, "init.npz")
        return {side: run_worker(side, cfg, args, weights) for side in SIDES}


# --------------------------------------------------------------------------- formatting
MiB = 2 ** 20


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds * 1e3 >= 10 else f"{seconds * 1e3:.2f}"


def spread(times: list[float]) -> str:
    return f"{ms(statistics.median(times))} ({ms(min(times))}-{ms(max(times))})"


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def mem_ratio(a: float, b: float) -> str:
    """Memory growths below 1 MiB are within the noise of RSS accounting: no ratio."""
    return ratio(a, b) if min(a, b) >= 1.0 else "n/a (<1 MiB)"


def summary(res: dict, cfg: dict) -> dict | None:
    if "error" in res:
        return None
    train = statistics.median(res["train_times"])
    return dict(train=train, infer=statistics.median(res["infer_times"]),
                tok_s=tokens_per_step(cfg) / train, mem=res["mem_growth"] / MiB,
                loss=res["losses"][0])


def mib(value: float) -> str:
    """RSS counters are kept per CPU and synced lazily: growths a few hundred KiB below
    zero are noise, shown as 0."""
    return f"{max(value, 0.0):.1f}"


def loss_check(pair: dict) -> tuple[str, bool]:
    ours, theirs = pair.get("npformer", {}), pair.get("pytorch", {})
    if "losses" not in ours or "losses" not in theirs:
        return "loss not compared (a side failed)", False
    if not ours.get("weights_loaded"):
        return "loss not compared (npformer did not get PyTorch's weights)", False
    a, b = ours["losses"][0], theirs["losses"][0]
    rel = abs(a - b) / max(abs(b), 1e-12)
    return f"first-step loss {a:.6f} vs {b:.6f} (rel diff {rel:.1e})", rel <= LOSS_RTOL


def describe(name: str, cfg: dict) -> str:
    if cfg["kind"] == "seq2seq":
        shape = (f"V {cfg['src_vocab_size']}/{cfg['tgt_vocab_size']}, d{cfg['d_model']}, "
                 f"{cfg['num_heads']} heads, {cfg['num_encoder_layers']}+"
                 f"{cfg['num_decoder_layers']} layers, FFN {cfg['d_ff']}, S=T={cfg['seq_len']}, "
                 f"B {cfg['batch']}, padding + causal masks")
    else:
        mask = "padding mask, mean pooling" if cfg["kind"] == "classifier" else "causal mask"
        shape = (f"V {cfg['vocab_size']}, d{cfg['d_model']}, {cfg['num_heads']} heads, "
                 f"{cfg['num_layers']} layers, FFN {cfg['d_ff']}, T {cfg['seq_len']}, "
                 f"B {cfg['batch']}, {mask}")
    return f"{name}: {shape}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_average() -> float | None:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def print_header(args, first: dict):
    py, npf = first.get("pytorch", {}), first.get("npformer", {})
    tunables = args.env.get("GLIBC_TUNABLES")
    print("npformer vs PyTorch (CPU, float32, post-norm, ReLU FFN, dropout 0, Adam lr 1e-3)")
    print(f"machine:   {cpu_model()}, {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} "
          f"usable); Python {platform.python_version()}")
    print(f"libraries: numpy {npf.get('version', '?')} ({npf.get('blas', '?')}), "
          f"torch {py.get('version', '?')} ({py.get('blas', '?')})")
    print(f"threads:   {args.threads} (torch.set_num_threads; NumPy: "
          f"{'threadpoolctl' if _has_threadpoolctl() else 'OMP/OPENBLAS/MKL_NUM_THREADS'}); "
          f"torch reports {py.get('threads', '?')}")
    if tunables:
        print(f"allocator: GLIBC_TUNABLES={tunables} (same environment for both sides)")
    else:
        print("allocator: GLIBC_TUNABLES not set: glibc default, allocations above the dynamic "
              "mmap threshold (up to 32 MiB) go back to the OS when freed (same environment for "
              "both sides; see --allocator)")
    print(f"timing:    median (min-max) of {args.steps} steps after {args.warmup} warmup; train "
          "= zero_grad + forward + loss + backward + Adam step; infer = forward only "
          "(npformer eval + no_grad, torch eval + inference_mode)")
    print("memory:    peak RSS growth = ru_maxrss after the training steps - current RSS "
          "(/proc/self/statm) before the first step, model and batch built (optimizer state "
          "is in the growth); each (config, side) in a fresh subprocess that first runs one "
          "step of a tiny model so lazily loaded library code is not counted; same method "
          "both sides")
    print("tokens/s:  token positions per training step (padding included; seq2seq counts "
          "source + target) / median step time")
    if args.load_at_start is not None:
        busy = args.load_at_start > BUSY_LOAD
        print(f"load:      1-minute load average {args.load_at_start:.2f} before the first worker"
              + (" -- WARNING: other processes are using the CPUs. A multi-threaded BLAS or "
                 "OpenMP region waits for its slowest thread, so a descheduled thread can "
                 "inflate step times many-fold (use an idle machine, or --threads 1)"
                 if busy else ""))


def _has_threadpoolctl() -> bool:
    import importlib.util

    return importlib.util.find_spec("threadpoolctl") is not None


def print_main_table(results: dict, cfgs: dict):
    cols = f"{'config':<9}{'side':<10}{'train ms (min-max)':>24}{'infer ms (min-max)':>24}" \
           f"{'tokens/s':>11}{'peak MiB':>10}{'first loss':>12}"
    print()
    print(cols)
    print("-" * len(cols))
    for name, pair in results.items():
        for side in SIDES:
            res = pair[side]
            if "error" in res:
                print(f"{name:<9}{side:<10}  FAILED: {res['error']}")
                continue
            s = summary(res, cfgs[name])
            print(f"{name:<9}{side:<10}{spread(res['train_times']):>24}"
                  f"{spread(res['infer_times']):>24}{s['tok_s']:>11,.0f}{mib(s['mem']):>10}"
                  f"{s['loss']:>12.5f}")
    print()
    print("ratios npformer / PyTorch (below 1 = npformer faster / smaller):")
    for name, pair in results.items():
        ours, theirs = summary(pair["npformer"], cfgs[name]), summary(pair["pytorch"], cfgs[name])
        if ours and theirs:
            line = (f"ratio {name:<8} train {ratio(ours['train'], theirs['train'])}  "
                    f"infer {ratio(ours['infer'], theirs['infer'])}  "
                    f"memory {mem_ratio(ours['mem'], theirs['mem'])}")
        else:
            line = f"ratio {name:<8} train n/a  infer n/a  memory n/a (a side failed)"
        text, ok = loss_check(pair)
        print(f"{line}  | {text}")
        if not ok and "not compared" not in text:
            print(f"WARNING: {name}: first-step losses differ by more than {LOSS_RTOL:g} "
                  "relative: the two sides are not computing the same model")


def print_markdown(results: dict, cfgs: dict):
    print()
    print("| config | npformer train ms | PyTorch train ms | ratio | npformer infer ms "
          "| PyTorch infer ms | ratio | npformer tokens/s | PyTorch tokens/s "
          "| npformer peak MiB | PyTorch peak MiB | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, pair in results.items():
        o, t = summary(pair["npformer"], cfgs[name]), summary(pair["pytorch"], cfgs[name])
        if not (o and t):
            print(f"| {name} | failed |" + " |" * 11)
            continue
        print(f"| {name} | {ms(o['train'])} | {ms(t['train'])} | {ratio(o['train'], t['train'])}"
              f" | {ms(o['infer'])} | {ms(t['infer'])} | {ratio(o['infer'], t['infer'])}"
              f" | {o['tok_s']:,.0f} | {t['tok_s']:,.0f} | {mib(o['mem'])} | {mib(t['mem'])}"
              f" | {mem_ratio(o['mem'], t['mem'])} |")


def print_sweep(title: str, rows: list[tuple[dict, dict]], markdown: bool):
    print()
    print(title)
    head = ("T", "B", "npformer ms", "PyTorch ms", "ratio", "npformer MiB", "PyTorch MiB",
            "ratio", "loss")
    cells = []
    for cfg, pair in rows:
        o, t = summary(pair["npformer"], cfg), summary(pair["pytorch"], cfg)
        if not (o and t):
            err = pair["npformer"].get("error") or pair["pytorch"].get("error")
            cells.append((str(cfg["seq_len"]), str(cfg["batch"]), "failed", err or "", "", "",
                          "", "", ""))
            continue
        _, ok = loss_check(pair)
        cells.append((str(cfg["seq_len"]), str(cfg["batch"]), ms(o["train"]), ms(t["train"]),
                      ratio(o["train"], t["train"]), mib(o["mem"]), mib(t["mem"]),
                      mem_ratio(o["mem"], t["mem"]), "agree" if ok else "DIFFER"))
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---:|" * len(head))
        for c in cells:
            print("| " + " | ".join(c) + " |")
        return
    widths = [max(len(h), *(len(c[i]) for c in cells)) + 2 for i, h in enumerate(head)]
    print("".join(h.rjust(w) for h, w in zip(head, widths)))
    for c in cells:
        print("".join(x.rjust(w) for x, w in zip(c, widths)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="imdb,lm,seq2seq",
                   help="comma-separated subset of imdb,lm,seq2seq (empty: none)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; smoke 1)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (default 2; smoke 0)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads for both sides (default: all usable cores)")
    p.add_argument("--sweeps", action="store_true",
                   help="imdb: sequence length 64..1024 at 8192 tokens/batch, batch 8..64 at 256")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 step: checks that it runs")
    p.add_argument("--allocator", choices=("inherit", "glibc-default", "keep-heap"),
                   default="inherit",
                   help="GLIBC_TUNABLES for both sides: inherit = as in this environment "
                        f"(default), glibc-default = unset, keep-heap = {NO_TRIM_TUNABLE}")
    p.add_argument("--markdown", action="store_true", help="also print README-ready tables")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 1 if args.smoke else 10
    if args.warmup is None:
        args.warmup = 0 if args.smoke else 2
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        p.error("--steps and --threads must be at least 1, --warmup at least 0")
    args.names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    args.env = worker_env(args)
    args.load_at_start = load_average()
    table = SMOKE if args.smoke else CONFIGS
    started = time.perf_counter()
    results, cfgs = {}, {}
    for name in args.names:
        cfgs[name] = table[name]
        results[name] = run_pair(table[name], args)
    sweeps = []
    if args.sweeps:
        base = table["imdb"]
        tokens = SMOKE_SWEEP_TOKENS if args.smoke else SWEEP_TOKENS
        lengths = SMOKE_SWEEP_LENGTHS if args.smoke else SWEEP_LENGTHS
        batches = SMOKE_SWEEP_BATCHES if args.smoke else SWEEP_BATCHES
        length_rows = [dict(base, seq_len=T, batch=tokens // T) for T in lengths]
        batch_rows = [dict(base, batch=B) for B in batches]
        sweeps = [(f"imdb sweep: sequence length at {tokens} tokens per batch (B = {tokens}/T)",
                   [(c, run_pair(c, args)) for c in length_rows]),
                  (f"imdb sweep: batch size at length {base['seq_len']}",
                   [(c, run_pair(c, args)) for c in batch_rows])]
    first = next(iter(results.values()), None) or (sweeps[0][1][0][1] if sweeps else {})
    print_header(args, first)
    if args.smoke:
        print("SMOKE RUN: tiny sizes, timings meaningless")
    for name in args.names:
        print("  " + describe(name, cfgs[name]))
    if results:
        print_main_table(results, cfgs)
        if args.markdown:
            print_markdown(results, cfgs)
    for title, rows in sweeps:
        print_sweep(title, rows, args.markdown)
    print(f"\n(total wall time {time.perf_counter() - started:.0f} s)")
    failed = [n for n, pair in results.items() if any("error" in r for r in pair.values())]
    failed += [title for title, rows in sweeps for _, pair in rows
               if any("error" in r for r in pair.values())]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
