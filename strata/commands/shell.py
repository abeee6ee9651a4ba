"""The shell every strata command runs in: what a person sees when a command ends, however it ends.

    def main(argv=None):
        return Command("python -m train", argv).run(train)   # train(cmd) reads cmd.argv

- A user's mistake (`StrataError`, a bad flag) ends with one line that says
  what to do, and a distinct exit code; never a traceback.
- The cluster failing under a run (its node, a worker or an object lost: `cluster_failure`) ends with
  one line naming what Ray lost, and EXIT_FAILED: not a bug of strata's, and a rerun continues.
- A bug (any other exception) shows its traceback and exits EXIT_BUG.
- Ctrl-C ends with one line: what was interrupted, what was kept, and the exact
  command that continues (`Command.interrupted`), and exit code 130.
- `Command.started` is when the process started, so a run's record counts the
  whole command, imports and Ray's start included.
- A command that works on Ray does it inside one `Job`: the lease on what it writes, the
  connection, its run info, the usage measured while it works and the record it leaves.
- What a command says goes through `logging` (`log("train").info(...)`), one line each as
  `[train] ...` on stderr; `--quiet` keeps warnings and errors only, `--verbose` adds debug lines
  (and, for commands that start Ray, Ray's own logs).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from strata.errors import (  # noqa: F401 - the shell's names, where commands have always found them
    _ACTIVE,
    EXIT_BUG,
    EXIT_BUSY,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_PIPE,
    EXIT_TERMINATED,
    EXIT_USAGE,
    STARTED,
    StrataError,
    Terminated,
    UsageError,
    command_started,
    log,
    process_started,
    set_verbosity,
    stop_on_sigterm,
)


class Parser(argparse.ArgumentParser):
    """argparse with a short failure: a mistyped flag prints one line and a hint, not the whole usage.
    Flags are never abbreviated: `--max-step` is a mistake, not `--max-steps`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        talk = self.add_mutually_exclusive_group()
        talk.add_argument("--quiet", action="store_true", help="say only warnings and errors")
        talk.add_argument("--verbose", action="store_true", help="say more (debug lines; Ray's own logs where "
                          "the command starts Ray)")

    def parse_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)  # for the hint: which subcommand was given
        parsed = super().parse_args(args, namespace)
        set_verbosity(quiet=parsed.quiet, verbose=parsed.verbose)
        return parsed

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}{self._did_you_mean(message)} (see {self.prog} --help)\n")

    def _did_you_mean(self, message: str) -> str:
        """For an unknown flag, the command's flags closest to it (`--max-step`: did you mean --max-steps?)."""
        import difflib

        if not message.startswith("unrecognized arguments: "):
            return ""
        flags = {o for p in [self, *self._subparsers_in_use()] for o in p._option_string_actions if o.startswith("--")}
        hints = []
        for arg in message.removeprefix("unrecognized arguments: ").split():
            if arg.startswith("--") and (near := difflib.get_close_matches(arg.split("=", 1)[0], sorted(flags), n=2,
                                                                           cutoff=0.6)):
                hints.append(f"{arg.split('=', 1)[0]}: did you mean {' or '.join(near)}?")
        return f"; {'; '.join(hints)}" if hints else ""

    def _subparsers_in_use(self) -> list:
        """The subcommand given (`show` of `datasets show x --jsn`), or, before one is, every subcommand."""
        choices = {name: p for action in self._actions if isinstance(action, argparse._SubParsersAction)
                   for name, p in action.choices.items()}
        given = [choices[w] for w in getattr(self, "_argv", []) if w in choices][:1]
        return given or list(choices.values())


def cluster_failure(e: BaseException) -> str | None:
    """What Ray lost, in one line, when `e` (or what caused it) is the cluster failing under the run: a
    node, its raylet, a worker or actor, an object, a call that could not reach its peer. None for
    anything else (a task's own exception is the code's)."""
    exc = sys.modules.get("ray.exceptions")
    if exc is None:
        return None
    lost = (exc.NodeDiedError, exc.LocalRayletDiedError, exc.RayActorError, exc.WorkerCrashedError,
            exc.ObjectLostError, exc.RpcError, exc.RaySystemError, exc.OutOfMemoryError, exc.OutOfDiskError)
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, lost):
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
            return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return None


class Command:
    """One run of a command: its exit, whatever happens inside `body`."""

    def __init__(self, prog: str, argv: list[str] | None = None, tag: str | None = None):
        """`argv` None: the process's own command line (sys.argv), and the command started with the
        process; a list: a call from other code (a notebook, a test), which starts now."""
        self.prog = prog
        self.argv = sys.argv[1:] if argv is None else list(argv)
        self.tag = tag or prog.split()[-1].rsplit(".", 1)[-1]
        self.started = STARTED if argv is None else time.time()
        self.whole_process = argv is None
        """The command is the process: once it has ended, the process ends (`end_process`)."""
        self.interrupted: Callable[[], str] | None = None
        """Says, when Ctrl-C comes, what was interrupted, what was kept and the command that continues."""

    def run(self, body: Callable[[Command], object], user_errors: tuple[type[BaseException], ...] = ()):
        """Run `body(self)`, return what it returns; errors and Ctrl-C end the process as described above.
        `user_errors` are other exception types whose message is meant for the user."""
        _ACTIVE.append(self)
        stop_on_sigterm()
        try:
            out = body(self)
            if self.whole_process:
                end_process(0)
            return out
        except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as a Unix tool does
            _quiet_stdout()
            _exit(EXIT_PIPE)
        except KeyboardInterrupt as e:
            self._say(("terminated (SIGTERM), " if isinstance(e, Terminated) else "") + self._interruption())
            _exit(EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED)
        except StrataError as e:
            self._error(e, e.exit_code)
        except user_errors as e:
            self._error(e, EXIT_FAILED)
        except SystemExit:
            raise
        except BaseException as e:  # noqa: BLE001 - a bug: show where (unless the cluster failed under it)
            if lost := cluster_failure(e):
                self._error(RuntimeError(f"the Ray cluster failed under this run: {lost}; what it committed "
                                         "stays: run the command again to continue"), EXIT_FAILED)
            traceback.print_exc()
            self._say(f"internal error (a bug in strata; the traceback is above), exit code {EXIT_BUG}")
            _exit(EXIT_BUG)
        finally:
            _ACTIVE.remove(self)

    def continue_with(self, *args: str) -> str:
        """The command line that runs this command again with `args` (quoted for a shell)."""
        return shlex.join(["python", "-m", self.prog.removeprefix("python -m "), *args])

    def _interruption(self) -> str:
        if self.interrupted is None:
            return "interrupted: nothing was kept"
        try:
            return f"interrupted: {self.interrupted()}"
        except Exception as e:  # noqa: BLE001 - the line must come out even if looking up what was kept fails
            return f"interrupted (what was kept could not be read: {e})"

    def _error(self, e: BaseException, code: int):
        print(f"error: {str(e).strip() or type(e).__name__}", file=sys.stderr, flush=True)
        _exit(code)

    def _say(self, line: str) -> None:
        print(f"\n[{self.tag}] {line}", file=sys.stderr, flush=True)


class Job:
    """One run's life on Ray, the same for every command that runs work there (preprocess, train, tune):

        with Job("train", name, storage, holds=run_dir, what=f"training run {name}") as job:
            job.connect()                      # an embedded Ray, or the cluster's
            job.begin(config)                  # its run info, once the config is resolved
            with job.working():                # the usage of every node it works on, measured
                ...
            cost = job.finish(beside=..., work_nodes=..., figures=...)   # its record

    The lease (strata/data/lease.py) is held from `with` to its end: one writer of `holds` at a time.
    Errors pass through unchanged; `Command.run` maps them to exit codes.
    """

    def __init__(self, kind: str, name: str, storage, *, holds: str, what: str, purpose: str | None = None,
                 wait: bool = False, tag: str | None = None):
        """`kind` names its records (preprocess, train, sweep); `tag` its log lines (default: kind)."""
        from strata.data.lease import Lease

        self.kind, self.name, self.storage, self.wait, self.holds = kind, name, storage, wait, holds
        self.lease = Lease(holds, what, purpose=purpose or kind)
        self.events = None  # the run's OpenLineage events (strata/accounting/openlineage.py), once `lineage` names its data
        self.log = log(tag or kind)
        self.info: dict | None = None
        """The run info (strata/accounting/runinfo.py): resolved config, code and library versions, start."""
        self.usage = None

    def __enter__(self) -> Job:
        self.lease.acquire(wait=self.wait, log=self.log.info)
        return self

    def __exit__(self, kind, error, tb) -> None:
        try:
            if self.events is not None:
                self.events.end(error if kind is not None else None)
        finally:
            self.lease.release()

    def lineage(self, inputs: list[dict], outputs: list[dict], path: str | None = None, streaming: bool = False) -> None:
        """What the run reads and writes (strata.accounting.openlineage.dataset of each): its OpenLineage START event, to
        `path` (default: openlineage.jsonl in the directory it holds) and $STRATA_OPENLINEAGE_URL; its end
        (COMPLETE, or FAIL with the error) follows when the job ends. `outputs` may be named again before the
        end (`self.events.outputs`), once a version is known."""
        from strata.accounting.openlineage import FILE, Emitter
        from strata.data.storage import join, write_bytes_atomic

        self.events = Emitter(self.kind, self.name, path or join(self.holds, FILE), inputs, outputs,
                              write_bytes_atomic, streaming=streaming)
        self.events.start()

    def connect(self, **kwargs) -> None:
        """Connect to the cluster (or start an embedded Ray): strata.cluster.connect.connect's arguments."""
        from strata.cluster.connect import connect

        self.log.info(connect(**kwargs))

    def begin(self, config, info: dict | None = None) -> dict:
        """The run info of `config` (a dataclass or dict), or `info` an earlier launch of it wrote."""
        from strata.accounting.runinfo import run_info

        self.info = info or run_info(self.kind, config)
        return self.info

    @contextmanager
    def working(self) -> Iterator[None]:
        """Measure every node's usage while the run works (strata/accounting/cost.py)."""
        from strata.accounting.cost import UsageMonitor

        with UsageMonitor() as self.usage:
            yield

    def finish(self, *, beside: str, work_nodes, figures: dict) -> dict:
        """Write the run's record (strata/accounting/records.py) beside its outputs and under records/; returns what
        every command's summary says of it: cost, node_hours, cpu_busy."""
        from strata.accounting.records import write_record

        rec = write_record(self.storage, self.info, name=self.name, beside=beside, usage=self.usage,
                           work_nodes=work_nodes, figures=figures, started=command_started())
        return {"cost": rec["cost"], "node_hours": rec["node_hours"], "cpu_busy": rec["utilization"]["cpu_busy"]}


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that nothing written or flushed later fails on the closed pipe."""
    import os

    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _exit(code: int):
    """Stop an embedded Ray this process started (its processes go with it), then exit with `code`."""
    if "ray" in sys.modules:
        from strata.cluster.connect import shutdown

        shutdown()  # waits for a start still under way (connect_early) first
    if _ACTIVE and _ACTIVE[-1].whole_process:
        end_process(code)
    sys.exit(code)


def end_process(code: int) -> None:
    """End the process of a command that has ended: its exit handlers run (Ray's shutdown, logging's
    flush), stdout and stderr are flushed, and then it exits without tearing down every imported module.
    That teardown is all that is left, and with torch and Ray Tune imported it takes about 0.9 s on these
    machines (measured: the last line printed to the process's end), at the end of every command. A
    thread that is not a daemon still running means work is left: the process then exits as usual,
    after it."""
    import atexit
    import os
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()  # what the interpreter would run at exit, in the same order
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
