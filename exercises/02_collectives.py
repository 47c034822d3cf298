"""Exercise 02: build all-reduce from point-to-point messages, as a ring.

Goal: all-reduce leaves on every rank the sum of a tensor over all ranks (data
parallelism sums gradients with it). Build it from sends and receives alone: N ranks
stand in a circle, rank r sends only to its right neighbour (r+1) % N and receives only
from its left neighbour (r-1) % N. The data is cut into N chunks; after the
reduce-scatter rank r holds chunk r summed over all ranks, after the all-gather every
rank holds every summed chunk, and each rank has sent 2(N-1)/N times the tensor's size.

Read chapters/02_collectives.md, section 4 "The ring, step by step" (and section 2
"Point-to-point: send, receive, and the deadlock").

Write, replacing each `raise NotImplementedError(...)`:

- ring_reduce_scatter(chunks): rank r's chunks[r] ends as the sum over ranks, in place
- ring_all_gather(chunks):     every rank's chunks[i] ends as rank i's chunks[i]
- all_reduce(tensor):          the sum over ranks, in `tensor` itself, made of the two

What is graded (on 2 and 3 ranks; chunks of 1 element, uneven, empty; against torch's
all_reduce and all_gather on the same data):

- ring_reduce_scatter: chunks[r], the same tensor, holds the sum (within 2N roundings)
- ring_all_gather: every chunks[i] equals rank i's, bit for bit
- all_reduce in float32: the sum, in `tensor`, from 1 to 4099 elements and 2-D
- all_reduce in bfloat16: the sum within 2N roundings of bfloat16
- the direction: every send goes to (r+1) % N, every receive comes from (r-1) % N
- the ring: each rank sends 2(N-1)/N * S bytes in an all_reduce of S bytes
- a ring that deadlocks fails its checks after 20 seconds

Rules: only dist.isend, irecv, send and recv move data, and minidist.comm's all_reduce,
all_reduce_pipelined and ring halves are not called (see the README, "Exercises and grading").

Grade your work with `python -m exercises.grade 02` (a few seconds: it starts 2 and 3
processes), ask for a hint with `python -m exercises.grade 02 --hint` (again for the
next, `--hint K` for the K-th), and see full marks with
`python -m exercises.grade 02 --reference`. To experiment, run a function of your own on
several processes with `minidist.launch.launch(fn, 3, *args)` (in a script, under
`if __name__ == "__main__":`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401 - get_rank, get_world_size, isend, irecv, ...


def ring_reduce_scatter(chunks: list[torch.Tensor]) -> None:
    """Reduce-scatter around the ring, in place.

    `chunks` holds N 1-D tensors (N = world size), chunks[i] of the same size and dtype
    on every rank, possibly different sizes for different i, possibly empty. Afterwards
    rank r's chunks[r] holds the sum over all ranks of chunk r. What the other chunks
    hold afterwards is up to you (partial sums, typically): they are scratch space.
    Update chunks[r] in place (add into it, copy into it); don't replace it in the list.
    """
    raise NotImplementedError("ring_reduce_scatter is not written yet")


def ring_all_gather(chunks: list[torch.Tensor]) -> None:
    """All-gather around the ring, in place.

    `chunks` as for ring_reduce_scatter; rank r's chunks[r] is final, the others hold
    anything. Afterwards every rank's chunks[i] equals rank i's chunks[i], for every i.
    Receive into the tensors of the list, in place.
    """
    raise NotImplementedError("ring_all_gather is not written yet")


@torch.no_grad()
def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks, in place, and return it (as minidist.comm.all_reduce).

    Any shape, any floating dtype (the grader uses float32 and bfloat16), any number of
    elements; the chunks are the flattened tensor cut by torch.tensor_split into N
    (sizes differ by at most one). On one rank there is nothing to do.
    """
    raise NotImplementedError("all_reduce is not written yet")


# Where minidist implements each function; `python -m exercises.grade 02 --reference`
# grades these instead of the stubs above. Leave it as it is. (minidist's two ring halves
# take a name as well; the grader's adapters have the signatures above.)
REFERENCE = {
    "ring_reduce_scatter": "exercises.grader.checks_02:reference_ring_reduce_scatter",
    "ring_all_gather": "exercises.grader.checks_02:reference_ring_all_gather",
    "all_reduce": "minidist.comm:all_reduce",
}
