"""The benchmarks: ``python bench/NAME.py`` (see bench/README.md).

Run as a script, a benchmark's own folder comes first on ``sys.path``, so its modules
would stand in for installed packages of the same name: transformers imports ``kernels``
(Hugging Face's kernel hub) where it finds one, found ``bench/kernels.py``, and that
module's import set the BLAS thread counts to 1 in the environment of every worker
started after it.  The folder leaves the path as soon as this package is imported (each
script imports it before anything else).
"""
import sys
from pathlib import Path

_FOLDER = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _FOLDER]
