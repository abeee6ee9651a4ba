"""Web crawls into tier 1 (strata/data/web.py): WARC and WET files built here with warcio's writer, as Common Crawl
ships them (a gzip member a record), with damage planted; pages of known main text inside realistic
boilerplate, for the extractors."""

import gzip
import io
import random
import zlib
from collections import Counter

import pytest

from strata.data.inputs import documents
from strata.data.sources import ReadConfig

MENU = ["Home", "Products", "Pricing", "Blog", "Careers", "Contact us", "Sign in", "Search"]
FOOTER = ("Copyright 2026 Example Media Group. All rights reserved. Privacy policy · Terms of service · "
          "Cookie settings · Accessibility · Sitemap")
COOKIES = ("We use cookies to improve your experience, analyse traffic and personalise ads. By clicking "
           "Accept all you agree to our use of cookies. Accept all Reject Manage preferences")
WORDS = ["river", "market", "garden", "engine", "winter", "signal", "harbor", "lantern", "orbit", "meadow", "canyon", "ledger", "summit", "copper", "violet", "thunder", "pepper", "marble", "falcon", "ember"]


def article(seed: int, paragraphs: int = 5) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 70))).capitalize() + "."
            for _ in range(paragraphs)]


def page(title: str, paragraphs: list[str], related: int = 6) -> str:
    """An HTML page as news and blog sites make them: navigation, a cookie banner, a sidebar of links and
    a footer around the article."""
    nav = "".join(f'<li><a href="/{m.lower()}">{m}</a></li>' for m in MENU)
    side = "".join(f'<li><a href="/story/{i}">Related story number {i}: read more</a></li>' for i in range(related))
    body = "".join(f"<p>{p}</p>" for p in paragraphs)
    return (f"<!DOCTYPE html><html><head><title>{title} | Example News</title><meta charset='utf-8'>"
            "<script>window.dataLayer=[];function gtag(){dataLayer.push(arguments)}</script>"
            f"<style>body{{font-family:sans-serif}}</style></head><body>"
            f'<div id="cookie-banner" class="cookie-consent"><p>{COOKIES}</p></div>'
            f'<header><nav class="menu"><ul>{nav}</ul></nav></header>'
            f'<main><article><h1>{title}</h1>{body}</article></main>'
            f'<aside class="sidebar"><h3>Most read</h3><ul>{side}</ul></aside>'
            f'<footer><p>{FOOTER}</p><ul>{nav}</ul></footer></body></html>')


def div_page(title: str, paragraphs: list[str], related: int = 6) -> str:
    """The same, as older sites build it: divs and classes only, share buttons and a newsletter box inside
    the post, comments below it."""
    nav = " | ".join(f'<a href="/{m.lower()}">{m}</a>' for m in MENU)
    side = "".join(f'<div class="item"><a href="/p/{i}">You may also like: post {i}</a></div>' for i in range(related))
    body = "".join(f'<div class="para">{p}</div>' for p in paragraphs)
    return (f"<html><head><title>{title}</title></head><body><div id='top'><div class='logo'>Example</div>"
            f"<div class='menu'>{nav}</div></div><div class='cookie'>{COOKIES}</div>"
            f"<div id='wrapper'><div class='content'><div class='post'><div class='post-title'>{title}</div>"
            "<div class='share'>Share on Facebook Share on X Email this</div>"
            f"<div class='post-body'>{body}</div>"
            "<div class='newsletter'>Subscribe to our newsletter for weekly updates. Enter your email Subscribe</div>"
            "</div><div class='comments'><div class='comment'>Great post, thanks!</div>"
            "<div class='comment'>First!</div></div></div>"
            f"<div class='sidebar'>{side}</div></div><div class='bottom'>{FOOTER}</div></body></html>")


def _record(writer, uri: str, kind: str, payload: bytes, content_type: str = "text/html; charset=utf-8"):
    from warcio.statusandheaders import StatusAndHeaders

    if kind == "response":
        http = StatusAndHeaders("200 OK", [("Content-Type", content_type)], protocol="HTTP/1.1")
        return writer.create_warc_record(uri, "response", payload=io.BytesIO(payload), http_headers=http)
    return writer.create_warc_record(uri, kind, payload=io.BytesIO(payload), warc_content_type=content_type)


def write_warc(path, pages: dict[str, str], *, damage: bool = False) -> None:
    """A WARC of `pages` (url -> html): a warcinfo, and per page a request and a response; then a PNG, a page
    whose bytes its charset cannot decode, a metadata record. With `damage`: garbage between two members, a
    member cut short, a record whose header is not WARC's."""
    from warcio.warcwriter import WARCWriter

    out = io.BytesIO()
    writer = WARCWriter(out, gzip=True)
    writer.write_record(writer.create_warcinfo_record("test.warc.gz", {"software": "strata tests"}))
    for url, html in pages.items():
        writer.write_record(_record(writer, url, "request", f"GET {url} HTTP/1.1\r\n\r\n".encode(),
                                    "application/http; msgtype=request"))
        writer.write_record(_record(writer, url, "response", html.encode()))
    writer.write_record(_record(writer, "https://example.com/logo.png", "response", b"\x89PNG\r\n\x1a\n" + bytes(64),
                                "image/png"))
    writer.write_record(_record(writer, "https://example.com/bad", "response", b"<p>caf\xe9 \xff\xfe</p>" * 20,
                                "text/html; charset=utf-8"))
    writer.write_record(_record(writer, "https://example.com/", "metadata", b"fetchTimeMs: 12\r\n",
                                "application/warc-fields"))
    data = out.getvalue()
    if damage:
        bad_header = gzip.compress(b"NOT/1.0 A WARC HEADER\r\nwhatever: yes\r\n\r\nbody\r\n\r\n")
        cut = gzip.compress(b"WARC/1.0\r\nWARC-Type: response\r\n" + b"x" * 5000)
        last = gzip.compress(b"")  # an empty member, then a last page after it all
        tail = io.BytesIO()
        w2 = WARCWriter(tail, gzip=True)
        w2.write_record(_record(w2, "https://example.com/after-damage", "response",
                                page("After the damage", article(99)).encode()))
        data = data + b"garbage between members" + bad_header + cut[: len(cut) // 2]
        data = data + tail.getvalue() + last
    path.write_bytes(data)


def write_wet(path, texts: dict[str, str]) -> None:
    from warcio.warcwriter import WARCWriter

    out = io.BytesIO()
    writer = WARCWriter(out, gzip=True)
    writer.write_record(writer.create_warcinfo_record("test.warc.wet.gz", {"software": "strata tests"}))
    for url, text in texts.items():
        writer.write_record(_record(writer, url, "conversion", text.encode(), "text/plain"))
    path.write_bytes(out.getvalue())


def overlap(extracted: str, truth: str) -> tuple[float, float]:
    """(recall, precision) of the words of `extracted` against `truth`, as multisets."""
    got, want = Counter(extracted.lower().split()), Counter(truth.lower().split())
    common = sum((got & want).values())
    return common / max(1, sum(want.values())), common / max(1, sum(got.values()))


@pytest.mark.parametrize("library", ["fastwarc", "warcio"])
def test_a_warc_gives_its_html_pages_and_accounts_for_every_other_record(tmp_path, library):
    pages = {f"https://example.com/news/{i}": page(f"Story {i}", article(i)) for i in range(3)}
    path = tmp_path / "crawl.warc.gz"
    write_warc(path, pages, damage=True)
    rows = list(documents([str(path)], ReadConfig(warc_library=library)))
    ok = [r for r in rows if r["status"] == "ok"]
    assert [r["meta"]["url"] for r in ok] == [*pages, "https://example.com/after-damage"]  # read past the damage
    reasons = Counter(r["reason"] for r in rows if r["status"] != "ok")
    assert reasons == {"not-a-document": 5, "not-html": 1, "undecodable-charset": 1, "truncated-record": 2,
                       "bad-record-header": 1}, reasons
    assert all(r["meta"]["date"] and r["meta"]["record_id"].startswith("<urn:uuid:") for r in ok)
    offsets = [int(r["doc_id"].rpartition(":")[2]) for r in rows]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(rows)  # a record's place: its member's offset
    data = path.read_bytes()
    assert all(data[o:o + 3] == b"\x1f\x8b\x08" for o, r in zip(offsets, rows, strict=True)
               if r["reason"] != "truncated-record")


def test_members_reads_members_larger_than_what_zlib_is_fed_at_a_time():
    """Members are handed to zlib a slice at a time: ones many slices long (incompressible bytes), ones that
    cross the reader's 1 MiB chunks, and small ones between, come back whole at their offsets."""
    from strata.data.web import CHUNK, FEED, members

    rng = random.Random(3)
    payloads = [rng.randbytes(n) for n in (10, 3 * FEED + 17, 5, CHUNK + 1234, 0, 40_000)]
    parts = [gzip.compress(p) for p in payloads]
    offsets = [sum(map(len, parts[:i])) for i in range(len(parts))]
    got = list(members(io.BytesIO(b"".join(parts)), 1 << 30))
    assert [o for o, _ in got] == offsets and [b for _, b in got] == payloads
    assert [r for _, r in members(io.BytesIO(b"".join(parts)), 2 * FEED)][1:4] == [
        "record-too-large", payloads[2], "record-too-large"]  # over the limit: named, and the next read on


@pytest.mark.parametrize("extractor", ["resiliparse", "trafilatura"])
def test_extraction_keeps_the_article_and_drops_the_boilerplate(tmp_path, extractor):
    pages, truth = {}, {}
    for i in range(8):
        paragraphs = article(100 + i, paragraphs=3 + i % 4)
        url = f"https://example.com/post/{i}"
        layout = page if i % 2 else div_page
        pages[url], truth[url] = layout(f"Post {i}", paragraphs, related=4 + i), f"Post {i} " + " ".join(paragraphs)
    path = tmp_path / "pages.warc.gz"
    write_warc(path, pages)
    got = {r["meta"]["url"]: r["text"] for r in documents([str(path)], ReadConfig(html_extractor=extractor))
           if r["status"] == "ok"}
    assert set(got) == set(pages)
    scores = [overlap(got[u], truth[u]) for u in pages]
    recall = sum(r for r, _ in scores) / len(scores)
    precision = sum(p for _, p in scores) / len(scores)
    print(f"{extractor}: recall {recall:.3f}, precision {precision:.3f}")
    assert recall >= 0.9 and precision >= 0.9, (recall, precision)
    assert not any("sign in" in t.lower() or "you may also like" in t.lower() for t in got.values())  # menus, links


def test_a_wet_gives_its_conversion_records(tmp_path):
    texts = {f"https://example.org/{i}": " ".join(article(i, 2)) for i in range(4)}
    path = tmp_path / "crawl.warc.wet.gz"
    write_wet(path, texts)
    rows = list(documents([str(path)]))
    assert [(r["meta"]["url"], r["text"]) for r in rows if r["status"] == "ok"] == list(texts.items())
    assert Counter(r["reason"] for r in rows if r["status"] != "ok") == {"not-a-document": 1}


def test_finewebs_line_rules_each_count_under_their_name():
    from pipelines.clean import CleanConfig, QualityFilter

    q = QualityFilter(CleanConfig(min_punct_line_fraction=0.12, max_short_line_fraction=0.67,
                                  max_duplicate_line_char_fraction=0.1))
    prose = "\n".join(" ".join(article(i, 1)) for i in range(6))
    assert q.reason(prose) == ""
    menu = "\n".join(f"{w} and more {w} items here for you" for w in WORDS[:12])  # long lines, no full stops
    assert q.reason(menu) == "fineweb-punctuation-lines"
    short = "\n".join(["A short line."] * 2 + [f"Item {i}." for i in range(8)] + [" ".join(article(1, 1))])
    assert q.reason(short) == "fineweb-short-lines"
    repeated = prose + "\n" + "\n".join([" ".join(article(7, 1))] * 3)
    assert q.reason(repeated) == "fineweb-duplicate-line-chars"
    assert q.counts() == {"fineweb-punctuation-lines": 1, "fineweb-short-lines": 1, "fineweb-duplicate-line-chars": 1}


def test_the_url_blocklist_takes_domains_with_their_subdomains_and_whole_words(tmp_path):
    from pipelines.clean import UrlBlocklist

    (tmp_path / "block.txt").write_text("# adult and spam\nspam-example.com\ncasino\n")
    b = UrlBlocklist.load(str(tmp_path / "block.txt"))
    assert b.blocks("https://spam-example.com/a") and b.blocks("http://www.SPAM-example.com/")
    assert b.blocks("https://news.example.org/best-casino-bonus")
    assert not b.blocks("https://news.example.org/casinorama") and not b.blocks("https://notspam-example.com/")
    assert not b.blocks("not a url at all [")


def test_pii_formatting_replaces_emails_and_public_addresses_only():
    from pipelines.clean import EMAIL_STANDIN, IP_STANDIN, format_pii

    text = ("Write to jane.doe+news@mail.example.org or ops@example.co.uk; the server is 8.8.4.4, the router "
            "192.168.1.1, this host 127.0.0.1, and version 1.2.3.4.5 is not an address.")
    out, counts = format_pii(text)
    assert counts == {"email": 2, "ip": 2}  # 1.2.3.4 inside the version string is a public address too
    assert out.count(EMAIL_STANDIN) == 2 and "8.8.4.4" not in out and IP_STANDIN in out
    assert "192.168.1.1" in out and "127.0.0.1" in out


@pytest.mark.ray
def test_a_crawl_becomes_a_dataset_with_the_web_preset(tmp_path, monkeypatch):
    from conftest import ensure_local_ray

    from pipelines.config import web
    from pipelines.driver import run
    from strata.data.lineage import find
    from strata.data.storage import Storage

    ensure_local_ray()
    pages = {f"https://news.example.org/story/{i}": page(f"Story {i}", article(300 + i, 6)) for i in range(6)}
    pages["https://spam-example.com/win"] = page("Win", article(400, 6))
    pages["https://news.example.org/contact"] = page("Contact", [
        "Write to the desk at desk@news.example.org or call our office; the newsroom's server is at 8.8.4.4 "
        + " ".join(article(500, 1)), *article(501, 5)])
    path = tmp_path / "crawl" / "CC-MAIN-test.warc.gz"
    path.parent.mkdir()
    write_warc(path, pages, damage=True)
    (tmp_path / "block.txt").write_text("spam-example.com\n")
    out = run(web("crawl", read={"inputs": (str(path.parent),)}, clean={"url_blocklist": str(tmp_path / "block.txt")},
                  pack={"seq_len": 128, "validation_fraction": 0.0}), Storage(str(tmp_path / "root")))
    stats = out["stats"]
    assert stats["documents"]["kept"] == 8 - 1 and stats["filtered_by_rule"] == {"url-blocklist": 1}, stats
    assert stats["rejected_by_reason"] == {"not-a-document": len(pages) + 2, "not-html": 1, "undecodable-charset": 1,
                                           "truncated-record": 2, "bad-record-header": 1}
    assert stats["pii_replaced"] == {"email": 1, "ip": 1}
    # Lineage names each kept page's record: its URL, date, content type and WARC id, at its byte offset. With
    # dedup off, pages are read in pass 2 (fused), and lineage keeps their records the same way.
    fused = run(web("fused", read={"inputs": (str(path.parent),)}, clean={"url_blocklist": str(tmp_path / "block.txt")},
                    dedup={"exact_dedup": False, "near_dedup": False}, pack={"seq_len": 128, "validation_fraction": 0.0}),
                Storage(str(tmp_path / "root")))
    assert fused["stats"]["documents"]["kept"] == 7 and fused["stats"]["documents"]["unpacked"] == 1
    for dataset in ("crawl", "fused"):
        docs = find(Storage(str(tmp_path / "root")), source=str(path), dataset=dataset)["documents"]
        urls = sorted(d["record"]["url"] for d in docs)  # the page in the carried tail has its first rows too
        assert urls == sorted({*pages, "https://example.com/after-damage"} - {"https://spam-example.com/win"})
        for d in docs:
            assert d["record"]["content_type"].startswith("text/html") and d["record"]["record_id"].startswith("<urn:")
            assert d["record"]["date"]
            with open(path, "rb") as f:  # the position is the record's gzip member
                f.seek(d["position"])
                assert d["record"]["url"].encode() in zlib.decompressobj(31).decompress(f.read(1 << 16))[:2000]


def test_rules_count_words_as_finewebs_tokenizer_cuts_them():
    """Gopher's word rules read tokens as FineWeb's spaCy rules cut them: identifiers whole, marks alone. A page
    of code is mostly marks and fails the alphabetic-words rule; prose naming a few identifiers passes it."""
    from pipelines.clean import _TOKEN, WEB, CleanConfig, QualityFilter

    assert _TOKEN.findall("Intel's x86-64 std::vec::Vec(a, b). type-driven --tool=none") == [
        "Intel", "'s", "x86", "-", "64", "std::vec::Vec(a", ",", "b", ")", ".", "type", "-", "driven",
        "--tool", "=", "none"]
    q = QualityFilter(CleanConfig(**WEB))
    code = "\n".join(f"let x{i} = _mm256_add_ps(a{i}, b{i}); // {i} + {i} = {{}};" for i in range(60))
    assert q.reason(code) == "gopher-alpha-words"
    prose = ("The method std::vec::Vec::push appends an element to the back of a collection. When the capacity "
             "is reached, it grows the buffer, which no caller has to manage by hand. Its sibling, Vec::pop, "
             "removes the last element and returns it, or None when the vector is empty. Both run in constant "
             "time on average, because growth doubles the allocation. A program that knows its final size ahead "
             "of time can call Vec::with_capacity instead, and then no reallocation happens at all while it fills "
             "the storage. These guarantees are documented, and code across the ecosystem relies on them.")
    assert q.reason(prose) == ""
