"""The GPT model and the per-rank batch iterator, without Ray."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from strata.data.dataset import arrow_schema
from train.config import TrainConfig, lr_at
from train.data import MixedBatches, Mixture, ShardRef, TokenBatches, validation_batches
from train.model import GPT, preset
from train.step import make_optimizer, parallelize, train_step

SEQ = 8


def test_forward_shapes_and_tied_embeddings():
    cfg = preset("debug", seq_len=SEQ, n_layer=1, n_embd=32, n_head=2)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, SEQ))
    logits = model(idx)
    none, loss = model(idx, idx)  # with targets, only the loss: the logits are never all kept
    assert logits.shape == (3, SEQ, cfg.vocab_size) and none is None
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(
        logits.view(-1, cfg.vocab_size), idx.view(-1)).item(), rel=1e-5)
    assert model.head.weight is model.wte.weight
    assert abs(loss.item() - np.log(cfg.vocab_size)) < 1.0  # near uniform at init
    assert model.flops_per_token() > 6 * model.num_params()


@pytest.mark.parametrize("start", [1, SEQ // 2, SEQ - 1])
def test_asking_for_the_last_positions_only_gives_the_same_logits_and_losses(start):
    cfg = preset("debug", seq_len=SEQ, n_layer=2, n_embd=32, n_head=2)
    torch.manual_seed(1)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 257, (3, SEQ))
    targets = torch.randint(0, 257, (3, SEQ))
    targets[1, -2:] = -1  # padding
    with torch.inference_mode():
        full, tail = model(idx), model(idx, start=start)
        _, losses = model(idx, targets, per_token=True)
        _, tail_losses = model(idx, targets, per_token=True, start=start)
    assert tail.shape == (3, SEQ - start, cfg.vocab_size)
    torch.testing.assert_close(tail, full[:, start:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail_losses, losses.view(3, SEQ)[:, start:].reshape(-1), rtol=1e-5, atol=1e-5)


def test_a_few_steps_fit_one_batch():
    cfg = preset("debug", seq_len=SEQ, n_layer=1, n_embd=32, n_head=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    tcfg = TrainConfig(lr=1e-2, warmup_steps=1, max_steps=30)
    opt = make_optimizer(model, tcfg)
    batch = np.random.default_rng(0).integers(0, 257, (4, SEQ + 1))
    losses = [train_step(model, opt, [batch], lr_at(s, tcfg), tcfg, torch.device("cpu")).item() for s in range(30)]
    assert losses[-1] < losses[0] * 0.5


def test_generate_never_draws_padding_ids():
    cfg = preset("debug", seq_len=SEQ, n_layer=1, n_embd=32, n_head=2)
    out = GPT(cfg).generate(torch.zeros(2, 1, dtype=torch.long), 20, temperature=2.0, top_k=None, vocab_limit=257)
    assert out.shape == (2, 21) and int(out.max()) < 257


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, max_steps=100, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=0.01)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 99))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three shards of unequal size; row r holds the value r in every position."""
    d = tmp_path_factory.mktemp("shards")
    refs, start = [], 0
    for i, n in enumerate((37, 50, 13)):
        ids = np.repeat(np.arange(start, start + n, dtype=np.uint16), SEQ + 1)
        table = pa.Table.from_arrays([pa.FixedSizeListArray.from_arrays(pa.array(ids), SEQ + 1)],
                                     schema=arrow_schema(SEQ, "uint16"))
        pq.write_table(table, d / f"s{i}.parquet")
        refs.append(ShardRef(str(d / f"s{i}.parquet"), n))
        start += n
    return refs


def _epoch_rows(loader, epoch):
    return [int(b[j, 0]) for b in loader.epoch(epoch) for j in range(len(b))]


def test_ranks_get_equal_steps_and_disjoint_rows(shards):
    loaders = [TokenBatches(shards, batch_size=4, rank=r, world_size=3, seed=1, shuffle_buffer=8) for r in range(3)]
    seen = [_epoch_rows(ld, 0) for ld in loaders]
    assert {len(s) for s in seen} == {loaders[0].steps_per_epoch * 4}
    assert loaders[0].steps_per_epoch == 100 // 3 // 4
    flat = [r for s in seen for r in s]
    assert len(flat) == len(set(flat)), "a row went to two ranks"
    assert _epoch_rows(loaders[0], 1) != seen[0], "epochs should reorder"


def test_resume_from_a_step_replays_the_same_batches(shards):
    loader = TokenBatches(shards, batch_size=4, seed=3, shuffle_buffer=16)
    spe = loader.steps_per_epoch
    it = loader.from_step(0)
    straight = [next(it) for _ in range(spe + 5)]
    resumed = loader.from_step(spe - 2)
    for k in range(spe - 2, spe + 5):
        assert np.array_equal(next(resumed), straight[k])


@pytest.mark.parametrize("batch,buffer,world", [(4, 16, 1), (3, 16, 2), (5, 12, 1), (4, 4, 1)])
def test_a_resume_seeks_to_its_batch_and_reads_a_bounded_number_of_rows(batch, buffer, world):
    """Starting an epoch at batch k gives batches k, k+1, ... of the whole epoch exactly, for buffers that
    carry rows over (buffer % batch) and that do not, and reads about a buffer's rows to get there: as few
    row groups (of 8 rows, say) near the end of the epoch as near its start; it never reads the rows
    before its position."""
    data = {f"s{i}": np.repeat(np.arange(1000 * i, 1000 * i + n), 2).reshape(n, 2) for i, n in enumerate((90, 41, 130, 7))}
    read_log = []

    def read(path, start=0, stop=None):
        rows = data[path][start:stop]
        read_log.append({(path, r // 8) for r in range(start, start + len(rows))})  # the row groups it touches
        return rows

    refs = [ShardRef(path, len(rows)) for path, rows in data.items()]
    for rank in range(world):
        loader = TokenBatches(refs, batch_size=batch, rank=rank, world_size=world, seed=7, shuffle_buffer=buffer,
                              read=read)
        whole = list(loader.epoch(1))
        assert len(whole) == loader.steps_per_epoch
        cost = {}
        for skip in range(len(whole)):
            read_log.clear()
            first = next(loader.epoch(1, skip))
            cost[skip] = len(set().union(*read_log))
            assert np.array_equal(first, whole[skip]), (rank, skip)
            assert all(np.array_equal(b, w) for b, w in zip(loader.epoch(1, skip), whole[skip:], strict=True))
        # At most two buffers' row groups, one per shard boundary and one per row the buffer carries over,
        # wherever the batch is; reading up to it would touch up to the rank's whole share (268 / world rows).
        bound = (2 * buffer) // 8 + 2 * len(refs) + batch
        assert max(cost.values()) <= bound < 268 // world // 8, cost


def test_too_small_a_dataset_is_a_clear_error(shards):
    with pytest.raises(ValueError, match="cannot give 8 worker"):
        TokenBatches(shards[2:], batch_size=4, world_size=8)


def test_validation_works_with_a_split_smaller_than_a_batch(shards):
    tiny = (ShardRef(shards[2].path, 3),)  # pretend the split holds 3 rows
    batches = validation_batches(tiny, TrainConfig(batch_size=16, eval_batches=4))
    assert [len(b) for b in batches] == [3]
    assert validation_batches((), TrainConfig()) == []
    full = validation_batches(tuple(shards), TrainConfig(batch_size=8, eval_batches=4))
    assert [len(b) for b in full] == [8, 8, 8, 8]


@pytest.mark.parametrize("name", ["gpt2-124m", "gpt2-350m", "gpt2-774m", "1.3b"])
def test_preset_sizes_follow_the_architecture(name):
    from train.model import PRESETS, describe

    c = PRESETS[name]
    per_block = 12 * c.n_embd**2 + 4 * c.n_embd  # qkv, proj, 2 MLP matrices; two norms
    expected = (c.vocab_size + c.seq_len) * c.n_embd + c.n_layer * per_block + 2 * c.n_embd
    got = describe(c)
    assert got["params"] == expected
    assert got["flops_per_token"] == 6 * (expected - c.seq_len * c.n_embd) + 12 * c.n_layer * c.n_embd * c.seq_len


def test_gradient_accumulation_matches_one_big_batch():
    cfg = preset("debug", seq_len=SEQ, n_layer=1, n_embd=32, n_head=2)
    batch = np.random.default_rng(1).integers(0, 257, (8, SEQ + 1))
    tcfg = TrainConfig(lr=1e-2, warmup_steps=1, grad_clip=0.5)
    params = []
    for micro in ([batch], [batch[:4], batch[4:]], [batch[:2], batch[2:4], batch[4:6], batch[6:]]):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = make_optimizer(model, tcfg)
        for _ in range(3):
            train_step(model, opt, micro, 1e-2, tcfg, torch.device("cpu"))
        params.append(torch.cat([p.detach().ravel() for p in model.parameters()]))
    torch.testing.assert_close(params[1], params[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(params[2], params[0], atol=1e-5, rtol=1e-4)


def test_peak_flops_table_and_override(monkeypatch):
    from train.hardware import PEAK_TFLOPS, peak_flops

    monkeypatch.delenv("STRATA_PEAK_TFLOPS", raising=False)
    assert peak_flops(torch.device("cpu"), bf16=False) is None
    monkeypatch.setenv("STRATA_PEAK_TFLOPS", "2.5")
    assert peak_flops(torch.device("cpu"), bf16=False) == 2.5e12
    names = [n for n, _, _ in PEAK_TFLOPS]  # a more specific name must come before its prefix
    assert all(names.index(a) < names.index(b) for a in names for b in names if a != b and b in a)


def test_prefetch_keeps_order_counts_waiting_and_surfaces_errors():
    from train.data import Prefetch

    def slow():
        for i in range(5):
            import time

            time.sleep(0.01)
            yield i
        raise OSError("shard vanished")

    p = Prefetch(slow(), depth=2)
    assert [next(p) for _ in range(5)] == list(range(5))
    assert p.waited > 0
    with pytest.raises(OSError, match="shard vanished"):
        next(p)


def test_bad_strategy_or_precision_is_a_clear_error():
    with pytest.raises(ValueError, match="strategy must be one of"):
        TrainConfig(strategy="zero3")
    with pytest.raises(ValueError, match="precision must be one of"):
        TrainConfig(precision="fp8")


def test_compiled_step_matches_eager():
    cfg = preset("debug", seq_len=SEQ, n_layer=1, n_embd=32, n_head=2)
    batch = np.random.default_rng(2).integers(0, 257, (4, SEQ + 1))
    tcfg = TrainConfig(lr=1e-2, warmup_steps=1)
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = make_optimizer(model, tcfg)
        # The training loop's way: each block compiled on its own, before any wrapping.
        step_fn = parallelize(model, "ddp", torch.device("cpu"), False, 1, compile_blocks=compiled)
        losses.append([train_step(step_fn, opt, [batch], 1e-2, tcfg, torch.device("cpu")).item() for _ in range(3)])
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_fused_loss_matches_cross_entropy_without_keeping_the_logits():
    import torch.nn.functional as F

    from train.model import linear_cross_entropy

    torch.manual_seed(0)
    n, c, v = 37, 16, 50
    h = torch.randn(n, c, requires_grad=True)
    w = torch.randn(v, c, requires_grad=True)
    t = torch.randint(0, v, (n,))
    ref = F.cross_entropy(h @ w.t(), t)
    ref_h, ref_w = torch.autograd.grad(ref * 3, (h, w))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.shape) or x, lambda x: x):
        loss = linear_cross_entropy(h, w, t, chunk=8)  # 5 chunks, the last one short
    got_h, got_w = torch.autograd.grad(loss * 3, (h, w))  # the upstream gradient scales both
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(got_h, ref_h, atol=1e-5) and torch.allclose(got_w, ref_w, atol=1e-5)
    assert sorted(saved) == sorted([h.shape, w.shape])  # what waits for backward: no (n, v) tensor
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the bf16 path the GPU takes
        low = linear_cross_entropy(h, w, t, chunk=8)
    assert low.item() == pytest.approx(ref.item(), rel=2e-2)


def test_auto_strategy_is_chosen_by_device_memory_not_by_size():
    from train.config import TrainConfig
    from train.memory import DDP_BYTES_PER_PARAM, strategy_for

    auto, gib = TrainConfig(), 1 << 30
    assert strategy_for(auto, 1_300_000_000, 80 * gib) == "ddp"  # 1.3B with its AdamW state fits an 80 GB GPU
    assert strategy_for(auto, 1_300_000_000, 24 * gib) == "fsdp"  # ... but not a 24 GB one
    assert strategy_for(auto, int(4 * gib / DDP_BYTES_PER_PARAM), 4 * gib) == "ddp"  # the boundary fits
    assert strategy_for(TrainConfig(strategy="fsdp"), 1000, 80 * gib) == "fsdp"  # asked for is asked for


def test_micro_batch_is_sized_for_the_devices_memory():
    from train.memory import (
        CPU_MICRO_BATCH,
        MAX_MICRO_BATCH,
        activation_bytes_per_row,
        micro_batch_for,
    )

    gib = 2**30
    cfg, params = preset("gpt2-350m"), 355_000_000
    sizes = [micro_batch_for(cfg, params, "ddp", 1, m * gib, True, "cuda") for m in (16, 24, 40, 80)]
    assert sizes == sorted(sizes) and len(set(sizes)) > 1  # more memory, larger micro-batches
    for memory, rows in zip((16, 24, 40, 80), sizes, strict=True):
        assert rows & (rows - 1) == 0 and 1 <= rows <= MAX_MICRO_BATCH  # a power of two, capped
        used = 16 * params + rows * activation_bytes_per_row(cfg, True)
        assert used <= 0.8 * memory * gib  # what is chosen fits ...
        if rows < MAX_MICRO_BATCH:  # ... and twice it would not
            assert 16 * params + 2 * rows * activation_bytes_per_row(cfg, True) + 2 * gib > 0.8 * memory * gib
    # fp32 keeps twice the activations; FSDP2 over 8 devices shards the states and leaves room for more rows.
    assert micro_batch_for(cfg, params, "ddp", 1, 24 * gib, False, "cuda") < sizes[1]
    big = preset("1.3b")
    assert micro_batch_for(big, 1_300_000_000, "fsdp", 8, 40 * gib, True, "cuda") > micro_batch_for(
        big, 1_300_000_000, "ddp", 1, 40 * gib, True, "cuda")
    assert micro_batch_for(cfg, params, "ddp", 1, 24 * gib, True, "cpu") == CPU_MICRO_BATCH
    with pytest.raises(ValueError, match="does not fit"):
        micro_batch_for(big, 1_300_000_000, "ddp", 1, 16 * gib, True, "cuda")


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [0.97, 0.02, 0.01]])
def test_a_mixture_draws_in_proportion_and_each_rows_source_is_a_function_of_its_index(weights):
    mix = Mixture(weights)
    n = 10_000
    drawn = [mix.source(r) for r in range(n)]
    counts = [sum(s == i for s, _ in drawn) for i in range(len(weights))]
    assert counts == mix.counts(n)
    for i, w in enumerate(weights):  # a deterministic schedule: within one row per split of the weight
        assert abs(counts[i] - n * w) <= len(weights)
    for i in range(len(weights)):  # each source's positions run 0, 1, 2, ... in stream order
        assert [p for s, p in drawn if s == i] == list(range(counts[i]))
    for r in (0, 17, 4_321, n - 1):  # the position is the count of earlier rows of that source
        s, p = mix.source(r)
        assert mix.counts(r)[s] == p


def test_mixed_batches_resume_exactly_and_wrap_around(shards):
    a, b = shards[:2], shards[2:]  # rows 0-86 and 87-99: the small source wraps around many times
    streams = [TokenBatches(x, batch_size=1, seed=5, shuffle_buffer=8) for x in (a, b)]
    mixed = MixedBatches(streams, [0.6, 0.4], batch_size=8)
    it = mixed.from_step(0)
    straight = [next(it) for _ in range(30)]
    rows = np.concatenate(straight)[:, 0]
    small = rows >= 87
    assert abs(small.mean() - 0.4) < 0.01 and len(set(rows[small])) == 13
    assert mixed.repeats(30)[1] == pytest.approx(30 * 8 * 0.4 / 13, rel=0.02) and mixed.repeats(30)[1] > 7
    resumed = mixed.from_step(17)
    for k in range(17, 30):
        assert np.array_equal(next(resumed), straight[k])


def test_the_fused_loss_leaves_padding_out_as_cross_entropy_ignores_it():
    """Padding targets (train.step.IGNORE) count in neither the mean nor the gradient."""
    from train.model import linear_cross_entropy
    from train.step import IGNORE

    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    targets[30:] = IGNORE
    ours = linear_cross_entropy(h, w, targets, chunk=8)
    ours.backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    theirs = torch.nn.functional.cross_entropy(h @ w.t(), targets, ignore_index=IGNORE)
    theirs.backward()
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grads[0], h.grad)
    torch.testing.assert_close(grads[1], w.grad)
    assert grads[0][30:].abs().sum() == 0


def test_padded_rows_are_masked_by_their_pad_value():
    import numpy as np

    from strata.data.dataset import pad_value
    from train.step import IGNORE, to_xy

    rows = np.array([[5, 6, 7, 8, 9], [1, 2, 3, pad_value("uint16"), pad_value("uint16")]], dtype=np.uint16)
    x, y = to_xy(rows, torch.device("cpu"))
    assert y.tolist() == [[6, 7, 8, 9], [2, 3, IGNORE, IGNORE]]
    assert x.tolist() == [[5, 6, 7, 8], [1, 2, 3, 0]]


def test_a_row_range_reads_only_its_row_groups(tmp_path, monkeypatch):
    """strata.rows.read_rows(path, start, stop) decodes just the row groups that hold the range, and the
    next range within them decodes nothing."""
    import strata.data.rows as dataset

    rows = np.arange(100 * (SEQ + 1), dtype=np.uint16).reshape(100, SEQ + 1)
    table = pa.Table.from_arrays([pa.FixedSizeListArray.from_arrays(pa.array(rows.ravel()), SEQ + 1)],
                                 schema=arrow_schema(SEQ, "uint16"))
    path = str(tmp_path / "s.parquet")
    pq.write_table(table, path, row_group_size=16)
    decoded = []
    real = pq.ParquetFile.read_row_groups
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups",
                        lambda self, groups, **kw: decoded.append(list(groups)) or real(self, groups, **kw))
    for a, b, groups in ((40, 50, [2, 3]), (41, 47, None), (90, 100, [5, 6]), (0, 1, [0]), (15, 17, [0, 1])):
        decoded.clear()
        assert np.array_equal(dataset.read_rows(path, a, b), rows[a:b])
        assert decoded == ([groups] if groups else []), (a, b, decoded)
    assert np.array_equal(dataset.read_rows(path), rows)
