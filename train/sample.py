"""Generate text from a training run's latest checkpoint (or a given one).

    python -m train.sample --run NAME [--prompt TEXT] [--tokens N] [--samples K] [--json]
"""

from __future__ import annotations

import json
import os
import sys

import torch

from strata.commands.cli import parser as cli_parser
from strata.commands.shell import StrataError
from strata.commands.shell import log as _logger
from strata.data.dataset import TokenizerInfo
from strata.data.signing import Untrusted
from strata.data.storage import Storage
from strata.data.tokenizer import from_info
from train.checkpoint import META, SignedFiles, load_model_state, local_copy, model_config
from train.committed import newest
from train.model import GPT
from train.taint import check_checkpoint

_log = _logger("sample")


def load_newest(run_dir: str, step: int | None = None, what: str = "") -> tuple[str, tuple]:
    """The run's newest checkpoint that Ray Train registered (complete: never one being written) and that
    verifies, loaded (`load`): (its path, (model, tokenizer, step)). Newer ones that fail their signatures
    are named and passed over."""
    found, loaded, refused = newest(run_dir, load, step=step)
    for name, why in refused:
        _log.warning(f"{what or run_dir}: skipped {name}: {why}")
    if found is None:
        at = f" at step {step}" if step is not None else ""
        raise FileNotFoundError(f"no committed checkpoint{at} that verifies in {run_dir}" if refused
                                else f"no committed checkpoint{at} in {run_dir}")
    return found, loaded


def load(checkpoint: str) -> tuple[GPT, object, int]:
    """Model, tokenizer and step from a checkpoint directory."""
    with local_copy(checkpoint) as d:
        signed = SignedFiles(d, checkpoint)  # signatures, binding and limits checked before the model is built
        meta = signed.meta()
        model = GPT(model_config(meta, signed), init=False)  # every weight comes from the checkpoint
        load_model_state(d, model, signed)
    try:
        tok = from_info(TokenizerInfo(**meta["tokenizer"]), meta.get("tokenizer_definition"))
    except (KeyError, TypeError, ValueError) as e:
        raise Untrusted(f"checkpoint {checkpoint}: {META} has no usable tokenizer ({e}); refused") from None
    return model.eval(), tok, meta["step"]


def latest_checkpoint(run_dir: str) -> str:
    """The run's newest checkpoint that Ray Train registered and whose signed lists verify (those refused are
    named and passed over)."""
    found, _, refused = newest(run_dir)
    for name, why in refused:
        _log.warning(f"{run_dir}: skipped {name}: {why}")
    if found is None:
        raise FileNotFoundError(f"no committed checkpoint{' that verifies' if refused else ''} in {run_dir}")
    return found


def sample(checkpoint, prompt: str, tokens: int, samples: int, temperature: float, seed: int) -> list[str]:
    """`samples` continuations of `prompt` from `checkpoint` (a path, or what `load` returned for one)."""
    model, tok, _ = checkpoint if isinstance(checkpoint, tuple) else load(checkpoint)
    torch.manual_seed(seed)
    ids = tok.encode(prompt).astype("int64").tolist() if prompt else [tok.eot_id]
    idx = torch.tensor(ids, dtype=torch.long).unsqueeze(0).repeat(samples, 1)  # (K, T)
    out = model.generate(idx, tokens, temperature=temperature, vocab_limit=tok.vocab_size)
    texts = []
    for row in out.tolist():
        row = row[len(ids):]
        if tok.eot_id in row:
            row = row[: row.index(tok.eot_id)]
        texts.append(prompt + tok.decode(row))
    return texts


def main(argv: list[str] | None = None) -> dict:
    parser = cli_parser("python -m train.sample", __doc__)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", help="run name under $STRATA_STORAGE/runs (uses its latest checkpoint)")
    where.add_argument("--checkpoint", help="a checkpoint directory")
    parser.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens to generate per sample")
    parser.add_argument("--samples", type=int, default=1, help="number of samples")
    parser.add_argument("--temperature", type=float, default=0.8, help="divides the logits before sampling: "
                        "lower is more predictable, 0 picks the most likely token (default: 0.8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling: the same seed, the same text "
                        "(default: 0)")
    parser.add_argument("--allow-tainted", action="store_true", help="sample a checkpoint a takedown tainted anyway "
                        "(the use is recorded in its run)")
    args = parser.parse_args(argv)
    try:
        if args.checkpoint:
            ckpt, loaded = args.checkpoint, load(args.checkpoint)
        else:
            ckpt, loaded = load_newest(Storage.from_env(args.storage).run(args.run), what=f"--run {args.run}")
        check_checkpoint(ckpt, loaded[2], "sampling", args.allow_tainted)
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        texts = sample(loaded, args.prompt, args.tokens, args.samples, args.temperature, args.seed)
    except (FileNotFoundError, ValueError, StrataError) as e:
        sys.exit(f"error: {e}")
    for t in texts:
        print(t + "\n" + "-" * 40, file=sys.stderr if args.json else sys.stdout)
    result = {"checkpoint": ckpt, "samples": texts}
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
