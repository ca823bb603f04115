"""Decoding: greedy and beam search for the seq2seq model; the language model's batched
generation (greedy, or sampling with temperature, top-k and top-p).

All of it runs under :func:`npformer.no_grad` with key/value caches: each step
feeds only the newest token; decoder self-attention appends one key/value per
layer, cross-attention keys/values are computed once from the encoder memory.
Token choice happens on the host (NumPy): it is a handful of numbers per step.

Beam search decodes a whole batch at once: the open hypotheses of every sentence
are rows of one decoder batch, so each position costs one ``forward_cached`` call for all
of them, and a sentence whose search is over leaves the batch (its rows of the
caches and of the encoder memory are dropped), so the batch shrinks as sentences
finish.  The language model's :func:`generate` decodes its prompts together likewise
(left-padded, the padding masked), a row leaving the batch at its end-of-text token.
Every row selection goes through :func:`_reorder_states`.

Arguments are checked before any work: token ids (arrays of any backend, NumPy
arrays or nested lists) must be integers inside the vocabulary, counts integers
in range, temperatures and the length penalty finite.  An empty batch decodes to
``[]``; a source with no tokens is refused (there is nothing to attend to).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import backend, ops
from .backend import Array
from .models.common import attention_mask_input, valid_lengths_from
from .nn import Module, evaluating
from .ops.contracts import check_flag, check_real, check_size, check_token_ids


def _last_log_probs(logits) -> np.ndarray:
    """logits (B, T, V) -> log-probabilities of the last position, on the host (B, V)."""
    log_p, _ = ops.log_softmax_forward(logits[:, -1, :], axis=-1)
    return backend.to_numpy(log_p).astype(np.float64)


def _argmax_last(logits: Array) -> Array:
    """logits (R, T, V) -> (R,): each row's most likely token at its last position (the
    first of equal ones)."""
    xp = backend.namespace_of(logits)
    return xp.argmax(logits[:, -1, :], axis=-1)


def _strip(ids, eos_id: int) -> list[int]:
    out = []
    for token in ids:
        if token == eos_id:
            break
        out.append(int(token))
    return out


def _source(model, src, src_lens):
    """Checked source ids -> (src (B, S), src_lens (B,) or None) on the backend (the rule:
    :func:`source_ids`)."""
    c = model.config
    host, lengths = source_ids(src, src_lens, c.src_vocab_size, c.pad_id)
    return backend.asarray(host), None if lengths is None else backend.asarray(lengths)


# --------------------------------------------------------------------------- seq2seq
def greedy_decode(model: Module, src: Array | Sequence[Sequence[int]],
                  src_lens: Array | None = None, max_len: int = 50) -> list[list[int]]:
    """src (B, S) -> B target id lists (without <bos>/<eos>), the most likely token each step.

    At most ``min(max_len, config.block_size)`` tokens each (``max_len`` 0 gives empty lists);
    an empty batch gives ``[]``."""
    check_model_kind(model, "seq2seq", "greedy_decode")
    max_len = check_size(max_len, "max_len", 0)
    src, src_lens = _source(model, src, src_lens)
    c = model.config
    batch = src.shape[0]
    if batch == 0:
        return []
    with evaluating(model):
        memory, memory_mask = model.encode(src, src_lens)
        states = model.new_cache()
        tokens = np.full((batch, 1), c.bos_id, dtype=np.int64)
        outputs = np.zeros((batch, 0), dtype=np.int64)
        done = np.zeros(batch, dtype=bool)
        for _ in range(min(max_len, c.block_size)):
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


@dataclass
class _Search:
    """One sentence's beam search: its open hypotheses, which are its rows of the decoder
    batch in this order, and the (score / length penalty, tokens) of those that ended."""
    beams: list[_Beam] = field(default_factory=lambda: [_Beam([], 0.0)])
    finished: list[tuple[float, list[int]]] = field(default_factory=list)

    def best(self, alpha: float) -> list[int]:
        """The best ended hypothesis; if none ended (length limit), the best open one."""
        finished = self.finished or [(b.score / length_penalty(len(b.tokens), alpha), b.tokens)
                                     for b in self.beams]
        return max(finished, key=lambda f: f[0])[1]


def _reorder_states(states, index, *batch_arrays):
    """Keep rows ``index`` (R_new,) of the decoder batch: row i of the new batch is row
    ``index[i]`` of the old one (a beam's origin; rows of finished sentences are left out).

    Applies to every cached key/value tensor of ``states`` (in place) and to each of
    ``batch_arrays`` (the encoder memory and its mask, batch first), returned in order.
    The one place where decoding selects, reorders or drops rows."""
    states.select(index)  # the DecodingCache reorders every layer's keys and values
    return tuple(backend.namespace_of(a).take(a, index, axis=0) for a in batch_arrays)


def _check_beam_arguments(beam_size, max_len, alpha) -> tuple[int, int, float]:
    return (check_size(beam_size, "beam_size", 1), check_size(max_len, "max_len", 0),
            check_real(alpha, "alpha", 0.0))


def beam_search(model: Module, src: Array | Sequence[Sequence[int]], src_lens: Array | None = None,
                beam_size: int = 4, max_len: int = 50, alpha: float = 0.6) -> list[list[int]]:
    """src (B, S) -> B target id lists: the best finished hypothesis of each beam search,
    ranked by log-probability / length_penalty(length, alpha).

    Each step, a sentence's open hypotheses (at most ``beam_size``) are extended by every
    token, and the ``2 * beam_size`` best continuations by total log-probability (ties:
    lowest hypothesis, then lowest token id) are taken in order: one ending in <eos> ends
    that hypothesis, the others stay open until ``beam_size`` are.  A sentence's search
    stops once no open hypothesis can still beat the best ended one, or once ``beam_size``
    have ended and no open one beats the best at its current length (see
    :func:`_search_done`; beam size 1 is exactly greedy decoding), or at
    ``min(max_len, config.block_size)`` tokens, where the best open one is taken if none ended.
    ``alpha`` >= 0 (the stopping rule's bound needs it); an empty batch gives ``[]``.

    All sentences are decoded together (one cached decoder step per position for the
    open hypotheses of every sentence still searching); the result equals searching each
    sentence alone (``tests/beam_reference.py``, tests/test_beam_batched.py)."""
    check_model_kind(model, "seq2seq", "beam_search")
    k, max_len, alpha = _check_beam_arguments(beam_size, max_len, alpha)
    src, src_lens = _source(model, src, src_lens)
    c = model.config
    limit = min(max_len, c.block_size)
    searches = [_Search() for _ in range(src.shape[0])]
    if not searches:
        return []
    with evaluating(model):
        memory, memory_mask = model.encode(src, src_lens)  # (B, S, D), (B, 1, 1, S)
        states = model.new_cache()
        live = list(range(len(searches)))  # sentences still searching, in row order
        for position in range(limit):
            beams = [beam for i in live for beam in searches[i].beams]  # the R rows
            last = np.array([[b.tokens[-1] if b.tokens else c.bos_id] for b in beams])  # (R, 1)
            logits = model.forward_cached(backend.asarray(last), memory, memory_mask, states)
            scores = np.array([b.score for b in beams])  # (R,)
            totals = scores[:, None] + _last_log_probs(logits)  # (R, V)
            counts = [len(searches[i].beams) for i in live]
            ranked = _ranked_continuations(totals, counts, 2 * k)
            kept_rows, still_live, first = [], [], 0
            for i, n, continuations in zip(live, counts, ranked):
                origins = _extend(searches[i], continuations, totals[first:first + n], k,
                                  c.eos_id, alpha, position + 1, limit)
                if origins is not None:
                    still_live.append(i)
                    kept_rows.extend(first + origin for origin in origins)
                first += n
            live = still_live
            if not live:
                break
            index = backend.asarray(np.array(kept_rows, dtype=np.int64))
            memory, memory_mask = _reorder_states(states, index, memory, memory_mask)
    return [search.best(alpha) for search in searches]


def _ranked_continuations(totals: np.ndarray, counts: list[int], width: int) -> list:
    """totals (R, V) of the rows of consecutive sentences (``counts`` rows each) ->
    for each sentence its ``width`` best continuations, [(row within the sentence, token)],
    best first: by total descending, ties by the flat index row * V + token ascending
    (the order of a stable sort of the sentence's (rows, V) totals, flattened).

    A continuation among its sentence's ``width`` best is among its own row's ``width``
    best, so only entries at or above their row's width-th largest total are sorted."""
    rows, vocab = totals.shape
    keep = min(width, vocab)
    threshold = np.partition(totals, vocab - keep, axis=1)[:, vocab - keep]  # (R,)
    row, token = np.nonzero(totals >= threshold[:, None])  # row-major: tokens ascend
    starts = np.cumsum([0, *counts[:-1]])  # each sentence's first row
    sentence = np.repeat(np.arange(len(counts)), counts)[row]
    origin = row - starts[sentence]
    order = np.lexsort((origin * vocab + token, -totals[row, token], sentence))
    bounds = np.searchsorted(sentence[order], np.arange(len(counts) + 1))
    return [list(zip(origin[order[a:min(b, a + width)]].tolist(),
                     token[order[a:min(b, a + width)]].tolist()))
            for a, b in zip(bounds[:-1], bounds[1:])]


def _extend(search: _Search, continuations, totals: np.ndarray, k: int, eos_id: int,
            alpha: float, length: int, max_length: int):
    """Take ``continuations`` ((origin, token), best first) of ``search``'s open hypotheses,
    whose totals are ``totals`` (n, V), until ``k`` stay open.  -> the origins of the new
    open hypotheses (the rows to keep, in order), or None when the search is over."""
    survivors, origins = [], []
    for origin, token in continuations:
        candidate = _Beam(search.beams[origin].tokens + [token], float(totals[origin, token]))
        if token == eos_id:
            search.finished.append((candidate.score / length_penalty(len(candidate.tokens), alpha),
                                    candidate.tokens[:-1]))
        else:
            survivors.append(candidate)
            origins.append(origin)
        if len(survivors) == k:
            break
    if not survivors or _search_done(search.finished, survivors, k, length, max_length, alpha):
        return None
    search.beams = survivors
    return origins


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
def generate(model: Module, prompt_ids: Array | Sequence, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, greedy: bool = False,
             rng: np.random.Generator | None = None, top_p: float | None = None,
             eos_id: int | Sequence[int] | None = None,
             attention_mask: Array | Sequence | None = None
             ) -> list[int] | list[list[int]]:
    """Continue a prompt, or a batch of prompts together, by up to ``max_new_tokens``
    tokens each -> prompt + continuation: a list for one prompt, a list of such lists
    for a batch (each row's prompt without its padding).

    ``prompt_ids``: one sequence of at least one id (a list, a 1-D array), or a batch:
    a list of sequences of any lengths, or a (B, T) array whose padding
    ``attention_mask`` (B, T) marks with 0 (left padding, as Hugging Face passes it; a
    row's tokens are those marked 1).  The rows are left-padded and decoded together,
    one cached step for all of them per new token (:meth:`CausalLM.forward_cached`, the
    padding masked, positions counted over each row's tokens), so each row gets the
    tokens that its prompt alone would give.

    Each step a row takes the argmax when ``greedy``, else a sample from
    :func:`sampling_distribution` (softmax(logits / temperature), restricted to the
    ``top_k`` most likely tokens, then to the nucleus of probability ``top_p``), drawn
    with ``rng`` (default ``np.random.default_rng(0)``: the same generator state gives
    the same tokens).  A row that produces ``eos_id`` ends there (the eos id is its last
    token) and leaves the batch; ``eos_id`` may list several ids (Llama 3's
    ``[128001, 128009]``, a tokenizer's ``eos_id`` read from such a config.json), any of
    which ends a row.  Past the model's block size a row's context is its last
    block_size tokens (re-encoded), as is a longer prompt's.
    """
    check_model_kind(model, CAUSAL_LM_KINDS, "generate")
    vocab_size, block_size = model.config.vocab_size, model.config.block_size
    prompts, single = _prompt_rows(prompt_ids, attention_mask, vocab_size)
    max_new_tokens = check_size(max_new_tokens, "max_new_tokens", 0)
    greedy = check_flag(greedy, "greedy")  # a temperature is not read when greedy:
    temperature, top_k, top_p = check_sampling(1.0 if greedy else temperature, top_k, top_p)
    ends = _eos_ids(eos_id, vocab_size)
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)) "
                        f"or None, got {rng!r} ({type(rng).__name__})")
    rng = rng or np.random.default_rng(0)
    rows = [list(prompt) for prompt in prompts]  # each row's tokens: prompt, then new ones
    live = list(range(len(rows)))  # the rows still decoding, in the batch's order
    with evaluating(model):
        states, keep = None, None  # the cache and its (R, S) mask: True at tokens
        for _ in range(max_new_tokens):
            if not live:
                break
            if states is None or keep.shape[1] + 1 > block_size:  # (re)start the window:
                pending, keep = _left_padded([rows[b][-block_size:] for b in live])  # (R, W)
                states = model.new_cache()  # each row's last block_size tokens, encoded
            else:
                pending = np.array([[rows[b][-1]] for b in live], dtype=np.int64)  # (R, 1)
                keep = np.concatenate([keep, np.ones((len(live), 1), dtype=bool)], axis=1)
            mask = None if keep.all() else backend.asarray(keep)  # (R, S); no padding: none
            logits = model.forward_cached(backend.asarray(pending), states, attention_mask=mask)
            if greedy:  # the most likely token: log-softmax keeps the logits' order
                next_ids = backend.to_numpy(_argmax_last(logits))  # (R,)
            else:
                log_p = _last_log_probs(logits)  # (R, V)
                next_ids = sample(sampling_distribution(log_p, temperature, top_k, top_p), rng)
            for b, token in zip(live, next_ids.tolist()):
                rows[b].append(int(token))
            going = [i for i, b in enumerate(live) if rows[b][-1] not in ends]
            if len(going) < len(live):  # rows that ended leave the batch and the caches
                _reorder_states(states, backend.asarray(np.array(going, dtype=np.int64)))
                keep, live = keep[going], [live[i] for i in going]
    return rows[0] if single else rows


def _eos_ids(eos_id: Any, vocab_size: int) -> frozenset[int]:
    """generate's ``eos_id``: None, an id, or a non-empty list (tuple, 1-D array) of ids,
    each in the vocabulary -> the set of ids that end a row."""
    if eos_id is None:
        return frozenset()
    if isinstance(eos_id, np.ndarray) and eos_id.ndim == 1:
        eos_id = eos_id.tolist()
    if isinstance(eos_id, (list, tuple)):
        if not eos_id:
            raise ValueError("eos_id must be an id or a non-empty list of ids, got "
                             f"{eos_id!r}")
        ids = [check_size(i, f"eos_id[{n}]", 0) for n, i in enumerate(eos_id)]
    else:
        ids = [check_size(eos_id, "eos_id", 0)]
    outside = [i for i in ids if i >= vocab_size]
    if outside:
        raise ValueError(f"eos_id {outside[0]} is outside the vocabulary of {vocab_size}")
    return frozenset(ids)


def _prompt_rows(prompt_ids: Any, attention_mask: Any, vocab_size: int
                 ) -> tuple[list[list[int]], bool]:
    """-> (each prompt's tokens, at least one each; whether one prompt was given, not a
    batch): one sequence, a list of sequences, or a (B, T) array with its mask."""
    if isinstance(prompt_ids, (list, tuple)) and prompt_ids and all(
            isinstance(row, (list, tuple)) or getattr(row, "ndim", 0) == 1
            for row in prompt_ids):  # a list of sequences: a batch of any lengths
        if attention_mask is not None:
            raise ValueError("attention_mask marks the padding of a (batch, positions) array "
                             "of prompts; a list of prompts of their own lengths has none")
        prompts = [host_token_ids(row, f"prompt_ids[{b}]", 1, "one sequence")
                   for b, row in enumerate(prompt_ids)]
        single = False
    else:
        single = getattr(prompt_ids, "ndim", 1) != 2
        host = host_token_ids(prompt_ids, "prompt_ids", 1 if single else 2,
                              "one sequence (a list or 1-D array) or a batch (a list of "
                              "sequences, or a 2-D array with its attention_mask)")
        if single and attention_mask is not None:
            raise ValueError("attention_mask marks the padding of a (batch, positions) array "
                             "of prompts, not of one sequence")
        keep = np.ones(host.shape, dtype=bool) if single or attention_mask is None else \
            backend.to_numpy(attention_mask_input(attention_mask, host.shape))
        prompts = [host] if single else [row[kept] for row, kept in zip(host, keep)]
    for b, prompt in enumerate(prompts):
        what = "prompt_ids" if single else f"prompt_ids row {b}"
        if prompt.size == 0:
            raise ValueError(f"generation needs a prompt of at least one token ({what} is "
                             "empty)")
        check_token_ids(prompt, vocab_size, what)
    return [prompt.tolist() for prompt in prompts], single


def _left_padded(contexts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of different lengths -> ids (R, W) and keep (R, W) (True at tokens), each row
    at the right end (left padding; the padding id 0 is masked, never read)."""
    width = max(len(row) for row in contexts)
    ids = np.zeros((len(contexts), width), dtype=np.int64)
    keep = np.zeros((len(contexts), width), dtype=bool)
    for r, row in enumerate(contexts):
        ids[r, width - len(row):], keep[r, width - len(row):] = row, True
    return ids, keep


def sampling_distribution(log_p: np.ndarray, temperature: float = 1.0,
                          top_k: int | None = None, top_p: float | None = None) -> np.ndarray:
    """log-probabilities (or logits) (R, V) -> the distributions (R, V) sampling draws
    from, each row summing to 1:

    * temperature: p proportional to exp(log_p / temperature);
    * top_k: only the k largest stay (ties with the k-th stay too), renormalized;
    * top_p (nucleus, Holtzman et al., 2020): of those, the most likely tokens, in order,
      until their total reaches top_p: a token stays when the tokens before it hold less
      than top_p (so at least one stays), renormalized.

    The order is Hugging Face's (temperature, then top-k, then top-p).  ``top_k`` None
    keeps every token; 0 is refused, as Hugging Face's ``TopKLogitsWarper`` refuses it
    (its ``generate`` reads 0 as None: pass None here)."""
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    log_p = _rows_of_scores(log_p)
    # Shifted by the max before dividing: a tiny temperature sends the others to -inf
    # and the best to exactly 0 (the argmax, its limit), never to NaN.
    with np.errstate(over="ignore"):  # overflowing to -inf is that limit
        scaled = (log_p - log_p.max(axis=-1, keepdims=True)) / temperature  # (R, V)
    if top_k is not None and top_k < scaled.shape[-1]:
        cutoff = -np.sort(-scaled, axis=-1)[:, top_k - 1:top_k]  # (R, 1): the k-th largest
        scaled = np.where(scaled < cutoff, -math.inf, scaled)
    probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")  # most likely first
        ranked = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(ranked, axis=-1) - ranked  # the mass ranked above each token
        kept = np.zeros_like(probs, dtype=bool)
        np.put_along_axis(kept, order, before < top_p, axis=-1)
        probs = np.where(kept, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def check_sampling(temperature: Any, top_k: Any, top_p: Any
                   ) -> tuple[float, int | None, float | None]:
    """Sampling's options, checked: temperature > 0, top_k None or a count >= 1, top_p
    None or a probability in (0, 1]."""
    temperature = check_real(temperature, "temperature", 0.0, inclusive=False)
    top_k = check_size(top_k, "top_k", 1, optional=True)
    top_p = check_real(top_p, "top_p", 0.0, inclusive=False, optional=True)
    if top_p is not None and top_p > 1.0:
        raise ValueError(f"top_p must be a probability in (0, 1], got {top_p}")
    return temperature, top_k, top_p


def _rows_of_scores(log_p: Any) -> np.ndarray:
    """log_p as float64 rows (R, V) with V >= 1, refused naming it otherwise."""
    try:
        rows = np.asarray(backend.to_numpy(log_p) if hasattr(log_p, "shape") else log_p,
                          dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"log_p must be an array of log-probabilities (rows, vocabulary), got "
                        f"{type(log_p).__name__}") from None
    if rows.ndim != 2 or rows.shape[1] == 0:
        raise ValueError(f"log_p must have shape (rows, vocabulary) with a vocabulary of at "
                         f"least 1, got shape {rows.shape}")
    bad = np.isnan(rows).any(axis=-1) | np.isposinf(rows).any(axis=-1) | \
        np.isneginf(rows).all(axis=-1)
    if bad.any():
        raise ValueError(f"log_p row {int(np.argmax(bad))} holds NaN or +inf, or no finite "
                         "value (-inf marks a token that cannot be drawn; a row needs one "
                         "that can)")
    return rows


def sample(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of ``probs`` (R, V), drawn with one uniform number per row
    (inverse transform: the first token whose cumulative probability exceeds it)."""
    cumulative = np.cumsum(probs, axis=-1)
    cumulative /= cumulative[:, -1:]  # the last is 1 exactly: every draw lands on a token
    u = rng.random((probs.shape[0], 1))  # (R, 1) in [0, 1)
    return np.sum(cumulative <= u, axis=-1)  # (R,): the first index with cumulative > u


# --------------------------------------------------------------------------- decoding
CAUSAL_LM_KINDS = ("causal_lm", "llama")  # the models generate continues: CausalLM (GPT-2's
#   shape) and LlamaCausalLM, each with forward_cached and new_cache


def check_model_kind(model: Any, kind: str | tuple[str, ...], function: str) -> None:
    """The model ``function`` decodes with must be of ``kind`` (seq2seq), or of one of the
    kinds ``kind`` lists (the causal LMs)."""
    given = getattr(model, "kind", None)
    kinds = (kind,) if isinstance(kind, str) else kind
    if given not in kinds:
        what = f"a {given!r} model" if given else f"a {type(model).__name__}"
        use = {"seq2seq": "greedy_decode or beam_search", "causal_lm": "generate",
               "llama": "generate"}.get(given)
        wanted = "a 'seq2seq' model (Seq2SeqTransformer)" if kinds == ("seq2seq",) else \
            "a causal language model (CausalLM or LlamaCausalLM)"
        raise TypeError(f"{function} decodes with {wanted}, got "
                        f"{what}" + (f" (use {use} for it)" if use else ""))


def host_token_ids(ids: Any, name: str, rank: int, shape_words: str) -> np.ndarray:
    """``ids`` (an array of any backend, a NumPy array, nested lists) as a host int64 array
    of rank ``rank``; refused naming ``name`` if ragged, of another rank or not integers."""
    try:
        host = backend.to_numpy(ids)
        host = np.asarray(host)
    except (ValueError, TypeError) as exc:  # ragged lists, objects
        raise ValueError(f"{name} must be {shape_words} of integer token ids: {exc}") from None
    if host.ndim == 1 and host.size == 0 and rank == 2:  # [] : a batch of no sequences
        host = host.reshape(0, 0)
    if host.ndim != rank:
        raise ValueError(f"{name} must be {shape_words} of integer token ids, got an array of "
                         f"shape {host.shape}")
    if host.size and host.dtype.kind not in "iu":  # an empty list arrives as float64
        raise TypeError(f"{name} must hold integer token ids, got dtype {host.dtype}")
    return host.astype(np.int64)


def source_ids(src: Any, src_lens: Any, vocab_size: int, pad_id: int) -> tuple[Any, Any]:
    """A decoder's source batch, checked -> (src (B, S) int64, src_lens (B,) int64 or
    None), on the host.

    src: integer ids in [0, vocab_size), padding at the end; src_lens: the number of real
    tokens of each row, in [1, S] (without it, the non-padding tokens are counted).  Every
    source needs at least one token."""
    host = host_token_ids(src, "src", 2, "a (batch, positions) array")
    check_token_ids(host, vocab_size, "src")
    batch, positions = host.shape
    if src_lens is None:  # padding at the end only (refused elsewhere, naming where)
        lengths, given = valid_lengths_from(host, pad_id, "src"), None
        where = "src row {row} is all padding"
    else:
        lengths = given = host_token_ids(src_lens, "src_lens", 1, "a (batch,) array")
        if lengths.shape[0] != batch:
            raise ValueError(f"src_lens has {lengths.shape[0]} lengths for a batch of {batch} "
                             "source rows")
        if lengths.size and lengths.max() > positions:
            raise ValueError(f"src_lens holds length {lengths.max()}, longer than the "
                             f"{positions} positions of src")
        where = "src_lens[{row}] is 0"
    if batch and positions == 0:
        raise ValueError("src has 0 positions (axis 1): every source needs at least one token")
    empty = np.flatnonzero(lengths < 1)
    if empty.size:
        raise ValueError(where.format(row=int(empty[0])) + ": every source needs at least "
                         "one token (lengths must be in [1, positions])")
    return host, given
