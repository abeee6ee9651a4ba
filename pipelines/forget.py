"""Takedown: `python -m pipelines.datasets forget NAME (--doc-ids FILE | --source GLOB) --reason TEXT [--purge]`.

Under the dataset's lease, in one Delta commit that makes the next version:

- The documents are found by lineage (pipelines/lineage.py) in the newest snapshot. Each shard holding one of
  their rows is rewritten without those rows; the other rows keep their order, and no other shard is
  touched. A row is fixed-length training data, so a row holding a forgotten document goes whole: the other
  documents packed in it lose those tokens (their other rows stay). The commit lists them (`co_packed`), with
  the tokens each lost; they are not forgotten, and they are not packed again.
- The tails the next version would pack first lose the forgotten documents' tokens too.
- The forget list, which pass 1 of every later run checks, gains the documents' record keys and exact keys
  (the same text, case and spacing aside): a new copy of the same file, under any name, is never ingested.
- The commit records the reason and the ids (the manifest's `forget`), and every later version carries the
  takedown on (`forgotten`): training refuses, in one line, a snapshot that still holds the rows.

Earlier versions keep their files for time travel; `--purge`, after the commit, deletes every earlier file
holding the documents' tokens (shards and tails) and scrubs their text samples from the rejects reports,
and those versions then say so when opened. A crash before the commit leaves only files of an uncommitted
run directory, which the next writer deletes.
"""

from __future__ import annotations

import fnmatch
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from strata.dataset import (
    DatasetError,
    DocumentCounts,
    Shard,
    abandoned_runs,
    commit_rewrite,
    delete_run,
    head,
    latest,
    version_at,
)
from strata.shell import log as _logger
from strata.storage import (
    Storage,
    delete,
    exists,
    filesystem,
    join,
    list_dir,
    make_dirs,
    read_json,
    write_json_atomic,
)

_say = _logger("forget").info
LIST_FILE = "forget-list.parquet"
LIST_SCHEMA = pa.schema([("key", pa.uint64()), ("kind", pa.string()), ("version", pa.string())])


def read_list(path: str) -> np.ndarray:
    """A forget list's keys (record and exact keys together), sorted: what pass 1 drops."""
    fs, p = filesystem(path)
    return np.unique(pq.read_table(fs.open_input_file(p), columns=["key"])["key"].to_numpy())


def forget(storage: Storage, name: str, *, doc_ids: list[str] | None = None, source: str | None = None,
           reason: str = "", purge: bool = False) -> dict:
    """Remove documents from dataset `name` (see the module's doc); returns what was done and the runs,
    checkpoints and exports that learned from them."""
    from strata.lease import Lease

    if not reason.strip():
        raise DatasetError("forget needs --reason TEXT: the commit records why the documents were removed")
    if (doc_ids is None) == (source is None):
        raise DatasetError("name the documents: --doc-ids FILE (a record id per line) or --source GLOB")
    if doc_ids is not None and not doc_ids:
        raise DatasetError("--doc-ids: the file names no document")
    with Lease(storage.dataset(name), f"dataset {name}", purpose="forget").acquire(wait=False) as lease:
        return Forget(storage, name, lease, doc_ids, source, reason.strip(), purge).run()


class Forget:
    def __init__(self, storage: Storage, name: str, lease, doc_ids, source, reason: str, purge: bool):
        self.storage, self.name, self.lease = storage, name, lease
        self.doc_ids, self.source, self.reason, self.purge = doc_ids, source, reason, purge
        self.path = storage.dataset(name)
        self.head = head(storage, name)
        if self.head.live is None:
            raise DatasetError(f"dataset {name!r} has no committed version")
        self.newest = latest(storage, name, self.head)
        self.label = f"v{self.head.table.version() + 1:04d}"  # the version the commit makes (no one else commits)
        self.tag = f"g{lease.gen:08d}-forget-{int(time.time())}"
        self.own = storage.run_files(name, self.tag)
        for leftover in abandoned_runs(storage, name, lease.gen, self.head):  # crashed or killed before a commit
            _say(f"deleting run {leftover}'s files: it ended before its commit")
            delete_run(storage, name, leftover)

    def run(self) -> dict:
        from strata.lineage import doc_key, find

        found = find(self.storage, self.doc_ids, self.source, self.name)
        docs = {d["doc_id"]: d for d in found["documents"]}
        if blind := found["without_lineage"]:
            _say(f"WARNING: {len(blind)} version(s) were made before lineage ({', '.join(blind[:3])}"
                 f"{' ...' if len(blind) > 3 else ''}): their rows cannot be searched, so any of these documents "
                 "there stays; the forget list still keeps them out of every later run")
        if self.source is not None and not docs:
            raise DatasetError(f"no document of dataset {self.name} comes from a file matching {self.source!r} "
                               "(by lineage): nothing was changed")
        ids = sorted(set(self.doc_ids or []) | set(docs))
        learned = self.learned_from(ids)  # before anything changes: the runs read the versions as they were
        doc_keys = {doc_key(i) for i in ids}
        exact = {int(d["exact"]) for d in docs.values()}
        held = next((h["rows"] for h in found["versions"] if h["ref"] == self.newest.ref), [])
        try:
            make_dirs(self.own, self.storage.run_shards(self.name, self.tag))
            removed, added, lineage, co_packed = self.rewrite(held, doc_keys)
            tails = self.rewrite_tails(doc_keys, exact)
            forget_list = self.write_list(doc_keys, exact)
            version = self.commit(ids, removed, added, lineage, co_packed, tails, forget_list, len(held))
        except BaseException:
            delete_run(self.storage, self.name, self.tag)  # nothing half-made is left
            raise
        purged = self.purge_files(version, removed, found, doc_keys, exact) if self.purge else {}
        not_found = sorted(set(self.doc_ids or []) - set(docs))
        return {"dataset": self.name, "version": version.manifest.version, "ref": version.ref,
                "not_searched": found["without_lineage"],
                "reason": self.reason, "documents": sorted(docs), "not_in_any_version": not_found,
                "rows_removed": len({(r["shard"], r["row"]) for r in held}),
                "shards_rewritten": len(removed), "co_packed": co_packed, "purged": purged.get("deleted", []),
                "scrubbed": purged.get("scrubbed", []), **learned}

    def learned_from(self, ids: list[str]) -> dict:
        """The runs, checkpoints, exports and sweeps that learned from the documents: `strata lineage doc`
        (training's own data order, run forward; tier 1 never imports training). If it fails, the takedown
        goes on and says so (`learned_from_error`)."""
        import json
        import subprocess
        import sys
        import tempfile

        if not ids:
            return {"runs": [], "sweeps": []}
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write("\n".join(ids) + "\n")
            f.flush()
            out = subprocess.run([sys.executable, "-m", "train.lineage", "doc", "--doc-ids", f.name, "--dataset",
                                  self.name, "--storage", self.storage.root, "--json"], capture_output=True, text=True)
        if out.returncode:
            why = (out.stderr.strip().splitlines() or ["no output"])[-1]
            _say(f"WARNING: could not list what learned from the documents: {why}")
            return {"runs": [], "sweeps": [], "learned_from_error": why}
        found = json.loads(out.stdout)
        return {"runs": found["runs"], "sweeps": found["sweeps"]}

    # ------------------------------------------------------------ the new version's files

    def rewrite(self, held: list[dict], doc_keys: set[int]):
        """Each shard of the newest snapshot holding a forgotten row, written again without those rows (in
        data/<tag>); its lineage, the rows renumbered; and the other documents the dropped rows held."""
        from pipelines.pack import ROW_GROUP_ROWS
        from strata.lineage import FILE, SCHEMA, read, write

        drop: dict[str, set[int]] = {}
        for r in held:
            drop.setdefault(r["shard"], set()).add(r["row"])
        shards = {s.path: s for s in self.newest.shards}
        removed, added, parts, co_packed = [], [], [], {}
        row_len = self.newest.manifest.seq_len + 1
        by_version = {}  # the lineage file of each version that added an affected shard
        for path in sorted(drop):
            old = shards[path]
            fs, p = filesystem(self.newest.file(path))
            table = pq.read_table(fs.open_input_file(p))
            gone = np.array(sorted(drop[path]), dtype=np.int64)
            keep = np.ones(table.num_rows, bool)
            keep[gone] = False
            removed.append(old)
            new_path = f"data/{self.tag}/{path.rsplit('/', 1)[1]}"
            if keep.any():
                fs, p = filesystem(join(self.path, new_path))
                with fs.open_output_stream(p) as f:
                    pq.write_table(table.filter(pa.array(keep)), f, row_group_size=ROW_GROUP_ROWS)
                    size = f.tell()
                added.append(Shard(path=new_path, split=old.split, rows=int(keep.sum()), tokens=int(keep.sum()) * row_len,
                                   bytes=size))
            if old.version not in by_version:
                owner = version_at(self.storage, self.name, int(old.version[1:]))
                lf = owner.manifest.lineage.get("file")
                by_version[old.version] = read(owner.file(lf)) if lf else SCHEMA.empty_table()
            spans = by_version[old.version].filter(pc.equal(by_version[old.version]["shard"], path))
            rows = spans["row"].to_numpy()
            dropped = np.isin(rows, gone)
            for r in spans.filter(pa.array(dropped)).to_pylist():
                if r["doc"] not in doc_keys:
                    doc_id = f"{r['source']}:{r['position']}"
                    co_packed[doc_id] = co_packed.get(doc_id, 0) + r["length"]
            kept = spans.filter(pa.array(~dropped))
            shifted = kept["row"].to_numpy() - np.searchsorted(gone, kept["row"].to_numpy())
            parts.append(kept.set_column(kept.schema.get_field_index("row"), "row", pa.array(shifted.astype(np.int32)))
                         .set_column(kept.schema.get_field_index("shard"), "shard",
                                     pa.array([new_path] * kept.num_rows, pa.string())))
        lineage = {}
        if parts:
            table = pa.concat_tables(parts)
            size = write(table, join(self.own, FILE), row_len)
            lineage = {"file": f"_strata/{self.tag}/{FILE}", "spans": table.num_rows, "bytes": size,
                       "documents": len(np.unique(table["doc"].to_numpy()))}
        return removed, added, lineage, [{"doc_id": k, "tokens_lost": v} for k, v in sorted(co_packed.items())]

    def forgotten_run(self, doc_id: str, exact_key: int, doc_keys: set[int], exact: set[int]) -> bool:
        """Whether a run of tails tokens is a forgotten document's (its id, its exact key or its file)."""
        return bool(doc_id) and (exact_key in exact or self.named(doc_id, doc_keys))

    def named(self, doc_id: str, keys: set[int]) -> bool:
        """Whether record `doc_id` has one of the record keys `keys`, or is of a file --source matches."""
        from strata.lineage import doc_key

        return doc_key(doc_id) in keys or (self.source is not None
                                           and fnmatch.fnmatchcase(doc_id.rpartition(":")[0], self.source))

    def rewrite_tails(self, doc_keys: set[int], exact: set[int]) -> str:
        """The newest version's tails without the forgotten documents' tokens: a new file (its path in the
        dataset), or the old one's when none of them is there."""
        from pipelines.lineage import DocRuns
        from pipelines.pack import write_tails

        m = self.newest.manifest
        if not m.tails:
            return ""
        from pipelines.pack import read_tails

        tails = read_tails(self.newest.file(m.tails))
        changed, carry, runs = False, {}, {}
        for split, (tokens, docs) in tails.items():
            keep, at, kept = np.ones(len(tokens), bool), 0, DocRuns()
            for doc_id, key, n in zip(docs.ids, docs.exact, docs.lengths, strict=True):
                if self.forgotten_run(doc_id, key, doc_keys, exact):
                    keep[at: at + n], changed = False, True
                else:
                    kept.add(doc_id, key, n)
                at += n
            carry[split], runs[split] = tokens[keep], kept
        if not changed:
            return m.tails
        for split in ("train", "validation"):
            carry.setdefault(split, np.zeros(0, np.uint32))
            runs.setdefault(split, DocRuns())
        rel = f"_strata/{self.tag}/tails.parquet"
        write_tails(join(self.path, rel), carry, runs)
        return rel

    def write_list(self, doc_keys: set[int], exact: set[int]) -> str:
        """The forget list as of the new version: the parent's, and these documents' keys."""
        m = self.newest.manifest
        parts = []
        if m.forgotten.get("list"):
            fs, p = filesystem(self.newest.file(m.forgotten["list"]))
            parts.append(pq.read_table(fs.open_input_file(p)).cast(LIST_SCHEMA))
        new = [(k, "doc") for k in sorted(doc_keys)] + [(k, "exact") for k in sorted(exact)]
        parts.append(pa.table({"key": pa.array([k for k, _ in new], pa.uint64()), "kind": [k for _, k in new],
                               "version": [self.label] * len(new)}, schema=LIST_SCHEMA))
        rel = f"_strata/{self.tag}/{LIST_FILE}"
        fs, p = filesystem(join(self.path, rel))
        pq.write_table(pa.concat_tables(parts).sort_by("key"), p, filesystem=fs)
        return rel

    def commit(self, ids, removed, added, lineage, co_packed, tails, forget_list, spans):
        m = self.newest.manifest
        rows = dict(m.totals.get("rows", {}))
        for s in removed:
            rows[s.split] = rows.get(s.split, 0) - s.rows
        for s in added:
            rows[s.split] = rows.get(s.split, 0) + s.rows
        lost = sum(s.tokens for s in removed) - sum(s.tokens for s in added)
        totals = {**m.totals, "versions": m.totals.get("versions", 1) + 1, "rows": rows,
                  "packed_tokens": m.totals.get("packed_tokens", 0) - lost,
                  "shards": m.totals.get("shards", 0) - len(removed) + len(added)}
        forgets = [*m.forgotten.get("forgets", []),
                   {"version": self.label, "reason": self.reason, "removed": [s.path for s in removed],
                    "purged": self.purge, "documents": len(ids)}]
        fields = dict(tokenizer=m.tokenizer, seq_len=m.seq_len, dtype=m.dtype, documents=DocumentCounts(), tokens=0,
                      inputs=[], run={"command": "forget", "at": time.time(), "lease_gen": self.lease.gen},
                      totals=totals, stats={}, dedup=m.dedup, consumed=m.consumed, tails=tails, quality=m.quality,
                      lineage=lineage,
                      forget={"reason": self.reason, "doc_ids": ids, "rows_removed": sum(s.rows for s in removed) -
                              sum(s.rows for s in added), "spans": spans, "co_packed": co_packed},
                      forgotten={"list": forget_list, "forgets": forgets})
        return commit_rewrite(self.storage, self.name, self.tag, fields, removed=removed, added=added,
                              lease=self.lease, head=self.head)

    def purge_files(self, version, removed: list[Shard], found: dict, doc_keys: set[int], exact: set[int]) -> dict:
        """--purge, once the commit stands: every file of an earlier version that holds the documents'
        tokens is deleted (the shards lineage names in any version, those an earlier takedown without
        --purge left included, and every tails file holding them), and each version's rejects report loses
        the text samples of them and of the copies dedup removed in their favour. {"deleted", "scrubbed"}."""
        from pipelines.pack import read_tails
        from strata.dataset import history
        from strata.lineage import doc_key

        live = {s.path for s in version.shards}  # the new snapshot holds none of their rows
        rel = {s.path for s in removed} | {r["shard"] for h in found["versions"] for r in h["rows"]}
        earlier = [v for v in history(self.storage, self.name) if v.number < version.number]
        copies = set()  # record keys of the documents dedup removed as copies of a forgotten one
        for v in earlier:
            d = v.manifest.dedup.get("removed")
            for part, is_dir in sorted(list_dir(v.file(d))) if d else []:
                if not is_dir:
                    fs, p = filesystem(join(v.file(d), part))
                    t = pq.read_table(fs.open_input_file(p), columns=["doc_id", "kept"])
                    copies |= {doc_key(i) for i, k in zip(t["doc_id"].to_pylist(), t["kept"].to_pylist(), strict=True)
                               if k in doc_keys}
        tails = {v.manifest.tails for v in earlier if v.manifest.tails} - {version.manifest.tails}
        for t in sorted(tails):
            held = read_tails(self.newest.file(t)) if exists(self.newest.file(t)) else {}
            if any(self.forgotten_run(i, k, doc_keys, exact) for _, runs in held.values()
                   for i, k in zip(runs.ids, runs.exact, strict=True)):
                rel.add(t)
        deleted = []
        for r in sorted(rel - live):
            if exists(f := self.newest.file(r)):
                delete(f)
                deleted.append(f)
        named = doc_keys | copies
        scrubbed = []
        for r in sorted({v.manifest.rejects for v in earlier if v.manifest.rejects}):
            if not exists(f := self.newest.file(r)):
                continue
            report = read_json(f)
            samples = {k: [x for x in v if not (isinstance(x, dict) and self.named(str(x.get("doc_id", "")), named))]
                       for k, v in (report.get("samples") or {}).items()}
            if samples != report.get("samples"):
                write_json_atomic(f, {**report, "samples": samples})
                scrubbed.append(f)
        return {"deleted": deleted, "scrubbed": scrubbed}
