"""Exercise 04: gradient accumulation, with every token weighing the same.

Chapter 04 (chapters/04_grad_accum.md) trains on a batch larger than fits in memory:
each rank runs forward and backward on several micro-batches one after another and lets
the gradients add up in p.grad, then takes one optimizer step. Done right, the step is
the one a single process would take on the whole global batch (all micro-batches of all
ranks). Two things make that so, and both are easy to get wrong:

1. Every unmasked token of the global batch weighs the same. The loss is a mean over
   target tokens, and targets of -1 are masked (padding, the end of a document) and do
   not count, so micro-batches, and ranks, hold different numbers of tokens.
2. Under DDP, gradient communication belongs to the last micro-step only: the backward
   of every earlier micro-step all-reduces nothing.

Chapter 04 explains both: section 4 (normalising the loss by tokens) and section 3
(no_sync).

Implement accumulate() below, replacing the `raise NotImplementedError(...)`.

Rules:
- The model is minidist.model.GPT (or a wrapper of it): `model(x, y, reduction="sum")`
  returns (logits, summed loss over the unmasked targets of the micro-batch).
- `ddp` is minidist.ddp.DDP (the grader's, not exercise 03's) or None. With None, the
  caller averages the gradients over ranks afterwards (for instance with
  minidist.ddp.allreduce_gradients_flat): prepare them exactly as for DDP.
- Communicate only with dist.all_reduce, and never gradients yourself: they are the
  DDP's (or the caller's) business. No torch.nn.parallel.DistributedDataParallel, and no
  other way of moving data (a process group of your own, a group's backend object, the
  rendezvous store). The grader records every all-reduce below torch.distributed's
  Python, with what it carried and which micro-step it fell in: a check that sees
  another collective, or torch's DDP, scores 0, and the global token count and loss must
  be among the sums of what your all-reduces carried (what every rank put in, added up).

The grader checks, against one process computing the loss of the whole global batch in
one go (`model(x, y)`, the mean over its unmasked targets): 1 rank with 3 micro-batches,
2 ranks with 2 micro-steps each, under DDP and without; micro-batches and ranks with
very different numbers of unmasked targets; float32, equal up to rounding. Grade your
work with

    python -m exercises.grade 04

(about 5 s on a quiet 2-core machine: it starts 1 and 2 processes), and see what full
marks look like with `python -m exercises.grade 04 --reference`, which grades minidist's
own implementation (named in REFERENCE below) instead of yours. Ask for a hint on the first failing check with
`python -m exercises.grade 04 --hint` (again for the next one; `--hint K` for the K-th).
"""

from __future__ import annotations

import contextlib  # noqa: F401 - for you: contextlib.nullcontext()

import torch
import torch.distributed as dist  # noqa: F401 - for you: all_reduce


def accumulate(model, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], world_size: int,
               ddp=None) -> float:
    """Forward and backward over this rank's micro-batches; return the global mean loss.

    `micro_batches` holds (x, y) pairs, inputs and targets of shape (B, T), targets of -1
    masked. Afterwards p.grad holds (on each rank, before averaging over ranks)
    world_size / N times the sum of this rank's per-token loss gradients, N being the
    number of unmasked targets of the global batch, so that the average over ranks is
    the gradient of the global batch's mean loss. `model` is what to call forward on (the
    DDP wrapper when there is one, else the bare GPT); `ddp` the DDP wrapper or None.

    Return the global batch's mean loss per unmasked target, a Python float, the same on
    every rank: the sum of every rank's summed losses, divided by N.
    """
    raise NotImplementedError(
        "accumulate is not written yet (`python -m exercises.grade 04 --hint` gives a hint)")


# Where minidist implements it; `python -m exercises.grade 04 --reference` grades it
# instead of the stub above. Leave it as it is.
REFERENCE = {
    "accumulate": "minidist.train:forward_backward",
}
