"""Which of a run's checkpoints count: those Ray Train registered that are whole, not written under a lease
generation a later holder had closed (its signed fence), oldest first (`committed_checkpoints`), and the newest
of them that loads (`newest`). A checkpoint a person deleted is dropped from Ray Train's record
(`forget_missing`), so a resume takes the one before it.
"""

from __future__ import annotations

import json
import re
import time

from strata.commands.shell import log as _logger
from strata.data.signing import Untrusted, signature
from train.checkpoint import (
    SNAPSHOT,
    UntiedCheckpoint,
    check_checkpoint,
    is_intact,
    read_meta,
    registered_checkpoints,
)

_log = _logger("checkpoint")


FENCES = "fences"  # <run>/fences/g<gen>.json: what a lease generation found committed when it took the run


def fence(run_dir: str, gen: int) -> None:
    """Close every earlier lease generation of the run: record, signed and bound to the run and generation,
    the checkpoints committed now. A checkpoint an earlier holder's workers hand over later (they had not yet
    seen the lease go, or Ray Train registers it late) names that earlier generation and is not in this list,
    so readers ignore it: no timing lets a stale holder publish. Only the lease's holder writes a fence, and
    only a signing key makes one count: a fence file planted in the folder closes nothing."""
    from strata.data.storage import basename, join, write_json_atomic

    body = {"run": basename(run_dir), "gen": gen,
            "checkpoints": sorted(basename(c) for c in committed_checkpoints(run_dir))}
    write_json_atomic(join(run_dir, FENCES, f"g{gen:08d}.json"), {**body, **signature(_fence_bytes(body))})


def _fence_bytes(body: dict) -> bytes:
    return json.dumps({"fence": body}, sort_keys=True).encode()


def _fences(run_dir: str) -> list[tuple[int, set, str]]:
    """The run's fences that its lease's holders wrote (signed by a key of the keyring, bound to this run and
    to their generation), oldest first: (generation, checkpoints it found committed, its file's name). Any
    other file there is named once and counts for nothing."""
    from strata.data.signing import check
    from strata.data.storage import basename, join, list_dir, read_json

    out = []
    for name, d in list_dir(join(run_dir, FENCES)):
        if d or not (m := re.fullmatch(r"g(\d{8,})\.json", name)):
            continue
        try:
            rec = read_json(join(run_dir, FENCES, name))
            body = {k: rec[k] for k in ("run", "gen", "checkpoints")}
            if body["run"] != basename(run_dir) or body["gen"] != int(m.group(1)) or not isinstance(
                    body["checkpoints"], list):
                raise Untrusted(f"it is not bound to this run and generation {int(m.group(1))}")
            check(_fence_bytes(body), rec.get("signature"), f"fence {name}", signed_by=rec.get("key"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, Untrusted) as e:
            _warn_once(f"{join(run_dir, FENCES, name)} counts for nothing: {e if isinstance(e, Untrusted) else 'unreadable'}")
            continue
        out.append((body["gen"], set(body["checkpoints"]), name))
    return sorted(out, key=lambda f: f[0])


_WARNED: set[str] = set()


def _warn_once(line: str) -> None:
    if line not in _WARNED:
        _WARNED.add(line)
        _log.warning(line)


def stale_checkpoints(run_dir: str, checkpoints: list[str]) -> dict[str, str]:
    """The checkpoints written under a lease generation that a later one had closed before they were
    committed (the first fence after their generation does not list them), each with the fence's file."""
    from strata.data.storage import basename

    fences = _fences(run_dir)
    if not fences:
        return {}
    stale = {}
    for c in checkpoints:
        try:
            gen = read_meta(c).get("lease_gen")
        except (OSError, ValueError, Untrusted):
            continue  # unreadable: loading it will say why
        after = next(((names, f) for g, names, f in fences if isinstance(gen, int) and g > gen), None)
        if after is not None and basename(c) not in after[0]:
            stale[basename(c)] = f"written under lease generation {gen}, after {FENCES}/{after[1]} closed it"
    return stale


def forget_missing(run_dir: str, also: dict[str, str] | None = None) -> dict[str, str]:
    """Drop registered checkpoints that are gone or incomplete (deleted by hand), or stale (handed over by
    a fenced-off lease generation), from Ray Train's record, so the run continues from the newest intact
    one; returns the names dropped, each with why. `also` names more to drop (refused by their signatures).

    Ray Train refuses to start a run whose record names a missing directory
    (`_assert_checkpoints_exist`), and no public API edits the record: this rewrites Ray Train's file, whose
    fields tests/test_ray_internals.py pins. The old record is kept beside, as `.bak-<time>`."""
    from strata.data.storage import join, read_bytes, write_bytes_atomic

    registered = registered_checkpoints(run_dir)
    gone = {c.rsplit("/", 1)[-1]: "missing or incomplete" for c in registered if not is_intact(c)}
    gone.update(stale_checkpoints(run_dir, registered))
    gone.update(also or {})
    if not gone:
        return {}
    path = join(run_dir, SNAPSHOT)
    raw = read_bytes(path)
    state = json.loads(raw)
    wrapped = isinstance(state, str)
    state = json.loads(state) if wrapped else state
    kept = [(r, i) for r, i in zip(state["checkpoint_results"], state["checkpoint_report_indices"], strict=True)
            if r["checkpoint_dir_name"] not in gone]
    state["checkpoint_results"] = [r for r, _ in kept]
    state["checkpoint_report_indices"] = [i for _, i in kept]
    if (state.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name") in gone:
        state["latest_checkpoint_result"] = kept[-1][0] if kept else None
    for key in ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
                "failed_validation_checkpoint_dir_names"):
        if key in state:
            state[key] = [n for n in state[key] if n not in gone]
    write_bytes_atomic(f"{path}.bak-{int(time.time())}", raw)
    text = json.dumps(state)
    write_bytes_atomic(path, (json.dumps(text) if wrapped else text).encode())
    return dict(sorted(gone.items()))


def committed_checkpoints(run_dir: str) -> list[str]:
    """The registered checkpoints that are intact and were not handed over by a lease generation after it
    was fenced off, oldest first: the ones a reader may load."""
    from strata.data.storage import basename

    registered = [c for c in registered_checkpoints(run_dir) if is_intact(c)]
    stale = stale_checkpoints(run_dir, registered)
    for name, why in stale.items():
        _warn_once(f"{run_dir}: {name} left out: {why}")
    return [c for c in registered if basename(c) not in stale]


def newest(run_dir: str, load=None, *, step: int | None = None, skip: set[str] = frozenset()):
    """The newest committed checkpoint of the run (at `step`, if given) that `load` takes (default: the checks
    a run makes before it continues, `check_checkpoint`): (its path, what `load` returned, [(name, why) of
    each newer one refused]). A checkpoint that fails its signatures is passed over, never retried forever nor
    hiding the good ones before it; `skip` names ones already refused. (None, None, refused) when none is left."""
    from strata.data.storage import basename

    load = load or check_checkpoint
    refused = []
    for c in reversed(committed_checkpoints(run_dir)):
        if basename(c) in skip:
            continue
        if step is not None:
            try:
                if read_meta(c)["step"] != step:
                    continue
            except (OSError, Untrusted):
                continue
        try:
            return c, load(c), refused
        except (Untrusted, UntiedCheckpoint) as e:
            refused.append((basename(c), str(e)))
    return None, None, refused
