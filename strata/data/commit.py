"""Writing a dataset: a new table (`create_table`), a version's one Delta commit (`commit`: the manifest, the
files it adds, the digests of the files it names, the run's and slot's application transactions), a rewrite
that replaces shards (`commit_rewrite`, forget), and deletes: a version, a run's files, the runs a crashed
writer abandoned. Reading is strata/data/dataset.py's; every write here holds the dataset's lease.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import replace

from strata.data.dataset import (
    CHECKPOINT_INTERVAL,
    DOCUMENT_STATUSES,
    LOG_RETENTION,
    PARTITIONS,
    RUN_APP,
    SCHEMA_VERSION,
    SLOT_APP,
    SPLITS,
    DatasetError,
    DatasetVersion,
    Head,
    Manifest,
    Shard,
    TokenizerInfo,
    _head,
    _load,
    _parent_number,
    label,
    list_versions,
    open_table,
    retrying,
    table_schema,
    transient,
)
from strata.data.integrity import file_sha256
from strata.data.storage import (
    S3_ATTEMPTS,
    Storage,
    check_name,
    delete,
    delete_dir,
    delta_options,
    inside,
    join,
    list_dir,
)

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
    from strata.errors import log

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
    from strata.data.storage import list_files

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
        from strata.errors import log

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
    from strata.data.lease import Lease

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
