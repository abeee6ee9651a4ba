"""Which rows a training step learned from (`python -m strata lineage step RUN STEP`).

A run's data order is a function of its settings (train/data.py): the sources (every dataset pinned to its
version, with its weight), the seed, the micro-batch, the accumulation and the world size. A continued run
keeps them, so step S of any launch is micro-batches (S - 1) * accumulation ... S * accumulation - 1 of each
rank's stream. This module runs that same stream with a reader that hands back each row's place instead
of its tokens: the order is the training loop's own code, not a copy of it.

The settings come from the run's log (each launch's `start` event: micro-batch, accumulation, world size)
and its launch records (the dataset spec and the seed).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from strata.runlog import LOG, read_launches, read_log
from strata.shell import Command, Parser, StrataError
from strata.storage import Storage, exists, join


class LineageError(StrataError):
    pass


def _settings(run_dir: str, run: str, step: int) -> tuple[dict, dict, int]:
    """(the launch record, the start event, the run's last step) that trained step `step`."""
    if not exists(join(run_dir, LOG)):
        raise LineageError(f"no training run named {run!r} has a log under {run_dir}")
    log = read_log(run_dir)
    starts = log.events("start")
    last = max((r["step"] for r in log.steps), default=0)
    if not starts or not last:
        raise LineageError(f"run {run} has not trained a step yet")
    if not 1 <= step <= last:
        raise LineageError(f"run {run} has trained steps 1 to {last}: no step {step}")
    start = [s for s in starts if s["start_step"] < step][-1]  # the attempt that went on past it
    launches = read_launches(run_dir)
    launch = [launch for launch in launches if launch["started_at"] <= start["time"]][-1]
    return launch, start, last


def step_rows(storage: Storage, run: str, step: int) -> dict:
    """Every rank's rows of optimizer step `step` (1 = the first), in the order the loop took them:
    {"ranks": [{"rank", "rows": [{"dataset", "shard", "file", "row"}, ...]}], and the settings used}. `shard`
    is the file's full path, `file` its path in the dataset."""
    from train import mixture
    from train.data import Source, open_batches

    run_dir = storage.run(run)
    try:  # the run's own files, read back from storage: a field missing or of the wrong type is one line
        launch, start, _ = _settings(run_dir, run, step)
        spec, seed = str(launch["config"]["dataset"]), int(launch["config"]["train"]["seed"])
        micro, accum, world = (int(start[k]) for k in ("micro_batch", "grad_accum", "world_size"))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise LineageError(f"run {run}: its log ({join(run_dir, LOG)}) or launch records ({join(run_dir, 'launches')}) "
                           f"do not say how it read its data ({type(e).__name__}: {e})") from None
    if min(micro, accum, world) < 1:
        raise LineageError(f"run {run}: its log says micro-batch {micro}, accumulation {accum}, world {world}")
    versions = mixture.resolve_all(storage, spec)
    sources = [Source.of(v, w) for v, w in versions]
    # (dataset ref, shard, its path in the dataset) of every training shard, in the sources' order
    places = [(v.ref, ref, s.path) for (v, _), src in zip(versions, sources, strict=True)
              for ref, s in zip(src.shards, [s for s in v.shards if s.split == "train"], strict=True)]
    index = {shard.path: i for i, (_, shard, _) in enumerate(places)}

    def where(path: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """In place of a shard's rows: (shard index, row) of each, as the stream reads them."""
        i = index[path]
        rows = np.arange(start, places[i][1].rows if stop is None else stop, dtype=np.int64)
        return np.stack([np.full(len(rows), i, dtype=np.int64), rows], axis=1)

    ranks = []
    for rank in range(world):
        stream = open_batches(sources, batch_size=micro, rank=rank, world_size=world, seed=seed, read=where)
        batches = stream.from_step((step - 1) * accum)
        rows = np.concatenate([next(batches) for _ in range(accum)])
        ranks.append({"rank": rank, "rows": [{"dataset": places[i][0], "shard": places[i][1].path, "file": places[i][2],
                                              "row": int(r)} for i, r in rows.tolist()]})
    return {"run": run, "step": step, "dataset": spec, "seed": seed, "micro_batch": micro, "grad_accum": accum,
            "world_size": world, "ranks": ranks}


def main(argv: list[str] | None = None) -> int:
    return Command("python -m strata lineage", argv, tag="lineage").run(_main, user_errors=(ValueError,))


def _main(cmd: Command) -> int:
    p = Parser(prog="python -m strata lineage", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sp = sub.add_parser("step", help="the rows of one training step's batch, every worker's")
    sp.add_argument("run", help="a training run's name")
    sp.add_argument("step", type=int, help="the optimizer step (1 = the first)")
    sp.add_argument("--storage", help="storage root (default: $STRATA_STORAGE or ~/strata-data)")
    sp.add_argument("--json", action="store_true", help="print JSON instead")
    a = p.parse_args(cmd.argv)
    out = step_rows(Storage.from_env(a.storage), a.run, a.step)
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"step {out['step']} of run {out['run']}: {out['world_size']} worker(s) x {out['grad_accum']} micro-batch(es) "
          f"of {out['micro_batch']} rows, dataset {out['dataset']}, seed {out['seed']}")
    for r in out["ranks"]:
        print(f"  worker {r['rank']}:")
        for row in r["rows"]:
            print(f"    {row['dataset']}  {row['file']}  row {row['row']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
