"""strata's signing key: signatures over the files strata reads back, with the key's fingerprint.

Checkpoints hold no pickle (train/checkpoint.py), so loading one is safe without any key; their
signatures say the files are the ones strata wrote. Ray Tune's sweep state is still pickled by Tune
(tune/trust.py): those files are refused unless signed.

The key is strata's own, never whichever token file exists first:

- `STRATA_SIGNING_KEY` (the secret itself), else
- the file `STRATA_SIGNING_KEY_FILE` names, else
- `~/.strata/signing-key`, created (0600, 32 random bytes) on first use.

`strata submit` passes the submitter's key to the job's environment, so the cluster's nodes sign and
check with it. Each signature records its key's fingerprint. Earlier keys go in a keyring,
`STRATA_SIGNING_KEYRING` (a file) or `~/.strata/keyring`: one secret per line, each of which verifies
what it signed.

Signatures made before fingerprints (checkpoints of format 1) name no key: they verify with any of
the secrets strata once took the key from (the Ray token files among them), so a token file that
appears later changes nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from strata.shell import StrataError

KEY_ENV = "STRATA_SIGNING_KEY"
KEY_FILE_ENV = "STRATA_SIGNING_KEY_FILE"
KEYRING_ENV = "STRATA_SIGNING_KEYRING"
LOCAL_KEY = "~/.strata/signing-key"
KEYRING = "~/.strata/keyring"
TOKEN_FILES = ("~/.strata/ray-token", "~/.ray/auth_token")  # Ray's token: strata submit's, never the key's


class Untrusted(StrataError):
    """A file is not signed by a key this machine holds, or does not match its signature."""


def _read_secret(path: str) -> bytes | None:
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read().strip() or None


def secret() -> bytes:
    """This machine's signing secret (see the module's doc); creates ~/.strata/signing-key if needed."""
    if value := os.environ.get(KEY_ENV):
        return value.strip().encode()
    if path := os.environ.get(KEY_FILE_ENV):
        if (value := _read_secret(path)) is None:
            raise Untrusted(f"{KEY_FILE_ENV}={path}: no such file, or it is empty")
        return value
    path = os.path.expanduser(LOCAL_KEY)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
    return _read_secret(path) or b""


def _derive(value: bytes) -> bytes:
    return hmac.new(value, b"strata file signatures v1", hashlib.sha256).digest()


def fingerprint(k: bytes) -> str:
    """A key's public name: 12 hex digits that say which key signed, and nothing of the key."""
    return hashlib.sha256(b"strata key fingerprint\0" + k).hexdigest()[:12]


def key() -> bytes:
    return _derive(secret())


def key_id() -> str:
    return fingerprint(key())


def keyring() -> dict[str, bytes]:
    """Every key that verifies here, by fingerprint: this machine's, then the keyring's."""
    ring = {key_id(): key()}
    path = os.environ.get(KEYRING_ENV) or os.path.expanduser(KEYRING)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            for line in f.read().splitlines():
                if line.strip() and not line.startswith(b"#"):
                    k = _derive(line.strip())
                    ring.setdefault(fingerprint(k), k)
    return ring


def _legacy_keys() -> list[bytes]:
    """Keys that format-1 signatures (no fingerprint) may have been made with: every secret strata ever
    took its key from, and the keyring's."""
    values = [os.environ.get(KEY_ENV, "").encode(), os.environ.get("RAY_AUTH_TOKEN", "").encode()]
    for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"), *TOKEN_FILES, LOCAL_KEY, os.environ.get(KEY_FILE_ENV)):
        if path:
            values.append(_read_secret(path) or b"")
    keys = [_derive(v.strip()) for v in values if v.strip()]
    return [*keys, *keyring().values()]


def sign(data: bytes) -> str:
    return hmac.new(key(), data, hashlib.sha256).hexdigest()


def signature(data: bytes) -> dict:
    """{"key": this key's fingerprint, "signature": its HMAC of `data`}, to store beside what it signs."""
    return {"key": key_id(), "signature": sign(data)}


def check(data: bytes, sig, what: str, signed_by: str | None = None) -> None:
    """Raise Untrusted unless `sig` is the signature of `data` by the key `signed_by` names (a key of
    the keyring), or, for a signature that names none, by any key strata may have made it with."""
    if not isinstance(sig, str) or not sig:
        raise Untrusted(f"{what} is not signed: strata signs what it writes, so it was not written by strata "
                        "(or was written before signing existed); refused")
    if signed_by is not None:
        ring = keyring()
        if not isinstance(signed_by, str) or signed_by not in ring:
            raise Untrusted(f"{what} was signed with key {signed_by}; this machine has key {key_id()}"
                            f"{' (and a keyring of ' + str(len(ring) - 1) + ')' if len(ring) > 1 else ''}: add the "
                            f"old key's secret as a line of {os.environ.get(KEYRING_ENV) or KEYRING} ({KEYRING_ENV}), "
                            f"or set {KEY_ENV} to it")
        candidates = [ring[signed_by]]
    else:
        candidates = _legacy_keys()
    if not any(hmac.compare_digest(hmac.new(k, data, hashlib.sha256).hexdigest(), sig) for k in candidates):
        raise Untrusted(f"{what} does not match its signature{f' by key {signed_by}' if signed_by else ''}: it "
                        "was changed after it was written; refused")
