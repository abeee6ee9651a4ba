"""Who gets in, and what was served: the ingress's bearer token, its bound on requests in flight, the
body's size and arrival time, and the ledger of every answer.

A request counts against the bound from the moment it is admitted, before its body is read: a client
that sends headers and never its body holds a slot only until `--body-timeout-s` (then 408), and once
the bound is reached every further request is answered 503 at once, whatever the others hold open.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections import Counter, deque

from infer.schemas import RequestError, ServeConfig

TOKEN_ENV = "STRATA_SERVE_TOKEN_SHA256"


def system_routes():
    """Ray Serve's HTTP callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names it): middleware around every
    HTTP server Serve starts, its proxy's and a direct ingress replica's, outside the routes Serve answers
    itself (`/-/routes`, `/-/healthz`), which otherwise answer anyone. With a token (STRATA_SERVE_TOKEN_SHA256)
    those need it too."""
    import os

    from starlette.middleware import Middleware

    return [Middleware(_Guard, token_sha256=os.environ.get(TOKEN_ENV) or None)]


class _Guard:
    def __init__(self, app, token_sha256: str | None):
        self.app, self.gate = app, Gate(token_sha256, 0, None)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path", "").startswith("/-/"):
            headers = dict(scope.get("headers") or [])
            try:
                self.gate.check_token(headers.get(b"authorization", b"").decode("latin-1"))
            except RequestError as e:
                body = json.dumps(e.body()).encode()
                await send({"type": "http.response.start", "status": e.status,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class Gate:
    """The bearer token (its SHA-256; None: none needed) and the bound on requests in flight."""

    def __init__(self, token_sha256: str | None, bound: int, limits: ServeConfig):
        self.token, self.bound, self.limits = token_sha256, bound, limits
        self.inflight = 0

    def check_token(self, authorization: str) -> None:
        if self.token is None:
            return
        scheme, _, value = authorization.partition(" ")
        digest = hashlib.sha256(value.strip().encode()).hexdigest() if scheme.lower() == "bearer" else ""
        if not hmac.compare_digest(digest, self.token):
            raise RequestError("a valid bearer token is required (Authorization: Bearer ...)", status=401,
                               kind="authentication_error", code="invalid_api_key")

    def admit(self) -> None:
        """Count a request in, or refuse it at once (503) when the bound is reached; `leave` counts it out."""
        if self.inflight >= self.bound:
            raise RequestError(f"overloaded: {self.inflight} requests in flight on this replica (--max-ongoing plus "
                               "--max-queued); retry", status=503, kind="overloaded")
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1

    async def body(self, request) -> object:
        """The request's JSON: 413 past --max-body-bytes, 408 when it does not arrive in --body-timeout-s,
        400 when it is not JSON (or nests deeper than the parser goes)."""
        limit = self.limits.max_body_bytes
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > limit:
            raise RequestError(f"the body is {int(size):,} bytes; the limit is {limit:,} (--max-body-bytes)",
                               status=413, code="limit")

        async def read() -> bytes:
            raw = bytearray()
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > limit:
                    raise RequestError(f"the body is over {limit:,} bytes (--max-body-bytes)", status=413, code="limit")
            return bytes(raw)

        try:
            raw = await asyncio.wait_for(read(), self.limits.body_timeout_s)
        except TimeoutError:
            raise RequestError(f"the body did not arrive within {self.limits.body_timeout_s:g} s (--body-timeout-s)",
                               status=408, code="timeout") from None
        try:
            return json.loads(raw)
        except RecursionError:
            raise RequestError("the body nests JSON too deeply") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the body is not JSON: {e}") from None


class Ledger:
    """What an ingress replica answered: every status (401s and 500s too), tokens, and latencies (the
    newest 100,000)."""

    KEEP = 100_000

    def __init__(self):
        self.latencies: deque[float] = deque(maxlen=self.KEEP)
        self.status: Counter = Counter()
        self.prompt_tokens = self.completion_tokens = 0

    def add(self, seconds: float, status: int, prompt: int = 0, completion: int = 0) -> None:
        self.latencies.append(seconds)
        self.status[status] += 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion

    def raw(self) -> dict:
        return {"latencies": list(self.latencies), "status": dict(self.status), "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens}

    @classmethod
    def merged(cls, raws: list[dict]) -> Ledger:
        """One ledger of several replicas' (`raw()`), every latency kept."""
        out = cls()
        out.latencies = deque(lat for r in raws for lat in r["latencies"])
        for r in raws:
            out.status.update({int(k): v for k, v in r["status"].items()})
            out.prompt_tokens += r["prompt_tokens"]
            out.completion_tokens += r["completion_tokens"]
        return out

    def figures(self) -> dict:
        lat = sorted(self.latencies)

        def q(p):
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 3) if lat else None

        return {"requests": sum(self.status.values()), "by_status": {str(k): v for k, v in self.status.items()},
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "p50_ms": q(0.5), "p99_ms": q(0.99)}


TALLY = "strata-serve-tally"


def tally():
    """The application's tally (created by the first that asks): each ingress replica leaves its ledger there
    as it stops, a replica that autoscaling removes too, so the record counts every replica's answers."""
    import ray

    @ray.remote(num_cpus=0)
    class Tally:
        def __init__(self):
            self.ledgers: dict[str, dict] = {}

        def add(self, replica: str, raw: dict) -> None:
            self.ledgers[replica] = raw

        def read(self) -> dict:
            return {"replicas": len(self.ledgers), **Ledger.merged(list(self.ledgers.values())).figures()}

    return Tally.options(name=TALLY, namespace="serve", get_if_exists=True, lifetime="detached").remote()
