"""Web crawls into tier 1: WARC files (HTML responses, their main text extracted) and WET files (text
Common Crawl already extracted), read as strata.data.sources reads every other kind, a record a document.

- **Which records.** From WARC, `response` records whose HTTP Content-Type is HTML; from WET, `conversion`
  records. Every other record is accounted for: a request, metadata or warcinfo record is
  `rejected: not-a-document`; a response that is not HTML, `rejected: not-html`.
- **Damage.** Common Crawl compresses each record as its own gzip member. Members are read one by one, so
  a truncated or corrupt member is `rejected: truncated-record` and reading resumes at the next member; a
  record whose WARC header does not parse is `rejected: bad-record-header`; a payload whose charset
  cannot decode it, `rejected: undecodable-charset`; a page with no main text, `rejected: no-main-text`.
  The rest of the file is read.
- **Libraries.** WARC parsing is fastwarc's (default) or warcio's (`--warc-library`); HTML to text is
  resiliparse's main-content extraction (default) or trafilatura's (`--html-extractor`). Both choices are
  measured in bench.peer's web workload.
- **Identity.** A document's id is `PATH:OFFSET`, the byte offset of its record (its gzip member) in the
  file, so lineage's position finds the record; the record's URL, date, content type and WARC record id
  come with the text (`meta`).
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterator

WARC_LIBRARIES = ("fastwarc", "warcio")
EXTRACTORS = ("resiliparse", "trafilatura")
GZIP_MAGIC = b"\x1f\x8b\x08"
CHUNK = 1 << 20
FEED = 64 << 10  # compressed bytes handed to zlib at a time (a crawl's record: a few KB compressed)


def members(stream, limit: int) -> Iterator[tuple[int, bytes | str]]:
    """(offset, bytes) of each gzip member of `stream`, decompressed, in order; (offset, reason) for one
    that cannot be read whole (`truncated-record`: it ends early or its data is corrupt;
    `record-too-large`: past `limit` bytes decompressed, never held), after which reading resumes at the
    next gzip header."""
    buf, base = bytearray(), 0  # buf: the compressed bytes from file offset `base` on

    def fill() -> bool:
        chunk = stream.read(CHUNK)
        buf.extend(chunk)
        return bool(chunk)

    def skip_to_next() -> bool:
        nonlocal base
        at = buf.find(GZIP_MAGIC, 1)
        while at < 0 and fill():
            at = buf.find(GZIP_MAGIC, 1)
        if at < 0:
            return False
        del buf[:at]
        base += at
        return True

    while buf or fill():
        if len(buf) < 3:
            fill()
        if not buf.startswith(GZIP_MAGIC):  # bytes that are no member: named, then the next member
            yield base, "truncated-record"
            if not skip_to_next():
                return
            continue
        d, out, size, fed, pending, reason = zlib.decompressobj(31), [], 0, 0, b"", ""
        while not d.eof:
            if not pending:
                if fed >= len(buf) and not fill():
                    reason = "truncated-record"  # the file ends inside the member
                    break
                pending = bytes(buf[fed: fed + FEED])  # a slice, not the whole buffer: members are small
                fed += len(pending)
            try:
                piece = d.decompress(pending, CHUNK)
            except zlib.error:
                reason = "truncated-record"
                break
            pending, size = d.unconsumed_tail, size + len(piece)
            out.append(piece)
            if size > limit:
                reason = "record-too-large"
                break
        if reason:
            yield base, reason
            if not skip_to_next():
                return
            continue
        used = fed - len(d.unused_data)
        yield base, b"".join(out)
        del buf[:used]
        base += used


def parse(data: bytes, library: str) -> dict | None:
    """One WARC record's type, headers, HTTP content type and payload (None: no record parses there)."""
    if library == "warcio":
        from warcio.archiveiterator import ArchiveIterator

        for r in ArchiveIterator(io.BytesIO(data)):
            ctype = r.http_headers.get_header("Content-Type") if r.http_headers else None
            return {"type": r.rec_type, "url": r.rec_headers.get_header("WARC-Target-URI"),
                    "date": r.rec_headers.get_header("WARC-Date"), "id": r.rec_headers.get_header("WARC-Record-ID"),
                    "content_type": ctype or r.rec_headers.get_header("Content-Type") or "",
                    "payload": r.content_stream().read()}
        return None
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    names = [(WarcRecordType.response, "response"), (WarcRecordType.conversion, "conversion"),
             (WarcRecordType.request, "request"), (WarcRecordType.metadata, "metadata"),
             (WarcRecordType.warcinfo, "warcinfo"), (WarcRecordType.resource, "resource"),
             (WarcRecordType.revisit, "revisit")]
    for r in ArchiveIterator(io.BytesIO(data), parse_http=True, auto_decode="all"):
        kind = next((name for t, name in names if r.record_type == t), "unknown")
        ctype = (r.http_headers.get("Content-Type", "") if kind == "response" and r.http_headers is not None
                 else r.headers.get("Content-Type", ""))
        return {"type": kind, "url": r.headers.get("WARC-Target-URI"), "date": r.headers.get("WARC-Date"),
                "id": r.headers.get("WARC-Record-ID"), "content_type": ctype or "", "payload": r.reader.read()}
    return None


def decode(payload: bytes, content_type: str) -> str | None:
    """The payload as text: the charset its Content-Type names, else the one detected; None if it does not
    decode as that charset."""
    charset = ""
    for part in content_type.split(";")[1:]:
        key, _, value = part.strip().partition("=")
        if key.lower() == "charset":
            charset = value.strip().strip('"').lower()
    if not charset:
        from resiliparse.parse.encoding import detect_encoding

        charset = detect_encoding(payload) or "utf-8"
    try:
        return payload.decode(charset)
    except (LookupError, UnicodeDecodeError):
        return None


def extract(html: str, extractor: str) -> str:
    """The main text of an HTML page: no navigation, menus, footers or cookie banners."""
    if extractor == "trafilatura":
        import trafilatura

        return trafilatura.extract(html, include_comments=False, include_tables=False, favor_precision=True) or ""
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.html import HTMLTree

    return extract_plain_text(HTMLTree.parse(html), preserve_formatting=True, main_content=True,
                              list_bullets=False, alt_texts=False, comments=False)


def documents(stream, path: str, kind: str, *, library: str, extractor: str, limit: int,
              compressed: bool) -> Iterator[tuple[str, dict]]:
    """(status, row fields) of each record of a WARC or WET file (`kind`): ("ok", {doc_id, text, meta}) for a
    document, (reason, {doc_id, sample}) for anything else. `compressed`: gzip members (Common Crawl's)."""
    chunks = members(stream, limit) if compressed else _plain(stream, limit)
    for offset, data in chunks:
        doc_id = f"{path}:{offset}"
        if isinstance(data, str):
            yield data, {"doc_id": doc_id, "sample": ""}
            continue
        if not data.strip():  # an empty member (padding): no record
            continue
        try:
            rec = parse(data, library)
        except Exception as e:  # noqa: BLE001 - the libraries raise their own kinds on a malformed header
            yield "bad-record-header", {"doc_id": doc_id, "sample": f"{type(e).__name__}: {e}"}
            continue
        if rec is None:
            yield "bad-record-header", {"doc_id": doc_id, "sample": data[:120].decode("latin-1")}
            continue
        meta = {"url": rec["url"], "date": rec["date"], "content_type": rec["content_type"], "record_id": rec["id"]}
        wanted = "conversion" if kind == "wet" else "response"
        if rec["type"] != wanted:
            yield "not-a-document", {"doc_id": doc_id, "sample": f"{rec['type']} record {rec['url'] or ''}"}
            continue
        if kind == "warc" and "html" not in rec["content_type"].lower():
            yield "not-html", {"doc_id": doc_id, "sample": f"{rec['content_type']} {rec['url'] or ''}"}
            continue
        text = decode(rec["payload"], rec["content_type"] if kind == "warc" else "text/plain; charset=utf-8")
        if text is None:
            yield "undecodable-charset", {"doc_id": doc_id, "sample": f"{rec['content_type']} {rec['url'] or ''}"}
            continue
        if kind == "warc":
            text = extract(text, extractor)
            if not text.strip():
                yield "no-main-text", {"doc_id": doc_id, "sample": rec["url"] or ""}
                continue
        yield "ok", {"doc_id": doc_id, "text": text, "meta": meta}


def _plain(stream, limit: int) -> Iterator[tuple[int, bytes | str]]:
    """An uncompressed WARC's records, each as its bytes, cut where each `WARC/1.x` header starts."""
    data = stream.read()
    starts = list(_header_starts(data))
    for a, b in zip(starts, [*starts[1:], len(data)], strict=True):
        yield a, (data[a:b] if b - a <= limit else "record-too-large")


def _header_starts(data: bytes) -> Iterator[int]:
    at = 0 if data.startswith(b"WARC/") else data.find(b"\r\n\r\nWARC/")
    while at >= 0:
        start = at if data[at:at + 5] == b"WARC/" else at + 4
        yield start
        at = data.find(b"\r\n\r\nWARC/", start + 5)
