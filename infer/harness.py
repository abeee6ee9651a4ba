"""strata models under lm-evaluation-harness (the optional extra `eval`: pip install -e ".[eval]").

`StrataLM` implements the harness's `LM` interface, so its standard tasks run on a strata model:

    import lm_eval
    from infer.harness import StrataLM
    lm_eval.simple_evaluate(model=StrataLM("RUN[@STEP]" or "EXPORT_DIR"), tasks=["my_task"],
                            task_manager=lm_eval.tasks.TaskManager(include_path="my_tasks/"))

or from the harness's command line with the model registered: `strata-lm-eval run --model strata
--model_args model=RUN@STEP --tasks TASK --include_path DIR` (or `python -m infer.harness ...`: the
harness's own `lm_eval` finds no models from other packages). Tasks whose data is on local disk need no
download.

- `loglikelihood`: each (context, continuation)'s summed log-likelihood and whether greedy decoding would
  give the continuation, the pair cut on the left to the model's context (as `infer eval` scores it).
- `loglikelihood_rolling`: a whole document's, in windows of the context (infer/score.py).
- `generate_until`: greedy or sampled decoding with a key/value cache (infer/generate.py), cut at the
  first stop string.
"""

from __future__ import annotations

import numpy as np
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from strata.data.storage import Storage


@register_model("strata")
class StrataLM(LM):
    def __init__(self, model: str, batch_tokens: int = 0, device: str = "cpu", storage: str | None = None,
                 **_ignored):
        from infer.model import resolve

        super().__init__()
        self.net, self.tok = resolve(model, Storage.from_env(storage)).build(device)
        from infer.score import batch_tokens_for

        self.batch_tokens, self.device_name = batch_tokens_for(device, int(batch_tokens)), device

    def _ids(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text), np.int64) if text else np.zeros(0, np.int64)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [(self._ids(r.args[0]), self._ids(r.args[1])) for r in requests]
        return self._continuations(pairs)

    def _continuations(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[float, bool]]:
        context, eot = self.net.cfg.seq_len, self.tok.eot_id
        rows = []
        for i, (ctx, cont) in enumerate(pairs):
            seq = np.concatenate([ctx if len(ctx) else np.array([eot], np.int64), cont])[-(context + 1):]
            rows.append((i, seq, len(cont)))
        rows.sort(key=lambda r: len(r[1]))
        out: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        at = 0
        with torch.no_grad():
            while at < len(rows):
                width = len(rows[at][1]) - 1
                batch = [r for r in rows[at:at + max(1, self.batch_tokens // max(width, 1))]
                         if len(r[1]) - 1 < 2 * width] or rows[at:at + 1]
                at += len(batch)
                T = max(len(r[1]) - 1 for r in batch)
                x = torch.zeros((len(batch), T), dtype=torch.long)
                for b, (_, seq, _) in enumerate(batch):
                    x[b, : len(seq) - 1] = torch.from_numpy(seq[:-1])
                logp = torch.log_softmax(self.net(x.to(self.device_name)).double(), dim=-1).cpu()
                for b, (i, seq, n) in enumerate(batch):
                    span = slice(len(seq) - 1 - n, len(seq) - 1)  # the positions that predict the continuation
                    targets = torch.from_numpy(seq[len(seq) - n:])
                    lp = logp[b, span]
                    out[i] = (float(lp.gather(1, targets[:, None]).sum()), bool((lp.argmax(-1) == targets).all()))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from infer.score import score_ids

        docs = [self._ids(r.args[0]) for r in requests]
        scored = score_ids(self.net, docs, self.tok.eot_id, stride=self.net.cfg.seq_len,
                           batch_tokens=self.batch_tokens, device=self.device_name)
        return [-s.nll for s in scored]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from infer.generate import decode

        out = []
        for r in requests:
            context, kwargs = r.args[0], dict(r.args[1] or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_tokens = min(int(kwargs.get("max_gen_toks", 64)), self.net.cfg.seq_len - 1)
            sample = kwargs.get("do_sample", False) and float(kwargs.get("temperature", 0.0)) > 0
            ids = decode(self.net, [self._ids(context).tolist() or [self.tok.eot_id]], max_tokens=max_tokens,
                         temperature=float(kwargs.get("temperature", 0.0)) if sample else 0.0,
                         eot_id=self.tok.eot_id, vocab_limit=self.tok.vocab_size)[0]
            text = self.tok.decode(ids[: ids.index(self.tok.eot_id)] if self.tok.eot_id in ids else ids)
            for stop in until:
                text = text.split(stop)[0] if stop else text
            out.append(text)
        return out


def main() -> None:
    """lm-evaluation-harness's own command line with the model `strata` registered: the harness (0.4) finds
    no models from other packages, so `lm_eval --model strata` cannot; `strata-lm-eval` (or
    `python -m infer.harness`) takes every `lm_eval` argument, e.g.
    `strata-lm-eval run --model strata --model_args model=RUN@STEP --tasks TASK --include_path DIR`."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if sys.argv[1:2] == ["run"] and "--device" not in sys.argv and not torch.cuda.is_available():
        sys.argv.append("--device=cpu")  # the harness's default is cuda, which a CPU machine does not have
    cli_evaluate()


if __name__ == "__main__":
    main()
