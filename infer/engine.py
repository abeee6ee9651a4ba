"""One model's work on a serving replica, batched across requests (`python -m infer serve`).

Generation is batched continuously. Each active sequence holds a row of one key/value cache (rows kept
contiguous: a finished sequence's row takes the last one's). Every step runs the model once over the
last token of every active row, each at its own position (a mask hides the cache beyond it). Between
steps, waiting sequences join: their prompts run first (grouped by length, no padding), their keys and
values go into free rows, and the next step carries them with the rest. A finished or cancelled
sequence leaves at once.

Embeddings and scores are single passes, batched by length (windows of [w, 2w) padded to the longest)
and run between decode steps.

`max_batch_tokens` bounds what is in flight. The active sequences' prompts plus the tokens they may
still add stay within it, and so does each pass batch. A sequence waits until it fits, so the cache
never outgrows it. The cache is freed when nothing is active.

All model work runs on one thread per replica (`pool`), one step at a time, so the models of a replica
take turns and never fight over its cores. Sampling is `infer generate`'s: a generator of the
sequence's own, seeded by the request's seed and the prompt's index, so the same seed gives the same
text whatever else is in the batch.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from infer.generate import _step


@dataclass
class Sampling:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    """How many most likely alternatives to return with each token's log-probability (None: none)."""
    echo: bool = False
    """Return the prompt's own tokens (and their log-probabilities, with `logprobs`) before the new ones."""
    ignore_eos: bool = False
    """Never draw end-of-text: the completion runs to max_tokens (what a load test asks for)."""
    min_tokens: int = 0
    """End-of-text is not drawn before this many new tokens."""


@dataclass
class Sequence:
    """One prompt's generation: what the engine and the request's coroutine share."""

    prompt: list[int]
    sampling: Sampling
    index: int = 0  # the prompt's index in its request (it seeds the generator)
    out: list[int] = field(default_factory=list)
    logprobs: list[tuple[float | None, dict[int, float]]] = field(default_factory=list)
    """One (logprob, {id: logprob of the most likely}) per token: the echoed prompt's (None first), then the new."""
    finish: str | None = None  # "stop" (end-of-text), "length", "cancelled", or an error message
    cancelled: bool = False
    events: asyncio.Queue | None = None
    generator: torch.Generator | None = None

    @property
    def position(self) -> int:
        """The position of the last token drawn (not yet in the cache)."""
        return len(self.prompt) + len(self.out) - 1

    @property
    def budget(self) -> int:
        return len(self.prompt) + self.sampling.max_tokens


class Busy(Exception):
    """The engine's queue is full: the request should be answered 503, to be retried."""


class Engine:
    def __init__(self, net, tok, *, pool: Executor, device: str = "cpu", max_batch_tokens: int = 8192,
                 max_waiting: int = 256, batch_wait_ms: float = 0.0):
        self.net, self.tok, self.pool, self.device = net, tok, pool, device
        self.context = net.cfg.seq_len
        self.max_batch_tokens = max(max_batch_tokens, self.context)
        self.max_waiting, self.batch_wait_s = max_waiting, batch_wait_ms / 1000
        self.waiting: deque[Sequence] = deque()
        self.passes: deque[tuple[str, list[int], asyncio.Future]] = deque()
        self.active: list[Sequence] = []  # row i of the cache is active[i]'s (touched by the model thread only)
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.task: asyncio.Task | None = None
        self.steps = 0  # decode steps run, and rows they carried (the mean batch: rows / steps)
        self.rows = 0

    # ---- the request side (the replica's event loop) -------------------------------------------------

    def check(self, prompt: list[int], max_tokens: int = 0) -> None:
        """A ValueError naming the limit when `prompt` (plus `max_tokens`) does not fit the model."""
        if len(prompt) + max_tokens > self.context:
            raise ValueError(f"the prompt's {len(prompt)} tokens plus max_tokens {max_tokens} exceed the "
                             f"model's context of {self.context} tokens")
        self.check_ids(prompt)

    def check_ids(self, ids: list[int]) -> None:
        """A ValueError when an id is outside the tokenizer's vocabulary."""
        if any(not 0 <= i < self.tok.vocab_size for i in ids):
            raise ValueError(f"a token id is outside the vocabulary (0 to {self.tok.vocab_size - 1})")

    def submit(self, prompt: list[int], sampling: Sampling, index: int = 0) -> Sequence:
        """Queue a generation; its events (("token", id) ..., then ("done", reason)) arrive on seq.events."""
        self.check(prompt or [self.tok.eot_id], sampling.max_tokens)
        if len(self.waiting) >= self.max_waiting:
            raise Busy(f"{len(self.waiting)} sequences are waiting for this model")
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(31)
        seq = Sequence(list(prompt) or [self.tok.eot_id], sampling, index, events=asyncio.Queue(),
                       generator=torch.Generator().manual_seed((seed * 1_000_003 + index) % (1 << 64)))
        self.waiting.append(seq)
        self._wake()
        return seq

    async def run_pass(self, kind: str, ids: list[int]):
        """A single pass: "embed" (the normalised mean of the last hidden states, a list of floats) or
        "score" ((tokens, summed negative log-likelihood in nats)). A score's document goes in windows of the
        context (infer/score.py), each a pass item of its own: a long document never holds the model thread
        for more than a round's `max_batch_tokens`, so decode steps go on between its pieces."""
        self.check(ids if kind == "embed" else [])
        if len(self.passes) >= self.max_waiting:
            raise Busy(f"{len(self.passes)} passes are waiting for this model")
        loop = asyncio.get_running_loop()
        if kind == "score":
            from infer.score import window_items

            pieces = window_items(ids, self.tok.eot_id, self.context, max(1, self.context // 2))
            futures = [loop.create_future() for _ in pieces]
            self.passes.extend(("window", piece, f) for piece, f in zip(pieces, futures, strict=True))
            self._wake()
            return len(ids), float(sum(await asyncio.gather(*futures)))
        done = loop.create_future()
        self.passes.append((kind, list(ids), done))
        self._wake()
        return await done

    def _wake(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        if self.batch_wait_s:  # idle until now: let the requests arriving with this one share its first pass
            await asyncio.sleep(self.batch_wait_s)
        while self.waiting or self.passes or self.active:
            admitted = self._admit()
            passes = self._take_passes()
            try:
                events = await loop.run_in_executor(self.pool, self._tick, admitted, passes)
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, never the replica
                for seq in [*self.active, *admitted]:
                    seq.finish = f"error: {e}"
                    seq.events.put_nowait(("done", seq.finish))
                self.active = []
                self.cache = None
                for _, _, fut in passes:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for seq, event in events:
                seq.events.put_nowait(event)
        self.cache = None  # idle: the cache's memory goes back

    def _admit(self) -> list[Sequence]:
        """Waiting sequences that fit beside the active ones (in order of arrival)."""
        held = sum(s.budget for s in self.active)
        admitted = []
        while self.waiting:
            seq = self.waiting[0]
            if seq.cancelled:
                self.waiting.popleft()
                seq.finish = "cancelled"
                seq.events.put_nowait(("done", "cancelled"))
                continue
            if held + seq.budget > self.max_batch_tokens and (self.active or admitted):
                break
            admitted.append(self.waiting.popleft())
            held += seq.budget
        return admitted

    def _take_passes(self) -> list[tuple[str, object, asyncio.Future]]:
        """This round's passes: up to `max_batch_tokens` of them (at least one)."""
        def size(item) -> int:
            return len(item[1][0]) if item[0] == "window" else len(item[1])

        taken, tokens = [], 0
        while self.passes and (not taken or tokens + size(self.passes[0]) <= self.max_batch_tokens):
            item = self.passes.popleft()
            if not item[2].cancelled():
                taken.append(item)
                tokens += size(item)
        return taken

    # ---- the model thread ---------------------------------------------------------------------------

    @torch.inference_mode()
    def _tick(self, admitted: list[Sequence], passes: list) -> list[tuple[Sequence, tuple]]:
        """One round: the passes, the new sequences' prompts, then one decode step over every active row.
        Returns the events to deliver."""
        events: list[tuple[Sequence, tuple]] = []
        if passes:
            self._passes(passes)
        self.active = [s for s in self.active if not self._left(s, events)]
        self._compact()
        fed = len(self.active)  # rows whose last token the step below feeds (new rows start with theirs)
        if admitted:
            self._prefill(admitted, events)
        if fed:
            self._decode(self.active[:fed], events)
        gone = [s for s in self.active if s.finish]
        if gone:
            self.active = [s for s in self.active if not s.finish]
            self._compact(gone)
        return events

    def _left(self, seq: Sequence, events: list) -> bool:
        if seq.cancelled and not seq.finish:
            seq.finish = "cancelled"
            events.append((seq, ("done", "cancelled")))
        return bool(seq.finish)

    def _compact(self, gone: list[Sequence] | None = None) -> None:
        """Give the active sequences rows 0..n-1 again (a row moves only when one before it left)."""
        rows = getattr(self, "_rows", {})
        if self.cache is not None and rows:
            for new, seq in enumerate(self.active):
                old = rows.get(id(seq), new)
                if old != new:
                    for k, v in self.cache:
                        k[new], v[new] = k[old], v[old]
        self._rows = {id(s): i for i, s in enumerate(self.active)}

    def _room(self, rows: int, length: int) -> None:
        """A cache of at least `rows` rows of `length` positions (its rows kept)."""
        blk = self.net.blocks[0].attn
        H, C = blk.n_head, self.net.cfg.n_embd
        have_rows, have_len = (self.cache[0][0].shape[0], self.cache[0][0].shape[2]) if self.cache else (0, 0)
        if rows <= have_rows and length <= have_len:
            return
        # Rounded up, not doubled: the cache stays within about --max-batch-tokens of keys and values.
        new_rows = max(have_rows, -(-rows // 8) * 8)
        new_len = min(self.context, max(have_len, -(-length // 64) * 64))
        dtype = self.net.wte.weight.dtype
        cache = []
        for i in range(len(self.net.blocks)):
            k = torch.zeros(new_rows, H, new_len, C // H, dtype=dtype, device=self.device)
            v = torch.zeros_like(k)
            if self.cache:
                k[:have_rows, :, :have_len] = self.cache[i][0]
                v[:have_rows, :, :have_len] = self.cache[i][1]
            cache.append((k, v))
        self.cache = cache

    def _prefill(self, seqs: list[Sequence], events: list) -> None:
        by_length: dict[int, list[Sequence]] = {}
        for s in seqs:
            by_length.setdefault(len(s.prompt), []).append(s)
        for length, group in sorted(by_length.items()):
            first = len(self.active)
            self.active.extend(group)
            self._rows.update({id(s): first + i for i, s in enumerate(group)})
            self._room(len(self.active), max(s.budget for s in self.active))
            idx = torch.tensor([s.prompt for s in group], dtype=torch.long, device=self.device)
            kv: list = [None] * len(self.net.blocks)
            echo = any(s.sampling.echo for s in group)
            logits = _step(self.net, idx, 0, kv, out="all" if echo else "last")
            for (k, v), (ck, cv) in zip(kv, self.cache, strict=True):
                ck[first:first + len(group), :, :length] = k
                cv[first:first + len(group), :, :length] = v
            if echo:
                for r, s in enumerate(group):
                    if s.sampling.echo:
                        self._echo(s, logits[r])
                logits = logits[:, -1]
            self._draw(group, logits, events)

    def _echo(self, seq: Sequence, logits: torch.Tensor) -> None:
        """The prompt's tokens' log-probabilities (None for the first), as OpenAI's echo returns them."""
        n = seq.sampling.logprobs
        # Over the model's whole output, padding ids too: the likelihood `infer eval` and `infer score` compute.
        lp = torch.log_softmax(logits[:-1].double(), dim=-1).cpu()
        targets = torch.tensor(seq.prompt[1:], dtype=torch.long)
        own = lp.gather(1, targets[:, None])[:, 0].tolist() if len(targets) else []
        seq.logprobs.append((None, {}))
        for value, row in zip(own, lp, strict=True):
            top = torch.topk(row, n) if n else None
            seq.logprobs.append((value, {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist(),
                                                                        strict=True))))

    def _decode(self, rows: list[Sequence], events: list) -> None:
        A = len(rows)
        net = self.net
        self.steps += 1
        self.rows += A
        ids = torch.tensor([s.out[-1] for s in rows], dtype=torch.long, device=self.device)
        pos = torch.tensor([s.position for s in rows], dtype=torch.long, device=self.device)
        span = int(pos.max()) + 1
        x = (net.wte(ids) + net.wpe(pos))[:, None]  # (A, 1, C)
        mask = (torch.arange(span, device=self.device)[None, :] <= pos[:, None]).view(A, 1, 1, span)
        at = torch.arange(A, device=self.device)
        for block, (ck, cv) in zip(net.blocks, self.cache, strict=True):
            attn, C = block.attn, x.size(-1)
            q, k, v = attn.qkv(block.ln1(x)).split(C, dim=2)
            q, k, v = (a.view(A, 1, attn.n_head, C // attn.n_head).transpose(1, 2) for a in (q, k, v))
            ck[at, :, pos] = k[:, :, 0]
            cv[at, :, pos] = v[:, :, 0]
            y = F.scaled_dot_product_attention(q, ck[:A, :, :span], cv[:A, :, :span], attn_mask=mask)
            x = x + attn.proj(y.transpose(1, 2).reshape(A, 1, C))
            x = x + block.mlp(block.ln2(x))
        self._draw(rows, net.head(net.ln_f(x[:, 0])), events)

    def _draw(self, rows: list[Sequence], logits: torch.Tensor, events: list) -> None:
        """The next token of each row (as infer generate draws it), its events, and the finished rows."""
        full = logits.double() if any(s.sampling.logprobs is not None for s in rows) else None
        logits = logits.float()
        logits[:, self.tok.vocab_size:] = -float("inf")  # padding ids are never drawn
        for r, s in enumerate(rows):
            if s.sampling.ignore_eos or len(s.out) < s.sampling.min_tokens:
                logits[r, self.tok.eot_id] = -float("inf")
        greedy = logits.argmax(dim=-1).tolist()
        for r, s in enumerate(rows):
            sp = s.sampling
            if sp.max_tokens == 0:  # echo only: the prompt's log-probabilities, nothing drawn
                s.finish = "length"
                events.append((s, ("done", s.finish)))
                continue
            if sp.temperature == 0:
                token = greedy[r]
            else:
                row = logits[r] / sp.temperature
                if sp.top_k:
                    kth = torch.topk(row, min(sp.top_k, row.numel())).values[-1]
                    row = row.masked_fill(row < kth, -float("inf"))
                probs = F.softmax(row, dim=-1).cpu()
                if sp.top_p < 1:
                    ranked, order = probs.sort(descending=True)
                    beyond = ranked.cumsum(0) - ranked > sp.top_p  # keep the smallest head reaching top_p
                    probs = probs.index_fill(0, order[beyond], 0.0)
                token = int(torch.multinomial(probs, 1, generator=s.generator))
            if sp.logprobs is not None:
                lp = torch.log_softmax(full[r], dim=-1).cpu()
                top = torch.topk(lp, sp.logprobs) if sp.logprobs else None
                s.logprobs.append((float(lp[token]), {} if top is None else
                                   dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))))
            s.out.append(token)
            events.append((s, ("token", token)))
            if token == self.tok.eot_id:
                s.finish = "stop"
            elif len(s.out) >= sp.max_tokens:
                s.finish = "length"
            if s.finish:
                events.append((s, ("done", s.finish)))

    def _passes(self, passes: list) -> None:
        """Embeddings and scores, batched by length."""
        from infer.score import score_items

        scores = [p for p in passes if p[0] == "window"]
        if scores:
            try:
                got = score_items(self.net, [p[1] for p in scores], self.max_batch_tokens, self.device)
                for (_, _, fut), nll in zip(scores, got, strict=True):
                    _resolve(fut, nll)
            except Exception as e:  # noqa: BLE001 - the batch's requests get the error
                for _, _, fut in scores:
                    _resolve(fut, error=e)
        embeds = sorted((p for p in passes if p[0] == "embed"), key=lambda p: len(p[1]))
        at = 0
        while at < len(embeds):
            width = max(1, len(embeds[at][1]))
            batch = [p for p in embeds[at:at + max(1, self.max_batch_tokens // width)] if len(p[1]) < 2 * width]
            batch = batch or embeds[at:at + 1]
            at += len(batch)
            T = max(len(p[1]) for p in batch)
            idx = torch.zeros(len(batch), T, dtype=torch.long, device=self.device)
            for i, p in enumerate(batch):
                idx[i, : len(p[1])] = torch.tensor(p[1], dtype=torch.long)
            # Causal attention: a row's padding at its end changes none of its own positions.
            hidden = _step(self.net, idx, 0, [None] * len(self.net.blocks), out="hidden").float()
            for i, (_, ids, fut) in enumerate(batch):
                v = hidden[i, : len(ids)].mean(dim=0)
                _resolve(fut, (v / v.norm().clamp_min(1e-12)).cpu().tolist())


def _resolve(fut: asyncio.Future, value=None, error: Exception | None = None) -> None:
    """Settle `fut` from the model thread (on its own loop)."""
    def settle():
        if not fut.done():
            fut.set_exception(error) if error else fut.set_result(value)

    fut.get_loop().call_soon_threadsafe(settle)
