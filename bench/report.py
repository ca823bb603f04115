"""Formatting and printing of the benchmark's results."""
from __future__ import annotations

import os
import platform
import statistics

from bench.configs import tokens_per_step
from bench.flops import share_of_peak, step_flops

LOSS_RTOL = 1e-3
# The busy warning reads the CPU time other processes take over one second (/proc/stat),
# not the 1-minute load average: that is a damped mean (one-minute time constant) of the
# runnable and waiting tasks, which still carries what ran in the last minutes (the
# command that started the bench, a test just finished): 0.66 on an idle 2-core machine.
SIDES = ("pytorch", "npformer", "nanogpt")  # PyTorch first: it writes the initial weights
SIDE_NAMES = {"pytorch": "PyTorch", "npformer": "npformer", "nanogpt": "nanoGPT's GPT"}


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
    """Medians (seconds), tokens/s, memory (MiB: the CPU's RSS growth, or a device's peak,
    None where neither was measured), the first-step loss (dropout off) and the last
    training loss of one side's result; None for a failed side."""
    if "error" in res:
        return None
    train = statistics.median(res["train_times"])

    def in_mib(key):
        return None if res.get(key) is None else res[key] / MiB

    return dict(train=train, infer=statistics.median(res["infer_times"]),
                tok_s=tokens_per_step(cfg) / train,
                mem=in_mib("mem_growth") if "mem_growth" in res else in_mib("peak_bytes"),
                rest=in_mib("rest_bytes"), loss=res.get("check_loss", res["losses"][0]),
                final_loss=res["losses"][-1], steps=len(res["losses"]))


TRAIN_TIMING = ("train = the demo's update: zero_grad + forward (dropout on) + loss + "
                "backward + clip + AdamW/Adam step + schedule (npformer: the demo's "
                "Trainer.update()); infer = forward only (npformer eval + no_grad, torch eval "
                "+ inference_mode)")
LOSS_NOTE = ("loss:      the first-step loss compared is each side's loss at the shared "
             "initial weights with dropout off (dropout masks differ between libraries)")


def mib(value: float) -> str:
    """RSS counters are kept per CPU and synced lazily: growths a few hundred KiB below
    zero are noise, shown as 0."""
    return f"{max(value, 0.0):.1f}"


def loss_check(pair: dict, against: str = "pytorch") -> tuple[str, bool]:
    """npformer's first-step loss (dropout off, the initial weights) against side
    ``against``'s: the same model on the same batch must give the same loss."""
    ours, theirs = pair.get("npformer", {}), pair.get(against, {})
    if "losses" not in ours or "losses" not in theirs:
        return "loss not compared (a side failed)", False
    if not (ours.get("weights_loaded") and (against == "pytorch"
                                            or theirs.get("weights_loaded"))):
        return "loss not compared (a side did not get PyTorch's initial weights)", False
    a, b = (res.get("check_loss", res["losses"][0]) for res in (ours, theirs))
    rel = abs(a - b) / max(abs(b), 1e-12)
    return (f"first-step loss (dropout off) {a:.6f} vs {b:.6f} (rel diff {rel:.1e})",
            rel <= LOSS_RTOL)


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
    return f"{name}: {shape}{model_text(cfg)}"


def model_text(cfg: dict) -> str:
    """", demos/generate.py: pre-norm gelu, dropout 0.0, AdamW, clip 1.0" (a demo's run)."""
    if "demo" not in cfg:
        return ""
    import numpy as np

    from bench.configs import clip_norm, npformer_config, npformer_optimizer
    from npformer.nn import Parameter

    c = npformer_config(cfg)
    optimizer = type(npformer_optimizer(cfg, [Parameter(np.zeros(1, np.float32))])).__name__
    return (f"; demos/{cfg['demo']}.py: {'pre' if c.norm_first else 'post'}-norm "
            f"{c.activation}, dropout {c.dropout:g}, {optimizer} with its schedule, "
            f"clip {clip_norm(cfg):g}")


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


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat's first line)."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already inside user time
    return total - idle, total


def busy_cores(seconds: float = 1.0) -> float | None:
    """How many cores' worth of CPU other processes use now: /proc/stat sampled over
    ``seconds`` (busy share of the CPU time x the cores), None where /proc is missing."""
    import time

    first = _cpu_times()
    time.sleep(seconds)
    second = _cpu_times()
    if first is None or second is None or second[1] == first[1]:
        return None
    return (second[0] - first[0]) / (second[1] - first[1]) * (os.cpu_count() or 1)


def busy_threshold(cores: int) -> float:
    """Cores in use by others above which the header warns: half a core, or a tenth of
    a large machine (background daemons take a little of every machine)."""
    return max(0.5, 0.1 * cores)


def machine_load() -> dict:
    """The load before the first worker: the 1-minute load average (for the record) and
    the cores busy over one second (what the warning reads)."""
    return {"load_average": load_average(), "busy_cores": busy_cores()}


def print_header(args, first: dict):
    py, npf = first.get("pytorch", {}), first.get("npformer", {})
    tunables = args.env.get("GLIBC_TUNABLES")
    print("npformer vs PyTorch on the demos' own runs (CPU, float32): each configuration is a "
          "demo's default model (norm placement, activation, dropout, sizes) and update "
          "(its AdamW / Adam, clipping and learning-rate schedule); lm also against nanoGPT's "
          "GPT")
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
    rounds = npf.get("rounds", 1)
    print(f"timing:    median (min-max) of {args.steps} steps after {args.warmup} warmup"
          + (f", in each of {rounds} rounds with the sides taking turns, pooled" if rounds > 1
             else "") + "; "
          f"{TRAIN_TIMING}")
    print(LOSS_NOTE)
    print("memory:    peak RSS growth = peak RSS over the training steps (VmHWM, reset at the "
          "baseline via /proc/self/clear_refs) - current RSS "
          "(/proc/self/statm) before the first step, model and batch built, free heap pages "
          "returned by malloc_trim(0) first (optimizer state "
          "is in the growth); each (config, side) in a fresh subprocess that first runs one "
          "step of a tiny model so lazily loaded library code is not counted; same method "
          "both sides")
    print("tokens/s:  token positions per training step (padding included; seq2seq counts "
          "source + target) / median step time")
    load = args.load_at_start or {}
    if load.get("busy_cores") is not None:
        cores = os.cpu_count() or 1
        busy = load["busy_cores"] > busy_threshold(cores)
        average = load.get("load_average")
        print(f"load:      {load['busy_cores']:.2f} of {cores} cores busy over 1 s (/proc/stat) "
              f"before the first worker" + (f"; 1-minute load average {average:.2f}"
                                            if average is not None else "")
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
        for side in (s for s in SIDES if s in pair):
            res = pair[side]
            if "error" in res:
                print(f"{name:<9}{side:<10}  FAILED: {res['error']}")
                continue
            s = summary(res, cfgs[name])
            print(f"{name:<9}{side:<10}{spread(res['train_times']):>24}"
                  f"{spread(res['infer_times']):>24}{s['tok_s']:>11,.0f}{mib(s['mem']):>10}"
                  f"{res['check_loss']:>12.5f}")
    print()
    print("ratios npformer / PyTorch, and / nanoGPT's GPT (below 1 = npformer faster / "
          "smaller):")
    for name, pair in results.items():
        for against in (s for s in SIDES[::2] if s in pair):  # pytorch, nanogpt
            label = name if against == "pytorch" else f"{name}/nanoGPT"
            print(ratio_line(label, pair, cfgs[name], against))


def ratio_line(label: str, pair: dict, cfg: dict, against: str = "pytorch",
               memory: str = "memory") -> str:
    """``ratio LABEL train Ax  infer Bx  MEMORY Cx  | the loss check`` of npformer against
    side ``against`` (and a WARNING line when their first-step losses differ)."""
    ours, theirs = summary(pair["npformer"], cfg), summary(pair[against], cfg)
    if ours and theirs:
        memory_ratio = (mem_ratio(ours["mem"], theirs["mem"]) if ours["mem"] is not None
                        and theirs["mem"] is not None else "n/a (not measured on the CPU)")
        line = (f"ratio {label:<8} train {ratio(ours['train'], theirs['train'])}  "
                f"infer {ratio(ours['infer'], theirs['infer'])}  {memory} {memory_ratio}")
    else:
        line = f"ratio {label:<8} train n/a  infer n/a  {memory} n/a (a side failed)"
    text, ok = loss_check(pair, against)
    line += f"  | {text}"
    if not ok and "not compared" not in text:
        line += (f"\nWARNING: {label}: first-step losses differ by more than {LOSS_RTOL:g} "
                 f"relative: npformer and {SIDE_NAMES[against]} are not computing the same "
                 "model")
    return line


def markdown_lines(results: dict, cfgs: dict) -> list[str]:
    """README-ready table: npformer against PyTorch per configuration (memory cells blank
    where memory was not measured)."""
    lines = ["", "| config | npformer train ms | PyTorch train ms | ratio | npformer infer ms "
             "| PyTorch infer ms | ratio | npformer tokens/s | PyTorch tokens/s "
             "| npformer peak MiB | PyTorch peak MiB | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, pair in results.items():
        o, t = summary(pair["npformer"], cfgs[name]), summary(pair["pytorch"], cfgs[name])
        if not (o and t):
            lines.append(f"| {name} | failed |" + " |" * 10)
            continue
        measured = o["mem"] is not None and t["mem"] is not None
        memory = (f" | {mib(o['mem'])} | {mib(t['mem'])} | {mem_ratio(o['mem'], t['mem'])}"
                  if measured else " |  |  | ")
        lines.append(
            f"| {name} | {ms(o['train'])} | {ms(t['train'])} | {ratio(o['train'], t['train'])}"
            f" | {ms(o['infer'])} | {ms(t['infer'])} | {ratio(o['infer'], t['infer'])}"
            f" | {o['tok_s']:,.0f} | {t['tok_s']:,.0f}{memory} |")
    return lines


def print_markdown(results: dict, cfgs: dict, peak_gflops: float | None = None):
    """The ratio table, and (given the peak) the utilisation table."""
    print(f"\n(machine: {cpu_model()})")
    print("\n".join(markdown_lines(results, cfgs)[1:]))
    if peak_gflops is not None:
        print("\n".join(utilisation_markdown(results, cfgs, peak_gflops)))


UTILISATION_NOTE = ("share of peak: the FLOPs of a step, counted from the configuration "
                    "(bench/flops.py, formula in bench/README.md: the matrix products, 2mkn "
                    "each; a training step 3x the forward's, as PaLM's MFU counts), over its "
                    "median time, over the peak measured in this run")
UTILISATION_HEAD = ("config", "side", "train GFLOP", "train ms", "share of peak",
                    "infer GFLOP", "infer ms", "share of peak")


def gflop(flops: float) -> str:
    value = flops / 1e9
    return f"{value:.0f}" if value >= 100 else f"{value:.2f}" if value >= 0.01 else f"{value:.2g}"


def percent(fraction: float) -> str:
    return f"{fraction * 100:.0f}%" if fraction >= 0.1 else f"{fraction * 100:.1f}%"


def utilisation_cells(name: str, label: str, res: dict, cfg: dict,
                      peak_gflops: float) -> tuple[str, ...]:
    """One row of the utilisation table (UTILISATION_HEAD): a side's FLOPs a step, its
    median times and their shares of ``peak_gflops``; "FAILED" for a failed side."""
    if "error" in res:
        return (name, label, "FAILED", "", "", "", "", "")
    flops = step_flops(cfg)
    cells = [name, label]
    for phase, key in (("train", "train_times"), ("infer", "infer_times")):
        seconds = statistics.median(res[key])
        cells += [gflop(flops[phase]), ms(seconds),
                  percent(share_of_peak(flops[phase], seconds, peak_gflops))]
    return tuple(cells)


def utilisation_rows(results: dict, cfgs: dict, peak_gflops: float,
                     names: dict | None = None) -> list[tuple[str, ...]]:
    """The rows of every configuration and side, each side labelled by ``names`` (default:
    its key)."""
    return [utilisation_cells(name, (names or {}).get(side, side), pair[side], cfgs[name],
                              peak_gflops)
            for name, pair in results.items() for side in SIDES if side in pair]


def print_utilisation(results: dict, cfgs: dict, peak_gflops: float):
    rows = utilisation_rows(results, cfgs, peak_gflops)
    widths = [max(len(h), *(len(r[i]) for r in rows)) + 2
              for i, h in enumerate(UTILISATION_HEAD)]
    print(f"\n{UTILISATION_NOTE} ({peak_gflops:.1f} GFLOP/s):")
    print("".join(h.ljust(w) if i < 2 else h.rjust(w)
                  for i, (h, w) in enumerate(zip(UTILISATION_HEAD, widths))))
    for row in rows:
        print("".join(c.ljust(w) if i < 2 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(row, widths))))


def utilisation_markdown(results: dict, cfgs: dict, peak_gflops: float) -> list[str]:
    """README-ready utilisation table: every configuration and side (PyTorch, npformer,
    nanoGPT's GPT)."""
    return (["", f"(float32 matrix-product peak {peak_gflops:.1f} GFLOP/s, measured in the "
                 "same run)", "", "| " + " | ".join(UTILISATION_HEAD) + " |",
             "|---|---|" + "---:|" * (len(UTILISATION_HEAD) - 2)]
            + ["| " + " | ".join(row) + " |"
               for row in utilisation_rows(results, cfgs, peak_gflops, SIDE_NAMES)])


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

