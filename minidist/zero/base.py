"""What every ZeRO stage shares, once its units exist. Chapter 06 (chapters/06_zero.md).
Exercised by `pytest tests/test_zero.py tests/test_fsdp.py`.

Each stage builds its units (minidist/zero/layout.py: buckets at stages 1-2, blocks at
stage 3, fully_shard-ed modules in fsdp.py) and hands them to ShardSync: the reduce-scatter
of each unit's gradients (during backward, in one `reduce_order` on every rank, at stages
2-3; when backward ends at stage 1), gathering and freeing a unit's parameters (stage 3)
and the gradient-sync interface (minidist/sync.py). ZeroBase adds what the optimizer faces
have: the inner optimizer on views of this rank's shards and state_pieces() for
minidist.checkpoint. ZeRO-3 has two faces on the one ShardSync: FullyShardedOptimizer
(stage3.py) and fully_shard (fsdp.py), whose caller brings any optimizer.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from minidist import comm
from minidist.sync import GradientSync
from minidist.zero.layout import Unit


def divide_factors(world: int, dtype: torch.dtype) -> tuple[float, float]:
    """(before, after), before * after = world: the gradients are divided by `before`,
    summed over the ranks, and the sum divided by `after`. All after, as a backend's AVG
    does (sum, then divide: the same bits), except in fp16, where a sum of N gradients may
    overflow: then the power of two at or above sqrt(N) before, the rest after."""
    if dtype != torch.float16 or world == 1:
        return 1, world
    before = 2 ** math.ceil(math.log2(world) / 2)
    return before, world / before


class ShardSync(GradientSync):
    """Units' gradients reduce-scattered into their shards, their parameters gathered and
    freed. A stage registers _on_grad on the parameters it reduces itself. no_sync() is a
    no-op at stages 2-3: they keep no full gradient, so every micro-step reduce-scatters
    into the shards."""

    def __init__(self, units: list[Unit], stage: int, group=None, collectives: str = "torch"):
        if collectives not in ("torch", "minidist"):
            raise ValueError(f"collectives must be 'torch' or 'minidist', got {collectives!r}")
        self.units, self.stage, self.group, self.collectives = units, stage, group, collectives
        self.world = dist.get_world_size(group)
        self._unit_of = {p: u for u in units for p in u.params}
        self._pending = []  # (unit, output or None if reduced in place, work or None)
        self._no_sync = False  # inside no_sync() at stage 1: backward reduces nothing
        self._queued = False  # the end-of-backward callback is queued for this backward
        # the one order in which every rank starts the units' reduce-scatters: index order
        # (stages 1-2: the units run in the order backward completes them); stage 3 sets its own
        self.reduce_order, self._started = list(units), 0
        self._gathered, self._inflight = set(), {}  # units gathered; their all-gathers in flight
        self._gathered_bytes, self.peak_gathered_bytes = 0, 0

    # ---- gradients: reduce-scatter each unit, during backward or at its end ------------

    def _queue_end_of_backward(self) -> None:
        if not self._queued:  # once per backward: finish the reductions when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True

    def _on_grad(self, p) -> None:
        if self._no_sync:
            return
        self._queue_end_of_backward()
        self._unit_of[p].ready += 1
        if self.stage < 2:
            return
        # Start every complete unit whose predecessors in reduce_order have all started: a
        # unit that completes early waits for the ones before it, so every rank issues the
        # same collectives in the same order whatever order its backward completes them in
        # (chapter 03: ranks pair collectives by the order they are issued, not by name).
        order = self.reduce_order
        while self._started < len(order) and order[self._started].ready == len(order[self._started].params):
            self._reduce(order[self._started])
            self._started += 1

    def _reduce(self, u: Unit) -> None:
        """Start averaging u's gradients into a new shard-sized tensor, in the unit's
        reduce_dtype (fully_shard's policy; else the gradients'), and free the full-size
        gradients (stages 2 and 3; stage 1 reduces in place instead). The average is a sum
        divided by N here, not the backend's AVG (FSDP2 on gloo once summed without
        dividing, torch #162338): divide_factors says when."""
        flat = u.flat_grads()
        for p in u.params:
            p.grad = None  # the full-size gradient is no longer needed on this rank
        flat = flat.to(u.reduce_dtype or flat.dtype)
        before, _ = divide_factors(self.world, flat.dtype)
        if before != 1:
            flat.div_(before)
        out = torch.empty(u.chunk, dtype=flat.dtype, device=flat.device)
        self._pending.append((u, out, self._reduce_scatter(out, flat, op="sum")))

    def _end_of_backward(self) -> None:
        # stage 1: every unit, now; stages 2-3: those not started yet (a unit waiting for
        # an earlier one, or one with parameters that got no gradient: it still joins)
        for u in self.units if self.stage == 1 else self.reduce_order[self._started:]:
            self._reduce(u)
        self._started = len(self.reduce_order)
        self.finish_gradient_synchronization()

    def finish_gradient_synchronization(self) -> None:
        """Wait for the reduce-scatters in flight and add their results into the gradient
        shards. Runs by itself at the end of backward; calling it again is a no-op."""
        for u, out, work in self._pending:
            if work is not None:
                work.wait()
            if out is not None:
                _, after = divide_factors(self.world, out.dtype)
                u.grad_shard += out.div_(after)  # in the shard's dtype (fp32 masters: fp32)
        self._pending.clear()
        for u in self.units:
            u.ready = 0
        self._queued, self._started = False, 0

    def grad_square_sum(self, weight=None) -> torch.Tensor:
        """The shards' squares summed over ranks (padding is zero): the squared norm of the
        whole averaged gradient, the same on every rank."""
        sq = self.local_grad_square_sum(weight).reshape(1)
        dist.all_reduce(sq, group=self.group)
        return sq[0]

    def local_grad_square_sum(self, weight=None) -> torch.Tensor:
        """This rank's part of grad_square_sum: its shards' squares (padding is zero)."""
        device = self.units[0].grad_shard.device if self.units else "cpu"
        total = torch.zeros((), dtype=torch.float64, device=device)
        for u in self.units:
            if weight is None:
                total += u.grad_shard.double().square().sum()
                continue
            for p, _, a, b in u.pieces(u.lo, u.hi):
                total += weight(p) * u.grad_shard[a - u.lo:b - u.lo].double().square().sum()
        return total

    def scale_grads(self, scale: torch.Tensor) -> None:
        for u in self.units:
            u.grad_shard.mul_(scale)

    # ---- stage 3: gathering and freeing parameters -------------------------------------
    # Freeing keeps the tensors: each parameter is a view into its unit's flat buffer, and
    # freeing resizes the buffer's storage to zero bytes (gathering resizes it back), so the
    # parameters, and the tensors autograd saved for backward, stay the same objects.

    def _gather(self, units: list[Unit], wait: bool = True) -> None:
        for u in units:
            if u not in self._gathered:
                u.flat.untyped_storage().resize_(u.flat.numel() * u.flat.element_size())
                send = u.shard.to(u.flat.dtype)  # a compute dtype: cast first, fewer bytes sent
                self._inflight[u] = (self._all_gather(u.flat, send), send)  # async with torch's
                self._gathered.add(u)
                self._gathered_bytes += u.flat.numel() * u.flat.element_size()
                self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)
                self._placed(u, gathered=True)
        for u in units if wait else []:
            self._wait(u)

    def _wait(self, u: Unit) -> None:
        work, _ = self._inflight.pop(u, (None, None))
        if work is not None:
            work.wait()

    def _free(self, units: list[Unit]) -> None:
        for u in units:
            if u not in self._gathered:
                continue
            self._wait(u)  # never free a buffer a collective is still writing into
            u.flat.untyped_storage().resize_(0)
            self._gathered.discard(u)
            self._gathered_bytes -= u.flat.numel() * u.flat.element_size()
            self._placed(u, gathered=False)

    def _placed(self, u: Unit, gathered: bool) -> None:
        """After u is gathered or freed. FullyShardedOptimizer's modules hold the full
        tensors throughout: nothing to do; fully_shard's hold shards at rest and swap."""

    # ---- collectives: torch's (asynchronous) or minidist's ring (synchronous, counted) ---

    def _reduce_scatter(self, out, inp, op: str = "avg"):
        if self.collectives == "minidist":
            comm.reduce_scatter(out, inp, op=op)
            return None
        torch_op = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
        return dist.reduce_scatter_single(out, inp, op=torch_op, group=self.group, async_op=True)

    def _all_gather(self, out, inp):
        if self.collectives == "minidist":
            comm.all_gather(out, inp.clone())
            return None
        return dist.all_gather_single(out, inp, group=self.group, async_op=True)


class ZeroBase(ShardSync):
    """The optimizer faces (ShardedOptimizer, stages 1-2; FullyShardedOptimizer, stage 3):
    ShardSync and the inner optimizer on views of this rank's shards. `shards_parameters`:
    are parameters only shards at rest (stage 3)?"""

    shards_parameters = False  # FullyShardedOptimizer: True

    def __init__(self, units: list[Unit], groups: list[dict], optimizer_class, defaults: dict,
                 stage: int, group=None, collectives: str = "torch"):
        super().__init__(units, stage, group, collectives)
        # the inner optimizer: for param group i, a view of each unit's shard where it meets
        # group i, with the gradient's matching view as .grad (linked for good: zero_grad
        # and the reduce-scatters write into the gradient shards in place)
        shard_groups, self.shard_views = [], []  # (view, its unit, its start in the shard)
        master = units[0].shard  # (stage 3: the fp32 master, whatever param_dtype)
        for i, g in enumerate(groups):
            views = []
            for u in units:
                if i in u.ranges:
                    a, b = u.ranges[i]
                    v = u.shard[a:b]
                    v.grad = u.grad_shard[a:b]
                    views.append(v)
                    self.shard_views.append((v, u, a))
            if not views:  # no element of this group on this rank: a placeholder
                views = [master.new_zeros(0)]
                views[0].grad = torch.zeros_like(views[0])
            shard_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": views})
        self.optim = optimizer_class(shard_groups, **defaults)

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards in place (the inner optimizer's .grad are views of them)
        and drop the full-size gradients."""
        for u in self.units:
            u.grad_shard.zero_()
            for p in u.params:
                p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    def state_pieces(self) -> tuple[list, list]:
        """What this rank holds, for minidist.checkpoint: (state, params). state: (p, start,
        holder, lo, hi): elements [start, start + hi - lo) of flattened p are elements
        [lo, hi) of `holder` (a key of self.state) and of its state's tensors; every element
        is kept by exactly one rank. params: (p, start, tensor) where this rank holds a
        parameter only as a piece (stage 3); empty at stages 1, 2."""
        state = []
        for view, u, a0 in self.shard_views:
            lo = u.lo + a0
            for p, start, a, b in u.pieces(lo, lo + view.numel()):
                state.append((p, start, view, a - lo, b - lo))
        return state, []

    def optimizer_state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for s in self.optim.state.values()
                   for v in s.values() if torch.is_tensor(v))
