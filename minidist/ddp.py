"""Data parallelism: every rank holds the whole model, sees its own part of the batch,
and averages gradients with the others before the optimizer step.

Chapter 03 (chapters/03_data_parallel.md) builds it up in three steps, all runnable:
- `allreduce_gradients_naive`: one all-reduce per parameter after backward;
- `allreduce_gradients_flat`: one all-reduce of one flat buffer after backward;
- `DDP`: buckets (`make_buckets`, shared with ZeRO) all-reduced asynchronously while
  backward is still running, with `no_sync()` for gradient accumulation (chapter 04).
Exercised by `torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py` (which uses
DDP by default; `--dp naive|flat` for the others) and by tests/test_ddp.py.

All three present the gradient-sync interface (minidist/sync.py: no_sync,
finish_gradient_synchronization, clip_grad_norm_), as minidist.zero's optimizers do.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.sync import GradientSync


def unique_params(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, each once (a tied weight appears once), in registration order."""
    return [p for p in module.parameters() if p.requires_grad]  # parameters() dedups by id


@torch.no_grad()
def broadcast_module(module: nn.Module, src: int = 0, group=None) -> None:
    """Copy rank `src`'s parameters and buffers to every rank (of `group`, where `src` is
    the rank within the group), so all start identical."""
    if dist.get_world_size(group) == 1:
        return
    src = src if group is None else dist.get_global_rank(group, src)
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src, group=group)


@torch.no_grad()
def allreduce_gradients_naive(module: nn.Module, group=None) -> None:
    """Average every gradient across ranks, one all-reduce per parameter.

    Correct but slow: one collective per tensor pays the latency many times over, and
    none of it overlaps the backward pass. Chapter 03 fixes both. A parameter with no
    gradient gets zeros, so every rank issues the same collectives in the same order.
    (`group`: the ranks that hold copies of this module, all by default.)
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    for p in unique_params(module):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
        p.grad.div_(world)


@torch.no_grad()
def allreduce_gradients_flat(module: nn.Module, group=None) -> None:
    """Average every gradient across ranks with one all-reduce of one flat buffer.

    The same arithmetic as the naive version (each element is summed across ranks and
    divided by the world size), but one message instead of one per parameter, so the
    per-message latency is paid once. Backward and communication still do not overlap.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    params = unique_params(module)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat.div_(world)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g)  # a view: no second copy
        offset += n


class ReplicaSync(GradientSync):
    """What the three forms share: every rank holds the whole averaged gradient of
    `self.module`, so its norm needs no communication."""

    @torch.no_grad()
    def grad_square_sum(self, weight=None) -> torch.Tensor:
        params = unique_params(self.module)
        total = torch.zeros((), dtype=torch.float64, device=params[0].device if params else "cpu")
        for p in params:
            if p.grad is not None:
                total += (1.0 if weight is None else weight(p)) * p.grad.double().square().sum()
        return total

    @torch.no_grad()
    def scale_grads(self, coef) -> None:
        for p in unique_params(self.module):
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device) if torch.is_tensor(coef) else coef)


class NaiveDDP(ReplicaSync):
    """allreduce_gradients_naive behind the gradient-sync interface: backward does not
    communicate; finish_gradient_synchronization() all-reduces one parameter at a time."""

    def __init__(self, module: nn.Module, group=None):
        self.module, self.group = module, group
        broadcast_module(module, group=group)  # every rank starts from rank 0's weights, as DDP does

    def finish_gradient_synchronization(self) -> None:
        """Average the gradients; call it once per step (a second call would average again)."""
        allreduce_gradients_naive(self.module, self.group)


class FlatDDP(NaiveDDP):
    """allreduce_gradients_flat behind the gradient-sync interface: one all-reduce of one
    flat buffer in finish_gradient_synchronization()."""

    def finish_gradient_synchronization(self) -> None:
        allreduce_gradients_flat(self.module, self.group)


# ---------------------------------------------------------------------------- bucketed

def make_buckets(params: list, bucket_cap_mb: float | None) -> list[list]:
    """Consecutive runs of `params`, in the order given, of at most `bucket_cap_mb` MiB each
    (a new bucket also starts where the dtype or device changes). A bucket holds at least
    one parameter, so `bucket_cap_mb=0` makes one bucket per parameter, `None` one for all."""
    if bucket_cap_mb is not None and not bucket_cap_mb >= 0:
        raise ValueError(f"bucket_cap_mb must be >= 0 or None, got {bucket_cap_mb}")
    cap = float("inf") if bucket_cap_mb is None else bucket_cap_mb * 2**20
    buckets, size = [[]], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        cur = buckets[-1]
        if cur and (size + nbytes > cap or (p.dtype, p.device) != (cur[0].dtype, cur[0].device)):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


class _Bucket:
    """Consecutive parameters (in the order their gradients arrive) sharing one flat buffer."""

    def __init__(self, params: list[nn.Parameter], names: list[str]):
        self.params, self.names = params, names
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.views, off = [], 0
        for p in params:
            self.views.append(self.buffer[off:off + p.numel()].view_as(p))
            off += p.numel()
        self.ready: set[int] = set()
        self.work = None


class DDP(ReplicaSync, nn.Module):
    """Data parallelism with bucketed gradient all-reduce overlapped with backward.

    - Construction broadcasts rank 0's parameters and buffers, so every rank starts equal.
    - Trainable parameters are grouped into buckets (`make_buckets`) in reverse
      registration order: roughly the order backward produces their gradients.
    - A hook on each parameter (`register_post_accumulate_grad_hook`, which fires once per
      backward after a tied weight's contributions are summed) copies its gradient into
      its bucket. When a bucket is full it starts an asynchronous all-reduce, while
      backward goes on computing earlier layers: communication overlaps compute.
    - Buckets are launched strictly in index order, so every rank issues the same
      collectives in the same order even if gradients arrive in a different order.
    - At the end of backward (an autograd callback) the remaining buckets are launched,
      all are awaited, averaged, and each `p.grad` becomes a view of its bucket. A plain
      `loss.backward(); opt.step()` loop needs nothing more.
    - A trainable parameter that got no gradient is an error naming it, unless
      `find_unused_parameters=True`, which treats its gradient as zero.
    - `no_sync()` skips communication: gradients accumulate locally until the backward
      of the first forward outside it (as in torch, the forward's context decides).
    - `overlap=False` waits until backward ends before communicating anything (the
      benchmark's baseline for how much communication overlap hides).
    - `group`: the ranks that hold replicas (all by default; chapter 10's mesh passes
      its data-parallel group).

    The all-reduce is torch.distributed's asynchronous one: overlap needs a collective that
    runs in the background while Python continues, which minidist.comm's teaching ring
    (synchronous, in Python) is not.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = 25.0,
                 find_unused_parameters: bool = False, overlap: bool = True, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.find_unused_parameters, self.overlap = find_unused_parameters, overlap
        self.world = dist.get_world_size(group)
        broadcast_module(module, group=group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DDP needs at least one parameter with requires_grad=True")
        name_of = {id(p): n for n, p in named}
        self.buckets = [_Bucket(b, [name_of[id(p)] for p in b])
                        for b in make_buckets([p for _, p in reversed(named)], bucket_cap_mb)]
        self._where = {id(p): (b, i) for b, bucket in enumerate(self.buckets)
                       for i, p in enumerate(bucket.params)}
        self._sync, self._sync_backward, self._next, self._callback_queued = True, True, 0, False
        for _, p in named:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        module.register_forward_pre_hook(self._before_forward)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _before_forward(self, module, args) -> None:
        # A hook on the wrapped module, so that calling it through the wrapper or directly
        # (as minidist.train.forward_backward does) is the same. As in torch's DDP, the
        # forward decides: a forward run inside no_sync() makes its backward skip
        # communication, wherever that backward runs.
        if self._callback_queued:  # the last backward was interrupted (an exception)
            self._reset()
        self._sync_backward = self._sync

    @contextmanager
    def no_sync(self):
        """Forward (and backward) passes inside accumulate gradients locally, with no
        communication; the first backward of a forward outside it averages them all."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # -- during backward

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync_backward:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
        b, i = self._where[id(p)]
        bucket = self.buckets[b]
        if p.grad is not bucket.views[i]:
            bucket.views[i].copy_(p.grad)  # no-op when p.grad is already the bucket's view
        bucket.ready.add(i)
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        # launch in bucket order: bucket k only after buckets 0..k-1 have been launched
        while self._next < len(self.buckets) and \
                len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            bucket = self.buckets[self._next]
            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group,
                                          async_op=True)
            self._next += 1

    def finish_gradient_synchronization(self) -> None:
        """Launch what is left, wait for every bucket, average, and point each p.grad at
        its bucket. Runs by itself at the end of backward; calling it again is a no-op."""
        if not self._callback_queued:
            return
        missing = [(bucket, i) for bucket in self.buckets
                   for i in range(len(bucket.params)) if i not in bucket.ready]
        if missing and not self.find_unused_parameters:
            self._reset()
            names = ", ".join(bucket.names[i] for bucket, i in missing[:5])
            raise RuntimeError(f"DDP: parameter(s) {names} received no gradient in this backward. "
                               "Every rank must all-reduce the same buckets: use all parameters "
                               "in the loss, freeze them (requires_grad=False), or pass "
                               "find_unused_parameters=True to treat their gradients as zero.")
        for bucket, i in missing:
            bucket.views[i].zero_()
            bucket.ready.add(i)
        self._launch_ready()
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.buffer.div_(self.world)
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view
        self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None
        self._next, self._callback_queued = 0, False
