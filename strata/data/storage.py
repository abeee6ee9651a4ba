"""The storage layout, and every read and write strata makes under it.

The root comes from `STRATA_STORAGE` (a local directory, NFS mount, or an
object-store URI such as `s3://bucket/strata`); it defaults to `~/strata-data`.
A multi-node cluster needs a root every node can reach (object store or NFS).
S3-compatible stores (MinIO, Ceph, moto) are reached through the standard
`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and
`AWS_DEFAULT_REGION` variables, which pyarrow, boto3 and Ray all read.

    <root>/datasets/<name>/                      a dataset: a Delta Lake table (strata/data/dataset.py)
    <root>/datasets/<name>/_delta_log/           its transaction log: one commit per version
    <root>/datasets/<name>/data/<id>/            the shards one preprocess run wrote (the table's files)
    <root>/datasets/<name>/_strata/<id>/         that run's other files (tails, dedup index, rejects, work)
    <root>/datasets/<name>/_lease/               who is writing the dataset now
    <root>/runs/<name>/                          a training run
    <root>/sweeps/<name>/                        a sweep
    <root>/scores/<name>/                        documents scored under a model (python -m infer score)

Object stores have no rename and no append. What must appear at once is
written in one PUT (`write_bytes_atomic`), what must appear at most once is a
conditional create (`create_exclusive`: S3 `If-None-Match: *`, a GCS
generation precondition, a hard link on local disk and NFS), and jsonl logs
go to bounded parts (`JsonlWriter`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from strata.errors import StrataError

ENV_VAR = "STRATA_STORAGE"
DEFAULT_ROOT = "~/strata-data"


def is_uri(path: str) -> bool:
    return "://" in path


class StorageNotSet(StrataError, ValueError):
    """A submitted job without a storage root."""


def storage_root(root: str | None = None) -> str:
    """The storage root: `root`, else `$STRATA_STORAGE`, else `~/strata-data` (not for a Ray job's driver,
    which runs on a cluster's node: that node's home directory is nobody's storage)."""
    if not (root or os.environ.get(ENV_VAR)) and os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        raise StorageNotSet(f"{ENV_VAR} is not set for this Ray job: submit it with `python -m strata submit`, "
                            f"which passes yours (or --storage), or add --runtime-env-json "
                            f"'{{\"env_vars\": {{\"{ENV_VAR}\": \"s3://BUCKET/strata\"}}}}' to `ray job submit`")
    root = root or os.environ.get(ENV_VAR) or DEFAULT_ROOT
    if is_uri(root) and not root.startswith("file://"):
        return root.rstrip("/")
    if root.startswith("file://"):
        root = root[len("file://"):]
    return str(Path(root).expanduser().resolve())


S3_ATTEMPTS = int(os.environ.get("STRATA_S3_ATTEMPTS", "10"))
"""Attempts per S3 request (connection resets, timeouts, throttling, 5xx), with the SDK's backoff
(10: about 25 s before a request that keeps failing gives up)."""


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it, for a local path or a URI.

    s3:// gets a client that retries a failed request S3_ATTEMPTS times (pyarrow's default gives up
    after 3 attempts, or once its retry quota is spent), one per bucket and process, which writes a small
    file in one request.
    """
    if path.startswith("s3://"):
        bucket = path[5:].partition("/")[0]
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        return _s3_filesystem(bucket, endpoint), path[5:]
    if is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), path


@functools.lru_cache(maxsize=64)
def _s3_filesystem(bucket: str, endpoint: str) -> pafs.S3FileSystem:
    region = pafs.FileSystem.from_uri(f"s3://{bucket}")[0].region  # the bucket's own (one request)
    # allow_delayed_open: a file smaller than one upload part (manifests, records, work-unit records,
    # small shards) is written with one PutObject at close, not a multipart upload's three requests.
    return pafs.S3FileSystem(region=region, endpoint_override=endpoint or None, allow_delayed_open=True,
                             retry_strategy=pafs.AwsDefaultS3RetryStrategy(max_attempts=S3_ATTEMPTS))


def delta_options(path: str) -> dict[str, str] | None:
    """The `storage_options` that take delta-rs (which has its own S3 client) to the same store as
    `filesystem`: the endpoint, region and credentials from the standard AWS variables."""
    if not path.startswith("s3://"):
        return None
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    options = {"AWS_REGION": _s3_filesystem(path[5:].partition("/")[0], endpoint).region}
    if endpoint:
        options.update(AWS_ENDPOINT_URL=endpoint, AWS_ALLOW_HTTP=str(endpoint.startswith("http://")).lower())
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        if os.environ.get(key):
            options[key] = os.environ[key]
    return options


def join(base: str, *parts: str) -> str:
    """Join path parts with `/` (object-store URIs) or the OS separator (local)."""
    if is_uri(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


class BadName(StrataError, ValueError):
    """A name that cannot be a path part (a user's typo, or a name read back from storage)."""


def check_name(name: str, what: str = "name") -> str:
    """Names become path parts and Ray ids: keep them to [A-Za-z0-9._-]."""
    ok = (isinstance(name, str) and name and all((c.isascii() and c.isalnum()) or c in "._-" for c in name)
          and not name.startswith("."))
    if not ok:
        raise BadName(f"invalid {what} {name!r}: use ASCII letters, digits, '.', '_' and '-' only")
    return name


class PathRefused(StrataError, ValueError):
    """A path read from storage (or given as an output) that would leave where it must stay."""


def inside(base: str, rel, what: str) -> str:
    """`rel`, a relative path read from storage (a manifest, a Delta log entry, a record, a sweep part),
    as a path under `base`; refused (PathRefused, naming `what` and the path) unless it stays there:
    not empty, not absolute, no `..`, no URI or backslash, and on local disk no link out of `base`.

    The one containment check for every path strata reads from storage before it reads, writes or
    deletes there."""
    import posixpath

    norm = posixpath.normpath(rel) if isinstance(rel, str) and rel else ""
    if (not norm or norm in (".", "..") or norm.startswith(("/", "../")) or "://" in rel or "\\" in rel
            or "\x00" in rel or norm != rel.rstrip("/")):
        raise PathRefused(f"{what} names {rel!r}, which is not a plain path inside {base}; refused")
    path = join(base, *norm.split("/"))
    if not is_uri(path):
        root = os.path.realpath(base)
        if not os.path.realpath(path).startswith(root + os.sep):
            raise PathRefused(f"{what} names {rel!r}, which leads outside {base} ({os.path.realpath(path)}); refused")
    return path


def under(path: str, base: str, strict: bool = False) -> bool:
    """Whether `path` is `base` (unless `strict`) or below it, however it is spelled (`..`, and links on
    local disk)."""
    import posixpath

    if is_uri(path) or is_uri(base):
        p, b = posixpath.normpath(path), posixpath.normpath(base)
        return is_uri(path) and ((p == b and not strict) or p.startswith(b.rstrip("/") + "/"))
    p, b = os.path.realpath(path), os.path.realpath(base)
    return (p == b and not strict) or p.startswith(b.rstrip(os.sep) + os.sep)


@dataclass(frozen=True)
class Storage:
    """Paths under one storage root."""

    root: str

    @classmethod
    def from_env(cls, root: str | None = None) -> Storage:
        return cls(storage_root(root))

    def datasets(self) -> str:
        return join(self.root, "datasets")

    def dataset(self, name: str) -> str:
        return join(self.root, "datasets", check_name(name, "dataset name"))

    def run_files(self, name: str, tag: str) -> str:
        """Where one preprocess run writes its own files (tails, dedup index, rejects, work units): a
        directory whose name starts with `_`, which Delta's vacuum leaves alone."""
        return join(self.dataset(name), "_strata", tag)

    def run_shards(self, name: str, tag: str) -> str:
        """Where one preprocess run writes its shards, the table's data files."""
        return join(self.dataset(name), "data", tag)

    def runs(self) -> str:
        return join(self.root, "runs")

    def run(self, name: str) -> str:
        return join(self.root, "runs", check_name(name, "run name"))

    def sweeps(self) -> str:
        return join(self.root, "sweeps")

    def sweep(self, name: str) -> str:
        return join(self.root, "sweeps", check_name(name, "sweep name"))

    def scores(self, name: str) -> str:
        """A scoring run's table (python -m infer score)."""
        return join(self.root, "scores", check_name(name, "scores name"))

    def evals(self, name: str) -> str:
        """An evaluation's summary and record (python -m infer eval)."""
        return join(self.root, "evals", check_name(name, "eval name"))

    def generations(self, name: str) -> str:
        """A generation run's completions and record (python -m infer generate)."""
        return join(self.root, "generations", check_name(name, "generations name"))

    def servings(self, name: str) -> str:
        """A serving run's record (python -m infer serve)."""
        return join(self.root, "servings", check_name(name, "serving name"))

    def records(self) -> str:
        """One JSON record per run of any kind (`python -m strata runs` lists them)."""
        return join(self.root, "records")

    def managed(self) -> list[str]:
        """The directories strata writes and reads back: a user's output never goes inside one."""
        return [self.datasets(), self.runs(), self.sweeps(), join(self.root, "scores"), join(self.root, "evals"),
                join(self.root, "generations"), self.records()]

    def check_output(self, path: str, what: str = "output") -> str:
        """Refuse (PathRefused) an output path a user gave that lies inside a directory strata manages
        (a dataset, a run, a sweep, its records): writing there could overwrite a commit or a checkpoint."""
        for d in self.managed():
            if under(path, d):
                raise PathRefused(f"{what} {path} is inside {d}, which strata manages (datasets, runs, sweeps and "
                                  "their records): give a path outside it")
        return path


# ---- reads -------------------------------------------------------------------------------------

def read_bytes(path: str) -> bytes:
    fs, p = filesystem(path)
    with fs.open_input_stream(p) as f:
        return f.read()


def text_of(path: str, what: str = "file") -> str:
    """A text file a user gave (a task, prompts), decoded as UTF-8; ValueError naming the file and the
    first bad byte otherwise."""
    data = read_bytes(path)
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(f"{what} {path}: not UTF-8 text (byte {e.start}, line {line}: {data[e.start:e.start + 1]!r}); "
                         "convert it, e.g. with iconv -t UTF-8") from None


def read_json(path: str) -> dict:
    return json.loads(read_bytes(path).decode())


def exists(path: str) -> bool:
    fs, p = filesystem(path)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def is_dir(path: str) -> bool:
    fs, p = filesystem(path)
    return fs.get_file_info(p).type == pafs.FileType.Directory


def list_dir(path: str) -> list[tuple[str, bool]]:
    """(name, is_directory) of each entry directly under `path`; empty when it does not exist."""
    fs, p = filesystem(path)
    try:
        infos = fs.get_file_info(pafs.FileSelector(p, allow_not_found=True))
    except FileNotFoundError:
        # Arrow's local listing fails on a missing directory and then asks whether it exists: a
        # directory created between the two (another writer's first lease, say) raises here.
        return []
    return sorted((i.base_name, i.type == pafs.FileType.Directory) for i in infos)


def list_files(path: str) -> list[str]:
    """Every file under `path`, recursively, as paths relative to it."""
    fs, p = filesystem(path)
    try:
        infos = fs.get_file_info(pafs.FileSelector(p, allow_not_found=True, recursive=True))
    except FileNotFoundError:
        return []  # created meanwhile, as in list_dir
    base = p.rstrip("/") + "/"
    return sorted(i.path[len(base):] for i in infos if i.type == pafs.FileType.File)


# ---- writes ------------------------------------------------------------------------------------

def write_json_atomic(path: str, obj: dict) -> None:
    """Write JSON so a reader sees the old file, or the whole new one, never a part."""
    write_bytes_atomic(path, json_bytes(obj))


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Local: write a temp file, then rename over. Object stores: one PUT is atomic."""
    fs, p = filesystem(path)
    if isinstance(fs, pafs.LocalFileSystem):
        os.makedirs(os.path.dirname(p), exist_ok=True)
        tmp = _local_temp(p, data)
        os.replace(tmp, p)
    else:
        with fs.open_output_stream(p) as f:
            f.write(data)


def _local_temp(p: str, data: bytes) -> str:
    """`data` in a durable temp file beside `p` (same directory: same filesystem for rename/link)."""
    tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def create_exclusive(path: str, data: bytes) -> bool:
    """Create `path` holding `data` if nothing is there; False if something already was.

    Exactly one of any number of concurrent callers (on any machines) gets True,
    and readers never see a partial file. Local disk and NFS: a complete temp
    file hard-linked to its name (link fails on an existing name, atomically,
    also over NFS). S3: PutObject with `If-None-Match: *`. GCS: an upload with
    generation precondition 0.
    """
    if path.startswith("s3://"):
        return _s3_create_exclusive(path, data)
    if path.startswith(("gs://", "gcs://")):
        return _gcs_create_exclusive(path, data)
    if is_uri(path):
        raise NotImplementedError(f"no conditional create for {path.split('://')[0]}:// storage; "
                                  "use a local or NFS path, s3:// or gs://")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = _local_temp(path, data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def _s3_client():
    try:
        import boto3
    except ImportError as e:  # a dependency of strata; only a broken install lacks it
        raise RuntimeError("s3:// storage needs boto3 for conditional writes: pip install boto3") from e
    from botocore.config import Config

    # AWS_ENDPOINT_URL and the other AWS_* variables apply; resets and throttling are retried like pyarrow's
    return boto3.client("s3", config=Config(retries={"max_attempts": S3_ATTEMPTS, "mode": "standard"}))


def _bucket_key(path: str) -> tuple[str, str]:
    bucket, _, key = path.split("://", 1)[1].partition("/")
    return bucket, key


def _s3_create_exclusive(path: str, data: bytes) -> bool:
    from botocore.exceptions import ClientError

    bucket, key = _bucket_key(path)
    client = _s3_client()
    try:
        client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        return True
    except ClientError as e:
        # 412: the key exists. 409: a concurrent conditional write to the key is in progress (it wins).
        if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
            return _ours(lambda: client.get_object(Bucket=bucket, Key=key)["Body"].read(), data)
        raise


def _ours(read, data: bytes) -> bool:
    """After a create was refused: whether what is there is our own write. A PUT whose response was
    lost (a reset) is retried by the client and then finds its own object; what is written
    (manifests, leases) holds times and ids, so another writer's bytes never equal ours."""
    try:
        return read() == data
    except Exception:  # gone again (a lease released), or unreadable: not ours to claim
        return False


def _gcs_create_exclusive(path: str, data: bytes) -> bool:
    try:
        from google.api_core.exceptions import PreconditionFailed
        from google.cloud import storage as gcs
    except ImportError as e:
        raise RuntimeError("gs:// storage needs google-cloud-storage for conditional writes: "
                           "pip install google-cloud-storage") from e
    bucket, key = _bucket_key(path)
    try:
        blob = gcs.Client().bucket(bucket).blob(key)
        blob.upload_from_string(data, if_generation_match=0)
        return True
    except PreconditionFailed:
        return _ours(blob.download_as_bytes, data)


def delete(path: str) -> None:
    """Delete a file; nothing if it is not there."""
    fs, p = filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.delete_file(p)


def delete_dir(path: str) -> None:
    """Delete a directory (prefix) and everything under it; nothing if it is not there."""
    fs, p = filesystem(path)
    if fs.get_file_info(p).type != pafs.FileType.NotFound:
        fs.delete_dir(p)


def make_dirs(*paths: str) -> None:
    """Create local directories; object stores have none to create."""
    for path in paths:
        if not is_uri(path):
            os.makedirs(path, exist_ok=True)


# ---- jsonl logs --------------------------------------------------------------------------------

PART_LINES = 500  # an object-store append rewrites at most this many lines


class JsonlWriter:
    """Appends JSON lines to `path`.

    Local disk and NFS: one file, appended in place. Object stores (no append):
    `path` is a prefix of parts `part-<start ns>-<n>.jsonl`; each append rewrites
    only the current part, which closes at PART_LINES lines, so the cost of an
    append stays bounded however long the run. `read_jsonl` reads either shape.
    """

    def __init__(self, path: str):
        self.path = path
        self.local = not is_uri(path)
        self.started = time.time_ns()
        self.part, self.lines = 0, []

    def append(self, row: dict) -> None:
        self.extend([row])

    def extend(self, rows: list[dict]) -> None:
        """Append `rows` with one write."""
        if not rows:
            return
        lines = [json.dumps(row) + "\n" for row in rows]
        if self.local:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a") as f:
                f.write("".join(lines))
            return
        self.lines += lines
        write_bytes_atomic(join(self.path, f"part-{self.started:020d}-{self.part:05d}.jsonl"),
                           "".join(self.lines).encode())
        if len(self.lines) >= PART_LINES:
            self.part, self.lines = self.part + 1, []


def append_jsonl(path: str, row: dict) -> None:
    """One append (a writer of its own: on object stores, a part of its own)."""
    JsonlWriter(path).append(row)


def read_jsonl(path: str) -> list[dict]:
    """Every row of a jsonl log written by JsonlWriter (a file, or a prefix of parts), in order."""
    fs, p = filesystem(path)
    info = fs.get_file_info(p)
    if info.type == pafs.FileType.NotFound:
        return []
    if info.type == pafs.FileType.File:
        chunks = [read_bytes(path)]
    else:
        chunks = [read_bytes(join(path, name)) for name, d in list_dir(path) if not d and name.endswith(".jsonl")]
    return [json.loads(line) for chunk in chunks for line in chunk.decode().splitlines() if line.strip()]


class JsonlTail:
    """The rows appended to a JsonlWriter log since the last `read()`, for a process that follows it
    (the training driver showing progress). A local file is read from where the last read stopped; on an
    object store only the parts that may have grown are read again: a writer's part is final once the
    same writer has started the next one."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0  # local file: bytes already read
        self.seen: dict[str, int] = {}  # object store: lines already returned, by part name
        self.final: set[str] = set()

    def read(self) -> list[dict]:
        fs, p = filesystem(self.path)
        info = fs.get_file_info(p)
        if info.type == pafs.FileType.NotFound:
            return []
        if info.type == pafs.FileType.File:
            with fs.open_input_file(p) as f:
                f.seek(self.offset)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line being written is left for the next read
            self.offset += end
            return [json.loads(line) for line in data[:end].decode().splitlines() if line.strip()]
        parts = sorted(name for name, d in list_dir(self.path) if not d and name.endswith(".jsonl"))
        rows = []
        for i, name in enumerate(parts):
            if name in self.final:
                continue
            lines = [line for line in read_bytes(join(self.path, name)).decode().splitlines() if line.strip()]
            rows += [json.loads(line) for line in lines[self.seen.get(name, 0):]]
            self.seen[name] = len(lines)
            writer = name.rsplit("-", 1)[0]
            if i + 1 < len(parts) and parts[i + 1].startswith(writer + "-"):
                self.final.add(name)
        return rows
