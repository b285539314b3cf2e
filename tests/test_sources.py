"""Every Python source of the package, its scripts and its tests compiles without a warning.

Python 3.12 reports an invalid escape sequence in a string (``"\\ "`` in a docstring) as a SyntaxWarning each
time the module is first compiled, that is on a user's first import; 3.11 only as a DeprecationWarning that
nobody sees. Compiling with warnings as errors catches both on any interpreter.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for part in ("hf_kbit", "scripts", "tests") for p in (ROOT / part).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_compiles_without_warnings(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile(path.read_text(encoding="utf-8"), str(path), "exec")


def test_an_invalid_escape_is_caught():
    with warnings.catch_warnings(), pytest.raises((SyntaxError, SyntaxWarning, DeprecationWarning)):
        warnings.simplefilter("error")
        compile('"""a TensorPlan\\ s"""', "example.py", "exec")
