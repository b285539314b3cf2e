"""The R-data reader on small files written here in R's XDR serialization format (no R needed)."""

from __future__ import annotations

import gzip
import lzma
import struct
import zlib

import pytest

from hf_kbit.eval import corpus, rdata

NIL = struct.pack(">i", rdata.NILVALUE_SXP)


def i32(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def header() -> bytes:
    return b"X\n" + i32(3, 0x040201, 0x030500, 5) + b"UTF-8"


def charsxp(s: str | None) -> bytes:
    if s is None:
        return i32(rdata.CHARSXP, -1)
    raw = s.encode("utf-8")
    return i32(rdata.CHARSXP | (rdata.UTF8_MASK << rdata.LEVELS_SHIFT), len(raw)) + raw


def attributes(attrs: dict[str, bytes]) -> bytes:
    out = b""
    for name, value in attrs.items():
        out += i32(rdata.LISTSXP | rdata.HAS_TAG_BIT) + i32(rdata.SYMSXP) + charsxp(name) + value
    return out + NIL


def vector(sexptype: int, length: int, body: bytes, attrs: dict[str, bytes] | None = None) -> bytes:
    flags = sexptype | (rdata.HAS_ATTR_BIT if attrs else 0)
    return i32(flags, length) + body + (attributes(attrs) if attrs else b"")


def strsxp(values, attrs=None) -> bytes:
    return vector(rdata.STRSXP, len(values), b"".join(charsxp(v) for v in values), attrs)


def intsxp(values) -> bytes:
    return vector(rdata.INTSXP, len(values), i32(*values))


def named_list(items: dict[str, bytes]) -> bytes:
    return vector(rdata.VECSXP, len(items), b"".join(items.values()), {"names": strsxp(list(items))})


BOOK = ["It is a truth universally acknowledged,", "", "that a single man — in want of a wife.", None]


def test_character_vector_with_na_and_utf8():
    value = rdata.unserialize(header() + strsxp(BOOK))
    assert value.rtype == "character" and list(value) == BOOK


def test_named_list_and_integers():
    value = rdata.unserialize(header() + named_list({"a": intsxp([1, -(2**31), 3]), "b": strsxp(["x"])}))
    d = value.as_dict()
    assert list(d["a"]) == [1, None, 3] and list(d["b"]) == ["x"]


@pytest.mark.parametrize("compress", [gzip.compress, lzma.compress, lambda b: b], ids=["gzip", "xz", "none"])
def test_read_rds(tmp_path, compress):
    path = tmp_path / "book.rds"
    path.write_bytes(compress(header() + strsxp(BOOK)))
    assert list(rdata.read_rds(path)) == BOOK


def test_read_rda(tmp_path):
    pairlist = i32(rdata.LISTSXP | rdata.HAS_TAG_BIT) + i32(rdata.SYMSXP) + charsxp("book") + strsxp(BOOK) + NIL
    path = tmp_path / "book.rda"
    path.write_bytes(gzip.compress(b"RDX3\n" + header() + pairlist))
    assert list(rdata.read_rda(path)["book"]) == BOOK


def write_lazyload_db(folder, objects: dict[str, bytes]):
    """``Rdata.rdx`` + ``Rdata.rdb`` as R's makeLazyLoadDB writes them (zlib chunks, compressed = TRUE)."""
    rdb, offsets = b"", {}
    for name, body in objects.items():
        stream = header() + body
        chunk = struct.pack(">I", len(stream)) + zlib.compress(stream)
        offsets[name] = intsxp([len(rdb), len(chunk)])
        rdb += chunk
    index = named_list({
        "variables": named_list(offsets),
        "references": vector(rdata.VECSXP, 0, b""),
        "compressed": vector(rdata.LGLSXP, 1, i32(1)),
    })
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "Rdata.rdb").write_bytes(rdb)
    (folder / "Rdata.rdx").write_bytes(gzip.compress(header() + index))
    return folder / "Rdata.rdx"


def test_read_lazyload_db(tmp_path):
    rdx = write_lazyload_db(tmp_path, {"emma": strsxp(["EMMA", "", "By Jane Austen"]), "n": intsxp([7])})
    data = rdata.read_lazyload_db(rdx)
    assert list(data["emma"]) == ["EMMA", "", "By Jane Austen"] and list(data["n"]) == [7]


def test_austen_text_from_package_tree(tmp_path):
    """The corpus builder on a fake janeaustenr package tree: publication order, blank line between novels."""
    books = {name: strsxp([name.upper(), "line"]) for name in reversed(corpus.AUSTEN_BOOKS)}
    write_lazyload_db(tmp_path / "usr" / "lib" / "R" / "site-library" / "janeaustenr" / "data", books)
    text = corpus.austen_text_from_package_tree(tmp_path)
    assert text == "\n\n".join(f"{b.upper()}\nline" for b in corpus.AUSTEN_BOOKS) + "\n"


def test_truncated_data_raises():
    with pytest.raises(rdata.RDataError, match="truncated"):
        rdata.unserialize(header() + strsxp(BOOK)[:-3])


def test_unsupported_format_raises():
    with pytest.raises(rdata.RDataError, match="XDR"):
        rdata.unserialize(b"A\n1\n")
