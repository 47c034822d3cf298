"""Exercise 03: data parallelism, with gradients all-reduced in buckets while backward runs.

Goal. Every rank holds the whole model and runs forward and backward on its own slice of
the batch; the gradients are averaged over ranks so that every rank takes the step one
process would take on the whole batch. Build the fast version, the way torch's
DistributedDataParallel does it: gradients go into a few large buckets, and a bucket's
all-reduce starts while backward is still computing the gradients of earlier layers.
Chapter 03 (chapters/03_data_parallel.md), section 4 "Bucketed and overlapped" explains
buckets, the hooks and the end-of-backward callback; section 2 why averaging is enough.

Implement make_buckets(module, bucket_cap_mb), BucketedDDP(module, bucket_cap_mb) (used
like torch's DDP: `loss = ddp(x, y); loss.backward()` leaves the average over ranks of
every gradient in p.grad), and fix bucket_by_dtype (find the bug, below).

What the grader checks (2 and 3 ranks; a model with a tied embedding/head weight, a
frozen layer and a buffer; a model whose forward uses its layers in another order than
it registers them; SGD with momentum, float32):
- make_buckets: trainable parameters (a tied weight counted once) in reverse
  registration order, a new bucket when the next parameter would take the current one
  over bucket_cap_mb MiB (2**20 bytes); at least one parameter per bucket; cap 0: one
  per parameter, None: one bucket.
- construction copies rank 0's parameters and buffers to every rank.
- after each backward p.grad is the whole batch's gradient (== one process, to rounding),
  with several buckets, one bucket and one per parameter, and so are the SGD steps.
- overlap: at least one asynchronous all-reduce starts before backward's last gradient.
- one all-reduce per bucket per backward, of its flat buffer, launched in bucket index
  order even when backward fills the buckets in another order; and each all-reduce carries
  its bucket's gradients (the grader records every all-reduce below torch.distributed's
  Python, with a copy of what its buffer held when it started: this rank's gradients of
  the bucket's parameters, in any order within the buffer, as they are or already divided
  by the world size).

Rules (enforced in every graded part; a part that breaks one scores 0):
- Move data with dist.broadcast (construction) and dist.all_reduce (buckets) only: no
  other collective, no torch.nn.parallel.DistributedDataParallel (nor FSDP) anywhere in
  what you build, and no other way of moving data (a process group of your own, a
  group's backend object, the rendezvous store).
- One hook per trainable parameter (p.register_post_accumulate_grad_hook); the wait for
  the buckets happens at the end of backward, before loss.backward() returns.
- Every rank issues the same all-reduces in the same order: ranks pair collectives by
  the order they are issued, not by what they hold.

Find the bug. bucket_by_dtype below is how a real framework grouped gradients by dtype
(one flat buffer holds one dtype); a job using it hung, or trained on garbage, on some
runs and not others. Fix it so that it gives the same buckets on every rank, every run:
per dtype in order of first appearance, each dtype's parameters bucketed as make_buckets
does.

Grade your work with `python -m exercises.grade 03` (about 10 s on a quiet 2-core
machine: it starts 2 and 3 processes), ask for a hint on the first failing check with
`python -m exercises.grade 03 --hint` (again for the next one, `--hint K` for the K-th),
and see what full marks look like with `python -m exercises.grade 03 --reference`. A
rank that waits more than 20 seconds for the others (a hang) fails its check.

To experiment, run a function of your own on several processes with
`minidist.launch.launch(fn, 2, *args)`: it returns each rank's return value and re-raises
a rank's exception here, with "[rank r of 2]" in front.
"""

from __future__ import annotations

import torch  # noqa: F401 - for you: torch.zeros, torch.no_grad, torch.autograd
import torch.distributed as dist  # noqa: F401 - for you: broadcast, all_reduce, get_world_size
import torch.nn as nn


def make_buckets(module: nn.Module, bucket_cap_mb: float | None) -> list[list[nn.Parameter]]:
    """The trainable parameters of `module`, grouped into buckets.

    Parameters with requires_grad, each once, in reverse registration order; a new
    bucket when the next parameter would take the current one over `bucket_cap_mb` MiB
    (2**20 bytes). A bucket holds at least one parameter: `bucket_cap_mb=0` means one
    bucket per parameter, `None` one bucket for everything.
    """
    raise NotImplementedError(
        "make_buckets is not written yet (`python -m exercises.grade 03 --hint` gives a hint)")


class BucketedDDP(nn.Module):
    """Wraps `module`; after `loss.backward()` every p.grad holds the average over ranks.
    Construction makes every rank start from rank 0's parameters and buffers; `forward`
    is the wrapped module's. The three methods below are one way to cut the work."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = 25.0):
        super().__init__()
        self.module = module
        raise NotImplementedError(
            "BucketedDDP.__init__ is not written yet (`python -m exercises.grade 03 --hint` gives a hint)")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p: nn.Parameter) -> None:
        """The hook, called once per backward when p.grad is complete."""
        raise NotImplementedError(
            "_grad_ready is not written yet (`python -m exercises.grade 03 --hint` gives a hint)")

    def _end_of_backward(self) -> None:
        """Called once when the whole backward is done, before loss.backward() returns."""
        raise NotImplementedError(
            "_end_of_backward is not written yet (`python -m exercises.grade 03 --hint` gives a hint)")


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
    "make_buckets": "exercises.checks_03:reference_make_buckets",
    "BucketedDDP": "minidist.ddp:DDP",
    "bucket_by_dtype": "exercises.checks_03:reference_bucket_by_dtype",
}
