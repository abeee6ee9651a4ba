"""Decontamination reads evaluation sets in the shapes they ship in (MMLU, GSM8K, HellaSwag, ARC; JSONL and
parquet), each leaking into a known set of documents: exactly those are caught. It never silently checks
nothing."""

import json
import os
import random
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO

from pipelines.decontam import ContaminationRule, build

RNG = random.Random(28)
VOCAB = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ro", "su", "ti", "va", "ze") for b in range(400)]


def words(n: int) -> str:
    return " ".join(RNG.choice(VOCAB) for _ in range(n))


def shapes() -> dict:
    """Per benchmark: its records, and the documents that leak from it (caught) or only seem to (not caught)."""
    out = {}
    q, long_choice, short_choice, tiny = words(20), words(9), words(10), words(5)
    out["mmlu"] = {
        "records": [{"question": q, "choices": [long_choice, short_choice, tiny, words(3)], "answer": 1},
                    {"question": words(18), "choices": [words(2), words(2), words(2), words(2)], "answer": 0}],
        "caught": [f"{words(30)} {q} {words(10)}",  # the question, verbatim
                   f"{words(40)} {short_choice.upper()}, {words(5)}",  # a 10-word choice: whole, case ignored
                   f"{long_choice} and then {words(20)}"],  # a 9-word choice (>= 8 words: matched whole)
        "clean": [f"{words(20)} {tiny} {words(20)}",  # a 5-word choice: too short to judge
                  f"{words(10)} {' '.join(q.split()[-6:])} {' '.join(long_choice.split()[:7])} {words(10)}",  # spans
                  f"{words(10)} {' '.join(q.split()[:12])} {words(10)}"]}  # 12 words of a 20-word question
    question, answer = words(25), f"{words(30)} so the answer is 42. #### 42"
    out["gsm8k"] = {
        "records": [{"question": question, "answer": answer}],
        "caught": [f"Worked example: {' '.join(answer.split()[5:20])} {words(5)}",  # 15 words of the answer
                   f"{question}"],
        "clean": [f"{words(30)} #### 42 {words(10)}"]}
    ctx, ending, other = words(16), words(14), words(13)
    out["hellaswag"] = {
        "records": [{"ctx": ctx, "endings": [ending, other, words(12), words(11)], "label": 0, "activity_label": "x"}],
        "caught": [f"{words(8)} {ending} {words(8)}", f"{other}", f"{words(3)} {ctx}"],
        "clean": [f"{' '.join(ctx.split()[-7:])} {' '.join(ending.split()[:7])}"]}  # across ctx and ending
    arc_q, arc_choice = words(15), words(11)
    out["arc"] = {
        "records": [{"id": "Mercury_1", "question": arc_q,
                     "choices": {"text": [arc_choice, words(3), words(4), words(2)], "label": ["A", "B", "C", "D"]},
                     "answerKey": "A"}],
        "caught": [f"{words(12)} {arc_q}", f"{words(2)} {arc_choice}."],
        "clean": [f"{' '.join(arc_q.split()[:12])} {words(20)}", f"{words(50)}"]}
    return out


SHAPES = shapes()


def write(path, rows: list[dict]) -> str:
    if str(path).endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_string_of_an_evaluation_record_is_checked(tmp_path, shape, fmt):
    s = SHAPES[shape]
    index = build([write(tmp_path / f"{shape}.{fmt}", s["records"])], 13)
    rule = ContaminationRule(index)
    assert [d for d in s["caught"] if rule.match(d) is None] == []
    assert [d for d in s["clean"] if rule.match(d) is not None] == []
    assert index["files"][str(tmp_path / f"{shape}.{fmt}")]["records"] == len(s["records"])


def test_fields_restrict_what_is_read_and_a_file_that_yields_nothing_is_an_error(tmp_path):
    mmlu = SHAPES["mmlu"]
    path = write(tmp_path / "mmlu.jsonl", mmlu["records"])
    only_choices = ContaminationRule(build([path], 13, fields=("choices",)))
    assert only_choices.match(mmlu["caught"][0]) is None and only_choices.match(mmlu["caught"][2]) is not None
    arc = write(tmp_path / "arc.parquet", SHAPES["arc"]["records"])
    nested = ContaminationRule(build([arc], 13, fields=("choices.text",)))
    assert nested.match(SHAPES["arc"]["caught"][1]) is not None and nested.match(SHAPES["arc"]["caught"][0]) is None
    labels = write(tmp_path / "labels.jsonl", [{"answer": "B", "choices": ["yes", "no"], "n": 3}] * 5)
    with pytest.raises(ValueError, match=r"labels.jsonl yields no 13-gram .*5 records; the fields with text it has: "
                                         r"answer, choices"):
        build([labels], 13)
    with pytest.raises(ValueError, match="--decontaminate-fields prompt"):
        build([path], 13, fields=("prompt",))
    # The command says so before any work starts (no Ray), with exit 1.
    (tmp_path / "docs").mkdir()
    write(tmp_path / "docs" / "d.jsonl", [{"text": words(40)}])
    out = subprocess.run([sys.executable, "-m", "pipelines.preprocess", "--input", str(tmp_path / "docs"),
                          "--dataset", "d", "--decontaminate", labels], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "STRATA_STORAGE": str(tmp_path / "s")})
    assert out.returncode == 1 and "labels.jsonl yields no 13-gram" in out.stderr
    assert "started embedded local Ray" not in out.stderr


def test_a_preprocess_run_filters_exactly_the_leaked_documents_and_reports_each_evaluation_file(local_ray, tmp_path):
    from pipelines.config import debug
    from pipelines.driver import run
    from strata.data.storage import Storage

    docs = tmp_path / "docs"
    docs.mkdir()
    expected, lines = {}, []
    for shape in sorted(SHAPES):
        for kind in ("caught", "clean"):
            for text in SHAPES[shape][kind]:
                lines.append({"text": f"{text} {words(20)}"})
        expected[shape] = len(SHAPES[shape]["caught"])
    write(docs / "docs.jsonl", lines)
    evals = [write(tmp_path / f"{shape}.{'parquet' if i % 2 else 'jsonl'}", SHAPES[shape]["records"])
             for i, shape in enumerate(sorted(SHAPES))]
    out = run(debug("decon", read={"inputs": (str(docs),)}, clean={"decontaminate": tuple(evals)}),
              Storage(str(tmp_path / "store")))
    assert out["stats"]["filtered_by_rule"]["contaminated"] == sum(expected.values())
    by_file = out["stats"]["decontamination"]
    for path, shape in zip(evals, sorted(SHAPES), strict=True):
        assert by_file[path]["documents"] == expected[shape], (shape, by_file[path])
        assert by_file[path]["records"] == len(SHAPES[shape]["records"]) and by_file[path]["ngrams"] > 0
