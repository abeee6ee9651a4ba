"""The training loop's schedule and clock, without Ray: what is logged, reported and checkpointed when."""

import pytest

from train.cadence import Cadence, Clock, poll_interval_s


def _cadence(**kw):
    return Cadence(**{**dict(max_steps=100, log_every=1, report_every_s=0.0), **kw})


def test_reports_are_never_faster_than_rays_poll(monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "4")
    assert poll_interval_s() == 4
    assert _cadence(report_every_s=1).report_every_s == 6  # 1.5 polls: the last report was drained
    assert _cadence(report_every_s=30).report_every_s == 30


def test_log_points_and_report_timer(monkeypatch):
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)  # Ray's default poll, whatever the shell's
    c = _cadence(log_every=10, checkpoint_every=25, started=0.0)
    assert [d for d in range(1, 101) if c.log_due(d)] == [1, 10, 20, 25, 30, 40, 50, 60, 70, 75, 80, 90, 100]
    interval = c.report_every_s
    assert c.timers(interval / 2)[:2] == (False, False) and c.timers(interval)[0]
    c.reported(interval)
    assert not c.timers(interval * 1.5)[0] and c.timers(interval * 2)[0]
    # Whether a node is being drained is asked on a timer of its own, not at every log point.
    check = c.drain_check_every_s
    assert check < interval and not c.timers(check / 2)[2] and c.timers(check)[2]
    c.checked(check)
    assert not c.timers(check * 1.5)[2] and c.timers(check * 2)[2]


def test_decisions():
    c = _cadence(start_step=10, checkpoint_every=50, checkpoint_every_s=60.0)
    quiet = dict(report_due=False, save_due=False, preempted=False, checkpoint_written=False)
    assert c.decide(11, **quiet).report  # the first step after (re)start tells Ray the run is alive
    assert not c.decide(12, **quiet).report and not c.decide(12, **quiet).save
    assert c.decide(12, **{**quiet, "report_due": True}) == c.decide(12, **{**quiet, "report_due": True})
    assert c.decide(12, **{**quiet, "report_due": True}).report
    assert c.decide(12, **{**quiet, "checkpoint_written": True}).report  # hand a written checkpoint over
    timed = c.decide(12, **{**quiet, "save_due": True})
    assert timed.save and timed.report and timed.reason == "interval"
    assert c.decide(50, **quiet).save  # every checkpoint_every steps
    drained = c.decide(13, **{**quiet, "preempted": True})
    assert drained.save and drained.reason == "preemption"
    end = c.decide(100, **quiet)
    assert end.save and end.report and end.reason == "end"


def test_clock_shares_add_up_to_the_window():
    clock = Clock(now=0.0)
    clock.add("data", 1.0)
    clock.add("report", 2.0)
    seconds, shares = clock.window(now=10.0)
    assert seconds == 10.0 and shares["data"] == 0.1 and shares["report"] == 0.2
    assert shares["compute"] == pytest.approx(0.7) and sum(shares.values()) == pytest.approx(1)
    clock.add("eval", 5.0)
    seconds, shares = clock.window(now=20.0)
    assert shares == pytest.approx({"data": 0, "eval": 0.5, "checkpoint": 0, "report": 0, "compute": 0.5})
    total, overall = clock.overall(now=20.0)
    assert total == 20.0 and overall["eval"] == 0.25 and overall["compute"] == pytest.approx(0.6)
