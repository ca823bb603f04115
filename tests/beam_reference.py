"""The per-sentence beam search: npformer's original implementation, which searched one
sentence at a time, kept here as the oracle that the batched
:func:`npformer.decoding.beam_search` is tested against (tests/test_beam_batched.py).

It shares the batched search's building blocks (the source checks, the length penalty,
the stopping rule, the cache reordering), so the two can differ only in how the
hypotheses of several sentences are laid out side by side.
"""
from __future__ import annotations

import numpy as np

from npformer import backend
from npformer.decoding import (
    _Beam,
    _check_beam_arguments,
    _last_log_probs,
    _reorder_states,
    _search_done,
    _source,
    length_penalty,
)
from npformer.nn import evaluating


def _beam_search_reference(model, src, src_lens=None, beam_size: int = 4, max_len: int = 50,
                           alpha: float = 0.6) -> list[list[int]]:
    """The same search, one sentence at a time: the original implementation, kept as the
    oracle that :func:`npformer.decoding.beam_search` (all sentences at once) is tested
    against."""
    k, max_len, alpha = _check_beam_arguments(beam_size, max_len, alpha)
    src, src_lens = _source(model, src, src_lens)
    return [_beam_search_one(model, src[i:i + 1],
                             None if src_lens is None else src_lens[i:i + 1],
                             k, max_len, alpha)
            for i in range(src.shape[0])]


def _beam_search_one(model, src, src_lens, k: int, max_len: int, alpha: float) -> list[int]:
    c = model.config
    with evaluating(model):
        memory, memory_mask = model.encode(src, src_lens)  # (1, S, D)
        states = model.new_cache()
        beams = [_Beam([], 0.0)]
        finished: list[tuple[float, list[int]]] = []
        xp = backend.namespace_of(memory)
        for position in range(min(max_len, c.block_size)):
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
                                             min(max_len, c.block_size), alpha):
                break
            beams = survivors
            _reorder_states(states, backend.asarray(np.array(origins, dtype=np.int64)))
        if not finished:  # ran out of length: rank the open hypotheses the same way
            finished = [(b.score / length_penalty(len(b.tokens), alpha), b.tokens) for b in beams]
    return max(finished, key=lambda f: f[0])[1]
