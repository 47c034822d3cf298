"""A GPT, shaped like nanoGPT's, small enough to read in one sitting.

Chapter 01 (chapters/01_gpt.md). Exercised by `python -m minidist.train_gpt` and by
tests/test_model.py.

The model is the one every later chapter trains: a token embedding tied to the output
head, learned position embeddings, and `n_layer` pre-norm transformer blocks whose
attention goes through `F.scaled_dot_product_attention` (flash attention where the
hardware has it). This module imports nothing from minidist, so it can be read first.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024   # longest sequence the position table covers
    vocab_size: int = 50257  # GPT-2's BPE; a multiple of 64 is faster on GPUs
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True        # biases in Linear and LayerNorm, as GPT-2 has

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}; "
                             "change one of them")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)


# Named sizes, the one table of them. "gpt2" is GPT-2 small (124M); "tiny" is what a laptop
# CPU trains in a couple of minutes; the last two are GPT-3's 1.3B and 6.7B shapes (Brown et
# al., 2020, table 2.1) with GPT-2's context. None names a vocabulary.
PRESETS = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "small": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),
    "gpt3-1.3b": dict(n_layer=24, n_head=16, n_embd=2048, block_size=1024),
    "gpt3-6.7b": dict(n_layer=32, n_head=32, n_embd=4096, block_size=1024),  # 6.65B parameters
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        # one matmul makes queries, keys and values for all heads at once
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scale = True  # see GPT._init_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scale = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        # chapter 09: a function recompute(fn, x) that runs this block's forward keeping
        # only x for backward (minidist.memory.recompute.set_activation_checkpointing sets it)
        self.recompute = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute is not None:
            return self.recompute(self._forward, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        # ModuleList, so ZeRO-3 (chapter 06) can gather one block at a time
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Tied weights: the head reuses the embedding matrix. One Parameter, two uses;
        # data parallelism must reduce its gradient once, not twice.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module) -> None:
        std = 0.02
        if isinstance(m, nn.Linear):
            # GPT-2 scales the projections that write into the residual stream by
            # 1/sqrt(2 * n_layer), so the stream's variance does not grow with depth.
            if getattr(m, "residual_scale", False):
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                reduction: str = "mean"):
        """Logits for `idx` (B, T); with `targets`, also the cross-entropy loss.
        `targets` equal to -1 are ignored (masked). `reduction="sum"` returns the summed
        loss, which chapter 04 divides by the token count of the whole global batch.
        """
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets, reduction)

    # forward's two ends, apart: a pipeline's first stage runs embed, its last head
    # (chapter 11's Stage holds wte, wpe, drop, ln_f and lm_head under these names)
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings of `idx` (B, T): the blocks' input (B, T, C)."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}; "
                             "use shorter sequences or a larger block_size")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"):
        """(logits, loss or None) from the last block's output: final norm, tied head, loss."""
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-1, reduction=reduction)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None):
        """Sample `max_new_tokens` tokens after the prompt `idx` (B, T)."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.config.block_size:]
            logits, _ = self(ctx)
            logits = logits[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def num_params(model: nn.Module, non_embedding: bool = False) -> int:
    """Distinct parameters (a tied weight counts once). non_embedding=True leaves out the
    position table, a lookup (the token table stays in: as the tied head it is a matmul)."""
    seen, n = set(), 0
    for name, p in model.named_parameters():  # named_parameters already skips duplicates
        if id(p) in seen:
            continue
        seen.add(id(p))
        if non_embedding and name.endswith("wpe.weight"):
            continue
        n += p.numel()
    return n


def config_num_params(cfg: GPTConfig) -> int:
    """The parameter count of a config, from the formula (no model is built)."""
    d, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    b = 1 if cfg.bias else 0
    per_block = (
        2 * d * b + 2 * d        # two LayerNorms (gain, and bias if any)
        + d * 3 * d + 3 * d * b  # qkv projection
        + d * d + d * b          # attention output projection
        + d * 4 * d + 4 * d * b  # MLP up
        + 4 * d * d + d * b      # MLP down
    )
    return V * d + T * d + L * per_block + d + d * b  # + final LayerNorm


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token (forward + backward), the PaLM-paper estimate:
    6 * N for the matmuls (N the non-embedding parameters, the tied head included), plus
    12 * L * T * d for attention (the convention counts the full T x T square).
    """
    T = cfg.block_size if seq_len is None else seq_len
    N = config_num_params(cfg) - cfg.block_size * cfg.n_embd
    return 6 * N + 12 * cfg.n_layer * T * cfg.n_embd
