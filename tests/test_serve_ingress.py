"""How requests reach `python -m infer serve` and what it refuses before it starts (--host, --ingress), and
the record of a serving no command waits on: a Serve config's application (`infer.serve:app`, as a
RayService deploys it)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from serving import exported

TOKEN = "s3cret-token-for-the-ingress-tests"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return exported(tmp_path_factory.mktemp("ingress-model") / "m1", seed=1)


@pytest.mark.serve
def test_listening_beyond_loopback_needs_a_token_and_the_ingress_what_it_needs(model, tmp_path):
    from conftest import REPO

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "infer", "serve", "--model", f"m1={model}", *args],
                              cwd=REPO, env={**os.environ, "STRATA_STORAGE": str(tmp_path)}, capture_output=True,
                              text=True, timeout=120)
    out = serve("--host", "0.0.0.0")
    assert out.returncode == 1 and "--host 0.0.0.0 listens beyond this machine" in out.stderr
    out = serve("--host", "0.0.0.0", "--token-sha256", "abc")
    assert out.returncode == 1 and "64 hex digits" in out.stderr
    (tmp_path / "short").write_text("short\n")
    out = serve("--host", "0.0.0.0", "--token-file", str(tmp_path / "short"))
    assert out.returncode == 1 and "at least 16 characters" in out.stderr
    out = serve("--model", "m1=/no/such/model")
    assert out.returncode == 2 and "two models are named 'm1'" in out.stderr
    out = serve("--models-per-replica", "0")
    assert out.returncode == 2 and "--models-per-replica must be >= 1" in out.stderr
    # Ray's HAProxy mode binds every interface: only with a token, and only where haproxy is installed.
    out = serve("--ingress", "ha-proxy")
    assert out.returncode == 1 and "--ingress ha-proxy listens on every interface" in out.stderr
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    out = serve("--ingress", "ha-proxy", "--token-sha256", digest, "--address", "127.0.0.1:1")
    assert out.returncode == 1 and "start its Ray with RAY_SERVE_ENABLE_HA_PROXY=1" in out.stderr
    if not shutil.which("haproxy"):
        out = serve("--ingress", "ha-proxy", "--token-sha256", digest)
        assert out.returncode == 1 and "needs the haproxy program on PATH" in out.stderr
    # Direct ingress puts one replica on the port: not with several, nor on a cluster started elsewhere.
    out = serve("--ingress", "direct", "--replicas", "2")
    assert out.returncode == 1 and "several ingress replicas cannot share --port" in out.stderr
    out = serve("--ingress", "direct", "--address", "127.0.0.1:1")
    assert out.returncode == 1 and "a cluster this command joins" in out.stderr
    assert not (tmp_path / "servings").exists()  # nothing started, nothing recorded


def _post(url: str, body: dict, token: str | None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.ray
@pytest.mark.serve
def test_a_serve_config_application_writes_each_replica_record_as_it_stops(model, local_ray, tmp_path):
    """The RayService path: no command waits on the application, so each ingress replica writes its own
    record, every answer in it (401s included), where `strata runs` reads records."""
    from conftest import _free_port
    from ray import serve

    from infer.serve import app
    from strata.accounting.records import list_records
    from strata.data.storage import Storage

    root = tmp_path / "storage"
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(app({"models": {"m1": model}, "storage": str(root), "name": "rs",
                       "token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest()}), name="rs", route_prefix="/",
                  blocking=False)
        url = f"http://127.0.0.1:{port}/v1/completions"
        from conftest import wait_for

        wait_for(lambda: serve.status().applications["rs"].status == "RUNNING", "the application running", 120)
        answers = [_post(url, {"model": "m1", "prompt": f"p{i}", "max_tokens": 3 + i}, TOKEN) for i in range(3)]
        assert [s for s, _ in answers] == [200] * 3
        assert _post(url, {"model": "m1", "prompt": "x"}, None)[0] == 401
        serve.delete("rs")
    finally:
        serve.shutdown()
    made = sum(out["usage"]["completion_tokens"] for _, out in answers)
    prompt = sum(out["usage"]["prompt_tokens"] for _, out in answers)
    written = list((root / "servings" / "rs" / "replicas").glob("*.json"))
    assert len(written) == 1
    record = json.loads(written[0].read_text())
    assert record["kind"] == "serve" and record["figures"]["by_status"] == {"200": 3, "401": 1}
    assert (record["figures"]["completion_tokens"], record["figures"]["prompt_tokens"]) == (made, prompt)
    assert 0 < record["figures"]["replica_hours"] < record["seconds"] / 3600 + 1e-3
    assert [r["name"] for r in list_records(Storage(str(root))) if r["kind"] == "serve"] == ["rs"]
