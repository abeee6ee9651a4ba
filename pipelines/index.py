"""Which earlier keys a run's dedup index compares with: the dataset's own segments as of the parent, the
versions in the dedup window, and another dataset's (--dedup-against). The index itself is pipelines/dedup.py;
pipelines/passes.py starts and saves it.
"""

from __future__ import annotations

from pipelines.config import PreprocessConfig
from strata.commands.shell import log as _logger
from strata.data.dataset import DatasetError
from strata.data.storage import Storage

_say = _logger("preprocess").info

def index_segments(parent, earlier, cfg: PreprocessConfig) -> dict[str, list[dict]]:
    """The dataset's dedup index as of `parent`, by table: its segments, each a file per slice of the key
    space (paths made whole). Band segments of other MinHash/LSH parameters are left out: their keys are
    not comparable. A dataset made before the index (each version's own dedup files, in `files`) gives
    a segment per earlier version whose files each span the whole key space (`earlier()` reads them)."""
    from pipelines.dedup import legacy_segment

    state = parent.manifest.dedup if parent else {}
    if "index" in state:
        segments = {t: [{**seg, "files": [{**f, "path": parent.file(f["path"]),
                                           "named": parent.named(f["path"], legacy_ok=True)} for f in seg["files"]]}
                        for seg in segs] for t, segs in state["index"].items()}
    else:
        versions = earlier() if parent else []
        segments = {t: [legacy_segment([v.file(p) for p in v.manifest.dedup["files"][t]], v.manifest.dedup.get("params"))
                        for v in versions if v.manifest.dedup.get("files", {}).get(t)] for t in ("exact", "band")}
    band = segments.get("band", [])
    if other := [seg for seg in band if seg["params"] != cfg.dedup.params()]:
        _say(f"near-dedup against {sum(seg['versions'] for seg in other)} earlier version(s) skipped: their "
             f"MinHash/LSH parameters {other[0]['params']} differ from this run's {cfg.dedup.params()} "
             "(pass --bands/--rows/--num-perm to match)")
        segments["band"] = [seg for seg in band if seg["params"] == cfg.dedup.params()]
    return segments


def window(parent, size: int | None, earlier) -> list[str] | None:
    """The versions a run deduplicates against, oldest first (None: every earlier one): from the parent's
    window, or, once, from the history (`earlier()`) when the parent's does not say (made before windows,
    under `all`, or under a smaller window)."""
    from pipelines.dedup import window_versions

    if size is None:
        return None
    if parent is None:
        return []
    w = parent.manifest.dedup.get("window")
    listed = w.get("versions") if isinstance(w, dict) and w.get("size") != "all" else None
    if not (isinstance(listed, list) and all(isinstance(x, str) for x in listed)) or (
            len(listed) < size - 1 and parent.manifest.totals.get("versions", 1) > len(listed) + 1):
        listed = [v.manifest.version for v in earlier()][:-1]  # the parent's ancestors (earlier() ends with it)
    return window_versions(listed, parent.manifest.version, size)


def against(storage: Storage, cfg: PreprocessConfig) -> tuple[dict, dict[str, list[dict]]]:
    """--dedup-against NAME[@VERSION]: that version's dedup index (its segments marked `against`, paths made
    whole), and what the manifest records of it. Band segments of other MinHash/LSH parameters are left out
    (their keys are not comparable), with a line saying so."""
    from strata.data.dataset import resolve

    ref = cfg.dedup.against
    name = ref.partition("@")[0]
    if not (cfg.dedup.exact_dedup or cfg.dedup.near_dedup):
        raise DatasetError(f"--dedup-against {ref} needs dedup on (--exact-dedup or --near-dedup)")
    if name == cfg.dataset:
        raise DatasetError(f"--dedup-against {ref}: that is the dataset being written; its own earlier versions are "
                           "what --dedup-window covers")
    other = resolve(storage, ref)
    state = other.manifest.dedup
    if not isinstance(state.get("index"), dict) or not any(state["index"].get(t) for t in ("exact", "band")):
        raise DatasetError(f"--dedup-against {other.ref}: it has no dedup index (it was made with dedup off, or "
                           "before the index): there is nothing to deduplicate against")
    # Another dataset's index: every file must match the digest its commit names (strata/data/integrity.py).
    segments = {t: [{**seg, "against": True, "files": [{**f, "path": other.file(f["path"]),
                                                        "named": other.named(f["path"])} for f in seg["files"]]}
                    for seg in state["index"].get(t, [])] for t in ("exact", "band")}
    if (band := segments["band"]) and (mismatch := [s for s in band if s.get("params") != cfg.dedup.params()]):
        _say(f"--dedup-against {other.ref}: its near-dedup keys were made with MinHash/LSH parameters "
             f"{mismatch[0].get('params')}, not this run's {cfg.dedup.params()}: only exact duplicates are dropped")
        segments["band"] = [s for s in band if s.get("params") == cfg.dedup.params()]
    keys = sum(f["rows"] for segs in segments.values() for seg in segs for f in seg["files"])
    count = sum(map(len, segments.values()))
    _say(f"deduplicating against {other.ref} too: {keys:,} keys in {count} segment(s)")
    return {"ref": other.ref, "segments": count}, segments
