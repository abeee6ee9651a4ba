"""Small CLIs over frozen dataclass configs: a preset plus overrides of its fields.

Each config field gets a `--field-name` flag whose help is the field's one-line
docstring; only the flags a user gives override the preset.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
import textwrap
import typing
from collections.abc import Callable

from strata.commands.shell import Parser


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """A `--flag` per field of `cls`; `metadata={"flag": "--x"}` renames one."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    group = parser.add_argument_group(f"{cls.__name__} fields (override the preset)")
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        hint = hints[f.name]
        kwargs: dict = {"dest": f.name, "default": argparse.SUPPRESS,
                        "help": docs.get(f.name, "").replace("%", "%%")}  # argparse formats help with %
        if hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(hint) is tuple:
            kwargs.update(action="append", type=typing.get_args(hint)[0], metavar=f.name.upper().rstrip("S"))
        else:
            base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
            kwargs.update(type=base, metavar=f.name.upper())
        group.add_argument(flag, **kwargs)


def overrides(args: argparse.Namespace, cls: type) -> dict:
    """The config fields the user set on the command line."""
    names = {f.name for f in dataclasses.fields(cls)}
    out = {k: v for k, v in vars(args).items() if k in names}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


def flag_of(cls: type, name: str) -> str:
    """The command-line flag of config field `name`."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.metadata.get("flag", "--" + name.replace("_", "-"))


Rule = tuple[Callable[[float], bool], str]  # (whether a value is allowed, what is allowed, in words)
POSITIVE: Rule = (lambda v: v > 0, "> 0")
NON_NEGATIVE: Rule = (lambda v: v >= 0, ">= 0")
AT_LEAST_ONE: Rule = (lambda v: v >= 1, ">= 1")
FRACTION: Rule = (lambda v: 0 <= v <= 1, "between 0 and 1")
BELOW_ONE: Rule = (lambda v: 0 <= v < 1, "in [0, 1)")


def check_fields(cfg, rules: dict[str, Rule]) -> None:
    """Raise ValueError naming the first field of `cfg` (by its flag) whose value breaks its rule; NaN and
    infinity break every rule; None (an optional rule left off) passes. Configs call this in __post_init__, so
    a bad value is refused where the config is made, on the driver, before anything starts."""
    for name, (ok, allowed) in rules.items():
        v = getattr(cfg, name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not ok(v):
            raise ValueError(f"{flag_of(type(cfg), name)} {v!r}: must be {allowed}")


def parser(prog: str, doc: str | None, json_summary: bool = True) -> argparse.ArgumentParser:
    """An entry point's parser with the flags every one of them shares."""
    p = Parser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage", help="storage root (default: $STRATA_STORAGE or ~/strata-data)")
    if json_summary:
        p.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    return p


def add_openlineage(parser: argparse.ArgumentParser) -> None:
    """--openlineage-url, for a command whose run emits OpenLineage events (strata/accounting/openlineage.py)."""
    parser.add_argument("--openlineage-url", help="also post the run's OpenLineage events to this endpoint "
                        "(Marquez's: URL/api/v1/lineage; default: $STRATA_OPENLINEAGE_URL); they always go to "
                        "openlineage.jsonl under the run")


def use_openlineage(args: argparse.Namespace) -> None:
    """The --openlineage-url given, for this process's runs (and the jobs it starts)."""
    import os

    from strata.accounting.openlineage import URL_ENV

    if getattr(args, "openlineage_url", None):
        os.environ[URL_ENV] = args.openlineage_url


def finish(summary: dict, as_json: bool) -> dict:
    """Stop the Ray this command connected (so no late log line follows), then print the JSON summary as the
    last line. A Ray the caller connected before the command ran in-process stays up: it is the caller's."""
    import ray

    from strata.cluster.connect import callers_ray, shutdown

    if ray.is_initialized() and not callers_ray():
        shutdown()
    if as_json:
        print(json.dumps(summary), flush=True)
    return summary
