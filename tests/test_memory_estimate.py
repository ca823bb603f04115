"""A model too large for the machine is refused before it is built (issue 37, case 27:
``--d-model 1000000000000`` and ``--block-size 100000000000`` ended in NumPy's
``_ArrayMemoryError``).

* :func:`parameter_count` is the built model's ``num_parameters()``, for every kind and
  option that changes it: the model's own, built with shapes only
  (:func:`npformer.backend.shapes_only`), which allocates no weight and draws no random
  number;
* :func:`training_memory` counts 4 floats a parameter, the sinusoidal tables and a
  batch's least activations; :func:`check_training_fits` refuses what exceeds the
  memory, naming the options that made the model large and the sizes;
* the demos refuse such a run with one ``error:`` line, exit status 2, and no weight
  allocated.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npformer import cli
from npformer.cli.memory import (
    check_training_fits,
    machine_memory,
    parameter_count,
    training_memory,
)
from npformer.models import (
    CausalLM,
    CausalLMConfig,
    ClassifierConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
    TransformerClassifier,
)
from npformer.models.common import check_weights_fit

from .conftest import using_backend
from .test_demos import SMOKE, load_demo, run_demo

shapes = st.fixed_dictionaries({
    "d_model": st.sampled_from([4, 6, 8]), "num_heads": st.sampled_from([1, 2]),
    "d_ff": st.integers(1, 9), "block_size": st.integers(1, 9),
    "norm_first": st.booleans(), "positional": st.sampled_from(["learned", "sinusoidal"]),
    "head_dim": st.sampled_from([None, 3]), "qk_norm": st.booleans()})


@settings(max_examples=40, deadline=None)
@given(shape=shapes, layers=st.integers(1, 3), decoder_layers=st.integers(1, 2),
       vocab=st.integers(2, 20), classes=st.integers(2, 5), tie=st.booleans(),
       bigrams=st.sampled_from([0, 7]))
def test_the_count_is_the_built_models(shape, layers, decoder_layers, vocab, classes, tie,
                                       bigrams):
    with using_backend("numpy", "float32"):
        for config, model in [
            (ClassifierConfig(vocab_size=vocab, num_classes=classes, num_layers=layers,
                              bigram_buckets=bigrams, **shape), TransformerClassifier),
            (CausalLMConfig(vocab_size=vocab, num_layers=layers, tie_weights=tie, **shape),
             CausalLM),
            (Seq2SeqConfig(vocab, vocab + 3, num_encoder_layers=layers,
                           num_decoder_layers=decoder_layers, tie_weights=tie, **shape),
             Seq2SeqTransformer),
        ]:
            assert parameter_count(config) == model(config).num_parameters(), config


def test_the_count_allocates_no_weight_and_draws_no_random_number():
    from npformer import backend
    from npformer.models.common import shape_model

    with using_backend("numpy", "float32", seed=5):
        before = backend.get_rng_state()
        config = CausalLMConfig(vocab_size=10**12, d_model=64)  # 232 TiB of weights
        model = shape_model(config)
        assert all(type(p.data) is backend.Shape for p in model.parameters())
        assert parameter_count(config) == model.num_parameters() == 64000000336256
        assert backend.get_rng_state() == before
        assert not backend.making_shapes()  # the block is left


def test_the_memory_by_hand():
    lm = CausalLMConfig(vocab_size=10, block_size=6, d_model=4, num_heads=2, num_layers=3,
                        d_ff=8, positional="sinusoidal")
    estimate = training_memory(lm, batch_size=5, sequence_length=6, itemsize=4)
    assert estimate.model_bytes == 4 * (4 * parameter_count(lm) + 6 * 4)  # + the table
    assert estimate.batch_bytes == 4 * 5 * 6 * (4 * 3 + 10)  # block inputs, logits
    assert estimate.total(copies=3) == 3 * estimate.model_bytes + estimate.batch_bytes
    classifier = ClassifierConfig(vocab_size=10, num_classes=3, d_model=4, num_heads=2,
                                  num_layers=2, d_ff=8, block_size=6)
    assert training_memory(classifier, 5, 6, 8).batch_bytes == 8 * (5 * 6 * 4 * 2 + 5 * 3)


@dataclass(frozen=True)
class Sizes:
    d_model: int = 8
    block_size: int = 16
    num_layers: int = 1
    lr: float = 1e-3


def _config(sizes: Sizes) -> CausalLMConfig:
    return CausalLMConfig(vocab_size=10, block_size=sizes.block_size, d_model=sizes.d_model,
                          num_heads=2, num_layers=sizes.num_layers, d_ff=4 * sizes.d_model)


@pytest.mark.parametrize("sizes, named, lower", [
    (Sizes(d_model=10**12), "--d-model 1000000000000 makes the model too large", "--d-model"),
    (Sizes(block_size=10**11), "--block-size 100000000000 makes", "--block-size"),
    (Sizes(d_model=8 * 64, num_layers=50), "--d-model 512 and --num-layers 50 make",
     "--d-model or --num-layers"),
    (Sizes(), "the model is too large", None),  # none raised: the preset itself
])
def test_a_model_too_large_is_refused_naming_the_options_and_sizes(sizes, named, lower):
    config = _config(sizes)
    with pytest.raises(cli.DemoError) as error:
        check_training_fits(config, 4, sizes.block_size, sizes, Sizes(), "float32",
                            copies=1, available=(1000, "this machine has"))
    message = str(error.value)
    assert message.startswith(named), message
    assert f"{parameter_count(config):,} parameters" in message
    assert "this machine has 1000 bytes" in message
    assert message.endswith(f"Lower {lower}." if lower else "Choose smaller settings.")


def test_a_model_that_fits_is_accepted_with_its_estimate():
    config = _config(Sizes())
    estimate = check_training_fits(config, 4, 16, Sizes(), Sizes(), "float64", copies=2,
                                   available=(10**9, "this machine has"))
    assert estimate == training_memory(config, 4, 16, itemsize=8)
    needed = estimate.total(copies=2)
    with pytest.raises(cli.DemoError, match="the model held by each of 2 processes"):
        check_training_fits(config, 4, 16, Sizes(), Sizes(), "float64", copies=2,
                            available=(needed - 1, "this machine has"))


def test_every_demos_default_run_fits_this_machine():
    """The check never refuses what the README runs (the stand-in vocabularies are the
    real data's sizes, bench/configs.py)."""
    memory, _ = machine_memory()
    imdb, generate, translate = (load_demo(f"{name}.py") for name in
                                 ("imdb", "generate", "translate"))

    class Vocabulary:
        def __init__(self, size):
            self.size, self.pad_id, self.bos_id, self.eos_id = size, 0, 2, 3

        def __len__(self):
            return self.size

    for config, preset in [
        (imdb.model_config(imdb.PRESETS["large"], 20_002, 0), imdb.PRESETS["large"]),
        (generate.model_config(generate.PRESETS["default"], 65), generate.PRESETS["default"]),
        (translate.model_config(translate.PRESETS["default"], Vocabulary(5_568),
                                Vocabulary(7_210)), translate.PRESETS["default"]),
    ]:
        assert training_memory(config, preset.batch_size, config.block_size).total() < memory


@pytest.mark.parametrize("script, data, option, value", [
    ("generate.py", "notes.txt", "--d-model", "1000000000000"),
    ("imdb.py", "mine.csv", "--block-size", "100000000000"),
    ("translate.py", "pairs.tsv", "--d-model", "1000000000000"),
])
def test_the_demos_refuse_it_in_one_line(script, data, option, value, tmp_path):
    files = {"notes.txt": "to be or not to be, that is the question\n" * 40,
             "mine.csv": "text,label\n" + "".join(f"review number {i},{'ab'[i % 2]}\n"
                                                  for i in range(40)),
             "pairs.tsv": "".join(f"go {i} .\tva {i} .\n" for i in range(60))}
    (tmp_path / data).write_text(files[data])
    extra = ["--heldout", "5"] if script == "translate.py" else []
    result = run_demo(script, *SMOKE, "--no-progress", "--data", str(tmp_path / data), "--out",
                      str(tmp_path / "run"), option, value, *extra)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {option} {value} makes the model too large"), last
    assert last.endswith(f"Lower {option}."), last
    assert not (tmp_path / "run" / "model.npz").exists()


@pytest.mark.parametrize("make, field", [
    (lambda: TransformerClassifier(ClassifierConfig(vocab_size=10, bigram_buckets=10**12)),
     "bigram_buckets"),
    (lambda: CausalLM(CausalLMConfig(vocab_size=10**12, d_model=64)), "vocab_size"),
    (lambda: CausalLM(CausalLMConfig(vocab_size=10, block_size=10**12, d_model=64)),
     "block_size"),
    (lambda: Seq2SeqTransformer(Seq2SeqConfig(10, 10**13)), "tgt_vocab_size"),
    (lambda: TransformerClassifier(ClassifierConfig(vocab_size=10, d_model=64, num_heads=2,
                                                    d_ff=10**11)), "d_ff"),
])
def test_a_model_whose_weights_cannot_fit_is_refused_before_allocating(make, field):
    """issue 47 case 11: TransformerClassifier(bigram_buckets=10**12) ended in
    "MemoryError: Unable to allocate 116. TiB", naming no field.  The library bounds
    every model's weights before it allocates one, naming its largest table's field, the
    bytes and the memory there is (parameter_count, the demos' estimate)."""
    with pytest.raises(ValueError, match=f"for its weights alone, and this .* its largest "
                                         f"table \\({field}=.*; lower {field}$"):
        make()


def test_the_weights_bound_is_the_parameter_count_in_the_backends_float():
    config = ClassifierConfig(vocab_size=10, bigram_buckets=100)
    count = parameter_count(config)
    check_weights_fit(config, 4, available=(4 * count, "here"))  # fits exactly
    with pytest.raises(ValueError, match=f"{count:,} parameters, .* in float32 for its weights "
                                         "alone, and here 2.9 KiB"):
        check_weights_fit(config, 4, available=(3000, "here"))


@pytest.mark.parametrize("fields", [{}, {"num_kv_heads": 1, "qk_norm": True, "head_dim": 6,
                                     "attention_bias": True, "tie_weights": False},
                                    {"num_kv_heads": 2, "qkv_bias": True}])
def test_a_llama_config_is_counted_as_its_model_holds(fields):
    """parameter_count (what the memory check reads) counts a LlamaConfig's parameters as
    the built model holds them: biases, QK-norm, shared key/value heads, an untied head."""
    from npformer.models import LlamaCausalLM, LlamaConfig
    from npformer.models.common import parameter_count

    config = LlamaConfig(vocab_size=11, d_model=8, d_ff=12,
                         num_layers=2, num_heads=2, **fields)
    assert parameter_count(config) == LlamaCausalLM(config).num_parameters()
    assert training_memory(config, 2, 8).parameters == parameter_count(config)
