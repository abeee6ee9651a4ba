"""Online serving: `python -m infer serve` in its default configuration under load from guidellm (vLLM's load
tester, on its OpenAI HTTP backend), against the same models behind a plain FastAPI app
(bench/serve_plain.py: one process, one request per forward) on the same cores, loaded the same way.

    python -m bench.serve [--seconds 6] [--concurrency 1,32,256] [--presets debug,gpt2-124m]
                          [--kinds plain,strata,strata-proxy] [--json]

Each server runs alone on the machine, both models loaded: `debug` and `gpt2-124m` shapes with random
weights and the byte tokenizer, exported as `python -m train.export` writes them. `strata` is the default
configuration (direct ingress: the ingress replica listens on the port itself); `strata-proxy` is
`--ingress proxy`, through Ray Serve's HTTP proxy. At each concurrency C, guidellm keeps C requests in flight
(its `concurrent` profile, one client process) for `--seconds` (at least 20 s for gpt2-124m, whose batches
take seconds). Completions: a 20-token prompt, 32 new tokens (`ignore_eos`), not streamed; embeddings: 128
tokens. The prompts come from a JSON-lines file guidellm reads (its synthetic data generator took about
0.4 cores of the 2 while it ran, which the servers then lacked). Every figure is guidellm's, measured on the wall clock by the client: successful
requests and output tokens per second over the window, p50 and p99 request latency, and its errored and
incomplete counts. At the highest concurrency the server's memory (the RSS of its whole process tree) is
read before, halfway through and at the end; strata's own count of every answer by status is printed as
its record says it.

Targets (ratios to the plain server, measured in the same run):
- embeddings on debug at concurrency 1: p50 within 3 ms of the plain server's;
- embeddings on debug at concurrency 32: at least the plain server's requests per second;
- completions on gpt2-124m at concurrency 32: at least 5x the plain server's tokens per second;
- p99 at most 3x p50 at concurrency 32;
- flat memory while overloaded: the server's RSS at the end of the top window / halfway through it, <= 1.2.
"""

from __future__ import annotations

import argparse
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


def make_models(directory: str, presets: list[str]) -> dict[str, str]:
    import torch

    from strata.data.tokenizer import ByteTokenizer
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
            if kind == "strata-proxy":
                cmd += ["--ingress", "proxy"]
        self.log = open(os.path.join(work, f"{kind}.log"), "w+")  # noqa: SIM115 - the server's life
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind} server exited: {self.tail()}")
            if self._up():
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
        finally:  # what outlived it in its session (Ray's dashboard can leave a resource tracker a while)
            _end_session(self.proc.pid)
        lines = [line for line in (out or "").splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else None


def _prompts(work: str, path: str) -> str:
    """guidellm's data as a file, so that its client makes none while it loads the server (its synthetic data
    took a loader process about 0.4 cores here): prompts of 20 bytes for 32 new tokens, or 128-byte inputs
    to embed; the byte tokenizer makes a byte a token."""
    completions = path == "/v1/completions"
    name = os.path.join(work, f"prompts-{'completions' if completions else 'embeddings'}.jsonl")
    if not os.path.exists(name):
        import random

        rng = random.Random(0)
        words = ["strata", "serves", "models", "behind", "the", "OpenAI", "API", "on", "Ray", "Serve", "with", "batching"]
        with open(name, "w") as f:
            for _ in range(50_000):
                text = " ".join(rng.choice(words) for _ in range(40))[:20 if completions else 128]
                row = {"prompt": text, "prompt_tokens_count": len(text)}
                if completions:
                    row["output_tokens_count"] = 32
                f.write(json.dumps(row) + "\n")
    return name


def _end_session(sid: int) -> None:
    """Kill what is left of the session `sid` started, and wait for it."""
    import psutil

    left = []
    for p in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            if os.getsid(p.pid) == sid:
                p.kill()
                left.append(p)
    psutil.wait_procs(left, timeout=30)


def guidellm(port: int, path: str, model: str, tokenizer: str, concurrency: int, seconds: float, work: str) -> dict:
    """guidellm keeping `concurrency` requests of `path` in flight for `seconds`: what it measured."""
    out = os.path.join(work, f"guidellm-{port}-{concurrency}.json")
    data = f"kind=json_file,path={_prompts(work, path)}"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model={model},request_format={path},"
           "stream=false",
           "--profile", f"kind=concurrent,streams={concurrency}", "--constraint", f"kind=max_duration,seconds={seconds}",
           "--data", data, "--tokenizer", f"kind=hf_auto,model={tokenizer}",
           "--output", f"kind=json,path={out}", "--disable-console"]
    env = {**os.environ, "HOME": work, "HF_HUB_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=work,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=seconds + 300)
    finally:
        _end_session(proc.pid)  # guidellm leaves multiprocessing's resource tracker running
    if proc.returncode:
        raise RuntimeError(f"guidellm exited {proc.returncode}: {err[-2000:]}")
    bench = json.loads(Path(out).read_text())["benchmarks"][0]
    m, took = bench["metrics"], bench["duration"] or seconds
    totals = m["request_totals"]
    latency = m["request_latency"]["successful"]

    def ms(v):
        return round(v * 1000, 2) if totals["successful"] else None
    return {"concurrency": concurrency, "ok": totals["successful"], "errored": totals["errored"],
            "incomplete": totals["incomplete"], "rps": round(totals["successful"] / took, 2),
            "tokens_per_s": round(m["output_token_count"]["successful"]["total_sum"] / took, 1),
            "p50_ms": ms(latency["median"]), "p99_ms": ms(latency["percentiles"]["p99"])}


LONG = 20.0  # seconds: the window of each gpt2-124m point
WORKLOADS = {  # name -> (path, model)
    "embeddings debug": ("/v1/embeddings", "debug"),
    "completions gpt2-124m": ("/v1/completions", "gpt2-124m"),
}


def run(seconds: float, concurrency: list[int], presets: list[str], kinds: list[str]) -> dict:
    work = tempfile.mkdtemp(prefix="strata-bench-serve-")
    try:
        models = make_models(work, presets)
        workloads = {k: v for k, v in WORKLOADS.items() if v[1] in models}
        results: dict = {}
        memory: dict = {}
        for kind in kinds:
            server = Server(kind, models, work)
            try:
                for name, (path, model) in workloads.items():
                    guidellm(server.port, path, model, models[model], 1, 1, work)  # warm: the model built, the path taken
                    # gpt2-124m's batches run for seconds: a longer window, so that several finish inside it
                    window = max(seconds, LONG) if model == "gpt2-124m" else seconds
                    for c in concurrency:
                        top = c == max(concurrency)
                        before = server.rss_mb() if top else None
                        mid: list[float] = []
                        timer = threading.Timer(window / 2, lambda m=mid, sv=server: m.append(sv.rss_mb())) if top else None
                        if timer:
                            timer.start()
                        point = guidellm(server.port, path, model, models[model], c, window, work)
                        if top:
                            timer.join()
                            # Overloaded all through the window: memory halfway through and at the end.
                            point.update(rss_mb_before=round(before, 1), rss_mb_mid=round(mid[0], 1),
                                         rss_mb_after=round(server.rss_mb(), 1))
                        results.setdefault(name, {}).setdefault(kind, []).append(point)
                        print(f"{kind:>12} {name:<22} c={c:<4} {point['rps']:>8.1f} req/s {point['tokens_per_s']:>9.1f} "
                              f"tok/s p50 {point['p50_ms']} ms p99 {point['p99_ms']} ms, {point['errored']} errored",
                              flush=True)
            finally:
                memory[kind] = server.stop()
                if memory[kind]:
                    print(f"{kind:>12} record: {memory[kind].get('by_status')}", flush=True)
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
    for kind in [k for k in results.get("embeddings debug", results.get("completions gpt2-124m", {})) if k != "plain"]:
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
    parser.add_argument("--concurrency", default="1,32,256", help="requests in flight, comma-separated")
    parser.add_argument("--presets", default="debug,gpt2-124m", help="the model shapes served")
    parser.add_argument("--kinds", default="plain,strata,strata-proxy", help="the servers measured: plain (the "
                        "baseline), strata (the default configuration), strata-proxy (--ingress proxy)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    kinds = args.kinds.split(",")
    if "plain" not in kinds or not set(kinds) <= {"plain", "strata", "strata-proxy"}:
        parser.error("--kinds: plain (the baseline) and any of strata, strata-proxy")
    out = run(args.seconds, concurrency, args.presets.split(","), kinds)
    t = out["targets"].get("strata", {})
    if args.json:
        print(json.dumps(out))
    print(f"strata serve / plain FastAPI: embeddings c=1 p50 +{t.get('embeddings_c1_p50_over_plain_ms')} ms, "
          f"completions gpt2-124m c=32 tokens/s x{t.get('completions_gpt2_c32_tokens_ratio')}, embeddings c=32 req/s "
          f"x{t.get('embeddings_c32_rps_ratio')}, p99/p50 {t.get('worst_p99_over_p50_c32')}, "
          f"memory x{t.get('memory_growth_at_top')}")
    return out


if __name__ == "__main__":
    main()
