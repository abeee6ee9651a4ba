"""The versioned dataset contract between tier 1 (writes) and tier 2 (reads).

A dataset is a directory of immutable versions; each version is a snapshot of
the whole dataset: the previous version's shards (referenced, never copied)
plus what its run added. A run writes its files under `data/<tag>/`, then
publishes the version by creating `vNNNN/manifest.json` with one conditional
create (`create_exclusive`): exactly one writer gets a number, and a version
is visible whole or not at all. A crashed run leaves only unreferenced files
under `data/`, which the next writer holding the dataset's lease deletes.

One parquet row is one packed training sequence: `seq_len + 1` token ids in a
fixed-size list column (inputs are row[:-1], targets row[1:]).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from strata.shell import StrataError
from strata.storage import (
    Storage,
    create_exclusive,
    delete,
    delete_dir,
    exists,
    filesystem,
    is_uri,
    join,
    list_dir,
    read_bytes,
    read_json,
)

SCHEMA_VERSION = 2
TOKENS = "tokens"
SPLITS = ("train", "validation")
MANIFEST = "manifest.json"
_VERSION_RE = re.compile(r"^v(\d{4,})$")


class DatasetError(StrataError):
    """A dataset is missing, or does not fit what the reader needs."""


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned integer type that holds every token id and, above them, the pad value."""
    for name, limit in (("uint8", 2**8), ("uint16", 2**16), ("uint32", 2**32)):
        if vocab_size < limit:
            return name
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


def pad_value(dtype) -> int:
    """The id that fills the end of a padded row (`--final`): the largest value of the rows' type, never a
    token (`token_dtype` leaves it free). Training masks it out of the loss."""
    return int(np.iinfo(np.dtype(dtype)).max)


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
    """Its definition file, relative to the dataset directory (none for `bytes`)."""


@dataclass(frozen=True, kw_only=True)
class Shard:
    path: str
    """Path relative to the dataset directory (e.g. `data/<tag>/train-00000.parquet`)."""
    split: str
    """`train` or `validation`."""
    rows: int
    """Packed sequences in the file."""
    tokens: int
    """Token ids in the file (rows * (seq_len + 1))."""
    version: str = ""
    """The version whose run added this shard."""


DOCUMENT_STATUSES = ("read", "kept", "filtered", "duplicate", "rejected", "unpacked")


@dataclass(kw_only=True)
class DocumentCounts:
    """Every document read is kept, filtered, duplicate, rejected or unpacked, with a reason."""

    read: int = 0
    kept: int = 0
    filtered: int = 0
    duplicate: int = 0
    rejected: int = 0
    unpacked: int = 0
    """Kept by every rule but not whole in the shards: they end in the last partial row of a split,
    which is not written (less than one row's worth of tokens per split per version)."""
    reasons: dict[str, int] = field(default_factory=dict)
    """Count per `status:reason`, e.g. `rejected:invalid-utf8`."""

    def balanced(self) -> bool:
        return self.read == self.kept + self.filtered + self.duplicate + self.rejected + self.unpacked


@dataclass(frozen=True, kw_only=True)
class Manifest:
    dataset: str
    version: str
    created_at: float
    tokenizer: TokenizerInfo
    seq_len: int
    dtype: str
    shards: list[Shard]
    """Every shard of the snapshot: the parent's, then this run's (each says which version added it)."""
    documents: DocumentCounts
    """This run's documents: every one read is kept, filtered, duplicate or rejected."""
    tokens: int
    """Tokens of this run's kept documents, end-of-text ids included, before packing."""
    inputs: list[dict]
    """The input files this run consumed: path, size, mtime."""
    run: dict
    """Resolved config, code and library versions of the run that wrote it."""
    parent: str = ""
    """The version this snapshot extends (empty for the first)."""
    totals: dict = field(default_factory=dict)
    """The whole snapshot: versions, inputs, documents by status, tokens, rows by split, shards."""
    files: str = ""
    """This run's directory, relative to the dataset directory (`data/<tag>`)."""
    stats: dict = field(default_factory=dict)
    """The run's summary table: counts by rule and reason, bytes, tokens, throughput."""
    dedup: dict = field(default_factory=dict)
    """Dedup parameters, `index`: the dataset's dedup index as of this version (per table, segments of
    sorted key files, one per slice of the key space: what later versions deduplicate against; versions
    made before it have `files` instead, their own keys), `audit`: the run's dedup
    audit (removal rates per source, duplicate-cluster sizes, sampled pairs with their Jaccard), and
    `removed`: a directory of parquet parts listing every document dedup removed."""
    rejects: str = ""
    """The rejects report (counts and samples by reason), relative to the dataset directory."""
    run_id: str = ""
    """The idempotency key of the run that wrote it (e.g. a scheduled slot), if any."""
    tails: str = ""
    """What this version's rows could not hold (each split's last tokens, shorter than a row), relative to
    the dataset directory: the next version packs them first, so no kept document is left out for good."""
    schema_version: int = SCHEMA_VERSION

    def rows(self, split: str) -> int:
        return sum(s.rows for s in self.shards if s.split == split)

    def packed_tokens(self, split: str | None = None) -> int:
        return sum(s.tokens for s in self.shards if split in (None, s.split))

    def added(self) -> list[Shard]:
        """The shards this version's run added."""
        return [s for s in self.shards if s.version == self.version]

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
    """A committed version: its directory (where the manifest is), the dataset's, and the manifest."""

    path: str
    manifest: Manifest

    @property
    def ref(self) -> str:
        return f"{self.manifest.dataset}@{self.manifest.version}"

    @property
    def root(self) -> str:
        """The dataset directory, which every path in the manifest is relative to."""
        return self.path.rstrip("/").rsplit("/", 1)[0] if "://" in self.path else os.path.dirname(self.path)

    def file(self, rel: str) -> str:
        """A path the manifest names, under the dataset's directory; a manifest is data read back from
        storage, so a path that would leave the dataset (`..`, absolute, a URI, a link out) is refused
        before anything reads, writes or deletes there."""
        norm = posixpath.normpath(rel) if rel else ""
        if not norm or norm == "." or norm.startswith(("/", "../")) or norm == ".." or "://" in rel or "\\" in rel:
            raise DatasetError(f"{self.ref}: its manifest names {rel!r}, which is not a path inside the dataset; "
                               "refused")
        path = join(self.root, *norm.split("/"))
        if not is_uri(path):
            root = os.path.realpath(self.root)
            if not os.path.realpath(path).startswith(root + os.sep):
                raise DatasetError(f"{self.ref}: {rel!r} leads outside the dataset ({os.path.realpath(path)}); "
                                   "refused")
        return path

    def shard_paths(self, split: str) -> list[str]:
        return [self.file(s.path) for s in self.manifest.shards if s.split == split]

    def tokenizer_definition(self) -> str | None:
        """The tokenizer file's text, for tokenizers that have one."""
        if not self.manifest.tokenizer.file:
            return None
        return read_bytes(self.file(self.manifest.tokenizer.file)).decode()


_GROUPS: OrderedDict[str, tuple[int, np.ndarray]] = OrderedDict()  # the last row groups read, per shard (2)
_GROUPS_LOCK = threading.Lock()  # read-ahead threads and the loop read at once


def read_rows(path: str, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows [start, stop) of a shard (all by default) as one (n, seq_len + 1) array of token ids; a range
    reads only the row groups that hold it, and the next range inside the same groups reads nothing (a
    shard written as one row group, as before 2026-12-02, is then decoded once, not once per range)."""
    fs, p = filesystem(path)
    if start == 0 and stop is None:
        col = pq.read_table(p, filesystem=fs, columns=[TOKENS]).column(TOKENS).combine_chunks()
        return col.values.to_numpy().reshape(len(col), -1)
    with _GROUPS_LOCK:
        held = _GROUPS.get(path)
    if stop is not None and held and held[0] <= start and stop <= held[0] + len(held[1]):
        return held[1][start - held[0]: stop - held[0]]
    f = pq.ParquetFile(fs.open_input_file(p))
    groups, first, at = [], None, 0
    stop = f.metadata.num_rows if stop is None else stop
    for g in range(f.metadata.num_row_groups):
        n = f.metadata.row_group(g).num_rows
        if at + n > start and at < stop:
            groups.append(g)
            first = at if first is None else first
        at += n
    col = f.read_row_groups(groups, columns=[TOKENS]).column(TOKENS).combine_chunks()
    rows, first = col.values.to_numpy().reshape(len(col), -1), first or 0
    with _GROUPS_LOCK:
        _GROUPS[path] = (first, rows)
        _GROUPS.move_to_end(path)
        while len(_GROUPS) > 2:
            _GROUPS.popitem(last=False)
    return rows[start - first: stop - first]


def list_versions(storage: Storage, name: str) -> list[str]:
    """Committed versions of `name`, oldest first. Directories without a manifest are skipped."""
    base = storage.dataset(name)
    found = [(int(m.group(1)), n) for n, d in list_dir(base) if d and (m := _VERSION_RE.match(n))]
    return [v for _, v in sorted(found) if exists(join(base, v, MANIFEST))]


def resolve(storage: Storage, ref: str) -> DatasetVersion:
    """`NAME` (the newest snapshot) or `NAME@VERSION` to a committed version."""
    name, _, version = ref.partition("@")
    versions = list_versions(storage, name)
    if not versions:
        others = sorted(n for n, d in list_dir(storage.datasets()) if d and n != name)
        there = (f"datasets there: {', '.join(others[:20])}{', ...' if len(others) > 20 else ''}" if others
                 else "there are none yet: make one with python -m pipelines.preprocess")
        raise DatasetError(f"dataset {name!r} has no committed version under {storage.datasets()}; {there}")
    version = version or versions[-1]
    if version not in versions:
        raise DatasetError(f"dataset {name!r} has no version {version!r}; committed: {', '.join(versions)}")
    return _load(join(storage.dataset(name), version))


def _load(path: str) -> DatasetVersion:
    return DatasetVersion(path, Manifest.from_dict(read_json(join(path, MANIFEST))))


def history(storage: Storage, name: str) -> list[DatasetVersion]:
    """Every committed version of `name`, oldest first, in one listing and a read per version (`resolve`
    lists the versions each time: N of them would make N^2 requests)."""
    return [_load(join(storage.dataset(name), v)) for v in list_versions(storage, name)]


def latest(storage: Storage, name: str) -> DatasetVersion | None:
    versions = list_versions(storage, name)
    return resolve(storage, f"{name}@{versions[-1]}") if versions else None


FAILPOINT = "STRATA_FAILPOINT"  # the process kills itself where `failpoint` names it (crash tests)


def failpoint(name: str) -> None:
    """With $STRATA_FAILPOINT equal to `name` (say `before-commit`, or `pass1:3`: the third unit of pass
    1 recorded), the process kills itself here, as a crash or a kill -9 would."""
    if os.environ.get(FAILPOINT) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def commit(storage: Storage, name: str, files: str, manifest_fields: dict, *, lease=None,
           built_on: str | None = None) -> DatasetVersion:
    """Publish this run's shards as the next snapshot, in one conditional create of its manifest.

    `files` is the run's directory (`storage.run_files`); `manifest_fields` are the
    Manifest fields except `dataset`, `version`, `created_at`, `parent`, `totals`
    and `files`, with shard, tokenizer and rejects paths relative to `files`. The
    snapshot is built on the newest version at the moment of commit; a writer that
    loses the race for a number rebuilds on the winner and takes the next. With a
    `lease`, a writer that lost it commits nothing. `built_on` is the version the run built on (deduplicated against):
    if it is gone (deleted meanwhile), the run's idea of what is new is wrong and it commits nothing.
    """
    base = storage.dataset(name)
    rel = files[len(base):].strip("/").replace(os.sep, "/")
    if not files.startswith(base) or not rel:
        raise DatasetError(f"{files} is not a run directory of dataset {name!r}")
    fields = dict(manifest_fields)
    new_shards = [Shard(**{**asdict(s), "path": f"{rel}/{s.path}"}) for s in fields.pop("shards")]
    if (tok := fields["tokenizer"]).file:
        fields["tokenizer"] = TokenizerInfo(**{**asdict(tok), "file": f"{rel}/{tok.file}"})
    if fields.get("rejects"):
        fields["rejects"] = f"{rel}/{fields['rejects']}"
    if fields.get("tails"):
        fields["tails"] = f"{rel}/{fields['tails']}"
    for key in ("audit", "removed"):
        if fields.get("dedup", {}).get(key):
            fields["dedup"] = {**fields["dedup"], key: f"{rel}/{fields['dedup'][key]}"}
    if fields.get("dedup", {}).get("files"):
        fields["dedup"] = {**fields["dedup"], "files": {t: [f"{rel}/{p}" for p in ps]
                                                       for t, ps in fields["dedup"]["files"].items()}}
    failpoint("before-commit")
    if built_on and built_on not in list_versions(storage, name):
        raise DatasetError(f"{name}@{built_on}, the version this run deduplicated against, was deleted while it ran: "
                           "nothing was committed (what it dropped as duplicates of that version would be lost). "
                           "Run it again")
    for _ in range(1000):
        parent = latest(storage, name)
        if parent:
            check_extends(parent, fields["tokenizer"], fields["seq_len"])
        version = f"v{int(parent.manifest.version[1:]) + 1 if parent else 1:04d}"
        shards = (parent.manifest.shards if parent else []) + [Shard(**{**asdict(s), "version": version})
                                                                for s in new_shards]
        manifest = Manifest(dataset=name, version=version, created_at=time.time(), shards=shards, files=rel,
                            parent=parent.manifest.version if parent else "",
                            totals=_totals(parent, shards, fields), **fields)
        if lease is not None:
            lease.check()
        path = join(base, version)
        data = (json.dumps(manifest.to_dict(), indent=2, sort_keys=True) + "\n").encode()
        if create_exclusive(join(path, MANIFEST), data):
            return DatasetVersion(path, manifest)
    raise DatasetError(f"could not commit a version of dataset {name!r}: 1000 writers won the race first")


def _totals(parent: DatasetVersion | None, shards: list[Shard], fields: dict) -> dict:
    before = parent.manifest.totals if parent else {}
    docs = fields["documents"]
    return {
        "versions": before.get("versions", 0) + 1,
        "inputs": before.get("inputs", 0) + len(fields["inputs"]),
        "documents": {k: before.get("documents", {}).get(k, 0) + getattr(docs, k)
                      for k in DOCUMENT_STATUSES},
        "tokens": before.get("tokens", 0) + fields["tokens"],
        "rows": {split: sum(s.rows for s in shards if s.split == split) for split in SPLITS},
        "packed_tokens": sum(s.tokens for s in shards),
        "shards": len(shards),
    }


def check_extends(parent: DatasetVersion, tokenizer: TokenizerInfo, seq_len: int) -> None:
    """A snapshot mixes shards of every version: they must share token ids and row length."""
    m = parent.manifest
    if m.tokenizer.hash != tokenizer.hash or m.seq_len != seq_len:
        raise DatasetError(
            f"dataset {parent.ref} has tokenizer {m.tokenizer.kind} {m.tokenizer.hash} and seq_len {m.seq_len}; "
            f"this run's are {tokenizer.kind} {tokenizer.hash} and {seq_len}: a version extends the previous "
            "one, so use the same tokenizer and seq_len, or another dataset name")


def delete_version(storage: Storage, name: str, version: str) -> list[str]:
    """Delete a version: only the newest, since every later snapshot references earlier shards.

    It holds the dataset's lease while it deletes, so it never pulls a version from under a run that
    deduplicates against it (a run in progress makes it refuse, LeaseBusy). Its manifest goes first (the
    version disappears at once), then the files its run added. Returns the deleted run directory."""
    from strata.lease import Lease

    with Lease(storage.dataset(name), f"dataset {name}", purpose=f"delete {version}").acquire(wait=False):
        return _delete_leased(storage, name, version)


def _delete_leased(storage: Storage, name: str, version: str) -> list[str]:
    versions = list_versions(storage, name)
    if version not in versions:
        raise DatasetError(f"dataset {name!r} has no version {version!r}")
    if version != versions[-1]:
        raise DatasetError(f"{name}@{version} is part of the later snapshots {', '.join(versions[versions.index(version) + 1:])}; "
                           f"only the newest version ({versions[-1]}) can be deleted")
    v = resolve(storage, f"{name}@{version}")
    files = v.file(v.manifest.files) if v.manifest.files else None  # checked to be inside, before any delete
    delete(join(v.path, MANIFEST))
    delete_dir(v.path)
    if files:
        delete_dir(files)
    return [files] if files else []


def abandoned_run_files(storage: Storage, name: str, before_gen: int) -> list[str]:
    """Run directories under `data/` that no committed version references and that writers holding
    an older lease generation left (crashed or killed before commit)."""
    referenced = {v.manifest.files for v in history(storage, name)}
    out = []
    for tag, d in list_dir(join(storage.dataset(name), "data")):
        m = re.match(r"^g(\d{8})-", tag)
        if d and m and int(m.group(1)) < before_gen and f"data/{tag}" not in referenced:
            out.append(storage.run_files(name, tag))
    return out


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
