"""The versioned dataset contract between tier 1 (writes) and tier 2 (reads).

A dataset is a Delta Lake table (delta-rs) at `<root>/datasets/<name>`: parquet shards under
`data/<run>/` and one commit per version in `_delta_log/`. A version is the table as of its commit, a
snapshot (the parent's shards, referenced, never copied, plus what its run added), named `vNNNN` after
its Delta version number. It is readable by that number (time travel), by strata, by Ray Data
(`ray.data.read_delta`) and by any Delta reader (Spark, DuckDB, Polars, Trino) without strata.

A run writes its shards, then publishes them in one commit: a conditional create of the next log
entry, so exactly one writer gets a number and a version is visible whole or not at all (on S3 too:
delta-rs needs no lock table). The commit carries the version's manifest (document accounting, inputs,
run, dedup index) in its `strata` field, and application transactions that say which run directory,
and which scheduled slot, it committed. strata's other files (tails, dedup index, rejects, work units)
live under `_strata/<run>/`, which Delta's vacuum leaves alone. A crashed run leaves only files no
commit references, which the next writer holding the dataset's lease deletes.

One row is one packed training sequence: `seq_len + 1` token ids (inputs are row[:-1], targets
row[1:]) in a list column (Delta has no fixed-size list, nor unsigned integers); the partition columns
say its split and the version that added it. Table properties (`strata.*`) carry the tokenizer's
identity, seq_len and the token type.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from strata.integrity import Named, file_sha256
from strata.shell import StrataError
from strata.storage import (
    S3_ATTEMPTS,
    PathRefused,
    Storage,
    check_name,
    delete,
    delete_dir,
    delta_options,
    filesystem,
    inside,
    join,
    list_dir,
    read_bytes,
)

SCHEMA_VERSION = 3
TOKENS = "tokens"
SPLITS = ("train", "validation")
PARTITIONS = ["split", "version"]
LOG = "_delta_log"
CHECKPOINT_INTERVAL = 10
"""A log checkpoint every 10 commits: opening any version reads a checkpoint and at most 10 log entries."""
LOG_RETENTION = "interval 36500 days"
"""Delta's default (30 days) lets delta-rs delete old log entries at a checkpoint, and with them the
versions' manifests and time travel: here a version lasts until it is deleted."""
RUN_APP = "strata-run:"  # an application transaction per run directory: the version that committed it
SLOT_APP = "strata-slot:"  # and per scheduled slot (run id)
DTYPE_KEY = b"strata.dtype"  # a shard file's metadata: its ids' unsigned type
LEGACY_MANIFEST = "manifest.json"  # a version of the format before Delta Lake: vNNNN/manifest.json
LEGACY_VERSION_RE = re.compile(r"^v(\d{4,})$")


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
    """Rows in memory and in the work files: one fixed-size list of `seq_len + 1` token ids per row."""
    return pa.schema([pa.field(TOKENS, pa.list_(pa.type_for_alias(dtype), seq_len + 1), nullable=False)])


def delta_type(dtype: str) -> pa.DataType:
    """The token ids' type in the table: Delta has no unsigned integers, and the pad value (the largest
    of `dtype`) must fit."""
    return pa.int64() if dtype == "uint32" else pa.int32()


def shard_schema(dtype: str) -> pa.Schema:
    """A shard file's schema: a list of token ids per row (the partition columns are not in the files),
    and the ids' own type in its metadata (read_rows gives them back in it)."""
    return pa.schema([pa.field(TOKENS, pa.list_(pa.field("element", delta_type(dtype), nullable=False)),
                               nullable=False)], metadata={DTYPE_KEY: dtype.encode()})


def table_schema(dtype: str) -> pa.Schema:
    return shard_schema(dtype).remove_metadata().append(pa.field("split", pa.string())).append(pa.field("version", pa.int64()))


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
    bytes: int = 0
    """The file's size."""


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
    """This run's own files, relative to the dataset directory (`_strata/<tag>`; its shards are in
    `data/<tag>`)."""
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
    consumed: list | None = None
    """The dataset's index of consumed input files as of this version (pipelines/consumed.py): segments of
    sorted (path, size, mtime) files, relative to the dataset directory. None in versions made before it."""
    tails: str = ""
    """What this version's rows could not hold (each split's last tokens, shorter than a row), relative to
    the dataset directory: the next version packs them first, so no kept document is left out for good."""
    quality: dict = field(default_factory=dict)
    """With --quality-model: the model (`model`, `model_id`: a digest of its weights) and its score cache as of
    this version (`scores`: sorted parquet files of exact key, tokens, loss, bpb, relative to the dataset
    directory), which the next version under the same model reuses (pipelines/quality.py)."""
    lineage: dict = field(default_factory=dict)
    """Which documents each row this version added holds (pipelines/lineage.py): `file`, relative to the
    dataset directory, sorted by document key, and its figures (`documents`, `spans`, `bytes`). Empty in
    versions made before it."""
    forget: dict = field(default_factory=dict)
    """A version made by `forget` (pipelines/forget.py): why (`reason`), which documents (`doc_ids`), the rows
    it removed and the other documents packed in them (`co_packed`). Empty in every other version."""
    forgotten: dict = field(default_factory=dict)
    """Every takedown so far, carried on by each later version: `list`, the forget list (exact and record
    keys pass 1 drops), relative to the dataset directory, and `forgets`: per takedown its `version`,
    `reason`, the shard files it `removed` from the snapshot, and whether they were `purged`."""
    digests: dict = field(default_factory=dict)
    """SHA-256 of every file this manifest names that strata reads back, by its path in the dataset: its own
    and those it carries on (strata/integrity.py: nothing else read back is trusted). Empty in versions made
    before 2026-12-05."""
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        if not isinstance(d, dict):
            raise DatasetError(f"a manifest is a JSON object, not {type(d).__name__}")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise DatasetError(
                f"dataset {d.get('dataset')}@{d.get('version')} has schema version "
                f"{d.get('schema_version')}; this strata reads version {SCHEMA_VERSION}")
        d = dict(d)
        d.pop("shards", None)  # a manifest of the format before Delta Lake (strata migrate)
        where = f"dataset {d.get('dataset')}@{d.get('version')}"
        try:
            d["tokenizer"] = _typed(TokenizerInfo, d["tokenizer"])
            d["documents"] = _typed(DocumentCounts, d["documents"])
            return _typed(cls, d)
        except (KeyError, TypeError) as e:
            raise DatasetError(f"{where}: its manifest is not strata's ({e}); refused") from None


_TYPES = {"str": str, "int": int, "float": int | float, "dict": dict, "list[dict]": list, "list | None": list | None,
          "dict[str, int]": dict}


def _typed(cls, d):
    """`cls(**d)` once every field whose annotation is a plain type holds that type (TypeError naming the
    field otherwise): a manifest is data read back from storage."""
    from dataclasses import fields

    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__} is {type(d).__name__}, not an object")
    for f in fields(cls):
        t = _TYPES.get(f.type) if isinstance(f.type, str) else None
        if f.name in d and t is not None and (isinstance(d[f.name], bool) or not isinstance(d[f.name], t)):
            raise TypeError(f"{f.name} is {type(d[f.name]).__name__}, not {f.type}")
    if isinstance(d.get("version"), str) and not re.fullmatch(r"v\d{4,}", d["version"]):
        raise TypeError(f"version {d['version']!r} is not vNNNN")
    return cls(**d)


@dataclass(frozen=True)
class DatasetVersion:
    """A committed version: the dataset's directory (the Delta table), its manifest, and the shards its
    run added; `shards`, the whole snapshot's, is read from the table when first asked for."""

    path: str
    manifest: Manifest
    added: tuple[Shard, ...] = ()
    table: object = field(default=None, compare=False, repr=False)
    """The DeltaTable as of this version, when the reader already opened it."""

    @property
    def ref(self) -> str:
        return f"{self.manifest.dataset}@{self.manifest.version}"

    @property
    def number(self) -> int:
        """The Delta version."""
        return int(self.manifest.version[1:])

    @property
    def root(self) -> str:
        """The dataset directory, which every path in the manifest is relative to."""
        return self.path

    @cached_property
    def shards(self) -> list[Shard]:
        """Every shard of the snapshot, in the order of the versions that added them, then by name."""
        table = pa.table(retrying((self.table or open_table(self.path, self.number)).get_add_actions, flatten=True))
        row_len = self.manifest.seq_len + 1
        shards = []
        for path, size, rows, split, version in zip(*(table.column(c).to_pylist() for c in (
                "path", "size_bytes", "num_records", "partition.split", "partition.version")), strict=True):
            if rows is None:  # a file a foreign writer added without statistics
                rows = _footer_rows(self.file(path))
            shards.append(Shard(path=path, split=split, rows=rows, tokens=rows * row_len,
                                version=f"v{int(version):04d}", bytes=size))
        return sorted(shards, key=lambda s: (int(s.version[1:]), s.path))

    def rows(self, split: str) -> int:
        return sum(s.rows for s in self.shards if s.split == split)

    def file(self, rel: str) -> str:
        """A path the manifest or the log names, under the dataset's directory (strata.storage.inside: a
        path that would leave it is refused before anything reads, writes or deletes there)."""
        try:
            return inside(self.root, rel, f"{self.ref}: its manifest")
        except PathRefused as e:
            raise DatasetError(str(e)) from None

    def named(self, rel: str, legacy_ok: bool = False) -> Named:
        """A file this version's manifest names, with the SHA-256 its commit gives it (strata/integrity.py): read
        it only through `Named`. `legacy_ok` reads the file of a version made before digests (with a warning)
        instead of refusing it; a version with digests that names none for `rel` is refused either way."""
        if not isinstance(self.manifest.digests, dict) or not all(isinstance(v, str) for v in self.manifest.digests.values()):
            raise DatasetError(f"{self.ref}: its manifest's digests are not a map of paths to SHA-256s; refused")
        return Named(self.file(rel), self.manifest.digests.get(rel), f"{self.ref}: {rel}",
                     legacy_ok and not self.manifest.digests)

    def shard_paths(self, split: str) -> list[str]:
        return [self.file(s.path) for s in self.shards if s.split == split]

    def tokenizer_definition(self) -> str | None:
        """The tokenizer file's text, for tokenizers that have one."""
        if not self.manifest.tokenizer.file:
            return None
        return self.named(self.manifest.tokenizer.file, legacy_ok=True).read().decode()


def _footer_rows(path: str) -> int:
    fs, p = filesystem(path)
    return pq.ParquetFile(fs.open_input_file(p)).metadata.num_rows


_GROUPS: OrderedDict[str, tuple[int, np.ndarray]] = OrderedDict()  # the last row groups read, per shard (2)
_GROUPS_LOCK = threading.Lock()  # read-ahead threads and the loop read at once


def read_rows(path: str, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows [start, stop) of a shard (all by default) as one (n, seq_len + 1) array of token ids; a range
    reads only the row groups that hold it, and the next range inside the same groups reads nothing (a
    shard written as one row group, as before 2026-12-02, is then decoded once, not once per range)."""
    fs, p = filesystem(path)
    if start == 0 and stop is None:
        table = pq.read_table(p, filesystem=fs, columns=[TOKENS])
        return _ids(table.column(TOKENS).combine_chunks(), table.schema)
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
    rows, first = _ids(f.read_row_groups(groups, columns=[TOKENS]).column(TOKENS).combine_chunks(), f.schema_arrow), first or 0
    with _GROUPS_LOCK:
        _GROUPS[path] = (first, rows)
        _GROUPS.move_to_end(path)
        while len(_GROUPS) > 2:
            _GROUPS.popitem(last=False)
    return rows[start - first: stop - first]


def _ids(col: pa.Array, schema: pa.Schema) -> np.ndarray:
    """A tokens column as an (n, seq_len + 1) array of the dataset's unsigned type (the file's metadata
    names it: Delta stores them signed); its pad value (the type's largest) is what training masks."""
    rows = col.flatten().to_numpy().reshape(len(col), -1)
    dtype = (schema.metadata or {}).get(DTYPE_KEY)
    return rows.astype(dtype.decode()) if dtype and rows.dtype.kind == "i" else rows


# ---- the table ---------------------------------------------------------------------------------

def transient(e: BaseException) -> bool:
    """An I/O error of delta-rs (a connection reset, a timeout): an OSError, or its generic DeltaError
    that says the object store failed (a lost race, a missing table or a bad schema are not)."""
    return isinstance(e, OSError) or (type(e).__name__ == "DeltaError" and "object store" in str(e))


def retrying(fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, again after a transient I/O error, S3_ATTEMPTS times in all with backoff:
    delta-rs gives up on the first reset (measured through the resetting proxy, tests/test_faults.py),
    where pyarrow's S3 client retries."""
    for attempt in range(S3_ATTEMPTS):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if attempt == S3_ATTEMPTS - 1 or not transient(e):
                raise
            time.sleep(min(2.0, 0.05 * 2**attempt))
    raise AssertionError("unreachable")


def open_table(path: str, version: int | None = None):
    """The Delta table at `path` (as of `version`), or None when there is none."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        return retrying(DeltaTable, path, version=version, storage_options=delta_options(path))
    except TableNotFoundError:
        return None
    except Exception as e:
        if transient(e) or type(e).__name__ not in ("DeltaError", "DeltaProtocolError", "SchemaMismatchError"):
            raise
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DatasetError(f"the Delta table at {path} does not read: {said}; its log was damaged or written by "
                           "something else") from None


def _entry(path: str, number: int) -> tuple[dict, list[dict]]:
    """Commit `number`'s commit info and the files it added: one read of its log entry."""
    info, adds, where = {}, [], join(path, LOG, f"{number:020d}.json")
    for line in read_bytes(where).splitlines():
        if line.strip():
            try:
                action = json.loads(line)
                info = action.get("commitInfo", info)
                if "add" in action:
                    add = action["add"]
                    if not (isinstance(add["path"], str) and isinstance(add["size"], int)
                            and isinstance(add["partitionValues"]["split"], str)):
                        raise TypeError
                    adds.append(add)
            except (ValueError, KeyError, TypeError, AttributeError):
                raise DatasetError(f"{where}: a line that is not a Delta action strata can read; refused") from None
    return info, adds


def _strata(info: dict) -> dict | None:
    """What strata wrote in a commit: {"manifest", "deleted"} for a version, {"delete", "live",
    "deleted"} for a deletion; None for another writer's commit (say an OPTIMIZE)."""
    value = info.get("strata")
    try:
        value = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        raise DatasetError("a Delta commit's strata field is not JSON: the log was changed by hand; refused") from None
    return value if value is None or isinstance(value, dict) else {}


@dataclass(frozen=True)
class Head:
    """A dataset's newest state, read once: a writer holding the lease reuses it until its commit."""

    table: object  # the newest DeltaTable, None when the dataset has none
    live: int | None  # the newest version (None: none, or every one deleted)
    deleted: tuple[str, ...]  # versions deleted so far
    entry: tuple | None = None  # the live version's log entry, when that is what was read


def head(storage: Storage, name: str) -> Head:
    return _head(storage.dataset(name), name)


def _head(path: str, name: str) -> Head:
    """The table's newest state: its newest strata commit, one log entry read (more only past other
    writers' commits)."""
    table = open_table(path)
    if table is None:
        _refuse_legacy(path, name)
        return Head(None, None, ())
    for number in range(table.version(), 0, -1):
        entry = _entry(path, number)
        if (st := _strata(entry[0])) is not None:
            if "delete" in st:
                return Head(table, st["live"], tuple(st["deleted"]))
            return Head(table, number, tuple(st.get("deleted", ())), entry)
    return Head(table, None, ())


def _refuse_legacy(path: str, name: str) -> None:
    if any(d and LEGACY_VERSION_RE.match(n) for n, d in list_dir(path)):
        raise DatasetError(f"dataset {name!r} ({path}) is in strata's format before Delta Lake (a manifest per "
                           f"version): convert it with `python -m strata migrate {name}`")


def _load(path: str, number: int, name: str, head: Head | None = None) -> DatasetVersion:
    info, adds = head.entry if head and head.entry and head.live == number else _entry(path, number)
    st = _strata(info)
    if not st or "manifest" not in st:
        raise DatasetError(f"dataset {name!r}: Delta version {number} is not a strata version")
    manifest = Manifest.from_dict(st["manifest"])
    if manifest.version != label(number) or manifest.dataset != name:
        raise DatasetError(f"dataset {name!r}: Delta version {number}'s manifest says it is "
                           f"{manifest.dataset}@{manifest.version}: corrupt or copied from elsewhere; refused")
    row_len = manifest.seq_len + 1
    added = tuple(sorted((Shard(path=a["path"], split=a["partitionValues"]["split"], version=manifest.version,
                                rows=(rows := json.loads(a.get("stats") or "{}").get("numRecords", 0)),
                                tokens=rows * row_len, bytes=a["size"]) for a in adds), key=lambda s: s.path))
    table = head.table if head and head.table.version() == number else None  # no second opening of the table
    return DatasetVersion(path, manifest, added, table)


def label(number: int) -> str:
    return f"v{number:04d}"


def resolve(storage: Storage, ref: str) -> DatasetVersion:
    """`NAME` (the newest snapshot) or `NAME@VERSION` (`v0003`, or `3`) to a committed version."""
    name, _, version = ref.partition("@")
    path = storage.dataset(name)
    head = _head(path, name)
    if head.live is None:
        others = sorted(n for n, d in list_dir(storage.datasets()) if d and n != name)
        there = (f"datasets there: {', '.join(others[:20])}{', ...' if len(others) > 20 else ''}" if others
                 else "there are none yet: make one with python -m pipelines.preprocess")
        raise DatasetError(f"dataset {name!r} has no committed version under {storage.datasets()}; {there}")
    if not version:
        return _load(path, head.live, name, head)
    m = re.fullmatch(r"v?(\d+)", version)
    number = int(m.group(1)) if m else -1
    if 1 <= number <= head.table.version() and label(number) not in head.deleted:
        try:
            v = _load(path, number, name, head)
        except DatasetError:
            pass  # a deletion's commit, or another writer's
        else:
            _check_purged(_load(path, head.live, name, head), v)
            return v
    raise DatasetError(f"dataset {name!r} has no version {version!r}; committed: "
                       f"{', '.join(list_versions(storage, name))}")


def _check_purged(newest: DatasetVersion, v: DatasetVersion) -> None:
    """An earlier version some of whose shards a takedown's --purge deleted cannot be read: say so."""
    purged = [f for f in forgotten_since(newest, v) if f.get("purged")]
    if purged:
        f = purged[-1]
        raise DatasetError(f"{v.ref} cannot be read: `forget --purge` at {v.manifest.dataset}@{f['version']} deleted "
                           f"{len(f.get('removed') or [])} of its shard files (reason: {f.get('reason')}); "
                           f"{v.manifest.dataset}@{f['version']} and later versions hold the rest")


def history(storage: Storage, name: str) -> list[DatasetVersion]:
    """Every committed version of `name`, oldest first (one log entry read per version: each names its
    parent). Without the snapshots' shard lists (`shards` reads one when asked)."""
    path = storage.dataset(name)
    head = _head(path, name)
    out, number = [], head.live
    while number is not None:
        out.append(v := _load(path, number, name, head))
        number = _parent_number(v, name, head.table.version())
    return out[::-1]


def _parent_number(v: DatasetVersion, name: str, newest: int) -> int | None:
    """The Delta version `v` extends. A parent is always an earlier commit, so a chain that loops or runs
    past the table's versions (a crafted or corrupt manifest) is an error naming both, not an endless walk."""
    parent = v.manifest.parent
    if not parent:
        return None
    m = re.fullmatch(r"v(\d+)", parent) if isinstance(parent, str) else None
    number = int(m.group(1)) if m else -1
    if not 1 <= number < v.number or number > newest:
        raise DatasetError(f"dataset {name!r}: version {v.manifest.version} names {parent!r} as its parent, which "
                           f"is not an earlier version of the table (1..{min(v.number - 1, newest)}): its manifest is "
                           "corrupt; refused")
    return number


def list_versions(storage: Storage, name: str) -> list[str]:
    """Committed versions of `name`, oldest first."""
    return [v.manifest.version for v in history(storage, name)]


def version_at(storage: Storage, name: str, number: int) -> DatasetVersion:
    """Version `number` of dataset `name` as it was committed, a purge since notwithstanding: for a writer
    that rewrites its files (`forget`), not for readers (`resolve` says why a purged version cannot be read)."""
    return _load(storage.dataset(name), number, name)


def latest(storage: Storage, name: str, head: Head | None = None) -> DatasetVersion | None:
    path = storage.dataset(name)
    head = head or _head(path, name)
    return _load(path, head.live, name, head) if head.live is not None else None


def slot_version(storage: Storage, name: str, run_id: str, head: Head | None = None) -> DatasetVersion | None:
    """The version a scheduled slot (run id) committed, if it is still there: Delta's application
    transaction, read from the table's state (no history read)."""
    path = storage.dataset(name)
    head = head or _head(path, name)
    number = retrying(head.table.transaction_version, SLOT_APP + run_id) if head.table else None
    if number is None or label(number) in head.deleted:
        return None
    return _load(path, number, name)


FAILPOINT = "STRATA_FAILPOINT"  # the process kills itself where `failpoint` names it (crash tests)


def failpoint(name: str) -> None:
    """With $STRATA_FAILPOINT equal to `name` (say `before-commit`, or `pass1:3`: the third unit of pass
    1 recorded), the process kills itself here, as a crash or a kill -9 would."""
    if os.environ.get(FAILPOINT) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def properties(tokenizer: TokenizerInfo, seq_len: int, dtype: str) -> dict[str, str]:
    """The table's properties: Delta's log settings, and what every version must share."""
    return {**SAFETY, "strata.schemaVersion": str(SCHEMA_VERSION), "strata.tokenizer.kind": tokenizer.kind,
            "strata.tokenizer.vocabSize": str(tokenizer.vocab_size), "strata.tokenizer.eotId": str(tokenizer.eot_id),
            "strata.tokenizer.hash": tokenizer.hash, "strata.seqLen": str(seq_len), "strata.dtype": dtype}


def create_table(path: str, name: str, tokenizer: TokenizerInfo, seq_len: int, dtype: str):
    """The table, created (version 0: schema and properties, no rows) unless another writer just did."""
    from deltalake import CommitProperties, DeltaTable

    try:
        # No commit retries: a creator that lost the race would otherwise add its own metadata commit.
        return retrying(DeltaTable.create, path, table_schema(dtype), mode="error", partition_by=PARTITIONS, name=name,
                        configuration=properties(tokenizer, seq_len, dtype), storage_options=delta_options(path),
                        raise_if_key_not_exists=False, commit_properties=CommitProperties(max_commit_retries=0))
    except Exception:
        if (table := open_table(path)) is None:
            raise
        return table  # another writer created it first


SAFETY = {"delta.checkpointInterval": str(CHECKPOINT_INTERVAL), "delta.logRetentionDuration": LOG_RETENTION,
          "delta.enableExpiredLogCleanup": "false"}
"""The log settings strata relies on: every version's manifest is in its log entry, so no entry may expire."""


def _no_cleanup():
    """Post-commit hooks that may write a log checkpoint but never delete an old log entry, whatever the
    table's properties say (another writer may have changed them)."""
    from deltalake import PostCommitHookProperties

    return PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=False)


def _keep_safe(table, name: str, conf: dict) -> None:
    """Restore the log settings another writer changed (one commit of its own, itself deleting nothing),
    saying so in one line, before strata commits on top of them."""
    changed = {k: v for k, v in SAFETY.items() if conf.get(k) != v and not (k == "delta.enableExpiredLogCleanup"
                                                                             and k not in conf)}
    if not changed:
        return
    from strata.shell import log

    log("dataset").warning(f"dataset {name!r}: another writer changed " + ", ".join(
        f"{k} to {conf.get(k)!r}" for k in changed) + "; restored before this commit (strata keeps every log entry)")
    retrying(table.alter.set_table_properties, SAFETY, raise_if_not_exists=False,
             post_commithook_properties=_no_cleanup())


def _check_table(table, name: str, tokenizer: TokenizerInfo, seq_len: int, dtype: str) -> None:
    """Every version shares the table's token ids, row length and type (its properties say which), and the
    log settings strata relies on hold (restored if another writer changed them)."""
    conf = retrying(table.metadata).configuration
    mine = properties(tokenizer, seq_len, dtype)
    keys = ("strata.tokenizer.hash", "strata.seqLen", "strata.dtype")
    if "strata.schemaVersion" not in conf:
        raise DatasetError(f"{name!r} is a Delta table strata did not make (no strata.* properties): refused")
    if any(conf.get(k) != mine[k] for k in keys):
        raise DatasetError(f"dataset {name!r} is a table of tokenizer {conf.get('strata.tokenizer.kind')} "
                           f"{conf.get('strata.tokenizer.hash')}, seq_len {conf.get('strata.seqLen')} and "
                           f"{conf.get('strata.dtype')} ids; this run's are {tokenizer.kind} {tokenizer.hash}, "
                           f"{seq_len} and {dtype}: use the same tokenizer and seq_len, or another dataset name")
    _keep_safe(table, name, conf)


def commit(storage: Storage, name: str, tag: str, manifest_fields: dict, *, lease=None,
           built_on: str | None = None, head: Head | None = None) -> DatasetVersion:
    """Publish this run's shards as the next version, in one Delta commit.

    `tag` names the run's directories: its shards in `data/<tag>` and its own files in `_strata/<tag>`.
    `manifest_fields` are the Manifest fields except `dataset`, `version`, `created_at`, `parent`,
    `totals` and `files`, plus `shards`: Shard records with paths relative to `data/<tag>` (and their
    sizes); the tokenizer, rejects, tails, audit and removed paths are relative to `_strata/<tag>`.
    The commit is built on the newest version at the moment of commit; a writer that loses the race for
    a number builds again on the winner and takes the next. With a `lease`, a writer that lost it commits
    nothing. `built_on` is the version the run built on (deduplicated against): if it was deleted
    meanwhile, the run's idea of what is new is wrong, and it commits nothing. `head`, the table as the
    run read it (under the lease), saves reading it again: if anything committed since, the commit
    fails as a lost race does, and is built again on a fresh read.
    """
    from deltalake.exceptions import CommitFailedError

    path, rel = storage.dataset(name), f"_strata/{tag}"
    fields = dict(manifest_fields)
    reported = fields.pop("digests", {})  # what the run hashed as it wrote (paths in the dataset)
    new = [replace(s, path=f"data/{tag}/{s.path}") for s in fields.pop("shards")]
    if (tok := fields["tokenizer"]).file:
        fields["tokenizer"] = replace(tok, file=f"{rel}/{tok.file}")
    for key in ("rejects", "tails"):
        if fields.get(key):
            fields[key] = f"{rel}/{fields[key]}"
    for key in ("audit", "removed"):
        if fields.get("dedup", {}).get(key):
            fields["dedup"] = {**fields["dedup"], key: f"{rel}/{fields['dedup'][key]}"}
    if fields.get("lineage", {}).get("file"):
        fields["lineage"] = {**fields["lineage"], "file": f"{rel}/{fields['lineage']['file']}"}
    if fields.get("dedup", {}).get("files"):
        fields["dedup"] = {**fields["dedup"], "files": {t: [f"{rel}/{p}" for p in ps]
                                                       for t, ps in fields["dedup"]["files"].items()}}
    failpoint("before-commit")
    failures = 0
    for attempt in range(1000):
        head = head if attempt == 0 and head is not None else _head(path, name)
        if built_on and (built_on in head.deleted or head.table is None):
            raise DatasetError(f"{name}@{built_on}, the version this run deduplicated against, was deleted while it "
                               "ran: nothing was committed (what it dropped as duplicates of that version would be "
                               "lost). Run it again")
        parent = _load(path, head.live, name, head) if head.live is not None else None
        if parent:
            check_extends(parent, fields["tokenizer"], fields["seq_len"])
        table = head.table or create_table(path, name, fields["tokenizer"], fields["seq_len"], fields["dtype"])
        _check_table(table, name, fields["tokenizer"], fields["seq_len"], fields["dtype"])
        number = table.version() + 1
        manifest = Manifest(dataset=name, version=label(number), created_at=time.time(), files=rel,
                            parent=parent.manifest.version if parent else "",
                            totals=_totals(parent, new, fields), **_named(fields, label(number)))
        manifest = replace(manifest, digests=digests_of(path, manifest, reported, parent))
        if lease is not None:
            lease.check()
        done = DatasetVersion(path, manifest, tuple(replace(s, version=manifest.version) for s in new))
        try:
            write_commit(table, manifest.dtype, add_actions(new, number),
                         {"manifest": manifest.to_dict(), "deleted": list(head.deleted)},
                         app_transactions(tag, manifest.run_id, number))
        except Exception as e:
            if not (isinstance(e, CommitFailedError) or transient(e)):
                raise
            now = open_table(path)
            if retrying(now.transaction_version, RUN_APP + tag) == number:
                return done  # it was committed; the answer was lost (a connection reset)
            if now.version() < number and not transient(e):
                raise  # not a lost race: nothing else committed
            failures += transient(e)
            if failures >= S3_ATTEMPTS:
                raise
            continue  # another writer took the number, or the write failed: build again
        return done
    raise DatasetError(f"could not commit a version of dataset {name!r}: 1000 writers won the race first")


def commit_rewrite(storage: Storage, name: str, tag: str, manifest_fields: dict, *, removed: list[Shard],
                   added: list[Shard], lease, head: Head) -> DatasetVersion:
    """One Delta commit that takes `removed` shard files out of the newest snapshot and puts `added` in (paths
    relative to the dataset directory; the added ones in `data/<tag>`), as the next version, under `lease`.
    `manifest_fields` are the Manifest's fields but `dataset`, `version`, `created_at`, `parent` and `files`.
    Nothing else commits under the lease: a lost race is an error, not a retry."""
    from deltalake.transaction import RemoveAction

    path = storage.dataset(name)
    parent = _load(path, head.live, name, head)
    number = head.table.version() + 1
    fields = dict(manifest_fields)
    reported = fields.pop("digests", {})
    manifest = Manifest(dataset=name, version=label(number), created_at=time.time(), files=f"_strata/{tag}",
                        parent=parent.manifest.version, **fields)
    manifest = replace(manifest, digests=digests_of(path, manifest, reported, parent))
    now_ms = int(time.time() * 1000)
    actions = [RemoveAction(s.path, True, now_ms, s.bytes, {"split": s.split, "version": str(int(s.version[1:]))})
               for s in removed] + add_actions(added, number)
    done = DatasetVersion(path, manifest, tuple(replace(s, version=manifest.version) for s in added))
    failpoint("before-commit")
    for attempt in range(S3_ATTEMPTS):
        lease.check()
        try:
            write_commit(head.table, manifest.dtype, actions, {"manifest": manifest.to_dict(),
                                                              "deleted": list(head.deleted)},
                         app_transactions(tag, "", number))
            return done
        except Exception as e:
            if retrying(open_table(path).transaction_version, RUN_APP + tag) == number:
                return done  # it was committed; the answer was lost
            if not transient(e) or attempt == S3_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def named_files(m: Manifest, root: str) -> list[str]:
    """Every file manifest `m` names that strata reads back, by its path in the dataset at `root`: the tokenizer,
    rejects report, tails, dedup audit, removed lists (each file of the directory), dedup index segments
    (`files` in versions made before the index), consumed index, quality cache, lineage and forget list."""
    from strata.storage import list_files

    out = [m.tokenizer.file, m.rejects, m.tails, m.dedup.get("audit"), m.lineage.get("file"), m.forgotten.get("list")]
    if removed := m.dedup.get("removed"):
        out += [f"{removed}/{f}" for f in list_files(inside(root, removed, f"{m.dataset}@{m.version}: removed"))]
    for segs in (m.dedup.get("index") or {}).values():
        out += [f["path"] for seg in segs for f in seg["files"]]
    for files in (m.dedup.get("files") or {}).values():
        out += list(files)
    out += [f["path"] for seg in (m.consumed or []) for f in seg["files"]]
    out += list(m.quality.get("scores") or [])
    return sorted({p for p in out if isinstance(p, str) and p})


def digests_of(root: str, m: Manifest, reported: dict[str, str], parent: DatasetVersion | None) -> dict[str, str]:
    """The `digests` of manifest `m`: for each file it names, the SHA-256 its writer reported, or the one its
    parent's commit names (a file carried on), or, for a file this run wrote without reporting one, its hash
    now. A file carried on from a parent made before digests is hashed now too: trusted as it is, said once."""
    out, adopted = {}, []
    known = parent.manifest.digests if parent is not None else {}
    for rel in named_files(m, root):
        if rel in reported:
            out[rel] = reported[rel]
        elif rel in known:
            out[rel] = known[rel]
        else:
            out[rel] = file_sha256(inside(root, rel, f"{m.dataset}@{m.version}"))
            if not rel.startswith(f"{m.files}/"):
                adopted.append(rel)
    if adopted:
        from strata.shell import log

        log("dataset").warning(f"dataset {m.dataset}: {len(adopted)} file(s) carried on from {parent.ref if parent else ''} "
                               f"(made before file digests) are named by {m.version}'s commit as they are now")
    return out


THIS_VERSION = "@this"  # what a run calls the version it is making, in its dedup index, until the commit


def _named(fields: dict, version: str) -> dict:
    """The manifest fields with the dedup index's segments of this run (`first`/`last` THIS_VERSION) naming
    the version the commit makes: the run learns its number only here."""
    index = fields.get("dedup", {}).get("index")
    if not isinstance(index, dict):
        return fields
    named = {t: [{**seg, **{k: version for k in ("first", "last") if seg.get(k) == THIS_VERSION}} for seg in segs]
             for t, segs in index.items()}
    return {**fields, "dedup": {**fields["dedup"], "index": named}}


def add_actions(shards: list[Shard], number: int) -> list:
    """Delta add actions for the shards version `number` adds (their row counts as statistics)."""
    from deltalake.transaction import AddAction

    now_ms = int(time.time() * 1000)
    return [AddAction(s.path, s.bytes, {"split": s.split, "version": str(number)}, now_ms, True,
                      json.dumps({"numRecords": s.rows})) for s in shards]


def app_transactions(tag: str, run_id: str, number: int) -> list:
    """The application transactions of version `number`: its run directory's, and its slot's."""
    from deltalake import Transaction

    return [Transaction(RUN_APP + tag, number)] + ([Transaction(SLOT_APP + run_id, number)] if run_id else [])


def write_commit(table, dtype: str, actions: list, meta: dict, apps: list | None = None) -> None:
    """One Delta commit of `actions` with strata's `meta`, at the version after `table`'s (no retry: a
    writer that lost the race sees CommitFailedError and builds its commit again)."""
    from deltalake import CommitProperties

    table.create_write_transaction(actions, "append", table_schema(dtype), partition_by=PARTITIONS,
                                   commit_properties=CommitProperties(
                                       custom_metadata={"strata": json.dumps(meta, sort_keys=True)},
                                       app_transactions=apps or None, max_commit_retries=0),
                                   post_commithook_properties=_no_cleanup())


def _totals(parent: DatasetVersion | None, new: list[Shard], fields: dict) -> dict:
    """The snapshot's totals: the parent's, plus this version's."""
    before = parent.manifest.totals if parent else {}
    docs = fields["documents"]
    return {
        "versions": before.get("versions", 0) + 1,
        "inputs": before.get("inputs", 0) + len(fields["inputs"]),
        "documents": {k: before.get("documents", {}).get(k, 0) + getattr(docs, k) for k in DOCUMENT_STATUSES},
        "tokens": before.get("tokens", 0) + fields["tokens"],
        "rows": {split: before.get("rows", {}).get(split, 0) + sum(s.rows for s in new if s.split == split)
                 for split in SPLITS},
        "packed_tokens": before.get("packed_tokens", 0) + sum(s.tokens for s in new),
        "shards": before.get("shards", 0) + len(new),
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

    A Delta commit removes the files its run added (the version disappears at once, and the table is
    its parent's snapshot again); then those files, and the run's own, are deleted. It holds the
    dataset's lease while it does, so it never pulls a version from under a run that deduplicates
    against it (a run in progress makes it refuse, LeaseBusy). Returns the deleted run directories."""
    from strata.lease import Lease

    with Lease(storage.dataset(name), f"dataset {name}", purpose=f"delete {version}").acquire(wait=False):
        return _delete_leased(storage, name, version)


def _delete_leased(storage: Storage, name: str, version: str) -> list[str]:
    from deltalake.transaction import RemoveAction

    path = storage.dataset(name)
    versions = list_versions(storage, name)
    if version not in versions:
        raise DatasetError(f"dataset {name!r} has no version {version!r}")
    if version != versions[-1]:
        raise DatasetError(f"{name}@{version} is part of the later snapshots {', '.join(versions[versions.index(version) + 1:])}; "
                           f"only the newest version ({versions[-1]}) can be deleted")
    head = _head(path, name)
    v = _load(path, head.live, name)
    if v.manifest.forget:
        raise DatasetError(f"{name}@{version} is a takedown (`forget`: {v.manifest.forget.get('reason')}): deleting it "
                           "would bring the documents it removed back; refused")
    tag, doomed = _own_files(v, head)  # every path checked before anything is deleted
    _keep_safe(head.table, name, retrying(head.table.metadata).configuration)
    now_ms = int(time.time() * 1000)
    removes = [RemoveAction(s.path, True, now_ms, s.bytes, {"split": s.split, "version": str(v.number)})
               for s in v.added]
    write_commit(head.table, v.manifest.dtype, removes,
                 {"delete": version, "live": _parent_number(v, name, head.table.version()),
                  "deleted": [*head.deleted, version]})
    for f in doomed:
        delete(f)
    delete_dir(storage.run_files(name, tag))  # the run's own files: a directory strata names, not the log
    return [storage.run_shards(name, tag), storage.run_files(name, tag)]


def _own_files(v: DatasetVersion, head: Head) -> tuple[str, list[str]]:
    """What deleting `v` may remove: the run tag its commit's application transaction names, and the
    files the version added, each `data/<tag>/<file>` exactly. A log entry or manifest that names
    anything else (`..`, another run's directory, the log) is refused, naming the path, before anything
    is deleted: no directory named by metadata is ever removed."""
    files = v.manifest.files
    tag = files[len("_strata/"):] if isinstance(files, str) and files.startswith("_strata/") else ""
    try:
        check_name(tag, "run tag")
    except ValueError:
        raise DatasetError(f"{v.ref}: its manifest names {files!r} as its run's files, not _strata/<run>: refused "
                           "to delete anything") from None
    if retrying(head.table.transaction_version, RUN_APP + tag) != v.number:
        raise DatasetError(f"{v.ref}: the log does not say this version committed run {tag!r}: refused to delete "
                           "anything")
    doomed = []
    for s in v.added:
        parts = s.path.split("/") if isinstance(s.path, str) else []
        if len(parts) != 3 or parts[:2] != ["data", tag]:
            raise DatasetError(f"{v.ref}: the version adds {s.path!r}, which is not a file of its own run directory "
                               f"data/{tag}/: refused to delete anything")
        doomed.append(v.file(s.path))
    v.file(f"_strata/{tag}")  # the run's own directory, not a link out of the dataset
    return tag, doomed

def abandoned_runs(storage: Storage, name: str, before_gen: int, head: Head | None = None) -> list[str]:
    """Run tags (`g<gen>-<work>`) with files under `data/` or `_strata/` that no version committed (or
    whose version was deleted), left by writers of an older lease generation (crashed or killed before
    their commit). A run deletes such leftovers before it commits, so only tags from the newest
    version's run's generation on can be one: for each of those (other than that run's own) the
    table's application transactions say. Neither the history nor the snapshot's files are read: the
    cost is the two listings (a request per 1,000 runs)."""
    path = storage.dataset(name)
    head = head or _head(path, name)
    newest = _load(path, head.live, name, head).manifest.files.rpartition("/")[2] if head.live is not None else ""
    since = int(m.group(1)) if (m := re.match(r"^g(\d{8,})-", newest)) else 0
    out = set()
    for sub in ("data", "_strata"):
        for tag, d in list_dir(join(path, sub)):
            m = re.match(r"^g(\d{8,})-", tag)
            if d and m and since <= int(m.group(1)) < before_gen and tag != newest and tag not in out:
                number = retrying(head.table.transaction_version, RUN_APP + tag) if head.table else None
                if number is None or label(number) in head.deleted:
                    out.add(tag)
    return sorted(out)


def delete_run(storage: Storage, name: str, tag: str) -> None:
    """Delete what a run wrote: its shards and its own files."""
    delete_dir(storage.run_shards(name, tag))
    delete_dir(storage.run_files(name, tag))


def forgotten_since(newest: DatasetVersion, version: DatasetVersion) -> list[dict]:
    """The takedowns after `version` (per `newest`'s record of them) that removed shards its snapshot
    holds: it still has rows of the documents they forgot."""
    forgets = newest.manifest.forgotten.get("forgets")
    after = [f for f in forgets if isinstance(f, dict) and isinstance(f.get("removed"), list)
             and re.fullmatch(r"v\d+", str(f.get("version"))) and int(f["version"][1:]) > version.number] \
        if isinstance(forgets, list) else []  # read back from storage: anything else is no takedown record
    if not after:
        return []
    mine = {s.path for s in version.shards}
    return [f for f in after if mine & {p for p in f["removed"] if isinstance(p, str)}]


def check_not_forgotten(storage: Storage, version: DatasetVersion, what: str = "train on") -> None:
    """Refuse, in one line, to `what` a snapshot holding rows of documents a later takedown forgot."""
    newest = latest(storage, version.manifest.dataset)
    if newest is None or newest.manifest.version == version.manifest.version:
        return
    if hits := forgotten_since(newest, version):
        f = hits[-1]
        raise DatasetError(f"{version.ref} holds rows of documents forgotten at {version.manifest.dataset}@"
                           f"{f['version']} (reason: {f.get('reason')}): refusing to {what} it; use "
                           f"{version.manifest.dataset}@{f['version']} or later")


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
