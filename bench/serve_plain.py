"""The baseline bench.serve measures `python -m infer serve` against: the same models behind a plain FastAPI
app under uvicorn, one process, one request per forward (a request's prompt decodes alone, with the same
key/value-cached decoding and packed layers; requests take turns on the model).

    python -m bench.serve_plain --model NAME=DIR [--model ...] --port PORT [--threads N]
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) as objects.
import argparse
import asyncio


def app(models: dict):
    from fastapi import FastAPI, Request, Response

    from infer.generate import decode

    api = FastAPI()  # what guidellm's OpenAI backend needs: /health, /v1/completions, /v1/embeddings
    turn = asyncio.Lock()  # one forward at a time: no batching across requests

    def complete(net, tok, prompt: list[int], max_tokens: int, ignore_eos: bool) -> list[int]:
        return decode(net, [prompt], max_tokens=max_tokens, temperature=0,
                      eot_id=-1 if ignore_eos else tok.eot_id, vocab_limit=tok.vocab_size)[0]

    def embed(net, tok, text: str) -> list[float]:
        import torch

        from infer.generate import _step

        with torch.inference_mode():
            h = _step(net, torch.tensor([tok.encode(text).tolist()]), 0, [None] * len(net.blocks), out="hidden")[0]
            v = h.float().mean(0)
            return (v / v.norm()).tolist()

    @api.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        net, tok = models[body["model"]]
        async with turn:
            if await request.is_disconnected():  # the client gave up while it waited: no work for no one
                return Response(status_code=499)
            prompt = tok.encode(body["prompt"]).tolist()
            ids = await asyncio.to_thread(complete, net, tok, prompt, int(body.get("max_tokens") or 16),
                                          bool(body.get("ignore_eos")))
        return {"choices": [{"index": 0, "text": tok.decode([i for i in ids if i != tok.eot_id]),
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids)}}

    @api.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await request.json()
        net, tok = models[body["model"]]
        async with turn:
            if await request.is_disconnected():
                return Response(status_code=499)
            vector = await asyncio.to_thread(embed, net, tok, body["input"])
        return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": vector}],
                "usage": {"prompt_tokens": len(tok.encode(body["input"])), "total_tokens": len(tok.encode(body["input"]))}}

    @api.get("/health")
    async def health():  # what load testers ask first
        return {}

    return api


def main() -> None:
    import torch
    import uvicorn

    from infer.model import resolve
    from strata.data.storage import Storage

    parser = argparse.ArgumentParser(prog="python -m bench.serve_plain", description=__doc__)
    parser.add_argument("--model", action="append", required=True, help="NAME=DIR (an exported model)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {}
    for item in args.model:
        name, _, path = item.partition("=")
        models[name] = resolve(path, Storage("/nonexistent")).build()
    uvicorn.run(app(models), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
