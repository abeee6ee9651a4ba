"""What a work unit's read proves about its files: each file's digest (sha256 of its bytes, or of its 8 MiB
parts' digests, as object stores checksum a multipart upload), read part by part by the ranges that read the
file (`part_digests`, put together by `file_digest`), and a unit processed with a file that stays unreadable
left out when the run defers such files (`with_deferral`).
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

from strata.data.sources import RETRY_BASE_S, InputMissing, InputUnreadable, ReadConfig, _node_name
from strata.data.storage import filesystem

DIGEST_PART = 8 << 20  # a file's digest: sha256 of its bytes up to this size, of its parts' sha256s above


def part_digests(f: dict, cfg: ReadConfig) -> list[tuple[str, int, str]]:
    """(path, part, sha256 hex) of each DIGEST_PART-byte part of input file `f` whose first byte is in its
    range [start, end): the ranges of a file share its parts out, each read once, so the file's digest
    costs one more read of it, spread like the reading (`file_digest` puts them together). Read failures
    are retried as records' are."""
    import hashlib

    first = -(-f["start"] // DIGEST_PART)
    parts = list(range(first, -(-f["end"] // DIGEST_PART)) if f["size"] else range(1 if f["start"] == 0 else 0))
    out = []
    for attempt in range(cfg.read_retries + 1):  # the file opened once; a retry goes on from the part that failed
        try:
            fs, p = filesystem(f["path"])
            with fs.open_input_file(p) as stream:
                for part in parts[len(out):]:
                    data = stream.read_at(DIGEST_PART, part * DIGEST_PART) if f["size"] else b""
                    out.append((f["path"], part, hashlib.sha256(data).hexdigest()))
            break
        except FileNotFoundError as e:
            raise InputMissing(f"input file {f['path']} is not there on node {_node_name()}", f["path"]) from e
        except OSError as e:
            if attempt == cfg.read_retries:
                raise InputUnreadable(f"reading {f['path']} failed: {e} (read {attempt + 1} times)", f["path"]) from e
            time.sleep(RETRY_BASE_S * 2 ** attempt * (0.5 + random.random() / 2))
    return out


def path_digest(path: str) -> str:
    """The digest of the file at `path` as tier 1 records its inputs' (`file_digest`), read whole here;
    FileNotFoundError if there is none."""
    import hashlib

    from strata.data.storage import filesystem

    fs, p = filesystem(path)
    parts, size = {}, 0
    with fs.open_input_stream(p) as f:
        while chunk := f.read(DIGEST_PART):
            parts[len(parts)] = hashlib.sha256(chunk).hexdigest()
            size += len(chunk)
    if not parts:
        parts[0] = hashlib.sha256(b"").hexdigest()
    return file_digest(size, parts)


def file_digest(size: int, parts: dict[int, str]) -> str | None:
    """A file's digest from its parts' sha256s (`part_digests`): `sha256:HEX` of its bytes when it is one
    part (what `sha256sum` prints), else `sha256-8MiB-parts:HEX`, the sha256 of its parts' digests in
    order (as object stores checksum a multipart upload). None when a part is missing (a deferred file)."""
    import hashlib

    count = max(1, -(-size // DIGEST_PART))
    if sorted(parts) != list(range(count)):
        return None
    if count == 1:
        return f"sha256:{parts[0]}"
    return "sha256-8MiB-parts:" + hashlib.sha256(b"".join(bytes.fromhex(parts[i]) for i in range(count))).hexdigest()


def with_deferral(unit: list[dict], cfg: ReadConfig, process):
    """`process(files)` (an Output, pipelines/stats.py) over a work unit's files; with `--unreadable defer`,
    a file that stays unreadable is left out and the unit processed again without it. The Output gains
    the unit's files, their parts' digests (`part_digests`) and, in its tally, the deferred ones with why,
    from which the run drops the other byte ranges of a deferred file (stats.without_deferred)."""
    files, deferred = list(unit), {}
    while True:
        try:
            digests = [d for f in files for d in part_digests(f, cfg)]
            out = process(files)
            break
        except InputMissing:
            raise
        except InputUnreadable as e:
            if cfg.unreadable != "defer" or e.path in deferred:
                raise
            deferred[e.path] = str(e)
            files = [f for f in files if f["path"] != e.path]
    return replace(out, unit_files=tuple(sorted({f["path"] for f in unit})), digests=tuple(digests),
                   tally=replace(out.tally, deferred=deferred))
