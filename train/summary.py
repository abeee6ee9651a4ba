"""A model's training-content summary (`strata lineage summary RUN[@STEP]`), in the sections of the EU AI
Office's Template for the Public Summary of Training Content for general-purpose AI models (Article
53(1)(d) of the AI Act; the template of 24 July 2025), generated from what strata recorded:

1. General information: the model (RUN@STEP, the weights it started from, when the checkpoint was made),
   its modality, the size of its training data (tokens, and the template's size band), the kinds of input,
   the newest input file's date, and the languages tier 1 tallied.
2. The data sources, sorted as the template sorts them (public datasets, licensed, other private, crawled,
   user, synthetic, other) by each version's `--origin`: per dataset version, the inputs as given, their
   files, bytes, documents kept, the dates of the files and their `--license`.
3. Data processing: the takedowns honored in those datasets (opt-outs), the filters applied, deduplication.

A model trains on a snapshot: every version of a dataset up to the one it read, so each of those versions'
sources is listed. What strata cannot know (the provider's name and contact, the date the model is placed
on the market) is left for the provider to fill in, and says so.
"""

from __future__ import annotations

import time

from strata.data.storage import Storage

TEMPLATE = ("EU AI Office, Template for the Public Summary of Training Content for general-purpose AI models "
            "(Article 53(1)(d) AI Act), version of 24 July 2025")
SECTIONS = {"public": "2.1 Publicly available datasets",
            "licensed": "2.2.1 Private datasets licensed from rightsholders",
            "third-party": "2.2.2 Private datasets obtained from other third parties",
            "crawled": "2.3 Data crawled and scraped from online sources", "user": "2.4 User data",
            "synthetic": "2.5 Synthetic data", "other": "2.6 Other sources of data"}
FILL_IN = "(for the provider to fill in)"


def size_band(tokens: int) -> str:
    """The template's band for a text modality's training data size."""
    if tokens < 10**9:
        return "less than 1 billion tokens"
    return "1 billion to 10 trillion tokens" if tokens <= 10**13 else "more than 10 trillion tokens"


def _day(t: float | None) -> str | None:
    return time.strftime("%Y-%m-%d", time.gmtime(t)) if t else None


def summary(storage: Storage, spec: str, provider: str = "") -> dict:
    """The summary of model `spec` (RUN or RUN@STEP: its newest checkpoint, or the one at STEP)."""
    from strata.accounting.runlog import read_launches
    from strata.data.dataset import DatasetError, history, resolve
    from train.checkpoint import read_meta
    from train.committed import newest

    run, _, step = spec.partition("@")
    run_dir = storage.run(run)
    found, meta, _ = newest(run_dir, read_meta, step=int(step) if step.isdigit() else None)
    if found is None:
        raise ValueError(f"{spec}: no committed checkpoint{' at that step' if step else ''} in {run_dir}")
    at = int(meta["step"])
    launches = [launch for launch in read_launches(run_dir)]
    refs = []
    for launch in launches:  # the dataset versions it read, launch by launch, up to that step
        for part in str(launch["config"].get("dataset", "")).split(","):
            ref = part.partition(":")[0].strip()
            if ref and ref not in refs:
                refs.append(ref)
    versions, sources, languages, kinds = [], [], {}, set()
    takedowns, filters, dedup = [], set(), set()
    tokens, newest_file = 0, None
    for ref in refs:
        try:
            v = resolve(storage, ref)
        except DatasetError as e:
            raise ValueError(f"{spec} trained on {ref}, which does not read ({e})") from None
        tokens += int(v.manifest.totals.get("packed_tokens", v.manifest.tokens))
        for f in v.manifest.forgotten.get("forgets", []) or []:
            if isinstance(f, dict):
                takedowns.append({"dataset": v.manifest.dataset, "version": f.get("version"), "reason": f.get("reason"),
                                  "documents": f.get("documents")})
        for old in history(storage, v.manifest.dataset):
            m = old.manifest
            if int(m.version[1:]) > int(v.manifest.version[1:]) or m.forget:
                continue
            cfg = (m.run or {}).get("config") or {}
            read, clean, dd = cfg.get("read") or {}, cfg.get("clean") or {}, cfg.get("dedup") or {}
            mtimes = [f["mtime_ns"] / 1e9 for f in m.inputs if f.get("mtime_ns")]
            if mtimes:
                newest_file = max(newest_file or 0, max(mtimes))
            kinds.update(f["path"].rsplit(".", 1)[-1].lower() for f in m.inputs if "." in f["path"].rsplit("/", 1)[-1])
            for lang, n in ((m.stats or {}).get("documents_by_language") or {}).items():
                languages[lang] = languages.get(lang, 0) + int(n)
            filters.update(f"{k} {v}" for k, v in clean.items() if k.startswith(("min_", "max_", "languages"))
                           and v not in (None, "", False) and not isinstance(v, bool))
            if dd.get("exact_dedup") or dd.get("near_dedup"):
                dedup.add(f"exact {'on' if dd.get('exact_dedup') else 'off'}, near (MinHash, Jaccard "
                          f"{dd.get('threshold')}) {'on' if dd.get('near_dedup') else 'off'}, window {dd.get('window')}")
            sources.append({"dataset": m.dataset, "version": m.version, "origin": read.get("origin") or "other",
                            "inputs": list(read.get("inputs") or []), "files": len(m.inputs),
                            "bytes": sum(int(f.get("size") or 0) for f in m.inputs),
                            "documents_kept": int(getattr(m.documents, "kept", 0) or 0),
                            "collected": [_day(min(mtimes)) if mtimes else None, _day(max(mtimes)) if mtimes else None],
                            "license": read.get("license") or "not recorded"})
        versions.append(v.ref)
    by_section = {title: [s for s in sources if s["origin"] == key] for key, title in SECTIONS.items()}
    return {
        "template": TEMPLATE,
        "1 General information": {
            "1.1 Provider": {"name": provider or FILL_IN, "contact": FILL_IN},
            "1.2 Model": {"name": f"{run}@{at}", "dependencies": next(
                (launch["config"].get("init_from") for launch in launches if launch["config"].get("init_from")), None)
                or "none (trained from scratch)", "checkpoint_made": _day(meta.get("time") or meta.get("saved_at")),
                "placed_on_market": FILL_IN},
            "1.3 Modalities and size": {"modality": "text", "training_data_tokens": tokens,
                                        "size_band": size_band(tokens),
                                        "types_of_content": sorted(kinds) or ["text"],
                                        "latest_collection_date": _day(newest_file),
                                        "languages": dict(sorted(languages.items(), key=lambda x: -x[1])) or
                                        "not tallied (preprocess with --languages to tally them)"},
            "datasets": versions},
        "2 Data sources": by_section,
        "3 Data processing": {
            "3.1 Opt-outs and takedowns honored": takedowns,
            "3.2 Removal of illegal or unwanted content": sorted(filters) or ["no quality rule set"],
            "3.3 Other": sorted(dedup) or ["no deduplication"]},
    }


def summary_text(s: dict) -> str:
    """The summary as markdown, section by section."""
    g = s["1 General information"]
    m, size = g["1.2 Model"], g["1.3 Modalities and size"]
    lines = [f"# Training-content summary: {m['name']}", "", f"Following: {s['template']}.", "",
             "## 1. General information", "",
             f"- 1.1 Provider: {g['1.1 Provider']['name']}; contact: {g['1.1 Provider']['contact']}",
             f"- 1.2 Model: {m['name']}; starting weights: {m['dependencies']}; checkpoint made "
             f"{m['checkpoint_made'] or 'unknown'}; placed on the market: {m['placed_on_market']}",
             f"- 1.3 Modality: {size['modality']}; training data: {size['training_data_tokens']:,} tokens "
             f"({size['size_band']}); content: {', '.join(size['types_of_content'])}; latest collection date: "
             f"{size['latest_collection_date'] or 'unknown'}; languages: "
             + (", ".join(f"{k} {v:,}" for k, v in size["languages"].items()) if isinstance(size["languages"], dict)
                else size["languages"]),
             f"- Datasets: {', '.join(g['datasets'])}", "", "## 2. Data sources", ""]
    for title, items in s["2 Data sources"].items():
        lines.append(f"### {title}")
        if not items:
            lines.append("- none")
        for x in items:
            lines.append(f"- {x['dataset']}@{x['version']}: {', '.join(x['inputs']) or 'inputs not recorded'}; "
                         f"{x['files']:,} file(s), {x['bytes']:,} bytes, {x['documents_kept']:,} document(s) kept; "
                         f"files dated {x['collected'][0] or '?'} to {x['collected'][1] or '?'}; license: {x['license']}")
        lines.append("")
    p = s["3 Data processing"]
    lines += ["## 3. Data processing", "", "### 3.1 Opt-outs and takedowns honored"]
    lines += [f"- {t['dataset']}@{t['version']}: {t['documents']} document(s): {t['reason']}"
              for t in p["3.1 Opt-outs and takedowns honored"]] or ["- none"]
    lines += ["", "### 3.2 Removal of illegal or unwanted content", f"- quality rules (tier 1's filters, as set): {', '.join(p['3.2 Removal of illegal or unwanted content'])}",
              "", "### 3.3 Other", *[f"- deduplication: {d}" for d in p["3.3 Other"]]]
    return "\n".join(lines)
