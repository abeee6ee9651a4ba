"""A loaded model's answers, in OpenAI's shapes: completions and chat completions (whole or streamed),
embeddings, scores, and vLLM's tokenize and detokenize. Each runs on the replica that holds the model,
on its event loop; the model's engine batches the work of every request.

A stream's chunks carry `usage` as the client asked (`stream_options`): in every chunk
(`continuous_usage_stats`), and in a last chunk with empty `choices`. That last chunk always comes from
here, so the ingress counts the tokens; it passes it on only when the client asked (`include_usage`).
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
import uuid
from dataclasses import dataclass


@dataclass
class Held:
    """A model on a replica: its engine, swapped in place when a newer checkpoint arrives."""

    name: str
    source: str
    engine: object
    tok: object
    template: object  # its chat template, compiled (strata.data.chat)


def ids_of(tok, item) -> list[int]:
    return tok.encode(item).tolist() if isinstance(item, str) else list(item)


def _sampling(req: dict):
    from infer.engine import Sampling

    return Sampling(max_tokens=req["max_tokens"], temperature=req["temperature"], top_p=req["top_p"],
                    top_k=req["top_k"], seed=req["seed"], logprobs=req["logprobs"], echo=req["echo"],
                    ignore_eos=req["ignore_eos"], min_tokens=req["min_tokens"])


def chat_prompt(held: Held, req: dict) -> str:
    from strata.data.chat import render

    return render(held.template, req["messages"], add_generation_prompt=req["add_generation_prompt"])


class _Choice:
    """One prompt's completion as it is drawn: the text so far, cut at a stop string."""

    def __init__(self, held: Held, prompt_ids: list[int], prompt_text: str | None, req: dict, index: int):
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
        text = self.tok.decode([i for i in self.seq.out if i != eot])
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


def _choices(held: Held, req: dict) -> list[_Choice]:
    prompts = [chat_prompt(held, req)] if "messages" in req else req["prompts"]
    out = []
    try:
        for k, item in enumerate(prompts):
            out.append(_Choice(held, ids_of(held.tok, item), item if isinstance(item, str) else None, req, k))
    except BaseException:
        for c in out:
            c.cancel()
        raise
    return out


def _usage(choices: list[_Choice]) -> dict:
    prompt = sum(c.usage()[0] for c in choices)
    made = sum(c.usage()[1] for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}


async def complete(held: Held, req: dict) -> dict:
    choices = _choices(held, req)
    try:
        async def drain(c):
            while await c.next_text() is not None:
                pass
        await asyncio.gather(*[drain(c) for c in choices])
    finally:
        for c in choices:
            c.cancel()
    head = {"created": int(time.time()), "model": req["model"], "system_fingerprint": held.source}
    if "messages" in req:
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", **head,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "logprobs": None, "finish_reason": c.finish} for c in choices],
                "usage": _usage(choices)}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", **head,
            "choices": [{"index": c.index, "text": (c.prompt_text if req["echo"] else "") + c.text,
                         "logprobs": c.logprobs(), "finish_reason": c.finish} for c in choices],
            "usage": _usage(choices)}


async def stream(held: Held, req: dict):
    """The chunks of a streamed completion (chat's when `req` has messages), then the usage chunk."""
    chat = "messages" in req
    choices = _choices(held, req)
    queue: asyncio.Queue = asyncio.Queue()
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": req["model"], "system_fingerprint": held.source}
    every = req["stream_options"]["continuous_usage_stats"]

    def chunk(parts: list[dict]) -> dict:
        return {**head, "choices": parts, **({"usage": _usage(choices)} if every else {})}

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
        if chat:
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for c in choices])
        while left:
            c, piece, finish = await queue.get()
            if piece is None:
                left -= 1
                continue
            if isinstance(piece, Exception):
                raise piece
            if chat:
                delta = {"content": piece} if piece else {}
                yield chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}])
            else:
                yield chunk([{"index": c.index, "text": piece, "logprobs": None, "finish_reason": finish}])
        yield {**head, "choices": [], "usage": _usage(choices)}
    finally:
        for c in choices:
            c.cancel()
        for t in tasks:
            t.cancel()


async def passes(held: Held, kind: str, req: dict, max_tokens: int) -> dict:
    """Embeddings (`kind` embed) or scores (score) of a request's inputs, `max_tokens` of them together at most."""
    engine, tok = held.engine, held.tok
    ids = [ids_of(tok, x) for x in req["inputs"]]
    tokens = sum(len(i) for i in ids)
    if tokens > max_tokens:
        raise ValueError(f"the inputs hold {tokens:,} tokens; the limit is {max_tokens:,} (--max-input-tokens)")
    if kind == "embed" and any(not i for i in ids):
        raise ValueError("an input is empty: an embedding needs at least one token")
    for i in ids:
        engine.check_ids(i)
    got = await asyncio.gather(*[engine.run_pass(kind, i) for i in ids])
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    if kind == "embed":
        data = [{"object": "embedding", "index": k, "embedding": _encoded(v, req["encoding_format"])}
                for k, v in enumerate(got)]
        return {"object": "list", "model": req["model"], "data": data, "usage": usage}
    per_token = tok.token_bytes()
    data = []
    for k, (i, (n, nll)) in enumerate(zip(ids, got, strict=True)):
        size = int(per_token[i].sum()) if len(i) else 0
        data.append({"index": k, "tokens": n, "loss": nll / n if n else None,
                     "bpb": nll / math.log(2) / max(1, size) if n else None, "bytes": size})
    return {"object": "list", "model": req["model"], "data": data, "usage": usage}


def tokenize(held: Held, req: dict) -> dict:
    text = chat_prompt(held, req) if "messages" in req else req["prompt"]
    ids = ids_of(held.tok, text)
    return {"count": len(ids), "max_model_len": held.engine.context, "tokens": ids}


def detokenize(held: Held, req: dict) -> dict:
    held.engine.check_ids(req["tokens"])
    return {"prompt": held.tok.decode(req["tokens"])}


def _encoded(vector: list[float], fmt: str):
    if fmt == "float":
        return vector
    import numpy as np

    return base64.b64encode(np.asarray(vector, np.float32).tobytes()).decode()
