"""cluster.yaml and platform/, checked offline: Ray's own validation, KubeRay's CRD schemas
(strict: an unknown or misspelt field is an error), and the rules strata relies on."""

import copy
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from ray._private.label_utils import validate_node_label_syntax

from strata.cluster import tiers
from tune.config import REFERENCE_CONCURRENT, SweepConfig

ROOT = Path(REPO)
SCHEMAS = ROOT.parent / "shared" / "schemas" / "kuberay"
K8S = ROOT / "platform" / "k8s"
CRDS = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml", "RayCronJob": "ray.io_raycronjobs.yaml",
        "RayService": "ray.io_rayservices.yaml"}
MODULES = {"pipelines.preprocess", "train", "tune"}


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def cluster():
    return _load(ROOT / "cluster.yaml")


@pytest.fixture(scope="module")
def manifests():
    return {p.name: _load(p) for p in sorted(K8S.glob("*.yaml"))}


def test_cluster_yaml_follows_our_rules(cluster):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(cluster))
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert head["resources"].get("CPU") == 0 and not tiers.tiers_of(head["labels"]), "the head runs no work"
    # It announces exactly the tiers the autoscaler can start (strata submit lets their jobs through).
    scaled = {t for name, n in types.items() if name != cluster["head_node_type"] and n.get("max_workers")
              for t in tiers.tiers_of(n.get("labels") or {})}
    assert tiers.autoscaled_tiers(head["labels"]) == scaled == set(tiers.Tier)
    assert set(head["labels"]) == {tiers.autoscale_key(t) for t in scaled}
    assert "InstanceMarketOptions" not in head["node_config"], "the head is on-demand"
    for name, t in types.items():
        assert t["resources"] and all(isinstance(v, int) for v in t["resources"].values()), name
        labels = t.get("labels") or {}
        validate_node_label_syntax(labels)
        assert not any(k.startswith("ray.io/") for k in labels), f"{name}: ray.io/ is Ray's prefix"
        assert t["node_config"].get("SecurityGroupIds"), f"{name}: supply security groups (Ray's own opens SSH)"
        if name != cluster["head_node_type"]:
            assert t.get("idle_timeout_s", 0) > 0, f"{name}: no idle timeout"
    assert cluster["idle_timeout_minutes"] > 0
    assert cluster["max_workers"] >= sum(t.get("max_workers", 0) for t in types.values())
    for rule in (cluster["provider"].get("security_group") or {}).get("IpPermissions", []):
        opens_ssh = rule.get("FromPort", 0) <= 22 <= rule.get("ToPort", 65535)
        assert not (opens_ssh and any(r.get("CidrIp") == "0.0.0.0/0" for r in rule.get("IpRanges", [])))
    spot = [t for t in types.values() if tiers.Tier.SPOT in tiers.tiers_of(t.get("labels") or {})]
    markets = [t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") for t in spot]
    assert "spot" in markets and None in markets, "spot types, plus an on-demand fallback"
    fallback = next(t for t in spot if "InstanceMarketOptions" not in t["node_config"])
    assert fallback["priority"] < max(t.get("priority", 0) for t in spot), "the fallback ranks below spot"
    # Spot capacity alone (the fallback aside) holds the reference sweep's trials at once.
    per_trial = SweepConfig().cpus_per_trial
    slots = sum(t["max_workers"] * int(t["resources"]["CPU"] // per_trial) for t in spot if t is not fallback)
    assert slots >= REFERENCE_CONCURRENT, slots
    starts = cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]
    for cmd in (c for c in starts if "ray start" in c):
        assert "RAY_AUTH_MODE=token" in cmd, f"token auth off in: {cmd}"
    from pipelines.driver import WORKER_MODULES

    worker_start = next(c for c in cluster["worker_start_ray_commands"] if "ray start" in c)
    assert f"RAY_preload_python_modules={','.join(WORKER_MODULES)} " in worker_start, "workers preload tier 1's modules"
    from strata.cluster.connect import WORKERS_PER_CPU

    assert f"RAY_num_workers_soft_limit=$(({WORKERS_PER_CPU} * $(nproc))) " in worker_start, "idle workers outlive actors"
    head_start = next(c for c in cluster["head_start_ray_commands"] if "ray start" in c)
    host = re.search(r"--dashboard-host[= ](\S+)", head_start)
    assert host and host.group(1) in ("127.0.0.1", "localhost"), "the dashboard stays on the head's localhost"
    assert any("pip install" in c and "~/strata" in c for c in cluster["setup_commands"])
    images = {cluster["docker"]["image"]} | {t["docker"]["worker_image"] for t in types.values() if "docker" in t}
    assert images == set(_images().values())


def _images() -> dict:
    """{'cpu': tag, 'gpu': tag} from the Dockerfiles' build comments."""
    out = {}
    for kind in ("cpu", "gpu"):
        text = (ROOT / "platform" / "docker" / f"{kind}.Dockerfile").read_text()
        out[kind] = re.search(r"docker build .* -t (\S+) \.", text).group(1)
    return out


def test_ray_up_copies_the_code_and_not_the_working_tree(cluster):
    """`ray up` syncs file_mounts with rsync: only the packages and the files the commands read, by name."""
    allowed = {"./strata", "./pipelines", "./train", "./tune", "./infer", "./pyproject.toml", "./README.md", "./cluster.yaml",
               "./prices.yaml"}
    mounts = {dst: src for dst, src in cluster["file_mounts"].items() if not dst.startswith("~/.strata/")}
    assert set(mounts.values()) == allowed, "a mount of the whole tree would copy .env, .git and keys to every node"
    assert all(dst == "~/strata/" + src[2:] for dst, src in mounts.items())
    assert cluster["file_mounts"]["~/.strata/ray-token"] == "~/.strata/ray-token"
    assert ".*" in cluster["rsync_exclude"], "dotfiles inside the packages stay behind"


def test_both_images_carry_the_same_code_and_pinned_deps():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [line.strip() for line in (ROOT / "platform" / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert all("==" in p for p in pins), "every image dependency is pinned"
    pinned = {re.split(r"[\[=]", p)[0].lower() for p in pins}
    declared = {re.split(r"[\[<>=~ ]", d)[0].lower() for d in project["dependencies"] + project["optional-dependencies"]["sweeps"]}
    assert declared - {"torch"} <= pinned, f"not pinned for the images: {declared - {'torch'} - pinned}"
    ray_pin = next(p for p in pins if p.startswith("ray["))
    assert re.search(r"ray\[[^\]]+\]==2\.60\.\*", " ".join(project["dependencies"]))
    assert ray_pin.endswith("==2.60.0")
    makefile_torch = re.search(r"TORCH_SPEC \?= torch==(\S+)", (ROOT / "Makefile").read_text()).group(1)
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"])
    for kind in ("cpu", "gpu"):
        text = (ROOT / "platform" / "docker" / f"{kind}.Dockerfile").read_text()
        assert re.search(rf"^FROM rayproject/ray:2\.60\.0-py311-{kind}$", text, re.M), kind
        assert re.search(rf"ARG TORCH_VERSION={re.escape(makefile_torch)}$", text, re.M), kind
        assert "-r platform/requirements.txt" in text and "--no-deps -e ." in text
        copied = set(re.findall(r"^COPY --chown=ray (\w+) \1$", text, re.M))
        assert {p.rstrip("*") for p in packages} == copied, f"{kind} image copies {copied}"


def _strict(schema):
    """A CRD's openAPIV3Schema as strict JSON Schema: x-kubernetes-* dropped, unknown fields refused."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def _validator(kind: str):
    jsonschema = pytest.importorskip("jsonschema")
    crd = _load(SCHEMAS / CRDS[kind])
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


@pytest.mark.skipif(not SCHEMAS.is_dir(), reason="KubeRay CRD schemas (../shared/schemas/kuberay) not present")
def test_kuberay_manifests_validate_strictly_against_the_crds(manifests):
    ray_kinds = {name: m for name, m in manifests.items() if m["kind"] in CRDS}
    assert {m["kind"] for m in ray_kinds.values()} == set(CRDS)
    for name, m in ray_kinds.items():
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in _validator(m["kind"]).iter_errors(m)]
        assert not errors, f"{name}: {errors}"
    # The check has teeth: a misspelt field is refused.
    bad = {**manifests["raycluster.yaml"], "spec": {**manifests["raycluster.yaml"]["spec"], "authOption": {}}}
    assert any("authOption" in e.message for e in _validator("RayCluster").iter_errors(bad))


def test_the_kuberay_cluster_matches_cluster_yaml(cluster, manifests):
    rc = manifests["raycluster.yaml"]
    spec = rc["spec"]
    assert spec["authOptions"]["mode"] == "token"
    assert spec["rayVersion"] == "2.60.0"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"  # the job API on loopback
    assert spec["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
    types = cluster["available_node_types"]
    assert spec["headGroupSpec"]["labels"] == types[cluster["head_node_type"]]["labels"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == set(types) - {cluster["head_node_type"]}
    images = _images()
    for name, g in groups.items():
        t = types[name]
        assert g["labels"] == t["labels"], name
        assert g["maxReplicas"] == t["max_workers"] and g.get("priority", 0) == t.get("priority", 0), name
        container = g["template"]["spec"]["containers"][0]
        gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
        assert gpus == t["resources"].get("GPU", 0), name
        assert container["image"] == images["gpu" if gpus else "cpu"], name
        market = g["template"]["spec"].get("nodeSelector", {}).get("karpenter.sh/capacity-type")
        is_spot = t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"
        assert (market == "spot") == is_spot, name


def _help(module: str) -> str:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    return subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=True).stdout


def _check_command(argv: list[str], helps: dict) -> str:
    """argv = python -m MODULE ARGS: a real module, and every flag one its CLI has."""
    assert argv[:2] == ["python", "-m"] and argv[2] in MODULES | {"strata"}, argv
    module = argv[2]
    if module == "strata":  # strata submit KIND [opts] -- ARGS
        assert argv[3] == "submit"
        kind = argv[4]
        rest = argv[argv.index("--") + 1:]
        module = {"preprocess": "pipelines.preprocess", "train": "train", "tune": "tune"}[kind]
        argv = ["python", "-m", module, *rest]
    text = helps.setdefault(module, _help(module))
    for flag in (a for a in argv[3:] if a.startswith("--")):
        assert re.search(rf"{re.escape(flag)}\b", text), f"python -m {module} has no {flag}"
    return module


def test_jobs_and_schedules_run_real_commands_on_the_strata_cluster(manifests):
    import shlex

    helps: dict = {}
    secret = manifests["raycluster.yaml"]["spec"]["authOptions"]["secretName"]
    seen = set()
    for fname, m in manifests.items():
        if m["kind"] == "RayJob":
            job = m["spec"]
        elif m["kind"] == "RayCronJob":
            job = m["spec"]["jobTemplate"]
        else:
            continue
        # Its own cluster, the strata cluster's spec; the submitter beside the head, on its loopback: the token
        # never crosses the pod network.
        assert job["submissionMode"] == "SidecarMode" and "clusterSelector" not in job, fname
        cluster_spec = copy.deepcopy(job["rayClusterSpec"])
        assert cluster_spec["headGroupSpec"]["template"]["spec"].pop("restartPolicy") == "Never", fname
        assert cluster_spec == manifests["raycluster.yaml"]["spec"], f"{fname}: not raycluster.yaml's cluster"
        assert "jobId" not in job, f"{fname}: a fixed jobId makes the second run fail"
        seen.add(_check_command(shlex.split(job["entrypoint"]), helps))
        assert "STRATA_STORAGE" in yaml.safe_load(job["runtimeEnvYAML"])["env_vars"], fname
    assert seen == MODULES
    cron = manifests["cronjob-preprocess.yaml"]
    assert cron["apiVersion"] == "batch/v1" and cron["kind"] == "CronJob"
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == _images()["cpu"]
    assert _check_command(container["command"], helps) == "pipelines.preprocess"
    assert "--slot" in container["command"], "a scheduled submission is idempotent per slot"
    token = next(e for e in container["env"] if e["name"] == "RAY_AUTH_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == secret
    # The token goes to the pod's loopback, forwarded to the head through the API server, never plain HTTP.
    from strata.commands.submit import check_address

    check_address(container["command"][container["command"].index("--address") + 1])
    [sidecar] = pod["initContainers"]
    assert sidecar["restartPolicy"] == "Always" and sidecar["command"][:2] == ["kubectl", "port-forward"]
    rbac = {i["kind"]: i for i in manifests["cronjob-rbac.yaml"]["items"]}
    assert pod["serviceAccountName"] == rbac["ServiceAccount"]["metadata"]["name"]
    assert {"pods/portforward"} <= {r for rule in rbac["Role"]["rules"] for r in rule["resources"]}


def test_the_rayservice_serves_strata_models_on_the_strata_cluster(manifests, monkeypatch):
    """Its cluster is raycluster.yaml's plus the serve port on the cpu workers; its Serve config passes Ray
    Serve's own schema, and the application builds from its args (once its placeholder digest is replaced)."""
    import hashlib

    from ray.serve.schema import ServeDeploySchema

    svc = manifests["rayservice.yaml"]["spec"]
    cluster_spec = copy.deepcopy(svc["rayClusterConfig"])
    served = []
    for g in cluster_spec["workerGroupSpecs"]:
        container = g["template"]["spec"]["containers"][0]
        if {"containerPort": 8000, "name": "serve"} in container.get("ports", []):
            served.append(g["labels"])
            container["ports"].remove({"containerPort": 8000, "name": "serve"})
            if not container["ports"]:
                del container["ports"]
    assert served and all(labels.get("strata.io/cpu") == "true" for labels in served)
    assert cluster_spec == manifests["raycluster.yaml"]["spec"]
    assert svc["excludeHeadPodFromServeSvc"] is True  # the head runs no work
    config = ServeDeploySchema(**yaml.safe_load(svc["serveConfigV2"]))
    [application] = config.applications
    assert application.import_path == "infer.serve:app" and config.http_options.port == 8000
    from infer.serve import ServeConfig, app

    args = copy.deepcopy(application.args)
    ServeConfig(**args["config"])  # every field is one of the command's
    with pytest.raises(ValueError, match="placeholder"):
        app(args)
    args["token_sha256"] = hashlib.sha256(b"a token").hexdigest()
    built = app(args)
    assert type(built).__name__ == "Application"
    with pytest.raises(ValueError, match="unknown args"):
        app({**args, "token": "plain"})


def test_gpu_nodes_get_shared_memory_and_their_network_interface(cluster, manifests):
    """NCCL needs a memory-backed /dev/shm far above a container's 64 MiB default, and NCCL and Gloo
    must talk on the node's NIC, not on docker0 or loopback."""
    gpu_types = {n: t for n, t in cluster["available_node_types"].items() if t["resources"].get("GPU")}
    assert gpu_types
    for name, t in gpu_types.items():
        opts = " ".join(t["docker"]["worker_run_options"])
        assert "--shm-size=" in opts and "NCCL_SOCKET_IFNAME=" in opts and "GLOO_SOCKET_IFNAME=" in opts, name
    groups = manifests["raycluster.yaml"]["spec"]["workerGroupSpecs"]
    gpu_groups = [g for g in groups
                  if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]]
    assert {g["groupName"] for g in gpu_groups} == set(gpu_types)
    for g in gpu_groups:
        pod = g["template"]["spec"]
        shm = {v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"}
        container = pod["containers"][0]
        assert any(m["mountPath"] == "/dev/shm" and m["name"] in shm for m in container["volumeMounts"]), g
        assert {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} <= {e["name"] for e in container["env"]}, g


def test_the_slurm_script_starts_the_same_cluster_as_cluster_yaml(cluster):
    script = ROOT / "platform" / "slurm" / "strata.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    # The labels it builds are strata.cluster.tiers' labels, for tiers that exist.
    assert f"{tiers.LABEL_PREFIX}/${{tier}}={tiers.LABEL_VALUE}" in text
    default = re.search(r"STRATA_TIERS=\$\{STRATA_TIERS:-([a-z,]+)\}", text).group(1)
    assert {tiers.Tier(t) for t in default.split(",")} == {tiers.Tier.CPU, tiers.Tier.GPU}
    # Token auth and the preloaded modules are those of cluster.yaml's ray start lines.
    from pipelines.driver import WORKER_MODULES

    assert "export RAY_AUTH_MODE=token" in text
    assert "RAY_AUTH_TOKEN_PATH:-$HOME/.strata/ray-token" in text
    assert f"export RAY_preload_python_modules={','.join(WORKER_MODULES)}" in text
    from strata.cluster.connect import WORKERS_PER_CPU

    assert f"export RAY_num_workers_soft_limit=$(({WORKERS_PER_CPU} * ${{SLURM_CPUS_ON_NODE:-$(nproc)}}))" in text
    head_line = next(c for c in cluster["head_start_ray_commands"] if "ray start" in c)
    worker_line = next(c for c in cluster["worker_start_ray_commands"] if "ray start" in c)
    assert "RAY_AUTH_TOKEN_PATH=~/.strata/ray-token" in head_line and "RAY_AUTH_MODE=token" in worker_line
    port = re.search(r"--port=(\d+)", head_line).group(1)
    assert f"PORT=${{STRATA_RAY_PORT:-{port}}}" in text
    starts = [ln.strip() for ln in text.splitlines() if "ray start" in ln and not ln.lstrip().startswith("#")]
    head, workers = [s for s in starts if "--head" in s], [s for s in starts if "--head" not in s]
    assert len(head) == 1 and len(workers) == 1
    for flag in ("--head", '--port="$PORT"', "--dashboard-host=127.0.0.1"):
        assert flag in head[0]
    assert "--dashboard-host=127.0.0.1" in head_line
    assert '--address="$RAY_ADDRESS"' in workers[0] and '--labels="$labels"' in workers[0]
    assert "--address=$RAY_HEAD_IP:6379" in worker_line
    # The head runs no work on a multi-node allocation, as cluster.yaml's head (CPU 0).
    assert "--num-cpus=0 --num-gpus=0" in text and cluster["available_node_types"][cluster["head_node_type"]][
        "resources"]["CPU"] == 0
    # Ray stops at the end whatever the driver did; the driver is the given command.
    assert "trap stop_ray EXIT" in text and text.rstrip().endswith('"$@"')


def _pod_specs(doc: dict) -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod a KubeRay manifest starts: its cluster's head and worker groups."""
    spec = doc.get("spec") or {}
    cluster = spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or (
        spec.get("jobTemplate") or {}).get("rayClusterSpec") or (spec if "headGroupSpec" in spec else None)
    if cluster is None:
        return []
    return [("head", cluster["headGroupSpec"]["template"]["spec"])] + [
        (g["groupName"], g["template"]["spec"]) for g in cluster["workerGroupSpecs"]]


def test_every_pod_of_every_cluster_reads_the_one_signing_key(cluster, manifests):
    """Issue 57, 3: no pod had a key, so each minted its own: the RayService refused every checkpoint the RayJob
    trained. Every pod, head and workers, of every manifest mounts the one Secret and names it in
    STRATA_SIGNING_KEY_FILE; cluster.yaml mounts the same file on every node; the Slurm script exports it."""
    secrets, paths, pods = set(), set(), 0
    for fname, doc in manifests.items():
        for where, pod in _pod_specs(doc):
            pods += 1
            vols = {v["name"]: v for v in pod.get("volumes", [])}
            [container] = pod["containers"]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert "STRATA_SIGNING_KEY" not in env, f"{fname} {where}: the secret itself in a pod's env"
            key_file = env.get("STRATA_SIGNING_KEY_FILE")
            mounts = [m for m in container.get("volumeMounts", []) if key_file and key_file.startswith(m["mountPath"])]
            assert key_file and len(mounts) == 1, f"{fname} {where}: no signing key file"
            vol = vols[mounts[0]["name"]]
            assert mounts[0].get("readOnly") and vol["secret"]["defaultMode"] & 0o007 == 0, f"{fname} {where}"
            secrets.add(vol["secret"]["secretName"])
            paths.add(key_file)
    assert pods >= 6 * 6 and len(secrets) == 1 and len(paths) == 1, (secrets, paths)
    docker_env = " ".join(cluster["docker"]["run_options"])
    assert "-e STRATA_SIGNING_KEY_FILE=/home/ray/.strata/signing-key" in docker_env
    assert cluster["file_mounts"]["~/.strata/signing-key"] == "~/.strata/signing-key"
    assert not any("STRATA_SIGNING_KEY=" in c for c in cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"])
    sbatch = (ROOT / "platform" / "slurm" / "strata.sbatch").read_text()
    assert "export STRATA_SIGNING_KEY_FILE=${STRATA_SIGNING_KEY_FILE:-$HOME/.strata/signing-key}" in sbatch
    runtime = yaml.safe_load((ROOT / "platform" / "runtime-env.yaml").read_text())
    assert "STRATA_SIGNING_KEY" not in (runtime.get("env_vars") or {})


def test_every_node_of_every_cluster_starts_with_the_network_settings(cluster, manifests):
    """The settings tests/hosts.py measured a cut-off host with are the ones a real cluster's nodes get:
    cluster.yaml's start commands, the images KubeRay's pods run, the Slurm script."""
    from hosts import ray_network_env

    def settings(text: str) -> dict:
        return dict(re.findall(r"(RAY_grpc_\w+)=(\S+)", text))

    want = ray_network_env()
    assert want, "platform/ray-network.env sets nothing"
    starts = [c for c in cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2
    for command in starts:
        assert settings(command) == want, command
    images = set()
    for doc in manifests.values():
        images |= set(re.findall(r"image: (strata/strata-\w+):", yaml.safe_dump(doc)))
    assert images == {"strata/strata-cpu", "strata/strata-gpu"}, images  # every pod runs one of the two images
    for kind in ("cpu", "gpu"):
        text = (ROOT / "platform" / "docker" / f"{kind}.Dockerfile").read_text()
        assert settings("\n".join(re.findall(r"^ENV .*$", text, re.M))) == want, kind
    sbatch = (ROOT / "platform" / "slurm" / "strata.sbatch").read_text()
    assert settings("\n".join(re.findall(r"^export .*$", sbatch, re.M))) == want
