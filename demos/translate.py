"""English-to-French translation with an encoder-decoder Transformer trained from scratch.

    python demos/translate.py                 # default run: <= 20 minutes on 2 CPU cores
    python demos/translate.py --translate "i'm home ."
    python demos/translate.py --smoke         # seconds (CI)
    python demos/translate.py --resume        # continue an interrupted run exactly

Data: the Tatoeba pairs of d2l's fra-eng.zip (--data, $NPFORMER_DATA or the user cache),
d2l's preprocessing, at most 15 tokens a side.  2,000 distinct English sentences are
held out as the test set (with all their translations, which serve as the references),
and 500 others for validation, so no held-out sentence is ever trained on, and the model
is chosen (on validation loss) without reading the test set.  Reports corpus BLEU
(sacrebleu, 13a) on the test set with greedy and beam search, and greedy on the
validation sentences (the figure to compare settings by), and translates d2l's probe
sentences.  Training is time-budgeted (--max-minutes): the learning rate warms up, then
decays by a cosine to zero at the end of the budget, whose length in updates the Trainer
measures as it goes (``TrainConfig.schedule_for``), so a slow machine's run ends decayed
as a fast one's does.  The budget holds under three epochs, with the validation loss still
falling at its end, so there is no dropout; an update reads 512 pairs (on 2 cores a
larger batch reads more pairs a second, and scored better than 128 and 256 on
validation: demos/README.md).  The vocabularies hold subword pieces (``npformer.data.BPE``,
10,000 merges learned on both sides of the training pairs: 5,568 English and 7,210 French
pieces, 1.06 and 1.10 a word), so no word of a held-out sentence or reference is <unk>,
where a French vocabulary of the words seen 3 times (12,888) misses 2.3% of the
references' words; the smaller output layer, most of an update's cost, fits a fifth more
updates in the budget.  --bpe-merges 0 reads whole words.
Writes model.npz, last.npz (the run, for --resume), curves.png, cross_attention.png and
metrics.json to --out.  Settings come from a preset (--preset, --smoke); an option given
overrides the preset's value.

Your own data: --data pairs.tsv (or any .txt but fra.txt), one source<TAB>target
pair a line, tokenized as the English-French pairs are.  --heldout and --validation
source sentences are held out in the same way; the probes are then the first held-out
sentences.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

try:
    import npformer  # noqa: F401  (reads $NPFORMER_BACKEND)
except (ValueError, RuntimeError) as exc:
    sys.exit(f"error: {exc}")

import numpy as np

from npformer import backend, ops
from npformer.cli import (
    LAST_FILE,
    MODEL_FILE,
    Demo,
    DemoError,
    Stopwatch,
    check_divisible,
    demo_parser,
    extra_output,
    load_demo_model,
    map_batches,
    nonnegative_int,
    option,
    plot_attention,
    plot_curves,
    positive_float,
    probability,
    resume_run,
    run_demo,
    run_record,
    start_demo,
    write_metrics,
    yes_no,
)
from npformer.cli.memory import check_training_fits
from npformer.data import (
    BPE,
    Vocab,
    filter_by_length,
    length_bucketed_batches,
    load_fra_eng,
    pad_batch,
    preprocess_fra_eng,
    read_sentence_pairs,
    split_by_source,
    tokenize_fra_eng,
)
from npformer.decoding import beam_search, greedy_decode
from npformer.models import Seq2SeqConfig, Seq2SeqTransformer
from npformer.nn import evaluating, record_attention
from npformer.optim import Adam, warmup_cosine
from npformer.train import EpochBatches, TrainConfig, Trainer
from npformer.train.tasks import Translation

DEMO = Demo(tag="translate", title="translation", model_kind="seq2seq",
            script="demos/translate.py", out="runs/translate")
PROBES = ["go .", "i lost .", "he's calm .", "i'm home ."]


@dataclass(frozen=True)
class Preset:
    max_tokens: int = option(15, "at most this many tokens a side")
    heldout: int = option(2000, "distinct English sentences held out (with all their "
                                "translations) for BLEU, the test set")
    validation: int = option(500, "further distinct English sentences held out (with all "
                                  "their translations) for the validation loss that selects "
                                  "the model; never scored for BLEU")
    max_pairs: int | None = option(None, "use only the first this many pairs (None: all)")
    target_min_count: int = option(3, "with whole words (--bpe-merges 0): a French word "
                                       "enters the vocabulary once it occurs this often in "
                                       "the training pairs (rarer ones are <unk>)")
    bpe_merges: int = option(10000, "the vocabularies hold subword pieces of this many "
                                    "byte-pair merges, learned on both sides of the training "
                                    "pairs (no word is <unk>); 0: whole words",
                             nonnegative_int)
    tie_weights: bool = option(False, "yes: the output layer is the French embedding "
                                      "transposed (the Transformer paper's sharing); it "
                                      "measured no better here", yes_no)
    d_model: int = option(256, "model width D")
    num_heads: int = option(4, "attention heads H (D must be a multiple)")
    num_layers: int = option(2, "encoder layers, and decoder layers")
    d_ff: int = option(1024, "feed-forward width")
    dropout: float = option(0.0, "dropout probability (the budget holds under three "
                                 "epochs, too few to overfit)", probability)
    batch_size: int = option(512, "sentence pairs per update")
    lr: float = option(3e-3, "peak learning rate (warmup, then cosine decay to zero at the "
                             "end of the time budget)", positive_float)
    warmup: int = option(75, "warmup updates")
    max_iters: int = option(20000, "at most this many updates")
    max_minutes: float = option(18.0, "training time budget, in minutes (the schedule "
                                      "decays over the updates it holds)", positive_float)
    beam_size: int = option(4, "beam width of the beam-search evaluation and of --translate")

    # what --translate reads of these (the saved model has the rest): any other
    # setting given with it is refused (npformer.cli.options.refuse_unread_with_saved_model)
    read_with_saved_model = ("beam_size",)

    def __post_init__(self):
        check_divisible(self, "d_model", "num_heads")


PRESETS = {
    "default": Preset(),
    # Dropout stays on in the smoke run, so that the tests' exact resumes and the
    # ranks' agreement cover its random streams.
    "smoke": Preset(max_pairs=3000, bpe_merges=500, heldout=40, validation=20, d_model=32,
                    num_heads=2, num_layers=1, d_ff=64, dropout=0.1, batch_size=32, warmup=10,
                    max_iters=30),
}


# --------------------------------------------------------------------------- data
def pieces(words: list[str], bpe: BPE | None) -> list[str]:
    """The tokens a vocabulary holds: the words, or their subword pieces."""
    if bpe is None:
        return words
    try:
        return bpe.encode(words)
    except ValueError as exc:  # a word holding the pieces' mark "@@"
        raise unencodable(exc) from None


def unencodable(exc: ValueError) -> DemoError:
    """BPE's refusal of a word, with the way out."""
    return DemoError(f"{exc}; use --bpe-merges 0 (whole words) for such text")


def words_of(tokens: list[str], bpe: BPE | None) -> list[str]:
    """Decoded tokens -> words (pieces marked @@ join the next)."""
    return tokens if bpe is None else bpe.decode(tokens)


def build_vocabs(train_pairs, preset: Preset):
    """-> (BPE or None, English vocabulary, French vocabulary) of the training pairs: every
    piece seen, or the English words seen twice and the French ones target_min_count times."""
    bpe = None
    if preset.bpe_merges:
        try:
            bpe = BPE.learn([e for e, _ in train_pairs] + [f for _, f in train_pairs],
                            preset.bpe_merges)
        except ValueError as exc:  # a word holding the pieces' mark "@@"
            raise unencodable(exc) from None
    min_english, min_french = (1, 1) if bpe is not None else (2, preset.target_min_count)
    return (bpe,
            Vocab.build([pieces(e, bpe) for e, _ in train_pairs], min_freq=min_english,
                        bos=True, eos=True),
            Vocab.build([pieces(f, bpe) for _, f in train_pairs], min_freq=min_french,
                        bos=True, eos=True))


def encode_pairs(pairs, src_vocab: Vocab, tgt_vocab: Vocab, bpe: BPE | None):
    """-> source id lists (+<eos>), target id lists (+<eos>)."""
    src = [src_vocab.encode(pieces(e, bpe)) + [src_vocab.eos_id] for e, _ in pairs]
    tgt = [tgt_vocab.encode(pieces(f, bpe)) + [tgt_vocab.eos_id] for _, f in pairs]
    return src, tgt


def make_batch(src, tgt, rows, pad_id: int, bos_id: int):
    """(src, src_lens, tgt_in = <bos> + y, tgt_out = y + <eos>, tgt_lens) for ``rows``."""
    s, s_lens = pad_batch([src[i] for i in rows], pad_id)
    t_out, t_lens = pad_batch([tgt[i] for i in rows], pad_id)
    t_in, _ = pad_batch([[bos_id] + tgt[i][:-1] for i in rows], pad_id)
    return s, s_lens, t_in, t_out, t_lens


def batch_stream(src, tgt, batch_size: int, pad_id: int, bos_id: int) -> EpochBatches:
    """next_batch(rng) for the Trainer: length-bucketed, reshuffled every epoch."""
    lengths = [max(len(a), len(b)) for a, b in zip(src, tgt)]
    return EpochBatches(lambda rng: length_bucketed_batches(lengths, batch_size, rng=rng),
                        lambda rows: make_batch(src, tgt, rows, pad_id, bos_id))


def validation_loss(model, src, tgt, batch_size: int, pad_id: int, bos_id: int,
                    replicas: int = 1) -> float:
    """Mean loss per real target token, batches spread over ``replicas`` threads."""
    def score(rows):  # -> (summed loss, tokens) of one batch
        s, s_lens, t_in, t_out, t_lens = make_batch(src, tgt, rows, pad_id, bos_id)
        logits = model(backend.asarray(s), backend.asarray(t_in), backend.asarray(s_lens),
                       backend.asarray(t_lens))
        targets = np.where(t_out == pad_id, ops.IGNORE_INDEX, t_out)
        loss, _ = ops.cross_entropy_forward(logits, backend.asarray(targets))
        count = int(np.sum(t_out != pad_id))
        return backend.to_float(loss) * count, count

    with evaluating(model):
        results = map_batches(score, [np.arange(i, min(i + batch_size, len(src)))
                                       for i in range(0, len(src), batch_size)], replicas,
                              "validation")
    return sum(loss for loss, _ in results) / max(sum(n for _, n in results), 1)


# --------------------------------------------------------------------------- translation
def translate(model, src_vocab: Vocab, tgt_vocab: Vocab, bpe: BPE | None,
              sentences: list[str], beam_size: int = 1, batch_size: int = 64, replicas: int = 1,
              phase: str | None = None) -> list[str]:
    """English sentences (d2l-preprocessed strings) -> French strings (space-joined tokens),
    batches decoded on ``replicas`` threads; ``phase`` names the pass in the progress
    shown ("beam search")."""
    encoded = [src_vocab.encode(pieces(tokenize_fra_eng(s), bpe)) + [src_vocab.eos_id]
               for s in sentences]
    max_src = model.config.block_size
    for sentence, ids in zip(sentences, encoded):
        if len(ids) > max_src:  # never cut silently: the translation would be of a part
            unit = "tokens" if bpe is None else "subword pieces"
            raise DemoError(f"the sentence {sentence!r} has {len(ids) - 1} {unit}, more than "
                            f"the model's source length allows ({max_src - 1} {unit} and "
                            f"<eos>, block_size {max_src}): shorten or split it")

    def decode(chunk):
        src, lens = pad_batch(chunk, src_vocab.pad_id)
        src, lens = backend.asarray(src), backend.asarray(lens)
        if beam_size == 1:
            return greedy_decode(model, src, lens, max_len=max_src)
        return beam_search(model, src, lens, beam_size=beam_size, max_len=max_src)

    chunks = [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)]
    with evaluating(model):  # set once, outside the threads: they must not toggle it
        decoded = map_batches(decode, chunks, replicas, phase)
    return [" ".join(words_of(tgt_vocab.decode(row), bpe)) for rows in decoded for row in rows]


def corpus_bleu(hypotheses: list[str], references: list[list[str]]) -> float:
    """sacreBLEU (13a) with a variable number of references per sentence."""
    import sacrebleu

    width = max(len(r) for r in references)
    streams = [[refs[i] if i < len(refs) else None for refs in references] for i in range(width)]
    # Hypotheses and references are both space-joined d2l tokens (the anchor's protocol),
    # so sacreBLEU's warning about tokenized input is expected: force silences it.
    return float(sacrebleu.corpus_bleu(hypotheses, streams, force=True).score)


def load_for_translation(path, tier: str = "fast"):
    """-> the model (of ``tier``), its English and French vocabularies, and its BPE
    (None: words)."""
    model, checkpoint = load_demo_model(path, DEMO, tier)
    extra = checkpoint.extra
    try:  # a damaged record is the user's file, not a bug: one error line naming it
        return (model, Vocab.from_json(extra["src_vocab"], f"{path}'s src_vocab"),
                Vocab.from_json(extra["tgt_vocab"], f"{path}'s tgt_vocab"),
                None if extra.get("bpe") is None else BPE.from_json(extra["bpe"],
                                                                    f"{path}'s BPE"))
    except KeyError as exc:
        raise DemoError(f"{path} holds no {exc.args[0]}: it is not a translation demo's "
                        "checkpoint") from None
    except ValueError as exc:
        raise DemoError(f"{exc}: the checkpoint is damaged; train the model again") from None


def split_pairs(preset: Preset, data, seed: int):
    """-> training pairs, then the validation and the held-out (test) English sentences,
    each mapped to its translations: three disjoint sets of English sentences, so the
    model is chosen on sentences that are neither trained on nor scored."""
    every = read_sentence_pairs(data) if is_user_pairs(data) else load_fra_eng(data)
    kept = filter_by_length(every, preset.max_tokens)
    pairs = kept[:preset.max_pairs]
    sentences = len({" ".join(english) for english, _ in pairs})  # as split_by_source counts
    if preset.heldout + preset.validation >= sentences:
        longer = len(every) - len(kept)
        raise DemoError(f"--heldout {preset.heldout} and --validation {preset.validation} "
                        f"leave nothing to train on: the corpus has {sentences} distinct "
                        f"English sentences in pairs of at most --max-tokens "
                        f"{preset.max_tokens} tokens a side ({longer} of its {len(every)} "
                        f"pairs are longer: raise --max-tokens, or lower --heldout and "
                        f"--validation)")
    train_pairs, heldout = split_by_source(pairs, preset.heldout, seed=seed)
    train_pairs, validation = split_by_source(train_pairs, preset.validation, seed=seed)
    return train_pairs, validation, heldout


def as_pairs(sentences: dict[str, list[str]]):
    """{English: [French, ...]} (space-joined tokens) -> one token-list pair a translation."""
    return [(english.split(), french.split())
            for english, translations in sentences.items() for french in translations]


def is_user_pairs(data) -> bool:
    """--data names the user's own pairs: a .tsv file, or a .txt one other than d2l's
    fra.txt (which, like fra-eng.zip and a folder, is read as the English-French data)."""
    if data is None:
        return False
    path = Path(data)
    return path.suffix.lower() == ".tsv" or (path.suffix.lower() == ".txt"
                                             and path.name.lower() != "fra.txt")


def probe_sentences(data, heldout: dict) -> list[str]:
    """The sentences translated at the end (and the first one's cross-attention drawn):
    d2l's probes, or with the user's own pairs the first held-out sources."""
    return list(heldout)[:len(PROBES)] if is_user_pairs(data) else PROBES


# --------------------------------------------------------------------------- model, update
# (bench/ times these too: bench/configs.py imports them)
CLIP_NORM = 1.0  # the gradients' global norm is clipped to this
LABEL_SMOOTHING = 0.1


def max_length(preset: Preset, longest: int = 0) -> int:
    """The most tokens a side the model reads (before <bos> / <eos>): max_tokens words;
    with a BPE, room for twice as many pieces (1.1 a word on this data, 27 at most for 15
    words), or for the ``longest`` sentence of the run's data if that is longer (few
    merges spell words in many pieces). The sinusoidal positions are fixed, not learned:
    the length only bounds what the model may read."""
    return max(preset.max_tokens * (2 if preset.bpe_merges else 1), longest)


def longest_sentence(encoded: list[list[int]], heldout: dict, bpe: BPE | None) -> int:
    """Tokens in the longest of the encoded sentences (ids ending with <eos>) and of the
    held-out English sentences (which are only translated)."""
    return max(max(map(len, encoded), default=1) - 1,
               max((len(pieces(tokenize_fra_eng(e), bpe)) for e in heldout), default=0))


def model_config(preset: Preset, src_vocab, tgt_vocab, longest: int = 0) -> Seq2SeqConfig:
    """The vocabularies: anything with len() and pad_id, bos_id, eos_id (a Vocab);
    ``longest``: tokens in the longest sentence the run reads (:func:`max_length`)."""
    return Seq2SeqConfig(src_vocab_size=len(src_vocab), tgt_vocab_size=len(tgt_vocab),
                         d_model=preset.d_model, num_heads=preset.num_heads,
                         num_encoder_layers=preset.num_layers, num_decoder_layers=preset.num_layers,
                         d_ff=preset.d_ff, block_size=max_length(preset, longest) + 2,
                         dropout=preset.dropout, tie_weights=preset.tie_weights,
                         pad_id=tgt_vocab.pad_id,
                         bos_id=tgt_vocab.bos_id, eos_id=tgt_vocab.eos_id)


def schedule(preset: Preset) -> warmup_cosine:
    """Warmup, then cosine decay to zero at max_iters; the Trainer fits its length to
    the time budget (``of_length``) as it measures how many updates the budget holds."""
    return warmup_cosine(preset.lr, preset.warmup, preset.max_iters)


def implementations(tier: str = "fast") -> tuple[type, type]:
    """(model class, optimizer class) that train on ``tier``: npformer.fast's, or the
    textbook's (``--tier textbook``, whose run never imports npformer.fast); both compute
    the same numbers up to rounding."""
    if tier == "fast":
        from npformer import fast  # the fast tier, imported only where it trains

        return fast.Seq2SeqTransformer, fast.Adam
    return Seq2SeqTransformer, Adam


def make_optimizer(params, preset: Preset, tier: str = "fast") -> Adam:
    """Adam with the Transformer paper's betas and eps; the schedule of a run of
    max_iters updates until the Trainer fits it to the time budget."""
    return implementations(tier)[1](params, lr=schedule(preset),
                                    betas=(0.9, 0.98), eps=1e-9)


# --------------------------------------------------------------------------- main
def build_parser():
    parser = demo_parser(DEMO, __doc__, PRESETS)
    parser.add_argument("--translate", metavar="SENTENCE",
                        help=f"translate SENTENCE with OUT/{MODEL_FILE} and exit")
    return parser


def main(argv=None) -> int:
    args, preset, out = start_demo(DEMO, build_parser(), PRESETS, argv, use_saved="translate")
    if args.translate is not None:
        return translate_only(args, preset, out)

    clock = Stopwatch()
    train_pairs, validation, heldout = split_pairs(preset, args.data, args.seed)
    val_pairs = as_pairs(validation)
    bpe, src_vocab, tgt_vocab = build_vocabs(train_pairs, preset)
    src, tgt = encode_pairs(train_pairs, src_vocab, tgt_vocab, bpe)
    val_src, val_tgt = encode_pairs(val_pairs, src_vocab, tgt_vocab, bpe)
    print(f"{len(train_pairs):,} training pairs, {len(val_pairs):,} validation pairs, "
          f"{len(heldout):,} held-out English sentences "
          f"({sum(len(r) for r in heldout.values()):,} pairs); vocabularies {len(src_vocab):,} "
          f"/ {len(tgt_vocab):,}; data ready in {clock.seconds():.0f} s")

    longest = longest_sentence(src + tgt + val_src + val_tgt, heldout, bpe)
    config = model_config(preset, src_vocab, tgt_vocab, longest)
    check_training_fits(config, preset.batch_size, config.block_size, preset,
                        PRESETS["default"], args.dtype)  # before a weight is made
    model = implementations(args.tier)[0](config)
    optimizer = make_optimizer(model.parameters(), preset, args.tier)
    print(f"model: {model.num_parameters():,} parameters")
    pad, bos = tgt_vocab.pad_id, tgt_vocab.bos_id
    trainer = Trainer(
        model, optimizer, Translation(label_smoothing=LABEL_SMOOTHING, pad_id=pad),
        batch_stream(src, tgt, preset.batch_size, pad, bos),
        TrainConfig(max_iters=preset.max_iters, max_seconds=preset.max_minutes * 60,
                    schedule_for=schedule(preset).of_length, clip_norm=CLIP_NORM,
                    replicas=args.replicas,
                    eval_every=max(1, min(500, preset.max_iters // 4)),
                    checkpoint_path=out / MODEL_FILE, select_metric="val_loss",
                    select_mode="min", last_path=out / LAST_FILE, stop_after=args.stop_after,
                    progress=not args.no_progress, desc="translate"),
        eval_fn=lambda m: {"val_loss": validation_loss(m, val_src, val_tgt, 128, pad, bos,
                                                       args.replicas)},
        checkpoint_extra={"demo": DEMO.tag, "src_vocab": src_vocab.to_json(),
                          "tgt_vocab": tgt_vocab.to_json(), "run": run_record(args, preset),
                          **({} if bpe is None else {"bpe": bpe.to_json()})},
        seed=args.seed)
    if args.resume:
        resume_run(trainer, out / LAST_FILE)
    history = trainer.fit()
    epochs = trainer.updates * preset.batch_size / len(train_pairs)

    model, src_vocab, tgt_vocab, bpe = load_for_translation(out / MODEL_FILE, args.tier)
    validation_greedy = translate(model, src_vocab, tgt_vocab, bpe, list(validation), beam_size=1,
                                  replicas=args.replicas, phase="validation decoding")
    bleu_validation = corpus_bleu(validation_greedy, list(validation.values()))
    english = list(heldout)
    references = [heldout[e] for e in english]
    greedy = translate(model, src_vocab, tgt_vocab, bpe, english, beam_size=1,
                       replicas=args.replicas, phase="greedy decoding")
    bleu_greedy = corpus_bleu(greedy, references)
    bleu_greedy_one_ref = corpus_bleu(greedy, [r[:1] for r in references])
    beam_clock = Stopwatch()
    beam = translate(model, src_vocab, tgt_vocab, bpe, english, beam_size=preset.beam_size,
                     replicas=args.replicas, phase="beam search")
    beam_seconds = beam_clock.seconds()
    bleu_beam = corpus_bleu(beam, references)
    print(f"validation BLEU: greedy {bleu_validation:.1f} ({len(validation):,} sentences)")
    print(f"held-out BLEU: greedy {bleu_greedy:.1f} (one reference: {bleu_greedy_one_ref:.1f}), "
          f"beam {preset.beam_size}: {bleu_beam:.1f} (decoded in {beam_seconds:.0f} s); "
          f"{trainer.updates} updates = {epochs:.2f} epochs")
    probe_sources = probe_sentences(args.data, heldout)
    probes = translate(model, src_vocab, tgt_vocab, bpe, probe_sources, beam_size=preset.beam_size)
    print(f"probes, decoded by {decoding(preset.beam_size)}:")
    for english_probe, french in zip(probe_sources, probes):
        print(f"  {english_probe} => {french}")
    total_seconds = clock.seconds()
    write_metrics(out, args, model.num_parameters(), {
        "bleu_greedy": bleu_greedy, "bleu_greedy_one_reference": bleu_greedy_one_ref,
        "bleu_beam": bleu_beam, "beam_size": preset.beam_size, "beam_seconds": beam_seconds,
        "bleu_validation_greedy": bleu_validation,
        "updates": trainer.updates,
        "best_val_loss": trainer.best, "epochs": epochs,
        "train_minutes": trainer.train_seconds / 60, "total_minutes": total_seconds / 60,
        "heldout_sentences": len(english), "probes": dict(zip(probe_sources, probes))})
    extra_output("cross_attention.png", draw_cross_attention, model, src_vocab, tgt_vocab, bpe,
                 probe_sources[-1], out / "cross_attention.png")
    extra_output("curves.png", plot_curves, out / "curves.png", history, ["val_loss"],
                 "English-French Transformer")
    print(f"{total_seconds / 60:.1f} min in all; wrote {MODEL_FILE}, {LAST_FILE}, curves.png, "
          f"cross_attention.png, metrics.json to {out}")
    return 0


def draw_cross_attention(model, src_vocab, tgt_vocab, bpe, sentence: str, path) -> None:
    """Last decoder layer's cross-attention (mean over heads) while translating ``sentence``:
    one row per decoder input, <bos> and the tokens fed back (a translation cut at the
    length limit feeds back all but its last token: at most config.block_size inputs),
    labelled with the tokens the model reads (subword pieces with a BPE)."""
    src_ids = src_vocab.encode(pieces(tokenize_fra_eng(sentence), bpe)) + [src_vocab.eos_id]
    with evaluating(model):
        french_ids = greedy_decode(model, np.array([src_ids]), max_len=model.config.block_size)[0]
    tgt_in = ([tgt_vocab.bos_id] + french_ids)[:model.config.block_size]
    french = tgt_vocab.decode(tgt_in[1:])
    with evaluating(model), record_attention(model) as recorded:
        model(backend.asarray(np.array([src_ids])), backend.asarray(np.array([tgt_in])))
    last = f"decoder.{len(model.decoder) - 1}.cross_attn"
    weights = backend.to_numpy(recorded[last])[0].mean(axis=0)  # (T, S)
    plot_attention(path, weights, ["<bos>"] + french, src_vocab.decode(src_ids),
                   f"cross-attention, last decoder layer, decoded by {decoding(1)}: "
                   f"{sentence}")


def decoding(beam_size: int) -> str:
    """How a translation was decoded, for the texts and figures that show one."""
    return "greedy search" if beam_size == 1 else f"beam search (beam {beam_size})"


def translate_only(args, preset: Preset, out: Path) -> int:
    sentence = preprocess_fra_eng(args.translate).strip()
    if not sentence:
        raise DemoError("--translate needs a sentence, got an empty string")
    model, src_vocab, tgt_vocab, bpe = load_for_translation(out / MODEL_FILE, args.tier)
    print(translate(model, src_vocab, tgt_vocab, bpe, [sentence], beam_size=preset.beam_size)[0])
    return 0


if __name__ == "__main__":
    sys.exit(run_demo(main))
