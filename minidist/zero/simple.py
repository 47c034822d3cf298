"""ZeRO stages 1, 2 and 3 in their plain form: a few lines each on torch.distributed, the
steps notebooks/06_zero.ipynb builds. Chapter 06 (chapters/06_zero.md). Exercised by:

    pytest tests/test_simple_forms.py     # each step equal to the classes and to one process

AdamW is elementwise: element i of the update needs element i of the parameter, the
gradient and the optimizer state, nothing else. So the parameters go into one flat
buffer, padded to a multiple of N, and rank r owns the slice [r S, (r+1) S), S = length/N;
each parameter's .data becomes a view into the buffer, so the model reads the buffer
without knowing it. A *unit* is that buffer, its parameters, and this rank's own copy of
its slice (the shard), the only tensor this rank's optimizer sees:

    units = [make_unit(params)]                   # stages 1, 2 (shard_per_block: stage 3)
    opt = torch.optim.AdamW([u.shard for u in units])
    loss.backward(); zero1_step(units[0], opt)    # or zero2_step, or zero3_step(units, opt)

The optimised classes (layout.py, base.py, stage12.py, stage3.py) do the same arithmetic
in buckets, during backward, with param groups, accumulation, clipping and checkpoints.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

__all__ = ["make_unit", "flat_grad", "zero1_step", "zero2_step", "gather", "free",
           "shard_per_block", "zero3_step"]


@torch.no_grad()
def make_unit(params: list, group=None) -> SimpleNamespace:
    """The parameters moved into one flat buffer padded to a multiple of N (their .data:
    views into it), and this rank's slice of it as a tensor of its own: the shard."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    numel = sum(p.numel() for p in params)
    flat = torch.zeros(-(-numel // n) * n, dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        flat[offset:offset + p.numel()] = p.detach().flatten()
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return SimpleNamespace(params=params, flat=flat, shard=flat.chunk(n)[r].clone(), group=group)


def flat_grad(unit) -> torch.Tensor:
    """This rank's local gradients laid out like the unit's buffer (zeros where none)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in unit.params]
    out = torch.zeros_like(unit.flat)
    out[:sum(g.numel() for g in grads)] = torch.cat([g.flatten() for g in grads])
    return out


@torch.no_grad()
def zero1_step(unit, opt) -> None:
    """ZeRO-1: average the whole gradient, keep this rank's slice, step the optimizer on
    the slice only (1/N of the state), all-gather the updated slices."""
    grad = flat_grad(unit)
    dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=unit.group)    # every rank: the average
    n, r = dist.get_world_size(unit.group), dist.get_rank(unit.group)
    unit.shard.grad = grad.chunk(n)[r]                                # ...it keeps 1/N
    opt.step()                                                        # on this slice only
    dist.all_gather_single(unit.flat, unit.shard, group=unit.group)  # every slice, everywhere


@torch.no_grad()
def zero2_step(unit, opt) -> None:
    """ZeRO-2: the all-reduce becomes a reduce-scatter (its first half): only this rank's
    slice of the average arrives, so only a shard of the averaged gradient is kept."""
    unit.shard.grad = torch.empty_like(unit.shard)
    dist.reduce_scatter_single(unit.shard.grad, flat_grad(unit), op=dist.ReduceOp.AVG, group=unit.group)
    opt.step()
    dist.all_gather_single(unit.flat, unit.shard, group=unit.group)


# ZeRO-3: at rest a rank holds only its shards; a unit's full parameters exist while it
# runs. Freeing shrinks the buffer's storage to zero bytes and gathering grows it back and
# fills it, so the parameters, and the tensors autograd saved for backward, stay the same
# objects.

def gather(unit) -> None:
    unit.flat.untyped_storage().resize_(unit.flat.numel() * unit.flat.element_size())
    dist.all_gather_single(unit.flat, unit.shard, group=unit.group)


def free(unit) -> None:
    unit.flat.untyped_storage().resize_(0)


def shard_per_block(model, group=None) -> list:
    """One unit per transformer block and a root unit for the rest (embeddings, final norm,
    tied head), all freed; hooks gather the root when the model's forward starts, each
    block before its forward (freed after it), and each block again when backward
    reaches its output. Frozen parameters stay whole, untouched."""
    trainable = lambda ps: [p for p in ps if p.requires_grad]
    blocks = [trainable(b.parameters()) for b in model.blocks]
    in_blocks = {p for ps in blocks for p in ps}
    units = [make_unit([p for p in trainable(model.parameters()) if p not in in_blocks], group)]
    units += [make_unit(ps, group) for ps in blocks]
    for u in units:
        free(u)
    model.register_forward_pre_hook(lambda m, args: gather(units[0]))
    for block, u in zip(model.blocks, units[1:]):
        block.register_forward_pre_hook(lambda m, args, u=u: gather(u))

        def after(m, args, out, u=u):
            free(u)
            if out.requires_grad:
                out.register_hook(lambda grad: gather(u))  # backward needs the weights again
        block.register_forward_hook(after)
    return units


@torch.no_grad()
def zero3_step(units, opt) -> None:
    """After backward (every unit gathered): reduce-scatter each unit's gradients into its
    shard, free it, step the shards. No all-gather: the next forward gathers."""
    for u in units:
        u.shard.grad = torch.empty_like(u.shard)
        dist.reduce_scatter_single(u.shard.grad, flat_grad(u), op=dist.ReduceOp.AVG, group=u.group)
        free(u)
        for p in u.params:
            p.grad = None
    opt.step()
