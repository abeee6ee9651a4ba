"""The README is the truth: every command its code blocks show exists, with the flags they show, and every
`--flag` its prose names is a flag of some command. The laptop recipe's head line runs in tests/test_jobs.py."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys

from conftest import REPO, doc_text, readme_blocks

# How a command line names a strata command, and the `--help` that lists its flags.
STRATA_COMMANDS = {"demo", "submit", "head", "keys", "runs", "report", "ledger", "lineage", "takedown", "plan",
                   "migrate"}
SUBCOMMANDS = {"pipelines.datasets": {"list", "show", "delete", "forget"}}
STRATA_SUBCOMMANDS = {"lineage": {"step", "doc", "summary"}, "keys": {"show", "trust", "rotate"},
                      "takedown": {"open", "plan", "apply", "retrain", "delete", "status", "report", "list"}}  # strata commands with subcommands of their own


@functools.cache
def help_of(*words: str) -> str:
    out = subprocess.run([sys.executable, "-m", *words, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    assert out.returncode == 0, f"python -m {' '.join(words)} --help failed: {out.stderr[-1000:]}"
    return out.stdout


def command_lines() -> list[str]:
    """Every command the README shows: the lines of its bash blocks, and `$ ` lines of its output blocks."""
    lines = []
    for block in readme_blocks("bash"):
        lines += [line.split(" # ")[0].strip() for line in block.splitlines()
                  if line.strip() and not line.strip().startswith("#")]
    for block in readme_blocks(""):
        lines += [line.strip()[2:] for line in block.splitlines() if line.strip().startswith("$ ")]
    return lines


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line (split at &&, ;, |), each without leading VAR=value words."""
    words = shlex.split(line.replace("&&", " ; ").replace("|", " ; "), comments=True)
    out, current = [], []
    for w in [*words, ";"]:
        if w == ";" or w.endswith(";"):
            w = w.rstrip(";")
            if w:
                current.append(w)
            while current and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", current[0]):
                current.pop(0)
            if current:
                out.append(current)
            current = []
        else:
            current.append(w)
    return out


def flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and w != "--"]


def check(module: str, args: list[str]) -> list[str]:
    """What is wrong with `python -m module args` (its flags against its --help)."""
    if module == "strata":
        sub = args[0] if args else ""
        if sub not in STRATA_COMMANDS:
            return [f"strata has no command {sub!r}"]
        own, rest = (args[1:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args[1:], [])
        text = help_of("strata", sub)
        if sub in STRATA_SUBCOMMANDS:
            if not own or own[0] not in STRATA_SUBCOMMANDS[sub]:
                return [f"strata {sub}: no subcommand {own[:1]}"]
            text = help_of("strata", sub, own[0])
        problems = [f"strata {sub}: no flag {f}" for f in flags(own) if f not in text]
        if sub == "submit" and own:
            from strata.commands.submit import MODULES

            problems += check(MODULES[own[0]], rest)
        return problems
    words = [module]
    if module in SUBCOMMANDS:
        if not args or args[0] not in SUBCOMMANDS[module]:
            return [f"{module}: no subcommand {args[:1]}"]
        words.append(args[0])
    text = help_of(*words)
    return [f"python -m {' '.join(words)}: no flag {f}" for f in flags(args) if f not in text]


def test_every_command_the_readme_shows_exists_with_its_flags():
    with open(os.path.join(REPO, "Makefile")) as f:
        targets = set(re.findall(r"^([a-z][a-z-]*):", f.read(), re.M))
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        pyproject = f.read()
    checked, problems = 0, []
    for line in command_lines():
        for words in simple_commands(line):
            program, args = words[0], words[1:]
            if program in (".venv/bin/python", "python", "python3") and args[:1] == ["-m"]:
                problems += check(args[1], args[2:])
            elif program in (".venv/bin/strata", "strata"):
                problems += check("strata", args)
            elif program == "make":
                problems += [f"make: no target {t}" for t in args if "=" not in t and t not in targets]
            elif program == ".venv/bin/tensorboard":
                problems += [] if 'tensorboard = ["tensorboard' in pyproject else ["no tensorboard extra"]
            else:
                continue
            checked += 1
    assert checked > 30, f"only {checked} commands found: has the README's layout changed?"
    assert not problems, "\n".join(problems)


def test_every_flag_the_readme_names_is_a_flag_of_a_command():
    text = doc_text()
    named = set(re.findall(r"`[^`]*?(--[a-z][a-z0-9-]*)", text))
    known = "\n".join(help_of(*m) for m in (("pipelines.preprocess",), ("pipelines.datasets", "show"),
                                           ("pipelines.datasets", "forget"), ("strata", "lineage", "doc"), ("train",),
                                           ("strata", "takedown", "open"), ("strata", "takedown", "report"),
                                           ("strata", "takedown", "retrain"), ("strata", "lineage", "summary"),
                                           ("train.sample",), ("train.export",), ("tune",), ("infer",), ("strata", "submit"),
                                           ("strata", "report"), ("strata", "plan"), ("strata", "demo"),
                                           ("strata", "keys", "trust"), ("train.convert",), ("tune.convert",),
                                           ("bench",), ("bench.peer",), ("bench.lid",), ("bench.scale",), ("bench.lineage_cost",),
                                           ("bench.train.gpu",)))
    with open(os.path.join(REPO, "bench", "train", "gpu.sh")) as f:  # its own flag, --smoke, in its usage lines
        known += "\n".join(line for line in f if line.startswith("#   bench/train/gpu.sh"))
    # ray's, pip's, make's, git's, kubectl's, sbatch's, guidellm's and mkdocs' own flags, which the README quotes from their docs
    others = {"--head", "--address", "--block", "--labels", "--node-ip-address", "--dashboard-host",
              "--dashboard-port", "--dashboard-agent-listen-port", "--num-cpus", "--num-gpus", "--disable-usage-stats",
              "--working-dir", "--runtime-env", "--runtime-env-json", "--logdir", "--nodes", "--gpus-per-node",
              "--export", "--from-literal", "--from-file", "--reason", "--deadline-remaining-seconds", "--shm-size", "--port",
              "--autoscaling-config", "--follow", "--log", "--backend", "--profile", "--constraint", "--data",
              "--tokenizer", "--strict"}
    unknown = sorted(f for f in named if f not in others and not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", known))
    assert not unknown, f"the README names flags no command has: {unknown}"
