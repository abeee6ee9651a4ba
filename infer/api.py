"""The HTTP API of `python -m infer serve`: OpenAI's routes (and vLLM's /tokenize, /detokenize, /health)
on a FastAPI app, the ingress of the Serve application.

Every request goes the same way (`Api._call`): the token, admission (infer/admission.py), the body,
its check (infer/schemas.py), then the answerer picked once at start: `Local` when the ingress holds
every model itself (one hop from the proxy), `Remote` when the Models deployment does. Every answer,
errors included, is counted in the ledger that /v1/stats and the run's record read.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) as objects.
import asyncio
import json
import time

from infer import schemas
from infer.admission import Gate, Ledger
from infer.schemas import RequestError, ServeConfig

CLIENT_GONE = 499  # a request whose client disconnected before its answer (nginx's "client closed request")
OPEN = frozenset({"/health", "/healthz"})  # what answers without the token
ROUTES = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/embeddings": "POST", "/v1/score": "POST",
          "/tokenize": "POST", "/detokenize": "POST", "/v1/models": "GET", "/v1/stats": "GET", "/metrics": "GET",
          "/health": "GET", "/healthz": "GET"}


class Remote:
    """The answerer when the Models deployment holds the models: each request to the replicas Serve picks
    for its model."""

    def __init__(self, models, names: list[str]):
        self.models = models
        self.handles = {n: models.options(multiplexed_model_id=n) for n in names}

    async def answer(self, what: str, req: dict) -> dict:
        return await self.handles[req["model"]].answer.remote(what, req)

    def stream(self, req: dict):
        return self.handles[req["model"]].options(stream=True).stream.remote(req)

    async def model_stats(self) -> dict:
        return await self.models.model_stats.remote()


def error(e: RequestError, retry_after: int | None = None):
    from fastapi.responses import JSONResponse

    if retry_after is None and e.status == 503:
        retry_after = 1
    return JSONResponse(e.body(), status_code=e.status, headers={"Retry-After": str(retry_after)} if retry_after
                        else None)


def api_deployment():
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from ray import serve
    from ray.serve.exceptions import BackPressureError, RequestCancelledError
    from starlette.requests import ClientDisconnect

    app = FastAPI(title="strata", docs_url=None, redoc_url=None, openapi_url=None)

    @serve.ingress(app)
    class Api:
        """The ingress. With `models` None it holds every model itself (`specs`, under `root`)."""

        def __init__(self, models, names: list[str], limits: dict, token_sha256: str | None,
                     specs: dict[str, str] | None = None, root: str = "", record: dict | None = None):
            from infer.replicas import Local

            self.names, self.record, self.started = list(names), record, time.time()
            self.limits = ServeConfig(**limits)
            self.ledger = Ledger()
            if models is None:
                self.answerer, bound = Local(specs, root, self.limits), self.limits.max_ongoing + self.limits.max_queued
            else:  # Serve bounds each model replica; this replica bounds what all of them may hold, and the queue
                most = self.limits.max_replicas or self.limits.replicas
                self.answerer, bound = Remote(models, self.names), most * self.limits.max_ongoing + self.limits.max_queued
            self.gate = Gate(token_sha256, bound, self.limits)

        async def _call(self, request: Request, check, what: str):
            started = time.perf_counter()
            admitted = streaming = False
            try:
                self.gate.check_token(request.headers.get("authorization", ""))
                self.gate.admit()
                admitted = True
                req = check(await self.gate.body(request), self.names, self.limits)
                if req.get("stream"):
                    streaming = True
                    return self._streamed(req, started)
                out = await self.answerer.answer(what, req)
            except RequestError as e:
                self.ledger.add(time.perf_counter() - started, e.status)
                return error(e)
            except BackPressureError as e:
                self.ledger.add(time.perf_counter() - started, 503)
                return error(RequestError(f"overloaded: {e.message}; retry", status=503, kind="overloaded"))
            except (asyncio.CancelledError, ClientDisconnect, RequestCancelledError):
                # The client went away (a load tester's window closed, a timeout): counted as nginx counts it.
                self.ledger.add(time.perf_counter() - started, CLIENT_GONE)
                raise
            except Exception as e:  # noqa: BLE001 - a bug or a failed replica: still OpenAI's shape, and counted
                self.ledger.add(time.perf_counter() - started, 500)
                return error(RequestError(f"internal error: {type(e).__name__}: {e}", status=500, kind="server_error"))
            finally:
                if admitted and not streaming:
                    self.gate.leave()
            status = out.pop("status", 200) if "error" in out else 200
            usage = out.get("usage", {})
            self.ledger.add(time.perf_counter() - started, status, usage.get("prompt_tokens", 0),
                            usage.get("completion_tokens", 0))
            if status != 200:
                return JSONResponse(out, status_code=status, headers={"Retry-After": "1"} if status == 503 else None)
            return out

        def _streamed(self, req: dict, started: float):
            """A server-sent event stream; the request leaves the gate when the stream ends."""
            gen = self.answerer.stream(req)
            forward_usage = req["stream_options"]["include_usage"]

            async def events():
                status, usage = 200, {}
                try:
                    async for chunk in gen:
                        if "error" in chunk:
                            status = chunk.pop("status", 500)
                            yield f"data: {json.dumps(chunk)}\n\n"
                            return
                        if not chunk["choices"]:  # the last: usage only
                            usage = chunk["usage"]
                            if not forward_usage:
                                continue
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                except BackPressureError as e:
                    status = 503
                    yield f"data: {json.dumps(RequestError(f'overloaded: {e.message}', status=503).body())}\n\n"
                except (asyncio.CancelledError, GeneratorExit, RequestCancelledError):
                    status = CLIENT_GONE  # the client went away mid-stream
                    raise
                except Exception as e:  # noqa: BLE001 - the stream ends with the error, counted
                    status = 500
                    body = RequestError(f"internal error: {type(e).__name__}: {e}", status=500, kind="server_error")
                    yield f"data: {json.dumps(body.body())}\n\n"
                finally:
                    self.gate.leave()
                    self.ledger.add(time.perf_counter() - started, status, usage.get("prompt_tokens", 0),
                                    usage.get("completion_tokens", 0))

            return StreamingResponse(events(), media_type="text/event-stream")

        def _open(self, request: Request):
            """Routes without a body (models, stats, metrics): the token checked and the answer counted."""
            try:
                self.gate.check_token(request.headers.get("authorization", ""))
            except RequestError as e:
                self.ledger.add(0.0, e.status)
                return error(e)
            return None

        @app.post("/v1/completions")
        async def completions(self, request: Request):
            return await self._call(request, schemas.completion_request, "complete")

        @app.post("/v1/chat/completions")
        async def chat_completions(self, request: Request):
            return await self._call(request, schemas.chat_request, "complete")

        @app.post("/v1/embeddings")
        async def embeddings(self, request: Request):
            return await self._call(request, schemas.embedding_request, "embed")

        @app.post("/v1/score")
        async def score(self, request: Request):
            return await self._call(request, schemas.score_request, "score")

        @app.post("/tokenize")
        async def tokenize(self, request: Request):
            return await self._call(request, schemas.tokenize_request, "tokenize")

        @app.post("/detokenize")
        async def detokenize(self, request: Request):
            return await self._call(request, schemas.detokenize_request, "detokenize")

        @app.get("/v1/models")
        async def list_models(self, request: Request):
            return self._open(request) or {
                "object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "strata"}
                                           for n in self.names]}

        @app.get("/v1/stats")
        async def stats(self, request: Request):
            """What this ingress served, and one model replica's decode batches (strata's own)."""
            return self._open(request) or {"served": self.ledger.figures(),
                                           "replica": await _maybe(self.answerer.model_stats())}

        @app.get("/metrics")
        async def metrics(self, request: Request):
            """This ingress's ledger in Prometheus' text format."""
            return self._open(request) or PlainTextResponse(_prometheus(self.ledger.figures(), self.gate.inflight),
                                                            media_type="text/plain; version=0.0.4")

        @app.get("/health")
        async def health(self):
            return {"status": "ok", "models": len(self.names)}

        @app.get("/healthz")
        async def healthz(self):
            return {"status": "ok", "models": len(self.names)}

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
        async def other(self, request: Request, path: str):
            """Every other route, and a known route's wrong method: OpenAI's error shape."""
            denied = self._open(request)
            if denied:
                return denied
            route = "/" + path
            if route in ROUTES:
                e = RequestError(f"{request.method} is not allowed on {route}; use {ROUTES[route]}", status=405,
                                 code="method_not_allowed")
                self.ledger.add(0.0, 405)
                return error(e)
            self.ledger.add(0.0, 404)
            return error(RequestError(f"no route {route}: this server answers " + ", ".join(sorted(ROUTES)),
                                      status=404, code="not_found"))

        async def warm(self, name: str) -> str:
            return await self.answerer.warm(name)

        async def __del__(self):
            """As Serve stops this replica (the application's end, or autoscaling's): its ledger to the tally
            the command reads, or (a Serve config's application, which no command waits on) its own record."""
            from ray import serve

            from infer.admission import tally

            replica = serve.get_replica_context().replica_id.unique_id
            if self.record is None:
                await tally().add.remote(replica, self.ledger.raw())
                return
            import asyncio

            from infer.records import write_replica_record

            await asyncio.to_thread(write_replica_record, self.record, replica, self.started, self.ledger,
                                    self.limits)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc):  # a bug outside a route's own handling: still OpenAI's shape
        return error(RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error"))

    return Api


async def _maybe(value):
    import inspect

    return await value if inspect.isawaitable(value) else value


def _prometheus(figures: dict, inflight: int) -> str:
    lines = ["# HELP strata_requests_total Requests this ingress answered, by HTTP status.",
             "# TYPE strata_requests_total counter"]
    lines += [f'strata_requests_total{{status="{k}"}} {v}' for k, v in sorted(figures["by_status"].items())]
    lines += ["# HELP strata_tokens_total Tokens in prompts and completions served.", "# TYPE strata_tokens_total counter",
              f'strata_tokens_total{{kind="prompt"}} {figures["prompt_tokens"]}',
              f'strata_tokens_total{{kind="completion"}} {figures["completion_tokens"]}',
              "# HELP strata_requests_in_flight Requests admitted and not yet answered.",
              "# TYPE strata_requests_in_flight gauge", f"strata_requests_in_flight {inflight}"]
    lines += ["# HELP strata_latency_ms Latency of the newest 100,000 answers, by quantile.",
              "# TYPE strata_latency_ms gauge"]
    for q, key in (("0.5", "p50_ms"), ("0.99", "p99_ms")):
        if figures.get(key) is not None:
            lines.append(f'strata_latency_ms{{quantile="{q}"}} {figures[key]}')
    return "\n".join(lines) + "\n"
