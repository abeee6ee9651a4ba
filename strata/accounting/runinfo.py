"""What every run writes beside its outputs: resolved config, code and library versions."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import socket
import subprocess
import time
from pathlib import Path

LIBRARIES = ("ray", "torch", "pyarrow", "pandas", "numpy", "tokenizers")


def code_version() -> str:
    """The git commit of this checkout (`+dirty` if modified), or `$STRATA_CODE_VERSION`.

    A job shipped with `ray job submit --working-dir .` has no `.git`; the submit
    wrapper passes the version in the environment instead.
    """
    if env := os.environ.get("STRATA_CODE_VERSION"):
        return env
    repo = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for lib in LIBRARIES:
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            out[lib] = "absent"
    return out


def run_info(kind: str, config: object) -> dict:
    """A run record: the resolved config (a dataclass or dict) and where it ran."""
    cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    return {
        "kind": kind,
        "config": cfg,
        "code_version": code_version(),
        "libraries": library_versions(),
        "host": socket.gethostname(),
        "started_at": time.time(),
    }
