"""Token vocabularies: the map between token strings and integer ids.

:class:`Vocab` is for word-level data (IMDB, English-French). Its ids are laid
out as::

    0 <pad>   1 <unk>   [<bos>]   [<eos>]   then the regular tokens,
                                            most frequent first, ties by string

so ``<pad>`` is always 0 and ``<unk>`` always 1, and building twice from the
same corpus gives the same ids. A vocabulary serialises to a JSON string, which
a checkpoint can hold as a 0-d unicode array (``np.array(vocab.to_json())``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence

from ..ops.contracts import (
    check_flag,
    check_size,
    check_string_lists,
    check_strings,
    read_json_object,
    shown,
)

__all__ = ["Vocab", "PAD", "UNK", "BOS", "EOS"]

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"


class TokenTable:
    """What a vocabulary of tokens ``_itos`` (id -> token) is compared and counted by:
    two are equal when they hold the same tokens in the same order."""

    _itos: tuple[str, ...]

    def __len__(self) -> int:
        return len(self._itos)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, type(self)):
            return NotImplemented
        return self._itos == other._itos

    def __hash__(self) -> int:
        return hash(self._itos)


class Vocab(TokenTable):
    """An immutable token <-> id map with reserved special tokens.

    Build one from a corpus with :meth:`Vocab.build`; the constructor takes the
    complete ordered token list (``id -> token``), whose first two entries must
    be ``<pad>`` and ``<unk>``.
    """

    def __init__(self, itos: Sequence[str]):
        itos = tuple(check_strings(itos, "itos", "token"))
        if itos[:2] != (PAD, UNK):
            raise ValueError(f"a Vocab must start with {PAD!r}, {UNK!r}; got {itos[:2]!r}")
        if len(set(itos)) != len(itos):
            raise ValueError("a Vocab's tokens must be distinct")
        self._itos = itos
        self._stoi = {token: i for i, token in enumerate(itos)}
        self._specials = frozenset(t for t in (PAD, UNK, BOS, EOS) if t in self._stoi)

    @classmethod
    def build(cls, token_lists: Iterable[Iterable[str]], min_freq: int = 1,
              max_size: int | None = None, bos: bool = False, eos: bool = False) -> Vocab:
        """A vocabulary of the tokens of ``token_lists`` (one list per example) occurring
        at least ``min_freq`` times, at most ``max_size`` of them (the most frequent; the
        specials not counted), in the order of the module's docstring; ``bos``, ``eos``:
        reserve ``<bos>`` (id 2) and/or ``<eos>`` (next id)."""
        check_size(min_freq, "min_freq", 1)
        check_size(max_size, "max_size", 0, optional=True)
        bos, eos = check_flag(bos, "bos"), check_flag(eos, "eos")
        specials = [PAD, UNK] + [BOS] * bos + [EOS] * eos
        token_lists = check_string_lists(token_lists, "token_lists", "token")
        counts = Counter(token for tokens in token_lists for token in tokens)
        for special in (PAD, UNK, BOS, EOS):
            counts.pop(special, None)
        kept = sorted((t for t, c in counts.items() if c >= min_freq),
                      key=lambda t: (-counts[t], t))
        if max_size is not None:
            kept = kept[:max_size]
        return cls(specials + kept)

    # --- lookups -----------------------------------------------------------
    def __contains__(self, token: object) -> bool:
        return token in self._stoi

    def __repr__(self) -> str:
        return f"Vocab(size={len(self)}, specials={[t for t in self._itos if t in self._specials]})"

    @property
    def tokens(self) -> tuple[str, ...]:
        """All tokens, indexed by id."""
        return self._itos

    def index(self, token: str) -> int:
        """The id of ``token``, or ``unk_id`` if it is unknown."""
        if not isinstance(token, str):
            raise TypeError(f"token must be a str, got {shown(token)} ({type(token).__name__})")
        return self._stoi.get(token, 1)

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """Map tokens to ids; unknown tokens become ``unk_id``."""
        stoi = self._stoi
        return [stoi.get(token, 1) for token in check_strings(tokens, "tokens", "token")]

    def decode(self, ids: Iterable[int], skip_specials: bool = False) -> list[str]:
        """Map ids back to tokens, optionally dropping the special tokens."""
        skip_specials = check_flag(skip_specials, "skip_specials")
        tokens = [self._itos[i] for i in self._checked_ids(ids)]
        if skip_specials:
            tokens = [t for t in tokens if t not in self._specials]
        return tokens

    def _checked_ids(self, ids: Iterable[int]) -> list[int]:
        """Token ids, each an integer in [0, len(self)) (a negative id would index from
        the end), refused naming its position."""
        if isinstance(ids, (str, bytes)):
            raise TypeError(f"ids must be a list of token ids (integers), got a "
                            f"{type(ids).__name__} ({ids!r})")
        checked = [check_size(i, f"ids[{n}]", 0) for n, i in enumerate(ids)]
        for n, i in enumerate(checked):
            if i >= len(self):
                raise ValueError(f"ids[{n}] = {i} is outside the vocabulary of {len(self)} "
                                 f"tokens (ids 0..{len(self) - 1})")
        return checked

    # --- special ids -------------------------------------------------------
    def _special_id(self, token: str) -> int:
        if token not in self._stoi:
            raise ValueError(f"this vocabulary has no {token} token "
                             f"(build it with {token[1:-1]}=True)")
        return self._stoi[token]

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def unk_id(self) -> int:
        return 1

    @property
    def bos_id(self) -> int:
        """The id of ``<bos>``; ValueError if the vocabulary has none."""
        return self._special_id(BOS)

    @property
    def eos_id(self) -> int:
        """The id of ``<eos>``; ValueError if the vocabulary has none."""
        return self._special_id(EOS)

    # --- serialisation -----------------------------------------------------
    def to_json(self) -> str:
        """A JSON string holding the whole vocabulary (for a checkpoint)."""
        return json.dumps({"type": "Vocab", "itos": list(self._itos)}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str, what: str = "the Vocab's JSON") -> Vocab:
        """Rebuild a vocabulary from :meth:`to_json`'s output (str, or a 0-d array);
        anything else is refused naming ``what`` (e.g. "the checkpoint's src_vocab") and
        what is wrong."""
        data = read_json_object(text, what, ("type", "itos"), "a serialised Vocab", "Vocab")
        try:
            return cls(data["itos"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{what} is not a serialised Vocab: {exc}") from None
