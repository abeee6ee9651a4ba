"""The versioned dataset contract between tier 1 (writes) and tier 2 (reads).

A dataset is a directory of immutable versions. Tier 1 writes shards into a
staging directory, renames it to the next free `vNNNN` and writes
`manifest.json` last; a version without a manifest is invisible, so a crashed
run leaves nothing a reader could mistake for complete.

One parquet row is one packed training sequence: `seq_len + 1` token ids in a
fixed-size list column (inputs are row[:-1], targets row[1:]).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from strata.storage import Storage, exists, filesystem, join, read_json, write_json_atomic

SCHEMA_VERSION = 1
TOKENS = "tokens"
SPLITS = ("train", "validation")
MANIFEST = "manifest.json"
_VERSION_RE = re.compile(r"^v(\d{4,})$")


class DatasetError(Exception):
    """A dataset is missing, or does not fit what the reader needs."""


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned integer type that holds every token id."""
    for name, limit in (("uint8", 2**8), ("uint16", 2**16), ("uint32", 2**32)):
        if vocab_size <= limit:
            return name
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


def arrow_schema(seq_len: int, dtype: str) -> pa.Schema:
    """The shard schema: one fixed-size list of `seq_len + 1` token ids per row."""
    return pa.schema([pa.field(TOKENS, pa.list_(pa.type_for_alias(dtype), seq_len + 1), nullable=False)])


@dataclass(frozen=True, kw_only=True)
class TokenizerInfo:
    kind: str
    """Tokenizer family, e.g. `bytes`."""
    vocab_size: int
    """Number of token ids, special tokens included."""
    eot_id: int
    """The end-of-text id that separates packed documents."""
    hash: str
    """Hash of the tokenizer's definition: equal hash, equal token ids."""
    file: str = ""
    """Its definition file, relative to the version directory (none for `bytes`)."""


@dataclass(frozen=True, kw_only=True)
class Shard:
    path: str
    """Path relative to the version directory."""
    split: str
    """`train` or `validation`."""
    rows: int
    """Packed sequences in the file."""
    tokens: int
    """Token ids in the file (rows * (seq_len + 1))."""


@dataclass(kw_only=True)
class DocumentCounts:
    """Every document read is kept, filtered, duplicate or rejected, with a reason."""

    read: int = 0
    kept: int = 0
    filtered: int = 0
    duplicate: int = 0
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    """Count per `status:reason`, e.g. `rejected:invalid-utf8`."""

    def balanced(self) -> bool:
        return self.read == self.kept + self.filtered + self.duplicate + self.rejected


@dataclass(frozen=True, kw_only=True)
class Manifest:
    dataset: str
    version: str
    created_at: float
    tokenizer: TokenizerInfo
    seq_len: int
    dtype: str
    shards: list[Shard]
    documents: DocumentCounts
    tokens: int
    """Tokens of the kept documents, end-of-text ids included, before packing."""
    inputs: list[dict]
    """The input files consumed: path, size, mtime."""
    run: dict
    """Resolved config, code and library versions of the run that wrote it."""
    stats: dict = field(default_factory=dict)
    """The run's summary table: counts by rule and reason, bytes, tokens, throughput."""
    dedup: dict = field(default_factory=dict)
    """Dedup parameters and the state files later versions deduplicate against."""
    rejects: str = ""
    """The rejects report (counts and samples by reason), relative to the version directory."""
    run_id: str = ""
    """The idempotency key of the run that wrote it (e.g. a scheduled slot), if any."""
    schema_version: int = SCHEMA_VERSION

    def rows(self, split: str) -> int:
        return sum(s.rows for s in self.shards if s.split == split)

    def packed_tokens(self, split: str | None = None) -> int:
        return sum(s.tokens for s in self.shards if split in (None, s.split))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        if d.get("schema_version") != SCHEMA_VERSION:
            raise DatasetError(
                f"dataset {d.get('dataset')}@{d.get('version')} has schema version "
                f"{d.get('schema_version')}; this strata reads version {SCHEMA_VERSION}")
        d = dict(d)
        d["tokenizer"] = TokenizerInfo(**d["tokenizer"])
        d["shards"] = [Shard(**s) for s in d["shards"]]
        d["documents"] = DocumentCounts(**d["documents"])
        return cls(**d)


@dataclass(frozen=True)
class DatasetVersion:
    """A committed version: its directory and manifest."""

    path: str
    manifest: Manifest

    @property
    def ref(self) -> str:
        return f"{self.manifest.dataset}@{self.manifest.version}"

    def shard_paths(self, split: str) -> list[str]:
        return [join(self.path, s.path) for s in self.manifest.shards if s.split == split]

    def tokenizer_definition(self) -> str | None:
        """The tokenizer file's text, for tokenizers that have one."""
        if not self.manifest.tokenizer.file:
            return None
        fs, p = filesystem(join(self.path, self.manifest.tokenizer.file))
        with fs.open_input_stream(p) as f:
            return f.read().decode()


def read_rows(path: str) -> np.ndarray:
    """A shard's rows as one (n, seq_len + 1) array of token ids."""
    fs, p = filesystem(path)
    col = pq.read_table(p, filesystem=fs, columns=[TOKENS]).column(TOKENS).combine_chunks()
    return col.values.to_numpy().reshape(len(col), -1)


def list_versions(storage: Storage, name: str) -> list[str]:
    """Committed versions of `name`, oldest first. Uncommitted directories are skipped."""
    fs, base = filesystem(storage.dataset(name))
    infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    found = []
    for info in infos:
        m = _VERSION_RE.match(info.base_name)
        if m and info.type == pafs.FileType.Directory and exists(join(storage.dataset(name), info.base_name, MANIFEST)):
            found.append((int(m.group(1)), info.base_name))
    return [v for _, v in sorted(found)]


def resolve(storage: Storage, ref: str) -> DatasetVersion:
    """`NAME` (latest version) or `NAME@VERSION` to a committed version."""
    name, _, version = ref.partition("@")
    versions = list_versions(storage, name)
    if not versions:
        raise DatasetError(f"dataset {name!r} has no committed version under {storage.datasets()}")
    version = version or versions[-1]
    if version not in versions:
        raise DatasetError(f"dataset {name!r} has no version {version!r}; committed: {', '.join(versions)}")
    path = join(storage.dataset(name), version)
    return DatasetVersion(path, Manifest.from_dict(read_json(join(path, MANIFEST))))


def commit(storage: Storage, name: str, staging: str, manifest_fields: dict) -> DatasetVersion:
    """Publish a staging directory as the next version; the manifest goes last.

    `manifest_fields` are the Manifest fields except `dataset`, `version` and
    `created_at`. Renaming onto an existing (non-empty) version fails, so two
    writers racing for one number end with two distinct versions.
    """
    fs, staging_path = filesystem(staging)
    if fs.get_file_info(staging_path).type != pafs.FileType.Directory:
        raise DatasetError(f"nothing staged at {staging}")
    for _ in range(100):
        existing = [int(_VERSION_RE.match(v).group(1)) for v in _version_dirs(storage, name)]
        version = f"v{max(existing, default=0) + 1:04d}"
        _, target = filesystem(join(storage.dataset(name), version))
        try:
            fs.move(staging_path, target)
            break
        except OSError:
            continue  # lost a race for this number: take the next
    else:
        raise DatasetError(f"could not allocate a version for dataset {name!r}")
    manifest = Manifest(dataset=name, version=version, created_at=time.time(), **manifest_fields)
    path = join(storage.dataset(name), version)
    write_json_atomic(join(path, MANIFEST), manifest.to_dict())
    return DatasetVersion(path, manifest)


def _version_dirs(storage: Storage, name: str) -> list[str]:
    """Every `vNNNN` directory, committed or not (numbers are never reused)."""
    fs, base = filesystem(storage.dataset(name))
    infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    return [i.base_name for i in infos if _VERSION_RE.match(i.base_name)]


def check_compatible(version: DatasetVersion, *, vocab_size: int, seq_len: int,
                     tokenizer_hash: str | None = None) -> None:
    """Refuse, with a clear message, a dataset that does not fit the model."""
    m = version.manifest
    problems = []
    if m.tokenizer.vocab_size > vocab_size:
        problems.append(f"its tokenizer has {m.tokenizer.vocab_size} ids but the model's vocab_size is {vocab_size}")
    if m.seq_len != seq_len:
        problems.append(f"its seq_len is {m.seq_len} but the model's is {seq_len}")
    if tokenizer_hash is not None and m.tokenizer.hash != tokenizer_hash:
        problems.append(f"its tokenizer hash {m.tokenizer.hash} differs from the model's {tokenizer_hash}")
    if problems:
        raise DatasetError(f"dataset {version.ref} does not fit the model: " + "; ".join(problems))
