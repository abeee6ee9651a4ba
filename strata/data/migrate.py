"""Convert a dataset of strata's format before Delta Lake (a `vNNNN/manifest.json` per version) into
a Delta table, in place:

    python -m strata migrate NAME [--storage ROOT]

Each old version becomes the Delta commit of its number, with the same shards (referenced where they
are, not copied: Delta readers read their unsigned ids as the table's signed type), the same document
accounting, inputs, run record and dedup index. strata's own files of each run (tails, dedup index,
rejects, tokenizer) are copied from `data/<run>/` to `_strata/<run>/`, where Delta's vacuum leaves
them alone. The old manifests and those files go only after the last commit. It holds the dataset's
lease, and a migration that stops half way continues where it stopped when run again.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from strata.data.commit import add_actions, app_transactions, create_table, write_commit
from strata.data.dataset import (
    LEGACY_MANIFEST,
    LEGACY_VERSION_RE,
    RUN_APP,
    SCHEMA_VERSION,
    DatasetError,
    Manifest,
    Shard,
    TokenizerInfo,
    label,
    open_table,
)
from strata.data.lease import Lease
from strata.data.storage import (
    Storage,
    check_name,
    delete,
    delete_dir,
    exists,
    filesystem,
    join,
    list_dir,
    list_files,
    read_json,
)


def _moved(path: str) -> str:
    """A run's own file, from `data/<run>/...` to `_strata/<run>/...` (shards stay where they are)."""
    return "_strata/" + path[len("data/"):] if path.startswith("data/") else path


def _converted(old: dict, number: int, parent: str) -> tuple[Manifest, list[Shard]]:
    """An old manifest as the manifest of Delta version `number`, and the shards its run added."""
    d = {k: v for k, v in old.items() if k != "shards"}
    added = [Shard(**s) for s in old["shards"] if s["version"] == old["version"]]
    d.update(version=label(number), parent=parent, schema_version=SCHEMA_VERSION, files=_moved(d.get("files", "")),
             rejects=_moved(d.get("rejects", "")), tails=_moved(d.get("tails", "")))
    d["tokenizer"] = {**d["tokenizer"], "file": _moved(d["tokenizer"].get("file", ""))}
    dedup = dict(d.get("dedup", {}))
    for key in ("audit", "removed"):
        if dedup.get(key):
            dedup[key] = _moved(dedup[key])
    if "files" in dedup:
        dedup["files"] = {t: [_moved(p) for p in ps] for t, ps in dedup["files"].items()}
    if "index" in dedup:
        dedup["index"] = {t: [{**seg, "files": [{**f, "path": _moved(f["path"])} for f in seg["files"]]}
                              for seg in segs] for t, segs in dedup["index"].items()}
    d["dedup"] = dedup
    return Manifest.from_dict(d), added


def migrate(storage: Storage, name: str, say=print) -> list[str]:
    """Convert dataset `name`; returns the versions it committed (`vNNNN`, old number -> new if a
    number changed)."""
    path = storage.dataset(name)
    with Lease(path, f"dataset {name}", purpose="migrate").acquire(wait=False):
        old = sorted((int(m.group(1)), n) for n, d in list_dir(path)
                     if d and (m := LEGACY_VERSION_RE.match(n)) and exists(join(path, n, LEGACY_MANIFEST)))
        if not old:
            raise DatasetError(f"dataset {name!r} ({path}) has no version in the format before Delta Lake: "
                               "nothing to migrate")
        manifests = [_checked(read_json(join(path, n, LEGACY_MANIFEST)), join(path, n, LEGACY_MANIFEST), n)
                     for _, n in old]
        table, done, parent, runs = open_table(path), [], "", []
        for m in manifests:
            tag = m["files"].split("/", 1)[1]
            runs.append((tag, m))
            if table is not None and (number := table.transaction_version(RUN_APP + tag)) is not None:
                parent = label(number)  # committed by a migration that stopped later
                continue
            number = table.version() + 1 if table is not None else 1
            manifest, added = _converted(m, number, parent)
            _copy_own_files(path, tag, {s.path for s in added}, m["version"])
            added = [replace(s, bytes=_size(join(path, s.path)), version=manifest.version) for s in added]
            if table is None:
                tok = TokenizerInfo(**{**m["tokenizer"], "file": manifest.tokenizer.file})
                table = create_table(path, name, tok, manifest.seq_len, manifest.dtype)
            write_commit(table, manifest.dtype, add_actions(added, number),
                         {"manifest": manifest.to_dict(), "deleted": []}, app_transactions(tag, manifest.run_id, number))
            table = open_table(path)
            parent = manifest.version
            done.append(m["version"] if m["version"] == parent else f"{m['version']} -> {parent}")
            say(f"{name}@{done[-1]}: {len(added)} shards, {manifest.documents.kept:,} documents kept")
        for tag, m in runs:  # the old layout: each run's own files (now copied), then the manifests
            shards = {s["path"] for s in m["shards"] if s["version"] == m["version"]}
            for rel in list_files(join(path, "data", tag)):
                if "/" in rel:  # a directory of its own (shards are at the top)
                    delete_dir(join(path, "data", tag, rel.split("/", 1)[0]))
                elif f"data/{tag}/{rel}" not in shards:
                    delete(join(path, "data", tag, rel))
            delete(join(path, f"{m['version']}.record.json"))
        for _, n in old:
            delete_dir(join(path, n))
        return done


def _checked(m, where: str, dirname: str) -> dict:
    """A legacy manifest whose paths stay inside its own run's directory: `files` is `data/<run>`, each
    shard `data/<run>/<file>`, and the version its directory's; anything else is refused, naming the file,
    before anything is copied or deleted."""
    def refuse(what: str):
        return DatasetError(f"{where}: {what}; refused (nothing was migrated or deleted)")

    if not isinstance(m, dict) or m.get("version") != dirname:
        raise refuse(f"it is not the manifest of {dirname}")
    files = m.get("files")
    tag = files[len("data/"):] if isinstance(files, str) and files.startswith("data/") else ""
    try:
        check_name(tag, "run directory")
    except ValueError:
        raise refuse(f"its files field {files!r} is not data/<run>") from None
    shards = m.get("shards")
    if not isinstance(shards, list) or not all(isinstance(x, dict) for x in shards):
        raise refuse("its shards are not a list of shards")
    for x in shards:
        parts = x.get("path").split("/") if isinstance(x.get("path"), str) else []
        if x.get("version") == dirname and (len(parts) != 3 or parts[:2] != ["data", tag]):
            raise refuse(f"it names the shard {x.get('path')!r}, which is not a file of data/{tag}/")
    if not isinstance(m.get("tokenizer"), dict):
        raise refuse("it has no tokenizer")
    for key in ("rejects", "tails"):
        if m.get(key) and not (isinstance(m[key], str) and m[key].startswith(f"data/{tag}/")
                               and ".." not in m[key].split("/")):
            raise refuse(f"its {key} {m[key]!r} is not under data/{tag}/")
    return m


def _copy_own_files(path: str, tag: str, shards: set[str], version: str) -> None:
    """Every file of run `tag` that is not one of its shards, to `_strata/<tag>/` (copied: the old
    manifests still name them until the migration ends)."""
    for rel in list_files(join(path, "data", tag)):
        if f"data/{tag}/{rel}" not in shards:
            fs, src = filesystem(join(path, "data", tag, rel))
            dst = filesystem(join(path, "_strata", tag, rel))[1]
            _parent_dirs(fs, dst)
            fs.copy_file(src, dst)
    record = join(path, f"{version}.record.json")
    if exists(record):
        fs, src = filesystem(record)
        dst = filesystem(join(path, "_strata", tag, "record.json"))[1]
        _parent_dirs(fs, dst)
        fs.copy_file(src, dst)


def _size(path: str) -> int:
    fs, p = filesystem(path)
    return fs.get_file_info(p).size


def _parent_dirs(fs, path: str) -> None:
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strata migrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="the dataset to convert")
    parser.add_argument("--storage", help="storage root (default: $STRATA_STORAGE, else ~/strata-data)")
    args = parser.parse_args(argv)
    from strata.data.lease import LeaseBusy

    try:
        done = migrate(Storage.from_env(args.storage), args.name)
    except (DatasetError, LeaseBusy) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.name}: {len(done)} version(s) now in the Delta table")
    return 0
