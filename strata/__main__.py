"""strata's own commands: demo, submit, head, keys, runs, report, ledger, lineage, takedown, plan, migrate (`python -m strata` lists them)."""

from __future__ import annotations

import os
import sys


def main() -> None:
    commands = {"demo": "run the main job end to end on an embedded local Ray",
                "submit": "submit preprocess, train, tune or infer to a Ray cluster (see submit --help)",
                "head": "start, stop or check a Ray head on this machine for submit: head start|status|stop",
                "keys": "the signing keys that verify checkpoints and sweep state: keys show|trust|rotate",
                "runs": "list every recorded run with its cost and key figures",
                "report": "summarise one run and write an HTML report with plots: report RUN",
                "ledger": "a model's whole cost, from its data to its evaluations: ledger RUN (or --dataset NAME)",
                "lineage": "where documents went and what a step learned from: lineage doc --doc-id ID | lineage step RUN STEP",
                "takedown": "a takedown request and every copy of its documents: takedown open|status|list",
                "plan": "estimate wall time and cost of a workload on each node type",
                "migrate": "convert a dataset of the format before Delta Lake: migrate NAME"}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print("usage: python -m strata COMMAND [args]\n\ncommands:")
        for name, what in commands.items():
            print(f"  {name:8} {what}")
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    if sys.argv[1] == "demo":
        from strata.commands.demo import main as demo

        demo(sys.argv[2:])
    elif sys.argv[1] in ("runs", "report", "ledger"):
        from strata.commands.report import main as report

        sys.exit(report(sys.argv[1:]))
    elif sys.argv[1] == "lineage":  # a run's data order is training's own code: run it there
        os.execv(sys.executable, [sys.executable, "-m", "train.lineage", *sys.argv[2:]])
    elif sys.argv[1] == "takedown":  # it follows documents through training's data order, as lineage does
        os.execv(sys.executable, [sys.executable, "-m", "train.takedown", *sys.argv[2:]])
    elif sys.argv[1] == "plan":  # the planner thinks in model FLOPs, so it lives in train: run it, never import it
        os.execv(sys.executable, [sys.executable, "-m", "train.plan", *sys.argv[2:]])
    elif sys.argv[1] == "migrate":
        from strata.data.migrate import main as migrate

        sys.exit(migrate(sys.argv[2:]))
    elif sys.argv[1] == "head":
        from strata.commands.head import main as head

        sys.exit(head(sys.argv[2:]))
    elif sys.argv[1] == "keys":
        from strata.commands.keys import main as keys

        sys.exit(keys(sys.argv[2:]))
    elif sys.argv[1] == "submit":
        from strata.commands.submit import main as submit

        sys.exit(submit(sys.argv[2:]))


if __name__ == "__main__":
    main()
