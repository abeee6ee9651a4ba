"""The sweep's config queue: long-lived worker trials pull configs from it and hand back their results.
This module (the queue, the workers' loop, sampling and ASHA's rule) imports no torch: a worker process
holds only what its configs' training needs.

A queued sweep (the default with random search) runs a few Tune trials, one
per slot of the spot tier: *workers*. A worker asks the queue for config
indices (a config is a pure function of its index: tune.sweep.sample),
trains them, and hands their results back with its next request. The queue
is one actor on the driver's node (never a spot node) and holds:

- what is left to run, with configs given back by a lost worker at the front;
- what each worker holds (at most about TAKE_S of work: `take`'s `n`);
- ASHA's rungs over the whole sweep;
- finished results not yet written. They are written to `results/` a part
  at a time (every FLUSH_S, or FLUSH_ROWS results), so what a sweep writes
  grows by a few files per hour, and the driver holds none of them.

A lost worker's configs go back to the front of the queue at once (the
driver's RequeueLost callback), where a waiting worker takes them: nothing
restores from a checkpoint, and no config that finished is run again. A
killed driver loses at most FLUSH_S of results; the rerun's queue reads
`results/` and queues only the configs not in it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import math
import time
import uuid
from collections import deque

import numpy as np

from strata.commands.shell import StrataError
from strata.data.storage import JsonlWriter, join, list_dir, text_of, write_bytes_atomic

FLUSH_S, FLUSH_ROWS = 10.0, 2000
GRACE, REDUCTION = 2, 2  # ASHA: first rung after 2 reports, keep the best half at each rung
TAKE_S = 0.25  # a worker takes about this much work from the queue at a time: a request is about 1 ms
MAX_TAKE = 256  # configs a worker takes at once, at most (trivial ones)
LOG_S = 5.0  # a worker writes its configs' training losses at most this often
RESULTS = "results"  # under the sweep's directory: part-<driver start ns>-<n>.jsonl, a result per line


def sample(space: dict, seed: int, index: int) -> dict:
    """Config number `index` of a queued sweep: a pure function of (space, seed, index)."""
    rng = np.random.default_rng([seed, index])
    out = {}
    for key in sorted(space):
        (name, args), = space[key].items()
        if name == "loguniform":
            v = float(math.exp(rng.uniform(math.log(args[0]), math.log(args[1]))))
        elif name == "uniform":
            v = float(rng.uniform(args[0], args[1]))
        elif name == "randint":  # Tune's convention: high excluded
            v = int(rng.integers(args[0], args[1]))
        else:
            v = args[int(rng.integers(len(args)))]
        out[key] = v
    return out


def rungs(max_t: int) -> list[int]:
    """ASHA's milestones (in reports) below max_t: GRACE, GRACE*REDUCTION, ..."""
    out, t = [], min(GRACE, max_t)
    while t < max_t:
        out.append(t)
        t *= REDUCTION
    return out


def asha_keeps(recorded: list[float], metric: float) -> bool:
    """ASHA's rule for a metric to minimise: go on unless worse than the best 1/REDUCTION recorded so far."""
    if not recorded:
        return True
    return not metric > float(np.nanpercentile(recorded, 100 / REDUCTION))


class Rung:
    """The (signed) metrics recorded at one ASHA rung, kept sorted: `keeps` is asha_keeps over them without
    rebuilding an array per judgement, which at 50,000 configs is O(n) each."""

    def __init__(self):
        self.sorted: list[float] = []  # NaN left out, as nanpercentile leaves it out
        self.count = 0  # every metric recorded, NaN too: a config's place in the rung's order

    def add(self, metric: float) -> None:
        self.count += 1
        if not math.isnan(metric):
            bisect.insort(self.sorted, metric)

    def keeps(self, metric: float) -> bool:
        v = self.sorted
        if not v:
            return True
        # numpy's default ("linear") percentile, computed the way numpy does, so that a tie decides alike
        pos = (len(v) - 1) * (1 / REDUCTION)
        lo = math.floor(pos)
        t, a, b = pos - lo, v[lo], v[min(lo + 1, len(v) - 1)]
        cut = b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t
        return not metric > cut


def _log_for(out: str):
    from ray import tune

    return JsonlWriter(join(out, "trials", tune.get_context().get_trial_id(), "metrics.jsonl")) if out else None


def _row(index, hp: dict, step: int, losses: list[float], metric_name: str, metric: float) -> dict:
    """A row of a trial's metrics.jsonl: a run's (`step`, `loss`, `step_losses`) with the config's `index`
    (None: its own Tune trial) and `config`."""
    return {"time": time.time(), "index": index, "config": hp, "step": step, "loss": sum(losses) / len(losses),
            "step_losses": losses, metric_name: metric}


def run_worker(*, sweep, space: dict, make_fit, queue: str, out: str = "") -> None:
    """Take configs from the queue named `queue` and train them until the queue says the sweep is over.

    Each config reports to the queue only at ASHA's rungs (whose answer may stop it) and when it ends; its
    results go back with the worker's next request. A config's own failure (an exception in its
    training) is its result, an error with the message; a storage error fails the worker instead, for Tune
    to restart, and the queue to hand its configs to a worker that can read. Training losses go to
    `out`/trials/WORKER/metrics.jsonl, at most every LOG_S.
    """
    import ray
    from ray import tune

    s = sweep
    q = ray.get_actor(queue)
    node = ray.get_runtime_context().get_node_id()
    worker = tune.get_context().get_trial_id()
    milestones = set(rungs(s.reports)) if s.scheduler == "asha" else set()
    log, rows, logged = _log_for(out), [], time.monotonic()
    results, n, configs, process = [], max(s.pack, 1), 0, uuid.uuid4().hex  # process: this one's id
    started, waited = time.monotonic(), 0.0  # waited: this worker's time in queue requests

    def ask(call):
        nonlocal waited
        t = time.monotonic()
        try:
            return ray.get(call)
        finally:
            waited += time.monotonic() - t

    while True:
        got = ask(q.take.remote(worker, n, results, process))
        results = []
        if log and rows and (got is None or time.monotonic() - logged >= LOG_S):
            log.extend(rows)
            rows, logged = [], time.monotonic()
        if got is None:
            tune.report({"configs": configs})  # Tune's record of the worker (no checkpoint)
            return
        configs += len(got)
        began = time.monotonic()
        for index, attempt in got:
            hp = sample(space, s.seed, index)
            curve, status, error, at = [], "completed", None, time.time()
            try:
                fit = make_fit(hp, None)
            except OSError:
                raise
            except Exception as e:  # noqa: BLE001 - the config's own failure is its result
                status, error = "error", _error(e)
            while error is None and len(curve) < s.reports:
                try:
                    metric, losses = fit.advance()
                except OSError:
                    raise
                except Exception as e:  # noqa: BLE001
                    status, error = "error", _error(e)
                    break
                curve.append(metric)
                if log:
                    rows.append(_row(index, hp, fit.step, losses, s.metric, metric))
                if len(curve) in milestones:
                    keep, order = ask(q.judge.remote(len(curve), s.sign * metric))
                    if log:  # the rung's record, in the order the queue met the configs there
                        rows[-1]["asha"] = {"rung": len(curve), "order": order, "kept": keep}
                    if not keep:
                        status = "stopped early"
                        break
            results.append({"index": index, "config": hp, "curve": curve, "status": status, "node": node,
                            "worker": worker, "attempts": attempt, "error": error, "started": at,
                            "report_share": waited / max(time.monotonic() - started, 1e-9)})
        if not s.pack:  # about TAKE_S of work per request
            per = (time.monotonic() - began) / len(got)
            n = max(1, min(MAX_TAKE, int(TAKE_S / max(per, 1e-6))))


def _error(e: Exception) -> str:
    import traceback

    traceback.print_exc()  # to the worker's log (the driver shows it with --verbose; the record keeps the line)
    return f"{type(e).__name__}: {e}"[:500]


STATUSES = ("completed", "stopped early", "error")


class SweepPartError(StrataError):
    """A results part of a sweep that is not what the queue writes."""


def _checked(line: str, where: str, configs: int | None) -> dict:
    """One result line, its fields' types and its index's range checked (a part is data read back from
    storage): the record, or SweepPartError naming the file and the line."""
    try:
        rec = json.loads(line)
    except ValueError:
        rec = None
    problem = ("not a JSON object" if not isinstance(rec, dict) else
               f"index {rec.get('index')!r} is not a config of this sweep (0..{configs - 1 if configs else '?'})"
               if isinstance(rec.get("index"), bool) or not isinstance(rec.get("index"), int) or rec["index"] < 0
               or (configs is not None and rec["index"] >= configs) else
               f"status {rec.get('status')!r} is not one of {', '.join(STATUSES)}" if rec.get("status") not in STATUSES
               else "curve is not a list of numbers" if not isinstance(rec.get("curve"), list) or not all(
                   isinstance(v, int | float) and not isinstance(v, bool) for v in rec["curve"])
               else "attempts is not a whole number" if isinstance(rec.get("attempts", 0), bool)
               or not isinstance(rec.get("attempts", 0), int) else None)
    if problem:
        raise SweepPartError(f"{where}: {problem}; this sweep's results were written by something else, or "
                             "damaged: move the file away to run those configs again")
    return rec


def read_results(sweep_dir: str, configs: int | None = None):
    """Every config result a queued sweep has written, in the order written (the first of any index
    written twice, which a killed driver's rerun can do); each checked (`configs`: the sweep's size)."""
    seen = set()
    for name, is_dir in list_dir(join(sweep_dir, RESULTS)):
        if is_dir or not name.endswith(".jsonl"):
            continue
        path = join(sweep_dir, RESULTS, name)
        for n, line in enumerate(text_of(path, "sweep results part").splitlines(), 1):
            if line.strip() and (rec := _checked(line, f"{path}:{n}", configs))["index"] not in seen:
                seen.add(rec["index"])
                yield rec


class ConfigQueue:
    """The queue of one sweep (see the module's doc). Its methods are coroutines on one event loop, so each
    runs to its first `await` alone: no locks. Workers are named by their Tune trial id, which a restarted
    trial keeps."""

    def __init__(self, sweep_dir: str, configs: int, *, rungs: list[int], sign: float, max_attempts: int,
                 flush_s: float = FLUSH_S):
        self.sweep_dir, self.configs, self.sign, self.max_attempts = sweep_dir, configs, sign, max_attempts
        self.flush_s = flush_s
        self.finished = np.zeros(configs, dtype=bool)
        self.rungs = {t: Rung() for t in rungs}  # signed metrics recorded at each rung
        self.counts = {"completed": 0, "stopped early": 0, "error": 0}
        self.best = None
        for rec in read_results(sweep_dir, configs):  # a rerun: what the killed driver's queue wrote, rungs included
            self._count(rec)
            for t, rung in self.rungs.items():
                if len(rec["curve"]) >= t:
                    rung.add(self.sign * rec["curve"][t - 1])
        self.resumed = int(self.finished.sum())
        self.pending = deque(int(i) for i in np.flatnonzero(~self.finished))
        self.held: dict[str, dict[int, int]] = {}  # worker -> {index: attempt}
        self.attempts = np.zeros(configs, dtype=np.int32)  # index -> times handed out
        self.back: set[int] = set()  # indices a lost worker gave back, queued again: only these can be both
        # queued and finished (a worker thought lost that was not), so only these are looked for in `pending`
        self.buffer: list[dict] = []
        self.started, self.part, self.flushed = time.time_ns(), 0, time.monotonic()
        self.requeued = self.peak = 0
        self.process: dict[str, str | None] = {}  # worker -> the id of its process now (None: lost)
        self.changed = None  # asyncio.Condition, made on the actor's loop (`_loop`)

    def _loop(self) -> asyncio.Condition:
        if self.changed is None:
            self.changed = asyncio.Condition()
            asyncio.get_running_loop().create_task(self._flush_every())
        return self.changed

    async def _flush_every(self):
        while True:
            await asyncio.sleep(self.flush_s)
            if time.monotonic() - self.flushed >= self.flush_s:
                self.flush()

    def _count(self, rec: dict) -> None:
        i = rec["index"]
        if self.finished[i]:
            return
        self.finished[i] = True
        self.counts[rec["status"]] += 1
        if rec["curve"]:
            best = min(self.sign * v for v in rec["curve"])
            self.best = best if self.best is None else min(best, self.best)

    def _done(self) -> bool:
        return not self.pending and not any(self.held.values())

    async def take(self, worker: str, n: int, results: list[dict], process: str = "") -> list[tuple[int, int]] | None:
        """Record `results` (the worker's finished configs), then give the worker up to `n` configs as
        (index, attempt): at once when some are queued, or once others' lost configs come back. None: the
        sweep is over, and every result is written; or this call's `process` (the worker process's own id)
        is no longer the worker's. A worker's first call from a new process means it (re)started: whatever
        it held was lost with the last one, and a call of the last one still waiting here takes nothing."""
        changed = self._loop()
        if self.process.get(worker) != process:
            self.lost(worker)
            self.process[worker] = process
        held = self.held.setdefault(worker, {})
        for rec in results:
            held.pop(rec["index"], None)
            self._record(rec)
        if len(self.buffer) >= FLUSH_ROWS or time.monotonic() - self.flushed >= self.flush_s:
            self.flush()
        async with changed:
            changed.notify_all()  # the last holder's results can end the sweep for the waiting workers
            while not self.pending:
                if self._done():
                    self.flush()  # before any worker is told the sweep is over
                    return None
                await changed.wait()
                if self.process.get(worker) != process:  # its process was lost while it waited
                    return None
        got, held = [], self.held.setdefault(worker, {})  # anew: `lost` may have dropped it meanwhile
        while self.pending and len(got) < max(1, n):
            i = self.pending.popleft()
            self.back.discard(i)
            self.attempts[i] += 1
            held[i] = attempt = int(self.attempts[i])
            got.append((i, attempt))
        self.peak = max(self.peak, sum(bool(h) for h in self.held.values()))
        return got

    def _record(self, rec: dict) -> None:
        i = rec["index"]
        if self.finished[i]:  # already on record (a worker thought lost that was not): the first stands
            return
        if i in self.back:  # requeued meanwhile
            self.back.discard(i)
            with contextlib.suppress(ValueError):
                self.pending.remove(i)
        self._count(rec)
        self.buffer.append(rec)

    async def judge(self, rung: int, metric: float) -> tuple[bool, int]:
        """ASHA at a rung, over every config of the sweep: go on unless the (signed) metric is worse than
        the best 1/REDUCTION recorded there so far. Returns (go on, how many were recorded before)."""
        r = self.rungs[rung]
        keep = r.keeps(metric)
        r.add(metric)
        return keep, r.count - 1

    def lost(self, worker: str, why: str = "") -> int:
        """Put a lost worker's configs back at the front of the queue; a config lost max_attempts times is
        recorded as an error instead (it may be what kills its worker). Returns how many were requeued."""
        held = self.held.pop(worker, {})
        back = 0
        for i, attempt in sorted(held.items(), reverse=True):
            if self.finished[i]:
                continue
            if attempt >= self.max_attempts:
                self._record({"index": i, "config": None, "curve": [], "status": "error", "node": None,
                              "worker": worker, "attempts": attempt, "error": f"lost with its worker {attempt} "
                              f"times{f' (last: {why})' if why else ''}", "report_share": None})
            else:
                self.pending.appendleft(i)
                self.back.add(i)
                back += 1
        self.requeued += back
        if self.changed is not None and held:
            asyncio.get_running_loop().create_task(self._wake())
        return back

    async def _wake(self):
        async with self.changed:
            self.changed.notify_all()

    async def requeue(self, worker: str, why: str = "") -> int:
        """`lost`, called by the driver's callback when Tune sees a worker fail: its process is gone, so a
        call of it still waiting here must take nothing (the configs would be held by no one)."""
        self.process[worker] = None
        return self.lost(worker, why)

    def flush(self) -> None:
        """Write the results not yet written as one part."""
        self.flushed = time.monotonic()
        if not self.buffer:
            return
        data = "".join(json.dumps(r) + "\n" for r in self.buffer).encode()
        write_bytes_atomic(join(self.sweep_dir, RESULTS, f"part-{self.started:020d}-{self.part:05d}.jsonl"), data)
        self.part += 1
        self.buffer = []

    async def close(self) -> dict:
        self.flush()
        return await self.progress()

    async def progress(self) -> dict:
        done = int(self.finished.sum())
        return {"trials": self.configs, "done": done - self.counts["error"], "errors": self.counts["error"],
                "best": None if self.best is None else self.sign * self.best,
                "running": sum(bool(h) for h in self.held.values()), "peak_running": self.peak,
                "queued": len(self.pending), "requeued": self.requeued, "resumed": self.resumed,
                "over": self._done(), "parts": self.part, "cpu_s": time.process_time()}
