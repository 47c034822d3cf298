"""Exercise 03: data parallelism, with gradients all-reduced in buckets while backward runs.

Goal: every rank holds the whole model and runs forward and backward on its own slice of
the batch; the gradients are averaged over ranks, so every rank takes the step one
process would take on the whole batch. Build the fast version, the way torch's
DistributedDataParallel does: gradients go into a few large buckets, and a bucket's
all-reduce starts while backward is still computing the gradients of earlier layers.

Read chapters/03_data_parallel.md, section 4 "Bucketed and overlapped: `minidist.ddp.DDP`"
(buckets, the hooks, the end-of-backward callback) and section 1 "Why averaging gradients
is enough".

Write, replacing each `raise NotImplementedError(...)`:

- make_buckets(module, bucket_cap_mb):  the trainable parameters, grouped into buckets
- BucketedDDP(module, bucket_cap_mb):   used like torch's DDP: `ddp(x, y).backward()`
  leaves in every p.grad the average over ranks (__init__, _grad_ready, _end_of_backward)
- bucket_by_dtype: find the bug (below)

What is graded (2 and 3 ranks; a model with a tied weight, a frozen layer and a buffer):

- make_buckets: trainable parameters, each once, in reverse registration order, a new
  bucket when the next would take it over bucket_cap_mb MiB; cap 0: one each, None: one
- construction copies rank 0's parameters and buffers to every rank
- after each backward p.grad == one process's on the whole batch, and so are SGD steps,
  with several buckets, one bucket, and one per parameter
- overlap: asynchronous all-reduces start from the hooks, before backward's last
  gradient, and nothing waits for them before that gradient
- one all-reduce per bucket per backward, of its flat buffer, in bucket index order
- launch order: bucket index order on every rank, the same all-reduces on every rank,
  even when backward fills the buckets out of order
- find the bug: bucket_by_dtype gives the same buckets on every rank, every run

Rules: move data with dist.broadcast and dist.all_reduce only; no torch DistributedDataParallel,
FSDP or fully_shard, and not minidist.ddp's DDP or make_buckets (see the README, "Exercises and grading").

Find the bug: bucket_by_dtype groups the trainable parameters by dtype (a flat buffer holds
one dtype); a job using it hung, or trained on garbage, on some runs and not others.

Grade your work with `python -m exercises.grade 03` (it starts 2 and 3 processes), ask for
a hint on the first failing check with `python -m exercises.grade 03 --hint` (`--hint K`
for the K-th), and see full marks with `python -m exercises.grade 03 --reference`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401
import torch.nn as nn


def make_buckets(module: nn.Module, bucket_cap_mb: float | None) -> list[list[nn.Parameter]]:
    """The trainable parameters of `module`, grouped into buckets.

    Parameters with requires_grad, each once, in reverse registration order; a new
    bucket when the next parameter would take the current one over `bucket_cap_mb` MiB
    (2**20 bytes). A bucket holds at least one parameter: `bucket_cap_mb=0` means one
    bucket per parameter, `None` one bucket for everything.
    """
    raise NotImplementedError("make_buckets is not written yet")


class BucketedDDP(nn.Module):
    """Wraps `module`; after `loss.backward()` every p.grad holds the average over ranks.
    Construction makes every rank start from rank 0's parameters and buffers; `forward`
    is the wrapped module's. The three methods below are one way to cut the work."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = 25.0):
        super().__init__()
        self.module = module
        raise NotImplementedError("BucketedDDP.__init__ is not written yet")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p: nn.Parameter) -> None:
        """The hook, called once per backward when p.grad is complete."""
        raise NotImplementedError("_grad_ready is not written yet")

    def _end_of_backward(self) -> None:
        """Called once when the whole backward is done, before loss.backward() returns."""
        raise NotImplementedError("_end_of_backward is not written yet")


def bucket_by_dtype(module: nn.Module, bucket_cap_mb: float | None) -> list[list[nn.Parameter]]:
    """FIND THE BUG. Buckets that each hold one dtype: the trainable parameters (each
    once) grouped by dtype, the dtypes in order of first appearance in reverse
    registration order, each group bucketed as make_buckets does. As shipped it gives
    different buckets on different ranks on some runs. Fix it in place."""
    cap = float("inf") if bucket_cap_mb is None else bucket_cap_mb * 2 ** 20
    trainable = {p for p in module.parameters() if p.requires_grad}  # a tied weight once
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in trainable:
        by_dtype.setdefault(p.dtype, []).append(p)
    buckets = []
    for params in by_dtype.values():
        buckets.append([])  # each dtype starts a bucket of its own
        used = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if buckets[-1] and used + nbytes > cap:
                buckets.append([])
                used = 0
            buckets[-1].append(p)
            used += nbytes
    return buckets


# Where minidist implements each; `python -m exercises.grade 03 --reference` grades these
# instead of the stubs above. Leave it as it is. minidist builds its buckets inside DDP,
# so the grader's module holds a small adapter with make_buckets' signature.
REFERENCE = {
    "make_buckets": "exercises.grader.checks_03:reference_make_buckets",
    "BucketedDDP": "minidist.ddp:DDP",
    "bucket_by_dtype": "exercises.grader.checks_03:reference_bucket_by_dtype",
}
