"""One entry for a Hugging Face folder of any family, as transformers'
``AutoModelForCausalLM``: the folder's config.json names its ``model_type``, which picks
the class, in the tier asked.

    from npformer.interop import auto

    model = auto.from_pretrained("path/to/folder", tier="fast")  # or a Hub name
    model, tokenizer = auto.load("path/to/folder")               # tier="textbook"

| model_type          | tier="textbook"                 | tier="fast"                   |
|---------------------|---------------------------------|-------------------------------|
| gpt2                | ``npformer.models.CausalLM``      | ``npformer.fast.CausalLM``      |
| llama, qwen2, qwen3 | ``npformer.models.LlamaCausalLM`` | ``npformer.fast.LlamaCausalLM`` |

A family not listed is refused naming the known ones.  Each class's own
``from_pretrained`` loads a folder of its family, ``model.save_pretrained(folder)`` writes
one; the tokenizer of any family is ``npformer.hf.gpt2.Tokenizer.from_pretrained``.  This
module sits above the fast tier (it names its classes).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import models
from ..hf.gpt2 import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    PretrainedError,
    Tokenizer,
    _json_object,
    check_tokenizer,
    resolve,
)
from ..nn import Module
from ..ops.contracts import check_choice

FAMILIES = {"gpt2": "CausalLM", "llama": "LlamaCausalLM", "qwen2": "LlamaCausalLM",
            "qwen3": "LlamaCausalLM"}  # config.json's model_type -> npformer's class name
TIERS = ("textbook", "fast")
KIND = "GPT-2, Llama or Qwen"  # the checkpoints read here, as the messages name them


def model_class(model_type: str, tier: str = "textbook") -> type:
    """The class of a ``model_type`` (config.json's: gpt2, llama, qwen2, qwen3) in ``tier``
    ("textbook": :mod:`npformer.models`; "fast": :mod:`npformer.fast`)."""
    check_choice(tier, TIERS, "tier")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise PretrainedError(f"npformer has no model of model_type {model_type!r}: it loads "
                              f"{', '.join(FAMILIES)}")
    if tier == "fast":
        from .. import fast  # the compiled tier, imported when asked for
        return getattr(fast, FAMILIES[model_type])
    return getattr(models, FAMILIES[model_type])


def model_type_of(folder: Path) -> str:
    """config.json's ``model_type`` of a folder, refused naming the file where absent or
    not a known family."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise PretrainedError(f"{folder} has no {CONFIG_FILE}: a Hugging Face folder holds "
                              f"{CONFIG_FILE} and {WEIGHTS_FILE} (or its shards)")
    family = _json_object(path, "a model config").get("model_type")
    if not isinstance(family, str) or family not in FAMILIES:
        raise PretrainedError(f"{path} describes a {family!r} model (model_type): npformer "
                              f"loads {', '.join(FAMILIES)}")
    return family


def from_pretrained(name_or_path: str | os.PathLike, tier: str = "textbook",
                    dtype: str | None = None, **kwargs: Any) -> Module:
    """The model of a Hugging Face folder (or Hub name, downloaded into the user's cache
    where the network allows) of any family npformer reads, of the class its model_type
    names in ``tier`` (:func:`model_class`): ``cls.from_pretrained(folder, dtype=dtype,
    **kwargs)`` (GPT-2's also takes ``dropout``)."""
    check_choice(tier, TIERS, "tier")
    folder = resolve(name_or_path, KIND)
    return model_class(model_type_of(folder), tier).from_pretrained(folder, dtype=dtype,
                                                                   **kwargs)


def load(name_or_path: str | os.PathLike, tier: str = "textbook", dtype: str | None = None,
         **kwargs: Any) -> tuple[Module, Tokenizer]:
    """The model (:func:`from_pretrained`) and the tokenizer
    (:meth:`Tokenizer.from_pretrained`) of a folder or Hub name of any family, the tokenizer
    checked against the model: its ids index the model's embeddings."""
    folder = resolve(name_or_path, KIND)
    model = from_pretrained(folder, tier, dtype=dtype, **kwargs)
    tokenizer = Tokenizer.from_pretrained(folder)
    check_tokenizer(tokenizer, model)
    return model, tokenizer


__all__ = ["from_pretrained", "load", "model_class", "model_type_of", "FAMILIES", "TIERS"]
