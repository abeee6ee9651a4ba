"""Tier 1 on a local Ray: the corpus becomes a committed version, every document accounted for."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from strata.dataset import list_versions, resolve
from strata.storage import Storage
from strata.tokenizer import ByteTokenizer


def test_every_document_is_accounted_for(dataset, corpus):
    d = dataset["documents"]
    rejected = sum(corpus["rejected"].values())
    filtered = sum(corpus["filtered"].values())
    assert d["read"] == d["kept"] + d["filtered"] + d["duplicate"] + d["rejected"]
    assert d["kept"] == len(corpus["good"])
    assert (d["rejected"], d["filtered"]) == (rejected, filtered)
    assert dataset["reasons"] == {**{f"rejected:{k}": v for k, v in corpus["rejected"].items()},
                                  **{f"filtered:{k}": v for k, v in corpus["filtered"].items()}}


def test_version_is_committed_with_a_complete_manifest(dataset, corpus):
    storage = Storage.from_env()
    assert dataset["version"] in list_versions(storage, dataset["dataset"])
    v = resolve(storage, f"{dataset['dataset']}@{dataset['version']}")
    m = v.manifest
    assert m.seq_len == 128 and m.dtype == "uint16" and m.tokenizer.kind == "bytes"
    assert m.documents.balanced()
    assert len(m.inputs) == corpus["files"]
    assert m.run["config"]["seq_len"] == 128 and m.run["code_version"] and m.run["libraries"]["ray"]
    assert sum(s.rows for s in m.shards) == dataset["sequences"]
    for path, shard in zip(sorted(v.shard_paths("train") + v.shard_paths("validation")),
                           sorted(m.shards, key=lambda s: v.path + "/" + s.path), strict=True):
        table = pq.read_table(path)
        assert table.num_rows == shard.rows
        t = table.schema.field("tokens").type
        assert pa.types.is_fixed_size_list(t) and t.list_size == 129 and t.value_type == pa.uint16()


def test_rows_decode_back_to_the_source_text(dataset, corpus):
    """Packing keeps the bytes: every row decodes to text found in the corpus."""
    tok = ByteTokenizer()
    v = resolve(Storage.from_env(), f"{dataset['dataset']}@{dataset['version']}")
    rows = pq.read_table(v.shard_paths("train")[0]).column("tokens").combine_chunks()
    rows = rows.values.to_numpy().reshape(len(rows), -1)
    whole = "\x00".join(corpus["good"])
    for row in rows[:: max(1, len(rows) // 10)]:
        ends = [-1, *np.flatnonzero(row == tok.eot_id), len(row)]
        for a, b in zip(ends, ends[1:], strict=False):  # each document piece between end-of-text ids
            assert tok.decode(row[a + 1: b]) in whole
    # kept-document tokens, EOT included, minus the tails too short for a row
    assert dataset["tokens"] == sum(len(t.encode()) + 1 for t in corpus["good"])
    assert dataset["sequences"] * 129 <= dataset["tokens"]
    assert np.all(rows < tok.vocab_size)


def test_manifest_is_plain_json(dataset):
    v = resolve(Storage.from_env(), dataset["dataset"])
    with open(v.path + "/manifest.json") as f:
        raw = json.load(f)
    assert raw["schema_version"] == 1 and raw["documents"]["read"] == dataset["documents"]["read"]
