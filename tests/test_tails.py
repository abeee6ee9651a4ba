"""No kept document is left out for good, and the same input makes the same version.

Every document carries a unique marker and is DOC_BYTES bytes: with its end-of-text id, a divisor of the
row (seq_len + 1), so every row holds whole documents, every unit's tail and every carried tail too, and
each piece of a decoded row between end-of-text ids is one whole document (bytes tokenizer).
"""

import hashlib
import json
import random
from collections import Counter

import numpy as np
import pytest

from pipelines.config import debug
from pipelines.driver import run
from strata.data.dataset import pad_value, resolve
from strata.data.rows import read_rows
from strata.data.storage import Storage
from strata.data.tokenizer import ByteTokenizer

EOT = ByteTokenizer().eot_id


DOC_BYTES = 63  # + its end-of-text id: 64, which divides rows of 128 and 4096 ids


def write_corpus(root, docs: int, seed: int, first: int = 0) -> dict[str, str]:
    """JSONL files of DOC_BYTES-byte documents, each a unique marker and some words; returns marker -> text."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    texts = {}
    for f in range(3):
        with open(root / f"part{f}.jsonl", "w") as out:
            for _ in range(docs // 3):
                n = first + len(texts)
                words = " ".join(rng.choice(["sand", "tide", "reef", "gull", "kelp", "dune"]) for _ in range(12))
                text = f"<d{n:06d}> {words}"[:DOC_BYTES].ljust(DOC_BYTES, ".")
                texts[f"{n:06d}"] = text
                out.write(json.dumps({"text": text}) + "\n")
    return texts


def rows_of(version) -> np.ndarray:
    return np.concatenate([read_rows(p) for split in ("train", "validation") for p in sorted(version.shard_paths(split))])


def whole_documents(rows: np.ndarray) -> Counter:
    """Each document the rows hold, with how many times: the pieces between end-of-text ids."""
    pad = pad_value(rows.dtype)
    found = Counter()
    for row in rows:
        row = row[row != pad]
        assert row[-1] == EOT, "a row that cuts a document: the documents here are sized to fill rows whole"
        found.update(_text(p[p != EOT]) for p in np.split(row, np.flatnonzero(row == EOT)[:-1] + 1))
    return found


def _text(ids: np.ndarray) -> str:
    return ids.astype(np.uint8).tobytes().decode()


def check_every_document(version, texts: dict[str, str], absent: int = 0) -> None:
    have = whole_documents(rows_of(version))
    assert max(have.values()) == 1, "a document twice"
    missing = [m for m, t in texts.items() if t not in have]
    assert len(missing) == absent, (len(missing), missing[:5])


@pytest.mark.parametrize("seq_len", [127, 4095])
def test_tails_carry_into_the_next_version_and_final_pads_the_last_row(local_ray, tmp_path, seq_len):
    storage = Storage(str(tmp_path / "store"))
    # 603 documents in one split (no validation): an odd count, and not a multiple of 64, leaves a tail.
    pack = {"seq_len": seq_len, "validation_fraction": 0.0}
    first = write_corpus(tmp_path / "a", 603, seed=seq_len)
    second = write_corpus(tmp_path / "b", 603, seed=seq_len + 1, first=len(first))
    v1 = run(debug("tails", read={"inputs": (str(tmp_path / "a"),)}, pack=pack), storage)
    d1 = v1["documents"]
    assert d1["kept"] + d1["unpacked"] == len(first) and d1["unpacked"] > 0
    check_every_document(resolve(storage, "tails@v0001"), first, absent=d1["unpacked"])  # carried, not lost
    v2 = run(debug("tails", read={"inputs": (str(tmp_path / "a"), str(tmp_path / "b"))}, pack=pack), storage)
    assert v2["stats"]["carried_in"]["documents"] >= d1["unpacked"]
    # Still absent: what this version carries on (its own documents, and any carried in that again did not fill
    # a row).
    check_every_document(resolve(storage, "tails@v0002"), {**first, **second},
                         absent=v2["stats"]["carried_on"]["documents"])
    v3 = run(debug("tails-final", read={"inputs": (str(tmp_path / "a"),)}, pack={**pack, "final": True}), storage)
    assert v3["documents"]["unpacked"] == 0 and v3["documents"]["kept"] == len(first)
    assert sum(v3["stats"]["tokens_padding"].values()) > 0
    check_every_document(resolve(storage, "tails-final@v0001"), first)


def test_the_same_input_makes_the_same_version_under_any_name(local_ray, tmp_path):
    storage = Storage(str(tmp_path / "store"))
    write_corpus(tmp_path / "in", 900, seed=3)
    shas, counts = [], []
    for name in ("same-a", "same-b"):
        out = run(debug(name, read={"inputs": (str(tmp_path / "in"),)}, pack={"seq_len": 511}), storage)
        counts.append((out["documents"], out["stats"]["tokens_unpacked"]))
        v = resolve(storage, f"{name}@v0001")
        shas.append({split: [hashlib.sha256(read_rows(p).tobytes()).hexdigest() for p in sorted(v.shard_paths(split))]
                     for split in ("train", "validation")})
    assert counts[0] == counts[1] and shas[0] == shas[1]
