"""Tensor parallelism: every layer's matrices split over the ranks of a group, so that each
rank holds and multiplies a slice of the layer, not a slice of the batch; then sequence
parallelism, which splits what is left between the split layers over the sequence.

Chapter 10 (chapters/10_tensor_parallel.md). Exercised by `pytest -q tests/test_tensor_parallel.py`
and `torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --tp 2 --sequence-parallel`.

The pieces, top to bottom: 1. the conjugate pairs f (identity forward, all-reduce
backward) and g (its mirror), and for sequence parallelism all-gather / reduce-scatter over
the sequence; 2. ColumnParallelLinear and RowParallelLinear (column then row costs one
all-reduce forward and one backward) and the replicated parameters sequence parallelism
applies to a rank's positions only; 3. which dropout draws the same mask on every rank.
minidist/tensor_parallel/gpt.py builds the GPT's split from them (`parallelize`).

Sequence parallelism (Korthikanti et al. 2022): between the split layers, the residual
stream, norms and dropout run on T/t positions per rank; g becomes a reduce-scatter over
the sequence and f an all-gather: the same bytes, as a ring all-reduce is the two in turn.

fp32 is what the tests prove; nothing here hard-codes a device or a backend.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ------------------------------------------------------------------ 1. the conjugate pairs
# A group of size 1 communicates nothing: every function below is then the identity.


class _CopyToRegion(torch.autograd.Function):
    """f: the input enters a tensor-parallel region whole on every rank. Each rank's part
    of the region uses it, so its gradient is the sum of every rank's: all-reduce it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # a copy: autograd may hand the same gradient tensor to the residual branch too
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """g: each rank holds a partial sum of the region's output; all-reduce makes the whole.
    The sum's gradient with respect to each term is the gradient itself: identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/t, ...) on each rank -> (B, T, ...): rank r's block is positions r*T/t on."""
    t = dist.get_world_size(group)
    out = x.new_empty((t * x.shape[0],) + x.shape[1:])
    dist.all_gather_single(out, x.contiguous(), group=group)
    # the collective stacks the blocks along dim 0; the sequence is dim 1, so one copy
    # (Megatron lays activations out [T, B, C] to make this free)
    out = out.view(t, *x.shape).movedim(0, 1)
    return out.reshape(x.shape[0], t * x.shape[1], *x.shape[2:])


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> rank r's block of T/t positions, summed."""
    t = dist.get_world_size(group)
    B, T = x.shape[:2]
    blocks = x.reshape(B, t, T // t, *x.shape[2:]).movedim(1, 0).reshape(t * B, T // t, *x.shape[2:])
    out = x.new_empty((B, T // t) + x.shape[2:])
    dist.reduce_scatter_single(out, blocks, group=group)  # block r of dim 0 goes to rank r
    return out


class _GatherSequence(torch.autograd.Function):
    """All-gather over the sequence forward; backward each rank keeps its block of the
    summed gradient (every rank used every position): reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter over the sequence forward (partial sums in, this rank's positions
    out, summed); backward every rank's partial sum needs every position's gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


def _apply(fn, x, group):
    return x if dist.get_world_size(group) == 1 else fn.apply(x, group)


def copy_to_region(x, group):            # f
    return _apply(_CopyToRegion, x, group)


def reduce_from_region(x, group):        # g
    return _apply(_ReduceFromRegion, x, group)


def gather_sequence(x, group):           # f under sequence parallelism
    return _apply(_GatherSequence, x, group)


def reduce_scatter_sequence(x, group):   # g under sequence parallelism
    return _apply(_ReduceScatterSequence, x, group)


# ------------------------------------------------------------------ 2. split linear layers

def shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank's contiguous block of n rows, as torch.tensor_split cuts: sizes differ by one
    at most, the first n % world ranks one larger."""
    size, extra = divmod(n, world)
    start = rank * size + min(rank, extra)
    return start, start + size + (rank < extra)


def shard_of(full: torch.Tensor, spec) -> torch.Tensor:
    """The slice `spec` = (dim, ((start, stop), ...)) of a full tensor: the ranges along dim,
    concatenated (None: the whole tensor, a replicated parameter)."""
    if spec is None:
        return full
    dim, ranges = spec
    return torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim)


def shard_param(full: torch.Tensor, spec) -> nn.Parameter:
    """A Parameter holding the slice `spec` of `full` (a copy), marked with it."""
    p = nn.Parameter(shard_of(full.detach(), spec).clone())
    p.tp_shard = spec  # read by shard_spec: which slice of the full tensor this is
    return p


class ColumnParallelLinear(nn.Module):
    """y[..., mine] = x @ W[mine].T + b[mine]: this rank's rows of W (`rows`: the ranges
    of output features it holds; default its even block). The input is whole on every
    rank, so backward all-reduces its gradient (f); under sequence parallelism it is
    gathered over the sequence first (_GatheredLinear). The output stays split."""

    def __init__(self, full: nn.Linear, group, rows=None, sequence_parallel=False):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        rows = tuple(rows or [shard_range(full.out_features, r, t)])
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = shard_param(full.weight, (0, rows))
        self.bias = None if full.bias is None else shard_param(full.bias, (0, rows))

    def forward(self, x):
        if not self.sequence_parallel:
            return F.linear(copy_to_region(x, self.group), self.weight, self.bias)
        if dist.get_world_size(self.group) == 1:  # nothing to gather, nothing to save
            return F.linear(x, self.weight, self.bias)
        return _GatheredLinear.apply(x, self.weight, self.bias, self.group)


class _GatheredLinear(torch.autograd.Function):
    """linear(all_gather_seq(x)), keeping only this rank's positions x for backward and
    gathering them again there (Megatron's regather): sequence parallelism's memory saving
    kept, for one more all-gather per layer, which a GPU overlaps with the gradient matmul."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_all_gather_seq(x, group), weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        full = _all_gather_seq(x, ctx.group).to(gy.dtype)  # again: what we did not keep
        gx = _reduce_scatter_seq(gy @ weight.to(gy.dtype), ctx.group)
        gy2 = gy.reshape(-1, gy.shape[-1])
        gw = gy2.t() @ full.reshape(-1, full.shape[-1])
        return gx, gw, gy2.sum(0) if ctx.has_bias else None, None


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[..., mine] @ W[:, mine].T, then + b: this rank's columns of
    W. Its input is the column-parallel layer's split output; the partial sums meet in one
    all-reduce (g), or a reduce-scatter over the sequence under sequence parallelism. The
    bias is added once, after the sum (added on every rank before it, it would count t
    times); it is replicated."""

    def __init__(self, full: nn.Linear, group, sequence_parallel=False):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = shard_param(full.weight, (1, (shard_range(full.in_features, r, t),)))
        self.bias = None if full.bias is None else shard_param(full.bias, None)

    def forward(self, x):
        y = F.linear(x, self.weight)
        if not self.sequence_parallel:
            y = reduce_from_region(y, self.group)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_sequence(y, self.group)  # this rank's positions only
        return y if self.bias is None else y + used_on_positions(self.bias, self.group)


def used_on_positions(p: torch.Tensor, group) -> torch.Tensor:
    """A replicated parameter applied, under sequence parallelism, to this rank's positions
    only (a layer norm's gain, a row-parallel bias, the position table): its gradient on
    each rank is a partial sum of the whole. Passing it through f sums the partial
    gradients inside backward, so p.grad is whole when autograd hands it over, and DDP's
    buckets or ZeRO's reduce-scatters need to know nothing about tensor parallelism."""
    return copy_to_region(p, group)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm on this rank's positions, its gain and bias passed through
    used_on_positions (sequence parallelism); or plain, on the whole sequence."""

    def __init__(self, full: nn.LayerNorm, group, sequence_parallel: bool):
        super().__init__(full.normalized_shape, full.eps, bias=full.bias is not None,
                         device=full.weight.device, dtype=full.weight.dtype)
        self.load_state_dict(full.state_dict())
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        if not self.sequence_parallel:
            return super().forward(x)
        w, b = (None if t is None else used_on_positions(t, self.group) for t in (self.weight, self.bias))
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


# ------------------------------------------------------------------ 3. random numbers

@contextlib.contextmanager
def tp_rng(group, device: torch.device | str = "cpu"):
    """Inside: random numbers of this rank's own, for dropout on what only this rank holds
    (its heads' attention weights; its positions under sequence parallelism). Outside,
    the default stream, the same on every rank of the group (seeded alike), so dropout on
    replicated activations draws the same mask everywhere and the replicas stay equal.

    Megatron keeps a second, persistent generator per tp rank; here each region's state is
    forked from the default stream (one number drawn from it, plus the rank), so chapter
    09's recompute, which replays only the default stream, replays these too.
    """
    seed = int(torch.randint(0, 2**62, (1,)))
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed + dist.get_rank(group))
        yield


def dropout(drop: nn.Dropout, x, group, own: bool):
    """drop(x); `own`: x is this rank's alone (not a replica), so draw this rank's mask."""
    if not (drop.training and drop.p > 0 and own):
        return drop(x)
    with tp_rng(group, x.device):
        return drop(x)
