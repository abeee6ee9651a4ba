"""Run a trained model over data.

    python -m infer score --model RUN[@STEP] | DIR --input PATH [--input PATH ...] | --dataset NAME[@VERSION]
                          [--name NAME]
                          [--tier cpu|gpu] [--actors N] [--stride N] [--batch-tokens N] [--json]

`score` writes a parquet table keyed by document id (`doc_id`, `source`, `tokens`, `loss`: the mean
negative log-likelihood per token in nats, `bpb`: bits per byte, `bytes`, and `unscored`: why a record
was not scored, empty when it was) under $STRATA_STORAGE/scores/NAME/table, reading its inputs as tier 1
does (files, folders, globs, s3:// URIs; jsonl, json, txt, parquet, compressed). `--dataset` scores a
version's packed rows instead, each a document keyed SHARD:ROW, its split as its source (the model must
read the dataset's tokenizer). `--json` prints a
summary whose `output` names the table, with throughput and dollars per million tokens.

    python -m infer eval --model RUN[@STEP] | DIR --task FILE.jsonl [--input HELDOUT ...] [--json]

`eval` scores a multiple-choice task (one {"context", "choices", "gold"} object a line) and reports
`acc` and `acc_norm` with their standard errors, as lm-evaluation-harness defines them, and the loss
and bits per byte of held-out text given with --input. It runs as one task on `--tier` (a node's CPUs,
or a GPU); its summary and record go to $STRATA_STORAGE/evals/NAME. infer/tasks/arithmetic.jsonl is a
small synthetic task.

    python -m infer generate --model RUN[@STEP] | DIR --prompts FILE.jsonl [--max-tokens N]
                             [--temperature T] [--top-k K] [--seed S] [--output FILE.jsonl] [--json]

`generate` completes each prompt (one {"prompt": str} a line) with batched, key/value-cached decoding,
as one task on `--tier`: `--temperature 0` is greedy, and the same seed gives the same text. It writes
one {"prompt", "completion"} line per prompt (by default to $STRATA_STORAGE/generations/NAME/
completions.jsonl, its record beside); the summary has throughput and dollars per million tokens.

    python -m infer serve --model [NAME=]RUN[@STEP|@latest]|DIR [--model ...] [--models-file FILE]
                          [--host 127.0.0.1] [--port 8000] [--address ADDR] [--token-file FILE]
                          [--tier cpu|gpu] [--replicas N] [--max-replicas N] [--models-per-replica N] ...

`serve` puts the models behind OpenAI's HTTP API on Ray Serve (infer/serve.py) until Ctrl-C or SIGTERM:
POST /v1/completions (streaming, logprobs and echo), /v1/chat/completions (the model's chat template),
/v1/embeddings, /v1/score, /tokenize, /detokenize; GET /v1/models, /v1/stats, /metrics, /health.
A request names its model by NAME (by default the run's name or the directory's). RUN@latest follows a
training run: replicas move to each checkpoint it commits, one at a time. A host other than loopback
needs --token-file or --token-sha256 (clients send `Authorization: Bearer TOKEN`). When it stops it writes a record under
$STRATA_STORAGE/servings/NAME: requests, tokens, p50 and p99 latency, replica-hours, dollars per million
tokens; it then exits 130 (Ctrl-C) or 143 (SIGTERM), as a process a signal stopped.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict

from strata.commands.cli import (
    add_config_arguments,
    add_openlineage,
    finish,
    overrides,
    use_openlineage,
)
from strata.commands.cli import parser as cli_parser
from strata.commands.shell import EXIT_INTERRUPTED, EXIT_TERMINATED, Command
from strata.commands.shell import log as _logger
from strata.data.lease import LeaseBusy
from strata.data.storage import Storage, check_name

_say = _logger("infer").info


def main(argv: list[str] | None = None) -> dict:
    return Command("python -m infer", argv).run(_main)


def _main(cmd: Command) -> dict:
    from infer.driver import ScoreConfig, score
    from infer.serve import ServeConfig

    parser = cli_parser("python -m infer", __doc__)
    parser.add_argument("command", choices=["score", "eval", "generate", "serve"], help="what to run")
    parser.add_argument("--model", action="append", default=[], help="RUN[@STEP] (a training run's checkpoint) or "
                        "an exported model directory; serve: [NAME=]..., RUN@latest follows the run, and the flag "
                        "repeats")
    parser.add_argument("--input", action="append", default=[], help="input files, folders, globs or URIs; "
                        "repeat the flag (eval: held-out text)")
    parser.add_argument("--dataset", help="score: a dataset version's rows (NAME[@VERSION]) instead of --input")
    parser.add_argument("--task", help="eval: a multiple-choice task file (JSONL)")
    parser.add_argument("--prompts", help="generate: prompts, one {\"prompt\": str} a line (JSONL)")
    parser.add_argument("--max-tokens", type=int, default=64, help="generate: tokens to add to each prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="generate: 0 is greedy")
    parser.add_argument("--top-k", type=int, default=50, help="generate: draw among the K most likely (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="generate: the same seed gives the same text")
    parser.add_argument("--output", help="generate: the JSONL file to write (default: under the storage root)")
    parser.add_argument("--name", help="the run's name (default: MODEL-TIME): score's table is under "
                        "$STRATA_STORAGE/scores/NAME, eval's summary under evals/NAME, generate's completions under "
                        "generations/NAME, each with its record")
    parser.add_argument("--models-file", help="serve: more models, one [NAME=]SPEC a line (# comments)")
    parser.add_argument("--host", default="127.0.0.1", help="serve: the address to listen on (beyond loopback "
                        "only with --token-file)")
    parser.add_argument("--port", type=int, default=8000, help="serve: the port to listen on")
    parser.add_argument("--address", help="serve: a Ray cluster to serve on (default: RAY_ADDRESS, or an "
                        "embedded Ray)")
    parser.add_argument("--token-file", help="serve: a file holding the bearer token clients must send")
    parser.add_argument("--token-sha256", help="serve: instead of --token-file, the token's SHA-256 (no secret: "
                        "it can go on a job's command line)")
    parser.add_argument("--proxies", choices=["EveryNode", "HeadOnly"], default="EveryNode",
                        help="serve: where Ray Serve runs its HTTP proxies (every node: any node takes traffic)")
    parser.add_argument("--allow-tainted", action="store_true", help="use a model a takedown tainted (it learned "
                        "from documents since removed) anyway; the use is recorded in its run (strata takedown)")
    parser.add_argument("--ingress", choices=["direct", "proxy", "ha-proxy"],
                        help="serve: direct (the default where it can be: an embedded Ray and one ingress replica) "
                        "has the ingress replica listen on --port itself; proxy puts Serve's HTTP proxy there; "
                        "ha-proxy is Ray's HAProxy mode, on every interface, only with a token")
    add_config_arguments(parser, ScoreConfig)
    add_config_arguments(parser, ServeConfig, skip=("tier", "allow_tainted"))  # --allow-tainted is every command's
    add_openlineage(parser)
    args = parser.parse_args(cmd.argv)
    use_openlineage(args)
    if args.command == "serve":
        return _serve(args, parser)
    if len(args.model) != 1:
        parser.error(f"{args.command} needs one --model RUN[@STEP] or DIR")
    args.model = args.model[0]
    name = args.name or f"{args.model.rstrip('/').rsplit('/', 1)[-1].partition('@')[0]}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        check_name(name, "--name")
    except ValueError as e:
        parser.error(str(e))
    if args.command == "eval":
        return _eval(args, parser, name)
    if args.command == "generate":
        return _generate(args, parser, name)
    if bool(args.input) == bool(args.dataset):
        parser.error("score needs --input PATH or --dataset NAME[@VERSION] (one of them)")
    cfg = _config(args, parser)
    try:
        summary = score(args.model, args.input, cfg, Storage.from_env(args.storage), name, args.dataset or "",
                        allow_tainted=args.allow_tainted)
    except LeaseBusy as e:
        sys.exit(f"error: {e}")
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    _say(f"{summary['documents']:,} documents scored ({summary['unscored']:,} not), {summary['tokens']:,} tokens: "
         f"loss {summary['loss']:.4f}, {summary['bpb']:.4f} bits per byte, {summary['tokens_per_s']:,.0f} tokens/s; "
         f"table {summary['output']}")
    if shown := summary.get("by_bpb"):  # best scored first: `bpb 3.032 headers.py, 3.310 handlers.py, ...`
        more = summary["documents"] - len(shown)
        items = [f"{bpb:.3f} {os.path.basename(str(doc)).removesuffix(':0')}" for bpb, doc in shown]
        items += [f"... and {more:,} more in the table"] if more > 0 else []
        lines, line = [], "    bpb"
        for i, item in enumerate(items):
            piece = f" {item}{',' if i < len(items) - 1 else ''}"
            if len(line) + len(piece) > 110:
                lines.append(line)
                line = "       "
            line += piece
        print("\n".join([*lines, line]), file=sys.stderr)
    return finish(summary, args.json)


def _eval(args, parser, name: str) -> dict:
    from infer.driver import on_tier
    from infer.evaluate import TaskError, load_task, run_eval
    from infer.model import resolve
    from strata.data.inputs import documents
    from strata.data.storage import join, write_bytes_atomic, write_json_atomic

    if not args.task:
        parser.error("eval needs --task FILE.jsonl")
    cfg = _config(args, parser)
    storage = Storage.from_env(args.storage)
    try:
        items = load_task(args.task)
        model = resolve(args.model, storage, allow_tainted=args.allow_tainted)
        texts = [d["text"] for d in documents(args.input) if d["status"] == "ok"]
    except (FileNotFoundError, ValueError, TaskError) as e:
        sys.exit(f"error: {e}")
    out = storage.evals(name)
    result, cost = on_tier("eval", name, storage, out, cfg.tier, {"model": model.source, "origin": model.origin,
                                                                  "task": args.task, "inputs": args.input, **asdict(cfg)},
                           run_eval, model, items, texts, stride=cfg.stride, batch_tokens=cfg.batch_tokens,
                           figures=lambda r: {k: v for k, v in r.items() if k != "samples"})
    per_item = result.pop("samples")
    summary = {"name": name, "model": model.source, "task": args.task, **result, **cost,
               "output": join(out, "summary.json"), "samples": join(out, "samples.jsonl")}
    write_bytes_atomic(summary["samples"], "".join(json.dumps(r) + "\n" for r in per_item).encode())
    write_json_atomic(summary["output"], summary)
    _say(f"{summary['items']} items: acc {summary['acc']:.4f} ± {summary['acc_stderr']:.4f}, acc_norm "
         f"{summary['acc_norm']:.4f} ± {summary['acc_norm_stderr']:.4f}"
         + (f"; held-out loss {summary['loss']:.4f}, {summary['bpb']:.4f} bits per byte" if texts else ""))
    return finish(summary, args.json)


def _generate(args, parser, name: str) -> dict:
    import json

    from infer.driver import on_tier
    from infer.generate import run_generate
    from infer.model import resolve
    from strata.data.storage import join, text_of, write_bytes_atomic

    if not args.prompts:
        parser.error("generate needs --prompts FILE.jsonl")
    if args.temperature < 0 or args.top_k < 0:
        parser.error("--temperature and --top-k must be >= 0")
    cfg = _config(args, parser)
    storage = Storage.from_env(args.storage)
    try:
        if args.output:
            storage.check_output(args.output, "--output")
        prompts = []
        for n, line in enumerate(text_of(args.prompts, "--prompts").splitlines(), 1):
            if line.strip():
                item = json.loads(line)
                if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                    raise ValueError(f"{args.prompts}:{n}: a line needs a prompt (a string)")
                prompts.append(item["prompt"])
        if not prompts:
            raise ValueError(f"{args.prompts} holds no prompt")
        model = resolve(args.model, storage, allow_tainted=args.allow_tainted)
        if not 1 <= args.max_tokens < model.cfg.seq_len:
            raise ValueError(f"--max-tokens must be between 1 and {model.cfg.seq_len - 1} (the model's context "
                             "less one)")
    except json.JSONDecodeError as e:
        sys.exit(f"error: {args.prompts}: not JSON lines ({e.msg}, line {e.lineno})")
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    home = storage.generations(name)
    out = args.output or join(home, "completions.jsonl")
    result, cost = on_tier(
        "generate", name, storage, home, cfg.tier,
        {"model": model.source, "origin": model.origin, "prompts": args.prompts, "max_tokens": args.max_tokens,
         "temperature": args.temperature, "top_k": args.top_k, "seed": args.seed, "tier": cfg.tier},
        run_generate, model, prompts, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        seed=args.seed, figures=lambda r: {"prompts": len(prompts), "tokens": r["tokens"], "seconds": r["seconds"]})
    if "://" not in out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    lines = [json.dumps({"prompt": p, "completion": c}) for p, c in zip(prompts, result["completions"], strict=True)]
    write_bytes_atomic(out, ("\n".join(lines) + "\n").encode())
    tokens, seconds = result["tokens"], result["seconds"]
    per_million = cost["cost"] / tokens * 1e6 if tokens and cost["cost"] is not None else None
    summary = {"name": name, "model": model.source, "output": out, "prompts": len(prompts), "tokens": tokens,
               "seconds": round(seconds, 3), "tokens_per_s": tokens / max(seconds, 1e-9), **cost,
               "dollars_per_million_tokens": per_million}
    _say(f"{len(prompts)} prompts, {tokens:,} tokens in {seconds:.2f} s ({summary['tokens_per_s']:,.0f} tokens/s): {out}")
    return finish(summary, args.json)


def _serve(args, parser) -> dict:
    from infer.serve import ServeConfig, model_specs, serve_models

    try:
        cfg = ServeConfig(**{**overrides(args, ServeConfig), "allow_tainted": args.allow_tainted})
        specs = model_specs(args.model, args.models_file)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    if not 0 < args.port < 65536:
        parser.error("--port must be between 1 and 65535")
    name = args.name or f"serve-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        check_name(name, "--name")
        summary = serve_models(specs, cfg, Storage.from_env(args.storage), name, host=args.host, port=args.port,
                               address=args.address, token_file=args.token_file,
                               token_sha256=args.token_sha256, proxies=args.proxies,
                               ingress=args.ingress, allow_tainted=args.allow_tainted)
    except LeaseBusy as e:
        sys.exit(f"error: {e}")
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    p50 = "-" if summary.get("p50_ms") is None else f"{summary['p50_ms']:.1f}"
    p99 = "-" if summary.get("p99_ms") is None else f"{summary['p99_ms']:.1f}"
    _say(f"served {summary.get('requests') or 0:,} requests, {summary.get('completion_tokens') or 0:,} tokens "
         f"generated; p50 {p50} ms, p99 {p99} ms; {summary['replica_hours']:.4f} replica-hours; "
         f"record {summary['record']}")
    finish(summary, args.json)
    # Stopped by a signal, as a process stopped so reports it (a service manager, a shell): 128 + its number.
    raise SystemExit(EXIT_TERMINATED if summary["stopped_by"] == "SIGTERM" else EXIT_INTERRUPTED)


def _config(args, parser):
    from infer.driver import ScoreConfig

    try:
        return ScoreConfig(**overrides(args, ScoreConfig))
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
