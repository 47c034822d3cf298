"""ZeRO stages 1 and 2: optimizer state and gradients sharded across ranks. Chapter 06
(chapters/06_zero.md). Exercised by:

    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --zero-stage 2
    pytest tests/test_zero.py

Plain data parallelism keeps N full copies of everything: parameters, gradients and the
optimizer state (AdamW: two moments, 8 bytes per fp32 parameter). ZeRO (Rajbhandari et
al., 2020) notices that an elementwise optimizer updates each element independently, so
rank r only needs the state, and the averaged gradient, of 1/N of the elements:

- stage 1: each rank keeps the optimizer state of its shard only, steps its shard, and
  the updated shards are all-gathered so every rank has the full parameters again;
- stage 2: also the gradients: while backward runs, each bucket of gradients is
  reduce-scattered (averaged, and only this rank's shard kept) and the full-size
  gradients are freed at once.

Communication stays that of data parallelism: a reduce-scatter plus an all-gather move the
same bytes as one all-reduce (which is exactly a reduce-scatter followed by an all-gather).

Sharding here is by flat, padded element ranges, as DeepSpeed does: the parameters of a
bucket live in one flat buffer whose length is padded to a multiple of N, and rank r owns
elements [r*S, (r+1)*S) of it (S = padded length / N). Every rank gets exactly the same
number of elements, whatever the parameter shapes; a parameter may straddle two ranks,
which an elementwise optimizer does not mind. (torch's ZeroRedundancyOptimizer instead
assigns whole parameters to ranks: no padding and no split tensors, but the balance is only
as good as the parameter sizes allow.) Within a bucket, parameters are ordered by param
group, so a rank's shard meets each group in one contiguous range: that range is the
tensor the rank's inner optimizer sees, with the group's hyperparameters.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from minidist import comm
from minidist.zero.layout import _Unit


class ShardedOptimizer:
    """ZeRO-1 with the API of torch.distributed.optim.ZeroRedundancyOptimizer, and ZeRO-2.

    ShardedOptimizer(params, optimizer_class, **defaults): as ZeroRedundancyOptimizer,
    gradients are expected to be averaged already (by DDP); step() updates this rank's
    shard with an `optimizer_class` built on the shard only, then all-gathers parameters.

    reduce_gradients=True: the optimizer averages the gradients itself, with a
    reduce-scatter that leaves each rank only its shard, so no DDP is needed (and the
    bytes sent per step are those of one all-reduce). stage=1 reduce-scatters after
    backward, every bucket at once; stage=2 (implies reduce_gradients) reduce-scatters each
    bucket as soon as backward has produced it, asynchronously, and frees the full-size
    gradients at once. Under gradient accumulation, stage 1 accumulates full gradients
    inside no_sync() and reduces once; stage 2 reduces every micro-step into its shard.

    param_groups are the shards' groups (lr and the like are set there, as usual);
    zero_grad() zeroes the gradient shards in place (after a reduction, a
    parameter's .grad is meaningful only within this rank's shard, if it exists at all); clip_grad_norm_() clips by the norm
    of the whole gradient, computed from the shards. `collectives="minidist"` runs the
    ring collectives of minidist.comm instead of torch's (synchronous, and countable with
    minidist.comm.count_bytes). `module`, when given, orders the buckets as its parameters
    are registered (backward produces gradients in roughly the reverse order); otherwise
    the order is that of the param groups.
    """

    def __init__(self, params, optimizer_class, group=None, stage: int = 1,
                 reduce_gradients: bool = False, bucket_cap_mb: float = 25.0,
                 collectives: str = "torch", module=None, **defaults):
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer is ZeRO stage 1 or 2, got stage={stage}")
        if collectives not in ("torch", "minidist"):
            raise ValueError(f"collectives must be 'torch' or 'minidist', got {collectives!r}")
        self.group, self.stage, self.collectives = group, stage, collectives
        self.reduce_gradients = reduce_gradients or stage == 2
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        groups = list(params)
        if not groups:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        group_of, ordered, seen = {}, [], set()
        for i, g in enumerate(groups):
            for p in g["params"]:
                if p.requires_grad and id(p) not in seen:  # frozen: not sharded, not updated
                    seen.add(id(p))
                    group_of[p] = i
                    ordered.append(p)
        if module is not None:  # bucket in the model's order, the order backward follows
            position = {p: i for i, p in enumerate(module.parameters())}
            ordered.sort(key=lambda p: position.get(p, -1))
        self.units = self._make_units(ordered, group_of, bucket_cap_mb)
        if self.stage == 1 and self.reduce_gradients:
            # stage 1 keeps full gradients, in one flat buffer per bucket (p.grad are views),
            # and reduce-scatters that buffer in place: the averaged shard is its own chunk
            for u in self.units:
                u.flat_grad = torch.zeros_like(u.flat)
                u.grad_shard = u.flat_grad[u.lo:u.hi]
                for p, view in zip(u.params, u.views(u.flat_grad)):
                    p.grad = view
        self._unit_of = {p: u for u in self.units for p in u.params}
        shard_groups, self.shard_views = [], []  # (view, its unit, its start in the shard)
        for i, g in enumerate(groups):
            views = []
            for u in self.units:
                if i in u.ranges:
                    a, b = u.ranges[i]
                    v = u.shard[a:b]
                    v.grad = u.grad_shard[a:b]  # stays linked: zero_grad zeroes in place
                    views.append(v)
                    self.shard_views.append((v, u, a))
            if not views:  # no element of this group on this rank: a placeholder
                views = [torch.zeros(0, device=ordered[0].device, dtype=ordered[0].dtype)]
                views[0].grad = torch.zeros_like(views[0])
            shard_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": views})
        self.optim = optimizer_class(shard_groups, **defaults)
        self._pending, self._no_sync, self._queued, self._taken = [], False, False, False
        if self.reduce_gradients:
            for p in ordered:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _make_units(self, ordered: list, group_of: dict, bucket_cap_mb) -> list[_Unit]:
        """Buckets of about bucket_cap_mb, in reverse order of registration: the order in
        which backward produces the gradients."""
        cap = (bucket_cap_mb or float("inf")) * 2**20
        buckets, size = [[]], 0
        for p in reversed(ordered):
            if buckets[-1] and size + p.numel() * p.element_size() > cap:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += p.numel() * p.element_size()
        return [_Unit(b, group_of, self.rank, self.world) for b in buckets]

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    # ---- gradients ------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Stage 1: accumulate full gradients locally, reduce after the last micro-step.
        Stage 2 reduces every micro-step anyway (its full gradients are freed), so this
        is a no-op there."""
        self._no_sync = self.stage == 1
        try:
            yield
        finally:
            self._no_sync = False

    def _on_grad(self, p) -> None:
        if self._no_sync:
            return
        if not self._queued:  # once per backward: finish the reductions when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
        u = self._unit_of[p]
        u.ready += 1
        if self.stage >= 2 and u.ready == len(u.params):
            self._reduce(u)

    def _reduce(self, u: _Unit) -> None:
        if hasattr(u, "flat_grad"):  # stage 1: in place, in the persistent gradient buffer
            for p, view in zip(u.params, u.views(u.flat_grad)):
                if p.grad is None:  # someone set it to None: no gradient is zero
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():  # replaced: copy it back in
                    view.copy_(p.grad)
                p.grad = view
            self._pending.append((u, None, self._reduce_scatter(u.grad_shard, u.flat_grad)))
            return
        flat = u.flat_grads()
        for p in u.params:
            p.grad = None  # the full-size gradient is no longer needed on this rank
        out = torch.empty_like(u.grad_shard)
        work = self._reduce_scatter(out, flat)
        self._pending.append((u, out, work))

    def _end_of_backward(self) -> None:
        for u in self.units:
            if u.ready < len(u.params) or self.stage == 1:
                self._reduce(u)  # stage 1; or parameters that got no gradient: still join
        self.finish_gradient_synchronization()

    def finish_gradient_synchronization(self) -> None:
        """Complete this rank's gradient shards: wait for the reduce-scatters in flight; or,
        under ZeroRedundancyOptimizer's contract (gradients averaged elsewhere), copy this
        rank's part of them in. step() calls it; so does LossScaler.unscale_, which must
        see the gradients the step will use."""
        if not self.reduce_gradients:
            if not self._taken:
                self._take_local_gradients()
                self._taken = True
            return
        for u, out, work in self._pending:
            if work is not None:
                work.wait()
            if out is not None:  # (stage 1 reduced in place)
                u.grad_shard += out  # summed over micro-steps; averaged over ranks
        self._pending.clear()
        for u in self.units:
            u.ready = 0
        self._queued = False

    def _take_local_gradients(self) -> None:
        """ZeroRedundancyOptimizer's contract: full gradients, already averaged."""
        for u in self.units:
            u.grad_shard.copy_(u.flat_grads()[u.lo:u.hi])

    # ---- the step -------------------------------------------------------------------

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.finish_gradient_synchronization()
        self.optim.step()
        works = [self._all_gather(u.flat, u.shard) for u in self.units]  # all in flight
        for w in works:
            if w is not None:
                w.wait()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._taken = False
        for u in self.units:
            u.grad_shard.zero_()
            if hasattr(u, "flat_grad"):  # stage 1: the buffer stays, p.grad stay its views
                u.flat_grad.zero_()
                continue
            for p in u.params:
                p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm of the averaged gradient, as clip_grad_norm_ on the full
        gradients would: the squares of the shards summed over ranks (padding is zero)."""
        self.finish_gradient_synchronization()
        sq = sum(u.grad_shard.double().square().sum() for u in self.units).reshape(1)
        dist.all_reduce(sq, group=self.group)
        norm = sq.sqrt().float()[0]
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for u in self.units:
            u.grad_shard.mul_(scale)
        return norm

    # ---- accounting and collectives -------------------------------------------------

    def memory_bytes(self) -> dict:
        """Tensor bytes this rank holds, by kind (the ZeRO paper's three terms)."""
        nbytes = lambda t: t.numel() * t.element_size()
        state = sum(nbytes(v) for s in self.optim.state.values() for v in s.values()
                    if torch.is_tensor(v))
        grads = sum(nbytes(u.flat_grad) if hasattr(u, "flat_grad") else  # p.grad: views
                    nbytes(u.grad_shard) + sum(nbytes(p.grad) for p in u.params if p.grad is not None)
                    for u in self.units)
        return {"params": sum(nbytes(u.flat) for u in self.units), "grads": grads,
                "optimizer_state": state, "padding_elements": sum(
                    u.flat.numel() - sum(p.numel() for p in u.params) for u in self.units)}

    def _reduce_scatter(self, out, inp):
        if self.collectives == "minidist":
            comm.reduce_scatter(out, inp, op="avg")
            return None
        return dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.AVG, group=self.group, async_op=True)

    def _all_gather(self, out, inp):
        if self.collectives == "minidist":
            comm.all_gather(out, inp.clone())
            return None
        return dist.all_gather_single(out, inp, group=self.group, async_op=True)
