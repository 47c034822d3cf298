"""The GPT over a cp group: each rank runs every layer on its own slice of the sequence, and
attention, the one layer whose tokens meet, by one of the three ways (ring, all-gather,
Ulysses). Chapter 12 (chapters/12_context_parallel.md, "The GPT over a cp axis").
Exercised by tests/test_context_parallel.py and
`torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --cp 2`.

Slice in, slice out: `model(idx, targets)` takes this rank's tokens as
split_sequence(x, group, dim=1, layout) cut them and returns their logits and their loss.
The positions follow the layout (a zigzag rank's two chunks keep their true positions), so
the whole sequence's loss is the sum of the ranks' losses. Every rank holds all the weights,
and each parameter's gradient on a rank is its own tokens' share (the attention's backward
brings every dK, dV home): summed over the cp ranks it is the whole sequence's gradient.
The parameters keep the GPT's names, so a checkpoint moves between cp sizes unchanged.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from minidist.model import GPT

from .allgather import allgather_attention
from .layout import LAYOUTS, check_length, positions, rank_and_size
from .ring import ring_attention
from .ulysses import ulysses_attention

ATTENTIONS = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}


class ContextAttention(nn.Module):
    """model.CausalSelfAttention on this rank's tokens, its attention by `attend` over the
    cp group; the same c_attn and c_proj (names and weights). `whole`: plain causal SDPA on
    a whole sequence held here (for sampling, where every rank holds the whole prompt)."""

    def __init__(self, full, group, attend, layout: str):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = full.c_attn, full.c_proj, full.n_head
        self.group, self.attend, self.layout, self.whole = group, attend, layout, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        if self.whole:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = self.attend(q, k, v, self.group, causal=True, layout=self.layout)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def check_context_parallel(n_head: int, dropout: float, n: int | None, attention: str, layout: str,
                           seq_len: int | None = None) -> None:
    """Refuse what the cp GPT cannot run on `n` ranks (None: any), saying what to use
    (train_gpt checks the same before any process starts)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"context parallel attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"context parallel layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if dropout > 0:  # the three ways never hold a whole row of probabilities to drop from
        raise ValueError(f"context parallelism has no attention dropout (dropout={dropout}): use dropout 0")
    if attention == "ulysses" and n is not None and n_head % n:
        raise ValueError(f"ulysses attention splits the {n_head} heads over {n} ranks: use a cp size "
                         f"that divides {n_head}, or the ring or allgather attention")
    if seq_len is not None and n is not None:
        check_length(seq_len, n, layout, "context parallelism")


class ContextParallelGPT(nn.Module):
    """This rank's view of `model` (copied, so the given model is left as it was) over the
    cp `group`: the same parameters under the same names, every attention through
    `attention` ("ring", "allgather" or "ulysses") with the tokens cut by `layout`."""

    def __init__(self, model: GPT, group, attention: str = "ring", layout: str = "zigzag"):
        super().__init__()
        cfg = model.config
        check_context_parallel(cfg.n_head, cfg.dropout, None, attention, layout)  # (before any group call)
        self.cp_rank, self.cp = rank_and_size(group)
        check_context_parallel(cfg.n_head, cfg.dropout, self.cp, attention, layout)
        model = copy.deepcopy(model)  # (the tied head stays tied: deepcopy keeps shared tensors shared)
        self.config, self.group, self.attention, self.layout = cfg, group, attention, layout
        for block in model.blocks:
            block.attn = ContextAttention(block.attn, group, ATTENTIONS[attention], layout)
        self.wte, self.wpe, self.drop, self.blocks = model.wte, model.wpe, model.drop, model.blocks
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"):
        """Logits of this rank's tokens `idx` (B, T_local) and, with `targets` (its slice of
        them, -1 ignored), their loss: summed, or their mean."""
        whole = self.blocks[0].attn.whole
        T = idx.shape[1] * (1 if whole else self.cp)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} ({self.cp} slices of {idx.shape[1]}) exceeds block_size "
                             f"{self.config.block_size}; use shorter sequences or a larger block_size")
        pos = torch.arange(T) if whole else positions(T, self.cp_rank, self.cp, self.layout)
        x = self.drop(self.wte(idx) + self.wpe(pos.to(idx.device)))
        for block in self.blocks:
            x = block(x)
        return GPT.head(self, x, targets, reduction)  # final norm, tied head, loss: the GPT's own

    @contextlib.contextmanager
    def whole_sequence(self):
        """Inside, the model runs on a whole sequence held by this rank, with plain attention."""
        for block in self.blocks:
            block.attn.whole = True
        try:
            yield
        finally:
            for block in self.blocks:
                block.attn.whole = False

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, **kw) -> torch.Tensor:
        """Sampling needs no split: every rank holds all the weights and the whole prompt, so
        each samples alone (the same tokens, given the same generator)."""
        with self.whole_sequence():
            return GPT.generate(self, idx, max_new_tokens, **kw)

    def describe(self) -> str:
        return f"cp {self.cp}: {self.attention} attention, {self.layout} layout"
