"""ZeRO stage 3: parameters sharded at rest, gathered one unit at a time. Chapter 06
(chapters/06_zero.md). Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --zero-stage 3
    pytest tests/test_zero.py

Stages 1 and 2 (minidist/zero/stage12.py) still keep every parameter on every rank. Stage 3 keeps
only this rank's shard of each unit at rest (a unit: one transformer block; the "root"
unit holds everything outside the blocks: embeddings, final norm, the tied head). A unit's
full parameters exist only while they are used:

    forward:  gather unit i (and start gathering unit i+1: prefetch), run it, free it
    backward: when the gradient reaches block i's output, gather it again (and start
              gathering block i-1), run its backward; once all its parameters have their
              gradients, reduce-scatter them (as stage 2) and free the parameters

The root unit is gathered when the model's forward starts and freed when backward ends
(its embeddings are used first in forward and last in backward, so there is nothing to
win by freeing it in between); in a forward without gradients (evaluation, generation)
everything is freed at once. Communication per step: an all-gather of every unit in
forward, of every block again in backward, and a reduce-scatter of the gradients: 3 Psi
(N-1)/N elements per rank, less the root's second gather, against 2 Psi for stages 0-2.

Freeing keeps the tensors: each parameter's .data is a view into its unit's flat buffer,
and freeing resizes that buffer's storage to zero bytes (gathering resizes it back and
fills it), so the parameters, and the tensors autograd saved for backward, stay the same
objects throughout. The optimizer sees only the shards, which are separate tensors.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from minidist.zero.layout import _Unit
from minidist.zero.stage12 import ShardedOptimizer


class FullyShardedOptimizer(ShardedOptimizer):
    """ZeRO-3 over `module`: FullyShardedOptimizer(module, params, optimizer_class, **kw).

    `params` are the parameters (or param groups) to optimise, as for any optimizer; the
    units are `module.blocks` (one per element) plus a root unit for the rest. The module
    is used as it is: hooks on it gather and free parameters around every forward.
    `prefetch=False` gathers each unit only when it is needed (to measure what prefetch
    gains). The optimizer API is ShardedOptimizer's: step(), zero_grad(), param_groups,
    no_sync() (a no-op: every micro-step reduce-scatters), clip_grad_norm_(),
    memory_bytes()."""

    def __init__(self, module: nn.Module, params, optimizer_class, group=None, prefetch: bool = True,
                 collectives: str = "torch", **defaults):
        self.module, self.prefetch = module, prefetch
        self.blocks: list[_Unit] = []
        self.root: _Unit | None = None
        self._inflight, self._gathered_bytes, self.peak_gathered_bytes = {}, 0, 0
        super().__init__(params, optimizer_class, group=group, stage=2, reduce_gradients=True,
                         collectives=collectives, **defaults)
        self.stage = 3

    def _make_units(self, ordered, group_of, bucket_cap_mb) -> list[_Unit]:
        mods = list(getattr(self.module, "blocks", []))
        wanted = set(ordered)
        per_block = [[p for p in m.parameters() if p in wanted] for m in mods]
        in_blocks = {p for ps in per_block for p in ps}
        rest = [p for p in ordered if p not in in_blocks]
        self.root = _Unit(rest, group_of, self.rank, self.world) if rest else None
        self.blocks = [_Unit(ps, group_of, self.rank, self.world) if ps else None for ps in per_block]
        units = [u for u in [self.root, *self.blocks] if u is not None]
        for u in units:
            u.shard = u.flat[u.lo:u.hi].clone()  # the shard lives on; the full buffer does not
            u.flat.untyped_storage().resize_(0)
            u.gathered = False
        self.module.register_forward_pre_hook(self._before_model)
        self.module.register_forward_hook(self._after_model)
        for i, m in enumerate(mods):
            m.register_forward_pre_hook(lambda mod, args, i=i: self._before_block(i))
            m.register_forward_hook(lambda mod, args, out, i=i: self._after_block(i, out))
        return units

    # ---- gathering and freeing ------------------------------------------------------

    def _gather(self, u: _Unit | None, wait: bool = True) -> None:
        if u is None:
            return
        if not u.gathered:
            u.flat.untyped_storage().resize_(u.flat.numel() * u.flat.element_size())
            self._inflight[u] = self._all_gather(u.flat, u.shard)  # async with torch's
            u.gathered = True
            self._gathered_bytes += u.flat.numel() * u.flat.element_size()
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)
        if wait and u in self._inflight:
            work = self._inflight.pop(u)
            if work is not None:
                work.wait()

    def _free(self, u: _Unit | None) -> None:
        if u is None or not u.gathered:
            return
        work = self._inflight.pop(u, None)
        if work is not None:
            work.wait()  # never free a buffer a collective is still writing into
        u.flat.untyped_storage().resize_(0)
        u.gathered = False
        self._gathered_bytes -= u.flat.numel() * u.flat.element_size()

    def _next(self, i: int, step: int) -> _Unit | None:
        j = i + step
        return self.blocks[j] if self.prefetch and 0 <= j < len(self.blocks) else None

    # ---- hooks ------------------------------------------------------------------------

    def _before_model(self, module, args) -> None:
        self._gather(self.root)
        self._gather(self._next(-1, 1), wait=False)  # block 0, while the embeddings run

    def _after_model(self, module, args, out) -> None:
        if not torch.is_grad_enabled():  # no backward will come: free everything now
            for u in self.units:
                self._free(u)

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

    def _reduce(self, u: _Unit) -> None:
        super()._reduce(u)  # reduce-scatter the gradients, free the full-size ones
        if u is not self.root:
            self._free(u)  # all its gradients are in: backward needs its weights no more

    def _end_of_backward(self) -> None:
        super()._end_of_backward()
        for u in self.units:
            self._free(u)

    @contextlib.contextmanager
    def gathered(self):
        """Every unit gathered, to read, save or copy the full parameters; freed after."""
        was = [u.gathered for u in self.units]
        for u in self.units:
            self._gather(u)
        try:
            yield
        finally:
            for u, keep in zip(self.units, was):
                if not keep:
                    self._free(u)

    # ---- the step and accounting ---------------------------------------------------

    def step(self, closure=None):
        """Update the shards; the next forward gathers the updated values."""
        loss = closure() if closure is not None else None
        self.optim.step()
        for u in self.units:  # a unit still gathered (a forward with no backward) is stale now
            self._free(u)
        return loss

    def memory_bytes(self) -> dict:
        out = super().memory_bytes()
        nbytes = lambda t: t.numel() * t.element_size()
        out["params"] = sum(nbytes(u.shard) for u in self.units) + self._gathered_bytes
        out["peak_gathered"] = self.peak_gathered_bytes
        return out
