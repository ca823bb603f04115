"""English-to-French translation with an encoder-decoder Transformer trained from scratch.

    python demos/translate.py                 # default run: <= 20 minutes on 2 CPU cores
    python demos/translate.py --translate "i'm home ."
    python demos/translate.py --smoke         # seconds (CI)

Data: the Tatoeba pairs of d2l's fra-eng.zip (--data, $NPFORMER_DATA or the
user cache), d2l's preprocessing, at most 15 tokens a side.  2,000 distinct
English sentences are held out (with all their translations, which serve as
the references), so no held-out sentence is ever trained on.  Reports corpus
BLEU (sacrebleu, 13a) on them with greedy and beam search, and translates d2l's
probe sentences.  Writes model.npz, curves.png, cross_attention.png and
metrics.json to --out.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from npformer import backend, ops
from npformer.checkpoint import CheckpointError, build_model, load_checkpoint
from npformer.cli import (Stopwatch, add_common_args, machine_description, plot_attention,
                          plot_curves, run_demo, setup, write_json)
from npformer.data import (Vocab, length_bucketed_batches, load_fra_eng, pad_batch,
                           preprocess_fra_eng, split_by_source, tokenize_fra_eng)
from npformer.decoding import beam_search, greedy_decode
from npformer.models import Seq2SeqConfig, Seq2SeqTransformer
from npformer.nn import no_grad
from npformer.optim import Adam, warmup_inverse_sqrt
from npformer.parallel import parallel_map
from npformer.tasks import Translation
from npformer.train import Trainer, TrainConfig

PROBES = ["go .", "i lost .", "he's calm .", "i'm home ."]


# --------------------------------------------------------------------------- data
def encode_pairs(pairs, src_vocab: Vocab, tgt_vocab: Vocab):
    """-> source id lists (+<eos>), target id lists (+<eos>)."""
    src = [src_vocab.encode(e) + [src_vocab.eos_id] for e, _ in pairs]
    tgt = [tgt_vocab.encode(f) + [tgt_vocab.eos_id] for _, f in pairs]
    return src, tgt


def make_batch(src, tgt, rows, pad_id: int, bos_id: int):
    """(src, src_lens, tgt_in = <bos> + y, tgt_out = y + <eos>, tgt_lens) for ``rows``."""
    s, s_lens = pad_batch([src[i] for i in rows], pad_id)
    t_out, t_lens = pad_batch([tgt[i] for i in rows], pad_id)
    t_in, _ = pad_batch([[bos_id] + tgt[i][:-1] for i in rows], pad_id)
    return s, s_lens, t_in, t_out, t_lens


def batch_stream(src, tgt, batch_size: int, pad_id: int, bos_id: int):
    lengths = [max(len(a), len(b)) for a, b in zip(src, tgt)]
    queue: list = []

    def next_batch(rng):
        if not queue:
            queue.extend(length_bucketed_batches(lengths, batch_size, rng=rng))
        return make_batch(src, tgt, queue.pop(), pad_id, bos_id)
    return next_batch


def validation_loss(model, src, tgt, batch_size: int, pad_id: int, bos_id: int,
                    workers: int = 1) -> float:
    """Mean loss per real target token, batches spread over ``workers`` threads."""
    def score(rows):  # -> (summed loss, tokens) of one batch
        s, s_lens, t_in, t_out, t_lens = make_batch(src, tgt, rows, pad_id, bos_id)
        logits = model(backend.asarray(s), backend.asarray(t_in), backend.asarray(s_lens),
                       backend.asarray(t_lens))
        targets = np.where(t_out == pad_id, ops.IGNORE_INDEX, t_out)
        loss, _ = ops.cross_entropy_forward(logits, backend.asarray(targets))
        count = int(np.sum(t_out != pad_id))
        return backend.to_float(loss) * count, count

    model.eval()
    with no_grad():
        results = parallel_map(score, [np.arange(i, min(i + batch_size, len(src)))
                                       for i in range(0, len(src), batch_size)], workers)
    model.train()
    return sum(loss for loss, _ in results) / max(sum(n for _, n in results), 1)


# --------------------------------------------------------------------------- translation
def translate(model, src_vocab: Vocab, tgt_vocab: Vocab, sentences: list[str],
              beam_size: int = 1, batch_size: int = 64, workers: int = 1) -> list[str]:
    """English sentences (d2l-preprocessed strings) -> French strings (space-joined tokens),
    batches decoded on ``workers`` threads."""
    encoded = [src_vocab.encode(tokenize_fra_eng(s)) + [src_vocab.eos_id] for s in sentences]
    max_src = model.config.max_len

    def decode(chunk):
        src, lens = pad_batch([ids[:max_src] for ids in chunk], src_vocab.pad_id)
        src, lens = backend.asarray(src), backend.asarray(lens)
        if beam_size == 1:
            return greedy_decode(model, src, lens, max_len=max_src)
        return beam_search(model, src, lens, beam_size=beam_size, max_len=max_src)

    chunks = [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)]
    was_training = model.training
    model.eval()  # set once, outside the threads: they must not toggle it for each other
    with no_grad():
        decoded = parallel_map(decode, chunks, workers)
    model.train(was_training)
    return [" ".join(tgt_vocab.decode(row)) for rows in decoded for row in rows]


def corpus_bleu(hypotheses: list[str], references: list[list[str]]) -> float:
    """sacreBLEU (13a) with a variable number of references per sentence."""
    import sacrebleu

    width = max(len(r) for r in references)
    streams = [[refs[i] if i < len(refs) else None for refs in references] for i in range(width)]
    # Hypotheses and references are both space-joined d2l tokens (the anchor's protocol),
    # so sacreBLEU's warning about tokenized input is expected: force silences it.
    return float(sacrebleu.corpus_bleu(hypotheses, streams, force=True).score)


def load_for_translation(path):
    checkpoint = load_checkpoint(path)
    if checkpoint.extra.get("demo") != "translate":
        raise CheckpointError(f"{path} was not saved by the translation demo")
    model = build_model(checkpoint, expected_kind="seq2seq")
    return (model, Vocab.from_json(checkpoint.extra["src_vocab"]),
            Vocab.from_json(checkpoint.extra["tgt_vocab"]))


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    add_common_args(parser, "runs/translate")
    parser.add_argument("--max-tokens", type=int, default=15, help="per side (default: 15)")
    parser.add_argument("--heldout", type=int, default=2000,
                        help="distinct English sentences held out (default: 2000)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2, help="encoder and decoder layers each")
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--steps", type=int, default=20000, help="at most this many updates")
    parser.add_argument("--max-minutes", type=float, default=15.0, help="training time budget")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--translate", metavar="SENTENCE",
                        help="translate SENTENCE with OUT/model.npz and exit")
    args = parser.parse_args(argv)
    out = setup(args)
    if args.translate is not None:
        return translate_only(args, out)
    if args.smoke:
        args.d_model, args.heads, args.layers, args.d_ff = 32, 2, 1, 64
        args.steps, args.heldout, args.warmup, args.batch = 30, 40, 10, 32

    clock = Stopwatch()
    pairs = load_fra_eng(args.data, max_len=args.max_tokens)
    if args.smoke:
        pairs = pairs[:3000]
    train_pairs, heldout = split_by_source(pairs, args.heldout, seed=args.seed)
    src_vocab = Vocab.build([e for e, _ in train_pairs], min_freq=2, bos=True, eos=True)
    tgt_vocab = Vocab.build([f for _, f in train_pairs], min_freq=2, bos=True, eos=True)
    src, tgt = encode_pairs(train_pairs, src_vocab, tgt_vocab)
    val_pairs = [(e.split(), refs[0].split()) for e, refs in list(heldout.items())[:500]]
    val_src, val_tgt = encode_pairs(val_pairs, src_vocab, tgt_vocab)
    print(f"{len(train_pairs):,} training pairs, {len(heldout):,} held-out English sentences "
          f"({sum(len(r) for r in heldout.values()):,} pairs); vocabularies {len(src_vocab):,} "
          f"/ {len(tgt_vocab):,}; data ready in {clock.seconds():.0f} s")

    config = Seq2SeqConfig(src_vocab_size=len(src_vocab), tgt_vocab_size=len(tgt_vocab),
                           d_model=args.d_model, num_heads=args.heads,
                           num_encoder_layers=args.layers, num_decoder_layers=args.layers,
                           d_ff=args.d_ff, max_len=args.max_tokens + 2, dropout=args.dropout,
                           pad_id=tgt_vocab.pad_id, bos_id=tgt_vocab.bos_id,
                           eos_id=tgt_vocab.eos_id)
    model = Seq2SeqTransformer(config)
    optimizer = Adam(model.parameters(), lr=warmup_inverse_sqrt(warmup=args.warmup,
                                                                peak_lr=args.lr),
                     betas=(0.9, 0.98), eps=1e-9)
    print(f"model: {model.num_parameters():,} parameters")
    pad, bos = tgt_vocab.pad_id, tgt_vocab.bos_id
    trainer = Trainer(
        model, optimizer, Translation(label_smoothing=0.1, pad_id=pad),
        batch_stream(src, tgt, args.batch, pad, bos),
        TrainConfig(max_steps=args.steps, max_seconds=args.max_minutes * 60, clip_norm=1.0,
                    data_parallel=args.replicas,
                    eval_every=max(1, min(500, args.steps // 4)),
                    checkpoint_path=out / "model.npz", select_metric="val_loss",
                    select_mode="min", progress=not args.no_progress, desc="translate"),
        eval_fn=lambda m: {"val_loss": validation_loss(m, val_src, val_tgt, 128, pad, bos,
                                                       args.replicas)},
        checkpoint_extra={"demo": "translate", "src_vocab": src_vocab.to_json(),
                          "tgt_vocab": tgt_vocab.to_json()},
        seed=args.seed)
    history = trainer.fit()
    train_seconds = clock.seconds()
    epochs = trainer.step * args.batch / len(train_pairs)

    model, src_vocab, tgt_vocab = load_for_translation(out / "model.npz")
    english = list(heldout)
    references = [heldout[e] for e in english]
    greedy = translate(model, src_vocab, tgt_vocab, english, beam_size=1, workers=args.replicas)
    bleu_greedy = corpus_bleu(greedy, references)
    bleu_greedy_one_ref = corpus_bleu(greedy, [r[:1] for r in references])
    beam = translate(model, src_vocab, tgt_vocab, english, beam_size=args.beam_size,
                     workers=args.replicas)
    bleu_beam = corpus_bleu(beam, references)
    print(f"held-out BLEU: greedy {bleu_greedy:.1f} (one reference: {bleu_greedy_one_ref:.1f}), "
          f"beam {args.beam_size}: {bleu_beam:.1f}; {trainer.step} steps = {epochs:.2f} epochs")
    probes = translate(model, src_vocab, tgt_vocab, PROBES, beam_size=args.beam_size)
    for english_probe, french in zip(PROBES, probes):
        print(f"  {english_probe} => {french}")
    draw_cross_attention(model, src_vocab, tgt_vocab, "i'm home .", out / "cross_attention.png")
    plot_curves(out / "curves.png", history, ["val_loss"], "English-French Transformer")
    total_seconds = clock.seconds()
    write_json(out / "metrics.json", {
        "bleu_greedy": bleu_greedy, "bleu_greedy_one_reference": bleu_greedy_one_ref,
        "bleu_beam": bleu_beam, "beam_size": args.beam_size, "steps": trainer.step,
        "epochs": epochs, "train_minutes": train_seconds / 60,
        "total_minutes": total_seconds / 60, "heldout_sentences": len(english),
        "probes": dict(zip(PROBES, probes)), "seed": args.seed,
        "machine": machine_description(), "parameters": model.num_parameters()})
    print(f"{total_seconds / 60:.1f} min in all; wrote model.npz, curves.png, "
          f"cross_attention.png, metrics.json to {out}")
    return 0


def draw_cross_attention(model, src_vocab, tgt_vocab, sentence: str, path) -> None:
    """Last decoder layer's cross-attention (mean over heads) while translating ``sentence``."""
    french = translate(model, src_vocab, tgt_vocab, [sentence])[0].split()
    src_ids = src_vocab.encode(tokenize_fra_eng(sentence)) + [src_vocab.eos_id]
    tgt_in = [tgt_vocab.bos_id] + tgt_vocab.encode(french)
    attention = model.decoder[-1].cross_attn
    attention.keep_attention = True
    model.eval()
    with no_grad():
        model(backend.asarray(np.array([src_ids])), backend.asarray(np.array([tgt_in])))
    weights = backend.to_numpy(attention.last_attention)[0].mean(axis=0)  # (T, S)
    attention.keep_attention, attention.last_attention = False, None
    plot_attention(path, weights, ["<bos>"] + french, src_vocab.decode(src_ids),
                   f"cross-attention, last decoder layer: {sentence}")


def translate_only(args, out) -> int:
    sentence = preprocess_fra_eng(args.translate).strip()
    if not sentence:
        print("error: --translate needs a sentence, got an empty string", file=sys.stderr)
        return 2
    try:
        model, src_vocab, tgt_vocab = load_for_translation(out / "model.npz")
    except (FileNotFoundError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(translate(model, src_vocab, tgt_vocab, [sentence], beam_size=args.beam_size)[0])
    return 0


if __name__ == "__main__":
    sys.exit(run_demo(main))
