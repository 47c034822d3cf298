"""Collectives from point-to-point messages: ring all-reduce, reduce-scatter, all-gather
and broadcast, built on nothing but isend/irecv.

Chapter 02 (chapters/02_collectives.md). Exercised by `python -m minidist.bench collectives`
and by tests/test_comm.py.

Every function works in place and means what its torch.distributed namesake means, for
any world size (3 included) and any tensor size (sizes that do not divide by the world
size are cut into chunks that differ by at most one element).

The ring: rank r sends only to r+1 and receives only from r-1 (mod N). Cut the data into
N chunks. In the reduce-scatter phase each of N-1 steps passes one partial sum along and
adds to it, so after N-1 steps rank r holds chunk r summed over all ranks. In the
all-gather phase N-1 more steps pass the finished chunks around. Each rank sends
(N-1)/N of the data per phase, whatever N is: that is why the ring is bandwidth-optimal.

Half precision: a received bf16/fp16 chunk is added to the local one with torch's
elementwise add, which computes in fp32 and rounds once per hop, so a sum over N ranks
is rounded N-1 times, as NCCL does. The data travels in its own dtype (half the bytes
of fp32): accumulating in fp32 would double the traffic for a small gain in precision.

Counting: every byte sent goes through `_exchange`, which adds it to the counters of the
`count_bytes()` contexts that are open, per collective. Chapter 06 uses the same counts.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from minidist.dist import DEFAULT_TIMEOUT_S

_counters: list[Counter] = []


@contextmanager
def count_bytes():
    """Count the bytes this rank sends, per collective name, while the block runs:

        with count_bytes() as sent:
            all_reduce(t)
        sent["all_reduce"]  # bytes this rank put on the wire
    """
    c = Counter()
    _counters.append(c)
    try:
        yield c
    finally:
        _counters.remove(c)


def _timeout() -> timedelta:
    return timedelta(seconds=DEFAULT_TIMEOUT_S)


def _exchange(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
              what: str) -> None:
    """Send `send` to rank dst while receiving `recv` from rank src, then wait for both.

    Posting both before waiting is what keeps a ring from deadlocking: if every rank
    first did a blocking send, each would wait for a neighbour that is itself sending.
    """
    works = []
    if recv is not None:
        works.append(("receive from", src, dist.irecv(recv, src)))
    if send is not None:
        works.append(("send to", dst, dist.isend(send, dst)))
        for c in _counters:
            c[what.split(":")[0]] += send.numel() * send.element_size()
    for verb, peer, w in works:
        _wait(w, verb, peer, what)


def _wait(work, verb: str, peer: int, what: str) -> None:
    try:
        work.wait(_timeout())
    except RuntimeError as e:
        where = f"{what}: rank {dist.get_rank()} could not {verb} rank {peer}"
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise TimeoutError(f"{where} within {_timeout().total_seconds():.0f}s; did every "
                               f"rank call the same collective? ({e})") from e
        raise RuntimeError(f"{where}: {e}") from e  # e.g. the peer died


def _ring_neighbours() -> tuple[int, int, int, int]:
    r, n = dist.get_rank(), dist.get_world_size()
    return r, n, (r + 1) % n, (r - 1) % n


# Large chunks travel in segments: while segment j is being added, segment j+1 is still
# arriving, so the additions hide behind the transfer (as gloo and NCCL pipeline theirs).
SEGMENT_BYTES = 1 << 20
_scratch: dict = {}


def _scratch_like(t: torch.Tensor) -> torch.Tensor:
    """A receive buffer shaped like t, reused across calls: allocating a fresh one each
    step would page-fault new memory in on every message."""
    key = (t.dtype, t.device)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < t.numel():
        buf = _scratch[key] = torch.empty(max(t.numel(), 1024), dtype=t.dtype, device=t.device)
    return buf[:t.numel()]


def _send_recv_add(send: torch.Tensor, dst: int, acc: torch.Tensor, src: int, what: str) -> None:
    """Send `send` to dst while receiving a tensor like `acc` from src and adding it to acc."""
    buf = _scratch_like(acc)
    seg = max(1, SEGMENT_BYTES // acc.element_size())
    if acc.numel() <= seg:
        _exchange(send, dst, buf, src, what)
        acc.add_(buf)
        return
    # post every segment's receive and send, then add each segment as soon as it lands
    recvs = [dist.irecv(b, src) for b in buf.split(seg)]
    sends = [dist.isend(s, dst) for s in send.split(seg)]
    for c in _counters:
        c[what.split(":")[0]] += send.numel() * send.element_size()
    for w, b, a in zip(recvs, buf.split(seg), acc.split(seg)):
        _wait(w, "receive from", src, what)
        a.add_(b)
    for w in sends:
        _wait(w, "send to", dst, what)


def _ring_reduce_scatter(chunks: list[torch.Tensor], name: str) -> None:
    """Sum chunk i over all ranks into chunks[i] of rank i (other chunks: partial sums)."""
    r, n, right, left = _ring_neighbours()
    for k in range(n - 1):
        # rank r passes on its partial sum of chunk r-k-1 and receives the partial sum of
        # chunk r-k-2, to which it adds its own; at the last step that chunk is r itself
        _send_recv_add(chunks[(r - k - 1) % n], right, chunks[(r - k - 2) % n], left,
                       f"{name}: reduce-scatter step {k + 1}/{n - 1}")


def _ring_all_reduce(chunks: list[torch.Tensor], name: str) -> None:
    """Reduce-scatter then all-gather, with the first all-gather step riding on the last
    reduce-scatter step: each segment of the chunk this rank finishes is sent on to the
    right as soon as its addition is done, while later segments are still arriving.
    Without this, the all-gather would wait for the whole reduce-scatter to drain."""
    r, n, right, left = _ring_neighbours()
    for k in range(n - 2):  # every reduce-scatter step but the last
        _send_recv_add(chunks[(r - k - 1) % n], right, chunks[(r - k - 2) % n], left,
                       f"{name}: reduce-scatter step {k + 1}/{n - 1}")
    # last reduce-scatter step: send chunk r+1, receive and finish chunk r; first
    # all-gather step: send the finished chunk r, receive the finished chunk r-1
    send, own, nxt = chunks[(r + 1) % n], chunks[r], chunks[(r - 1) % n]
    buf = _scratch_like(own)
    seg = max(1, SEGMENT_BYTES // own.element_size())
    what = f"{name}: reduce-scatter step {n - 1}/{n - 1} + all-gather step 1/{n - 1}"
    # posting order is message order on each link: every rank posts the reduce-scatter
    # messages before the all-gather ones, so each receive matches its send
    rs_recvs = [dist.irecv(b, left) for b in buf.split(seg)]
    sends = [dist.isend(t, right) for t in send.split(seg)]
    ag_recvs = [dist.irecv(t, left) for t in nxt.split(seg)]
    for w, b, a in zip(rs_recvs, buf.split(seg), own.split(seg)):
        _wait(w, "receive from", left, what)
        a.add_(b)
        sends.append(dist.isend(a, right))  # this segment of chunk r is final: pass it on
    for c in _counters:
        c[name] += (send.numel() + own.numel()) * own.element_size()
    for w in ag_recvs:
        _wait(w, "receive from", left, what)
    for w in sends:
        _wait(w, "send to", right, what)
    for k in range(1, n - 1):  # the remaining all-gather steps
        _exchange(chunks[(r - k) % n], right, chunks[(r - k - 1) % n], left,
                  f"{name}: all-gather step {k + 1}/{n - 1}")


def _ring_all_gather(chunks: list[torch.Tensor], name: str) -> None:
    """Rank i holds the final chunks[i]; afterwards every rank holds all of them."""
    r, n, right, left = _ring_neighbours()
    for k in range(n - 1):
        # pass on the chunk that arrived last step (our own first); receive the next one
        _exchange(chunks[(r - k) % n], right, chunks[(r - k - 1) % n], left,
                  f"{name}: all-gather step {k + 1}/{n - 1}")


def _check_op(op: str, t: torch.Tensor) -> None:
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if op == "avg" and not t.is_floating_point():
        raise ValueError("op='avg' needs a floating-point tensor")


@torch.no_grad()
def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or average) `tensor` over all ranks, in place: a ring reduce-scatter followed
    by a ring all-gather over N chunks of the flattened tensor."""
    _check_op(op, tensor)
    n = dist.get_world_size()
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    if n > 1:
        chunks = list(torch.tensor_split(flat, n))  # views: the ring works inside `flat`
        _ring_all_reduce(chunks, "all_reduce")
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
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    chunks = list(torch.tensor_split(flat, n))
    if r == src:
        for dst in range(n):
            if dst != src:
                _exchange(chunks[dst], dst, None, dst, f"broadcast: scatter to rank {dst}")
    else:
        _exchange(None, src, chunks[r], src, f"broadcast: scatter from rank {src}")
    _ring_all_gather(chunks, "broadcast")
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
