"""The fast tier's classes equal their textbook classes: layers, blocks, models, optimizers.

Each fast class (npformer.fast.layers, .blocks, .models, .optim) is built beside its
textbook class from the same seed (so with the same initial weights, which is checked),
both are run on the same inputs, and the outputs and every gradient (each parameter's,
each input's) must agree within ``RTOL`` of the textbook's size in float64
(``rel_diff``), over Hypothesis-drawn shapes, masks and valid lengths.

Every test runs twice: with the fast tier's compiled kernels, and with its NumPy statements
(numba missing or turned off).

Packed rows: a fast block given a ``Packing`` computes only the valid positions, as
rows (N, D); it is compared with the textbook block at those positions, with the
upstream gradient zero at padding (what the models give it: nothing reads padding).
Dropout masks are drawn per array shape, so a packed run draws other masks than the
padded one: those comparisons run without dropout; unpacked ones run with it, from the
same seed.

The attention layer and the blocks run with Bloem's narrow heads and qk_norm too, and the
causal LM with an attention mask (left padding, padding anywhere) or given positions.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer import backend, fast, nn, ops
from npformer.fast import compiler
from npformer.models import (
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
)

from .conftest import using_backend
from .helpers import rel_diff, tiered, using_tier

RTOL = 1e-12  # float64: the tiers differ only by the order of their additions
SEEDS = st.integers(0, 2**16)


def built(tier: str, seed: int, make):
    """``make()`` in tier ``tier``, the generator seeded with ``seed`` first."""
    with using_tier(tier):
        backend.seed(seed)
        return make()


def pair(seed: int, make):
    """(textbook, fast) instances of ``make()``, with the same initial weights."""
    textbook, quick = built("textbook", seed, make), built("fast", seed, make)
    with using_tier("fast"):
        assert type(quick) is getattr(tiered, type(textbook).__name__) is not type(textbook)
    for (name, p), (_, q) in zip(textbook.named_parameters(), quick.named_parameters()):
        assert np.array_equal(backend.to_numpy(p.data), backend.to_numpy(q.data)), name
    return textbook, quick


def host(rng, *shape):
    return backend.asarray(rng.standard_normal(shape), dtype="float64")


def largest(*arrays) -> float:
    return max((float(np.max(np.abs(backend.to_numpy(a)), initial=0.0)) for a in arrays),
               default=0.0)


def gradient_scale(module, *input_grads) -> float:
    """The largest entry of the module's gradients (its parameters' and its inputs')."""
    return largest(*(p.grad for _, p in module.named_parameters()), *input_grads)


def assert_equal_grads(textbook, quick, what: str, *input_grads) -> None:
    """Every parameter's gradient, measured against the largest gradient entry of the whole
    module: some are 0 in exact arithmetic (a key bias: softmax ignores a constant added to
    a row's scores; the keys of a row with one key) and only rounding is left of them, in
    either tier, a few roundings of the terms that cancelled."""
    scale = gradient_scale(textbook, *input_grads)
    for (name, p), (_, q) in zip(textbook.named_parameters(), quick.named_parameters()):
        d = rel_diff(q.grad, p.grad, at_least=scale)
        assert d <= RTOL, f"{what}: gradient of {name} differs by {d:.2e}"


def assert_equal_input_grad(actual, expected, scale: float, what: str) -> None:
    d = rel_diff(actual, expected, at_least=scale)
    assert d <= RTOL, f"{what} differs by {d:.2e}"


def assert_close(actual, expected, what: str) -> None:
    d = rel_diff(actual, expected)
    assert d <= RTOL, f"{what} differs by {d:.2e}"


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def float64_numpy(request, monkeypatch):
    """Every test in float64 on NumPy, with the fast tier's compiled kernels and without
    them (its NumPy statements: what runs where numba is missing)."""
    if request.param == "numpy":
        monkeypatch.setattr(compiler, "COMPILED", False)
        monkeypatch.setattr(compiler, "_warned", True)  # the fallback's one warning: not here
    with using_backend("numpy", "float64"):
        yield


# --------------------------------------------------------------------------- the basic layers
@given(seed=SEEDS, batch=st.integers(1, 3), length=st.integers(1, 4), width=st.integers(1, 5),
       out=st.integers(1, 5), bias=st.booleans())
def test_linear(seed, batch, length, width, out, bias):
    textbook, quick = pair(seed, lambda: tiered.Linear(width, out, bias))
    rng = np.random.default_rng(seed)
    x, dy = host(rng, batch, length, width), host(rng, batch, length, out)
    assert_close(quick(x), textbook(x), "output")
    assert_close(quick.backward(dy), textbook.backward(dy), "dx")
    assert_equal_grads(textbook, quick, "Linear")


@given(seed=SEEDS, batch=st.integers(1, 3), length=st.integers(1, 4), width=st.integers(1, 6))
def test_layer_norm_and_its_output_again(seed, batch, length, width):
    textbook, quick = pair(seed, lambda: tiered.LayerNorm(width))
    rng = np.random.default_rng(seed)
    for p, q in zip(textbook.parameters(), quick.parameters()):  # not the init's 1 and 0
        p.data = q.data = host(rng, *p.shape)
    x, dy = host(rng, batch, length, width), host(rng, batch, length, width)
    y = quick(x)
    assert_close(y, textbook(x), "output")
    assert np.array_equal(backend.to_numpy(quick.output_again()), backend.to_numpy(y))
    assert_close(quick.backward(dy), textbook.backward(dy), "dx")
    assert_equal_grads(textbook, quick, "LayerNorm")


@given(seed=SEEDS, batch=st.integers(1, 3), length=st.integers(1, 4), width=st.integers(1, 6))
def test_rms_norm(seed, batch, length, width):
    textbook, quick = pair(seed, lambda: tiered.RMSNorm(width))
    rng = np.random.default_rng(seed)
    for p, q in zip(textbook.parameters(), quick.parameters()):  # not the init's 1
        p.data = q.data = host(rng, *p.shape)
    x, dy = host(rng, batch, length, width), host(rng, batch, length, width)
    assert_close(quick(x), textbook(x), "output")
    assert_close(quick.backward(dy), textbook.backward(dy), "dx")
    assert_equal_grads(textbook, quick, "RMSNorm")


@given(seed=SEEDS, batch=st.integers(1, 3), length=st.integers(1, 4), width=st.integers(1, 5),
       vocab=st.integers(1, 7))
def test_embedding_and_its_tied_projection(seed, batch, length, width, vocab):
    textbook, quick = pair(seed, lambda: tiered.Embedding(vocab, width))
    rng = np.random.default_rng(seed)
    ids = backend.asarray(rng.integers(0, vocab, (batch, length)))
    dy, h = host(rng, batch, length, width), host(rng, batch, length, width)
    dlogits = host(rng, batch, length, vocab)
    assert_close(quick(ids), textbook(ids), "output")
    quick.backward(dy), textbook.backward(dy)
    assert_close(quick.project(h), textbook.project(h), "logits")
    assert_close(quick.project_backward(dlogits), textbook.project_backward(dlogits), "dh")
    assert_equal_grads(textbook, quick, "Embedding")


@given(seed=SEEDS, p=st.sampled_from([0.0, 0.3, 0.7]), training=st.booleans(),
       shape=st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_dropout_draws_the_same_masks(seed, p, training, shape):
    textbook, quick = pair(seed, lambda: tiered.Dropout(p))
    textbook.train(training), quick.train(training)
    rng = np.random.default_rng(seed)
    x, dy = host(rng, *shape), host(rng, *shape)
    backend.seed(seed + 1)
    expected = textbook(x)
    backend.seed(seed + 1)
    assert_close(quick(x), expected, "output")
    dx = textbook.backward(dy)
    assert_close(quick.mask_again(dy), dx, "mask_again")
    assert_close(quick.backward(dy), dx, "dx")


@given(seed=SEEDS, name=st.sampled_from(["relu", "gelu", "gelu_tanh"]),
       shape=st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_activation_and_its_output_again(seed, name, shape):
    textbook, quick = pair(seed, lambda: tiered.Activation(name))
    rng = np.random.default_rng(seed)
    x, dy = host(rng, *shape) * 3, host(rng, *shape)
    y = quick(x)
    assert_close(y, textbook(x), "output")
    assert_close(quick.output_again(), y, "output again")
    assert_close(quick.backward(dy), textbook.backward(dy), "dx")


# --------------------------------------------------------------------------- attention and blocks
MASKS = ("none", "causal", "padding", "causal_padding")


@st.composite
def batches(draw, cross: bool = False):
    """Shapes, a mask kind, valid lengths of the queries (or None) and whether to pack."""
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    memory = draw(st.integers(1, 5)) if cross else length
    kind = draw(st.sampled_from(MASKS if not cross else ("none", "padding")))
    lens = draw(st.lists(st.integers(1, length), min_size=batch, max_size=batch))
    memory_lens = draw(st.lists(st.integers(1, memory), min_size=batch, max_size=batch))
    return dict(batch=batch, length=length, memory=memory, kind=kind,
                lens=np.array(lens, dtype=np.int64), memory_lens=np.array(memory_lens),
                pack=draw(st.booleans()), seed=draw(SEEDS), heads=draw(st.integers(1, 3)),
                head_width=draw(st.integers(1, 3)), norm_first=draw(st.booleans()),
                activation=draw(st.sampled_from(["relu", "gelu", "gelu_tanh"])))


def self_mask(case):
    """The mask of a self-attention case (B, 1, T, T) or None; padding from case["lens"]."""
    lens, length = backend.asarray(case["lens"]), case["length"]
    mask = None
    if "causal" in case["kind"]:
        mask = ops.causal_mask(length)[None, None]  # (1, 1, T, T)
    if "padding" in case["kind"]:
        pad = ops.padding_mask(lens, length)  # (B, 1, 1, T)
        mask = pad if mask is None else mask & pad
    return mask


def packing_of(case):
    """The case's queries packed (fast), or None; padding rows only where the mask hides them."""
    if not case["pack"]:
        return None
    lens = case["lens"] if "padding" in case["kind"] else \
        np.full(case["batch"], case["length"], dtype=np.int64)
    return fast.Packing.from_lengths(backend.asarray(lens), case["length"])


def on_rows(packing, x):
    """x (B, T, D) as the fast layer takes it: the packed rows, or x itself."""
    return x if packing is None else packing.pack(x)


def run_pair(textbook, quick, case, args, quick_kwargs, width):
    """Forward and backward of both on (B, T, D) inputs x (the first of ``args``) -> the
    fast module's output and input gradient compared at the valid positions."""
    rng = np.random.default_rng(case["seed"])
    packing = quick_kwargs.get("packing")
    x = host(rng, case["batch"], case["length"], width)
    dy = on_rows(packing, host(rng, case["batch"], case["length"], width))  # (N, D) or (B, T, D)
    dy_full = dy if packing is None else packing.unpack(dy)  # zero at padding
    y_textbook = textbook(x, *args)
    assert_close(quick(on_rows(packing, x), *args, **quick_kwargs), on_rows(packing, y_textbook),
                 "output")
    grads_textbook, grads_quick = textbook.backward(dy_full), quick.backward(dy)
    if not isinstance(grads_textbook, tuple):  # cross-attention, a decoder block: (dx, dmemory)
        grads_textbook, grads_quick = (grads_textbook,), (grads_quick,)
    scale = gradient_scale(textbook, *grads_textbook)
    assert_equal_input_grad(grads_quick[0], on_rows(packing, grads_textbook[0]), scale, "dx")
    if len(grads_textbook) == 2:
        assert_equal_input_grad(grads_quick[1], grads_textbook[1], scale, "dmemory")
    assert_equal_grads(textbook, quick, type(textbook).__name__, *grads_textbook)


# Bloem's narrow heads and qk_norm (nn.MultiHeadAttention's options), off and on.
OPTIONS = st.sampled_from([{}, {"narrow_heads": True}, {"qk_norm": True},
                           {"narrow_heads": True, "qk_norm": True}])


@given(case=batches(), options=OPTIONS)
def test_self_attention(case, options):
    width = case["heads"] * case["head_width"]
    textbook, quick = pair(case["seed"],
                           lambda: tiered.MultiHeadAttention(width, case["heads"], **options))
    packing, mask = packing_of(case), self_mask(case)
    run_pair(textbook, quick, case, (None, mask), {"packing": packing}, width)


@given(case=batches(cross=True), options=OPTIONS)
def test_cross_attention(case, options):
    width = case["heads"] * case["head_width"]
    textbook, quick = pair(case["seed"],
                           lambda: tiered.MultiHeadAttention(width, case["heads"], **options))
    rng = np.random.default_rng(case["seed"] + 1)
    memory = host(rng, case["batch"], case["memory"], width)
    mask = ops.padding_mask(backend.asarray(case["memory_lens"]), case["memory"]) \
        if case["kind"] == "padding" else None
    case = dict(case, kind="padding")  # the queries' own padding: packed or not
    run_pair(textbook, quick, case, (memory, mask), {"packing": packing_of(case)}, width)


@given(case=batches(), d_ff=st.integers(1, 6), dropout=st.sampled_from([0.0, 0.4]))
def test_feed_forward(case, d_ff, dropout):
    width = case["heads"] * case["head_width"]
    textbook, quick = pair(case["seed"], lambda: tiered.FeedForward(width, d_ff, case["activation"],
                                                               dropout))
    rng = np.random.default_rng(case["seed"])
    x = host(rng, case["batch"], case["length"], width)
    dy = host(rng, case["batch"], case["length"], width)
    backend.seed(case["seed"] + 1)
    expected = textbook(x)
    backend.seed(case["seed"] + 1)
    assert_close(quick(x), expected, "output")
    dx = textbook.backward(dy)
    assert_equal_input_grad(quick.backward(dy), dx, gradient_scale(textbook, dx), "dx")
    assert_equal_grads(textbook, quick, "FeedForward", dx)


@given(case=batches(), dropout=st.sampled_from([0.0, 0.3]), options=OPTIONS)
def test_encoder_block(case, dropout, options):
    width = case["heads"] * case["head_width"]
    dropout = 0.0 if case["pack"] else dropout  # packed rows draw other masks
    make = lambda: tiered.EncoderBlock(width, case["heads"], 2 * width, dropout,  # noqa: E731
                                   case["activation"], case["norm_first"], **options)
    textbook, quick = pair(case["seed"], make)
    run_pair(_Seeded(textbook, case["seed"]), _Seeded(quick, case["seed"]), case,
             (self_mask(case),), {"packing": packing_of(case)}, width)


@given(case=batches(cross=True), dropout=st.sampled_from([0.0, 0.3]), options=OPTIONS)
def test_decoder_block(case, dropout, options):
    width = case["heads"] * case["head_width"]
    case = dict(case, kind="causal_padding", memory_lens=case["memory_lens"])
    dropout = 0.0 if case["pack"] else dropout
    make = lambda: tiered.DecoderBlock(width, case["heads"], 2 * width, dropout,  # noqa: E731
                                   case["activation"], case["norm_first"], **options)
    textbook, quick = pair(case["seed"], make)
    rng = np.random.default_rng(case["seed"] + 2)
    memory = host(rng, case["batch"], case["memory"], width)
    memory_mask = ops.padding_mask(backend.asarray(case["memory_lens"]), case["memory"])
    run_pair(_Seeded(textbook, case["seed"]), _Seeded(quick, case["seed"]), case,
             (memory, self_mask(case), memory_mask), {"packing": packing_of(case)}, width)


class _Seeded:
    """A module whose forward starts from one seed (so two modules draw the same dropout
    masks), and whose parameters are the module's."""

    def __init__(self, module, seed):
        self.module, self.seed = module, seed

    def __call__(self, *args, **kwargs):
        backend.seed(self.seed + 7)
        return self.module(*args, **kwargs)

    def backward(self, dy):
        return self.module.backward(dy)

    def named_parameters(self):
        return self.module.named_parameters()


# --------------------------------------------------------------------------- the models
def padded_ids(rng, lens, length, vocab, pad_id=0):
    ids = np.full((len(lens), length), pad_id, dtype=np.int64)
    for row, n in enumerate(lens):
        ids[row, :n] = rng.integers(1, vocab, n)
    return ids


@given(seed=SEEDS, batch=st.integers(1, 3), length=st.integers(1, 6),
       pooling=st.sampled_from(["mean", "max", "first"]), norm_first=st.booleans(),
       bigram_buckets=st.sampled_from([0, 4]), data=st.data())
def test_classifier(seed, batch, length, pooling, norm_first, bigram_buckets, data):
    lens = data.draw(st.lists(st.integers(1, length), min_size=batch, max_size=batch))
    config = ClassifierConfig(vocab_size=11, num_classes=3, d_model=8, num_heads=2,
                              num_layers=2, d_ff=12, block_size=8, dropout=0.0,
                              norm_first=norm_first, pooling=pooling,
                              bigram_buckets=bigram_buckets)
    textbook, quick = pair(seed, lambda: tiered.TransformerClassifier(config))
    rng = np.random.default_rng(seed)
    if bigram_buckets:  # the pairs' table starts at zero: give both models the same values
        textbook.bigrams.weight.data = host(rng, bigram_buckets, 8)
        quick.load_state_dict(textbook.state_dict())
    ids = backend.asarray(padded_ids(rng, lens, length, 11))
    valid = backend.asarray(np.array(lens))
    dlogits = host(rng, batch, 3)
    assert_close(quick(ids, valid), textbook(ids, valid), "logits")
    textbook.backward(dlogits), quick.backward(dlogits)
    assert_equal_grads(textbook, quick, "TransformerClassifier")


@given(seed=SEEDS, batch=st.integers(1, 3), length=st.integers(1, 6), tie=st.booleans(),
       norm_first=st.booleans(), dropout=st.sampled_from([0.0, 0.2]),
       padding=st.sampled_from(["none", "left", "anywhere", "positions"]),
       options=st.sampled_from([{}, {"narrow_heads": True, "qk_norm": True,
                                     "norm_eps": 1e-3}]))
def test_causal_lm(seed, batch, length, tie, norm_first, dropout, padding, options):
    """Also with an attention mask (left padding, or padding anywhere, whole rows of it
    included) and given position ids: the models' own mask and position handling."""
    config = CausalLMConfig(vocab_size=9, block_size=8, d_model=8, num_heads=2, num_layers=2,
                            d_ff=16, dropout=dropout, norm_first=norm_first, tie_weights=tie,
                            **options)
    textbook, quick = pair(seed, lambda: tiered.CausalLM(config))
    rng = np.random.default_rng(seed)
    ids = backend.asarray(rng.integers(0, 9, (batch, length)))
    dlogits = host(rng, batch, length, 9)
    kwargs = {}
    if padding == "left":
        starts = rng.integers(0, length + 1, batch)  # a row of padding only, sometimes
        kwargs["attention_mask"] = np.arange(length)[None, :] >= starts[:, None]
    elif padding == "anywhere":
        kwargs["attention_mask"] = rng.integers(0, 2, (batch, length))
    elif padding == "positions":
        kwargs["position_ids"] = rng.integers(0, 8, (batch, length))
    backend.seed(seed + 3)
    expected = textbook(ids, **kwargs)
    backend.seed(seed + 3)
    assert_close(quick(ids, **kwargs), expected, "logits")
    textbook.backward(dlogits), quick.backward(dlogits)
    assert_equal_grads(textbook, quick, "CausalLM")


@given(seed=SEEDS, batch=st.integers(1, 3), src_len=st.integers(1, 5), tgt_len=st.integers(1, 5),
       norm_first=st.booleans(), valid_only=st.booleans(), tie=st.booleans(), data=st.data())
def test_seq2seq(seed, batch, src_len, tgt_len, norm_first, valid_only, tie, data):
    src_lens = data.draw(st.lists(st.integers(1, src_len), min_size=batch, max_size=batch))
    tgt_lens = data.draw(st.lists(st.integers(1, tgt_len), min_size=batch, max_size=batch))
    config = Seq2SeqConfig(src_vocab_size=10, tgt_vocab_size=12, d_model=8, num_heads=2,
                           num_encoder_layers=2, num_decoder_layers=2, d_ff=12, block_size=8,
                           dropout=0.0, norm_first=norm_first, tie_weights=tie)
    textbook, quick = pair(seed, lambda: tiered.Seq2SeqTransformer(config))
    rng = np.random.default_rng(seed)
    src = backend.asarray(padded_ids(rng, src_lens, src_len, 10))
    tgt = backend.asarray(padded_ids(rng, tgt_lens, tgt_len, 12))
    args = (src, tgt, backend.asarray(np.array(src_lens)), backend.asarray(np.array(tgt_lens)))
    expected = textbook(*args, valid_only=valid_only)
    assert_close(quick(*args, valid_only=valid_only), expected, "logits")
    dlogits = host(rng, *expected.shape)
    textbook.backward(dlogits), quick.backward(dlogits)
    assert_equal_grads(textbook, quick, "Seq2SeqTransformer")


@pytest.mark.parametrize("options", [{}, {"narrow_heads": True, "qk_norm": True}])
@pytest.mark.parametrize("padded", [False, True])
def test_cached_decoding_is_the_textbook_s(options, padded):
    """forward_cached (the KV cache) of the fast models gives the textbook's logits, with
    and without a left-padded batch's attention mask."""
    config = CausalLMConfig(vocab_size=9, block_size=8, d_model=8, num_heads=2, num_layers=2,
                            d_ff=16, **options)
    textbook, quick = pair(3, lambda: tiered.CausalLM(config))
    ids = backend.asarray(np.random.default_rng(0).integers(0, 9, (2, 5)))
    keep = np.ones((2, 5), dtype=bool)
    keep[0, :2] = not padded
    with nn.no_grad():
        caches = textbook.new_cache(), quick.new_cache()
        for start, stop in ((0, 3), (3, 4), (4, 5)):
            step, mask = ids[:, start:stop], backend.asarray(keep[:, :stop])
            assert_close(quick.forward_cached(step, caches[1], attention_mask=mask),
                         textbook.forward_cached(step, caches[0], attention_mask=mask),
                         f"positions {start}:{stop}")


# --------------------------------------------------------------------------- the Llama family
LLAMA_VARIANTS = [  # Llama (grouped kv heads), Qwen2 (q/k/v biases), Qwen3 (QK-norm, head_dim)
    {"num_kv_heads": 1},
    {"num_kv_heads": 2, "qkv_bias": True, "tie_weights": False},
    {"num_kv_heads": 1, "qk_norm": True, "head_dim": 6, "attention_bias": True},
]


def llama_config(**fields):
    from npformer.models import LlamaConfig

    return LlamaConfig(**{"vocab_size": 9, "d_model": 8, "d_ff": 12,
                          "num_layers": 2, "num_heads": 2,
                          "block_size": 16, **fields})


@given(seed=SEEDS, batch=st.integers(1, 3), length=st.integers(1, 6),
       variant=st.sampled_from(LLAMA_VARIANTS),
       padding=st.sampled_from(["none", "left", "positions"]))
def test_llama_causal_lm(seed, batch, length, variant, padding):
    """The fast Llama-shaped model (its layers on the fast tier's Linear, RMS norm, gated
    SiLU, rotary and blocked grouped attention, its weights in one flat buffer) equals the
    textbook's: logits and every gradient, with left padding or given positions."""
    config = llama_config(**variant)
    textbook, quick = pair(seed, lambda: tiered.LlamaCausalLM(config))
    rng = np.random.default_rng(seed)
    for p, q in zip(textbook.parameters(), quick.parameters()):  # norms not all ones
        p.data = host(rng, *p.shape)
        q.data = p.data
    ids = backend.asarray(rng.integers(0, 9, (batch, length)))
    dlogits = host(rng, batch, length, 9)
    kwargs = {}
    if padding == "left":
        starts = rng.integers(0, length, batch)  # every row keeps a token
        kwargs["attention_mask"] = np.arange(length)[None, :] >= starts[:, None]
    elif padding == "positions":
        kwargs["position_ids"] = rng.integers(0, 16, (batch, length))
    assert_close(quick(ids, **kwargs), textbook(ids, **kwargs), "logits")
    textbook.backward(dlogits), quick.backward(dlogits)
    assert_equal_grads(textbook, quick, "LlamaCausalLM")


@pytest.mark.parametrize("variant", LLAMA_VARIANTS)
def test_llama_cached_decoding_is_the_textbook_s(variant):
    from npformer.decoding import generate

    config = llama_config(**variant)
    textbook, quick = pair(0, lambda: tiered.LlamaCausalLM(config))
    prompts = [[1, 2, 3], [4, 5]]
    assert generate(quick, prompts, 5, greedy=True) == generate(textbook, prompts, 5,
                                                                greedy=True)



# --------------------------------------------------------------------------- the optimizers
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_optimizer_updates(name, weight_decay):
    """Three updates (with clipping) of the fast optimizer over a fast model's flat buffer
    equal the textbook optimizer's over the textbook model, from the same gradients, and so
    do their state dicts.  (The gradients are given, not computed: a key bias's gradient is
    0 up to rounding, and Adam scales any rounding up to a step of lr.)"""
    config = CausalLMConfig(vocab_size=9, block_size=8, d_model=8, num_heads=2, num_layers=1,
                            d_ff=16)
    models = pair(5, lambda: tiered.CausalLM(config))
    optimizers = []
    for tier, model in zip(("textbook", "fast"), models):
        with using_tier(tier):
            optimizers.append(getattr(tiered, name)(model.parameters(), lr=1e-2,
                                                   weight_decay=weight_decay))
    with using_tier("fast"):
        assert type(optimizers[1]) is getattr(tiered, name)
    rng = np.random.default_rng(0)
    for _ in range(3):
        grads = [host(rng, *p.shape) for p in models[0].parameters()]
        for tier, model, opt in zip(("textbook", "fast"), models, optimizers):
            opt.zero_grad()
            for p, g in zip(model.parameters(), grads):
                p.accumulate(g)
            with using_tier(tier):
                tiered.clip_grad_norm(model.named_parameters(), 0.5)
            opt.step()
    assert_equal_grads(*models, name)
    for (key, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert_close(q.data, p.data, f"{name} update of {key}")
    expected, got = optimizers[0].state_dict(), optimizers[1].state_dict()
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        if hasattr(value, "shape"):
            assert_close(got[key], value, f"state {key}")
        else:
            assert got[key] == value, key


def test_the_textbook_tier_never_runs_the_fast_tier():
    """With the engine on "textbook", a model's training step, an optimizer's update and
    cached decoding never execute a line of npformer/fast/ (a profiler records every
    function called)."""
    import sys
    from pathlib import Path

    from npformer.decoding import generate
    from npformer.train.tasks import LanguageModeling

    fast_folder = str(Path(fast.__file__).parent)
    entered = set()

    def record(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(fast_folder):
            entered.add(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    with using_tier("textbook"):
        config = CausalLMConfig(vocab_size=9, block_size=8, d_model=8, num_heads=2,
                                num_layers=2, d_ff=16, dropout=0.1)
        sys.setprofile(record)
        try:
            model = tiered.CausalLM(config)
            opt = tiered.AdamW(model.parameters(), lr=1e-3)
            ids = np.arange(12).reshape(2, 6) % 9
            LanguageModeling().loss_and_grad(model, (ids[:, :-1], ids[:, 1:]))
            tiered.clip_grad_norm(model.named_parameters(), 1.0)
            opt.step()
            generate(model, [1, 2, 3], max_new_tokens=3, greedy=True)
        finally:
            sys.setprofile(None)
    assert not entered, sorted(entered)
    with using_tier("fast"):  # the recorder is sharp: the fast tier's step enters it
        model = tiered.CausalLM(config)
        sys.setprofile(record)
        try:
            LanguageModeling().loss_and_grad(model, (ids[:, :-1], ids[:, 1:]))
        finally:
            sys.setprofile(None)
    assert entered
