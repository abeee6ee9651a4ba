"""A TCP proxy on 127.0.0.1 in front of the test S3 server (AWS_ENDPOINT_URL pointing at it) that logs
every request, and can make the faults an object store shows under load: a connection reset by peer
after part of a response has arrived.

The log is what `bench.scale` and the growth-law tests count: method, path, bytes sent (the request)
and received (the response). A client waits for a response before it sends the next request on the same
connection, so each response's bytes belong to the last request line seen on it.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass

METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")


@dataclass
class Request:
    method: str
    path: str
    """The object's key with its bucket."""
    query: str = ""
    sent: int = 0
    received: int = 0


class ResettingProxy:
    """Forwards every connection to `upstream`; each `every`-th one is reset once `cut` bytes of the
    response have passed (its request arrives whole), and every request whose request line holds
    `poison` (say, an object's key) is reset before it arrives: that object cannot be read at all. `resets` counts the
    faults injected."""

    def __init__(self, upstream: tuple[str, int], every: int = 4, cut: int = 300, poison: bytes = b""):
        self.upstream, self.every, self.cut, self.poison = upstream, every, cut, poison
        self.connections = self.resets = self.poisoned = 0
        self.log: list[Request] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock, self.stopped = threading.Lock(), False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.stopped:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                faulty = self.every > 0 and self.connections % self.every == 0
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._relay, args=(client, server, self.cut if faulty else None),
                             daemon=True).start()

    def _relay(self, client: socket.socket, server: socket.socket, cut: int | None) -> None:
        """Both directions in one thread (so a reset closes both sockets at once, with nobody blocked on them)."""
        sent, current = 0, Request("", "")
        try:
            while True:
                ready, _, _ = select.select([client, server], [], [], 30)
                if not ready:
                    break
                if client in ready:
                    if not (data := client.recv(65536)):
                        break
                    line = data.split(b"\r\n", 1)[0]
                    if line.startswith(METHODS):
                        method, _, rest = line.decode("latin-1").partition(" ")
                        path, _, query = rest.rsplit(" ", 1)[0].partition("?")
                        current = Request(method, path, query)
                        with self.lock:
                            self.log.append(current)
                    current.sent += len(data)
                    if self.poison and line.startswith(METHODS) and self.poison in line:
                        with self.lock:
                            self.poisoned += 1
                        self._reset(client)
                        break
                    server.sendall(data)
                if server in ready:
                    if not (data := server.recv(65536)):
                        break
                    if cut is not None and sent + len(data) > cut:
                        client.sendall(data[: cut - sent])
                        self._reset(client)
                        break
                    client.sendall(data)
                    sent += len(data)
                    current.received += len(data)
        except OSError:
            pass
        client.close()
        server.close()

    def _reset(self, client: socket.socket) -> None:
        """Closing with linger 0 sends RST: the client sees "connection reset by peer"."""
        with self.lock:
            self.resets += 1
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def close(self) -> None:
        self.stopped = True
        self.listener.close()


def tally(log: list[Request], contains: str = "") -> dict:
    """Requests by method, and bytes read (GET responses) and written (PUT and POST bodies), of the logged
    requests whose path holds `contains`."""
    picked = [r for r in log if contains in r.path]
    return {"requests": dict(Counter(r.method for r in picked)),
            "read_bytes": sum(r.received for r in picked if r.method == "GET"),
            "written_bytes": sum(r.sent for r in picked if r.method in ("PUT", "POST"))}


def s3_server(bucket: str):
    """moto's S3 server and a logging proxy before it, both on 127.0.0.1; a fresh `bucket`: (server, proxy, the
    environment that points boto3 and pyarrow at the proxy)."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's own line per request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_EC2_METADATA_DISABLED": "true"}
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="bench",
                 aws_secret_access_key="bench", region_name="us-east-1").create_bucket(Bucket=bucket)
    proxy = ResettingProxy(("127.0.0.1", port), every=0)
    return server, proxy, {**creds, "AWS_ENDPOINT_URL": proxy.endpoint}
