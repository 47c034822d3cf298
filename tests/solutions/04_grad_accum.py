"""Exercise 04 solved the way chapter 04 teaches, written apart from minidist's module
(tests/test_exercises.py grades it: full marks)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


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
    # the unmasked targets of the whole global batch: every rank's count, added up
    count = torch.tensor([float(sum(int((y != -1).sum()) for _, y in micro_batches))])
    dist.all_reduce(count)
    total = torch.zeros(1)
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # DDP communicates in the last micro-step only; before it, gradients add up in p.grad
        with contextlib.nullcontext() if ddp is None or last else ddp.no_sync():
            _, loss_sum = model(x, y, reduction="sum")
            (loss_sum * (world_size / count)).backward()
        total += loss_sum.detach()
    dist.all_reduce(total)  # every rank's summed losses
    return (total / count).item()


# Where minidist implements it; `python -m exercises.grade 04 --reference` grades it
# instead of the stub above. Leave it as it is.
REFERENCE = {
    "accumulate": "minidist.train:forward_backward",
}
