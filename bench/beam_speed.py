"""Beam search speed: all sentences of a chunk at once (``beam_search``) against one
sentence at a time (``_beam_search_reference``, the implementation it replaced, kept
in tests/beam_reference.py as the reference the tests compare with).

    python bench/beam_speed.py                  # 200 held-out sentences, beam 4, 3 rounds
    python bench/beam_speed.py --sentences 40 --rounds 1   # quick look

The model is the translation demo's default (d_model 256, 4 heads, 2 + 2 layers,
FFN 1024, block_size 17, vocabularies built from the demo's training split of
fra-eng.zip), freshly initialised, or the trained one of ``--checkpoint``
(``runs/translate/model.npz`` after ``python demos/translate.py``).  An untrained
model rarely ends a hypothesis with <eos>, so most searches run to the length limit
(17 tokens): the worst case for both, with the same number of decoder steps for both;
a trained model's searches end early, at different steps for different sentences.
Sentences are decoded in chunks of ``--chunk`` (the demo's 64), each chunk padded to
its longest source, as ``demos/translate.py`` does.

The two are timed alternately (old, new, old, new, ...) in one process so that load
from other processes falls on both; the medians and their ratio are printed, and the
two must give the same hypotheses (counted: in float32 a near-tie can be broken
differently when batch composition changes a logit's last bit).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path[:1]:  # `python bench/beam_speed.py`: the tests' reference search
    sys.path.insert(0, str(ROOT))

from npformer import backend, fast  # noqa: E402
from npformer.cli import positive_int  # noqa: E402
from npformer.data import (  # noqa: E402
    Vocab,
    load_fra_eng,
    pad_batch,
    split_by_source,
    tokenize_fra_eng,
)
from npformer.decoding import beam_search  # noqa: E402
from npformer.models import Seq2SeqConfig  # noqa: E402
from tests.beam_reference import _beam_search_reference  # noqa: E402


def heldout_english(data, sentences: int, max_tokens: int = 15):
    """The demo's split of fra-eng.zip: (training pairs, ``sentences`` held-out English
    sentences)."""
    pairs = load_fra_eng(data, max_len=max_tokens)
    train_pairs, heldout = split_by_source(pairs, 2000, seed=0)
    return train_pairs, list(heldout)[:sentences]


def encode_sources(src_vocab: Vocab, english: list, max_tokens: int = 15) -> list:
    """English sentences as source id lists (+<eos>), as the demo feeds them."""
    return [src_vocab.encode(tokenize_fra_eng(s))[:max_tokens + 1] + [src_vocab.eos_id]
            for s in english]


def untrained_model(train_pairs, english: list, max_tokens: int = 15):
    """The demo's vocabularies and default model (untrained, the fast tier's) -> (model,
    sources, pad id, source and target vocabulary sizes)."""
    src_vocab = Vocab.build([e for e, _ in train_pairs], min_freq=2, bos=True, eos=True)
    tgt_vocab = Vocab.build([f for _, f in train_pairs], min_freq=2, bos=True, eos=True)
    config = Seq2SeqConfig(src_vocab_size=len(src_vocab), tgt_vocab_size=len(tgt_vocab),
                           d_model=256, num_heads=4, num_encoder_layers=2,
                           num_decoder_layers=2, d_ff=1024, block_size=max_tokens + 2,
                           dropout=0.1, pad_id=tgt_vocab.pad_id, bos_id=tgt_vocab.bos_id,
                           eos_id=tgt_vocab.eos_id)
    backend.seed(0)
    model = fast.Seq2SeqTransformer(config)  # the demo's tier, as build_model's default
    return (model, encode_sources(src_vocab, english, max_tokens), src_vocab.pad_id,
            len(src_vocab), len(tgt_vocab))


def trained_model(path, english: list, max_tokens: int = 15):
    """The translation demo's checkpoint -> (model, sources, pad id, vocabulary sizes)."""
    from npformer.checkpoint import build_model, load_checkpoint

    checkpoint = load_checkpoint(path)
    model = build_model(checkpoint, expected_kind="seq2seq")
    src_vocab = Vocab.from_json(checkpoint.extra["src_vocab"])
    tgt_size = len(Vocab.from_json(checkpoint.extra["tgt_vocab"]))
    return (model, encode_sources(src_vocab, english, max_tokens), src_vocab.pad_id,
            len(src_vocab), tgt_size)


def decode_all(search, model, sources, pad_id: int, chunk: int, beam_size: int):
    out = []
    for i in range(0, len(sources), chunk):
        src, lens = pad_batch(sources[i:i + chunk], pad_id)
        out += search(model, backend.asarray(src), backend.asarray(lens), beam_size=beam_size,
                      max_len=model.config.block_size)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None, help="fra-eng.zip or its folder "
                        "(default: $NPFORMER_DATA or the user cache)")
    parser.add_argument("--sentences", type=positive_int, default=200, help="held-out sentences")
    parser.add_argument("--beam-size", type=positive_int, default=4, help="beam size (default: 4)")
    parser.add_argument("--chunk", type=positive_int, default=64,
                        help="sentences per call (default: 64)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="old/new pairs timed (default: 3)")
    parser.add_argument("--checkpoint", default=None,
                        help="the translation demo's trained model.npz (default: untrained)")
    args = parser.parse_args(argv)

    train_pairs, english = heldout_english(args.data, args.sentences)
    model, sources, pad_id, src_v, tgt_v = (
        trained_model(args.checkpoint, english) if args.checkpoint
        else untrained_model(train_pairs, english))
    print(f"{len(sources)} sentences, vocabularies {src_v:,} / {tgt_v:,}, "
          f"{model.num_parameters():,} parameters, beam {args.beam_size}, "
          f"chunks of {args.chunk}, backend {backend.backend_name()} "
          f"{backend.default_float_name()}")
    searches = {"per-sentence": _beam_search_reference, "batched": beam_search}
    seconds: dict[str, list[float]] = {name: [] for name in searches}
    results = {}
    for round_ in range(args.rounds):
        for name, search in searches.items():  # alternate: old, new, old, new, ...
            start = time.perf_counter()
            results[name] = decode_all(search, model, sources, pad_id, args.chunk,
                                       args.beam_size)
            seconds[name].append(time.perf_counter() - start)
            print(f"round {round_ + 1} {name:>12}: {seconds[name][-1]:7.2f} s", flush=True)
    old, new = (statistics.median(seconds[name]) for name in searches)
    same = sum(a == b for a, b in zip(*results.values()))
    lengths = [len(h) for h in results["batched"]]
    print(f"hypothesis lengths: mean {np.mean(lengths):.1f}, at the limit "
          f"({model.config.block_size}): {sum(n == model.config.block_size for n in lengths)} "
          f"of {len(lengths)}")
    print(f"same hypotheses: {same} of {len(sources)}")
    print(f"median per-sentence {old:.2f} s, batched {new:.2f} s: {old / new:.1f}x faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
