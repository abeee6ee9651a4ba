"""Sign a sweep's saved Tune state again, explicitly, after it verifies under the old secret you name:

    python -m tune.convert SWEEP_DIR --old-secret-file FILE

Tune unpickles its experiment state when a sweep resumes, so `--resume` refuses state whose signatures name
no key (strata's format before 2026-12-04, which a Ray token could verify). If you trust the sweep, this
checks every file Tune would unpickle against the signature made with FILE's secret, and only then signs
them with this machine's key. Nothing is unpickled here.
"""

from __future__ import annotations

import json
import sys

from strata.commands.cli import parser as cli_parser
from strata.commands.shell import StrataError
from strata.data import signing
from strata.data.signing import Untrusted
from strata.data.storage import join, list_dir, read_bytes


def resign(sweep_dir: str, old: bytes) -> list[str]:
    """The files re-signed (strata-signatures-<what>.json, each verified first)."""
    from tune.trust import SIGNATURES, sign_files, unpickled

    signing.secret()  # refuse before anything is written without a key
    done = []
    for name, is_dir in sorted(list_dir(sweep_dir)):
        if is_dir or not (name.startswith(SIGNATURES) and name.endswith(".json")):
            continue
        try:
            listed = json.loads(read_bytes(join(sweep_dir, name)))
            files = listed["files"]
        except (ValueError, KeyError, TypeError):
            raise Untrusted(f"{join(sweep_dir, name)} is not a list of signatures; refused") from None
        if listed.get("key"):
            continue  # signed by a key already: checked as it is
        for f, sig in files.items():
            if not unpickled(f) or not signing.verify_with(old, read_bytes(join(sweep_dir, f)), sig):
                raise Untrusted(f"{join(sweep_dir, f)} does not verify under the secret of --old-secret-file: not "
                                "signed with it, or changed since; nothing was signed")
        done.append((name, sorted(files)))
    for name, files in done:
        sign_files(sweep_dir, files, name[len(SIGNATURES):-len(".json")])
    return [name for name, _ in done]


def main(argv: list[str] | None = None) -> int:
    p = cli_parser("python -m tune.convert", __doc__, json_summary=False)
    p.add_argument("sweep_dir", help="the sweep's directory (under the storage root's sweeps/)")
    p.add_argument("--old-secret-file", required=True, help="the secret the state was signed with")
    a = p.parse_args(argv)
    old = signing.read_secret(a.old_secret_file)
    if old is None:
        sys.exit(f"error: --old-secret-file {a.old_secret_file}: no such file, or it is empty")
    try:
        done = resign(a.sweep_dir.rstrip("/"), old)
    except (StrataError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"signed {len(done)} list(s) of sweep state with key {signing.key_id()}: {', '.join(done) or 'none needed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
