"""What this machine's processes use: CPU seconds, memory, and who started whom, through psutil.

The one place strata reads process tables (the run records' Ray daemon CPU, the benchmarks' process
trees and memory), so every figure is counted the same way on every platform psutil supports.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    cmdline: str  # arguments joined by spaces ("" when the process hides them)
    cpu_s: float  # user + system CPU seconds so far
    rss_mb: float


def processes() -> dict[int, Proc]:
    """Every process this user may read, by pid; one that exits while being read is left out."""
    out = {}
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "cpu_times", "memory_info"]):
        info = p.info
        if info["cpu_times"] is None or info["memory_info"] is None:  # access denied
            continue
        out[info["pid"]] = Proc(info["pid"], info["ppid"] or 0, " ".join(info["cmdline"] or ()),
                                info["cpu_times"].user + info["cpu_times"].system,
                                info["memory_info"].rss / 2**20)
    return out


def tree(root: int, procs: dict[int, Proc]) -> set[int]:
    """`root` and its descendants among `procs`."""
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def rss_mb() -> float:
    """This process's resident memory now (MB)."""
    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    """The most memory this process has held (MB; Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cmdline(pid: int) -> list[str]:
    """The arguments of process `pid` as the kernel shows them (Linux /proc); [] once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def kill_naming(text: str) -> list[int]:
    """SIGKILL every process of this user whose command line holds `text` (a Ray's temp dir: each of its
    processes names it), this one excepted; returns their pids."""
    import os
    import signal

    killed = []
    for pid, proc in processes().items():
        if pid != os.getpid() and text in proc.cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:  # gone already
                continue
    return killed
