"""Exercise 10: the vocabulary and the heads split over ranks, and a sequence-parallel bug.

Goal. A GPT split over t ranks cuts its output layer by the vocabulary (each rank makes the
logits of its own block of words) and its attention by heads. Two pieces of that split are
explained in chapter 10 in words only: a cross entropy that never gathers the logits, and
the re-cut of attention's fused q/k/v weight so that every rank holds whole heads. Write
both, then find the two bugs in a sequence-parallel MLP block that runs and looks right.
Read chapters/10_tensor_parallel.md, section 2 "The GPT, split" (attention by heads, the
loss without the logits) and section 4 "Sequence parallelism" (random numbers included).

Write (each function's docstring is its contract):
(a) vocab_parallel_cross_entropy(logits, targets, start, group): the mean cross entropy
    from this rank's logits [B, T, V_r], vocabulary ids start .. start + V_r - 1;
(b) qkv_shard(weight, bias, n_head, rank, world_size): rank's rows of a fused c_attn;
(c) find the bug in sequence_parallel_mlp (two of them).

What is graded (float32, against one process's computation; (a) and (c) on 2 and 3 ranks):
- (a) the loss on every rank equals F.cross_entropy of the full logits, and logits.grad is
  this rank's columns of its gradient (rtol 1e-5), with uneven blocks and large logits;
- (a) what it moves: forward, only all-reduces, of at most 8 fp32 numbers a token in all
  (of order B*T, not B*T*V: no rank gathers the logits); backward, nothing;
- (b) attention computed on each rank from its shard alone (its heads, then c_proj's
  matching columns), summed over the ranks, equals the full attention (1, 2, 3, 6 ranks);
- (c) the contract in sequence_parallel_mlp's docstring: at p = 0 its output, gradients and
  collectives; at p > 0 its dropout masks and the default random stream.

Rules: no DTensor, distribute_tensor, parallelize_module or minidist.tensor_parallel; only all_reduce, all_gather, reduce_scatter (see the README, "Exercises and grading").

Grade with `python -m exercises.grade 10`; `python -m exercises.grade 10 --hint` gives a
hint on the first failing check (again for the next one), and `python -m exercises.grade
10 --reference` grades minidist's implementations instead of yours.
"""

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
    raise NotImplementedError(
        "vocab_parallel_cross_entropy is not written yet (`python -m exercises.grade 10 --hint`)")


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
    raise NotImplementedError("qkv_shard is not written yet (`python -m exercises.grade 10 --hint`)")


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
        # every rank used every position: the gradient is summed over the ranks ...
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        # ... and each rank keeps the gradient of its own positions
        return _scatter_positions(grad, ctx.group), None


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
    As shipped it breaks two of these. Fix them in place."""
    h = _GatherPositions.apply(x, group)                    # (B, T, C), every position
    a = F.gelu(F.linear(h, w_fc), approximate="tanh")       # (B, T, H/t), this rank's hidden units
    y = _ScatterPositions.apply(F.linear(a, w_proj), group)  # partial sums -> own positions, summed
    y = F.dropout(y, p, training=p > 0)
    return x + y


# Where the answers are: `python -m exercises.grade 10 --reference` grades these instead of
# the functions above (minidist's implementations, given this exercise's signatures).
# Leave it as it is.
REFERENCE = {
    "vocab_parallel_cross_entropy": "exercises.grader.checks_10:reference_vocab_parallel_cross_entropy",
    "qkv_shard": "exercises.grader.checks_10:reference_qkv_shard",
    "sequence_parallel_mlp": "exercises.grader.checks_10:reference_sequence_parallel_mlp",
}
