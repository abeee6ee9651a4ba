"""Helpers for the serving tests: small models as training writes them, and `python -m infer serve` run as a
user runs it (its own embedded Ray, or a cluster's address), stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

from conftest import REPO, _free_port, write_checkpoint


def model_config(seq_len: int = 64, **shape):
    from train.model import preset

    return preset("debug", **{"n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": seq_len, **shape})


def exported(root, seed: int, seq_len: int = 64, **shape) -> str:
    """A small random model (byte tokenizer) exported by train.export: its directory."""
    import torch

    from strata.data.tokenizer import ByteTokenizer
    from train.export import export
    from train.model import GPT

    os.makedirs(root, exist_ok=True)
    cfg = model_config(seq_len, **shape)
    torch.manual_seed(seed)
    ckpt = write_checkpoint(os.path.join(root, "checkpoint"), GPT(cfg), 5,
                            {"model_config": asdict(cfg), "tokenizer": asdict(ByteTokenizer().info())})
    export(ckpt, os.path.join(root, "hf"))
    return os.path.join(root, "hf")


def commit_checkpoint(run_dir: str, step: int, seed: int) -> None:
    """A checkpoint at `step` in a training run's directory, written by training's checkpointer and then
    registered as Ray Train registers one (its snapshot lists it): a commit."""
    import torch

    from strata.data.tokenizer import ByteTokenizer
    from train.checkpoint import SNAPSHOT, dir_name
    from train.model import GPT

    cfg = model_config()
    torch.manual_seed(seed)
    name = dir_name(step)
    write_checkpoint(os.path.join(run_dir, name), GPT(cfg), step,
                     {"model_config": asdict(cfg), "tokenizer": asdict(ByteTokenizer().info())})
    path = os.path.join(run_dir, SNAPSHOT)
    state = json.loads(Path(path).read_text()) if os.path.exists(path) else {"checkpoint_results": []}
    state["checkpoint_results"].append({"checkpoint_dir_name": name})
    state["latest_checkpoint_result"] = {"checkpoint_dir_name": name}
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)


class Server:
    """`python -m infer serve ARGS` on a free port; `call` posts JSON and returns (status, body, headers)."""

    def __init__(self, args: list[str], storage: str, token: str | None = None, env: dict | None = None):
        self.port = _free_port()
        self.token = token
        self.log = open(os.path.join(storage, f"serve-{self.port}.log"), "w+")  # noqa: SIM115 - the server's life
        self.env = {**os.environ, "STRATA_STORAGE": storage, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "infer", "serve", "--port", str(self.port), "--json",
                                      *args], cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 240
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited {self.proc.returncode}: {self.output()[-3000:]}")
            try:  # once every deployment is up (the command says so), the ingress answers
                if "Ctrl-C stops" in self.output() and self.call("GET", "/healthz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.kill()
        raise TimeoutError(f"the server did not answer: {self.output()[-3000:]}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def call(self, method: str, path: str, body=None, *, token: str | None = "same", raw: bytes | None = None,
             timeout: float = 120) -> tuple[int, dict | str, dict]:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        token = self.token if token == "same" else token
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                text, status, headers = r.read().decode(), r.status, {k.lower(): v for k, v in r.headers.items()}
        except urllib.error.HTTPError as e:
            text, status, headers = e.read().decode(), e.code, {k.lower(): v for k, v in e.headers.items()}
        try:
            return status, json.loads(text), headers
        except json.JSONDecodeError:
            return status, text, headers

    def stop(self, timeout: float = 120, sig: int = signal.SIGTERM, group: bool = False) -> tuple[int, dict | None]:
        """SIGTERM, as Kubernetes or a scheduler stops it (or `sig`: SIGINT, a terminal's Ctrl-C), to the process
        or to its whole process group (`group`, as systemd and container runtimes send it): its exit code and
        its summary (--json)."""
        if group:
            os.killpg(self.proc.pid, sig)  # it leads its group (start_new_session)
        else:
            self.proc.send_signal(sig)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()  # it did not stop: the test fails, and leaves no server behind
            raise
        lines = [line for line in out.strip().splitlines() if line.startswith("{")]
        return self.proc.returncode, json.loads(lines[-1]) if lines else None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
