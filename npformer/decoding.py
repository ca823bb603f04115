"""Decoding: greedy and beam search for the seq2seq model, sampling for the language model.

All of it runs under :func:`npformer.no_grad` with key/value caches: each step
feeds only the newest token; decoder self-attention appends one key/value per
layer, cross-attention keys/values are computed once from the encoder memory.
Token choice happens on the host (NumPy): it is a handful of numbers per step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import backend, ops
from .nn import evaluating


def _last_log_probs(logits) -> np.ndarray:
    """logits (B, T, V) -> log-probabilities of the last position, on the host (B, V)."""
    log_p, _ = ops.log_softmax_forward(logits[:, -1, :], axis=-1)
    return backend.to_numpy(log_p).astype(np.float64)


def _strip(ids, eos_id: int) -> list[int]:
    out = []
    for token in ids:
        if token == eos_id:
            break
        out.append(int(token))
    return out


# --------------------------------------------------------------------------- seq2seq
def greedy_decode(model, src, src_lens=None, max_len: int = 50) -> list[list[int]]:
    """src (B, S) -> B target id lists (without <bos>/<eos>), the most likely token each step."""
    c = model.config
    with evaluating(model):
        memory, memory_mask = model.encode(src, src_lens)
        states = model.new_cache()
        batch = src.shape[0]
        tokens = np.full((batch, 1), c.bos_id, dtype=np.int64)
        outputs = np.zeros((batch, 0), dtype=np.int64)
        done = np.zeros(batch, dtype=bool)
        for position in range(min(max_len, c.max_len)):
            logits = model.forward_cached(backend.asarray(tokens), memory, memory_mask, states)
            next_ids = np.argmax(_last_log_probs(logits), axis=-1)  # (B,)
            next_ids = np.where(done, c.eos_id, next_ids)
            outputs = np.concatenate([outputs, next_ids[:, None]], axis=1)
            done |= next_ids == c.eos_id
            if done.all():
                break
            tokens = next_ids[:, None]
    return [_strip(row, c.eos_id) for row in outputs]


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's ((5 + |Y|) / 6)^alpha: alpha 0 ranks by total log-probability."""
    return ((5.0 + length) / 6.0) ** alpha


@dataclass
class _Beam:
    tokens: list[int]
    score: float  # total log-probability


def _reorder_states(states, index):
    """Select rows ``index`` (beam origins) of every cached key/value tensor."""
    states.select(index)


def beam_search(model, src, src_lens=None, beam_size: int = 4, max_len: int = 50,
                alpha: float = 0.6) -> list[list[int]]:
    """src (B, S) -> B target id lists: the best finished hypothesis of each beam search,
    ranked by log-probability / length_penalty(length, alpha).  A hypothesis ends when it
    emits <eos>; the search for a sentence stops once no open hypothesis can still beat the
    best ended one, or once ``beam_size`` have ended and no open one beats the best at its
    current length (see :func:`_search_done`; beam size 1 is exactly greedy decoding)."""
    if beam_size < 1:
        raise ValueError(f"beam_size must be at least 1, got {beam_size}")
    return [_beam_search_one(model, src[i:i + 1],
                             None if src_lens is None else src_lens[i:i + 1],
                             beam_size, max_len, alpha)
            for i in range(src.shape[0])]


def _beam_search_one(model, src, src_lens, k: int, max_len: int, alpha: float) -> list[int]:
    c = model.config
    with evaluating(model):
        memory, memory_mask = model.encode(src, src_lens)  # (1, S, D)
        states = model.new_cache()
        beams = [_Beam([], 0.0)]
        finished: list[tuple[float, list[int]]] = []
        xp = backend.namespace_of(memory)
        for position in range(min(max_len, c.max_len)):
            rows = backend.asarray(np.zeros(len(beams), dtype=np.int64))
            last = np.array([[b.tokens[-1] if b.tokens else c.bos_id] for b in beams])
            logits = model.forward_cached(backend.asarray(last), xp.take(memory, rows, axis=0),
                                          memory_mask, states)
            log_p = _last_log_probs(logits)  # (beams, V)
            totals = np.array([b.score for b in beams])[:, None] + log_p  # (beams, V)
            order = np.argsort(-totals, axis=None, kind="stable")[: 2 * k]
            survivors, origins = [], []
            for flat in order:
                origin, token = divmod(int(flat), totals.shape[1])
                candidate = _Beam(beams[origin].tokens + [token], float(totals.flat[flat]))
                if token == c.eos_id:
                    length = len(candidate.tokens)
                    finished.append((candidate.score / length_penalty(length, alpha),
                                     candidate.tokens[:-1]))
                else:
                    survivors.append(candidate)
                    origins.append(origin)
                if len(survivors) == k:
                    break
            if not survivors or _search_done(finished, survivors, k, position + 1,
                                             min(max_len, c.max_len), alpha):
                break
            beams = survivors
            _reorder_states(states, backend.asarray(np.array(origins, dtype=np.int64)))
        if not finished:  # ran out of length: rank the open hypotheses the same way
            finished = [(b.score / length_penalty(len(b.tokens), alpha), b.tokens) for b in beams]
    return max(finished, key=lambda f: f[0])[1]


def _search_done(finished, open_beams, k: int, length: int, max_length: int,
                 alpha: float) -> bool:
    """Whether beam search can stop: the best ended hypothesis scores at least what any open
    one could still reach (totals only fall as tokens are added, so an open total s is
    worth at most s / length_penalty(max_length) for alpha >= 0), or ``k`` have ended and
    the best of them beats every open hypothesis at its current ``length``.  (Stopping as
    soon as ``k`` have ended, whatever their scores, can drop a far better open hypothesis,
    greedy's among them.)"""
    if not finished:
        return False
    best_done = max(score for score, _ in finished)
    best_open = max(b.score for b in open_beams)  # total log-probability, <= 0
    if best_done >= best_open / length_penalty(max_length, alpha):
        return True
    return len(finished) >= k and best_done >= best_open / length_penalty(length, alpha)


# --------------------------------------------------------------------------- language model
def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, greedy: bool = False,
             rng: np.random.Generator | None = None) -> list[int]:
    """Continue ``prompt_ids`` (a list of ids, at least one) by ``max_new_tokens`` tokens.

    Each step samples from softmax(logits / temperature), restricted to the ``top_k``
    most likely tokens if given, or takes the argmax when ``greedy``.  Past the
    model's block size the context is the last block_size tokens (re-encoded).
    """
    if len(prompt_ids) == 0:
        raise ValueError("generation needs a prompt of at least one token")
    if temperature <= 0 and not greedy:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1 (or None for no limit), got {top_k}")
    rng = rng or np.random.default_rng(0)
    block = model.config.block_size
    ids = [int(t) for t in prompt_ids]
    with evaluating(model):
        states, offset = model.new_cache(), 0
        pending = ids[-block:]
        for _ in range(max_new_tokens):
            if offset + len(pending) > block:  # window full: restart the cache on the tail
                states, offset, pending = model.new_cache(), 0, ids[-block:]
            logits = model.forward_cached(backend.asarray(np.array([pending], dtype=np.int64)), states)
            offset += len(pending)
            log_p = _last_log_probs(logits)[0]  # (V,)
            next_id = int(np.argmax(log_p)) if greedy else _sample(log_p, temperature, top_k, rng)
            ids.append(next_id)
            pending = [next_id]
    return ids


def _sample(log_p: np.ndarray, temperature: float, top_k: int | None,
            rng: np.random.Generator) -> int:
    scaled = log_p / temperature
    if top_k is not None and top_k < scaled.size:
        cutoff = np.sort(scaled)[-top_k]
        scaled = np.where(scaled < cutoff, -math.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))
