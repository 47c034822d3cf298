"""Where experts meet data parallelism: the ep groups, and the gradient rules.
Chapter 13 (chapters/13_experts.md), section "The gradient rules"; `pytest
tests/test_experts.py` holds them equal to one process (and catches the wrong scaling).

The world's ranks all hold different tokens. They form world/ep groups of ep consecutive
ranks; inside one, rank i holds experts i*E/ep .. (i+1)*E/ep - 1, so each expert has one
replica per ep group: its replica group is the ranks with the same index i in every group.

The rules follow from chapter 04's loss. Every rank scales its summed loss by W / N (W the
world, N the global batch's tokens) because averaging divides by W. A weight every rank
holds (attention, the router, embeddings) gets each rank's own tokens' share, so the
average over the world is the whole batch's gradient, as in chapter 03. An expert's weight
gets, on each replica, the share of every token its ep group sent it (the all-to-all's
backward brings those home), times W / N: the whole gradient is the SUM over its replicas
divided by W, never the average over its replicas (ep times too large: a test at ep 1,
where every rank is a replica of every expert, cannot see the difference).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.ddp import ReplicaSync, unique_params
from minidist.zero import ShardedOptimizer


def expert_groups(ep: int) -> tuple:
    """(this rank's ep group, its replica group): ep consecutive ranks share out the
    experts; the ranks at the same place in every ep group hold the same experts. Every
    rank makes every group, in the same order, as dist.new_group requires."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep < 1 or world % ep:
        raise ValueError(f"--ep {ep} must divide the world size {world}: use an --ep that divides it")
    mine = {}
    for g in range(world // ep):
        members = list(range(g * ep, (g + 1) * ep))
        group = dist.new_group(members)
        if rank in members:
            mine["ep"] = group
    for i in range(ep):
        members = list(range(i, world, ep))
        group = dist.new_group(members)
        if rank in members:
            mine["replicas"] = group
    return mine["ep"], mine["replicas"]


@torch.no_grad()
def sum_then_scale(params, group, coef: float) -> None:
    """Each gradient summed over `group` (one flat all-reduce), times `coef`."""
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    flat.mul_(coef)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g)
        offset += g.numel()


class ExpertSync(ReplicaSync):
    """The gradient-sync interface (minidist/sync.py) of a model whose expert parameters
    are marked `p.expert` (minidist.experts.expert_parallel): after the last backward,
    the shared weights averaged over the world, each expert's summed over `replicas` and
    divided by the world size (the derivation above). `replica_scale`: the divisor of the
    experts' sum, the world's size unless a test plants the wrong one."""

    def __init__(self, model, ep_group, replicas, replica_scale: float | None = None, zeros=()):
        self.module, self.ep_group, self.replicas, self.zeros = model, ep_group, replicas, list(zeros)
        self.world = dist.get_world_size()
        self.replica_scale = self.world if replica_scale is None else replica_scale
        # ZeRO-2's parameters are reduce-scattered by their optimizer during backward (expert_adamw)
        self.reducing = [z for z in self.zeros if z.reduce_gradients]
        theirs = {id(p) for z in self.reducing for u in z.units for p in u.params}
        params = [p for p in unique_params(model) if id(p) not in theirs]
        self.shared = [p for p in params if not getattr(p, "expert", False)]
        self.experts = [p for p in params if getattr(p, "expert", False)]

    def finish_gradient_synchronization(self) -> None:
        """Call once per step, after the last backward (a second call would reduce again)."""
        sum_then_scale(self.shared, None, 1.0 / self.world)
        sum_then_scale(self.experts, self.replicas, 1.0 / self.replica_scale)
        for zero in self.zeros:  # ZeRO-1's shards of the averages (expert_zero)
            zero.finish_gradient_synchronization()

    def scale_grads(self, coef) -> None:
        super().scale_grads(coef)
        for zero in self.zeros:
            zero.scale_grads(coef)

    @torch.no_grad()
    def grad_square_sum(self, weight=None) -> torch.Tensor:
        """The whole model's squared gradient norm: the shared weights' (the same on every
        rank) plus every expert's once (one ep group holds each expert once)."""
        w = (lambda p: 1.0) if weight is None else weight
        zero = torch.zeros((), dtype=torch.float64, device=next(self.module.parameters()).device)
        sq = [sum((w(p) * p.grad.double().square().sum() for p in ps if p.grad is not None), zero)
              for ps in (self.shared, self.experts)]
        for z in self.reducing:  # ZeRO-2's shards: summed over the ranks that hold them
            sq[_holds_experts(z)] = sq[_holds_experts(z)] + z.grad_square_sum(weight)
        mine = sq[1].reshape(1).clone()
        dist.all_reduce(mine, group=self.ep_group)
        return sq[0] + mine[0]


def _holds_experts(zero) -> bool:
    return any(getattr(p, "expert", False) for u in zero.units for p in u.params)



def expert_adamw(groups: list[dict], replicas, group=None, zero_stage: int = 0, bucket_cap_mb: float = 25.0,
                 **adamw) -> list:
    """An MoE model's AdamW, in two: the shared parameters' and the experts' (the same
    two at every ep size and ZeRO stage, so a checkpoint resumes at another). Each part's
    state is sharded over the ranks that hold those parameters: the world (`group`), or
    each expert's replicas. ZeRO-1: ExpertSync averages the gradients, then each takes its
    shard. ZeRO-2: each reduce-scatters its own during backward, averaging over its ranks;
    an expert's average over its replicas is ep times its gradient (the rule above), so
    each expert gradient is divided by ep as backward produces it, before it is reduced."""
    opts, ep = [], dist.get_world_size() // dist.get_world_size(replicas)
    for experts, over in ((False, group), (True, replicas)):
        part = [{**g, "params": [p for p in g["params"] if getattr(p, "expert", False) == experts]} for g in groups]
        part = [g for g in part if g["params"]]
        if part and zero_stage:
            opts.append(ShardedOptimizer(part, torch.optim.AdamW, group=over, stage=zero_stage,
                                         reduce_gradients=zero_stage == 2, bucket_cap_mb=bucket_cap_mb, **adamw))
            for p in (p for g in part for p in g["params"]) if experts and zero_stage == 2 and ep > 1 else ():
                p.register_hook(lambda grad: grad / ep)
        elif part:
            opts.append(torch.optim.AdamW(part, **adamw))
    return opts
