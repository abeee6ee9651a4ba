"""`python -m strata runs` lists every run with its cost; `python -m strata report RUN` explains one:
a terminal summary, and an HTML page with plots (loss, throughput, utilization, cost); `python -m strata
ledger RUN` (or `--dataset NAME`) adds up a model's (or a dataset's) whole cost (strata/accounting/ledger.py)."""

from __future__ import annotations

import base64
import html
import io
import json
import sys
import time

from strata.accounting.records import find_record, list_records
from strata.accounting.runlog import TASK_EVAL, read_log
from strata.commands.shell import Command, Parser
from strata.data.storage import Storage, join, under, write_bytes_atomic


def describe_age(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _money(v, currency="USD") -> str:
    return "unpriced" if v is None else f"{v:,.4f} {currency}" if v < 1 else f"{v:,.2f} {currency}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _headline(r: dict) -> str:
    f = r.get("figures", {})
    if r["kind"] == "train":
        return f"{f.get('steps', 0)} steps, loss {f.get('last_loss') or 0:.3f}, {f.get('tokens_per_s') or 0:,.0f} tok/s"
    if r["kind"] == "preprocess":
        return f"{f.get('version')}: {f.get('tokens') or 0:,} tokens, {f.get('tokens_per_s') or 0:,.0f} tok/s"
    if r["kind"] == "score":
        return f"{f.get('documents') or 0:,} documents, {f.get('tokens') or 0:,} tokens scored"
    if r["kind"] == "eval":
        acc = f"acc {f['acc']:.4f}" if isinstance(f.get("acc"), int | float) else "no accuracy"
        return f"{f.get('items') or 0:,} items, {acc}"
    if r["kind"] == "generate":
        return f"{f.get('prompts') or 0:,} prompts, {f.get('tokens') or 0:,} tokens generated"
    if r["kind"] == "serve":
        p50, p99 = f.get("p50_ms"), f.get("p99_ms")
        lat = f", p50 {p50:.1f} ms, p99 {p99:.1f} ms" if p50 is not None and p99 is not None else ""
        return (f"{f.get('requests') or 0:,} requests, {f.get('completion_tokens') or 0:,} tokens generated{lat}, "
                f"{f.get('replica_hours') or 0:.3f} replica-h")
    if r["kind"] == "sweep":
        return f"{f.get('trials', 0)} trials, best {f.get('metric', '')} {f.get('best') or 0:.4f}"
    return ", ".join(f"{k} {v}" for k, v in sorted(f.items()) if isinstance(v, int | float))[:60]


def runs_table(records: list[dict]) -> str:
    head = ["started", "kind", "name", "seconds", "node-h", "cost", "cpu busy", "result"]
    rows = [[describe_age(r["started_at"]), r["kind"], r["name"], f"{r['seconds']:,.0f}", f"{r['node_hours']:.3f}",
             _money(r["cost"], r.get("currency") or ""), _pct(r["utilization"]["cpu_busy"]), _headline(r)]
            for r in records]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in [head, *rows])


def summary(r: dict) -> str:
    cur = r.get("currency") or ""
    lines = [f"{r['kind']} run {r['name']} ({describe_age(r['started_at'])}, {r['seconds']:,.0f} s, "
             f"code {r.get('code_version')}, ray {r.get('libraries', {}).get('ray')})",
             f"  result       {_headline(r)}",
             f"  cost         {_money(r['cost'], cur)} for {r['node_hours']:.3f} node-hours "
             f"(prices as of {r.get('prices_as_of')})"]
    for name, t in sorted(r["by_type"].items()):
        price = "unpriced" if t["price_per_hour"] is None else f"{t['price_per_hour']}/h {t['market']}"
        lines.append(f"    {name:<14} {t['nodes']} node(s), {t['hours']:.3f} h at {price}: {_money(t['cost'], cur)}")
    u = r["utilization"]
    lines.append(f"  utilization  CPU busy {_pct(u['cpu_busy'])}, GPU busy {_pct(u['gpu_busy'])}, "
                 f"MFU {_pct(u['mfu'])}")
    if u["cpu_busy"] is not None and u["cpu_busy"] < 0.5 and not u["gpu_busy"]:
        lines.append("  note         the nodes were idle more than half the time: fewer or smaller nodes would do")
    if u["gpu_busy"] is not None and u["gpu_busy"] < 0.5:
        lines.append("  note         the GPUs were idle more than half the time: look at data wait and batch size")
    return "\n".join(lines)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def plots(r: dict, storage: Storage) -> dict[str, str]:
    """{title: base64 PNG}: loss, throughput over time, utilization over time, cost by node type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    metrics, launches = _train_metrics(r, storage.root)
    if metrics:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="train loss")
        val = [m for m in metrics if m.get("val_loss") is not None]
        if val:
            ax.plot([m["step"] for m in val], [m["val_loss"] for m in val], "o-", label="validation loss")
        for i, step in enumerate(launches[1:], start=2):  # where each later launch of the run continued
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
            ax.annotate(f"launch {i}", (step, 1), xycoords=("data", "axes fraction"), fontsize=7,
                        rotation=90, va="top", ha="right", color="grey")
        ax.set_xlabel("step"), ax.set_ylabel("loss"), ax.legend(), ax.grid(alpha=0.3)
        out["Loss" if len(launches) < 2 else f"Loss, all {len(launches)} launches"] = _png(fig)
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        t0 = metrics[0]["time"]
        ax.plot([m["time"] - t0 for m in metrics], [m.get("tokens_per_s", 0) for m in metrics])
        ax.set_xlabel("seconds"), ax.set_ylabel("tokens/s"), ax.grid(alpha=0.3)
        out["Throughput over time"] = _png(fig)
        if evals := _task_evals(r):
            fig, ax = plt.subplots(figsize=(6.4, 3.6))
            ok = [e for e in evals if e.get("status") == "ok"]
            for k in ("acc", "acc_norm"):
                ax.plot([e["step"] for e in ok], [e[k] for e in ok], "o-", label=k)
            failed = [e["step"] for e in evals if e.get("status") != "ok"]
            if failed:
                ax.plot(failed, [0] * len(failed), "rx", label="failed")
            ax.set_xlabel("step"), ax.set_ylabel(evals[0].get("task", "task")), ax.legend(), ax.grid(alpha=0.3)
            out["Task accuracy (evaluations during training)"] = _png(fig)
    elif r["kind"] == "sweep" and r["figures"].get("curves"):
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for i, curve in enumerate(r["figures"]["curves"]):
            ax.plot(range(1, len(curve) + 1), curve, marker="o", label=f"#{i + 1}")
        ax.set_xlabel("report"), ax.set_ylabel(r["figures"]["metric"]), ax.legend(), ax.grid(alpha=0.3)
        out["Loss (best trials)"] = _png(fig)
    if any(n["samples"] for n in r["nodes"]):
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for n in r["nodes"]:
            if n["samples"]:
                t0 = r["started_at"]
                ax.plot([s[0] - t0 for s in n["samples"]], [100 * s[1] for s in n["samples"]],
                        label=f"{n['type']} {n['node_id'][:8]} CPU")
                gpu = [(s[0] - t0, 100 * s[2]) for s in n["samples"] if s[2] is not None]
                if gpu:
                    ax.plot(*zip(*gpu, strict=True), "--", label=f"{n['type']} {n['node_id'][:8]} GPU")
        ax.set_ylim(0, 105), ax.set_xlabel("seconds"), ax.set_ylabel("busy %"), ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        out["Utilization"] = _png(fig)
    priced = {k: t["cost"] for k, t in r["by_type"].items() if t["cost"] is not None}
    if priced:
        fig, ax = plt.subplots(figsize=(6.4, 2 + 0.4 * len(priced)))
        ax.barh(list(priced), list(priced.values()))
        ax.set_xlabel(f"cost ({r.get('currency')})"), ax.grid(alpha=0.3, axis="x")
        out["Cost by node type"] = _png(fig)
    return out


def _train_metrics(r: dict, root: str) -> tuple[list[dict], list[int]]:
    """Every log point of the run up to this record's end, every launch's (a continued run plots its
    whole history), and the step each launch started at."""
    if r["kind"] != "train" or not under(r["outputs"], root, strict=True):
        return [], []
    log = read_log(r["outputs"], until=r["ended_at"] + 5)
    return log.steps, log.launch_steps()


def _task_evals(r: dict) -> list[dict]:
    """The run's evaluations during training (--eval-task), every launch's, in step order."""
    return sorted(read_log(r["outputs"], until=r["ended_at"] + 5).events(TASK_EVAL), key=lambda e: e["step"])


def html_page(r: dict, images: dict[str, str], said: str | None = None) -> str:
    figs = "\n".join(f"<h2>{html.escape(t)}</h2>\n<img alt='{html.escape(t)}' src='data:image/png;base64,{b}'>"
                     for t, b in images.items())
    rows = "\n".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(json.dumps(v))}</td></tr>"
                     for k, v in sorted(r["figures"].items()) if k != "curves")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>strata {html.escape(r['kind'])} run {html.escape(r['name'])}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}pre{{background:#f4f4f4;padding:1em}}
td{{padding:0.2em 1em;vertical-align:top}}img{{max-width:100%}}</style></head><body>
<h1>{html.escape(r['kind'])} run {html.escape(r['name'])}</h1>
<pre>{html.escape(said or summary(r))}</pre>
<h2>Figures</h2><table>{rows}</table>
{figs}
<h2>Configuration</h2><pre>{html.escape(json.dumps(r.get('config'), indent=1))}</pre>
</body></html>
"""


def report(ref: str, storage: Storage, out: str | None = None) -> tuple[str, str]:
    """(terminal summary, path of the HTML page written): `out`, else beside the run's outputs when they
    lie under the storage root (a record is data read back from storage: where it says the outputs are
    is not trusted), else in the root's reports/."""
    records = list_records(storage)  # read once: the ledger below adds up the same records
    r = find_record(storage, ref, records)
    name = f"report-{r['kind']}-{r['name']}.html"
    path = out or (join(r["outputs"], name) if under(r["outputs"], storage.root, strict=True) else join(storage.root, "reports", name))
    said = summary(r)
    if r["kind"] == "train":  # the model's whole cost: its data's share, its sweep, its scoring and evaluations
        from strata.accounting import ledger

        said += "\n" + ledger.text(ledger.model_ledger(r["name"], records), r.get("currency") or "USD")
    write_bytes_atomic(path, html_page(r, plots(r, storage), said).encode())
    return said, path


def main(argv: list[str]) -> int:
    return Command("python -m strata", argv, tag="report").run(_main, user_errors=(FileNotFoundError,))


def _main(cmd: Command) -> int:
    argv = cmd.argv
    p = Parser(prog="python -m strata", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("runs", help="list every recorded run with its cost")
    rp = sub.add_parser("report", help="summarise one run and write its HTML report")
    rp.add_argument("run", help="a run's name, or KIND/NAME (kind: preprocess, train, sweep)")
    rp.add_argument("--out", help="where to write the HTML page (default: beside the run's outputs)")
    lp = sub.add_parser("ledger", help="a model's whole cost (its training, its share of its data's preprocessing, "
                        "its sweep, scoring and evaluations), or a dataset's")
    lp.add_argument("run", nargs="?", help="a training run's name")
    lp.add_argument("--dataset", help="instead of a run: what each version of this dataset cost, and who read it")
    for s in sub.choices.values():
        s.add_argument("--storage", help="storage root (default: $STRATA_STORAGE or ~/strata-data)")
        s.add_argument("--json", action="store_true", help="print JSON instead")
    a = p.parse_args(argv)
    storage = Storage.from_env(a.storage)
    if a.command == "runs":
        records = list_records(storage)
        if a.json:
            print(json.dumps([{k: r[k] for k in ("kind", "name", "started_at", "seconds", "node_hours", "cost")}
                              for r in records]))
        else:
            print(runs_table(records) if records else f"no runs recorded under {storage.records()}")
        for bad in list_records(storage, errors=True)[len(records):]:
            print(f"error  {bad['error']}", file=sys.stderr if a.json else sys.stdout)
        return 0
    if a.command == "ledger":
        from strata.accounting import ledger

        if bool(a.run) == bool(a.dataset):
            p.error("ledger takes a training run's name, or --dataset NAME")
        records = list_records(storage)
        book = ledger.dataset_ledger(a.dataset, records) if a.dataset else ledger.model_ledger(a.run, records)
        currency = next((r.get("currency") for r in records if r.get("currency")), None) or "USD"
        print(json.dumps(book) if a.json else ledger.text(book, currency))
        return 0
    if a.out:
        storage.check_output(a.out, "--out")
    text, path = report(a.run, storage, a.out)  # a run it cannot find: one line, exit 1 (Command)
    print(json.dumps({"report": path}) if a.json else f"{text}\n  report       {path}")
    return 0
