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
import re
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from strata.data.integrity import Named
from strata.data.storage import (
    S3_ATTEMPTS,
    PathRefused,
    Storage,
    delta_options,
    filesystem,
    inside,
    join,
    list_dir,
    read_bytes,
)
from strata.errors import StrataError

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
    and those it carries on (strata/data/integrity.py: nothing else read back is trusted). Empty in versions made
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
        """A path the manifest or the log names, under the dataset's directory (strata.data.storage.inside: a
        path that would leave it is refused before anything reads, writes or deletes there)."""
        try:
            return inside(self.root, rel, f"{self.ref}: its manifest")
        except PathRefused as e:
            raise DatasetError(str(e)) from None

    def named(self, rel: str, legacy_ok: bool = False) -> Named:
        """A file this version's manifest names, with the SHA-256 its commit gives it (strata/data/integrity.py): read
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
