"""Online serving (`python -m infer serve`): strata models behind OpenAI's HTTP API, on Ray Serve.

Two deployments make the application:

- `Api`, the FastAPI ingress. It checks the bearer token and the request (body size, JSON, types,
  limits, a known model), answering 4xx in OpenAI's error shape. It then hands the request to `Models`
  under the model's name as Serve's multiplexed model id, and counts what it served.
- `Models`, the replicas that hold models. Each holds up to `models_per_replica` models, least recently
  used evicted. Each model is an `infer.engine.Engine` batching every request for it. A model loads on
  a thread of its own, so the models already loaded keep serving while it loads.

Serve routes a model's requests to the replicas that hold it. When those are at `max_ongoing_requests`,
it sends them to the replicas holding the fewest models, so a hot model spreads over replicas.
Overload answers 503 with Retry-After at once: Serve's bounded queue (`max_queued_requests`) and the
engine's (`max_waiting`).

A model given as RUN@latest follows its training run: every `follow_s` each replica looks for a newer
committed checkpoint. When it finds one, it takes the application's one move lock (a small named actor),
loads the new weights beside the old ones, swaps them and lets the lock go. Replicas move one at a time
and never stop answering.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) as objects.
import asyncio
import base64
import contextlib
import hmac
import json
import math
import time
import weakref
from dataclasses import asdict, dataclass

from strata import tiers

APP = "strata"


@dataclass(kw_only=True)
class ServeConfig:
    tier: str = "cpu"
    """The tier the model replicas run on: `cpu` or `gpu` (one GPU a replica)."""
    replicas: int = 1
    """Model replicas to start with (and the fewest, unless --min-replicas says otherwise)."""
    min_replicas: int = 0
    """Autoscaling: the fewest model replicas (0: --replicas, and no autoscaling unless --max-replicas)."""
    max_replicas: int = 0
    """Autoscaling: the most model replicas (0: --replicas; above it, replicas follow the load)."""
    target_ongoing: float = 8.0
    """Autoscaling: the requests in flight per replica that it aims for."""
    cpus_per_replica: float = 1.0
    """CPUs a model replica takes (its torch threads)."""
    models_per_replica: int = 3
    """Models a replica holds at once (least recently used evicted)."""
    max_batch_tokens: int = 8192
    """Tokens in flight per model on a replica: active sequences' prompts plus what they may still add,
    and a pass batch's tokens. A sequence waits until it fits."""
    batch_wait_ms: float = 0.0
    """How long an idle model waits after a request arrives, so that others share its first pass (under
    load batches form anyway: requests arriving during a step share the next)."""
    max_ongoing: int = 64
    """Requests a model replica takes at once; past it Serve tries another replica or queues."""
    max_queued: int = 256
    """Requests queued for the model replicas; past it the answer is 503 with Retry-After."""
    max_prompts: int = 64
    """Prompts (or inputs) a request may carry."""
    max_new_tokens: int = 1024
    """The largest max_tokens a request may ask for (the model's context bounds it too)."""
    max_body_bytes: int = 1 << 20
    """The largest request body (64 prompts of a 1,024-token context fit in well under 1 MB of JSON)."""
    follow_s: float = 10.0
    """How often a RUN@latest model looks for a newer checkpoint."""

    def __post_init__(self):
        if self.tier not in (tiers.Tier.CPU, tiers.Tier.GPU):
            raise ValueError("--tier must be cpu or gpu")
        ints = {"--replicas": self.replicas, "--models-per-replica": self.models_per_replica,
                "--max-batch-tokens": self.max_batch_tokens, "--max-ongoing": self.max_ongoing,
                "--max-queued": self.max_queued, "--max-prompts": self.max_prompts,
                "--max-new-tokens": self.max_new_tokens, "--max-body-bytes": self.max_body_bytes}
        for flag, value in ints.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1")
        if self.min_replicas < 0 or self.max_replicas < 0:
            raise ValueError("--min-replicas and --max-replicas must be >= 0")
        if self.max_replicas and self.max_replicas < max(self.min_replicas, 1):
            raise ValueError("--max-replicas must be at least --min-replicas (and 1)")
        if self.batch_wait_ms < 0 or self.target_ongoing <= 0 or self.cpus_per_replica <= 0 or self.follow_s <= 0:
            raise ValueError("--batch-wait-ms must be >= 0; --target-ongoing, --cpus-per-replica and --follow-s > 0")

    def autoscaling(self) -> dict | None:
        if not self.max_replicas:
            return None
        low = self.min_replicas or 1
        return {"min_replicas": low, "max_replicas": self.max_replicas,
                "initial_replicas": min(max(self.replicas, low), self.max_replicas),
                "target_ongoing_requests": self.target_ongoing,
                "upscale_delay_s": 2.0, "downscale_delay_s": 10.0, "metrics_interval_s": 1.0,
                "look_back_period_s": 4.0}


# ---- requests: checked on the ingress, in OpenAI's shapes ----------------------------------------------

class RequestError(Exception):
    """A request the server refuses: `status` and OpenAI's error body."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def _number(body: dict, key: str, default, low: float, high: float, kind=float):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not float(value).is_integer()):
        raise RequestError(f"{key} must be {'an integer' if kind is int else 'a number'}", param=key)
    if not low <= value <= high:
        raise RequestError(f"{key} must be between {low} and {high}, not {value}", param=key,
                           code="limit" if key == "max_tokens" else None)
    return kind(value)


def _inputs(body: dict, key: str, limits: ServeConfig) -> list:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids: a list of
    items, each a string or a list of ints."""
    value = body.get(key)
    if value is None:
        raise RequestError(f"{key} is required", param=key)
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_id(x) for x in value)):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise RequestError(f"{key} must be a string, a list of strings or token ids, or a list of lists of "
                           "token ids", param=key)
    if len(items) > limits.max_prompts:
        raise RequestError(f"{key} holds {len(items)} items; the limit is {limits.max_prompts} (--max-prompts)",
                           param=key, code="limit")
    for item in items:
        if not (isinstance(item, str) or (isinstance(item, list) and all(_is_id(x) for x in item))):
            raise RequestError(f"each item of {key} must be a string or a list of token ids", param=key)
    return items


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def completion_request(body, models: list[str], limits: ServeConfig) -> dict:
    """A completion request checked: its fields as the model replicas take them."""
    body = _object(body, models)
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop must be a string or a list of up to 4 non-empty strings", param="stop")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _number(body, "logprobs", None, 0, 20, int)
    for flag in ("stream", "echo"):
        if not isinstance(body.get(flag, False), bool):
            raise RequestError(f"{flag} must be true or false", param=flag)
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1 (send the prompt again for more completions)", param="n")
    echo = body.get("echo", False)
    out = {"model": body["model"], "prompts": _inputs(body, "prompt", limits),
           "max_tokens": _number(body, "max_tokens", 16, 0 if echo else 1, limits.max_new_tokens, int),
           "temperature": _number(body, "temperature", 1.0, 0, 2),
           "top_p": _number(body, "top_p", 1.0, 0, 1), "top_k": _number(body, "top_k", 0, 0, 1 << 20, int),
           "seed": _number(body, "seed", None, -(1 << 62), 1 << 62, int), "stop": stop or [],
           "stream": body.get("stream", False), "echo": echo, "logprobs": logprobs}
    if out["top_p"] == 0:
        out["temperature"] = 0.0
    return out


def embedding_request(body, models: list[str], limits: ServeConfig) -> dict:
    body = _object(body, models)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise RequestError("encoding_format must be float or base64", param="encoding_format")
    return {"model": body["model"], "inputs": _inputs(body, "input", limits), "encoding_format": fmt}


def score_request(body, models: list[str], limits: ServeConfig) -> dict:
    body = _object(body, models)
    return {"model": body["model"], "inputs": _inputs(body, "input", limits)}


def _object(body, models: list[str]) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError("model is required (a string): one of " + ", ".join(models), param="model")
    if model not in models:
        raise RequestError(f"the model {model!r} does not exist; this server has " + ", ".join(models),
                           param="model", status=404, code="model_not_found")
    return body


# ---- the model replicas ----------------------------------------------------------------------------------

@dataclass
class Held:
    """A model on a replica: its engine, swapped in place when a newer checkpoint arrives."""

    name: str
    source: str
    engine: object
    tok: object


def _load(spec: str, root: str, device: str, limits: ServeConfig, pool) -> tuple[str, object, object]:
    from infer.engine import Engine
    from infer.model import resolve
    from strata.storage import Storage

    model = resolve(spec, Storage(root))
    net, tok = model.build(device)
    return model.source, Engine(net, tok, pool=pool, device=device, max_batch_tokens=limits.max_batch_tokens,
                                max_waiting=limits.max_queued, batch_wait_ms=limits.batch_wait_ms), tok


class Holder:
    """What a replica that holds models does with them (the Models deployment; the ingress itself when every
    replica holds every model): load, follow a run, answer. `_model(name)` gives the loaded model."""

    def _hold(self, specs: dict[str, str], root: str, limits: ServeConfig) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import ray
        import torch
        from ray import serve

        self.specs, self.root, self.limits = specs, root, limits
        self.device = "cuda" if ray.get_gpu_ids() else "cpu"
        torch.set_num_threads(max(1, int(limits.cpus_per_replica)))
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="strata-model")
        self.held: weakref.WeakValueDictionary[str, Held] = weakref.WeakValueDictionary()
        self.follower: asyncio.Task | None = None
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def _model(self, name: str) -> Held:
        raise NotImplementedError

    async def _load_held(self, name: str) -> Held:
        """`name` loaded on a thread of its own: the models already loaded keep answering meanwhile."""
        spec = self.specs[name].removesuffix("@latest")
        source, engine, tok = await asyncio.to_thread(_load, spec, self.root, self.device, self.limits, self.pool)
        held = Held(name, source, engine, tok)
        self.held[name] = held
        return held

    async def model(self, name: str) -> Held:
        if self.follower is None and any(s.endswith("@latest") for s in self.specs.values()):
            self.follower = asyncio.get_running_loop().create_task(self._follow())
        return await self._model(name)

    async def _follow(self) -> None:
        """Move RUN@latest models to their run's newest checkpoint, one replica at a time."""
        import logging

        while True:
            await asyncio.sleep(self.limits.follow_s)
            try:
                await self._move()
            except Exception as e:  # noqa: BLE001 - a failed look is tried again at the next
                logging.getLogger("ray.serve").warning(f"strata serve: following a run failed: {e}")

    async def _move(self) -> None:
        """For each RUN@latest model: the run's newest checkpoint that verifies, loaded beside the old one under
        the move lock, then swapped in. A checkpoint refused once (its signatures, or its weights on load) is
        named once and never tried again, so it neither stalls following nor hides a later good one."""
        import logging

        from strata.shell import StrataError
        from strata.storage import Storage

        refused = self.__dict__.setdefault("refused", {})
        for name, spec in self.specs.items():
            held = self.held.get(name)
            if not spec.endswith("@latest") or held is None:
                continue
            run = spec.removesuffix("@latest")
            skip = refused.setdefault(name, set())
            newest, found, passed = await asyncio.to_thread(_newest, run, Storage(self.root), frozenset(skip))
            for ckpt, why in passed:
                skip.add(ckpt)
                logging.getLogger("ray.serve").warning(f"strata serve: {name}: skipped {ckpt} of run {run}: {why}")
            if newest is None or newest == held.source:
                continue
            lock, me = _mover(), f"{self.replica}:{name}"
            await lock.acquire.remote(me, MOVE_LEASE_S)
            renew = asyncio.get_running_loop().create_task(_renew(lock, me))
            try:
                source, engine, tok = await asyncio.to_thread(_load, newest, self.root, self.device, self.limits,
                                                              self.pool)
                held.source, held.engine, held.tok = source, engine, tok
            except (ValueError, OSError, StrataError) as e:  # refused on load (a weight file that does not match)
                skip.add(found.rstrip("/").rsplit("/", 1)[-1])
                logging.getLogger("ray.serve").warning(f"strata serve: {name}: skipped {newest}: {e}")
            finally:
                renew.cancel()
                await lock.release.remote(me)

    async def complete(self, req: dict) -> dict:
        from infer.engine import Busy

        held = await self.model(req["model"])
        try:
            return {**await _complete(held, req), "strata": {"source": held.source, "replica": self.replica}}
        except ValueError as e:
            return {**RequestError(str(e), param="prompt", code="limit").body(), "status": 400}
        except Busy as e:
            return {**RequestError(str(e), kind="overloaded", status=503).body(), "status": 503}

    async def stream(self, req: dict):
        from infer.engine import Busy

        held = await self.model(req["model"])
        try:
            async for chunk in _stream(held, req):
                yield chunk
        except ValueError as e:
            yield {**RequestError(str(e), param="prompt", code="limit").body(), "status": 400}
        except Busy as e:
            yield {**RequestError(str(e), kind="overloaded", status=503).body(), "status": 503}

    async def passes(self, kind: str, req: dict) -> dict:
        from infer.engine import Busy

        held = await self.model(req["model"])
        engine, tok = held.engine, held.tok
        try:
            ids = [_ids(tok, x) for x in req["inputs"]]
            got = await asyncio.gather(*[engine.run_pass(kind, i) for i in ids])
        except ValueError as e:
            return {**RequestError(str(e), param="input", code="limit").body(), "status": 400}
        except Busy as e:
            return {**RequestError(str(e), kind="overloaded", status=503).body(), "status": 503}
        tokens = sum(len(i) for i in ids)
        where = {"source": held.source, "replica": self.replica}
        if kind == "embed":
            data = [{"object": "embedding", "index": k, "embedding": _encoded(v, req["encoding_format"])}
                    for k, v in enumerate(got)]
            return {"object": "list", "model": req["model"], "data": data,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "strata": where}
        per_token = tok.token_bytes()
        data = []
        for k, (i, (n, nll)) in enumerate(zip(ids, got, strict=True)):
            size = int(per_token[i].sum()) if len(i) else 0
            data.append({"index": k, "tokens": n, "loss": nll / n if n else None,
                         "bpb": nll / math.log(2) / max(1, size) if n else None, "bytes": size})
        return {"object": "list", "model": req["model"], "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "strata": where}

    async def warm(self, name: str) -> str:
        """Load `name` here (before the first request asks): its source."""
        return (await self.model(name)).source

    def model_stats(self) -> dict:
        """This replica's models: their sources and decode steps (rows / steps: the mean batch)."""
        return {"replica": self.replica, "models": {
            n: {"source": h.source, "steps": h.engine.steps, "rows": h.engine.rows} for n, h in self.held.items()}}


def models_deployment(limits: ServeConfig):
    """The Models deployment class, its multiplexing sized by `limits.models_per_replica`."""
    from ray import serve

    class Models(Holder):
        def __init__(self, specs: dict[str, str], root: str):
            self._hold(specs, root, limits)

        @serve.multiplexed(max_num_models_per_replica=limits.models_per_replica)
        async def _model(self, name: str) -> Held:
            return await self._load_held(name)

    return Models


def _newest(run: str, storage, skip: frozenset) -> tuple[str | None, str | None, list]:
    """RUN@STEP of the run's newest committed checkpoint whose signed lists and meta verify (none in `skip`),
    its path, and the (name, why) of newer ones refused."""
    from train.checkpoint import SignedFiles, newest

    found, meta, refused = newest(storage.run(run), lambda c: SignedFiles(c).meta(), skip=skip)
    return (f"{run}@{meta['step']}" if found else None), found, refused


MOVE_LEASE_S = 60.0  # the move lock's lease: a replica that died holding it lets the others move after this


async def _renew(lock, me: str) -> None:
    """Keep the move lock's lease while this replica loads (a load may take longer than the lease)."""
    while True:
        await asyncio.sleep(MOVE_LEASE_S / 3)
        await lock.acquire.remote(me, MOVE_LEASE_S)


def _mover():
    """The application's one move lock (created by the first replica that asks): a lease, so a replica that
    died while it held the lock stops holding it once the lease runs out."""
    import ray

    @ray.remote(num_cpus=0)
    class MoveLock:
        def __init__(self):
            self.holder, self.until, self.freed = None, 0.0, asyncio.Event()

        async def acquire(self, holder: str, lease_s: float) -> None:
            """Take (or, for its holder, renew) the lock for `lease_s` seconds, waiting while another holds it."""
            while self.holder not in (None, holder) and time.monotonic() < self.until:
                self.freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.freed.wait(), timeout=self.until - time.monotonic())
            self.holder, self.until = holder, time.monotonic() + lease_s

        def release(self, holder: str) -> None:
            if self.holder == holder:
                self.holder = None
                self.freed.set()

    return MoveLock.options(name=f"{APP}-move-lease", namespace="serve", get_if_exists=True,
                            lifetime="detached", label_selector=tiers.selector(tiers.Tier.CPU)).remote()


def _ids(tok, item) -> list[int]:
    return tok.encode(item).tolist() if isinstance(item, str) else list(item)


def _encoded(vector: list[float], fmt: str):
    if fmt == "float":
        return vector
    import numpy as np

    return base64.b64encode(np.asarray(vector, np.float32).tobytes()).decode()


def _sampling(req: dict):
    from infer.engine import Sampling

    return Sampling(max_tokens=req["max_tokens"], temperature=req["temperature"], top_p=req["top_p"],
                    top_k=req["top_k"], seed=req["seed"], logprobs=req["logprobs"], echo=req["echo"])


class _Choice:
    """One prompt's completion as it is drawn: the text so far, cut at a stop string."""

    def __init__(self, held, prompt_ids: list[int], prompt_text: str | None, req: dict, index: int):
        self.tok, self.req, self.index = held.tok, req, index
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text if prompt_text is not None else held.tok.decode(prompt_ids)
        self.seq = held.engine.submit(prompt_ids, _sampling(req), index)
        self.text, self.sent, self.finish = "", 0, None

    async def next_text(self) -> str | None:
        """The text that may be sent now (None once finished and all sent)."""
        if self.finish:
            return None
        kind, value = await self.seq.events.get()
        eot = self.tok.eot_id
        ids = [i for i in self.seq.out if i != eot]
        text = self.tok.decode(ids)
        if kind == "done":
            self.finish = "stop" if value in ("stop", "cancelled") else "length"
            if value.startswith("error"):
                raise RuntimeError(value)
        for stop in self.req["stop"]:
            at = text.find(stop)
            if at >= 0:
                text, self.finish = text[:at], "stop"
                self.seq.cancelled = True
        self.text = text
        hold = 0 if self.finish else max([len(s) - 1 for s in self.req["stop"]] + [0])
        if not self.finish and text.endswith("\ufffd"):  # a character not yet complete
            hold = max(hold, 1)
        upto = max(self.sent, len(text) - hold)
        piece, self.sent = text[self.sent:upto], upto
        return piece

    def cancel(self) -> None:
        self.seq.cancelled = True

    def logprobs(self) -> dict | None:
        if self.req["logprobs"] is None:
            return None
        ids = (self.prompt_ids if self.req["echo"] else []) + self.seq.out[: len(self.seq.logprobs)]
        pairs = self.seq.logprobs[: len(ids)]
        tokens = [self.tok.decode([i]) for i in ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [p for p, _ in pairs],
                "top_logprobs": [None if p is None else {self.tok.decode([i]): v for i, v in top.items()}
                                 for p, top in pairs],
                "text_offset": offsets}

    def usage(self) -> tuple[int, int]:
        return len(self.prompt_ids), len(self.seq.out)


def _choices(held, req: dict) -> list[_Choice]:
    out = []
    try:
        for k, item in enumerate(req["prompts"]):
            ids = _ids(held.tok, item)
            out.append(_Choice(held, ids, item if isinstance(item, str) else None, req, k))
    except BaseException:
        for c in out:
            c.cancel()
        raise
    return out


async def _complete(held, req: dict) -> dict:
    choices = _choices(held, req)
    try:
        async def drain(c):
            while await c.next_text() is not None:
                pass
        await asyncio.gather(*[drain(c) for c in choices])
    finally:
        for c in choices:
            c.cancel()
    prompt = sum(c.usage()[0] for c in choices)
    made = sum(c.usage()[1] for c in choices)
    return {"id": f"cmpl-{time.time_ns():x}", "object": "text_completion", "created": int(time.time()),
            "model": req["model"], "system_fingerprint": held.source,
            "choices": [{"index": c.index, "text": (c.prompt_text if req["echo"] else "") + c.text,
                         "logprobs": c.logprobs(), "finish_reason": c.finish} for c in choices],
            "usage": {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}}


async def _stream(held, req: dict):
    choices = _choices(held, req)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c):
        try:
            if req["echo"]:
                await queue.put((c, c.prompt_text, None))
            while (piece := await c.next_text()) is not None:
                if piece or c.finish:
                    await queue.put((c, piece, c.finish))
        except Exception as e:  # noqa: BLE001 - the stream ends with the error
            await queue.put((c, e, None))
        await queue.put((c, None, None))

    tasks = [asyncio.get_running_loop().create_task(pump(c)) for c in choices]
    left = len(choices)
    try:
        while left:
            c, piece, finish = await queue.get()
            if piece is None:
                left -= 1
                continue
            if isinstance(piece, Exception):
                raise piece
            yield {"id": f"cmpl-{id(req):x}", "object": "text_completion", "created": int(time.time()),
                   "model": req["model"],
                   "choices": [{"index": c.index, "text": piece, "logprobs": None, "finish_reason": finish}]}
        prompt = sum(c.usage()[0] for c in choices)
        made = sum(c.usage()[1] for c in choices)
        yield {"usage": {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}}
    finally:
        for c in choices:
            c.cancel()
        for t in tasks:
            t.cancel()


# ---- the ingress ------------------------------------------------------------------------------------------

def api_deployment():
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from ray import serve
    from ray.serve.exceptions import BackPressureError

    app = FastAPI(title="strata", docs_url=None, redoc_url=None)

    @serve.ingress(app)
    class Api(Holder):
        """The ingress. With `models` None it holds every model itself (`specs`, under `root`) and answers in
        this process: one hop from the proxy instead of two."""

        def __init__(self, models, names: list[str], limits: dict, token_sha256: str | None,
                     specs: dict[str, str] | None = None, root: str = ""):
            self.models, self.names = models, list(names)
            self.limits = ServeConfig(**limits)
            self.token = token_sha256
            self.ledger = Ledger()
            self.inflight = 0  # requests in this replica (the bound when it holds the models itself)
            if models is None:
                self._hold(specs, root, self.limits)
                self.loads: dict[str, asyncio.Task] = {}
                self.handles = {}
                try:  # the constructor runs on the replica's event loop: every model starts loading now
                    loop = asyncio.get_running_loop()
                    self.loads = {n: loop.create_task(self._load_held(n)) for n in specs}
                except RuntimeError:
                    pass
            else:
                self.handles = {n: models.options(multiplexed_model_id=n) for n in self.names}

        async def _model(self, name: str) -> Held:  # every model stays: a load happens once per name
            if name not in self.loads:
                self.loads[name] = asyncio.get_running_loop().create_task(self._load_held(name))
            try:
                return await asyncio.shield(self.loads[name])
            except Exception:
                self.loads.pop(name, None)  # a failed load is tried again by the next request
                raise


        def _deny(self, request: Request) -> JSONResponse | None:
            if self.token is None:
                return None
            import hashlib

            given = request.headers.get("authorization", "")
            scheme, _, value = given.partition(" ")
            digest = hashlib.sha256(value.strip().encode()).hexdigest() if scheme.lower() == "bearer" else ""
            if hmac.compare_digest(digest, self.token):
                return None
            return _error(RequestError("a valid bearer token is required (Authorization: Bearer ...)",
                                       status=401, kind="authentication_error", code="invalid_api_key"))

        async def _body(self, request: Request):
            size = request.headers.get("content-length")
            if size and size.isdigit() and int(size) > self.limits.max_body_bytes:
                raise RequestError(f"the body is {int(size):,} bytes; the limit is {self.limits.max_body_bytes:,} "
                                   "(--max-body-bytes)", status=413, code="limit")
            raw = b""
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > self.limits.max_body_bytes:
                    raise RequestError(f"the body is over {self.limits.max_body_bytes:,} bytes (--max-body-bytes)",
                                       status=413, code="limit")
            try:
                return json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"the body is not JSON: {e}") from None

        async def _call(self, request: Request, check, method: str, *args):
            started = time.perf_counter()
            denied = self._deny(request)
            if denied:
                return denied
            try:
                if self.models is None and self.inflight >= self.limits.max_ongoing + self.limits.max_queued:
                    # At once, before the body is read: an overload costs this replica next to nothing.
                    raise RequestError(f"overloaded: {self.inflight} requests in flight on this replica "
                                       "(--max-ongoing plus --max-queued); retry", status=503, kind="overloaded")
                req = check(await self._body(request), self.names, self.limits)
                if req.get("stream"):
                    return self._streamed(req, started)
                if self.models is None:
                    self.inflight += 1
                    try:
                        out = await getattr(self, method)(*args, req)
                    finally:
                        self.inflight -= 1
                else:
                    out = await getattr(self.handles[req["model"]], method).remote(*args, req)
            except RequestError as e:
                self.ledger.add(time.perf_counter() - started, e.status)
                return _error(e, retry_after=1 if e.status == 503 else None)
            except BackPressureError as e:
                self.ledger.add(time.perf_counter() - started, 503)
                return _error(RequestError(f"overloaded: {e.message}; retry", status=503, kind="overloaded"),
                              retry_after=1)
            status = out.pop("status", 200) if "error" in out else 200
            usage = out.get("usage", {})
            self.ledger.add(time.perf_counter() - started, status, usage.get("prompt_tokens", 0),
                            usage.get("completion_tokens", 0))
            if status != 200:
                return JSONResponse(out, status_code=status, headers={"Retry-After": "1"} if status == 503 else None)
            return out

        def _streamed(self, req: dict, started: float):
            if self.models is None:
                gen = self.stream(req)
            else:
                gen = self.handles[req["model"]].options(stream=True).stream.remote(req)
            self.inflight += 1

            async def events():
                status, usage = 200, {}
                try:
                    async for chunk in gen:
                        if "error" in chunk:
                            status = chunk.pop("status", 500)
                            yield f"data: {json.dumps(chunk)}\n\n"
                            return
                        if "usage" in chunk and "choices" not in chunk:
                            usage = chunk["usage"]
                            continue
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                except BackPressureError as e:
                    status = 503
                    yield f"data: {json.dumps(RequestError(f'overloaded: {e.message}', status=503).body())}\n\n"
                finally:
                    self.inflight -= 1
                    self.ledger.add(time.perf_counter() - started, status, usage.get("prompt_tokens", 0),
                                    usage.get("completion_tokens", 0))

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(self, request: Request):
            return await self._call(request, completion_request, "complete")

        @app.post("/v1/embeddings")
        async def embeddings(self, request: Request):
            return await self._call(request, embedding_request, "passes", "embed")

        @app.post("/v1/score")
        async def score(self, request: Request):
            return await self._call(request, score_request, "passes", "score")

        @app.get("/v1/models")
        async def list_models(self, request: Request):
            denied = self._deny(request)
            if denied:
                return denied
            return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "strata"}
                                               for n in self.names]}

        @app.get("/v1/stats")
        async def stats(self, request: Request):
            """What this ingress served, and one model replica's decode batches (strata's own)."""
            denied = self._deny(request)
            if denied:
                return denied
            replica = self.model_stats() if self.models is None else await self.models.model_stats.remote()
            return {"served": self.ledger.figures(), "replica": replica}

        @app.get("/healthz")
        async def healthz(self):
            return {"status": "ok", "models": len(self.names)}

        def figures(self) -> dict:
            return self.ledger.figures()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc):  # a bug or a failed replica: still OpenAI's shape
        return _error(RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error"))

    return Api


def _error(e: RequestError, retry_after: int | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers={"Retry-After": str(retry_after)} if retry_after
                        else None)


class Ledger:
    """What an ingress replica served: counts, tokens, and latencies (the newest 100,000)."""

    KEEP = 100_000

    def __init__(self):
        from collections import Counter, deque

        self.latencies: deque[float] = deque(maxlen=self.KEEP)
        self.status: Counter = Counter()
        self.prompt_tokens = self.completion_tokens = 0

    def add(self, seconds: float, status: int, prompt: int = 0, completion: int = 0) -> None:
        self.latencies.append(seconds)
        self.status[status] += 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion

    def figures(self) -> dict:
        lat = sorted(self.latencies)

        def q(p):
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 3) if lat else None

        return {"requests": sum(self.status.values()), "by_status": {str(k): v for k, v in self.status.items()},
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "p50_ms": q(0.5), "p99_ms": q(0.99)}


def build(specs: dict[str, str], root: str, limits: ServeConfig, token_sha256: str | None):
    """The Serve application. When every replica can hold every model (no more models than
    --models-per-replica), one deployment: the ingress holds the models and answers itself, one hop from
    the proxy. Otherwise Api in front of Models, which Serve multiplexes by model."""
    gpu = limits.tier == tiers.Tier.GPU
    options = {"ray_actor_options": {"num_cpus": 0 if gpu else limits.cpus_per_replica, "num_gpus": 1 if gpu else 0,
                                     "label_selector": tiers.selector(limits.tier)},
               "max_ongoing_requests": limits.max_ongoing, "max_queued_requests": limits.max_queued,
               "health_check_period_s": 2.0, "graceful_shutdown_timeout_s": 10.0,
               "logging_config": {"enable_access_log": False},  # a log line per request costs each hop CPU
               "backpressure_config": {"retry_after_s": 1}}  # Serve's own 503s say when to retry too
    if limits.autoscaling():
        options["autoscaling_config"] = limits.autoscaling()
    else:
        options["num_replicas"] = limits.replicas
    from ray import serve

    if len(specs) <= limits.models_per_replica:
        # The replica refuses past --max-ongoing plus --max-queued itself, before reading the body (503 in OpenAI's
        # shape, Retry-After); Serve's own bounds sit far above it as the last line.
        # (The proxy's router holds a burst's requests while it picks replicas: its queue is that large too.)
        bound = max(1024, 4 * (limits.max_ongoing + limits.max_queued))
        options.update(max_ongoing_requests=bound, max_queued_requests=bound)
        return serve.deployment(api_deployment(), name="Api", **options).bind(None, sorted(specs), asdict(limits),
                                                                            token_sha256, specs, root)
    model_app = serve.deployment(models_deployment(limits), name="Models", **options).bind(specs, root)
    api = serve.deployment(api_deployment(), name="Api", num_replicas=1, max_ongoing_requests=4 * limits.max_queued,
                           ray_actor_options={"num_cpus": 0, "label_selector": tiers.selector(tiers.Tier.CPU)},
                           logging_config={"enable_access_log": False})
    return api.bind(model_app, sorted(specs), asdict(limits), token_sha256)


# ---- the command --------------------------------------------------------------------------------------------

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def model_specs(flags: list[str], models_file: str | None) -> dict[str, str]:
    """`[NAME=]SPEC` items (from --model, and one a line of a models file, `#` comments) as {name: spec}.
    The name defaults to the run's name (or the directory's last part)."""
    from strata.storage import check_name, text_of

    items = list(flags)
    if models_file:
        for line in text_of(models_file, "--models-file").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                items.append(line)
    out: dict[str, str] = {}
    for item in items:
        name, eq, spec = item.partition("=")
        if not eq:
            spec, name = item, item.rstrip("/").rsplit("/", 1)[-1].partition("@")[0]
        check_name(name, "a model's name")
        if name in out:
            raise ValueError(f"two models are named {name!r}: name them with NAME=SPEC")
        out[name] = spec
    if not out:
        raise ValueError("no model: give --model [NAME=]RUN[@STEP|@latest]|DIR, or --models-file FILE")
    return out


def serve_models(specs: dict[str, str], cfg: ServeConfig, storage, name: str, *, host: str, port: int,
                 address: str | None, token_file: str | None = None, token_sha256: str | None = None,
                 proxies: str = "EveryNode") -> dict:
    """Check every model, deploy the application, serve until Ctrl-C or SIGTERM, then stop it and write
    the run's record (requests, tokens, latency, replica-hours, dollars per million tokens)."""
    import hashlib
    import re

    import ray
    from ray import serve

    from infer.model import resolve
    from strata.shell import Job, StrataError
    from strata.shell import log as _logger
    from strata.storage import join, text_of

    say = _logger("serve").info
    digest = token_sha256.lower() if token_sha256 else None
    if token_file and token_sha256:
        raise ValueError("give --token-file or --token-sha256, not both")
    if token_file:
        token = text_of(token_file, "--token-file").strip()
        if len(token) < 16:
            raise ValueError(f"--token-file {token_file}: the token must be at least 16 characters")
        digest = hashlib.sha256(token.encode()).hexdigest()
    elif digest and not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ValueError("--token-sha256 must be 64 hex digits: printf %s \"$TOKEN\" | sha256sum")
    elif not digest and host not in LOOPBACK:
        raise ValueError(f"--host {host} listens beyond this machine: give --token-file FILE or --token-sha256 HEX "
                         "(the bearer token clients must send), or keep the default 127.0.0.1")
    sources = {}
    for n, spec in specs.items():  # on the driver: a bad --model fails before anything starts
        sources[n] = resolve(spec.removesuffix("@latest"), storage, "--model").source
    out = storage.servings(name)
    with Job("serve", name, storage, holds=out, what=f"serving {name}") as job:
        job.connect(address=address, quiet=True, log_to_driver=False)
        job.begin({"models": specs, "host": host, "port": port, **asdict(cfg)})
        if not tiers.nodes_of(cfg.tier, ray.nodes()):
            raise StrataError(f"no alive node serves the {cfg.tier} tier (label {tiers.label_key(cfg.tier)}=true)")
        serve.start(http_options={"host": host, "port": port, "location": proxies})
        started = time.time()
        replica_s, polled = 0.0, time.time()
        with job.working():
            serve.run(build(specs, storage.root, cfg, digest), name=APP, route_prefix="/", blocking=False)
            shown = ", ".join(f"{n} ({sources[n]}{', following the run' if s.endswith('@latest') else ''})"
                              for n, s in specs.items())
            _warm(specs, cfg)
            metrics = sorted(f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes()
                             if n.get("Alive") and n.get("MetricsExportPort"))
            if metrics:  # Ray Serve's Prometheus metrics (ray_serve_*), from each node's metrics agent
                say(f"Prometheus metrics at {metrics[0]}" + (f" and {len(metrics) - 1} more nodes" if len(metrics) > 1
                                                              else ""))
            say(f"serving {shown} at http://{host}:{port}/v1 on the {cfg.tier} tier; Ctrl-C stops")
            try:
                while True:
                    time.sleep(1.0)
                    now = time.time()
                    replica_s += (now - polled) * _replicas()
                    polled = now
            except KeyboardInterrupt:
                say("stopping: draining requests in flight")
                figures = _figures()
                serve.delete(APP)
                serve.shutdown()
                seconds = time.time() - started
                tokens = figures.get("prompt_tokens", 0) + figures.get("completion_tokens", 0)
                figures.update({"models": len(specs), "seconds": round(seconds, 3),
                                "replica_hours": round(replica_s / 3600, 6),
                                "requests_per_s": figures.get("requests", 0) / max(seconds, 1e-9)})
        nodes = [n["NodeID"] for n in tiers.nodes_of(cfg.tier, ray.nodes())]
        cost = job.finish(beside=join(out, "record.json"), work_nodes=nodes, figures=figures)
    per_million = cost["cost"] / tokens * 1e6 if tokens and cost["cost"] is not None else None
    return {"name": name, "models": sources, **figures, **cost, "dollars_per_million_tokens": per_million,
            "record": join(out, "record.json")}


def _warm(specs: dict[str, str], cfg: ServeConfig) -> None:
    """Load the first models (as many as the replicas hold) before the first request, so that it does not
    wait for a load: each through Serve's router, as a request for it would go."""
    from ray import serve

    room = cfg.models_per_replica * max(1, cfg.replicas if not cfg.max_replicas else cfg.min_replicas or 1)

    async def warm():  # in an event loop: Serve's throughput-optimised mode routes only from inside one
        if len(specs) <= cfg.models_per_replica:  # the ingress holds them all (build): each replica loads them
            handle = serve.get_deployment_handle("Api", app_name=APP)
            await asyncio.gather(*[handle.warm.remote(n) for n in specs])
            return
        handle = serve.get_deployment_handle("Models", app_name=APP)
        await asyncio.gather(*[handle.options(multiplexed_model_id=n).warm.remote(n) for n in list(specs)[:room]])
    asyncio.run(asyncio.wait_for(warm(), 600))


def _replicas() -> int:
    from ray import serve

    try:
        app = serve.status().applications.get(APP)
        dep = (app.deployments.get("Models") or app.deployments.get("Api")) if app else None
        return sum(n for state, n in dep.replica_states.items() if str(state).endswith("RUNNING")) if dep else 0
    except Exception as e:  # noqa: BLE001 - a status that fails to read counts no replica for that second
        from strata.shell import log

        log("serve").warning(f"Ray Serve's status did not read ({type(e).__name__}: {e}): no replica counted")
        return 0


def _figures() -> dict:
    from ray import serve

    async def read():
        return await serve.get_app_handle(APP).figures.remote()

    try:
        return asyncio.run(asyncio.wait_for(read(), 10))
    except Exception as e:  # noqa: BLE001 - the record says it could not count
        return {"requests": None, "error": f"the ingress's figures could not be read: {e}"}


def app(args: dict):
    """Ray Serve's application builder, for a Serve config (a RayService's serveConfigV2, `serve deploy`):
    `import_path: infer.serve:app` with args `models` ({name: spec}), `storage` (the root; default
    $STRATA_STORAGE), `config` (ServeConfig's fields) and `token_sha256`, the SHA-256 of the bearer token
    clients send (`printf %s "$TOKEN" | sha256sum`): such a server listens beyond loopback, so it is required.
    """
    import re

    from strata.storage import Storage

    unknown = set(args) - {"models", "storage", "config", "token_sha256"}
    if unknown:
        raise ValueError(f"infer.serve:app: unknown args {sorted(unknown)} (models, storage, config, token_sha256)")
    digest = str(args.get("token_sha256", ""))
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ValueError("infer.serve:app needs token_sha256: the SHA-256 (64 hex digits) of the bearer token clients "
                         "must send; make one with printf %s \"$TOKEN\" | sha256sum")
    if digest == "0" * 64:
        raise ValueError("infer.serve:app: token_sha256 is still the placeholder of platform/k8s/rayservice.yaml; put "
                         "the SHA-256 of your token there")
    models = args.get("models")
    if not isinstance(models, dict) or not models:
        raise ValueError("infer.serve:app needs models: {name: RUN[@STEP|@latest] or an exported directory}")
    specs = model_specs([f"{n}={s}" for n, s in models.items()], None)
    root = Storage.from_env(args.get("storage")).root
    return build(specs, root, ServeConfig(**args.get("config", {})), digest)
