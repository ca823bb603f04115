"""Every public class of npformer says what it is: ``help()`` shows a class docstring.

Public: a class exported by a public module of the package (its ``__all__``, or its
names without a leading underscore), walked over every subpackage.  A dataclass
without a docstring gets its signature as ``__doc__``; that does not count.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import pydoc

import npformer


def public_modules():
    for info in pkgutil.walk_packages(npformer.__path__, "npformer."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            yield importlib.import_module(info.name)


def public_classes() -> dict[str, type]:
    """{qualified name: class} of every class a public npformer module exports."""
    found = {}
    for module in [npformer, *public_modules()]:
        names = getattr(module, "__all__", None) or [n for n in vars(module)
                                                     if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name, None)
            if inspect.isclass(obj) and obj.__module__.startswith("npformer"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def has_own_docstring(cls: type) -> bool:
    doc = vars(cls).get("__doc__")
    return bool(doc and doc.strip()) and not doc.startswith(f"{cls.__name__}(")


def test_the_walk_finds_the_classes_a_user_meets():
    names = set(public_classes())
    for expected in ("npformer.nn.attention.MultiHeadAttention",
                     "npformer.models.classifier.TransformerClassifier",
                     "npformer.models.lm.CausalLMConfig",
                     "npformer.models.seq2seq.Seq2SeqTransformer",
                     "npformer.optim.AdamW", "npformer.train.tasks.Classification",
                     "npformer.train.loop.Trainer", "npformer.train.config.TrainConfig",
                     "npformer.data.vocab.Vocab",
                     "npformer.data.files.TextClassificationData"):
        assert expected in names, f"{expected} was not found among the public classes"


def test_every_public_class_has_a_docstring():
    missing = sorted(name for name, cls in public_classes().items()
                     if not has_own_docstring(cls))
    assert not missing, "public classes without a docstring:\n" + "\n".join(missing)


def test_help_shows_the_attention_docstring():
    text = pydoc.render_doc(npformer.nn.MultiHeadAttention, renderer=pydoc.plaintext)
    assert "Multi-head scaled dot-product attention" in text
    assert "need_weights" in text
