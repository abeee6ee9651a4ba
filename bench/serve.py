"""Online serving: `python -m infer serve` under a bounded loopback load, against the same models behind a plain
FastAPI app (bench/serve_plain.py: one process, one request per forward) on the same cores, and against
itself with Ray Serve's throughput-optimised mode (RAY_SERVE_THROUGHPUT_OPTIMIZED=1).

    python -m bench.serve [--seconds 6] [--concurrency 1,4,16,32,64,256] [--presets debug,gpt2-124m] [--json]

Each server runs alone on the machine, both models loaded: `debug` and `gpt2-124m` shapes with random
weights and the byte tokenizer, exported as `python -m train.export` writes them. At each concurrency C, C
clients (aiohttp, one connection each) send requests back to back for `--seconds` (at least 20 s for
gpt2-124m, whose batches take seconds); requests still open then are cancelled and not counted. Completions ask for 32 new tokens, greedy, after a 20-token prompt;
embeddings embed 128 tokens. Every figure is measured on the wall clock by the clients: requests per
second and tokens per second over the window, p50 and p99 latency of the answered requests, and the share
that were not 200 (503s are counted apart). At the highest concurrency the server's memory (the RSS of
its whole process tree) is read before, halfway through and at the end.

The Ray Serve HA proxy (RAY_SERVE_ENABLE_HA_PROXY=1) is left out: it binds every interface, and this
machine keeps Ray's traffic on loopback.

Targets (ratios to the plain server, measured in the same run):
- embeddings on debug at concurrency 1: p50 within 3 ms of the plain server's;
- completions on gpt2-124m at concurrency 32: at least 3x the plain server's tokens per second;
- embeddings on debug at concurrency 32: at least the plain server's requests per second;
- p99 at most 3x p50 at concurrency 32;
- at the highest concurrency: only 200s and 503s, and flat memory while overloaded (the server's RSS at
  the end of the window / halfway through it, <= 1.2; what it took over idle is printed too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The quick brown fox "  # 20 bytes: 20 tokens
TEXT = ("strata serves models behind OpenAI's API on Ray Serve; " * 4)[:128]  # 128 tokens


def make_models(directory: str, presets: list[str]) -> dict[str, str]:
    import torch

    from strata.tokenizer import ByteTokenizer
    from train.checkpoint import AsyncCheckpointer
    from train.export import export
    from train.model import GPT, preset

    out = {}
    for name in presets:
        cfg = preset(name)
        torch.manual_seed(0)
        model = GPT(cfg)
        ckpt = AsyncCheckpointer(model, torch.optim.AdamW(model.parameters()), 0)
        ckpt.start(1, {"model_config": asdict(cfg), "tokenizer": asdict(ByteTokenizer().info())})
        _, local = ckpt.take()
        out[name] = export(local, os.path.join(directory, name))["out"]
    return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, kind: str, models: dict[str, str], work: str):
        self.kind, self.port = kind, _port()
        cores = os.cpu_count() or 1
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "STRATA_STORAGE": os.path.join(work, kind)}
        flags = [a for n, d in models.items() for a in ("--model", f"{n}={d}")]
        if kind == "plain":
            cmd = [sys.executable, "-m", "bench.serve_plain", *flags, "--port", str(self.port), "--threads", str(cores)]
        else:
            cmd = [sys.executable, "-m", "infer", "serve", *flags, "--port", str(self.port), "--cpus-per-replica",
                   str(cores), "--models-per-replica", str(len(models)), "--name", f"bench-{kind}", "--json"]
            if kind == "strata-optimized":
                # Direct ingress: the ingress replica serves HTTP on a port of its own (the first of this range),
                # where Ray's HA proxy would send traffic; the load goes there.
                self.direct = _port()
                env.update(RAY_SERVE_THROUGHPUT_OPTIMIZED="1", RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(self.direct),
                           RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(self.direct + 20))
        self.log = open(os.path.join(work, f"{kind}.log"), "w+")  # noqa: SIM115 - the server's life
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind} server exited: {self.tail()}")
            if self._up():
                if kind == "strata-optimized":
                    proxy, self.port = self.port, self.direct
                    if not self._up():
                        self.port = proxy  # no direct ingress here: through the proxy, and said so
                        print("strata-optimized: no direct ingress port answered; through the proxy", flush=True)
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{kind} server did not come up: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-2000:]

    def _up(self) -> bool:
        import urllib.request

        if self.kind != "plain" and "Ctrl-C stops" not in self.tail():
            return False
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/embeddings", method="POST",
                                         data=json.dumps({"model": "debug", "input": "warm"}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status == 200
        except OSError:
            return False

    def rss_mb(self) -> float:
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return math.nan
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
        return total / 2**20

    def stop(self) -> dict | None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate()
        lines = [line for line in (out or "").splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else None


async def load(port: int, path: str, body: dict, concurrency: int, seconds: float) -> dict:
    """`concurrency` clients sending `body` back to back for `seconds`: what was answered within the window."""
    import aiohttp

    url = f"http://127.0.0.1:{port}{path}"
    latencies, tokens, codes = [], 0, {}
    started = time.perf_counter()
    deadline = started + seconds

    async def client(session):
        nonlocal tokens
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            try:
                async with session.post(url, json=body) as r:
                    out = await r.json(content_type=None)
                    status = r.status
            except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError):
                status, out = 0, {}
            if time.perf_counter() > deadline:
                return  # answered after the window: not counted
            codes[status] = codes.get(status, 0) + 1
            if status == 200:
                latencies.append(time.perf_counter() - t)
                tokens += (out.get("usage") or {}).get("completion_tokens", 0)

    timeout = aiohttp.ClientTimeout(total=seconds + 60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:
        tasks = [asyncio.create_task(client(session)) for _ in range(concurrency)]
        await asyncio.sleep(seconds)
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    window = seconds
    lat = sorted(latencies)

    def q(p):
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 2) if lat else None
    return {"concurrency": concurrency, "ok": len(lat), "codes": {str(k): v for k, v in sorted(codes.items())},
            "rps": round(len(lat) / window, 2), "tokens_per_s": round(tokens / window, 1),
            "p50_ms": q(0.5), "p99_ms": q(0.99)}


LONG = 20.0  # seconds: the window of each gpt2-124m point
WORKLOADS = {  # name -> (path, body)
    "completions gpt2-124m": ("/v1/completions", {"model": "gpt2-124m", "prompt": PROMPT, "max_tokens": 32,
                                                  "temperature": 0}),
    "completions debug": ("/v1/completions", {"model": "debug", "prompt": PROMPT, "max_tokens": 32, "temperature": 0}),
    "embeddings debug": ("/v1/embeddings", {"model": "debug", "input": TEXT}),
}


def run(seconds: float, concurrency: list[int], presets: list[str]) -> dict:
    work = tempfile.mkdtemp(prefix="strata-bench-serve-")
    try:
        models = make_models(work, presets)
        workloads = {k: v for k, v in WORKLOADS.items() if v[1]["model"] in models}
        results: dict = {}
        memory: dict = {}
        for kind in ("plain", "strata", "strata-optimized"):
            server = Server(kind, models, work)
            try:
                for name, (path, body) in workloads.items():
                    asyncio.run(load(server.port, path, body, 1, 0.5))  # warm: the model built, the path taken
                    # gpt2-124m's batches run for seconds: a longer window, so that several finish inside it
                    window = max(seconds, LONG) if body["model"] == "gpt2-124m" else seconds
                    for c in concurrency:
                        top = c == max(concurrency)
                        before = server.rss_mb() if top else None
                        mid: list[float] = []
                        timer = threading.Timer(window / 2, lambda m=mid, sv=server: m.append(sv.rss_mb())) if top else None
                        if timer:
                            timer.start()
                        point = asyncio.run(load(server.port, path, body, c, window))
                        if top:
                            timer.join()
                            # Overloaded all through the window: memory halfway through and at the end.
                            point.update(rss_mb_before=round(before, 1), rss_mb_mid=round(mid[0], 1),
                                         rss_mb_after=round(server.rss_mb(), 1))
                        results.setdefault(name, {}).setdefault(kind, []).append(point)
                        print(f"{kind:>17} {name:<22} c={c:<4} {point['rps']:>8.1f} req/s {point['tokens_per_s']:>9.1f} "
                              f"tok/s p50 {point['p50_ms']} ms p99 {point['p99_ms']} ms {point['codes']}", flush=True)
            finally:
                memory[kind] = server.stop()
        return {"seconds_per_point": seconds, "gpt2_seconds_per_point": max(seconds, LONG), "concurrency": concurrency, "results": results,
                "summaries": memory, "targets": targets(results, concurrency)}
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def _at(results, name, kind, c):
    return next((p for p in results.get(name, {}).get(kind, []) if p["concurrency"] == c), None)


def targets(results: dict, concurrency: list[int]) -> dict:
    out = {}
    c1, c32, top = 1, 32 if 32 in concurrency else max(concurrency), max(concurrency)
    for kind in ("strata", "strata-optimized"):
        t = {}
        s, p = _at(results, "embeddings debug", kind, c1), _at(results, "embeddings debug", "plain", c1)
        if s and p and s["p50_ms"] is not None and p["p50_ms"] is not None:
            t["embeddings_c1_p50_over_plain_ms"] = round(s["p50_ms"] - p["p50_ms"], 2)
        s, p = _at(results, "completions gpt2-124m", kind, c32), _at(results, "completions gpt2-124m", "plain", c32)
        if s and p and p["tokens_per_s"]:
            t["completions_gpt2_c32_tokens_ratio"] = round(s["tokens_per_s"] / p["tokens_per_s"], 2)
        s, p = _at(results, "embeddings debug", kind, c32), _at(results, "embeddings debug", "plain", c32)
        if s and p and p["rps"]:
            t["embeddings_c32_rps_ratio"] = round(s["rps"] / p["rps"], 2)
        tails = [pt["p99_ms"] / pt["p50_ms"] for name in results for pt in results[name].get(kind, [])
                 if pt["concurrency"] == c32 and pt["p50_ms"]]
        if tails:
            t["worst_p99_over_p50_c32"] = round(max(tails), 2)
        at_top = [pt for name in results for pt in results[name].get(kind, []) if pt["concurrency"] == top]
        t["only_200_503_at_top"] = all(set(pt["codes"]) <= {"200", "503"} for pt in at_top)
        growth = [pt["rss_mb_after"] / pt["rss_mb_mid"] for pt in at_top if pt.get("rss_mb_mid")]
        if growth:  # flat under overload: the end of the window / its middle
            t["memory_growth_at_top"] = round(max(growth), 3)
        grown = [pt["rss_mb_mid"] - pt["rss_mb_before"] for pt in at_top if pt.get("rss_mb_mid")]
        if grown:  # what the overload took on top of idle (bounded by --max-batch-tokens' cache)
            t["memory_mb_taken_at_top"] = round(max(grown), 1)
        emb = [pt for pt in results.get("embeddings debug", {}).get(kind, [])]
        if emb:
            best = max(pt["rps"] for pt in emb)
            per_core = best / (os.cpu_count() or 1)
            t["embeddings_best_rps_per_core"] = round(per_core, 1)
            t["cores_for_250_rps"] = math.ceil(250 / per_core) if per_core else None
        out[kind] = t
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0, help="the window each point is measured over")
    parser.add_argument("--concurrency", default="1,4,16,32,64,256", help="clients at once, comma-separated")
    parser.add_argument("--presets", default="debug,gpt2-124m", help="the model shapes served")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    out = run(args.seconds, concurrency, args.presets.split(","))
    t = out["targets"].get("strata", {})
    if args.json:
        print(json.dumps(out))
    print(f"strata serve / plain FastAPI: embeddings c=1 p50 +{t.get('embeddings_c1_p50_over_plain_ms')} ms, "
          f"completions gpt2-124m c=32 tokens/s x{t.get('completions_gpt2_c32_tokens_ratio')}, embeddings c=32 req/s "
          f"x{t.get('embeddings_c32_rps_ratio')}, p99/p50 {t.get('worst_p99_over_p50_c32')}, only 200/503 at the top "
          f"{t.get('only_200_503_at_top')}, memory x{t.get('memory_growth_at_top')}")
    return out


if __name__ == "__main__":
    main()
