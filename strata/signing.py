"""Signatures over the files strata reads back that a library would unpickle.

strata itself never unpickles what it reads from storage: its own state is
JSON, and tensors load with `torch.load(weights_only=True)`. One file comes
from a library that does: torch.distributed.checkpoint's `.metadata` (a
pickle, read by every `dcp.load`). strata signs it when a checkpoint is
written and refuses to load a checkpoint whose signature is missing or wrong,
so write access to the storage root alone cannot run code on a reader.

The key is HMAC-derived from a secret that only the cluster and its users
hold: `STRATA_SIGNING_KEY`, else the Ray auth token (`RAY_AUTH_TOKEN`,
`RAY_AUTH_TOKEN_PATH`, `~/.strata/ray-token`, `~/.ray/auth_token`), else a
key of this machine's own in `~/.strata/signing-key` (created 0600).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from strata.shell import StrataError

KEY_ENV = "STRATA_SIGNING_KEY"
TOKEN_FILES = ("~/.strata/ray-token", "~/.ray/auth_token")
LOCAL_KEY = "~/.strata/signing-key"


class Untrusted(StrataError):
    """A file that would be unpickled is not signed with this cluster's key."""


def _secret() -> bytes:
    if value := os.environ.get(KEY_ENV) or os.environ.get("RAY_AUTH_TOKEN"):
        return value.encode()
    for path in filter(None, [os.environ.get("RAY_AUTH_TOKEN_PATH"), *TOKEN_FILES]):
        path = os.path.expanduser(path)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                return f.read().strip()
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
    with open(path, "rb") as f:
        return f.read().strip()


def key() -> bytes:
    return hmac.new(_secret(), b"strata file signatures v1", hashlib.sha256).digest()


def sign(data: bytes) -> str:
    return hmac.new(key(), data, hashlib.sha256).hexdigest()


def check(data: bytes, signature: str | None, what: str) -> None:
    """Raise Untrusted unless `signature` is this key's signature of `data`."""
    if not signature:
        raise Untrusted(f"{what} is not signed: strata signs what it writes, so it was not written by strata "
                        "on this cluster (or before signing existed); refusing to unpickle it")
    if not hmac.compare_digest(sign(data), signature):
        raise Untrusted(f"{what} does not match its signature: it was changed after it was written, or "
                        f"written with another key ({KEY_ENV} or the Ray token); refusing to unpickle it")
