"""The signing keys this machine trusts (strata.data.signing):

    python -m strata keys show [--json]
    python -m strata keys trust FILE --fingerprint FP
    python -m strata keys rotate

`show` names this machine's key by fingerprint, where it comes from, and the keyring's keys. `trust` adds
another cluster's key to the keyring, so that what it signed (a run trained there) verifies here: FILE holds
its secret (`-` reads it from stdin), and the fingerprint the cluster shows (`strata keys show` there) must
match, so a wrong or swapped file is refused before it is trusted. `rotate` replaces this machine's key file
with a new secret and keeps the old one in the keyring: what it signed still verifies.
"""

from __future__ import annotations

import json
import os
import secrets
import sys

from strata.commands.shell import Command, Parser, StrataError, log
from strata.data import signing

_log = log("keys")


def show() -> dict:
    try:
        mine = {"fingerprint": signing.key_id(), "from": signing.source()[0]}
    except signing.NoKey as e:
        mine = {"fingerprint": None, "from": None, "why": str(e)}
    ring = [signing.fingerprint_of_secret(v) for v in signing.keyring_secrets()]
    return {"key": mine, "keyring": {"path": signing.keyring_path(), "keys": ring}}


def trust(path: str, expected: str) -> str:
    value = sys.stdin.buffer.read().strip() if path == "-" else signing.read_secret(path)
    if not value:
        raise StrataError(f"{path}: no such file, or it is empty: it should hold the other cluster's signing secret")
    found = signing.fingerprint_of_secret(value)
    if found != expected.strip().lower():
        raise StrataError(f"{path} holds the key {found}, not {expected}: refused (ask that cluster for its key "
                          "again: `strata keys show` there names it)")
    ring = signing.keyring_path()
    if found in {signing.fingerprint_of_secret(v) for v in signing.keyring_secrets()}:
        return f"key {found} is already in the keyring ({ring})"
    _append(ring, value)
    return f"trusted key {found}: added to the keyring ({ring}); what it signed now verifies here"


def _append(ring: str, value: bytes) -> None:
    os.makedirs(os.path.dirname(ring), mode=0o700, exist_ok=True)
    fd = os.open(ring, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "ab") as f:
        f.write(value + b"\n")
    os.chmod(ring, 0o600)


def rotate() -> str:
    where, path = signing.source()
    if not path:
        raise StrataError(f"the key comes from {where}: rotate it where it is set (a new secret there, the old one "
                          f"as a line of {signing.keyring_path()})")
    old = signing.read_secret(path)
    new = secrets.token_hex(32).encode()
    if old:
        _append(signing.keyring_path(), old)
    signing.write_secret(path, new, replace=True)
    before = signing.fingerprint_of_secret(old) if old else "none"
    return (f"rotated the key in {path}: {before} -> {signing.fingerprint_of_secret(new)}; the old key stays in the "
            f"keyring ({signing.keyring_path()}), so what it signed still verifies. A cluster's nodes take the new "
            "key from their provisioned file: update the Secret or file mount they read")


def main(argv: list[str]) -> int:
    return Command("python -m strata keys", argv, tag="keys").run(_main)


def _main(cmd: Command) -> int:
    p = Parser(prog="python -m strata keys", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("show", help="this machine's key (by fingerprint) and the keyring's")
    s.add_argument("--json", action="store_true", help="print it as JSON")
    t = sub.add_parser("trust", help="add another cluster's key to the keyring, checked by its fingerprint")
    t.add_argument("file", help="a file holding that key's secret (- for stdin)")
    t.add_argument("--fingerprint", required=True, help="the key's fingerprint, as `strata keys show` there says it")
    sub.add_parser("rotate", help="a new key in this machine's key file; the old one kept in the keyring")
    a = p.parse_args(cmd.argv)
    if a.command == "show":
        shown = show()
        if a.json:
            print(json.dumps(shown))
            return 0
        k = shown["key"]
        print(f"key: {k['fingerprint']} (from {k['from']})" if k["fingerprint"] else f"key: none ({k['why']})")
        ring = shown["keyring"]
        print(f"keyring: {', '.join(ring['keys']) if ring['keys'] else 'empty'} ({ring['path']})")
        return 0 if k["fingerprint"] else 1
    _log.info(trust(a.file, a.fingerprint) if a.command == "trust" else rotate())
    return 0
