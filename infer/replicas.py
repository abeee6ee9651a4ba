"""The replicas that hold models (`Holder`): load them, follow a training run, and answer.

- `Models`, the deployment Serve multiplexes by model (`models_deployment`). Each replica holds up to
  `models_per_replica` models, least recently used evicted. A model loads on a thread of its own, so the
  models already loaded keep serving while it loads.
- `Local`, the same work inside the ingress itself, when every replica holds every model (infer/api.py).

A model given as RUN@latest follows its training run: every `follow_s` each replica looks for a newer
committed checkpoint. When it finds one, it takes the application's one move lock (a small named actor),
loads the new weights beside the old ones, swaps them and lets the lock go. Replicas move one at a time
and never stop answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref

from infer import answers
from infer.answers import Held
from infer.schemas import RequestError, ServeConfig
from strata.cluster import tiers

APP = "strata"
MOVE_LEASE_S = 60.0  # the move lock's lease: a replica that died holding it lets the others move after this


def _load(spec: str, root: str, device: str, limits: ServeConfig, pool) -> tuple[str, object, object, object]:
    from infer.engine import Engine
    from infer.model import resolve
    from strata.data.chat import DEFAULT_TEMPLATE, compile_template
    from strata.data.storage import Storage

    model = resolve(spec, Storage(root), allow_tainted=limits.allow_tainted)  # a tainted model: refused, or its use recorded
    template = compile_template(model.chat_template or DEFAULT_TEMPLATE)
    net, tok = model.build(device)
    return model.source, Engine(net, tok, pool=pool, device=device, max_batch_tokens=limits.max_batch_tokens,
                                max_waiting=limits.max_queued, batch_wait_ms=limits.batch_wait_ms), tok, template


def _refused(e: Exception, param: str) -> dict:
    """A request's error from the model's side (a ValueError, or the engine's Busy), as the ingress passes it on."""
    if not isinstance(e, ValueError):
        return {**RequestError(str(e), kind="overloaded", status=503).body(), "status": 503}
    return {**RequestError(str(e), param=param, code="limit").body(), "status": 400}


class Holder:
    """What a replica that holds models does with them: load, follow a run, answer. `_model(name)` gives
    the loaded model (a subclass says how it keeps them)."""

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
        self.refused: dict[str, set] = {}
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def _model(self, name: str) -> Held:
        raise NotImplementedError

    async def _load_held(self, name: str) -> Held:
        """`name` loaded on a thread of its own: the models already loaded keep answering meanwhile."""
        spec = self.specs[name].removesuffix("@latest")
        held = Held(name, *await asyncio.to_thread(_load, spec, self.root, self.device, self.limits, self.pool))
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

        from strata.commands.shell import StrataError
        from strata.data.storage import Storage

        for name, spec in self.specs.items():
            held = self.held.get(name)
            if not spec.endswith("@latest") or held is None:
                continue
            run = spec.removesuffix("@latest")
            skip = self.refused.setdefault(name, set())
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
                loaded = await asyncio.to_thread(_load, newest, self.root, self.device, self.limits, self.pool)
                held.source, held.engine, held.tok, held.template = loaded
            except (ValueError, OSError, StrataError) as e:  # refused on load (a weight file that does not match)
                skip.add(found.rstrip("/").rsplit("/", 1)[-1])
                logging.getLogger("ray.serve").warning(f"strata serve: {name}: skipped {newest}: {e}")
            finally:
                renew.cancel()
                await lock.release.remote(me)

    async def answer(self, what: str, req: dict) -> dict:
        """`what` (complete, embed, score, tokenize, detokenize) for `req`: OpenAI's shape, or an error body
        with its `status`."""
        from infer.engine import Busy

        held = await self.model(req["model"])
        try:
            if what == "complete":
                out = await answers.complete(held, req)
            elif what in ("embed", "score"):
                out = await answers.passes(held, what, req, self.limits.max_input_tokens)
            elif what == "tokenize":
                return answers.tokenize(held, req)
            else:
                return answers.detokenize(held, req)
        except (ValueError, Busy) as e:  # a limit, a bad id or a full engine: the request's error
            return _refused(e, "input" if what in ("embed", "score") else "prompt")
        return {**out, "strata": {"source": held.source, "replica": self.replica}}

    async def stream(self, req: dict):
        from infer.engine import Busy

        held = await self.model(req["model"])
        try:
            async for chunk in answers.stream(held, req):
                yield chunk
        except (ValueError, Busy) as e:
            yield _refused(e, "prompt")

    async def warm(self, name: str) -> str:
        """Load `name` here (before the first request asks): its source."""
        return (await self.model(name)).source

    def model_stats(self) -> dict:
        """This replica's models: their sources and decode steps (rows / steps: the mean batch)."""
        return {"replica": self.replica, "models": {
            n: {"source": h.source, "steps": h.engine.steps, "rows": h.engine.rows} for n, h in self.held.items()}}


class Local(Holder):
    """Every model held in the ingress's own replica, loaded once each, none evicted."""

    def __init__(self, specs: dict[str, str], root: str, limits: ServeConfig):
        self._hold(specs, root, limits)
        self.loads: dict[str, asyncio.Task] = {}
        with contextlib.suppress(RuntimeError):  # on the replica's event loop: every model starts loading now
            loop = asyncio.get_running_loop()
            self.loads = {n: loop.create_task(self._load_held(n)) for n in specs}

    async def _model(self, name: str) -> Held:
        if name not in self.loads:
            self.loads[name] = asyncio.get_running_loop().create_task(self._load_held(name))
        try:
            return await asyncio.shield(self.loads[name])
        except Exception:
            self.loads.pop(name, None)  # a failed load is tried again by the next request
            raise


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
    from train.checkpoint import SignedFiles
    from train.committed import newest

    found, meta, refused = newest(storage.run(run), lambda c: SignedFiles(c).meta(), skip=skip)
    return (f"{run}@{meta['step']}" if found else None), found, refused


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
