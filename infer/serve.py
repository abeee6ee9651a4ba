"""Online serving (`python -m infer serve`): strata models behind OpenAI's HTTP API, on Ray Serve.

The application (`build`) is one deployment or two:

- `Api`, the FastAPI ingress (infer/api.py). It checks the bearer token, admits the request against its
  bound, reads and checks the body (infer/admission.py, infer/schemas.py), answering 4xx in OpenAI's
  error shape, and counts every answer.
- When every replica can hold every model, the ingress holds them itself and answers in its own process.
  Otherwise `Models` replicas hold them (infer/replicas.py), up to `models_per_replica` each, least
  recently used evicted; Serve routes a model's requests to the replicas that hold it, and when those are
  at `max_ongoing_requests`, to the replicas holding the fewest models, so a hot model spreads.

Overload answers 503 with Retry-After at once. A model given as RUN@latest follows its training run.
This module is the command: check the models, deploy, serve until Ctrl-C or SIGTERM, drain, and write
the run's record.
"""

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import sys
import threading
import time
from dataclasses import asdict

from infer.replicas import APP
from infer.schemas import ServeConfig
from strata.cluster import tiers


def build(specs: dict[str, str], root: str, limits: ServeConfig, token_sha256: str | None,
          record: dict | None = None):
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

    from infer.api import api_deployment
    from infer.replicas import models_deployment

    if len(specs) <= limits.models_per_replica:
        # The replica refuses past --max-ongoing plus --max-queued itself, before reading the body (503 in OpenAI's
        # shape, Retry-After); Serve's own bounds sit far above it as the last line.
        # (The proxy's router holds a burst's requests while it picks replicas: its queue is that large too.)
        bound = max(1024, 4 * (limits.max_ongoing + limits.max_queued))
        options.update(max_ongoing_requests=bound, max_queued_requests=bound)
        return serve.deployment(api_deployment(), name="Api", **options).bind(None, sorted(specs), asdict(limits),
                                                                            token_sha256, specs, root, record)
    model_app = serve.deployment(models_deployment(limits), name="Models", **options).bind(specs, root)
    most = limits.max_replicas or limits.replicas  # the ingress's own bound (infer/api.py) sits below Serve's
    api = serve.deployment(api_deployment(), name="Api", num_replicas=1,
                           max_ongoing_requests=max(1024, 4 * (most * limits.max_ongoing + limits.max_queued)),
                           ray_actor_options={"num_cpus": 0, "label_selector": tiers.selector(tiers.Tier.CPU)},
                           logging_config={"enable_access_log": False})
    return api.bind(model_app, sorted(specs), asdict(limits), token_sha256, record=record)


# ---- the command --------------------------------------------------------------------------------------------

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def model_specs(flags: list[str], models_file: str | None) -> dict[str, str]:
    """`[NAME=]SPEC` items (from --model, and one a line of a models file, `#` comments) as {name: spec}.
    The name defaults to the run's name (or the directory's last part)."""
    from strata.data.storage import check_name, text_of

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
                 proxies: str = "EveryNode", ingress: str | None = None, allow_tainted: bool = False) -> dict:
    """Check every model, deploy the application, serve until Ctrl-C or SIGTERM, then stop it and write
    the run's record (requests, tokens, latency, replica-hours, dollars per million tokens)."""
    import hashlib
    import re

    import ray

    from infer.model import check
    from strata.commands.shell import Job, StrataError
    from strata.commands.shell import log as _logger
    from strata.data.storage import join, text_of

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
    mode, why = ingress_mode(ingress, specs, cfg, joined=bool(address or os.environ.get("RAY_ADDRESS")),
                             token=digest is not None)
    proxy_port = _ingress_env(mode, host, port, digest)  # before Ray and Serve start: their processes read it
    from ray import serve

    sources = {}
    for n, spec in specs.items():  # on the driver, weights unread: a bad --model fails before anything starts
        # a tainted model refused here, in one line (allowed: each replica that loads it records the use)
        sources[n] = check(spec.removesuffix("@latest"), storage, "--model", None if allow_tainted else False)
    out = storage.servings(name)
    with Job("serve", name, storage, holds=out, what=f"serving {name}") as job:
        job.connect(address=address, quiet=True, log_to_driver=False)
        job.begin({"models": specs, "host": host, "port": port, "ingress": mode, **asdict(cfg)})
        from infer.driver import model_dataset

        job.lineage([d for src in sources.values() for d in model_dataset(src, storage)], [], streaming=True)
        if not tiers.nodes_of(cfg.tier, ray.nodes()):
            raise StrataError(f"no alive node serves the {cfg.tier} tier (label {tiers.label_key(cfg.tier)}=true)")
        if not logging.getLogger("strata").isEnabledFor(logging.DEBUG):  # Serve's INFO lines with --verbose only
            logging.getLogger("ray.serve").setLevel(logging.WARNING)
        serve.start(http_options={"host": host, "port": proxy_port or port, "location": proxies})
        _forget_tally()
        started = time.time()
        with job.working():
            serve.run(build(specs, storage.root, cfg, digest), name=APP, route_prefix="/", blocking=False)
            shown = ", ".join(f"{n} ({sources[n]}{', following the run' if s.endswith('@latest') else ''})"
                              for n, s in specs.items())
            # One event loop for the driver's handles: in throughput-optimised mode their routers run on it,
            # and Serve's shutdown stops them there.
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="serve-handles", daemon=True).start()
            _warm(specs, cfg, loop)
            metrics = sorted(f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes()
                             if n.get("Alive") and n.get("MetricsExportPort"))
            if metrics:  # Ray Serve's Prometheus metrics (ray_serve_*), from each node's metrics agent
                say(f"Prometheus metrics at {metrics[0]}" + (f" and {len(metrics) - 1} more nodes" if len(metrics) > 1
                                                              else ""))
            how = _ingress_line(mode, why, proxy_port)
            say(f"serving {shown} at http://{host}:{port}/v1 on the {cfg.tier} tier ({how}); Ctrl-C stops")
            # Replica-seconds: each interval at the count of running replicas seen at its start, the last
            # (cut short by the stop) included.
            replica_s, polled, stop = 0.0, time.time(), _StopSignal(say)
            running = _replicas()
            while not stop.wait(1.0):
                now = time.time()
                replica_s += (now - polled) * running
                polled, running = now, _replicas()
            replica_s += (time.time() - polled) * running
            stopped_by = stop.name
            say(f"stopping ({stopped_by}): draining requests in flight")
            serve.delete(APP)  # each ingress replica drains, then leaves its ledger to the tally
            figures = _figures()
            try:
                asyncio.run_coroutine_threadsafe(serve.shutdown_async(), loop).result(timeout=SHUTDOWN_S)
            except TimeoutError:
                say(f"Ray Serve did not shut down in {SHUTDOWN_S} s: the record is written without waiting longer")
            loop.call_soon_threadsafe(loop.stop)
            seconds = time.time() - started
            tokens = figures.get("prompt_tokens", 0) + figures.get("completion_tokens", 0)
            figures.update({"models": len(specs), "seconds": round(seconds, 3), "stopped_by": stopped_by,
                            "replica_hours": round(replica_s / 3600, 6),
                            "requests_per_s": figures.get("requests", 0) / max(seconds, 1e-9)})
        nodes = [n["NodeID"] for n in tiers.nodes_of(cfg.tier, ray.nodes())]
        cost = job.finish(beside=join(out, "record.json"), work_nodes=nodes, figures=figures)
    per_million = cost["cost"] / tokens * 1e6 if tokens and cost["cost"] is not None else None
    return {"name": name, "models": sources, **figures, **cost, "dollars_per_million_tokens": per_million,
            "record": join(out, "record.json")}


INGRESS = ("direct", "proxy", "ha-proxy")


def ingress_mode(asked: str | None, specs: dict, cfg: ServeConfig, *, joined: bool, token: bool) -> tuple[str, str]:
    """How requests reach the ingress, and why: `direct` (the default where it can be) has the ingress replica
    itself listen on --port, one hop less than through Serve's proxy; `proxy` is Serve's HTTP proxy on --port;
    `ha-proxy` is Ray's HAProxy mode, which binds every interface, so only with a token."""
    if asked not in (None, *INGRESS):
        raise ValueError(f"--ingress must be one of {', '.join(INGRESS)}")
    joins = "a cluster this command joins runs Serve as it was started (RAY_ADDRESS or --address)"
    if asked == "ha-proxy":
        if joined:
            raise ValueError(f"--ingress ha-proxy cannot be used here: {joins}; start its Ray with "
                             "RAY_SERVE_ENABLE_HA_PROXY=1 instead")
        if not token:
            raise ValueError("--ingress ha-proxy listens on every interface: give --token-file FILE or --token-sha256 "
                             "HEX as well")
        if not shutil.which("haproxy"):
            raise ValueError("--ingress ha-proxy needs the haproxy program on PATH (Ray Serve runs it); install it, "
                             "or leave --ingress at its default")
        return "ha-proxy", "asked"
    one = len(specs) > cfg.models_per_replica or (not cfg.autoscaling() and cfg.replicas == 1)
    blocker = joins if joined else "several ingress replicas cannot share --port" if not one else None
    if asked == "direct" and blocker:
        raise ValueError(f"--ingress direct cannot be used here: {blocker}; use --ingress proxy")
    if asked == "proxy" or blocker:
        return "proxy", "asked" if asked == "proxy" else blocker
    if "ray.serve._private.constants" in sys.modules:  # read once per process, at import
        return "proxy", "Ray Serve was imported in this process before its mode could be set"
    return "direct", "asked" if asked else "default"


def _ingress_env(mode: str, host: str, port: int, token_sha256: str | None) -> int | None:
    """The environment Ray Serve reads at import (in this process, and in every process of the Ray this command
    starts) for `mode`; for `direct`, the port Serve's own proxy takes instead of --port (a free one on --host).
    Serve's own routes (/-/routes, /-/healthz) need the token too (infer.admission.system_routes)."""
    from infer.admission import TOKEN_ENV

    os.environ.update({"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "infer.admission.system_routes",
                       TOKEN_ENV: token_sha256 or ""})
    if mode == "ha-proxy":
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
        return None
    if mode != "direct":
        return None
    # Ray Serve's throughput-optimised mode, with its direct ingress pinned to --port (Serve's range [min, max)
    # holds that one port), and no wait for a load balancer to deregister the replica as it stops: none is in front.
    os.environ.update(RAY_SERVE_THROUGHPUT_OPTIMIZED="1", RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(port),
                      RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(port + 1),
                      RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="0")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ingress_line(mode: str, why: str, proxy_port: int | None) -> str:
    if mode == "direct":
        return f"direct ingress; Serve's proxy on port {proxy_port}"
    if mode == "ha-proxy":
        return "through Ray's HAProxy on every interface"
    return f"through Serve's proxy: {why}" if why != "asked" else "through Serve's proxy"


SHUTDOWN_S = 120  # the most a stop waits for Serve's own shutdown once the app is deleted


class _StopSignal:
    """SIGINT (Ctrl-C) and SIGTERM, from now on, set this instead of raising KeyboardInterrupt in whatever the
    main thread runs: the serving loop asks Ray Serve for its status every second, and an interrupt raised
    inside that call can leave the driver's Ray connection mid-call, so that the stop after it never ends.
    A second one, while the server drains (a terminal's group, a runtime that sends it again), is told to
    wait instead of cutting the drain and the record short."""

    def __init__(self, say):
        import signal

        self.event, self.name = threading.Event(), "SIGINT"

        def handler(signum, frame):
            if self.event.is_set():
                say(f"already stopping ({signal.Signals(signum).name}): the record is being written")
                return
            self.name = signal.Signals(signum).name
            self.event.set()

        if threading.current_thread() is threading.main_thread():  # only there can a handler be set
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, handler)

    def wait(self, seconds: float) -> bool:
        """Whether a stop signal came, waiting up to `seconds` for one."""
        return self.event.wait(seconds)


def _warm(specs: dict[str, str], cfg: ServeConfig, loop: asyncio.AbstractEventLoop) -> None:
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
    asyncio.run_coroutine_threadsafe(asyncio.wait_for(warm(), 600), loop).result()


def _replicas() -> int:
    from ray import serve

    try:
        app = serve.status().applications.get(APP)
        dep = (app.deployments.get("Models") or app.deployments.get("Api")) if app else None
        return sum(n for state, n in dep.replica_states.items() if str(state).endswith("RUNNING")) if dep else 0
    except Exception as e:  # noqa: BLE001 - a status that fails to read counts no replica for that second
        from strata.commands.shell import log

        log("serve").warning(f"Ray Serve's status did not read ({type(e).__name__}: {e}): no replica counted")
        return 0


def _forget_tally() -> None:
    """A tally an earlier server on this cluster left (one killed before its end) counts nothing of this one's."""
    import ray

    from infer.admission import TALLY

    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(TALLY, namespace="serve"))


def _figures() -> dict:
    """Every ingress replica's answers, from the tally their replicas left as they stopped; then the tally goes."""
    import ray

    from infer.admission import tally

    try:
        counter = tally()
        figures = ray.get(counter.read.remote(), timeout=30)
        ray.kill(counter)
        return figures
    except Exception as e:  # noqa: BLE001 - the record says it could not count
        return {"requests": None, "error": f"the ingress replicas' figures could not be read: {e}"}


def app(args: dict):
    """Ray Serve's application builder, for a Serve config (a RayService's serveConfigV2, `serve deploy`):
    `import_path: infer.serve:app` with args `models` ({name: spec}), `storage` (the root; default
    $STRATA_STORAGE), `config` (ServeConfig's fields), `name` (the serving's name: each ingress replica writes
    its record under servings/NAME/replicas/ as it stops; default `rayservice`) and `token_sha256`, the SHA-256
    of the bearer token clients send (`printf %s "$TOKEN" | sha256sum`): such a server listens beyond
    loopback, so it is required. A model a takedown tainted is refused by each replica as it loads it,
    unless config's `allow_tainted`.
    """
    import re

    from strata.data.storage import Storage, check_name

    unknown = set(args) - {"models", "storage", "config", "token_sha256", "name"}
    if unknown:
        raise ValueError(f"infer.serve:app: unknown args {sorted(unknown)} (models, storage, config, name, "
                         "token_sha256)")
    name = check_name(str(args.get("name", "rayservice")), "infer.serve:app's name")
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
    return build(specs, root, ServeConfig(**args.get("config", {})), digest,
                 record={"root": root, "name": name, "models": specs})
