"""Evaluation corpora: Jane Austen's novels (prose) and the Python standard library's sources (code).

Both are reproducible offline once cached: the Austen text comes from Debian's ``r-cran-janeaustenr``
(``apt-get download``, unpacked with ``dpkg -x``, never installed); the code corpus is read from the running
interpreter's own standard library. The cache lives in ``$HF_KBIT_CACHE`` or ``$XDG_CACHE_HOME/hf_kbit``
(default ``~/.cache/hf_kbit``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CORPORA = ("janeausten", "python-stdlib")


def cache_dir() -> Path:
    """Root of the evaluation cache (created on demand)."""
    root = os.environ.get("HF_KBIT_CACHE")
    if root:
        path = Path(root)
    else:
        path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf_kbit"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_command(cmd: list[str], cwd: Path, what: str) -> None:
    """Run ``cmd``; RuntimeError naming ``what``, the command and its stderr when it fails."""
    proc = subprocess.run(cmd, check=False, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{what} failed: `{shlex.join(cmd)}` exited {proc.returncode}:\n{proc.stderr.strip()[-2000:]}"
        )


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class Corpus:
    """A text to score and what identifies it.

    ``info``: JSON-ready facts (name, chars, sha256 and, per corpus, what makes it reproducible).
    ``segments``: ``(label, start, end)`` character spans of the documents the text joins, in order
    (the code corpus's files), so that a run can record which of them its tokens came from.
    """

    name: str
    text: str
    info: dict[str, Any]
    segments: list[tuple[str, int, int]] = field(default_factory=list)

    def segments_within(self, chars: int) -> list[str]:
        """Labels of the segments that start before character ``chars`` (those a token prefix reaches)."""
        return [label for label, start, _ in self.segments if start < chars]


# ----------------------------------------------------------------------------- Jane Austen

AUSTEN_DEB = "r-cran-janeaustenr"
# Publication order; the names are the R objects in the package's data.
AUSTEN_BOOKS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")


def austen_text_from_package_tree(root: Path) -> str:
    """The six novels as one text from an extracted janeaustenr package (``dpkg -x`` output or an R library).

    Lines of a novel are joined with newlines; novels are separated by a blank line, in
    publication order.
    """
    from . import rdata

    hits = sorted(root.rglob("janeaustenr/data/Rdata.rdx"))
    if not hits:
        raise FileNotFoundError(f"no janeaustenr/data/Rdata.rdx under {root}")
    data = rdata.read_lazyload_db(hits[0])
    missing = [b for b in AUSTEN_BOOKS if b not in data]
    if missing:
        raise RuntimeError(f"janeaustenr data lacks {missing}; found {sorted(data)}")
    return "\n\n".join("\n".join(line or "" for line in data[book]) for book in AUSTEN_BOOKS) + "\n"


def austen_corpus(deb: Path | None = None) -> Path:
    """Path of the cached Jane Austen text, fetched from Debian's r-cran-janeaustenr on first use.

    The package is downloaded (``apt-get download``), unpacked with ``dpkg -x`` in a
    temporary folder (never installed) and its R data parsed; only the text is cached.
    ``deb``: use this already-downloaded .deb instead (offline machines).
    """
    target = cache_dir() / "corpora" / "janeausten.txt"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if deb is None:
            if shutil.which("apt-get") is None:
                raise RuntimeError(
                    "the Jane Austen corpus comes from Debian's r-cran-janeaustenr package and needs `apt-get` "
                    "(or pass a downloaded .deb with --austen-deb, or any text file with --corpus)"
                )
            run_command(["apt-get", "download", AUSTEN_DEB], tmp,
                        f"downloading Debian's {AUSTEN_DEB} (run `apt-get update` first?)")
            debs = sorted(tmp.glob(f"{AUSTEN_DEB}_*.deb"))
            if not debs:
                raise RuntimeError(f"apt-get download {AUSTEN_DEB} produced no .deb")
            deb = debs[-1]
        run_command(["dpkg", "-x", str(deb), str(tmp / "tree")], tmp, f"unpacking {deb.name}")
        text = austen_text_from_package_tree(tmp / "tree")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(target)
    return target


# ----------------------------------------------------------------------------- Python standard library

# Folders left out of the code corpus: installed third-party packages (site-packages lives inside the stdlib
# folder on many installs), tests (test data, odd encodings, and the part that changes most between versions),
# generated tables that are not code (codec maps, pydoc's help text) and build configuration.
STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
)
STDLIB_SKIP_PREFIXES = ("config-", "_sysconfigdata")  # build configuration: machine paths, not code


def stdlib_sources(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the standard library's ``.py`` files that the code corpus uses, in corpus order.

    Order: by sha256 of the relative path. A file keeps its place relative to every other file whatever the
    Python version adds or drops, and a token budget that covers the first files samples the whole library
    rather than its alphabetical head (``__future__``, ``_aix_support``, ...). Symlinks are not followed.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library folder {root} does not exist")
    paths = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIP_DIRS and not d.startswith(STDLIB_SKIP_PREFIXES)]
        rel = Path(folder).relative_to(root)
        paths += [(rel / f).as_posix() for f in files
                  if f.endswith(".py") and not f.startswith(STDLIB_SKIP_PREFIXES)
                  and not os.path.islink(os.path.join(folder, f))]
    return sorted(paths, key=lambda p: hashlib.sha256(p.encode("utf-8")).hexdigest())


def python_stdlib_corpus(root: Path | None = None) -> Corpus:
    """The standard library's sources (:func:`stdlib_sources`) as one text, files joined by a blank line.

    Files that are not UTF-8 are left out (counted in ``info``). The Python version is part of the corpus:
    ``info`` records it with the sha256 of the ordered file list and of the text, so two runs on different
    interpreters show at once whether they scored the same code.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    parts, segments, skipped, offset = [], [], [], 0
    for rel in stdlib_sources(root):
        try:
            source = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        source = source.rstrip("\n") + "\n\n"
        segments.append((rel, offset, offset + len(source)))
        parts.append(source)
        offset += len(source)
    if not parts:
        raise RuntimeError(f"no UTF-8 .py file found under the standard library folder {root}")
    text = "".join(parts)
    files = [label for label, _, _ in segments]
    name = f"python-stdlib ({platform.python_implementation()} {platform.python_version()} sources)"
    info = {
        "name": name,
        "kind": "code",
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "selection": "*.py under sysconfig's stdlib, without " + ", ".join(sorted(STDLIB_SKIP_DIRS))
                     + " folders and config-*/_sysconfigdata* build files; ordered by sha256 of the relative path",
        "files": len(files),
        "files_sha256": _sha256("\n".join(files)),
        "skipped_not_utf8": skipped,
        "chars": len(text),
        "sha256": _sha256(text),
    }
    return Corpus(name, text, info, segments)


# ----------------------------------------------------------------------------- dispatch


def load_corpus(corpus: str, austen_deb: str | None = None) -> Corpus:
    """``--corpus``: ``janeausten`` (prose, the default), ``python-stdlib`` (code) or a UTF-8 text file."""
    if corpus == "janeausten":
        text = austen_corpus(Path(austen_deb) if austen_deb else None).read_text(encoding="utf-8")
        name = "janeausten (Debian r-cran-janeaustenr, 6 novels)"
        return Corpus(name, text, {"name": name, "kind": "prose", "chars": len(text), "sha256": _sha256(text)})
    if corpus == "python-stdlib":
        return python_stdlib_corpus()
    path = Path(corpus)
    if not path.is_file():
        raise FileNotFoundError(f"--corpus: {corpus!r} is neither one of {CORPORA} nor a text file")
    text = path.read_text(encoding="utf-8")
    return Corpus(path.name, text, {"name": path.name, "kind": "file", "chars": len(text), "sha256": _sha256(text)})
