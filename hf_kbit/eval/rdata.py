"""A small reader for R's serialized data, enough to take text corpora out of R packages.

R stores data in three containers, all around the same serialization stream
(R Internals, "Serialization Formats"):

- ``.rds``: one serialized object, usually gzip/bzip2/xz compressed;
- ``.rda`` / ``.RData``: ``RDX2\\n`` or ``RDX3\\n`` then a serialized pairlist name -> value;
- lazy-load databases (``Rdata.rdx`` + ``Rdata.rdb``, what an installed package's
  ``data/`` holds): the ``.rdx`` is an RDS index ``list(variables = list(name = c(offset,
  length)), references, compressed)``; each value is a chunk of the ``.rdb`` at that offset:
  a 4-byte big-endian uncompressed length, (for ``compressed`` 2 and 3) one byte naming the
  compressor, then the compressed serialization stream.

Only the XDR (binary, big-endian) stream format, versions 2 and 3, is read. Supported values:
NULL, logical/integer/double/complex/character/raw vectors, lists, pairlists, symbols,
attributes, references to earlier symbols/environments, and the ALTREP classes R writes for
plain data (compact integer/real sequences, wrappers). Environments come back as
:class:`REnvironment` placeholders; anything else (closures, bytecode, external pointers)
raises :class:`RDataError` naming the type.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import math
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RDataError(ValueError):
    """The bytes are not R serialized data this reader understands."""


class RVector(list):
    """An R vector: a Python list of its elements plus R's ``attributes`` (``names``, ``class``...)."""

    def __init__(self, values=(), rtype: str = "list", attributes: dict[str, Any] | None = None):
        super().__init__(values)
        self.rtype = rtype
        self.attributes = attributes or {}

    @property
    def names(self) -> list[str] | None:
        return self.attributes.get("names")

    def as_dict(self) -> dict[str, Any]:
        """``{name: element}`` for a named vector (a named R list becomes a dict)."""
        if self.names is None:
            raise RDataError(f"this R {self.rtype} vector has no names")
        return dict(zip(self.names, self))


@dataclass
class REnvironment:
    """Placeholder for an R environment (its contents are not needed for data)."""

    kind: str
    frame: Any = None
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RSymbol:
    name: str


# SEXP types (R Internals, "SEXPTYPEs") and the pseudo-types of the serialization stream.
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP, DOTSXP = 9, 10, 13, 14, 15, 16, 17
VECSXP, EXPRSXP, RAWSXP, S4SXP = 19, 20, 24, 25
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP, MISSINGARG_SXP = 255, 254, 253, 252, 251
BASENAMESPACE_SXP, NAMESPACESXP, PACKAGESXP, PERSISTSXP = 250, 249, 248, 247
EMPTYENV_SXP, BASEENV_SXP, ATTRLANGSXP, ATTRLISTSXP, ALTREP_SXP = 242, 241, 240, 239, 238

# Flag bits of an item header: type in the low byte, then these, then the "levels" (gp) field.
IS_OBJECT_BIT, HAS_ATTR_BIT, HAS_TAG_BIT = 1 << 8, 1 << 9, 1 << 10
LEVELS_SHIFT = 12
# CHARSXP encodings carried in the levels field.
LATIN1_MASK, UTF8_MASK, BYTES_MASK = 1 << 2, 1 << 3, 1 << 1

NA_INTEGER = -(2**31)
_SPECIAL_ENVS = {
    GLOBALENV_SXP: "global",
    EMPTYENV_SXP: "empty",
    BASEENV_SXP: "base",
    BASENAMESPACE_SXP: "base-namespace",
}


def decompress(data: bytes) -> bytes:
    """Undo gzip, bzip2 or xz compression, recognised by magic bytes; other bytes pass through."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    return data


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0
        self.refs: list[Any] = []

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise RDataError(f"truncated R data: wanted {n} bytes at offset {self.pos}, have {len(self.data) - self.pos}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints, upper and lower 32 bits
            upper, lower = struct.unpack(">II", self.take(8))
            n = (upper << 32) | lower
        return n

    def header(self) -> None:
        fmt = self.take(2)
        if fmt != b"X\n":
            raise RDataError(f"only the XDR serialization format (b'X\\n') is supported, found {fmt!r}")
        version = self.int()
        self.int()  # R version that wrote it
        self.int()  # oldest R version that reads it
        if version == 3:
            self.take(self.int())  # native encoding name
        elif version != 2:
            raise RDataError(f"R serialization version {version} is not supported (2 and 3 are)")

    def item(self) -> Any:
        flags = self.int()
        sexptype = flags & 0xFF
        has_attr = bool(flags & HAS_ATTR_BIT)
        has_tag = bool(flags & HAS_TAG_BIT)
        levels = flags >> LEVELS_SHIFT

        if sexptype == NILVALUE_SXP:
            return None
        if sexptype in _SPECIAL_ENVS:
            return REnvironment(_SPECIAL_ENVS[sexptype])
        if sexptype in (UNBOUNDVALUE_SXP, MISSINGARG_SXP):
            return None
        if sexptype == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if sexptype == PERSISTSXP:
            value = REnvironment("persistent", frame=self.string_vector())
            self.refs.append(value)
            return value
        if sexptype in (NAMESPACESXP, PACKAGESXP):
            value = REnvironment("namespace" if sexptype == NAMESPACESXP else "package", frame=self.string_vector())
            self.refs.append(value)
            return value
        if sexptype == SYMSXP:
            symbol = RSymbol(self.item())
            self.refs.append(symbol)
            return symbol
        if sexptype == ENVSXP:
            env = REnvironment("environment")
            self.refs.append(env)  # registered before its contents, which may refer back to it
            self.int()  # locked
            self.item()  # enclosing environment
            env.frame = self.item()
            self.item()  # hash table
            env.attributes = self.attributes_from(self.item())
            return env
        if sexptype in (LISTSXP, LANGSXP, CLOSXP, PROMSXP, DOTSXP, ATTRLANGSXP, ATTRLISTSXP):
            return self.pairlist(has_attr, has_tag)
        if sexptype == ALTREP_SXP:
            return self.altrep()
        if sexptype == CHARSXP:
            return self.charsxp(levels)

        value = self.vector(sexptype)
        if has_attr:
            value.attributes = self.attributes_from(self.item())
        return value

    def vector(self, sexptype: int) -> RVector:
        n = self.length()
        if sexptype in (LGLSXP, INTSXP):
            raw = struct.unpack(f">{n}i", self.take(4 * n))
            if sexptype == LGLSXP:
                return RVector([None if v == NA_INTEGER else bool(v) for v in raw], "logical")
            return RVector([None if v == NA_INTEGER else v for v in raw], "integer")
        if sexptype == REALSXP:
            return RVector(struct.unpack(f">{n}d", self.take(8 * n)), "double")
        if sexptype == CPLXSXP:
            parts = struct.unpack(f">{2 * n}d", self.take(16 * n))
            return RVector([complex(parts[2 * i], parts[2 * i + 1]) for i in range(n)], "complex")
        if sexptype == STRSXP:
            return RVector([self.item() for _ in range(n)], "character")
        if sexptype in (VECSXP, EXPRSXP):
            return RVector([self.item() for _ in range(n)], "list")
        if sexptype == RAWSXP:
            return RVector(self.take(n), "raw")
        raise RDataError(f"R type {sexptype} (SEXPTYPE) is not data this reader supports")

    def charsxp(self, levels: int) -> str | None:
        n = self.int()
        if n == -1:
            return None  # NA_character_
        raw = self.take(n)
        if levels & LATIN1_MASK:
            return raw.decode("latin-1")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("latin-1")

    def string_vector(self) -> list[str | None]:
        if self.int() != 0:
            raise RDataError("malformed persistent string vector")
        return [self.item() for _ in range(self.int())]

    def pairlist(self, has_attr: bool, has_tag: bool) -> RVector:
        """A pairlist as an RVector of its CARs with ``names`` from the tags (CDR chain walked)."""
        values, names = [], []
        while True:
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            values.append(self.item())
            names.append(tag.name if isinstance(tag, RSymbol) else "")
            flags = self.int()
            sexptype = flags & 0xFF
            if sexptype == NILVALUE_SXP:
                break
            if sexptype not in (LISTSXP, LANGSXP, ATTRLISTSXP, ATTRLANGSXP):
                self.pos -= 4  # an unusual tail: read it as one more element
                values.append(self.item())
                names.append("")
                break
            has_attr, has_tag = bool(flags & HAS_ATTR_BIT), bool(flags & HAS_TAG_BIT)
        return RVector(values, "pairlist", {"names": names})

    def attributes_from(self, pairlist: Any) -> dict[str, Any]:
        if not isinstance(pairlist, RVector):
            return {}
        out = {}
        for name, value in zip(pairlist.names, pairlist):
            out[name] = list(value) if name == "names" and isinstance(value, RVector) else value
        return out

    def altrep(self) -> RVector:
        info = self.item()
        state = self.item()
        attributes = self.attributes_from(self.item())
        cls = info[0].name if isinstance(info, RVector) and isinstance(info[0], RSymbol) else str(info)
        if cls in ("compact_intseq", "compact_realseq"):
            n, start, step = state[0], state[1], state[2]
            values = [start + i * step for i in range(int(n))]
            if cls == "compact_intseq":
                values = [int(v) for v in values]
            out = RVector(values, "integer" if cls == "compact_intseq" else "double")
        elif cls.startswith("wrap_"):
            out = RVector(state[0], state[0].rtype)
        else:
            raise RDataError(f"ALTREP class {cls!r} is not supported")
        out.attributes = attributes
        return out


def unserialize(data: bytes) -> Any:
    """One R object from an (uncompressed) XDR serialization stream."""
    reader = _Reader(data)
    reader.header()
    return reader.item()


def read_rds(path: str | Path) -> Any:
    """The object of an ``.rds`` file (``saveRDS``), compressed or not."""
    return unserialize(decompress(Path(path).read_bytes()))


def read_rda(path: str | Path) -> dict[str, Any]:
    """``{name: object}`` of an ``.rda`` / ``.RData`` file (``save``)."""
    data = decompress(Path(path).read_bytes())
    if data[:5] not in (b"RDX2\n", b"RDX3\n"):
        raise RDataError(f"{path}: not an RData file (starts with {data[:5]!r}, expected RDX2/RDX3)")
    return unserialize(data[5:]).as_dict()


def _lazyload_chunk(chunk: bytes, compressed: int) -> bytes:
    expected = struct.unpack(">I", chunk[:4])[0]
    if compressed == 1:
        out = zlib.decompress(chunk[4:])
    else:
        kind, body = chunk[4:5], chunk[5:]
        decoders = {b"Z": lzma.decompress, b"2": bz2.decompress, b"1": zlib.decompress, b"0": bytes}
        if kind not in decoders:
            raise RDataError(f"unknown lazy-load compression byte {kind!r}")
        out = decoders[kind](body)
    if len(out) != expected:
        raise RDataError(f"lazy-load chunk decompressed to {len(out)} bytes, its header says {expected}")
    return out


def read_lazyload_db(rdx_path: str | Path) -> dict[str, Any]:
    """``{name: object}`` of a lazy-load database (``<name>.rdx`` with ``<name>.rdb`` beside it)."""
    rdx_path = Path(rdx_path)
    index = read_rds(rdx_path).as_dict()
    compressed = index.get("compressed", [True])[0]
    compressed = 1 if compressed is True else int(compressed)
    if compressed not in (1, 2, 3):
        raise RDataError(f"{rdx_path}: unknown lazy-load compression {compressed!r}")
    rdb = rdx_path.with_suffix(".rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].as_dict().items():
        offset, length = int(offset), int(length)
        if not (math.isfinite(offset) and 0 <= offset and offset + length <= len(rdb)):
            raise RDataError(f"{rdx_path}: variable {name!r} points outside the .rdb ({offset}+{length})")
        out[name] = unserialize(_lazyload_chunk(rdb[offset : offset + length], compressed))
    return out
