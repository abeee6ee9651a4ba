"""The main job end to end on an embedded local Ray: preprocess -> train -> sweep -> sample, then the
loop back to tier 1: the next version's documents scored with the trained model and the worst filtered,
and last the trained model served behind OpenAI's API and called over HTTP.

Each stage runs as its real command line (`python -m ...  --json`), exactly as a
user or `ray job submit` would run it, and the demo reads each stage's JSON
summary. It imports none of the stage packages.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

from strata.commands.shell import Parser
from strata.data.storage import Storage, join


def demo_corpus(storage: Storage) -> list[str]:
    """Inputs that need no download: the standard library's top-level modules,
    plus damaged and duplicated files that show the rejects and dedup accounting."""
    # Outside the storage root (preprocessing refuses inputs that overlap it), in a fresh private folder
    # (mkdtemp: 0700, made by this call), so nothing planted in a shared temp dir is read or written.
    dirty = Path(tempfile.mkdtemp(prefix="strata-demo-inputs-"))
    (dirty / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e, written in Latin-1".encode("latin-1"))
    (dirty / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (dirty / "notes.jsonl").write_text('{"text": "A line of JSON with enough text to keep."}\n'
                                       '{"text": "truncated\n{"title": "no text field here"}\n')
    source = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()
    (dirty / "textwrap-copy.py").write_text(source)  # an exact duplicate
    (dirty / "textwrap-edited.py").write_text(source.replace("import re", "import re  # edited", 1))  # a near one
    return [os.path.join(sysconfig.get_paths()["stdlib"], "*.py"), str(dirty)]


def next_inputs() -> list[str]:
    """The next version's inputs: code like the first version's (the json package) and prose (the license),
    which a model trained on code scores worse."""
    stdlib = sysconfig.get_paths()["stdlib"]
    return [os.path.join(stdlib, "json", "*.py"), *[p for p in [os.path.join(stdlib, "LICENSE.txt")] if os.path.exists(p)]]


def shown(module: str, args) -> str:
    """A stage's command line as a shell would take it (a prompt with a space in it stays one argument)."""
    return shlex.join(["python", "-m", module, *args])


def stage(title: str, module: str, *args: str) -> dict:
    """Run one stage's CLI; its progress streams to the terminal, its JSON comes back."""
    print(f"\n=== {title}: {shown(module, args)}", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", module, *args, "--json"], stdout=subprocess.PIPE, text=True)
    last = ""
    for line in proc.stdout:  # stream progress; the JSON summary is the last line
        if last:
            print(last, end="", flush=True)
        last = line
    if proc.wait() != 0 or not last.strip():
        print(last, end="")
        raise SystemExit(f"demo stage {module} failed (exit {proc.returncode})")
    return json.loads(last)


def serve_stage(title: str, run: str) -> tuple[dict, list[dict]]:
    """Serve the trained run (`python -m infer serve`) on a free loopback port, call it as an OpenAI client
    would, then stop it with SIGTERM: its summary, and what the calls returned."""
    import signal
    import socket
    import threading
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ["serve", "--model", f"{run}@latest", "--port", str(port), "--name", f"{run}-serve"]
    print(f"\n=== {title}: {shown('infer', args)}", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "infer", *args, "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    up = threading.Event()

    def relay():  # its log lines to the terminal, and the moment it serves
        for line in proc.stderr:
            if line.startswith("["):
                print(line, end="", flush=True)
            if "Ctrl-C stops" in line:
                up.set()
    threading.Thread(target=relay, daemon=True).start()
    while not up.wait(0.5):
        if proc.poll() is not None:
            raise SystemExit(f"demo stage infer serve failed (exit {proc.returncode})")
    calls = []
    for path, body in (("/v1/completions", {"model": run, "prompt": "def ", "max_tokens": 48, "temperature": 0}),
                       ("/v1/completions", {"model": run, "prompt": ["import ", "class "], "max_tokens": 32,
                                            "temperature": 0.8, "seed": 1}),
                       ("/v1/embeddings", {"model": run, "input": ["def f(x):", "return x"]}),
                       ("/v1/chat/completions", {"model": run, "max_tokens": 32, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "Write a function."}]})):
        print(f"POST {path} {json.dumps(body)}", flush=True)
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            calls.append(json.loads(r.read()))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    if proc.returncode != 143:  # a server stopped by SIGTERM exits 128 + 15
        raise SystemExit(f"demo stage infer serve failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1]), calls


def _cost(summary: dict) -> str:
    return "unpriced" if summary.get("cost") is None else f"{summary['cost']:.4f}"


def _busy(summary: dict) -> str:
    return "-" if summary.get("cpu_busy") is None else f"{summary['cpu_busy']:.0%}"


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m strata demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
    parser.add_argument("--trials", type=int, default=8, help="sweep trials (default: 8)")
    args = parser.parse_args(argv)
    storage = Storage.from_env()
    os.environ["STRATA_STORAGE"] = storage.root  # the stages use the same root
    t0 = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    corpus = demo_corpus(storage)
    inputs = [a for path in corpus for a in ("--input", path)]
    # A dataset per demo run: a rerun over unchanged inputs into one dataset would (rightly) make no version.
    try:
        pre = stage("1/6 tier 1: preprocess", "pipelines.preprocess", *inputs, "--dataset", f"demo-{stamp}",
                    "--final")  # a one-off dataset: its last row padded, so every kept document is in it
    finally:
        shutil.rmtree(corpus[-1], ignore_errors=True)  # the damaged files' private folder
    dataset = f"{pre['dataset']}@{pre['version']}"
    cpus = str(os.cpu_count() or 1)
    tr = stage("2/6 tier 2: train", "train", "--dataset", dataset, "--preset", "debug",
               "--max-steps", str(args.steps), "--run", f"demo-{stamp}", "--cpus-per-worker", cpus)
    sw = stage("3/6 sweep", "tune", "--dataset", dataset, "--preset", "debug",
               "--num-samples", str(args.trials), "--sweep", f"demo-sweep-{stamp}")
    sm = stage("4/6 sample", "train.sample", "--run", tr["run"], "--prompt", "def ", "--tokens", "160",
               "--samples", "2")
    loop = stage("5/6 tier 1 again: the next version, scored with the trained model", "pipelines.preprocess",
                 *[a for path in next_inputs() for a in ("--input", path)], "--dataset", pre["dataset"], "--final",
                 "--quality-model", tr["run"], "--keep-fraction", "0.8")
    q = loop["stats"]["quality"]
    sv, calls = serve_stage("6/6 serve the trained model (OpenAI's API, Ray Serve)", tr["run"])

    d = pre["documents"]
    best = sw["best"]
    print(textwrap.dedent(f"""
        ======================== strata demo: summary ========================
        tier 1  {d['read']} documents read: {d['kept']} kept, {d['filtered']} filtered, {d['unpacked']} unpacked,
                {d['duplicate']} duplicate {pre['stats']['duplicate']}, {d['rejected']} rejected {pre['stats']['rejected_by_reason']}
                {pre['tokens']:,} tokens -> {pre['sequences']:,} packed rows in {pre['shards']} shards
        tier 2  {tr['steps']} steps, loss {tr['first_loss']:.3f} -> {tr['last_loss']:.3f} (validation {tr['val_loss']:.3f}),
                {tr['params'] / 1e6:.2f}M params, {tr['strategy'].upper()}, {tr['tokens_per_s']:,.0f} tokens/s,
                data wait {tr['data_wait']:.1%}, checkpoints {tr['checkpoint_blocked']:.1%} of wall time
        sweep   {sw['trials']} trials: {sw['completed']} completed, {sw['stopped_early']} stopped early by ASHA ({sw['iterations']} iterations),
                best {best['metric_name']} {best['metric']:.3f} with {json.dumps(best['config'])}
        loop    {pre['dataset']}@{loop['version']}: {q['documents']} new documents scored under {q['model']}, the best 80%
                kept (bits per byte <= {q['threshold']:.3f}): {q['filtered']} filtered:quality ({q['tokens_per_s']:,.0f} tokens/s scored)
        serve   {sv['requests']} requests ({sv['completion_tokens']} tokens generated), p50 {sv['p50_ms']:.0f} ms, p99 {sv['p99_ms']:.0f} ms,
                {sv['replica_hours']:.4f} replica-hours; completion of "def ": {json.dumps(calls[0]['choices'][0]['text'][:60])}
                embeddings: {len(calls[2]['data'])} vectors of {len(calls[2]['data'][0]['embedding'])} floats;
                chat ("Write a function."): {json.dumps(calls[3]['choices'][0]['message']['content'][:60])}
        cost    preprocess {_cost(pre)}, train {_cost(tr)}, sweep {_cost(sw)} for {pre['node_hours'] + tr['node_hours'] + sw['node_hours']:.3f} node-hours
                (prices.yaml charges 0 for the local node); CPU busy {_busy(pre)} / {_busy(tr)} / {_busy(sw)}
                (`.venv/bin/strata runs`; `.venv/bin/strata report NAME` writes an HTML report)
        outputs dataset    {pre['path']}
                checkpoint {tr['checkpoint']}
                sweep      {sw['path']} (best config: {join(sw['path'], 'best.json')})
        samples from the trained model (prompt "def "):"""))
    for text in sm["samples"]:
        print(textwrap.indent(text.strip()[:400], "    | "))
        print("    " + "-" * 60)
    from strata import ledger  # the trained model's whole cost: `.venv/bin/strata ledger RUN`

    print(textwrap.indent(ledger.text(ledger.model_ledger(tr["run"], storage=storage)), "    "))
    print(f"done in {time.time() - t0:.0f} s")
