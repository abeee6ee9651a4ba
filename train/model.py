"""A GPT-style decoder: pre-norm blocks, scaled-dot-product attention, tied embeddings.

GPT-2's architecture, by default without the linear biases (they add nothing
at this scale and cost bandwidth): a model exports to Hugging Face's GPT-2
with zero biases (train/export.py). `bias=True` keeps them, for models
imported from GPT-2 checkpoints that have them (train/pretrained.py). Attention is `F.scaled_dot_product_attention`, which
takes the flash kernels on GPU.

    python -m train.model      # the presets with parameters and FLOPs per token
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

from strata.commands.cli import AT_LEAST_ONE, BELOW_ONE, check_fields


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 50304
    """Embedding rows; at least the tokenizer's vocab (the CLI defaults it to the dataset's, rounded up to 128)."""
    seq_len: int = 1024
    """Context length: must equal the dataset's seq_len (the CLI defaults it to the dataset's)."""
    n_layer: int = 12
    """Transformer blocks."""
    n_head: int = 12
    """Attention heads per block."""
    n_embd: int = 768
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on attention and MLP outputs."""
    bias: bool = False
    """Biases on the linear layers, as GPT-2 has them (set by --init-from a model that has them)."""

    def __post_init__(self):
        check_fields(self, {**dict.fromkeys(("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"), AT_LEAST_ONE),
                            "dropout": BELOW_ONE})
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")


PRESETS = {
    "debug": GPTConfig(vocab_size=320, seq_len=128, n_layer=4, n_head=4, n_embd=128),
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-774m": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048),
}


VOCAB_MULTIPLE = 128  # embedding rows padded to this: tensor-core friendly, few unused logits


def fit_to_dataset(cfg: GPTConfig, *, vocab: int, seq_len: int, keep: frozenset = frozenset()) -> GPTConfig:
    """The model shaped for a dataset: its vocabulary (rounded up to VOCAB_MULTIPLE) and its seq_len,
    except for the fields in `keep` (given explicitly)."""
    fitted = {"vocab_size": -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE, "seq_len": seq_len}
    return replace(cfg, **{k: v for k, v in fitted.items() if k not in keep})


def preset(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The attention output at positions `start`.. (each over every position up to its own)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        drop = self.dropout if self.training else 0.0
        if start:  # queries start..T-1 over keys 0..T-1: the causal mask aligned to the bottom right
            mask = torch.ones(T - start, T, dtype=torch.bool, device=x.device).tril(start)
            y = F.scaled_dot_product_attention(q[:, :, start:], k, v, attn_mask=mask, dropout_p=drop)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T - start, C))


class LayerNorm(nn.LayerNorm):
    """LayerNorm in the dtype of its input, whatever its weights' (the same parameters as nn.LayerNorm):
    under FSDP2 a block's weights arrive in bf16 while the residual stream it normalises stays fp32, and
    the norm stays fp32 with it, as it does under autocast (train.step.parallelize)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = LayerNorm(cfg.n_embd), LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The block's output at positions `start`.. (the earlier ones are still its attention's keys)."""
        x = x[:, start:] + self.drop(self.attn(self.ln1(x), start))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    compiled = False
    """Set by train.step.parallelize when it compiles the blocks: the loss's chunks and evaluation's
    forward are compiled too."""

    def __init__(self, cfg: GPTConfig, init: bool = True):
        """`init=False`: weights left as allocated, for a model whose weights are loaded or only counted
        (its embeddings skip their own random init too: on the meta device that init alone imports
        torch's compiler, 1-1.5 s of the training driver's start)."""
        super().__init__()
        self.cfg = cfg
        def embedding(rows: int) -> nn.Embedding:
            return nn.Embedding(rows, cfg.n_embd, **({} if init else {"_weight": torch.empty(rows, cfg.n_embd)}))

        self.wte, self.wpe = embedding(cfg.vocab_size), embedding(cfg.seq_len)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie_weights()
        if init:
            self.init_weights()

    def tie_weights(self) -> None:
        """The output layer is the token embedding (GPT-2's tied embeddings). Anything that replaces
        parameters (`to_empty` after a meta-device build, a load by assignment) unties them: call this
        again after it, before the weights are initialised or loaded."""
        self.head.weight = self.wte.weight

    @property
    def tied(self) -> bool:
        return self.head.weight is self.wte.weight

    def check_tied(self) -> None:
        """Raise if the output layer is no longer the token embedding: the model trained would then not be
        the model that sampling, export and --init-from load."""
        if not self.tied:
            raise RuntimeError("the output layer (head.weight) is not tied to the token embedding (wte.weight)")

    def init_weights(self) -> None:
        """GPT-2's init (also for a model built on the meta device and then `to_empty` on its own)."""
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        """Parameters of the model as it trains: the tied embedding counts once (`parameters()` lists a
        shared parameter once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the matmuls of the weights plus 12·L·C·T for attention
        (PaLM, appendix B). N leaves out the position table, which takes no matmul."""
        c = self.cfg
        return 6 * (self.num_params() - self.wpe.weight.numel()) + 12 * c.n_layer * c.n_embd * c.seq_len

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, per_token: bool = False,
                start: int = 0):
        """Logits (B, T, V) without targets. With targets (B, T): (None, the mean loss), or with
        `per_token` (None, each target's loss (B*T,), 0 where the target is IGNORE), for evaluation
        under no_grad. `start`: only positions start.. are wanted (logits (B, T - start, V), the losses of
        targets[:, start:]); the last block computes no others (the earlier ones are its keys and values).
        Call the model, not a method of it: FSDP2 gathers the weights in its hooks."""
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        *body, last = self.blocks
        if self.compiled and not torch.is_grad_enabled():
            # Evaluation runs the blocks through a compiled function of its own (any batch size, no grad,
            # eval mode), so it never recompiles (or evicts) the graph that training compiled.
            torch._dynamo.maybe_mark_dynamic(x, 0)
            for block in body:
                x = _eval_blocks()(block, x)
            x = last(x, start) if start else _eval_blocks()(last, x)
        else:
            for block in body:
                x = block(x)
            x = last(x, start) if start else last(x)  # as training calls (and compiles) it
        h = self.ln_f(x)  # (B, T - start, C)
        if targets is None:
            return self.head(h)  # (B, T - start, V)
        targets = targets[:, start:]
        n = B * (T - start)
        with record_function(LOSS_RANGE):  # the profile (bench/train/gpu.py) counts what runs in here as loss
            if per_token:
                return None, token_losses(h.reshape(n, -1), self.head.weight, targets.reshape(-1))
            # With targets only the loss comes back: the (B*T, V) logits are never all alive at once.
            return None, linear_cross_entropy(h.reshape(n, -1), self.head.weight, targets.reshape(-1),
                                              compiled=self.compiled)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 50, vocab_limit: int | None = None) -> torch.Tensor:
        """Sample `new_tokens` after `idx` (B, T); ids >= vocab_limit (padding) are never drawn."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.seq_len:])[:, -1, :] / max(temperature, 1e-5)  # (B, V)
            if vocab_limit is not None:
                logits[:, vocab_limit:] = -float("inf")
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits[logits < kth] = -float("inf")
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx


def build(cfg: GPTConfig, device: torch.device | str) -> GPT:
    """The model made on the meta device (no host copy of its weights), materialised on `device`, tied
    and initialised. `to_empty` gives every parameter new storage, which unties the output layer from the
    embedding: they are tied again before init, so the model trained is the one sampled and exported."""
    with torch.device("meta"):
        model = GPT(cfg, init=False)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights()
    return model


LOSS_CHUNK_ROWS = 4096  # rows of logits materialized at a time by linear_cross_entropy
LOSS_RANGE = "strata::loss"  # the profiler range around the classifier and its loss


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int = LOSS_CHUNK_ROWS, compiled: bool = False) -> torch.Tensor:
    """Mean cross-entropy of the logits `h @ weight.T` (h: (N, C), weight: (V, C)) against targets (N,);
    a negative target (train.step.IGNORE: padding) is left out of the mean and gets no gradient.
    `compiled`: each chunk's softmax and gradient run as compiled (fused) kernels."""
    return _LinearCrossEntropy.apply(h, weight, targets, chunk, compiled)


def _chunk_nll(hc: torch.Tensor, w: torch.Tensor, tc: torch.Tensor):
    """A chunk's fp32 logits (c, V), their log-sum-exp and each row's cross-entropy, 0 where the target is
    negative (IGNORE): the one definition of the loss that training, its compiled form and evaluation share."""
    valid = tc >= 0
    logits = (hc @ w.t()).float()  # (c, V)
    lse = torch.logsumexp(logits, dim=-1)
    return logits, lse, (lse - logits.gather(1, tc.clamp(min=0)[:, None]).squeeze(1)) * valid


def _loss_chunk(hc: torch.Tensor, w: torch.Tensor, tc: torch.Tensor, n: torch.Tensor):
    """One chunk of rows, eagerly: (its summed loss, d(mean loss)/d(hc), the chunk's d(mean loss)/d(w)).
    The softmax is made in place of the logits: no (c, V) tensor is allocated beyond them and the cast."""
    logits, lse, nll = _chunk_nll(hc, w, tc)
    valid, tc = (tc >= 0)[:, None], tc.clamp(min=0)
    loss = nll.sum()
    g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
    g[torch.arange(len(tc), device=g.device), tc] -= 1.0
    g = (g * valid / n).to(hc.dtype)  # d(mean loss)/d(logits); none for an ignored target
    return loss, g @ w, g.t() @ hc


def _fused_loss_chunk(hc: torch.Tensor, w: torch.Tensor, tc: torch.Tensor, n: torch.Tensor):
    """`_loss_chunk` written for torch.compile: the one-hot is a comparison and nothing is in place, so the
    fp32 upcast, the log-sum-exp and the gradient fuse into one reduction and one pointwise pass over
    the (c, V) logits (eager, the same takes about eight)."""
    logits, lse, nll = _chunk_nll(hc, w, tc)
    valid, tc = tc >= 0, tc.clamp(min=0)
    loss = nll.sum()
    onehot = torch.arange(logits.size(1), device=logits.device)[None, :] == tc[:, None]
    g = ((torch.exp(logits - lse[:, None]) - onehot.float()) * (valid[:, None] / n)).to(hc.dtype)
    return loss, g @ w, g.t() @ hc


@functools.cache
def _compiled_loss_chunk():
    return torch.compile(_fused_loss_chunk)


@functools.cache
def _eval_blocks():
    """A block's forward for evaluation, compiled apart from training's (GPT.forward)."""

    def eval_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block._call_impl(x)  # the hooks (FSDP2's) and forward, without the block's own compiled call

    return torch.compile(eval_block)


class _LinearCrossEntropy(torch.autograd.Function):
    """The classifier and its loss fused, a chunk of rows at a time, as llm.c does: each chunk's
    gradients are computed in the forward pass, so what waits for backward is grad_h (N, C) and
    grad_w (V, C), never the (N, V) logits and their softmax. No recompute: the matmul FLOPs are those
    of the plain head (2NCV forward, 4NCV backward)."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, compiled):
        device = h.device.type
        mm = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        w = weight.to(mm)
        n = (targets >= 0).sum().clamp(min=1).float()  # the targets that count: a tensor (no device sync)
        step = _compiled_loss_chunk() if compiled else _loss_chunk
        loss = torch.zeros((), device=h.device, dtype=torch.float32)
        grad_h = torch.empty(h.shape, device=h.device, dtype=h.dtype)
        grad_w = torch.zeros(weight.shape, device=h.device, dtype=torch.float32)
        with torch.autocast(device, enabled=False):  # the dtypes are chosen here
            for i in range(0, h.size(0), chunk):
                part, gh, gw = step(h[i:i + chunk].to(mm), w, targets[i:i + chunk], n)
                loss += part
                grad_h[i:i + chunk] = gh
                grad_w += gw
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None, None


@torch.no_grad()
def token_losses(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                 chunk: int = LOSS_CHUNK_ROWS) -> torch.Tensor:
    """Each target's cross-entropy (N,) in fp32, 0 where the target is negative (IGNORE); the logits are
    made a chunk of rows at a time."""
    device = h.device.type
    mm = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    w, out = weight.to(mm), torch.empty(targets.shape, device=h.device, dtype=torch.float32)
    with torch.autocast(device, enabled=False):
        for i in range(0, h.size(0), chunk):
            out[i:i + chunk] = _chunk_nll(h[i:i + chunk].to(mm), w, targets[i:i + chunk])[2]
    return out


def describe(cfg: GPTConfig) -> dict:
    """Parameters and training FLOPs per token of a config, without allocating its weights."""
    with torch.device("meta"):
        model = GPT(cfg, init=False)
    return {"params": model.num_params(), "flops_per_token": model.flops_per_token()}


def main() -> None:
    print(f"{'preset':10} {'layers':>6} {'heads':>5} {'width':>5} {'seq':>5} {'params':>9} {'GFLOP/token':>11}")
    for name, cfg in PRESETS.items():
        d = describe(cfg)
        print(f"{name:10} {cfg.n_layer:6} {cfg.n_head:5} {cfg.n_embd:5} {cfg.seq_len:5} "
              f"{d['params'] / 1e6:8.1f}M {d['flops_per_token'] / 1e9:11.2f}")


if __name__ == "__main__":
    main()
