"""One name per idea (issue 17 item 7): PyTorch's and nanoGPT's, everywhere.

* model width ``d_model``, head count ``num_heads``, context length ``block_size``, updates
  of a run ``max_iters``: no model config, ``TrainConfig`` or demo preset spells one of
  them another way, and an old name is an unknown keyword (npformer is unreleased: no
  old name is kept for anyone);
* the demos' ``--help`` shows the option names.
"""
from __future__ import annotations

import dataclasses

import pytest

from npformer.models import (
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
)
from npformer.optim import warmup_cosine
from npformer.train import TrainConfig

from .test_demos import load_demo

OLD_NAMES = {"width", "heads", "max_len", "block", "iters", "steps", "max_steps", "layers",
             "total_steps"}
SCRIPTS = ("imdb.py", "translate.py", "generate.py")


# =========================================================================== one name
@pytest.mark.parametrize("cls", [ClassifierConfig, CausalLMConfig, Seq2SeqConfig, TrainConfig],
                         ids=lambda c: c.__name__)
def test_no_config_field_has_an_old_name(cls):
    assert not {f.name for f in dataclasses.fields(cls)} & OLD_NAMES


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_preset_field_has_an_old_name(script):
    names = {f.name for f in dataclasses.fields(load_demo(script).Preset)}
    assert not names & OLD_NAMES, names & OLD_NAMES


@pytest.mark.parametrize("make", [
    lambda: TrainConfig(max_steps=7),
    lambda: ClassifierConfig(vocab_size=10, max_len=9),
    lambda: Seq2SeqConfig(10, 11, max_len=9),
    lambda: warmup_cosine(1e-3, 2, total_steps=9),
    lambda: load_demo("generate.py").Preset(width=16),
])
def test_an_old_keyword_is_unknown(make):
    with pytest.raises(TypeError, match="unexpected keyword"):
        make()


# =========================================================================== the options
@pytest.mark.parametrize("script,options", [
    ("generate.py", ["--max-iters", "--block-size", "--num-heads", "--d-model"]),
    ("imdb.py", ["--num-heads", "--block-size", "--d-model"]),
    ("translate.py", ["--num-heads", "--max-iters", "--d-model"]),
])
def test_help_shows_the_new_option_names(script, options):
    text = load_demo(script).build_parser().format_help()
    for option in options:
        assert option in text, option
