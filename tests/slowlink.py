"""A TCP proxy that can make a link slow and lossy, for the cluster of hosts (tests/hosts.py): this kernel
has no netem and no tc actions, so latency and loss are added here, in user space.

    python tests/slowlink.py --listen IP:PORT --to IP:PORT --control FILE

The link's state is FILE, a JSON object read again whenever it changes (no file: a plain link):

    {"delay_ms": [50, 200], "loss": 0.01}

- `delay_ms`: the round trip added, drawn for each chunk of bytes from [low, high]; each direction takes
  half. Bytes stay in order, as TCP delivers them: a chunk is never handed over before the one ahead of it.
- `loss`: the share of TCP segments (1,448 bytes) lost. TCP hides a loss from the application as a wait for
  the retransmission, so each lost segment holds its chunk, and everything behind it, for Linux's least
  retransmission timeout (200 ms); a lost handshake costs the first timeout (1 s).

Every 5 s, when they changed, it prints a JSON line of what went through it: connections, HTTP requests,
bytes each way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time

MSS = 1448
RTO_S, SYN_RTO_S = 0.2, 1.0
CHUNK = 64 << 10


class Link:
    def __init__(self, control: str):
        self.control = control
        self.counts = {"connections": 0, "requests": 0, "bytes_up": 0, "bytes_down": 0}
        self.delay_ms: tuple[float, float] = (0.0, 0.0)
        self.loss = 0.0
        self._seen: int | None = None

    def refresh(self) -> None:
        try:
            seen = os.stat(self.control).st_mtime_ns
        except FileNotFoundError:
            seen = None
        if seen == self._seen:
            return
        cfg = {}
        if seen is not None:
            try:
                with open(self.control) as f:
                    cfg = json.load(f)
            except (OSError, ValueError):
                return  # half-written: read it next time
        self._seen = seen
        low, high = cfg.get("delay_ms") or (0, 0)
        self.delay_ms, self.loss = (float(low), float(high)), float(cfg.get("loss") or 0)

    def rtt(self) -> float:
        return random.uniform(*self.delay_ms) / 1000

    def one_way(self, nbytes: int) -> float:
        """Seconds a chunk of `nbytes` takes beyond the wire: half a round trip, and a retransmission
        timeout for each of its segments lost."""
        lost = sum(random.random() < self.loss for _ in range(math.ceil(nbytes / MSS))) if self.loss else 0
        return self.rtt() / 2 + lost * RTO_S


async def _pipe(link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool) -> None:
    queue: asyncio.Queue = asyncio.Queue(maxsize=64)  # bounded: a slow reader holds the sender back

    async def receive():
        due = 0.0
        try:
            while data := await reader.read(CHUNK):
                if up:  # a request's line ends with its version: HTTP requests, counted roughly
                    link.counts["requests"] += data.count(b" HTTP/1.1\r\n")
                link.counts["bytes_up" if up else "bytes_down"] += len(data)
                due = max(due, time.monotonic() + link.one_way(len(data)))
                await queue.put((due, data))
        finally:
            await queue.put((due, b""))

    async def deliver():
        while True:
            due, data = await queue.get()
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    async with asyncio.TaskGroup() as tasks:  # one failing cancels the other
        tasks.create_task(receive())
        tasks.create_task(deliver())


async def _serve(link: Link, to: tuple[str, int], client_r, client_w) -> None:
    upstream_w = None
    try:
        wait = link.rtt() + (SYN_RTO_S if random.random() < link.loss else 0.0)  # the handshake's round trip
        if wait:
            await asyncio.sleep(wait)
        upstream_r, upstream_w = await asyncio.open_connection(*to)
        async with asyncio.TaskGroup() as pipes:
            link.counts["connections"] += 1
            pipes.create_task(_pipe(link, client_r, upstream_w, True))
            pipes.create_task(_pipe(link, upstream_r, client_w, False))
    except* OSError:
        pass  # a reset or a refused upstream: the client sees its connection close, as it would
    finally:
        for w in (client_w, upstream_w):
            if w is not None:
                w.close()


async def _main(listen: tuple[str, int], to: tuple[str, int], control: str) -> None:
    link = Link(control)
    link.refresh()
    server = await asyncio.start_server(lambda r, w: _serve(link, to, r, w), *listen, reuse_address=True)
    print(f"slowlink {listen[0]}:{listen[1]} -> {to[0]}:{to[1]}, state in {control}", flush=True)
    said, ticks = None, 0
    async with server:
        while True:
            link.refresh()
            await asyncio.sleep(0.5)
            ticks += 1
            if ticks % 10 == 0 and link.counts != said:  # what went through it, every 5 s when it changed
                said = dict(link.counts)
                print(json.dumps(said), flush=True)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_address, required=True, help="IP:PORT to listen on")
    parser.add_argument("--to", type=_address, required=True, help="IP:PORT to forward to")
    parser.add_argument("--control", required=True, help="the JSON file that says how slow and lossy the link is")
    args = parser.parse_args()
    asyncio.run(_main(args.listen, args.to, args.control))


if __name__ == "__main__":
    main()
