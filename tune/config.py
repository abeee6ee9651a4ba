"""What a sweep runs (`SweepConfig`): the `python -m tune` flags. Imports no torch, so that the command
checks its flags, and starts Ray, before it loads the model code."""

from __future__ import annotations

import math
from dataclasses import dataclass

from strata.commands.cli import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, check_fields


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    num_samples: int = 8
    """Trials to run."""
    max_concurrent: int = 0
    """Trials running at once (0: as many as the spot tier's CPUs hold)."""
    steps: int = 40
    """Optimizer steps per trial (if not stopped early)."""
    report_every: int = 10
    """Steps between reports; ASHA decides at these points."""
    scheduler: str = "asha"
    """`asha` (early stopping) or `fifo` (every trial runs to the end)."""
    search: str = "random"
    """`random` (seeded random sampling) or `optuna` (Optuna's TPE; needs the optuna package)."""
    space: str = "lr-batch"
    """Search space: a name (lr-batch, small) or a .json/.yaml file of {param: {distribution: args}}."""
    max_rows: int = 65536
    """Training rows each trial process keeps in memory: it reads a shard once while they fit (trials read
    the dataset's shards as a run's workers do, in the same order)."""
    eval_rows: int = 64
    """Validation rows each report is scored on."""
    seed: int = 0
    """Seed of the search and of every trial's init and data order."""
    pack: int = 0
    """Configs a worker takes from the sweep's queue at a time (0: about TAKE_S seconds of them, at least one);
    1: one Tune trial per config instead, with Tune's scheduler and a checkpoint at every report."""
    max_failures: int = 3
    """Times a trial (a worker, or a config's own trial with --pack 1) is restarted after its node is lost;
    with the queue, a config lost this many times plus one is recorded as an error."""
    cpus_per_trial: float = 1.0
    """CPUs each trial reserves on its spot node."""
    init_from: str = ""
    """Fine-tune: every trial starts from these weights (a GPT-2-layout directory or RUN[@STEP]); the model's
    shape is theirs."""
    metric: str = "val_loss"
    """What ranks trials: val_loss, val_bpb (bits per byte: comparable across tokenizers), or task_acc or
    task_acc_norm: accuracy on --eval-task (higher is better), scored at each report."""
    eval_task: str = ""
    """A multiple-choice task file (JSONL: context, choices, gold; train/tasks.py) for --metric task_acc or
    task_acc_norm."""

    def __post_init__(self):
        if self.scheduler not in ("asha", "fifo"):
            raise ValueError(f"scheduler must be asha or fifo, not {self.scheduler!r}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {', '.join(METRICS)}, not {self.metric!r}")
        if (self.metric in MAXIMIZED) != bool(self.eval_task):
            raise ValueError(f"--metric {self.metric} and --eval-task go together: --metric task_acc or "
                             "task_acc_norm scores the --eval-task file")
        if self.search not in ("random", "optuna"):
            raise ValueError(f"search must be random or optuna, not {self.search!r}")
        check_fields(self, {**dict.fromkeys(("num_samples", "steps", "report_every", "max_rows", "eval_rows"),
                                            AT_LEAST_ONE), "cpus_per_trial": POSITIVE,
                            **dict.fromkeys(("max_concurrent", "pack", "seed"), NON_NEGATIVE),
                            "max_failures": (lambda v: v >= -1, ">= 0, or -1 for no limit")})
        if self.search == "optuna" and self.pack > 1:
            raise ValueError("--search optuna proposes one config per Tune trial (--pack 1); it cannot "
                             "take configs from the queue")

    @property
    def mode(self) -> str:
        """Tune's mode: accuracy rises as a model gets better, losses fall."""
        return "max" if self.metric in MAXIMIZED else "min"

    @property
    def sign(self) -> float:
        """+1 for a metric to minimise, -1 for one to maximise: `sign * value` is smaller when better."""
        return -1.0 if self.metric in MAXIMIZED else 1.0

    def best(self, values) -> float:
        """The best of `values` under the metric."""
        return min(values, key=lambda v: self.sign * v)

    @property
    def queued(self) -> bool:
        """Workers pull configs from the sweep's queue (random search, --pack other than 1); else one Tune
        trial per config."""
        return self.search == "random" and self.pack != 1

    @property
    def reports(self) -> int:
        """Reports (ASHA's time unit) of a config that runs to the end."""
        return math.ceil(self.steps / self.report_every)


MAXIMIZED = ("task_acc", "task_acc_norm")
METRICS = ("val_loss", "val_bpb", *MAXIMIZED)
REFERENCE_CONCURRENT = 200  # trials at once the sweep tier is sized for (50,000 configs in about 4 hours)
