"""Exercise 02: build all-reduce from point-to-point messages, as a ring.

Goal. All-reduce leaves on every rank the sum of a tensor over all ranks (data
parallelism sums gradients with it). Build it from nothing but send and receive, as the
ring of chapter 02 (chapters/02_collectives.md, section 4 "The ring, step by step"; the
deadlock is section 2): ring_reduce_scatter, then ring_all_gather, then all_reduce made
of the two.

The ring. N ranks stand in a circle: rank r sends only to its right neighbour (r+1) % N
and receives only from its left neighbour (r-1) % N. The data is cut into N chunks; after
the reduce-scatter rank r holds chunk r summed over all ranks, after the all-gather every
rank holds every summed chunk. Each rank sends 2(N-1)/N times the tensor's size S,
however many ranks there are.

What the grader checks (2 and 3 ranks; chunk sizes 1 element, not divisible by N,
uneven, empty chunks; float32 and bfloat16):
- ring_reduce_scatter: rank r's chunks[r], the same tensor object, holds the sum over
  ranks (within 2N roundings of the dtype).
- ring_all_gather: every rank's chunks[i] equals rank i's chunks[i], bit for bit.
- all_reduce: the sum, in `tensor` itself, float32 and bfloat16, any shape.
- the ring: each rank sends 2(N-1)/N * S bytes (counted per destination), in a run whose
  sum is checked too.
- the data travels in the messages: every chunk a rank ends with arrived from its left
  neighbour, bit for bit (the chunk it finishes itself: its own values plus what
  arrived). The grader records every message where every torch.distributed call ends,
  below its Python, with its peer, its bytes and what it carried.

Rules (enforced in every graded part: ring_reduce_scatter, ring_all_gather and
all_reduce alike; a part that breaks one scores 0, the message naming what was seen):
- Move data only with torch.distributed.isend, irecv, send and recv. No dist.all_reduce,
  all_gather, broadcast, reduce_scatter, all_to_all, ... nor their functional versions or
  torch's operators under them.
- The ring's direction: in every part a rank sends only to its right neighbour (r+1) % N
  and receives only from its left neighbour (r-1) % N (no receive from any source).
  Each byte the ring needs and no more.
- No other way of moving data: no process group of your own, no group's backend object
  called directly, no rendezvous store.
- Don't deadlock: a rank still busy after 20 seconds is stopped, and the part fails.
- Any number of ranks and any size, down to one element.

Grade your work with `python -m exercises.grade 02` (about 5 s on a quiet 2-core
machine: it starts 2 and 3 processes), ask for a hint on the first failing check with
`python -m exercises.grade 02 --hint` (again for the next one, `--hint K` for the K-th),
and see what full marks look like with `python -m exercises.grade 02 --reference`.

To experiment, run a function of your own on several processes with
`minidist.launch.launch(fn, 3, *args)`: it returns each rank's return value and re-raises
a rank's exception here, with "[rank r of 3]" in front. (In a script, call it under
`if __name__ == "__main__":`: each new process imports the script again.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401 - for you: get_rank, isend, irecv, ...


def ring_reduce_scatter(chunks: list[torch.Tensor]) -> None:
    """Reduce-scatter around the ring, in place.

    `chunks` holds N 1-D tensors (N = world size), chunks[i] of the same size and dtype
    on every rank, possibly different sizes for different i, possibly empty. Afterwards
    rank r's chunks[r] holds the sum over all ranks of chunk r. What the other chunks
    hold afterwards is up to you (partial sums, typically): they are scratch space.
    Update chunks[r] in place (add into it, copy into it); don't replace it in the list.
    """
    raise NotImplementedError(
        "ring_reduce_scatter is not written yet (`python -m exercises.grade 02 --hint` gives a hint)")


def ring_all_gather(chunks: list[torch.Tensor]) -> None:
    """All-gather around the ring, in place.

    `chunks` as for ring_reduce_scatter; rank r's chunks[r] is final, the others hold
    anything. Afterwards every rank's chunks[i] equals rank i's chunks[i], for every i.
    Receive into the tensors of the list, in place.
    """
    raise NotImplementedError(
        "ring_all_gather is not written yet (`python -m exercises.grade 02 --hint` gives a hint)")


@torch.no_grad()
def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks, in place, and return it (as minidist.comm.all_reduce).

    Any shape, any floating dtype (the grader uses float32 and bfloat16), any number of
    elements; the chunks are the flattened tensor cut by torch.tensor_split into N
    (sizes differ by at most one). On one rank there is nothing to do.
    """
    raise NotImplementedError(
        "all_reduce is not written yet (`python -m exercises.grade 02 --hint` gives a hint)")


# Where minidist implements each function; `python -m exercises.grade 02 --reference`
# grades these instead of the stubs above. Leave it as it is. minidist's two ring halves
# take an extra argument (a name for its byte counters and error messages), so the
# grader's module holds one-line adapters with the signatures above.
REFERENCE = {
    "ring_reduce_scatter": "exercises.checks_02:reference_ring_reduce_scatter",
    "ring_all_gather": "exercises.checks_02:reference_ring_all_gather",
    "all_reduce": "minidist.comm:all_reduce",
}
