"""The storage layout: every path strata writes, built from one root.

The root comes from `STRATA_STORAGE` (a local directory, or an object-store URI
such as `s3://bucket/strata`); it defaults to `~/strata-data`. A multi-node
cluster needs a root every node can reach (object store or NFS).

    <root>/datasets/<name>/v0001/manifest.json   a committed dataset version
    <root>/datasets/<name>/_staging/<id>/        a version being written
    <root>/runs/<name>/                          a training run
    <root>/sweeps/<name>/                        a sweep
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

ENV_VAR = "STRATA_STORAGE"
DEFAULT_ROOT = "~/strata-data"


def _is_uri(path: str) -> bool:
    return "://" in path


def storage_root(root: str | None = None) -> str:
    """The storage root: `root`, else `$STRATA_STORAGE`, else `~/strata-data`."""
    root = root or os.environ.get(ENV_VAR) or DEFAULT_ROOT
    if _is_uri(root) and not root.startswith("file://"):
        return root.rstrip("/")
    if root.startswith("file://"):
        root = root[len("file://"):]
    return str(Path(root).expanduser().resolve())


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it, for a local path or a URI."""
    if _is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), path


def join(base: str, *parts: str) -> str:
    """Join path parts with `/` (object-store URIs) or the OS separator (local)."""
    if _is_uri(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)


def check_name(name: str, what: str = "name") -> str:
    """Names become path parts and Ray ids: keep them to [A-Za-z0-9._-]."""
    ok = name and all(c.isalnum() or c in "._-" for c in name) and not name.startswith(".")
    if not ok:
        raise ValueError(f"invalid {what} {name!r}: use letters, digits, '.', '_' and '-' only")
    return name


@dataclass(frozen=True)
class Storage:
    """Paths under one storage root."""

    root: str

    @classmethod
    def from_env(cls, root: str | None = None) -> Storage:
        return cls(storage_root(root))

    def datasets(self) -> str:
        return join(self.root, "datasets")

    def dataset(self, name: str) -> str:
        return join(self.root, "datasets", check_name(name, "dataset name"))

    def staging(self, name: str) -> str:
        """A fresh staging directory for a dataset version being written."""
        return join(self.dataset(name), "_staging", uuid.uuid4().hex[:12])

    def runs(self) -> str:
        return join(self.root, "runs")

    def run(self, name: str) -> str:
        return join(self.root, "runs", check_name(name, "run name"))

    def sweeps(self) -> str:
        return join(self.root, "sweeps")

    def sweep(self, name: str) -> str:
        return join(self.root, "sweeps", check_name(name, "sweep name"))

    def records(self) -> str:
        """One JSON record per run of any kind (`python -m strata runs` lists them)."""
        return join(self.root, "records")


def read_json(path: str) -> dict:
    fs, p = filesystem(path)
    with fs.open_input_stream(p) as f:
        return json.loads(f.read().decode())


def write_json_atomic(path: str, obj: dict) -> None:
    """Write JSON so a reader sees the old file, or the whole new one, never a part."""
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Local: write a temp file, then rename over. Object stores: one PUT is atomic."""
    fs, p = filesystem(path)
    fs.create_dir(p.rsplit("/", 1)[0])
    if isinstance(fs, pafs.LocalFileSystem):
        tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    else:
        with fs.open_output_stream(p) as f:
            f.write(data)


def exists(path: str) -> bool:
    fs, p = filesystem(path)
    return fs.get_file_info(p).type != pafs.FileType.NotFound
