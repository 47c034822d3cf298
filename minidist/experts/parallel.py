"""Expert parallelism: the E experts spread over the ranks of an ep group, each token
sent to the rank of its expert by an all-to-all, and its result brought back by a second
one. Chapter 13 (chapters/13_experts.md); `pytest tests/test_experts.py` holds it equal to
one process's MoE (minidist/experts/moe.py), gradients included.

The ranks of an ep group hold different tokens (they are data-parallel ranks for the rest
of the model) and different experts: rank r of n holds experts r*E/n .. (r+1)*E/n - 1.
`MoE.forward` routes and sorts the kept choices by expert, so the tokens for rank j's
experts are one contiguous block; only `run_experts` changes:

    counts   all-to-all of E counts: how many tokens each rank sends each of my experts
    tokens   all-to-all of the rows, split by those counts (uneven splits are the rule)
    experts  my experts on what arrived, grouped by expert (it arrives grouped by sender)
    back     all-to-all of the results, the reverse splits, to the tokens' own ranks

Backward runs the same two all-to-alls in reverse (`_AllToAll`). The gradient rules for
the experts' weights are in minidist/compose/expert_sync.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist import comm

from .moe import MoE


class _AllToAll(torch.autograd.Function):
    """Rows `send` (block j to rank j) in, the rows received out; the gradient of what was
    received goes back the way it came: the same all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        return comm.all_to_all(out, x.contiguous(), recv, send, group=group)

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        return comm.all_to_all(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group), None, None, None


def local_experts(n_experts: int, ep_group) -> range:
    """The global indices of the experts this rank holds in `ep_group`."""
    n, r = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    if n_experts % n:
        raise ValueError(f"{n_experts} experts do not split over an ep group of {n} ranks: use an "
                         f"expert count divisible by {n} (--n-experts), or --ep dividing it")
    per = n_experts // n
    return range(r * per, (r + 1) * per)


class ExpertParallelMoE(MoE):
    """`moe` with only this rank's experts (the same router, the same weights), its
    experts reached by all-to-all over `ep_group`; `group`: the ranks whose tokens form
    the micro-batch, as in MoE (at least the ep group)."""

    def __init__(self, moe: MoE, ep_group, group):
        nn.Module.__init__(self)  # not MoE's: the experts come from `moe`, not fresh
        self.n_experts, self.top_k, self.capacity_factor = moe.n_experts, moe.top_k, moe.capacity_factor
        self.group, self.ep_group = group, ep_group
        self.local = local_experts(moe.n_experts, ep_group)
        self.router = moe.router
        self.experts = nn.ModuleDict({str(e): moe.experts[str(e)] for e in self.local})
        self.aux_sum, self.stats = None, None

    def run_experts(self, xs: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        n, mine = dist.get_world_size(self.ep_group), len(self.local)
        # counts: recv[s, e] = rows rank s sends to my expert e
        recv = torch.empty_like(per_expert)
        comm.all_to_all(recv, per_expert, group=self.ep_group)
        recv = recv.view(n, mine)
        send_rows, recv_rows = per_expert.view(n, mine).sum(1).tolist(), recv.sum(1).tolist()
        got = _AllToAll.apply(xs, send_rows, recv_rows, self.ep_group)  # grouped by sender
        # group by expert (stable: sender order within an expert), run, and undo the grouping
        which = torch.arange(mine, device=xs.device).repeat(n).repeat_interleave(recv.reshape(-1))
        order = torch.argsort(which, stable=True)
        blocks = got[order].split(recv.sum(0).tolist())
        ys = torch.cat([self.experts[str(e)](b) for e, b in zip(self.local, blocks)])
        ys = ys[torch.argsort(order)]  # the inverse permutation: back in arrival order
        return _AllToAll.apply(ys, recv_rows, send_rows, self.ep_group)


def expert_parallel(model: nn.Module, ep_group, group) -> nn.Module:
    """Every MoE layer of `model` (in place) keeps only this rank's experts of `ep_group`
    and reaches the others by all-to-all; `group`: every rank that holds other tokens (the
    capacity and balance statistics' ranks). Each expert parameter is marked
    `p.expert = True` for the gradient rules (minidist/compose/expert_sync.py)."""
    for name, module in list(model.named_modules()):
        if type(module) is MoE:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr,
                    ExpertParallelMoE(module, ep_group, group))
    mark_experts(model)
    return model


def mark_experts(model: nn.Module) -> list[nn.Parameter]:
    """Mark (and return) the expert parameters: those the gradient rules treat apart."""
    params = [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]
    for p in params:
        p.expert = True
    return params
