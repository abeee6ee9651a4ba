"""Which datasets a run trains on, and in what proportions.

    python -m train --dataset web:0.7 --dataset code:0.3     # NAME[@VERSION]:WEIGHT, weights normalised
    python -m train --mixture mixture.yaml                     # {datasets: {NAME[@VERSION]: WEIGHT}}

A run's datasets are one spec string: a lone dataset is its ref (`web@v0002`),
a mixture its refs and weights (`web@v0002:0.7,code@v0001:0.3`). Every dataset
of a mixture must share the tokenizer (by hash) and the seq_len: the ids and
the rows mean the same things in each, or the run is refused.
"""

from __future__ import annotations

from strata.data.dataset import DatasetError, DatasetVersion, resolve
from strata.data.storage import Storage, read_bytes

MIX = "mix."  # a sweep's parameter mix.NAME is dataset NAME's weight in the mixture


def swept(config: dict, datasets: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """The mixture a sweep's config trains on, its trials and `train --from-sweep` alike: each dataset's
    `mix.NAME` weight where the config has one, else the sweep's, normalised and rounded as a run's spec."""
    parts = [f"{ref}:{config.get(MIX + ref.partition('@')[0], w)}" for ref, w in datasets]
    return split(spec(parse(parts)))


def _part(text: str) -> tuple[str, float | None]:
    ref, sep, weight = text.strip().rpartition(":")
    if not sep:
        return text.strip(), None
    try:
        w = float(weight)
    except ValueError:
        raise ValueError(f"dataset {text!r}: the weight after ':' must be a number (NAME[@VERSION]:WEIGHT)") from None
    if not w > 0:
        raise ValueError(f"dataset {text!r}: a weight must be positive")
    return ref, w


def parse(parts: list[str], weighted: bool = True) -> list[tuple[str, float]]:
    """[(ref, weight)] from `--dataset` values, weights normalised to sum to 1. Unless `weighted` (a sweep,
    whose space may weigh them), a mixture's datasets without a weight weigh 1 each."""
    got = [_part(p) for p in parts]
    if weighted and len(got) > 1 and any(w is None for _, w in got):
        raise ValueError("a mixture gives every dataset a weight: --dataset NAME:WEIGHT for each")
    refs = [r for r, _ in got]
    if len({r.partition("@")[0] for r in refs}) < len(refs):
        raise ValueError(f"a dataset appears twice in the mixture {refs}")
    total = sum(w or 1.0 for _, w in got)
    return [(r, (w or 1.0) / total) for r, w in got]


def spec(parts: list[tuple[str, float]]) -> str:
    if len(parts) == 1:
        return parts[0][0]
    return ",".join(f"{r}:{w:.6g}" for r, w in parts)


def split(text: str, weighted: bool = True) -> list[tuple[str, float]]:
    return parse(text.split(","), weighted)


def unpinned(text: str) -> str:
    """The spec without its versions: what `--dataset` names when it asks for the newest snapshots."""
    return spec([(r.partition("@")[0], w) for r, w in split(text, weighted=False)])


def load_file(path: str) -> list[str]:
    """`--dataset` values from a mixture file: {datasets: {NAME[@VERSION]: WEIGHT}}."""
    import yaml

    try:
        raw = yaml.safe_load(read_bytes(path))
    except FileNotFoundError:
        raise ValueError(f"mixture file {path!r} does not exist") from None
    datasets = raw.get("datasets") if isinstance(raw, dict) else None
    if not isinstance(datasets, dict) or not datasets:
        raise ValueError(f"mixture file {path}: expected {{datasets: {{NAME[@VERSION]: WEIGHT, ...}}}}")
    return [f"{ref}:{w}" for ref, w in datasets.items()]


def resolve_all(storage: Storage, text: str, weighted: bool = True) -> list[tuple[DatasetVersion, float]]:
    """Each dataset of the spec resolved to a committed version, checked to share a tokenizer and seq_len."""
    out = [(resolve(storage, r), w) for r, w in split(text, weighted)]
    first = out[0][0]
    for v, _ in out[1:]:
        a, b = first.manifest, v.manifest
        if b.tokenizer.hash != a.tokenizer.hash:
            raise DatasetError(f"the mixture's datasets use different tokenizers: {first.ref} {a.tokenizer.hash}, "
                               f"{v.ref} {b.tokenizer.hash}; tokenize them with the same one")
        if b.seq_len != a.seq_len:
            raise DatasetError(f"the mixture's datasets have different seq_len: {first.ref} {a.seq_len}, "
                               f"{v.ref} {b.seq_len}")
    return out


def expected_repeats(sources: list[tuple[DatasetVersion, float]], rows_drawn: int, world: int) -> dict[str, float]:
    """Passes over each dataset's training rows after `rows_drawn` rows in all (every rank's)."""
    out = {}
    for v, w in sources:
        rows = v.rows("train") // world * world
        out[v.ref] = rows_drawn * w / rows if rows else float("inf")
    return out
