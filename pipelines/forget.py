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
  It gains their MinHash band keys too (`near`, by the dataset's dedup parameters, from the documents' text
  decoded from their rows): an edited copy is filtered as `forgotten`, whatever the dedup window.
- The commit records the reason and the ids (the manifest's `forget`), and every later version carries the
  takedown on (`forgotten`): training refuses, in one line, a snapshot that still holds the rows.

Earlier versions keep their files for time travel; `--purge` deletes every earlier file holding the
documents' tokens (shards and tails) and scrubs their text samples from the rejects reports, and those
versions then say so when opened. The purge is planned before the commit and the commit records the plan
(each file to delete, and each scrubbed report's new SHA-256), so it either finishes after the commit, or
the next `forget` on the dataset (a rerun of this one) finishes it. A crash before the commit leaves only
files of an uncommitted run directory, which the next writer deletes.

Nothing is acted on that is not verified first (strata/data/integrity.py): lineage, tails, forget list, dedup's
removed lists and rejects reports are read only as the commits that made them name them, and every
document's spans are checked against the version that added it (strata.data.lineage.check_spans). Versions
made before file digests are not searched (as versions made before lineage are not), and said so.
"""

from __future__ import annotations

import fnmatch
import time
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from strata.commands.shell import log as _logger
from strata.data.commit import abandoned_runs, commit_rewrite, delete_run
from strata.data.dataset import DatasetError, DocumentCounts, Shard, head, latest, version_at
from strata.data.integrity import file_sha256, sha256
from strata.data.storage import (
    Storage,
    delete,
    exists,
    filesystem,
    join,
    make_dirs,
    write_bytes_atomic,
)

_say = _logger("forget").info
LIST_FILE = "forget-list.parquet"
LIST_SCHEMA = pa.schema([("key", pa.uint64()), ("kind", pa.string()), ("version", pa.string())])


def read_list(named, near: bool = False) -> np.ndarray:
    """A forget list's record and exact keys together, sorted (with `near`: its MinHash band keys instead):
    what pass 1 drops. `named`: the list as its version's commit names it (strata.data.integrity.Named), checked
    against its digest."""
    t = named.parquet(columns=["key", "kind"])
    is_near = pc.equal(t["kind"], "near")
    return np.unique(t.filter(is_near if near else pc.invert(is_near))["key"].to_numpy())


def forget(storage: Storage, name: str, *, doc_ids: list[str] | None = None, source: str | None = None,
           reason: str = "", purge: bool = False) -> dict:
    """Remove documents from dataset `name` (see the module's doc); returns what was done and the runs,
    checkpoints and exports that learned from them."""
    from strata.data.lease import Lease

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
        self.digests: dict[str, str] = {}  # of the files it writes, as it writes them
        self.own = storage.run_files(name, self.tag)
        for leftover in abandoned_runs(storage, name, lease.gen, self.head):  # crashed or killed before a commit
            _say(f"deleting run {leftover}'s files: it ended before its commit")
            delete_run(storage, name, leftover)

    def run(self) -> dict:
        from strata.data.lineage import doc_key, find

        finished = finish_purges(self.storage, self.newest)  # a purge a crash cut short, from its commit's plan
        found = find(self.storage, self.doc_ids, self.source, self.name, verified_only=True)
        docs = {d["doc_id"]: d for d in found["documents"]}
        if blind := found["without_lineage"]:
            _say(f"WARNING: {len(blind)} version(s) were made before lineage or file digests ({', '.join(blind[:3])}"
                 f"{' ...' if len(blind) > 3 else ''}): their rows cannot be searched, so any of these documents "
                 "there stays; the forget list still keeps them out of every later run")
        if self.source is not None and not docs:
            if finished:
                return self.nothing_more(finished)
            raise DatasetError(f"no document of dataset {self.name} comes from a file matching {self.source!r} "
                               "(by lineage): nothing was changed")
        ids = sorted(set(self.doc_ids or []) | set(docs))
        doc_keys = {doc_key(i) for i in ids}
        held = next((h["rows"] for h in found["versions"] if h["ref"] == self.newest.ref), [])
        if finished and not held and doc_keys <= self.listed():  # a rerun of the takedown a crash cut short
            return self.nothing_more(finished)
        learned = self.learned_from(ids)  # before anything changes: the runs read the versions as they were
        exact = {int(d["exact"]) for d in docs.values()}
        near, params = self.near_keys(held, docs)
        try:
            make_dirs(self.own, self.storage.run_shards(self.name, self.tag))
            removed, added, lineage, co_packed = self.rewrite(held, doc_keys)
            tails = self.rewrite_tails(doc_keys, exact)
            forget_list = self.write_list(doc_keys, exact, near)
            plan = self.plan_purge(removed, added, tails, found, doc_keys, exact) if self.purge else None
            version = self.commit(ids, removed, added, lineage, co_packed, tails, forget_list, len(held), plan, params)
        except BaseException:
            delete_run(self.storage, self.name, self.tag)  # nothing half-made is left
            raise
        purged = carry_out(version, plan) if plan else {}
        for f in finished:
            purged.setdefault("deleted", []).extend(f["deleted"])
            purged.setdefault("scrubbed", []).extend(f["scrubbed"])
        not_found = sorted(set(self.doc_ids or []) - set(docs))
        return {"dataset": self.name, "version": version.manifest.version, "ref": version.ref,
                "not_searched": found["without_lineage"],
                "reason": self.reason, "documents": sorted(docs), "not_in_any_version": not_found,
                "rows_removed": len({(r["shard"], r["row"]) for r in held}),
                "shards_rewritten": len(removed), "co_packed": co_packed, "purged": purged.get("deleted", []),
                "scrubbed": purged.get("scrubbed", []), **learned}

    def listed(self) -> set[int]:
        """The keys the newest version's forget list holds (checked against its commit's digest)."""
        listed = self.newest.manifest.forgotten.get("list")
        return {int(k) for k in read_list(self.newest.named(listed, legacy_ok=True))} if listed else set()

    def nothing_more(self, finished: list[dict]) -> dict:
        """A rerun after a purge a crash cut short: the purge is finished, and nothing else changes."""
        _say(f"these documents were forgotten already; finished the purge of {', '.join(f['version'] for f in finished)}")
        return {"dataset": self.name, "version": self.newest.manifest.version, "ref": self.newest.ref,
                "not_searched": [], "reason": self.reason, "documents": [], "not_in_any_version": [],
                "rows_removed": 0, "shards_rewritten": 0, "co_packed": [], "runs": [], "sweeps": [],
                "purged": [p for f in finished for p in f["deleted"]],
                "scrubbed": [p for f in finished for p in f["scrubbed"]], "finished": [f["version"] for f in finished]}

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
        from strata.data.lineage import FILE, SCHEMA, check_spans, read, write

        drop: dict[str, set[int]] = {}
        for r in held:
            drop.setdefault(r["shard"], set()).add(r["row"])
        shards = {s.path: s for s in self.newest.shards}
        if outside := [(p, r) for p, rows in drop.items() for r in rows if p not in shards or r >= shards[p].rows]:
            raise DatasetError(f"forget: lineage names row {outside[0][1]} of {outside[0][0]}, which {self.newest.ref} "
                               "does not hold: refused before anything changed")
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
                by_version[old.version] = read(owner.named(lf)) if lf else SCHEMA.empty_table()
                check_spans(owner, by_version[old.version])
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
            size, self.digests[f"_strata/{self.tag}/{FILE}"] = write(table, join(self.own, FILE), row_len)
            lineage = {"file": f"_strata/{self.tag}/{FILE}", "spans": table.num_rows, "bytes": size,
                       "documents": len(np.unique(table["doc"].to_numpy()))}
        return removed, added, lineage, [{"doc_id": k, "tokens_lost": v} for k, v in sorted(co_packed.items())]

    def named(self, doc_id: str, keys: set[int]) -> bool:
        """Whether record `doc_id` has one of the record keys `keys`, or is of a file --source matches."""
        from strata.data.lineage import doc_key

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

        tails = read_tails(self.newest.named(m.tails, legacy_ok=True))
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

    def near_keys(self, held: list[dict], docs: dict[str, dict]) -> tuple[set[int], dict | None]:
        """The MinHash band keys of the documents' texts (pipelines/near.py), by the dataset's dedup
        parameters (the forget list's own, once it has near keys): pass 1 then drops an edited copy as
        `forgotten`, as near dedup would drop it, but for good, not only within the dedup window. (keys, the
        parameters); no keys when the parameters are not ones this code computes."""
        from pipelines.dedup import hasher_of
        from pipelines.near import band_keys, texts

        m = self.newest.manifest
        params = m.forgotten.get("near") or m.dedup.get("params")
        hasher = hasher_of(params)
        if hasher is None or not held:
            if held:
                _say("WARNING: the dataset's dedup parameters are not ones this version of strata computes: edited "
                     "copies are kept out only by the record and exact keys")
            return set(), m.forgotten.get("near")
        return band_keys(hasher, texts(self.newest, held, docs).values()), params

    def write_list(self, doc_keys: set[int], exact: set[int], near: set[int] = frozenset()) -> str:
        """The forget list as of the new version: the parent's, and these documents' keys."""
        m = self.newest.manifest
        parts = []
        if m.forgotten.get("list"):
            parts.append(self.newest.named(m.forgotten["list"], legacy_ok=True).parquet().cast(LIST_SCHEMA))
        new = ([(k, "doc") for k in sorted(doc_keys)] + [(k, "exact") for k in sorted(exact)]
               + [(k, "near") for k in sorted(near)])
        parts.append(pa.table({"key": pa.array([k for k, _ in new], pa.uint64()), "kind": [k for _, k in new],
                               "version": [self.label] * len(new)}, schema=LIST_SCHEMA))
        rel = f"_strata/{self.tag}/{LIST_FILE}"
        fs, p = filesystem(join(self.path, rel))
        pq.write_table(pa.concat_tables(parts).sort_by("key"), p, filesystem=fs)
        return rel

    def commit(self, ids, removed, added, lineage, co_packed, tails, forget_list, spans, plan=None, near=None):
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
                    "purged": self.purge, "documents": len(ids), **({"purge": plan["record"]} if plan else {})}]
        fields = dict(tokenizer=m.tokenizer, seq_len=m.seq_len, dtype=m.dtype, documents=DocumentCounts(), tokens=0,
                      inputs=[], run={"command": "forget", "at": time.time(), "lease_gen": self.lease.gen},
                      totals=totals, stats={}, dedup=m.dedup, consumed=m.consumed, tails=tails, quality=m.quality,
                      lineage=lineage,
                      forget={"reason": self.reason, "doc_ids": ids, "rows_removed": sum(s.rows for s in removed) -
                              sum(s.rows for s in added), "spans": spans, "co_packed": co_packed},
                      forgotten={"list": forget_list, "forgets": forgets, **({"near": near} if near else {})},
                      digests=self.digests)
        return commit_rewrite(self.storage, self.name, self.tag, fields, removed=removed, added=added,
                              lease=self.lease, head=self.head)

    def plan_purge(self, removed: list[Shard], added: list[Shard], tails: str, found: dict, doc_keys: set[int],
                   exact: set[int]) -> dict:
        """--purge, planned before the commit: every file of an earlier version that holds the documents'
        tokens (the shards verified lineage names in any version, those an earlier takedown without --purge
        left included, and every tails file holding them), and each rejects report without the text samples
        of them and of the copies dedup removed in their favour. Everything it reads is checked against its
        commit's digest; a version made before digests is left out, and said so. {"record": what the commit
        keeps (files to delete; reports with their scrubbed SHA-256), "reports": {path: scrubbed bytes}}."""
        from pipelines.pack import read_tails
        from strata.data.dataset import history
        from strata.data.lineage import doc_key

        live = ({s.path for s in self.newest.shards} - {s.path for s in removed}) | {s.path for s in added}
        doomed = {s.path for s in removed} | {r["shard"] for h in found["versions"] for r in h["rows"]}
        earlier = [v for v in history(self.storage, self.name)]
        unverified = [v.ref for v in earlier if not v.manifest.digests]
        if unverified:
            _say(f"WARNING: --purge leaves the files of {len(unverified)} version(s) made before file digests as they are "
                 f"({', '.join(unverified[:3])}{' ...' if len(unverified) > 3 else ''}): they cannot be verified")
        earlier = [v for v in earlier if v.manifest.digests]
        copies = set()  # record keys of the documents dedup removed as copies of a forgotten one
        for v in earlier:
            d = v.manifest.dedup.get("removed")
            for part in sorted(p for p in v.manifest.digests if d and p.startswith(f"{d}/")):
                t = v.named(part).parquet(columns=["doc_id", "kept"])
                copies |= {doc_key(i) for i, k in zip(t["doc_id"].to_pylist(), t["kept"].to_pylist(), strict=True)
                           if k in doc_keys}
        for v in earlier:
            t = v.manifest.tails
            if t and t != tails and t not in doomed and v.named(t).exists():  # (`tails`: the new version's)
                held = read_tails(v.named(t))
                if any(self.forgotten_run(i, k, doc_keys, exact) for _, runs in held.values()
                       for i, k in zip(runs.ids, runs.exact, strict=True)):
                    doomed.add(t)
        named = sorted(doc_keys | copies)
        reports, scrub, rewritten = {}, {}, scrubbed_so_far(self.newest)
        for v in earlier:
            if not (r := v.manifest.rejects) or r in scrub or not v.named(r).exists():
                continue
            report = replace(v.named(r), sha256=rewritten.get(r, v.named(r).sha256))  # as an earlier purge left it
            new = scrubbed_report(report.json(), set(named), self.source, report.what)
            if new is not None:
                reports[v.file(r)], scrub[r] = new, {"sha256": sha256(new), "version": v.manifest.version}
        return {"record": {"delete": sorted(doomed - live), "scrub": scrub, "keys": [str(k) for k in named],
                           "source": self.source},
                "reports": reports}

    def forgotten_run(self, doc_id: str, exact_key: int, doc_keys: set[int], exact: set[int]) -> bool:
        """Whether a run of tails tokens is a forgotten document's (its id, its exact key or its file)."""
        return bool(doc_id) and (exact_key in exact or self.named(doc_id, doc_keys))


def scrubbed_report(report, keys: set[int], source: str | None, what: str) -> bytes | None:
    """A rejects report without the samples of the documents `keys` names (or of files `source` matches), as
    the bytes strata writes; None when it holds none of them. A report that is not one is an error naming it."""
    from strata.data.lineage import doc_key
    from strata.data.storage import json_bytes

    samples = report.get("samples") if isinstance(report, dict) else None
    if not isinstance(samples, dict) or not all(isinstance(v, list) for v in samples.values()):
        raise DatasetError(f"{what} is not a rejects report (no samples by reason); refused")

    def named(x) -> bool:
        doc_id = str(x.get("doc_id", "")) if isinstance(x, dict) else ""
        return doc_key(doc_id) in keys or (source is not None and fnmatch.fnmatchcase(doc_id.rpartition(":")[0], source))

    kept = {k: [x for x in v if not named(x)] for k, v in samples.items()}
    return None if kept == samples else json_bytes({**report, "samples": kept})


def scrubbed_so_far(newest) -> dict[str, str]:
    """The rejects reports earlier purges rewrote, with the SHA-256 their plans recorded: what they hold now."""
    out = {}
    for f in newest.manifest.forgotten.get("forgets") or []:
        scrub = (f.get("purge") or {}).get("scrub") if isinstance(f, dict) else None
        for rel, s in (scrub or {}).items() if isinstance(scrub, dict) else ():
            if isinstance(s, dict) and isinstance(s.get("sha256"), str):
                out[rel] = s["sha256"]
    return out


def rewritten_before(newest, version, rel: str) -> str | None:
    """The SHA-256 `rel` had after the purges before takedown `version` (None: as its own commit made it)."""
    sha = None
    for f in newest.manifest.forgotten.get("forgets") or []:
        if not isinstance(f, dict) or f.get("version") == version:
            break
        s = ((f.get("purge") or {}).get("scrub") or {}).get(rel)
        if isinstance(s, dict) and isinstance(s.get("sha256"), str):
            sha = s["sha256"]
    return sha


def carry_out(version, plan: dict) -> dict:
    """Do what a purge's plan says, now that its commit stands: {"deleted", "scrubbed"} (paths)."""
    from strata.data.commit import failpoint

    deleted, scrubbed = [], []
    for rel in plan["record"]["delete"]:
        if exists(f := version.file(rel)):
            delete(f)
            deleted.append(f)
            failpoint(f"purge:{len(deleted)}")  # a crash part way (tests): the next forget finishes it
    for path, data in plan["reports"].items():
        write_bytes_atomic(path, data)
        scrubbed.append(path)
    return {"deleted": deleted, "scrubbed": scrubbed}


def finish_purges(storage: Storage, newest) -> list[dict]:
    """Finish every purge whose commit stands but which a crash cut short (its plan is in the takedown record
    every later version carries on): files still there are deleted, reports not yet scrubbed are. A report is
    scrubbed again only from the bytes its own version's commit names, and only to the SHA-256 the plan
    recorded. [{"version", "deleted", "scrubbed"}] of each purge that had something left."""
    from strata.data.integrity import IntegrityError

    out = []
    for f in newest.manifest.forgotten.get("forgets") or []:
        plan = f.get("purge") if isinstance(f, dict) else None
        if not isinstance(plan, dict):
            continue
        left = [rel for rel in plan.get("delete") or [] if isinstance(rel, str) and exists(newest.file(rel))]
        todo = {rel: s for rel, s in (plan.get("scrub") or {}).items() if isinstance(rel, str) and isinstance(s, dict)
                and exists(newest.file(rel)) and file_sha256(newest.file(rel)) != s.get("sha256")}
        if not left and not todo:
            continue
        deleted, scrubbed = [], []
        for rel in left:
            delete(newest.file(rel))
            deleted.append(newest.file(rel))
        keys = {int(k) for k in plan.get("keys") or []}
        for rel, s in todo.items():
            owner = version_at(storage, newest.manifest.dataset, int(str(s.get("version", "v0"))[1:] or 0))
            before = rewritten_before(newest, f.get("version"), rel) or owner.named(rel).sha256
            report = replace(owner.named(rel), sha256=before)
            new = scrubbed_report(report.json(), keys, plan.get("source"), report.what)
            if new is None or sha256(new) != s.get("sha256"):
                raise IntegrityError(f"the purge of {newest.manifest.dataset}@{f.get('version')}: {rel} does not scrub "
                                     "to the SHA-256 its plan recorded; refused")
            write_bytes_atomic(newest.file(rel), new)
            scrubbed.append(newest.file(rel))
        _say(f"finished the purge of {newest.manifest.dataset}@{f.get('version')} a crash cut short: deleted "
             f"{len(deleted)} file(s), scrubbed {len(scrubbed)} report(s)")
        out.append({"version": f.get("version"), "deleted": deleted, "scrubbed": scrubbed})
    return out
