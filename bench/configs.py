"""The benchmark's three configurations (and their tiny smoke versions), the batch
both sides train on, and the npformer model of a configuration (the PyTorch side
builds its reference from the same npformer configuration: bench/torch_models.py)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAD, BOS, EOS = 0, 2, 3
SEED = 0
LR = 1e-3

# --------------------------------------------------------------------------- configurations
# kind: which model; every size named the way the npformer configs name it.
CONFIGS = {
    "imdb": dict(kind="classifier", vocab_size=20_000, num_classes=2, d_model=128, num_heads=8,
                 num_layers=4, d_ff=512, seq_len=256, batch=32),
    "lm": dict(kind="causal_lm", vocab_size=65, d_model=128, num_heads=4, num_layers=4,
               d_ff=512, seq_len=64, batch=12),
    "seq2seq": dict(kind="seq2seq", src_vocab_size=8_000, tgt_vocab_size=8_000, d_model=256,
                    num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=1024,
                    src_len=16, seq_len=16, batch=128),
}
SMOKE = {
    "imdb": dict(CONFIGS["imdb"], vocab_size=200, d_model=16, num_heads=2, num_layers=1, d_ff=32,
                 seq_len=16, batch=4),
    "lm": dict(CONFIGS["lm"], d_model=16, num_heads=2, num_layers=1, d_ff=32, seq_len=16,
               batch=2),
    "seq2seq": dict(CONFIGS["seq2seq"], src_vocab_size=100, tgt_vocab_size=100, d_model=16,
                    num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=32, src_len=8,
                    seq_len=8, batch=4),
}
# Larger configurations that fill a GPU (bench/gpu.py), and their smoke versions.
LARGE = {
    "imdb_large": dict(CONFIGS["imdb"], batch=256),
    "lm_large": dict(CONFIGS["lm"], d_model=768, num_heads=12, num_layers=12, d_ff=3072,
                     seq_len=1024, batch=8),
}
SMOKE_LARGE = {
    "imdb_large": dict(SMOKE["imdb"], batch=8),
    "lm_large": dict(SMOKE["lm"], num_layers=2, seq_len=32),
}
GPU_CONFIGS = {**CONFIGS, **LARGE}
GPU_SMOKE = {**SMOKE, **SMOKE_LARGE}
WARMUP_CONFIGS = {c["kind"]: c for c in SMOKE.values()}  # library warm-up, per model kind
SWEEP_TOKENS = 8192
SWEEP_LENGTHS = (64, 128, 256, 512, 1024)
SWEEP_BATCHES = (8, 16, 32, 64)
SMOKE_SWEEP_TOKENS = 64
SMOKE_SWEEP_LENGTHS = (8, 16)
SMOKE_SWEEP_BATCHES = (2, 4)

SIDES = ("pytorch", "npformer")  # PyTorch first: it writes the shared initial weights


def tokens_per_step(cfg: dict) -> int:
    """Token positions one step processes, padding included (seq2seq: source + target)."""
    return cfg["batch"] * (cfg["seq_len"] + cfg.get("src_len", 0))


def make_batch(cfg: dict, seed: int):
    """The same host NumPy batch on both sides (a fixed batch, reused every step)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    B, T = cfg["batch"], cfg["seq_len"]

    def padded(lengths, width, vocab, low):
        ids = np.full((len(lengths), width), PAD, dtype=np.int64)
        for b, n in enumerate(lengths):
            ids[b, :n] = rng.integers(low, vocab, size=n)
        return ids

    if cfg["kind"] == "classifier":
        lens = rng.integers(max(1, T // 4), T + 1, size=B).astype(np.int64)  # none fully padded
        return padded(lens, T, cfg["vocab_size"], 1), lens, rng.integers(0, cfg["num_classes"], B)
    if cfg["kind"] == "causal_lm":
        x = rng.integers(0, cfg["vocab_size"], size=(B, T + 1))
        return np.ascontiguousarray(x[:, :-1]), np.ascontiguousarray(x[:, 1:])
    S = cfg["src_len"]
    src_lens = rng.integers(max(1, S // 2), S + 1, size=B).astype(np.int64)
    tgt_lens = rng.integers(max(1, T // 2), T + 1, size=B).astype(np.int64)  # incl. <eos>
    src = padded(src_lens, S, cfg["src_vocab_size"], 4)
    body = padded(tgt_lens - 1, T, cfg["tgt_vocab_size"], 4)
    tgt_in = np.full((B, T), PAD, dtype=np.int64)
    tgt_out = np.full((B, T), PAD, dtype=np.int64)
    for b, n in enumerate(tgt_lens):
        tgt_in[b, :n] = [BOS, *body[b, :n - 1]]
        tgt_out[b, :n] = [*body[b, :n - 1], EOS]
    return src, src_lens, tgt_in, tgt_out, tgt_lens



def npformer_config(cfg: dict):
    """The npformer model configuration of a benchmark configuration (post-norm, ReLU,
    dropout 0; learned positions, except seq2seq's sinusoids)."""
    from npformer.models import CausalLMConfig, ClassifierConfig, Seq2SeqConfig

    common = dict(d_model=cfg["d_model"], num_heads=cfg["num_heads"], d_ff=cfg["d_ff"],
                  dropout=0.0, activation="relu", norm_first=False)
    if cfg["kind"] == "classifier":
        return ClassifierConfig(vocab_size=cfg["vocab_size"], num_classes=cfg["num_classes"],
                                num_layers=cfg["num_layers"], max_len=cfg["seq_len"],
                                positional="learned", pooling="mean", pad_id=PAD, **common)
    if cfg["kind"] == "causal_lm":
        return CausalLMConfig(vocab_size=cfg["vocab_size"], block_size=cfg["seq_len"],
                              num_layers=cfg["num_layers"], positional="learned",
                              tie_weights=False, **common)
    return Seq2SeqConfig(src_vocab_size=cfg["src_vocab_size"],
                         tgt_vocab_size=cfg["tgt_vocab_size"],
                         num_encoder_layers=cfg["num_encoder_layers"],
                         num_decoder_layers=cfg["num_decoder_layers"],
                         max_len=max(cfg["src_len"], cfg["seq_len"]), positional="sinusoidal",
                         scale_embeddings=True, pad_id=PAD, bos_id=BOS, eos_id=EOS, **common)


def npformer_model(cfg: dict, weights: str | None = None):
    """(model, task) of ``cfg`` on the current backend, with PyTorch's initial weights
    from ``weights`` (an .npz of a state dict) when given."""
    import numpy as np

    from npformer.models import CausalLM, Seq2SeqTransformer, TransformerClassifier
    from npformer.tasks import Classification, LanguageModeling, Translation
    from npformer.torch_interop import load_torch_state_dict

    model_class, task = {
        "classifier": (TransformerClassifier, Classification()),
        "causal_lm": (CausalLM, LanguageModeling()),
        "seq2seq": (Seq2SeqTransformer, Translation(label_smoothing=0.0, pad_id=PAD)),
    }[cfg["kind"]]
    model = model_class(npformer_config(cfg))
    if weights:
        with np.load(weights) as f:
            load_torch_state_dict(model, {k: f[k] for k in f.files})
    return model, task
