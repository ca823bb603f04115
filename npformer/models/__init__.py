"""The three Transformer architectures, built from :mod:`npformer.nn` layers."""
from . import common
from .classifier import ClassifierConfig, TransformerClassifier
from .llama import LlamaCausalLM, LlamaConfig
from .lm import CausalLM, CausalLMConfig
from .seq2seq import Seq2SeqConfig, Seq2SeqTransformer

# by kind, as checkpoints name them
MODELS = {cls.kind: cls for cls in (TransformerClassifier, CausalLM, Seq2SeqTransformer,
                                    LlamaCausalLM)}
common.TEXTBOOK_MODELS.update({cls.config_class: cls for cls in MODELS.values()})

__all__ = ["ClassifierConfig", "TransformerClassifier", "CausalLM", "CausalLMConfig",
           "Seq2SeqConfig", "Seq2SeqTransformer", "LlamaConfig", "LlamaCausalLM", "MODELS"]
