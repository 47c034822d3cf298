"""Exercise 02: build all-reduce from point-to-point messages, as a ring.

Chapter 02 (chapters/02_collectives.md) starts processes, gives them ranks and lets them
send tensors to one another. Every later chapter leans on one collective: all-reduce,
which leaves on every rank the sum of a tensor over all ranks (data parallelism sums
gradients with it). Here you build it from nothing but send and receive.

Implement the three functions below, replacing each `raise NotImplementedError(...)`:

- ring_reduce_scatter(chunks): rank r ends with chunks[r] summed over all ranks
- ring_all_gather(chunks):     rank r's chunks[r] is final; afterwards every rank has all
- all_reduce(tensor):          sum over ranks in place: the first two, one after the other

The ring. N ranks stand in a circle: rank r sends only to its right neighbour (r+1) % N
and receives only from its left neighbour (r-1) % N. Cut the data into N chunks.
Reduce-scatter takes N-1 steps: at each, every rank sends one chunk's partial sum to the
right, receives another chunk's partial sum from the left and adds its own data to it.
A partial sum picks up one more rank's contribution per hop, so after N-1 hops each chunk
has them all, and it ends on the rank that owns it (chunk r on rank r). All-gather takes
N-1 more steps that pass the finished chunks around the circle, now copying, not adding.
Each rank then sends 2(N-1)/N times the tensor's size S, however many ranks there are:
nearly 2S, where sending everything to one rank and back costs that rank (N-1)S each way.

Rules:
- Move data only with torch.distributed.isend, irecv, send and recv. No dist.all_reduce,
  all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, broadcast,
  reduce, all_to_all, ...: the grader makes them raise while your code runs.
  dist.get_rank() and dist.get_world_size() say where you are in the circle.
- Send only to your right neighbour, and send each byte the ring needs, no more: the
  grader counts the bytes each rank sends and to whom.
- Don't deadlock. A blocking dist.send waits until the receiver has posted its receive;
  if every rank sends first, every rank waits forever. Post the receive and the send
  (irecv, isend) before waiting on either. The grader stops a rank that is still busy
  after 20 seconds, and the checks that needed it fail.
- Any number of ranks (the grader runs 2, 3 and 4) and any size, down to one element
  (with more ranks than elements some chunks are empty) and sizes not divisible by N.

Grade your work with

    python -m exercises.grade 02

(it starts 2, 3 and 4 processes on this machine; allow half a minute), and see what full
marks look like with `python -m exercises.grade 02 --reference`, which grades minidist's
own implementations (named in REFERENCE below) instead of yours.

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
        "ring_reduce_scatter: in each of N-1 steps, send one chunk to rank (r+1) % N "
        "while receiving a chunk from rank (r-1) % N into a scratch tensor (torch.empty_like), "
        "then add the scratch into your own copy of that chunk. Post dist.irecv and "
        "dist.isend before waiting on either. Choose the chunk index of each step from r "
        "and the step number so that the last chunk you add into is chunks[r]: try N=3 "
        "on paper first")


def ring_all_gather(chunks: list[torch.Tensor]) -> None:
    """All-gather around the ring, in place.

    `chunks` as for ring_reduce_scatter; rank r's chunks[r] is final, the others hold
    anything. Afterwards every rank's chunks[i] equals rank i's chunks[i], for every i.
    """
    raise NotImplementedError(
        "ring_all_gather: N-1 steps again; at each, send to the right the chunk you "
        "completed most recently (your own, chunks[r], at the first step) and receive "
        "the next one from the left straight into its place in chunks: nothing to add")


@torch.no_grad()
def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks, in place, and return it (as minidist.comm.all_reduce).

    Any shape, any floating dtype (the grader uses float32 and bfloat16), any number of
    elements. Work on the flattened tensor cut into N nearly equal chunks by
    torch.tensor_split (sizes differ by at most one), with your two functions above.
    On one rank there is nothing to do.
    """
    raise NotImplementedError(
        "all_reduce: tensor.view(-1) and the pieces torch.tensor_split cuts from it are "
        "views that share tensor's memory: whatever your two ring functions write into "
        "them lands in tensor itself")


# Where minidist implements each function; `python -m exercises.grade 02 --reference`
# grades these instead of the stubs above. Leave it as it is. minidist's two ring halves
# take an extra argument (a name for its byte counters and error messages), so the
# grader's module holds one-line adapters with the signatures above.
REFERENCE = {
    "ring_reduce_scatter": "exercises.checks_02:reference_ring_reduce_scatter",
    "ring_all_gather": "exercises.checks_02:reference_ring_all_gather",
    "all_reduce": "minidist.comm:all_reduce",
}
