# %% [markdown]
# # Exercise: the backward of adding positions
#
# Derivation: docs/derivations.md, §12 Positional encodings
#
# The forward is given: the first T rows of a table of positions (L, D), L >= T, added to
# every sequence of x (B, T, D).  The table is a learned one or the fixed sinusoidal one;
# either way, write `add_positions_backward`: from the upstream gradient `dy` and the
# saved, the gradients `dx` and `dtable` (of the whole table, (L, D)).
#
# Check it: `python exercises/check.py positions` (from the repository's root),
# or run the last cell.

# %%
import numpy as np  # noqa: F401  (yours to use)


# %%
def add_positions_forward(x, table):
    """x (B, T, D), table (L, D) with T <= L -> y (B, T, D), saved (T, L)."""
    length = x.shape[1]
    return x + table[:length][None, :, :], (length, table.shape[0])


# %%
def add_positions_backward(dy, saved):
    """dy (B, T, D) -> dx (B, T, D), dtable (L, D)."""
    length, table_length = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/positions.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "positions.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("positions", module=sys.modules[__name__]))
