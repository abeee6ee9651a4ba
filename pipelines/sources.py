"""Input discovery and tolerant decoding: every file and line becomes a document
row with a status, so nothing read goes unaccounted for.

A row is `{doc_id, text, status, reason, node}`; status is `kept`, `filtered` or
`rejected`, and reason says why (empty for kept).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import unicodedata
import zlib

import pyarrow.fs as pafs

from strata.storage import filesystem

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")


def list_inputs(inputs: list[str]) -> list[dict]:
    """Expand paths, directories (recursively) and globs into files with size and mtime.

    A missing input is an error before any work starts, not an empty dataset.
    """
    found: dict[str, dict] = {}
    for spec in inputs:
        if "://" not in spec and glob.has_magic(spec):
            matches = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
            if not matches:
                raise FileNotFoundError(f"input glob {spec!r} matches no file")
            for m in matches:
                _add(found, os.path.abspath(m))
        else:
            _add(found, spec if "://" in spec else os.path.abspath(os.path.expanduser(spec)))
    return [found[p] for p in sorted(found)]


def _add(found: dict[str, dict], path: str) -> None:
    fs, p = filesystem(path)
    info = fs.get_file_info(p)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"input {path!r} does not exist")
    infos = [info]
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(p, recursive=True))
    prefix = path[: len(path) - len(p)] if "://" in path else ""
    for i in infos:
        if i.type == pafs.FileType.File and not i.base_name.startswith("."):
            full = prefix + i.path
            found[full] = {"path": full, "size": i.size, "mtime": i.mtime_ns}


def _row(doc_id: str, text: str, status: str, reason: str, node: str) -> dict:
    return {"doc_id": doc_id, "text": text, "status": status, "reason": reason, "node": node}


def decode_file(row: dict, *, text_field: str, min_chars: int, max_chars: int) -> list[dict]:
    """One file's bytes to document rows (Ray Data `flat_map`). Never raises on bad data."""
    import ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    path, data = row["path"], row["bytes"]
    if path.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error):
            return [_row(f"{path}#0", "", "rejected", "corrupt-compressed", node)]
    if path.endswith(JSONL_SUFFIXES):
        return [_json_doc(f"{path}#{i}", line, text_field, min_chars, max_chars, node)
                for i, line in enumerate(data.splitlines()) if line.strip()]
    return [_text_doc(f"{path}#0", data, min_chars, max_chars, node)]


def _json_doc(doc_id: str, line: bytes, field: str, min_chars: int, max_chars: int, node: str) -> dict:
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return _row(doc_id, "", "rejected", "malformed-json", node)
    text = obj.get(field) if isinstance(obj, dict) else None
    if not isinstance(text, str):
        return _row(doc_id, "", "rejected", "missing-text-field", node)
    return _clean(doc_id, text, min_chars, max_chars, node)


def _text_doc(doc_id: str, data: bytes, min_chars: int, max_chars: int, node: str) -> dict:
    if b"\x00" in data:
        return _row(doc_id, "", "rejected", "binary", node)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return _row(doc_id, "", "rejected", "invalid-utf8", node)
    return _clean(doc_id, text, min_chars, max_chars, node)


def _clean(doc_id: str, text: str, min_chars: int, max_chars: int, node: str) -> dict:
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n")).strip()
    if len(text) < min_chars:
        return _row(doc_id, "", "filtered", "too-short", node)
    if len(text) > max_chars:
        return _row(doc_id, "", "filtered", "too-long", node)
    return _row(doc_id, text, "kept", "", node)
