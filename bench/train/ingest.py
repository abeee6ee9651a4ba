"""Ingest capacity: tokens/s the per-rank batch iterator delivers vs tokens/s the debug model consumes.

    python -m bench.train.ingest [--seconds 10] [--world-size 2] [--threads 1] [--workdir DIR]

The iterator (train/data.py: parquet shards -> this rank's rows -> seeded
shuffle buffer -> batches -> int64 tensors) runs alone, without read-ahead,
as rank 0 of `--world-size` workers, epoch after epoch. The consumer is
the plain-PyTorch training loop of the debug model (as in bench.train.e2e),
measured in the same run on the same threads. Prints both and, as the last
line, the ratio delivered/consumed (target >= 10).
"""

from __future__ import annotations

import json
import time

from bench.train import common


def delivered_tokens_per_s(spec, world_size: int, seconds: float) -> float:
    import torch

    from train.data import open_batches
    from train.step import to_xy

    batch_size, seq_len = spec.train.batch_size, spec.model.seq_len
    data = open_batches(spec.sources, batch_size=batch_size, rank=0, world_size=world_size, seed=0)
    tokens, started, device = 0, time.perf_counter(), torch.device("cpu")
    for batch in data.from_step(0):
        x, _ = to_xy(batch, device)
        tokens += x.numel()
        if tokens >= batch_size * seq_len * 5 and time.perf_counter() - started >= seconds:
            break
    return tokens / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--seconds", type=float, default=10, help="how long to pull batches")
    parser.add_argument("--world-size", type=int, default=2, help="the iterator runs as rank 0 of this many")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of the consumer")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    root, ref = common.make_dataset(args.workdir)
    spec = common.debug_spec(root, ref, args.batch_size, 5 + args.steps)
    delivered = delivered_tokens_per_s(spec, args.world_size, args.seconds)
    consumed = args.batch_size * spec.model.seq_len / common.plain_loop(spec, args.threads, warmup=5)[1]
    print(f"iterator delivers {delivered:12,.0f} tokens/s per worker (rank 0 of {args.world_size}, no read-ahead)")
    print(f"debug model eats  {consumed:12,.0f} tokens/s per worker ({args.threads} thread(s), batch {args.batch_size})")
    if args.json:
        print(json.dumps({"delivered_tokens_per_s": delivered, "consumed_tokens_per_s": consumed}))
    print(f"ratio delivered/consumed: {delivered / consumed:.1f}")


if __name__ == "__main__":
    main()
