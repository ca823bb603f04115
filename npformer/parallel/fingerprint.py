"""Rank comparison by hashing: do every rank's values agree, and if not, which differ?

Each rank hashes its values (a configuration, a model's signature, a batch) into short
digests; the ranks gather the digests, not the values, and every rank finds the same
differences (:func:`differences`), so every rank refuses together, naming the field.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from .. import backend


def fingerprints(values: dict) -> dict[str, tuple[str, str]]:
    """{"a.b": (digest, shortened repr)} of every leaf of ``values`` (dicts and
    dataclasses opened, so that a difference names its field)."""
    return {name: (digest(value), _short(value)) for name, value in _flatten(values).items()}


def differences(everyone: list[dict[str, tuple[str, str]]]) -> list[str]:
    """What differs between the ranks' :func:`fingerprints` (rank r's at index r): one
    line per name, grouping the ranks that agree and showing their values."""
    problems = []
    for name in sorted(set().union(*everyone)):
        seen: dict[str, tuple[str, list[int]]] = {}
        for rank, entries in enumerate(everyone):
            found, text = entries.get(name, ("(missing)", "(not given)"))
            seen.setdefault(found, (text, []))[1].append(rank)
        if len(seen) > 1:
            groups = "; ".join(f"ranks {ranks}: {text}" for text, ranks in seen.values())
            problems.append(f"{name} differs between ranks ({groups})")
    return problems


def digest(value: Any) -> str:
    """A short hash: of the contents where ``value`` is an array or a tuple of arrays (a
    batch), else of its ``repr``."""
    arrays = _arrays(value)
    if arrays is not None:
        return batch_fingerprint(arrays)
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def batch_fingerprint(batch: tuple) -> str:
    """A hash of a batch's arrays (shapes, dtypes, contents): equal batches, equal hashes."""
    hashed = hashlib.sha256()
    for array in batch:
        array = np.ascontiguousarray(backend.to_numpy(array))
        hashed.update(repr((array.shape, str(array.dtype))).encode())
        hashed.update(array.tobytes())
    return hashed.hexdigest()[:16]


def _arrays(value: Any) -> tuple | None:
    """``value`` as a tuple of arrays where it is an array or a tuple of them, else None."""
    items = value if isinstance(value, tuple) else (value,)
    is_array = [getattr(item, "ndim", 0) >= 1 and hasattr(item, "dtype") for item in items]
    return items if items and all(is_array) else None


def _flatten(values: dict, prefix: str = "") -> dict:
    """{"a.b": leaf}: dicts and dataclasses opened (so a message names the field)."""
    flat = {}
    for name, value in values.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            flat.update(_flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _short(value: Any, limit: int = 160) -> str:
    arrays = _arrays(value)
    if arrays is not None:
        return "arrays " + ", ".join(f"{a.dtype}{tuple(a.shape)}" for a in arrays)
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
