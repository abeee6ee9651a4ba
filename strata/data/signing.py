"""strata's signing key: the one secret that verifies what strata reads back from a run folder.

Only a signing key verifies, never a Ray token: a token is for reaching the cluster, and every token holder
can read what a job's runtime env carries. The key is, in this order:

- `STRATA_SIGNING_KEY` (the secret itself: for a process that is handed it, never set by strata), else
- the file `STRATA_SIGNING_KEY_FILE` names (how a cluster gets its key: a Kubernetes Secret mounted in
  every pod, a file mount of `cluster.yaml`, a file on Slurm's shared home), else
- `~/.strata/signing-key`.

A laptop's embedded Ray (`strata.cluster.connect`) and `strata head start` make `~/.strata/signing-key` (0600, 32
random bytes) on first use. Nothing else makes a key: a driver that joins a cluster which has none refuses
to start (`require_key`), and a worker without one refuses to sign, in one line, instead of minting a key
nobody else holds.

Every signature records its key's fingerprint (12 hex digits, nothing of the key). Earlier or other
clusters' keys go in a keyring, `STRATA_SIGNING_KEYRING` (a file) or `~/.strata/keyring`: one secret per
line, each of which verifies what it signed. `strata keys show|trust|rotate` manages them
(strata/commands/keys.py). A signature that names no key (checkpoints and sweep state of the format before
2026-12-04, which a Ray token could verify) is refused; `python -m train.convert` and `python -m
tune.convert` take one explicitly, with the old secret the user names.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from strata.errors import StrataError

KEY_ENV = "STRATA_SIGNING_KEY"
KEY_FILE_ENV = "STRATA_SIGNING_KEY_FILE"
KEYRING_ENV = "STRATA_SIGNING_KEYRING"
LOCAL_KEY = "~/.strata/signing-key"
KEYRING = "~/.strata/keyring"
PROVISIONING = "docs/security.md: a Kubernetes Secret, a file mount of cluster.yaml, or a file on Slurm"


class Untrusted(StrataError):
    """A file is not signed by a key this machine holds, or does not match its signature."""


class NoKey(Untrusted):
    """This machine holds no signing key."""


def read_secret(path: str) -> bytes | None:
    """A secret file's bytes, stripped (None: no such file, or it is empty)."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read().strip() or None


def source() -> tuple[str, str]:
    """(where the key comes from, in words; the path of its file, or '' for the environment variable)."""
    if os.environ.get(KEY_ENV):
        return f"${KEY_ENV}", ""
    if path := os.environ.get(KEY_FILE_ENV):
        return f"${KEY_FILE_ENV} ({path})", os.path.expanduser(path)
    path = os.path.expanduser(LOCAL_KEY)
    return path, path


def has_key() -> bool:
    try:
        secret()
    except NoKey:
        return False
    return True


def secret() -> bytes:
    """This machine's signing secret (see the module's doc); NoKey, in one line, if it holds none."""
    if value := os.environ.get(KEY_ENV, "").strip():
        return value.encode()
    if path := os.environ.get(KEY_FILE_ENV):
        if (value := read_secret(path)) is None:
            raise NoKey(f"{KEY_FILE_ENV}={path}: no such file, or it is empty: this node holds no signing key "
                        f"(provision one: {PROVISIONING})")
        return value
    if (value := read_secret(LOCAL_KEY)) is None:
        raise NoKey(f"no signing key on this machine ({KEY_FILE_ENV} unset, no {LOCAL_KEY}): a laptop makes one "
                    f"on its first embedded run; a cluster gets one provisioned ({PROVISIONING})")
    return value


def ensure_local_key() -> None:
    """Make `~/.strata/signing-key` (0600) when no key is configured: for this machine's own Ray (an embedded
    one, or `strata head start`), never on a node of a cluster someone provisioned."""
    if os.environ.get(KEY_ENV) or os.environ.get(KEY_FILE_ENV):
        return
    path = os.path.expanduser(LOCAL_KEY)
    if read_secret(path) is not None:
        return
    write_secret(path, secrets.token_hex(32).encode())


def write_secret(path: str, value: bytes, *, replace: bool = False) -> None:
    """A secret file only its owner reads (0600, in a 0700 folder); created exclusively unless `replace`."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    if replace:
        tmp = f"{path}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(value + b"\n")
        os.replace(tmp, path)
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # another process made it first
        return
    with os.fdopen(fd, "wb") as f:
        f.write(value + b"\n")


def require_key(where: str) -> None:
    """Refuse, in one line, to go on without a signing key (a driver joining the cluster at `where`)."""
    try:
        secret()
    except NoKey as e:
        raise NoKey(f"{where} holds no signing key, so nothing its runs write could be verified: {e}") from None


def derive(value: bytes) -> bytes:
    return hmac.new(value, b"strata file signatures v1", hashlib.sha256).digest()


def fingerprint(k: bytes) -> str:
    """A key's public name: 12 hex digits that say which key signed, and nothing of the key."""
    return hashlib.sha256(b"strata key fingerprint\0" + k).hexdigest()[:12]


def fingerprint_of_secret(value: bytes) -> str:
    return fingerprint(derive(value.strip()))


def key() -> bytes:
    return derive(secret())


def key_id() -> str:
    return fingerprint(key())


def keyring_path() -> str:
    return os.path.expanduser(os.environ.get(KEYRING_ENV) or KEYRING)


def keyring_secrets() -> list[bytes]:
    path = keyring_path()
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        return [line.strip() for line in f.read().splitlines() if line.strip() and not line.startswith(b"#")]


def keyring() -> dict[str, bytes]:
    """Every key that verifies here, by fingerprint: this machine's, then the keyring's."""
    try:
        ring = {key_id(): key()}
    except NoKey:
        ring = {}
    for value in keyring_secrets():
        k = derive(value)
        ring.setdefault(fingerprint(k), k)
    return ring


def sign(data: bytes) -> str:
    return hmac.new(key(), data, hashlib.sha256).hexdigest()


def signature(data: bytes) -> dict:
    """{"key": this key's fingerprint, "signature": its HMAC of `data`}, to store beside what it signs."""
    return {"key": key_id(), "signature": sign(data)}


def verify_with(value: bytes, data: bytes, sig) -> bool:
    """Whether `sig` is the HMAC of `data` under the key of secret `value` (for an explicit conversion)."""
    return isinstance(sig, str) and hmac.compare_digest(hmac.new(derive(value), data, hashlib.sha256).hexdigest(), sig)


def check(data: bytes, sig, what: str, signed_by, convert: str = "") -> None:
    """Raise Untrusted unless `sig` is the signature of `data` by the key `signed_by` names, a key of this
    machine's keyring. A signature that names no key is refused, naming the command that converts it."""
    if not isinstance(sig, str) or not sig:
        raise Untrusted(f"{what} is not signed: strata signs what it writes, so it was not written by strata "
                        "(or was written before signing existed); refused")
    if not isinstance(signed_by, str) or not signed_by:
        raise Untrusted(f"{what} is signed without a key fingerprint (strata's format before 2026-12-04, which a "
                        f"Ray token could verify): refused. If you trust it, {convert or 'convert it'}")
    ring = keyring()
    if signed_by not in ring:
        have = f"key {key_id()}" if ring and has_key() else "no key"
        raise Untrusted(f"{what} was signed with key {signed_by}; this machine has {have}"
                        f"{' (and a keyring of ' + str(len(ring) - 1) + ')' if len(ring) > 1 else ''}: add that key "
                        f"to the keyring with `strata keys trust FILE --fingerprint {signed_by}` (FILE: its secret, "
                        f"from the cluster that signed), or set {KEY_FILE_ENV} to it")
    if not hmac.compare_digest(hmac.new(ring[signed_by], data, hashlib.sha256).hexdigest(), sig):
        raise Untrusted(f"{what} does not match its signature by key {signed_by}: it was changed after it was "
                        "written; refused")
