"""The fast tier's compiled forward (npformer.fast.compiled) equals the textbook's.

Under no_grad a fast block runs as one compiled kernel (the GPT/encoder block, the Llama
block).  Each kernel is compared with the textbook block built from the same seed, every
parameter drawn at random (norms and biases not at their initial ones and zeros): in
float64 within ``RTOL["float64"]`` of the output's size (the two differ by the order of
their additions only), in float32 within the suite's float32 tolerance.  Every option
the kernels cover: pre- and post-norm, ReLU, GELU and its tanh form, narrow heads,
query-key norm, wide heads; no mask, causal, padding and both, padded or packed rows;
grouped key/value heads, biases, QK-norm, rotary tables of given positions, a left-padded
batch; dropout off in eval mode; a prompt's keys and values written into an empty cache.
Then the models, through the fast blocks' forward under no_grad (the kernels counted),
and the inputs the kernels refuse (the usual path runs).
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

from npformer import backend, fast, nn, ops
from npformer.fast import compiled, compiler
from npformer.models import CausalLMConfig, ClassifierConfig, Seq2SeqConfig

from .conftest import using_backend
from .helpers import PARITY_RTOL, assert_close, tiered, using_tier

pytestmark = pytest.mark.skipif(not compiler.COMPILED, reason="the kernels need numba")

RTOL = {"float64": 1e-12, "float32": PARITY_RTOL["float32"]}
DTYPES = ["float64", "float32"]
MASKS = ["none", "causal", "padding", "causal+padding"]


@pytest.fixture(params=DTYPES)
def dtype(request):
    with using_backend("numpy", request.param):
        yield request.param


def pair(seed: int, make):
    """(textbook, fast) instances of ``make()`` with the same random parameters (in the
    backend's default float), both in eval mode."""
    built = []
    for tier in ("textbook", "fast"):
        with using_tier(tier):
            backend.seed(seed)
            built.append(make().eval())
    textbook, quick = built
    rng = np.random.default_rng(seed)
    for p, q in zip(textbook.parameters(), quick.parameters()):
        p.data = backend.asarray(rng.standard_normal(p.shape) * 0.5, dtype=p.data.dtype)
        q.data = p.data.copy()
    return textbook, quick


def inputs(seed: int, *shape) -> np.ndarray:
    """Standard normal numbers of ``shape`` in the backend's default float."""
    values = np.random.default_rng(seed + 1).standard_normal(shape)
    return backend.asarray(values.astype(backend.default_float_name()))


def block_mask(kind: str, lens: np.ndarray, length: int):
    """A self-attention mask of ``kind`` (B, 1, T, T) or None; padding from ``lens``."""
    mask = None
    if "causal" in kind:
        mask = ops.causal_mask(length)[None, None]  # (1, 1, T, T)
    if "padding" in kind:
        pad = ops.padding_mask(backend.asarray(lens), length)  # (B, 1, 1, T)
        mask = pad if mask is None else mask & pad
    return mask


def valid_rows(y: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The rows of y (B, T, D) at each sequence's first lens[b] positions (N, D)."""
    return np.concatenate([y[b, :n] for b, n in enumerate(lens)])


# --------------------------------------------------------------------------- the encoder block
ENCODER_OPTIONS = [{}, {"narrow_heads": True}, {"qk_norm": True},
                   {"narrow_heads": True, "qk_norm": True}, {"head_dim": 5}]


@pytest.mark.parametrize("options", ENCODER_OPTIONS)
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_encoder_block_kernel_is_the_textbook_block(dtype, norm_first, activation, options):
    """The encoder block's kernel, padded and packed, under each mask: the textbook block's
    output at every valid position.  Dropout 0.1, off in eval mode."""
    batch, length, width, heads = 3, 6, 12, 3
    textbook, quick = pair(7, lambda: tiered.EncoderBlock(
        width, heads, 20, 0.1, activation, norm_first, **options))
    x = inputs(7, batch, length, width)
    lens = np.array([6, 2, 4])
    with nn.no_grad():
        for kind in MASKS:
            mask = block_mask(kind, lens, length)
            expected = textbook(x, mask)
            got = compiled.encoder_block_forward(quick, x, mask)
            assert got is not None, f"{kind}: the kernel refused a block it covers"
            assert_close(got, expected, RTOL[dtype], f"{kind} mask, padded")
            if "padding" in kind:  # the classifier's rows: each sequence's valid positions
                packing = fast.Packing.from_lengths(backend.asarray(lens), length)
                got = compiled.encoder_block_forward(quick, packing.pack(x), mask,
                                                     packing=packing)
                assert_close(got, valid_rows(expected, lens), RTOL[dtype], f"{kind}, packed")


def test_a_prompt_s_keys_and_values_fill_the_cache(dtype):
    """Given an empty cache, the kernel writes the prompt's keys and values (B, H, T, E)
    into it: the textbook block's, and the next cached step reads them."""
    textbook, quick = pair(3, lambda: tiered.EncoderBlock(8, 2, 16, 0.0, "gelu", True,
                                                          qk_norm=True))
    x, step = inputs(3, 2, 5, 8), inputs(4, 2, 1, 8)
    caches = nn.BlockCache(), nn.BlockCache()
    with nn.no_grad():
        mask = ops.causal_mask(5)
        assert compiled.encoder_block_forward(quick, x, mask, caches[1]) is not None
        textbook(x, mask, kv_cache=caches[0])
        for kept in ("keys", "values"):
            assert_close(getattr(caches[1].self_attn, kept), getattr(caches[0].self_attn, kept),
                         RTOL[dtype], kept)
        assert_close(quick(step, None, kv_cache=caches[1]),
                     textbook(step, None, kv_cache=caches[0]), RTOL[dtype], "the next step")


# --------------------------------------------------------------------------- the Llama block
LLAMA_OPTIONS = [{}, {"num_kv_heads": 1}, {"num_kv_heads": 2, "qkv_bias": True},
                 {"num_kv_heads": 2, "qk_norm": True, "head_dim": 6, "qkv_bias": True,
                  "output_bias": True}]


@pytest.mark.parametrize("options", LLAMA_OPTIONS)
@pytest.mark.parametrize("positions", ["counted", "given"])
def test_llama_block_kernel_is_the_textbook_block(dtype, options, positions):
    """The Llama block's kernel (RMS norms, grouped-query attention with rotary positions,
    SwiGLU): the textbook block's output, causal or causal with left padding, the rotary
    tables of positions counted from 0 or given per row."""
    batch, length, width = 2, 5, 16
    textbook, quick = pair(5, lambda: tiered.LlamaBlock(width, 4, 24, **options))
    x = inputs(5, batch, length, width)
    rng = np.random.default_rng(5)
    place = np.arange(length) if positions == "counted" else rng.integers(0, 20, (batch, length))
    cos, sin = ops.rotary_table(backend.asarray(place), textbook.self_attn.head_dim,
                                dtype=x.dtype)  # (T, E) or (B, T, E)
    keep = np.arange(length)[None, :] >= np.array([[0], [2]])  # row 1 left-padded
    with nn.no_grad():
        for mask in (ops.causal_mask(length), ops.causal_mask(length)[None, None]
                     & backend.asarray(keep)[:, None, None, :]):
            got = llama_kernel(quick, x, cos, sin, mask)
            assert_close(got, textbook(x, cos, sin, mask), RTOL[dtype],
                         f"mask {tuple(mask.shape)}")


def llama_kernel(block, x, cos, sin, mask):
    y = compiled.llama_block_forward(block, x, cos, sin, mask)
    assert y is not None, "the kernel refused a block it covers"
    return y


# --------------------------------------------------------------------------- the models
@pytest.fixture
def kernels_run(monkeypatch):
    """A count of the blocks the kernels ran (a stack's kernel runs all its blocks)."""
    count = {"blocks": 0}
    for name, blocks in (("encoder_block_forward", lambda args: 1),
                         ("llama_block_forward", lambda args: 1),
                         ("encoder_stack_forward", lambda args: len(args[0]))):
        run = getattr(compiled, name)

        def counted(*args, run=run, blocks=blocks, **kwargs):
            y = run(*args, **kwargs)
            count["blocks"] += 0 if y is None else blocks(args)
            return y
        monkeypatch.setattr(compiled, name, counted)
    return count


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_causal_lm_evaluates_through_the_kernels(dtype, kernels_run, norm_first, padded):
    """The fast causal LM under no_grad runs its blocks and final norm as one kernel, and
    gives the textbook's logits, a left-padded batch's too; then decoding from the prompt
    (the stack's kernel, every block's keys and values into its cache), and steps (the
    stack's kernel, each block reading its cache)."""
    config = CausalLMConfig(vocab_size=11, block_size=8, d_model=8, num_heads=2,
                            num_layers=2, d_ff=16, dropout=0.1, norm_first=norm_first)
    textbook, quick = pair(1, lambda: tiered.CausalLM(config))
    ids = backend.asarray(np.random.default_rng(1).integers(0, 11, (2, 6)))
    keep = np.ones((2, 6), dtype=bool)
    keep[1, :3] = not padded
    mask = backend.asarray(keep)
    with nn.no_grad():
        assert_close(quick(ids, attention_mask=mask), textbook(ids, attention_mask=mask),
                     RTOL[dtype], "logits")
        assert kernels_run["blocks"] == 2
        caches = textbook.new_cache(), quick.new_cache()
        for start, stop in ((0, 4), (4, 5), (5, 6)):  # the prompt, then two steps
            step, seen = ids[:, start:stop], mask[:, :stop]
            assert_close(quick.forward_cached(step, caches[1], attention_mask=seen),
                         textbook.forward_cached(step, caches[0], attention_mask=seen),
                         RTOL[dtype], f"positions {start}:{stop}")
    assert kernels_run["blocks"] == 8  # the whole forward's, the prompt's and each step's


@pytest.mark.parametrize("padded", [False, True])
def test_a_causal_lm_s_decoding_steps_run_its_stack_as_one_kernel(dtype, monkeypatch, padded):
    """The prompt and each step after it: one call of the stack's kernel (no block's own),
    the textbook's logits, and every block's cache the textbook's keys and values.  Caches
    it does not take (one block's holding other positions, or the textbook's cache holding
    positions): the stack declines, and the blocks run one by one, still equal."""
    config = CausalLMConfig(vocab_size=11, block_size=12, d_model=8, num_heads=2,
                            num_layers=3, d_ff=16, dropout=0.0)
    textbook, quick = pair(3, lambda: tiered.CausalLM(config))
    ids = backend.asarray(np.random.default_rng(2).integers(0, 11, (2, 10)))
    keep = np.ones((2, 10), dtype=bool)
    keep[1, :2] = not padded
    mask = backend.asarray(keep)
    stacks = []
    run_stack, run_block = compiled.encoder_stack_forward, compiled.encoder_block_forward

    def counted(*args, **kwargs):
        y = run_stack(*args, **kwargs)
        stacks.append(y is not None)
        return y

    def no_block(*args, **kwargs):
        raise AssertionError("a block's own kernel ran: the step left the stack's")

    monkeypatch.setattr(compiled, "encoder_stack_forward", counted)
    monkeypatch.setattr(compiled, "encoder_block_forward", no_block)
    caches = textbook.new_cache(), quick.new_cache()
    with nn.no_grad():
        for start, stop in ((0, 5), (5, 6), (6, 7), (7, 9)):
            step, seen = ids[:, start:stop], mask[:, :stop]
            assert_close(quick.forward_cached(step, caches[1], attention_mask=seen),
                         textbook.forward_cached(step, caches[0], attention_mask=seen),
                         RTOL[dtype], f"positions {start}:{stop}")
            for mine, theirs in zip(caches[1].blocks, caches[0].blocks):
                for kept in ("keys", "values"):
                    assert_close(getattr(mine.self_attn, kept), getattr(theirs.self_attn, kept),
                                 RTOL[dtype], f"positions {start}:{stop}: {kept}")
    assert stacks == [True] * 4
    monkeypatch.setattr(compiled, "encoder_block_forward", run_block)
    step, seen = ids[:, 9:10], mask  # the tenth position
    with nn.no_grad():
        expected = textbook.forward_cached(step, copy.deepcopy(caches[0]), attention_mask=seen)
        mixed = copy.deepcopy(caches[1])  # block 1's cache the textbook's, same positions
        mixed.blocks[1].self_attn = copy.deepcopy(caches[0].blocks[1].self_attn)
        assert_close(quick.forward_cached(step, mixed, attention_mask=seen), expected,
                     RTOL[dtype], "a textbook cache among the fast ones")
        assert stacks[-1] is False
        short = copy.deepcopy(caches[1])
        short.blocks[2].self_attn._length -= 1  # one position fewer than the others
        x = backend.asarray(np.zeros((2, 1, 8), dtype=dtype))
        assert run_stack(quick.blocks, quick.norm, x, None, short) is None


def test_the_kernels_run_their_products_on_one_blas_thread(dtype, monkeypatch):
    """Every kernel call runs inside npformer.backend.single_threaded_blas: SciPy's BLAS on
    every core left its threads spinning against NumPy's after a prompt's encoding, and a
    small model's decoding steps ran at half speed (issue 59)."""
    from contextlib import contextmanager

    from threadpoolctl import threadpool_info

    threads = []

    @contextmanager
    def recorded():
        with backend.single_threaded_blas():
            threads.append(max(lib["num_threads"] for lib in threadpool_info()
                               if lib["user_api"] == "blas"))
            yield
    monkeypatch.setattr(compiled, "single_threaded_blas", recorded)
    config = CausalLMConfig(vocab_size=11, block_size=8, d_model=8, num_heads=2,
                            num_layers=2, d_ff=16, dropout=0.0)
    model = fast.CausalLM(config)
    ids = backend.asarray(np.random.default_rng(1).integers(0, 11, (2, 6)))
    with nn.no_grad():
        model(ids)  # the stack's kernel
        model.forward_cached(ids, model.new_cache())  # the prompt: the stack's kernel too
    assert threads == [1, 1]


def test_large_products_run_the_layers_on_every_core_except_in_one_thread_blas(
        dtype, kernels_run, monkeypatch):
    """Above ONE_CORE_WORK multiply-adds a block runs its layers (BLAS on every core), not
    the one-core kernel; inside single_threaded_blas (thread replicas) the kernel again."""
    monkeypatch.setattr(compiled, "ONE_CORE_WORK", 0)
    config = CausalLMConfig(vocab_size=11, block_size=8, d_model=8, num_heads=2,
                            num_layers=2, d_ff=16, dropout=0.0)
    model = fast.CausalLM(config)
    ids = backend.asarray(np.random.default_rng(1).integers(0, 11, (2, 6)))
    with nn.no_grad():
        layers = backend.to_numpy(model(ids))
        assert kernels_run["blocks"] == 0
        with backend.single_threaded_blas():
            kernel = backend.to_numpy(model(ids))
        assert kernels_run["blocks"] == 2
    np.testing.assert_allclose(kernel, layers, rtol=RTOL[dtype], atol=RTOL[dtype])


def test_classifier_predicts_through_the_kernels(dtype, kernels_run):
    """The classifier's packed rows through the kernels: the textbook's probabilities."""
    config = ClassifierConfig(vocab_size=13, d_model=8, num_heads=2, num_layers=2, d_ff=16,
                              block_size=7, activation="gelu")
    textbook, quick = pair(2, lambda: tiered.TransformerClassifier(config))
    ids = backend.asarray(np.random.default_rng(2).integers(1, 13, (3, 7)))
    lens = backend.asarray(np.array([7, 3, 5]))
    assert_close(quick.predict(ids, lens), textbook.predict(ids, lens), RTOL[dtype],
                 "probabilities")
    assert kernels_run["blocks"] == 2


def test_seq2seq_encodes_through_the_kernels(dtype, kernels_run):
    """The translation model's encoder blocks through the kernels (its decoder blocks, with
    cross-attention, the usual path): the textbook's logits."""
    config = Seq2SeqConfig(src_vocab_size=9, tgt_vocab_size=10, d_model=8, num_heads=2,
                           num_encoder_layers=2, num_decoder_layers=1, d_ff=16, block_size=6)
    textbook, quick = pair(4, lambda: tiered.Seq2SeqTransformer(config))
    rng = np.random.default_rng(4)
    src, tgt = (backend.asarray(rng.integers(1, 9, (2, 6))),
                backend.asarray(rng.integers(1, 9, (2, 5))))
    src_lens = backend.asarray(np.array([6, 4]))
    with nn.no_grad():
        assert_close(quick(src, tgt, src_lens), textbook(src, tgt, src_lens), RTOL[dtype],
                     "logits")
    assert kernels_run["blocks"] == 2


# Llama (grouped kv heads), Qwen2 (q/k/v biases, untied head), Qwen3 (QK-norm, head_dim,
# biases on q, k, v and the output): the configs of the LLAMA_OPTIONS blocks
LLAMA_CONFIGS = [{}, {"num_kv_heads": 1},
                 {"num_kv_heads": 2, "qkv_bias": True, "tie_weights": False},
                 {"num_kv_heads": 2, "qk_norm": True, "head_dim": 6, "attention_bias": True}]


@pytest.mark.parametrize("options", LLAMA_CONFIGS)
def test_llama_evaluates_through_the_kernels(dtype, kernels_run, options):
    """The fast Llama model under no_grad, a left-padded batch: every block a kernel, the
    textbook's logits; greedy decoding from the prompts gives the textbook's tokens."""
    from npformer.decoding import generate
    from npformer.models import LlamaConfig

    config = LlamaConfig(vocab_size=9, d_model=16, d_ff=24, num_layers=2, num_heads=4,
                         block_size=16, **options)
    textbook, quick = pair(6, lambda: tiered.LlamaCausalLM(config))
    ids = backend.asarray(np.random.default_rng(6).integers(0, 9, (2, 5)))
    mask = backend.asarray(np.arange(5)[None, :] >= np.array([[0], [2]]))
    with nn.no_grad():
        assert_close(quick(ids, attention_mask=mask), textbook(ids, attention_mask=mask),
                     RTOL[dtype], "logits")
    assert kernels_run["blocks"] == 2
    prompts = [[1, 2, 3], [4, 5]]
    assert generate(quick, prompts, 4, greedy=True) == generate(textbook, prompts, 4,
                                                                greedy=True)


# --------------------------------------------------------------------------- the usual path
def test_what_the_kernels_refuse_runs_the_usual_path(dtype):
    """Recorded gradients, dropout in training mode, a LoRA adapter, attention weights
    kept, a cache already holding positions: the kernel declines (None)."""
    from npformer.nn import lora

    _, quick = pair(8, lambda: tiered.EncoderBlock(8, 2, 16, 0.1, "relu", True))
    x, mask = inputs(8, 2, 4, 8), ops.causal_mask(4)
    assert compiled.encoder_block_forward(quick, x, mask) is None  # gradients recorded
    with nn.no_grad():
        assert compiled.encoder_block_forward(quick, x, mask) is not None
        quick.train()  # dropout 0.1 draws masks
        assert compiled.encoder_block_forward(quick, x, mask) is None
        quick.eval()
        quick.self_attn.keep_attention = True
        assert compiled.encoder_block_forward(quick, x, mask) is None
        quick.self_attn.keep_attention = False
        cache = nn.BlockCache()
        quick(x, mask, kv_cache=cache)
        assert compiled.encoder_block_forward(quick, x[:, :1], None, cache) is None
        lora.apply_lora(quick, r=2, targets=("q_proj",))
        assert compiled.encoder_block_forward(quick, x, mask) is None


def test_nan_input_gets_the_textbook_s_nan(dtype):
    """A NaN in the input reaches the kernel's queries, keys and values: the usual path
    runs (its statements define what NaN gives), equal to the textbook block's."""
    textbook, quick = pair(9, lambda: tiered.EncoderBlock(8, 2, 16, 0.0, "gelu", True))
    x = inputs(9, 2, 4, 8)
    x[1, 2, 3] = np.nan
    with nn.no_grad():
        assert compiled.encoder_block_forward(quick, x, ops.causal_mask(4)) is None
        got, expected = quick(x, ops.causal_mask(4)), textbook(x, ops.causal_mask(4))
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    assert_close(np.nan_to_num(got), np.nan_to_num(expected), RTOL[dtype], "finite entries")


@pytest.mark.parametrize("projection", ["q_proj", "k_proj", "v_proj"])
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_a_non_finite_query_key_or_value_runs_the_usual_path(dtype, projection, value):
    """One inf or NaN in the queries, the keys or the values alone (the input finite: a
    bias holding it) and the kernel declines, in either block: the usual path's
    statements define what it gives."""
    _, block = pair(10, lambda: tiered.EncoderBlock(8, 2, 16, 0.0, "gelu", True))
    _, llama = pair(10, lambda: tiered.LlamaBlock(8, 2, 16, num_kv_heads=1, qkv_bias=True))
    x, mask = inputs(10, 2, 4, 8), ops.causal_mask(4)
    cos, sin = ops.rotary_table(backend.asarray(np.arange(4)), 4, dtype=x.dtype)
    with nn.no_grad():
        assert compiled.encoder_block_forward(block, x, mask) is not None
        assert compiled.llama_block_forward(llama, x, cos, sin, mask) is not None
        for layer in (getattr(block.self_attn, projection), getattr(llama.self_attn, projection)):
            bias = layer.bias.data.copy()
            bias[-1] = value
            layer.bias.data = bias
        assert compiled.encoder_block_forward(block, x, mask) is None
        assert compiled.llama_block_forward(llama, x, cos, sin, mask) is None


@pytest.mark.parametrize("options", [{}, {"qk_norm": True}, {"head_dim": 5}])
@pytest.mark.parametrize("padded", [False, True])
def test_a_decoding_step_attends_over_the_cache_in_the_kernel(dtype, options, padded):
    """A step after cached positions (the fast tier's growing cache): the kernel reads the
    cached keys and values, attends over them and the step's own, and the cache takes the
    step's: the textbook block's output and cache, step after step, a left-padded row's
    mask too.  The kernel counts the positions it found finite in the cache; a non-finite
    key or value appended as the layers append (unchecked) and the kernel declines; a
    finite one it checks, then counts."""
    from npformer.fast.cache import KVCache as GrowingKVCache

    textbook, quick = pair(6, lambda: tiered.EncoderBlock(8, 2, 16, 0.0, "gelu", True,
                                                          **options))
    x = inputs(6, 2, 7, 8)
    keep = np.ones((2, 7), dtype=bool)
    keep[1, :2] = not padded  # row 1's first two positions padding
    caches = nn.BlockCache(), nn.BlockCache(layer_cache=GrowingKVCache)
    with nn.no_grad():
        for start, stop in ((0, 3), (3, 4), (4, 5), (5, 7)):
            mask = ops.causal_mask(stop - start, stop)[None, None] \
                & backend.asarray(keep[:, None, None, :stop])  # (B, 1, T, S)
            got = compiled.encoder_block_forward(quick, x[:, start:stop], mask, caches[1])
            assert got is not None, f"positions {start}:{stop}: the kernel refused"
            expected = textbook(x[:, start:stop], mask, kv_cache=caches[0])
            assert_close(got, expected, RTOL[dtype], f"positions {start}:{stop}")
            for kept in ("keys", "values"):
                assert_close(getattr(caches[1].self_attn, kept),
                             getattr(caches[0].self_attn, kept), RTOL[dtype], kept)
        cached = caches[1].self_attn
        assert cached.finite == cached.length == 7  # every position the kernel's, checked
        for value in (np.nan, np.inf, 1.0):
            for kept in ("keys", "values"):
                trial = copy.deepcopy(caches[1])
                added = {name: getattr(cached, name)[:, :, -1:].copy()
                         for name in ("keys", "values")}
                added[kept][1, 0, 0, 0] = value
                trial.self_attn.append(added["keys"], added["values"])  # as the layers do
                got = compiled.encoder_block_forward(quick, x[:, 6:7], None, trial)
                assert (got is None) == (not np.isfinite(value)), (kept, value)
                assert trial.self_attn.finite == (7 if got is None else 9), (kept, value)
