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
and bits per byte of held-out text given with --input. It runs in this process (a task is small);
infer/tasks/arithmetic.jsonl is a small synthetic task.

    python -m infer generate --model RUN[@STEP] | DIR --prompts FILE.jsonl [--max-tokens N]
                             [--temperature T] [--top-k K] [--seed S] [--output FILE.jsonl] [--json]

`generate` completes each prompt (one {"prompt": str} a line) with batched, key/value-cached decoding
in this process: `--temperature 0` is greedy, and the same seed gives the same text. It writes one
{"prompt", "completion"} line per prompt (by default to $STRATA_STORAGE/generations/NAME.jsonl).
"""

from __future__ import annotations

import sys
import time

from strata.cli import add_config_arguments, finish, overrides
from strata.cli import parser as cli_parser
from strata.lease import LeaseBusy
from strata.shell import Command
from strata.shell import log as _logger
from strata.storage import Storage, check_name

_say = _logger("infer").info


def main(argv: list[str] | None = None) -> dict:
    return Command("python -m infer", argv).run(_main)


def _main(cmd: Command) -> dict:
    from infer.driver import ScoreConfig, score

    parser = cli_parser("python -m infer", __doc__)
    parser.add_argument("command", choices=["score", "eval", "generate"], help="what to run")
    parser.add_argument("--model", required=True, help="RUN[@STEP] (a training run's checkpoint) or an exported "
                        "model directory")
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
    parser.add_argument("--name", help="the table's name under $STRATA_STORAGE/scores (default: MODEL-TIME)")
    add_config_arguments(parser, ScoreConfig)
    args = parser.parse_args(cmd.argv)
    if args.command == "eval":
        return _eval(args, parser)
    if args.command == "generate":
        return _generate(args, parser)
    if bool(args.input) == bool(args.dataset):
        parser.error("score needs --input PATH or --dataset NAME[@VERSION] (one of them)")
    try:
        cfg = ScoreConfig(**overrides(args, ScoreConfig))
    except ValueError as e:
        parser.error(str(e))
    name = args.name or f"{args.model.rstrip('/').rsplit('/', 1)[-1].partition('@')[0]}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        check_name(name, "scores name")
        summary = score(args.model, args.input, cfg, Storage.from_env(args.storage), name, args.dataset or "")
    except LeaseBusy as e:
        sys.exit(f"error: {e}")
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    _say(f"{summary['documents']:,} documents scored ({summary['unscored']:,} not), {summary['tokens']:,} tokens: "
         f"loss {summary['loss']:.4f}, {summary['bpb']:.4f} bits per byte, {summary['tokens_per_s']:,.0f} tokens/s; "
         f"table {summary['output']}")
    return finish(summary, args.json)


def _eval(args, parser) -> dict:
    from infer.driver import ScoreConfig
    from infer.evaluate import TaskError, evaluate, heldout, load_task
    from infer.model import resolve, threads
    from strata.sources import ReadConfig, list_inputs, read_file

    if not args.task:
        parser.error("eval needs --task FILE.jsonl")
    cfg = ScoreConfig(**overrides(args, ScoreConfig))
    storage = Storage.from_env(args.storage)
    try:
        items = load_task(args.task)
        model, tok = resolve(args.model, storage).build()
        texts = [d["text"] for f in list_inputs(args.input) for d in read_file({**f, "start": 0, "end": f["size"]},
                                                                              ReadConfig()) if d["status"] == "ok"]
    except (FileNotFoundError, ValueError, TaskError) as e:
        sys.exit(f"error: {e}")
    import os

    threads(os.cpu_count() or 1)
    started = time.time()
    result = evaluate(model, tok, items, batch_tokens=cfg.batch_tokens)
    summary = {"model": args.model, "task": args.task, **{k: v for k, v in result.items() if k != "logliks"}}
    if texts:
        summary.update(heldout(model, tok, texts, stride=cfg.stride or max(1, model.cfg.seq_len // 2),
                               batch_tokens=cfg.batch_tokens))
    summary["seconds"] = round(time.time() - started, 3)
    _say(f"{summary['items']} items: acc {summary['acc']:.4f} ± {summary['acc_stderr']:.4f}, acc_norm "
         f"{summary['acc_norm']:.4f} ± {summary['acc_norm_stderr']:.4f}"
         + (f"; held-out loss {summary['loss']:.4f}, {summary['bpb']:.4f} bits per byte" if texts else ""))
    return finish(summary, args.json)


def _generate(args, parser) -> dict:
    import json
    import os

    from infer.generate import decode
    from infer.model import resolve, threads
    from strata.storage import join, read_bytes, write_bytes_atomic

    if not args.prompts:
        parser.error("generate needs --prompts FILE.jsonl")
    if args.temperature < 0 or args.top_k < 0:
        parser.error("--temperature and --top-k must be >= 0")
    storage = Storage.from_env(args.storage)
    try:
        prompts = []
        for n, line in enumerate(read_bytes(args.prompts).decode().splitlines(), 1):
            if line.strip():
                item = json.loads(line)
                if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                    raise ValueError(f"{args.prompts}:{n}: a line needs a prompt (a string)")
                prompts.append(item["prompt"])
        if not prompts:
            raise ValueError(f"{args.prompts} holds no prompt")
        model, tok = resolve(args.model, storage).build()
    except json.JSONDecodeError as e:
        sys.exit(f"error: {args.prompts}: not JSON lines ({e.msg}, line {e.lineno})")
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    threads(os.cpu_count() or 1)
    started = time.time()
    try:
        made = decode(model, [tok.encode(p).tolist() for p in prompts], max_tokens=args.max_tokens,
                      temperature=args.temperature, top_k=args.top_k, seed=args.seed, eot_id=tok.eot_id,
                      vocab_limit=tok.vocab_size)
    except ValueError as e:
        sys.exit(f"error: {e}")
    seconds = time.time() - started
    out = args.output or join(storage.root, "generations", f"{os.path.basename(args.model.rstrip('/')).partition('@')[0]}"
                                                         f"-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    if "://" not in out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    lines = [json.dumps({"prompt": p, "completion": tok.decode([t for t in ids if t != tok.eot_id])})
             for p, ids in zip(prompts, made, strict=True)]
    write_bytes_atomic(out, ("\n".join(lines) + "\n").encode())
    tokens = sum(len(ids) for ids in made)
    summary = {"model": args.model, "output": out, "prompts": len(prompts), "tokens": tokens,
               "seconds": round(seconds, 3), "tokens_per_s": tokens / max(seconds, 1e-9)}
    _say(f"{len(prompts)} prompts, {tokens:,} tokens in {seconds:.2f} s ({summary['tokens_per_s']:,.0f} tokens/s): {out}")
    return finish(summary, args.json)


if __name__ == "__main__":
    main()
