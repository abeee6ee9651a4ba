"""Batch scoring as a Ray Data job: documents read as tier 1 reads them, scored by an actor pool on the
tier `--tier` names (the model built once per actor), written as a parquet table keyed by document id."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from strata.cluster import tiers
from strata.commands.shell import Job, StrataError
from strata.commands.shell import log as _logger
from strata.data.storage import Storage, delete_dir, join

_say = _logger("score").info


@dataclass(kw_only=True)
class ScoreConfig:
    stride: int = 0
    """Tokens a window moves by when a document is longer than the model's context (0: half the context)."""
    batch_tokens: int = 0
    """Tokens a batch of windows holds (windows of like length are batched together; 0: 4096 on a CPU,
    65536 on a GPU)."""
    actors: int = 0
    """Scoring actors (0: one per CPU but one, or one per GPU on the gpu tier)."""
    tier: str = "cpu"
    """The tier the work runs on: `cpu` (cheap nodes, the default) or `gpu`."""
    docs_per_batch: int = 64
    """Documents handed to an actor at a time."""

    def __post_init__(self):
        if self.tier not in (tiers.Tier.CPU, tiers.Tier.GPU):
            raise ValueError("--tier must be cpu or gpu")
        if self.stride < 0 or self.batch_tokens < 0 or self.actors < 0 or self.docs_per_batch < 1:
            raise ValueError("--stride, --batch-tokens and --actors must be >= 0, --docs-per-batch >= 1")


def score(spec: str, inputs: list[str], cfg: ScoreConfig, storage: Storage, name: str, dataset: str = "",
          allow_tainted: bool = False) -> dict:
    """Score every document of `inputs` (or every row of `dataset`, NAME[@VERSION]) under model `spec`; the
    summary (output table, counts, loss, bpb, throughput, cost)."""
    import ray

    from infer.model import resolve
    from infer.score import default_actors, scoring
    from strata.data.inputs import list_inputs
    from strata.data.sources import ReadConfig, read_file

    model = resolve(spec, storage, allow_tainted=allow_tainted)  # on the driver: a bad --model fails before Ray starts
    items, reader = _dataset_rows(dataset, model, storage) if dataset else (list_inputs(inputs), None)
    stride = cfg.stride or max(1, model.cfg.seq_len // 2)
    if stride > model.cfg.seq_len:
        raise ValueError(f"--stride {stride} is longer than the model's context {model.cfg.seq_len}")
    out = storage.scores(name)
    with Job("score", name, storage, holds=out, what=f"scores {name}") as job:
        job.connect(quiet=True, log_to_driver=False)
        job.begin({"model": model.source, "origin": model.origin, "inputs": inputs, "dataset": dataset, **asdict(cfg)})
        from strata.accounting.openlineage import dataset as lineage_dataset

        name_, _, version_ = dataset.partition("@")
        job.lineage([*model_dataset(model.source, storage), *(lineage_dataset(p) for p in inputs),
                     *([lineage_dataset(storage.dataset(name_), version_ or None)] if dataset else [])],
                    [lineage_dataset(out)])
        actors = cfg.actors or default_actors(cfg.tier)
        read = ReadConfig()

        def documents(f: dict) -> list[dict]:  # a row is an input file: path, size, mtime, and the --input
            return [{"doc_id": d["doc_id"], "source": f["path"], "input": f["source"], "text": d["text"],
                     "status": d["status"], "reason": d["reason"]}
                    for d in read_file({**f, "start": 0, "end": f["size"]}, read)]

        delete_dir(out)  # a rerun of the same name replaces it
        started = time.time()
        with job.working():
            ds = ray.data.from_items(items).flat_map(reader or documents, label_selector=tiers.selector(tiers.Tier.CPU))
            ds = scoring(ds, model, tier=cfg.tier, actors=actors, stride=stride, batch_tokens=cfg.batch_tokens,
                         docs_per_batch=cfg.docs_per_batch)
            ds.write_parquet(join(out, "table"))
        table = _read(join(out, "table"))
        wall = time.time() - started
        ok = [r for r in table if not r["unscored"]]
        tokens = sum(r["tokens"] for r in ok)
        nll = sum(r["loss"] * r["tokens"] for r in ok)
        figures = {"documents": len(ok), "unscored": len(table) - len(ok), "tokens": tokens,
                   "loss": nll / tokens if tokens else math.nan,
                   "bpb": nll / math.log(2) / max(1, sum(r["bytes"] for r in ok)),
                   "tokens_per_s": tokens / max(wall, 1e-9),
                   "by_bpb": [[round(r["bpb"], 4), r["doc_id"]] for r in sorted(ok, key=lambda r: r["bpb"])[:SHOWN]]}
        nodes = [n["NodeID"] for n in tiers.nodes_of(cfg.tier, ray.nodes())]
        cost = job.finish(beside=join(out, "record.json"), work_nodes=nodes, figures=figures)
    per_million = cost["cost"] / tokens * 1e6 if tokens and cost["cost"] is not None else None
    return {"name": name, "model": model.source, "output": join(out, "table"), **figures, **cost,
            "dollars_per_million_tokens": per_million, "actors": actors, "stride": stride}


SHOWN = 12  # documents a score's summary names, best scored first (the table has them all)


def model_dataset(source: str, storage: Storage) -> list[dict]:
    """A model a run reads, as an OpenLineage dataset: RUN@STEP as its run's directory at that step, or the
    exported directory."""
    from strata.accounting.openlineage import dataset

    if not source:
        return []
    run, _, step = source.rpartition("@")
    if run and step.isdigit():
        try:
            return [dataset(storage.run(run), step)]
        except ValueError:
            pass
    return [dataset(source)]


def on_tier(kind: str, name: str, storage: Storage, out: str, tier: str, config: dict, fn, *args,
            figures, **kwargs) -> tuple[object, dict]:
    """`fn(*args, **kwargs, cpus=, device=)` as one Ray task on `tier` (a cpu-tier node's CPUs, or one GPU), under a
    Job: `out` leased, the usage measured, the record beside it (`figures(result)` in it). Returns the
    task's result and the cost figures (cost, node_hours, cpu_busy)."""
    import ray

    from strata.accounting.openlineage import dataset

    with Job(kind, name, storage, holds=out, what=f"{kind} {name}") as job:
        job.connect(quiet=True, log_to_driver=False)
        job.begin(config)
        job.lineage([*model_dataset(config.get("model", ""), storage),
                     *(dataset(p) for p in config.get("inputs") or [] if isinstance(p, str)),
                     *(dataset(config[k]) for k in ("task", "prompts") if isinstance(config.get(k), str))],
                    [dataset(out)])
        gpu = tier == tiers.Tier.GPU
        nodes = tiers.nodes_of(tier, ray.nodes())
        if not nodes:
            raise StrataError(f"no alive node serves the {tier} tier (label {tiers.label_key(tier)}=true)")
        # A node's CPUs, less what is taken now (a submitted job's driver holds one): asking for more than is
        # free would leave the task pending for ever on a one-node cluster.
        free = ray.available_resources().get("CPU", 1)
        cpus = 1 if gpu else max(1, int(min(max(n["Resources"].get("CPU", 1) for n in nodes), free)))
        task = ray.remote(fn).options(num_cpus=cpus, num_gpus=1 if gpu else 0, label_selector=tiers.selector(tier),
                                      max_retries=0)
        with job.working():
            result = ray.get(task.remote(*args, **kwargs, cpus=cpus, device="cuda" if gpu else "cpu"))
        cost = job.finish(beside=join(out, "record.json"), work_nodes=[n["NodeID"] for n in nodes],
                          figures=figures(result))
    return result, cost


def _dataset_rows(ref: str, model, storage: Storage) -> tuple[list[dict], object]:
    """A dataset version's shards, and a reader of a shard's rows as documents (`doc_id` SHARD:ROW, `source`
    the split, `ids` the row's token ids without padding); the model must read the dataset's tokenizer."""
    from strata.data.dataset import resolve

    version = resolve(storage, ref)
    m = version.manifest
    if m.tokenizer.hash != model.tokenizer.hash:
        raise ValueError(f"--dataset {ref} was tokenized with {m.tokenizer.kind} (vocab {m.tokenizer.vocab_size}, "
                         f"hash {m.tokenizer.hash[:12]}), --model {model.source} reads {model.tokenizer.kind} "
                         f"(vocab {model.tokenizer.vocab_size}, hash {model.tokenizer.hash[:12]}): score its "
                         "documents with --input instead")
    shards = [{"path": version.file(s.path), "name": s.path, "split": s.split} for s in version.shards]
    return shards, _rows_of


def _rows_of(shard: dict) -> list[dict]:
    from strata.data.dataset import pad_value
    from strata.data.rows import read_rows

    rows = read_rows(shard["path"])
    pad = pad_value(rows.dtype)
    return [{"doc_id": f"{shard['name']}:{i}", "source": shard["split"], "ids": row[row != pad].astype(np.int64)}
            for i, row in enumerate(rows)]


def _read(path: str) -> list[dict]:
    import pyarrow.dataset as pads

    from strata.data.storage import filesystem

    fs, p = filesystem(path)
    return pads.dataset(p, filesystem=fs, format="parquet").to_table(
        columns=["doc_id", "unscored", "tokens", "loss", "bpb", "bytes"]).to_pylist()
