"""Tokenize kept documents, pack them into fixed-length rows, write parquet shards.

Runs as a Ray Data `map_batches` actor so the tokenizer loads once per worker.
Each batch writes at most one shard per split, named by a digest of its
documents (a retried task rewrites the same file), and returns one stats row:
the accounting of every document in the batch and the shards it wrote.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from strata.dataset import SPLITS, arrow_schema, token_dtype
from strata.storage import filesystem, join
from strata.tokenizer import load_tokenizer


def validation_split(doc_id: str, seed: int, fraction: float) -> bool:
    """Whether a document belongs to validation: a stable hash, so no document is in both."""
    h = hashlib.blake2b(f"{seed}:{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64 < fraction


class PackAndWrite:
    def __init__(self, *, staging: str, tokenizer: str, seq_len: int, validation_fraction: float, seed: int):
        self.tok = load_tokenizer(tokenizer)
        self.staging, self.row_len = staging, seq_len + 1
        self.fraction, self.seed = validation_fraction, seed
        self.dtype = token_dtype(self.tok.vocab_size)
        self.schema = arrow_schema(seq_len, self.dtype)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        import ray

        statuses = Counter(batch["status"].tolist())
        reasons = Counter(f"{s}:{r}" for s, r in zip(batch["status"], batch["reason"], strict=True) if r)
        streams: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        eot = np.array([self.tok.eot_id], dtype=np.uint32)
        for doc_id, text, status in zip(batch["doc_id"], batch["text"], batch["status"], strict=True):
            if status == "kept":
                split = "validation" if validation_split(doc_id, self.seed, self.fraction) else "train"
                streams[split] += [self.tok.encode(text).astype(np.uint32), eot]
        digest = hashlib.sha1("\n".join(batch["doc_id"].tolist()).encode()).hexdigest()[:16]
        shards, tokens, dropped = [], 0, 0
        for split, parts in streams.items():
            flat = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
            n = len(flat) // self.row_len
            tokens += len(flat)
            dropped += len(flat) - n * self.row_len  # the tail that does not fill a row
            if n:
                name = f"{split}-{digest}.parquet"
                self._write(name, flat[: n * self.row_len])
                shards.append({"path": name, "split": split, "rows": n, "tokens": n * self.row_len})
        here = ray.get_runtime_context().get_node_id()
        return {
            "read": [len(batch["status"])],
            "kept": [statuses.get("kept", 0)],
            "filtered": [statuses.get("filtered", 0)],
            "rejected": [statuses.get("rejected", 0)],
            "reasons": [json.dumps(reasons)],
            "tokens": [tokens],
            "tokens_dropped": [dropped],
            "shards": [json.dumps(shards)],
            "nodes": [json.dumps(sorted(set(batch["node"].tolist()) | {here}))],
        }

    def _write(self, name: str, ids: np.ndarray) -> None:
        values = pa.array(ids.astype(self.dtype))
        column = pa.FixedSizeListArray.from_arrays(values, self.row_len)
        table = pa.Table.from_arrays([column], schema=self.schema)
        fs, path = filesystem(join(self.staging, name))
        pq.write_table(table, path, filesystem=fs)

