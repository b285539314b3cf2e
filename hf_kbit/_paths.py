"""Which files kbit-convert reads from a model folder, and how its output is put in place.

Reads: the weight files ``from_pretrained`` would read and a few config and tokenizer files, each
checked to lie inside the model folder, so that an index or a symlink cannot make kbit-convert
read (and push) a file from elsewhere. Writes: the output is built in a hidden folder beside
``out`` and moved there by one rename that never replaces a folder it was not asked to replace.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TMP_INFIX = ".kbit-tmp-"  # .<out>.kbit-tmp-XXXX: the output being written
OLD_INFIX = ".kbit-old-"  # .<out>.kbit-old-XXXX: the replaced output, until the new one is in place
SCRATCH_PREFIX = "kbit-convert-"  # kbit-convert-<pid>-XXXX in the system temp folder (dry runs of GGUF files)


class ConversionError(ValueError):
    """The input, output or options of a conversion are not usable; the message says why and what to do."""


class OutputConflictError(ConversionError):
    """Something appeared at ``out`` while the conversion ran; it was left as it is and the new output discarded."""


# ---------------------------------------------------------------------------- reading the source


def source_roots(source: Path) -> list[Path]:
    """Folders that the files of ``source`` may resolve into: the folder itself and, for a Hugging Face
    cache snapshot (``<repo>/snapshots/<revision>``, whose files are symlinks into ``<repo>/blobs``),
    that blobs folder."""
    real = source.resolve()
    roots = [real]
    blobs = real.parent.parent / "blobs"
    if real.parent.name == "snapshots" and blobs.is_dir():
        roots.append(blobs)
    return roots


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _plain_relative(name: str) -> bool:
    """A relative '/'-separated name without '.', '..' or empty parts, backslashes or control characters."""
    if not name or name.startswith("/") or any(c == "\\" or ord(c) < 32 or ord(c) == 127 for c in name):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def source_file(source: Path, name: object, what: str, suffix: str = "") -> Path:
    """``source / name``, once ``name`` (found in ``what``) is checked to be a plain relative file name
    ending in ``suffix`` and the file, symlinks resolved, is checked to lie inside ``source``."""
    if not isinstance(name, str) or not _plain_relative(name) or not name.endswith(suffix):
        raise ConversionError(
            f"{what} names the file {name!r}; expected a file name relative to {source}"
            + (f" ending in {suffix}" if suffix else "")
            + " (no absolute path, '..', backslash or control character); fix or download the model folder again"
        )
    path = source / name
    real = path.resolve()
    if not any(_within(real, root) for root in source_roots(source)):
        raise ConversionError(
            f"{path} resolves to {real}, outside the model folder {source}; kbit-convert reads only files inside "
            "the model folder (copy the file into it)"
        )
    return path


def weight_files(source: Path) -> list[Path]:
    """The safetensors files ``from_pretrained(source)`` reads: ``model.safetensors``, else the shards
    that ``model.safetensors.index.json`` names, else the folder's only ``*.safetensors`` file."""
    if (source / SAFE_WEIGHTS_NAME).is_file():
        files = [source_file(source, SAFE_WEIGHTS_NAME, "the model folder")]
    elif (source / SAFE_WEIGHTS_INDEX_NAME).is_file():
        files = _index_shards(source)
    else:
        names = sorted(p.name for p in source.glob("*.safetensors"))
        if len(names) > 1:
            raise ConversionError(
                f"{source} has several .safetensors files ({', '.join(names)}) but neither {SAFE_WEIGHTS_NAME} nor "
                f"{SAFE_WEIGHTS_INDEX_NAME}, so which of them make the model is unclear (from_pretrained reads only "
                "those two names); keep the model's file as model.safetensors, or add the index"
            )
        if not names:
            other = sorted(p.name for p in source.glob("*.bin")) + sorted(p.name for p in source.glob("*.pt*"))
            hint = (
                f" It has {other[0]}: kbit-convert reads safetensors only (pickle files can run code); "
                "convert them with transformers' save_pretrained(safe_serialization=True) first."
                if other
                else ""
            )
            raise ConversionError(f"{source} has no *.safetensors weights.{hint}")
        files = [source_file(source, names[0], "the model folder")]
    absent = [p.name for p in files if not p.is_file()]
    if absent:
        raise ConversionError(f"{source} lacks shard(s) listed in its index, e.g. {absent[0]}; download them first")
    return files


def _index_shards(source: Path) -> list[Path]:
    """The shards ``source``'s index names, each checked with :func:`source_file`."""
    index = source_file(source, SAFE_WEIGHTS_INDEX_NAME, "the model folder")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise TypeError("'weight_map' is not a non-empty object")
    except (ValueError, KeyError, TypeError) as e:
        raise ConversionError(
            f"{index} is not a safetensors index (a JSON object with a 'weight_map' of tensor name -> file): "
            f"{type(e).__name__}: {e}"
        ) from None
    files: dict[str, Path] = {}
    for name in weight_map.values():  # each checked before use as a key: a list value must not raise TypeError
        files[name] = source_file(source, name, str(index), ".safetensors")
    return [files[name] for name in sorted(files)]


def extra_files(source: Path, names: Iterable[str]) -> list[Path]:
    """Those of ``names`` (tokenizer and generation files) present in ``source``, each checked to lie inside it."""
    return [source_file(source, name, "the model folder") for name in names if (source / name).is_file()]


def source_paths(model: str | os.PathLike) -> list[Path]:
    """What ``out`` must never replace for the input ``model``: the local folder or file, else the Hub
    cache a repo is downloaded into."""
    path = Path(model).expanduser()
    if path.exists():
        return [path]
    from huggingface_hub import constants

    return [Path(constants.HF_HUB_CACHE)]


# ---------------------------------------------------------------------------- writing the output


@dataclass(frozen=True)
class OutputTarget:
    """Where a conversion puts its output: ``path`` (absolute, symlinks resolved) and, with overwrite, the
    state of the folder that was there when checked (see :func:`_state`): the only thing it may replace."""

    path: Path
    replaces: tuple[int, ...] | None


def check_output(out: str | os.PathLike, overwrite: bool, protect: Iterable[str | os.PathLike] = ()) -> OutputTarget:
    """Refuse an ``out`` that is or holds the source (``protect``), the current folder, the home folder or
    the filesystem root, and a non-empty ``out`` unless ``overwrite``; check its parent is writable."""
    shown = Path(out).expanduser()
    path = shown.resolve()
    refuse_protected(shown, path, protect)
    if path.exists() and not path.is_dir():
        raise ConversionError(f"out={shown} exists and is not a folder")
    replaces = None
    if path.is_dir():
        if any(path.iterdir()) and not overwrite:
            raise ConversionError(f"out={shown} is not empty; pass --overwrite (overwrite=True) to replace it")
        if overwrite:
            replaces = _state(path)
    if not path.parent.is_dir():
        raise ConversionError(f"the parent folder of out={shown} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise ConversionError(f"cannot write to {path.parent} (needed for out={shown})")
    return OutputTarget(path, replaces)


def refuse_protected(shown: Path, path: Path, protect: Iterable[str | os.PathLike]) -> None:
    """Raise if ``path`` (``out`` as resolved; ``shown`` as given) is or holds a folder kbit-convert must keep."""
    if path.parent == path:
        raise ConversionError(f"out={shown} is the filesystem root; pass a new folder as --out")
    keep = []
    with contextlib.suppress(OSError, RuntimeError):  # no current folder or no home: nothing to protect there
        keep.append((Path.cwd(), "the current folder"))
    with contextlib.suppress(OSError, RuntimeError):
        keep.append((Path.home(), "your home folder"))
    keep += [(Path(p), "the source") for p in protect]
    for folder, label in keep:
        real = folder.expanduser().resolve()
        if path == real:
            raise ConversionError(f"out={shown} is {label}; kbit-convert never replaces it, pass a new folder as --out")
        if path in real.parents:
            raise ConversionError(
                f"out={shown} holds {label} ({folder}); kbit-convert never replaces it, pass a new folder as --out"
            )


def _state(path: Path) -> tuple[int, ...]:
    """Device, inode and the times that change when an entry is added or removed: a folder removed and made
    again (which may get the same inode number) or changed since it was checked compares unequal."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns


def temp_output(target: OutputTarget) -> Path:
    """A new hidden folder beside ``target`` (same filesystem, so the final rename is atomic)."""
    return Path(tempfile.mkdtemp(prefix=f".{target.path.name}{TMP_INFIX}", dir=target.path.parent))


def publish(tmp: Path, target: OutputTarget) -> None:
    """Rename the complete ``tmp`` to ``target.path``.

    Without overwrite only a missing or empty folder is taken. With overwrite only the folder checked at
    the start is replaced: it is moved aside, ``tmp`` renamed in, and the old folder deleted after that
    (or moved back if the rename fails). Anything else at ``target.path`` is left as it is and
    :class:`OutputConflictError` raised; the caller removes ``tmp``.
    """
    _usual_modes(tmp)
    path = target.path
    if target.replaces is None:
        with contextlib.suppress(OSError):
            os.rmdir(path)  # an empty folder is taken; anything else makes the rename below fail
        _rename_new(tmp, path)
        return
    try:
        if _state(path) != target.replaces:
            raise _conflict(path)
    except FileNotFoundError:  # removed meanwhile: nothing left to replace
        _rename_new(tmp, path)
        return
    aside_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}{OLD_INFIX}", dir=path.parent))
    aside = aside_dir / path.name
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        aside_dir.rmdir()
        _rename_new(tmp, path)
        return
    except BaseException:
        aside_dir.rmdir()
        raise
    if _state(aside)[:2] != target.replaces[:2]:  # swapped between the check and the move (a rename may change ctime)
        _restore(aside, path)
        raise _conflict(path)
    try:
        _rename_new(tmp, path)
    except BaseException:
        _restore(aside, path)
        raise
    shutil.rmtree(aside_dir, ignore_errors=True)


def _conflict(path: Path) -> OutputConflictError:
    return OutputConflictError(
        f"out={path} was created or changed by someone else while this conversion ran; it was left as it is and "
        "this run's output discarded. Pass a new --out (or --overwrite to replace what is there now)"
    )


def _rename_new(tmp: Path, path: Path) -> None:
    try:
        rename_noreplace(tmp, path)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise _conflict(path) from None
        raise


def _restore(aside: Path, path: Path) -> None:
    """Put the folder moved aside back at ``path``; if that is taken now, keep it and say where it is."""
    try:
        rename_noreplace(aside, path)
    except OSError:
        raise OutputConflictError(
            f"out={path} was created or changed by someone else while this conversion ran; the folder that was "
            f"there is kept at {aside}"
        ) from None
    aside.parent.rmdir()


def _usual_modes(tmp: Path) -> None:
    """mkdtemp (and some writers) create owner-only modes; give the output the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


@functools.cache
def _renameat2():
    """glibc's renameat2, or None (other C libraries and systems)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename ``src`` to ``dst``; FileExistsError if ``dst`` exists, even an empty folder.

    Atomic on Linux (renameat2 with RENAME_NOREPLACE). Elsewhere, or on a filesystem without that flag,
    a check and then ``os.rename``, which POSIX refuses onto a non-empty folder, so at worst an empty
    folder created between the two is replaced.
    """
    fn = _renameat2()
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(dst))
    os.rename(src, dst)


# ---------------------------------------------------------------------------- scratch space of dry runs


def scratch_dir() -> Path:
    """A new folder in the system temp folder, named with this process id so that a later run can remove
    the ones that killed runs left (see :func:`remove_stale_scratch`)."""
    remove_stale_scratch()
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))


def remove_stale_scratch() -> None:
    """Remove this user's ``kbit-convert-<pid>-*`` folders whose process no longer runs."""
    if os.name != "posix":  # os.kill(pid, 0) probes a process only on POSIX
        return
    for folder in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = folder.name[len(SCRATCH_PREFIX) :].partition("-")[0]
        try:
            if not pid.isdigit() or folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # alive but not ours to signal, or the folder vanished
            continue
