"""The models' configs take what users write (issue 37, case 21; case 20's old field
names given to ``dataclasses.replace`` went with the old names).

* NumPy integers, floats and bools are accepted where Python's are
  (``vocab_size=ids.max() + 1``), stored as Python's (so the config equals one built
  from Python numbers and saves to JSON), and a refused one reads as its value and type.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from npformer.checkpoint import load_checkpoint, save_checkpoint
from npformer.models import (
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
)
from npformer.train import TrainConfig
from tests.helpers import tiered

from .conftest import using_backend


# =========================================================================== case 21
def test_numpy_numbers_are_accepted_and_stored_as_pythons():
    ids = np.array([[3, 17], [0, 5]])
    config = ClassifierConfig(vocab_size=ids.max() + 1, num_classes=np.int32(3),
                              d_model=np.int64(8), num_heads=np.int16(2), num_layers=np.uint8(1),
                              d_ff=np.int64(16), block_size=np.int64(4),
                              dropout=np.float32(0.25), norm_first=np.bool_(True),
                              head_dim=np.int64(4), pad_id=np.int64(0))
    python = ClassifierConfig(vocab_size=18, num_classes=3, d_model=8, num_heads=2,
                              num_layers=1, d_ff=16, block_size=4, dropout=0.25,
                              norm_first=True, head_dim=4, pad_id=0)
    assert config == python
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        assert type(value) is type(getattr(python, field.name)), field.name
    seq2seq = Seq2SeqConfig(np.int64(10), np.int64(12), bos_id=np.int64(1), eos_id=np.int64(2),
                            scale_embeddings=np.bool_(False), dropout=np.float64(0.0))
    assert json.dumps(dataclasses.asdict(seq2seq))  # a checkpoint's config


def test_a_config_of_numpy_numbers_saves_and_loads(tmp_path):
    with using_backend("numpy", "float32"):
        model = tiered.CausalLM(CausalLMConfig(vocab_size=np.int64(7), block_size=np.int64(4),
                                        d_model=np.int64(8), num_heads=np.int64(2),
                                        num_layers=np.int64(1), d_ff=np.int64(8),
                                        tie_weights=np.bool_(False)))
        save_checkpoint(tmp_path / "m.npz", model)  # json.dumps refused np.int64
        assert load_checkpoint(tmp_path / "m.npz").config["vocab_size"] == 7


@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", np.int64(0), "vocab_size must be a positive integer, got 0 (int64)"),
    ("d_model", np.float64(8.0), "d_model must be a positive integer, got 8.0 (float64)"),
    ("dropout", np.float32(1.5), "dropout must be in [0, 1), got 1.5 (float32)"),
    ("dropout", np.bool_(False), "dropout must be in [0, 1), got False (bool)"),
    ("norm_first", np.int64(1), "norm_first must be True or False, got 1 (int64)"),
    ("pad_id", np.int64(-1), "pad_id must be a token id in [0, 10) (vocab_size=10), got -1 "
                             "(int64)"),
    ("head_dim", np.int64(0), "head_dim must be None or a positive integer, got 0 (int64)"),
    ("bigram_buckets", np.int64(-1), "bigram_buckets must be an integer >= 0, got -1 (int64)"),
    ("bigram_buckets", 2.5, "bigram_buckets must be an integer >= 0, got 2.5"),
])
def test_a_refused_numpy_value_reads_as_its_value_and_type(field, value, message):
    with pytest.raises(ValueError) as error:
        ClassifierConfig(**{"vocab_size": 10, field: value})
    assert str(error.value) == f"ClassifierConfig.{message}"
    assert "np." not in str(error.value)


# =========================================================================== issue 47
def test_the_training_config_takes_numpy_bools_as_the_model_configs_do():
    """issue 47 case 17: TrainConfig(cuda_graph=np.True_) was refused while the model
    configs accept NumPy bools; stored as Python's bool."""
    config = TrainConfig(max_iters=3, cuda_graph=np.True_, progress=np.False_)
    assert config.cuda_graph is True and config.progress is False
    assert TrainConfig(max_iters=3, cuda_graph=None).cuda_graph is None
    numbers = TrainConfig(max_iters=np.int64(3), eval_every=np.int32(2), max_seconds=np.int64(9))
    assert (type(numbers.max_iters), type(numbers.eval_every)) == (int, int)
    assert type(numbers.max_seconds) is float and numbers == TrainConfig(3, 9.0, eval_every=2)
    assert ClassifierConfig(vocab_size=10, qk_norm=np.True_).qk_norm is True


@pytest.mark.parametrize("make, match", [
    (lambda: TrainConfig(max_iters=3, cuda_graph="no"),
     "TrainConfig.cuda_graph must be True, False or None .* got 'no'"),
    (lambda: TrainConfig(max_iters=3, cuda_graph=1), "TrainConfig.cuda_graph must be True"),
    (lambda: TrainConfig(max_iters=3, progress="false"), "TrainConfig.progress must be True "
                                                          "or False, got 'false'"),
    (lambda: CausalLMConfig(vocab_size=10, tie_weights="false"),
     "CausalLMConfig.tie_weights must be True or False, got 'false'"),
    (lambda: Seq2SeqConfig(10, 11, norm_first=0), "norm_first must be True or False, got 0"),
])
def test_every_config_switch_refuses_what_is_not_a_bool(make, match):
    """One switch converter for every config's bool field (issue 47's switch kind; these
    were refused before too, and stay refused through the one converter)."""
    with pytest.raises((TypeError, ValueError), match=match):
        make()
