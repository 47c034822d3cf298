"""ZeRO stages 1 and 2: optimizer state and gradients sharded across ranks. Chapter 06
(chapters/06_zero.md). Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --zero-stage 2
    pytest tests/test_zero.py

Sharding is by flat, padded element ranges (minidist/zero/layout.py): each bucket of
parameters (minidist.ddp.make_buckets, as DDP's) is one flat buffer cut N ways. (torch's
ZeroRedundancyOptimizer assigns whole parameters to ranks instead: no padding, but the
balance is only as good as the parameter sizes allow.) What the stages share is in
minidist/zero/base.py; this file is what stages 1 and 2 add.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from minidist.ddp import make_buckets
from minidist.zero.base import ZeroBase
from minidist.zero.layout import Unit, trainable_in_order


class ShardedOptimizer(ZeroBase):
    """ZeRO-1 with the API of torch.distributed.optim.ZeroRedundancyOptimizer, and ZeRO-2.

    reduce_gradients=False, the default, is ZeroRedundancyOptimizer's contract: the gradients
    arrive averaged already (by DDP); finish_gradient_synchronization() copies this rank's
    part into its shards once per step, step() updates the shards and all-gathers.
    reduce_gradients=True, what training uses: the optimizer reduce-scatters the gradients
    itself, so no DDP is needed. stage=1 reduce-scatters every bucket after backward (and
    accumulates full gradients inside no_sync()); stage=2 (implies reduce_gradients) each
    bucket as soon as backward has produced it, freeing the full-size gradients at once.

    bucket_cap_mb: as DDP's (0 one bucket per parameter, None one for everything).
    clip_grad_norm_() clips by the whole gradient's norm, computed from the shards.
    `collectives="minidist"` runs minidist.comm's ring collectives (synchronous, countable
    with minidist.comm.count_bytes). `module`, when given, orders the buckets as its
    parameters are registered; otherwise the order is that of the param groups.
    """

    def __init__(self, params, optimizer_class, group=None, stage: int = 1,
                 reduce_gradients: bool = False, bucket_cap_mb: float | None = 25.0,
                 collectives: str = "torch", module=None, **defaults):
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer is ZeRO stage 1 or 2, got stage={stage}")
        self.reduce_gradients = reduce_gradients or stage == 2
        # stage 1 reducing itself keeps full gradients in one flat buffer per bucket (the
        # p.grad are views of it) and reduce-scatters that buffer in place after backward
        self.keeps_full_gradients = stage == 1 and self.reduce_gradients
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        groups, group_of, ordered = trainable_in_order(params, module)
        # buckets in the order backward produces the gradients: the reverse of the model's
        units = [Unit(b, group_of, self.rank, self.world)
                 for b in make_buckets(list(reversed(ordered)), bucket_cap_mb)]
        if self.keeps_full_gradients:
            for u in units:
                u.flat_grad = torch.zeros_like(u.flat)
                u.grad_shard = u.flat_grad[u.lo:u.hi]  # the averaged shard: its own chunk
                for p, view in zip(u.params, u.views(u.flat_grad)):
                    p.grad = view
        super().__init__(units, groups, optimizer_class, defaults, stage, group, collectives)
        self._taken = False  # reduce_gradients=False only: this step's gradients copied in
        if self.reduce_gradients:
            for p in ordered:
                p.register_post_accumulate_grad_hook(self._on_grad)

    # ---- gradients ------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Stage 1: accumulate full gradients locally, reduce after the last micro-step.
        A no-op at stage 2, which reduces every micro-step (its full gradients are freed)."""
        self._no_sync = self.stage == 1
        try:
            yield
        finally:
            self._no_sync = False

    def _reduce(self, u: Unit) -> None:
        if not self.keeps_full_gradients:
            return super()._reduce(u)
        # stage 1: in place, in the persistent gradient buffer, the averaged shard its chunk
        for p, view in zip(u.params, u.views(u.flat_grad)):
            if p.grad is None:  # someone set it to None: no gradient is zero
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():  # replaced: copy it back in
                view.copy_(p.grad)
            p.grad = view
        self._pending.append((u, None, self._reduce_scatter(u.grad_shard, u.flat_grad)))

    def finish_gradient_synchronization(self) -> None:
        """Complete this rank's gradient shards: wait for the reduce-scatters in flight, or
        (reduce_gradients=False) copy this rank's part of the averaged gradients in, once per
        step. step() calls it; call it before LossScaler.unscale_."""
        if self.reduce_gradients:
            return super().finish_gradient_synchronization()
        if not self._taken:
            for u in self.units:
                u.grad_shard.copy_(u.flat_grads()[u.lo:u.hi])
            self._taken = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._taken = False
        if not self.keeps_full_gradients:
            return super().zero_grad(set_to_none)
        for u in self.units:  # stage 1: the buffer stays, the p.grad stay its views
            u.flat_grad.zero_()

    # ---- the step -------------------------------------------------------------------

    def step(self, closure=None):
        """Update this rank's shard, then all-gather every bucket (all in flight at once)."""
        loss = closure() if closure is not None else None
        self.finish_gradient_synchronization()
        self.optim.step()
        works = [self._all_gather(u.flat, u.shard) for u in self.units]
        for w in works:
            if w is not None:
                w.wait()
        return loss

    def memory_bytes(self) -> dict:
        """Tensor bytes this rank holds, by kind (the ZeRO paper's three terms)."""
        nbytes = lambda t: t.numel() * t.element_size()
        if self.keeps_full_gradients:  # the p.grad are views of these buffers
            grads = sum(nbytes(u.flat_grad) for u in self.units)
        else:
            grads = sum(nbytes(u.grad_shard) + sum(nbytes(p.grad) for p in u.params
                                                   if p.grad is not None) for u in self.units)
        return {"params": sum(nbytes(u.flat) for u in self.units), "grads": grads,
                "optimizer_state": self.optimizer_state_bytes(), "padding_elements": sum(
                    u.flat.numel() - sum(p.numel() for p in u.params) for u in self.units)}
