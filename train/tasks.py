"""Multiple-choice tasks: acc and acc_norm as lm-evaluation-harness defines them, for `python -m infer eval`,
for evaluations during training (`--eval-task`) and for sweeps that optimise accuracy.

A task file holds one JSON object a line: {"context": str, "choices": [str, ...], "gold": int}. Each
choice is scored by the summed log-likelihood of its tokens after the context's (the context alone when
it is not empty, else an end-of-text id; the left of a pair longer than the model's context is cut).
`acc` takes the most likely choice; `acc_norm` the most likely per byte of the choice. Each comes with
its standard error over the task's items (the sample standard deviation over the square root of n).

`evaluate_checkpoint` is an evaluation during training: a Ray task on the cpu tier, off the training
workers, over a committed checkpoint (train/trainer.py `TaskEvals` launches it).
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from strata.accounting.runlog import TASK_EVAL
from train.step import IGNORE


class TaskError(ValueError):
    """A task file that is not what evaluation reads."""


def load_task(path: str) -> list[dict]:
    from strata.data.storage import text_of

    items = []
    try:
        text = text_of(path, "task")
    except ValueError as e:
        raise TaskError(str(e)) from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}:{n}: not JSON ({e.msg})") from None
        ok = (isinstance(item, dict) and isinstance(item.get("context"), str) and isinstance(item.get("choices"), list)
              and len(item["choices"]) >= 2 and all(isinstance(c, str) and c for c in item["choices"])
              and isinstance(item.get("gold"), int) and 0 <= item["gold"] < len(item["choices"]))
        if not ok:
            raise TaskError(f"{path}:{n}: an item needs a context (a string), at least two non-empty choices and "
                            "a gold index among them")
        items.append(item)
    if not items:
        raise TaskError(f"{path} holds no item")
    return items


def continuation_logliks(model, pairs: list[tuple[np.ndarray, np.ndarray]], eot_id: int, *,
                         batch_tokens: int = 4096, device: str = "cpu") -> list[float]:
    """The summed log-likelihood of each continuation's tokens after its context's."""
    context = model.cfg.seq_len
    items = []
    for i, (ctx, cont) in enumerate(pairs):
        seq = np.concatenate([np.asarray(ctx if len(ctx) else [eot_id], np.int64), np.asarray(cont, np.int64)])
        seq = seq[-(context + 1):]
        targets = seq[1:].copy()
        targets[: len(targets) - len(cont)] = IGNORE
        items.append((i, seq[:-1], targets))
    items.sort(key=lambda it: len(it[1]))
    out = np.zeros(len(pairs))
    with torch.no_grad():
        at = 0
        while at < len(items):
            width = len(items[at][1])
            batch = [it for it in items[at:at + max(1, batch_tokens // width)] if len(it[1]) < 2 * width] or items[at:at + 1]
            at += len(batch)
            T = max(len(it[1]) for it in batch)
            x = torch.zeros((len(batch), T), dtype=torch.long)
            y = torch.full((len(batch), T), IGNORE, dtype=torch.long)
            for r, (_, inputs, targets) in enumerate(batch):
                x[r, : len(inputs)], y[r, : len(targets)] = torch.from_numpy(inputs), torch.from_numpy(targets)
            _, losses = model(x.to(device), y.to(device), per_token=True)
            for (i, _, _), s in zip(batch, losses.view(len(batch), T).sum(dim=1).double().cpu().numpy(), strict=True):
                out[i] = -s
    return out.tolist()


def _stderr(hits: np.ndarray) -> float:
    return float(np.std(hits, ddof=1) / math.sqrt(len(hits))) if len(hits) > 1 else math.nan


def evaluate(model, tok, items: list[dict], *, batch_tokens: int = 4096, device: str = "cpu") -> dict:
    """acc and acc_norm with their standard errors, and each item's choice log-likelihoods."""
    pairs, owner = [], []
    for k, item in enumerate(items):
        ctx = tok.encode(item["context"]) if item["context"] else np.zeros(0, np.int64)
        for c in item["choices"]:
            pairs.append((ctx, tok.encode(c)))
            owner.append(k)
    lls = continuation_logliks(model, pairs, tok.eot_id, batch_tokens=batch_tokens, device=device)
    acc, acc_norm, per_item, at = [], [], [], 0
    for item in items:
        ll = np.array(lls[at: at + len(item["choices"])])
        at += len(item["choices"])
        lengths = np.array([len(c.encode()) for c in item["choices"]], dtype=float)
        acc.append(float(np.argmax(ll) == item["gold"]))
        acc_norm.append(float(np.argmax(ll / lengths) == item["gold"]))
        per_item.append(ll.tolist())
    acc, acc_norm = np.array(acc), np.array(acc_norm)
    return {"items": len(items), "acc": float(acc.mean()), "acc_stderr": _stderr(acc),
            "acc_norm": float(acc_norm.mean()), "acc_norm_stderr": _stderr(acc_norm), "logliks": per_item}


EVENT = TASK_EVAL  # a row of metrics.jsonl: an evaluation during training, at the step of its checkpoint


def evaluate_checkpoint(checkpoint: str, items: list[dict], step: int) -> dict:
    """An evaluation during training: acc and acc_norm of a committed checkpoint (a task on the cpu tier)."""
    import time

    from strata.data.commit import failpoint
    from train.sample import load

    failpoint(f"task-eval:{step}")  # tests: the task dies here, as the out-of-memory killer would kill it
    started = time.time()
    model, tok, at = load(checkpoint)
    result = {k: v for k, v in evaluate(model, tok, items).items() if k != "logliks"}
    return {**result, "step": at, "seconds": round(time.time() - started, 2)}


class TaskEvals:
    """The training driver's evaluations during training (`--eval-task FILE`).

    A thread beside `fit()` looks for committed checkpoints at multiples of --eval-every (the loop saves
    one there) and evaluates each in a Ray task on the cpu tier, off the training workers: training never
    waits for it. Each result, or the failure of a task that crashed or ran out of memory, becomes a
    `task_eval` row of metrics.jsonl at the checkpoint's step, and a TensorBoard point (`task/acc`,
    `task/acc_norm`). `close` waits up to `wait_s` for the evaluations still running when training ends.
    """

    POLL_S = 2.0

    def __init__(self, run_dir: str, task: str, every: int, done_steps: set[int]):
        import threading

        from strata.data.storage import basename

        self.run_dir, self.task, self.every = run_dir, task, every
        self.name = basename(task)
        self.items = load_task(task)  # a bad task file fails before training starts
        self.launched: set[int] = set(done_steps)  # a continued run does not evaluate a step again
        self.pending: dict = {}  # ObjectRef -> step
        self.rows: list[dict] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="strata-task-evals", daemon=True)
        self.items_ref, self.tb = None, None

    def start(self) -> TaskEvals:
        import ray

        self.items_ref = ray.put(self.items)
        self.thread.start()
        return self

    def _watch(self) -> None:
        import logging

        while not self.stopping.wait(self.POLL_S):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - a storage hiccup: look again at the next poll
                logging.getLogger("strata.train").warning(f"task evaluations: {type(e).__name__}: {e}")

    def poll(self) -> None:
        import os

        import ray

        from strata.cluster import tiers
        from strata.data.commit import FAILPOINT
        from train.checkpoint import is_intact, registered_checkpoints

        with self.lock:
            for ckpt in registered_checkpoints(self.run_dir):
                step = int(ckpt.rstrip("/").rsplit("-", 1)[-1])
                if step % self.every or step in self.launched or not is_intact(ckpt):
                    continue
                self.launched.add(step)
                env = {FAILPOINT: os.environ[FAILPOINT]} if os.environ.get(FAILPOINT) else {}
                task = ray.remote(evaluate_checkpoint).options(
                    num_cpus=1, max_retries=0, label_selector=tiers.selector(tiers.Tier.CPU),
                    **({"runtime_env": {"env_vars": env}} if env else {}))
                self.pending[task.remote(ckpt, self.items_ref, step)] = step
            if self.pending:
                ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
                for ref in ready:
                    self._record(self.pending.pop(ref), ref)

    def _record(self, step: int, ref) -> None:
        import ray

        try:
            result = {**ray.get(ref), "status": "ok"}
        except Exception as e:  # noqa: BLE001 - an evaluation never stops training: it is recorded failed
            result = {"status": "failed", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        self._write({"event": EVENT, "task": self.name, **result, "step": step})

    def _write(self, row: dict) -> None:
        import time

        from strata.accounting.runlog import LOG
        from strata.data.storage import append_jsonl, join
        from train.metrics import tensorboard_writer

        row = {"time": time.time(), **row}
        self.rows.append(row)
        append_jsonl(join(self.run_dir, LOG), row)
        if row["status"] == "ok":
            self.tb = self.tb or tensorboard_writer(self.run_dir, suffix=".task-evals")
            for k in ("acc", "acc_norm"):
                if self.tb:
                    self.tb.add_scalar(f"task/{k}", row[k], row["step"])

    def close(self, wait_s: float) -> list[dict]:
        """Stop looking, evaluate the last checkpoints, wait up to `wait_s` for what runs; this launch's rows."""
        import time

        import ray

        self.stopping.set()
        self.thread.join()
        self.poll()
        deadline = time.time() + wait_s
        while self.pending and time.time() < deadline:
            time.sleep(0.5)
            self.poll()
        for ref, step in list(self.pending.items()):
            ray.cancel(ref, force=True)
            self._write({"event": EVENT, "task": self.name, "status": "failed", "step": step,
                         "error": f"still running {wait_s:g} s after training ended"})
        self.pending.clear()
        if self.tb:
            self.tb.close()
        return self.rows
