"""Exercise 10 solved the way chapter 10 teaches, written apart from minidist's module
(tests/test_exercises.py grades it: full marks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


# ------------------------------------------------------------------ (a) the loss over a split vocabulary

def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int,
                                 group) -> torch.Tensor:
    """F.cross_entropy(full_logits.view(-1, V), targets.view(-1)) (the mean over the B*T
    tokens), as a 0-dim tensor, the same on every rank of `group`, computed from this
    rank's block of the logits: `logits` [B, T, V_r] holds vocabulary ids start ..
    start + V_r - 1 (the blocks tile the vocabulary in rank order; V_r may differ by one
    from rank to rank); `targets` [B, T] holds ids of the whole vocabulary. loss.backward()
    must leave in logits.grad this rank's columns of the full logits' gradient. The full
    logits never meet: no rank may gather them."""
    return _VocabParallelCrossEntropy.apply(logits, targets, start, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Three all-reduces of one number per token: the largest logit, the sum of exp(z - max)
    and the target's logit (from the one rank that holds it). Backward is
    (softmax - onehot) / N on this rank's columns: no communication."""

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        z = logits.reshape(-1, logits.shape[-1])           # (N, V_r)
        t = targets.reshape(-1)
        m = z.max(dim=-1).values                            # the largest logit, over the ranks
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = (z - m.unsqueeze(1)).exp()
        total = e.sum(dim=-1)                               # sum of exp(z - m), over the ranks
        dist.all_reduce(total, group=group)
        local = t - start
        here = (local >= 0) & (local < z.shape[-1])         # the targets this rank holds
        local = torch.where(here, local, torch.zeros_like(local))
        z_t = torch.where(here, z.gather(1, local.unsqueeze(1)).squeeze(1), torch.zeros_like(m))
        dist.all_reduce(z_t, group=group)                   # the target's logit, from its rank
        ctx.save_for_backward(e / total.unsqueeze(1), local, here)
        ctx.shape = logits.shape
        return (total.log() + m - z_t).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, here = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(len(local))
        g[rows, local] -= here.to(g.dtype)
        return (g * grad / len(local)).reshape(ctx.shape), None, None, None


# ------------------------------------------------------------------ (b) attention by heads

def qkv_shard(weight: torch.Tensor, bias: torch.Tensor | None, n_head: int, rank: int,
              world_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank `rank` of `world_size`'s shard of a fused c_attn: `weight` [3C, C] is the query
    rows, then the key rows, then the value rows of n_head heads (head h: rows
    h*C/n_head .. (h+1)*C/n_head of each), `bias` [3C] or None likewise. Rank r holds heads
    r*n_head/t .. (r+1)*n_head/t - 1 whole (n_head divides by t): return (weight_r
    [3C/t, C], bias_r [3C/t] or None), laid out as the full one (its queries, its keys, its
    values), so that F.linear(x, weight_r, bias_r) splits into q, k, v as c_attn's output
    does. No communication: the grader runs attention on each shard and sums c_proj's."""
    C = weight.shape[1]
    a, b = rank * C // world_size, (rank + 1) * C // world_size  # its heads' block of each part
    rows = torch.cat([torch.arange(a, b) + i * C for i in range(3)])  # its q, then k, then v rows
    return weight[rows].clone(), None if bias is None else bias[rows].clone()


# ------------------------------------------------------------------ (c) find the bug

def _gather_positions(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/t, C) on each rank -> (B, T, C): rank r's positions are block r of the sequence."""
    t = dist.get_world_size(group)
    out = x.new_empty((t * x.shape[0],) + x.shape[1:])
    dist.all_gather_single(out, x.contiguous(), group=group)  # blocks stacked on dim 0
    return out.view(t, *x.shape).movedim(0, 1).reshape(x.shape[0], t * x.shape[1], *x.shape[2:])


def _scatter_positions(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, C) on each rank -> this rank's block of T/t positions, summed over ranks."""
    t = dist.get_world_size(group)
    B, T = x.shape[:2]
    blocks = x.reshape(B, t, T // t, *x.shape[2:]).movedim(1, 0).reshape(t * B, T // t, *x.shape[2:])
    out = x.new_empty((B, T // t) + x.shape[2:])
    dist.reduce_scatter_single(out, blocks.contiguous(), group=group)  # block r -> rank r
    return out


class _GatherPositions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_positions(x, group)

    @staticmethod
    def backward(ctx, grad):
        # every rank used every position: the reduce-scatter sums their gradients and
        # leaves each rank its own positions' (an all-reduce before it summed twice)
        return _scatter_positions(grad.contiguous(), ctx.group), None


class _ScatterPositions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter_positions(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_positions(grad, ctx.group), None


def sequence_parallel_mlp(x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor, group,
                          p: float = 0.0) -> torch.Tensor:
    """FIND THE BUG (two of them). A residual MLP block under sequence parallelism, without
    biases: `x` is this rank's block of positions, (B, T/t, C); `w_fc` this rank's rows of
    the full c_fc weight, (H/t, C); `w_proj` this rank's columns of the full c_proj weight,
    (C, H/t). It returns this rank's positions of x + dropout_p(c_proj(gelu(c_fc(x_full)))).

    The contract, which the grader checks (2 and 3 ranks, fp32):
    - with p = 0, the output, x.grad, w_fc.grad and w_proj.grad equal this rank's slices
      of one process's block;
    - forward moves one all-gather and one reduce-scatter, each of B*T*C elements, and
      backward the same, nothing else;
    - with p > 0, each element of the MLP branch is dropped or kept and scaled by
      1/(1-p), with masks independent along the whole sequence; two calls draw different
      masks, and a call run again from the same state of the default random stream draws
      the same ones (activation recomputation replays it);
    - the default random stream, seeded alike on every rank, is the same on every rank
      after the call.
    As shipped it broke two of these; both are fixed here."""
    h = _GatherPositions.apply(x, group)                    # (B, T, C), every position
    a = F.gelu(F.linear(h, w_fc), approximate="tanh")       # (B, T, H/t), this rank's hidden units
    y = _ScatterPositions.apply(F.linear(a, w_proj), group)  # partial sums -> own positions, summed
    if p > 0:
        # this rank's positions need a mask of their own: a state forked from the default
        # stream (one number drawn from it, alike on every rank, plus the rank), restored on exit
        seed = int(torch.randint(0, 2**62, (1,)))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + dist.get_rank(group))
            y = F.dropout(y, p, training=True)
    return x + y


# Where the answers are: `python -m exercises.grade 10 --reference` grades these instead of
# the functions above (minidist's implementations, given this exercise's signatures).
# Leave it as it is.
REFERENCE = {
    "vocab_parallel_cross_entropy": "exercises.grader.checks_10:reference_vocab_parallel_cross_entropy",
    "qkv_shard": "exercises.grader.checks_10:reference_qkv_shard",
    "sequence_parallel_mlp": "exercises.grader.checks_10:reference_sequence_parallel_mlp",
}
