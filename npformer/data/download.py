"""Finding dataset files on disk, and downloading them once when they are absent.

A dataset file is looked for, in this order:

1. an explicit ``path`` (what a demo's ``--data PATH`` passes): either the file
   itself (any name) or a folder holding it under its canonical relative name;
2. the folder named by the environment variable ``NPFORMER_DATA``;
3. the per-user cache folder, ``$XDG_CACHE_HOME/npformer`` or ``~/.cache/npformer``.

A folder is expected in the canonical layout of the offline data folder::

    aclImdb_v1.tar.gz
    fra-eng.zip
    tinyshakespeare/input.txt      (a bare input.txt is accepted too)

An explicit ``path`` is taken at its word: a folder that lacks the file, or a path
that does not exist, is an error naming them (no fall-through, no download).

A file found nowhere is downloaded into the cache folder (:func:`fetch`: atomically, its
digest checked); when that fails (no network, say) a single :class:`DatasetNotFoundError`
names the file, every place searched, the download address and the fix.

Files found locally are *not* checked against the checksums: a user may hold
their own copy (another mirror, a re-packed archive). The readers in this
package check that a file opens and has the expected content instead.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["DatasetNotFoundError", "DatasetFormatError", "ChecksumError", "DatasetWarning",
           "DatasetSpec", "IMDB", "FRA_ENG", "TINY_SHAKESPEARE", "cache_dir", "locate",
           "locate_dataset", "fetch"]

ENV_VAR = "NPFORMER_DATA"


class DatasetNotFoundError(FileNotFoundError):
    """A dataset file is absent from every place searched and could not be downloaded."""


class DatasetFormatError(ValueError):
    """A dataset file exists but is not readable as the expected format."""


class ChecksumError(ValueError):
    """A downloaded file's digest matches none of the accepted checksums."""


class DatasetWarning(UserWarning):
    """A dataset file was read, but some of its content was skipped (the message says
    what and where)."""


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset file lives and how to recognise a good download."""

    name: str  # a short human-readable name, for messages
    filename: str  # its path relative to a data folder (and in the cache)
    url: str  # the canonical download address
    checksums: frozenset[str]  # of a good download: a sha256 (64 hex digits) or a sha1 (40)
    alternatives: tuple[str, ...] = ()  # other relative paths accepted inside a data folder


# Checksums: the first of each set is the sha256 of the project's offline copy (its
# SHA256SUMS); the others are those of the official downloads.
IMDB = DatasetSpec(
    name="IMDB Large Movie Review Dataset v1.0",
    filename="aclImdb_v1.tar.gz",
    url="https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz",
    checksums=frozenset({
        # offline copy (rebuilt from the original review files; same reviews)
        "9d55595fb1965681500e9c18ca5533388ec0b63bab356111e69965f2cbd94630",
        # official Stanford archive (84,125,825 bytes), as pinned by several
        # independent loaders (e.g. Julia's MLDatasets/DataDeps, gomlx)
        "c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe",
    }),
)

FRA_ENG = DatasetSpec(
    name="Tatoeba English-French pairs (d2l's fra-eng.zip)",
    filename="fra-eng.zip",
    url="http://d2l-data.s3-accelerate.amazonaws.com/fra-eng.zip",
    checksums=frozenset({
        # offline copy: same text as d2l's, but a different zip (its sha1 differs)
        "98b9896dd23a8fbdc60a7adb6f055382df75bdbd4de1db52eb29726d347c6701",
        # d2l publishes only a sha1 for its fra-eng.zip (d2l's DATA_HUB); no
        # official sha256 could be established, so the sha1 is what we check.
        "94646ad1522d915e7b0f9296181140edcf86a4f5",
    }),
    alternatives=("fra-eng/fra.txt", "fra.txt"),
)

TINY_SHAKESPEARE = DatasetSpec(
    name="tiny Shakespeare",
    filename="tinyshakespeare/input.txt",
    url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
    checksums=frozenset({
        # the offline copy is byte-identical to karpathy/char-rnn's file
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    }),
    alternatives=("input.txt",),
)


def cache_dir() -> Path:
    """The per-user cache folder: ``$XDG_CACHE_HOME/npformer`` or ``~/.cache/npformer``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "npformer"


def _find_in_folder(folder: Path, names: Sequence[str]) -> Path | None:
    """The first of ``folder / name`` that is a file, or None."""
    return next((folder / name for name in names if (folder / name).is_file()), None)


def _downloader(url: str):
    """pooch's HTTP(S) downloader with a progress bar (a seam the tests replace to fake
    the network: any callable ``(url, output_file, pooch)`` that writes the file)."""
    import pooch

    return pooch.HTTPDownloader(progressbar=True, timeout=60)


def fetch(url: str, destination: Path, checksums: Iterable[str] = ()) -> Path:
    """Download ``url`` to ``destination`` atomically, verifying its digest.

    `pooch <https://www.fatiando.org/pooch/>`_ streams the bytes, with a progress bar,
    into a private staging folder in ``destination``'s folder; if ``checksums`` is not
    empty the file must match one of them (sha256 or sha1 hex digests: a dataset may have
    several accepted copies, which pooch's single ``known_hash`` cannot express) or
    :class:`ChecksumError` is raised and nothing is kept; then it is renamed into place
    (``os.replace``: an interrupted or concurrent download never leaves a half-written
    file under the final name).  Network failures propagate as ``OSError``.
    """
    import pooch

    destination = Path(destination)
    accepted = {c.lower() for c in checksums}
    for c in accepted:
        if len(c) not in (64, 40):
            raise ValueError(f"unsupported checksum {c!r}: expected a sha256 or sha1 hex digest")
    kinds = {"sha256" if len(c) == 64 else "sha1" for c in accepted}  # by the digest's length
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=destination.parent, prefix=f".{destination.name}."))
    logger = pooch.get_logger()  # its "Downloading data from ..." line would come before
    quiet_from = logger.level  # an error message; the progress bar says as much
    logger.setLevel("WARNING")
    try:
        fetched = Path(pooch.retrieve(url, known_hash=None, fname=destination.name,
                                      path=staging, downloader=_downloader(url)))
        digests = {pooch.file_hash(str(fetched), alg=kind) for kind in kinds}
        if accepted and not digests & accepted:
            raise ChecksumError(
                f"the file downloaded from {url} has checksum(s) {sorted(digests)}, "
                f"none of the accepted {sorted(accepted)}: the download is corrupt or the "
                f"file has changed upstream. It was deleted; try again, or download it "
                f"yourself and pass --data PATH.")
        os.replace(fetched, destination)
    finally:
        logger.setLevel(quiet_from)
        shutil.rmtree(staging, ignore_errors=True)
    return destination


def locate(filename: str, url: str, checksums: Iterable[str],
           path: str | os.PathLike | None = None, env_var: str = ENV_VAR, *,
           alternatives: Sequence[str] = (), download: bool = True) -> Path:
    """The path of the dataset file ``filename`` (relative to a data folder, or
    ``alternatives`` there), found where the module's docstring says, or downloaded from
    ``url`` (checked against ``checksums``) into the cache folder unless ``download`` is
    False.  ``path``: an explicit file or folder, taken at its word (a typo should not
    trigger a download or pick another copy); ``env_var``: the variable naming a folder.

    Raises:
        DatasetNotFoundError: an explicit ``path`` does not exist or lacks the
            file; or the file is found nowhere and downloading was disabled or
            failed (the message lists every place searched).
        ChecksumError: a download did not match any accepted checksum.
    """
    names = (filename, *alternatives)
    searched: list[str] = []

    if path is not None:
        explicit = Path(path).expanduser()
        if explicit.is_file():
            return explicit
        if not explicit.exists():
            raise DatasetNotFoundError(
                f"{explicit} does not exist: pass the path of {Path(filename).name} "
                f"or of a folder holding it (download address: {url}).")
        found = _find_in_folder(explicit, names)
        if found is not None:
            return found
        raise DatasetNotFoundError(
            f"the data folder {explicit} has no {' or '.join(names)}: put the file there, "
            f"or pass the file itself (download address: {url}).")

    env_value = os.environ.get(env_var)
    if env_value:
        folder = Path(env_value).expanduser()
        found = _find_in_folder(folder, names)
        if found is not None:
            return found
        state = "no such folder" if not folder.is_dir() else f"no {' or '.join(names)} in it"
        searched.append(f"{folder} (${env_var}): {state}")
    else:
        searched.append(f"${env_var}: not set")

    cache = cache_dir()
    found = _find_in_folder(cache, names)
    if found is not None:
        return found
    searched.append(f"{cache} (cache folder): no {' or '.join(names)} in it")

    destination = cache / filename
    failure, cause = f"Downloading was disabled; its address is {url}", None
    if download:
        try:
            return fetch(url, destination, checksums)
        except ChecksumError:
            raise
        except OSError as exc:  # URLError, HTTPError, timeouts, unwritable cache
            failure, cause = f"Downloading it from {url} failed: {exc}", exc
    places = "\n".join(f"  - {place}" for place in searched)
    raise DatasetNotFoundError(
        f"Could not find the dataset file {filename!r}.\n"
        f"Searched:\n{places}\n"
        f"{failure}.\n"
        f"To fix: download {url} yourself, then pass --data PATH (the file, or its "
        f"folder) or set {env_var}=FOLDER, or save it as {destination}.") from cause


def locate_dataset(spec: DatasetSpec, path: str | os.PathLike | None = None,
                   *, download: bool = True) -> Path:
    """:func:`locate` for one of the known datasets (:data:`IMDB`, :data:`FRA_ENG`, ...)."""
    return locate(spec.filename, spec.url, spec.checksums, path,
                  alternatives=spec.alternatives, download=download)
