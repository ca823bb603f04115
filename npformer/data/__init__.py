"""Datasets, tokenizers, vocabularies and batching (host-side: NumPy arrays and lists).

Three real datasets, each read from its canonical download without unpacking:

- IMDB movie reviews (``aclImdb_v1.tar.gz``): :func:`load_imdb`, :func:`tokenize_imdb`;
- English-French pairs (d2l's ``fra-eng.zip``): :func:`load_fra_eng`, :func:`split_by_source`;
- tiny Shakespeare (``tinyshakespeare/input.txt``): :func:`load_shakespeare`, :class:`CharVocab`.

Subword pieces: :class:`BPE` learns byte-pair merges from word lists and splits
words into pieces a :class:`Vocab` holds (no word is then ``<unk>``).

Your own files (:mod:`npformer.data.files`): labelled texts in CSV, TSV or JSON
Lines for the classifier (:func:`load_text_classification`), ``source<TAB>target``
pairs for translation (:func:`read_sentence_pairs`), any UTF-8 text for the
language model (:func:`read_text_file`).

Every ``load_*`` function of the three datasets takes an optional ``path`` (the file or a folder
holding it) and otherwise looks in ``$NPFORMER_DATA`` and the user cache folder,
downloading there if needed (see :mod:`npformer.data.download`).
"""

from .batching import EpochBatches, batches, length_bucketed_batches, lm_batch, pad_batch
from .bpe import BPE
from .download import (
    FRA_ENG,
    IMDB,
    TINY_SHAKESPEARE,
    ChecksumError,
    DatasetFormatError,
    DatasetNotFoundError,
    DatasetSpec,
    DatasetWarning,
    cache_dir,
    fetch,
    locate,
    locate_dataset,
)
from .files import (
    TextClassificationData,
    is_user_data,
    load_text_classification,
    read_labelled_texts,
    read_sentence_pairs,
    read_text_file,
    sorted_labels,
)
from .fra_eng import (
    filter_by_length,
    load_fra_eng,
    parse_fra_eng,
    preprocess_fra_eng,
    read_fra_eng,
    split_by_source,
    tokenize_fra_eng,
)
from .imdb import load_imdb, load_imdb_splits, read_imdb_archive, split_validation, tokenize_imdb
from .shakespeare import CharVocab, load_shakespeare, read_shakespeare, split_90_10
from .vocab import Vocab

__all__ = [  # the names imported above
    "DatasetSpec", "IMDB", "FRA_ENG", "TINY_SHAKESPEARE", "DatasetNotFoundError",
    "DatasetFormatError", "ChecksumError", "DatasetWarning", "cache_dir", "locate",
    "locate_dataset", "fetch", "Vocab", "CharVocab", "BPE", "read_imdb_archive", "load_imdb",
    "load_imdb_splits", "tokenize_imdb", "split_validation", "preprocess_fra_eng",
    "tokenize_fra_eng", "parse_fra_eng", "read_fra_eng", "load_fra_eng", "filter_by_length",
    "split_by_source", "read_shakespeare", "load_shakespeare", "split_90_10",
    "TextClassificationData", "is_user_data", "load_text_classification", "read_labelled_texts",
    "sorted_labels", "read_sentence_pairs", "read_text_file", "pad_batch", "batches",
    "length_bucketed_batches", "lm_batch", "EpochBatches",
]
