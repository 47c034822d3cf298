"""The flat padded shard layout every ZeRO stage uses. Chapter 06 (chapters/06_zero.md),
section "The layout". Exercised by `pytest tests/test_zero.py`.

A unit's parameters (a bucket at stages 1-2, a block at stage 3) live in one flat buffer
padded to a multiple of N; rank r owns elements [r*S, (r+1)*S). A parameter may straddle
two ranks, which an elementwise optimizer does not mind. Within a unit, parameters are
ordered by param group, so a rank's shard meets each group in one contiguous range: the
tensor its inner optimizer sees, with the group's hyperparameters.
"""

from __future__ import annotations

import math

import torch


def trainable_in_order(params, module=None) -> tuple[list[dict], dict, list]:
    """(groups, group_of, ordered) for an optimizer's `params` (tensors or param groups):
    the groups as dicts; each trainable parameter's group index; the trainable parameters,
    each once, in `module`'s registration order when given, else the groups'. Frozen
    parameters are neither sharded nor updated."""
    groups = list(params)
    if not groups:
        raise ValueError("a ZeRO optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    group_of, ordered = {}, []
    for i, g in enumerate(groups):
        for p in g["params"]:
            if p.requires_grad and p not in group_of:
                group_of[p] = i
                ordered.append(p)
    if not ordered:
        raise ValueError("a ZeRO optimizer got no parameter with requires_grad=True")
    if module is not None:
        position = {p: i for i, p in enumerate(module.parameters())}
        ordered.sort(key=lambda p: position.get(p, -1))
    return groups, group_of, ordered


class Unit:
    """Some parameters in one flat buffer, padded to a multiple of N, sharded N ways.
    After construction each parameter's .data is a view into the flat buffer."""

    def __init__(self, params: list, group_of: dict, rank: int, world: int):
        self.params = sorted(params, key=lambda p: group_of[p])
        numel = sum(p.numel() for p in self.params)
        self.chunk = math.ceil(numel / world)
        p0 = self.params[0]
        self.flat = torch.zeros(self.chunk * world, dtype=p0.dtype, device=p0.device)
        self.lo, self.hi = rank * self.chunk, (rank + 1) * self.chunk
        self.ranges = {}  # param group -> (start, end) within this rank's shard
        offset = 0
        for p in self.params:
            n = p.numel()
            self.flat[offset:offset + n].copy_(p.detach().flatten())
            p.data = self.flat[offset:offset + n].view_as(p)
            a, b = max(offset, self.lo), min(offset + n, self.hi)
            if a < b:
                g = group_of[p]
                start, end = self.ranges.get(g, (a - self.lo, b - self.lo))
                self.ranges[g] = (min(start, a - self.lo), max(end, b - self.lo))
            offset += n
        self.shard = self.flat[self.lo:self.hi]  # this rank's parameters, a view
        self.grad_shard = torch.zeros_like(self.shard)  # this rank's averaged gradient
        self.flat_grad = None  # stage 1 only: the full gradients, kept in one flat buffer
        self.ready = 0  # parameters whose gradient is complete in this backward
        self.reduce_dtype = None  # the gradients' dtype on the wire (ZeRO-3's policy: keep_shard); None: theirs

    def keep_shard(self, param_dtype=None, reduce_dtype=None) -> list[torch.Tensor]:
        """ZeRO-3's units (both faces): this rank's shard kept as a tensor of its own, the
        master in the parameters' dtype; the full buffer, which gathers fill, becomes one of
        `param_dtype` (a mixed-precision policy's, None: theirs) and is freed. Gradients go
        on the wire in `reduce_dtype` (None: param_dtype, as torch's). Returns one view per
        parameter into the buffer: what forward and backward compute with."""
        self.shard = self.flat[self.lo:self.hi].clone()
        dtype = param_dtype or self.flat.dtype
        if dtype != self.flat.dtype:  # a buffer of its own: the cast happens as the shards are sent
            self.flat = torch.empty(self.flat.numel(), dtype=dtype, device=self.flat.device)
        self.reduce_dtype = reduce_dtype or dtype
        views = self.views(self.flat)
        self.flat.untyped_storage().resize_(0)
        return views

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view per parameter into a flat tensor laid out like this unit's buffer."""
        out, offset = [], 0
        for p in self.params:
            out.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return out

    def pieces(self, lo: int, hi: int):
        """(param, start, a, b) for each parameter that overlaps the flat elements [lo, hi):
        the overlap [a, b), in flat coordinates, is the parameter's flattened elements
        [start, start + b - a)."""
        offset = 0
        for p in self.params:
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:
                yield p, a - offset, a, b
            offset += p.numel()

    def flat_grads(self) -> torch.Tensor:
        """The parameters' local gradients in one padded flat tensor (zeros where none)."""
        flat = torch.zeros_like(self.flat)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                flat[offset:offset + p.numel()].copy_(p.grad.flatten())
            offset += p.numel()
        return flat


