"""hf_kbit._lib: where the compiled CUDA library is looked for, and the errors when it can't be had.

CPU only: the search is tested with empty placeholder files (never dlopen'ed, except where a
test wants the "could not be loaded" error), with the package folder and the site-packages
folders replaced by temporary folders so that a real installed library never interferes.
"""

from __future__ import annotations

import sys

import pytest
import torch

from hf_kbit import _lib


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """``_lib`` with nothing loaded, no $HF_KBIT_LIBRARY, an empty package folder and two empty
    site-packages folders; yields ``(package_dir, [site folders])``."""
    monkeypatch.setattr(_lib, "_lib", None)
    monkeypatch.setattr(_lib, "_load_error", None)
    monkeypatch.delenv(_lib.LIBRARY_ENV, raising=False)
    package = tmp_path / "src" / "hf_kbit"
    package.mkdir(parents=True)
    monkeypatch.setattr(_lib, "_PACKAGE_DIR", package)
    entries = [tmp_path / "site-a", tmp_path / "site-b"]
    for entry in entries:
        entry.mkdir()
    monkeypatch.setattr(_lib, "site_dirs", lambda: [str(e) for e in entries])
    return package, entries


def _place(folder, name=_lib.LIBRARY_NAME):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(b"not a shared library")
    return path


def test_finds_library_in_a_site_packages_hf_kbit_folder(fresh):
    """scikit-build-core editable installs: Python files in the source tree, library in site-packages/hf_kbit/."""
    package, (site_a, site_b) = fresh
    placed = _place(site_b / "hf_kbit")
    assert _lib.library_path() == placed.resolve()


def test_search_order_package_folder_then_site_packages_in_order(fresh):
    package, (site_a, site_b) = fresh
    in_b = _place(site_b / "hf_kbit")
    in_a = _place(site_a / "hf_kbit")
    assert _lib.library_path() == in_a.resolve(), "the earlier site-packages folder wins"
    in_package = _place(package)
    assert _lib.library_path() == in_package.resolve(), "the package folder wins over site-packages"
    candidates = _lib.library_candidates()
    assert candidates[:3] == [in_package.resolve(), in_a.resolve(), in_b.resolve()]


def test_site_folder_without_library_is_skipped(fresh):
    package, (site_a, site_b) = fresh
    (site_a / "hf_kbit").mkdir()
    _place(site_a / "hf_kbit", "libsomething_else.so")
    placed = _place(site_b / "hf_kbit")
    assert _lib.library_path() == placed.resolve()


def test_candidates_have_no_duplicates(fresh, monkeypatch):
    package, (site_a, _) = fresh
    # A site folder may name the package folder again (an install into the source tree's parent).
    monkeypatch.setattr(_lib, "site_dirs", lambda: [str(package.parent), str(site_a), str(site_a), str(site_a) + "/"])
    candidates = _lib.library_candidates()
    assert len(candidates) == len(set(candidates))
    assert candidates[0] == package.resolve() / _lib.LIBRARY_NAME


def test_current_directory_and_sys_path_are_never_searched(fresh, monkeypatch, tmp_path):
    """A library planted in ./hf_kbit/ (or any sys.path entry) must not be dlopen'ed."""
    package, _ = fresh
    monkeypatch.undo()  # the real site_dirs, sys.path and package folder
    monkeypatch.setattr(_lib, "_lib", None)
    monkeypatch.setattr(_lib, "_load_error", None)
    monkeypatch.delenv(_lib.LIBRARY_ENV, raising=False)
    planted = tmp_path / "cwd"
    _place(planted / "hf_kbit")
    monkeypatch.chdir(planted)
    monkeypatch.setattr(sys, "path", ["", str(planted), *sys.path])
    assert all(not str(c).startswith(str(planted.resolve())) for c in _lib.library_candidates())
    assert not str(_lib.library_path()).startswith(str(planted.resolve()))


def test_environment_variable_overrides_search(fresh, monkeypatch, tmp_path):
    package, (site_a, _) = fresh
    _place(package)
    _place(site_a / "hf_kbit")
    explicit = _place(tmp_path / "elsewhere", "custom.so")
    monkeypatch.setenv(_lib.LIBRARY_ENV, str(explicit))
    assert _lib.library_path() == explicit


def test_missing_library_error_lists_where_it_looked(fresh):
    package, (site_a, site_b) = fresh
    assert not _lib.available()
    with pytest.raises(_lib.KbitLibraryError, match="was not found") as info:
        _lib.load()
    message = str(info.value)
    for folder in (package, site_a / "hf_kbit", site_b / "hf_kbit"):
        assert str(folder.resolve()) in message
    assert _lib.LIBRARY_ENV in message and "pip install" in message


def test_missing_override_error_names_the_variable(fresh, monkeypatch, tmp_path):
    package, _ = fresh
    _place(package)  # a library that would be found by the search is not used instead
    missing = tmp_path / "nope" / _lib.LIBRARY_NAME
    monkeypatch.setenv(_lib.LIBRARY_ENV, str(missing))
    with pytest.raises(_lib.KbitLibraryError, match=f"{_lib.LIBRARY_ENV}=.*is not a file"):
        _lib.load()


def test_unloadable_library_error_names_the_path(fresh):
    package, (site_a, _) = fresh
    placed = _place(site_a / "hf_kbit")  # found by the search, but not an ELF file
    with pytest.raises(_lib.KbitLibraryError, match="could not be loaded") as info:
        _lib.load()
    assert str(placed.resolve()) in str(info.value)
    with pytest.raises(_lib.KbitLibraryError, match="could not be loaded"):
        _lib.load()  # the failure is remembered, not retried


def test_require_gpu_error_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(_lib.KbitLibraryError, match="CUDA GPU"):
        _lib.require_gpu()
