r"""The fast tier's forward compiled whole where nothing is recorded: one kernel a block.

Under :func:`npformer.no_grad` (evaluation, prediction, a prompt's encoding before
decoding) a forward keeps nothing for a backward, so a block need not run as its layers,
each a Python call that saves its cache: it runs here as one compiled function (numba,
``nogil``), with no Python between its operations.  Thread replicas
(:func:`npformer.parallel.parallel_map`) then never wait on each other for the GIL.

Two kernels, each the textbook block's statements in its order, on rows (N, D):

* :func:`_encoder_block` (:class:`npformer.nn.EncoderBlock`, the GPT block with a causal
  mask; the classifier's and the seq2seq encoder's blocks): post-norm
  $y = \text{LN}_2(h + F(h))$, $h = \text{LN}_1(x + A(x))$, or pre-norm
  $h = x + A(\text{LN}_1(x))$, $y = h + F(\text{LN}_2(h))$; A multi-head attention
  (standard or narrow heads, optional query-key norm), F the feed-forward network (ReLU,
  GELU or its tanh form).
* :func:`_llama_block` (:class:`npformer.nn.LlamaBlock`): $h = x + A(N_1(x))$,
  $y = h + \text{SwiGLU}(N_2(h))$, RMS norms, grouped-query attention with rotary
  positions, optional q/k/v and output biases, optional QK-norm.

A causal LM's blocks and final norm run as one call (:func:`_encoder_stack`), so that
no Python runs between its blocks either: its whole forward, its prompt's encoding and
each decoding step (every block's keys and values then go into its cache).

Attention, :func:`_attend`, per sequence and head: $S = Q K^\top$ (one BLAS product),
each row scaled by $1/\sqrt{E}$, the masked keys at $-\infty$, the stable softmax (the
max, exp, a float64 sum), $P V$ (one product).  A row is computed up to its last
visible key (the causal future and end padding are never exponentiated); a query with
no visible key gets a zero output, as in the textbook op.  The products are
``np.dot`` inside the kernel: numba calls SciPy's BLAS (``scipy.linalg.cython_blas``),
which is loaded when this module is, so that the one-thread limit
(:func:`npformer.backend.single_threaded_blas`) finds it too.  The kernels run in that
limit: with SciPy's BLAS on every core, its threads (spinning for a while after each
product, as OpenBLAS's do) and NumPy's took the two cores from each other, and a small
model's decoding steps after its prompt's encoding ran at half speed.

Rows.  A padded batch (B, T, D) is B sequences of T rows; the fast models' packed rows
(:class:`npformer.fast.Packing`) are sequence b's first n_b positions, one after the
other.  ``starts`` (B + 1,) gives each sequence's first row: position t of sequence b is
row ``starts[b] + t``, and the mask (broadcasting to (B, H, T, S)) is read at (b, h, t, s).

When the fast blocks and the fast causal LM use them (:func:`encoder_block_forward`,
:func:`llama_block_forward`, :func:`encoder_stack_forward`): no gradient recorded, NumPy
float32 or float64 arrays of one dtype, no dropout (eval mode, or p = 0), the layers the
fast tier builds (not a LoRA adapter), no attention weights asked for, and no key/value
cache or an empty one (a prompt's encoding: the keys and values go into it) or, for the
encoder block and the stack, the fast tier's cache holding positions already (a decoding
step: the kernel attends over the cached keys and values where they lie, as
:func:`_attend_after` says, then the cache takes the step's); and where
the kernel pays: its products run on one core
(:func:`npformer.backend.single_threaded_blas`), so it runs inside thread replicas (whose
BLAS is on one thread anyway) and otherwise for small products only (:func:`_pays`: a
large model's prompt runs its layers, on every core, and so do its decoding steps, whose
weights one core reads from memory slower than two).  Otherwise, and for input holding
NaN or inf (the textbook's statements define what it gives), the block's usual path
runs.  Tested equal to the textbook blocks in
``tests/test_compiled_forward.py``.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..backend import Array, blas_on_one_thread, single_threaded_blas
from ..nn import BlockCache, DecodingCache, EncoderBlock, KVCache, LayerNorm, LlamaBlock, lora
from ..nn.module import grad_enabled
from . import activations, compiler, layernorm, rmsnorm, rotary, streaming, swiglu
from .activations import (
    gelu_forward32,
    gelu_forward64,
    gelu_tanh_forward32,
    gelu_tanh_forward64,
)
from .cache import KVCache as GrowingKVCache
from .compiler import COMPILED, jit
from .numerics import exp, max8, sum4
from .packing import Packing
from .streaming import MAX_ROWS, columns_into

ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2}  # the kernel's codes
STREAMED_WEIGHTS = 2 ** 18  # the largest W a block's few-row products stream (1 MiB float32)
FEW_QUERIES = 2  # a sequence's rows up to which attention takes its products by hand
CACHED_STEP_WEIGHTS = 2 ** 20  # a block's weights up to which a decoding step's kernel pays
ONE_CORE_WORK = 2 ** 24  # multiply-adds of a block's products up to which its kernel, on
#   one core, beats its layers on every core (GPT-2 small's block: 2 rows; the lm's: 85)
# the files of the kernels these call (their code is compiled into these kernels' cache)
CALLS = tuple(Path(m.__file__) for m in (activations, layernorm, rmsnorm, rotary, streaming,
                                          swiglu))
if COMPILED:  # numba's np.dot calls SciPy's BLAS: loaded now, before any thread limit is set
    import scipy.linalg.cython_blas  # noqa: F401


# =========================================================================== when it runs
def _plain(*layers) -> bool:
    """Whether the layers are the tier's own (a LoRA adapter adds a term the kernels lack)."""
    return not any(isinstance(layer, lora.LoRALinear) for layer in layers)


def _no_dropout(*dropouts) -> bool:
    return all(not d.training or d.p == 0.0 for d in dropouts)


def _takes(x: Array, mask: Array | None, parameters) -> bool:
    """NumPy arrays the kernels take: x and the weights C-contiguous floats of one dtype,
    a boolean mask of at most 4 axes."""
    if not compiler.COMPILED or grad_enabled() or type(x) is not np.ndarray \
            or x.dtype not in (np.float32, np.float64):
        return False
    if mask is not None and (type(mask) is not np.ndarray or mask.dtype != np.bool_
                             or mask.ndim > 4):
        return False
    return x.size > 0 and all(type(p) is np.ndarray and p.dtype == x.dtype
                              and p.flags.c_contiguous for p in parameters)


def _pays(rows: int, weights, cached: bool = False) -> bool:
    """Whether a block's kernel, whose products run on one core, is faster than its layers
    for ``rows`` rows: always where BLAS is on one thread anyway (thread replicas,
    :func:`npformer.backend.blas_on_one_thread`), else where its products are small
    (rows x matrix weights at most ONE_CORE_WORK), so that the Python between the layers
    costs more than the second core would save.  A step after ``cached`` positions: where
    its weights fit in a core's cache (at most CACHED_STEP_WEIGHTS numbers), as a small
    model's do; a large model's step reads its weights from memory, which one core reads
    slower than two."""
    if blas_on_one_thread():  # the replicas' forward: no count needed
        return True
    matrices = sum(w.size for w in weights if isinstance(w, np.ndarray) and w.ndim == 2)
    return matrices <= CACHED_STEP_WEIGHTS if cached else rows * matrices <= ONE_CORE_WORK


def _nothing_cached(kv_cache: KVCache | None) -> bool:
    """No cache, or an empty one (the kernel's keys and values fill it)."""
    return kv_cache is None or kv_cache.length == 0


def _cache_takes(kv_cache: KVCache | None, packing: Packing | None = None) -> bool:
    """An empty cache (:func:`_nothing_cached`), or the fast tier's holding NumPy arrays (a
    decoding step's: the encoder block's kernel reads its keys and values, then they take
    the step's), not for packed rows."""
    if _nothing_cached(kv_cache):
        return True
    return isinstance(kv_cache, GrowingKVCache) and packing is None \
        and type(kv_cache.keys) is np.ndarray


def _past(kv_cache: KVCache | None, like: np.ndarray, heads: int, head_dim: int) -> tuple:
    """The cached keys and values (B, H, P, E) the rows follow and how many of their first
    positions a kernel already found finite (the cache's ``finite``), or two empty ones
    (P = 0) and 0."""
    if _nothing_cached(kv_cache):
        empty = np.empty((1, heads, 0, head_dim), dtype=like.dtype)
        return empty, empty, 0
    return kv_cache.keys, kv_cache.values, kv_cache.finite


def _mask4(mask: Array | None) -> np.ndarray:
    """The mask with 4 axes (1s prepended), C-contiguous; None: every key visible."""
    if mask is None:
        return np.ones((1, 1, 1, 1), dtype=np.bool_)
    return np.ascontiguousarray(mask.reshape((1,) * (4 - mask.ndim) + mask.shape))


def _empty(like: np.ndarray) -> np.ndarray:
    """The kernels' 'none' for an absent bias or norm: an empty array of like's dtype."""
    return np.empty((0,), dtype=like.dtype)


def _linear(layer, like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Linear's (weight (D_in, D_out), bias (D_out,) or empty)."""
    return layer.weight.data, _empty(like) if layer.bias is None else layer.bias.data


def _norm(norm, like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An optional layer norm's or RMS norm's (weight, bias), empty where there is none."""
    bias = getattr(norm, "bias", None)  # an RMS norm has none
    if norm is None:
        return _empty(like), _empty(like)
    return norm.weight.data, _empty(like) if bias is None else bias.data


def _rows(x: Array) -> np.ndarray:
    """x (..., D) as rows (N, D), C-contiguous and writable (the kernels' one array type)."""
    return np.require(x.reshape(-1, x.shape[-1]), requirements=["C", "W"])


def _starts(batch: int, length: int, packing: Packing | None) -> np.ndarray:
    """(B + 1,) first rows: T each for a padded batch, n_b each for a packing's rows."""
    if packing is None:
        return np.arange(batch + 1, dtype=np.int64) * length
    counts = np.bincount(np.asarray(packing.index) // packing.length, minlength=packing.batch)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _into_cache(kv_cache: KVCache | None, k: np.ndarray, v: np.ndarray, batch: int, length: int,
                heads: int) -> None:
    """k, v rows (B T, Hkv E), which the kernel found finite -> the cache's (B, Hkv, T, E)
    (the fast tier's cache told so: a later step's kernel need not check them again)."""
    if kv_cache is not None:
        shape = (batch, length, heads, k.shape[1] // heads)
        keys, values = (a.reshape(shape).transpose(0, 2, 1, 3) for a in (k, v))
        if isinstance(kv_cache, GrowingKVCache):
            kv_cache.append(keys, values, all_finite=True)  # the cached ones checked too
        else:
            kv_cache.append(keys, values)


def _arrays(arguments: tuple) -> list:
    return [a for a in arguments if isinstance(a, np.ndarray)]


def _encoder_arguments(block: EncoderBlock, like: np.ndarray) -> tuple | None:
    """(the block's options, its weights) in the kernel's order, or None where the kernel
    does not cover it (attention weights kept, dropout drawing masks, a LoRA adapter,
    another activation, weights of another dtype or layout)."""
    attn, ffn = block.self_attn, block.ffn
    a, f = block.attn_residual, block.ffn_residual
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, ffn.linear1,
                   ffn.linear2)
    if attn.keep_attention or ffn.activation.name not in ACTIVATIONS \
            or not _plain(*projections) or not _no_dropout(a.dropout, f.dropout, ffn.dropout):
        return None
    options = (attn.num_heads, attn.head_dim, attn.narrow_heads, block.norm_first,
               ACTIVATIONS[ffn.activation.name])
    weights = (*_norm(a.norm, like), a.norm.eps, *_linear(attn.q_proj, like),
               *_linear(attn.k_proj, like), *_linear(attn.v_proj, like),
               *_norm(attn.q_norm, like), *_norm(attn.k_norm, like),
               0.0 if attn.q_norm is None else attn.q_norm.eps, *_linear(attn.out_proj, like),
               *_norm(f.norm, like), f.norm.eps, *_linear(ffn.linear1, like),
               *_linear(ffn.linear2, like))
    return (options, weights) if _takes(like, None, _arrays(weights)) else None


def encoder_block_forward(block: EncoderBlock, x: Array, mask: Array | None,
                          kv_cache: BlockCache | None = None,
                          packing: Packing | None = None) -> Array | None:
    """``block`` (a fast :class:`npformer.nn.EncoderBlock`)'s forward on x (B, T, D), or on
    ``packing``'s rows (N, D), as one kernel -> the output in x's form, or None where the
    kernel does not take these inputs (the caller runs the usual path).  ``kv_cache``: the
    block's :class:`npformer.nn.BlockCache`."""
    kv_cache = None if kv_cache is None else kv_cache.self_attn
    if not _takes(x, mask, []) or not _cache_takes(kv_cache, packing):
        return None
    arguments = _encoder_arguments(block, x)
    if arguments is None:
        return None
    options, weights = arguments
    if not _pays(x.shape[0] * x.shape[1] if packing is None else x.shape[0], weights,
                 cached=not _nothing_cached(kv_cache)):
        return None
    batch, length = x.shape[:2] if packing is None else (packing.batch, packing.length)
    past_k, past_v, checked = _past(kv_cache, x, block.self_attn.num_heads,
                                    block.self_attn.head_dim)
    with single_threaded_blas():
        y, k, v, ok = _encoder_block(_rows(x), _starts(batch, length, packing), _mask4(mask),
                                     past_k, past_v, checked, *options, *weights)
    if not ok:  # NaN or inf in the keys, queries or values: the usual path defines it
        return None
    _into_cache(kv_cache, k, v, batch, length, block.self_attn.num_heads)
    return y.reshape(x.shape)


def encoder_stack_forward(blocks: list, norm: LayerNorm | None, x: Array,
                          mask: Array | None, kv_cache: DecodingCache | None = None
                          ) -> Array | None:
    """x (B, T, D) through ``blocks`` (fast :class:`npformer.nn.EncoderBlock` s of one
    configuration), then ``norm`` (if any), as one kernel call -> (B, T, D), or None where
    the kernel does not take them: a causal LM's whole stack with no Python between its
    blocks.  ``kv_cache``: the model's :class:`npformer.nn.DecodingCache`, each block's
    keys and values then going into its cache: a prompt's (every cache empty) or a
    decoding step's (every cache the fast tier's, holding the same positions)."""
    if not blocks or not _takes(x, mask, []):
        return None
    caches = [None] * len(blocks) if kv_cache is None else \
        [block_cache.self_attn for block_cache in kv_cache.blocks]
    arguments = [_encoder_arguments(block, x) for block in blocks]
    if any(a is None or a[0] != arguments[0][0] for a in arguments) \
            or not _caches_take(caches):
        return None
    final = (*_norm(norm, x), 0.0 if norm is None else norm.eps)
    if not _takes(x, None, _arrays(final)) or not _pays(
            x.shape[0] * x.shape[1], arguments[0][1], cached=not _nothing_cached(caches[0])):
        return None
    (batch, length), attn = x.shape[:2], blocks[0].self_attn
    pasts = [_past(c, x, attn.num_heads, attn.head_dim) for c in caches]
    with single_threaded_blas():
        y, keys, values, ok = _encoder_stack(
            _rows(x), _starts(batch, length, None), _mask4(mask),
            tuple(k for k, _, _ in pasts), tuple(v for _, v, _ in pasts),
            np.array([checked for _, _, checked in pasts], dtype=np.int64),
            kv_cache is not None, *arguments[0][0], tuple(w for _, w in arguments), *final)
    if not ok:  # NaN or inf in a block's keys, queries or values: the layers define it
        return None
    for c, k, v in zip(caches, keys, values):
        _into_cache(c, k, v, batch, length, attn.num_heads)
    return y.reshape(x.shape)


def _caches_take(caches: list) -> bool:
    """Whether the stack's kernel takes the blocks' caches: none, or each as
    :func:`_cache_takes` says, all holding the same positions, their cached keys and
    values all of one memory layout (one kernel signature)."""
    if all(c is None for c in caches):
        return True
    if not all(c is not None and _cache_takes(c) for c in caches) \
            or len({c.length for c in caches}) > 1:
        return False
    return _nothing_cached(caches[0]) or len(
        {(c.keys.flags.c_contiguous, c.values.flags.c_contiguous) for c in caches}) == 1


def llama_block_forward(block: LlamaBlock, x: Array, cos: Array, sin: Array,
                        mask: Array | None, kv_cache: KVCache | None = None) -> Array | None:
    """``block`` (a fast :class:`npformer.nn.LlamaBlock`)'s forward on x (B, T, D) as one
    kernel -> (B, T, D), or None where the kernel does not take these inputs.
    ``kv_cache``: its attention's :class:`npformer.nn.KVCache`."""
    attn, ffn = block.self_attn, block.ffn
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, ffn.gate_proj,
                   ffn.up_proj, ffn.down_proj)
    if not _plain(*projections) or not _nothing_cached(kv_cache) or not _takes(x, mask, []) \
            or not all(type(t) is np.ndarray and t.dtype == x.dtype for t in (cos, sin)):
        return None
    weights = (block.attn_norm.weight.data, block.attn_norm.eps, *_linear(attn.q_proj, x),
               *_linear(attn.k_proj, x), *_linear(attn.v_proj, x), _norm(attn.q_norm, x)[0],
               _norm(attn.k_norm, x)[0], 0.0 if attn.q_norm is None else attn.q_norm.eps,
               *_linear(attn.out_proj, x), block.ffn_norm.weight.data, block.ffn_norm.eps,
               ffn.gate_proj.weight.data, ffn.up_proj.weight.data, ffn.down_proj.weight.data)
    if not _takes(x, mask, _arrays(weights)) or not _pays(x.shape[0] * x.shape[1], weights):
        return None
    batch, length = x.shape[0], x.shape[1]
    cos, sin = (np.ascontiguousarray(rotary._batched(t)) for t in (cos, sin))  # (1|B, T, E)
    with single_threaded_blas():
        y, k, v, ok = _llama_block(_rows(x), batch, length, _mask4(mask), cos, sin,
                                   attn.num_heads, attn.num_kv_heads, attn.head_dim, *weights)
    if not ok:  # NaN or inf in the keys, queries or values: the usual path defines it
        return None
    _into_cache(kv_cache, k, v, batch, length, attn.num_kv_heads)
    return y.reshape(x.shape)


# =========================================================================== the pieces
@jit(inline="always")
def _affine(x, w, b):
    """x (N, D_in) @ w (D_in, D_out) (+ b (D_out,) unless empty) -> (N, D_out).  From 2 to
    MAX_ROWS rows and a W of at most STREAMED_WEIGHTS numbers (in a core's cache) the
    product is streamed (:mod:`.streaming`: faster than BLAS's blocked product there,
    bench/README.md, "Decoding at the memory bound"; one row stays BLAS's matrix-vector
    product)."""
    if 2 <= x.shape[0] <= MAX_ROWS and w.size <= STREAMED_WEIGHTS:
        y = np.empty((x.shape[0], w.shape[1]), dtype=x.dtype)
        columns_into(np.ascontiguousarray(x), w, y, 0, w.shape[1])
    else:
        y = np.dot(x, w)
    if b.size:
        for i in range(y.shape[0]):
            for j in range(y.shape[1]):
                y[i, j] += b[j]
    return y


@jit(inline="always")
def _add_into(y, x):
    """y += x, element by element (the residual sum), in place."""
    for i in range(y.shape[0]):
        for j in range(y.shape[1]):
            y[i, j] += x[i, j]


@jit(inline="always")
def _layer_norm(x, gamma, beta, eps):
    """x (N, D) -> LN(x) (N, D): the fast tier's layer norm kernel."""
    y, x_hat = np.empty_like(x), np.empty_like(x)
    r = np.empty((x.shape[0], 1), dtype=x.dtype)
    layernorm._layernorm_forward(x, gamma, beta, eps, y, x_hat, r)
    return y


@jit(inline="always")
def _rms_norm(x, weight, eps):
    """x (N, D) -> RMSNorm(x) (N, D): the fast tier's RMS norm kernel."""
    y, x_hat = np.empty_like(x), np.empty_like(x)
    r = np.empty((x.shape[0], 1), dtype=x.dtype)
    rmsnorm._rmsnorm_forward(x, weight, eps, y, x_hat, r)
    return y


def _gelu_into(x, y, kind):
    """y = GELU(x) (kind 1) or its tanh form (kind 2), x and y (N,): the fast tier's
    kernels of x's precision (numba picks them at compile time)."""
    raise NotImplementedError("compiled only")


if COMPILED:
    from numba import types
    from numba.extending import overload

    @overload(_gelu_into)
    def _gelu_of_its_precision(x, y, kind):
        exact, tanh_form = ((gelu_forward32, gelu_tanh_forward32) if x.dtype == types.float32
                            else (gelu_forward64, gelu_tanh_forward64))

        def gelu_into(x, y, kind):
            if kind == 1:
                exact(x, y)
            else:
                tanh_form(x, y, np.empty_like(x))
        return gelu_into


@jit(inline="always")
def _activate(h, kind):
    """h (N, D_ff) -> ReLU (kind 0: max(h, 0), in place), GELU (1) or its tanh form (2)."""
    if kind == 0:
        zero = h.dtype.type(0.0)
        flat = h.reshape(-1)
        for i in range(flat.size):
            flat[i] = max(flat[i], zero)  # NaN stays NaN, as NumPy's maximum keeps it
        return h
    y = np.empty_like(h)
    _gelu_into(h.reshape(-1), y.reshape(-1), kind)
    return y


@jit(inline="always")
def _per_head(x, heads):
    """(N, H E) -> (N H, E): each head's features a row (a view)."""
    return x.reshape(x.shape[0] * heads, x.shape[1] // heads)


@jit(inline="always")
def _add_times_zero(x, sums):
    """sums (F,) += x (N, F) * 0 down each column: 0 where x is finite, NaN where it is
    inf or NaN (independent sums, which vectorize, where a test and branch per element
    does not)."""
    zero = x.dtype.type(0.0)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            sums[j] += x[i, j] * zero


@jit(inline="always")
def _finite(x):
    """Whether every element of x (N, F) is finite (:func:`_add_times_zero`)."""
    sums = np.zeros(x.shape[1], dtype=x.dtype)  # (F,)
    _add_times_zero(x, sums)
    return np.sum(sums) == 0


@jit(inline="always")
def _finite_cached(x):
    """:func:`_finite` of a cache's keys or values (B, H, P, E), read where they lie (a
    view of the cache's buffer), each (b, h)'s (P, E) in turn."""
    sums = np.zeros(x.shape[3], dtype=x.dtype)  # (E,)
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            _add_times_zero(x[b, h], sums)
    return np.sum(sums) == 0


@jit
def _attend(q, k, v, starts, mask, heads, kv_heads):
    """q (N, H E), k, v (N, Hkv E) rows of the sequences starting at ``starts`` ->
    (N, H E): each query head h attends with key/value head h // (H / Hkv) over its
    sequence's positions the mask (4 axes, broadcasting to (B, H, T, S)) allows."""
    past = np.empty((1, kv_heads, 0, q.shape[1] // heads), dtype=q.dtype)  # none cached
    return _attend_after(q, k, v, past, past, starts, mask, heads, kv_heads)


@jit(inline="always")
def _dot(x, y):
    """x . y of two (E,) rows, as four running sums (independent chains)."""
    zero = x.dtype.type(0.0)
    s0 = s1 = s2 = s3 = zero
    n = x.size
    j = 0
    while j + 4 <= n:
        s0 += x[j] * y[j]
        s1 += x[j + 1] * y[j + 1]
        s2 += x[j + 2] * y[j + 2]
        s3 += x[j + 3] * y[j + 3]
        j += 4
    while j < n:
        s0 += x[j] * y[j]
        j += 1
    return (s0 + s1) + (s2 + s3)


@jit(inline="always")
def _probabilities(row, allowed, ms, scale):
    """One query's scores ``row`` (S,) -> in place its attention probabilities: the keys
    ``allowed`` (read at s, or at 0 where ms is 1) lets it see scaled by ``scale`` and
    softmaxed (the stable form: the max, exp, a float64 sum), 0 at every other key.
    Returns 1 + its last visible key (0: none, the row all 0)."""
    zero, neg_inf = row.dtype.type(0.0), row.dtype.type(-np.inf)
    last = 0
    for s in range(row.size):
        if allowed[s if ms > 1 else 0]:
            row[s] = row[s] * scale
            last = s + 1
        else:
            row[s] = neg_inf
    for s in range(last, row.size):  # the causal future and end padding: never exponentiated
        row[s] = zero
    seen = row[:last]
    m = max8(seen, neg_inf)
    if m == neg_inf:  # no visible key: a zero output
        for s in range(last):
            seen[s] = zero
        return 0
    for s in range(last):
        seen[s] = exp(seen[s] - m)  # exp(-inf) = 0 at masked keys
    total = row.dtype.type(sum4(seen, seen, 0))
    for s in range(last):
        seen[s] = seen[s] / total
    return last


@jit
def _attend_after(q, k, v, past_k, past_v, starts, mask, heads, kv_heads):
    """:func:`_attend` of rows that follow P cached positions: sequence b's keys and values
    are past_k[b], past_v[b] (B, Hkv, P, E) then its rows' own, S = P + T of them, and
    the mask is read at (b, h, t, s) with t the row's place among its sequence's new rows.
    P = 0: :func:`_attend`.  A sequence of at most FEW_QUERIES rows (a decoding step's:
    T = 1) takes its products by hand, reading the cache where it lies; more take them
    from BLAS, their keys and values copied into (E, S) and (S, E) first."""
    width = q.shape[1] // heads
    group = heads // kv_heads
    before = past_k.shape[2]  # P
    scale = q.dtype.type(1.0 / math.sqrt(width))
    zero = q.dtype.type(0.0)
    out = np.empty_like(q)
    mb, mh, mt, ms = mask.shape
    for b in range(starts.size - 1):
        first, n = starts[b], starts[b + 1] - starts[b]
        if n == 0:
            continue
        keys = before + n  # S
        for h in range(heads):
            g = h // group
            if n <= FEW_QUERIES:  # each query's S scores and its P V, one at a time
                row = np.empty(keys, dtype=q.dtype)  # (S,)
                for t in range(n):
                    query = q[first + t, h * width:(h + 1) * width]  # (E,)
                    for s in range(keys):
                        key = past_k[b, g, s] if s < before else \
                            k[first + s - before, g * width:(g + 1) * width]
                        row[s] = _dot(query, key)
                    allowed = mask[b if mb > 1 else 0, h if mh > 1 else 0, t if mt > 1 else 0]
                    o = out[first + t, h * width:(h + 1) * width]  # (E,)
                    o[:] = zero
                    for s in range(_probabilities(row, allowed, ms, scale)):
                        value = past_v[b, g, s] if s < before else \
                            v[first + s - before, g * width:(g + 1) * width]
                        for j in range(width):
                            o[j] += row[s] * value[j]
                continue
            qh = np.empty((n, width), dtype=q.dtype)      # (T, E)
            kt = np.empty((width, keys), dtype=q.dtype)   # (E, S)
            vh = np.empty((keys, width), dtype=q.dtype)   # (S, E)
            for s in range(before):  # the cached positions
                for j in range(width):
                    kt[j, s] = past_k[b, g, s, j]
                    vh[s, j] = past_v[b, g, s, j]
            for t in range(n):
                for j in range(width):
                    qh[t, j] = q[first + t, h * width + j]
                    kt[j, before + t] = k[first + t, g * width + j]
                    vh[before + t, j] = v[first + t, g * width + j]
            p = np.dot(qh, kt)  # (T, S) scores Q K^T
            for t in range(n):
                allowed = mask[b if mb > 1 else 0, h if mh > 1 else 0, t if mt > 1 else 0]
                _probabilities(p[t], allowed, ms, scale)
            o = np.dot(p, vh)  # (T, E) = P V
            for t in range(n):
                for j in range(width):
                    out[first + t, h * width + j] = o[t, j]
    return out


# =========================================================================== the blocks
@jit(calls=CALLS)
def _encoder_block(x, starts, mask, past_k, past_v, checked, heads, head_dim, narrow,
                   norm_first, activation, g1, b1, eps1, wq, bq, wk, bk, wv, bv, gq, bqn, gk,
                   bkn, eps_qk, wo, bo, g2, b2, eps2, w1, c1, w2, c2):
    """x (N, D) -> (the block's output (N, D), K, V (N, H E), whether K, Q and V were
    finite); past_k, past_v (B, H, P, E): the keys and values of P positions before the
    rows (a decoding step's cache; P = 0: none), the first ``checked`` of them found finite
    by an earlier step's kernel (the rest are checked here); see
    :func:`encoder_block_forward` for the arguments' sources."""
    n = x.shape[0]
    a_in = _layer_norm(x, g1, b1, eps1) if norm_first else x
    source = _per_head(a_in, heads) if narrow else a_in  # narrow: each head's slice a row
    q = _affine(source, wq, bq).reshape(n, heads * head_dim)
    k = _affine(source, wk, bk).reshape(n, heads * head_dim)
    v = _affine(source, wv, bv).reshape(n, heads * head_dim)
    if gq.size:  # query-key norm: a layer norm over each head's E features
        q = _layer_norm(_per_head(q, heads), gq, bqn, eps_qk).reshape(n, heads * head_dim)
        k = _layer_norm(_per_head(k, heads), gk, bkn, eps_qk).reshape(n, heads * head_dim)
    if not (_finite(q) and _finite(k) and _finite(v) and _finite_cached(past_k[:, :, checked:])
            and _finite_cached(past_v[:, :, checked:])):
        return x, k, v, False
    h = _affine(_attend_after(q, k, v, past_k, past_v, starts, mask, heads, heads), wo, bo)
    _add_into(h, x)  # x + A(.)
    if not norm_first:
        h = _layer_norm(h, g1, b1, eps1)
    f_in = _layer_norm(h, g2, b2, eps2) if norm_first else h
    y = _affine(_activate(_affine(f_in, w1, c1), activation), w2, c2)  # F(.)
    _add_into(y, h)
    if not norm_first:
        y = _layer_norm(y, g2, b2, eps2)
    return y, k, v, True


@jit(calls=CALLS)
def _encoder_stack(x, starts, mask, pasts_k, pasts_v, checked, keep, heads, head_dim, narrow,
                   norm_first, activation, blocks, g, b, eps):
    """x (N, D) -> each block's kernel in turn (``blocks``: their weights; block i after
    the positions pasts_k[i], pasts_v[i] (B, H, P, E), the first checked[i] of them found
    finite), then the final layer norm (g empty: none) -> (the output (N, D), each block's
    K and V (N, H E) where ``keep`` (else none), whether every block's K, Q and V were
    finite)."""
    keys, values = [], []
    for i in range(len(blocks)):
        x, k, v, ok = _encoder_block(x, starts, mask, pasts_k[i], pasts_v[i], checked[i],
                                     heads, head_dim, narrow, norm_first, activation,
                                     *blocks[i])
        if not ok:
            return x, keys, values, False
        if keep:
            keys.append(k)
            values.append(v)
    if g.size:
        x = _layer_norm(x, g, b, eps)
    return x, keys, values, True


@jit(inline="always")
def _rotated(x, batch, length, heads, cos, sin):
    """x (B T, H E) -> each head's pairs turned by their positions' angles: the fast
    tier's rotary kernel on x seen as (B, H, T, E), as the layer's heads are (a strided
    view) into a (B, H, T, E) array, then back to rows."""
    width = x.shape[1] // heads
    y = np.empty((batch, heads, length, width), dtype=x.dtype)
    rotary._rotate(x.reshape((batch, length, heads, width)).transpose((0, 2, 1, 3)), cos, sin, y)
    return np.ascontiguousarray(y.transpose((0, 2, 1, 3))).reshape(x.shape)


@jit(calls=CALLS)
def _llama_block(x, batch, length, mask, cos, sin, heads, kv_heads, head_dim, w1, eps,
                 wq, bq, wk, bk, wv, bv, wqn, wkn, eps_qk, wo, bo, w2, eps2, wg, wu, wd):
    """x (B T, D) -> (the block's output (B T, D), K, V (B T, Hkv E) rotated, whether
    they and Q were finite); see :func:`llama_block_forward` for the arguments."""
    n = x.shape[0]
    a_in = _rms_norm(x, w1, eps)
    q, k, v = _affine(a_in, wq, bq), _affine(a_in, wk, bk), _affine(a_in, wv, bv)
    if wqn.size:  # QK-norm: an RMS norm over each head's E features
        q = _rms_norm(_per_head(q, heads), wqn, eps_qk).reshape(n, heads * head_dim)
        k = _rms_norm(_per_head(k, kv_heads), wkn, eps_qk).reshape(n, kv_heads * head_dim)
    q = _rotated(q, batch, length, heads, cos, sin)
    k = _rotated(k, batch, length, kv_heads, cos, sin)
    if not (_finite(q) and _finite(k) and _finite(v)):
        return x, k, v, False
    starts = np.arange(batch + 1) * length
    h = _affine(_attend(q, k, v, starts, mask, heads, kv_heads), wo, bo)  # (N, D)
    _add_into(h, x)  # x + A(N1(x))
    f_in = _rms_norm(h, w2, eps2)
    gate, up = np.dot(f_in, wg), np.dot(f_in, wu)  # (N, D_ff) each
    hidden, sigmoid = np.empty_like(gate), np.empty_like(gate)
    swiglu._swiglu_forward(gate.reshape(-1), up.reshape(-1), hidden.reshape(-1),
                           sigmoid.reshape(-1))
    y = np.dot(hidden, wd)
    _add_into(y, h)
    return y, k, v, True
