"""The three Transformer architectures, built from :mod:`npformer.nn` layers."""
from .classifier import ClassifierConfig, TransformerClassifier
from .lm import CausalLM, CausalLMConfig
from .seq2seq import Seq2SeqConfig, Seq2SeqTransformer

MODELS = {cls.kind: cls for cls in (TransformerClassifier, CausalLM, Seq2SeqTransformer)}

__all__ = ["ClassifierConfig", "TransformerClassifier", "CausalLM", "CausalLMConfig",
           "Seq2SeqConfig", "Seq2SeqTransformer", "MODELS"]
