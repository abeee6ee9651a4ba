"""Signatures over the experiment state Ray Tune unpickles when a sweep resumes, and over each trial's
checkpoint (its book of results and model state).

`Tuner.restore` unpickles `tuner.pkl`, the newest `experiment_state-*.json`
(cloudpickled trials and controller state) and the searcher's and
callbacks' `*-state-*` files. strata signs each of them with
`strata.data.signing`'s key as they are written, and checks every such file in
the sweep directory before a resume, so a file planted in the storage root
is refused before Tune reads it. Only a signing key verifies (strata.data.signing): state signed in the format
before 2026-12-04, without a key's fingerprint, is refused until `python -m tune.convert` re-signs it with
the old secret the user names.

Where the signatures are made: Tune writes its state into a driver staging
directory and then uploads that directory. The callbacks' `get_state` runs
inside that save, after the trial and searcher state are written and before
the upload, so `SignTuneState` signs the staging directory's files there and
the signatures travel in the same upload. `tuner.pkl` is written straight
to the sweep directory when the Tuner is made; the driver signs it then.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os

from ray.tune import Callback

from strata.data.signing import Untrusted, check, key_id, sign, signature
from strata.data.storage import join, list_dir, read_bytes, read_json, write_json_atomic

CONVERT = "re-sign it with `python -m tune.convert SWEEP_DIR --old-secret-file FILE`"
TRIAL_SIGNED = "signed.json"  # in a trial's checkpoint: its files' SHA-256, bound to the trial, signed

# What Tune reads back with pickle from an experiment directory's top level.
UNPICKLED = ("tuner.pkl", "*.pkl", "experiment_state-*", "*-state-*", "search_gen_state-*")
SIGNATURES = "strata-signatures-"  # strata-signatures-<what>.json: {"files": {name: hmac}, "key": fingerprint}


def unpickled(name: str) -> bool:
    return not name.startswith(SIGNATURES) and any(fnmatch.fnmatch(name, p) for p in UNPICKLED)


def sign_files(directory: str, names: list[str], what: str) -> None:
    """Write strata-signatures-<what>.json in `directory` over the named files there."""
    files = {n: sign(read_bytes(join(directory, n))) for n in names}
    write_json_atomic(join(directory, f"{SIGNATURES}{what}.json"), {"files": files, "key": key_id()})


def check_tune_state(sweep_dir: str) -> None:
    """Raise Untrusted unless every file Tune would unpickle in `sweep_dir` carries strata's signature."""
    entries = [name for name, is_dir in list_dir(sweep_dir) if not is_dir]
    signed: dict[str, list[tuple[str, str | None]]] = {}
    for name in entries:
        if name.startswith(SIGNATURES) and name.endswith(".json"):
            try:
                listed = read_json(join(sweep_dir, name))
                for f, sig in listed.get("files", {}).items():
                    signed.setdefault(f, []).append((sig, listed.get("key")))
            except (ValueError, AttributeError):
                continue  # an unreadable signature file signs nothing
    for name in sorted(filter(unpickled, entries)):
        data, sigs = read_bytes(join(sweep_dir, name)), signed.get(name) or [(None, None)]
        errors = []
        for sig, by in sigs:
            try:
                check(data, sig, f"sweep state {join(sweep_dir, name)}", signed_by=by, convert=CONVERT)
                break
            except Untrusted as e:
                errors.append(e)
        else:
            raise errors[0]


class SignTuneState(Callback):
    """Signs each snapshot Tune saves of the experiment, in its staging directory, before the upload."""

    def __init__(self, name: str):
        self.name, self.staging = name, None

    def on_step_begin(self, iteration, trials, **info):
        if self.staging is None and trials:
            self.staging = trials[0].storage.experiment_driver_staging_path

    def get_state(self):
        staging = self.staging or _newest_staging(self.name)
        if staging:
            names = sorted(n for n in os.listdir(staging) if unpickled(n) and os.path.isfile(join(staging, n)))
            states = [n for n in names if n.startswith("experiment_state-")]
            stamp = max(states)[len("experiment_state-"):-len(".json")] if states else "session"
            sign_files(staging, names, stamp)
        return None  # no state of its own: Tune writes no callback file for it


def _newest_staging(name: str) -> str | None:
    """The staging directory of the snapshot being saved, before any trial has said where it is: the one
    whose experiment state was written last (Tune has just written it). Tune says where it stages only
    through Ray Train's private storage module (pinned by tests/test_ray_internals.py)."""
    from ray.train._internal.storage import _get_ray_train_session_dir

    found = glob.glob(os.path.join(_get_ray_train_session_dir(), "*", name, "driver_artifacts",
                                   "experiment_state-*.json"))
    return os.path.dirname(max(found, key=os.path.getmtime)) if found else None


def sign_tuner(sweep_dir: str) -> None:
    """Sign the tuner.pkl a new Tuner has just written to the sweep directory."""
    sign_files(sweep_dir, ["tuner.pkl"], "tuner")



def sign_trial(directory: str, trial_id: str) -> None:
    """Sign a trial checkpoint's files (local `directory`, before Tune persists it), bound to its trial."""
    files = {n: hashlib.sha256(read_bytes(os.path.join(directory, n))).hexdigest() for n in sorted(os.listdir(directory))
             if n != TRIAL_SIGNED}
    body = {"files": files, "trial": trial_id}
    with open(os.path.join(directory, TRIAL_SIGNED), "w") as f:
        json.dump({**body, **signature(json.dumps(body, sort_keys=True).encode())}, f)


def trial_files(read, where: str, trial_id: str | None) -> dict[str, bytes]:
    """A trial checkpoint's files, each checked against its signed list (`read(name)` gives a file's bytes;
    FileNotFoundError for one that is not there): {name: bytes}. Refused (Untrusted, one line) unless the list
    is signed by a key of the keyring, for this trial (when `trial_id` is known), and every file matches."""
    try:
        listed = json.loads(read(TRIAL_SIGNED))
        body = {"files": listed["files"], "trial": listed["trial"]}
        if not isinstance(body["files"], dict):
            raise TypeError
    except FileNotFoundError:
        raise Untrusted(f"trial checkpoint {where} has no signed list ({TRIAL_SIGNED}): not written by this strata; "
                        "refused") from None
    except (ValueError, KeyError, TypeError):
        raise Untrusted(f"trial checkpoint {where}: {TRIAL_SIGNED} is not a signed file list; refused") from None
    check(json.dumps(body, sort_keys=True).encode(), listed.get("signature"), f"trial checkpoint {where}",
          signed_by=listed.get("key"))
    if trial_id is not None and body["trial"] != trial_id:
        raise Untrusted(f"trial checkpoint {where} is signed for trial {body['trial']!r}, not {trial_id!r}; refused")
    out = {}
    for name, sha in body["files"].items():
        data = read(name)
        if hashlib.sha256(data).hexdigest() != sha:
            raise Untrusted(f"trial checkpoint {where}: {name} does not match its signed SHA-256; refused")
        out[name] = data
    return out
