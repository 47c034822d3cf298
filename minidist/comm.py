"""Collectives from point-to-point messages: ring all-reduce, reduce-scatter, all-gather
and broadcast, built on nothing but isend/irecv. Chapter 02 (chapters/02_collectives.md).
Exercised by `python -m minidist.bench collectives` and by tests/test_comm.py.

Every collective works in place and means what its torch.distributed namesake means, for
any world size and tensor size. The ring: rank r sends only to r+1 and receives only from
r-1; a reduce-scatter phase of N-1 steps leaves chunk r summed on rank r, an all-gather
phase of N-1 more passes the finished chunks around, so each rank sends (N-1)/N of the
data per phase, whatever N is. `all_reduce_pipelined`: the same bits, in segments, so that
additions hide behind transfers. Half precision is rounded once per hop, as NCCL does.
`all_to_all`: pairwise exchange, block i to rank i (context and expert parallelism).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from minidist.comm_pipelined import pipelined_ring
from minidist.dist import default_timeout_s, group_timeout
from minidist.metrics import Tallies

# ------------------------------------------------------------------ counting, messages

_sent = Tallies()  # count_bytes's


def count_bytes():
    """Count the bytes this rank sends, per collective name, while the block runs:

        with count_bytes() as sent:
            all_reduce(t)
        sent["all_reduce"]  # bytes this rank put on the wire

    Contexts nest: every open one counts.
    """
    return _sent.counting()


def _isend(t: torch.Tensor, dst: int, name: str):
    """Post a send of t to rank dst on behalf of collective `name`. Every send in this
    module goes through here, and this is the one place that counts bytes."""
    _sent.add(name, t.numel() * t.element_size())
    return dist.isend(t, dst)


def wait(work, where: str, timeout: timedelta | None = None, hint: str = "") -> None:
    """Wait for one posted message within `timeout` (the run's: the default group's); a
    failure is an error that says `where` (this rank, the peer, what it was doing)."""
    timeout = group_timeout() if timeout is None else timeout
    try:
        work.wait(timeout)
    except RuntimeError as e:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            # (gloo's own message, chained below, adds only its source file and line)
            raise TimeoutError(f"{where} within {timeout.total_seconds():g}s{hint}") from e
        raise RuntimeError(f"{where}: {e}") from e  # e.g. the peer died


def _wait(work, verb: str, peer: int, name: str, step: str) -> None:
    """wait() for a collective's message, MINIDIST_TIMEOUT (read as it waits) or the run's."""
    wait(work, f"{name}: {step}: rank {dist.get_rank()} could not {verb} rank {peer}",
         timedelta(seconds=default_timeout_s(group_timeout().total_seconds())),
         "; did every rank call the same collective?")


def _exchange(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
              name: str, step: str) -> None:
    """Send `send` to rank dst while receiving `recv` from rank src, then wait for both.

    Posting both before waiting is what keeps a ring from deadlocking: if every rank
    first did a blocking send, each would wait for a neighbour that is itself sending.
    """
    works = []
    if recv is not None:
        works.append(("receive from", src, dist.irecv(recv, src)))
    if send is not None:
        works.append(("send to", dst, _isend(send, dst, name)))
    for verb, peer, w in works:
        _wait(w, verb, peer, name, step)


# ------------------------------------------------------------------ the two ring phases

def _ring_neighbours() -> tuple[int, int, int, int]:
    r, n = dist.get_rank(), dist.get_world_size()
    return r, n, (r + 1) % n, (r - 1) % n


def _send_recv_add(send: torch.Tensor, dst: int, acc: torch.Tensor, src: int, buf: torch.Tensor,
                   name: str, step: str) -> None:
    """One reduce-scatter step: send `send` to dst while receiving a tensor like `acc`
    from src into `buf`, then add it to acc."""
    _exchange(send, dst, buf, src, name, step)
    acc.add_(buf)


def _ring_reduce_scatter(chunks: list[torch.Tensor], name: str) -> None:
    """Sum chunk i over all ranks into chunks[i] of rank i (other chunks: partial sums)."""
    r, n, right, left = _ring_neighbours()
    if n == 1:
        return
    # one receive buffer for every step, as large as the largest chunk
    scratch = chunks[0].new_empty(max(c.numel() for c in chunks))
    for k in range(n - 1):
        # rank r passes on its partial sum of chunk r-k-1 and receives the partial sum of
        # chunk r-k-2, to which it adds its own; at the last step that chunk is r itself
        acc = chunks[(r - k - 2) % n]
        _send_recv_add(chunks[(r - k - 1) % n], right, acc, left, scratch[:acc.numel()],
                       name, f"reduce-scatter step {k + 1}/{n - 1}")


def _ring_all_gather(chunks: list[torch.Tensor], name: str) -> None:
    """Rank i holds the final chunks[i]; afterwards every rank holds all of them."""
    r, n, right, left = _ring_neighbours()
    for k in range(n - 1):
        # pass on the chunk that arrived last step (our own first); receive the next one
        _exchange(chunks[(r - k) % n], right, chunks[(r - k - 1) % n], left,
                  name, f"all-gather step {k + 1}/{n - 1}")


# ------------------------------------------------------------------ the four collectives

def _check_op(op: str, t: torch.Tensor) -> None:
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if op == "avg" and not t.is_floating_point():
        raise ValueError("op='avg' needs a floating-point tensor")


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of tensor, or a contiguous copy to work in and copy back."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


@torch.no_grad()
def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or average) `tensor` over all ranks, in place: a ring reduce-scatter followed
    by a ring all-gather over N chunks of the flattened tensor."""
    _check_op(op, tensor)
    n = dist.get_world_size()
    flat = _flat(tensor)
    chunks = list(torch.tensor_split(flat, n))  # views: the ring works inside `flat`
    _ring_reduce_scatter(chunks, "all_reduce")
    _ring_all_gather(chunks, "all_reduce")
    if op == "avg":
        flat.div_(n)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


@torch.no_grad()
def reduce_scatter(output: torch.Tensor, input, op: str = "sum") -> torch.Tensor:
    """output = the sum over ranks of this rank's block of `input`.

    `input` is a list of N tensors (block i goes to rank i, as torch's reduce_scatter) or
    one tensor of N * output.numel() elements (as torch's reduce_scatter_single). `input`
    is left unchanged, as torch leaves it: the ring works on a copy.
    """
    n, r = dist.get_world_size(), dist.get_rank()
    if isinstance(input, (list, tuple)):
        if len(input) != n:
            raise ValueError(f"reduce_scatter needs {n} input tensors (one per rank), got {len(input)}")
        chunks = [t.reshape(-1).clone() for t in input]
    else:
        if input.numel() != n * output.numel():
            raise ValueError(f"reduce_scatter input has {input.numel()} elements; it needs "
                             f"world_size * output.numel() = {n * output.numel()}")
        chunks = list(input.reshape(-1).clone().chunk(n))
    if chunks[r].numel() != output.numel():
        raise ValueError(f"rank {r}'s block has {chunks[r].numel()} elements, output {output.numel()}")
    _check_op(op, output)
    _ring_reduce_scatter(chunks, "reduce_scatter")
    output.view(-1).copy_(chunks[r])
    if op == "avg":
        output.div_(n)
    return output


@torch.no_grad()
def all_gather(output, input: torch.Tensor):
    """Every rank receives every rank's `input`: into a list of N tensors (as torch's
    all_gather) or into one tensor of N * input.numel() elements (as all_gather_single)."""
    n, r = dist.get_world_size(), dist.get_rank()
    if isinstance(output, (list, tuple)):
        if len(output) != n:
            raise ValueError(f"all_gather needs {n} output tensors (one per rank), got {len(output)}")
        chunks = [t.view(-1) for t in output]
    else:
        if output.numel() != n * input.numel():
            raise ValueError(f"all_gather output has {output.numel()} elements; it needs "
                             f"world_size * input.numel() = {n * input.numel()}")
        chunks = list(output.view(-1).chunk(n))
    chunks[r].copy_(input.reshape(-1))
    _ring_all_gather(chunks, "all_gather")
    return output


@torch.no_grad()
def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy rank src's `tensor` to every rank, in place.

    Scatter, then ring all-gather (van de Geijn's broadcast): src sends each rank one
    chunk, then the ring circulates them. Every link carries about (N-1)/N of the data
    once more, instead of src sending the whole tensor N-1 times.
    """
    r, n = dist.get_rank(), dist.get_world_size()
    if not 0 <= src < n:
        raise ValueError(f"src must be a rank in [0, {n}), got {src}")
    if n == 1:
        return tensor
    flat = _flat(tensor)
    chunks = list(torch.tensor_split(flat, n))
    if r == src:
        for dst in range(n):
            if dst != src:
                _exchange(chunks[dst], dst, None, dst, "broadcast", f"scatter to rank {dst}")
    else:
        _exchange(None, src, chunks[r], src, "broadcast", f"scatter from rank {src}")
    _ring_all_gather(chunks, "broadcast")
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


# ------------------------------------------------------------------ all-to-all

def isend(t: torch.Tensor, dst: int, name: str):
    """Post a send to global rank dst, counted under `name` (ring attention's messages)."""
    return _isend(t, dst, name)


def _blocks(t: torch.Tensor, sizes, n: int, what: str) -> list[torch.Tensor]:
    rows = t.shape[0] if t.dim() else 0
    sizes = [rows // n] * n if sizes is None and rows % n == 0 else sizes
    if sizes is None or len(sizes) != n or sum(sizes) != rows or min(sizes) < 0:
        raise ValueError(f"all_to_all: {what}_split_sizes must be {n} sizes >= 0 summing to {what}'s "
                         f"{rows} rows (dim 0; None splits evenly when {n} divides it), got {sizes}")
    return list(t.split(list(sizes)))


@torch.no_grad()
def all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
               input_split_sizes=None, group=None) -> torch.Tensor:
    """torch.distributed.all_to_all_single's meaning and calling shape: `input` cut along
    dim 0 (input_split_sizes rows, equal if None), block i to rank i of `group` (default:
    the world); block j of `output` (cut by output_split_sizes) comes from rank j.

    Pairwise exchange: at step s rank r sends to r+s while receiving from r-s, one block
    each way, N-1 steps; each rank sends all of `input` but its own block.
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ins, outs = _blocks(input, input_split_sizes, n, "input"), _blocks(output, output_split_sizes, n, "output")
    if output.dtype != input.dtype or ins[r].shape != outs[r].shape or not output.is_contiguous():
        raise ValueError(f"all_to_all: output must be contiguous, of input's dtype ({input.dtype}) and shape "
                         f"but dim 0, and keep as many rows as rank {r} sends itself ({ins[r].shape[0]})")
    outs[r].copy_(ins[r])
    peer = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
    for s in range(1, n):
        send, recv = ins[(r + s) % n].contiguous(), outs[(r - s) % n]
        _exchange(send if send.numel() else None, peer((r + s) % n),  # empty blocks: no message
                  recv if recv.numel() else None, peer((r - s) % n), "all_to_all", f"pairwise step {s}/{n - 1}")
    return output


# ------------------------------------------------------------------ the pipelined all-reduce

SEGMENT_BYTES = 1 << 20  # segment j is added while j+1 arrives (steps: minidist/comm_pipelined.py)


@torch.no_grad()
def all_reduce_pipelined(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """all_reduce's result, bit for bit, faster for large tensors: chunks in segments added
    as they land (comm_pipelined.pipelined_ring, through this module's counted messages)."""
    _check_op(op, tensor)
    r, n, right, left = _ring_neighbours()
    flat = _flat(tensor)
    name = "all_reduce_pipelined"
    pipelined_ring(list(torch.tensor_split(flat, n)), r, n, right, left, SEGMENT_BYTES,
                   lambda t, dst: _isend(t, dst, name),
                   lambda w, verb, peer, step: _wait(w, verb, peer, name, step),
                   lambda s, dst, recv, src, step: _exchange(s, dst, recv, src, name, step))
    if op == "avg":
        flat.div_(n)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
