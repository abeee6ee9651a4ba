"""Tolerant, streaming readers: every record gets a status, damage costs only what it touched."""

import gzip
import json
import os
import random
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from pipelines.pack import validation_split
from strata.data.digests import file_digest, part_digests
from strata.data.inputs import check_outside, list_inputs, plan_units
from strata.data.sources import ReadConfig, describe, read_file


def records(path, **cfg):
    rcfg = ReadConfig(inputs=(str(path),), **cfg)
    [f] = list_inputs([str(path)])
    parts = sorted((part for unit in plan_units([f], rcfg) for part in unit), key=lambda p: p["start"])
    return [r for part in parts for r in read_file(part, rcfg)]


def statuses(rows):
    return [(r["status"], r["reason"]) for r in rows]


def test_describe_by_suffix():
    assert describe("a/b.JSONL.gz") == ("jsonl", "gz")
    assert describe("x.json.zst") == ("json", "zst")
    assert describe("x.parquet") == ("parquet", "")
    assert describe("notes.md") == ("text", "")


@pytest.mark.parametrize(("data", "reason"), [
    (b"\xff\xfe broken bytes", "invalid-utf8"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary"),
    (b"", "empty-file"),
])
def test_bad_text_files_are_rejected_with_a_reason(tmp_path, data, reason):
    (tmp_path / "a.txt").write_bytes(data)
    [row] = records(tmp_path / "a.txt")
    assert (row["status"], row["reason"]) == ("rejected", reason)
    assert row["doc_id"].startswith(str(tmp_path / "a.txt"))


def test_jsonl_lines_each_get_a_status(tmp_path):
    lines = [b'{"text": "good one"}', b"{broken", b"", b'{"text": 5}', b'["a list"]', b'{"body": "x"}',
             b'{"text": "caf\xe9"}', b'{"text": "lone \\ud800 surrogate"}', b'{"text": "good two"}']
    (tmp_path / "x.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert statuses(records(tmp_path / "x.jsonl")) == [
        ("ok", ""), ("rejected", "malformed-json"), ("rejected", "missing-text-field"),
        ("rejected", "missing-text-field"), ("rejected", "missing-text-field"), ("rejected", "invalid-utf8"),
        ("rejected", "invalid-unicode"), ("ok", "")]


def test_json_array_and_custom_field(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"body": "first"}, {"body": 3}, {"body": "third"}]))
    rows = records(tmp_path / "a.json", text_field="body")
    assert statuses(rows) == [("ok", ""), ("rejected", "missing-text-field"), ("ok", "")]
    assert [r["text"] for r in rows if r["status"] == "ok"] == ["first", "third"]


def test_parquet_text_column(tmp_path):
    pq.write_table(pa.table({"content": ["alpha", None, "gamma"]}), tmp_path / "a.parquet")
    rows = records(tmp_path / "a.parquet", text_field="content")
    assert statuses(rows) == [("ok", ""), ("rejected", "missing-text-field"), ("ok", "")]
    [missing] = records(tmp_path / "a.parquet")
    assert (missing["status"], missing["reason"]) == ("rejected", "missing-text-column")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really parquet")
    [bad] = records(tmp_path / "bad.parquet")
    assert (bad["status"], bad["reason"]) == ("rejected", "corrupt-file")


def test_a_bad_parquet_value_rejects_its_row_only(tmp_path):
    """Invalid UTF-8, NUL, a null, a value over --max-record-bytes: each rejects its row with a
    reason; the rows around it are kept. A column that is not text rejects every row, by name."""
    raw = pa.array([b"first", b"bad \xff\xfe utf-8", b"nul \x00 inside", None, b"y" * 5000, b"last"], pa.binary())
    text = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers(), null_count=raw.null_count)  # unvalidated
    pq.write_table(pa.table({"text": text}), tmp_path / "a.parquet")
    rows = records(tmp_path / "a.parquet", max_record_bytes=1000)
    assert statuses(rows) == [("ok", ""), ("rejected", "invalid-utf8"), ("rejected", "binary"),
                              ("rejected", "missing-text-field"), ("rejected", "record-too-large"), ("ok", "")]
    assert [r["text"] for r in rows if r["status"] == "ok"] == ["first", "last"]
    assert [r["doc_id"].rsplit(":", 1)[1] for r in rows] == [str(i) for i in range(6)]
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    assert statuses(records(tmp_path / "ints.parquet")) == [("rejected", "missing-text-field")] * 2


def _jsonl(n, seed=0):
    rng = random.Random(seed)
    return b"".join(json.dumps({"text": f"doc {i} " + "x" * rng.randint(0, 300)}).encode() + b"\n"
                    for i in range(n))


@pytest.mark.parametrize("compress", [gzip.compress, lambda b: zstandard.ZstdCompressor().compress(b)])
def test_truncated_compressed_file_keeps_what_came_before_the_damage(tmp_path, compress):
    data = compress(_jsonl(5000))  # zstd decodes whole 128 KB blocks: give it several
    suffix = ".jsonl.gz" if data[:2] == b"\x1f\x8b" else ".jsonl.zst"
    (tmp_path / f"a{suffix}").write_bytes(data[: len(data) * 2 // 3])
    rows = records(tmp_path / f"a{suffix}")
    ok = [r for r in rows if r["status"] == "ok"]
    assert 1000 < len(ok) < 5000
    assert [r["text"].split()[1] for r in ok] == [str(i) for i in range(len(ok))]  # a clean prefix
    damaged = [r for r in rows if r["status"] == "rejected"]
    assert [r["reason"] for r in damaged][-1] == "truncated-compressed"


def test_an_io_error_half_way_is_retried_and_then_fails_the_file_instead_of_counting_it_read(tmp_path, monkeypatch):
    """A connection reset 40 KB into a file is not the file's damage: the file is read again (with
    backoff), handing out each record once; a file that keeps failing raises (its unit fails, the file is
    not consumed) instead of ending as one corrupt-file. A local input missing on a worker's node says so."""
    import pyarrow.fs as pafs

    from strata.data import sources

    (tmp_path / "a.jsonl").write_bytes(_jsonl(2000))
    [f] = list_inputs([str(tmp_path / "a.jsonl")])
    f = {**f, "start": 0, "end": f["size"]}

    class Resetting:
        def __init__(self, inner, fail):
            self.inner, self.served, self.fail = inner, 0, fail

        def read(self, n=-1):
            if self.fail and self.served > 40_000:
                raise ConnectionResetError("connection reset by peer")
            data = self.inner.read(min(n, 8192) if n and n > 0 else 8192)
            self.served += len(data)
            return data

        def seek(self, pos):
            self.inner.seek(pos)

        def close(self):
            self.inner.close()

    class FlakyFS:
        def __init__(self, failing_opens):
            self.failing, self.opens = failing_opens, 0

        def open_input_file(self, path):
            self.opens += 1
            return Resetting(pafs.LocalFileSystem().open_input_file(path), self.opens <= self.failing)

    monkeypatch.setattr(sources, "RETRY_BASE_S", 0.0)
    cfg = ReadConfig(inputs=(str(tmp_path),), read_retries=2)
    fs = FlakyFS(failing_opens=2)
    monkeypatch.setattr(sources, "filesystem", lambda path: (fs, path))
    rows = list(read_file(f, cfg))  # two resets, then a whole read: every record once, in order
    assert fs.opens == 3 and [int(r["text"].split()[1]) for r in rows] == list(range(2000))
    fs = FlakyFS(failing_opens=10)
    got = []
    with pytest.raises(sources.InputUnreadable, match="connection reset.*read 3 times"):
        for row in read_file(f, cfg):
            got.append(row)
    assert fs.opens == 3 and got and all(r["status"] == "ok" for r in got)  # no corrupt-file reject for the rest
    monkeypatch.undo()
    (tmp_path / "a.jsonl").unlink()
    with pytest.raises(sources.InputMissing, match="is not there on node .*shared filesystem"):
        list(read_file(f, cfg))


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize("kind", ["zstd-frames", "gzip-members", "gzip-zero-padding", "zstd-then-damage"])
def test_concatenated_and_padded_compressed_files_keep_every_record(tmp_path, kind):
    """`cat a.zst b.zst`, `cat a.gz b.gz`, a .gz padded with zeros (as tape and some uploaders leave
    them): every record is read. After damage, what came before is kept and the damage counted."""
    first, second = _jsonl(300), _jsonl(300).replace(b'"doc ', b'"more ')
    data, suffix, want = {
        "zstd-frames": (_zstd(first) + _zstd(second), ".zst", 600),
        "gzip-members": (gzip.compress(first) + gzip.compress(second), ".gz", 600),
        "gzip-zero-padding": (gzip.compress(first + second) + b"\0" * 4096, ".gz", 600),
        "zstd-then-damage": (_zstd(first) + b"\x28\xb5\x2f\xfd" + b"\xff" * 64, ".zst", 300),
    }[kind]
    (tmp_path / f"a.jsonl{suffix}").write_bytes(data)
    rows = records(tmp_path / f"a.jsonl{suffix}")
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == want and len({r["text"] for r in ok}) == want
    rejected = [r["reason"] for r in rows if r["status"] == "rejected"]
    assert rejected == ([] if want == 600 else [rejected[0]]) and (want == 600 or rejected[0] in (
        "corrupt-file", "truncated-compressed"))


def test_a_decompression_bomb_is_read_in_bounded_memory(tmp_path):
    """A 32 KB zstd file that decodes to 1 GB of one line: rejected as too large, in a few MB."""
    import subprocess
    import sys

    z = zstandard.ZstdCompressor(level=19).compressobj()
    bomb = b"".join(z.compress(b"a" * (1 << 20)) for _ in range(1024)) + z.flush()
    assert len(bomb) < 1 << 17
    (tmp_path / "bomb.jsonl.zst").write_bytes(bomb)
    code = ("import resource, sys; from tests.test_sources import records, statuses; "
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
            f"rows = records({str(tmp_path / 'bomb.jsonl.zst')!r}); "
            "print(statuses(rows), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    found, grew_mb = out.stdout.strip().rsplit(" ", 1)
    assert found == "[('rejected', 'record-too-large')]"
    assert int(grew_mb) < 128, grew_mb  # the line is skipped chunk by chunk; decoding is in slices


def test_corrupt_gzip_is_counted_not_raised(tmp_path):
    data = bytearray(gzip.compress(_jsonl(200)))
    data[len(data) // 2: len(data) // 2 + 50] = b"\x00" * 50
    (tmp_path / "a.jsonl.gz").write_bytes(bytes(data))
    rows = records(tmp_path / "a.jsonl.gz")
    assert rows[-1]["status"] == "rejected" and rows[-1]["reason"] in ("corrupt-file", "truncated-compressed")


def test_a_huge_line_is_skipped_without_holding_it(tmp_path):
    with open(tmp_path / "a.jsonl", "wb") as f:
        f.write(b'{"text": "before"}\n')
        f.write(b'{"text": "' + b"y" * (20 << 20) + b'"}\n')  # a 20 MB line
        f.write(b'{"text": "after"}\n')
    rows = records(tmp_path / "a.jsonl", max_record_bytes=1 << 20)
    assert statuses(rows) == [("ok", ""), ("rejected", "record-too-large"), ("ok", "")]
    assert rows[2]["text"] == "after"
    (tmp_path / "big.txt").write_bytes(b"z" * (3 << 20))
    [big] = records(tmp_path / "big.txt", max_record_bytes=1 << 20)
    assert big["reason"] == "record-too-large"


def test_a_long_line_is_read_once_not_by_every_range_it_covers(tmp_path, monkeypatch):
    """A 40 MB line cut into 2 MiB ranges: each range stops at its own end, the one where the line
    begins too, so the file is read about once (it used to be read 7 times: every range the line
    covered scanned to its end)."""
    from strata.data import sources

    with open(tmp_path / "a.jsonl", "wb") as f:
        f.write(b'{"text": "before"}\n{"text": "' + b"y" * (40 << 20) + b'"}\n{"text": "after"}\n')
    size = os.path.getsize(tmp_path / "a.jsonl")
    read = []
    original = sources._Raw.readinto
    monkeypatch.setattr(sources._Raw, "readinto", lambda self, b: read.append(original(self, b)) or read[-1])
    rows = records(tmp_path / "a.jsonl", split_bytes=2 << 20, max_record_bytes=1 << 20)
    assert statuses(rows) == [("ok", ""), ("rejected", "record-too-large"), ("ok", "")]
    assert sum(read) < 1.3 * size, sum(read) / size  # each range's own bytes, and a buffer's read-ahead


@pytest.mark.parametrize("split_bytes", [1 << 16, 100_000, 1 << 20])
def test_ranges_read_every_jsonl_record_exactly_once(tmp_path, split_bytes):
    data = _jsonl(3000, seed=split_bytes)
    (tmp_path / "a.jsonl").write_bytes(data)
    rows = records(tmp_path / "a.jsonl", split_bytes=split_bytes)
    assert len(plan_units(list_inputs([str(tmp_path / "a.jsonl")]), ReadConfig(inputs=("x",), split_bytes=split_bytes))) \
        == -(-len(data) // split_bytes)
    assert [r["text"].split()[1] for r in rows] == [str(i) for i in range(3000)]
    assert len({r["doc_id"] for r in rows}) == 3000


@pytest.mark.parametrize("split_bytes", [1 << 16, 77_777])
def test_blank_line_blocks_split_into_ranges_read_every_block_once(tmp_path, split_bytes):
    rng = random.Random(1)
    blocks = ["\n".join(f"block {i} line {j} " + "w" * rng.randint(0, 80) for j in range(rng.randint(1, 6)))
              for i in range(2000)]
    sep = ["\n\n", "\n\n\n", "\n  \n"]
    (tmp_path / "a.txt").write_text("".join(b + rng.choice(sep) for b in blocks))
    rows = records(tmp_path / "a.txt", txt_documents="blank-line", split_bytes=split_bytes)
    assert [r["text"] for r in rows] == blocks


def test_list_inputs_expands_dirs_globs_and_file_uris(tmp_path):
    (tmp_path / "d").mkdir()
    for name in ("d/a.txt", "d/b.txt", "c.jsonl", "d/.hidden"):
        (tmp_path / name).write_text("x")
    files = list_inputs([str(tmp_path / "d"), str(tmp_path / "*.jsonl"), str(tmp_path / "d" / "a.txt")])
    assert [os.path.basename(f["path"]) for f in files] == ["c.jsonl", "a.txt", "b.txt"]
    assert all(f["size"] == 1 and f["mtime_ns"] for f in files)
    uri = list_inputs([f"file://{tmp_path}/d"])
    assert [f["path"] for f in uri] == [f"file://{tmp_path}/d/a.txt", f"file://{tmp_path}/d/b.txt"]
    assert records(f"file://{tmp_path}/d/a.txt")[0]["status"] == "ok"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_inputs([str(tmp_path / "nope")])
    with pytest.raises(FileNotFoundError, match="matches no file"):
        list_inputs([str(tmp_path / "*.parquet")])


def test_small_files_are_grouped_into_units(tmp_path):
    for i in range(10):
        (tmp_path / f"{i}.txt").write_bytes(b"x" * 30_000)
    units = plan_units(list_inputs([str(tmp_path)]), ReadConfig(inputs=("x",), split_bytes=1 << 16))
    assert [len(u) for u in units] == [3, 3, 3, 1]


def test_big_files_are_cut_into_equal_ranges_biggest_units_first(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b"x" * 250_000)
    (tmp_path / "b.jsonl").write_bytes(b"x" * 40_000)
    units = plan_units(list_inputs([str(tmp_path)]), ReadConfig(inputs=("x",), split_bytes=100_000))
    sizes = [sum(p["end"] - p["start"] for p in u) for u in units]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) == 290_000
    assert max(sizes[:3]) - min(sizes[:3]) <= 1 and sizes[3] == 40_000


def test_validation_split_is_stable_and_near_the_fraction():
    ids = [f"doc{i}" for i in range(4000)]
    val = [d for d in ids if validation_split(d, 0, 0.1)]
    assert val == [d for d in ids if validation_split(d, 0, 0.1)]
    assert 300 < len(val) < 500
    assert val != [d for d in ids if validation_split(d, 1, 0.1)]


def test_a_deferred_file_leaves_its_unit_and_its_other_ranges_out(tmp_path):
    """--unreadable defer: a unit runs again without the file that stays unreadable; the run then drops
    every unit that held only byte ranges of it, and no other. The default fails instead."""
    from pipelines.stats import Output, Tally, without_deferred
    from strata.data.digests import with_deferral
    from strata.data.sources import InputUnreadable

    for name in ("a", "bad", "c"):
        (tmp_path / name).write_text(f"{name}\n")
    path = {name: str(tmp_path / name) for name in ("a", "bad", "c")}
    unit = [{"path": path[n], "start": 0, "end": 2, "size": 2} for n in ("a", "bad", "c")]
    seen = []

    def process(files):
        seen.append([os.path.basename(f["path"]) for f in files])
        if any(f["path"] == path["bad"] for f in files):
            raise InputUnreadable("reading bad failed", path["bad"])
        return Output(tally=Tally(kept=len(files)))

    with pytest.raises(InputUnreadable):
        with_deferral(unit, ReadConfig(inputs=("x",)), process)
    out = with_deferral(unit, ReadConfig(inputs=("x",), unreadable="defer"), process)
    assert seen[-2:] == [["a", "bad", "c"], ["a", "c"]] and out.tally.kept == 2
    assert out.tally.deferred == {path["bad"]: "reading bad failed"}
    assert [(p, i) for p, i, _ in out.digests] == [(path["a"], 0), (path["c"], 0)]  # not the deferred file's
    ranges = [with_deferral([{"path": path["bad"], "start": s, "end": s + 1, "size": 2}],
                            ReadConfig(inputs=("x",), unreadable="defer"),
                            lambda files: Output(tally=Tally(kept=len(files)))) for s in (0, 1)]  # read fine
    kept, deferred = without_deferred([out, *ranges])
    assert kept == [out] and deferred == {path["bad"]: "reading bad failed"}


def test_symbolic_link_loops_are_followed_once(tmp_path):
    (tmp_path / "in" / "a").mkdir(parents=True)
    (tmp_path / "in" / "a" / "one.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "two.jsonl").write_text('{"text": "y"}\n')
    os.symlink("..", tmp_path / "in" / "a" / "up")  # a loop back to the input's root
    os.symlink("../a", tmp_path / "in" / "a" / "self")  # and to itself
    os.symlink(tmp_path / "elsewhere", tmp_path / "in" / "linked")  # a linked directory is read
    os.symlink(tmp_path / "in" / "a" / "one.jsonl", tmp_path / "in" / "again.jsonl")  # a second path to one file
    os.symlink(tmp_path / "nowhere", tmp_path / "in" / "dangling.jsonl")
    skipped = []
    found = [f["path"] for f in list_inputs([str(tmp_path / "in")], skipped=skipped)]
    real = sorted(os.path.realpath(p) for p in found)  # each file once, by whichever path came first
    assert real == [str(tmp_path / "in" / "a" / "one.jsonl")], found  # the link out of the folder is not read
    assert sorted(skipped) == [str(tmp_path / "in" / n) for n in ("dangling.jsonl", "linked")]
    found = [f["path"] for f in list_inputs([str(tmp_path / "in")], follow_links=True)]
    real = sorted(os.path.realpath(p) for p in found)
    assert real == [str(tmp_path / "elsewhere" / "two.jsonl"), str(tmp_path / "in" / "a" / "one.jsonl")], found


def test_links_and_globs_never_reach_the_storage_root_or_a_secret(tmp_path):
    """The red team's inputs: a folder with links into the storage root and to a credentials file, and globs
    and URIs that spell the root another way."""
    root = tmp_path / "store"
    (root / "datasets" / "web" / "v0001").mkdir(parents=True)
    (root / "datasets" / "web" / "v0001" / "manifest.json").write_text('{"text": "a manifest, not input"}')
    (tmp_path / "home" / ".aws").mkdir(parents=True)
    (tmp_path / "home" / ".aws" / "credentials.txt").write_text("aws_secret_access_key = hunter2hunter2")
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "good.txt").write_text("a document")
    os.symlink(root / "datasets", inp / "datasets")
    os.symlink(tmp_path / "home" / ".aws" / "credentials.txt", inp / "notes.txt")
    skipped = []
    files = list_inputs([str(inp)], skipped=skipped)
    assert [os.path.basename(f["path"]) for f in files] == ["good.txt"]
    assert sorted(os.path.basename(p) for p in skipped) == ["datasets", "notes.txt"]
    followed = list_inputs([str(inp)], follow_links=True)
    with pytest.raises(ValueError, match="inside the storage root"):
        check_outside([str(inp)], str(root), followed)  # even when asked to follow links, never the root
    for spelling in (f"{root}/dat[a]/**", f"{tmp_path}/stor?", f"file://{root}/datasets", f"{root}/../store/*"):
        with pytest.raises(ValueError, match="storage root"):
            check_outside([spelling], str(root))
    check_outside([str(inp)], str(root), files)


def test_rejected_binary_bytes_are_summarised_never_copied(tmp_path):
    key = bytes(range(256)) * 4 + b"\x00PRIVATE"
    (tmp_path / "id_key.txt").write_bytes(key)
    (tmp_path / "latin.txt").write_bytes("caf\xe9 secret 12345".encode("latin-1"))
    (tmp_path / "lines.jsonl").write_text('{"text": "ok"}\n{broken json line\n')
    rows = {os.path.basename(r["doc_id"].rsplit(":", 1)[0]): r for p in ("id_key.txt", "latin.txt", "lines.jsonl")
            for r in records(tmp_path / p) if r["status"] == "rejected"}
    assert rows["id_key.txt"]["reason"] == "binary" and "PRIVATE" not in rows["id_key.txt"]["sample"]
    assert rows["id_key.txt"]["sample"].startswith(f"<{len(key):,} bytes, sha256 ")
    assert "secret" not in rows["latin.txt"]["sample"]
    assert rows["lines.jsonl"]["sample"] == "{broken json line"  # text stays readable


def test_deep_json_nesting_is_a_malformed_line_not_a_crash(tmp_path):
    (tmp_path / "deep.jsonl").write_text('{"text": "before"}\n' + "[" * 100_000 + "\n" + '{"text": "after"}\n')
    (tmp_path / "deep.json").write_text("[" * 100_000)
    assert statuses(records(tmp_path / "deep.jsonl")) == [("ok", ""), ("rejected", "malformed-json"), ("ok", "")]
    assert statuses(records(tmp_path / "deep.json")) == [("rejected", "malformed-json")]


def test_dictionary_encoded_text_is_read(tmp_path):
    texts = ["the same text", "another one", "the same text"]
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), tmp_path / "dict.parquet")
    pq.write_table(pa.table({"text": pa.array(texts, pa.large_string()).dictionary_encode()}), tmp_path / "big.parquet")
    for name in ("dict.parquet", "big.parquet"):
        assert [r["text"] for r in records(tmp_path / name)] == texts


def test_a_corrupt_parquet_costs_its_damaged_row_groups_and_is_never_retried(tmp_path):
    """Flipped bytes in a page, or a broken footer, are the file's own damage: counted corrupt-file, the rest
    of the file (and its other row groups) kept, and no I/O retry (which would fail the run)."""
    texts = [f"doc {i} " + "word " * 40 for i in range(4000)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "good.parquet", row_group_size=1000, compression="snappy")
    data = bytearray((tmp_path / "good.parquet").read_bytes())
    meta = pq.ParquetFile(tmp_path / "good.parquet").metadata
    second = meta.row_group(1).column(0)
    for i in range(second.data_page_offset, second.data_page_offset + 16):
        data[i] ^= 0x5A  # the second row group's first page header
    (tmp_path / "page.parquet").write_bytes(bytes(data))
    (tmp_path / "footer.parquet").write_bytes(bytes(data[:-12]) + b"\xff" * 8 + b"PAR1")
    rows = records(tmp_path / "page.parquet", read_retries=0)  # an I/O error would raise at once
    good = [r["text"] for r in rows if r["status"] == "ok"]
    assert good == texts[:1000] + texts[2000:]
    assert statuses([r for r in rows if r["status"] != "ok"]) == [("rejected", "corrupt-file")]
    assert "row group 1 (1,000 rows)" in next(r["sample"] for r in rows if r["status"] != "ok")
    assert statuses(records(tmp_path / "footer.parquet", read_retries=0)) == [("rejected", "corrupt-file")]


def test_an_input_that_overlaps_the_storage_root_is_refused(tmp_path):
    root = str(tmp_path / "store")
    for bad in (root, root + "/datasets/web", str(tmp_path), root + "/*.json", "s3://b"):
        with pytest.raises(ValueError, match="storage root"):
            check_outside([bad], root if not bad.startswith("s3") else "s3://b/strata")
    check_outside([str(tmp_path / "raw"), str(tmp_path / "store2")], root)
    check_outside(["s3://b/raw/"], "s3://b/strata")
    out = subprocess.run([sys.executable, "-m", "pipelines.preprocess", "--input", root, "--dataset", "d"],
                         env={**os.environ, "STRATA_STORAGE": root}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "overlaps the storage root" in out.stderr and not os.path.exists(root)


@pytest.mark.parametrize("size", [0, 1000, 17 * 2**20 + 5])
def test_the_ranges_of_a_file_digest_each_part_once_and_give_its_sha256(any_root, size):
    """Every part of a file, on local disk or the S3 server, is digested by exactly one of its ranges,
    however it is cut: one part's digest is the file's sha256 (what sha256sum prints); more are the sha256
    of their sha256s, in order (the test's own computation). A part no range digested (a deferred file)
    gives no digest."""
    import hashlib

    from strata.data.storage import join, write_bytes_atomic

    data = random.Random(size).randbytes(size)
    write_bytes_atomic(join(any_root, "in", "a.jsonl"), data)
    [f] = list_inputs([join(any_root, "in", "a.jsonl")], allow_empty=True)
    units = plan_units([f], ReadConfig(inputs=("x",), split_bytes=3 << 20))
    assert (len(units) > 3) == (size > 2**20)  # ranges where no part starts, as well as ones where one does
    parts = [p for unit in units for r in unit for p in part_digests(r, ReadConfig(inputs=("x",)))]
    assert sorted(i for _, i, _ in parts) == list(range(max(1, -(-size // 2**23))))  # each once
    digest = file_digest(size, {i: h for _, i, h in parts})
    whole = [data[i:i + 2**23] for i in range(0, size, 2**23)] or [b""]
    if len(whole) == 1:
        assert digest == "sha256:" + hashlib.sha256(data).hexdigest()
    else:
        inner = b"".join(hashlib.sha256(p).digest() for p in whole)
        assert digest == "sha256-8MiB-parts:" + hashlib.sha256(inner).hexdigest()
    assert file_digest(size, {i: h for _, i, h in parts[1:]}) is None
