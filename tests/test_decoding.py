"""Decoding: cached steps, greedy, beam search and sampling, against full forward passes.

* ``Seq2SeqTransformer.forward_cached`` (one token at a time, or several) and
  ``CausalLM.forward_cached`` (in chunks) give the logits of a full forward over the
  whole prefix (float64, 1e-10), with padded sources and both norm placements;
* ``greedy_decode`` equals a reference greedy loop that recomputes the whole
  prefix with ``model.forward`` at every step (batched, padded sources);
* ``beam_search(beam_size=1)`` equals ``greedy_decode``, on random weights over
  many sources and on a trained model;
* beam search scores (sum of log-probs / length penalty, recomputed here with
  full forwards) are never below greedy's on the trained model, and a beam wide
  enough to be exhaustive returns exactly the brute-force best hypothesis;
* ``generate(greedy=True)`` equals the argmax continuation computed with full
  forwards over the last block_size tokens, also far beyond block_size
  (sliding window); ``top_k=1`` sampling equals greedy, sampled tokens always
  lie in the reference top-k, and the rng makes sampling reproducible;
* ``generate`` on a batch of prompts of different lengths (a list, or a left-padded
  array with its attention mask) gives each row what its prompt alone gives (greedy,
  far past block_size too); a row ends at ``eos_id``; sampling follows
  ``sampling_distribution``, which is temperature, top-k and top-p as defined (checked
  against each definition written out), draws follow it in frequency, and the
  generator's seed reproduces them;
* bad arguments raise ValueError or TypeError with a message naming the argument (counts,
  length penalty, temperature, top_k; token ids outside the vocabulary, of another rank,
  ragged or not integers; sources with no tokens), lists and host arrays are accepted
  where arrays are expected, an empty batch decodes to [], max_len / max_new_tokens 0
  decode nothing;
* a tiny seq2seq trained with Trainer + Adam on reversing digit strings decodes
  held-out strings correctly with greedy and beam search (the whole training
  and decoding path learns).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from npformer import backend, optim
from npformer.decoding import (
    beam_search,
    generate,
    greedy_decode,
    length_penalty,
    sample,
    sampling_distribution,
)
from npformer.models import CausalLMConfig, Seq2SeqConfig
from npformer.nn import no_grad
from npformer.train import TrainConfig, Trainer
from npformer.train.tasks import Translation

from .conftest import using_backend
from .helpers import rel_diff, tiered

# A behaviour test: it runs in both tiers (tests.helpers.tiered), which must behave the same.
pytestmark = pytest.mark.usefixtures("tier")

PAD, UNK, BOS, EOS = 0, 1, 2, 3
CACHE_RTOL = 1e-10


# =========================================================================== helpers
def randomize(model, seed: int, std: float = 0.8) -> None:
    rng = np.random.default_rng(seed)
    for _, p in model.named_parameters():
        p.data = backend.asarray(rng.standard_normal(p.shape) * std, dtype="float64")


def dev(host):
    return backend.asarray(np.asarray(host, dtype=np.int64))


def random_seq2seq(seed=0, norm_first=False, positional="sinusoidal", vocab=(9, 8),
                   block_size=8, tie=False):
    cfg = Seq2SeqConfig(src_vocab_size=vocab[0], tgt_vocab_size=vocab[1], d_model=8,
                        num_heads=2, num_encoder_layers=2, num_decoder_layers=2, d_ff=12,
                        block_size=block_size, dropout=0.1, activation="gelu",
                        norm_first=norm_first, positional=positional, tie_weights=tie,
                        pad_id=PAD, bos_id=BOS, eos_id=EOS)
    model = tiered.Seq2SeqTransformer(cfg)
    randomize(model, seed)
    return model


def random_lm(seed=0, tie=True, norm_first=True, positional="learned", block_size=6):
    cfg = CausalLMConfig(vocab_size=11, block_size=block_size, d_model=8, num_heads=2,
                         num_layers=2, d_ff=12, dropout=0.1, activation="gelu",
                         norm_first=norm_first, positional=positional, tie_weights=tie)
    model = tiered.CausalLM(cfg)
    randomize(model, seed)
    return model


def padded(rng, lengths, vocab, low=4):
    ids = np.full((len(lengths), max(lengths)), PAD, dtype=np.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(low, vocab, size=n)
    return ids, np.asarray(lengths, dtype=np.int64)


def full_logits(model, src, src_lens, tgt_in):
    """Logits of one whole forward pass (eval mode, no caches)."""
    model.eval()
    with no_grad():
        out = backend.to_numpy(model(dev(src), dev(tgt_in), dev(src_lens)))
    model.train()
    return out


def full_log_probs(logits_row):
    z = logits_row - logits_row.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def reference_greedy(model, src_row, src_len, steps):
    """Greedy decoding by recomputing the whole target prefix every step."""
    out = []
    for _ in range(steps):
        logits = full_logits(model, src_row[None], np.array([src_len]), [[BOS, *out]])
        token = int(np.argmax(logits[0, -1]))
        if token == EOS:
            break
        out.append(token)
    return out


def hypothesis_score(model, src_row, src_len, hyp, steps, alpha):
    """Model score of a decoded hypothesis as beam search ranks it: total log-probability
    (including <eos> if it ended, i.e. is shorter than ``steps``) / length penalty."""
    finished = len(hyp) < steps
    targets = [*hyp, EOS] if finished else list(hyp)
    tgt_in = [BOS, *targets[:-1]]
    log_p = full_log_probs(full_logits(model, src_row[None], np.array([src_len]), [tgt_in])[0])
    total = float(sum(log_p[t, tok] for t, tok in enumerate(targets)))
    return total / length_penalty(len(targets), alpha)


# =========================================================================== cached steps
@pytest.mark.parametrize("norm_first,positional,tie", [(False, "sinusoidal", False),
                                                       (True, "learned", False),
                                                       (False, "sinusoidal", True)])
@pytest.mark.parametrize("chunks", [[1] * 6, [2, 1, 3], [6]])
def test_forward_cached_matches_full_forward(norm_first, positional, tie, chunks):
    with using_backend("numpy", "float64"):
        rng = np.random.default_rng(1)
        model = random_seq2seq(seed=2, norm_first=norm_first, positional=positional, tie=tie)
        src, src_lens = padded(rng, [7, 3, 5], 9)
        tgt = np.concatenate([np.full((3, 1), BOS), rng.integers(4, 8, size=(3, 5))], axis=1)
        expected = full_logits(model, src, src_lens, tgt)  # (B, 6, V)
        model.eval()
        with no_grad():
            memory, memory_mask = model.encode(dev(src), dev(src_lens))
            cache, offset, pieces = model.new_cache(), 0, []
            for n in chunks:
                logits = model.forward_cached(dev(tgt[:, offset:offset + n]), memory,
                                              memory_mask, cache)
                pieces.append(backend.to_numpy(logits))
                offset += n
        cached = np.concatenate(pieces, axis=1)
        assert cached.shape == expected.shape
        assert rel_diff(cached, expected) <= CACHE_RTOL
        # the caches hold exactly the decoded positions
        assert cache.length == 6
        assert all(tuple(b.self_attn.keys.shape)[2] == 6 for b in cache.blocks)
        assert all(tuple(b.cross_attn.keys.shape)[2] == src.shape[1] for b in cache.blocks)


@pytest.mark.parametrize("tie,norm_first,positional", [(True, True, "learned"),
                                                       (False, False, "sinusoidal")])
@pytest.mark.parametrize("chunks", [[1] * 6, [3, 1, 2], [6]])
def test_lm_forward_cached_in_chunks_matches_full_forward(tie, norm_first, positional, chunks):
    with using_backend("numpy", "float64"):
        model = random_lm(seed=3, tie=tie, norm_first=norm_first, positional=positional)
        ids = np.random.default_rng(4).integers(0, 11, size=(2, 6))
        model.eval()
        with no_grad():
            expected = backend.to_numpy(model(dev(ids)))
            cache, offset, pieces = model.new_cache(), 0, []
            for n in chunks:
                pieces.append(backend.to_numpy(model.forward_cached(dev(ids[:, offset:offset + n]),
                                                                    cache)))
                offset += n
        assert rel_diff(np.concatenate(pieces, axis=1), expected) <= CACHE_RTOL


def test_cached_decoding_past_the_table_raises():
    with using_backend("numpy", "float64"):
        model = random_lm(block_size=4)
        model.eval()
        with no_grad():
            cache = model.new_cache()
            model.forward_cached(dev([[1, 2, 3]]), cache)
            with pytest.raises(ValueError, match="5"):
                model.forward_cached(dev([[4, 5]]), cache)


def test_cached_decoding_needs_no_grad():
    with using_backend("numpy", "float64"):
        model = random_lm(block_size=4)
        with pytest.raises(RuntimeError, match="forward_cached is for inference"):
            model.forward_cached(dev([[1, 2]]), model.new_cache())


def test_cache_select_reorders_every_layer():
    """Beam search keeps, drops and copies hypotheses: select(rows) on the model's cache."""
    with using_backend("numpy", "float64"):
        model = random_seq2seq(seed=2)
        rng = np.random.default_rng(0)
        src, src_lens = padded(rng, [7, 3, 5], 9)
        model.eval()
        with no_grad():
            memory, memory_mask = model.encode(dev(src), dev(src_lens))
            cache = model.new_cache()
            model.forward_cached(dev(np.full((3, 2), BOS)), memory, memory_mask, cache)
            before = [(backend.to_numpy(b.self_attn.keys), backend.to_numpy(b.cross_attn.values))
                      for b in cache.blocks]
            cache.select(dev(np.array([2, 0, 0, 1])))
        for (keys, values), b in zip(before, cache.blocks):
            np.testing.assert_array_equal(backend.to_numpy(b.self_attn.keys), keys[[2, 0, 0, 1]])
            np.testing.assert_array_equal(backend.to_numpy(b.cross_attn.values),
                                          values[[2, 0, 0, 1]])
        assert cache.length == 2


# =========================================================================== greedy and beam
def test_greedy_matches_full_recompute_reference():
    with using_backend("numpy", "float64"):
        rng = np.random.default_rng(5)
        for seed in range(4):
            model = random_seq2seq(seed=10 + seed, norm_first=bool(seed % 2))
            src, src_lens = padded(rng, [7, 2, 5, 4], 9)
            out = greedy_decode(model, dev(src), dev(src_lens), max_len=7)
            for b in range(len(src)):
                assert out[b] == reference_greedy(model, src[b], src_lens[b], 7)
            assert model.training  # decoding restores the mode


def test_greedy_stops_at_max_len_and_config_max_len():
    with using_backend("numpy", "float64"):
        model = random_seq2seq(seed=1, block_size=5)
        # never emit <eos>: outputs run to the length limit
        bias = backend.to_numpy(model.lm_head.bias.data).copy()
        bias[EOS] = -1e3
        model.lm_head.bias.data = backend.asarray(bias)
        src, lens = padded(np.random.default_rng(0), [3, 4], 9)
        assert [len(r) for r in greedy_decode(model, dev(src), dev(lens), max_len=3)] == [3, 3]
        assert [len(r) for r in greedy_decode(model, dev(src), dev(lens), max_len=50)] == [5, 5]
        assert [len(r) for r in beam_search(model, dev(src), dev(lens), 3, max_len=50)] == [5, 5]


def test_beam_size_one_equals_greedy_on_random_models():
    with using_backend("numpy", "float64"):
        rng = np.random.default_rng(7)
        for seed in range(6):
            model = random_seq2seq(seed=20 + seed, norm_first=bool(seed % 2))
            src, src_lens = padded(rng, list(rng.integers(1, 8, size=5)), 9)
            greedy = greedy_decode(model, dev(src), dev(src_lens), max_len=7)
            for alpha in (0.0, 0.6):
                beam = beam_search(model, dev(src), dev(src_lens), beam_size=1, max_len=7,
                                   alpha=alpha)
                assert beam == greedy


def test_exhaustive_beam_finds_the_brute_force_optimum():
    """A beam as wide as the whole hypothesis space returns the best finished hypothesis
    (by the model's own score), which is at least as good as greedy's."""
    with using_backend("numpy", "float64"):
        vocab, steps = 5, 3
        rng = np.random.default_rng(8)
        compared = 0
        for seed in range(5):
            model = random_seq2seq(seed=30 + seed, vocab=(9, vocab), block_size=6)
            src, src_lens = padded(rng, [4, 2], 9)
            non_eos = [t for t in range(vocab) if t != EOS]
            for alpha in (0.0, 1.0):
                beams = beam_search(model, dev(src), dev(src_lens), beam_size=vocab ** steps,
                                    max_len=steps, alpha=alpha)
                greedy = greedy_decode(model, dev(src), dev(src_lens), max_len=steps)
                for b in range(len(src)):
                    candidates = [list(h) for n in range(steps)
                                  for h in itertools.product(non_eos, repeat=n)]
                    scores = [hypothesis_score(model, src[b], src_lens[b], h, steps, alpha)
                              for h in candidates]
                    best = max(scores)
                    got = hypothesis_score(model, src[b], src_lens[b], beams[b], steps, alpha)
                    assert len(beams[b]) < steps  # a finished hypothesis
                    assert got == pytest.approx(best, rel=1e-12, abs=1e-12)
                    if len(greedy[b]) < steps:  # greedy finished too: it cannot beat the optimum
                        compared += 1
                        assert got >= hypothesis_score(model, src[b], src_lens[b], greedy[b],
                                                       steps, alpha) - 1e-12
        assert compared > 0


# ========================================================================== language model sampling
def reference_generate(model, prompt, n):
    """Argmax continuation, each step a full forward over the last block_size tokens."""
    block = model.config.block_size
    ids = list(prompt)
    model.eval()
    with no_grad():
        for _ in range(n):
            logits = backend.to_numpy(model(dev([ids[-block:]])))
            ids.append(int(np.argmax(logits[0, -1])))
    model.train()
    return ids


def _recording(forward_cached, seen: list):
    """``forward_cached`` that also appends each call's last-position logits to ``seen``."""
    def recording(ids, cache, **kwargs):
        logits = forward_cached(ids, cache, **kwargs)
        seen.append(backend.to_numpy(logits)[0, -1])
        return logits
    return recording


@pytest.mark.parametrize("prompt_len", [1, 3, 6, 9])
def test_generate_greedy_matches_full_forward_beyond_block_size(prompt_len, monkeypatch):
    """Every generated token is the argmax of a full forward over the last block_size
    tokens, and the cached logits it was chosen from equal that forward's (the window
    slides: past block_size each prediction still sees block_size tokens)."""
    with using_backend("numpy", "float64"):
        for seed in range(3):
            model = random_lm(seed=40 + seed, tie=bool(seed % 2), block_size=6)
            block = model.config.block_size
            prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 11, size=prompt_len)]
            n = 3 * block  # far past the positional table
            seen = []
            monkeypatch.setattr(model, "forward_cached", _recording(model.forward_cached, seen))
            out = generate(model, prompt, n, greedy=True)
            monkeypatch.undo()
            assert len(out) == prompt_len + n
            assert out[:prompt_len] == prompt
            assert out == reference_generate(model, prompt, n)
            assert len(seen) == n
            model.eval()
            with no_grad():
                for i, cached in enumerate(seen):
                    context = out[:prompt_len + i][-block:]
                    expected = backend.to_numpy(model(dev([context])))[0, -1]
                    assert rel_diff(cached, expected) <= CACHE_RTOL, (i, len(context))
            model.train()
            assert model.training


def test_top_k_one_sampling_equals_greedy():
    with using_backend("numpy", "float64"):
        model = random_lm(seed=50, block_size=5)
        greedy = generate(model, [1, 2], 12, greedy=True)
        for temperature in (0.3, 1.0, 5.0):
            sampled = generate(model, [1, 2], 12, temperature=temperature, top_k=1,
                               rng=np.random.default_rng(1))
            assert sampled == greedy


def test_sampling_stays_in_top_k_and_is_reproducible():
    with using_backend("numpy", "float64"):
        model = random_lm(seed=51, block_size=5)
        a = generate(model, [3], 15, temperature=2.0, top_k=3, rng=np.random.default_rng(9))
        b = generate(model, [3], 15, temperature=2.0, top_k=3, rng=np.random.default_rng(9))
        assert a == b
        model.eval()
        with no_grad():
            for t in range(1, len(a)):
                logits = backend.to_numpy(model(dev([a[:t][-5:]])))[0, -1]
                assert a[t] in set(np.argsort(-logits)[:3].tolist())
        # without top_k, a high temperature does leave the top 3 sometimes
        c = generate(model, [3], 60, temperature=50.0, rng=np.random.default_rng(9))
        assert len(set(c)) > 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_ids=[], max_new_tokens=3), "prompt"),
    (dict(prompt_ids=[1], max_new_tokens=3, temperature=0.0), "temperature"),
    (dict(prompt_ids=[1], max_new_tokens=3, temperature=-1.0), "temperature"),
    (dict(prompt_ids=[1], max_new_tokens=3, top_k=0), "top_k"),
])
def test_generate_rejects_bad_arguments(kwargs, match):
    with using_backend("numpy", "float64"):
        model = random_lm(block_size=5)
        with pytest.raises(ValueError, match=match):
            generate(model, **kwargs)


@pytest.mark.parametrize("beam_size", [0, -2])
def test_beam_search_rejects_bad_beam_size(beam_size):
    with using_backend("numpy", "float64"):
        model = random_seq2seq()
        src, lens = padded(np.random.default_rng(0), [3], 9)
        with pytest.raises(ValueError, match="beam_size"):
            beam_search(model, dev(src), dev(lens), beam_size=beam_size)


def test_decoding_keeps_no_backward_caches():
    with using_backend("numpy", "float64"):
        model = random_seq2seq(seed=3)
        src, lens = padded(np.random.default_rng(0), [5, 3], 9)
        greedy_decode(model, dev(src), dev(lens), max_len=4)
        beam_search(model, dev(src), dev(lens), beam_size=2, max_len=4)
        lm = random_lm(seed=3)
        generate(lm, [1, 2], 8)
        for m in (model, lm):
            leftovers = [type(sub).__name__ for sub in m.modules()
                         if getattr(sub, "_saved", None) is not None]
            assert not leftovers, leftovers


# =========================================================================== a model that learned
DIGITS = range(4, 12)  # token ids of the 8 "digits"
TASK_VOCAB = 12
STEPS = 300  # Adam updates of the toy reverser (a few seconds)


def reverse_batch(rng, batch=32, min_len=2, max_len=5):
    lens = rng.integers(min_len, max_len + 1, size=batch)
    src = np.full((batch, max_len), PAD, dtype=np.int64)
    tgt_in = np.full((batch, max_len + 1), PAD, dtype=np.int64)
    tgt_out = np.full((batch, max_len + 1), PAD, dtype=np.int64)
    for b, n in enumerate(lens):
        seq = rng.integers(DIGITS.start, DIGITS.stop, size=n)
        src[b, :n] = seq
        tgt_in[b, :n + 1] = [BOS, *seq[::-1]]
        tgt_out[b, :n + 1] = [*seq[::-1], EOS]
    return src, lens, tgt_in, tgt_out, lens + 1


@pytest.fixture(scope="module")
def reverser():
    """A small seq2seq trained (Trainer, Adam, warmup) to reverse digit strings."""
    with using_backend("numpy", "float64", seed=0):
        cfg = Seq2SeqConfig(src_vocab_size=TASK_VOCAB, tgt_vocab_size=TASK_VOCAB, d_model=32,
                            num_heads=4, num_encoder_layers=1, num_decoder_layers=1, d_ff=64,
                            block_size=8, dropout=0.0, activation="relu", norm_first=True,
                            pad_id=PAD, bos_id=BOS, eos_id=EOS)
        model = tiered.Seq2SeqTransformer(cfg)
        opt = tiered.Adam(model.parameters(),
                         lr=optim.warmup_cosine(peak_lr=1e-2, warmup=30,
                                                total_updates=STEPS, min_lr=1e-3))
        trainer = Trainer(model, opt, Translation(pad_id=PAD), reverse_batch,
                          TrainConfig(max_iters=STEPS, clip_norm=1.0, progress=False), seed=1)
        history = trainer.fit()
    return model, history



def test_trained_reverser_decodes_correctly(reverser):
    model, history = reverser
    assert np.mean(history.losses[-20:]) < 0.1 * history.losses[0]
    with using_backend("numpy", "float64"):
        src, lens, _, _, _ = reverse_batch(np.random.default_rng(123), batch=40)
        expected = [list(src[b, :n][::-1]) for b, n in enumerate(lens)]
        greedy = greedy_decode(model, dev(src), dev(lens), max_len=8)
        beam = beam_search(model, dev(src), dev(lens), beam_size=3, max_len=8)
        greedy_acc = np.mean([g == e for g, e in zip(greedy, expected)])
        beam_acc = np.mean([g == e for g, e in zip(beam, expected)])
        assert greedy_acc >= 0.95, greedy_acc
        assert beam_acc >= 0.95, beam_acc


def test_trained_reverser_beam_one_is_greedy_and_wider_beams_score_higher(reverser):
    model, _ = reverser
    with using_backend("numpy", "float64"):
        # inputs partly outside the training distribution (length 6, 1) so that the
        # model is unsure and the beams have something to choose between
        rng = np.random.default_rng(321)
        src, lens = padded(rng, [6, 1, 3, 6, 5, 2, 6, 4], TASK_VOCAB)
        steps = 8
        greedy = greedy_decode(model, dev(src), dev(lens), max_len=steps)
        assert beam_search(model, dev(src), dev(lens), beam_size=1, max_len=steps) == greedy
        alpha = 0.6
        for k in (2, 4):
            beams = beam_search(model, dev(src), dev(lens), beam_size=k, max_len=steps,
                                alpha=alpha)
            for b in range(len(src)):
                ours = hypothesis_score(model, src[b], lens[b], beams[b], steps, alpha)
                theirs = hypothesis_score(model, src[b], lens[b], greedy[b], steps, alpha)
                assert ours >= theirs - 1e-9, (k, b, beams[b], greedy[b])


# =========================================================================== bad and edge inputs
@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(max_len=-1), ValueError, "max_len must be at least 0, got -1"),
    (dict(max_len=2.5), TypeError, "max_len must be an integer"),
    (dict(max_len=None), TypeError, "max_len must be an integer"),
])
def test_decoders_reject_bad_max_len(decode, kwargs, error, match):
    with using_backend("numpy", "float64"):
        model = random_seq2seq()
        src, lens = padded(np.random.default_rng(0), [3, 2], 9)
        with pytest.raises(error, match=match):
            decode(model, dev(src), dev(lens), **kwargs)


@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
def test_max_len_zero_decodes_empty_hypotheses(decode):
    with using_backend("numpy", "float64"):
        model = random_seq2seq()
        src, lens = padded(np.random.default_rng(0), [3, 2], 9)
        assert decode(model, dev(src), dev(lens), max_len=0) == [[], []]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(beam_size=2.5), TypeError, "beam_size must be an integer"),
    (dict(beam_size=True), TypeError, "beam_size must be an integer"),
    (dict(alpha=float("nan")), ValueError, "alpha must be a finite number >= 0, got nan"),
    (dict(alpha=-0.5), ValueError, "alpha must be a finite number >= 0, got -0.5"),
    (dict(alpha=float("inf")), ValueError, "alpha must be a finite number"),
    (dict(alpha="0.6"), TypeError, "alpha must be a real number"),
])
def test_beam_search_rejects_bad_beam_size_and_length_penalty(kwargs, error, match):
    with using_backend("numpy", "float64"):
        model = random_seq2seq()
        src, lens = padded(np.random.default_rng(0), [3], 9)
        with pytest.raises(error, match=match):
            beam_search(model, dev(src), dev(lens), **kwargs)


@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
def test_decoders_accept_lists_and_numpy_arrays(decode):
    """Array-likes are converted once: lists and host arrays give what backend arrays give."""
    with using_backend("numpy", "float64"):
        model = random_seq2seq(seed=4)
        src, lens = padded(np.random.default_rng(1), [5, 2, 4], 9)
        expected = decode(model, dev(src), dev(lens), max_len=6)
        assert decode(model, src.tolist(), lens.tolist(), max_len=6) == expected
        assert decode(model, src, lens, max_len=6) == expected
        assert decode(model, src.tolist(), max_len=6) == decode(model, dev(src), max_len=6)


@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
@pytest.mark.parametrize("src,src_lens,error,match", [
    ([4, 5, 6], None, ValueError, r"src must be a \(batch, positions\) array .* shape \(3,\)"),
    ([[4, 5], [6]], None, ValueError, r"src must be a \(batch, positions\) array"),
    ([[4.0, 5.0]], None, TypeError, "src must hold integer token ids, got dtype float64"),
    ([[4, 9]], None, ValueError, r"src out of range: found id 9, .*vocabulary has 9 entries"),
    ([[4, -1]], None, ValueError, r"src out of range: found id -1, .*vocabulary"),
    ([[4, 5], [6, 7]], [2], ValueError, "src_lens has 1 lengths for a batch of 2"),
    ([[4, 5], [6, 7]], [[2, 2]], ValueError, r"src_lens must be a \(batch,\) array"),
    ([[4, 5], [6, 7]], [2, 3], ValueError, "src_lens holds length 3, longer than the 2 positions"),
    ([[4, 5], [6, 7]], [2, 0], ValueError, r"src_lens\[1\] is 0: every source needs at least one"),
    ([[4, 5], [0, 0]], None, ValueError, "src row 1 is all padding: every source needs"),
    (np.zeros((2, 0), np.int64), None, ValueError, r"src has 0 positions \(axis 1\)"),
])
def test_decoders_reject_bad_sources_naming_them(decode, src, src_lens, error, match):
    with using_backend("numpy", "float64"):
        model = random_seq2seq()
        with pytest.raises(error, match=match):
            decode(model, src, src_lens, max_len=4)


@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
@pytest.mark.parametrize("src", [np.zeros((0, 3), np.int64), np.zeros((0, 0), np.int64), []])
def test_an_empty_batch_decodes_to_an_empty_list(decode, src):
    with using_backend("numpy", "float64"):
        model = random_seq2seq()
        assert decode(model, src, max_len=4) == []
        assert decode(model, dev(src), np.zeros(0, np.int64), max_len=4) == []


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(prompt_ids=[1], max_new_tokens=-1), ValueError,
     "max_new_tokens must be at least 0, got -1"),
    (dict(prompt_ids=[1], max_new_tokens=2.0), TypeError, "max_new_tokens must be an integer"),
    (dict(prompt_ids=[1], max_new_tokens=3, temperature=float("nan")), ValueError,
     "temperature must be a finite number > 0, got nan"),
    (dict(prompt_ids=[1], max_new_tokens=3, temperature=float("inf")), ValueError,
     "temperature must be a finite number > 0, got inf"),
    (dict(prompt_ids=[1], max_new_tokens=3, top_k=-3), ValueError,
     "top_k must be at least 1, got -3"),
    (dict(prompt_ids=[1], max_new_tokens=3, top_k=1.5), TypeError, "top_k must be an integer"),
    (dict(prompt_ids=[1, 11], max_new_tokens=3), ValueError,
     r"prompt_ids out of range: found id 11, .*vocabulary has 11 entries"),
    (dict(prompt_ids=[-1], max_new_tokens=3), ValueError, "prompt_ids out of range: found id -1"),
    (dict(prompt_ids=np.ones((1, 1, 2), np.int64), max_new_tokens=3), ValueError,
     r"prompt_ids must be one sequence .* or a batch .* shape \(1, 1, 2\)"),
    (dict(prompt_ids=[1.5], max_new_tokens=3), TypeError, "prompt_ids must hold integer"),
    (dict(prompt_ids=np.zeros(0, np.int64), max_new_tokens=3), ValueError,
     "prompt of at least one token"),
])
def test_generate_rejects_bad_arguments_naming_them(kwargs, error, match):
    with using_backend("numpy", "float64"):
        model = random_lm(block_size=5)
        with pytest.raises(error, match=match):
            generate(model, **kwargs)


def test_generate_accepts_any_one_dimensional_prompt_and_zero_new_tokens():
    with using_backend("numpy", "float64"):
        model = random_lm(seed=52, block_size=5)
        expected = generate(model, [1, 2, 3], 4, greedy=True)
        for prompt in ((1, 2, 3), np.array([1, 2, 3]), dev([1, 2, 3]), np.array([1, 2, 3],
                                                                              np.int32)):
            assert generate(model, prompt, 4, greedy=True) == expected
        assert generate(model, np.array([4, 5]), 0) == [4, 5]
        assert generate(model, [4, 5], 0, greedy=True) == [4, 5]


# =========================================================================== batched generation
def test_batched_greedy_rows_equal_each_prompt_alone_beyond_block_size():
    """Prompts of different lengths (one longer than the context) decoded together, far
    past block_size (the window slides): each row is what its prompt alone gives, with
    the rows given as a list or as a left-padded array with its attention mask."""
    with using_backend("numpy", "float64"):
        model = random_lm(seed=60, block_size=6)
        rng = np.random.default_rng(8)
        prompts = [rng.integers(0, 11, n).tolist() for n in (1, 4, 6, 9, 2)]
        batch = generate(model, prompts, 14, greedy=True)
        assert batch == [generate(model, p, 14, greedy=True) for p in prompts]
        assert batch[3] == reference_generate(model, prompts[3], 14)
        width = max(map(len, prompts))
        ids = np.zeros((len(prompts), width), np.int64)
        mask = np.zeros((len(prompts), width), np.int64)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
        assert generate(model, ids, 14, greedy=True, attention_mask=mask) == batch
        assert generate(model, dev(ids), 14, greedy=True, attention_mask=dev(mask)) == batch


def test_a_row_ends_at_the_end_of_text_id_and_leaves_the_batch():
    with using_backend("numpy", "float64"):
        model = random_lm(seed=61, block_size=8)
        prompts = [[1, 2, 3], [4], [5, 6]]
        free = generate(model, prompts, 6, greedy=True)
        eos = free[0][3]  # row 0's first new token
        got = generate(model, prompts, 6, greedy=True, eos_id=eos)
        assert got[0] == prompts[0] + [eos]
        for row, (p, f) in enumerate(zip(prompts, free)):
            tail = f[len(p):]
            end = tail.index(eos) + 1 if eos in tail else len(tail)
            assert got[row] == p + tail[:end], row


def test_sampling_is_reproducible_with_the_seed_and_varies_without_it():
    with using_backend("numpy", "float64"):
        model = random_lm(seed=62, block_size=8)
        prompts = [[1], [2, 3, 4]]
        a = generate(model, prompts, 10, temperature=1.5, rng=np.random.default_rng(3))
        b = generate(model, prompts, 10, temperature=1.5, rng=np.random.default_rng(3))
        c = generate(model, prompts, 10, temperature=1.5, rng=np.random.default_rng(4))
        assert a == b and a != c


def brute_force_nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose total reaches top_p (ties: lowest id)."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    kept, total = set(), 0.0
    for i in order:
        kept.add(i)
        total += probs[i]
        if total >= top_p:
            break
    return kept


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("top_k", [None, 1, 4])
@pytest.mark.parametrize("top_p", [None, 0.3, 0.9, 1.0])
def test_the_sampling_distribution_is_its_definition(temperature, top_k, top_p):
    """temperature, then the top_k largest, then the nucleus of mass top_p, renormalized
    (HF's order), against each definition written out."""
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((5, 12)) * 2
    got = sampling_distribution(logits, temperature, top_k, top_p)
    for row, z in enumerate(logits):
        p = np.exp(z / temperature - np.max(z / temperature))
        if top_k is not None:
            p[np.argsort(-z)[top_k:]] = 0.0
        p /= p.sum()
        if top_p is not None:
            keep = brute_force_nucleus(p, top_p)
            p = np.array([p[i] if i in keep else 0.0 for i in range(len(p))])
            p /= p.sum()
        np.testing.assert_allclose(got[row], p, rtol=1e-12, atol=1e-15)
        assert (got[row] > 0).sum() >= 1


def test_draws_follow_the_distribution():
    """sample() over many rows of one distribution: each token's frequency within five
    standard deviations of its probability; zero-probability tokens never drawn."""
    probs = np.array([0.5, 0.0, 0.2, 0.25, 0.0, 0.05])
    n = 40000
    draws = sample(np.tile(probs, (n, 1)), np.random.default_rng(10))
    frequency = np.bincount(draws, minlength=probs.size) / n
    sigma = np.sqrt(probs * (1 - probs) / n)
    assert np.all(np.abs(frequency - probs) <= 5 * sigma + 1e-12), frequency
    assert frequency[1] == frequency[4] == 0.0


def test_generate_samples_from_the_models_distribution():
    """One new token for 6000 copies of one prompt (one batch): its frequencies follow the
    model's next-token distribution under temperature, top-k and top-p."""
    with using_backend("numpy", "float64"):
        model = random_lm(seed=63, block_size=8)
        prompt = [3, 1, 4]
        model.eval()
        with no_grad():
            logits = backend.to_numpy(model(dev([prompt])))[0, -1]
        model.train()
        expected = sampling_distribution(logits[None], 0.8, 6, 0.85)[0]
        n = 6000
        rows = generate(model, [prompt] * n, 1, temperature=0.8, top_k=6, top_p=0.85,
                        rng=np.random.default_rng(11))
        frequency = np.bincount([row[-1] for row in rows], minlength=expected.size) / n
        sigma = np.sqrt(expected * (1 - expected) / n)
        assert np.all(np.abs(frequency - expected) <= 5 * sigma + 1e-12)
        assert np.all(frequency[expected == 0] == 0)
        assert (expected > 0).sum() > 1


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(top_p=0.0), ValueError, "top_p must be a finite number > 0, got 0.0"),
    (dict(top_p=1.5), ValueError, "top_p must be a probability in \\(0, 1\\], got 1.5"),
    (dict(top_p=float("nan")), ValueError, "top_p must be a finite number > 0, got nan"),
    (dict(eos_id=11), ValueError, "eos_id 11 is outside the vocabulary of 11"),
    (dict(eos_id=-1), ValueError, "eos_id must be at least 0"),
    (dict(prompt_ids=[[1, 2], []]), ValueError, "prompt_ids row 1 is empty"),
    (dict(prompt_ids=[[1, 2], [3, 11]]), ValueError, "prompt_ids row 1 out of range"),
    (dict(prompt_ids=[[1, 2], [3]], attention_mask=[[1, 1], [0, 1]]), ValueError,
     "a list of prompts of their own lengths has none"),
    (dict(prompt_ids=np.ones((2, 3), np.int64), attention_mask=[[1, 1, 1]]), ValueError,
     "attention_mask must have shape \\(2, 3\\)"),
    (dict(prompt_ids=[1, 2], attention_mask=[1, 1]), ValueError, "not of one sequence"),
])
def test_batched_generation_rejects_bad_arguments_naming_them(kwargs, error, match):
    with using_backend("numpy", "float64"):
        model = random_lm(block_size=5)
        kwargs = {"prompt_ids": [[1, 2], [3]], "max_new_tokens": 2, **kwargs}
        with pytest.raises(error, match=match):
            generate(model, **kwargs)


@pytest.mark.parametrize("greedy", ["no", "yes", 0, 1, None, "False"])
def test_a_switch_that_is_not_a_bool_is_refused(greedy):
    """issue 47 case 4: generate(greedy="no") decoded greedily (a truthy string).  A switch
    takes True or False (NumPy's too), nothing else."""
    with using_backend("numpy", "float64"):
        model = random_lm(seed=3, block_size=5)
        with pytest.raises(TypeError, match=f"greedy must be True or False, got {greedy!r}"):
            generate(model, [1, 2], 3, greedy=greedy)
        assert generate(model, [1, 2], 3, greedy=np.True_) == \
            generate(model, [1, 2], 3, greedy=True)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(top_k=0), ValueError, "top_k must be at least 1, got 0"),
    (dict(top_k=-2), ValueError, "top_k must be at least 1, got -2"),
    (dict(top_k=2.0), TypeError, "top_k must be an integer or None, got 2.0"),
    (dict(top_k=True), TypeError, "top_k must be an integer or None, got True"),
    (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0"),
    (dict(temperature="1"), TypeError, "temperature must be a real number"),
    (dict(top_p=0.0), ValueError, "top_p must be a finite number > 0"),
    (dict(top_p=1.5), ValueError, "top_p must be a probability in \\(0, 1\\]"),
    (dict(log_p=np.zeros(4)), ValueError, "log_p must have shape \\(rows, vocabulary\\)"),
    (dict(log_p=np.zeros((2, 0))), ValueError, "log_p must have shape"),
    (dict(log_p="abc"), TypeError, "log_p must be an array of log-probabilities"),
    (dict(log_p=np.array([[0.0, 0.0], [np.nan, 0.0]])), ValueError, "log_p row 1 holds NaN"),
    (dict(log_p=np.full((1, 3), -np.inf)), ValueError, "log_p row 0 .* no finite value"),
])
def test_sampling_distribution_refuses_bad_options_naming_them(kwargs, error, match):
    """issue 47 case 13: sampling_distribution(..., top_k=0) raised a broadcasting error.
    top_k=0 is refused as generate refuses it, and as transformers' TopKLogitsWarper does
    ("`top_k` has to be a strictly positive integer"; transformers' generate reads 0 as
    "no top-k", which is None here)."""
    kwargs = {"log_p": np.log(np.full((2, 4), 0.25)), **kwargs}
    with pytest.raises(error, match=match):
        sampling_distribution(**kwargs)
    assert np.allclose(sampling_distribution(np.log(np.full((2, 4), 0.25)), top_k=np.int64(4)),
                       0.25)


def test_a_decoding_step_without_padding_attends_without_a_mask():
    """``decoder_mask``: one new position and no padding hide nothing, so no mask (None) is
    built; a longer step, or one with padding, gets the causal (and padding) mask."""
    from npformer.models.common import decoder_mask

    like = np.zeros((1, 1), dtype=np.float32)
    assert decoder_mask(None, 1, 9, like) is None
    causal = decoder_mask(None, 2, 9, like)
    assert causal.shape == (2, 9) and not causal[0, -1] and causal[1].all()
    keep = np.array([[False, True, True]])
    padded = decoder_mask(keep, 1, 3, like)
    assert padded.shape == (1, 1, 1, 3) and padded.tolist() == [[[[False, True, True]]]]


def test_the_fast_kv_cache_appends_without_copying_what_it_holds():
    """The fast tier's cache: keys and values appended step by step read back as their
    concatenation (the textbook cache's), after a select too; an append within the
    buffer's room writes the new position only (the cached ones stay where they are: the
    buffer is the same array).  The fast models' caches are made of it."""
    from npformer import fast, nn
    from npformer.fast.cache import KVCache
    from npformer.models import CausalLM

    config = CausalLMConfig(vocab_size=11, block_size=8, d_model=8, num_heads=2,
                            num_layers=2, d_ff=16)
    assert type(fast.CausalLM(config).new_cache().blocks[0].self_attn) is KVCache
    assert type(CausalLM(config).new_cache().blocks[0].self_attn) is nn.KVCache

    rng = np.random.default_rng(0)
    steps = [rng.normal(size=(3, 2, t, 4)) for t in (5, 1, 1, 1, 7, 1)]
    values = [-s for s in steps]
    cache = KVCache()
    buffers = []
    for k, v in zip(steps, values):
        cache.append(backend.asarray(k), backend.asarray(v))
        buffers.append(cache._keys)
        held = sum(s.shape[2] for s in steps[:len(buffers)])
        assert cache.length == held
        np.testing.assert_array_equal(backend.to_numpy(cache.keys),
                                      np.concatenate(steps[:len(buffers)], axis=2))
        np.testing.assert_array_equal(backend.to_numpy(cache.values),
                                      np.concatenate(values[:len(buffers)], axis=2))
    assert buffers[1] is buffers[2] is buffers[3]  # room for them: 2 x 6 positions
    cache.select(backend.asarray(np.array([2, 0, 0])))
    cache.append(backend.asarray(steps[0][:, :, :1]), backend.asarray(values[0][:, :, :1]))
    expected = np.concatenate([np.concatenate(steps, axis=2)[[2, 0, 0]], steps[0][:, :, :1]],
                              axis=2)
    np.testing.assert_array_equal(backend.to_numpy(cache.keys), expected)
