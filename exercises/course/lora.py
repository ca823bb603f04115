"""LoRA: y = x W + b + scale * dropout(x) A B, W and b frozen; the adapter's A and B and
the input x take gradients."""
from __future__ import annotations

from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal
from exercises.course._later import _built, dropout_bw
from npformer.nn import Linear
from npformer.nn.lora import LoRALinear


def _textbook_forward(x, w, b, lora_a, lora_b, scale, p=0.0, training=True):
    d_in, r = lora_a.shape
    layer = _built(lambda: LoRALinear(Linear(d_in, w.shape[1]), r, alpha=scale * r,
                                      dropout=p))
    layer.weight.data, layer.bias.data = w, b
    layer.lora_A.data, layer.lora_B.data = lora_a, lora_b
    layer.train(training)
    layer.zero_grad()
    return layer(x), layer


def _textbook_backward(dy, layer):
    dx = layer.backward(dy)
    assert layer.weight.grad is None, "the frozen W took a gradient"
    return dx, layer.lora_A.grad, layer.lora_B.grad


def make(rng, lead, d_in, d_out, r, p, training):
    return Case([normal(rng, *lead, d_in), normal(rng, d_in, d_out), normal(rng, d_out),
                 normal(rng, d_in, r), normal(rng, r, d_out), float(rng.uniform(0.25, 4.0)), p],
                {"training": training}, seed=int(rng.integers(2**31)))


# =========================================================================== the mistakes
def _rows(a):
    return a.reshape(-1, a.shape[-1])


def _with(scale_in_db=True, scale_in_du=True, adapter_path=True, dropout=True,
          da_transposed=False, frozen_w=False):
    def backward(dy, saved):
        x_dropped, u, w, lora_a, lora_b, scale, dropped = saved
        du = (scale if scale_in_du else 1.0) * (dy @ lora_b.T)
        da = _rows(x_dropped).T @ _rows(du)
        if da_transposed:
            da = _rows(du).T @ _rows(x_dropped)
        db = (scale if scale_in_db else 1.0) * (_rows(u).T @ _rows(dy))
        dx_dropped = du @ lora_a.T
        dx = dy @ w.T
        if adapter_path:
            dx = dx + (dropout_bw(dx_dropped, dropped) if dropout else dx_dropped)
        if frozen_w:  # W's gradient returned as well: the frozen map trained
            return dx, _rows(x_dropped).T @ _rows(dy), da, db
        return dx, da, db
    return backward


EXERCISE = Exercise(
    name="lora", file="lora.py", section="Low-rank adapters", order=1,
    parts=[Part(
        forward="lora_forward", backward="lora_backward",
        textbook=(_textbook_forward, _textbook_backward), grads=("dx", "dA", "dB"),
        wrt=(0, 3, 4), make=make,
        sizes=dict(lead=st.lists(st.integers(1, 3), min_size=1, max_size=2),
                   d_in=st.integers(1, 5), d_out=st.integers(1, 5), r=st.integers(1, 3),
                   p=st.sampled_from([0.0, 0.3]), training=st.booleans()),
        edge_cases=[("a batch of sequences, dropout 0.3",
                     dict(lead=[2, 3], d_in=4, d_out=3, r=2, p=0.3, training=True)),
                    ("one row, rank 1", dict(lead=[1], d_in=3, d_out=2, r=1, p=0.0,
                                             training=True)),
                    ("evaluation: no dropout", dict(lead=[2], d_in=3, d_out=4, r=2, p=0.5,
                                                    training=False))],
        hints={
            "dB": "Low-rank adapters, Backward: dB = scale (x^A)^T dy summed over every row, "
                  "x^A = dropout(x) A (the saved values' u); the scale alpha / r comes back.",
            "dA": "Low-rank adapters, Backward: dx^A = scale dy B^T, then dA = "
                  "dropout(x)^T dx^A over every row: the adapter's own input, after its "
                  "dropout, and the scale inside dx^A.",
            "dx": "Low-rank adapters, Backward: x reaches y two ways: dx = dy W^T (the "
                  "frozen map) + dropout's backward (§5) of dx_drop = dx^A A^T, "
                  "dx^A = scale dy B^T.",
            "*": "Low-rank adapters, Backward: W and b are frozen: their gradients are not "
                 "computed; return dx, dA, dB.",
        },
    )],
    mistakes=[
        Mistake("LoRA's scale left out of dB", "dB", _with(scale_in_db=False)),
        Mistake("LoRA's scale left out of dx^A (dA and dx)", "dx", _with(scale_in_du=False)),
        Mistake("the adapter's path into dx left out (dx = dy W^T)", "dx",
                _with(adapter_path=False)),
        Mistake("dA = dx^A^T dropout(x), transposed", "dA", _with(da_transposed=True)),
        Mistake("a gradient for the frozen W returned as well", "lora_backward",
                _with(frozen_w=True)),
    ],
)
