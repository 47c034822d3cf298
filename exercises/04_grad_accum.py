"""Exercise 04: gradient accumulation, with every token weighing the same.

Goal: train on a batch larger than fits in memory. Each rank runs forward and backward on
several micro-batches one after another, letting the gradients add up in p.grad, before
one optimizer step. Done right, that step is the one a single process would take on the
whole global batch (all micro-batches of all ranks): the loss is a mean over target
tokens, targets of -1 are masked and do not count, so micro-batches and ranks hold
different numbers of tokens; and under DDP only the last micro-step communicates.

Read chapters/04_grad_accum.md, section 2 "k micro-steps × R ranks = one batch R·k times
larger", section 3 "no_sync: communicate once per step" and section 4 "Normalising the
loss by tokens".

Write, replacing the `raise NotImplementedError(...)`:

- accumulate(model, micro_batches, world_size, ddp): the forward and backward passes of
  one step over this rank's micro-batches; returns the global batch's mean loss

`model` is minidist.model.GPT or a wrapper of it: `model(x, y, reduction="sum")` returns
(logits, the summed loss over the unmasked targets). `ddp` is minidist.ddp.DDP (the
grader's) or None; with None the caller averages the gradients over ranks afterwards.

What is graded (against one process computing `model(x, y)` on the whole global batch;
micro-batches of very unequal token counts; float32, equal up to rounding):

- 1 rank, 3 micro-batches: the gradient equals the whole batch's
- 2 ranks x 2 micro-steps under DDP: the gradient equals the whole batch's
- 2 ranks x 2 micro-steps with ddp=None, averaged afterwards: the same
- the returned loss is the global batch's mean per unmasked target, on every rank
- under DDP the buckets are all-reduced once, in the last micro-step, none before

Rules: communicate only with dist.all_reduce; no torch DistributedDataParallel, and not
minidist.train.forward_backward (see the README, "Exercises and grading").

Grade your work with `python -m exercises.grade 04` (it starts 1 and 2 processes), ask
for a hint on the first failing check with `python -m exercises.grade 04 --hint`
(`--hint K` for the K-th), and see full marks with `python -m exercises.grade 04 --reference`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401


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
    raise NotImplementedError("accumulate is not written yet")


# Where minidist implements it; `python -m exercises.grade 04 --reference` grades it
# instead of the stub above. Leave it as it is.
REFERENCE = {
    "accumulate": "minidist.train:forward_backward",
}
