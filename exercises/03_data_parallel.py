"""Exercise 03: data parallelism, with gradients all-reduced in buckets while backward runs.

Chapter 03 (chapters/03_data_parallel.md) trains one model on several processes: every
rank holds the whole model, runs forward and backward on its own slice of the batch, and
averages the gradients with the others before the optimizer step, so every rank takes
the same step, the one a single process would take on the whole batch. The simplest
version all-reduces each gradient after backward. Here you build the fast one, the way
torch's DistributedDataParallel does it: gradients go into a few large buckets, and each
bucket's all-reduce starts as soon as backward has filled it, while backward goes on
computing the gradients of earlier layers.

Implement, replacing each `raise NotImplementedError(...)`:

- make_buckets(module, bucket_cap_mb): the trainable parameters, grouped into buckets
- BucketedDDP(module, bucket_cap_mb):  a wrapper that makes `loss.backward()` leave the
                                       average over ranks of every gradient in p.grad

Used like torch's DDP (a plain training loop needs nothing else):

    model = Net()                                   # same architecture on every rank
    ddp = BucketedDDP(model, bucket_cap_mb=25.0)    # rank 0's weights everywhere
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = ddp(x_mine, y_mine)                      # forward: the wrapped module's
    loss.backward()                                 # gradients averaged when it returns
    opt.step(); opt.zero_grad(set_to_none=True)

Rules (the grader checks each):
- Construction copies rank 0's parameters and buffers to every rank (dist.broadcast),
  so all ranks start from the same model whatever their seeds.
- Buckets as make_buckets defines them: trainable parameters (requires_grad; a weight
  tied to two modules is one parameter, counted once) in reverse registration order,
  which is roughly the order backward produces their gradients (the last layer first).
- One hook per parameter, registered with `p.register_post_accumulate_grad_hook(hook)`:
  it runs once per backward when p.grad is complete (for a tied weight, after both uses
  have added their parts). Copy the gradient into its bucket's flat buffer there.
- When a bucket is full (every one of its parameters has reported), start its all-reduce
  asynchronously: `work = dist.all_reduce(buffer, async_op=True)` returns at once and
  the sum proceeds in the background while backward continues. One all-reduce per bucket
  per backward, of the bucket's flat buffer.
- Launch buckets in index order: bucket k only after buckets 0..k-1. Gradients may arrive
  in a slightly different order than the buckets assume, and ranks pair collectives by
  their order: every rank must issue the same all-reduces in the same order.
- Backward ends, then you wait: from the first hook of a backward, queue a callback with
  `torch.autograd.Variable._execution_engine.queue_callback(fn)`; autograd calls `fn`
  when the whole backward is done, before `loss.backward()` returns. There, launch any
  bucket not launched yet, `wait()` on every work, divide by the world size (all-reduce
  sums; we want the average) and put the results in p.grad (copy, or make p.grad a view
  of the buffer). Then reset, ready for the next backward.
- Use torch.distributed (imported as dist): dist.broadcast, dist.all_reduce,
  dist.get_world_size(). The grader counts the all_reduce calls and when they start.

The grader wraps a small model with a tied embedding/head weight, a frozen layer and a
buffer, on 2 and 3 ranks, and compares with one process training on the whole batch
(SGD with momentum, a few steps, float32: equal up to rounding). Every trainable
parameter gets a gradient in each of its backward passes. Grade your work with

    python -m exercises.grade 03

(it starts 2 and 3 processes on this machine; allow half a minute), and see what full
marks look like with `python -m exercises.grade 03 --reference`, which grades minidist's
own implementation (named in REFERENCE below) instead of yours. A rank that waits more
than 20 seconds for the others (a hang) fails its check.

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

    Walk the parameters with requires_grad, each once, in reverse registration order
    (`module.parameters()` yields each once, in registration order). Fill the current
    bucket until the next parameter would take it over `bucket_cap_mb` MiB (2**20 bytes;
    a parameter's bytes are p.numel() * p.element_size()): then that parameter starts a
    new bucket. A bucket always holds at least one parameter, so `bucket_cap_mb=0` means
    one bucket per parameter, and `None` means no limit: one bucket for everything.
    """
    raise NotImplementedError(
        "make_buckets: params = [p for p in module.parameters() if p.requires_grad], "
        "reversed; keep a running byte count of the current bucket and start a new one "
        "when count + p.numel() * p.element_size() > bucket_cap_mb * 2**20 (None: "
        "float('inf')) and the current bucket is not empty")


class BucketedDDP(nn.Module):
    """Wraps `module`; after `loss.backward()` every p.grad holds the average over ranks.

    Suggested state: `self.module`; `self.buckets = make_buckets(module, bucket_cap_mb)`;
    per bucket a flat buffer (torch.zeros of the bucket's total numel, the parameters'
    dtype) and per parameter a view of it (buffer[offset:offset + numel].view_as(p));
    a map from a parameter to (bucket index, position); per bucket the set of positions
    ready in this backward and its work (None until launched); the index of the next
    bucket to launch; whether this backward's callback is queued.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = 25.0):
        super().__init__()
        self.module = module
        raise NotImplementedError(
            "BucketedDDP.__init__: broadcast every parameter and buffer from rank 0 "
            "(dist.broadcast(t.data, src=0) in a torch.no_grad() block), make the buckets, "
            "their flat buffers and views, and register self._grad_ready on each trainable "
            "parameter with p.register_post_accumulate_grad_hook")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p: nn.Parameter) -> None:
        """The hook: p.grad is complete. Queue the end-of-backward callback if this is the
        backward's first hook, copy p.grad into its view, mark it ready, and launch every
        bucket that is now full and next in line."""
        raise NotImplementedError(
            "_grad_ready: queue self._end_of_backward once per backward "
            "(torch.autograd.Variable._execution_engine.queue_callback), copy p.grad into "
            "its bucket's view under torch.no_grad(), then: while the next bucket in index "
            "order has all its parameters ready, work = dist.all_reduce(buffer, "
            "async_op=True) and move on to the bucket after it")

    def _end_of_backward(self) -> None:
        """The callback, after the whole backward: launch what is left, wait for every
        bucket, average, hand the results to p.grad, reset for the next backward."""
        raise NotImplementedError(
            "_end_of_backward: launch the buckets not yet launched (in order), then for "
            "each bucket work.wait(), buffer.div_(dist.get_world_size()) and p.grad = its "
            "view (or p.grad.copy_(view)); clear the ready sets, works and counters")


# Where minidist implements each; `python -m exercises.grade 03 --reference` grades these
# instead of the stubs above. Leave it as it is. minidist builds its buckets inside DDP,
# so the grader's module holds a small adapter with make_buckets' signature.
REFERENCE = {
    "make_buckets": "exercises.checks_03:reference_make_buckets",
    "BucketedDDP": "minidist.ddp:DDP",
}
