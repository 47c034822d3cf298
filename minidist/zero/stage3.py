"""ZeRO stage 3: parameters sharded at rest, gathered one unit at a time. Chapter 06
(chapters/06_zero.md). Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --zero-stage 3
    pytest tests/test_zero.py

A unit is one transformer block (cut by bucket_cap_mb when larger); the "root" holds
everything outside the blocks and is gathered for the whole step (its embeddings are used
first in forward and last in backward, so there is nothing to win by freeing it between).
Gathering and freeing are minidist/zero/base.py's ShardSync, shared with fully_shard (the
other face of this ZeRO-3, fsdp.py): freeing resizes a unit's flat buffer's storage to
zero bytes and gathering resizes it back, so the parameters (views into the buffer) and the
tensors autograd saved for backward stay the same objects. This file adds units per block
and the hooks that say when. `param_dtype`, `reduce_dtype`: fully_shard's mixed-precision
policy (train_gpt's --fsdp-param-dtype), cast by the same Unit.keep_shard (layout.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.ddp import make_buckets
from minidist.zero.base import ZeroBase
from minidist.zero.fsdp import MixedPrecisionPolicy
from minidist.zero.layout import Unit, trainable_in_order


class FullyShardedOptimizer(ZeroBase):
    """ZeRO-3 over `module`: FullyShardedOptimizer(module, params, optimizer_class, **kw).

    The blocks are `module.blocks`, the root the rest; hooks on the module gather and free
    parameters around every forward. `prefetch=False` gathers each block only when needed
    (to measure what prefetch gains). `others`: parameters another optimizer updates from
    the shards (Muon's matrices: minidist/compose/zero_muon.py), sharded and gathered here
    in units of their own, their gradients left alone. The API is ShardedOptimizer's.

    `param_dtype`, `reduce_dtype`: as MixedPrecisionPolicy's. The gathered buffers, hence the
    module's parameters in forward and backward, are in param_dtype; the inner optimizer
    steps fp32 master shards; gradients are reduce-scattered in reduce_dtype (default
    param_dtype) and added into fp32 gradient shards."""

    shards_parameters = True

    def __init__(self, module: nn.Module, params, optimizer_class, group=None, prefetch: bool = True,
                 bucket_cap_mb: float | None = 25.0, collectives: str = "torch", others=(),
                 param_dtype=None, reduce_dtype=None, **defaults):
        self.module, self.prefetch = module, prefetch
        self.policy = MixedPrecisionPolicy(param_dtype, reduce_dtype)  # (its checks: a float dtype or None)
        self.reduce_gradients = True  # always: it averages the gradients itself, as stage 2
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        groups, group_of, ordered = trainable_in_order(params)
        others = [p for p in dict.fromkeys(others) if p not in group_of]
        if others and param_dtype not in (None, ordered[0].dtype):
            raise ValueError(f"param_dtype={param_dtype} with `others`: the other optimizer (Muon) would "
                             "average, accumulate and keep momentum for its whole matrices in that dtype, "
                             "outside the fp32 master shards; use one optimizer here, or param_dtype=None")
        make_units = lambda ps, of: [Unit(b, of, self.rank, self.world)
                                     for b in (make_buckets(ps, bucket_cap_mb) if ps else [])]
        mods = list(getattr(module, "blocks", []))
        wanted, theirs = set(ordered), {p: 0 for p in others}
        per_block = [[p for p in m.parameters() if p in wanted] for m in mods]
        their_block = [[p for p in m.parameters() if p in theirs] for m in mods]
        in_blocks = {p for ps in per_block + their_block for p in ps}
        own_root = make_units([p for p in ordered if p not in in_blocks], group_of)
        self.other_units = make_units([p for p in others if p not in in_blocks], theirs)
        self.root = own_root + list(self.other_units)
        self.blocks = []  # a list of units per block: ours, then the other optimizer's
        for ps, qs in zip(per_block, their_block):
            mine, other = make_units(ps, group_of), make_units(qs, theirs)
            self.other_units += other
            self.blocks.append(mine + other)
        self.all_units = self.root + [u for block in self.blocks for u in block]
        for u in self.all_units:  # the shard lives on, as its own tensor; the full buffer does not
            for p, view in zip(u.params, u.keep_shard(param_dtype, reduce_dtype)):
                p.data = view  # the same parameter, now in the compute dtype (a no-op without one)
        units = [u for u in self.all_units if u not in self.other_units]
        super().__init__(units, groups, optimizer_class, defaults, 3, group, collectives)
        # reduce-scatters in the order backward completes the units: the last block first,
        # the root (the embeddings, whose gradient is complete only at the very end) last
        mine = set(units)
        self.reduce_order = ([u for block in reversed(self.blocks) for u in reversed(block) if u in mine]
                             + [u for u in own_root if u in mine])
        self.other_unit_of = {p: u for u in self.other_units for p in u.params}
        for p in self.other_unit_of:
            p.register_post_accumulate_grad_hook(self._on_other_grad)
        for p in ordered:
            p.register_post_accumulate_grad_hook(self._on_grad)
        module.register_forward_pre_hook(self._before_model)
        module.register_forward_hook(self._after_model)
        for i, m in enumerate(mods):
            m.register_forward_pre_hook(lambda mod, args, i=i: self._before_block(i))
            m.register_forward_hook(lambda mod, args, out, i=i: self._after_block(i, out))

    # ---- which units to gather (ShardSync gathers and frees them) --------------------

    def _next(self, i: int, step: int) -> list[Unit]:
        j = i + step
        return self.blocks[j] if self.prefetch and 0 <= j < len(self.blocks) else []

    # ---- hooks ------------------------------------------------------------------------

    def _before_model(self, module, args) -> None:
        self._gather(self.root)
        self._gather(self._next(-1, 1), wait=False)  # block 0, while the embeddings run

    def _after_model(self, module, args, out) -> None:
        if not torch.is_grad_enabled():  # no backward will come: free everything now
            self._free(self.all_units)

    def _before_block(self, i: int) -> None:
        self._gather(self.blocks[i])
        self._gather(self._next(i, 1), wait=False)

    def _after_block(self, i: int, out) -> None:
        self._free(self.blocks[i])
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._before_block_backward(i))

    def _before_block_backward(self, i: int) -> None:
        self._gather(self.blocks[i])
        self._gather(self._next(i, -1), wait=False)

    def _reduce(self, u: Unit) -> None:
        super()._reduce(u)  # reduce-scatter the gradients, free the full-size ones
        if u not in self.root:
            self._free([u])  # all its gradients are in: backward needs its weights no more

    def _on_other_grad(self, p) -> None:
        """The other optimizer's parameters: once a unit's gradients are all in, backward
        needs its weights no more (the gradients are that optimizer's to reduce)."""
        u = self.other_unit_of[p]
        u.ready += 1
        if u.ready == len(u.params) and u not in self.root:
            self._free([u])

    def _end_of_backward(self) -> None:
        super()._end_of_backward()
        self._free(self.all_units)
        for u in self.other_units:
            u.ready = 0

    @contextlib.contextmanager
    def gathered(self):
        """Every unit gathered, to read or copy the full parameters (in param_dtype: the
        fp32 masters are the shards, state_pieces()); freed after."""
        was = set(self._gathered)
        self._gather(self.all_units)
        try:
            yield
        finally:
            self._free([u for u in self.all_units if u not in was])

    # ---- the step, accounting, checkpoint pieces --------------------------------------

    def step(self, closure=None):
        """Update the shards; the next forward gathers the updated values."""
        loss = closure() if closure is not None else None
        self.optim.step()
        self.free_gathered()
        return loss

    def free_gathered(self, units=None) -> None:
        """Free `units` (all by default) where gathered: once their shards have changed
        (this step; ShardedMuon's on the `others`), a unit still gathered is stale."""
        self._free(self.all_units if units is None else units)

    def memory_bytes(self) -> dict:
        """Tensor bytes this rank holds, by kind; params: the shards plus what is gathered."""
        nbytes = lambda t: t.numel() * t.element_size()
        grads = sum(nbytes(u.grad_shard) + sum(nbytes(p.grad) for p in u.params if p.grad is not None)
                    for u in self.units)
        return {"params": sum(nbytes(u.shard) for u in self.all_units) + self._gathered_bytes,
                "grads": grads, "optimizer_state": self.optimizer_state_bytes(),
                "padding_elements": sum(u.flat.numel() - sum(p.numel() for p in u.params)
                                        for u in self.units),
                "peak_gathered": self.peak_gathered_bytes}

    def state_pieces(self) -> tuple[list, list]:
        """As ZeroBase's, and the parameters too, as their shards (a sharded parameter none of
        whose elements is here comes with an empty tensor)."""
        state, _ = super().state_pieces()
        params = [(p, start, holder[lo:hi]) for p, start, holder, lo, hi in state]
        params += [(p, start, u.shard[a - u.lo:b - u.lo])  # the other optimizer's: from the shards
                   for u in self.other_units for p, start, a, b in u.pieces(u.lo, u.hi)]
        here = {p for p, _, _ in params}
        every = {**self._unit_of, **self.other_unit_of}  # (empty, in the masters' dtype)
        return state, params + [(p, 0, u.shard.new_empty(0)) for p, u in every.items() if p not in here]
