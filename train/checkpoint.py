"""Sharded, asynchronous checkpoints: torch.distributed.checkpoint (DCP) written beside training,
handed to Ray Train, which uploads them and keeps the last N.

A checkpoint directory `checkpoint-<step>` holds

    .metadata, __<rank>_0.distcp   model and optimizer tensors, sharded: every rank writes its own part
    optim-groups.json              the optimizer's hyperparameters (AdamW's param groups), as JSON
    rng-<rank>.pt                  that rank's RNG states (tensors only: loaded with weights_only)
    meta.json                      step, data position, loss, reason, model/train config, tokenizer
    signed-<rank>.json             every file that rank wrote with its SHA-256, and an HMAC over the list
                                   (strata.signing, keyed by the cluster's secret)

Nothing in a checkpoint runs when it is read. DCP unpickles `.metadata` and, with
`weights_only=False`, any non-tensor value saved beside the tensors; so only
tensors go through DCP (the optimizer's param groups go to JSON), and every file
is checked against its signed SHA-256 before it is read: `.metadata` before DCP
opens it, each shard as DCP is about to read it (each rank hashes only the files
it reads), the RNG state and the JSON files before they load. A file that is not
listed, or does not match, refuses the checkpoint with a line naming the file.

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

from strata.signing import Untrusted, check, sign

META = "meta.json"
TIED = "tied_embeddings"  # in meta.json: the output layer was the token embedding when saved
OPTIM_GROUPS = "optim-groups.json"
SIGNED = "signed-"  # signed-<rank>.json
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
            with open(os.path.join(local, OPTIM_GROUPS), "w") as f:  # the same on every rank
                json.dump(_groups_to_json(optim_state["param_groups"]), f)
        self.future = dcp.async_save(_tensors_only(model_state, optim_state), checkpoint_id=local,
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
        sign_files(taken[1], self.rank)
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
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    signed = SignedFiles(directory)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = _tensors_only(model_state, optim_state)
    _dcp_load(state, signed, process_group=pg)
    groups = _groups_from_json(json.loads(signed.read(OPTIM_GROUPS)))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"]["state"], "param_groups": groups})
    rng = f"rng-{rank}.pt"
    if os.path.exists(os.path.join(directory, rng)):  # absent when the world grew: seeds differ from a straight run
        signed.verify(rng)
        _set_rng_state(torch.load(os.path.join(directory, rng), weights_only=True))
    return json.loads(signed.read(META))


def load_model_state(directory: str, model) -> dict:
    """The model's weights alone, in one process (sample, export); returns the meta."""
    signed = SignedFiles(directory)
    meta = json.loads(signed.read(META))
    # Every tensor its own buffer: a tied model's state_dict shares one between head and wte, into which
    # the checkpoint's two would load one over the other.
    state = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
    _load_one_process(state, signed)
    _check_tied(state["model"], directory, meta)
    model.load_state_dict(state["model"])
    return meta


def _tensors_only(model_state: dict, optim_state: dict) -> dict:
    """What goes through DCP: tensors alone (a non-tensor value would be pickled, and unpickled on load)."""
    state = {"model": model_state, "optim": {"state": optim_state["state"]}}
    for key, value in _leaves(state):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"checkpoint state {key} is a {type(value).__name__}, not a tensor: DCP would pickle it")
    return state


def _leaves(tree, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, tree


def _groups_to_json(groups: list[dict]) -> list[dict]:
    out = []
    for g in groups:
        for k, v in g.items():
            if isinstance(v, torch.Tensor):
                raise TypeError(f"optimizer param group value {k} is a tensor: it does not go to JSON")
        out.append({k: list(v) if isinstance(v, tuple) else v for k, v in g.items()})
    return out


def _groups_from_json(groups: list[dict]) -> list[dict]:
    return [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in groups]


def sign_files(directory: str, rank: int) -> None:
    """List every file this rank wrote with its SHA-256, and sign the list (signed-<rank>.json)."""
    files = {name: _sha256(os.path.join(directory, name)) for name in sorted(os.listdir(directory))
             if not name.startswith(SIGNED)}
    body = json.dumps(files, sort_keys=True)
    with open(os.path.join(directory, f"{SIGNED}{rank}.json"), "w") as f:
        json.dump({"files": files, "signature": sign(body.encode())}, f)


def _sha256(path: str) -> str:
    """SHA-256 of a file on local disk or in the object store, read in 1 MiB pieces."""
    import hashlib

    from strata.storage import filesystem

    fs, p = filesystem(path)
    h = hashlib.sha256()
    with fs.open_input_stream(p) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class SignedFiles:
    """A checkpoint directory (local, or a storage URI) whose every file must match its rank's signed list
    before it is read.

    Made from the signed lists (their HMACs checked) and the directory's listing: a file no list names is
    refused at once; a listed one is hashed when something is about to read it."""

    def __init__(self, directory: str):
        from strata.storage import join, list_dir, read_bytes

        self.directory = directory
        names = sorted(n for n, is_dir in list_dir(directory) if not is_dir)
        lists = [n for n in names if n.startswith(SIGNED) and n.endswith(".json")]
        if not lists:
            raise Untrusted(f"checkpoint {directory} has no signed list of its files ({SIGNED}<rank>.json): it was "
                            "not written by this strata on this cluster; refused")
        self.digests: dict[str, str] = {}
        for name in lists:
            try:
                listed = json.loads(read_bytes(join(directory, name)))
                files, signature = listed["files"], listed["signature"]
            except (ValueError, KeyError, TypeError):
                raise Untrusted(f"checkpoint {directory}: {name} is not a signed file list; refused") from None
            check(json.dumps(files, sort_keys=True).encode(), signature, f"checkpoint {directory}: {name}")
            self.digests.update(files)
        if unlisted := [n for n in names if n not in self.digests and n not in lists]:
            raise Untrusted(f"checkpoint {directory}: {unlisted[0]} is in no signed list of its files (added after "
                            "it was written); refused")
        self.present = set(names)
        self.checked: set[str] = set()

    def verify(self, name: str) -> None:
        from strata.storage import join

        if name in self.checked:
            return
        if name not in self.digests or name not in self.present:
            raise Untrusted(f"checkpoint {self.directory}: {name} is "
                            f"{'missing' if name in self.digests else 'in no signed list'}; refused")
        if _sha256(join(self.directory, name)) != self.digests[name]:
            raise Untrusted(f"checkpoint {self.directory}: {name} does not match its signed SHA-256 (changed after it "
                            "was written); refused")
        self.checked.add(name)

    def read(self, name: str) -> bytes:
        from strata.storage import join, read_bytes

        self.verify(name)
        return read_bytes(join(self.directory, name))

    def reader(self):
        """A DCP storage reader that checks `.metadata` before it is unpickled and every shard file before
        it is read."""
        from torch.distributed.checkpoint import FileSystemReader

        signed = self
        signed.verify(DCP_METADATA)

        class Reader(FileSystemReader):
            def read_data(self, plan, planner):
                for item in plan.items:
                    signed.verify(self.storage_data[item.storage_index].relative_path)
                return super().read_data(plan, planner)

        return Reader(self.directory)


def _load_one_process(state: dict, signed: SignedFiles) -> None:
    """DCP's load in this process alone (it warns that it assumes so: it is meant to)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _dcp_load(state, signed, no_dist=True)


def _dcp_load(state: dict, signed: SignedFiles, **kwargs) -> None:
    """`dcp.load` through the checking reader; a file it refused comes out as the Untrusted it is (DCP
    gathers every rank's errors into one CheckpointException)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=signed.reader(), **kwargs)
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, Untrusted)]
        if refused:
            raise refused[0] from None
        raise


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


def check_checkpoint(directory: str) -> None:
    """What a run checks before it continues from a checkpoint: its signed lists, its small files
    (`.metadata`, meta.json, the param groups; each worker checks the shards it reads), and the tie."""
    signed = SignedFiles(directory)
    for name in (DCP_METADATA, META, OPTIM_GROUPS):
        signed.verify(name)
    check_tied(directory)


def check_tied(directory: str) -> None:
    """Refuse (UntiedCheckpoint) a checkpoint saved untied, before its run continues from it. Checkpoints
    that say they were saved tied (meta.json) are not read; older ones are, their two matrices only."""

    meta = read_meta(directory)
    if meta.get(TIED):
        return
    with local_copy(directory) as d:
        cfg = meta["model_config"]
        shape = (cfg["vocab_size"], cfg["n_embd"])
        state = {"model": {"wte.weight": torch.empty(shape), "head.weight": torch.empty(shape)}}
        _load_one_process(state, SignedFiles(d))
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
    (`_assert_checkpoints_exist`), and no public API edits the record: this rewrites Ray Train's file, whose
    fields tests/test_ray_internals.py pins. The old record is kept beside, as `.bak-<time>`."""
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
