"""Whole-model parity with PyTorch: the same model assembled from torch.nn modules.

For each architecture the reference is a plain ``torch.nn.Module`` (the one copy, in
npformer/interop/torch_reference.py, which the benchmark runs too) with the attribute names
:mod:`npformer.interop.pytorch` expects (tok_emb, pos_emb, layers.<i> =
``nn.TransformerEncoderLayer(batch_first=True)``, norm, head / lm_head; src_tok_emb,
tgt_tok_emb, encoder.layers.<i>, decoder.layers.<i> = ``nn.TransformerDecoderLayer``,
encoder.norm, decoder.norm, out_proj), built with dropout 0, the same norm_first and
activation ("gelu" is the exact form in both; npformer's "gelu_tanh" is torch's
approximate="tanh"), torch's masks (True = ignore) and pooling over valid positions.
Sinusoidal positions are npformer's table as a non-persistent buffer.  Weights move with
``load_torch_state_dict``.  npformer runs on NumPy with torch on the CPU and, where a
GPU is there, on CuPy with torch on CUDA (``parity_backend``); then

* logits, loss (cross-entropy; seq2seq: ignore_index on padding and label
  smoothing) and EVERY parameter gradient agree: float64 within 1e-9, float32
  within 1e-4 (relative to the largest entry of each tensor);
* 10 Adam steps (npformer.optim.Adam vs torch.optim.Adam) on fixed batches give
  the same loss at every step (float64, 1e-8) and the same final weights.

Torch modules stay in train() mode (dropout is 0): eval mode would take
TransformerEncoderLayer's fast path, a different kernel.  No sequence is fully
padded (torch gives NaN rows there).
"""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend, ops
from npformer.fast import layernorm as fast_layernorm
from npformer.interop.pytorch import to_torch_state_dict
from npformer.interop.torch_reference import torch_models  # the PyTorch references (bench/ too)
from npformer.models import (
    CausalLM,
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
    TransformerClassifier,
)
from npformer.train.tasks import Classification, LanguageModeling, Translation

from .conftest import require_torch, using_backend
from .helpers import (
    load_from_torch,
    rel_diff,
    tier_under_test,
    tiered,
    to_torch,
    torch_device,
    using_tier,
)


@pytest.fixture(autouse=True, params=["fast", "textbook"])
def each_tier(request):
    """Every test of this file runs in both tiers (tests.helpers.tiered), then restores it."""
    with using_tier(request.param):
        yield request.param

RTOL = {"float64": 1e-9, "float32": 1e-4}
ADAM_LOSS_RTOL = 1e-8
ADAM_STEPS = 10
PAD, BOS, EOS = 0, 2, 3
LABEL_SMOOTHING = 0.1


# =========================================================================== configs and data
def classifier_config(pooling="mean", norm_first=False, positional="learned",
                      activation="relu", num_layers=2, bigram_buckets=0):
    return ClassifierConfig(vocab_size=9, num_classes=3, d_model=8, num_heads=2,
                            num_layers=num_layers, d_ff=12, block_size=7, dropout=0.0,
                            activation=activation, norm_first=norm_first,
                            positional=positional, pooling=pooling, pad_id=PAD,
                            bigram_buckets=bigram_buckets)


def lm_config(tie=True, norm_first=True, positional="learned", activation="gelu"):
    return CausalLMConfig(vocab_size=9, block_size=6, d_model=8, num_heads=2, num_layers=2,
                          d_ff=12, dropout=0.0, activation=activation, norm_first=norm_first,
                          positional=positional, tie_weights=tie)


def seq2seq_config(norm_first=False, positional="sinusoidal", activation="relu", tie=False):
    return Seq2SeqConfig(src_vocab_size=9, tgt_vocab_size=10, d_model=8, num_heads=2,
                         num_encoder_layers=2, num_decoder_layers=2, d_ff=12, block_size=7,
                         dropout=0.0, activation=activation, norm_first=norm_first,
                         positional=positional, tie_weights=tie, pad_id=PAD, bos_id=BOS,
                         eos_id=EOS)


def _padded(rng, lengths, width, vocab, low=1):
    ids = np.full((len(lengths), width), PAD, dtype=np.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(low, vocab, size=n)
    return ids


def classifier_batch(rng, c):
    lens = np.array([6, 3, 1, 5])  # padded rows, none fully padded
    ids = _padded(rng, lens, 6, c.vocab_size)
    return ids, lens, rng.integers(0, c.num_classes, size=len(lens))


def lm_batch(rng, c):
    x = rng.integers(0, c.vocab_size, size=(3, c.block_size))
    return x, rng.integers(0, c.vocab_size, size=x.shape)


def seq2seq_batch(rng, c):
    src_lens = np.array([5, 2, 4])
    tgt_lens = np.array([3, 6, 1])  # tgt_out has tgt_lens real tokens (the last is <eos>)
    src = _padded(rng, src_lens, 5, c.src_vocab_size, low=4)
    body = _padded(rng, tgt_lens - 1, 5, c.tgt_vocab_size, low=4)
    tgt_in = np.full((3, 6), PAD, dtype=np.int64)
    tgt_out = np.full((3, 6), PAD, dtype=np.int64)
    for b, n in enumerate(tgt_lens):
        tgt_in[b, :n] = [BOS, *body[b, :n - 1]]
        tgt_out[b, :n] = [*body[b, :n - 1], EOS]
    return src, src_lens, tgt_in, tgt_out, tgt_lens


# --------------------------------------------------------------------------- per-kind glue
class Kind:
    """How to build, feed and score one architecture on both sides."""

    def __init__(self, kind, model_cls, batch_fn, task):
        self.kind, self.model_cls, self.batch_fn, self.task = kind, model_cls, batch_fn, task

    def build(self, config):
        """The model of the tier under test (``tiered``)."""
        return getattr(tiered, self.model_cls.__name__)(config)

    def torch_loss(self, torch, ref, batch):
        F = torch.nn.functional
        t = [to_torch(torch, a) for a in batch]
        if self.kind == "classifier":
            ids, lens, labels = t
            return F.cross_entropy(ref(ids, lens), labels), None
        if self.kind == "causal_lm":
            x, y = t
            logits = ref(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), logits
        src, src_lens, tgt_in, tgt_out, tgt_lens = t
        logits = ref(src, tgt_in, src_lens, tgt_lens)
        targets = torch.where(tgt_out == PAD, -100, tgt_out)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100, label_smoothing=LABEL_SMOOTHING)
        return loss, logits

    def torch_logits(self, torch, ref, batch):
        t = [to_torch(torch, a) for a in batch]
        if self.kind == "classifier":
            return ref(t[0], t[1])
        if self.kind == "causal_lm":
            return ref(t[0])
        return ref(t[0], t[2], t[1], t[4])

    def our_logits(self, model, batch):
        a = [backend.asarray(np.asarray(x)) for x in batch]
        if self.kind == "classifier":
            return model(a[0], a[1])
        if self.kind == "causal_lm":
            return model(a[0])
        return model(a[0], a[2], a[1], a[4])


KINDS = {
    "classifier": Kind("classifier", TransformerClassifier, classifier_batch, Classification()),
    "causal_lm": Kind("causal_lm", CausalLM, lm_batch, LanguageModeling()),
    "seq2seq": Kind("seq2seq", Seq2SeqTransformer, seq2seq_batch,
                    Translation(label_smoothing=LABEL_SMOOTHING, pad_id=PAD)),
}


def build_pair(kind: str, config, dtype: str, seed: int = 0):
    """(npformer model, torch reference) with identical weights (torch's init, moved over).

    Call inside ``using_backend(..., dtype)``: the reference is drawn on the CPU (the same
    weights on every device), then moved to ``torch_device()``.
    """
    torch = require_torch()
    torch.manual_seed(seed)
    tdtype = getattr(torch, dtype)
    ref = torch_models()[kind](config, tdtype).train()
    # no weight is left at a trivial value: LayerNorm's 1/0 and the attention biases torch
    # initialises to zero would hide errors in their gradients' use
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name or not bool(p.any()):
                p.add_(0.3 * torch.randn_like(p))
        assert all(bool(p.any()) for p in ref.parameters())
    ref = ref.to(torch_device())
    model = KINDS[kind].build(config)
    load_from_torch(model, ref)
    return model, ref


def torch_grads_of(model) -> dict[str, np.ndarray]:
    """npformer's gradients under PyTorch's names and layouts: the grads are put into a
    clone's parameters, which are then converted like weights."""
    clone = type(model)(model.config)
    for (_, p), (_, q) in zip(model.named_parameters(), clone.named_parameters()):
        q.data = p.grad
    return to_torch_state_dict(clone)


def ours_loss_and_grads(kind: str, model, batch):
    model.zero_grad()
    loss = KINDS[kind].task.loss_and_grad(model, batch, 1.0)
    return loss, torch_grads_of(model)


# ========================================================================== forward/backward parity
PARITY_CASES = [
    ("classifier", dict(pooling="mean", norm_first=False, positional="learned")),
    ("classifier", dict(pooling="max", norm_first=True, positional="sinusoidal",
                        activation="gelu")),
    ("classifier", dict(pooling="first", norm_first=False, positional="sinusoidal",
                        num_layers=1)),
    ("classifier", dict(pooling="mean", norm_first=True, bigram_buckets=5)),
    ("causal_lm", dict(tie=True)),
    ("causal_lm", dict(tie=False, norm_first=False, positional="sinusoidal",
                       activation="relu")),
    ("seq2seq", dict()),
    ("seq2seq", dict(norm_first=True, positional="learned", activation="gelu")),
    ("seq2seq", dict(tie=True)),
]
CONFIGS = {"classifier": classifier_config, "causal_lm": lm_config, "seq2seq": seq2seq_config}


def _case_id(case):
    kind, kw = case
    return kind + "-" + "-".join(f"{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", PARITY_CASES, ids=[_case_id(c) for c in PARITY_CASES])
def test_forward_backward_parity(case, dtype, parity_backend, torch):
    kind, kw = case
    config = CONFIGS[kind](**kw)
    rtol = RTOL[dtype]
    with using_backend(parity_backend, dtype):
        model, ref = build_pair(kind, config, dtype, seed=1)
        batch = KINDS[kind].batch_fn(np.random.default_rng(2), config)

        # logits
        ours_logits = backend.to_numpy(KINDS[kind].our_logits(model, batch))
        assert ours_logits.dtype == np.dtype(dtype)
        theirs_logits = KINDS[kind].torch_logits(torch, ref, batch)
        assert rel_diff(ours_logits, theirs_logits) <= rtol, \
            f"logits: {rel_diff(ours_logits, theirs_logits):.3e}"

        # loss and every gradient
        loss, grads = ours_loss_and_grads(kind, model, batch)
        ref.zero_grad()
        theirs_loss, _ = KINDS[kind].torch_loss(torch, ref, batch)
        theirs_loss.backward()
        assert abs(loss - theirs_loss.item()) <= rtol * abs(theirs_loss.item()), \
            f"loss {loss!r} vs torch {theirs_loss.item()!r}"
        theirs_grads = {name: p.grad for name, p in ref.named_parameters()}
        assert set(grads) == set(theirs_grads)
        failures = []
        for name, expected in theirs_grads.items():
            assert expected is not None, name
            d = rel_diff(grads[name], expected)
            if not d <= rtol:
                failures.append(f"{name}: {d:.3e}")
        assert not failures, "gradients differ from torch: " + ", ".join(failures)


def test_parity_harness_detects_a_wrong_gradient(parity_backend, torch, monkeypatch):
    """The comparison above is sharp: layer norm's backward off by 1e-6 is caught."""
    # the op the tier's LayerNorm calls: npformer.ops's, or the fast tier's own module's
    tier = fast_layernorm if tier_under_test() == "fast" else ops
    original = tier.layernorm_backward

    def slightly_wrong(dy, cache):
        dx, dg, db = original(dy, cache)
        return dx, dg * (1 + 1e-6), db

    monkeypatch.setattr(tier, "layernorm_backward", slightly_wrong)
    config = classifier_config()
    with using_backend(parity_backend, "float64"):
        model, ref = build_pair("classifier", config, "float64", seed=1)
        batch = classifier_batch(np.random.default_rng(2), config)
        _, grads = ours_loss_and_grads("classifier", model, batch)
        loss, _ = KINDS["classifier"].torch_loss(torch, ref, batch)
        loss.backward()
        d = rel_diff(grads["layers.0.norm1.weight"],
                     dict(ref.named_parameters())["layers.0.norm1.weight"].grad)
        assert d > RTOL["float64"]


def test_sinusoidal_table_is_not_in_the_state_dict(parity_backend, torch):
    config = classifier_config(positional="sinusoidal")
    with using_backend(parity_backend, "float64"):
        model, ref = build_pair("classifier", config, "float64")
        assert not any("pos" in k or "pe" == k for k in ref.state_dict())
        assert set(ref.state_dict()) == set(to_torch_state_dict(model))


# =========================================================================== Adam trajectories
ADAM_CASES = [
    ("classifier", dict(pooling="mean", norm_first=True, positional="learned",
                        activation="gelu")),
    ("causal_lm", dict(tie=True)),
    ("seq2seq", dict()),
    ("seq2seq", dict(tie=True)),
]


@pytest.mark.parametrize("case", ADAM_CASES, ids=[_case_id(c) for c in ADAM_CASES])
def test_adam_trajectory_matches_torch(case, parity_backend, torch):
    kind, kw = case
    config = CONFIGS[kind](**kw)
    lr = 3e-3
    with using_backend(parity_backend, "float64"):
        model, ref = build_pair(kind, config, "float64", seed=3)
        rng = np.random.default_rng(4)
        fixed = [KINDS[kind].batch_fn(rng, config) for _ in range(3)]
        opt = tiered.Adam(model.parameters(), lr=lr)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=lr)
        ours_losses, theirs_losses = [], []
        for step in range(ADAM_STEPS):
            batch = fixed[step % len(fixed)]
            opt.zero_grad()
            loss = KINDS[kind].task.loss_and_grad(model, batch, 1.0)
            opt.step()
            ref_opt.zero_grad()
            theirs, _ = KINDS[kind].torch_loss(torch, ref, batch)
            theirs.backward()
            ref_opt.step()
            ours_losses.append(loss)
            theirs_losses.append(theirs.item())
        np.testing.assert_allclose(ours_losses, theirs_losses, rtol=ADAM_LOSS_RTOL, atol=0)
        # the optimizer really moved the model: the losses are not all the same
        assert ours_losses[-1] < ours_losses[0]
        final = to_torch_state_dict(model)
        for name, p in ref.named_parameters():
            assert rel_diff(final[name], p) <= 1e-8, name
