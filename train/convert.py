"""Convert checkpoints every command refuses into today's format, explicitly:

    python -m train.convert CHECKPOINT [CHECKPOINT ...] [--old-secret-file FILE]

Two kinds are refused by default (train/checkpoint.py), each in one line that names this command:

- format 1 (before 2026-12-04): DCP's pickled `.metadata`, `__<rank>_0.distcp` shards, `rng-<rank>.pt`, and
  signed lists that name no key (they verified under whatever secret strata once took its key from, a Ray
  token among them). `--old-secret-file` names the secret they were signed with; the lists must verify
  under it and every file must match its digest. `.metadata` is then read by an unpickler that admits DCP's
  metadata classes and nothing else, the tensors are read through DCP's own safe loader (weights only), and
  the checkpoint is written again as format 2 (safetensors and JSON), signed by this machine's key.
- lists of format 2 signed before 2026-12-05, which do not bind their run and step: their key must be in
  this machine's keyring; they are signed again, bound to where the checkpoint lies.

The new files are written beside the old ones, then the new signed list, then the old files are deleted: a
conversion cut short leaves a checkpoint that a rerun of this command finishes.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import sys

import torch

from strata.commands.cli import parser as cli_parser
from strata.commands.shell import StrataError
from strata.commands.shell import log as _logger
from strata.data import signing
from strata.data.signing import Untrusted
from train.checkpoint import DCP_METADATA, META, SIGNED, _canonical, _sha256, bound_to, dir_name

_log = _logger("convert")
FORMAT_1 = re.compile(r"(\.metadata|__\d+_\d+\.distcp|rng-\d+\.pt)")

# What DCP's .metadata pickles (torch 2.13), and nothing else: classes whose constructors only store fields.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
      ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise Untrusted(f"{DCP_METADATA} names {module}.{name}, which is not one of DCP's metadata classes: refused")


def read_metadata(data: bytes):
    """DCP's checkpoint metadata from `.metadata`'s bytes, unpickled with DCP's classes alone."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Untrusted:
        raise
    except Exception as e:  # noqa: BLE001 - anything that is not DCP's metadata
        raise Untrusted(f"{DCP_METADATA} is not DCP's metadata ({type(e).__name__}: {e}); refused") from None
    if not isinstance(md, Metadata):
        raise Untrusted(f"{DCP_METADATA} holds a {type(md).__name__}, not DCP's Metadata; refused")
    return md


def _lists(directory: str) -> dict[str, dict]:
    from strata.data.storage import join, list_dir, read_bytes

    out = {}
    for name, is_dir in list_dir(directory):
        if not is_dir and name.startswith(SIGNED) and name.endswith(".json"):
            try:
                listed = json.loads(read_bytes(join(directory, name)))
                if not isinstance(listed, dict) or not isinstance(listed.get("files"), dict):
                    raise TypeError
            except (ValueError, TypeError):
                raise Untrusted(f"checkpoint {directory}: {name} is not a signed file list; refused") from None
            out[name] = listed
    if not out:
        raise Untrusted(f"checkpoint {directory} has no signed list of its files: nothing says it is strata's; refused")
    return out


def _verify(directory: str, lists: dict[str, dict], old: bytes | None) -> dict[str, str]:
    """Every list verified (a key of the keyring, or, naming none, the old secret) and every listed file
    matching its digest; the files and their digests."""
    from strata.data.storage import join

    digests = {}
    for name, listed in lists.items():
        body = {"files": listed["files"], **{k: listed[k] for k in ("run", "step") if k in listed}}
        what = f"checkpoint {directory}: {name}"
        if listed.get("key"):
            signing.check(_canonical(body), listed.get("signature"), what, signed_by=listed["key"])
        elif old is None:
            raise Untrusted(f"{what} names no key: pass --old-secret-file FILE, the secret it was signed with (say the "
                            "Ray token file of the cluster that trained it)")
        elif not signing.verify_with(old, _canonical(body), listed.get("signature")):
            raise Untrusted(f"{what} does not verify under the secret of --old-secret-file: not signed with it, or "
                            "changed since; refused")
        digests.update(listed["files"])
    for name, sha in sorted(digests.items()):
        if _sha256(join(directory, name)) != sha:
            raise Untrusted(f"checkpoint {directory}: {name} does not match its signed SHA-256; refused")
    return digests


def _format_1_state(local: str) -> dict[str, torch.Tensor]:
    """Format 1's tensors, by their flat DCP names, read with the metadata unpickled safely."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType

    with open(os.path.join(local, DCP_METADATA), "rb") as f:
        md = read_metadata(f.read())
    state = {}
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise Untrusted(f"checkpoint {local}: {fqn} is a pickled object, not a tensor; refused")
        state[fqn] = torch.empty(item.size, dtype=item.properties.dtype)

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return md

        def read_data(self, plan, planner):
            if any(i.type == LoadItemType.BYTE_IO for i in plan.items):
                raise Untrusted(f"checkpoint {local} holds pickled objects beside its tensors; refused")
            return super().read_data(plan, planner)  # tensors through torch.load(weights_only=True)

    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=Reader(local), no_dist=True)
    return state


def _nest(flat: dict[str, torch.Tensor]) -> dict:
    """{"model": {...}, "optim": {"state": {...}}} from DCP's flat names, as format 2 saves it."""
    out: dict = {"model": {}, "optim": {"state": {}}}
    for k, v in flat.items():
        if k.startswith("model."):
            out["model"][k[len("model."):]] = v
        elif k.startswith("optim.state."):
            param, _, field = k[len("optim.state."):].rpartition(".")
            out["optim"]["state"].setdefault(param, {})[field] = v
        else:
            raise Untrusted(f"format 1 state {k!r} is neither the model's nor the optimizer's; refused")
    return out


def convert(directory: str, old: bytes | None) -> str:
    """Convert one checkpoint (see the module's doc); returns what was done, in words."""
    from safetensors.torch import save as save_tensors
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from strata.data.storage import delete, join, list_dir, read_bytes, write_bytes_atomic
    from train.checkpoint import local_copy

    signing.secret()  # the key it will be signed with: refuse before anything is written without one
    lists = _lists(directory)
    names = {n for n, d in list_dir(directory) if not d}
    current = lists.get(f"{SIGNED}0.json", {})
    if len(lists) == 1 and current.get("key") and "step" in current and DCP_METADATA not in current["files"]:
        _verify(directory, lists, None)  # already converted: finish a conversion cut short
        left = sorted(n for n in names - set(current["files"]) - {f"{SIGNED}0.json"} if FORMAT_1.fullmatch(n))
        for n in left:
            delete(join(directory, n))
        return f"already format 2, bound to run {current['run']!r} step {current['step']}" + (
            f"; deleted {len(left)} file(s) of format 1 left over" if left else "")
    digests = _verify(directory, lists, old)
    meta = json.loads(read_bytes(join(directory, META)))
    step = meta.get("step") if isinstance(meta, dict) else None
    if isinstance(step, bool) or not isinstance(step, int):
        raise Untrusted(f"checkpoint {directory}: {META} has no integer step; refused")
    want_run, want_step = bound_to(directory)
    if want_step is not None and want_step != step:
        raise Untrusted(f"checkpoint {directory}: {META} says step {step}, its name {dir_name(want_step)}; refused")
    new_files: dict[str, bytes] = {}
    if DCP_METADATA in digests:
        with local_copy(directory) as local:
            state = _nest(_format_1_state(local))
            import tempfile

            with tempfile.TemporaryDirectory(prefix="strata-convert-") as out:
                import torch.distributed.checkpoint as dcp

                dcp.save(state, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True), no_dist=True)
                for n in os.listdir(out):
                    if n.startswith("shard-"):
                        with open(os.path.join(out, n), "rb") as f:
                            new_files[n] = f.read()
            for n in sorted(os.listdir(local)):
                if m := re.fullmatch(r"rng-(\d+)\.pt", n):
                    rng = torch.load(os.path.join(local, n), weights_only=True)  # tensors only: nothing runs
                    flat = {"torch": rng["torch"], **{f"cuda.{i}": t for i, t in enumerate(rng.get("cuda") or [])}}
                    new_files[f"rng-{m.group(1)}.safetensors"] = save_tensors(flat)
    for n, data in new_files.items():
        write_bytes_atomic(join(directory, n), data)
    keep = {n: sha for n, sha in digests.items() if not FORMAT_1.fullmatch(n)}
    keep.update({n: _sha256(join(directory, n)) for n in new_files})
    run = want_run if want_run is not None else str(current.get("run") or "")
    body = {"files": dict(sorted(keep.items())), "run": run, "step": step}
    write_bytes_atomic(join(directory, f"{SIGNED}0.json"),
                       json.dumps({**body, **signing.signature(_canonical(body))}).encode())
    for n in sorted(names - set(keep) - {f"{SIGNED}0.json"}):
        if FORMAT_1.fullmatch(n) or (n.startswith(SIGNED) and n.endswith(".json")):
            delete(join(directory, n))
    was = "format 1" if DCP_METADATA in digests else "format 2 without run and step"
    return f"converted from {was}: signed with key {signing.key_id()}, run {body['run']!r}, step {step}"


def main(argv: list[str] | None = None) -> int:
    p = cli_parser("python -m train.convert", __doc__, json_summary=False)
    p.add_argument("checkpoints", nargs="+", help="checkpoint directories (local or in the storage root)")
    p.add_argument("--old-secret-file", help="the secret format 1's lists were signed with (a format-1 checkpoint "
                   "names no key; nothing else is tried)")
    a = p.parse_args(argv)
    old = signing.read_secret(a.old_secret_file) if a.old_secret_file else None
    if a.old_secret_file and old is None:
        sys.exit(f"error: --old-secret-file {a.old_secret_file}: no such file, or it is empty")
    failed = 0
    for c in a.checkpoints:
        try:
            _log.info(f"{c}: {convert(c.rstrip('/'), old)}")
        except (StrataError, OSError, ValueError) as e:
            failed += 1
            print(f"error: {c}: {e}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
