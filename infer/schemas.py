"""What `python -m infer serve` takes: its configuration, and each request checked on the ingress into the
fields the model replicas take, or refused with OpenAI's error shape (`RequestError`).

Every field a request may carry is known here. A field the server does not implement is accepted only
with the value that changes nothing (`n: 1`, `presence_penalty: 0`, `tools: []`...); any other value, and
any field not known, is a 400 that names it: a client never gets a silent default in its place.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass

from strata.cluster import tiers


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
    max_input_tokens: int = 32768
    """Tokens the inputs of one /v1/embeddings or /v1/score request may hold together."""
    max_body_bytes: int = 1 << 20
    """The largest request body (64 prompts of a 1,024-token context fit in well under 1 MB of JSON)."""
    body_timeout_s: float = 30.0
    """How long a request's body may take to arrive once its headers have; past it the answer is 408."""
    follow_s: float = 10.0
    """How often a RUN@latest model looks for a newer checkpoint."""
    allow_tainted: bool = False
    """Serve a model a takedown tainted (train/taint.py) anyway; each replica that loads it records the use.
    Otherwise a replica refuses to load it (and `infer serve` refuses before it starts)."""

    def __post_init__(self):
        if self.tier not in (tiers.Tier.CPU, tiers.Tier.GPU):
            raise ValueError("--tier must be cpu or gpu")
        ints = {"--replicas": self.replicas, "--models-per-replica": self.models_per_replica,
                "--max-batch-tokens": self.max_batch_tokens, "--max-ongoing": self.max_ongoing,
                "--max-queued": self.max_queued, "--max-prompts": self.max_prompts,
                "--max-new-tokens": self.max_new_tokens, "--max-input-tokens": self.max_input_tokens,
                "--max-body-bytes": self.max_body_bytes}
        for flag, value in ints.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1")
        if self.min_replicas < 0 or self.max_replicas < 0:
            raise ValueError("--min-replicas and --max-replicas must be >= 0")
        if self.max_replicas and self.max_replicas < max(self.min_replicas, 1):
            raise ValueError("--max-replicas must be at least --min-replicas (and 1)")
        if self.batch_wait_ms < 0 or min(self.target_ongoing, self.cpus_per_replica, self.follow_s,
                                         self.body_timeout_s) <= 0:
            raise ValueError("--batch-wait-ms must be >= 0; --target-ongoing, --cpus-per-replica, --follow-s and "
                             "--body-timeout-s > 0")

    def autoscaling(self) -> dict | None:
        if not self.max_replicas:
            return None
        low = self.min_replicas or 1
        return {"min_replicas": low, "max_replicas": self.max_replicas,
                "initial_replicas": min(max(self.replicas, low), self.max_replicas),
                "target_ongoing_requests": self.target_ongoing,
                "upscale_delay_s": 2.0, "downscale_delay_s": 10.0, "metrics_interval_s": 1.0,
                "look_back_period_s": 4.0}


class RequestError(Exception):
    """A request the server refuses: `status` and OpenAI's error body."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


SEED_BOUND = 1 << 63  # seeds in [-2^63, 2^63): what a JSON client's 64-bit integer holds

# Fields the server takes only with the value that changes nothing: (test, what it must be).
_NEUTRAL = {
    "n": (lambda v: v == 1, "1 (send the request again for more choices)"),
    "best_of": (lambda v: v == 1, "1"),
    "presence_penalty": (lambda v: v == 0, "0"),
    "frequency_penalty": (lambda v: v == 0, "0"),
    "repetition_penalty": (lambda v: v == 1, "1"),
    "logit_bias": (lambda v: v == {}, "empty"),
    "suffix": (lambda v: v == "", "empty"),
    "tools": (lambda v: v == [], "empty: this server calls no tools"),
    "tool_choice": (lambda v: v == "none", "none: this server calls no tools"),
    "parallel_tool_calls": (lambda v: v is False, "false"),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}'),
    "top_logprobs": (lambda v: v == 0, "0 (log-probabilities are served on /v1/completions)"),
    "logprobs": (lambda v: v is False, "false (log-probabilities are served on /v1/completions)"),
}
_IGNORED = {"user", "metadata", "store", "service_tier"}  # a client's own bookkeeping: changes no answer
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
             "ignore_eos", "min_tokens"}
COMPLETION_FIELDS = _SAMPLING | {"prompt", "echo", "logprobs", "n", "best_of", "presence_penalty",
                                 "frequency_penalty", "repetition_penalty", "logit_bias", "suffix"} | _IGNORED
CHAT_FIELDS = _SAMPLING | {"messages", "max_completion_tokens", "n", "presence_penalty", "frequency_penalty",
                           "repetition_penalty", "logit_bias", "tools", "tool_choice", "parallel_tool_calls",
                           "response_format", "logprobs", "top_logprobs", "add_generation_prompt"} | _IGNORED


def _known(body: dict, fields: set[str], *, taken: frozenset = frozenset()) -> None:
    """A 400 for a field not in `fields`, or one of _NEUTRAL's (not in `taken`) with a value that would change
    the answer."""
    for key, value in body.items():
        if key not in fields:
            raise RequestError(f"{key} is not supported by this server", param=key, code="unsupported")
        if key in _NEUTRAL and key not in taken and value is not None and not _NEUTRAL[key][0](value):
            raise RequestError(f"{key} must be {_NEUTRAL[key][1]} on this server, not {reprlib.repr(value)}", param=key,
                               code="unsupported")


def _number(body: dict, key: str, default, low: float, high: float, kind=float):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not float(value).is_integer()):
        raise RequestError(f"{key} must be {'an integer' if kind is int else 'a number'}", param=key)
    if not low <= value <= high:
        raise RequestError(f"{key} must be between {low} and {high}, not {value}", param=key,
                           code="limit" if key in ("max_tokens", "max_completion_tokens") else None)
    return kind(value)


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false", param=key)
    return value


def is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _inputs(body: dict, key: str, limits: ServeConfig) -> list:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids: a list of
    items, each a string or a list of ints."""
    value = body.get(key)
    if value is None:
        raise RequestError(f"{key} is required", param=key)
    if isinstance(value, str) or (isinstance(value, list) and value and all(is_id(x) for x in value)):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise RequestError(f"{key} must be a non-empty string or list: strings, token ids, or lists of token ids",
                           param=key)
    if len(items) > limits.max_prompts:
        raise RequestError(f"{key} holds {len(items)} items; the limit is {limits.max_prompts} (--max-prompts)",
                           param=key, code="limit")
    for item in items:
        if not (isinstance(item, str) or (isinstance(item, list) and all(is_id(x) for x in item))):
            raise RequestError(f"each item of {key} must be a string or a list of token ids", param=key)
    return items


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of up to 4 strings", param="stop")
    return [s for s in stop if s]  # an empty stop string would end every completion before it began


def _stream_options(body: dict, stream: bool) -> dict:
    options = body.get("stream_options")
    if options is None:
        return {"include_usage": False, "continuous_usage_stats": False}
    if not stream:
        raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    unknown = set(options) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise RequestError(f"stream_options.{sorted(unknown)[0]} is not supported by this server",
                           param="stream_options", code="unsupported")
    return {k: _flag(options, k) for k in ("include_usage", "continuous_usage_stats")}


def _sampling(body: dict, limits: ServeConfig, max_tokens: int | None, low: int) -> dict:
    stream = _flag(body, "stream")
    out = {"model": body["model"], "stream": stream, "stream_options": _stream_options(body, stream),
           "max_tokens": _number({"max_tokens": max_tokens}, "max_tokens", 16, low, limits.max_new_tokens, int),
           "temperature": _number(body, "temperature", 1.0, 0, 2),
           "top_p": _number(body, "top_p", 1.0, 0, 1), "top_k": _number(body, "top_k", 0, 0, 1 << 20, int),
           "seed": _number(body, "seed", None, -SEED_BOUND, SEED_BOUND - 1, int), "stop": _stop(body),
           "ignore_eos": _flag(body, "ignore_eos"), "min_tokens": _number(body, "min_tokens", 0, 0, 1 << 20, int)}
    if out["top_p"] == 0:
        out["temperature"] = 0.0
    if out["min_tokens"] > out["max_tokens"]:
        raise RequestError(f"min_tokens ({out['min_tokens']}) must not exceed max_tokens ({out['max_tokens']})",
                           param="min_tokens")
    return out


def completion_request(body, models: list[str], limits: ServeConfig) -> dict:
    """A completion request checked: its fields as the model replicas take them."""
    body = _object(body, models)
    _known(body, COMPLETION_FIELDS, taken=frozenset({"logprobs"}))
    echo = _flag(body, "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _number(body, "logprobs", None, 0, 20, int)
    return {**_sampling(body, limits, body.get("max_tokens"), 0 if echo else 1), "prompts": _inputs(body, "prompt", limits),
            "echo": echo, "logprobs": logprobs}


def chat_request(body, models: list[str], limits: ServeConfig) -> dict:
    """A chat completion request checked: `messages` as {"role", "content"} with string contents (text
    parts joined), rendered into a prompt on the replica by the model's chat template."""
    body = _object(body, models)
    _known(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    if len(messages) > 4 * limits.max_prompts:
        raise RequestError(f"messages holds {len(messages)} items; the limit is {4 * limits.max_prompts} "
                           "(4 x --max-prompts)", param="messages", code="limit")
    clean = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise RequestError(f"messages[{k}] must be an object whose role is system, developer, user or assistant",
                               param="messages")
        clean.append({"role": m["role"], "content": _content(m.get("content"), k)})
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None:
            _number(body, key, 16, 1, limits.max_new_tokens, int)  # its own error, under its own name
    wanted = body.get("max_completion_tokens", body.get("max_tokens"))
    return {**_sampling(body, limits, wanted, 1), "messages": clean, "echo": False, "logprobs": None,
            "add_generation_prompt": _flag({"a": body.get("add_generation_prompt", True)}, "a")}


def _content(content, k: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{k}].content must be a string or a list of text parts (this server reads text "
                       "only)", param="messages")


def embedding_request(body, models: list[str], limits: ServeConfig) -> dict:
    body = _object(body, models)
    _known(body, {"model", "input", "encoding_format", "dimensions"} | _IGNORED)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise RequestError("encoding_format must be float or base64", param="encoding_format")
    if body.get("dimensions") is not None:
        raise RequestError("dimensions is not supported: embeddings have the model's width", param="dimensions",
                           code="unsupported")
    return {"model": body["model"], "inputs": _inputs(body, "input", limits), "encoding_format": fmt}


def score_request(body, models: list[str], limits: ServeConfig) -> dict:
    body = _object(body, models)
    _known(body, {"model", "input"} | _IGNORED)
    return {"model": body["model"], "inputs": _inputs(body, "input", limits)}


def tokenize_request(body, models: list[str], limits: ServeConfig) -> dict:
    """vLLM's /tokenize: `prompt` (a string), or chat `messages` rendered by the model's template."""
    body = _object(body, models)
    _known(body, {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens"})
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("give prompt (a string) or messages, one of them", param="prompt")
    if "messages" in body:
        req = chat_request({"model": body["model"], "messages": body["messages"],
                            "add_generation_prompt": body.get("add_generation_prompt", True)}, models, limits)
        return {"model": body["model"], "messages": req["messages"], "add_generation_prompt": req["add_generation_prompt"]}
    if not isinstance(body["prompt"], str):
        raise RequestError("prompt must be a string", param="prompt")
    return {"model": body["model"], "prompt": body["prompt"]}


def detokenize_request(body, models: list[str], limits: ServeConfig) -> dict:
    body = _object(body, models)
    _known(body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_id(t) for t in tokens):
        raise RequestError("tokens must be a list of token ids", param="tokens")
    return {"model": body["model"], "tokens": tokens}


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
