# %% [markdown]
# # Exercise: the backward of an embedding table
#
# Derivation: docs/derivations.md, §11 Embedding
#
# The forward is given: each id picks its row of the table.  Write `embedding_backward`:
# from the upstream gradient `dy` and the saved values, the gradient `dtable` of the table (the
# integer ids have none).  An id may appear more than once.
#
# Check it: `python exercises/check.py embedding` (from the repository's root),
# or run the last cell.

# %%
import numpy as np  # noqa: F401  (yours to use)


# %%
def embedding_forward(ids, table):
    """ids (...) integers in [0, V), table (V, D) -> y (..., D), saved (ids, V)."""
    return table[ids], (ids, table.shape[0])


# %%
def embedding_backward(dy, saved):
    """dy (..., D) -> dtable (V, D)."""
    ids, vocab_size = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/embedding.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "embedding.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("embedding", module=sys.modules[__name__]))
