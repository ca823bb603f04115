"""Adam's update with bias correction and AdamW's decoupled weight decay (§17): the
reader's step against npformer.optim.AdamW's, update by update."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from exercises._step import StepCase, StepPart
from exercises.check import Exercise, Mistake
from exercises.course._draw import normal
from npformer.nn.module import Parameter
from npformer.optim import AdamW


def _init(param):
    return np.zeros_like(param), np.zeros_like(param)


def _step(param, grad, m, v, t, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
          weight_decay=0.01):
    """npformer.optim.AdamW's update t of one parameter, from the state (m, v) given."""
    p = Parameter(param.copy())
    optimizer = AdamW([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    optimizer.state["m"][0], optimizer.state["v"][0] = m.copy(), v.copy()
    optimizer.updates = t - 1
    p.grad = grad.copy()
    optimizer.step()
    return p.data, optimizer.state["m"][0], optimizer.state["v"][0]


def make(rng, shape, updates, lr, betas, weight_decay, scale):
    param = normal(rng, *shape)
    grads = normal(rng, updates, *shape, scale=scale)
    return StepCase([param], grads=grads, hyper=dict(lr=lr, beta1=betas[0], beta2=betas[1],
                                                     eps=1e-8, weight_decay=weight_decay))


HINTS = {
    "*": "Return the parameter, m and v after update t: m and v updated with the gradient "
         "as it is, the bias corrections 1 - beta^t in the step, AdamW's decay on the "
         "weights.",
    "param": "Bias correction: m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t), then "
             "param <- param - lr m_hat / (sqrt(v_hat) + eps), eps outside the square root; "
             "and, before it, AdamW's decoupled decay param <- param (1 - lr weight_decay) "
             "(the subsection AdamW: decoupled weight decay).",
    "m": "The first moment: m_t = beta1 m_{t-1} + (1 - beta1) g with the gradient as it is "
         "(AdamW's decay does not enter the gradient) and no bias correction kept in m.",
    "v": "The second moment: v_t = beta2 v_{t-1} + (1 - beta2) g^2, elementwise, the "
         "gradient as it is, no bias correction kept in v.",
}


# =========================================================================== the mistakes
def _adam(correct1=True, correct2=True, decay="decoupled", keep_hat=False):
    def step(param, grad, m, v, t, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
             weight_decay=0.01):
        if decay == "decoupled":
            param = param * (1 - lr * weight_decay)
        elif decay == "gradient":  # L2 in the gradient: Adam's, not AdamW's
            grad = grad + weight_decay * param
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad * grad
        m_hat = m / (1 - beta1**t) if correct1 else m
        v_hat = v / (1 - beta2**t) if correct2 else v
        param = param - lr * m_hat / (np.sqrt(v_hat) + eps)
        if keep_hat:  # the corrected moments kept as the state
            return param, m_hat, v_hat
        return param, m, v
    return step


EXERCISE = Exercise(
    name="adam", file="adam.py", section="Adam, with bias correction",
    parts=[StepPart(
        forward="adam_init", backward="adam_step", textbook=(_init, _step),
        grads=("param", "m", "v"), wrt=(), make=make,
        sizes=dict(shape=st.lists(st.integers(1, 4), min_size=1, max_size=2),
                   updates=st.integers(1, 5), lr=st.sampled_from([1e-3, 0.05, 0.3]),
                   betas=st.sampled_from([(0.9, 0.999), (0.8, 0.9), (0.5, 0.99)]),
                   weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
                   scale=st.sampled_from([1.0, 1e-3, 30.0])),
        edge_cases=[("three updates, weight decay 0.1",
                     dict(shape=[2, 3], updates=3, lr=0.1, betas=(0.9, 0.999),
                          weight_decay=0.1, scale=1.0)),
                    ("one update of a scalar-like parameter, no decay",
                     dict(shape=[1], updates=1, lr=0.1, betas=(0.9, 0.999),
                          weight_decay=0.0, scale=1.0)),
                    ("five updates, beta2 = 0.9", dict(shape=[4], updates=5, lr=0.05,
                                                       betas=(0.8, 0.9), weight_decay=0.01,
                                                       scale=2.0))],
        hints=HINTS)],
    mistakes=[
        Mistake("the bias correction forgotten", "param", _adam(correct1=False,
                                                                correct2=False)),
        Mistake("the second moment's bias correction forgotten", "param",
                _adam(correct2=False)),
        Mistake("weight decay added to the gradient (Adam's L2), not decoupled", "m",
                _adam(decay="gradient")),
        Mistake("the bias-corrected moments kept as the state", "v", _adam(keep_hat=True)),
        Mistake("the weight decay forgotten", "param", _adam(decay=None)),
    ],
)
