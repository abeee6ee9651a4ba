"""Sharded, asynchronous checkpoints: torch.distributed.checkpoint (DCP) written beside training,
handed to Ray Train, which uploads them and keeps the last N.

A checkpoint directory `checkpoint-<step>` (format 2) holds no pickle at all:

    shard-<rank+1>-model-00001-of-00001.safetensors
                                   model and optimizer tensors, sharded: every rank writes its own part
                                   (DCP's safetensors storage: each file's header says, in JSON, where
                                   its pieces sit in the whole tensors, so a load reshards to any world)
    optim-groups.json              the optimizer's hyperparameters (AdamW's param groups), as JSON
    rng-<rank>.safetensors         that rank's RNG states
    meta.json                      format, step, data position, loss, reason, model/train config, tokenizer
    signed-<rank>.json             every file that rank wrote with its SHA-256, the signing key's
                                   fingerprint, and an HMAC over the list (strata.data.signing)

Reading one is safe with no key: safetensors and JSON run nothing. The signed lists still say the files
are the ones strata wrote, and where: each list binds its run's name and the step, so a checkpoint copied into
another run's folder, or renamed to another step, is refused. A file that is not listed, or does not match,
refuses the checkpoint with a line naming the file; a list signed by a key this machine lacks names both keys.

Format 1 (before 2026-12-04: DCP's pickled `.metadata`, `__<rank>_0.distcp`, `rng-<rank>.pt`, lists that
name no key) is refused by every command: `python -m train.convert` converts one explicitly, with the old
secret the user names, reading `.metadata` through an unpickler that admits DCP's metadata classes alone.

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
import re
import shutil
import tempfile
import time

import torch

from strata.commands.shell import log as _logger
from strata.data.signing import Untrusted, check, signature

FORMAT = 2  # meta.json's "format": 2, safetensors and JSON only; 1 (no field), DCP's pickled .metadata
META = "meta.json"
TIED = "tied_embeddings"  # in meta.json: the output layer was the token embedding when saved
OPTIM_GROUPS = "optim-groups.json"
SIGNED = "signed-"  # signed-<rank>.json
DCP_METADATA = ".metadata"
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of registered checkpoints
CONVERT = "convert it with `python -m train.convert CHECKPOINT... [--old-secret-file FILE]`"
_NAME_RE = re.compile(r"checkpoint-(\d{8,})")
_log = _logger("checkpoint")


def dir_name(step: int) -> str:
    return f"checkpoint-{step:08d}"


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    cuda = [state[k] for k in sorted((k for k in state if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if "cuda" in state:  # format 1: one list
        cuda = state["cuda"]
    if len(cuda) and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _rng_file(rank: int) -> str:
    return f"rng-{rank}.safetensors"


def staging_prefix(run: str, step: int, rank: int) -> str:
    """The name a rank's local copy of a checkpoint starts with, in the temp dir, until it is handed over."""
    return f"strata-{run + '-' if run else ''}{dir_name(step)}-rank{rank}-"


class AsyncCheckpointer:
    """One checkpoint in flight at a time, per rank; `pg` is a gloo group used only for checkpoints,
    so the background write's collectives never interleave with training's."""

    def __init__(self, model, optimizer, rank: int, pg=None, run: str = ""):
        self.model, self.optimizer, self.rank, self.pg, self.run = model, optimizer, rank, pg, run
        self.future = None
        self.pending: tuple[int, str] | None = None  # (step, local dir)

    def start(self, step: int, meta: dict) -> None:
        """Stage this rank's shards to CPU and start writing them; returns once staged."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert self.pending is None, "finish the previous checkpoint first"
        getattr(self.model, "module", self.model).check_tied()  # what is saved is what sampling will load
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        from safetensors.torch import save_file
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        local = tempfile.mkdtemp(prefix=staging_prefix(self.run, step, self.rank))
        save_file(_rng_state(), os.path.join(local, _rng_file(self.rank)))
        if self.rank == 0:
            with open(os.path.join(local, META), "w") as f:
                json.dump({"format": FORMAT, "step": step, **meta, TIED: True, "saved_at": time.time()}, f)
            with open(os.path.join(local, OPTIM_GROUPS), "w") as f:  # the same on every rank
                json.dump(_groups_to_json(optim_state["param_groups"]), f)
        self.future = dcp.async_save(_tensors_only(model_state, optim_state), process_group=self.pg,
                                     storage_writer=HuggingFaceStorageWriter(local, save_distributed=True))
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
        sign_files(taken[1], self.rank, run=self.run, step=taken[0])
        self.future, self.pending = None, None
        return taken

    def discard(self) -> None:
        if self.pending:
            try:
                self.wait()
            finally:
                shutil.rmtree(self.pending[1], ignore_errors=True)
                self.future, self.pending = None, None


def load(directory: str, model, optimizer, rank: int, pg=None, origin: str | None = None) -> dict:
    """Restore model, optimizer and this rank's RNG from a checkpoint directory (`origin`: where it lies in
    storage, when `directory` is a local copy); returns its meta."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    signed = SignedFiles(directory, origin)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = _tensors_only(model_state, optim_state)
    _dcp_load(state, signed, process_group=pg)
    groups = _groups_from_json(json.loads(signed.read(OPTIM_GROUPS)))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"]["state"], "param_groups": groups})
    if os.path.exists(os.path.join(directory, _rng_file(rank))):  # absent when the world grew: seeds differ
        from safetensors.torch import load

        _set_rng_state(load(signed.read(_rng_file(rank))))
    return signed.meta()


def load_model_state(directory: str, model, signed: SignedFiles | None = None) -> dict:
    """The model's weights alone, in one process (sample, export); returns the meta."""
    signed = signed or SignedFiles(directory)
    meta = signed.meta()
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


def sign_files(directory: str, rank: int, *, run: str = "", step: int | None = None) -> None:
    """List every file this rank wrote with its SHA-256, bind the list to its run and step, and sign it
    (signed-<rank>.json)."""
    files = {name: _sha256(os.path.join(directory, name)) for name in sorted(os.listdir(directory))
             if not name.startswith(SIGNED)}
    if step is None:
        with open(os.path.join(directory, META)) as f:
            step = json.load(f)["step"]
    body = {"files": files, "run": run, "step": step}
    with open(os.path.join(directory, f"{SIGNED}{rank}.json"), "w") as f:
        json.dump({**body, **signature(_canonical(body))}, f)


def _canonical(body: dict) -> bytes:
    """What a list's signature covers: its files, and (format 2 since 2026-12-05) its run and step."""
    return json.dumps(body if "step" in body else body["files"], sort_keys=True).encode()


def bound_to(path: str) -> tuple[str | None, int | None]:
    """(run, step) a checkpoint must be signed for where it lies: `.../runs/<run>/checkpoint-<step>` says
    both; a checkpoint elsewhere is bound by its directory's name only (None where it says nothing)."""
    parts = str(path).rstrip("/").split("/")
    m = _NAME_RE.fullmatch(parts[-1]) if parts else None
    step = int(m.group(1)) if m else None
    run = parts[-2] if step is not None and len(parts) >= 3 and parts[-3] == "runs" else None
    return run, step


def _sha256(path: str) -> str:
    """SHA-256 of a file on local disk or in the object store, read in 1 MiB pieces."""
    import hashlib

    from strata.data.storage import filesystem

    fs, p = filesystem(path)
    h = hashlib.sha256()
    with fs.open_input_stream(p) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class SignedFiles:
    """A checkpoint directory (local, or a storage URI) whose every file must match its rank's signed list
    before it is read.

    Made from the signed lists (their HMACs checked, by a key of this machine's keyring) and the directory's
    listing: a file no list names is refused at once; a listed one is hashed when something is about to read
    it. The lists must name one run and one step, and those must be where the checkpoint lies (`origin`, its
    path in the storage root: `bound_to`); format 1 (DCP's pickled `.metadata`) is refused."""

    def __init__(self, directory: str, origin: str | None = None):
        from strata.data.storage import join, list_dir, read_bytes

        self.directory, self.origin = directory, origin or directory
        names = sorted(n for n, is_dir in list_dir(directory) if not is_dir)
        lists = [n for n in names if n.startswith(SIGNED) and n.endswith(".json")]
        if not lists:
            raise Untrusted(f"checkpoint {self.origin} has no signed list of its files ({SIGNED}<rank>.json): it was "
                            "not written by strata on a cluster whose key this machine holds; refused")
        self.digests: dict[str, str] = {}
        bindings = set()
        for name in lists:
            try:
                listed = json.loads(read_bytes(join(directory, name)))
                files, sig = listed["files"], listed["signature"]
                if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
                    raise TypeError(name)
            except (ValueError, KeyError, TypeError):
                raise Untrusted(f"checkpoint {self.origin}: {name} is not a signed file list; refused") from None
            body = {"files": files, **{k: listed[k] for k in ("run", "step") if k in listed}}
            check(_canonical(body), sig, f"checkpoint {self.origin}: {name}", signed_by=listed.get("key"),
                  convert=CONVERT)
            bindings.add((body.get("run"), body.get("step")))
            self.digests.update(files)
        self._bind(bindings)
        if DCP_METADATA in self.digests:
            raise Untrusted(f"checkpoint {self.origin} is of format 1 (DCP's pickled {DCP_METADATA}), which no default "
                            f"command unpickles: {CONVERT}")
        if unlisted := [n for n in names if n not in self.digests and n not in lists]:
            raise Untrusted(f"checkpoint {self.origin}: {unlisted[0]} is in no signed list of its files (added after "
                            "it was written); refused")
        self.present = set(names)
        self.checked: set[str] = set()

    def _bind(self, bindings: set) -> None:
        """The run and step every list names, checked against where the checkpoint lies."""
        run, step = next(iter(bindings)) if len(bindings) == 1 else (None, None)
        if len(bindings) != 1 or isinstance(step, bool) or not isinstance(step, int) or not isinstance(run, str):
            raise Untrusted(f"checkpoint {self.origin}: its signed lists name no single run and step (signed before "
                            f"2026-12-05, or assembled from several checkpoints); refused. If you trust it, {CONVERT}")
        want_run, want_step = bound_to(self.origin)
        if want_step is not None and step != want_step:
            raise Untrusted(f"checkpoint {self.origin} is signed as step {step}, not {want_step}: renamed or copied "
                            "after it was written; refused")
        if want_run is not None and run != want_run:
            raise Untrusted(f"checkpoint {self.origin} is signed for run {run!r}, not {want_run!r}: copied from "
                            "another run's folder; refused")
        self.run, self.step = run, step

    def verify(self, name: str) -> None:
        from strata.data.storage import join

        if name in self.checked:
            return
        if name not in self.digests or name not in self.present:
            raise Untrusted(f"checkpoint {self.origin}: {name} is "
                            f"{'missing' if name in self.digests else 'in no signed list'}; refused")
        if _sha256(join(self.directory, name)) != self.digests[name]:
            raise Untrusted(f"checkpoint {self.origin}: {name} does not match its signed SHA-256 (changed after it "
                            "was written); refused")
        self.checked.add(name)

    def read(self, name: str) -> bytes:
        from strata.data.storage import join, read_bytes

        self.verify(name)
        return read_bytes(join(self.directory, name))

    def meta(self) -> dict:
        """meta.json, checked against its signed digest, as a dict (one line naming the file otherwise)."""
        try:
            meta = json.loads(self.read(META))
        except ValueError:
            meta = None
        if not isinstance(meta, dict) or isinstance(meta.get("step"), bool) or not isinstance(meta.get("step"), int):
            raise Untrusted(f"checkpoint {self.origin}: {META} is not a checkpoint's meta (no integer step); refused")
        if meta["step"] != self.step:
            raise Untrusted(f"checkpoint {self.origin}: {META} says step {meta['step']}, its signed lists step "
                            f"{self.step}; refused")
        return meta

    def weight_bytes(self) -> int:
        """The size of the files that hold tensors: no model in them can have more parameters than bytes."""
        from strata.data.storage import join

        return sum(_size(join(self.directory, n)) for n in self.present
                   if n.endswith((".safetensors", ".distcp")) and not n.startswith("rng-"))

    def reader(self):
        """A DCP storage reader that checks every safetensors file as DCP is about to read it."""
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        signed = self

        class Reader(HuggingFaceStorageReader):
            def read_metadata(self):
                real = self.fs
                self.fs = _ShardsOnly(real)  # the rng-<rank> files are safetensors too, but no DCP shards
                try:
                    return super().read_metadata()
                except Exception:  # a header that does not parse: say which file changed, if one did
                    for name in sorted(signed.present):
                        if name.startswith("shard-"):
                            signed.verify(name)
                    raise
                finally:
                    self.fs = real

            def read_data(self, plan, planner):
                for item in plan.items:
                    signed.verify(os.path.basename(self.storage_data[item.storage_index].relative_path))
                return super().read_data(plan, planner)

        return Reader(self.directory)


class _ShardsOnly:
    """A DCP filesystem whose listing shows only the model's shard files."""

    def __init__(self, fs):
        self._fs = fs

    def ls(self, path):
        return [p for p in self._fs.ls(path) if os.path.basename(str(p)).startswith("shard-")]

    def __getattr__(self, name):
        return getattr(self._fs, name)


def _size(path: str) -> int:
    from strata.data.storage import filesystem

    fs, p = filesystem(path)
    return fs.get_file_info(p).size or 0


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
        first = next(iter(e.failures.values()), (e, None))[0]
        raise Untrusted(f"checkpoint {signed.origin}: its tensors do not load ({type(first).__name__}: "
                        f"{str(first).splitlines()[0] if str(first) else ''}); refused") from None
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        if isinstance(e, Untrusted):
            raise
        raise Untrusted(f"checkpoint {signed.origin}: its tensors do not load ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); refused") from None


def model_config(meta: dict, signed: SignedFiles):
    """The model a checkpoint holds, from its (verified) meta, checked before anything is allocated: the
    fields' types and rules (GPTConfig's), and a parameter count its weight files can hold (one byte a
    parameter at the least), so crafted metadata cannot make a reader allocate gigabytes."""
    from dataclasses import fields

    from train.model import GPTConfig

    cfg, where = meta.get("model_config"), f"checkpoint {signed.origin}: {META}"
    names = {f.name for f in fields(GPTConfig)}
    if not isinstance(cfg, dict) or not set(cfg) <= names:
        raise Untrusted(f"{where} has no model_config of GPTConfig's fields; refused")
    for k, v in cfg.items():
        if k not in ("dropout", "bias") and (isinstance(v, bool) or not isinstance(v, int)):
            raise Untrusted(f"{where}: model_config.{k} is {v!r}, not an integer; refused")
    try:
        c = GPTConfig(**cfg)
    except (TypeError, ValueError) as e:
        raise Untrusted(f"{where}: model_config is not a valid model ({e}); refused") from None
    params = c.vocab_size * c.n_embd + c.seq_len * c.n_embd + 12 * c.n_layer * c.n_embd ** 2
    have = signed.weight_bytes()
    if params > have:
        raise Untrusted(f"{where}: model_config describes {params:,} parameters, more than its weight files' "
                        f"{have:,} bytes hold; refused")
    return c


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
    """What a run checks before it continues from a checkpoint: its signed lists (bound to where it lies),
    its small files (meta.json, the param groups; each worker checks the shards it reads), and the tie."""
    signed = SignedFiles(directory)
    signed.meta()
    signed.verify(OPTIM_GROUPS)
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
        _load_one_process(state, SignedFiles(d, directory))
    _check_tied(state["model"], directory, meta)


@contextlib.contextmanager
def local_copy(directory: str):
    """A local directory with the checkpoint's files (a download when it lives in an object store)."""
    import pyarrow.fs as pafs

    from strata.data.storage import filesystem

    fs, path = filesystem(directory)
    if isinstance(fs, pafs.LocalFileSystem):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="strata-ckpt-") as d:
        pafs.copy_files(path, d, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield d


def read_meta(directory: str) -> dict:
    """meta.json as it is (not checked against its signature: for listing and picking a checkpoint, never
    for building a model); one line naming the file if it is not a checkpoint's meta."""
    from strata.data.storage import filesystem, join

    fs, path = filesystem(join(directory, META))
    with fs.open_input_stream(path) as f:
        raw = f.read()
    try:
        meta = json.loads(raw)
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or isinstance(meta.get("step"), bool) or not isinstance(meta.get("step"), int):
        raise Untrusted(f"checkpoint {directory}: {META} is not a checkpoint's meta (no integer step); refused")
    return meta


def registered_checkpoints(run_dir: str) -> list[str]:
    """The run's checkpoints Ray Train has registered (all files were there at commit), oldest first. Every
    name in Ray Train's record is contained in the run's folder (strata.data.storage.inside) and must be a
    checkpoint's (`checkpoint-<step>`): a record naming `../other-run/...` names nothing here."""
    from strata.data.storage import PathRefused, exists, inside, join, read_json

    snapshot = join(run_dir, SNAPSHOT)
    if not exists(snapshot):
        return []
    try:
        state = read_json(snapshot)
        if isinstance(state, str):  # stored as a JSON string of the JSON
            state = json.loads(state)
        results = state.get("checkpoint_results", []) + [state.get("latest_checkpoint_result") or {}]
        names = {r["checkpoint_dir_name"] for r in results if isinstance(r, dict) and r.get("checkpoint_dir_name")}
    except (ValueError, AttributeError, TypeError) as e:
        raise Untrusted(f"{snapshot} is not Ray Train's record of checkpoints ({type(e).__name__}); refused") from None
    out = []
    for n in sorted(x for x in names if isinstance(x, str)):
        try:
            path = inside(run_dir, n, f"{snapshot}: a checkpoint")
        except PathRefused as e:
            _log.warning(f"{e}: left out")
            continue
        if not _NAME_RE.fullmatch(n):
            _log.warning(f"{snapshot} names {n!r}, which is not a checkpoint's name (checkpoint-<step>): left out")
            continue
        out.append(path)
    return out


def is_intact(directory: str) -> bool:
    """Whether a checkpoint's files are still there (one deleted by hand is not)."""
    from strata.data.storage import exists, join

    return exists(join(directory, META)) and exists(join(directory, f"{SIGNED}0.json"))
