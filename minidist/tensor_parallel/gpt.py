"""The GPT split for tensor parallelism (Megatron-LM, Shoeybi et al. 2019), from the pieces
in minidist/tensor_parallel/layers.py: attention by heads, the MLP by its hidden width, the token
embedding and the tied head by vocabulary, with a cross entropy that never gathers the
logits. `parallelize(model, tp_group, sequence_parallel)` returns this rank's shard;
`shard_spec` says which slice of which full tensor each parameter is.
Chapter 10 (chapters/10_tensor_parallel.md). Exercised by `pytest -q tests/test_tensor_parallel.py`
and `torchrun --standalone --nproc_per_node=4 minidist/train_gpt.py --tp 2` (dp 2 x tp 2).

    rank r of t holds, of each block:        and of the model:
      c_attn   q, k, v rows of its heads       wte = lm_head   vocabulary rows [V r/t, V (r+1)/t)
      c_proj   the matching columns            wpe, ln_*       whole (replicated)
      c_fc     rows r/t of the hidden
      mlp.c_proj  the matching columns
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minidist.model import GPT
from minidist.tensor_parallel.layers import (ColumnParallelLinear, LayerNorm, RowParallelLinear, dropout,
                                      reduce_from_region, reduce_scatter_sequence, shard_param,
                                      shard_range, tp_rng, used_on_positions)

# ------------------------------------------------------------------ the GPT split

class ParallelAttention(nn.Module):
    """Attention by heads: rank r computes heads r*H/t .. (r+1)*H/t whole, so no head's
    softmax spans ranks. The fused c_attn [3C, C] is re-cut: this rank's q rows, k rows and
    v rows (each a contiguous block of C/t), concatenated q|k|v; c_proj by its columns."""

    def __init__(self, full, group, sp=False):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        C = full.c_attn.in_features
        q = shard_range(C, r, t)
        rows = [(q[0] + i * C, q[1] + i * C) for i in range(3)]
        self.group, self.n_head, self.dropout = group, full.n_head // t, full.dropout
        self.c_attn = ColumnParallelLinear(full.c_attn, group, rows, sp)
        self.c_proj = RowParallelLinear(full.c_proj, group, sp)

    def forward(self, x):
        qkv = self.c_attn(x)  # (B, T, 3C/t): the whole sequence, this rank's heads
        B, T, C3 = qkv.shape
        q, k, v = (z.view(B, T, self.n_head, C3 // 3 // self.n_head).transpose(1, 2)
                   for z in qkv.split(C3 // 3, dim=2))
        p = self.dropout if self.training else 0.0
        with tp_rng(self.group, x.device) if p > 0 else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C3 // 3))


class ParallelMLP(nn.Module):
    """The MLP by its hidden width: c_fc's rows (column-parallel), c_proj's columns (row-
    parallel). GELU acts elementwise, so it runs on the split hidden with nothing to sync."""

    def __init__(self, full, group, sp=False):
        super().__init__()
        self.c_fc = ColumnParallelLinear(full.c_fc, group, None, sp)
        self.c_proj = RowParallelLinear(full.c_proj, group, sp)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class ParallelBlock(nn.Module):
    """model.Block with split attention and MLP; layer norms and residual dropout on the
    whole sequence, or on this rank's positions (sequence parallel). `recompute` as Block's."""

    def __init__(self, full, group, sp):
        super().__init__()
        self.group, self.sequence_parallel = group, sp
        self.ln_1 = LayerNorm(full.ln_1, group, sp)
        self.attn = ParallelAttention(full.attn, group, sp)
        self.ln_2 = LayerNorm(full.ln_2, group, sp)
        self.mlp = ParallelMLP(full.mlp, group, sp)
        self.drop = copy.deepcopy(full.drop)
        self.recompute = None

    def forward(self, x):
        if self.recompute is not None:
            return self.recompute(self._forward, x)
        return self._forward(x)

    def _forward(self, x):
        x = x + dropout(self.drop, self.attn(self.ln_1(x)), self.group, self.sequence_parallel)
        return x + dropout(self.drop, self.mlp(self.ln_2(x)), self.group, self.sequence_parallel)


class VocabParallelEmbedding(nn.Module):
    """Rank r holds the contiguous vocabulary rows [start, stop). An id outside them looks
    up zeros, so the sum over ranks is the full lookup: all-reduce (or reduce-scatter over
    the sequence, which also leaves each rank its positions, under sequence parallelism)."""

    is_lookup = True  # a table, not a linear map: AdamW's, never Muon's (minidist.muon.hidden_matrices)

    def __init__(self, full: nn.Embedding, group, sp):
        super().__init__()
        self.group, self.sequence_parallel = group, sp
        self.start, self.stop = shard_range(full.num_embeddings, dist.get_rank(group),
                                            dist.get_world_size(group))
        self.weight = shard_param(full.weight, (0, ((self.start, self.stop),)))

    def forward(self, idx):
        outside = (idx < self.start) | (idx >= self.stop)
        x = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return (reduce_scatter_sequence if self.sequence_parallel else reduce_from_region)(x, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits split over the vocabulary, (N, V/t) on each rank,
    from three all-reduces of N numbers: the max (for a stable exp), the sum of exps, and
    the target's logit (from the one rank that holds it). The (N, V) logits never meet.
    Backward is softmax - onehot on this rank's columns: no communication."""

    @staticmethod
    def forward(ctx, logits, target, start, group):
        m = logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = (logits - m.unsqueeze(-1)).exp()
        sum_e = e.sum(-1)
        dist.all_reduce(sum_e, group=group)
        local = target - start
        mine = (local >= 0) & (local < logits.shape[-1])  # false for -1 (ignored) too
        local = local.masked_fill(~mine, 0)
        z_t = (logits.gather(1, local.unsqueeze(1)).squeeze(1) - m).masked_fill(~mine, 0.0)
        dist.all_reduce(z_t, group=group)
        softmax = e / sum_e.unsqueeze(-1)
        ctx.save_for_backward(softmax, local, mine)
        return sum_e.log() - z_t  # -log softmax[target] = log sum exp(z - m) - (z_t - m)

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(len(local), device=g.device), local] -= mine.to(g.dtype)
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits, targets, start: int, group, reduction: str = "mean"):
    """F.cross_entropy(full logits, targets, ignore_index=-1, reduction=...) from this
    rank's logits[..., start:start + V/t]; the same value on every rank of the group."""
    logits, targets = logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
    loss = _VocabParallelCrossEntropy.apply(logits, targets, start, group)
    valid = targets != -1
    loss = loss.masked_fill(~valid, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / valid.sum()
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


class ParallelGPT(nn.Module):
    """This rank's shard of a model.GPT: same attribute names and forward signature. With
    targets, `forward` returns (logits, loss), logits this rank's vocabulary columns (never
    gathered); without (sampling) the full vocabulary's logits, so `generate` is GPT's."""

    generate = GPT.generate  # every rank of the group runs it, in step, drawing the same tokens

    def __init__(self, full: GPT, group, sequence_parallel=False):
        super().__init__()
        sp = sequence_parallel
        self.config, self.group, self.sequence_parallel = full.config, group, sp
        self.tp_group = group  # (a pipeline stage cut from this keeps it under this name)
        self.wte = VocabParallelEmbedding(full.wte, group, sp)
        self.wpe = copy.deepcopy(full.wpe)
        self.drop = copy.deepcopy(full.drop)
        self.blocks = nn.ModuleList(ParallelBlock(b, group, sp) for b in full.blocks)
        self.ln_f = LayerNorm(full.ln_f, group, sp)
        self.lm_head = ColumnParallelLinear(full.lm_head, group, [(self.wte.start, self.wte.stop)], sp)
        self.lm_head.weight = self.wte.weight  # tied, as in the full model: one Parameter

    def forward(self, idx, targets=None, reduction: str = "mean"):
        if targets is None and self.sequence_parallel:
            # sampling grows the sequence a token at a time, so it would rarely split
            # evenly: the same weights in the plain layout (the same arithmetic; without
            # gradients what sequence parallelism saves does not exist)
            with plain_layout(self):
                return self.forward(idx)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets, reduction)

    # forward's two ends, apart, as model.GPT's: a pipeline's first stage runs embed, its
    # last head (chapter 11). They read the group from the modules (wte.group), so a stage,
    # whose own .group is its pipeline, runs them as they are.
    def embed(self, idx):
        """This rank's input to the blocks: (B, T, C), or (B, T/t, C), its positions."""
        B, T = idx.shape
        group, sp = self.wte.group, self.wte.sequence_parallel
        t, r = dist.get_world_size(group), dist.get_rank(group)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}; "
                             "use shorter sequences or a larger block_size")
        if sp and T % t:
            raise ValueError(f"sequence parallelism splits the sequence over {t} ranks: T={T} "
                             f"must be divisible by tp={t}; change the sequence length")
        x = self.wte(idx)  # (B, T, C), or (B, T/t, C): this rank's positions
        if sp:  # this rank's rows of the position table
            lo = r * (T // t)
            pos = torch.arange(lo, lo + x.shape[1], device=idx.device)
            x = x + F.embedding(pos, used_on_positions(self.wpe.weight, group))
        else:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        return dropout(self.drop, x, group, sp)

    def head(self, x, targets=None, reduction: str = "mean"):
        """(logits, loss), as forward's. Under sequence parallelism the head gathers the
        whole sequence first, so each rank's loss covers every position."""
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return gather_vocabulary(logits.detach(), self.config.vocab_size, self.wte.group), None
        return logits, vocab_parallel_cross_entropy(logits, targets, self.wte.start, self.wte.group,
                                                    reduction)


@contextlib.contextmanager
def plain_layout(model: nn.Module):
    """Every module of `model` (a ParallelGPT, or a pipeline stage of one) without sequence
    parallelism for a while (the flag each one reads): for sampling."""
    mods = [m for m in model.modules() if hasattr(m, "sequence_parallel")]
    old = [m.sequence_parallel for m in mods]
    for m in mods:
        m.sequence_parallel = False
    try:
        yield
    finally:
        for m, o in zip(mods, old):
            m.sequence_parallel = o


@torch.no_grad()
def gather_vocabulary(local: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """(..., V_r) logits of each rank's vocabulary range -> (..., V), for sampling only (no
    gradient): ranges may differ by one row, so each part is padded to the widest."""
    t = dist.get_world_size(group)
    if t == 1:
        return local
    ranges = [shard_range(vocab_size, r, t) for r in range(t)]
    width = max(b - a for a, b in ranges)
    padded = F.pad(local, (0, width - local.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(t)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[..., :b - a] for p, (a, b) in zip(parts, ranges)], dim=-1)


def parallelize(model: GPT, tp_group, sequence_parallel: bool = False):
    """This rank's shard of `model` (a minidist.model.GPT, identical on every rank of
    tp_group), its weights copied. No collective runs here: a refusal reaches every rank."""
    cfg, t = model.config, dist.get_world_size(tp_group)
    if cfg.n_head % t:
        raise ValueError(f"tensor parallelism splits attention by heads: n_head={cfg.n_head} "
                         f"must be divisible by tp={t}; change n_head or tp")
    # then n_embd = n_head * head_dim divides too, and so does the MLP's 4 * n_embd.
    # The vocabulary need not: ranks then hold V // t or V // t + 1 rows (shard_range).
    return ParallelGPT(model, tp_group, sequence_parallel)


def shard_spec(model: nn.Module) -> dict:
    """{full-model parameter name: (dim, ((start, stop), ...)) or None}: which slice of the
    full tensor each parameter of a parallelized model holds (None: replicated)."""
    return {name: getattr(p, "tp_shard", None) for name, p in model.named_parameters()}


# the closed forms (bytes, parameters, activations), here for the notebook and the tests
# that name them from this module
from minidist.tensor_parallel.cost import (comm_bytes, korthikanti_activation_bytes,  # noqa: E402,F401
                                           param_bytes, tp_block_activation_bytes)
