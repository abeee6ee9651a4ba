"""The sweep's config queue on its own (no Ray): what workers are handed, what a lost worker gives
back, ASHA across the sweep, and what a killed driver's rerun finds on record."""

import asyncio
import os
import re
import warnings

import numpy as np
import pytest

from tune import queued as q
from tune.queued import ConfigQueue, asha_keeps, read_results


def _result(i: int, worker: str, curve=(3.0, 2.0), status="completed") -> dict:
    return {"index": i, "config": {"lr": i}, "curve": list(curve), "status": status, "node": "n", "worker": worker,
            "attempts": 1, "error": None, "report_share": 0.0}


def test_workers_take_in_order_and_a_lost_workers_configs_go_back_to_the_front(tmp_path):
    async def main():
        cq = ConfigQueue(str(tmp_path), 6, rungs=[], sign=1.0, max_attempts=2)
        assert await cq.take("a", 2, []) == [(0, 1), (1, 1)]
        assert await cq.take("b", 1, []) == [(2, 1)]
        assert cq.lost("a") == 2  # its node went away holding 0 and 1
        assert await cq.take("b", 3, [_result(2, "b")]) == [(0, 2), (1, 2), (3, 1)]  # the lost ones first
        assert (await cq.progress())["requeued"] == 2 and (await cq.progress())["done"] == 1
        # Lost again: a config handed out max_attempts times is recorded as an error, not run a third time.
        assert cq.lost("b") == 1  # 3 goes back; 0 and 1 were on their second attempt
        p = await cq.progress()
        assert p["errors"] == 2 and p["queued"] == 3 and not p["over"]
        got = await cq.take("c", 8, [])
        assert got == [(3, 2), (4, 1), (5, 1)]
        assert await cq.take("c", 8, [_result(i, "c") for i, _ in got]) is None  # over, and written
        recs = {r["index"]: r for r in read_results(str(tmp_path))}
        assert sorted(recs) == list(range(6)) and [recs[i]["status"] for i in (0, 1)] == ["error", "error"]
        assert "lost with its worker 2 times" in recs[0]["error"]

    asyncio.run(main())


def test_a_worker_waits_while_others_hold_configs_and_takes_what_a_lost_one_gave_back(tmp_path):
    async def main():
        cq = ConfigQueue(str(tmp_path), 2, rungs=[], sign=1.0, max_attempts=3)
        assert await cq.take("a", 1, []) == [(0, 1)]
        assert await cq.take("b", 1, []) == [(1, 1)]
        waiting = asyncio.ensure_future(cq.take("b", 1, [_result(1, "b")]))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing queued, but a's config may yet come back
        cq.lost("a")
        assert await asyncio.wait_for(waiting, 5) == [(0, 2)]
        ended = asyncio.ensure_future(cq.take("a", 1, [], "a2"))  # a's restart (a new process): nothing for it
        await asyncio.sleep(0.05)
        assert not ended.done()
        assert await cq.take("b", 1, [_result(0, "b")]) is None
        assert await asyncio.wait_for(ended, 5) is None  # the last result ends the sweep for every worker

    asyncio.run(main())


def test_asha_is_applied_across_the_sweep_and_a_rerun_queues_only_what_is_not_on_record(tmp_path):
    async def main():
        cq = ConfigQueue(str(tmp_path), 5, rungs=[2], sign=1.0, max_attempts=3, flush_s=3600.0)
        await cq.take("a", 5, [])
        metrics = [3.0, 1.0, 2.5, 0.5, 4.0]
        decisions = [await cq.judge(2, m) for m in metrics]
        expected = [asha_keeps(metrics[:i], m) for i, m in enumerate(metrics)]
        assert [keep for keep, _ in decisions] == expected and [n for _, n in decisions] == list(range(5))
        assert expected == [True, True, False, True, False]  # the rule, worked by hand: above the median before
        cq._record(_result(0, "a", curve=(5.0, 3.0)))
        cq._record(_result(1, "a", curve=(4.0, 1.0)))
        cq.flush()
        # The driver is killed with configs 2-4 in flight; its rerun's queue starts from the record.
        again = ConfigQueue(str(tmp_path), 5, rungs=[2], sign=1.0, max_attempts=3)
        p = await again.progress()
        assert p["resumed"] == 2 and p["queued"] == 3 and p["best"] == 1.0
        assert await again.take("b", 5, []) == [(2, 1), (3, 1), (4, 1)]
        assert again.rungs[2].sorted == [1.0, 3.0] and again.rungs[2].count == 2  # the recorded configs' stand

    asyncio.run(main())


def test_a_rung_judges_as_the_asha_rule_does_on_every_prefix_ties_and_nan_included():
    rng = np.random.default_rng(5)
    for trial in range(40):
        n = int(rng.integers(1, 60))
        metrics = rng.choice([0.5, 1.0, 1.5, np.nan], n).tolist() if trial % 2 else rng.normal(2.0, 1.0, n).tolist()
        rung = q.Rung()
        for i, m in enumerate(metrics):
            probe = float(rng.normal(2.0, 1.0)) if i % 3 else m  # a metric equal to one recorded: a tie
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # nanpercentile of all-NaN
                assert rung.keeps(probe) == asha_keeps(metrics[:i], probe), (metrics[:i], probe)
            rung.add(m)
        assert rung.count == n and rung.sorted == sorted(m for m in metrics if not np.isnan(m))


def test_a_result_that_comes_after_its_worker_was_thought_lost_is_not_run_again(tmp_path):
    async def main():
        cq = ConfigQueue(str(tmp_path), 4, rungs=[], sign=1.0, max_attempts=3, flush_s=3600.0)
        assert await cq.take("a", 2, []) == [(0, 1), (1, 1)]
        assert cq.lost("a") == 2  # the driver thought a lost: both back at the front
        assert await cq.take("b", 1, []) == [(0, 2)]
        assert await cq.take("a", 1, [_result(0, "a"), _result(1, "a")]) == [(2, 1)]  # a was not lost after all
        assert cq.attempts.tolist() == [2, 1, 1, 0] and not cq.back  # 1 is on record: no longer queued
        assert await cq.take("b", 1, [_result(0, "b")]) == [(3, 1)]  # 0 twice: the first result stands
        waiting = asyncio.ensure_future(cq.take("b", 1, [_result(3, "b")]))
        assert await cq.take("a", 1, [_result(2, "a")]) is None
        assert await asyncio.wait_for(waiting, 5) is None
        assert (await cq.progress())["done"] == 4 and sorted(r["index"] for r in read_results(str(tmp_path))) == [
            0, 1, 2, 3]

    asyncio.run(main())


def test_results_are_written_a_part_at_a_time_not_a_file_per_config(tmp_path, monkeypatch):
    monkeypatch.setattr(q, "FLUSH_ROWS", 10)

    async def main():
        cq = ConfigQueue(str(tmp_path), 25, rungs=[], sign=-1.0, max_attempts=3, flush_s=3600.0)
        results, taken = [], 0
        while (got := await cq.take("a", 1, results)) is not None:  # a result per request, as 1-config takes
            results = [_result(i, "a", curve=(0.1 * (i % 7),)) for i, _ in got]
            taken += len(got)
        assert taken == 25
        p = await cq.progress()
        assert p["best"] == pytest.approx(0.6) and p["done"] == 25  # sign -1: the highest accuracy is best
        return p

    p = asyncio.run(main())
    parts = os.listdir(tmp_path / "results")
    assert len(parts) == p["parts"] == 3  # 10 + 10 + the 5 written when the sweep ended
    assert sorted(r["index"] for r in read_results(str(tmp_path))) == list(range(25))


def test_a_call_of_a_lost_process_still_waiting_takes_nothing(tmp_path):
    """Worker b waits at the end of a sweep (others hold the last configs) when its node is lost: its call
    waits on in the queue though no one will read the answer. The configs that come back later must go
    to a live worker, not to that call, or no one would ever finish them."""
    async def main():
        cq = ConfigQueue(str(tmp_path), 2, rungs=[], sign=1.0, max_attempts=3)
        assert await cq.take("a", 2, [], "a1") == [(0, 1), (1, 1)]
        stale = asyncio.ensure_future(cq.take("b", 1, [], "b1"))
        await asyncio.sleep(0.05)
        assert not stale.done()
        assert await cq.requeue("b") == 0  # Tune saw b's process fail; it held nothing
        assert await cq.requeue("a") == 2  # and a's: both configs go back
        assert await asyncio.wait_for(stale, 5) is None  # b's old call takes nothing...
        assert await cq.take("b", 2, [], "b2") == [(0, 2), (1, 2)]  # ...b's restarted process does
        assert await cq.take("b", 2, [_result(0, "b"), _result(1, "b")], "b2") is None

    asyncio.run(main())


@pytest.mark.parametrize("line, said", [
    ('{"index": -1, "curve": [], "status": "completed"}', "index -1 is not a config of this sweep (0..3)"),
    ('{"index": 4, "curve": [], "status": "completed"}', "index 4 is not a config"),
    ('{"index": true, "curve": [], "status": "completed"}', "index True is not a config"),
    ('{"index": 1, "curve": [], "status": "done"}', "status 'done' is not one of"),
    ('{"index": 1, "curve": ["x"], "status": "completed"}', "curve is not a list of numbers"),
    ("junk", "not a JSON object"),
])
def test_a_results_part_that_is_not_the_queues_is_one_line_naming_it(tmp_path, line, said):
    """m12: index -1 marked the last config done; junk raised IndexError or KeyError."""
    import json

    parts = tmp_path / "results"
    parts.mkdir()
    (parts / "part-1.jsonl").write_text(json.dumps(_result(0, "w")) + "\n" + line + "\n")
    with pytest.raises(q.SweepPartError, match=f"part-1.jsonl:2: {re.escape(said)}"):
        list(read_results(str(tmp_path), 4))
    with pytest.raises(q.SweepPartError, match="part-1.jsonl:2"):
        ConfigQueue(str(tmp_path), 4, rungs=[], sign=1.0, max_attempts=2)
