"""The Llama-shaped causal LM (npformer.models.LlamaCausalLM, LlamaConfig): gradient checks
of the whole model, training with the Trainer, batched left-padded generation, checkpoints
saved and resumed, the config's checks.

Gradient checks (float64, both backends of ``xb``): every parameter, tied and untied
heads, key/value heads 1 and H, q/k/v and output biases, QK-norm, the llama3 scaling, a
left-padded batch.  Padding: a left-padded row gets the logits it gets alone.  Training: a
few Trainer updates lower the loss; stopped and resumed, the run ends with the weights of
the uninterrupted one.  Generation: a batch of prompts of different lengths, left-padded,
gives each row the tokens it gets alone (greedy and sampled with top_k/top_p).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from npformer import backend, optim
from npformer.checkpoint import load_checkpoint, restore, save_checkpoint
from npformer.decoding import generate
from npformer.gradcheck import check_module
from npformer.models import LlamaCausalLM, LlamaConfig
from npformer.nn import evaluating
from npformer.train import TrainConfig, Trainer, TrainingInterrupted
from npformer.train.tasks import LanguageModeling

from .helpers import GRADCHECK_TOL, raises_naming, to_host

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}

VARIANTS = {  # name -> LlamaConfig fields
    "llama_gqa_tied": dict(num_kv_heads=1, tie_weights=True),
    "llama_bias_untied_llama3": dict(num_kv_heads=2, attention_bias=True,
                                     tie_weights=False, rope_scaling=LLAMA3),
    "qwen2": dict(num_kv_heads=1, qkv_bias=True, tie_weights=False),
    "qwen3": dict(num_kv_heads=1, qk_norm=True, head_dim=6, tie_weights=True),
}


def make(seed=0, **fields) -> LlamaCausalLM:
    backend.seed(seed)
    config = dict(vocab_size=11, d_model=8, d_ff=10, num_layers=2,
                  num_heads=2, block_size=16, rope_theta=100.0)
    return LlamaCausalLM(LlamaConfig(**{**config, **fields}))


def left_padded(rows, pad=0):
    width = max(map(len, rows))
    ids = np.array([[pad] * (width - len(r)) + list(r) for r in rows])
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


# =========================================================================== gradients
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gradcheck(xb, on_device, variant):
    model = make(**VARIANTS[variant])
    ids, mask = left_padded([[1, 4, 2, 9], [3, 7]])
    result = check_module(model, [on_device(ids)], kwargs={"attention_mask": on_device(mask)},
                          h=1e-6)
    assert result.worst_error < GRADCHECK_TOL, f"gradient check failed:\n{result}"
    names = {name for name, _ in model.named_parameters()}
    assert ("lm_head.weight" in names) == (not model.config.tie_weights)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_left_padded_row_gets_its_own_logits(xb, on_device, variant):
    model = make(**VARIANTS[variant])
    rows = [[1, 4, 2, 9, 5], [3, 7], [8]]
    ids, mask = left_padded(rows)
    with evaluating(model):
        batched = to_host(model(on_device(ids), attention_mask=on_device(mask)))
        for b, row in enumerate(rows):
            alone = to_host(model(on_device(np.array([row]))))
            np.testing.assert_allclose(batched[b, -len(row):], alone[0], rtol=1e-12,
                                       atol=1e-12)


def test_cached_decoding_is_the_full_forward(xb, on_device):
    model = make(**VARIANTS["qwen3"])
    ids = np.array([[1, 4, 2, 9, 5, 6], [3, 7, 7, 1, 0, 2]])
    with evaluating(model):
        full = to_host(model(on_device(ids)))
        cache = model.new_cache()
        first = to_host(model.forward_cached(on_device(ids[:, :3]), cache))
        rest = [to_host(model.forward_cached(on_device(ids[:, i:i + 1]), cache))
                for i in range(3, 6)]
    assert tuple(cache.blocks[0].self_attn.keys.shape) == (2, 1, 6, 6)  # Hkv = 1 head kept
    np.testing.assert_allclose(np.concatenate([first, *rest], axis=1), full, rtol=1e-12,
                               atol=1e-12)


# =========================================================================== generate
@pytest.mark.parametrize("variant", ["llama_bias_untied_llama3", "qwen3"])
@pytest.mark.parametrize("sampling", [dict(greedy=True), dict(top_k=4, top_p=0.9)])
def test_generate_batched_left_padded_equals_one_by_one(variant, sampling):
    model = make(**VARIANTS[variant])
    prompts = [[1, 4, 2, 9, 5], [3, 7], [8, 1, 1]]
    batched = generate(model, prompts, 6, rng=np.random.default_rng(1), **sampling)
    for prompt, row in zip(prompts, batched):
        # one row alone draws from its own generator: compare the greedy path exactly,
        # and a sampled row against the batch row sampled with the batch's generator
        if sampling.get("greedy"):
            assert generate(model, prompt, 6, **sampling) == row
    assert [len(r) for r in batched] == [11, 8, 9]
    if not sampling.get("greedy"):  # sampling in a batch is each row's with that generator
        ids, mask = left_padded(prompts)
        again = generate(model, ids, 6, attention_mask=mask, rng=np.random.default_rng(1),
                         **sampling)
        assert again == batched


def test_generate_past_the_context_window():
    model = make(block_size=6)
    out = generate(model, [[1, 2, 3, 4], [5]], 5, greedy=True)
    assert out[0] == generate(model, [1, 2, 3, 4], 5, greedy=True)
    assert [len(r) for r in out] == [9, 6]


# =========================================================================== training
def batches(rng):
    """Next-token batches of a fixed repeating sequence: a model can learn it."""
    start = rng.integers(0, 5, size=4)
    seq = (start[:, None] + np.arange(7)[None, :]) % 11
    return seq[:, :-1], seq[:, 1:]


def make_trainer(tmp_path, seed=0, **config):
    model = make(seed, **VARIANTS["qwen3"])
    opt = optim.AdamW(model.parameters(), lr=optim.warmup_cosine(peak_lr=3e-2, warmup=2,
                                                                 total_updates=12))
    cfg = dict(max_iters=12, clip_norm=1.0, last_path=tmp_path / "last.npz", progress=False)
    return Trainer(model, opt, LanguageModeling(), batches, TrainConfig(**{**cfg, **config}),
                   seed=5)


def test_trainer_lowers_the_loss(tmp_path):
    trainer = make_trainer(tmp_path)
    x, y = batches(np.random.default_rng(9))
    task = LanguageModeling()
    before = task.loss_and_grad(trainer.model, (x, y))
    trainer.fit()
    trainer.model.zero_grad()
    after = task.loss_and_grad(trainer.model, (x, y))
    assert after < 0.8 * before, (before, after)


@pytest.mark.parametrize("stop_after", [3, 7])
def test_stopped_and_resumed_ends_like_the_uninterrupted_run(tmp_path, stop_after):
    straight = make_trainer(tmp_path / "straight")
    straight.fit()
    first = make_trainer(tmp_path / "resumed", stop_after=stop_after)
    with pytest.raises(TrainingInterrupted):
        first.fit()
    second = make_trainer(tmp_path / "resumed", seed=123)  # other weights at the start
    second.resume(tmp_path / "resumed" / "last.npz")
    second.fit()
    for (name, a), (_, b) in zip(straight.model.named_parameters(),
                                 second.model.named_parameters()):
        np.testing.assert_array_equal(to_host(a.data), to_host(b.data), err_msg=name)


def test_checkpoint_restores_into_a_model_of_the_config(tmp_path):
    model = make(3, **VARIANTS["llama_bias_untied_llama3"])
    path = save_checkpoint(tmp_path / "m.npz", model, step=4)
    checkpoint = load_checkpoint(path)
    assert checkpoint.config["rope_scaling"] == LLAMA3
    other = make(9, **VARIANTS["llama_bias_untied_llama3"])
    restore(other, checkpoint)
    ids = np.array([[1, 2, 3]])
    with evaluating(model), evaluating(other):
        np.testing.assert_array_equal(to_host(model(ids)), to_host(other(ids)))
    different = make(9, **{**VARIANTS["llama_bias_untied_llama3"], "qk_norm": True})
    with raises_naming(Exception, "qk_norm"):
        restore(different, checkpoint)


# =========================================================================== the config
@pytest.mark.parametrize("fields, fragments", [
    (dict(num_heads=4, num_kv_heads=3),
     ["num_heads 4", "num_kv_heads 3", "[1, 2, 4]"]),
    (dict(d_model=10, num_heads=4), ["d_model 10", "head_dim"]),
    (dict(head_dim=5), ["head_dim", "even", "5"]),
    (dict(vocab_size=0), ["vocab_size", "positive integer", "0"]),
    (dict(num_kv_heads=2.0), ["num_kv_heads", "2.0"]),
    (dict(norm_eps=0.0), ["norm_eps", "> 0"]),
    (dict(rope_theta=float("inf")), ["rope_theta", "inf"]),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), ["rope_scaling", "yarn",
                                                                 "llama3"]),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 2.0}),
     ["rope_scaling", "low_freq_factor"]),
    (dict(qk_norm="yes"), ["qk_norm", "yes"]),
])
def test_config_errors(fields, fragments):
    base = dict(vocab_size=11, d_model=8, num_heads=2)
    with raises_naming(ValueError, "LlamaConfig", *fragments):
        LlamaConfig(**{**base, **fields})


def test_config_resolves_heads_and_width():
    config = LlamaConfig(vocab_size=5, d_model=12, num_heads=3)
    assert (config.num_kv_heads, config.head_dim, config.block_size) == (3, 4, 256)
    assert dataclasses.replace(config) == config


def test_model_input_errors():
    model = make()
    with raises_naming(ValueError, "token ids", "11"):
        model(np.array([[1, 11]]))
    with raises_naming(ValueError, "longer than", "block_size 16"):
        model(np.ones((1, 17), dtype=np.int64))
    with raises_naming(ValueError, "attention_mask", "(1, 2)"):
        model(np.array([[1, 2]]), attention_mask=np.array([[1, 1, 1]]))
    with raises_naming(TypeError, "LlamaConfig"):
        LlamaCausalLM(dict(vocab_size=3))


def test_build_model_builds_a_llama_checkpoint_again(tmp_path):
    """A checkpoint names the model's kind, "llama": build_model makes a LlamaCausalLM of
    its config with its weights in either tier (the same logits), and generate decodes
    with it."""
    from npformer import fast
    from npformer.checkpoint import build_model
    from npformer.decoding import generate

    from .conftest import using_backend

    with using_backend("numpy", "float64"):
        model = make(seed=3)
        path = save_checkpoint(tmp_path / "m.npz", model)
        ids = np.array([[1, 2, 3, 4]])
        for tier, cls in (("textbook", LlamaCausalLM), ("fast", fast.LlamaCausalLM)):
            built = build_model(load_checkpoint(path), expected_kind="llama", tier=tier)
            assert type(built) is cls and built.kind == "llama"
            np.testing.assert_allclose(built(ids), model(ids), rtol=1e-12, atol=1e-14)
            assert generate(built, [1, 2], 3, greedy=True) == generate(model, [1, 2], 3,
                                                                       greedy=True)


# =========================================================================== sweep 5
def test_cached_decoding_past_the_context_is_refused_as_the_forward_is():
    """sweep 5: forward refuses a sequence longer than block_size, but
    forward_cached computed positions 16, 17, ... past it (a prompt of 17 at once, or one
    more token after 16 cached), silently."""
    from npformer import no_grad

    model = make()
    with no_grad():
        with raises_naming(ValueError, "sequence of length 17", "block_size 16"):
            model.forward_cached(np.ones((1, 17), dtype=np.int64), model.new_cache())
        cache = model.new_cache()
        model.forward_cached(np.ones((1, 16), dtype=np.int64), cache)
        with raises_naming(ValueError, "sequence of length 17 (16 cached and 1 new)",
                           "block_size 16"):
            model.forward_cached(np.ones((1, 1), dtype=np.int64), cache)


def test_a_cache_that_is_not_this_models_is_refused_naming_it():
    """sweep 5: a cache of fewer blocks than the model's layers left the last layers
    without theirs (zip stopped early: wrong logits, silently); None gave an
    AttributeError, a cache filled for another batch or by another model a concatenation
    error from inside KVCache.append, ids of one or three axes an unpacking error."""
    from npformer import no_grad
    from npformer.nn import DecodingCache

    model, one = make(num_kv_heads=1), np.ones((1, 1), dtype=np.int64)
    with no_grad():
        with raises_naming(ValueError, "kv_cache holds the caches of 1 blocks",
                           "LlamaCausalLM has 2"):
            model.forward_cached(one, DecodingCache(1))
        with raises_naming(TypeError, "kv_cache must be a DecodingCache", "NoneType"):
            model.forward_cached(one, None)
        cache = model.new_cache()
        model.forward_cached(np.ones((1, 3), dtype=np.int64), cache)
        with raises_naming(ValueError, "keys of shape (1, 1, 3, 4)", "a batch of 2"):
            model.forward_cached(np.ones((2, 1), dtype=np.int64), cache)
        other = make(num_kv_heads=2)
        with raises_naming(ValueError, "keys of shape (1, 1, 3, 4)", "2 heads of width 4"):
            other.forward_cached(one, cache)
        for ids in (np.ones(3, dtype=np.int64), np.ones((1, 1, 1), dtype=np.int64)):
            with raises_naming(ValueError, "token ids (batch, positions) must have 2 "
                                           "dimensions"):
                model.forward_cached(ids, model.new_cache())
