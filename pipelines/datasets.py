"""List datasets and their versions, and show a version's manifest.

    python -m pipelines.datasets list [NAME]
    python -m pipelines.datasets show NAME[@VERSION] [--json]
"""

from __future__ import annotations

import json
import sys
import time

import pyarrow.fs as pafs

from strata.cli import parser as cli_parser
from strata.dataset import DatasetError, list_versions, resolve
from strata.storage import Storage, filesystem


def datasets(storage: Storage) -> list[str]:
    fs, base = filesystem(storage.datasets())
    infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory and list_versions(storage, i.base_name))


def main(argv: list[str] | None = None) -> None:
    parser = cli_parser("python -m pipelines.datasets", __doc__, json_summary=False)
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="datasets, or one dataset's committed versions")
    ls.add_argument("name", nargs="?")
    show = sub.add_parser("show", help="a version's manifest (latest if no @VERSION)")
    show.add_argument("ref", help="NAME or NAME@VERSION")
    show.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    args = parser.parse_args(argv)
    storage = Storage.from_env(args.storage)
    try:
        if args.command == "list" and not args.name:
            for name in datasets(storage):
                print(f"{name:<24} {len(list_versions(storage, name))} version(s)")
        elif args.command == "list":
            versions = list_versions(storage, args.name)
            if not versions:
                raise DatasetError(f"dataset {args.name!r} has no committed version under {storage.datasets()}")
            print(f"{'version':<9}{'created (UTC)':<21}{'kept docs':>11}{'tokens':>14}{'rows':>11}{'shards':>8}")
            for v in versions:
                m = resolve(storage, f"{args.name}@{v}").manifest
                created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m.created_at))
                print(f"{v:<9}{created:<21}{m.documents.kept:>11,}{m.tokens:>14,}"
                      f"{sum(s.rows for s in m.shards):>11,}{len(m.shards):>8}")
        else:
            v = resolve(storage, args.ref)
            m = v.manifest
            if args.json:
                print(json.dumps(m.to_dict(), indent=2))
                return
            t = m.tokenizer
            print(f"{v.ref}  {v.path}\ntokenizer {t.kind} vocab {t.vocab_size} eot {t.eot_id} hash {t.hash}\n"
                  f"seq_len {m.seq_len} dtype {m.dtype}; {len(m.inputs)} input files; "
                  f"rows train {m.rows('train'):,} validation {m.rows('validation'):,} in {len(m.shards)} shards")
            if m.stats:
                from pipelines.preprocess import format_table

                print(format_table(m.stats))
    except DatasetError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
