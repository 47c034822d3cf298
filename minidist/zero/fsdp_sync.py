"""The one ZeRO-3 behind fully_shard: ShardSync over every fully_shard-ed module under a root.
Chapter 06 (chapters/06_zero.appendix.md, section F, "ZeRO-3 as FSDP2 does it"). Exercised by
`pytest tests/test_fsdp.py`.

What FullyShardedOptimizer does per block, this does per fully_shard-ed module, on the same
ShardSync (base.py): gather a module's unit before its forward (and the next module's,
prefetched), free it after (reshard_after_forward), gather it again when backward reaches
its output, reduce-scatter its gradients as soon as they are all in, in one order on every
rank, and free it. The differences are the optimizer's: it is the caller's, so the averaged
gradient is left in each shard's .grad (a view of the unit's gradient shard, linked anew
whenever the optimizer set it to None), and the module registers shards at rest and the
gathered tensors only while they are gathered. The root (the outermost fully_shard-ed
module) stays gathered from its forward to the end of backward, as FSDP2's and as
FullyShardedOptimizer's root. Parameters outside every fully_shard-ed module (`replicated`,
FSDP's) stay whole; their gradients are averaged by one all-reduce when backward ends.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from minidist.zero.base import ShardSync


class ShardedModules(ShardSync):
    """ShardSync over `states` (fsdp.py's ModuleShards, one per fully_shard call), `root`
    their outermost (None: FSDP's model is not sharded itself and calls root_done)."""

    def __init__(self, states: list, group=None, root=None, replicated=()):
        for s in states:
            if s.engine is not None:
                raise ValueError(f"{type(s.modules[0]).__name__} ran forward on its own before its parent: "
                                 "apply fully_shard to the root too, or run the model from its root")
            if s.group is not group:
                raise ValueError("every fully_shard under one root must use the same process group")
        super().__init__([u for s in states for u in s.grad_units], 3, group)
        self.states, self.root = states, root
        self.all_units = [u for s in states for u in s.units]
        self._state_of = {u: s for s in states for u in s.units}
        self.order = []  # the states in the order forward first ran them: prefetch, reduce order
        self.replicated = [p for p in replicated if p.requires_grad]
        self._replicas_wait = False  # inside no_sync(): the replicated gradients accumulate here
        for s in states:
            s.engine = self
            for u in s.grad_units:
                for p in u.params:
                    p.register_post_accumulate_grad_hook(self._on_grad)
        for p in self.replicated:
            p.register_post_accumulate_grad_hook(lambda p: self._queue_end_of_backward())

    # ---- when to gather and free ------------------------------------------------------

    def _neighbour(self, s, step: int) -> list:
        i = self.order.index(s) + step
        return self.order[i].units if 0 <= i < len(self.order) else []

    def before(self, s) -> None:
        """s's forward starts: gather it, prefetch the next (from the second forward on)."""
        if s not in self.order:
            self.order.append(s)  # backward completes them in the reverse order
            seen = [u for t in reversed(self.order) for u in t.grad_units]
            self.reduce_order = seen + [u for u in self.units if u not in seen]
        self._gather(s.units)
        self._gather(self._neighbour(s, 1), wait=False)

    def after(self, s, out) -> None:
        """s's forward is over: free it (unless the root or told not to), and gather it
        again when backward reaches its output."""
        if s is self.root:
            return self.root_done()
        if s.reshard or not torch.is_grad_enabled():
            self._free(s.units)
        if torch.is_grad_enabled():
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(lambda grad, s=s: self._before_backward(s))

    def root_done(self) -> None:
        if not torch.is_grad_enabled():  # no backward will come: free everything now
            self._free(self.all_units)

    def _before_backward(self, s) -> None:
        self._gather(s.units)
        self._gather(self._neighbour(s, -1), wait=False)

    def _placed(self, u, gathered: bool) -> None:
        self._state_of[u].swap(u, gathered)

    # ---- gradients --------------------------------------------------------------------

    def _reduce(self, u) -> None:
        super()._reduce(u)  # reduce-scatter the gradients, free the full-size ones
        self._free([u])  # all its gradients are in: backward needs its weights no more

    def _end_of_backward(self) -> None:
        super()._end_of_backward()
        self._free(self.all_units)  # the root, frozen units
        if not self._replicas_wait:
            self._average_replicas()

    def _average_replicas(self) -> None:
        """The replicated gradients averaged in one all-reduce of one flat tensor: a sum of
        gradient/N, as the shards' (base.py's ShardSync._reduce says why)."""
        if not self.replicated:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.replicated]
        flat = torch.cat([g.flatten() for g in grads]).div_(self.world)
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for p in self.replicated:
            p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()

    def finish_gradient_synchronization(self) -> None:
        """As ShardSync's, each shard's .grad first made a view of its gradient shard again
        (zero where the optimizer set it to None, copied in where it was replaced)."""
        for u, _, _ in self._pending:
            for shard, a, b in self._state_of[u].shards[u]:
                if a == b:  # no element here: left without a gradient, as the optimizer skips it
                    continue
                view = u.grad_shard[a:b]
                if shard.grad is None:
                    view.zero_()
                elif shard.grad.data_ptr() != view.data_ptr():
                    view.copy_(shard.grad)
                shard.grad = view
        super().finish_gradient_synchronization()

    @contextlib.contextmanager
    def no_sync(self):
        """The replicated gradients accumulate locally until a backward outside it; the
        sharded ones are reduce-scattered every micro-step (their full size is freed)."""
        self._replicas_wait = True
        try:
            yield
        finally:
            self._replicas_wait = False

    def grad_square_sum(self, weight=None) -> torch.Tensor:
        total = super().grad_square_sum(weight)
        for p in self.replicated:  # the same on every rank: counted once
            if p.grad is not None:
                total = total + (1.0 if weight is None else weight(p)) * p.grad.double().square().sum()
        return total

    def scale_grads(self, scale) -> None:
        super().scale_grads(scale)
        for p in self.replicated:
            if p.grad is not None:
                p.grad.mul_(scale)

    # ---- whole parameters -------------------------------------------------------------

    @torch.no_grad()
    def full_tensors(self) -> dict:
        """id(shard) -> the whole parameter, all-gathered from the master shards (their
        dtype, not the compute dtype)."""
        out = {}
        for s in self.states:
            for u in s.units:
                full = torch.empty(u.flat.numel(), dtype=u.shard.dtype, device=u.shard.device)
                dist.all_gather_single(full, u.shard, group=self.group)
                offset = 0
                for (shard, _, _), p in zip(s.shards[u], u.params):
                    out[id(shard)] = full[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()
        return out
