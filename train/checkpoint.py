"""Sharded, asynchronous checkpoints: torch.distributed.checkpoint (DCP) written beside training,
handed to Ray Train, which uploads them and keeps the last N.

A checkpoint directory `checkpoint-<step>` holds

    .metadata, __<rank>_0.distcp   model and optimizer, sharded: every rank writes its own part
    rng-<rank>.pt                  that rank's RNG states (tensors only: loaded with weights_only)
    meta.json                      step, data position, loss, reason, model/train config, tokenizer
    signature.json                 an HMAC of .metadata, which DCP unpickles (strata.signing): a
                                   checkpoint without a valid one is refused before DCP reads it

Saving (`AsyncCheckpointer.start`): every rank copies its shards to CPU memory
(the only time training waits), then a background thread writes them to a
local directory while training goes on. Once every rank's write is done, the
directories go to `ray.train.report` with an asynchronous upload: Ray Train
merges them into one directory under the run's storage (local, NFS or object
store) and registers the checkpoint only when every rank's files are there.
Readers (`committed_checkpoints`) take only checkpoints Ray Train has
registered, never a directory still being written.

The learning-rate schedule is a pure function of the step, and the data
position is the step times the micro-batches per step, so (step, model,
optimizer, RNG) is the whole training state: a resumed run continues exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time

import torch

from strata.signing import check, sign

META = "meta.json"
TIED = "tied_embeddings"  # in meta.json: the output layer was the token embedding when saved
SIGNATURE = "signature.json"
DCP_METADATA = ".metadata"
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of registered checkpoints


def dir_name(step: int) -> str:
    return f"checkpoint-{step:08d}"


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class AsyncCheckpointer:
    """One checkpoint in flight at a time, per rank; `pg` is a gloo group used only for checkpoints,
    so the background write's collectives never interleave with training's."""

    def __init__(self, model, optimizer, rank: int, pg=None):
        self.model, self.optimizer, self.rank, self.pg = model, optimizer, rank, pg
        self.future = None
        self.pending: tuple[int, str] | None = None  # (step, local dir)

    def start(self, step: int, meta: dict) -> None:
        """Stage this rank's shards to CPU and start writing them; returns once staged."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert self.pending is None, "finish the previous checkpoint first"
        getattr(self.model, "module", self.model).check_tied()  # what is saved is what sampling will load
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        local = tempfile.mkdtemp(prefix=f"strata-{dir_name(step)}-rank{self.rank}-")
        torch.save(_rng_state(), os.path.join(local, f"rng-{self.rank}.pt"))
        if self.rank == 0:
            with open(os.path.join(local, META), "w") as f:
                json.dump({"step": step, **meta, TIED: True, "saved_at": time.time()}, f)
        self.future = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=local,
                                     process_group=self.pg)
        self.pending = (step, local)

    def written(self) -> bool:
        """Whether this rank's background write is done (raising its error if it failed)."""
        if self.future is None or not self.future.done():
            return False
        self.future.result()
        return True

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()

    def take(self) -> tuple[int, str]:
        """The written checkpoint's (step, local dir), now the caller's to hand over."""
        self.wait()
        taken = self.pending
        if os.path.exists(os.path.join(taken[1], DCP_METADATA)):  # the coordinator's directory
            sign_checkpoint(taken[1])
        self.future, self.pending = None, None
        return taken

    def discard(self) -> None:
        if self.pending:
            try:
                self.wait()
            finally:
                shutil.rmtree(self.pending[1], ignore_errors=True)
                self.future, self.pending = None, None


def load(directory: str, model, optimizer, rank: int, pg=None) -> dict:
    """Restore model, optimizer and this rank's RNG from a checkpoint directory; returns its meta."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    check_signed(directory)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory, process_group=pg)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = os.path.join(directory, f"rng-{rank}.pt")
    if os.path.exists(rng):  # absent when the world grew since the save: seeds then differ from a straight run
        _set_rng_state(torch.load(rng, weights_only=True))
    with open(os.path.join(directory, META)) as f:
        return json.load(f)


def load_model_state(directory: str, model) -> dict:
    """The model's weights alone, in one process (sample, export); returns the meta."""

    check_signed(directory)
    with open(os.path.join(directory, META)) as f:
        meta = json.load(f)
    # Every tensor its own buffer: a tied model's state_dict shares one between head and wte, into which
    # the checkpoint's two would load one over the other.
    state = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
    _load_one_process(state, directory)
    _check_tied(state["model"], directory, meta)
    model.load_state_dict(state["model"])
    return meta


def _load_one_process(state: dict, directory: str) -> None:
    """DCP's load in this process alone (it warns that it assumes so: it is meant to)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=directory, no_dist=True)


class UntiedCheckpoint(ValueError):
    """A checkpoint whose output layer is not its token embedding."""


def _check_tied(weights: dict, directory: str, meta: dict) -> None:
    if meta.get(TIED) or torch.equal(weights["head.weight"], weights["wte.weight"]):
        return
    raise UntiedCheckpoint(
        f"checkpoint {directory} holds an output layer (head.weight) that differs from its token embedding "
        f"(wte.weight): it was written by a strata that trained them untied (before 2026-12), while the model "
        "is GPT-2's, with the two tied. Loading it would keep one of the two and give a different model, so it "
        "is refused: train a new run")


def check_tied(directory: str) -> None:
    """Refuse (UntiedCheckpoint) a checkpoint saved untied, before its run continues from it. Checkpoints
    that say they were saved tied (meta.json) are not read; older ones are, their two matrices only."""

    meta = read_meta(directory)
    if meta.get(TIED):
        return
    with local_copy(directory) as d:
        check_signed(d)
        cfg = meta["model_config"]
        shape = (cfg["vocab_size"], cfg["n_embd"])
        state = {"model": {"wte.weight": torch.empty(shape), "head.weight": torch.empty(shape)}}
        _load_one_process(state, d)
    _check_tied(state["model"], directory, meta)


@contextlib.contextmanager
def local_copy(directory: str):
    """A local directory with the checkpoint's files (a download when it lives in an object store)."""
    import pyarrow.fs as pafs

    from strata.storage import filesystem

    fs, path = filesystem(directory)
    if isinstance(fs, pafs.LocalFileSystem):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="strata-ckpt-") as d:
        pafs.copy_files(path, d, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield d


def sign_checkpoint(directory: str) -> None:
    """Write the signature of a local checkpoint directory's .metadata beside it."""
    with open(os.path.join(directory, DCP_METADATA), "rb") as f:
        signature = {DCP_METADATA: sign(f.read())}
    with open(os.path.join(directory, SIGNATURE), "w") as f:
        json.dump(signature, f)


def check_signed(directory: str) -> None:
    """Refuse (strata.signing.Untrusted) a checkpoint whose .metadata, which DCP unpickles, is not signed."""
    try:
        with open(os.path.join(directory, SIGNATURE)) as f:
            signature = json.load(f).get(DCP_METADATA)
    except (OSError, ValueError):
        signature = None
    with open(os.path.join(directory, DCP_METADATA), "rb") as f:
        check(f.read(), signature, f"checkpoint {directory}: {DCP_METADATA}")


def read_meta(directory: str) -> dict:
    from strata.storage import filesystem, join

    fs, path = filesystem(join(directory, META))
    with fs.open_input_stream(path) as f:
        return json.loads(f.read())


def registered_checkpoints(run_dir: str) -> list[str]:
    """The run's checkpoints Ray Train has registered (all files were there at commit), oldest first."""
    from strata.storage import exists, join, read_json

    snapshot = join(run_dir, SNAPSHOT)
    if not exists(snapshot):
        return []
    state = read_json(snapshot)
    if isinstance(state, str):  # stored as a JSON string of the JSON
        state = json.loads(state)
    results = state.get("checkpoint_results", []) + [state.get("latest_checkpoint_result") or {}]
    names = {r["checkpoint_dir_name"] for r in results if r.get("checkpoint_dir_name")}
    return [join(run_dir, n) for n in sorted(names)]


def is_intact(directory: str) -> bool:
    """Whether a checkpoint's files are still there (one deleted by hand is not)."""
    from strata.storage import exists, join

    return exists(join(directory, META)) and exists(join(directory, ".metadata"))


def forget_missing(run_dir: str) -> list[str]:
    """Drop registered checkpoints that are gone or incomplete (deleted by hand) from Ray Train's
    record, so the run continues from the newest intact one; returns the names dropped.

    Ray Train refuses to start a run whose record names a missing directory
    (`_assert_checkpoints_exist`). The old record is kept beside, as `.bak-<time>`."""
    from strata.storage import join, read_bytes, write_bytes_atomic

    registered = registered_checkpoints(run_dir)
    gone = {c.rsplit("/", 1)[-1] for c in registered if not is_intact(c)}
    if not gone:
        return []
    path = join(run_dir, SNAPSHOT)
    raw = read_bytes(path)
    state = json.loads(raw)
    wrapped = isinstance(state, str)
    state = json.loads(state) if wrapped else state
    kept = [(r, i) for r, i in zip(state["checkpoint_results"], state["checkpoint_report_indices"], strict=True)
            if r["checkpoint_dir_name"] not in gone]
    state["checkpoint_results"] = [r for r, _ in kept]
    state["checkpoint_report_indices"] = [i for _, i in kept]
    if (state.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name") in gone:
        state["latest_checkpoint_result"] = kept[-1][0] if kept else None
    for key in ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
                "failed_validation_checkpoint_dir_names"):
        if key in state:
            state[key] = [n for n in state[key] if n not in gone]
    write_bytes_atomic(f"{path}.bak-{int(time.time())}", raw)
    text = json.dumps(state)
    write_bytes_atomic(path, (json.dumps(text) if wrapped else text).encode())
    return sorted(gone)


def committed_checkpoints(run_dir: str) -> list[str]:
    """The registered checkpoints that are intact, oldest first: the ones a reader may load."""
    return [c for c in registered_checkpoints(run_dir) if is_intact(c)]
