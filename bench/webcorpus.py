"""bench.peer's web corpus: Common Crawl-shaped WARC files built from the real HTML pages on this machine.

    python -m bench.webcorpus DIR [--mb 200]

No download. The pages are every .html/.htm file over 2 KB under the documentation trees a Linux machine
with developer tools carries (ROOTS: Debian's /usr/share/doc, the Rust toolchains' docs, the installed Python
and Node packages), shuffled with a fixed seed. Each becomes a `response` record (its own gzip member, HTTP
headers with `Content-Type: text/html; charset=utf-8`, `WARC-Identified-Payload-Type: text/html`, a URL
`http://HOST/PATH` with HOST the page's tree), after a `warcinfo` record and with a `request` record before
every 20th response, as crawls have. Planted: every 10th page is repeated under a second URL (an exact
copy) and every 10th other page with one in 40 of its words dropped (a near copy), each later in the
corpus. Files of about 50 MB on disk (.warc.gz) until `--mb` MB in all. A blocklist file beside them names
one of the trees' hosts, so the URL filter has pages to take. Built once per size under DIR.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import os
import random
import re

ROOTS = {"debian.docs": "/usr/share/doc", "rust.docs": "/root/.rustup/toolchains/*/share/doc",
         "python.docs": "/usr/lib/python3*", "node.docs": "/usr/lib/node_modules",
         "site.docs": "/usr/local/lib/python3*/site-packages"}
BLOCKED = "node.docs"  # the host the blocklist names
PART_BYTES = 50 << 20
_WORDS = re.compile(r"(>[^<]*)")


def pages() -> list[tuple[str, str]]:
    """(url, path) of every page, shuffled with a fixed seed."""
    found = []
    for host, pattern in ROOTS.items():
        for i, root in enumerate(sorted(glob.glob(pattern))):
            for d, _, files in os.walk(root):
                for f in sorted(files):
                    path = os.path.join(d, f)
                    if f.endswith((".html", ".htm")) and os.path.isfile(path) and os.path.getsize(path) > 2048:
                        found.append((f"http://{host}/{i}/{os.path.relpath(path, root)}", path))
    found.sort()
    random.Random(1).shuffle(found)
    return found


def _near(html: bytes, rng: random.Random) -> bytes:
    """`html` with about one in 40 of the words of its text (not its tags) dropped."""
    def drop(m: re.Match) -> str:
        words = m.group(1).split(" ")
        return " ".join(w for w in words if rng.random() >= 1 / 40)

    return _WORDS.sub(drop, html.decode("utf-8", "replace")).encode()


def build(root: str, mb: int) -> tuple[list[str], str]:
    """The .warc.gz files (about `mb` MB) under `root`, built once; and the blocklist's path."""
    done, blocklist = os.path.join(root, f".done-{mb}"), os.path.join(root, "blocklist.txt")
    if os.path.exists(done):
        return sorted(glob.glob(os.path.join(root, "*.warc.gz"))), blocklist
    os.makedirs(root, exist_ok=True)
    for old in glob.glob(os.path.join(root, "*.warc.gz")):
        os.remove(old)
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    with open(blocklist, "w") as f:
        f.write(f"# the bench's URL blocklist: one domain\n{BLOCKED}\n")
    rng, total, part, planted = random.Random(2), 0, 0, []
    out = writer = None

    def record(url: str, body: bytes, n: int) -> None:
        nonlocal total
        rid = f"<urn:uuid:{hashlib.md5(f'{url}#{n}'.encode()).hexdigest()}>"
        if n % 20 == 0:
            writer.write_record(writer.create_warc_record(url, "request", payload=io.BytesIO(b"GET / HTTP/1.1\r\n\r\n"),
                                                          warc_headers_dict={"WARC-Record-ID": rid[:-2] + "r>"}))
        http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
        writer.write_record(writer.create_warc_record(
            url, "response", payload=io.BytesIO(body), http_headers=http,
            warc_headers_dict={"WARC-Record-ID": rid, "WARC-Identified-Payload-Type": "text/html",
                               "WARC-Date": "2026-11-01T00:00:00Z"}))

    def open_part() -> None:
        nonlocal out, writer, part
        if out:
            out.close()
        out = open(os.path.join(root, f"crawl-{part:04d}.warc.gz"), "wb")  # noqa: SIM115 - closed at the next part
        part += 1
        writer = WARCWriter(out, gzip=True)
        writer.write_record(writer.create_warcinfo_record(f"crawl-{part:04d}.warc.gz", {"software": "bench.webcorpus"}))

    open_part()
    for n, (url, path) in enumerate(pages()):
        with open(path, "rb") as f:
            body = f.read()
        record(url, body, n)
        if n % 10 == 3:
            planted.append((url + "?copy", body))
        elif n % 10 == 7:
            planted.append((url + "?edited", _near(body, rng)))
        if planted and n % 10 == 9 and len(planted) > 5:
            record(*planted.pop(0), n + 10_000_000)
        if out.tell() >= PART_BYTES:
            total += out.tell()
            if total >= mb << 20:
                break
            open_part()
    else:
        total += out.tell()
    out.close()
    open(done, "w").close()
    return sorted(glob.glob(os.path.join(root, "*.warc.gz"))), blocklist


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--mb", type=int, default=200)
    a = p.parse_args(argv)
    files, _ = build(a.dir, a.mb)
    print(f"{len(files)} files, {sum(os.path.getsize(f) for f in files) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
