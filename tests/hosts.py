"""A Ray cluster of hosts on one machine: each host a Linux network namespace with its own address on one
bridge, so the head, the workers, the S3 server and the laptop talk over a network that can be cut.

    python tests/hosts.py            # `make hosts`: start it, say how to use it, tear it down on Ctrl-C

Layout (cluster.yaml's node types, smaller): `head` (no CPUs), `cpu-a`/`cpu-b` (cpu tier), `spot`,
`gpu-a`/`gpu-b` (gpu-labelled, no GPU), `s3` (moto's S3 server), `laptop` (reaches only the head's job
API, port 8265, its serving port, 8000, and the S3 server). Addresses are in 198.18.0.0/24 (a range
reserved for tests); the bridge lives in a namespace of its own and nothing routes off it. Each host has
its own hostname and process table (`Host.boot`), and an /etc/hosts naming every host.

Faults are network ones: `cut`/`heal` take a host's link down and up (the host's processes live on, cut
off, as behind a failed switch), `block`/`unblock` keep a host from one address while it reaches the rest
(asymmetric reachability), `slow_storage` adds latency and loss between everyone and the S3 server, and
`replace` brings a host back as a new node. Reachability rules are routes and policy routes (`only`), and
latency and loss a proxy of our own in front of the S3 server (tests/slowlink.py): this kernel has no
netem and no tc actions, and the machine no iptables.

Ray here binds where it must: every address it announces is its host's (`--node-ip-address`), the
dashboard and the S3 server bind their host's address only; Ray's core (GCS, raylets, workers) listens
on every interface of its host, which inside a namespace is that host's one address and loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from strata.cluster.procs import cmdline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
SUBNET = "198.18.0"
GCS_PORT, DASHBOARD_PORT, SERVE_PORT, S3_PORT = 6379, 8265, 8000, 9000
MOTO_PORT = 9001  # the S3 server itself, behind the link's proxy (tests/slowlink.py) on S3_PORT
# name: (last octet, Ray node type in cluster.yaml or None, CPUs)
LAYOUT = {
    "head": (1, "head", 0), "s3": (2, None, 0), "laptop": (3, None, 0),
    "cpu-a": (11, "cpu", 1), "cpu-b": (12, "cpu", 1), "spot": (21, "spot", 2),
    "gpu-a": (31, "gpu-1x", 1), "gpu-b": (32, "gpu-1x", 1),
}
# Ray's defaults would take minutes to notice a host that went silent (gRPC keepalive 5 min); these are the
# settings strata's cluster.yaml starts every node with (platform/ray-network.env), read from one place.
NETWORK_ENV_FILE = os.path.join(REPO, "platform", "ray-network.env")


def ray_network_env() -> dict:
    env = {}
    with open(NETWORK_ENV_FILE) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                key, value = line.split("=", 1)
                env[key] = value
    return env


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def missing() -> str | None:
    """Why a cluster of hosts cannot start here, in one line, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (this user is not)"
    for tool in ("ip", "unshare", "nsenter"):
        if not shutil.which(tool):
            return f"`{tool}` is not installed"
    probe = f"stprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    link: str
    """The host's veth end on the bridge: taking it down cuts the host off."""
    net: Net
    tmp: str
    """The host's own directory: its Ray's temp dir is in it."""
    procs: list = field(default_factory=list)

    def boot(self) -> None:
        """The host's init: its own hostname (leases and logs name hosts by it) and process table, as a real
        host has. A Ray driver finds its node among the raylets it sees in the process table: seeing every
        host's, a driver on a worker host took the head's for its own. Every command on the host joins
        these namespaces; when the init ends, the kernel ends what is left in them. The file system stays
        the machine's (the repository and its environment may be anywhere, /tmp included): each host's Ray
        keeps its files in a directory of its own (`tmp`)."""
        self.init = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--pid", "--fork", "--mount-proc", "--kill-child",
             "sh", "-c", 'hostname "$0" && exec sleep infinity', self.name],
            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 30
        while True:  # the namespaces' first process: the child of unshare, once it sleeps
            kids = _children(self.init.pid)
            if kids and "sleep" in cmdline(kids[0]):
                self.pid1 = kids[0]
                return
            if self.init.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"host {self.name} did not boot (unshare exited {self.init.poll()})")
            time.sleep(0.05)

    def argv(self, argv: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.pid1), "--net", "--uts", "--pid", "--mount", "--", *argv]

    def popen(self, argv: list[str], env: dict, log: str) -> subprocess.Popen:
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.argv(argv), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], env: dict, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), env=env, capture_output=True, text=True, cwd=REPO,
                              timeout=timeout, **kw)

    def cut(self) -> None:
        _ip("-n", self.net.switch, "link", "set", self.link, "down")

    def heal(self) -> None:
        _ip("-n", self.net.switch, "link", "set", self.link, "up")

    def block(self, ip: str) -> None:
        """This host can no longer reach `ip` (nor answer it): a security group or route gone wrong."""
        _ip("-n", self.ns, "route", "add", "prohibit", f"{ip}/32")

    def unblock(self, ip: str) -> None:
        _ip("-n", self.ns, "route", "del", "prohibit", f"{ip}/32", check=False)

    def only(self, allowed: list[tuple[str, int | None]]) -> None:
        """This host reaches only these (address, TCP port or None for any) on the bridge."""
        for i, (ip, port) in enumerate(allowed):
            sel = ["ipproto", "tcp", "dport", str(port)] if port else []
            _ip("-n", self.ns, "rule", "add", "to", f"{ip}/32", *sel, "table", "main", "priority", str(100 + i))
        _ip("-n", self.ns, "rule", "add", "to", f"{SUBNET}.0/24", "prohibit", "priority", "900")

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to what this host's processes are, then SIGKILL to their groups after `timeout`."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.time()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.procs.clear()
        if getattr(self, "init", None) is not None:  # its init: the kernel ends the rest of the host
            self.init.kill()
            self.init.wait()
        for pid in _ip("netns", "pids", self.ns, check=False).stdout.split():  # anything left in the namespace
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)


class Net:
    """Namespaces on one bridge; the bridge in a namespace of its own (the machine's own stack is untouched)."""

    def __init__(self, workdir: str, tag: str | None = None):
        self.workdir = workdir
        self.tag = tag or f"st{secrets.token_hex(2)}"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def add(self, name: str, octet: int) -> Host:
        ns, ip = f"{self.tag}-{name}", f"{SUBNET}.{octet}"
        host_end, switch_end = f"{self.tag}{octet}h", f"{self.tag}{octet}s"
        _ip("netns", "add", ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
        _ip("link", "set", host_end, "netns", ns)
        _ip("link", "set", switch_end, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", switch_end, "master", "br0", "up")
        _ip("-n", ns, "link", "set", host_end, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        tmp = os.path.join(self.workdir, name)  # short: Ray's unix sockets live under it (108 bytes at most)
        os.makedirs(tmp)
        host = self.hosts[name] = Host(name, ns, ip, switch_end, self, tmp)
        return host

    def boot(self) -> None:
        """Every host's /etc/hosts naming them all (`ip netns exec` mounts /etc/netns/NS/hosts over it), then
        their inits."""
        self.write_hosts_files()
        for h in self.hosts.values():
            h.boot()

    def write_hosts_files(self) -> None:
        lines = "127.0.0.1 localhost\n" + "".join(f"{h.ip} {h.name}\n" for h in self.hosts.values())
        for h in self.hosts.values():
            os.makedirs(f"/etc/netns/{h.ns}", exist_ok=True)
            with open(f"/etc/netns/{h.ns}/hosts", "w") as f:
                f.write(lines)

    def close(self) -> None:
        for h in self.hosts.values():
            h.stop()
        for h in self.hosts.values():
            _ip("netns", "del", h.ns, check=False)
            shutil.rmtree(f"/etc/netns/{h.ns}", ignore_errors=True)
        _ip("netns", "del", self.switch, check=False)


def _labels(node_type: str) -> dict:
    import yaml

    with open(os.path.join(REPO, "cluster.yaml")) as f:
        return yaml.safe_load(f)["available_node_types"][node_type].get("labels", {})


class HostCluster:
    """LAYOUT as Ray nodes and servers in namespaces. Every process is started here and stopped by its pid."""

    def __init__(self, layout: dict | None = None, workdir: str | None = None):
        self.layout = layout or LAYOUT
        self.workdir = workdir or tempfile.mkdtemp(prefix="sth-", dir="/tmp")
        self.token = secrets.token_hex(32)
        self.bucket = "strata"
        self.net = Net(self.workdir)
        self.nodes: dict[str, subprocess.Popen] = {}
        try:
            for name, (octet, _, _) in self.layout.items():
                self.net.add(name, octet)
            self.net.boot()
            head = self.host("head").ip
            self.host("laptop").only([(head, DASHBOARD_PORT), (head, SERVE_PORT), (self.host("s3").ip, S3_PORT)])
            self._start_s3()
            self.start_node("head")
            for name in self.ray_hosts():
                if name != "head":
                    self.start_node(name, wait=False)
            self.wait_nodes(len(self.ray_hosts()))
        except BaseException:
            self.close()
            raise

    # -- addresses and environments ----------------------------------------------------------------
    def host(self, name: str) -> Host:
        return self.net.hosts[name]

    def ray_hosts(self) -> list[str]:
        return [n for n, (_, node_type, _) in self.layout.items() if node_type]

    @property
    def gcs(self) -> str:
        return f"{self.host('head').ip}:{GCS_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.host('head').ip}:{DASHBOARD_PORT}"

    @property
    def s3(self) -> str:
        return f"http://{self.host('s3').ip}:{S3_PORT}"

    def env(self, host: str, **extra) -> dict:
        """What a process on `host` runs with: its own home, the cluster's token and signing key (a file
        provisioned with the cluster, as a Secret or a file mount provisions it), the S3 server."""
        home = os.path.join(self.workdir, "home", host)
        os.makedirs(home, exist_ok=True)
        key = os.path.join(self.workdir, "signing-key")
        if not os.path.exists(key):
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_", "STRATA_"))}
        return {**keep, "HOME": home, "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # a cluster of hosts: Ray must not pin itself to loopback
                "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_USAGE_STATS_ENABLED": "0",
                "AWS_ENDPOINT_URL": self.s3, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                "STRATA_STORAGE": f"s3://{self.bucket}/strata", "STRATA_SIGNING_KEY_FILE": key, "PYTHONUNBUFFERED": "1",
                **ray_network_env(), **extra}

    def log(self, name: str) -> str:
        os.makedirs(os.path.join(self.workdir, "logs"), exist_ok=True)
        return os.path.join(self.workdir, "logs", f"{name}.log")

    # -- processes ---------------------------------------------------------------------------------
    def _start_s3(self) -> None:
        s3 = self.host("s3")
        s3.popen([sys.executable, "-m", "moto.server", "-H", s3.ip, "-p", str(MOTO_PORT)], self.env("s3"),
                 self.log("s3"))
        s3.popen([sys.executable, os.path.join(REPO, "tests", "slowlink.py"), "--listen", f"{s3.ip}:{S3_PORT}",
                  "--to", f"{s3.ip}:{MOTO_PORT}", "--control", self._link_file()], self.env("s3"), self.log("s3-link"))
        code = ("import boto3, time\nfor i in range(300):\n    try:\n"
                f"        boto3.client('s3').create_bucket(Bucket='{self.bucket}'); break\n"
                "    except Exception:\n        time.sleep(0.2)\nelse:\n    raise SystemExit('S3 never answered')")
        out = self.host("laptop").run([sys.executable, "-c", code], self.env("laptop"), timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"the S3 host did not come up: {out.stderr[-1500:]}")

    def _link_file(self) -> str:
        return os.path.join(self.host("s3").tmp, "link.json")

    def slow_storage(self, delay_ms: tuple[float, float] | None = (50, 200), loss: float = 0.01) -> None:
        """From now on every connection to the S3 server has `delay_ms` of round trip added and loses
        `loss` of its segments (tests/slowlink.py); `slow_storage(None)` makes the link plain again."""
        path = self._link_file()
        if delay_ms is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        else:
            with open(path + ".tmp", "w") as f:
                json.dump({"delay_ms": list(delay_ms), "loss": loss}, f)
            os.replace(path + ".tmp", path)
        time.sleep(1)  # the proxy reads it every 0.5 s

    def start_node(self, name: str, wait: bool = True) -> subprocess.Popen:
        """`ray start --block` on host `name` as its node type in cluster.yaml (labels; CPUs scaled down)."""
        from strata.cluster import tiers

        _, node_type, cpus = self.layout[name]
        host = self.host(name)
        shutil.rmtree(os.path.join(host.tmp, "ray"), ignore_errors=True)  # a replaced host starts afresh
        argv = [os.path.join(BIN, "ray"), "start", "--block", f"--node-ip-address={host.ip}",
                f"--temp-dir={os.path.join(host.tmp, 'ray')}",
                f"--num-cpus={cpus}", "--object-store-memory=80000000", "--disable-usage-stats",
                f"--labels={tiers.format_labels(_labels(node_type))}"]
        if node_type == "head":
            argv += ["--head", f"--port={GCS_PORT}", f"--dashboard-host={host.ip}", f"--dashboard-port={DASHBOARD_PORT}"]
        else:
            argv += [f"--address={self.gcs}"]
        proc = self.nodes[name] = host.popen(argv, self.env(name), self.log(f"ray-{name}"))
        if wait:
            self.wait_started(name)
        return proc

    def wait_started(self, name: str, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            with open(self.log(f"ray-{name}"), errors="replace") as f:
                if "Ray runtime started" in f.read():
                    return
            if self.nodes[name].poll() is not None:
                break
            time.sleep(0.5)
        with open(self.log(f"ray-{name}"), errors="replace") as f:
            raise RuntimeError(f"ray start on {name} did not come up:\n{f.read()[-3000:]}")

    def stop_node(self, *names: str, timeout: float = 10) -> None:
        """SIGTERM to each node's `ray start --block` (it stops what it started), all at once; SIGKILL to
        what is left of their process groups after `timeout`."""
        procs = [self.nodes.pop(n) for n in names]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + timeout
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.time()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def replace(self, name: str) -> None:
        """The host back on the network as a new node, as a replaced instance joins: its link up, what is
        left of its old node stopped, a fresh `ray start`."""
        self.host(name).heal()
        if name in self.nodes:
            self.stop_node(name, timeout=5)
        self.start_node(name)

    def python(self, host: str, code: str, timeout: float = 120, **env) -> object:
        """Run `code` on `host` with Ray's address set; it prints one JSON value last, returned here."""
        out = self.host(host).run([sys.executable, "-c", code], self.env(host, RAY_ADDRESS=self.gcs, **env),
                                  timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"on {host}: {out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def alive(self) -> dict[str, str]:
        """{node id: host name} of the nodes the GCS holds alive."""
        code = ("import json, ray\nray.init(logging_level='ERROR')\n"
                "print(json.dumps({n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']}))")
        by_ip = {h.ip: h.name for h in self.net.hosts.values()}
        return {node: by_ip[ip] for node, ip in self.python("head", code).items()}

    def wait_nodes(self, n: int, timeout: float = 240) -> dict[str, str]:
        for name in list(self.nodes):
            if name != "head":
                self.wait_started(name, timeout)
        deadline = time.time() + timeout
        while len(alive := self.alive()) != n:
            if time.time() > deadline:
                raise RuntimeError(f"{len(alive)} of {n} nodes alive after {timeout} s: {sorted(alive.values())}")
            time.sleep(1)
        return alive

    def close(self) -> None:
        self.stop_node(*[n for n in self.nodes if n != "head"])
        if "head" in self.nodes:
            self.stop_node("head")
        self.net.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def main(argv: list[str]) -> int:
    if argv:
        print(__doc__)
        return 0 if argv[0] in ("-h", "--help") else 2
    if why := missing():
        print(f"no cluster of hosts here: {why}", file=sys.stderr)
        return 1
    # Before anything starts: a SIGTERM while the cluster comes up stops it and deletes its namespaces too.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print("starting: hosts", ", ".join(f"{n} {SUBNET}.{o}" for n, (o, _, _) in LAYOUT.items()), flush=True)
    try:
        cluster = HostCluster()  # stops what it started if interrupted
    except KeyboardInterrupt:
        print("stopped while starting; namespaces deleted")
        return 130
    laptop = cluster.host("laptop")
    print(f"up: Ray {cluster.gcs}, jobs {cluster.dashboard}, S3 {cluster.s3}; logs {cluster.workdir}/logs\n"
          f"a shell on the laptop host:  ip netns exec {laptop.ns} bash\n"
          f"  (its environment: RAY_AUTH_TOKEN={cluster.token} AWS_ENDPOINT_URL={cluster.s3})\n"
          f"cut a host off:  ip -n {cluster.net.switch} link set {cluster.host('cpu-b').link} down\n"
          f"slow the storage:  echo '{{\"delay_ms\": [50, 200], \"loss\": 0.01}}' > {cluster._link_file()}\n"
          "Ctrl-C stops every process and deletes every namespace.", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.close()
        print("stopped; namespaces deleted")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
