"""A shard's rows as training reads them: token ids as an (n, seq_len + 1) array of the dataset's unsigned type,
a range decoding only the row groups that hold it (`read_rows`), the last groups read kept for the next range.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from strata.data.dataset import DTYPE_KEY, TOKENS
from strata.data.storage import filesystem

_GROUPS: OrderedDict[str, tuple[int, np.ndarray]] = OrderedDict()  # the last row groups read, per shard (2)
_GROUPS_LOCK = threading.Lock()  # read-ahead threads and the loop read at once


def read_rows(path: str, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows [start, stop) of a shard (all by default) as one (n, seq_len + 1) array of token ids; a range
    reads only the row groups that hold it, and the next range inside the same groups reads nothing (a
    shard written as one row group, as before 2026-12-02, is then decoded once, not once per range)."""
    fs, p = filesystem(path)
    if start == 0 and stop is None:
        table = pq.read_table(p, filesystem=fs, columns=[TOKENS])
        return _ids(table.column(TOKENS).combine_chunks(), table.schema)
    with _GROUPS_LOCK:
        held = _GROUPS.get(path)
    if stop is not None and held and held[0] <= start and stop <= held[0] + len(held[1]):
        return held[1][start - held[0]: stop - held[0]]
    f = pq.ParquetFile(fs.open_input_file(p))
    groups, first, at = [], None, 0
    stop = f.metadata.num_rows if stop is None else stop
    for g in range(f.metadata.num_row_groups):
        n = f.metadata.row_group(g).num_rows
        if at + n > start and at < stop:
            groups.append(g)
            first = at if first is None else first
        at += n
    rows, first = _ids(f.read_row_groups(groups, columns=[TOKENS]).column(TOKENS).combine_chunks(), f.schema_arrow), first or 0
    with _GROUPS_LOCK:
        _GROUPS[path] = (first, rows)
        _GROUPS.move_to_end(path)
        while len(_GROUPS) > 2:
            _GROUPS.popitem(last=False)
    return rows[start - first: stop - first]


def _ids(col: pa.Array, schema: pa.Schema) -> np.ndarray:
    """A tokens column as an (n, seq_len + 1) array of the dataset's unsigned type (the file's metadata
    names it: Delta stores them signed); its pad value (the type's largest) is what training masks."""
    rows = col.flatten().to_numpy().reshape(len(col), -1)
    dtype = (schema.metadata or {}).get(DTYPE_KEY)
    return rows.astype(dtype.decode()) if dtype and rows.dtype.kind == "i" else rows
