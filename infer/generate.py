"""Batched decoding with a key/value cache: each step runs the model on one new token per row and
attends to the keys and values kept from the steps before.

Prompts of one length decode together (no padding: every row's positions are the same). `temperature`
0 takes the most likely token; otherwise tokens are drawn from the softmax at that temperature, among
the `top_k` most likely, by a generator of the row's own (seeded by `seed` and the prompt's index), so
a prompt gives the same text for the same seed whatever else is in the batch. Padding ids (ids at or
above the tokenizer's vocabulary) are never drawn. A row stops at the end-of-text id.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _step(model, idx: torch.Tensor, start: int, cache: list, out: str = "last") -> torch.Tensor:
    """After `idx` (B, t) at positions start.., the cache extended: the last position's logits (B, V), or
    with `out` "all" every position's (B, t, V), or "hidden" every position's final hidden state (B, t, C)."""
    B, t = idx.shape
    x = model.wte(idx) + model.wpe(torch.arange(start, start + t, device=idx.device))
    for i, block in enumerate(model.blocks):
        attn, C = block.attn, x.size(-1)
        q, k, v = attn.qkv(block.ln1(x)).split(C, dim=2)
        q, k, v = (a.view(B, t, attn.n_head, C // attn.n_head).transpose(1, 2) for a in (q, k, v))
        if cache[i] is not None:
            k, v = torch.cat([cache[i][0], k], dim=2), torch.cat([cache[i][1], v], dim=2)
        cache[i] = (k, v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0 and t > 1)
        x = x + attn.proj(y.transpose(1, 2).contiguous().view(B, t, C))
        x = x + block.mlp(block.ln2(x))
    if out == "hidden":
        return model.ln_f(x)
    return model.head(model.ln_f(x if out == "all" else x[:, -1]))


@torch.no_grad()
def decode(model, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0, top_k: int = 0,
           seed: int = 0, eot_id: int, vocab_limit: int) -> list[list[int]]:
    """The tokens generated after each prompt (up to max_tokens, the end-of-text id included when drawn).
    A prompt longer than the context leaves room for max_tokens by keeping its end."""
    context = model.cfg.seq_len
    if not 1 <= max_tokens < context:
        raise ValueError(f"--max-tokens must be between 1 and {context - 1} (the model's context less one)")
    prompts = [(p or [eot_id])[-(context - max_tokens):] for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    device = model.wte.weight.device
    for length, rows in sorted(by_length.items()):
        gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in rows]  # on the CPU: any device draws alike
        idx = torch.tensor([prompts[i] for i in rows], dtype=torch.long, device=device)
        cache = [None] * len(model.blocks)
        logits, done = _step(model, idx, 0, cache), torch.zeros(len(rows), dtype=torch.bool, device=device)
        for n in range(max_tokens):
            logits[:, vocab_limit:] = -float("inf")
            if temperature == 0:
                nxt = logits.argmax(dim=-1)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, -float("inf"))
                probs = F.softmax(logits.float(), dim=-1).cpu()
                nxt = torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(gens)]).to(device)
            for r, i in enumerate(rows):
                if not done[r]:
                    out[i].append(int(nxt[r]))
            done |= nxt == eot_id
            if bool(done.all()) or n == max_tokens - 1:
                break
            logits = _step(model, nxt[:, None], length + n, cache)
    return out


def run_generate(model, prompts: list[str], *, max_tokens: int, temperature: float, top_k: int, seed: int,
                 cpus: float, device: str) -> dict:
    """`python -m infer generate`'s work, in a task on the tier it names: each prompt's completion (cut at
    the end-of-text id) and the tokens generated."""
    import time

    from infer.model import threads

    threads(cpus)
    net, tok = model.build(device)
    started = time.time()
    made = decode(net, [tok.encode(p).tolist() for p in prompts], max_tokens=max_tokens, temperature=temperature,
                  top_k=top_k, seed=seed, eot_id=tok.eot_id, vocab_limit=tok.vocab_size)
    seconds = time.time() - started
    return {"completions": [tok.decode(ids[: ids.index(tok.eot_id)] if tok.eot_id in ids else ids) for ids in made],
            "tokens": sum(len(ids) for ids in made), "seconds": seconds}
