"""Encoder-decoder Transformer ("Attention is all you need"; d2l's English-French model).

    source ids (B, S) -> embeddings * sqrt(D) + sinusoids -> N encoder blocks -> memory
    target ids (B, T) -> embeddings * sqrt(D) + sinusoids -> N decoder blocks
                         (causal + padding self-attention, cross-attention to memory)
                      -> linear -> logits (B, T, V_tgt)
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import backend, ops
from ..nn import DecoderBlock, EncoderBlock, Linear, Module
from ..ops._checks import check_rank
from .common import TokenEmbedding, check_config, final_norm, key_padding, valid_lengths_from


@dataclass
class Seq2SeqConfig:
    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 256
    num_heads: int = 4
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    d_ff: int = 1024
    max_len: int = 64
    dropout: float = 0.1
    activation: str = "relu"
    norm_first: bool = False
    head_dim: int | None = None
    positional: str = "sinusoidal"
    scale_embeddings: bool = True
    pad_id: int = 0
    bos_id: int = 2
    eos_id: int = 3

    def __post_init__(self):
        check_config(self)


class Seq2SeqTransformer(Module):
    kind = "seq2seq"
    config_class = Seq2SeqConfig

    def __init__(self, config: Seq2SeqConfig):
        self.config = c = config
        self.src_embed = TokenEmbedding(c.src_vocab_size, c.d_model, c.max_len, c.positional,
                                        c.dropout, c.scale_embeddings, init_std=c.d_model ** -0.5)
        self.tgt_embed = TokenEmbedding(c.tgt_vocab_size, c.d_model, c.max_len, c.positional,
                                        c.dropout, c.scale_embeddings, init_std=c.d_model ** -0.5)
        self.encoder = [EncoderBlock(c.d_model, c.num_heads, c.d_ff, c.dropout, c.activation,
                                     c.norm_first, c.head_dim) for _ in range(c.num_encoder_layers)]
        self.encoder_norm = final_norm(c)
        self.decoder = [DecoderBlock(c.d_model, c.num_heads, c.d_ff, c.dropout, c.activation,
                                     c.norm_first, c.head_dim) for _ in range(c.num_decoder_layers)]
        self.decoder_norm = final_norm(c)
        self.out_proj = Linear(c.d_model, c.tgt_vocab_size)

    # ------------------------------------------------------------------ training
    def encode(self, src, src_lens=None):
        """src (B, S) -> memory (B, S, D), memory mask (B, 1, 1, S)."""
        memory, src_mask, _ = self._encode(src, src_lens)
        return memory, src_mask

    def _encode(self, src, src_lens):
        """-> memory (B, S, D), memory mask (B, 1, 1, S), the source packing."""
        check_rank(src, 2, "source ids (batch, positions)")
        if src_lens is None:
            src_lens = valid_lengths_from(src, self.config.pad_id)
        src_mask = key_padding(src_lens, src.shape[1])  # (B, 1, 1, S)
        packing = ops.Packing.from_lengths(src_lens, src.shape[1])  # the valid source positions
        x = packing.pack(self.src_embed(src))  # rows (N_src, D): padding is skipped
        for block in self.encoder:
            x = block(x, mask=src_mask, packing=packing)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return packing.unpack(x), src_mask, packing  # (B, S, D), zeros at padding

    def forward(self, src, tgt_in, src_lens=None, tgt_lens=None, positions=None):
        """src (B, S), tgt_in (B, T) (target shifted right, starting with <bos>)
        -> logits (B, T, V_tgt).

        ``positions`` (N,) integers, flat indices into the B*T target positions: only
        those rows get logits, (N, V_tgt).  Training passes the non-padding positions,
        skipping the output projection where no loss is taken (the largest matmul of
        the model when the vocabulary is big)."""
        check_rank(tgt_in, 2, "target ids (batch, positions)")
        if tgt_in.shape[0] != src.shape[0]:
            raise ValueError(f"target batch of {tgt_in.shape[0]} sequences does not match "
                             f"the source batch of {src.shape[0]}")
        memory, memory_mask, src_packing = self._encode(src, src_lens)
        if tgt_lens is None:
            tgt_lens = valid_lengths_from(tgt_in, self.config.pad_id)
        length = tgt_in.shape[1]
        self_mask = ops.causal_mask(length, like=memory)[None, None, :, :] \
            & key_padding(tgt_lens, length)  # (B, 1, T, T)
        # With logits only at ``positions`` (real targets), padding targets need no value at
        # all: the decoder runs on the valid target positions, packed as rows.
        packing = None
        if positions is not None:
            _check_positions(positions, tgt_lens, length)
            packing = ops.Packing.from_lengths(tgt_lens, length)
        y = self.tgt_embed(tgt_in)  # (B, T, D)
        if packing is not None:
            y = packing.pack(y)  # rows (N_tgt, D)
        for block in self.decoder:
            y = block(y, memory, self_mask=self_mask, memory_mask=memory_mask, packing=packing)
        if self.decoder_norm is not None:
            y = self.decoder_norm(y)
        if packing is not None:
            y = packing.unpack(y)  # (B, T, D), zeros at padding
        self._save((positions, tuple(tgt_in.shape), packing, src_packing))
        if positions is not None:
            xp = backend.namespace_of(y)
            y = xp.take(xp.reshape(y, (-1, y.shape[-1])), positions, axis=0)  # (N, D)
        return self.out_proj(y)  # (B, T, V_tgt), or (N, V_tgt) at ``positions``

    def backward(self, dlogits):
        positions, (batch, length), packing, src_packing = self._pop_saved()
        dy = self.out_proj.backward(dlogits)
        if positions is not None:  # rows without logits get zero gradient
            dy = backend.scatter_rows(positions, dy, batch * length)
            dy = backend.namespace_of(dy).reshape(dy, (batch, length, -1))  # (B, T, D)
        if packing is not None:
            dy = packing.pack(dy)  # rows (N_tgt, D): the backward of unpack
        if self.decoder_norm is not None:
            dy = self.decoder_norm.backward(dy)
        dmemory = None
        for block in reversed(self.decoder):
            dy, dmem = block.backward(dy)
            dmemory = dmem if dmemory is None else dmemory + dmem  # memory feeds every block
        if packing is not None:
            dy = packing.unpack(dy)  # the backward of pack: 0 at padding
        self.tgt_embed.backward(dy)
        dmemory = src_packing.pack(dmemory)  # (B, S, D) -> rows (N_src, D)
        if self.encoder_norm is not None:
            dmemory = self.encoder_norm.backward(dmemory)
        for block in reversed(self.encoder):
            dmemory = block.backward(dmemory)
        self.src_embed.backward(src_packing.unpack(dmemory))

    # ------------------------------------------------------------------ cached inference
    def start_state(self) -> list[dict]:
        return [{} for _ in self.decoder]

    def decode_step(self, tgt_ids, memory, memory_mask, states: list[dict], offset: int):
        """Inference: tgt_ids (B, T_new) at positions offset.. -> logits (B, T_new, V),
        with self-attention keys/values cached and cross-attention ones computed once."""
        y = self.tgt_embed(tgt_ids, offset=offset)
        self_mask = ops.causal_mask(tgt_ids.shape[1], offset + tgt_ids.shape[1], like=y)
        for block, state in zip(self.decoder, states):
            y = block.step(y, memory, state, self_mask=self_mask, memory_mask=memory_mask)
        if self.decoder_norm is not None:
            y = self.decoder_norm(y)
        return self.out_proj(y)



def _check_positions(positions, tgt_lens, length: int) -> None:
    """Logits are asked for at real target positions only: b * T + t with t < tgt_lens[b]."""
    xp = backend.namespace_of(positions)
    batch = tgt_lens.shape[0]
    if not bool(xp.all((positions >= 0) & (positions < batch * length))):
        raise ValueError(f"positions must be flat indices into the {batch} x {length} target "
                         "positions, in [0, B * T)")
    t = positions % length  # (N,)
    if not bool(xp.all(t < xp.take(tgt_lens, positions // length, axis=0))):
        raise ValueError("positions must be real (non-padding) targets, b * T + t with "
                         "t < tgt_lens[b]: the decoder skips padding target positions")
