"""Cleaning rules, MinHash/LSH dedup logic and tokenizers, without Ray."""

import math
import random

import numpy as np
import pytest

from pipelines.clean import WEB, CleanConfig, normalize, quality_reason
from pipelines.dedup import DedupConfig, DedupIndex, MinHasher, exact_key, legacy_segment, shard_of
from strata.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    check_spec,
    from_info,
    load_tokenizer,
    train_bpe,
)

PROSE = ("The committee met on Tuesday to review the proposal. After a long discussion, members agreed "
         "that the plan needed more work before a vote. The chair asked for a revised draft by next month. ")


def test_normalize_keeps_indentation_unless_collapsing():
    text = "cafe\u0301\r\n    indented\t \x07line   \n\n\n\nend  "
    assert normalize(text, CleanConfig()) == "caf\u00e9\n    indented\t line\n\nend"
    assert normalize(text, CleanConfig(whitespace="collapse")) == "caf\u00e9\n indented line\n\nend"
    assert normalize("\ufb01", CleanConfig(normalization="NFKC")) == "fi"


def _prose(n_sentences=12, seed=0):
    rng = random.Random(seed)
    words = ["committee", "plan", "river", "market", "teacher", "garden", "window", "report", "village", "engine", "harbor", "budget", "reviewed", "changed", "followed", "opened", "described", "measured", "delayed", "improved", "visited", "quiet", "early", "bright", "narrow", "careful", "public", "local", "several", "winter", "summer", "morning", "evening", "question", "answer", "letter", "station", "bridge", "forest", "museum", "library", "kitchen", "doctor", "farmer", "painter", "student"]
    return " ".join(" ".join(rng.choice(words) for _ in range(rng.randint(8, 14))).capitalize() + "."
                    for _ in range(n_sentences))


def test_varied_prose_passes_every_web_rule():
    cfg = CleanConfig(**WEB)
    assert quality_reason(normalize(_prose(), cfg), cfg) == ""


@pytest.mark.parametrize(("rule", "text", "reason"), [
    ("min_words", "word " * 10, "gopher-min-words"),
    ("min_mean_word_length", "a b c d e " * 30, "gopher-mean-word-length"),
    ("max_mean_word_length", "extraordinarily incomprehensible " * 40, "gopher-mean-word-length"),
    ("min_alpha_word_fraction", "### 1234 5678 " * 30 + _prose(2), "gopher-alpha-words"),
    ("max_symbol_word_ratio", _prose(2) + " #" * 60, "gopher-symbol-ratio"),
    ("max_bullet_line_fraction", "\n".join(f"- item {i} in the list" for i in range(40)), "gopher-bullet-lines"),
    ("max_ellipsis_line_fraction", "\n".join(["and then ..."] * 10 + [_prose(1)]), "gopher-ellipsis-lines"),
    ("max_duplicate_line_fraction", "\n".join([_prose(1)] + ["the same line"] * 10), "gopher-duplicate-lines"),
    ("max_top_2gram_fraction", "buy now " * 40 + _prose(2), "gopher-top-2gram"),
    ("max_duplicate_5gram_fraction", _prose(3) * 3, "gopher-duplicate-5grams"),
    ("min_terminal_punct_line_fraction", "\n".join(["no full stop here"] * 5), "c4-terminal-punctuation"),
    ("c4_bad_phrases", _prose(2) + " Lorem ipsum dolor sit amet.", "c4-bad-phrase"),
])
def test_each_rule_has_its_own_reason(rule, text, reason):
    value = WEB.get(rule) if WEB.get(rule) is not None else 0.5
    cfg = CleanConfig(**{rule: value})
    assert quality_reason(normalize(text, cfg), cfg) == reason
    assert quality_reason(normalize(_prose(), cfg), cfg) == ""


def test_rules_are_a_list_built_once_each_with_its_counter():
    from pipelines.clean import QualityFilter

    web = QualityFilter(CleanConfig(**WEB))
    names = [r.name for r in web.rules]
    assert names[:4] == ["too-short", "too-long", "gopher-min-words", "gopher-max-words"]
    assert "c4-bad-phrase" in names and "c4-terminal-punctuation" not in names  # off in the web preset
    assert [r.name for r in QualityFilter(CleanConfig()).rules] == ["too-short", "too-long"]
    texts = ["tiny", _prose(), "lorem ipsum " + _prose(), "tiny too"]
    assert [web.reason(normalize(t, CleanConfig(**WEB))) for t in texts] == [
        "too-short", "", "c4-bad-phrase", "too-short"]
    assert web.counts() == {"too-short": 2, "c4-bad-phrase": 1}


def test_rules_are_off_by_default():
    assert quality_reason("a b c d e " * 30, CleanConfig()) == ""
    assert quality_reason("x" * 20, CleanConfig(min_chars=1, max_chars=10)) == "too-long"


def _weighted_error(threshold: float, bands: int, rows: int, fn_weight: float) -> float:
    """The weighted false-positive and false-negative areas under the S-curve (trapezoids, each side of
    the threshold on a grid of its own)."""
    low, high = np.linspace(0, threshold, 20001), np.linspace(threshold, 1, 20001)

    def p(s):
        return 1 - (1 - s**rows) ** bands

    return (1 - fn_weight) * np.trapezoid(p(low), low) + fn_weight * np.trapezoid(1 - p(high), high)


def test_lsh_bands_and_rows_minimise_the_weighted_error_over_all_splits():
    from pipelines.dedup import optimal_lsh

    for threshold, num_perm, w in ((0.8, 128, 0.5), (0.8, 128, 0.9), (0.5, 64, 0.5), (0.9, 256, 0.7)):
        b, r = optimal_lsh(threshold, num_perm, w)
        assert b * r <= num_perm
        mine = _weighted_error(threshold, b, r, w)
        # No split of num_perm, divisor or not, does better (up to the integration grid's error).
        assert all(mine <= _weighted_error(threshold, bb, rr, w) + 1e-4
                   for bb in range(1, num_perm + 1) for rr in range(1, num_perm // bb + 1)), (threshold, b, r)
    # For 0.8 over 128 permutations divisors allowed only 8 x 16, whose S-curve is centred at 0.88.
    assert optimal_lsh(0.8, 128, 0.5) != (8, 16)
    assert DedupConfig(num_perm=128, bands=32).lsh() == (32, 4) and DedupConfig(bands=10, rows=12).lsh() == (10, 12)
    assert DedupConfig().lsh() == optimal_lsh(0.8, 256, 0.9) == (23, 11)  # the defaults
    with pytest.raises(ValueError, match="at most num_perm"):
        DedupConfig(num_perm=128, bands=10, rows=13)


def test_default_lsh_catches_one_word_edits_and_not_unrelated_documents():
    """One-word edits of 75-110-word documents share a band >= 99.5% of the time (128 permutations: about
    99%); unrelated documents over the same 2,000-word vocabulary <= 0.1%."""
    rng = random.Random(11)
    vocab = [f"w{i}" for i in range(2000)]
    hasher = MinHasher(DedupConfig())

    def shares_a_band(a: str, b: str) -> bool:
        return bool(np.intersect1d(hasher.band_keys(hasher.signature(a)), hasher.band_keys(hasher.signature(b))).size)

    docs = [[rng.choice(vocab) for _ in range(rng.randint(75, 110))] for _ in range(1000)]
    edited = []
    for d in docs:
        e = list(d)
        e[rng.randrange(len(e))] = rng.choice(vocab)
        edited.append(e)
    caught = sum(shares_a_band(" ".join(a), " ".join(b)) for a, b in zip(docs, edited, strict=True))
    merged = sum(shares_a_band(" ".join(docs[i]), " ".join(docs[i + 1])) for i in range(0, 1000, 2))
    merged += sum(shares_a_band(" ".join(docs[i]), " ".join(edited[i + 2])) for i in range(0, 998, 2))
    assert caught >= 995, caught
    assert merged <= 1, merged  # of 999 unrelated pairs


def _doc(seed, n=200):
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa",
                                "lambda", "mu", "nu", "xi", "omicron", "pi"]) for _ in range(n))


def test_minhash_collides_for_near_duplicates_only():
    h = MinHasher(DedupConfig())
    a = _doc(1)
    near = a.rsplit(" ", 1)[0] + " changed"
    other = _doc(2)
    ka, kn, ko = (h.band_keys(h.signature(t)) for t in (a, near, other))
    assert (ka == kn).any()
    assert not (ka == ko).any()
    est = (h.signature(a) == h.signature(near)).mean()
    assert est > 0.9
    assert exact_key(a) == exact_key("  " + a.upper()) and exact_key(a) != exact_key(near)


def test_shingle_normalize_makes_pages_differing_in_numbers_near_duplicates():
    """FineWeb's normalization (the web preset's): numbers, accents and underscores do not tell pages apart; off,
    a release note whose every line names its version is unlike the next release's."""
    rng = random.Random(5)
    lines = [f"{rng.choice(['Fixed', 'Added', 'Removed'])} {rng.choice(['the', 'a'])} {_doc(i, 6)} in release "
             + "{v} on {d}, see issue {n}_{v}." for i in range(40)]
    old = " ".join(line.format(v="2.3", d="2024-05-01", n=i * 7) for i, line in enumerate(lines))
    new = " ".join(line.format(v="2.4", d="2024-06-11", n=i * 7 + 3) for i, line in enumerate(lines))
    plain, normal = MinHasher(DedupConfig()), MinHasher(DedupConfig(shingle_normalize=True))

    def shared_bands(h: MinHasher, a: str, b: str) -> int:
        return int((h.band_keys(h.signature(a)) == h.band_keys(h.signature(b))).sum())

    assert shared_bands(normal, old, new) == normal.bands  # the same words once numbers are 0
    assert shared_bands(plain, old, new) == 0
    assert normal.words("Café déjà_vu 10,5 v1.2.3") == ["cafe", "deja", "vu", "0", "v0", "0"]
    assert plain.words("Café déjà_vu") == ["café", "déjà_vu"]
    # A dataset's params name the normalization, so its index and a forget list's keys stay comparable.
    from pipelines.config import web
    from pipelines.dedup import hasher_of

    params = web("w", read={"inputs": ("x",)}).dedup.params()
    assert params != DedupConfig().params() and hasher_of(params).normalize and not hasher_of(DedupConfig().params()).normalize
    assert hasher_of({**params, "normalize": "something-else"}) is None


def test_index_keeps_one_winner_per_key_and_earlier_versions_win(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.pack import docs_schema

    exact = [10, 10, 20, 30]
    docs = [5, 3, 7, 9]
    bands = pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 1, 3, 4, 5, 6, 7], pa.uint64()), 2)
    order = [0, 1, 2, 3]  # their places in the input
    pq.write_table(pa.Table.from_arrays([pa.array(["a", "b", "c", "d"]), pa.array(docs, pa.uint64()),
                                         pa.array(exact, pa.uint64()), bands, pa.array(["t"] * 4, pa.large_string()),
                                         pa.array(order, pa.uint64())],
                                        schema=docs_schema(2)), tmp_path / "work.parquet")
    pq.write_table(pa.table({"key": pa.array([30], pa.uint64()), "doc": pa.array([99], pa.uint64())}),
                   tmp_path / "prior.parquet")  # an earlier version holds key 30
    prior = {"exact": [legacy_segment([str(tmp_path / "prior.parquet")], None)]}
    shards = [DedupIndex(s, 2, [str(tmp_path / "work.parquet")], prior, ("exact", "band")) for s in range(2)]
    owner = shard_of(np.array(exact, dtype=np.uint64), 2)
    winner, earlier = np.zeros(4, dtype=np.uint64), np.zeros(4, dtype=bool)
    for s, idx in enumerate(shards):
        mine = owner == s
        winner[mine], earlier[mine] = idx.winners("exact", np.array(exact, np.uint64)[mine])
    lost = earlier | (winner != np.array(docs, np.uint64))
    # doc 5 beats doc 3, the smaller doc key: it comes first in the input; key 30 was taken earlier
    assert lost.tolist() == [False, True, False, True]
    assert winner[lost].tolist() == [5, 99] and earlier[lost].tolist() == [False, True]
    assert sum(i.sizes()["exact"] for i in shards) == 3 and sum(i.sizes()["band"] for i in shards) == 7
    saved = [i.save("exact", str(tmp_path / f"s{s}.parquet"))["rows"] for s, i in enumerate(shards)]
    assert sum(saved) == 2  # keys 10 and 20: 30 is an earlier version's


def test_the_index_holds_only_new_keys_and_compaction_keeps_its_segments_few(tmp_path, monkeypatch):
    """Twelve versions, each with 300 new keys and 20 of version 1's again: each actor holds this run's keys
    only, streams earlier ones a row group at a time, still finds every repeat, and after compaction the
    index has at most (fan_in - 1) x log_fan_in(versions) + 1 segments."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines import dedup
    from pipelines.pack import docs_schema

    monkeypatch.setattr(dedup, "INDEX_ROW_GROUP", 64)
    monkeypatch.setattr(dedup, "MERGE_ROWS", 200)
    streamed = []
    rows = dedup.segment_rows
    monkeypatch.setattr(dedup, "segment_rows", lambda *a: (streamed.append(len(kd[0])) or kd for kd in rows(*a)))
    rng = np.random.default_rng(0)
    first = rng.integers(0, 2**63, 300, dtype=np.uint64) * np.uint64(2)
    segments, fan_in = [], 2
    for version in range(1, 13):
        keys = first if version == 1 else np.concatenate([rng.integers(0, 2**63, 300, dtype=np.uint64), first[:20]])
        docs = np.arange(len(keys), dtype=np.uint64) + np.uint64(1000 * version)
        work = tmp_path / f"work-{version}.parquet"
        pq.write_table(pa.Table.from_arrays([pa.array([str(d) for d in docs]), pa.array(docs), pa.array(keys),
                                             pa.FixedSizeListArray.from_arrays(pa.array(keys), 1),
                                             pa.array([""] * len(keys), pa.large_string()), pa.array(docs)],
                                            schema=docs_schema(1)), work)
        streamed.clear()
        actors = [DedupIndex(s, 3, [str(work)], {"exact": segments}, ("exact",)) for s in range(3)]
        assert sum(a.sizes()["exact"] for a in actors) == len(keys)  # this run's keys, not history's
        assert max(streamed, default=0) <= 64  # earlier keys arrive a row group at a time
        owner = shard_of(keys, 3)
        earlier = np.zeros(len(keys), bool)
        for s, a in enumerate(actors):
            earlier[owner == s] = a.winners("exact", keys[owner == s])[1]
        assert earlier.sum() == (0 if version == 1 else 20)  # every repeat of version 1 is found
        files = [a.save("exact", str(tmp_path / f"v{version}-{s}.parquet")) for s, a in enumerate(actors)]
        segments = [*segments, {"versions": 1, "params": None, "files": files}]
        while k := dedup.compaction(segments, fan_in):
            merged = [a.merge("exact", segments[-k:], str(tmp_path / f"v{version}-m{len(segments)}-{s}.parquet"))
                      for s, a in enumerate(actors)]
            segments = [*segments[:-k], {"versions": sum(x["versions"] for x in segments[-k:]), "params": None,
                                         "files": merged}]
        assert len(segments) <= (fan_in - 1) * math.log(version, fan_in) + 1
        assert sum(x["versions"] for x in segments) == version
        assert sum(f["rows"] for x in segments for f in x["files"]) == 300 * version  # each key once


def test_tokenizers_round_trip_and_identify_themselves(tmp_path):
    b = ByteTokenizer()
    assert b.decode(b.encode("héllo")) == "héllo" and b.info().vocab_size == 257
    bpe = train_bpe((PROSE + str(i) for i in range(200)), 300)
    assert bpe.vocab_size <= 300 and bpe.eot_token == "<|endoftext|>"
    ids = bpe.encode(PROSE)
    assert bpe.decode(ids) == PROSE and len(ids) < len(PROSE.encode()) * 0.75
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe.definition)
    again = load_tokenizer(str(path))
    assert again.info() == bpe.info() and again.info().file == "tokenizer.json"
    assert from_info(bpe.info(), bpe.definition).encode(PROSE).tolist() == ids.tolist()
    assert from_info(b.info()).eot_id == 256
    with pytest.raises(ValueError, match="end-of-text"):
        HFTokenizer(bpe.definition, "<nope>")
    for bad in ("train:abc", "train:10", "sentencepiece"):
        with pytest.raises(ValueError):
            check_spec(bad)
