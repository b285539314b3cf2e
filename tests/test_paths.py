"""kbit-convert's reads stay inside the model folder, and its output never replaces what it was not asked to."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_kbit
from hf_kbit import convert as convert_mod
from hf_kbit.convert import run as convert_run
from hf_kbit.convert import sources as convert_sources
from hf_kbit.convert import ConversionError, ConversionResult, convert

from convert_helpers import llama_fp32, make_llama  # noqa: F401


def load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def packed(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def single_file_copy(src: Path, dst: Path, scale: float = 1.0) -> Path:
    """``src`` (sharded) rewritten as one ``model.safetensors`` in ``dst`` (tensors times ``scale``)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file({k: v * scale for k, v in packed(src).items()}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------------------- which files are read


def test_index_cannot_point_outside_the_folder(llama_fp32, tmp_path):
    elsewhere = single_file_copy(llama_fp32, tmp_path / "elsewhere")
    outside = (elsewhere / "model.safetensors").resolve()
    for name in (str(outside), "../elsewhere/model.safetensors"):
        src = tmp_path / "src"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(llama_fp32, src, ignore=shutil.ignore_patterns("*.safetensors"))
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"] = dict.fromkeys(index["weight_map"], name)
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ConversionError, match=r"model\.safetensors\.index\.json.*expected a file name relative"):
            convert(src, tmp_path / "out", progress=False)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["model\x1b[2J.safetensors", "a\\..\\b.safetensors", "config.json", 7],
                         ids=["control-char", "backslash", "not-safetensors", "not-a-string"])
def test_odd_index_names_are_refused(llama_fp32, tmp_path, name):
    src = tmp_path / "src"
    shutil.copytree(llama_fp32, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = name
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=r"model\.safetensors\.index\.json names the file"):
        convert(src, tmp_path / "out", progress=False)


def test_malformed_index_is_a_clear_error(llama_fp32, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(llama_fp32, src)
    (src / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ConversionError, match=r"model\.safetensors\.index\.json is not a safetensors index"):
        convert(src, tmp_path / "out", progress=False)


def test_symlink_out_of_a_local_folder_is_refused(llama_fp32, tmp_path):
    elsewhere = single_file_copy(llama_fp32, tmp_path / "elsewhere")
    src = tmp_path / "src"
    shutil.copytree(elsewhere, src, ignore=shutil.ignore_patterns("*.safetensors"))
    (src / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    with pytest.raises(ConversionError, match=r"resolves to .*outside the model folder"):
        convert(src, tmp_path / "out", progress=False)
    # a symlinked tokenizer file would be copied into the output (and pushed): refused as well
    src2 = tmp_path / "src2"
    shutil.copytree(elsewhere, src2, ignore=shutil.ignore_patterns("tokenizer.json"))
    (src2 / "tokenizer.json").symlink_to(elsewhere / "tokenizer.json")
    with pytest.raises(ConversionError, match=r"tokenizer\.json resolves to .*outside the model folder"):
        convert(src2, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_symlinks_inside_the_folder_and_cache_snapshots_are_read(llama_fp32, tmp_path):
    """A Hugging Face cache snapshot's files are symlinks into the repo's blobs folder: that is inside."""
    repo = tmp_path / "cache" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in llama_fp32.iterdir():
        shutil.copy2(f, repo / "blobs" / f"sha-{f.name}")
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f"sha-{f.name}"))
    got = convert(snapshot, tmp_path / "got", progress=False).out
    ref = convert(llama_fp32, tmp_path / "ref", progress=False).out
    assert packed(got).keys() == packed(ref).keys()
    assert all(torch.equal(packed(got)[k], packed(ref)[k]) for k in packed(ref))


def test_stray_safetensors_file_is_not_converted(llama_fp32, tmp_path):
    """Without an index, from_pretrained reads model.safetensors; so does kbit-convert, whatever else is there."""
    src = single_file_copy(llama_fp32, tmp_path / "src")
    stray = {k: v * 0 + 1 for k, v in packed(llama_fp32).items()}
    save_file(stray, src / "model_old.safetensors", metadata={"format": "pt"})
    config = hf_kbit.KbitConfig(bits=4)
    out = convert(src, tmp_path / "out", config, progress=False).out
    ref = convert(single_file_copy(llama_fp32, tmp_path / "clean"), tmp_path / "ref", config, progress=False).out
    got, want = packed(out), packed(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_several_safetensors_without_model_safetensors_or_index_is_an_error(llama_fp32, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(llama_fp32, src)
    (src / "model.safetensors.index.json").unlink()
    names = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(names) > 1
    with pytest.raises(ConversionError, match="several .safetensors files") as e:
        convert(src, tmp_path / "out", progress=False)
    assert all(n in str(e.value) for n in names)


# ---------------------------------------------------------------------------- what --out may replace


def test_overwrite_never_replaces_a_folder_holding_the_source(llama_fp32, tmp_path):
    parent = tmp_path / "p"
    shutil.copytree(llama_fp32, parent / "model")
    before = files_of(parent)
    for out in (parent, parent / "model", tmp_path):
        with pytest.raises(ConversionError, match="holds the source|is the source"):
            convert(parent / "model", out, overwrite=True, progress=False)
    assert files_of(parent) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def test_overwrite_never_replaces_the_current_folder(llama_fp32, tmp_path, monkeypatch):
    parent = tmp_path / "p"
    shutil.copytree(llama_fp32, parent / "model")
    (parent / "notes.txt").write_text("mine")
    monkeypatch.chdir(parent)
    with pytest.raises(ConversionError, match="current folder"):
        convert("./model", ".", overwrite=True, progress=False)
    with pytest.raises(ConversionError, match="holds the current folder"):
        convert(llama_fp32, "..", overwrite=True, progress=False)
    assert (parent / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in parent.iterdir()) == ["model", "notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def test_overwrite_never_replaces_home_or_root(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(ConversionError, match="home folder"):
        convert_mod.check_output(home, overwrite=True)
    with pytest.raises(ConversionError, match="filesystem root"):
        convert_mod.check_output(Path("/"), overwrite=True)


def _during_write(monkeypatch, action):
    """Run ``action`` after all shards are written, just before config.json (the run's last file) and the rename."""
    real = convert_run._write_config

    def write_config(*args, **kwargs):
        action()
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_run, "_write_config", write_config)


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_folder_created_during_the_run_is_kept(llama_fp32, tmp_path, monkeypatch, overwrite):
    out = tmp_path / "out"

    def someone_writes():
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")

    _during_write(monkeypatch, someone_writes)
    with pytest.raises(ConversionError, match="while this conversion ran"):
        convert(llama_fp32, out, overwrite=overwrite, progress=False)
    assert files_of(out) == {"theirs.txt": b"theirs"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the run's temporary output is gone


def test_overwrite_replaces_only_the_folder_that_was_checked(llama_fp32, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")

    def someone_replaces():
        shutil.rmtree(out)
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")

    _during_write(monkeypatch, someone_replaces)
    with pytest.raises(ConversionError, match="while this conversion ran"):
        convert(llama_fp32, out, overwrite=True, progress=False)
    assert files_of(out) == {"theirs.txt": b"theirs"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_restores_the_old_output_when_the_rename_fails(llama_fp32, tmp_path, monkeypatch):
    from hf_kbit import _paths

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real = _paths.rename_noreplace

    def failing(src, dst):
        if ".kbit-tmp-" in Path(src).name:
            raise OSError(errno.EIO, "I/O error", str(dst))
        return real(src, dst)

    monkeypatch.setattr(_paths, "rename_noreplace", failing)
    with pytest.raises(OSError, match="I/O error"):
        convert(llama_fp32, out, overwrite=True, progress=False)
    assert files_of(out) == {"old.txt": b"old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_concurrent_conversions_to_one_out(llama_fp32, tmp_path, monkeypatch):
    """Four runs reach the final rename together: one publishes, three fail cleanly, nothing is left behind."""
    out, runs = tmp_path / "out", 4
    barrier = threading.Barrier(runs)
    _during_write(monkeypatch, lambda: barrier.wait(timeout=300))
    results: list = [None] * runs

    def run(i: int) -> None:
        try:
            results[i] = convert(llama_fp32, out, hf_kbit.KbitConfig(bits=2 + i), progress=False)
        except Exception as e:  # noqa: BLE001 -- collected and checked below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [i for i, r in enumerate(results) if isinstance(r, ConversionResult)]
    assert len(won) == 1, results
    for i, r in enumerate(results):
        if i not in won:
            assert isinstance(r, ConversionError) and "while this conversion ran" in str(r), r
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 2 + won[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert load(out) is not None


def test_rename_noreplace_never_replaces(tmp_path):
    from hf_kbit import _paths

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(FileExistsError):
        _paths.rename_noreplace(tmp_path / "a", tmp_path / "b")  # even an empty folder
    _paths.rename_noreplace(tmp_path / "a", tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "c"]


def test_rename_noreplace_fallback(tmp_path, monkeypatch):
    """Where renameat2 is missing, a folder is still never renamed onto an existing path."""
    from hf_kbit import _paths

    monkeypatch.setattr(_paths, "_renameat2", lambda: None)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        _paths.rename_noreplace(tmp_path / "a", tmp_path / "b")
    _paths.rename_noreplace(tmp_path / "a", tmp_path / "c")
    assert (tmp_path / "b" / "x").read_text() == "x" and (tmp_path / "c").is_dir()


# ---------------------------------------------------------------------------- GGUF scratch copy


def _fake_gguf(monkeypatch, llama: Path, seen: list):
    """Stand-in for transformers' GGUF dequantization: writes the Llama folder where the real one would."""

    def dequantize(path, workdir):
        seen.append(Path(workdir))
        shutil.copytree(llama, Path(workdir) / "gguf-dequantized")
        return Path(workdir) / "gguf-dequantized"

    monkeypatch.setattr(convert_sources, "_dequantize_gguf", dequantize)


def test_gguf_copy_lives_in_the_hidden_output_folder(llama_fp32, tmp_path, monkeypatch):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    systemp = tmp_path / "systemp"
    systemp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(systemp))
    seen: list[Path] = []
    _fake_gguf(monkeypatch, llama_fp32, seen)
    work = tmp_path / "work"
    work.mkdir()
    out = convert(tmp_path / "model.gguf", work / "out", progress=False).out
    assert seen[0].parent.parent == work and seen[0].parent.name.startswith(".out.kbit-tmp-")
    assert sorted(p.name for p in work.iterdir()) == ["out"]
    assert not any(p.name.startswith(".") for p in out.iterdir())  # the copy is not part of the output
    assert list(systemp.iterdir()) == []


def test_dry_run_gguf_copy_is_removed_and_stale_ones_cleaned(llama_fp32, tmp_path, monkeypatch):
    import subprocess
    import sys

    systemp = tmp_path / "systemp"
    systemp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(systemp))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = systemp / f"kbit-convert-{int(dead.stdout)}-abc"
    (stale / "gguf").mkdir(parents=True)
    live = systemp / f"kbit-convert-{os.getppid()}-abc"
    live.mkdir()
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    seen: list[Path] = []
    _fake_gguf(monkeypatch, llama_fp32, seen)
    plan = convert(tmp_path / "model.gguf", tmp_path / "out", dry_run=True, progress=False)
    assert plan.tensors and seen[0].parent == systemp
    assert sorted(p.name for p in systemp.iterdir()) == [live.name]
