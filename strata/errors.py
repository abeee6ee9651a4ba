"""What every strata module may need to say or end with, and nothing else: the exit codes, `StrataError`
(a message the user can act on, in one line), `log` (the `[tag] ...` lines on stderr) and how a command stops
on SIGTERM. It imports nothing of strata's, so storage, signing, leases and the cluster code use it without
reaching up to the command shell (strata/commands/shell.py), which is built on them.
"""

from __future__ import annotations

import logging
import sys
import time

EXIT_FAILED = 1  # the command failed for a reason it states in one line
EXIT_USAGE = 2  # a flag or value it cannot take (argparse's code)
EXIT_BUG = 70  # EX_SOFTWARE: a bug; the traceback follows
EXIT_BUSY = 75  # EX_TEMPFAIL: another run holds what this one would write
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM
EXIT_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader went away (`| head`)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job manager, Kubernetes, `kill`): the command stops as Ctrl-C stops it."""


def _terminated(signum, frame):
    raise Terminated


def stop_on_sigterm() -> None:
    """From the main thread of a command that is the process: SIGTERM raises Terminated there, so the
    command stops as on Ctrl-C (what was kept, the command that continues) instead of Ray's handler, which
    exits from inside whatever Ray call is running (a C++ abort, exit 134). `connect` sets it again after
    ray.init, which installs Ray's own."""
    import signal
    import threading

    if _ACTIVE and _ACTIVE[-1].whole_process and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)


class StrataError(Exception):
    """An error the user can act on: its message is one line that says what to do."""

    exit_code = EXIT_FAILED


class UsageError(StrataError):
    """A flag or value the command cannot take."""

    exit_code = EXIT_USAGE


def process_started() -> float:
    """When this process started (wall clock), imports included."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - no psutil or no /proc: the call's time is the best left
        return time.time()


STARTED = process_started()
_ACTIVE: list = []  # the Command running in this process, if any


def command_started() -> float | None:
    """When the command running in this process started (None when strata runs inside another program,
    a notebook or a test, where the process's start says nothing about the run's)."""
    return _ACTIVE[-1].started if _ACTIVE else None


class _Stderr(logging.StreamHandler):
    """A handler that writes to whatever sys.stderr is when a line comes (a notebook or pytest swaps it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class _Tagged(logging.Formatter):
    """`[tag] message`, the tag the last part of the logger's name (strata.train -> train)."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"[{record.name.rsplit('.', 1)[-1]}] {record.getMessage()}"
        return f"{line}\n{self.formatException(record.exc_info)}" if record.exc_info else line


def log(tag: str) -> logging.Logger:
    """The logger a command's lines go through (`strata.TAG`); strata's loggers print to stderr at INFO
    unless a command's --quiet or --verbose says otherwise, in a notebook or a test too."""
    root = logging.getLogger("strata")
    if not any(isinstance(h, _Stderr) for h in root.handlers):
        handler = _Stderr()
        handler.setFormatter(_Tagged())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return logging.getLogger(f"strata.{tag}")


def set_verbosity(*, quiet: bool = False, verbose: bool = False) -> None:
    """--quiet: warnings and errors only; --verbose: debug lines too."""
    log("shell")
    logging.getLogger("strata").setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
