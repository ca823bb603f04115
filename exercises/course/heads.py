"""Multi-head attention's split and merge of the heads: reshapes and transposes."""
from __future__ import annotations

from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal
from npformer.nn import merge_heads, split_heads


# npformer has no op for these (they are functions of npformer.nn): the textbook pairs.
def _split_forward(x, num_heads):
    return split_heads(x, num_heads), num_heads


def _split_backward(dy, num_heads):
    return merge_heads(dy)


def _merge_forward(x):
    return merge_heads(x), x.shape[1]


def _merge_backward(dy, num_heads):
    return split_heads(dy, num_heads)


def make_split(rng, b, t, h, e):
    return Case([normal(rng, b, t, h * e), h])


def make_merge(rng, b, t, h, e):
    return Case([normal(rng, b, h, t, e)])


SIZES = dict(b=st.integers(1, 2), t=st.integers(1, 4), h=st.integers(1, 3), e=st.integers(1, 3))
EDGES = [("several heads and positions", dict(b=2, t=3, h=2, e=2)),
         ("one position", dict(b=1, t=1, h=3, e=2)),
         ("one head", dict(b=2, t=3, h=1, e=2))]
HINT = ("Backward of split and merge: a reshape or a transpose only moves entries, so "
        "its backward moves each gradient back to where its entry came from: split's "
        "backward is merge, merge's is split (the transpose undone before the reshape).")


def _split_as_reshape(dy, num_heads):
    batch, heads, length, width = dy.shape
    dx = dy.reshape(batch, length, heads * width)
    return dx


def _split_heads_last(dy, num_heads):
    batch, heads, length, width = dy.shape
    return dy.transpose(0, 2, 3, 1).reshape(batch, length, heads * width)


def _merge_as_reshape(dy, num_heads):
    batch, length, width = dy.shape
    return dy.reshape(batch, num_heads, length, width // num_heads)


def _merge_width_first(dy, num_heads):
    batch, length, width = dy.shape
    dx = dy.reshape(batch, length, width // num_heads, num_heads).transpose(0, 3, 1, 2)
    return dx


EXERCISE = Exercise(
    name="heads", file="heads.py", section="Multi-head attention",
    parts=[
        Part(forward="split_heads_forward", backward="split_heads_backward",
             textbook=(_split_forward, _split_backward), grads=("dx",), wrt=(0,),
             make=make_split, sizes=SIZES, edge_cases=EDGES, hints={"dx": HINT}),
        Part(forward="merge_heads_forward", backward="merge_heads_backward",
             textbook=(_merge_forward, _merge_backward), grads=("dx",), wrt=(0,),
             make=make_merge, sizes=SIZES, edge_cases=EDGES, hints={"dx": HINT}),
    ],
    mistakes=[
        Mistake("split's backward as a plain reshape", "dx", _split_as_reshape),
        Mistake("split's backward with the heads last, (B, T, E, H)", "dx", _split_heads_last),
        Mistake("merge's backward as a plain reshape", "dx", _merge_as_reshape,
                part="merge_heads_backward"),
        Mistake("merge's backward with the width cut (E, H)", "dx", _merge_width_first,
                part="merge_heads_backward"),
    ],
)
