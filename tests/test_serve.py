"""Online serving (`python -m infer serve`): the batching engine against `infer generate`'s decoding, and a
live server against clients strata did not write (OpenAI's Python client, lm-evaluation-harness,
transformers' forward on the exported weights)."""

import asyncio
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from serving import Server, exported

from infer.engine import Busy, Engine, Sampling
from infer.generate import decode
from infer.model import resolve
from strata.data.storage import Storage

TOKEN = "s3cret-token-for-the-tests"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-models")
    return {"m1": exported(root / "m1", seed=1), "m2": exported(root / "m2", seed=2), "m3": exported(root / "m3", seed=3),
            "big": exported(root / "big", seed=4, n_layer=8, n_embd=512, n_head=8)}  # 25M parameters: slow to load


@pytest.fixture(scope="module")
def built(models):
    return resolve(models["m1"], Storage("/nonexistent")).build()


# ---- the engine, without Ray ------------------------------------------------------------------------------

def _run_engine(net, tok, jobs, **engine_kwargs):
    """Each job (prompt ids, Sampling, index, delay s) submitted after its delay; the tokens of each, and
    the engine."""
    async def main():
        engine = Engine(net, tok, pool=ThreadPoolExecutor(1), **engine_kwargs)

        async def one(prompt, sampling, index, delay):
            await asyncio.sleep(delay)
            seq = engine.submit(prompt, sampling, index)
            while (await seq.events.get())[0] != "done":
                pass
            return seq.out

        return await asyncio.gather(*[one(*j) for j in jobs]), engine

    return asyncio.run(main())


def test_continuous_batching_gives_the_tokens_decoding_alone_gives(built):
    net, tok = built
    prompts = [tok.encode(t).tolist() for t in ("hello world", "the cat", "a", "hello there friends", "xy")]
    greedy = decode(net, prompts, max_tokens=20, temperature=0, eot_id=tok.eot_id, vocab_limit=tok.vocab_size)
    drawn = decode(net, prompts, max_tokens=20, temperature=0.9, top_k=40, seed=7, eot_id=tok.eot_id,
                   vocab_limit=tok.vocab_size)
    # Arrivals staggered by a few ms: later prompts join the decode loop while earlier ones run.
    got, engine = _run_engine(net, tok, [(p, Sampling(max_tokens=20, temperature=0), i, 0.004 * i)
                                         for i, p in enumerate(prompts)])
    assert got == greedy
    steps_alone = sum(len(g) - 1 for g in greedy)  # one token comes from each prompt's own first pass
    assert engine.steps < steps_alone and engine.rows == steps_alone  # steps were shared
    got, _ = _run_engine(net, tok, [(p, Sampling(max_tokens=20, temperature=0.9, top_k=40, seed=7), i,
                                     0.003 * (len(prompts) - i)) for i, p in enumerate(prompts)])
    assert got == drawn  # the same seed and index: the same text, whatever shared the steps
    assert engine.cache is None  # idle: the cache is freed


def test_a_full_engine_refuses_at_once_and_a_too_long_prompt_names_the_limit(built):
    net, tok = built

    async def main():
        engine = Engine(net, tok, pool=ThreadPoolExecutor(1), max_waiting=2, max_batch_tokens=64)
        with pytest.raises(ValueError, match="exceed the model's context of 64"):
            engine.submit(list(range(60)), Sampling(max_tokens=10))
        seqs = [engine.submit([1, 2, 3], Sampling(max_tokens=50, temperature=0)) for _ in range(2)]
        with pytest.raises(Busy):
            for _ in range(3):
                engine.submit([1, 2, 3], Sampling(max_tokens=50))
        for s in seqs:
            s.cancelled = True
        while engine.task and not engine.task.done():
            await asyncio.sleep(0.01)
        return seqs

    seqs = asyncio.run(main())
    assert all(s.finish in ("cancelled", "length") for s in seqs)


def test_top_p_keeps_the_smallest_head_of_the_distribution(built):
    net, tok = built
    p = tok.encode("hello").tolist()
    tiny, _ = _run_engine(net, tok, [(p, Sampling(max_tokens=8, temperature=1.0, top_p=1e-6, seed=s), 0, 0)
                                     for s in range(3)])
    greedy = decode(net, [p], max_tokens=8, temperature=0, eot_id=tok.eot_id, vocab_limit=tok.vocab_size)[0]
    assert all(t == greedy for t in tiny)  # only the most likely token is left to draw


def test_ignore_eos_and_min_tokens_keep_end_of_text_from_being_drawn(built):
    net, tok = built
    prompt = tok.encode("the quick brown fox").tolist()
    (first,), _ = _run_engine(net, tok, [(prompt, Sampling(max_tokens=1, temperature=0), 0, 0)])

    class EndsThere:
        """The same tokenizer, with the greedy first token as its end-of-text: plain decoding stops at once."""

        eot_id = first[0]

        def __getattr__(self, name):
            return getattr(tok, name)

    ends = EndsThere()
    (plain, ignored, at_least, huge_seed), _ = _run_engine(net, ends, [
        (prompt, Sampling(max_tokens=6, temperature=0), 0, 0),
        (prompt, Sampling(max_tokens=6, temperature=0, ignore_eos=True), 1, 0),
        (prompt, Sampling(max_tokens=6, temperature=0, min_tokens=3), 2, 0),
        (prompt, Sampling(max_tokens=6, temperature=1.0, seed=(1 << 63) - 1, ignore_eos=True), 3, 0)])
    assert plain == first
    assert len(ignored) == 6 and ends.eot_id not in ignored
    assert ends.eot_id not in at_least[:3] and (len(at_least) == 6 or at_least[-1] == ends.eot_id)
    assert len(huge_seed) == 6  # the largest seed a request may send draws as any other


def test_a_long_score_goes_in_pieces_between_decode_steps_and_scores_as_infer_score_does(built):
    from infer.score import score_ids

    net, tok = built
    doc = tok.encode("a long document to score, " * 80).tolist()  # 2,080 tokens: 65 windows of a 64-token context

    async def main():
        engine = Engine(net, tok, pool=ThreadPoolExecutor(1), max_batch_tokens=128)
        order = []

        async def generate():
            seq = engine.submit(tok.encode("meanwhile").tolist(), Sampling(max_tokens=12, temperature=0, ignore_eos=True))
            while (await seq.events.get())[0] != "done":
                pass
            order.append("generated")

        async def score():
            got = await engine.run_pass("score", doc)
            order.append("scored")
            return got

        got, _ = await asyncio.gather(score(), generate())
        return got, order, engine.steps

    (tokens, nll), order, steps = asyncio.run(main())
    want = score_ids(net, [doc], tok.eot_id, stride=32, batch_tokens=4096)[0]
    assert tokens == want.tokens and nll == pytest.approx(want.nll, rel=1e-5)
    # At most 128 tokens of windows a round, each round a decode step: the 12 tokens came while it scored.
    assert order == ["generated", "scored"] and steps >= 11


# ---- a live server ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    storage = tmp_path_factory.mktemp("serve-storage")
    token_file = storage / "token"
    token_file.write_text(TOKEN + "\n")
    # Three slots: the first three models load at start, and big when it is first asked for.
    srv = Server([*[a for n in ("m1", "m2", "m3", "big") for a in ("--model", f"{n}={models[n]}")], "--token-file",
                  str(token_file), "--name", "live", "--max-new-tokens", "48", "--max-prompts", "8",
                  "--max-body-bytes", "65536"], str(storage), token=TOKEN)
    yield srv
    try:  # the SIGTERM test stops it; when that test did not run, it stops as cleanly here
        if srv.proc.poll() is None:
            srv.stop(group=True)
    finally:
        srv.kill()


def _openai(server):
    openai = pytest.importorskip("openai")
    return openai, openai.OpenAI(base_url=server.url + "/v1", api_key=TOKEN, max_retries=0)


@pytest.mark.slow("starts the module's server (four models)")
def test_the_default_ingress_is_the_replica_on_the_port_and_serves_own_routes_need_the_token(server):
    """Direct ingress (the default): the ingress replica itself listens on --port, on --host; Serve's proxy
    takes another port on the same host. Serve's own routes (/-/routes, /-/healthz) need the token on both;
    /health answers anyone. Every socket of the server's process tree on a wildcard address is a replica's
    inter-deployment gRPC server, which Ray Serve opens on [::] in every mode."""
    import contextlib
    import re
    import urllib.request

    import psutil

    listening = []
    root = psutil.Process(server.proc.pid)
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            listening += [(c.laddr.ip, c.laddr.port, p.name()) for c in p.net_connections("inet") if c.status == "LISTEN"]
    owners = {name for _, port, name in listening if port == server.port}
    assert len(owners) == 1 and next(iter(owners)).startswith("ray::ServeReplica") and "Api" in next(iter(owners))
    assert {ip for ip, port, _ in listening if port == server.port} <= {"127.0.0.1", "::ffff:127.0.0.1"}
    wildcard = {name for ip, _, name in listening if ip in ("0.0.0.0", "::")}
    assert all(n.startswith("ray::ServeReplica") for n in wildcard), listening
    proxy = int(re.search(r"Serve's proxy on port (\d+)", server.output()).group(1))
    assert any(port == proxy and name == "ray::ProxyActor" for _, port, name in listening)

    def get(port: int, path: str, token: str | None) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {token}"}
                                     if token else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
    for port in (server.port, proxy):
        assert [get(port, p, None) for p in ("/-/routes", "/-/healthz", "/health")] == [401, 401, 200], port
        assert [get(port, p, TOKEN) for p in ("/-/routes", "/-/healthz")] == [200, 200], port


@pytest.mark.slow("starts the module's server (four models)")
def test_the_openai_client_completes_streams_and_embeds_as_transformers_computes(server, models, built):
    transformers = pytest.importorskip("transformers")
    openai, client = _openai(server)
    net, tok = built
    hf = transformers.AutoModelForCausalLM.from_pretrained(models["m1"]).eval()
    prompt = "the quick brown fox"
    out = client.completions.create(model="m1", prompt=prompt, max_tokens=12, temperature=0)
    x = torch.tensor([tok.encode(prompt).tolist()])
    for _ in range(12):  # transformers' own forward, a token at a time
        with torch.no_grad():
            logits = hf(x).logits[0, -1]
        logits[tok.vocab_size:] = -float("inf")
        x = torch.cat([x, logits.argmax().view(1, 1)], dim=1)
    made = x[0, x.shape[1] - 12:].tolist()
    want = tok.decode(made[: made.index(tok.eot_id)] if tok.eot_id in made else made)
    assert out.choices[0].text == want
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 12
    assert out.usage.total_tokens == len(prompt) + 12
    pieces = [c.choices[0].text for c in client.completions.create(model="m1", prompt=prompt, max_tokens=12,
                                                                    temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == want and len(pieces) > 1
    texts = ["hello", "an embedding of a longer text"]
    emb = client.embeddings.create(model="m1", input=texts)  # the client asks for base64 and decodes it
    floats = client.embeddings.create(model="m1", input=texts, encoding_format="float")
    base = transformers.AutoModel.from_pretrained(models["m1"]).eval()
    for text, a, b in zip(texts, emb.data, floats.data, strict=True):
        with torch.no_grad():
            h = base(torch.tensor([tok.encode(text).tolist()])).last_hidden_state[0].mean(0)
        want_v = (h / h.norm()).tolist()
        assert a.embedding == pytest.approx(want_v, abs=1e-4) and b.embedding == pytest.approx(want_v, abs=1e-4)
    assert [m.id for m in client.models.list()] == ["big", "m1", "m2", "m3"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="m9", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_chat_completions_render_the_exported_template_as_transformers_does(server, models, built):
    transformers = pytest.importorskip("transformers")
    openai, client = _openai(server)
    net, tok = built
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "fox"}]  # 40 of 64 tokens
    prompt = transformers.AutoTokenizer.from_pretrained(models["m1"]).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    status, ids, _ = server.call("POST", "/tokenize", {"model": "m1", "messages": messages})
    assert status == 200 and ids["tokens"] == tok.encode(prompt).tolist() and ids["count"] == len(ids["tokens"])
    assert server.call("POST", "/detokenize", {"model": "m1", "tokens": ids["tokens"]})[1] == {"prompt": prompt}
    chat = client.chat.completions.create(model="m1", messages=messages, max_tokens=10, temperature=0)
    plain = client.completions.create(model="m1", prompt=prompt, max_tokens=10, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens == len(ids["tokens"])

    def streamed(**options):
        return list(client.chat.completions.create(model="m1", messages=messages, max_tokens=10, temperature=0,
                                                   stream=True, **options))
    bare = streamed()
    assert "".join(c.choices[0].delta.content or "" for c in bare) == chat.choices[0].message.content
    assert all(c.choices and c.usage is None for c in bare)  # no usage unless asked
    last = streamed(stream_options={"include_usage": True})
    assert last[-1].choices == [] and last[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert all(c.usage is None for c in last[:-1])
    every = streamed(stream_options={"include_usage": True, "continuous_usage_stats": True})
    made = [c.usage.completion_tokens for c in every]
    assert made == sorted(made) and made[-1] == chat.usage.completion_tokens and every[-1].choices == []
    forced = client.chat.completions.create(model="m1", messages=messages, max_tokens=12, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 12 and forced.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="presence_penalty must be 0"):
        client.chat.completions.create(model="m1", messages=messages, presence_penalty=0.5)


def test_the_same_seed_gives_the_same_text_whatever_else_is_in_the_batch(server, built):
    net, tok = built
    body = {"model": "m1", "prompt": ["once upon", "a time"], "max_tokens": 16, "temperature": 0.9, "top_k": 40,
            "seed": 11}
    status, alone, _ = server.call("POST", "/v1/completions", body)
    assert status == 200
    want = decode(net, [tok.encode(p).tolist() for p in body["prompt"]], max_tokens=16, temperature=0.9, top_k=40,
                  seed=11, eot_id=tok.eot_id, vocab_limit=tok.vocab_size)  # infer generate's sampling
    assert [c["text"] for c in alone["choices"]] == [
        tok.decode(w[: w.index(tok.eot_id)] if tok.eot_id in w else w) for w in want]
    results = {}

    def other(i):
        results[i] = server.call("POST", "/v1/completions", {"model": "m1", "prompt": f"n{i}" * (i + 1),
                                                             "max_tokens": 24, "temperature": 1.0, "seed": i})
    threads = [threading.Thread(target=other, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    status, crowded, _ = server.call("POST", "/v1/completions", body)
    for t in threads:
        t.join()
    assert status == 200 and [c["text"] for c in crowded["choices"]] == [c["text"] for c in alone["choices"]]
    assert all(r[0] == 200 for r in results.values())
    status, stats, _ = server.call("GET", "/v1/stats")
    m1 = stats["replica"]["models"]["m1"]
    assert m1["rows"] > m1["steps"]  # requests from different clients shared decode steps


def test_a_model_loading_never_holds_up_the_models_already_loaded(server):
    assert server.call("POST", "/v1/completions", {"model": "m1", "prompt": "warm", "max_tokens": 2})[0] == 200
    box = {}

    def load_big():
        box["answer"] = server.call("POST", "/v1/completions", {"model": "big", "prompt": "x", "max_tokens": 2})
    first = threading.Thread(target=load_big)
    first.start()
    answered_meanwhile = 0
    while first.is_alive():
        status, out, _ = server.call("POST", "/v1/completions", {"model": "m1", "prompt": "meanwhile", "max_tokens": 2})
        assert status == 200
        answered_meanwhile += first.is_alive()
    first.join()
    assert box["answer"][0] == 200
    assert answered_meanwhile >= 3  # m1 kept answering while big loaded on the same replica


def test_scores_are_infer_scores_figures(server, built):
    from infer.score import score_ids

    net, tok = built
    texts = ["a document to score", "another, longer document " * 5]
    status, out, _ = server.call("POST", "/v1/score", {"model": "m1", "input": texts})
    assert status == 200
    want = score_ids(net, [tok.encode(t) for t in texts], tok.eot_id, stride=32, batch_tokens=4096)
    for got, w, text in zip(out["data"], want, texts, strict=True):
        assert got["tokens"] == w.tokens
        assert got["loss"] == pytest.approx(w.loss(), rel=1e-4)
        assert got["bpb"] == pytest.approx(w.nll / 0.6931471805599453 / len(text.encode()), rel=1e-4)


def test_bad_requests_get_openai_errors_and_never_a_500(server):
    cases = [
        ({"model": "m1", "prompt": "x", "max_tokens": "3"}, 400, "max_tokens must be an integer"),
        ({"model": "m1", "prompt": "x", "max_tokens": 49}, 400, "between 1 and 48"),
        ({"model": "m1", "prompt": "x" * 60, "max_tokens": 10}, 400, "exceed the model's context of 64"),
        ({"model": "m1", "prompt": ["x"] * 9}, 400, "the limit is 8 (--max-prompts)"),
        ({"model": "m1", "prompt": {"a": 1}}, 400, "prompt must be"),
        ({"model": "m1", "prompt": [1, 2, 100000]}, 400, "outside the vocabulary"),
        ({"model": "m1", "prompt": "x", "temperature": -1}, 400, "temperature must be between"),
        ({"model": "m1", "prompt": "x", "stream": "yes"}, 400, "stream must be true or false"),
        ({"model": "m1", "prompt": "x", "stop": [1]}, 400, "stop must be"),
        ({"model": "nope", "prompt": "x"}, 404, "does not exist"),
        ({"prompt": "x"}, 400, "model is required"),
        ([1, 2], 400, "must be a JSON object"),
    ]
    for body, status, message in cases:
        got, out, _ = server.call("POST", "/v1/completions", body)
        assert (got, out["error"]["type"] if isinstance(out, dict) else out) == (
            status, "invalid_request_error"), (body, out)
        assert message in out["error"]["message"], (body, out)
    more = [  # each endpoint's own checks, and options this server does not implement
        ("/v1/completions", {"model": "m1", "prompt": "x", "n": 2}, "n must be 1"),
        ("/v1/completions", {"model": "m1", "prompt": "x", "frobnicate": 1}, "frobnicate is not supported"),
        ("/v1/completions", {"model": "m1", "prompt": "x", "stream_options": {"include_usage": True}},
         "only allowed when stream is true"),
        ("/v1/completions", {"model": "m1", "prompt": [-1, 2]}, "outside the vocabulary"),
        ("/v1/completions", {"model": "m1", "prompt": "x", "seed": 1 << 63}, "seed must be between"),
        ("/v1/score", {"model": "m1", "input": [[1, -3]]}, "outside the vocabulary"),
        ("/v1/score", {"model": "m1", "input": [[10 ** 30]]}, "outside the vocabulary"),
        ("/v1/embeddings", {"model": "m1", "input": [""]}, "an input is empty"),
        ("/v1/embeddings", {"model": "m1", "input": []}, "input must be"),
        ("/v1/embeddings", {"model": "m1", "input": "x", "dimensions": 8}, "dimensions is not supported"),
        ("/v1/chat/completions", {"model": "m1", "messages": []}, "messages must be"),
        ("/v1/chat/completions", {"model": "m1", "messages": [{"role": "tool", "content": "x"}]}, "role is"),
        ("/v1/chat/completions", {"model": "m1", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "text parts"),
        ("/v1/chat/completions", {"model": "m1", "messages": [{"role": "user", "content": "x"}], "tools": [{"a": 1}]},
         "calls no tools"),
        ("/detokenize", {"model": "m1", "tokens": [-1]}, "outside the vocabulary"),
        ("/tokenize", {"model": "m1"}, "give prompt"),
    ]
    for path, body, message in more:
        got, out, _ = server.call("POST", path, body)
        assert got == 400 and message in out["error"]["message"], (path, body, out)
    got, out, _ = server.call("POST", "/v1/completions", raw=b'{"model": "m1", "prompt": ' + b"[" * 50000)
    assert got == 400 and "too deeply" in out["error"]["message"]
    got, out, _ = server.call("POST", "/v1/completions", {"model": "m1", "prompt": "x", "seed": (1 << 63) - 1})
    assert got == 200
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405), ("GET", "/openapi.json", 404)):
        got, out, _ = server.call(method, path)
        assert got == status and out["error"]["code"] in ("not_found", "method_not_allowed"), (method, path, out)
        assert server.call(method, path, token=None)[0] == 401  # with no token, nothing is told about routes
    assert server.call("GET", "/health", token=None)[0] == 200
    got, out, _ = server.call("POST", "/v1/completions", raw=b'{"model": "m1", "prompt": ')
    assert got == 400 and "not JSON" in out["error"]["message"]
    got, out, _ = server.call("POST", "/v1/completions", raw=b"\xff\xfe")
    assert got == 400 and "not JSON" in out["error"]["message"]
    got, out, _ = server.call("POST", "/v1/embeddings", raw=json.dumps({"model": "m1", "input": "x" * 70000}).encode())
    assert got == 413 and "--max-body-bytes" in out["error"]["message"]
    got, out, _ = server.call("POST", "/v1/embeddings", {"model": "m1", "input": "x", "encoding_format": "hex"})
    assert got == 400 and out["error"]["param"] == "encoding_format"
    got, out, _ = server.call("POST", "/v1/completions", {"model": "m1", "prompt": "x"}, token=None)
    assert got == 401 and out["error"]["type"] == "authentication_error"
    got, out, _ = server.call("GET", "/v1/models", token="s3cret-token-for-the-test")  # one character short
    assert got == 401
    assert server.call("GET", "/healthz", token=None)[0] == 200  # health checks need no token
    counted = server.call("GET", "/v1/stats")[1]["served"]["by_status"]
    assert all(counted.get(k, 0) > 0 for k in ("200", "400", "401", "404", "405", "413")) and "500" not in counted
    # Prometheus' own reading of /metrics.
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for family in
               text_string_to_metric_families(server.call("GET", "/metrics")[1]) for s in family.samples}
    assert samples[("strata_requests_total", (("status", "401"),))] == counted["401"]
    assert samples[("strata_requests_in_flight", ())] == 0 and ("strata_latency_ms", (("quantile", "0.5"),)) in samples


def test_a_client_that_leaves_before_its_answer_is_counted_499_never_500(server):
    """A load tester's window closes, a client times out: the request is counted as the client's leaving
    (499, nginx's "client closed request"), streamed or not, and nothing is a 500."""
    import socket
    import time

    from conftest import wait_for

    def leave(stream: bool) -> None:
        body = json.dumps({"model": "big", "prompt": "x", "max_tokens": 48, "ignore_eos": True,
                           "stream": stream}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # the stream began
        else:
            time.sleep(0.2)  # admitted, its body read, decoding
        sock.close()

    def gone() -> int:
        return server.call("GET", "/v1/stats")[1]["served"]["by_status"].get("499", 0)

    before = gone()
    leave(stream=True)
    wait_for(lambda: gone() == before + 1, "the stream that lost its client counted 499", 60)
    leave(stream=False)
    wait_for(lambda: gone() == before + 2, "the request that lost its client counted 499", 60)
    assert "500" not in server.call("GET", "/v1/stats")[1]["served"]["by_status"]


def test_guidellm_on_its_defaults_gets_no_error_and_counts_the_tokens_the_server_counted(server, models, tmp_path):
    """guidellm's default backend: its health check (GET /health), chat completions streamed with
    stream_options and ignore_eos. Only the model (the server has four) and the token are named."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("guidellm") is None:  # not imported here: it starts multiprocessing's tracker
        pytest.skip("guidellm is not installed")
    before = server.call("GET", "/v1/stats")[1]["served"]
    out = tmp_path / "guidellm.json"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={server.url},model=m1,api_key={TOKEN}",
           "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=6",
           "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
           "--tokenizer", f"kind=hf_auto,model={models['m1']}", "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    env = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=100)
    finally:
        _end_session(proc.pid)  # guidellm leaves its multiprocessing resource tracker running
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    got = json.loads(out.read_text())["benchmarks"][0]["requests"]
    assert len(got["successful"]) == 6 and not got["errored"] and not got["incomplete"], got
    after = server.call("GET", "/v1/stats")[1]["served"]
    assert after["by_status"]["200"] - before["by_status"].get("200", 0) == 6
    made = [r["output_metrics"]["text_tokens"] for r in got["successful"]]
    assert made == [8] * 6  # ignore_eos: every completion runs to the length asked for
    assert sum(made) == after["completion_tokens"] - before["completion_tokens"]
    assert sum(r["prompt_tokens"] for r in got["successful"]) == after["prompt_tokens"] - before["prompt_tokens"]


def _end_session(sid: int) -> None:
    """Kill what is left of the session `sid` started (its processes), and wait for them."""
    import psutil

    left = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                p.kill()
                left.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    psutil.wait_procs(left, timeout=30)


def test_lm_evaluation_harness_local_completions_gets_infer_evals_accuracy(server, models, built, tmp_path,
                                                                           monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")
    from lm_eval.tasks import TaskManager
    from test_harness import TASK, _local_task

    from train.tasks import evaluate, load_task

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)  # local-completions sends it as the bearer token
    # The harness's own class (its registry by name can miss it once another model was registered first).
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(model="m1", base_url=server.url + "/v1/completions", tokenizer_backend="huggingface",
                             tokenizer=models["m1"], num_concurrent=4, max_retries=1)
    out = lm_eval.simple_evaluate(model=lm, tasks=["strata_arith"],
                                  task_manager=TaskManager(include_path=str(_local_task(tmp_path))), log_samples=True)
    net, tok = built
    ours = evaluate(net, tok, load_task(TASK))
    got = out["results"]["strata_arith"]
    assert got["acc,none"] == pytest.approx(ours["acc"]) and got["acc_norm,none"] == pytest.approx(ours["acc_norm"])
    theirs = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in out["samples"]["strata_arith"]}
    for k, ll in enumerate(ours["logliks"]):  # every choice's log-likelihood, not only the argmax
        assert theirs[k] == pytest.approx(ll, abs=1e-3)


def test_lm_evaluation_harness_local_chat_completions_gets_what_the_chat_endpoint_gives(server, monkeypatch):
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion

    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)
    lm = LocalChatCompletion(model="m1", base_url=server.url + "/v1/chat/completions", max_retries=1)
    chats = [[{"role": "user", "content": "fox"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "cat"}]]
    requests = [Instance(request_type="generate_until", doc={}, idx=i, arguments=(
        JsonChatStr(json.dumps(c)), {"until": ["\n\n"], "max_gen_toks": 8, "temperature": 0})) for i, c in enumerate(chats)]
    got = lm.generate_until(requests)  # as `lm_eval --model local-chat-completions --apply_chat_template` sends them
    for chat, text in zip(chats, got, strict=True):
        status, want, _ = server.call("POST", "/v1/chat/completions", {"model": "m1", "messages": chat, "max_tokens": 8,
                                                                      "temperature": 0, "stop": ["\n\n"]})
        assert status == 200 and text == want["choices"][0]["message"]["content"], (text, want)


def test_sigterm_stops_the_server_and_its_record_counts_what_it_served(server, tmp_path):
    import re
    import urllib.request

    from conftest import wait_for

    status, _, _ = server.call("POST", "/v1/completions", {"model": "m2", "prompt": "last", "max_tokens": 4})
    assert status == 200
    assert server.call("POST", "/v1/completions", {"model": "m2", "prompt": 7})[0] == 400
    # Ray Serve's own Prometheus metrics, as Ray's metrics agent exports them (every few seconds).
    url = re.search(r"Prometheus metrics at (\S+)", server.output()).group(1)

    def counted():
        with urllib.request.urlopen(url, timeout=30) as r:
            text = r.read().decode()
        return re.search(r'^ray_serve_num_http_requests(_total)?\{[^}]*\} [0-9.]+', text, re.M)
    wait_for(counted, "Ray Serve's request counter in the metrics", 120)
    code, summary = server.stop(group=True)  # to its whole process group, its embedded Ray's daemons' too
    assert code == 143 and summary["stopped_by"] == "SIGTERM", server.output()[-3000:]  # 128 + SIGTERM
    assert summary["requests"] >= 2 and summary["completion_tokens"] >= 4
    assert summary["by_status"]["200"] >= 1 and summary["by_status"]["400"] >= 1 and "500" not in summary["by_status"]
    assert 0 < summary["p50_ms"] <= summary["p99_ms"]
    assert summary["replica_hours"] > 0 and summary["node_hours"] > 0
    assert summary["dollars_per_million_tokens"] is not None
    record = json.loads(Path(summary["record"]).read_text())
    assert record["kind"] == "serve" and record["figures"]["requests"] == summary["requests"]
    from test_openlineage import check_event

    events = [json.loads(line) for line in (Path(summary["record"]).parent / "openlineage.jsonl").read_text().splitlines()]
    assert [e["eventType"] for e in events] == ["START", "COMPLETE"]  # a server's SIGTERM is its normal end
    assert events[0]["job"]["facets"]["jobType"]["processingType"] == "STREAMING" and events[0]["inputs"]
    for e in events:
        check_event(e)
    from strata.commands.report import runs_table

    assert "requests" in runs_table([record])
    assert not os.path.exists(f"/proc/{server.proc.pid}")
    temp = re.search(r"started embedded local Ray \(.*temp (\S+)\)", server.output()).group(1)
    assert not os.path.exists(temp)  # its Ray went with it
    assert "INFO" not in server.output() and "graceful_shutdown" not in server.output()  # strata's lines only


# ---- many models, following a run, scaling and back-pressure ----------------------------------------------

@pytest.mark.ray
@pytest.mark.serve
@pytest.mark.slow("twelve models and a run followed")
def test_twelve_models_on_two_replicas_of_three_slots_and_a_run_followed_without_a_failed_request(tmp_path):
    from serving import commit_checkpoint

    storage = tmp_path / "storage"
    storage.mkdir()
    run_dir = storage / "runs" / "live"
    commit_checkpoint(str(run_dir), 1, seed=100)
    dirs = {f"m{i:02d}": exported(tmp_path / f"m{i:02d}", seed=i) for i in range(11)}
    srv = Server([*[a for n, d in dirs.items() for a in ("--model", f"{n}={d}")], "--model", "live=live@latest",
                  "--replicas", "2", "--models-per-replica", "3", "--cpus-per-replica", "0.5", "--max-ongoing", "2",
                  "--follow-s", "1"], str(storage))
    try:
        prompt = "same prompt"
        for name, d in [*dirs.items(), ("live", "live@1")]:  # every model answers with its own weights
            net, tok = resolve(d, Storage(str(storage))).build()
            want = decode(net, [tok.encode(prompt).tolist()], max_tokens=8, temperature=0, eot_id=tok.eot_id,
                          vocab_limit=tok.vocab_size)[0]
            status, out, _ = srv.call("POST", "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 8,
                                                                  "temperature": 0})
            assert status == 200, out
            assert out["choices"][0]["text"] == tok.decode([t for t in want if t != tok.eot_id]), name

        # A skewed load: the hot model gets 24 requests at once, and spreads over both replicas.
        with ThreadPoolExecutor(24) as pool:
            hot = list(pool.map(lambda i: srv.call("POST", "/v1/completions", {
                "model": "m00", "prompt": f"hot {i}", "max_tokens": 24, "temperature": 0}), range(24)))
        assert all(s == 200 for s, _, _ in hot)
        assert len({out["strata"]["replica"] for _, out, _ in hot}) == 2

        # The run commits a checkpoint under steady load: no request fails, and the answers move to it.
        stop, seen = threading.Event(), []

        def steady():
            while not stop.is_set():
                status, out, _ = srv.call("POST", "/v1/completions", {"model": "live", "prompt": prompt,
                                                                      "max_tokens": 8, "temperature": 0})
                seen.append((status, out.get("strata", {}).get("source"), out.get("choices", [{}])[0].get("text")))
        clients = [threading.Thread(target=steady) for _ in range(3)]
        for c in clients:
            c.start()
        try:
            commit_checkpoint(str(run_dir), 2, seed=200)
            from conftest import wait_for

            wait_for(lambda: sum(1 for s in seen[-6:] if s[1] == "live@2") == 6, "the replicas to move to step 2", 120)
        finally:
            stop.set()
            for c in clients:
                c.join()
        assert all(s == 200 for s, _, _ in seen), [s for s in seen if s[0] != 200][:3]
        net, tok = resolve("live@2", Storage(str(storage))).build()
        want = decode(net, [tok.encode(prompt).tolist()], max_tokens=8, temperature=0, eot_id=tok.eot_id,
                      vocab_limit=tok.vocab_size)[0]
        assert seen[-1][2] == tok.decode([t for t in want if t != tok.eot_id])
        assert {s[1] for s in seen} == {"live@1", "live@2"}
    finally:
        code, summary = srv.stop(sig=signal.SIGINT)  # Ctrl-C
    assert code == 130 and summary["stopped_by"] == "SIGINT" and summary["models"] == 12 and summary["by_status"].get("200", 0) == summary["requests"]


@pytest.mark.ray
@pytest.mark.serve
@pytest.mark.slow("waits for Serve's autoscaler both ways")
def test_replicas_scale_up_under_load_and_down_after_it_and_overload_gets_503_at_once(tmp_path, models):
    from conftest import simulated_cluster, wait_for
    from ray import serve

    def running():
        app = serve.status().applications.get("strata")
        dep = app.deployments.get("Api") if app else None  # one model: the ingress holds it (one hop)
        return dep.replica_states.get("RUNNING", 0) if dep else 0

    # Its own cluster: replicas on two nodes, scaled by Serve's autoscaler under load.
    with simulated_cluster([(("cpu",), 1), (("cpu",), 1)]) as (cluster, _):
        srv = Server(["--model", f"m1={models['m1']}", "--address", cluster.address, "--min-replicas", "1",
                      "--max-replicas", "2", "--target-ongoing", "1", "--max-ongoing", "4", "--max-queued", "8",
                      "--proxies", "HeadOnly"],  # the nodes share one loopback: one proxy on the port
                     str(tmp_path))
        try:
            assert running() == 1
            stop = threading.Event()
            statuses = []

            def load():
                while not stop.is_set():
                    statuses.append(srv.call("POST", "/v1/completions", {"model": "m1", "prompt": "load",
                                                                         "max_tokens": 40, "temperature": 0})[0])
            clients = [threading.Thread(target=load) for _ in range(4)]
            for c in clients:
                c.start()
            try:
                wait_for(lambda: running() == 2, "a second replica under load", 120)
            finally:
                stop.set()
                for c in clients:
                    c.join()
            assert set(statuses) == {200}
            wait_for(lambda: running() == 1, "the replicas to come back down after the load", 120)

            # 256 clients at once against 1 replica taking 4 and a queue of 8: refused at once, never a 500.
            def burst(i):
                return srv.call("POST", "/v1/completions", {"model": "m1", "prompt": f"b{i}", "max_tokens": 40,
                                                            "temperature": 0}, timeout=300)
            with ThreadPoolExecutor(256) as pool:
                answers = list(pool.map(burst, range(256)))
            codes = [a[0] for a in answers]
            assert set(codes) <= {200, 503} and codes.count(503) > 0 and codes.count(200) > 0, set(codes)
            refused = [a for a in answers if a[0] == 503]
            assert all(isinstance(a[1], dict) for a in refused), {a[1] for a in refused if not isinstance(a[1], dict)}
            assert all(a[2].get("retry-after") == "1" and a[1]["error"]["type"] == "overloaded" for a in refused)
            status, _, _ = srv.call("POST", "/v1/completions", {"model": "m1", "prompt": "after", "max_tokens": 4})
            assert status == 200  # and it still serves
        finally:
            code, summary = srv.stop()
        assert code == 143 and summary["replica_hours"] > 0
        # Every answer is in the record, those of the replica autoscaling removed included.
        assert summary["replicas"] >= 2, summary
        assert summary["by_status"] == {"200": len(statuses) + codes.count(200) + 1, "503": codes.count(503)}, summary


@pytest.mark.ray
@pytest.mark.serve
def test_clients_that_never_send_their_bodies_hold_a_slot_until_408_and_the_rest_get_503_at_once(models, tmp_path,
                                                                                                   joined):
    import re
    import socket

    from conftest import wait_for

    srv = Server(["--model", f"m1={models['m1']}", "--max-ongoing", "2", "--max-queued", "2", "--body-timeout-s", "4",
                  "--max-input-tokens", "8"], str(tmp_path), env=joined)
    slow = []
    try:
        def in_flight() -> int:
            return int(re.search(r"^strata_requests_in_flight (\d+)$", srv.call("GET", "/metrics")[1], re.M).group(1))

        for _ in range(4):  # the bound: --max-ongoing plus --max-queued
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 64\r\n\r\n")
            slow.append(sock)
        wait_for(lambda: in_flight() == 4, "the four silent clients admitted", 30)
        status, out, headers = srv.call("POST", "/v1/completions", {"model": "m1", "prompt": "x", "max_tokens": 2})
        assert status == 503 and out["error"]["type"] == "overloaded" and headers.get("retry-after") == "1"
        for sock in slow:  # each answered 408 once --body-timeout-s has passed, its slot freed
            assert sock.recv(4096).startswith(b"HTTP/1.1 408"), "a silent client was not answered 408"
        assert in_flight() == 0
        assert srv.call("POST", "/v1/completions", {"model": "m1", "prompt": "x", "max_tokens": 2})[0] == 200
        for path in ("/v1/score", "/v1/embeddings"):  # inputs bounded in tokens, the flag named
            status, out, _ = srv.call("POST", path, {"model": "m1", "input": ["five!", "more!"]})
            assert status == 400 and "--max-input-tokens" in out["error"]["message"], out
    finally:
        for sock in slow:
            sock.close()
        code, summary = srv.stop()
    assert code == 143 and summary["by_status"] == {"408": 4, "503": 1, "200": 1, "400": 2}
