"""Optimizers, clipping and schedules: step-for-step parity with PyTorch, and bookkeeping.

Properties checked:

* for any shapes, hyperparameters and gradients, SGD (momentum), Adam and AdamW
  follow ``torch.optim`` for 12 updates: parameters *and* optimizer state, to
  1e-12 (relative) in float64 and 1e-6 in float32; parameters with
  ``decay=False`` match a second torch parameter group with weight_decay 0;
* ``clip_grad_norm`` returns torch's pre-clipping norm and leaves torch's grads;
* the schedules have their defining shape (peak, end value, monotonicity) and
  agree with the paper's formula and with torch's built-in schedulers;
* saving the state after N updates and resuming for M gives exactly the arrays
  of N + M updates in one go, also through an ``.npz`` file;
* the same code runs on ``array_api_strict`` and gives NumPy's numbers, bit for bit;
* float32 stays float32; a state dict that does not fit is refused clearly.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from npformer import backend, optim
from npformer.nn.module import Parameter
from tests.helpers import tiered

# A behaviour test: it runs in both tiers (tests.helpers.tiered), which must behave the same.
pytestmark = pytest.mark.usefixtures("tier")

SETTINGS = settings(max_examples=25, deadline=None)
STEPS = 12
REL = {"float64": 1e-12, "float32": 1e-6}

shapes_st = st.lists(
    st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4
)
dtype_st = st.sampled_from(["float64", "float32"])


# =========================================================================== helpers
def make_params(shapes, dtype, seed, decay=None):
    """npformer Parameters (NumPy) and their torch twins with identical values."""
    rng = np.random.default_rng(seed)
    decay = decay if decay is not None else [True] * len(shapes)
    ours, theirs = [], []
    for shape, dec in zip(shapes, decay):
        data = rng.standard_normal(shape).astype(dtype)
        ours.append(Parameter(data.copy(), decay=dec))
        theirs.append(torch.tensor(data.copy(), requires_grad=True))
    return ours, theirs


def grad_sequence(shapes, dtype, seed, steps=STEPS):
    rng = np.random.default_rng(seed + 1)
    return [
        [(rng.standard_normal(s) * rng.uniform(0.01, 3.0)).astype(dtype) for s in shapes]
        for _ in range(steps)
    ]


def torch_groups(theirs, decay, wd):
    """Two torch parameter groups: the decayed params (wd) and the others (0)."""
    groups = [
        {"params": [t for t, d in zip(theirs, decay) if d], "weight_decay": wd},
        {"params": [t for t, d in zip(theirs, decay) if not d], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def run_both(ours_opt, ours, torch_opt, theirs, grads, lrs=None):
    for t, step_grads in enumerate(grads, start=1):
        for p, tp, g in zip(ours, theirs, step_grads):
            p.grad = g.copy()
            tp.grad = torch.from_numpy(g.copy())
        if lrs is not None:
            for group in torch_opt.param_groups:
                group["lr"] = lrs(t)
        ours_opt.step()
        torch_opt.step()


def assert_match(ours, theirs, dtype, what="parameter"):
    """Equal to REL[dtype], relative to each element and to the array's largest entry.

    (An element that is the small difference of large terms, e.g. a momentum buffer
    summing gradients of opposite signs, carries the rounding of the large terms.)
    """
    for i, (a, b) in enumerate(zip(ours, theirs)):
        b = b.detach().numpy() if isinstance(b, torch.Tensor) else b
        assert a.dtype == np.dtype(dtype), f"{what} {i} changed dtype to {a.dtype}"
        scale = max(1.0, float(np.max(np.abs(b))))
        np.testing.assert_allclose(a, b, rtol=REL[dtype], atol=REL[dtype] * scale,
                                   err_msg=f"{what} {i}")


# =========================================================================== parity
@SETTINGS
@given(
    shapes=shapes_st,
    dtype=dtype_st,
    lr=st.floats(1e-3, 0.5),
    momentum=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    wd=st.sampled_from([0.0, 1e-3, 0.1]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_sgd_matches_torch(shapes, dtype, lr, momentum, wd, seed, data):
    decay = data.draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    ours, theirs = make_params(shapes, dtype, seed, decay)
    opt = optim.SGD(ours, lr=lr, momentum=momentum, weight_decay=wd)
    ref = torch.optim.SGD(torch_groups(theirs, decay, wd), lr=lr, momentum=momentum)
    run_both(opt, ours, ref, theirs, grad_sequence(shapes, dtype, seed))
    assert_match([p.data for p in ours], theirs, dtype)
    if momentum:
        bufs = [ref.state[t]["momentum_buffer"] for t in theirs]
        assert_match(opt.state["momentum"], bufs, dtype, "momentum buffer")
    assert opt.updates == STEPS


@SETTINGS
@given(
    shapes=shapes_st,
    dtype=dtype_st,
    lr=st.floats(1e-4, 0.1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
    wd=st.sampled_from([0.0, 1e-2, 0.3]),
    decoupled=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_adam_and_adamw_match_torch(shapes, dtype, lr, beta1, beta2, eps, wd, decoupled,
                                    seed, data):
    decay = data.draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
    ours, theirs = make_params(shapes, dtype, seed, decay)
    ours_cls, torch_cls = (optim.AdamW, torch.optim.AdamW) if decoupled else (
        optim.Adam, torch.optim.Adam)
    opt = ours_cls(ours, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
    ref = torch_cls(torch_groups(theirs, decay, wd), lr=lr, betas=(beta1, beta2), eps=eps)
    run_both(opt, ours, ref, theirs, grad_sequence(shapes, dtype, seed))
    assert_match([p.data for p in ours], theirs, dtype)
    assert_match(opt.state["m"], [ref.state[t]["exp_avg"] for t in theirs], dtype, "m")
    assert_match(opt.state["v"], [ref.state[t]["exp_avg_sq"] for t in theirs], dtype, "v")


def test_adamw_no_decay_params_are_untouched_by_decay():
    """With zero gradients Adam moves nothing, so only the decoupled decay acts."""
    w = Parameter(np.ones((3, 3)), decay=True)
    b = Parameter(np.ones(3), decay=False)
    opt = tiered.AdamW([w, b], lr=0.1, weight_decay=0.5)
    for _ in range(4):
        opt.step()
    np.testing.assert_allclose(w.data, (1 - 0.1 * 0.5) ** 4, rtol=1e-15)
    np.testing.assert_array_equal(b.data, np.ones(3))


def test_parity_check_can_fail():
    """The harness tells Adam (L2 in the gradient) from AdamW (decoupled decay)."""
    shapes = [(4, 3), (3,)]
    ours, theirs = make_params(shapes, "float64", 0)
    opt = tiered.Adam(ours, lr=0.01, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1)
    run_both(opt, ours, ref, theirs, grad_sequence(shapes, "float64", 0))
    with pytest.raises(AssertionError):
        assert_match([p.data for p in ours], theirs, "float64")


def test_schedule_given_as_lr_is_called_with_the_update_number():
    shapes = [(5, 4), (4,)]
    sched = optim.warmup_cosine(peak_lr=0.05, warmup=3, total_updates=10, min_lr=0.001)
    ours, theirs = make_params(shapes, "float64", 3)
    opt = tiered.Adam(ours, lr=sched)
    ref = torch.optim.Adam(theirs, lr=sched(1))
    run_both(opt, ours, ref, theirs, grad_sequence(shapes, "float64", 3), lrs=sched)
    assert_match([p.data for p in ours], theirs, "float64")
    assert opt.lr == sched(STEPS)


def test_set_lr_is_used_by_the_next_step():
    p = Parameter(np.zeros(2))
    opt = optim.SGD([p], lr=1.0)
    opt.set_lr(0.25)
    p.grad = np.ones(2)
    opt.step()
    np.testing.assert_array_equal(p.data, [-0.25, -0.25])
    with pytest.raises(ValueError, match="lr must be .*>= 0"):
        opt.set_lr(-1.0)


# =========================================================================== clipping
@SETTINGS
@given(
    shapes=shapes_st,
    dtype=dtype_st,
    scale=st.floats(1e-3, 1e3),
    max_norm=st.floats(0.01, 10.0),
    seed=st.integers(0, 2**16),
)
def test_clip_grad_norm_matches_torch(shapes, dtype, scale, max_norm, seed):
    ours, theirs = make_params(shapes, dtype, seed)
    grads = [g * np.asarray(scale, dtype=dtype) for g in grad_sequence(shapes, dtype, seed, 1)[0]]
    for p, tp, g in zip(ours, theirs, grads):
        p.grad = g.copy()
        tp.grad = torch.from_numpy(g.copy())
    flat = np.concatenate([g.astype(np.float64).ravel() for g in grads])
    assert optim.global_grad_norm(ours) == pytest.approx(np.linalg.norm(flat), rel=1e-6)

    total = optim.clip_grad_norm(ours, max_norm)
    ref_total = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert isinstance(total, float)
    assert total == pytest.approx(float(ref_total), rel=REL[dtype])
    assert_match([p.grad for p in ours], [t.grad for t in theirs], dtype, "clipped grad")
    after = optim.global_grad_norm(ours)
    assert after <= max_norm * (1 + 1e-5)
    if total + 1e-6 <= max_norm:  # factor clamped at 1: gradients unchanged, bit for bit
        for p, g in zip(ours, grads):
            np.testing.assert_array_equal(p.grad, g)


def test_clip_grad_norm_rejects_bad_max_norm():
    p = Parameter(np.ones(3))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_norm"):
            optim.clip_grad_norm([p], bad)


# =========================================================================== schedules
def paper_lr(step, d_model, warmup):
    return d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


@settings(max_examples=30, deadline=None)
@given(d_model=st.sampled_from([64, 128, 512, 1024]), warmup=st.integers(1, 500),
       scale=st.floats(0.1, 10.0))
def test_warmup_inverse_sqrt_is_the_paper_formula(d_model, warmup, scale):
    sched = optim.warmup_inverse_sqrt(d_model, warmup=warmup, scale=scale)
    steps = np.arange(1, 4 * warmup + 10)
    lrs = np.array([sched(int(t)) for t in steps])
    ref = np.array([scale * paper_lr(int(t), d_model, warmup) for t in steps])
    np.testing.assert_allclose(lrs, ref, rtol=1e-14)
    assert steps[np.argmax(lrs)] == warmup
    assert np.all(np.diff(lrs[:warmup]) > 0)  # linear warmup
    assert np.all(np.diff(lrs[warmup - 1:]) < 0)  # then 1/sqrt decay


def test_warmup_inverse_sqrt_paper_values():
    sched = optim.warmup_inverse_sqrt(512, warmup=4000)
    assert sched(4000) == pytest.approx(512**-0.5 * 4000**-0.5)  # about 7.0e-4
    assert sched(1) == pytest.approx(512**-0.5 * 4000**-1.5)
    assert sched(16000) == pytest.approx(sched(4000) / 2)


@settings(max_examples=30, deadline=None)
@given(warmup=st.integers(1, 300), peak=st.floats(1e-5, 1.0))
def test_warmup_inverse_sqrt_peak_lr_form(warmup, peak):
    sched = optim.warmup_inverse_sqrt(warmup=warmup, peak_lr=peak)
    paper = optim.warmup_inverse_sqrt(256, warmup=warmup)
    assert sched(warmup) == pytest.approx(peak, rel=1e-12)
    for t in (1, max(1, warmup // 2), warmup + 1, 3 * warmup):
        assert sched(t) / paper(t) == pytest.approx(peak / paper(warmup), rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(peak=st.floats(1e-4, 1.0), frac=st.floats(0.0, 0.99), warmup=st.integers(0, 100),
       decay=st.integers(1, 400))
def test_warmup_cosine_shape(peak, frac, warmup, decay):
    min_lr = peak * frac
    total = warmup + decay
    sched = optim.warmup_cosine(peak_lr=peak, warmup=warmup, total_updates=total, min_lr=min_lr)
    lrs = np.array([sched(t) for t in range(1, total + 20)])
    if warmup:
        assert sched(warmup) == pytest.approx(peak, rel=1e-15)
        assert np.all(np.diff(lrs[:warmup]) > 0)
        assert lrs.max() == pytest.approx(peak, rel=1e-15)
    assert sched(total) == pytest.approx(min_lr, rel=1e-12, abs=1e-15)
    assert np.all(np.diff(lrs[max(warmup, 1) - 1:]) <= 1e-15)  # never increases after warmup
    assert np.all(lrs[total:] == min_lr)  # flat afterwards
    assert np.all(lrs[warmup:] >= min_lr - 1e-15) and np.all(lrs <= peak * (1 + 1e-15))


def nanogpt_get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT's get_lr (iterations from 0), transcribed independently."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


@pytest.mark.parametrize("peak,warmup,total,min_lr", [
    (6e-4, 20, 200, 6e-5), (1e-3, 2, 50, 0.0), (0.1, 10, 11, 0.01), (3e-4, 5, 1000, 1e-5),
])
def test_warmup_cosine_matches_nanogpt_and_torch_schedulers(peak, warmup, total, min_lr):
    sched = optim.warmup_cosine(peak_lr=peak, warmup=warmup, total_updates=total, min_lr=min_lr)
    # nanoGPT: update t (from 1) is iteration t-1; its decay starts one iteration after ours
    # peaks, so compare the warmup literally and the cosine with the shifted iteration.
    for t in range(1, warmup + 1):
        assert sched(t) == pytest.approx(nanogpt_get_lr(t - 1, peak, warmup, total, min_lr))
    for t in range(warmup, total + 5):
        assert sched(t) == pytest.approx(nanogpt_get_lr(t, peak, warmup, total, min_lr),
                                         rel=1e-12, abs=1e-15)

    # torch: LinearLR for the warmup, CosineAnnealingLR after; the lr after k scheduler
    # steps is the lr of update k + 1.
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warm = torch.optim.lr_scheduler.LinearLR(
            opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup,
                                                         eta_min=min_lr)
        seq = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[warmup - 1])
        for t in range(1, total + 1):
            assert sched(t) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-12), t
            opt.step()
            seq.step()


def test_constant_schedule():
    sched = optim.constant(3e-4)
    assert [sched(t) for t in (1, 10, 10**6)] == [3e-4] * 3


@pytest.mark.parametrize("make,match", [
    (lambda: optim.constant(-1.0), "lr"),
    (lambda: optim.warmup_cosine(peak_lr=-1e-3, warmup=1, total_updates=10), "peak_lr"),
    (lambda: optim.warmup_cosine(peak_lr=1e-3, warmup=-1, total_updates=10), "warmup"),
    (lambda: optim.warmup_cosine(peak_lr=1e-3, warmup=1, total_updates=0), "total_updates"),
    (lambda: optim.warmup_cosine(peak_lr=1e-3, warmup=1, total_updates=10, min_lr=1e-2), "min_lr"),
    (lambda: optim.warmup_inverse_sqrt(warmup=10), "exactly one"),
    (lambda: optim.warmup_inverse_sqrt(512, warmup=10, peak_lr=1e-3), "exactly one"),
    (lambda: optim.warmup_inverse_sqrt(512, warmup=0), "warmup"),
    (lambda: optim.warmup_inverse_sqrt(-4, warmup=10), "d_model"),
    (lambda: optim.warmup_inverse_sqrt(warmup=10, peak_lr=1e-3, scale=2.0), "scale"),
])
def test_schedules_reject_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_schedules_reject_a_count_that_is_not_an_integer():
    """A count of updates of the wrong kind is a TypeError naming it (contracts.check_size)."""
    with pytest.raises(TypeError, match="warmup must be an integer"):
        optim.warmup_cosine(peak_lr=1e-3, warmup=2.5, total_updates=10)
    with pytest.raises(TypeError, match="update number"):
        optim.constant(1e-3)(1.0)


@pytest.mark.parametrize("sched", [
    optim.constant(1e-3),
    optim.warmup_cosine(peak_lr=1e-3, warmup=5, total_updates=10),
    optim.warmup_inverse_sqrt(512, warmup=10),
])
def test_schedules_count_from_one(sched):
    with pytest.raises(ValueError, match="from 1"):
        sched(0)


# =========================================================================== state dict
OPTIMIZERS = {
    "sgd": lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: tiered.Adam(ps, lr=0.01, weight_decay=0.01),
    "adamw": lambda ps: tiered.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def _train(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.copy()
        opt.step()


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("via_file", [False, True])
def test_state_dict_resume_is_exact(kind, via_file, tmp_path):
    shapes, n, m = [(6, 4), (4,), (3, 2, 2)], 7, 5
    grads = grad_sequence(shapes, "float32", 11, n + m)
    decay = [True, False, True]

    straight, _ = make_params(shapes, "float32", 5, decay)
    opt = OPTIMIZERS[kind](straight)
    _train(opt, straight, grads)

    first, _ = make_params(shapes, "float32", 5, decay)
    opt1 = OPTIMIZERS[kind](first)
    _train(opt1, first, grads[:n])
    state = opt1.state_dict()
    weights = [p.data.copy() for p in first]
    if via_file:
        np.savez(tmp_path / "opt.npz", **state)
        with np.load(tmp_path / "opt.npz") as f:
            state = {k: f[k] for k in f.files}

    resumed = [Parameter(w, decay=d) for w, d in zip(weights, decay)]
    opt2 = OPTIMIZERS[kind](resumed)
    opt2.load_state_dict(state)
    assert opt2.updates == n
    _train(opt2, resumed, grads[n:])

    for a, b in zip(resumed, straight):
        np.testing.assert_array_equal(a.data, b.data)
        assert a.data.dtype == np.float32
    for name in opt.state:
        for a, b in zip(opt2.state[name], opt.state[name]):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == np.float32


def test_state_dict_is_flat_and_restores_hyperparameters():
    params, _ = make_params([(2, 3), (3,)], "float64", 0)
    opt = tiered.Adam(params, lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    _train(opt, params, grad_sequence([(2, 3), (3,)], "float64", 0, 2))
    state = opt.state_dict()
    assert set(state) == {"optimizer", "step", "lr", "params", "beta1", "beta2", "eps",
                          "weight_decay", "m.0", "m.1", "v.0", "v.1"}
    assert state["step"] == 2 and state["optimizer"] == "Adam" and state["params"] == 2
    other = tiered.Adam(params)  # defaults, replaced by the saved ones (as torch does)
    other.load_state_dict(state)
    assert (other.lr, other.betas, other.eps, other.weight_decay) == (0.02, (0.8, 0.99), 1e-6, 0.1)


def _adam_state(shapes, n_steps=1):
    params, _ = make_params(shapes, "float64", 0)
    opt = tiered.Adam(params)
    _train(opt, params, grad_sequence(shapes, "float64", 0, n_steps))
    return opt.state_dict()


def test_load_state_dict_rejects_a_different_number_of_params():
    state = _adam_state([(2, 3), (3,)])
    params, _ = make_params([(2, 3)], "float64", 0)
    with pytest.raises(ValueError, match="state for 2 parameters, this optimizer has 1"):
        tiered.Adam(params).load_state_dict(state)


def test_load_state_dict_rejects_wrong_shapes_and_changes_nothing():
    state = _adam_state([(2, 3), (3,)])
    params, _ = make_params([(3, 2), (3,)], "float64", 0)
    opt = tiered.Adam(params)
    before = [a.copy() for a in opt.state["m"]]
    with pytest.raises(ValueError, match=r"wrong shapes: m\.0: expected \(3, 2\), got \(2, 3\)"):
        opt.load_state_dict(state)
    assert opt.updates == 0
    for a, b in zip(opt.state["m"], before):
        np.testing.assert_array_equal(a, b)


def test_load_state_dict_rejects_another_optimizer_type():
    state = _adam_state([(2, 3)])
    params, _ = make_params([(2, 3)], "float64", 0)
    with pytest.raises(ValueError, match="saved by Adam, not AdamW"):
        tiered.AdamW(params).load_state_dict(state)
    with pytest.raises(ValueError, match="saved by Adam, not SGD"):
        optim.SGD(params, lr=0.1, momentum=0.9).load_state_dict(state)
    sgd_plain = optim.SGD(params, lr=0.1).state_dict()
    with pytest.raises(ValueError, match="momentum"):
        optim.SGD(params, lr=0.1, momentum=0.9).load_state_dict(sgd_plain)


def test_load_state_dict_rejects_missing_and_extra_keys():
    state = _adam_state([(2, 3), (3,)])
    del state["v.1"]
    state["w.0"] = np.zeros((2, 3))
    params, _ = make_params([(2, 3), (3,)], "float64", 0)
    with pytest.raises(ValueError, match=r"missing keys: \['v\.1'\].*unexpected keys: \['w\.0'\]"):
        tiered.Adam(params).load_state_dict(state)


# =========================================================================== dtype policy
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_float32_stays_float32(kind):
    shapes = [(4, 3), (3,)]
    params, _ = make_params(shapes, "float32", 1, decay=[True, False])
    opt = OPTIMIZERS[kind](params)
    for step_grads in grad_sequence(shapes, "float32", 1, 3):
        for p, g in zip(params, step_grads):
            p.grad = g
        optim.clip_grad_norm(params, 0.5)
        for p in params:
            assert p.grad.dtype == np.float32
        opt.step()
    for p in params:
        assert p.data.dtype == np.float32
    for arrays in opt.state.values():
        assert all(a.dtype == np.float32 for a in arrays)
    # a float64 checkpoint is cast to the parameters' dtype on load
    state = {k: (v.astype(np.float64) if isinstance(v, np.ndarray) else v)
             for k, v in opt.state_dict().items()}
    opt.load_state_dict(state)
    for arrays in opt.state.values():
        assert all(a.dtype == np.float32 for a in arrays)


def test_step_rejects_a_gradient_of_the_wrong_shape_or_dtype_before_updating_anything():
    good = Parameter(np.ones(4, dtype=np.float32))
    p = Parameter(np.zeros((2, 3), dtype=np.float32))
    opt = tiered.Adam([good, p])
    good.grad = np.ones(4, dtype=np.float32)
    p.grad = np.zeros((3,), dtype=np.float32)
    with pytest.raises(RuntimeError, match=r"params\[1\]: gradient shape"):
        opt.step()
    p.grad = np.zeros((2, 3), dtype=np.float64)
    with pytest.raises(RuntimeError, match="dtype"):
        opt.step()
    np.testing.assert_array_equal(good.data, np.ones(4))  # no half-done update
    assert opt.updates == 0


@pytest.mark.parametrize("make,match", [
    (lambda ps: tiered.Adam([]), "empty"),
    (lambda ps: tiered.Adam([np.zeros(3)]), "not a Parameter"),
    (lambda ps: tiered.Adam(ps + ps), "more than once"),
    (lambda ps: tiered.Adam(ps, lr=-1e-3), "lr"),
    (lambda ps: tiered.Adam(ps, betas=(1.0, 0.999)), "beta1"),
    (lambda ps: tiered.Adam(ps, betas=(0.9, -0.1)), "beta2"),
    (lambda ps: tiered.AdamW(ps, weight_decay=-0.1), "weight_decay"),
    (lambda ps: optim.SGD(ps, lr=0.1, momentum=1.5), "momentum"),
])
def test_constructors_reject_bad_arguments(make, match):
    params, _ = make_params([(2,)], "float64", 0)
    with pytest.raises((ValueError, TypeError), match=match):
        make(params)


# =========================================================================== strict backend
@pytest.fixture
def strict_backend():
    backend.set_backend("strict")
    try:
        yield
    finally:
        backend.set_backend("numpy")


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_runs_on_strict_backend_and_matches_numpy(kind, dtype, strict_backend):
    from array_api_strict._array_object import Array

    shapes = [(5, 3), (3,)]
    decay = [True, False]
    grads = grad_sequence(shapes, dtype, 2, 6)

    host, _ = make_params(shapes, dtype, 2, decay)
    strict = [Parameter(backend.asarray(p.data), decay=d) for p, d in zip(host, decay)]
    opt_host, opt_strict = OPTIMIZERS[kind](host), OPTIMIZERS[kind](strict)
    for step_grads in grads:
        for ph, ps, g in zip(host, strict, step_grads):
            ph.grad = g.copy()
            ps.grad = backend.asarray(g)
        norm_host = optim.clip_grad_norm(host, 1.0)
        norm_strict = optim.clip_grad_norm(strict, 1.0)
        assert norm_strict == norm_host
        opt_host.step()
        opt_strict.step()

    for ph, ps in zip(host, strict):
        assert isinstance(ps.data, Array)
        assert ps.data.device == backend.device()
        np.testing.assert_array_equal(backend.to_numpy(ps.data), ph.data)  # same kernels
        assert backend.to_numpy(ps.data).dtype == np.dtype(dtype)
    for name in opt_host.state:
        for a, b in zip(opt_strict.state[name], opt_host.state[name]):
            assert isinstance(a, Array)
            np.testing.assert_array_equal(backend.to_numpy(a), b)

    # a host (NumPy) checkpoint loads onto the strict device
    opt_strict.load_state_dict({k: backend.to_numpy(v) if not isinstance(v, (int, float, str))
                                else v for k, v in opt_host.state_dict().items()})
    for arrays in opt_strict.state.values():
        assert all(isinstance(a, Array) for a in arrays)
        assert all(a.device == backend.device() for a in arrays)
