"""Near copies of documents, for takedowns: their MinHash band keys, and the documents of every dataset that
share one (`python -m pipelines.datasets near --doc-ids FILE`).

A document's text is read from its input file when that is still where it was read, with the digest the
version that read it recorded; else it is decoded from its tokens in a version's rows (and tails) with the
dataset's tokenizer (strata.data.lineage.document_tokens). Rows are shuffled into shards, so a document of more
than three rows decodes with its middle rows in an order lineage does not keep: its band keys then match
its edited copies less often than its own text's would.

Keys are made with each dataset's own dedup parameters (its manifest's `dedup.params`), so they compare
with what its dedup index holds: the band keys of the documents each version kept, for the versions in the
dedup window of its newest version (24 by default). Near copies in older versions are not found: their
band keys are no longer kept (their exact copies are, through lineage's exact keys).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pipelines.dedup import hasher_of
from strata.commands.shell import log as _logger
from strata.data.storage import Storage, list_dir

_say = _logger("near").info


def band_keys(hasher, texts: Iterable[str]) -> set[int]:
    """Every band key of `texts`."""
    keys: set[int] = set()
    for text in texts:
        keys.update(int(k) for k in hasher.band_keys(hasher.signature(text)))
    return keys


def original_texts(docs: dict[str, dict]) -> dict[str, str]:
    """The normalized text of each document (`find`'s documents, by id) whose input file is still where it
    was read, with the digest recorded then: {doc_id: text} of those found."""
    from pipelines.clean import CleanConfig, normalize
    from strata.data.digests import path_digest
    from strata.data.inputs import documents

    out, by_source = {}, {}
    for doc_id, d in docs.items():
        by_source.setdefault(d["source"], set()).add(doc_id)
    for source, ids in sorted(by_source.items()):
        want = next(iter(docs[i]["file"].get("digest") for i in ids))
        try:
            if not want or path_digest(source) != want:
                continue
            for rec in documents([source]):
                if rec["doc_id"] in ids and rec["status"] == "ok":
                    out[rec["doc_id"]] = normalize(rec["text"], CleanConfig())
        except (OSError, ValueError):  # gone, or unreadable now: the decoded tokens serve
            continue
    return out


def texts(version, rows: list[dict], docs: dict[str, dict]) -> dict[str, str]:
    """The text of each document of `rows` (`find`'s rows of `version`): its input file's record when that
    verifies (`original_texts`), else its tokens in `version` decoded (its end in the tails included)."""
    from pipelines.pack import read_tails
    from strata.data.lineage import document_tokens
    from strata.data.tokenizer import from_info

    m = version.manifest
    tokens = document_tokens(version, rows)
    if m.tails:  # a document's end may wait in the tails, for the next version to pack first
        for split_tokens, runs in read_tails(version.named(m.tails, legacy_ok=True)).values():
            at = 0
            for doc_id, n in zip(runs.ids, runs.lengths, strict=True):
                if doc_id in tokens:
                    tokens[doc_id] = np.concatenate([tokens[doc_id], split_tokens[at: at + n].astype(np.int64)])
                at += n
    tok = from_info(m.tokenizer, version.tokenizer_definition())
    out = {doc_id: tok.decode(ids[ids != tok.eot_id].tolist()) for doc_id, ids in tokens.items()}
    out.update(original_texts({d: docs[d] for d in out if d in docs}))
    return out


def near_copies(storage: Storage, doc_ids: list[str]) -> dict:
    """The documents, in every dataset under the root, that share a MinHash band with one of `doc_ids`, by
    that dataset's own parameters, in the versions its dedup index holds: {"doc_ids": the near copies (the
    documents themselves left out), "searched": {dataset: versions in its index}, "not_searched": {dataset:
    why}}."""
    from pipelines.dedup import segment_lookup
    from strata.data.dataset import DatasetError, resolve
    from strata.data.lineage import doc_key, find, find_keys

    found = find(storage, doc_ids=doc_ids)
    docs = {d["doc_id"]: d for d in found["documents"]}
    texts_of: dict[str, str] = {}
    for h in found["versions"]:  # each document from the first version that holds it
        todo = [r for r in h["rows"] if r["doc_id"] not in texts_of]
        if todo:
            texts_of.update(texts(resolve(storage, h["ref"]), todo, docs))
    out, searched, skipped = set(), {}, {}
    for name in sorted(n for n, d in list_dir(storage.datasets()) if d):
        try:
            newest = resolve(storage, name)
        except DatasetError as e:
            skipped[name] = str(e)
            continue
        params = newest.manifest.dedup.get("params")
        hasher = hasher_of(params)
        segments = [s for s in (newest.manifest.dedup.get("index") or {}).get("band", []) if s.get("params") == params]
        if hasher is None or not segments:
            skipped[name] = "no MinHash index this code reads (made before the index, or near dedup off)"
            continue
        wanted = np.array(sorted(band_keys(hasher, texts_of.values())), dtype=np.uint64)
        hits: set[int] = set()
        for seg in segments:
            seg = {**seg, "files": [{**f, "path": newest.file(f["path"]), "named": newest.named(f["path"], legacy_ok=True)}
                                    for f in seg["files"]]}
            hits.update(int(d) for d in segment_lookup(seg, wanted))
        searched[name] = sum(s["versions"] for s in segments)
        hits -= {doc_key(d) for d in doc_ids}
        if hits:
            out.update(find_keys(storage, docs=hits, dataset=name)["doc_ids"])
    return {"doc_ids": sorted(out - set(doc_ids)), "searched": searched, "not_searched": skipped}
