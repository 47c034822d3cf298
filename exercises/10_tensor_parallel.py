"""Exercise 10: tensor parallelism, the layer split over the ranks of a group.

Goal. Data parallelism splits the batch; tensor parallelism splits each layer. In the
Megatron split of an MLP the first linear layer is cut by its output features (rows of
its weight: "column-parallel", each rank makes some of the hidden units from the whole
input) and the second by its input features (columns of its weight: "row-parallel", each
rank makes a partial sum of every output from its hidden units). Between the two nothing
moves: GELU acts on each hidden unit alone. Two conjugate autograd functions do all the
communication: f (identity forward, all-reduce backward) where a whole activation enters
the split region, and g (all-reduce forward, identity backward) where the partial sums
leave it. Chapter 10 (chapters/10_tensor_parallel.md) explains why each is what it is.

Implement, with `group` a torch.distributed process group of t ranks (use it: the grader
passes one, and counts what moves on it):
(a) copy_to_region(x, group) (f) and reduce_from_region(x, group) (g), autograd-aware;
(b) ColumnParallelLinear(full, group) and RowParallelLinear(full, group): nn.Modules built
    from a full nn.Linear (the same weights on every rank), holding only this rank's slice
    in `.weight` (and `.bias`, or None when `full` has none) as nn.Parameters: rank r of t
    holds the r-th contiguous block of 1/t of the output features (column) or of the input
    features (row); the grader's sizes divide evenly. ColumnParallelLinear(x) takes the
    whole input and returns this rank's block of the outputs; RowParallelLinear(x) takes
    this rank's block of the input features and returns the whole output on every rank.
    The row-parallel bias is whole on every rank, and counts once in the output;
(c) ParallelMLP(full, group): `full` has .c_fc and .c_proj (nn.Linear) and computes
    c_proj(F.gelu(c_fc(x), approximate="tanh")), as minidist.model.MLP does; yours has
    .c_fc (column-parallel) and .c_proj (row-parallel) and, on every rank, the same
    output, with x.grad the full MLP's and each shard's gradients the matching slice of
    the full MLP's;
(d) find the bug in sequence_parallel_mlp below.

What the grader checks (2 and 3 ranks, a group it makes, float32, inputs and upstream
gradients that differ from rank to rank where the contract allows it; the oracle is the
full layer or MLP computed by the grader in the same process):
- f and g: forward values and the gradients they pass back, including through a residual
  branch that uses the same tensor (autograd may hand the same gradient tensor to both);
  g leaves its input as it was;
- each layer: its parameters are exactly its slice of the full ones (and nothing more),
  its output, and the gradients of its weight, bias and input equal the full layer's slices;
- the MLP: output, x.grad and every shard's gradient equal the full MLP's slices;
- communication and work: f moves nothing forward and one all-reduce of x's size
  backward, g the mirror; the MLP (one column+row pair) one all-reduce forward and one
  backward, each of B*T*C elements, on the group it was given, and nothing else, carrying
  what this rank's slice contributes (the output's share, the input gradient's share); on
  each rank 1/t of the full MLP's matrix-multiply FLOPs (products written as convolutions
  count too), forward and backward;
- (d) as its docstring says.
Tolerances: fp32 results equal the full computation up to the order of the sums
(rtol 1e-5, atol 1e-5 on values of order 1); what moves no sum (f forward, g backward) is
exact.

Rules (enforced in every graded part; a part that breaks one scores 0, naming the rule):
- Write the communication yourself with torch.distributed's collectives on `group`: no
  torch.distributed.tensor (DTensor, distribute_tensor, parallelize_module and its
  Colwise/Rowwise/Sequence styles), no torch.distributed.nn.functional (its autograd-aware
  collectives are what (a) asks you to write), no torch.distributed._functional_collectives.
- Import nothing from minidist (minidist.tensor_parallel and its neighbours are the answer
  to this exercise, and its other modules re-export them), nor the grader (anything under
  exercises.), nor modules outside torch and the standard library's plain tools, nor reach
  anything by a name built at run time (importlib, __import__, sys.modules, getattr). The grader reads this file before it
  runs anything: such a line scores 0 in every check, naming the line.
- The collectives allowed are all-reduce, all-gather and reduce-scatter (any of their
  torch.distributed forms); other data movement (broadcast, all-to-all, send/recv) fails.

Grade your work with `python -m exercises.grade 10` (about 15 s on a quiet 2-core machine:
it starts 2 and 3 processes), ask for a hint on the first failing check with
`python -m exercises.grade 10 --hint` (again for the next one, `--hint K` for the K-th),
and see what full marks look like with `python -m exercises.grade 10 --reference`. A rank
that waits more than 20 seconds for the others (a hang) fails its check.

To experiment, run a function of your own on several processes with
`minidist.launch.launch(fn, 2, *args)`: it returns each rank's return value and re-raises
a rank's exception here, with "[rank r of 2]" in front.
"""

from __future__ import annotations

import torch  # noqa: F401 - for you: torch.autograd.Function, torch.random.fork_rng
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ------------------------------------------------------------------ (a) the f/g pair

def copy_to_region(x: torch.Tensor, group) -> torch.Tensor:
    """f: x unchanged forward; backward, the gradient summed over the ranks of `group`."""
    raise NotImplementedError(
        "copy_to_region (f) is not written yet: what must its backward return, given that "
        "every rank's part of the region used the same x? (`python -m exercises.grade 10 "
        "--hint` gives a hint)")


def reduce_from_region(x: torch.Tensor, group) -> torch.Tensor:
    """g: forward, x summed over the ranks of `group`; backward, the gradient unchanged."""
    raise NotImplementedError(
        "reduce_from_region (g) is not written yet: the mirror of f (`python -m "
        "exercises.grade 10 --hint` gives a hint)")


# ------------------------------------------------------------------ (b) the split layers

class ColumnParallelLinear(nn.Module):
    """This rank's block of the output features of `full`: the whole input in, this
    rank's outputs out."""

    def __init__(self, full: nn.Linear, group):
        super().__init__()
        raise NotImplementedError(
            "ColumnParallelLinear is not written yet: which rows of full.weight are this "
            "rank's, and where does its input enter the split region? (`python -m "
            "exercises.grade 10 --hint`)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("ColumnParallelLinear.forward is not written yet")


class RowParallelLinear(nn.Module):
    """This rank's block of the input features of `full`: this rank's block of the input
    in, the whole output out, on every rank."""

    def __init__(self, full: nn.Linear, group):
        super().__init__()
        raise NotImplementedError(
            "RowParallelLinear is not written yet: which columns of full.weight are this "
            "rank's, where do the partial sums meet, and where does the bias go? (`python "
            "-m exercises.grade 10 --hint`)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("RowParallelLinear.forward is not written yet")


# ------------------------------------------------------------------ (c) the MLP

class ParallelMLP(nn.Module):
    """`full` (.c_fc, .c_proj) split over `group`: .c_fc column-parallel, .c_proj
    row-parallel; forward equals full's on every rank."""

    def __init__(self, full: nn.Module, group):
        super().__init__()
        raise NotImplementedError(
            "ParallelMLP is not written yet: your two layers and GELU between them (`python "
            "-m exercises.grade 10 --hint`)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("ParallelMLP.forward is not written yet")


# ------------------------------------------------------------------ (d) find the bug

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
    The all-gather over the sequence replaces f, the reduce-scatter replaces g: the same
    bytes as tensor parallelism's two all-reduces, and the residual stream, its dropout
    (and a layer norm, left out here) run on T/t positions per rank.

    The contract, which the grader checks (2 and 3 ranks):
    - with p = 0, the output, x.grad, w_fc.grad and w_proj.grad equal this rank's slices
      of the full block's (fp32, as above);
    - forward moves one all-gather and one reduce-scatter, each of B*T*C elements, and
      backward the same, nothing else;
    - with p > 0, dropout drops each element of the output's MLP branch or keeps it scaled
      by 1/(1-p); each rank's positions get a mask of their own (the ranks hold different
      positions: the same mask on every rank is a pattern repeating along the sequence),
      two calls draw different masks, and a call run again from the same state of the
      default random stream draws the same masks (activation recomputation replays it);
    - the default random stream, seeded alike on every rank (replicated activations
      elsewhere draw their dropout from it, and must get the same mask everywhere), is in
      step on every rank after the call.
    As shipped it breaks two of these. Fix them in place."""
    h = _GatherPositions.apply(x, group)                    # (B, T, C), every position
    a = F.gelu(F.linear(h, w_fc), approximate="tanh")       # (B, T, H/t), this rank's hidden units
    y = _ScatterPositions.apply(F.linear(a, w_proj), group)  # partial sums -> own positions, summed
    y = F.dropout(y, p, training=p > 0)
    return x + y


# Where minidist implements each; `python -m exercises.grade 10 --reference` grades these
# instead of the stubs above. Leave it as it is. Each entry is a one-line adapter in the
# grader (exercises/checks_10.py) that calls minidist.tensor_parallel's piece (and
# minidist.tensor_parallel.gpt.ParallelMLP), giving it this exercise's signature.
REFERENCE = {
    "copy_to_region": "exercises.checks_10:reference_copy_to_region",
    "reduce_from_region": "exercises.checks_10:reference_reduce_from_region",
    "ColumnParallelLinear": "exercises.checks_10:reference_column_parallel_linear",
    "RowParallelLinear": "exercises.checks_10:reference_row_parallel_linear",
    "ParallelMLP": "exercises.checks_10:reference_parallel_mlp",
    "sequence_parallel_mlp": "exercises.checks_10:reference_sequence_parallel_mlp",
}
