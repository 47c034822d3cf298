"""Exercise 13 solved the way chapter 13 teaches, written apart from minidist's modules
(tests/test_exercises.py grades it: full marks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist import comm


# ------------------------------------------------------------------ (a) dispatch and combine

def _tokens(keep: torch.Tensor) -> torch.Tensor:
    """The token of each kept choice, in the choices' own order (token by token, slot by slot)."""
    n, k = keep.shape
    return torch.arange(n).repeat_interleave(k)[keep.reshape(-1)]


def dispatch(x, experts, keep, n_experts):
    """A stable sort of the kept choices by expert keeps token order within each expert;
    sorting the sorting permutation gives its inverse."""
    chosen = experts.reshape(-1)[keep.reshape(-1)]
    order = torch.sort(chosen, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return x[_tokens(keep)[order]], torch.bincount(chosen, minlength=n_experts), inverse


def combine(ys, inverse, gates, keep):
    """Back in the choices' order, weighted by their gates, summed into their tokens."""
    weighted = ys[inverse] * gates.reshape(-1)[keep.reshape(-1)].unsqueeze(1)
    out = torch.zeros(keep.shape[0], ys.shape[1], dtype=ys.dtype)
    return out.index_add(0, _tokens(keep), weighted)


# ------------------------------------------------------------------ (b) expert parallelism

class _Exchange(torch.autograd.Function):
    """Rows out by `send` splits, rows in by `recv` splits; the gradient goes back the way
    the rows came: the same all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), x.shape[1]))
        return comm.all_to_all(out, x.contiguous(), recv, send, group=group)

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), grad.shape[1]))
        comm.all_to_all(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def expert_parallel_run(layer, rows, counts):
    """Counts first (recv[s][i]: rows rank s sends my i-th expert), then the rows; they
    arrive grouped by sender, are regrouped by expert to run each expert once, put back
    in arrival order, and return by the reverse exchange."""
    group, local = layer.ep_group, list(layer.local)
    n, per = dist.get_world_size(group), len(local)
    recv = torch.empty_like(counts)
    comm.all_to_all(recv, counts, group=group)
    recv = recv.view(n, per)
    send_rows = counts.view(n, per).sum(1).tolist()
    recv_rows = recv.sum(1).tolist()
    arrived = _Exchange.apply(rows, send_rows, recv_rows, group)
    expert_of = torch.arange(per).repeat(n).repeat_interleave(recv.reshape(-1))
    by_expert = torch.sort(expert_of, stable=True).indices
    blocks = arrived[by_expert].split(recv.sum(0).tolist())
    done = torch.cat([layer.experts[str(e)](b) for e, b in zip(local, blocks)])
    back = torch.empty_like(by_expert)
    back[by_expert] = torch.arange(len(by_expert))
    return _Exchange.apply(done[back], recv_rows, send_rows, group)


# ------------------------------------------------------------------ (c) the bug, fixed

def draft_sync_gradients(shared: list, experts: list, replicas) -> None:
    """Every rank's loss was scaled by W / N, so the whole gradient is the sum over the
    ranks that hold a weight, divided by W: for an expert, its replicas' sum over W (the
    draft divided by the replica count, ep times too little)."""
    world = dist.get_world_size()
    for p in shared:
        dist.all_reduce(p.grad)
        p.grad /= world
    for p in experts:
        dist.all_reduce(p.grad, group=replicas)
        p.grad /= world


REFERENCE = {
    "dispatch": "exercises.grader.checks_13:reference_dispatch",
    "combine": "exercises.grader.checks_13:reference_combine",
    "expert_parallel_run": "minidist.experts.parallel:ExpertParallelMoE.run_experts",
    "draft_sync_gradients": "exercises.grader.checks_13:reference_sync_gradients",
}
