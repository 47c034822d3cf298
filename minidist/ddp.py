"""Data parallelism: every rank holds the whole model, sees its own part of the batch,
and averages gradients with the others before the optimizer step.

Chapter 03 (chapters/03_data_parallel.md) builds this up from the simplest correct
version, which is what is here so far and what chapter 01's training run uses:
all-reduce every gradient, one parameter at a time, after backward has finished.
Exercised by `torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


def unique_params(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, each once (a tied weight appears once), in registration order."""
    return [p for p in module.parameters() if p.requires_grad]  # parameters() dedups by id


@torch.no_grad()
def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Copy rank `src`'s parameters and buffers to every rank, so all start identical."""
    if dist.get_world_size() == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src)


@torch.no_grad()
def allreduce_gradients_naive(module: nn.Module) -> None:
    """Average every gradient across ranks, one all-reduce per parameter.

    Correct but slow: one collective per tensor pays the latency many times over, and
    none of it overlaps the backward pass. Chapter 03 fixes both. A parameter with no
    gradient gets zeros, so every rank issues the same collectives in the same order.
    """
    world = dist.get_world_size()
    if world == 1:
        return
    for p in unique_params(module):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad.div_(world)


@torch.no_grad()
def allreduce_gradients_flat(module: nn.Module) -> None:
    """Average every gradient across ranks with one all-reduce of one flat buffer.

    The same arithmetic as the naive version (each element is summed across ranks and
    divided by the world size), but one message instead of one per parameter, so the
    per-message latency is paid once. Backward and communication still do not overlap.
    """
    world = dist.get_world_size()
    if world == 1:
        return
    params = unique_params(module)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(world)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g)  # a view: no second copy
        offset += n
