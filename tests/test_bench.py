"""The benchmark runs end to end: ``python bench/bench.py --smoke`` (tiny sizes, 1 step).

It checks that both sides run for every configuration, that a ratio line is printed
for each, and that the first-step losses agree (PyTorch's initial weights are loaded
into npformer, so the two sides compute the same model on the same batch).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import GPU, require_torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("imdb", "lm", "seq2seq")


@pytest.fixture(scope="module")
def smoke_output():
    require_torch()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench.py"), "--smoke"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc


def test_smoke_exits_cleanly(smoke_output):
    assert smoke_output.returncode == 0, smoke_output.stdout + smoke_output.stderr
    assert "FAILED" not in smoke_output.stdout


@pytest.mark.parametrize("name", CONFIGS)
def test_ratio_line_per_config(smoke_output, name):
    pattern = rf"^ratio {name}\s+train \d+\.\d+x\s+infer \d+\.\d+x\s+memory "
    assert re.search(pattern, smoke_output.stdout, re.MULTILINE), smoke_output.stdout


@pytest.mark.parametrize("name", CONFIGS)
def test_first_step_losses_agree(smoke_output, name):
    line = next(line for line in smoke_output.stdout.splitlines()
                if line.startswith(f"ratio {name} "))
    assert "first-step loss" in line, line
    assert not re.search(rf"^WARNING: {name}:", smoke_output.stdout, re.MULTILINE)


def test_lm_also_against_nanogpt_where_it_is_found(smoke_output):
    from bench.torch_models import nanogpt_folder

    if nanogpt_folder(ROOT) is None:
        pytest.skip("no nanoGPT model.py ($NPFORMER_NANOGPT)")
    out = smoke_output.stdout
    assert re.search(r"^lm\s+nanogpt\s+[\d.]+ \(", out, re.MULTILINE), out
    line = next(line for line in out.splitlines() if line.startswith("ratio lm/nanoGPT "))
    assert re.search(r"train \d+\.\d+x .*\| first-step loss \(dropout off\)", line), line
    assert "WARNING: lm/nanoGPT" not in out


def test_header_names_machine_versions_threads_and_allocator(smoke_output):
    out = smoke_output.stdout
    for label in ("machine:", "libraries:", "threads:", "allocator:", "memory:", "load:"):
        assert re.search(rf"^{label}", out, re.MULTILINE), f"{label} missing:\n{out}"
    libraries = next(line for line in out.splitlines() if line.startswith("libraries:"))
    assert re.search(r"numpy \d[^(]*\((?!\?)", libraries), libraries  # its BLAS named
    assert re.search(r"torch \S+ \((?!\?)", libraries), libraries


def test_header_gives_the_measured_peak_bandwidth_and_cpu(smoke_output):
    """Issue 48, item 1 (and 3's bandwidth): the same run measures the float32 product
    peak and the copy bandwidth, printed with the CPU's model."""
    from bench.report import cpu_model

    out = smoke_output.stdout
    assert re.search(r"^peak: +float32 matrix products \d+\.\d GFLOP/s on \d+ threads "
                     r"\((numpy|torch), \(\d+x\d+\)@\(\d+x\d+\);", out, re.MULTILINE), out
    peak_line = next(line for line in out.splitlines() if line.startswith("peak:"))
    assert peak_line.endswith(f"CPU: {cpu_model()}"), peak_line
    assert re.search(r"^bandwidth: \d+\.\d GB/s \(a \d+ MiB float32 copy", out, re.MULTILINE)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_side_gets_its_flops_and_share_of_the_peak(smoke_output, name):
    """Each tier's utilisation table has a row per side of every configuration: the
    counted GFLOP (bench/flops.py) and the share of the peak, training and inference."""
    from bench.configs import SMOKE
    from bench.flops import step_flops
    from bench.report import gflop

    out = smoke_output.stdout
    flops = step_flops(SMOKE[name])
    share = r"\d+(\.\d)?%"
    row = (rf"^{name}\s+(pytorch|npformer)\s+{re.escape(gflop(flops['train']))}\s+[\d.]+\s+"
           rf"{share}\s+{re.escape(gflop(flops['infer']))}\s+[\d.]+\s+{share}$")
    assert len(re.findall(row, out, re.MULTILINE)) == 2 * 2, out  # 2 sides x 2 tiers
    assert out.count("share of peak: the FLOPs of a step") == 2  # one table a tier


# --------------------------------------------------------------------------- the sweeps
def test_every_sweep_point_fits_the_model_it_is_timed_on():
    """Issue 37, case 36: `bench.py --sweeps` timed length 1024 on the demo's model of
    block_size 512 ("sequence of length 1024 is longer than block_size 512")."""
    from bench.configs import SWEEP_LENGTHS, npformer_config, sweeps

    for smoke in (False, True):
        (_, lengths), (_, batches) = sweeps(smoke)
        assert lengths[-1]["seq_len"] == max(SWEEP_LENGTHS) == 1024  # smoke: the same end
        for cfg in lengths + batches:
            assert npformer_config(cfg).block_size >= cfg["seq_len"] >= 1 and cfg["batch"] >= 1
        assert {npformer_config(cfg).block_size for cfg in lengths} == {1024}  # one model


def test_the_sweeps_largest_point_runs_in_its_smoke_form():
    require_torch()
    from bench import bench
    from bench.configs import sweeps

    (_, lengths), _ = sweeps(smoke=True)
    pair = bench.run_pair(lengths[-1], bench.parse_args(["--smoke", "--configs", ""]))
    assert set(pair) == {"pytorch", "npformer"}
    assert not any("error" in result for result in pair.values()), pair


# --------------------------------------------------------------------------- inference bound
def test_inference_bound_runs_and_its_compiled_forward_is_the_models():
    """``bench/inference_bound.py --smoke``: the three sides run, and the compiled forward
    it times computes the model's logits (it exits 1 when they differ by 1e-4)."""
    require_torch()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "inference_bound.py"),
                           "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"model's forward within ([\d.e+-]+)", proc.stdout)
    assert match and float(match.group(1)) < 1e-5, proc.stdout
    for side in ("pytorch", "npformer", "compiled"):
        assert re.search(rf"^  {side}\s+[\d.]+ ms\s+[\d.]+x PyTorch$", proc.stdout,
                         re.MULTILINE), proc.stdout


# --------------------------------------------------------------------------- process modes
@pytest.fixture(scope="module")
def processes_output():
    """``--processes --smoke`` on one configuration (lm): MPI ranks, thread replicas, PyTorch
    DDP and PyTorch threads, the scaling and Allreduce lines, the sweep and the projection."""
    require_torch()
    if shutil.which("mpiexec", path=str(Path(sys.executable).parent)) is None \
            and shutil.which("mpiexec") is None:
        if os.environ.get("CI"):
            raise RuntimeError("no mpiexec: CI installs mpi4py and mpich (the test extra)")
        pytest.skip("no mpiexec (pip install -e '.[mpi]')")
    return subprocess.run([sys.executable, str(ROOT / "bench" / "bench.py"), "--processes",
                           "--smoke", "--configs", "lm"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_process_modes_run_and_agree_on_the_first_loss(processes_output):
    out = processes_output.stdout
    assert processes_output.returncode == 0, out + processes_output.stderr
    assert "FAILED" not in out
    losses = {}
    for mode in ("PyTorch 2 threads", "npformer 2 threads", "npformer 2 ranks",
                 "PyTorch DDP 2"):
        match = re.search(rf"^  {mode}\s+[\d.]+ \([\d.]+-[\d.]+\)\s+loss ([\d.]+)$", out,
                          re.MULTILINE)
        assert match, f"{mode} missing:\n{out}"
        losses[mode] = float(match.group(1))
    for mode in ("npformer 1 rank, half batch", "npformer 2 x 1 rank, half"):  # own weights
        assert re.search(rf"^  {mode}\s+[\d.]+ \([\d.]+-[\d.]+\)", out, re.MULTILINE), out
    # the same model (PyTorch's initial weights) on the same global batch: the same loss
    # (lm: every shard holds as many tokens, so DDP's mean of the two halves is it too)
    assert max(losses.values()) - min(losses.values()) <= 1e-3 * losses["PyTorch 2 threads"]


def test_process_summary_scaling_allreduce_and_projection(processes_output):
    out = processes_output.stdout
    assert re.search(r"^processes lm\s+2 ranks / PyTorch 2 threads \d+\.\d+x\s+/ PyTorch DDP "
                     r"\d+\.\d+x\s+/ npformer threads \d+\.\d+x\s+\| scaling 1->2 ranks \d+%"
                     r" \(two processes at once, nothing summed: \d+%\)"
                     r"\s+\| waiting for the slower rank [\d.]+ ms = \d+%, "
                     r"gradient sum [\d.]+ ms = \d+% of the step \([\d.]+ KiB sent of "
                     r"[\d.]+ KiB\)", out, re.MULTILINE), out
    for ranks in (2, 4):
        assert re.search(rf"^  {ranks} ranks fit: alpha -?[\d.]+ us", out, re.MULTILINE), out
    assert re.search(r"^  lm\s+compute [\d.]+ ms, \d+ buckets [\d.]+ KiB, window [\d.]+ ms "
                     r"\(after the last [\d.]+ ms\): 8 ranks [\d.]+ KiB [\d.]+ ms \d+% \(\d+%\)",
                     out, re.MULTILINE), out


def test_projected_sums_carry_the_union_of_the_ranks_changed_rows():
    """The projection's bytes at P ranks: every parameter but, of each lookup table, only
    the rows P per-rank batches changed, counted from the tables' gradients: growing with
    P, at most the whole buffer, and the whole buffer where a table is tied (lm)."""
    from bench import processes
    from bench.configs import SMOKE, npformer_model
    from npformer import backend

    backend.set_backend("numpy", seed=0)
    cfg = dict(SMOKE["imdb"], batch=2)
    model, task = npformer_model(cfg, None)
    dense = (sum(p.data.size for p in model.parameters()) + 1) * 4
    sent = processes.sparse_sum_bytes(model, task, cfg, (1, 2, 4, 8))
    assert sent[1] < sent[2] < sent[4] <= sent[8] <= dense, (sent, dense)
    lm, lm_task = npformer_model(SMOKE["lm"], None)
    lm_dense = (sum(p.data.size for p in lm.parameters()) + 1) * 4
    assert processes.sparse_sum_bytes(lm, lm_task, SMOKE["lm"], (1, 8)) == {1: lm_dense,
                                                                            8: lm_dense}


def test_alpha_beta_fit_and_ring_projection():
    from bench import processes

    sizes = [1024, 4096, 65536]
    alpha, beta = processes.fit_alpha_beta(sizes, [3e-6 + n / 2e9 for n in sizes])
    assert abs(alpha - 3e-6) < 1e-12 and abs(1 / beta - 2e9) < 1e-3 * 2e9
    # 2 ranks: one exchange each way of half the message, twice: 2 alpha + n / bandwidth
    assert processes.ring_allreduce_seconds(2, 1e6, 1e-6, 1e9) == 2e-6 + 1e-3
    step, efficiency = processes.projection(0.010, 4e6, 8, alpha=5e-6, bandwidth=12e9)
    assert step == 0.010 + 14 * 5e-6 + 2 * 7 / 8 * 4e6 / 12e9
    assert efficiency == 0.010 / step


def test_the_projection_hides_the_buckets_sums_behind_the_backward():
    """Of a 4 MB sum, two 1 MB buckets overlap the backward's window: a long window hides
    all but the last bucket's sum (but what of it the backward's time after the last
    bucket hides), none hides none; the other 2 MB (the tables' rows) are summed after the
    backward either way."""
    from bench import processes

    def ring(n):
        return processes.ring_allreduce_seconds(8, n, 5e-6, 12e9)

    def step(window, last=0.0):
        return processes.projection(0.010, 4e6, 8, [1e6, 1e6], window, last, alpha=5e-6,
                                    bandwidth=12e9)[0]

    assert step(window=1.0) == 0.010 + ring(1e6) + ring(2e6)
    assert step(window=0.0) == 0.010 + (ring(1e6) + ring(1e6)) + ring(2e6)
    assert step(window=ring(1e6) / 2) == 0.010 + (2 * ring(1e6) - ring(1e6) / 2) + ring(2e6)
    # the last bucket final some time before the backward ends: that much of it hides too
    assert step(window=1.0, last=ring(1e6) / 4) == 0.010 + 3 * ring(1e6) / 4 + ring(2e6)
    assert step(window=1.0, last=1.0) == 0.010 + ring(2e6)


# --------------------------------------------------------------------------- bench/gpu.py
GPU_SCRIPT = ROOT / "bench" / "gpu.py"
GPU_NAMES = ("imdb", "lm", "seq2seq", "imdb_large", "lm_large")


def run_gpu_script(*args, timeout=600):
    return subprocess.run([sys.executable, str(GPU_SCRIPT), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_large_configs_are_the_issue_sizes():
    from bench.configs import CONFIGS, GPU_CONFIGS, GPU_SMOKE, bench_config, tokens_per_step

    assert tuple(GPU_CONFIGS) == GPU_NAMES and tuple(GPU_SMOKE) == GPU_NAMES
    assert GPU_CONFIGS["imdb_large"] == dict(CONFIGS["imdb"], batch=256,
                                             preset=dict(CONFIGS["imdb"]["preset"],
                                                         batch_size=256),
                                             max_iters=220)  # 2.5 epochs of 88 (22,500/256)
    assert GPU_CONFIGS["lm_large"] == bench_config("lm", "nanogpt", d_model=768, num_heads=12,
                                                   num_layers=12, block_size=1024, batch_size=8)
    lm = GPU_CONFIGS["lm_large"]
    assert (lm["d_model"], lm["num_heads"], lm["num_layers"], lm["d_ff"], lm["seq_len"],
            lm["batch"], lm["vocab_size"]) == (768, 12, 12, 3072, 1024, 8, 65)
    assert tokens_per_step(GPU_CONFIGS["imdb_large"]) == 256 * 256
    assert tokens_per_step(GPU_CONFIGS["lm_large"]) == 8 * 1024
    for name in GPU_NAMES:  # each smoke version is a model of the same kind
        assert GPU_SMOKE[name]["kind"] == GPU_CONFIGS[name]["kind"]


# --------------------------------------------------------------------------- the demos' runs
def test_configs_are_the_demos_default_models_and_updates():
    """Each configuration builds the demo's own model config and optimizer from the demo's
    default preset: the lm is pre-norm, exact GELU, tied, AdamW (0.9, 0.99) with decay 0.1
    and nanoGPT's schedule; imdb post-norm ReLU with dropout 0.1 and AdamW; seq2seq without
    dropout, Adam (0.9, 0.98, eps 1e-9) with label smoothing 0.1; all clip at 1."""
    import numpy as np

    from bench.configs import (
        CONFIGS,
        SMOKE,
        clip_norm,
        demo_module,
        label_smoothing,
        npformer_config,
        npformer_optimizer,
    )
    from npformer import optim
    from npformer.nn import Parameter

    generate, imdb, translate = (demo_module(n) for n in ("generate", "imdb", "translate"))
    lm = npformer_config(CONFIGS["lm"])
    assert lm == generate.model_config(generate.PRESETS["nanogpt"], 65)  # nanoGPT's shape
    assert (lm.d_model, lm.num_layers, CONFIGS["lm"]["batch"]) == (128, 4, 12)
    assert (lm.norm_first, lm.activation, lm.tie_weights, lm.dropout) == (True, "gelu", True,
                                                                         0.0)
    classifier = npformer_config(CONFIGS["imdb"])
    assert classifier == imdb.model_config(imdb.PRESETS["default"], 20_002, 0)
    assert (classifier.dropout, classifier.block_size, CONFIGS["imdb"]["batch"]) == (0.1, 512, 32)
    seq2seq = npformer_config(CONFIGS["seq2seq"])
    assert (seq2seq.d_model, seq2seq.dropout, CONFIGS["seq2seq"]["batch"]) == (256, 0.0, 512)
    params = [Parameter(np.zeros((2, 2), dtype=np.float32))]
    adamw = npformer_optimizer(CONFIGS["lm"], params)
    assert isinstance(adamw, optim.AdamW) and adamw.betas == (0.9, 0.99)  # of either tier
    assert adamw.weight_decay == 0.1 and adamw.schedule(2000) == pytest.approx(1e-4)
    adam = npformer_optimizer(CONFIGS["seq2seq"], params)
    assert isinstance(adam, optim.Adam) and not isinstance(adam, optim.AdamW)
    assert (adam.betas, adam.eps) == ((0.9, 0.98), 1e-9)
    assert isinstance(npformer_optimizer(CONFIGS["imdb"], params), optim.AdamW)
    assert label_smoothing(CONFIGS["seq2seq"]) == 0.1 == translate.LABEL_SMOOTHING
    assert {clip_norm(c) for c in CONFIGS.values()} == {1.0}
    for name, cfg in SMOKE.items():  # tiny
        assert cfg["d_model"] <= 32 and cfg["batch"] <= 32, name


@pytest.mark.parametrize("tier", ["fast", "textbook"])
@pytest.mark.parametrize("name", CONFIGS)
def test_each_tier_builds_the_classes_the_demo_names(name, tier):
    """prepare_npformer(tier=...) builds the model and optimizer classes the demo's own
    ``implementations(tier)`` names (no global switch: the tier is an argument)."""
    from bench.configs import SMOKE, demo_module
    from bench.measure import prepare_npformer

    cfg = SMOKE[name]
    model_class, optimizer_class = demo_module(cfg["demo"]).implementations(tier)
    run = prepare_npformer(cfg, 0, None, tier=tier)
    assert type(run.model) is model_class
    assert type(run.make_optimizer().optimizer) is optimizer_class


def test_an_unknown_tier_is_refused_by_name():
    from bench.configs import SMOKE, npformer_model, npformer_optimizer

    with pytest.raises(ValueError, match=r"tier must be one of .*got 'quick'"):
        npformer_model(SMOKE["lm"], tier="quick")
    with pytest.raises(ValueError, match=r"tier must be one of .*got 'quick'"):
        npformer_optimizer(SMOKE["lm"], [], tier="quick")


def test_tiers_option_sends_each_tier_to_its_worker_in_the_spec(monkeypatch):
    """``--tiers``: npformer runs once per tier, the tier in the worker's spec (not in its
    environment), under the keys the tables read ("npformer" is the fast tier)."""
    from bench import bench
    from bench.configs import SMOKE

    args = bench.parse_args(["--smoke", "--configs", "", "--tiers", "textbook,fast"])
    assert args.tiers == ["textbook", "fast"]
    sent = []

    def fake_worker(script, spec, env):
        sent.append((spec["side"], spec["tier"], env.get("NPFORMER_ENGINE")))
        return {"side": spec["side"], "tier": spec["tier"]}

    monkeypatch.setattr(bench.runner, "run_worker", fake_worker)
    pair = bench.run_pair(SMOKE["imdb"], args, args.tiers)
    assert pair["npformer"]["tier"] == "fast"
    assert pair["npformer textbook"]["tier"] == "textbook"
    assert ("npformer", "fast", None) in sent and ("npformer", "textbook", None) in sent
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiers", "fast,quick"])


@pytest.mark.parametrize("name", CONFIGS)
def test_pytorch_update_is_the_demos_update(name, tmp_path):
    """Dropout off, the same initial weights and batch: 4 updates of the PyTorch reference
    (torch AdamW / Adam, clip_grad_norm_, LambdaLR) and of npformer's Trainer.update()
    give the same losses and weights, and weight decay touches the same parameters."""
    require_torch()
    import numpy as np

    from bench.configs import SMOKE
    from bench.measure import prepare_npformer, prepare_pytorch
    from bench.torch_models import decays

    cfg = dict(SMOKE[name], dropout=0.0, preset=dict(SMOKE[name]["preset"], dropout=0.0))
    weights = str(tmp_path / "init.npz")
    torch_run = prepare_pytorch(cfg, 0, weights)
    ours = prepare_npformer(cfg, 0, weights)
    theirs_state, our_state = torch_run.make_optimizer(), ours.make_optimizer()
    theirs = [torch_run.step(theirs_state) for _ in range(4)]
    mine = [ours.step(our_state) for _ in range(4)]
    np.testing.assert_allclose(mine, theirs, rtol=2e-4)
    assert len(set(np.round(theirs, 4))) > 1  # the weights moved
    # The weights after the updates (Adam hides a uniform gradient scale, so the losses
    # barely see the clipping: the weights do; a clip left out moves lm's by 2e-4).
    # The key bias's gradient is zero up to rounding (softmax ignores a shift shared by
    # every key) and Adam blows that noise up: it is left out.
    from npformer.interop.pytorch import to_torch_state_dict

    after = to_torch_state_dict(ours.model)
    for key, value in torch_run.model.state_dict().items():
        expected, got = value.numpy(), np.asarray(after[key])
        if key.endswith("in_proj_bias"):
            third = len(expected) // 3
            expected, got = (np.concatenate([v[:third], v[2 * third:]]) for v in (expected, got))
        scale = np.max(np.abs(expected))
        assert np.max(np.abs(got - expected)) <= 5e-5 * scale, key
    decayed = sum(p.numel() for n, p in torch_run.model.named_parameters() if decays(
        torch_run.model)[n])
    assert decayed == sum(int(np.prod(p.shape)) for p in ours.model.parameters() if p.decay)


def test_nanogpt_gpt_computes_the_reference_lm(tmp_path):
    """nanoGPT's own GPT with the reference's weights mapped onto its names: the same
    first loss, and the same losses over 3 of the demo's updates."""
    require_torch()
    import numpy as np

    from bench.configs import SMOKE
    from bench.measure import prepare_nanogpt, prepare_pytorch
    from bench.torch_models import nanogpt_folder

    if nanogpt_folder(ROOT) is None:
        pytest.skip("no nanoGPT model.py ($NPFORMER_NANOGPT)")
    weights = str(tmp_path / "init.npz")
    reference = prepare_pytorch(SMOKE["lm"], 0, weights)
    gpt = prepare_nanogpt(SMOKE["lm"], 0, weights)
    assert gpt.check_loss() == pytest.approx(reference.check_loss(), rel=1e-6)
    a, b = reference.make_optimizer(), gpt.make_optimizer()
    np.testing.assert_allclose([gpt.step(b) for _ in range(3)],
                               [reference.step(a) for _ in range(3)], rtol=1e-5)


def test_nanogpt_names_refuse_a_model_that_does_not_map():
    from bench.torch_models import nanogpt_state_dict

    with pytest.raises(ValueError, match="do not map onto nanoGPT's"):
        nanogpt_state_dict({"tok_emb.weight": 0, "lm_head.weight": 0}, num_layers=0)


def test_busy_warning_reads_cores_in_use_not_the_load_average():
    from bench.report import busy_cores, busy_threshold

    assert busy_threshold(2) == 0.5 and busy_threshold(64) == pytest.approx(6.4)
    busy = busy_cores(0.2)
    assert busy is None or 0.0 <= busy <= (os.cpu_count() or 1) + 1e-9


def test_timed_synchronizes_around_every_call():
    from bench.measure import timed

    events = []
    times = timed(lambda: events.append("call"), warmup=2, steps=3,
                  sync=lambda: events.append("sync"))
    assert len(times) == 3
    assert events == ["sync", "call", "sync"] * 5


def test_kernels_ops_names_where_one_ranks_lm_update_goes():
    """``bench/kernels.py --ops``: the step, each op of the fast tier that ran, and the
    rest; a --repeat below 1 is refused naming it."""
    script = [sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / "kernels.py")]
    proc = subprocess.run(script + ["--ops", "--repeat", "2"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert re.search(r"CPU: .*one rank's half batch \(B 6, T 64\): [\d.]+ ms", lines[0])
    ops = {line.split()[0] for line in lines[1:-2]}
    assert {"linear_forward", "linear_backward", "attention_forward", "attention_backward",
            "adamw_flat_update", "embedding_backward"} <= ops
    assert lines[-2].lstrip().startswith("the rest (layers, Python)")
    # the lm demo's linear products on 384 rows: 4 layers of (128->128) x 4 and 128->512
    # and 512->128, and the 128->65 head; forward 2 N D_in D_out, backward twice that
    per_step = 6 * 384 * (4 * (4 * 128 * 128 + 2 * 128 * 512) + 128 * 65)
    assert re.fullmatch(rf"linear layers: {per_step / 1e9:.3f} GFLOP a step in their products, "
                        r"[\d.]+ GFLOP/s with the ops' own work; one bare \(384, 128\) @ "
                        r"\(128, 512\) product: [\d.]+ GFLOP/s", lines[-1]), lines[-1]
    refused = subprocess.run(script + ["--ops", "--repeat", "0"], capture_output=True,
                             text=True)
    assert refused.returncode == 2 and "--repeat must be at least 1, got 0" in refused.stderr


def test_kernels_table_times_every_kernel_against_numpy_and_torch():
    """``bench/kernels.py``: one row per case, the causal softmax with its rows cut and over
    whole rows among them, each with three positive times and their two ratios."""
    require_torch()
    script = [sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / "kernels.py")]
    proc = subprocess.run(script + ["--repeat", "1"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.splitlines()[2:]
    names = [re.split(r"\s{2,}", row)[0] for row in rows]
    assert {"gelu forward (768, 512) f32", "layernorm backward (768, 128) f32",
            "attn softmax (6,4,64,64) f32", "attn softmax (6,4,64,64) f32 whole rows"} <= set(names)
    for row in rows:
        times = [float(x) for x in row.split()[-5:]]
        assert len(times) == 5 and all(t > 0 for t in times), row


def test_rounds_pool_every_rounds_steps_and_keep_a_failed_side_failed():
    from bench.runner import pooled_rounds

    one = {"pytorch": dict(train_times=[1.0, 2.0], infer_times=[0.5], mem_growth=10,
                           losses=[4.0], version="a"),
           "npformer": dict(train_times=[3.0], infer_times=[0.1], mem_growth=7, losses=[4.0])}
    two = {"pytorch": dict(train_times=[5.0], infer_times=[0.7], mem_growth=30, losses=[9.0],
                           version="b"),
           "npformer": {"side": "npformer", "error": "boom"}}
    three = {"pytorch": dict(train_times=[6.0], infer_times=[0.2], mem_growth=20, losses=[1.0],
                             version="c"),
             "npformer": dict(train_times=[3.5], infer_times=[0.3], mem_growth=8, losses=[4.0])}
    pooled = pooled_rounds([one, two, three])
    assert pooled["pytorch"]["train_times"] == [1.0, 2.0, 5.0, 6.0]
    assert pooled["pytorch"]["infer_times"] == [0.5, 0.7, 0.2]
    assert pooled["pytorch"]["mem_growth"] == 20 and pooled["pytorch"]["rounds"] == 3
    assert pooled["pytorch"]["losses"] == [4.0] and pooled["pytorch"]["version"] == "a"
    assert pooled["npformer"] == {"side": "npformer", "error": "boom"}


def test_npformer_on_another_backend_takes_one_replica():
    from bench.configs import SMOKE
    from bench.measure import prepare_npformer

    with pytest.raises(ValueError, match=r"threads.*must be 1, got 2"):
        prepare_npformer(SMOKE["lm"], 0, None, threads=2, backend_name="cupy")


def test_pytorch_side_moves_model_batch_and_masks_to_its_device(tmp_path):
    """prepare_pytorch(device=...) on the meta device: parameters there, and a forward
    pass there runs, which it would not if the batch or a mask stayed on the CPU (on a
    GPU, the same mistake fails the bench).  The weights file holds the initial values."""
    torch = require_torch()
    import numpy as np

    from bench.configs import SMOKE
    from bench.measure import prepare_pytorch

    for name, cfg in SMOKE.items():
        weights = tmp_path / f"{name}.npz"
        run = prepare_pytorch(cfg, 0, str(weights), device="meta")
        assert {p.device.type for p in run.model.parameters()} == {"meta"}
        run.infer()  # the training forward (train mode), on meta: no CPU tensor in it
        torch.manual_seed(0)  # the same initial weights as a model built on the CPU
        cpu = prepare_pytorch(cfg, 0, None).model.state_dict()
        with np.load(weights) as saved:
            assert set(saved.files) == set(cpu)
            for key in saved.files:
                np.testing.assert_array_equal(saved[key], cpu[key].numpy())


def test_worker_result_reads_the_result_line_or_the_error():
    from types import SimpleNamespace

    from bench.measure import RESULT_PREFIX, worker_result

    done = SimpleNamespace(stdout=f"noise\n{RESULT_PREFIX}" + '{"a": 1}\n', stderr="",
                           returncode=0)
    assert worker_result(done, "npformer") == {"a": 1}
    crashed = SimpleNamespace(stdout="", stderr="Traceback\nMemoryError: out of memory\n",
                              returncode=1)
    assert worker_result(crashed, "pytorch") == dict(
        side="pytorch", error="worker exited 1: MemoryError: out of memory")


def fake_result(train_ms, infer_ms, losses, peak_mib=None, rest_mib=None, **extra):
    """A worker's result: step times around the given medians, memory in bytes."""
    def mib(value):
        return None if value is None else value * 2 ** 20
    return dict(train_times=[train_ms * 1.1e-3, train_ms * 1e-3, train_ms * 0.9e-3],
                infer_times=[infer_ms * 1e-3], losses=list(losses), peak_bytes=mib(peak_mib),
                rest_bytes=mib(rest_mib), **extra)


LM = dict(kind="causal_lm", vocab_size=65, d_model=16, num_heads=2, num_layers=1, d_ff=32,
          seq_len=16, batch=4)  # 64 tokens per step


def test_gpu_config_table_rows_ratios_and_loss_check():
    from bench import gpu

    pair = {"pytorch": fake_result(10, 4, [2.0, 1.5], peak_mib=100, rest_mib=20),
            "npformer": fake_result(15, 2, [2.0005, 1.4], peak_mib=80, rest_mib=20,
                                    weights_loaded=True)}
    lines = gpu.config_lines("lm", LM, pair)
    text = "\n".join(lines)
    assert lines[1].startswith("lm: ")
    pytorch_row = next(line for line in lines if line.startswith("  pytorch "))
    assert pytorch_row.split()[1:] == ["10.0", "(9.00-11.0)", "4.00", "(4.00-4.00)", "6,400",
                                       "20.0", "100.0", "2.00000", "1.50000"]
    npformer_row = next(line for line in lines if line.startswith("  npformer "))
    assert npformer_row.split()[-4:] == ["20.0", "80.0", "2.00050", "1.40000"]
    assert re.search(r"^ratio lm\s+train 1\.50x  infer 0\.50x  peak memory 0\.80x  \| "
                     r"first-step loss \(dropout off\) 2\.000500 vs 2\.000000 \(rel diff "
                     r"2\.5e-04\)$", text,
                     re.MULTILINE), text
    assert "WARNING" not in text

    pair["npformer"]["losses"][0] = 2.01  # 5e-3 relative: not the same model
    assert re.search(r"^WARNING: lm: first-step losses differ", "\n".join(
        gpu.config_lines("lm", LM, pair)), re.MULTILINE)


def test_gpu_config_table_without_memory_or_with_a_failed_side():
    from bench import gpu

    cpu_pair = {"pytorch": fake_result(10, 4, [2.0]),
                "npformer": fake_result(5, 2, [2.0], weights_loaded=True)}
    text = "\n".join(gpu.config_lines("lm", LM, cpu_pair))
    assert "peak memory n/a (not measured on the CPU)" in text
    row = next(line for line in text.splitlines() if line.startswith("  npformer "))
    assert row.split()[-3:] == ["12,800", "2.00000", "2.00000"]  # blank memory cells

    failed = {"pytorch": fake_result(10, 4, [2.0]),
              "npformer": dict(side="npformer", error="worker exited 1: out of memory")}
    text = "\n".join(gpu.config_lines("lm", LM, failed))
    assert "  npformer        FAILED: worker exited 1: out of memory" in text
    assert re.search(r"^ratio lm\s+train n/a .*a side failed\)  \| loss not compared", text,
                     re.MULTILINE), text


def test_gpu_markdown_table():
    from bench import gpu

    results = {"lm": {"pytorch": fake_result(10, 4, [2.0], peak_mib=100),
                      "npformer": fake_result(15, 2, [2.0], peak_mib=80)},
               "imdb": {"pytorch": fake_result(10, 4, [2.0]),
                        "npformer": dict(side="npformer", error="boom")}}
    lines = gpu.markdown_lines(results, {"lm": LM, "imdb": LM})
    assert lines[3] == ("| lm | 15.0 | 10.0 | 1.50x | 2.00 | 4.00 | 0.50x | 4,267 | 6,400 "
                        "| 80.0 | 100.0 | 0.80x |")
    assert lines[4].startswith("| imdb | failed |")
    assert all(line.count("|") == lines[1].count("|") for line in lines[1:])


@pytest.mark.parametrize("env, verdict", [
    ({}, "off on both sides"),
    ({"CUPY_TF32": "1"}, "DIFFERS: torch off, CuPy on"),
    ({"CUPY_TF32": "1", "NVIDIA_TF32_OVERRIDE": "0"}, "off on both sides"),
])
def test_tf32_line(env, verdict):
    from bench import gpu

    torch_settings = dict(allow_tf32=False, matmul_precision="highest", fp32_precision="ieee")
    line = gpu.tf32_line({"tf32": torch_settings},
                         {"tf32_env": {name: env.get(name) for name in gpu.TF32_VARIABLES}})
    assert line.startswith(f"TF32:      {verdict}"), line
    tf32_torch = dict(torch_settings, matmul_precision="high")
    assert "torch on" in gpu.tf32_line({"tf32": tf32_torch}, {"tf32_env": {"CUPY_TF32": None}})


def test_cupy_peak_records_the_pool_high_water_mark_and_restores_the_allocator():
    """CupyPeak against a stand-in for CuPy's pool: the peak of used_bytes() seen at each
    allocation, from the bytes in use at start(); the pool's malloc reinstated by stop()."""
    from types import SimpleNamespace

    from bench import gpu

    class Pool:
        used = 1000

        def malloc(self, size):
            self.used += size
            return ("block", size)

        def used_bytes(self):
            return self.used

    pool, installed, synced = Pool(), [], []
    cupy = SimpleNamespace(
        get_default_memory_pool=lambda: pool,
        cuda=SimpleNamespace(set_allocator=installed.append, get_current_stream=lambda:
                             SimpleNamespace(synchronize=lambda: synced.append(1))))
    peak = gpu.CupyPeak(cupy)
    assert peak.start() == 1000
    allocate = installed[-1]
    assert allocate(500) == ("block", 500)  # in use 1500
    pool.used -= 1200  # arrays freed: 300
    allocate(100)  # 400
    assert peak.stop() == 1500
    assert installed[-1] == pool.malloc and len(synced) == 2
    assert peak.start() == 400  # reset to what is in use now


def test_gpu_script_without_a_gpu_exits_2_with_one_line():
    if GPU:
        pytest.skip("a GPU is here: the script would run the benchmark")
    proc = run_gpu_script("--configs", "lm", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench/gpu.py needs a GPU: "), proc.stderr
    assert "cupy" in lines[0].lower() or "torch" in lines[0]


def check_gpu_script_output(proc, names=GPU_NAMES):
    """Exit 0, nothing failed, no loss warning, and for every configuration its block:
    title, column names, rule, a row per side, the ratio line with the loss check."""
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "FAILED" not in out and "WARNING" not in out, out
    lines = out.splitlines()
    for name in names:
        start = next((i for i, line in enumerate(lines) if line.startswith(f"{name}: ")), None)
        assert start is not None, f"{name} missing:\n{out}"
        title, columns, rule, pytorch, npformer, ratios = lines[start:start + 6]
        for side, row in (("pytorch", pytorch), ("npformer", npformer)):
            assert re.match(rf"  {side}\s+[\d.]+ \([\d.]+-[\d.]+\)\s+[\d.]+ \([\d.]+-[\d.]+\)"
                            r"\s+[\d,]+\s", row), row
        assert re.match(rf"ratio {name}\s+train \d+\.\d+x  infer \d+\.\d+x  peak memory ",
                        ratios), ratios
        assert "first-step loss" in ratios, ratios
    return out


def test_gpu_script_runs_on_the_cpu(tmp_path):
    """``--device cpu``: the whole orchestration (workers, shared weights, tables, JSON)
    with torch on the CPU and npformer on NumPy."""
    require_torch()
    path = tmp_path / "gpu.json"
    proc = run_gpu_script("--smoke", "--device", "cpu", "--markdown", "--json", str(path))
    out = check_gpu_script_output(proc)
    assert "peak memory n/a (not measured on the CPU)" in out
    assert sum(line.startswith("| ") for line in out.splitlines()) == 1 + len(GPU_NAMES)
    saved = json.loads(path.read_text())
    assert list(saved["configs"]) == list(GPU_NAMES)
    for name in GPU_NAMES:
        entry = saved["configs"][name]
        assert entry["npformer"]["weights_loaded"] is True
        assert len(entry["pytorch"]["train_times"]) == 2  # --smoke: 2 timed steps


def test_gpu_script_profiles_npformer_on_the_cpu():
    proc = run_gpu_script("--profile", "lm", "--smoke", "--device", "cpu", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^npformer lm on NumPy: 10 training steps in [\d.]+ s", proc.stdout,
                     re.MULTILINE), proc.stdout
    assert "top 25 by cumulative time" in proc.stdout
    assert "top 25 by own time (tottime)" in proc.stdout
    assert "(step)" in proc.stdout  # measure.py's step function is in the profile


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CuPy and a GPU")
def test_gpu_script_smoke_on_the_gpu():
    out = check_gpu_script_output(run_gpu_script("--smoke"))
    for label in ("device:", "libraries:", "TF32:", "timing:", "memory:"):
        assert re.search(rf"^{label}", out, re.MULTILINE), f"{label} missing:\n{out}"
    for name in GPU_NAMES:  # both peaks measured: a memory ratio, not n/a
        line = next(line for line in out.splitlines() if line.startswith(f"ratio {name} "))
        assert re.search(r"peak memory \d+\.\d+x", line), line


# --------------------------------------------------------------------------- FLOPs and peak
def lm_by_hand(B, T, D, L, V, F=None):
    """One forward of a causal LM by hand: per block q, k, v (2N.D.3D), scores and weighted
    values (2N.T.D each), output (2N.D.D), feed-forward (2 x 2N.D.F); the logits 2N.D.V."""
    N, F = B * T, F or 4 * D
    return L * (2 * N * D * 3 * D + 2 * 2 * N * T * D + 2 * N * D * D
                + 2 * 2 * N * D * F) + 2 * N * D * V


def test_lm_flops_are_the_formula_and_the_issues_figures():
    """Issue 48: nanoGPT's baby GPT, about 3.96 GFLOP a training step (3x the forward:
    6 x parameters x tokens plus attention) and 1.32 GFLOP a forward."""
    from bench.configs import CONFIGS
    from bench.flops import step_flops

    forward = lm_by_hand(B=12, T=64, D=128, L=4, V=65)
    assert forward == 1_321_402_368
    assert step_flops(CONFIGS["lm"]) == {"train": 3 * forward, "infer": forward}
    assert round(3 * forward / 1e9, 2) == 3.96 and round(forward / 1e9, 2) == 1.32
    assert step_flops(LM) == {"train": 3 * lm_by_hand(4, 16, 16, 1, 65, F=32),
                              "infer": lm_by_hand(4, 16, 16, 1, 65, F=32)}


def test_gpt2_benchmark_counts_gpt2_smalls_shape():
    from bench.flops import step_flops
    from bench.gpt2 import SMALL, flops_config

    forward = lm_by_hand(B=4, T=256, D=768, L=12, V=50257)
    assert step_flops(flops_config(SMALL, 4, 256)) == {"train": 3 * forward, "infer": forward}


def test_flops_follow_each_field_of_the_configuration():
    from bench.configs import CONFIGS
    from bench.flops import forward_flops

    lm = CONFIGS["lm"]
    base = forward_flops(lm)
    logits = 2 * 768 * 128 * 65
    block = (base - logits) // 4
    assert forward_flops(dict(lm, num_layers=5)) == base + block
    assert forward_flops(dict(lm, batch=24)) == 2 * base  # every product scales with B
    assert forward_flops(dict(lm, vocab_size=130)) == base + logits
    attention = 2 * 2 * 768 * 64 * 128  # a block's scores and weighted values, N x T x D
    # the same N = B T positions, each attending to twice as many: attention doubles
    assert forward_flops(dict(lm, seq_len=128, batch=6)) == base + 4 * attention
    assert forward_flops(dict(lm, d_ff=1024)) == base + 4 * 2 * 2 * 768 * 128 * 512

    imdb = CONFIGS["imdb"]
    assert forward_flops(dict(imdb, num_classes=5)) == forward_flops(imdb) + 2 * 32 * 64 * 3
    with pytest.raises(ValueError, match=r"cfg\['kind'\] must be .*got 'vision'"):
        forward_flops(dict(imdb, kind="vision"))


def test_seq2seq_training_counts_logits_at_the_valid_targets_only():
    """The demo's update asks for ``valid_only`` logits; the bench's forward computes them
    at every target position; cross-attention reads the source's length."""
    from bench.configs import CONFIGS, SEED, make_batch
    from bench.flops import forward_flops, step_flops

    cfg = CONFIGS["seq2seq"]
    B, T, D, V = cfg["batch"], cfg["seq_len"], cfg["d_model"], cfg["tgt_vocab_size"]
    valid = int(make_batch(cfg, SEED + 1)[4].sum())
    assert 0 < valid < B * T
    flops = step_flops(cfg)
    assert flops["infer"] - flops["train"] // 3 == 2 * (B * T - valid) * D * V
    longer = dict(cfg, src_len=20)  # the encoder (self-attention T x T grows 4x), the
    #   cross-attention's k, v, scores and weighted values: exactly these terms change
    Ns, Ns2, Nt = B * 10, B * 20, B * T
    encoder = lambda n, s: 2 * (2 * n * D * 3 * D + 2 * 2 * n * s * D + 2 * n * D * D  # noqa: E731
                                + 2 * 2 * n * D * cfg["d_ff"])
    cross = lambda n, s: 2 * (2 * n * D * 2 * D + 2 * 2 * Nt * s * D)  # noqa: E731
    assert forward_flops(longer) - forward_flops(cfg) == (
        encoder(Ns2, 20) - encoder(Ns, 10) + cross(Ns2, 20) - cross(Ns, 10))


def test_share_of_peak_is_flops_over_time_over_peak():
    from bench.flops import share_of_peak

    assert share_of_peak(3.96e9, 0.042, 200.0) == pytest.approx(3.96 / 0.042 / 200)
    assert share_of_peak(1e9, 0.01, 100.0) == pytest.approx(1.0)
    for seconds, peak in ((0.0, 100.0), (0.01, 0.0), (-1.0, 100.0)):
        with pytest.raises(ValueError, match="seconds and peak_gflops must be positive"):
            share_of_peak(1e9, seconds, peak)


def test_utilisation_table_rows_plain_and_markdown(capsys):
    """Every side of every configuration: its counted GFLOP, median ms and share of the
    peak, training and inference; a failed side says so."""
    from bench import report

    forward = lm_by_hand(4, 16, 16, 1, 65, F=32)  # 460,800
    peak = 3 * forward / 0.010 / 0.5 / 1e9  # PyTorch's 10 ms training step: 50%
    results = {"lm": {"pytorch": fake_result(10, 4, [2.0]),
                      "npformer": fake_result(5, 2, [2.0]),
                      "nanogpt": dict(side="nanogpt", error="boom")}}
    rows = report.utilisation_rows(results, {"lm": LM}, peak)
    assert rows == [("lm", "pytorch", "0.0014", "10.0", "50%", "0.00046", "4.00", "42%"),
                    ("lm", "npformer", "0.0014", "5.00", "100%", "0.00046", "2.00", "83%"),
                    ("lm", "nanogpt", "FAILED", "", "", "", "", "")]
    report.print_utilisation(results, {"lm": LM}, peak)
    out = capsys.readouterr().out
    assert re.search(r"^lm +npformer +0\.0014 +5\.00 +100% +0\.00046 +2\.00 +83%$", out,
                     re.MULTILINE), out
    lines = report.utilisation_markdown(results, {"lm": LM}, peak)
    assert "| lm | nanoGPT's GPT | FAILED |" in "\n".join(lines)
    assert "| lm | PyTorch | 0.0014 | 10.0 | 50% | 0.00046 | 4.00 | 42% |" in lines
    assert all(line.count("|") == 9 for line in lines if line.startswith("|"))
    report.print_markdown(results, {"lm": LM}, peak)
    assert "| config | side | train GFLOP | train ms | share of peak |" in capsys.readouterr().out


def test_peak_is_the_best_rate_of_every_library_and_shape(monkeypatch):
    from bench import peak

    rates = [dict(library="numpy", shape=(8, 8, 8), gflops=1.0),
             dict(library="torch", shape=(64, 64, 64), gflops=3.0),
             dict(library="numpy", shape=(64, 64, 64), gflops=2.0)]
    seen = {}

    def fake_rates(shapes, threads, repeats):
        seen.update(shapes=shapes, threads=threads, repeats=repeats)
        return rates

    monkeypatch.setattr(peak, "matmul_rates", fake_rates)
    monkeypatch.setattr(peak, "copy_rates", lambda nbytes, threads, repeats: [
        dict(library="numpy", bytes=nbytes, gb_s=5.0)])
    limits = peak.measure([(8, 8, 8), (3, 5, 7)], 2, smoke=True)
    assert limits["matmul"] == rates[1] and limits["copy"]["gb_s"] == 5.0
    assert seen == dict(shapes=[(3, 5, 7), (8, 8, 8), (64, 64, 64), (128, 128, 128)],
                        threads=2, repeats=peak.SMOKE_REPEATS)
    with pytest.raises(ValueError, match="threads must be at least 1, got 0"):
        peak.measure([], 0)


def test_peak_and_copy_rates_run_on_every_installed_library():
    from bench import peak

    rates = peak.matmul_rates([(16, 8, 4)], 1, 1)
    assert {r["library"] for r in rates} == set(peak.libraries())
    assert all(r["shape"] == (16, 8, 4) and r["gflops"] > 0 for r in rates)
    copies = peak.copy_rates(2 ** 16, 1, 1)
    assert all(c["bytes"] == 2 ** 16 and c["gb_s"] > 0 for c in copies)
    reads = peak.read_rates(2 ** 16, 1, 1)  # bench/decode.py's bandwidth
    assert {r["library"] for r in reads} == set(peak.libraries())
    assert all(r["bytes"] == 2 ** 16 and r["gb_s"] > 0 for r in reads)


# --------------------------------------------------------------------------- bench/decode.py
def test_decode_bench_runs_on_both_shapes_and_batches():
    """``bench/decode.py --smoke --markdown``: both sides decode both (tiny) shapes at
    batch 1 and 8, of equal parameter counts (else it exits with an error); the bandwidth
    line and a table row for each shape and batch come out."""
    require_torch()
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "decode.py"), "--smoke",
                           "--markdown"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert re.search(r"^bandwidth: read [\d.]+ GB/s .* copy [\d.]+ GB/s", out, re.MULTILINE), out
    number = r"-?[\d.]+"
    for model in ("lm", "gpt2"):
        for batch in (1, 8):
            assert re.search(rf"^\| {model} \| {batch} \| {number} \| {number} \| {number}x \| "
                             rf"[\d.]+ \| [\d.]+ \| {number}x \|$", out, re.MULTILINE), out


def test_decode_bound_counts_the_weights_and_the_cache_read_per_token():
    """GPT-2 small: 124,439,808 parameters, of which the positions' 1,024 x 768 are read a
    row at a time (left out); each layer's keys and values, (B, c, 768) each, are read."""
    from bench import decode

    gpt2 = decode.SHAPES["gpt2"]
    assert decode.bytes_per_token(gpt2, 124_439_808, 1, 0) == 4 * 123_653_376
    assert decode.bytes_per_token(gpt2, 124_439_808, 8, 10) == 4 * (
        123_653_376 + 2 * 12 * 8 * 10 * 768)


def test_products_alone_counts_every_product_and_its_backward():
    """``bench/products.py --smoke``: a row per forward product of bench/flops.py, and the
    sums are those rows' times (a product left out or counted twice changes them)."""
    from bench import products
    from bench.configs import SMOKE
    from bench.flops import forward_products

    cfg = SMOKE["lm"]
    rows = products.product_rows(cfg, threads=2, repeats=1)
    assert [r["product"] for r in rows] == forward_products(cfg, training=True)
    assert all(r["forward"] > 0 and r["backward"] > 0 for r in rows)
    assert products.backward_shapes(rows[0]["product"]) == [(384, 96, 32), (32, 384, 96)]
    out = products.table("lm", cfg, rows, peak_gflops=100.0)
    train = 1e3 * sum(r["forward"] + r["backward"] for r in rows)
    assert f"training step: the products alone {train:.2f} ms" in out
    assert products.split_rows(7, 2) == [4, 3] and products.split_rows(1, 2) == [1, 0]
