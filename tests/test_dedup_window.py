"""Dedup within a window of versions (--dedup-window), against another dataset (--dedup-against), and the
index that follows the window: real runs on the embedded Ray, real Delta tables."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, WORDS

from pipelines.config import debug
from pipelines.dedup import DedupConfig, compaction, in_window, window_versions
from pipelines.driver import run
from strata.data.dataset import DatasetError, resolve
from strata.data.storage import Storage


def _docs(rng: random.Random, n: int, tag: str) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(80, 160))) + f" {tag}{i}." for i in range(n)]


def _write(directory, texts: list[str]) -> str:
    os.makedirs(directory, exist_ok=True)
    for i, t in enumerate(texts):
        (directory / f"d{i:03d}.txt").write_text(t)
    return str(directory)


def _near(text: str) -> str:
    """The text with its last word changed: a near duplicate (Jaccard about 0.97)."""
    return text.rsplit(" ", 1)[0] + " changed."


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Three versions' inputs: v1 holds X and Y; v2 adds a copy of Y; v3 a copy of X (only v1 holds it)
    and a near copy of one of v2's documents."""
    rng = random.Random(46)
    root = tmp_path_factory.mktemp("window")
    one, two, three = _docs(rng, 12, "a"), _docs(rng, 12, "b"), _docs(rng, 12, "c")
    return {"x": one[0], "inputs": [_write(root / "v1", one), _write(root / "v2", [*two, one[1]]),
                                    _write(root / "v3", [*three, one[0], _near(two[2])])]}


def _grow(name: str, inputs: list[str], window) -> list[dict]:
    storage = Storage.from_env()
    return [run(debug(name, read={"inputs": (path,)}, dedup={"window": window}), storage) for path in inputs]


def test_a_window_compares_with_the_last_n_versions_only(local_ray, versions, capsys):
    storage = Storage.from_env()
    one, two, three = _grow("win", versions["inputs"], 1)
    assert two["documents"]["duplicate"] == 1 and two["stats"]["duplicate_of"]["earlier versions"] == 1
    # v3's window is v2 alone: the copy of X (only v1 kept it) is kept; the near copy of a v2 document is not.
    assert three["documents"]["duplicate"] == 1 and three["stats"]["duplicate"] == {"exact": 0, "near": 1}
    m = resolve(storage, f"win@{three['version']}").manifest
    assert m.dedup["window"] == {"size": 1, "versions": [two["version"]], "keys_compared": three["dedup_keys_compared"]}
    # The index the next version reads holds this version's keys alone: v2's left with the window, unread.
    for table in ("exact", "band"):
        assert [(s["first"], s["last"]) for s in m.dedup["index"][table]] == [(three["version"],) * 2]
    from pipelines.datasets import main

    main(["show", f"win@{three['version']}"])
    assert f"the last 1 versions (--dedup-window), 1 so far: {two['version']}" in capsys.readouterr().out

    # The same inputs under --dedup-window all: v3's copy of X is a duplicate of v1's.
    a1, a2, a3 = _grow("win-all", versions["inputs"], "all")
    assert (a2["documents"]["duplicate"], a3["documents"]["duplicate"]) == (1, 2)
    assert resolve(storage, f"win-all@{a3['version']}").manifest.dedup["window"] == {
        "size": "all", "earlier_versions": 2, "keys_compared": a3["dedup_keys_compared"]}
    assert a3["dedup_keys_compared"] > three["dedup_keys_compared"]  # v1's keys too


def test_dedup_against_another_dataset(local_ray, versions, tmp_path):
    """A fine-tuning set kept free of a pretraining corpus: documents the other dataset holds (exact and
    near copies) are dropped and counted as its, through its own index."""
    storage = Storage.from_env()
    pre = run(debug("pre", read={"inputs": (versions["inputs"][0],)}), storage)
    rng = random.Random(7)
    mine = _docs(rng, 10, "ft")
    x = versions["x"]
    ft = _write(tmp_path / "ft", [*mine, x, _near((Path(versions["inputs"][0]) / "d003.txt").read_text())])
    out = run(debug("ft", read={"inputs": (ft,)}, dedup={"against": f"pre@{pre['version']}"}), storage)
    assert out["documents"]["duplicate"] == 2 and out["stats"]["duplicate_of"]["other dataset"] == 2
    assert out["documents"]["kept"] + out["documents"]["unpacked"] == len(mine)
    m = resolve(storage, f"ft@{out['version']}").manifest
    assert m.dedup["against"]["dataset"] == f"pre@{pre['version']}" and m.dedup["against"]["removed"] == 2
    # Without the flag the same input keeps both.
    plain = run(debug("ft-plain", read={"inputs": (ft,)}), storage)
    assert plain["documents"]["duplicate"] == 0
    with pytest.raises(DatasetError, match="no committed version"):
        run(debug("ft2", read={"inputs": (ft,)}, dedup={"against": "no-such"}), storage)
    with pytest.raises(DatasetError, match="the dataset being written"):
        run(debug("ft", read={"inputs": (ft,)}, dedup={"against": "ft"}), storage)


def test_the_flags_on_the_command_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipelines.preprocess", "--input", str(tmp_path), "--dataset", "d",
                           "--dedup-window", "0"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "--dedup-window '0': must be a number of versions >= 1, or all" in proc.stderr
    assert DedupConfig(window="all").window_size() is None and DedupConfig(window=24).window_size() == 24
    assert DedupConfig().window == "24"


def test_the_window_moves_and_drops_versions_unread():
    seg = lambda v, n=1: {"versions": n, "first": v, "last": v}  # noqa: E731
    assert window_versions(None, None, 3) == [] and window_versions(["v1", "v2", "v3"], "v4", 3) == ["v2", "v3", "v4"]
    assert window_versions(["v1"], "v2", None) is None
    segments = [seg("v1"), seg("v2"), seg("v3"), seg("v4")]
    assert in_window(segments, ["v3", "v4"]) == segments[2:]
    assert in_window(segments, []) == []
    # Segments made before windows (no `last`) fill what the named ones leave, newest first.
    old = [{"versions": 4}, {"versions": 1}, {"versions": 1}]
    assert in_window([*old, seg("v7")], ["v5", "v6", "v7"]) == [old[1], old[2], seg("v7")]
    # A merged segment goes when its newest version leaves.
    merged = {"versions": 4, "first": "v1", "last": "v4"}
    assert in_window([merged, seg("v5")], ["v4", "v5"]) == [merged, seg("v5")]
    assert in_window([merged, seg("v5")], ["v5", "v6"]) == [seg("v5")]


def test_a_bounded_compaction_stops_at_its_size():
    level = lambda n, k: [{"versions": n}] * k  # noqa: E731
    assert compaction(level(16, 4), 4) == 4 and compaction(level(16, 4), 4, most=64) == 4
    assert compaction(level(64, 4), 4, most=64) == 0 and compaction([*level(64, 4), *level(1, 4)], 4, most=64) == 4
