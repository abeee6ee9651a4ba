"""Which rows and documents a training step learned from (`python -m strata lineage step RUN STEP`), and where
a document went (`python -m strata lineage doc`).

A run's data order is a function of its settings (train/data.py): the sources (every dataset pinned to its
version, with its weight), the seed, the micro-batch, the accumulation and the world size. A continued run
keeps them, so step S of any launch is micro-batches (S - 1) * accumulation ... S * accumulation - 1 of each
rank's stream. This module runs that same stream with a reader that hands back each row's place instead
of its tokens: the order is the training loop's own code, not a copy of it.

The settings come from the run's log (each launch's `start` event: micro-batch, accumulation, world size)
and its launch records (the dataset spec and the seed).
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import numpy as np

from strata.accounting.runlog import LOG, read_launches, read_log
from strata.commands.shell import Command, Parser, StrataError
from strata.data.storage import Storage, exists, join


class LineageError(StrataError):
    pass


def _settings(run_dir: str, run: str, step: int) -> tuple[dict, dict, int]:
    """(the launch record, the start event, the run's last step) that trained step `step`."""
    if not exists(join(run_dir, LOG)):
        raise LineageError(f"no training run named {run!r} has a log under {run_dir}")
    log = read_log(run_dir)
    starts = log.events("start")
    last = max((r["step"] for r in log.steps), default=0)
    if not starts or not last:
        raise LineageError(f"run {run} has not trained a step yet")
    if not 1 <= step <= last:
        raise LineageError(f"run {run} has trained steps 1 to {last}: no step {step}")
    start = [s for s in starts if s["start_step"] < step][-1]  # the attempt that went on past it
    launches = read_launches(run_dir)
    launch = [launch for launch in launches if launch["started_at"] <= start["time"]][-1]
    return launch, start, last


class _Order:
    """One launch's data order, run with a reader of row places: `places[i]` is (dataset ref, shard ref, its
    path in the dataset) of training shard i, in the sources' order; `stream(rank)` is that rank's stream of
    micro-batches of (shard index, row)."""

    def __init__(self, storage: Storage, run: str, run_dir: str, launch: dict, start: dict):
        from train import mixture
        from train.data import Source

        try:  # the run's own files, read back from storage: a field missing or of the wrong type is one line
            self.spec, self.seed = str(launch["config"]["dataset"]), int(launch["config"]["train"]["seed"])
            self.micro, self.accum, self.world = (int(start[k]) for k in ("micro_batch", "grad_accum", "world_size"))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise _bad_record(run, run_dir, e) from None
        if min(self.micro, self.accum, self.world) < 1:
            raise LineageError(f"run {run}: its log says micro-batch {self.micro}, accumulation {self.accum}, "
                               f"world {self.world}")
        versions = mixture.resolve_all(storage, self.spec)
        self.versions = {v.ref: v for v, _ in versions}
        self.sources = [Source.of(v, w) for v, w in versions]
        self.places = [(v.ref, ref, s.path) for (v, _), src in zip(versions, self.sources, strict=True)
                       for ref, s in zip(src.shards, [s for s in v.shards if s.split == "train"], strict=True)]
        self.index = {shard.path: i for i, (_, shard, _) in enumerate(self.places)}

    def where(self, path: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """In place of a shard's rows: (shard index, row) of each, as the stream reads them."""
        i = self.index[path]
        rows = np.arange(start, self.places[i][1].rows if stop is None else stop, dtype=np.int64)
        return np.stack([np.full(len(rows), i, dtype=np.int64), rows], axis=1)

    def stream(self, rank: int, micro_step: int):
        from train.data import open_batches

        return open_batches(self.sources, batch_size=self.micro, rank=rank, world_size=self.world, seed=self.seed,
                            read=self.where).from_step(micro_step)


def _bad_record(run: str, run_dir: str, e: Exception) -> LineageError:
    return LineageError(f"run {run}: its log ({join(run_dir, LOG)}) or launch records ({join(run_dir, 'launches')}) "
                        f"do not say how it read its data ({type(e).__name__}: {e})")


def step_rows(storage: Storage, run: str, step: int) -> dict:
    """Every rank's rows of optimizer step `step` (1 = the first), in the order the loop took them:
    {"ranks": [{"rank", "rows": [{"dataset", "shard", "file", "row", "documents"}, ...]}], and the settings
    used}. `shard` is the file's full path, `file` its path in the dataset, `documents` the documents the row
    holds (strata.data.lineage.row_documents: id, input file, place, and the row's tokens that are theirs)."""
    from strata.data.lineage import row_documents

    run_dir = storage.run(run)
    try:
        launch, start, _ = _settings(run_dir, run, step)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise _bad_record(run, run_dir, e) from None
    o = _Order(storage, run, run_dir, launch, start)
    ranks = []
    for rank in range(o.world):
        batches = o.stream(rank, (step - 1) * o.accum)
        rows = np.concatenate([next(batches) for _ in range(o.accum)])
        ranks.append({"rank": rank, "rows": [{"dataset": o.places[i][0], "shard": o.places[i][1].path,
                                              "file": o.places[i][2], "row": int(r)} for i, r in rows.tolist()]})
    for ref, v in o.versions.items():
        docs = row_documents(storage, v, {(r["file"], r["row"]) for rank in ranks for r in rank["rows"]
                                          if r["dataset"] == ref})
        for rank in ranks:
            for r in rank["rows"]:
                if r["dataset"] == ref:
                    r["documents"] = docs[(r["file"], r["row"])]
    return {"run": run, "step": step, "dataset": o.spec, "seed": o.seed, "micro_batch": o.micro,
            "grad_accum": o.accum, "world_size": o.world, "ranks": ranks}


def first_steps(storage: Storage, run: str, wanted: set[tuple[str, str, int]]) -> dict[tuple[str, str, int], int]:
    """The first optimizer step at which run `run` trained on each of the rows `wanted` ((dataset ref, path in
    the dataset, row)) it did train on: its data order run forward launch by launch (each launch's own
    settings, from the step it started at), every worker's, until each row is found or the run's last step."""
    run_dir = storage.run(run)
    log = read_log(run_dir)
    starts, launches = log.events("start"), read_launches(run_dir)
    last = max((r["step"] for r in log.steps), default=0)
    found: dict[tuple[str, str, int], int] = {}
    for i, start in enumerate(starts):
        begin = int(start.get("start_step", 0))
        end = min(int(starts[i + 1].get("start_step", 0)), last) if i + 1 < len(starts) else last
        mine = [x for x in launches if x["started_at"] <= start["time"]]
        if end <= begin or not mine:
            continue
        o = _Order(storage, run, run_dir, mine[-1], start)
        place = {(ref, path): j for j, (ref, _, path) in enumerate(o.places)}
        codes = {place[key[:2]] << 32 | key[2]: key for key in wanted - found.keys() if key[:2] in place}
        if not codes:
            continue
        targets = np.array(sorted(codes), dtype=np.int64)
        for rank in range(o.world):
            batches = o.stream(rank, begin * o.accum)
            for m in range((end - begin) * o.accum):
                rows = next(batches)
                hit = rows[:, 0] << 32 | rows[:, 1]
                for code in hit[np.isin(hit, targets)].tolist():
                    step = begin + m // o.accum + 1
                    key = codes[code]
                    if key not in found or step < found[key]:
                        found[key] = step
    return found


def documents(storage: Storage, doc_ids: list[str] | None = None, source: str | None = None,
              dataset: str | None = None) -> dict:
    """Where documents went (`python -m strata lineage doc`): by record id (`PATH:POSITION`, as tier 1 names
    them) or by input-file glob, in every dataset (or `dataset`). Lists each document's place in its input,
    every version whose snapshot holds one of its rows (strata.data.lineage.find), and for each training run that
    read such a version the first step it trained on each row, the checkpoints and exports made from then
    on, and what used the run since (scoring, evaluation, generation); and the sweeps that read such a
    version."""
    from strata.accounting.ledger import USES, model_of, pinned
    from strata.accounting.records import list_records
    from strata.data.dataset import DatasetError
    from strata.data.lineage import find

    try:
        out = find(storage, doc_ids, source, dataset)
    except DatasetError as e:
        raise LineageError(str(e)) from None
    holders = out["versions"]
    held = {h["ref"] for h in holders}
    records = list_records(storage)
    runs, sweeps = [], []
    for run in dict.fromkeys(r["name"] for r in records if r["kind"] == "train"):
        launches = [r for r in records if r["kind"] == "train" and r["name"] == run]
        refs = [f"{n}@v{v:04d}" for n, v in pinned(str((launches[-1].get("config") or {}).get("dataset") or ""))]
        wanted = {(h["ref"], r["shard"], r["row"]): r["doc_id"] for h in holders if h["ref"] in refs
                  for r in h["rows"] if r["split"] == "train"}
        if not wanted:
            continue
        first: dict[str, int] = {}
        for key, step in first_steps(storage, run, set(wanted)).items():
            first[wanted[key]] = min(step, first.get(wanted[key], step))
        entry = {"run": run, "datasets": [r for r in refs if r in held], "rows": len(wanted),
                 "first_step": min(first.values()) if first else None, "first_step_by_document": first,
                 "checkpoints": [], "exports": [], "used_by": []}
        if first:
            entry["checkpoints"], entry["exports"] = made_after(storage.run(run), entry["first_step"])
            entry["used_by"] = [{"kind": r["kind"], "name": r["name"], "model": (r.get("config") or {}).get("model")}
                                for r in records if r["kind"] in USES
                                and (m := model_of(r))[0] == run and m[1] >= entry["first_step"]]
        runs.append(entry)
    for r in records:
        if r["kind"] == "sweep" and (read := [f"{n}@v{v:04d}" for n, v in
                                              pinned(str((r.get("config") or {}).get("dataset") or "")) if
                                              f"{n}@v{v:04d}" in held]):
            sweeps.append({"sweep": r["name"], "datasets": read})
    return {**out, "runs": runs, "sweeps": sweeps}


def made_after(run_dir: str, step: int) -> tuple[list[dict], list[dict]]:
    """The run's checkpoints of step `step` or later, and the exports made of them."""
    from train.checkpoint import read_meta
    from train.committed import committed_checkpoints
    from train.export import exports

    checkpoints = []
    for c in committed_checkpoints(run_dir):
        if (at := int(read_meta(c).get("step", 0))) >= step:
            checkpoints.append({"path": c, "step": at})
    return checkpoints, [e for e in exports(run_dir) if int(e.get("step", 0)) >= step]


def main(argv: list[str] | None = None) -> int:
    return Command("python -m strata lineage", argv, tag="lineage").run(_main, user_errors=(ValueError,))


def _main(cmd: Command) -> int:
    p = Parser(prog="python -m strata lineage", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sp = sub.add_parser("step", help="the rows of one training step's batch, every worker's, and their documents")
    sp.add_argument("run", help="a training run's name")
    sp.add_argument("step", type=int, help="the optimizer step (1 = the first)")
    sp.add_argument("--storage", help="storage root (default: $STRATA_STORAGE or ~/strata-data)")
    sp.add_argument("--json", action="store_true", help="print JSON instead")
    dp = sub.add_parser("doc", help="where documents went: every version, training run, checkpoint and export")
    dp.add_argument("--doc-id", action="append", help="a record id, PATH:POSITION as tier 1 names it (repeat it)")
    dp.add_argument("--doc-ids", help="a file of record ids, one a line")
    dp.add_argument("--source", help="every document of the input files matching this glob")
    dp.add_argument("--dataset", help="look in this dataset only (default: every one)")
    dp.add_argument("--storage", help="storage root (default: $STRATA_STORAGE or ~/strata-data)")
    dp.add_argument("--json", action="store_true", help="print JSON instead")
    sm = sub.add_parser("summary", help="a model's training-content summary, in the EU AI Office template's sections")
    sm.add_argument("model", help="RUN or RUN@STEP (its newest checkpoint, or the one at STEP)")
    sm.add_argument("--provider", default="", help="the provider's name, for section 1.1")
    sm.add_argument("--storage", help="storage root (default: $STRATA_STORAGE or ~/strata-data)")
    sm.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    a = p.parse_args(cmd.argv)
    if a.what == "summary":
        from train.summary import summary, summary_text

        out = summary(Storage.from_env(a.storage), a.model, a.provider)
        print(json.dumps(out) if a.json else summary_text(out))
        return 0
    if a.what == "doc":
        ids = a.doc_id
        if a.doc_ids:
            try:
                with open(a.doc_ids) as f:
                    ids = [*(ids or []), *(line.strip() for line in f if line.strip())]
            except OSError as e:
                raise LineageError(f"--doc-ids {a.doc_ids}: {e.strerror}") from None
        out = documents(Storage.from_env(a.storage), ids, a.source, a.dataset)
        print(json.dumps(out) if a.json else doc_text(out))
        return 0
    out = step_rows(Storage.from_env(a.storage), a.run, a.step)
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"step {out['step']} of run {out['run']}: {out['world_size']} worker(s) x {out['grad_accum']} micro-batch(es) "
          f"of {out['micro_batch']} rows, dataset {out['dataset']}, seed {out['seed']}")
    for r in out["ranks"]:
        print(f"  worker {r['rank']}:")
        for row in r["rows"]:
            print(f"    {row['dataset']}  {row['file']}  row {row['row']}")
            for d in row["documents"]:
                print(f"      tokens {d['start']}-{d['start'] + d['length']}  {d['doc_id']}")
    return 0


def doc_text(out: dict) -> str:
    """`documents`' answer, for people."""
    lines = [f"{len(out['documents'])} document(s):"]
    for d in out["documents"]:
        f = d["file"]
        lines.append(f"  {d['doc_id']}  (file {f.get('size')} bytes, mtime_ns {f.get('mtime_ns')}, "
                     f"{f.get('digest') or 'no digest'}; added in {d['added_in']})")
        if d.get("record"):  # a web page: the WARC record it came from
            r = d["record"]
            lines.append(f"    record {r.get('record_id')}: {r.get('url')}, {r.get('date')}, {r.get('content_type')}")
    for h in out["versions"]:
        rows = h["rows"]
        splits = ", ".join(f"{n} {s}" for s, n in sorted(Counter(r["split"] for r in rows).items()))
        lines.append(f"{h['ref']} holds {len(rows)} row(s) of them ({splits}) in {len({r['shard'] for r in rows})} "
                     f"shard(s), e.g.:")
        lines += [f"    {r['shard']}  row {r['row']}  tokens {r['start']}-{r['start'] + r['length']}  {r['doc_id']}"
                  for r in rows[:3]]
    for r in out["runs"]:
        lines.append(f"run {r['run']} read {', '.join(r['datasets'])}: first trained on them at step {r['first_step']}"
                     if r["first_step"] else f"run {r['run']} read {', '.join(r['datasets'])} but has not reached their rows")
        lines += [f"    checkpoint step {c['step']}  {c['path']}" for c in r["checkpoints"]]
        lines += [f"    export of step {e['step']}  {e['path']}" for e in r["exports"]]
        lines += [f"    used by {u['kind']} {u['name']} ({u['model']})" for u in r["used_by"]]
    lines += [f"sweep {s['sweep']} read {', '.join(s['datasets'])}" for s in out["sweeps"]]
    if out["without_lineage"]:
        lines.append(f"not searched (made before lineage): {', '.join(out['without_lineage'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
