"""List datasets and their versions, and show a version's manifest.

    python -m pipelines.datasets list [NAME]
    python -m pipelines.datasets show NAME[@VERSION] [--json]
    python -m pipelines.datasets delete NAME@VERSION
    python -m pipelines.datasets forget NAME (--doc-ids FILE | --source GLOB) --reason TEXT [--purge] [--json]
    python -m pipelines.datasets near --doc-ids FILE [--json]

A dataset is a Delta Lake table; a version is one of its commits, a snapshot:
every shard of the versions before it plus what its own run added. `show` says
which version added which shards. Only the newest version can be deleted (every
later snapshot references the earlier shards): a Delta commit removes the files
its run added, then they are deleted, and the input files it consumed count as
new again. A dataset of the format before Delta Lake is listed as such:
convert it with `python -m strata migrate NAME`. `forget` is a takedown: it
removes documents from the newest version in one commit and keeps them from
ever being ingested again (pipelines/forget.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from strata.commands.cli import parser as cli_parser
from strata.commands.shell import EXIT_BUSY, Command
from strata.data.commit import delete_version
from strata.data.dataset import DatasetError, history, latest, resolve
from strata.data.lease import LeaseBusy
from strata.data.storage import Storage, list_dir


def datasets(storage: Storage) -> list[tuple[str, str]]:
    """(name, what it holds) of every dataset: its newest version and how many it has, or why it cannot
    be read (a dataset of the format before Delta Lake says how to convert it)."""
    out = []
    for name, d in list_dir(storage.datasets()):
        if not d:
            continue
        try:
            newest = latest(storage, name)
        except DatasetError as e:
            out.append((name, str(e)))
            continue
        if newest:
            out.append((name, f"{newest.manifest.totals.get('versions', 1)} version(s), newest {newest.manifest.version}"))
    return out


def dedup_scope(dedup: dict) -> str:
    """What a version's run deduplicated against, in a line: its window and the versions in it, and the
    --dedup-against dataset ("" for a version made before windows)."""
    w, a = dedup.get("window"), dedup.get("against")
    parts = []
    if isinstance(w, dict) and w.get("size") == "all":
        parts.append(f"every earlier version ({w.get('earlier_versions', 0)}; --dedup-window all)")
    elif isinstance(w, dict):
        vs = [v for v in w.get("versions") or [] if isinstance(v, str)]
        span = f"{len(vs)} so far: {vs[0]}" + (f" to {vs[-1]}" if len(vs) > 1 else "") if vs else "none before this one"
        parts.append(f"the last {w.get('size')} versions (--dedup-window), {span}")
    if isinstance(a, dict):
        parts.append(f"dataset {a.get('dataset')} (--dedup-against; {a.get('removed', 0):,} documents removed as in it)")
    return "deduplicated against " + " and ".join(parts) if parts else ""


def _forget(storage: Storage, args) -> None:
    from pipelines.forget import forget

    ids = None
    if args.doc_ids:
        try:
            with open(args.doc_ids) as f:
                ids = [line.strip() for line in f if line.strip()]
        except OSError as e:
            raise DatasetError(f"--doc-ids {args.doc_ids}: {e.strerror}") from None
    out = forget(storage, args.name, doc_ids=ids, source=args.source, reason=args.reason, purge=args.purge)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['ref']}: forgot {len(out['documents'])} document(s) ({out['reason']}): {out['rows_removed']} row(s) "
          f"removed from {out['shards_rewritten']} shard(s); the forget list keeps them out of every later run")
    for d in out["documents"]:
        print(f"  {d}")
    if out["not_in_any_version"]:
        print(f"in no version (added to the forget list only): {', '.join(out['not_in_any_version'])}")
    if out["co_packed"]:
        print(f"{len(out['co_packed'])} other document(s) shared those rows and lost "
              f"{sum(c['tokens_lost'] for c in out['co_packed']):,} tokens (listed in the commit)")
    for r in out["runs"]:
        steps = f"from step {r['first_step']}" if r["first_step"] else "(not reached yet)"
        print(f"learned from them: run {r['run']} {steps}; checkpoints "
              f"{', '.join(str(c['step']) for c in r['checkpoints']) or 'none'}; exports "
              f"{', '.join(e['path'] for e in r['exports']) or 'none'}"
              + "".join(f"; used by {u['kind']} {u['name']}" for u in r["used_by"]))
    for s in out["sweeps"]:
        print(f"read them: sweep {s['sweep']} ({', '.join(s['datasets'])})")
    if out.get("finished"):
        print(f"finished the purge of {', '.join(out['finished'])}, which a crash had cut short")
    if out["purged"]:
        print(f"purged {len(out['purged'])} file(s): earlier versions holding them can no longer be read")
    if out["scrubbed"]:
        print(f"removed their text samples from {len(out['scrubbed'])} rejects report(s)")


def main(argv: list[str] | None = None) -> None:
    Command("python -m pipelines.datasets", argv).run(_main)


def _main(cmd: Command) -> None:
    parser = cli_parser("python -m pipelines.datasets", __doc__, json_summary=False)
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="datasets, or one dataset's committed versions")
    ls.add_argument("name", nargs="?")
    show = sub.add_parser("show", help="a version's manifest (latest if no @VERSION)")
    show.add_argument("ref", help="NAME or NAME@VERSION")
    show.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    rm = sub.add_parser("delete", help="delete the newest version (a Delta commit removes its files, then they go)")
    rm.add_argument("ref", help="NAME@VERSION")
    fg = sub.add_parser("forget", help="remove documents from the newest version for good (a takedown)")
    fg.add_argument("name", help="the dataset")
    which = fg.add_mutually_exclusive_group(required=True)
    which.add_argument("--doc-ids", help="a file of record ids (PATH:POSITION, as lineage names them), one a line")
    which.add_argument("--source", help="every document of the input files matching this glob")
    fg.add_argument("--reason", required=True, help="why (a claim, an erasure request): the commit records it")
    fg.add_argument("--purge", action="store_true",
                    help="also delete every earlier file holding their tokens, and their text samples in the rejects "
                         "reports: earlier versions then cannot be read")
    fg.add_argument("--json", action="store_true", help="print what was done as JSON")
    nr = sub.add_parser("near", help="the documents of every dataset that share a MinHash band with these")
    nr.add_argument("--doc-ids", required=True, help="a file of record ids (PATH:POSITION), one a line")
    nr.add_argument("--json", action="store_true", help="print the result as JSON")
    for p in sub.choices.values():  # --storage after the subcommand too (not overriding one given before it)
        p.add_argument("--storage", default=argparse.SUPPRESS, help="storage root (default: $STRATA_STORAGE)")
    args = parser.parse_args(cmd.argv)
    storage = Storage.from_env(args.storage)
    try:
        if args.command == "forget":
            _forget(storage, args)
            return
        if args.command == "near":
            from pipelines.near import near_copies
            from strata.data.storage import text_of

            out = near_copies(storage, [x for x in text_of(args.doc_ids, "--doc-ids").split("\n") if x.strip()])
            print(json.dumps(out) if args.json else "\n".join(out["doc_ids"]))
            return
        if args.command == "list" and not args.name:
            for name, what in datasets(storage):
                print(f"{name:<24} {what}")
        elif args.command == "list":
            versions = history(storage, args.name)
            if not versions:
                raise DatasetError(f"dataset {args.name!r} has no committed version under {storage.datasets()}")
            print(f"{'version':<9}{'created (UTC)':<21}{'added docs':>11}{'added rows':>11}"
                  f"{'snapshot rows':>14}{'shards':>8}")
            for v in versions:
                m = v.manifest
                created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m.created_at))
                rows = m.totals.get("rows", {})
                added = f"-{m.forget.get('rows_removed', 0):,}" if m.forget else f"{sum(s.rows for s in v.added):,}"
                print(f"{m.version:<9}{created:<21}{m.documents.kept:>11,}{added:>11}"
                      f"{sum(rows.values()):>14,}{m.totals.get('shards', 0):>8}"
                      + (f"  forget: {m.forget.get('reason')}" if m.forget else ""))
        elif args.command == "delete":
            name, _, version = args.ref.partition("@")
            if not version:
                raise DatasetError("name the version to delete: NAME@VERSION")
            for gone in delete_version(storage, name, version):
                print(f"deleted {gone}")
            print(f"deleted {args.ref}")
        else:
            v = resolve(storage, args.ref)
            m = v.manifest
            if args.json:
                print(json.dumps(m.to_dict(), indent=2))
                return
            t = m.tokenizer
            print(f"{v.ref}  {v.path}\ntokenizer {t.kind} vocab {t.vocab_size} eot {t.eot_id} hash {t.hash}\n"
                  f"seq_len {m.seq_len} dtype {m.dtype}; snapshot of {m.totals.get('versions', 1)} version(s): "
                  f"rows train {v.rows('train'):,} validation {v.rows('validation'):,} in {len(v.shards)} shards")
            print(f"{'shards by version':<20}{'shards':>8}{'rows':>12}{'tokens':>14}  files")
            for added_in in sorted({s.version for s in v.shards}):
                mine = [s for s in v.shards if s.version == added_in]
                where = sorted({s.path.rsplit("/", 1)[0] for s in mine})
                print(f"{added_in:<20}{len(mine):>8}{sum(s.rows for s in mine):>12,}"
                      f"{sum(s.tokens for s in mine):>14,}  {', '.join(where)}")
            if m.forget:
                f = m.forget
                print(f"a takedown ({f.get('reason')}): {len(f.get('doc_ids') or [])} document(s) forgotten, "
                      f"{f.get('rows_removed', 0):,} row(s) removed; {len(f.get('co_packed') or [])} other document(s) "
                      "lost the tokens they had in those rows")
            else:
                print(f"this version's run: {m.documents.kept:,} documents kept of {m.documents.read:,} read, "
                      f"{len(m.inputs)} input files")
            if line := dedup_scope(m.dedup):
                print(line)
            if m.stats:
                from pipelines.stats import format_table

                print(format_table(m.stats))
    except LeaseBusy as e:  # a run is building on the dataset: deleting under it would lose its documents
        print(f"error: {e}: {args.command} once that run has ended", file=sys.stderr)
        sys.exit(EXIT_BUSY)


if __name__ == "__main__":
    main()
