"""Takedown requests (`python -m strata takedown open | plan | apply | retrain | delete | status | report |
list`): one request, recorded with an id and the time it was received, from every copy of its documents to
the models retrained without them. It lives in train/ because where a document went runs through training's
own data order (train/lineage.py).

- `open` takes what the requester gives: a file (`--source PATH`, its bytes digested as tier 1 digests its
  inputs), a digest (`--sha256 HEX`) or record ids (`--doc-ids FILE`, `PATH:POSITION` a line). It finds every
  input file with that digest under any path (every version's manifest), the documents lineage read from
  them, every document with the same exact key (the same text in other bytes), and with `--near` every
  document sharing a MinHash band with one of them (pipelines/near.py). The request is written to
  `takedowns/ID.json`, signed (strata.data.signing), under an id no other request has.
- `plan` finds, again, what is left: the datasets whose newest version holds the documents, the runs that
  trained on them from which step, their checkpoints, exports and uses, and the command for each.
- `apply` forgets them in each such dataset (`python -m pipelines.datasets forget`, one commit under each
  dataset's lease) and marks the runs tainted (train/taint.py); `retrain` trains each again without them;
  `delete` removes the tainted checkpoints and exports. Each step is an event in the request's timeline
  (`status`); `report` gives each request's time to honor.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

from strata.commands.shell import Command, Parser, StrataError
from strata.data.storage import Storage, exists, join, list_dir
from train.lineage import documents
from train.taint import read_signed, write_signed

DIR = "takedowns"


class TakedownError(StrataError):
    pass


def digest_of(path: str) -> str:
    """A file's digest as tier 1 records its inputs' (strata.data.sources.path_digest)."""
    from strata.data.digests import path_digest

    try:
        return path_digest(path)
    except FileNotFoundError:
        raise TakedownError(f"--source {path}: no such file") from None


def copies(storage: Storage, digests: set[str]) -> list[dict]:
    """Every input file, under any path, of any version of any dataset, whose digest is one of `digests`:
    [{"path", "digest", "dataset", "version"}] (the version that consumed it)."""
    from strata.data.dataset import DatasetError, history

    out = []
    for name, is_dir in sorted(list_dir(storage.datasets())):
        if not is_dir:
            continue
        try:
            versions = history(storage, name)
        except DatasetError:
            continue  # a dataset that does not read: its own commands say why
        for v in versions:
            for f in v.manifest.inputs:
                if f.get("digest") in digests:
                    out.append({"path": f["path"], "digest": f["digest"], "dataset": name, "version": v.ref})
    return out


def open_request(storage: Storage, *, reason: str, source: str | None = None, sha256: str | None = None,
                 doc_ids: list[str] | None = None, near: bool = False) -> dict:
    """Record a takedown request and find its documents: the request, as `status` shows it. Its documents are
    those of the file (every copy of it, by digest) or the record ids given, then every document anywhere
    with the same exact key (the same text, up to case and spacing, in a file of other bytes), and, with
    `near`, every document sharing a MinHash band with one of them (pipelines/near.py, the window of each
    dataset's dedup index)."""
    from strata.data.lineage import find_keys

    if sum(x is not None for x in (source, sha256, doc_ids)) != 1:
        raise TakedownError("name what to take down: --source PATH, --sha256 HEX or --doc-ids FILE (one of them)")
    if not reason.strip():
        raise TakedownError("--reason must say why (it is recorded with every commit the takedown makes)")
    received = time.time()
    digests: set[str] = set()
    if source is not None:
        digests.add(digest_of(source))
    elif sha256 is not None:
        hex_ = sha256.lower().removeprefix("sha256:")
        if len(hex_) != 64 or any(c not in "0123456789abcdef" for c in hex_):
            raise TakedownError("--sha256 must be 64 hex digits (what sha256sum prints)")
        digests.add(f"sha256:{hex_}")
    ids = set(doc_ids or [])
    if ids:  # the files the records came from: their digests reach every other copy
        positions: dict[str, set[int]] = {}
        for d in documents(storage, doc_ids=sorted(ids))["documents"]:
            if d["file"].get("digest"):
                digests.add(d["file"]["digest"])
                positions.setdefault(d["file"]["digest"], set()).add(d["position"])
    found = copies(storage, digests) if digests else []
    for path in sorted({c["path"] for c in found}):  # each copy's lineage read once
        if doc_ids is None:  # a whole file: the documents read from each copy, in every dataset's lineage
            ids.update(d["doc_id"] for d in documents(storage, source=_literal(path))["documents"])
    if doc_ids is not None:  # the same records in each copy
        ids.update(f"{c['path']}:{p}" for c in found for p in positions.get(c["digest"], ()))
    located = documents(storage, doc_ids=sorted(ids)) if ids else {"documents": []}
    same_text = find_keys(storage, exact={int(d["exact"]) for d in located["documents"]})["doc_ids"] if ids else []
    by_text = sorted(set(same_text) - ids)
    ids.update(by_text)
    by_near = _near(storage, sorted(ids)) if near and ids else []
    ids.update(by_near)
    located = documents(storage, doc_ids=sorted(ids)) if ids else {"documents": [], "versions": []}
    request = {"id": "", "reason": reason, "received_at": received,
               "asked": {"source": source, "sha256": sha256, "doc_ids": doc_ids, "near": near},
               "digests": sorted(digests), "copies": found, "same_text": by_text, "near": by_near,
               "documents": [{k: d[k] for k in ("doc_id", "source", "position", "exact", "added_in")}
                             for d in located["documents"]],
               "versions": [{"ref": h["ref"], "rows": len(h["rows"])} for h in located["versions"]],
               "events": [{"event": "received", "at": received}]}
    return _create(storage, request)


def _near(storage: Storage, doc_ids: list[str]) -> list[str]:
    """The near copies of `doc_ids` in every dataset (`python -m pipelines.datasets near`: MinHash lives in
    tier 1, which training does not import)."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write("\n".join(doc_ids) + "\n")
        f.flush()
        out = subprocess.run([sys.executable, "-m", "pipelines.datasets", "--storage", storage.root, "near",
                              "--doc-ids", f.name, "--json"], capture_output=True, text=True)
    if out.returncode:
        why = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise TakedownError(f"--near: finding near copies failed ({why})")
    return json.loads(out.stdout.strip().splitlines()[-1])["doc_ids"]


def read(storage: Storage, request_id: str) -> dict:
    """A request as `open` (and each later step) wrote it, its signature verified."""
    from strata.data.storage import check_name

    path = join(storage.root, DIR, f"{check_name(request_id, 'a takedown id')}.json")
    if not exists(path):
        raise TakedownError(f"no takedown request {request_id} under {storage.root} (strata takedown list shows them)")
    request = read_signed(path, "request", "takedown request")
    if request.get("id") != request_id:
        raise TakedownError(f"{path} holds request {request.get('id')!r}, not {request_id}: refused")
    return request


def list_requests(storage: Storage) -> tuple[list[dict], list[dict]]:
    """Every request that verifies, and those refused ({"id", "refused": why}): one bad file hides no other."""
    from strata.data.signing import Untrusted

    out, refused = [], []
    for name, is_dir in sorted(list_dir(join(storage.root, DIR))):
        if not is_dir and name.endswith(".json"):
            try:
                out.append(read(storage, name.removesuffix(".json")))
            except (TakedownError, Untrusted, ValueError) as e:
                refused.append({"id": name.removesuffix(".json"), "refused": str(e)})
    return out, refused


def plan(storage: Storage, request: dict) -> dict:
    """What is left to do for `request`, found again now: each dataset whose newest version still holds its
    documents (one `forget` commit each), every version holding them, each training run that trained on them
    with its first such step, the checkpoints and exports made from then on and what used them (scoring,
    evaluation, generation, serving), and the sweeps that read those versions; each item with the one
    command that finishes it."""
    from strata.accounting.records import list_records
    from strata.data.dataset import DatasetError, resolve

    ids = [d["doc_id"] for d in request["documents"]]
    located = documents(storage, doc_ids=ids) if ids else {"versions": [], "runs": [], "sweeps": []}
    datasets = []
    for name in sorted({h["dataset"] for h in located["versions"]}):
        held = [h for h in located["versions"] if h["dataset"] == name]
        try:
            newest = resolve(storage, name).ref
        except DatasetError:
            newest = None
        open_ = any(h["ref"] == newest for h in held)
        datasets.append({"dataset": name, "versions": [h["ref"] for h in held], "newest": newest,
                         "rows": sum(len(h["rows"]) for h in held if h["ref"] == newest), "done": not open_,
                         "doc_ids": sorted({r["doc_id"] for h in held for r in h["rows"]}),
                         "command": None if not open_ else f"strata takedown apply {request['id']} --dataset {name}"})
    servings = [r for r in list_records(storage) if r["kind"] == "serve"]
    runs = []
    for r in located["runs"]:
        exports = {e.get("path") for e in r["exports"]}
        served = [s["name"] for s in servings for spec in ((s.get("config") or {}).get("models") or {}).values()
                  if isinstance(spec, str) and (spec.partition("@")[0] == r["run"] or spec in exports)]
        command = (f"strata takedown retrain {request['id']} --run && strata takedown delete {request['id']}"
                   if r["first_step"] else None)
        runs.append({**r, "servings": sorted(set(served)), "command": command})
    return {"id": request["id"], "reason": request["reason"], "datasets": datasets, "runs": runs,
            "sweeps": located["sweeps"]}


def plan_text(p: dict) -> str:
    lines = [f"takedown {p['id']}: {p['reason']}"]
    if not p["datasets"]:
        lines.append("no version holds its documents")
    for d in p["datasets"]:
        state = (f"{d['newest']} holds {d['rows']} row(s) of them" if not d["done"]
                 else f"the newest version ({d['newest']}) holds none")
        lines.append(f"dataset {d['dataset']}: {state}; held by {', '.join(d['versions'])}")
        if d["command"]:
            lines.append(f"    finish: {d['command']}")
    for r in p["runs"]:
        if not r["first_step"]:
            lines.append(f"run {r['run']} read {', '.join(r['datasets'])} but has not reached their rows")
            continue
        lines.append(f"run {r['run']} trained on them from step {r['first_step']}: its weights from then on hold what "
                     "it learned from them")
        lines += [f"    checkpoint step {c['step']}  {c['path']}" for c in r["checkpoints"]]
        lines += [f"    export of step {e['step']}  {e['path']}" for e in r["exports"]]
        lines += [f"    used by {u['kind']} {u['name']}" for u in r["used_by"]]
        lines += [f"    served by {s}: stop it, and serve the retrained run" for s in r["servings"]]
        lines.append(f"    finish: {r['command']}")
    lines += [f"sweep {s['sweep']} read {', '.join(s['datasets'])}" for s in p["sweeps"]]
    return "\n".join(lines)


def apply(storage: Storage, request_id: str, *, purge: bool = False, dataset: str | None = None) -> dict:
    """`forget` on every dataset whose newest version still holds the request's documents (or only on
    `dataset`): each under its own lease, one commit each, the request's id and reason in the commit. Each
    commit is an event in the request's timeline; `report` gives each request's time to honor."""
    import subprocess
    import tempfile

    request = read(storage, request_id)
    planned = plan(storage, request)
    todo = [d for d in planned["datasets"] if not d["done"] and dataset in (None, d["dataset"])]
    if dataset and not todo:
        raise TakedownError(f"dataset {dataset}'s newest version holds none of takedown {request_id}'s documents")
    done = []
    for d in todo:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write("\n".join(d["doc_ids"]) + "\n")
            f.flush()
            out = subprocess.run([sys.executable, "-m", "pipelines.datasets", "--storage", storage.root, "forget",
                                  d["dataset"], "--doc-ids", f.name, "--reason",
                                  f"takedown {request_id}: {request['reason']}", "--json",
                                  *(["--purge"] if purge else [])], capture_output=True, text=True)
        if out.returncode:
            why = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise TakedownError(f"forget on dataset {d['dataset']} failed ({why}); "
                                f"rerun strata takedown apply {request_id}") from None
        commit = json.loads(out.stdout.strip().splitlines()[-1])
        request["events"].append({"event": "applied", "at": time.time(), "commit": commit["ref"],
                                  "rows_removed": commit["rows_removed"], "purged": len(commit["purged"])})
        _write(storage, request)  # each commit recorded as it is made
        done.append(commit["ref"])
    marked = mark_runs(storage, request, planned["runs"])
    return {**request, "applied": done, "marked": marked}


def mark_runs(storage: Storage, request: dict, runs: list[dict]) -> list[dict]:
    """Mark each run that trained on the request's documents tainted from its first such step
    (train/taint.py), once; each mark is an event in the request's timeline."""
    from train import taint

    out = []
    for r in runs:
        if not r["first_step"]:
            continue
        run_dir = storage.run(r["run"])
        if any(m["request"] == request["id"] for m in taint.marks(run_dir)):
            continue
        taint.mark(run_dir, request, r["first_step"])
        request["events"].append({"event": "marked", "at": time.time(), "run": r["run"], "from_step": r["first_step"]})
        _write(storage, request)
        out.append({"run": r["run"], "from_step": r["first_step"]})
    return out


def tainted_runs(storage: Storage, request: dict) -> list[dict]:
    """The runs `apply` marked for the request: [{"run", "from_step"}]."""
    return [{"run": e["run"], "from_step": e["from_step"]} for e in request["events"] if e["event"] == "marked"]


def retraining(storage: Storage, request: dict) -> list[dict]:
    """For each tainted run, how to train it again without the documents: from its newest checkpoint before
    the first tainted step (`--init-from RUN@STEP`, for the steps it had left), or from scratch with its model
    and settings when it has none, on the newest version of each dataset it read, which no longer holds them
    (`apply` made it). [{"run", "from_step", "init_from", "dataset", "new_run", "command"}]."""
    from strata.accounting.runlog import read_launches
    from train.checkpoint import read_meta
    from train.committed import committed_checkpoints
    from train.config import TrainConfig
    from train.model import GPTConfig

    out = []
    for t in tainted_runs(storage, request):
        run_dir = storage.run(t["run"])
        launches = read_launches(run_dir)
        if not launches:
            raise TakedownError(f"run {t['run']} has no launch record: its settings are unknown, so it cannot be "
                                "retrained from here")
        config = launches[-1]["config"]
        steps = [int(read_meta(c)["step"]) for c in committed_checkpoints(run_dir)]
        before = max((s for s in steps if s < t["from_step"]), default=None)
        parts = [p.strip() for p in str(config.get("dataset", "")).split(",") if p.strip()]
        datasets = [p.partition(":")[0].partition("@")[0] + (f":{p.partition(':')[2]}" if ":" in p else "")
                    for p in parts]
        train = dict(config.get("train") or {})
        if before is not None:
            train["max_steps"] = max(1, int(train.get("max_steps", 0)) - before)
        new_run = f"{t['run']}-{request['id']}"
        argv = [sys.executable, "-m", "train", *(a for d in datasets for a in ("--dataset", d)), "--run", new_run]
        if before is not None:
            argv += ["--init-from", f"{t['run']}@{before}"]
        else:
            argv += _flags(GPTConfig, config.get("model") or {}, skip={"vocab_size", "seq_len"})
        argv += _flags(TrainConfig, train, skip={"schedule_steps"})
        out.append({"run": t["run"], "from_step": t["from_step"], "init_from": before, "dataset": ",".join(datasets),
                    "new_run": new_run, "command": argv})
    return out


def _flags(cls: type, recorded: dict, skip: set[str]) -> list[str]:
    """The flags that give `cls`'s fields the recorded values that differ from its defaults."""
    import dataclasses

    from strata.commands.cli import flag_of

    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name not in recorded or f.default is dataclasses.MISSING:
            continue
        value = recorded[f.name]
        if value == f.default or isinstance(value, list | tuple) and tuple(value) == tuple(f.default):
            continue
        flag = flag_of(cls, f.name)
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag.removeprefix('--')}")
        elif isinstance(value, list | tuple):
            out += [a for v in value for a in (flag, str(v))]
        else:
            out += [flag, str(value)]
    return out


def retrain(storage: Storage, request_id: str, *, start: bool = False) -> list[dict]:
    """`retraining`'s commands; with `start`, each is run (its output shown as it goes) and recorded as a
    `retrained` event naming the new run."""
    import subprocess

    request = read(storage, request_id)
    todo = retraining(storage, request)
    if not todo:
        raise TakedownError(f"takedown {request_id} tainted no run (strata takedown apply {request_id} marks them)")
    for r in todo:
        if not start:
            continue
        print(f"retraining {r['run']}: {shlex.join(r['command'][1:])}", file=sys.stderr, flush=True)
        if subprocess.run(r["command"], env={**os.environ, "STRATA_STORAGE": storage.root}).returncode:
            raise TakedownError(f"retraining {r['run']} as {r['new_run']} failed (its output is above); rerun "
                                f"strata takedown retrain {request_id} --run: the new run continues")
        request["events"].append({"event": "retrained", "at": time.time(), "run": r["run"], "new_run": r["new_run"]})
        _write(storage, request)
    return todo


def delete_tainted(storage: Storage, request_id: str) -> dict:
    """Delete every checkpoint and export a takedown tainted (from each marked run's first tainted step on):
    what is left of each run is what it learned before it met the documents. Recorded as a `deleted` event."""
    from strata.data.storage import delete_dir
    from train.lineage import made_after

    request = read(storage, request_id)
    gone = []
    for t in tainted_runs(storage, request):
        checkpoints, exports = made_after(storage.run(t["run"]), t["from_step"])
        for item in [*exports, *checkpoints]:
            if exists(item["path"]):
                delete_dir(item["path"])
                gone.append(item["path"])
    request["events"].append({"event": "deleted", "at": time.time(), "paths": gone})
    _write(storage, request)
    return {**request, "deleted": gone}


def report(storage: Storage, since: str | None = None) -> list[dict]:
    """Every request received on or after `since` (YYYY-MM-DD, UTC), oldest first, with its time to honor:
    from its receipt to the last of its datasets' forget commits (None while a dataset still holds them);
    first, any request file that does not verify, with why."""
    import calendar

    start = 0.0
    if since:
        try:
            start = calendar.timegm(time.strptime(since, "%Y-%m-%d"))
        except ValueError:
            raise TakedownError(f"--since {since}: give a date as YYYY-MM-DD") from None
    requests, refused = list_requests(storage)
    out = list(refused)  # named first: a request that does not verify is not counted as honored or open
    for r in sorted(requests, key=lambda r: r["received_at"]):
        if r["received_at"] < start:
            continue
        left = [d["dataset"] for d in plan(storage, r)["datasets"] if not d["done"]]
        applied = [e["at"] for e in r["events"] if e["event"] == "applied"]
        honored = max(applied) if applied and not left else None
        out.append({"id": r["id"], "reason": r["reason"], "received_at": r["received_at"],
                    "honored_at": honored, "hours_to_honor": None if honored is None else
                    round((honored - r["received_at"]) / 3600, 3), "commits": [e["commit"] for e in r["events"]
                                                                               if e.get("commit")],
                    "still_held_by": left})
    return out


def report_text(rows: list[dict]) -> str:
    lines = [f"{'request':<24} {'received (UTC)':<20} {'honored in':>12}  reason"]
    for r in rows:
        if "refused" in r:
            lines.append(f"{r['id']:<24} refused: {r['refused']}")
            continue
        took = f"{r['hours_to_honor']:.2f} h" if r["hours_to_honor"] is not None else (
            f"open: {', '.join(r['still_held_by'])}" if r["still_held_by"] else "nothing held")
        lines.append(f"{r['id']:<24} {time.strftime('%Y-%m-%d %H:%M', time.gmtime(r['received_at'])):<20} "
                     f"{took:>12}  {r['reason']}")
    return "\n".join(lines)


def status_text(request: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(request["received_at"]))
    lines = [f"takedown {request['id']}: {request['reason']}", f"  received   {when}"]
    for e in request["events"][1:]:
        lines.append(f"  {e['event']:<10} {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(e['at']))}"
                     + (f"  {e['commit']}" if e.get("commit") else "")
                     + (f" ({e['rows_removed']} row(s) removed)" if "rows_removed" in e else "")
                     + (f"  run {e['run']} from step {e['from_step']}" if e["event"] == "marked" else "")
                     + (f"  run {e['run']} as {e['new_run']}" if e["event"] == "retrained" else "")
                     + (f"  {len(e['paths'])} checkpoint(s) and export(s)" if e["event"] == "deleted" else ""))
    paths = sorted({c["path"] for c in request["copies"]})
    if request["digests"]:
        lines.append(f"  copies     {len(paths)} file(s) with digest {', '.join(request['digests'])}"
                     + "".join(f"\n               {p}" for p in paths))
    for what, key, how in (("same text", "same_text", "the same text"), ("near", "near", "an edited copy")):
        if request.get(key):
            lines.append(f"  {what:<10} {len(request[key])} document(s) holding {how}, in files of other bytes"
                         + "".join(f"\n               {d}" for d in request[key]))
    lines.append(f"  documents  {len(request['documents'])}"
                 + "".join(f"\n               {d['doc_id']}  (added in {d['added_in']})" for d in request["documents"]))
    lines.append(f"  held by    {', '.join(v['ref'] for v in request['versions']) or 'no version'}")
    return "\n".join(lines)


def _literal(path: str) -> str:
    """`path` as a glob that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)


def _create(storage: Storage, request: dict) -> dict:
    """`request` written under the first free id of its second (`td-YYYYMMDD-HHMMSS-N`): created only where
    nothing is, so two requests opened at once never share one."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(request["received_at"]))
    for n in range(1, 1000):
        request = {**request, "id": f"td-{stamp}-{n}"}
        if write_signed(join(storage.root, DIR, f"{request['id']}.json"), "request", request, exclusive=True):
            return request
    raise TakedownError("more than 999 takedown requests in one second")


def _write(storage: Storage, request: dict) -> None:
    write_signed(join(storage.root, DIR, f"{request['id']}.json"), "request", request)


def main(argv: list[str] | None = None) -> int:
    return Command("python -m strata takedown", argv, tag="takedown").run(_main, user_errors=(ValueError,))


def _main(cmd: Command) -> int:
    p = Parser(prog="python -m strata takedown", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    op = sub.add_parser("open", help="record a request and find every copy of its documents")
    op.add_argument("--source", help="the file to take down (its bytes, under any path, in any dataset)")
    op.add_argument("--sha256", help="instead: the file's SHA-256, as sha256sum prints it")
    op.add_argument("--doc-ids", help="instead: a file of record ids (PATH:POSITION), one a line")
    op.add_argument("--reason", required=True, help="why: recorded with the request and every commit it makes")
    op.add_argument("--near", action="store_true", help="also every near copy (an edited copy): documents sharing "
                    "a MinHash band with them, by each dataset's dedup parameters")
    st = sub.add_parser("status", help="a request's timeline and what it found")
    st.add_argument("id", help="the request's id (td-...)")
    pl = sub.add_parser("plan", help="what is left to do: datasets, runs, checkpoints, exports, uses; a command each")
    pl.add_argument("id", help="the request's id (td-...)")
    ap = sub.add_parser("apply", help="forget the documents in every dataset that holds them, one commit each")
    ap.add_argument("id", help="the request's id (td-...)")
    ap.add_argument("--dataset", help="only this dataset")
    ap.add_argument("--purge", action="store_true", help="also delete every earlier file holding them")
    rt = sub.add_parser("retrain", help="how to retrain each tainted run without the documents (--run: do it)")
    rt.add_argument("id", help="the request's id (td-...)")
    rt.add_argument("--run", action="store_true", help="start the retraining now, each run in turn")
    dl = sub.add_parser("delete", help="delete every checkpoint and export the documents tainted")
    dl.add_argument("id", help="the request's id (td-...)")
    rp = sub.add_parser("report", help="every request with its time to honor")
    rp.add_argument("--since", help="only requests received on or after this date (YYYY-MM-DD, UTC)")
    sub.add_parser("list", help="every request, oldest first")
    for sp in (op, st, pl, ap, rt, dl, rp, sub.choices["list"]):
        sp.add_argument("--storage", help="storage root (default: $STRATA_STORAGE or ~/strata-data)")
        sp.add_argument("--json", action="store_true", help="print JSON instead")
    a = p.parse_args(cmd.argv)
    storage = Storage.from_env(a.storage)
    if a.what == "open":
        ids = None
        if a.doc_ids:
            try:
                with open(a.doc_ids) as f:
                    ids = [line.strip() for line in f if line.strip()]
            except OSError as e:
                raise TakedownError(f"--doc-ids {a.doc_ids}: {e.strerror}") from None
        out = open_request(storage, reason=a.reason, source=a.source, sha256=a.sha256, doc_ids=ids, near=a.near)
    elif a.what == "status":
        out = read(storage, a.id)
    elif a.what == "plan":
        out = plan(storage, read(storage, a.id))
        print(json.dumps(out) if a.json else plan_text(out))
        return 0
    elif a.what == "apply":
        out = apply(storage, a.id, purge=a.purge, dataset=a.dataset)
    elif a.what == "retrain":
        todo = retrain(storage, a.id, start=a.run)
        if a.json:
            print(json.dumps(todo))
        for r in [] if a.json else todo:
            start = f"from {r['run']}@{r['init_from']}" if r["init_from"] is not None else "from scratch"
            print(f"{r['run']} (tainted from step {r['from_step']}): {start} on {r['dataset']}, as run {r['new_run']}"
                  + ("" if a.run else f"\n    {shlex.join(['python', *r['command'][1:]])}"))
        return 0
    elif a.what == "delete":
        out = delete_tainted(storage, a.id)
    elif a.what == "report":
        rows = report(storage, a.since)
        print(json.dumps(rows) if a.json else report_text(rows))
        return 0
    else:
        requests, refused = list_requests(storage)
        out = [*requests, *refused]
        if not a.json:
            for r in requests:
                print(f"{r['id']}  {r['events'][-1]['event']:<10} {len(r['documents']):>5} document(s)  {r['reason']}")
            for r in refused:
                print(f"{r['id']}  refused: {r['refused']}")
            return 0
    print(json.dumps(out) if a.json else status_text(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
