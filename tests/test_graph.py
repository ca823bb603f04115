"""The update replayed as a CUDA graph (:mod:`npformer.gpu.cuda_graph`) and the products it
captures (:mod:`npformer.gpu.gemm`).

On the CPU: the update's device statements (``StepGraphs(capture=False)``, what a graph
records) equal the Trainer's eager update, update for update, in both tiers, on NumPy and
on the strict namespace, where they are also shown to read nothing from the device (any
copy between host and device, explicit or implicit, raises); a non-finite update
changes nothing; the batch is checked on the host; graph mode off a GPU says why and
trains eagerly.  On a GPU (``gpu`` mark): the cuBLAS products equal ``@``, a captured
product replays, a replayed update equals the eager one with dropout on (float64 within
1e-12, float32 within rounding), and the Trainer's graph mode trains as it does eagerly.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import numpy as np
import pytest

from npformer import backend
from npformer.gpu.cuda_graph import CaptureFailed, StepGraphs, graph_safe, unsupported
from npformer.models import (
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
)
from npformer.ops.contracts import TokenIdError, run_trusted
from npformer.optim import SGD, warmup_cosine
from npformer.train import TrainConfig, Trainer, TrainingDiverged
from npformer.train.tasks import Classification, LanguageModeling, Translation
from tests.helpers import tiered

from .conftest import GPU, using_backend

VOCAB, CLASSES, UPDATES, CLIP = 11, 3, 4, 0.05
KINDS = ("lm", "classifier", "translation")


def make_run(kind: str, dropout: float = 0.0, seed: int = 0):
    """(model, AdamW with a schedule and decay, task, host batches) of a small model."""
    backend.seed(seed)
    if kind == "lm":
        model = tiered.CausalLM(CausalLMConfig(vocab_size=VOCAB, d_model=8, num_heads=2,
                                               num_layers=2, d_ff=16, block_size=8,
                                               dropout=dropout))
        rng = np.random.default_rng(1)
        tokens = [rng.integers(0, VOCAB, size=(3, 9)) for _ in range(UPDATES + 2)]
        batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
        task = LanguageModeling()
    elif kind == "translation":
        model = tiered.Seq2SeqTransformer(Seq2SeqConfig(
            src_vocab_size=VOCAB, tgt_vocab_size=VOCAB + 2, d_model=8, num_heads=2,
            num_encoder_layers=1, num_decoder_layers=2, d_ff=16, block_size=8, dropout=dropout))
        rng = np.random.default_rng(3)
        batches = []
        for _ in range(UPDATES + 2):
            src_lens, tgt_lens = rng.integers(1, 7, size=4), rng.integers(1, 6, size=4)
            src = rng.integers(4, VOCAB, size=(4, 6))
            src[np.arange(6)[None, :] >= src_lens[:, None]] = 0
            words = rng.integers(4, VOCAB + 2, size=(4, 6))
            tgt_in = np.concatenate([np.full((4, 1), 2), words[:, :4]], axis=1)  # <bos> ...
            tgt_out = words[:, :5].copy()
            tgt_out[np.arange(4), tgt_lens - 1] = 3  # <eos>
            for ids in (tgt_in, tgt_out):
                ids[np.arange(5)[None, :] >= tgt_lens[:, None]] = 0
            batches.append((src, src_lens, tgt_in, tgt_out, tgt_lens))
        task = Translation(label_smoothing=0.1)
    else:
        model = tiered.TransformerClassifier(ClassifierConfig(
            vocab_size=VOCAB, num_classes=CLASSES, d_model=8, num_heads=2, num_layers=2,
            d_ff=16, block_size=8, dropout=dropout, bigram_buckets=16))  # as the IMDB demo's
        rng = np.random.default_rng(2)
        batches = []
        for _ in range(UPDATES + 2):
            lengths = rng.integers(1, 8, size=4)
            ids = rng.integers(1, VOCAB, size=(4, 7))
            ids[np.arange(7)[None, :] >= lengths[:, None]] = 0  # padding at the end
            batches.append((ids, lengths, rng.integers(0, CLASSES, size=4)))
        task = Classification()
    optimizer = tiered.AdamW(model.parameters(),
                             lr=warmup_cosine(3e-3, warmup=2, total_updates=UPDATES),
                             weight_decay=0.1)
    return model, optimizer, task, batches


def trainer_of(model, optimizer, task, batches, cuda_graph=None, clip=CLIP):
    it = iter(batches)
    return Trainer(model, optimizer, task, lambda rng: next(it),
                   TrainConfig(max_iters=UPDATES, clip_norm=clip, progress=False,
                               cuda_graph=cuda_graph))


def host_params(model) -> list[np.ndarray]:
    return [backend.to_numpy(p.data).copy() for p in model.parameters()]


def assert_same_run(losses_a, params_a, losses_b, params_b, rtol: float, atol: float) -> None:
    np.testing.assert_allclose(losses_a, losses_b, rtol=rtol, atol=0)
    for a, b in zip(params_a, params_b):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


# =========================================================================== on the CPU
@pytest.mark.usefixtures("tier")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["numpy", "strict"])
def test_the_device_update_equals_the_trainers_eager_update(kind, name):
    """Four updates (warmup and cosine schedule, AdamW's decay, clipping that bites):
    the losses and every weight agree to float64 rounding."""
    with using_backend(name, "float64"):
        model, optimizer, task, batches = make_run(kind)
        trainer = trainer_of(model, optimizer, task, batches)
        eager = [trainer.update() for _ in range(UPDATES)]
        model2, optimizer2, task2, batches2 = make_run(kind)
        graphs = StepGraphs(model2, optimizer2, task2, CLIP, capture=False)
        device = [float(graphs.update(b)[0]) for b in batches2[:UPDATES]]
        assert optimizer2.updates == optimizer.updates == UPDATES
        assert optimizer2.lr == optimizer.lr
        assert_same_run(eager, host_params(model), device, host_params(model2), 1e-12, 1e-13)


@contextmanager
def implicit_reads_refused():
    """Strict arrays refuse bool(), float(), int() and the rest: an implicit host read
    (``if x.any():``) in the update fails the test, as an explicit one does."""
    from array_api_strict._array_object import Array

    names = ("__bool__", "__float__", "__int__", "__index__", "__complex__", "__array__",
             "item", "tolist")
    saved = {name: getattr(Array, name) for name in names if hasattr(Array, name)}

    def refuse(name):
        def refused(self, *args, **kwargs):
            raise AssertionError(f"an implicit host read ({name}) in the captured update")
        return refused
    for name in saved:
        setattr(Array, name, refuse(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(Array, name, method)


@pytest.mark.parametrize("kind", KINDS)
def test_the_device_update_reads_nothing_from_the_device(kind, monkeypatch):
    """On the strict namespace (arrays on a pretend accelerator) the update runs under
    :func:`graph_safe`, whose guard refuses every copy either way, with the implicit
    conversions refused too: it completes, so a graph could capture it.  (Without
    dropout: the strict backend draws its masks on the host; CuPy's generator draws them
    on the device, which the replay tests on a GPU check.)"""
    import npformer.gpu.cuda_graph as cuda_graph

    update = cuda_graph.device_update

    def guarded(*args, **kwargs):
        with implicit_reads_refused():
            return update(*args, **kwargs)

    monkeypatch.setattr(cuda_graph, "device_update", guarded)
    with using_backend("strict", "float64"):
        model, optimizer, task, batches = make_run(kind)
        graphs = StepGraphs(model, optimizer, task, CLIP, capture=False)
        for batch in batches[:2]:
            assert graphs.update(batch)[2] == 1.0
        # the guards bite: a read inside graph_safe is refused, with and without a copy
        x = backend.asarray(np.ones(3))
        with graph_safe(), pytest.raises(backend.HostReadError, match="CUDA graph"):
            backend.to_float(x[0])
        with graph_safe(), pytest.raises(backend.HostReadError, match="copied to the device"):
            backend.asarray(np.ones(3))
        with implicit_reads_refused(), pytest.raises(AssertionError, match="__bool__"):
            bool(x[0] > 0)


def test_a_nonfinite_update_changes_nothing():
    """An infinite weight makes the loss NaN: the flag is off, and no weight, moment or
    count moves (the Trainer then raises TrainingDiverged, naming it)."""
    with using_backend("numpy", "float64"):
        model, optimizer, task, batches = make_run("lm")
        model.parameters()[-1].data[...] = np.inf
        before = host_params(model)
        graphs = StepGraphs(model, optimizer, task, CLIP, capture=False)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN is the point here
            loss, _, finite = graphs.update(batches[0])
        assert not np.isfinite(loss) and finite == 0.0
        assert optimizer.updates == 0
        for a, b in zip(before, host_params(model)):
            np.testing.assert_array_equal(a, b)
        assert all(not np.any(m) for m in optimizer.state["m"])


def test_the_batch_is_checked_on_the_host():
    """A captured update checks nothing itself: the batch's ids and targets are checked
    before they are copied, with the eager door's messages."""
    with using_backend("numpy", "float64"):
        model, optimizer, task, batches = make_run("lm")
        graphs = StepGraphs(model, optimizer, task, CLIP, capture=False)
        x, y = batches[0]
        with pytest.raises(TokenIdError, match="found id 99"):
            graphs.update((np.where(x == x[0, 0], 99, x), y))
        with pytest.raises(TokenIdError, match="next-token targets"):
            graphs.update((x, np.where(y == y[0, 0], VOCAB, y)))
        with pytest.raises(ValueError, match="next-token targets must have shape"):
            graphs.update((x, y[:, :-1]))
        assert optimizer.updates == 0


def test_graph_mode_off_a_gpu_says_why_and_trains_eagerly(capsys):
    with using_backend("numpy", "float64"):
        model, optimizer, task, batches = make_run("lm")
        eager = [trainer_of(model, optimizer, task, batches).update() for _ in range(1)]
        model2, optimizer2, task2, batches2 = make_run("lm")
        trainer = trainer_of(model2, optimizer2, task2, batches2, cuda_graph=True)
        graphed = [trainer.update() for _ in range(1)]
    assert "CUDA graph: off (CUDA graphs need the cupy backend (this run is on numpy))" \
        in capsys.readouterr().out
    assert graphed == eager


def graph_mode_on_the_cpu(monkeypatch) -> None:
    """The Trainer's graph mode on the CPU: nothing refused for the backend, and each
    update the graphs' device statements, run uncaptured (``StepGraphs(capture=False)``)."""
    import npformer.gpu.cuda_graph as cuda_graph

    monkeypatch.setattr(cuda_graph, "unsupported", lambda *args, **kwargs: None)
    monkeypatch.setattr(cuda_graph, "StepGraphs", functools.partial(StepGraphs, capture=False))


def eager_and_graphed(updates: int = UPDATES) -> tuple[list, list, list, list, Trainer]:
    """(losses, weights) of the same run eagerly and in graph mode, and the latter's
    Trainer."""
    model, optimizer, task, batches = make_run("lm")
    trainer = trainer_of(model, optimizer, task, batches)
    eager = [trainer.update() for _ in range(updates)]
    model2, optimizer2, task2, batches2 = make_run("lm")
    trainer = trainer_of(model2, optimizer2, task2, batches2, cuda_graph=True)
    graphed = [trainer.update() for _ in range(updates)]
    return eager, host_params(model), graphed, host_params(model2), trainer


def test_the_trainers_graph_mode_runs_the_device_update(monkeypatch, capsys):
    """The Trainer's graph mode (its update's device statements, uncaptured on the CPU)
    trains as the eager updates do, update for update, and says nothing."""
    graph_mode_on_the_cpu(monkeypatch)
    with using_backend("numpy", "float64"):
        *run, trainer = eager_and_graphed()
    assert isinstance(trainer.cuda_graphs.graphs, StepGraphs) and trainer.updates == UPDATES
    assert_same_run(*run, 1e-12, 1e-13)
    assert "CUDA graph" not in capsys.readouterr().out
    from bench.gpu import trainer_graphs  # what bench/gpu.py reports as captured

    assert trainer_graphs(trainer) is trainer.cuda_graphs.graphs
    assert trainer_graphs(object()) is None  # another side's optimizer


def test_a_capture_that_fails_trains_eagerly_from_that_update(monkeypatch, capsys):
    """The second update's capture fails: that update runs eagerly on the batch already
    drawn, and every later one eagerly, the reason said once; the run is the eager one."""
    graph_mode_on_the_cpu(monkeypatch)
    update, calls = StepGraphs.update, []

    def second_fails(self, batch):
        calls.append(batch)
        if len(calls) == 2:
            raise CaptureFailed("the update cannot be captured: refused by the test")
        return update(self, batch)

    monkeypatch.setattr(StepGraphs, "update", second_fails)
    with using_backend("numpy", "float64"):
        *run, trainer = eager_and_graphed()
    assert len(calls) == 2 and trainer.cuda_graphs.graphs is False
    assert_same_run(*run, 1e-12, 1e-13)
    assert capsys.readouterr().out.count("CUDA graph: off (the update cannot be captured: "
                                         "refused by the test); training eagerly") == 1


def test_the_trainers_graph_mode_names_a_divergence(monkeypatch):
    """A replayed update whose loss, or whose gradient, is not finite stops the run with
    the eager update's messages: the loss, or the parameter whose gradient it is."""
    graph_mode_on_the_cpu(monkeypatch)
    with using_backend("numpy", "float64"):
        model, optimizer, task, batches = make_run("lm")
        model.parameters()[-1].data[...] = np.inf
        trainer = trainer_of(model, optimizer, task, batches, cuda_graph=True)
        with np.errstate(invalid="ignore", over="ignore"), pytest.raises(
                TrainingDiverged, match=r"training diverged at update 1: loss nan "):
            trainer.update()
        def nan_gradient(self, batch):  # a finite loss, the first gradient NaN: no update
            for p in self.optimizer.params:
                p.grad = np.zeros_like(p.data)
            self.optimizer.params[0].grad[0] = np.nan
            return np.array([2.5, np.nan, 0.0])

        monkeypatch.setattr(StepGraphs, "update", nan_gradient)
        model, optimizer, task, batches = make_run("lm")
        name = next(n for n, p in model.named_parameters() if p is optimizer.params[0])
        trainer = trainer_of(model, optimizer, task, batches, cuda_graph=True)
        with pytest.raises(TrainingDiverged, match=rf"training diverged at update 1: the "
                                                   rf"gradient of {name} \(shape "):
            trainer.update()


def test_what_cannot_be_captured_is_named():
    with using_backend("numpy", "float64"):
        model, optimizer, task, _ = make_run("lm")
        params = model.parameters()
        assert "cupy backend" in unsupported(optimizer, task)
        assert "SGD" in unsupported(SGD(params, lr=0.1), task, capture=False)
        assert "L2 decay" in unsupported(tiered.Adam(params, weight_decay=0.1), task, capture=False)
        assert unsupported(tiered.Adam(params), task, capture=False) is None
        class OwnLoss(LanguageModeling):  # its own loss_and_grad: the graph would skip it
            def loss_and_grad(self, model, batch, grad_scale=1.0):
                return super().loss_and_grad(model, batch, grad_scale)

        assert "OwnLoss defines loss_and_grad but not loss_and_grad_on_device" in \
            unsupported(optimizer, OwnLoss(), capture=False)
        assert unsupported(optimizer, Translation(), capture=False) is None
        assert "replicas 2" in unsupported(optimizer, task, replicas=2, capture=False)
        assert "grad_accum 3" in unsupported(optimizer, task, grad_accum=3, capture=False)


def test_cuda_graph_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="cuda_graph must be True, False or None"):
        TrainConfig(max_iters=1, cuda_graph="yes")


# =========================================================================== on a GPU
needs_gpu = pytest.mark.skipif(not GPU, reason="needs CuPy and a GPU")

PRODUCTS = [  # (a's shape, b's shape, how each is laid out)
    ((5, 7), (7, 3), "plain"),
    ((5, 7), (3, 7), "b transposed"),
    ((7, 5), (7, 3), "a transposed"),
    ((2, 3, 5, 7), (2, 3, 7, 4), "batched"),
    ((2, 3, 5, 7), (2, 3, 4, 7), "batched, b transposed"),
    ((2, 5, 3, 7), (2, 3, 7, 4), "a's heads swapped (a strided view)"),
    ((4, 6, 7), (7, 3), "rows times one matrix"),
    ((4, 6, 7), (3, 7), "rows times one transposed matrix"),
    ((5, 0), (0, 3), "no inner axis"),
    ((0, 7), (7, 3), "no rows"),
]


def _laid_out(a, b, layout):
    if layout.startswith("a transposed"):
        a = a.mT
    if "b transposed" in layout or "one transposed" in layout:
        b = b.mT
    if layout.startswith("a's heads swapped"):
        a = a.transpose(0, 2, 1, 3)
    return a, b


def _in_pool(x: np.ndarray) -> np.ndarray:
    """x copied into a buffer with room after it (a call reading past x reads zeros)."""
    pool = np.zeros(x.size + 4096, dtype=x.dtype)
    view = pool[:x.size].reshape(x.shape)
    view[...] = x
    return view


def _from_first_element(x: np.ndarray) -> np.ndarray:
    """The 1-d buffer a device pointer to x's first element reads (its pool, from there)."""
    root = x
    while root.base is not None:
        root = root.base
    offset = (x.ctypes.data - root.ctypes.data) // x.itemsize
    return root.reshape(-1)[offset:]


def _emulated_call(call, first: np.ndarray, second: np.ndarray, out: np.ndarray) -> None:
    """cublasGemmStridedBatchedEx's column-major semantics on 1-d buffers, in NumPy."""
    def matrix(buffer, offset, rows, cols, ld):
        return np.lib.stride_tricks.as_strided(buffer[offset:], shape=(rows, cols),
                                               strides=(buffer.itemsize, ld * buffer.itemsize))
    for i in range(call.batch):
        a = matrix(first, i * call.stride_first,
                   *((call.m, call.k) if call.op_first == 0 else (call.k, call.m)), call.ld_first)
        b = matrix(second, i * call.stride_second,
                   *((call.k, call.n) if call.op_second == 0 else (call.n, call.k)),
                   call.ld_second)
        a, b = (a if call.op_first == 0 else a.T), (b if call.op_second == 0 else b.T)
        matrix(out, i * call.stride_c, call.m, call.n, call.ldc)[...] = a @ b


@pytest.mark.parametrize("a_shape,b_shape,layout", [p for p in PRODUCTS if 0 not in p[0] + p[1]])
def test_the_planned_cublas_call_computes_the_product(a_shape, b_shape, layout):
    """The arguments given to cuBLAS, read with its column-major semantics (emulated in
    NumPy, operands in buffers with room after them): every layout gives a @ b."""
    from npformer.gpu.gemm import plan

    rng = np.random.default_rng(3)
    a, b = _laid_out(*(_in_pool(rng.standard_normal(s)) for s in (a_shape, b_shape)), layout)
    a_used, b_used, call, out_shape = plan(a, b, lambda x: _in_pool(np.ascontiguousarray(x)))
    out = np.zeros(int(np.prod(out_shape)) + 4096)
    _emulated_call(call, _from_first_element(b_used), _from_first_element(a_used), out)
    np.testing.assert_allclose(out[:int(np.prod(out_shape))].reshape(out_shape), a @ b,
                               rtol=1e-13, atol=1e-13)
    assert not out[int(np.prod(out_shape)):].any()  # nothing written past the output


@pytest.mark.parametrize("dtype,rtol", [("float32", 2e-6), ("float64", 1e-13)])
@pytest.mark.parametrize("a_shape,b_shape,layout", PRODUCTS)
@pytest.mark.gpu
@needs_gpu
def test_the_cublas_products_equal_matmul(a_shape, b_shape, layout, dtype, rtol):
    import cupy

    from npformer.fast import gemm

    rng = np.random.default_rng(3)
    a, b = (cupy.asarray(rng.standard_normal(s).astype(dtype)) for s in (a_shape, b_shape))
    a, b = _laid_out(a, b, layout)
    expected = (a.astype("float64") @ b.astype("float64")).get()
    previous = gemm.set_routed(True)
    try:
        got = gemm.matmul(a, b)
    finally:
        gemm.set_routed(previous)
    assert got.dtype == a.dtype and got.shape == expected.shape
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(got.get(), expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.gpu
@needs_gpu
def test_a_captured_product_replays_on_new_inputs():
    import cupy

    from npformer.fast import gemm

    rng = np.random.default_rng(4)
    a, b = (cupy.asarray(rng.standard_normal(s)) for s in ((6, 5), (4, 5)))
    stream = cupy.cuda.Stream(non_blocking=True)
    previous = gemm.set_routed(True)
    try:
        with stream:
            gemm.matmul(a, b.mT)  # the handle and its workspace, made outside the capture
            stream.begin_capture()
            out = gemm.matmul(a, b.mT)
            graph = stream.end_capture()
    finally:
        gemm.set_routed(previous)
    a[...] = cupy.asarray(rng.standard_normal((6, 5)))
    graph.launch(stream)
    stream.synchronize()
    np.testing.assert_allclose(out.get(), (a @ b.mT).get(), rtol=1e-13)


@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-12), ("float32", 1e-6)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.gpu
@needs_gpu
def test_a_replayed_update_equals_the_eager_one(kind, dtype, rtol):
    """Six updates with dropout 0.1, from the same generator state: the first eager, the
    second captured, the rest replayed, against the same statements run eagerly."""
    runs = []
    for capture in (True, False):
        with using_backend("cupy", dtype, seed=5):
            model, optimizer, task, batches = make_run(kind, dropout=0.1)
            backend.seed(7)  # the dropout masks' stream, the same for both runs
            graphs = StepGraphs(model, optimizer, task, CLIP, capture=capture)
            losses = [float(graphs.update(b)[0]) for b in batches]
            runs.append((losses, host_params(model), graphs.captures))
    (graph_losses, graph_params, captures), (eager_losses, eager_params, _) = runs
    assert captures == 1
    assert_same_run(graph_losses, graph_params, eager_losses, eager_params, rtol, rtol)


@pytest.mark.gpu
@needs_gpu
def test_the_trainers_graph_mode_trains_as_eagerly():
    """Without dropout the Trainer's graph mode and its eager updates agree (float64; the
    products of cuBLAS's own call and of CuPy's differ in rounding only)."""
    runs = []
    for cuda_graph in (True, False):
        with using_backend("cupy", "float64"):
            model, optimizer, task, batches = make_run("lm")
            trainer = trainer_of(model, optimizer, task, batches, cuda_graph=cuda_graph)
            runs.append(([trainer.update() for _ in range(UPDATES)], host_params(model),
                         trainer.cuda_graphs.graphs))
    (graph_losses, graph_params, graphs), (eager_losses, eager_params, none) = runs
    assert graphs.captures == 1 and none is False
    assert_same_run(graph_losses, graph_params, eager_losses, eager_params, 1e-10, 1e-12)


@pytest.mark.gpu
@needs_gpu
def test_graph_mode_says_what_it_cannot_capture(capsys):
    with using_backend("cupy", "float32"):
        model, optimizer, task, batches = make_run("lm")
        trainer = trainer_of(model, SGD(model.parameters(), lr=0.1), task, batches,
                             cuda_graph=True)
        trainer.update()
    assert "CUDA graph: off (the graph's update is Adam's or AdamW's, not SGD's)" in \
        capsys.readouterr().out


MASKINGS = ("none", "causal", "padding, a row fully masked")


def _scores_and_mask(masking: str, dtype: str):
    """Scores (2, 3, 5, 7) on the GPU and a 4-axis mask of the kind named, or None."""
    import cupy

    rng = np.random.default_rng(6)
    scores = cupy.asarray(3 * rng.standard_normal((2, 3, 5, 7)).astype(dtype))
    if masking == "none":
        return scores, None
    if masking == "causal":
        i, j = np.arange(5)[:, None], np.arange(7)[None, :]
        return scores, cupy.asarray((j <= i + 2)[None, None])  # (1, 1, 5, 7)
    lengths = np.array([4, 0])  # the second sequence has no token: every key masked
    return scores, cupy.asarray((np.arange(7)[None, :] < lengths[:, None])[:, None, None])


@pytest.mark.parametrize("dtype,rtol", [("float32", 1e-5), ("float64", 1e-12)])
@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.gpu
@needs_gpu
def test_the_fused_softmax_kernels_equal_the_textbook_statements(masking, dtype, rtol):
    """softmax(alpha A + M) and alpha P (dP - rowsum(dP P)): one kernel each, against
    the textbook's softmax_forward and softmax_backward (a fully masked row: zeros)."""
    import cupy

    from npformer.gpu import attention
    from npformer.ops import softmax

    scale = 0.37
    scores, mask = _scores_and_mask(masking, dtype)
    expected, cache = softmax.softmax_forward(scores * scale, axis=-1, mask=mask)
    got = attention.fused_softmax(scores.copy(), scale, mask)
    np.testing.assert_allclose(got.get(), expected.get(), rtol=rtol, atol=rtol)
    dp = cupy.asarray(np.random.default_rng(7).standard_normal(scores.shape).astype(dtype))
    expected_ds = softmax.softmax_backward(dp, cache) * scale
    got_ds = attention.fused_softmax_backward(dp.copy(), got, scale)
    np.testing.assert_allclose(got_ds.get(), expected_ds.get(), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.gpu
@needs_gpu
def test_attention_in_a_captured_step_equals_the_textbook_op(masking):
    """The fast attention under graph_safe (cuBLAS products, the fused softmax) against
    the textbook op: outputs and every gradient, float64."""
    import cupy

    from npformer import ops
    from npformer.fast import attention

    with using_backend("cupy", "float64"):
        _, mask = _scores_and_mask(masking, "float64")
        rng = np.random.default_rng(8)
        q, k, v, dout = (cupy.asarray(rng.standard_normal(s)) for s in
                         ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6), (2, 3, 5, 6)))
        expected, cache = ops.attention_forward(q, k, v, mask)
        expected_grads = ops.attention_backward(dout, cache)
        with graph_safe():  # trusted, as inside a model: its door checked the inputs
            got, got_cache = run_trusted(attention.attention_forward, q, k, v, mask)
            got_grads = run_trusted(attention.attention_backward, dout, got_cache)
    np.testing.assert_allclose(got.get(), expected.get(), rtol=1e-12, atol=1e-12)
    for g, e in zip(got_grads, expected_grads):
        np.testing.assert_allclose(g.get(), e.get(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,rtol", [("float32", 1e-5), ("float64", 1e-12)])
@pytest.mark.gpu
@needs_gpu
def test_the_column_sums_equal_sum(dtype, rtol):
    import cupy

    from npformer.fast import gemm

    x = cupy.asarray(np.random.default_rng(9).standard_normal((1000, 37)).astype(dtype))
    with graph_safe():
        got = gemm.column_sum(x)
    np.testing.assert_allclose(got.get(), x.sum(axis=0).get(), rtol=rtol, atol=rtol * 30)


@pytest.mark.parametrize("value,wanted", [("1", True), (" Yes ", True), ("on", True),
                                          ("0", False), ("off", False), ("", False)])
def test_npformer_cuda_graph_is_read_as_a_boolean(value, wanted, monkeypatch):
    monkeypatch.setenv("NPFORMER_CUDA_GRAPH", value)
    with using_backend("numpy", "float64"):
        model, optimizer, task, batches = make_run("lm")
        assert trainer_of(model, optimizer, task, batches).cuda_graphs.wanted is wanted
        assert trainer_of(model, optimizer, task, batches, cuda_graph=not wanted
                          ).cuda_graphs.wanted is (not wanted)  # the config wins


@pytest.mark.parametrize("name", ["NPFORMER_CUDA_GRAPH", "NPFORMER_GPU_FUSED"])
def test_the_gpu_switches_refuse_what_is_not_a_boolean(name):
    """Anything but the boolean words stops at once, naming the variable and its value
    ("false" must not mean on: every value but "" and "0" once did)."""
    import os
    import subprocess
    import sys

    code = ("import npformer.train, npformer.gpu.cuda_graph as g, npformer.gpu.attention as a; "
            "a.fused(); g.wanted_by_environment()")  # read where used, not on import
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, name: "maybe"})
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: {name}='maybe' is not a boolean")
