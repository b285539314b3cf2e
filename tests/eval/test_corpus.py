"""The code corpus: which standard-library files, in which order, and how a run identifies them."""

from __future__ import annotations

import hashlib
import os

import pytest

from hf_kbit.eval import corpus


@pytest.fixture
def fake_stdlib(tmp_path):
    """A small stdlib-like tree with every kind of folder and file the selection must leave out."""
    files = {
        "abc.py": "import os\n", "json/__init__.py": "x = 1\n", "json/decoder.py": "y = 2\n\n\n",
        "test/test_abc.py": "assert 1\n", "site-packages/pkg.py": "z = 3\n", "encodings/cp1252.py": "t = ()\n",
        "idlelib/idle_test/t.py": "pass\n", "config-3.12-x86_64-linux-gnu/python-config.py": "c = 0\n",
        "_sysconfigdata__linux.py": "build = {}\n", "README.txt": "not python\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "latin.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    os.symlink(tmp_path / "abc.py", tmp_path / "link.py")
    return tmp_path


def test_selection_and_order(fake_stdlib):
    kept = ["abc.py", "json/__init__.py", "json/decoder.py", "latin.py"]
    assert corpus.stdlib_sources(fake_stdlib) == sorted(kept, key=lambda p: hashlib.sha256(p.encode()).hexdigest())


def test_corpus_text_segments_and_fingerprint(fake_stdlib):
    c = corpus.python_stdlib_corpus(fake_stdlib)
    files = [label for label, _, _ in c.segments]
    assert "latin.py" not in files and c.info["skipped_not_utf8"] == ["latin.py"]
    assert c.info["files"] == 3 and c.info["kind"] == "code" and c.info["python"]
    for label, start, end in c.segments:  # each file once, its text followed by one blank line
        assert c.text[start:end] == (fake_stdlib / label).read_text().rstrip("\n") + "\n\n"
    assert c.segments[-1][2] == len(c.text) and c.info["sha256"] == hashlib.sha256(c.text.encode()).hexdigest()
    assert c.segments_within(1) == files[:1] and c.segments_within(len(c.text)) == files
    (fake_stdlib / "json/decoder.py").write_text("y = 3\n")
    changed = corpus.python_stdlib_corpus(fake_stdlib).info
    assert changed["files_sha256"] == c.info["files_sha256"] and changed["sha256"] != c.info["sha256"]


def test_real_stdlib_is_large_and_stable():
    c = corpus.python_stdlib_corpus()
    assert c.info["files"] > 300 and c.info["chars"] > 1_000_000
    assert not any(label.startswith(("test/", "site-packages/")) for label, _, _ in c.segments)
    assert corpus.python_stdlib_corpus().info == c.info


def test_load_corpus_by_name_and_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello\n")
    assert corpus.load_corpus(str(path)).text == "hello\n"
    assert corpus.load_corpus("python-stdlib").info["kind"] == "code"
    with pytest.raises(FileNotFoundError, match="neither one of"):
        corpus.load_corpus(str(tmp_path / "missing.txt"))
