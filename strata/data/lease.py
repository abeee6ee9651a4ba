"""One writer at a time, across machines: an expiring lease kept in storage.

A lease on a directory (a dataset, a training run, a sweep) is a sequence of
objects `_lease/g<NNNNNNNN>.json`. The holder is the writer of the highest
generation, while that object is neither released nor expired. To take the
lease a writer creates generation n+1 with `create_exclusive`, so of any
number of writers racing, exactly one wins. The holder renews its object from
a background thread every `ttl/4`; a crashed holder stops renewing and its
lease expires after `ttl` seconds (`STRATA_LEASE_TTL_S`, default 60), or at
once for a holder on this same machine whose process is gone. A holder that finds a higher generation has
lost the lease (it stalled past its ttl) and `check()` says so before it
commits anything.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import threading
import time
import uuid

from strata.data.storage import (
    create_exclusive,
    delete,
    join,
    list_dir,
    read_json,
    write_json_atomic,
)
from strata.errors import EXIT_BUSY, StrataError
from strata.errors import log as _logger

DEFAULT_TTL_S = 60.0
TTL_ENV = "STRATA_LEASE_TTL_S"
HOST = socket.gethostname()
_GEN_RE = re.compile(r"^g(\d{8,})\.json$")  # 8 digits at least, more past 99,999,999


class LeaseBusy(StrataError):
    """Someone else holds the lease (and the caller would not wait)."""

    exit_code = EXIT_BUSY

    def __init__(self, what: str, holder: dict):
        self.holder = holder
        super().__init__(f"{what} is in use by {describe(holder)}")


class LeaseLost(StrataError):
    """The lease expired while held and another writer took it."""


def describe(holder: dict) -> str:
    left = holder.get("expires_at", 0) - time.time()
    return (f"{holder.get('owner', '?')} ({holder.get('purpose', '')}; since "
            f"{time.strftime('%H:%M:%S', time.localtime(holder.get('acquired_at', 0)))}, "
            f"lease {f'expires in {left:.0f} s' if left > 0 else 'expired'})")


def _pause(seconds: float) -> None:
    """A writer's back-off after a lost race (one place, so a test can count them)."""
    time.sleep(seconds)


def _generations(directory: str) -> list[int]:
    return sorted(int(m.group(1)) for name, d in list_dir(join(directory, "_lease"))
                  if not d and (m := _GEN_RE.match(name)))


def _path(directory: str, gen: int) -> str:
    return join(directory, "_lease", f"g{gen:08d}.json")


def _live(state: dict | None) -> bool:
    if not state or state.get("released") or state.get("expires_at", 0) <= time.time():
        return False
    return not (state.get("host") == HOST and not _pid_alive(state.get("pid", 0)))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    return True


def _read(directory: str, gen: int) -> dict | None:
    try:
        return read_json(_path(directory, gen))
    except (FileNotFoundError, OSError, ValueError):
        return None  # deleted meanwhile (superseded), or not readable: not a holder


def holder(directory: str) -> dict | None:
    """The live lease on `directory`, if any."""
    gens = _generations(directory)
    state = _read(directory, gens[-1]) if gens else None
    return state if _live(state) else None


def check_held(directory: str, gen: int, what: str) -> None:
    """For a process that works under another's lease (a training worker under its driver's): raise
    LeaseLost unless generation `gen` is still the newest and live, so nothing is committed once the
    holder has lost it."""
    gens = _generations(directory)
    if not gens or gens[-1] != gen or not _live(_read(directory, gen)):
        raise LeaseLost(f"the lease on {what} (generation {gen}) is no longer held: it ran out or another writer "
                        "took it; nothing more is committed")


class Lease:
    """`with Lease(dir, "dataset web").acquire(): ...` holds the lease for the block."""

    def __init__(self, directory: str, what: str, *, purpose: str = "", ttl_s: float | None = None):
        self.directory, self.what, self.purpose = directory, what, purpose
        self.ttl_s = ttl_s or float(os.environ.get(TTL_ENV) or DEFAULT_TTL_S)
        self.owner = f"{HOST} pid {os.getpid()} [{uuid.uuid4().hex[:6]}]"
        self.gen: int | None = None
        self.acquired_at = 0.0
        self.lost = False
        self.valid_until = 0.0  # the last renewal's expiry: past it, this holder has lost the lease
        self.error = ""  # the storage error that kept it from renewing, if that is how it was lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _state(self, released: bool = False) -> dict:
        now = time.time()
        return {"owner": self.owner, "host": HOST, "pid": os.getpid(), "purpose": self.purpose, "acquired_at": self.acquired_at,
                "renewed_at": now, "expires_at": now + self.ttl_s, "released": released, "ttl_s": self.ttl_s}

    def try_acquire(self) -> dict | None:
        """Take the lease if nobody holds it; returns None on success, else the holder's state. A writer that
        loses the race for the next generation backs off (jittered, doubling to 2 s) before it looks again, so
        racing writers never storm the store with listings."""
        races = 0
        while True:
            gens = _generations(self.directory)
            top = gens[-1] if gens else 0
            state = _read(self.directory, top) if top else None
            if _live(state):
                return state
            self.acquired_at = time.time()
            state = self._state()
            if create_exclusive(_path(self.directory, top + 1), json.dumps(state).encode()):
                self.gen, self.valid_until = top + 1, state["expires_at"]
                for old in gens[:-1]:  # keep the previous one: a reader may be looking at it
                    delete(_path(self.directory, old))
                self._thread = threading.Thread(target=self._renew, daemon=True, name=f"lease {self.what}")
                self._thread.start()
                return None
            # another writer took top + 1 first: look again, after a pause
            races += 1
            _pause(min(2.0, 0.02 * 2 ** min(races, 7)) * random.uniform(0.5, 1.0))

    def acquire(self, *, wait: bool = True, timeout_s: float | None = None, poll_s: float = 2.0,
                log=None) -> Lease:
        """Take the lease, waiting (and saying for whom) while somebody else holds it.

        `wait=False` raises LeaseBusy at once instead; so does running past `timeout_s`."""
        log = log or _logger("lease").info
        deadline = None if timeout_s is None else time.time() + timeout_s
        said = None
        while (busy := self.try_acquire()) is not None:
            if not wait or (deadline is not None and time.time() >= deadline):
                raise LeaseBusy(self.what, busy)
            if busy.get("owner") != said:
                log(f"waiting for {describe(busy)}, which holds {self.what}")
                said = busy.get("owner")
            time.sleep(poll_s * random.uniform(0.75, 1.25))  # jittered: waiters do not poll in step
        return self

    def _renew(self) -> None:
        """Renew every ttl/4. A storage error (a failed listing or write) is retried with backoff; a holder
        that could not renew before its lease ran out has lost it (another writer may hold it now), and
        `check()` says so before its work commits anything."""
        wait = self.ttl_s / 4
        while not self._stop.wait(wait):
            try:
                if not self.check(raise_=False):
                    return
                write_json_atomic(_path(self.directory, self.gen), self._state())
                self.valid_until = time.time() + self.ttl_s
                self.error, wait = "", self.ttl_s / 4
            except Exception as e:  # noqa: BLE001 - any storage error: the lease is kept while time is left
                self.error = f"{type(e).__name__}: {e}"  # the why, whichever check finds the lease ran out
                if time.time() >= self.valid_until:
                    self.lost = True
                    return
                wait = min(wait / 2, max(0.05, (self.valid_until - time.time()) / 4))  # sooner, before it runs out

    def check(self, raise_: bool = True) -> bool:
        """Whether this writer still holds the lease: nobody took a later generation, and its last renewal
        has not run out."""
        if self.gen is None or self.lost:
            ok = False
        elif time.time() >= self.valid_until:
            ok, self.lost = False, True
        else:
            ok = max(_generations(self.directory), default=0) == self.gen
            self.lost = not ok
        if not ok and raise_:
            why = f" (renewal kept failing: {self.error})" if self.error else ""
            raise LeaseLost(f"lost the lease on {self.what}: it ran out (no renewal for {self.ttl_s:.0f} s){why}, so "
                            "another writer may hold it; nothing more is committed")
        return ok

    def release(self) -> None:
        if self._thread:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self.gen is not None and self.check(raise_=False):
            write_json_atomic(_path(self.directory, self.gen), self._state(released=True))
        self.gen = None

    def __enter__(self) -> Lease:
        if self.gen is None:
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
