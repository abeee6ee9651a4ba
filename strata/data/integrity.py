"""One integrity rule for what strata reads back from a dataset: a file is trusted only when the commit
that names it names its SHA-256, and the bytes read match.

A version's manifest (in its Delta commit) holds `digests`: the SHA-256 of every file of the dataset it
names that strata reads back, its own (lineage, tails, rejects report, dedup audit and removed lists,
tokenizer) and those it carries on from its parent (dedup index segments, the consumed index, the quality
cache, the forget list). A reader takes such a file as a `Named`: its path, the digest its commit names,
and what to call it. `read` gives its bytes only once they match; `opened` gives a file to read (parquet
row groups, say) that is a checked copy, in memory or, when large, on local disk, so memory stays bounded
and nothing is read from storage after the check. A missing digest, a mismatch or a missing file is one
line naming the file (`IntegrityError`), never a traceback.

Versions committed before digests (2026-12-05) name none: their files are refused where a destructive
operation would act on them, and read with a warning naming the version where a run carries them on (the
run's commit then names them as they are: trust on first use, said once).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from dataclasses import dataclass

from strata.errors import StrataError

IN_MEMORY = 64 << 20  # a checked file larger than this is copied to local disk, not held in memory
CHUNK = 1 << 20


class IntegrityError(StrataError):
    """A file read back from storage is not the one the commit that names it says."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str) -> str:
    """A file's SHA-256, read in pieces (local or in the object store)."""
    from strata.data.storage import filesystem

    fs, p = filesystem(path)
    h = hashlib.sha256()
    with fs.open_input_stream(p) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


class HashingSink:
    """A file-like sink for pyarrow writers (a ParquetWriter's `where`) that hashes what it passes on to `raw`, a
    pyarrow output stream: the writer learns the SHA-256 of what it wrote without reading it back."""

    def __init__(self, raw):
        self.raw, self.h, self.pos, self.closed = raw, hashlib.sha256(), 0, False

    def write(self, data) -> int:
        data = bytes(data)
        self.h.update(data)
        self.raw.write(data)
        self.pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True  # the raw stream is its owner's to close

    def hexdigest(self) -> str:
        return self.h.hexdigest()


_WARNED: set[str] = set()


@dataclass(frozen=True)
class Named:
    """A file a commit names: `path` (whole), `sha256` (None: the commit predates digests) and `what` (how
    errors name it: the version and the path in the dataset). Plain data: it travels to Ray workers."""

    path: str
    sha256: str | None
    what: str
    legacy_ok: bool = False
    """Read a file whose commit names no digest (with a warning) instead of refusing it."""

    def _unnamed(self) -> None:
        if not self.legacy_ok:
            raise IntegrityError(f"{self.what} is named by no SHA-256 in the commit that made it (a version made before "
                                 "strata named its files' digests, 2026-12-05): it cannot be verified; refused")
        if self.what not in _WARNED:
            _WARNED.add(self.what)
            from strata.errors import log

            log("integrity").warning(f"{self.what}: its commit predates file digests; read as it is")

    def _missing(self) -> IntegrityError:
        return IntegrityError(f"{self.what} is missing: its commit names it ({self.path}); refused")

    def _check(self, digest: str) -> None:
        if digest != self.sha256:
            raise IntegrityError(f"{self.what} does not match the SHA-256 its commit names (changed after it was "
                                 f"written): {self.path}; refused")

    def read(self) -> bytes:
        """The file's bytes, once they match the commit's digest."""
        from strata.data.storage import read_bytes

        if self.sha256 is None:
            self._unnamed()
        try:
            data = read_bytes(self.path)
        except FileNotFoundError:
            raise self._missing() from None
        if self.sha256 is not None:
            self._check(sha256(data))
        return data

    def exists(self) -> bool:
        from strata.data.storage import exists

        return exists(self.path)

    @contextlib.contextmanager
    def opened(self):
        """A pyarrow file of the checked bytes: a buffer, or, past IN_MEMORY, a local copy made while hashing."""
        import pyarrow as pa
        import pyarrow.fs as pafs

        from strata.data.storage import filesystem

        if self.sha256 is None:
            self._unnamed()
        fs, p = filesystem(self.path)
        try:
            size = fs.get_file_info(p).size
        except FileNotFoundError:
            raise self._missing() from None
        if size is None:
            raise self._missing()
        if size <= IN_MEMORY:
            yield pa.BufferReader(self.read())
            return
        fd, local = tempfile.mkstemp(prefix="strata-checked-")
        try:
            h = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, fs.open_input_stream(p) as src:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
            if self.sha256 is not None:
                self._check(h.hexdigest())
            with pafs.LocalFileSystem().open_input_file(local) as f:
                yield f
        except FileNotFoundError:
            raise self._missing() from None
        finally:
            os.unlink(local)

    def parquet(self, **kwargs):
        """The whole file as a pyarrow Table (pq.read_table's keyword arguments), checked first."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        with self.opened() as f:
            try:
                return pq.read_table(f, **kwargs)
            except (pa.ArrowInvalid, OSError) as e:
                raise IntegrityError(f"{self.what} is not a readable parquet file ({e}); refused") from None

    def json(self):
        import json

        try:
            return json.loads(self.read())
        except ValueError:
            raise IntegrityError(f"{self.what} is not JSON; refused") from None
