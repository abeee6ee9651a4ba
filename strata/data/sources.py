"""Tolerant streaming readers of input files (strata/data/inputs.py finds the files and cuts them into units).

Every record read becomes a row `{doc_id, text, status, reason, sample}`:
status `ok` (decoded, to be cleaned) or `rejected` with a reason and a short
sample of the bad bytes. Nothing raises on bad data, and memory stays bounded:
files are streamed line by line, big uncompressed files are split into byte
ranges, and a record larger than `max_record_bytes` is skipped without ever
being held whole.

Kinds by suffix (after `.gz`/`.zst`): `.jsonl`/`.ndjson` (a JSON object per
line), `.json` (an array of objects, or JSON lines), `.parquet` (a text
column), anything else text: one document per file, or per blank-line
separated block.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from strata.data.storage import filesystem

COMPRESSIONS = {".gz": "gz", ".zst": "zst"}
JSONL = (".jsonl", ".ndjson")
SAMPLE_BYTES = 120


ORIGINS = ("", "public", "licensed", "third-party", "crawled", "user", "synthetic", "other")


@dataclass(frozen=True, kw_only=True)
class ReadConfig:
    inputs: tuple[str, ...] = field(default=(), metadata={"flag": "--input"})
    """Input files, directories, globs or URIs (s3://, gs://, file://); repeat the flag."""
    txt_documents: str = "file"
    """Documents in text files: `file` (one per file) or `blank-line` (blocks separated by blank lines)."""
    text_field: str = "text"
    """The field holding the text in .jsonl/.json records, and the column in .parquet files."""
    split_bytes: int = 64 << 20
    """Work unit size: bigger splittable files are cut into ranges, smaller ones grouped."""
    max_record_bytes: int = 8 << 20
    """A line, block or file-document larger than this is rejected as record-too-large."""
    incremental: bool = True
    """Skip input files an earlier version consumed (same path, size and modification time)."""
    follow_links: bool = False
    """Read what symbolic links inside an input folder point to outside it (by default such links are
    not followed: a link to a credentials file or to the storage root is not input; they are counted)."""
    allow_empty: bool = False
    """An input that holds no file is not an error (a scheduled run over a folder that may still be empty):
    the run makes no version and exits 0."""
    read_retries: int = 3
    """Times a file whose read fails (a reset, a timeout, throttling, after the object-store client's
    own retries) is read again, with exponential backoff, before its work unit fails; Ray then runs
    the unit again, twice."""
    unreadable: str = "fail"
    """A file still unreadable after every retry: `fail` (the run fails, nothing is committed) or `defer`
    (the version is published without it, and it is not recorded as consumed: the next run reads it)."""

    warc_library: str = "fastwarc"
    """What parses WARC and WET files (.warc.gz, .warc.wet.gz): `fastwarc` or `warcio`."""
    html_extractor: str = "resiliparse"
    """What takes a WARC page's main text from its HTML: `resiliparse` or `trafilatura` (bench.peer --workload
    web measures both)."""
    license: str = ""
    """The license under which this run's inputs may be used (an SPDX id such as CC-BY-4.0, or words): recorded
    in the version, for each model's training-content summary (`strata lineage summary`)."""
    origin: str = ""
    """Where this run's inputs come from, in the terms of the EU AI Office's training-content summary:
    `public` (a publicly available dataset), `licensed` (licensed from its rightsholders), `third-party` (another
    private dataset), `crawled` (crawled or scraped online), `user` (your users' data), `synthetic` or `other`;
    recorded in the version."""

    def __post_init__(self):
        from strata.data.web import EXTRACTORS, WARC_LIBRARIES

        if self.warc_library not in WARC_LIBRARIES or self.html_extractor not in EXTRACTORS:
            raise ValueError(f"--warc-library is one of {', '.join(WARC_LIBRARIES)}; --html-extractor one of "
                             f"{', '.join(EXTRACTORS)}")
        if self.origin not in ORIGINS:
            raise ValueError(f"--origin {self.origin!r}: one of {', '.join(o for o in ORIGINS if o)}")
        if self.txt_documents not in ("file", "blank-line"):
            raise ValueError("txt_documents must be `file` or `blank-line`")
        if self.unreadable not in ("fail", "defer"):
            raise ValueError("unreadable must be `fail` or `defer`")
        if self.read_retries < 0:
            raise ValueError("read_retries must be >= 0")
        if self.split_bytes < 1 << 16 or self.max_record_bytes < 1:
            raise ValueError("split_bytes must be >= 64 KiB and max_record_bytes >= 1")


def describe(path: str) -> tuple[str, str]:
    """(kind, compression) of a path from its suffixes."""
    base = path.lower()
    compression = ""
    for suffix, name in COMPRESSIONS.items():
        if base.endswith(suffix):
            compression, base = name, base[: -len(suffix)]
    if base.endswith(JSONL):
        return "jsonl", compression
    if base.endswith(".json"):
        return "json", compression
    if base.endswith(".parquet"):
        return "parquet", compression
    if base.endswith(".wet"):  # Common Crawl's CC-MAIN-....warc.wet.gz
        return "wet", compression
    if base.endswith(".warc"):
        return "warc", compression
    return "text", compression


# ---------------------------------------------------------------- streams


class _Raw(io.RawIOBase):
    """A pyarrow file as a raw stream, so io.BufferedReader can give it readline()."""

    def __init__(self, f):
        self.f = f

    def readable(self):
        return True

    def readinto(self, b):
        data = self.f.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self):
        self.f.close()
        super().close()


class _Zstd(io.RawIOBase):
    """zstd: every frame of a concatenation (`cat a.zst b.zst`), in bounded steps.

    Input goes to the decoder in small slices, so one step's output stays bounded (a frame of zeros
    decodes some 40,000 times larger than it is: 64 KiB in one call would be 2.5 GB). What was
    decoded before damage is handed out before the error; a file ending inside a frame raises
    EOFError (the zstandard stream reader would end it silently).
    """

    SLICE = 256  # bytes of input per step: at most ~11 MB out

    def __init__(self, f):
        import zstandard

        self.f, self.pending, self.off, self.buf = f, b"", 0, b""
        self.new, self.error = zstandard.ZstdDecompressor().decompressobj, zstandard.ZstdError
        self.d, self.in_frame = self.new(), False

    def readable(self):
        return True

    def _step(self) -> bool:
        """Decode one slice into `buf`; False at the end of the input."""
        if self.off >= len(self.pending):
            self.pending, self.off = self.f.read(1 << 16), 0
            if not self.pending:
                if self.in_frame:
                    raise EOFError("zstd stream ended inside a frame")
                return False
        if self.d.eof:  # the next frame
            self.d = self.new()
        piece = self.pending[self.off: self.off + self.SLICE]
        self.off += len(piece)
        try:
            self.buf = self.d.decompress(piece)
        except self.error as e:
            raise zlib.error(str(e)) from e
        self.in_frame = not self.d.eof
        if self.d.eof and self.d.unused_data:  # the rest of the slice starts the next frame
            self.pending, self.off = self.d.unused_data + self.pending[self.off:], 0
        return True

    def readinto(self, b):
        while not self.buf:
            if not self._step():
                return 0
        n = min(len(b), len(self.buf))
        b[:n], self.buf = self.buf[:n], self.buf[n:]
        return n


def open_stream(path: str, start: int = 0) -> io.BufferedReader:
    """A buffered, decompressed stream of `path`, positioned at `start` (uncompressed only)."""
    fs, p = filesystem(path)
    raw = fs.open_input_file(p)
    if start:
        raw.seek(start)
    stream = io.BufferedReader(_Raw(raw), buffer_size=1 << 20)
    compression = describe(path)[1]
    if compression == "gz":  # the standard library's: members, zero padding, truncation, bounded reads
        return gzip.GzipFile(fileobj=stream, mode="rb")
    if compression == "zst":
        return io.BufferedReader(_Zstd(stream), buffer_size=1 << 20)
    return stream


def read_capped_line(stream, cap: int, limit: float = float("inf")) -> tuple[bytes | None, int]:
    """The next line (without its newline) and the bytes consumed; None if longer than `cap`.

    An over-long line is skipped chunk by chunk, never held whole, and only until `limit` bytes
    are consumed (a range reader stops at its range's end). Returns (b"", 0) at the end of the stream.
    """
    line = stream.readline(cap + 1)
    n = len(line)
    if not line:
        return b"", 0
    if len(line) > cap and not line.endswith(b"\n"):
        while line and not line.endswith(b"\n") and n < limit:
            line = stream.readline(1 << 20)
            n += len(line)
        return None, n
    return line.rstrip(b"\r\n"), n


# ---------------------------------------------------------------- records


def _row(doc_id: str, text: str, status: str = "ok", reason: str = "", sample: bytes | str = b"") -> dict:
    if isinstance(sample, bytes):
        sample = _text_or_summary(sample, reason)
    return {"doc_id": doc_id, "text": text, "status": status, "reason": reason, "sample": sample[:SAMPLE_BYTES]}


def _text_or_summary(data: bytes, reason: str) -> str:
    """A rejected record's bytes as a sample: text stays readable (a malformed JSON line); bytes that are not
    UTF-8 text are summarised, never copied (a rejected file may be a key)."""
    head = data[: SAMPLE_BYTES + 3]
    if head and reason not in ("binary", "invalid-utf8") and b"\x00" not in head:
        try:
            return head.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start >= len(head) - 3 and len(data) > SAMPLE_BYTES:  # only a character cut at the end
                return head[: e.start].decode("utf-8")
    return byte_summary(data) if data else ""


def byte_summary(data: bytes) -> str:
    """What a rejected record's raw bytes were, without them: a rejected file may be a key or a credential,
    and rejects.json is read by people and tools. Its size, a hash to find it by, and its byte classes."""
    import hashlib

    text = sum(32 <= b < 127 or b in (9, 10, 13) for b in data[:4096])
    return (f"<{len(data):,} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}, "
            f"{text * 100 // max(1, min(len(data), 4096))}% printable ASCII>")


def decode_text(doc_id: str, data: bytes) -> dict:
    if b"\x00" in data:
        return _row(doc_id, "", "rejected", "binary", data)
    try:
        return _row(doc_id, data.decode("utf-8"))
    except UnicodeDecodeError:
        return _row(doc_id, "", "rejected", "invalid-utf8", data)


def json_record(doc_id: str, raw: bytes, field: str) -> dict:
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        return _row(doc_id, "", "rejected", "invalid-utf8", raw)
    except (ValueError, RecursionError):  # nesting deeper than Python's stack (`[[[[...`) is malformed too
        return _row(doc_id, "", "rejected", "malformed-json", raw)
    return json_object(doc_id, obj, field, raw)


def json_object(doc_id: str, obj, field: str, raw: bytes | str = b"") -> dict:
    text = obj.get(field) if isinstance(obj, dict) else None
    if not isinstance(text, str):
        return _row(doc_id, "", "rejected", "missing-text-field", raw or json.dumps(obj)[:SAMPLE_BYTES])
    if "\x00" in text:
        return _row(doc_id, "", "rejected", "binary", text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from \ud800-style escapes
        return _row(doc_id, "", "rejected", "invalid-unicode", text.encode("utf-8", "backslashreplace"))
    return _row(doc_id, text)


RETRY_BASE_S = 1.0  # the first retry's backoff; each next one doubles it (with jitter)


def read_file(f: dict, cfg: ReadConfig) -> Iterator[dict]:
    """Records of one file (or one byte range of it). Damage ends the file, not the job:
    what was read before the damage is kept and the damage is counted.

    A read that fails for a reason that is not the file's content (`InputUnreadable`) is retried
    `cfg.read_retries` times with backoff, from the start, handing out only records not handed out
    yet; then it raises. A local file missing on this node (`InputMissing`) raises at once.
    """
    handed = 0
    for attempt in range(cfg.read_retries + 1):
        try:
            for i, row in enumerate(_read_once(f, cfg)):
                if i >= handed:
                    handed += 1
                    yield row
            return
        except InputMissing:
            raise
        except InputUnreadable as e:
            if attempt == cfg.read_retries:
                raise InputUnreadable(f"{e} (read {attempt + 1} times)", f["path"]) from e.__cause__
            time.sleep(RETRY_BASE_S * 2 ** attempt * (0.5 + random.random() / 2))


def _read_once(f: dict, cfg: ReadConfig) -> Iterator[dict]:
    path = f["path"]
    kind, _ = describe(path)
    if f["size"] == 0:
        yield _row(f"{path}:0", "", "rejected", "empty-file")
        return
    try:
        if kind == "parquet":
            yield from _parquet(f, cfg)
            return
        if kind in ("warc", "wet"):
            yield from _web(f, cfg, kind)
            return
        stream = open_stream(path, max(0, f["start"] - 1))
        with stream:
            if kind in ("jsonl", "json"):
                yield from _json(stream, f, cfg, kind)
            elif cfg.txt_documents == "blank-line":
                yield from _blocks(stream, f, cfg)
            else:
                yield from _whole(stream, f, cfg)
    except EOFError as e:
        yield _row(f"{path}:damage", "", "rejected", "truncated-compressed", str(e))
    except (gzip.BadGzipFile, zlib.error) as e:  # corrupt gzip/zstd data: the file's own damage
        yield _row(f"{path}:damage", "", "rejected", "corrupt-file", str(e))
    except FileNotFoundError as e:
        raise InputMissing(
            f"input file {path} is not there on node {_node_name()} (it was when the run listed its inputs): "
            "a local path must be on every cpu-tier node (a shared filesystem), or give a URI", path) from e
    except OSError as e:  # a reset, a timeout, throttling: not the file's fault, so never recorded as read
        raise InputUnreadable(f"reading {path} failed: {e}", path) from e


def _web(f: dict, cfg: ReadConfig, kind: str) -> Iterator[dict]:
    """A WARC or WET file's records (strata/data/web.py): gzip members one by one, so damage costs one record."""
    from strata.data.web import documents

    path = f["path"]
    compression = describe(path)[1]
    if compression == "gz":  # each record its own member, as Common Crawl ships them
        fs, p = filesystem(path)
        stream = io.BufferedReader(_Raw(fs.open_input_file(p)), buffer_size=1 << 20)
    else:
        stream = open_stream(path)
    with stream:
        for status, row in documents(stream, path, kind, library=cfg.warc_library, extractor=cfg.html_extractor,
                                     limit=cfg.max_record_bytes, compressed=compression == "gz"):
            if status == "ok":
                yield {**_row(row["doc_id"], row["text"]), "meta": row["meta"]}
            else:
                yield _row(row["doc_id"], "", "rejected", status, row["sample"])


class InputUnreadable(OSError):
    """An input file could not be read for a reason that is not its content (an I/O error after the
    filesystem's own retries): its work unit fails, and Ray retries it; then, per `--unreadable`, the
    run fails or is published without the file. Nothing marks such a file consumed."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path

    def __reduce__(self):  # raised in Ray workers: keep the path through pickling
        return type(self), (str(self), self.path)


class InputMissing(InputUnreadable):
    """A local input path that is not there on the worker's node: the run fails, at once."""


def _node_name() -> str:
    import socket

    return socket.gethostname()


def _whole(stream, f: dict, cfg: ReadConfig) -> Iterator[dict]:
    data = stream.read(cfg.max_record_bytes + 1)
    if len(data) > cfg.max_record_bytes:
        yield _row(f"{f['path']}:0", "", "rejected", "record-too-large", data)
    elif not data:
        yield _row(f"{f['path']}:0", "", "rejected", "empty-file")
    else:
        yield decode_text(f"{f['path']}:0", data)


def _owned_lines(stream, f: dict, cap: int) -> Iterator[tuple[int, bytes | None]]:
    """(offset, line) for the lines that start inside [start, end); None for an over-long line."""
    pos, end = f["start"], f["end"]
    if pos:  # the stream starts at start-1: skip through the first newline at or after it
        n = 0
        while True:
            piece = stream.readline(1 << 20)
            n += len(piece)
            if not piece or piece.endswith(b"\n"):
                break
            if f["start"] - 1 + n >= end:  # no line starts in this range: a long line is read by its owner only
                return
        pos = f["start"] - 1 + n
    compressed = bool(describe(f["path"])[1])
    while compressed or pos < end:
        line, n = read_capped_line(stream, cap, float("inf") if compressed else end - pos)
        if n == 0:
            return
        yield pos, line
        pos += n
        if line is None and not compressed and pos >= end:
            return  # an over-long line runs past this range: the range holding its end skips the rest


def _json(stream, f: dict, cfg: ReadConfig, kind: str) -> Iterator[dict]:
    path = f["path"]
    if kind == "json" and f["start"] == 0:
        head = stream.peek(64)[:64].lstrip()
        if head.startswith(b"["):  # one JSON array of records: bounded by max_record_bytes
            data = stream.read(cfg.max_record_bytes + 1)
            if len(data) > cfg.max_record_bytes:
                yield _row(f"{path}:0", "", "rejected", "record-too-large", data)
                return
            try:
                records = json.loads(data)
            except (ValueError, RecursionError):
                yield _row(f"{path}:0", "", "rejected", "malformed-json", data)
                return
            for i, obj in enumerate(records):
                yield json_object(f"{path}:{i}", obj, cfg.text_field)
            return
    for pos, line in _owned_lines(stream, f, cfg.max_record_bytes):
        if line is None:
            yield _row(f"{path}:{pos}", "", "rejected", "record-too-large")
        elif line.strip():
            yield json_record(f"{path}:{pos}", line, cfg.text_field)


def _blocks(stream, f: dict, cfg: ReadConfig) -> Iterator[dict]:
    """Blank-line separated blocks. A block belongs to the range holding the blank line
    before it (the first block to the range at offset 0)."""
    path = f["path"]
    owned = f["start"] == 0
    block, block_at, size, too_big = [], 0, 0, False
    compressed = bool(describe(path)[1])

    def flush():
        if too_big:
            return _row(f"{path}:{block_at}", "", "rejected", "record-too-large")
        return decode_text(f"{path}:{block_at}", b"\n".join(block))

    for pos, line in _owned_lines(stream, {**f, "end": float("inf")}, cfg.max_record_bytes):
        blank = line is not None and not line.strip()
        if blank:
            if owned and (block or too_big):
                yield flush()
            block, size, too_big = [], 0, False
            if not compressed and pos >= f["end"]:
                return  # the block after this blank line belongs to the next range
            owned = True
            continue
        if not owned:
            continue
        if not block and not too_big:
            block_at = pos
        if line is None or size + len(line) > cfg.max_record_bytes:
            too_big, block = True, []
            continue
        if not too_big:
            block.append(line)
            size += len(line) + 1
    if owned and (block or too_big):
        yield flush()


def _parquet(f: dict, cfg: ReadConfig) -> Iterator[dict]:
    """A parquet file's text column, a record per row. The file is decoded from local disk (an object
    store's is copied there first, through the retried reads), so a decoding error (a corrupt page or
    footer) is the file's own damage, counted `corrupt-file`, and only a failed read is an I/O error."""
    if "://" in f["path"] and not f["path"].startswith("file://"):
        with tempfile.NamedTemporaryFile(prefix="strata-parquet-", suffix=".parquet") as local:
            fs, p = filesystem(f["path"])
            with fs.open_input_stream(p) as src:  # an OSError here is I/O: read_file retries it
                shutil.copyfileobj(src, local, 1 << 20)
            local.flush()
            yield from _parquet_local(local.name, f["path"], cfg)
        return
    yield from _parquet_local(f["path"].removeprefix("file://"), f["path"], cfg)


def _parquet_local(local: str, path: str, cfg: ReadConfig) -> Iterator[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not os.path.exists(local):
        raise FileNotFoundError(local)
    try:
        pf = pq.ParquetFile(local)
        names = pf.schema_arrow.names
    except (pa.ArrowException, OSError) as e:  # a corrupt footer or magic bytes
        yield _row(f"{path}:damage", "", "rejected", "corrupt-file", str(e))
        return
    if cfg.text_field not in names:
        yield _row(f"{path}:0", "", "rejected", "missing-text-column", ", ".join(names))
        return
    row = 0
    for group in range(pf.num_row_groups):  # one row group at a time: a corrupt one costs only itself
        try:
            column = pf.read_row_group(group, columns=[cfg.text_field]).column(0).combine_chunks()
        except (pa.ArrowException, OSError) as e:  # a corrupt page or chunk
            rows = pf.metadata.row_group(group).num_rows
            yield _row(f"{path}:damage-{group}", "", "rejected", "corrupt-file",
                       f"row group {group} ({rows:,} rows) unreadable: {e}")
            row += rows
            continue
        if pa.types.is_dictionary(column.type):  # dictionary-encoded text: its values, row by row
            column = column.dictionary_decode()
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            column = column.cast(pa.large_binary())  # the bytes as stored: a bad value is its row's
        textual = pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)
        for value in column.to_pylist():
            yield _parquet_value(f"{path}:{row}", value, textual, cfg.max_record_bytes)
            row += 1


def _parquet_value(doc_id: str, value, textual: bool, cap: int) -> dict:
    """One parquet row's text value as a record, or its reason: null, not text, too large, invalid UTF-8."""
    if value is None:
        return _row(doc_id, "", "rejected", "missing-text-field", "null")
    if not textual:
        return _row(doc_id, "", "rejected", "missing-text-field", repr(value))
    if len(value) > cap:
        return _row(doc_id, "", "rejected", "record-too-large", value)
    return decode_text(doc_id, value)
