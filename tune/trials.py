"""A sweep's trials as people read them: the CSV of every trial and the aligned table of the best, each
ranked best first with the sweep's metric and direction (`SweepConfig.sign`), and the count by status."""

from __future__ import annotations


def trials_csv(trials: list[dict], metric: str = "val_loss", sign: float = 1.0) -> str:
    """One row per trial: id, status, iterations, best metric, then each hyperparameter."""
    import csv
    import io

    keys = sorted({k for t in trials for k in t["config"]})
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["trial", "status", "iterations", f"best_{metric}", *keys])
    for t in sorted(trials, key=lambda t: _rank(t, sign)):
        w.writerow([t["trial"], t["status"], t["iterations"], t["best"], *(t["config"].get(k) for k in keys)])
    return out.getvalue()


def trials_table(trials: list[dict], metric: str = "val_loss", top: int = 10, sign: float = 1.0) -> str:
    """The best trials as an aligned table, with a count by status."""
    keys = sorted({k for t in trials for k in t["config"]})
    rows = [[f"{t['best']:.4f}" if t["best"] is not None else "-", str(t["iterations"] or 0), t["status"],
             *(f"{v:.4g}" if isinstance(v := t["config"].get(k), float) else str(v) for k in keys)]
            for t in sorted(trials, key=lambda t: _rank(t, sign))[:top]]
    head = [metric, "iters", "status", *keys]
    widths = [max(len(c) for c in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]]
    counts = status_counts(trials)
    return "\n".join([f"[tune] best {min(top, len(trials))} of {len(trials)} trials "
                      f"({', '.join(f'{n} {s}' for s, n in counts.items())}):", *lines])


def status_counts(trials: list[dict]) -> dict[str, int]:
    return {s: sum(t["status"] == s for t in trials) for s in ("completed", "stopped early", "error")}


def _rank(t: dict, sign: float = 1.0) -> tuple:
    """Trials with a metric first, the best first (`sign`: SweepConfig.sign)."""
    return (t["best"] is None, sign * t["best"] if t["best"] is not None else 0.0)
