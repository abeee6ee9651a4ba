"""Tainted models: a run whose weights learned from documents a takedown removed (train/takedown.py).

`strata takedown apply` marks each run that trained on a request's documents, from the first step that
did: `runs/RUN/tainted/ID.json`, signed (strata.data.signing), holding the request's id, reason and that step.
Every way a model leaves a run goes through `check`: sampling (train.sample), exporting (train.export),
fine-tuning from it (`--init-from`, train.pretrained), continuing the run (train.trainer), and scoring,
evaluating, generating and serving it (infer.model, for a run or for a directory exported from one). A
checkpoint at or after a mark's step is refused in one line naming the request and the command that
retrains; with `--allow-tainted` it is used, and the use is recorded beside the marks
(`runs/RUN/tainted/allowed-*.json`: what, which step, which requests, when, by which command), so
`strata takedown status` can show it. A mark that does not verify refuses too: a model is never taken as
clean on a file strata cannot trust.
"""

from __future__ import annotations

import json
import os
import sys
import time

from strata.commands.shell import StrataError
from strata.commands.shell import log as _logger
from strata.data.storage import exists, filesystem, join, list_dir, write_bytes_atomic

DIR = "tainted"
_log = _logger("takedown")


class Tainted(StrataError):
    """A model learned from documents a takedown removed."""


def canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_signed(path: str, key: str, body: dict, exclusive: bool = False) -> bool:
    """`body` under `key`, with its signature, written whole (a reader sees the old file or the new one);
    `exclusive`: only where nothing is (False if something was)."""
    from strata.data import signing
    from strata.data.storage import create_exclusive

    data = (json.dumps({key: body, **signing.signature(canonical(body))}, indent=2, sort_keys=True) + "\n").encode()
    if exclusive:
        return create_exclusive(path, data)
    write_bytes_atomic(path, data)
    return True


def read_signed(path: str, key: str, what: str) -> dict:
    """What `write_signed` wrote at `path`, its signature verified (strata.data.signing.Untrusted if not)."""
    from strata.data import signing

    fs, p = filesystem(path)
    with fs.open_input_stream(p) as f:
        try:
            doc = json.loads(f.read())
        except ValueError:
            raise signing.Untrusted(f"{what} {path}: not JSON; refused") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(key), dict):
        raise signing.Untrusted(f"{what} {path}: not a {what}; refused")
    signing.check(canonical(doc[key]), doc.get("signature"), f"{what} {path}", doc.get("key"))
    return doc[key]


def mark(run_dir: str, request: dict, from_step: int) -> str:
    """Mark the run in `run_dir` tainted by takedown `request` from step `from_step` on; returns the mark's path."""
    path = join(run_dir, DIR, f"{request['id']}.json")
    write_signed(path, "mark", {"request": request["id"], "reason": request["reason"], "from_step": int(from_step),
                                "run": run_dir.rstrip("/").rpartition("/")[2], "marked_at": time.time()})
    return path


def marks(run_dir: str) -> list[dict]:
    """The run's taint marks, each verified; one that does not verify raises (strata.data.signing.Untrusted)."""
    where = join(run_dir, DIR)
    if not exists(where):
        return []
    out = []
    for name, is_dir in sorted(list_dir(where)):
        if not is_dir and name.endswith(".json") and not name.startswith("allowed-"):
            m = read_signed(join(where, name), "mark", "taint mark")
            if m.get("request") != name.removesuffix(".json") or not isinstance(m.get("from_step"), int):
                from strata.data.signing import Untrusted

                raise Untrusted(f"taint mark {join(where, name)}: names request {m.get('request')!r}; refused")
            out.append(m)
    return out


def allowances(run_dir: str) -> list[dict]:
    """Each recorded use of the run's tainted checkpoints (`--allow-tainted`), oldest first."""
    where = join(run_dir, DIR)
    if not exists(where):
        return []
    out = []
    for name, is_dir in sorted(list_dir(where)):
        if not is_dir and name.startswith("allowed-") and name.endswith(".json"):
            try:
                out.append(read_signed(join(where, name), "use", "tainted use"))
            except StrataError as e:
                out.append({"refused": str(e)})
    return out


def check(run_dir: str, step: int, what: str, allow: bool = False) -> list[dict]:
    """The marks that taint the run's checkpoint at `step` (`what`: what is being done with it, for the
    message). Any: refused with Tainted, unless `allow`, when the use is recorded and the marks returned."""
    hits = [m for m in marks(run_dir) if int(step) >= m["from_step"]]
    if not hits:
        return []
    run = run_dir.rstrip("/").rpartition("/")[2]
    first = min(hits, key=lambda m: m["from_step"])
    if not allow:
        others = f" (and {len(hits) - 1} more)" if len(hits) > 1 else ""
        raise Tainted(f"{what}: {run}@{step} learned from documents taken down by request {first['request']}"
                      f"{others} ({first['reason']}) from step {first['from_step']}; retrain with `strata takedown "
                      f"retrain {first['request']}`, or pass --allow-tainted to use it anyway (the use is recorded)")
    at = time.time()
    write_signed(join(run_dir, DIR, f"allowed-{int(at * 1000)}-{os.getpid()}.json"), "use",
                 {"what": what, "step": int(step), "requests": sorted(m["request"] for m in hits), "at": at,
                  "command": " ".join(sys.argv)[:500]})
    _log.warning(f"{what}: {run}@{step} is tainted by takedown {', '.join(sorted(m['request'] for m in hits))}; "
                 "used anyway (--allow-tainted), and the use is recorded")
    return hits


def export_origin(meta: dict, storage) -> str:
    """RUN@STEP of an exported directory (`meta`: its strata.json) whose checkpoint is a run's under this
    storage root; else ""."""
    run_dir, _, _ = str(meta.get("checkpoint") or "").rstrip("/").rpartition("/")
    name = run_dir.rpartition("/")[2]
    try:
        ours = bool(name) and storage.run(name).rstrip("/") == run_dir
    except ValueError:  # not a name a run can have
        ours = False
    return f"{name}@{int(meta.get('step') or 0)}" if ours else ""


def check_export(directory: str, storage, what: str, allow: bool = False) -> list[dict]:
    """`check` for a directory exported from one of this root's runs (its strata.json names the checkpoint);
    a directory from elsewhere is no run's, and passes."""
    from strata.data.storage import read_json

    if not exists(join(directory, "strata.json")):
        return []
    origin = export_origin(read_json(join(directory, "strata.json")), storage)
    if not origin:
        return []
    run, _, step = origin.rpartition("@")
    return check(storage.run(run), int(step), what, allow)


def check_checkpoint(checkpoint: str, step: int, what: str, allow: bool = False) -> list[dict]:
    """`check` for a checkpoint directory: its run is the directory above it."""
    return check(checkpoint.rstrip("/").rpartition("/")[0], step, what, allow)
