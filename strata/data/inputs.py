"""Which files a run reads, and in what work units: `list_inputs` expands paths, directories, globs and URIs
into files (with sizes and modification times; links are not followed unless asked, and what is skipped is
named), `check_outside` refuses inputs inside strata's own storage, and `plan_units` cuts the files into work
units (large files into byte ranges, small ones grouped) so a worker's memory is bounded whatever the sizes.
`documents` reads every record of a small input whole, in one process.
"""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Iterator

import pyarrow.fs as pafs

from strata.data.sources import ReadConfig, describe, read_file
from strata.data.storage import filesystem


def list_inputs(inputs: list[str], allow_empty: bool = False, follow_links: bool = False,
                skipped: list[str] | None = None) -> list[dict]:
    """Expand paths, directories (recursively), globs and URIs into files with size and mtime.

    A missing input, or one that holds no file (unless `allow_empty`), is an error before any work
    starts, not an empty dataset. Inside a local input folder, a symbolic link that leads out of it is
    not followed unless `follow_links`; such links are appended to `skipped`.
    """
    found: dict[str, dict] = {}
    skipped = [] if skipped is None else skipped
    for spec in inputs:
        if "://" not in spec and glob.has_magic(spec):
            matches = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
            files = sum(_add(found, os.path.abspath(m), spec, follow_links, skipped) for m in matches)
        else:
            files = _add(found, spec if "://" in spec else os.path.abspath(os.path.expanduser(spec)), spec,
                         follow_links, skipped)
        if not files and not allow_empty:
            why = "the glob matches no file" if "://" not in spec and glob.has_magic(spec) else "it is empty"
            raise FileNotFoundError(f"no input files found under {spec} ({why}; --allow-empty accepts that)")
    return [found[p] for p in sorted(found)]


def _add(found: dict[str, dict], path: str, source: str, follow_links: bool = False,
         skipped: list[str] | None = None) -> int:
    """`path`'s files, each with its `source`: the input it was found under (dedup is audited per source);
    returns how many files it holds."""
    fs, p = filesystem(path)
    info = fs.get_file_info(p)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"input {path!r} does not exist")
    infos = [info]
    if info.type == pafs.FileType.Directory:
        infos = (_local_tree(p, follow_links, [] if skipped is None else skipped) if "://" not in path
                 else fs.get_file_info(pafs.FileSelector(p, recursive=True)))
    prefix = path[: path.index("://") + 3] if "://" in path else ""
    files = [i for i in infos if i.type == pafs.FileType.File and not i.base_name.startswith(".")]
    for i in files:
        full = prefix + i.path
        found.setdefault(full, {"path": full, "size": i.size, "mtime_ns": i.mtime_ns, "source": source})
    return len(files)


def _local_tree(root: str, follow_links: bool = False, skipped: list[str] | None = None) -> list:
    """Every file under a local directory, each directory and file once; symbolic links are followed
    while they stay inside `root` (anywhere with `follow_links`), and the others go to `skipped`.

    Arrow's recursive listing follows a link back to a parent forever; here a directory already seen
    (same device and inode) is not entered again, and a file reached by a second path is listed once.
    """
    real_root = os.path.realpath(root)

    def inside(path: str) -> bool:
        if follow_links:
            return True
        real = os.path.realpath(path)
        if real == real_root or real.startswith(real_root + os.sep):
            return True
        if skipped is not None:
            skipped.append(path)
        return False

    seen_dirs, seen_files, out = set(), set(), []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen_dirs:
            dirnames[:] = []
            continue
        seen_dirs.add((st.st_dev, st.st_ino))
        dirnames[:] = sorted(d for d in dirnames if inside(os.path.join(dirpath, d)))
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if not inside(full):
                continue
            try:
                st = os.stat(full)
            except OSError:  # a dangling link: nothing to read
                continue
            if (st.st_dev, st.st_ino) not in seen_files and stat.S_ISREG(st.st_mode):
                seen_files.add((st.st_dev, st.st_ino))
                out.append(pafs.FileInfo(full, pafs.FileType.File, size=st.st_size, mtime_ns=st.st_mtime_ns))
    return out


def check_outside(inputs: list[str], root: str, files: list[dict] | None = None) -> None:
    """Refuse an input that is, or is inside, or holds the storage root: strata would read back its own
    shards, records and reports as text. Every spelling counts: a glob is judged by the folder it starts
    from (`ROOT/dat[a]/**`, `ROOT/dat?`), a `file://` URI as its path, a link by where it leads; and
    `files` (what the inputs expanded to) are each checked where they really are."""
    def norm(p: str) -> str:
        if p.startswith("file://"):
            p = p[len("file://"):]
        return p.rstrip("/") if "://" in p else os.path.realpath(os.path.expanduser(p))

    def fixed_part(spec: str) -> str:  # a glob's folder before its first wildcard component
        parts = spec.split("/")
        keep = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
        return "/".join(parts[:keep]) or "/"

    r = norm(root)
    for spec in inputs:
        p = norm(fixed_part(spec) if glob.has_magic(spec) else spec)
        if p == r or p.startswith(r + "/") or r.startswith(p.rstrip("/") + "/"):
            raise ValueError(f"input {spec!r} overlaps the storage root {root!r}: strata would read its own "
                             "datasets, records and reports as input. Keep raw text outside it")
    for f in files or []:
        p = norm(f["path"])
        if p == r or p.startswith(r + "/"):
            raise ValueError(f"input file {f['path']!r} is inside the storage root {root!r} (through a link or "
                             "a glob): strata would read its own data as input. Keep raw text outside it")


UNITS_AT_LEAST = 16  # a small input is still cut into this many units (unless that would make them < 1 MiB)


def plan_units(files: list[dict], cfg: ReadConfig) -> list[list[dict]]:
    """Group files into work units of about `split_bytes`; cut big splittable files into ranges.

    Units shrink (not below 1 MiB) so that even a small input makes UNITS_AT_LEAST of them, a file is
    cut into equal ranges, and the biggest units come first: coarse or uneven units leave cores idle at
    the end. The units are a function of the input alone, never of the cluster's size: what a version
    holds, row for row, does not depend on where it ran. A range [start, end) owns the records that start
    inside it, so ranges are read independently and every record exactly once.
    """
    total = sum(f["size"] for f in files)
    files = [{**f, "ordinal": i} for i, f in enumerate(files)]  # its place in the input order (dedup keeps the first)
    unit = min(cfg.split_bytes, max(1 << 20, -(-total // UNITS_AT_LEAST)))
    units, current, size = [], [], 0
    for f in files:
        kind, compression = describe(f["path"])
        splittable = not compression and (kind == "jsonl" or (kind == "text" and cfg.txt_documents == "blank-line"))
        if splittable and f["size"] > unit:
            n = -(-f["size"] // unit)
            cuts = [f["size"] * i // n for i in range(n + 1)]
            units += [[{**f, "start": a, "end": b}] for a, b in zip(cuts, cuts[1:], strict=False)]
            continue
        current.append({**f, "start": 0, "end": f["size"]})
        size += f["size"]
        if size >= unit or len(current) >= 512:
            units.append(current)
            current, size = [], 0
    if current:
        units.append(current)
    return sorted(units, key=lambda u: -sum(f["end"] - f["start"] for f in u))


def documents(inputs: list[str], read: ReadConfig | None = None) -> Iterator[dict]:
    """Every record of `inputs` (files, folders, globs, URIs) in order, read whole in this process: a
    small input's (held-out text, a test's corpus)."""
    read = read or ReadConfig()
    for f in list_inputs(inputs) if inputs else []:
        yield from read_file({**f, "start": 0, "end": f["size"]}, read)
