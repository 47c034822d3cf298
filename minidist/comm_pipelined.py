"""The pipelined ring all-reduce's steps: chapter 02's ring (minidist/comm.py), with each
chunk in segments so that additions hide behind transfers, as gloo and NCCL pipeline theirs.
Chapter 02 (chapters/02_collectives.md). Exercised by `python -m minidist.bench collectives`
and by tests/test_comm.py through `minidist.comm.all_reduce_pipelined`.

comm.py imports this module, so this one cannot import comm: comm hands in its counted
send (`isend(t, dst)`), its named wait (`wait(work, verb, peer, step)`) and its exchange
(`exchange(send, dst, recv, src, step)`), and every message still goes through them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_scratch: dict = {}


def _scratch_like(t: torch.Tensor) -> torch.Tensor:
    """A receive buffer like t, kept across calls (a fresh one would page-fault in)."""
    buf = _scratch.get((t.dtype, t.device))
    if buf is None or buf.numel() < t.numel():
        buf = _scratch[t.dtype, t.device] = t.new_empty(max(t.numel(), 1024))
    return buf[:t.numel()]


def _segments(t: torch.Tensor, segment_bytes: int) -> list[torch.Tensor]:
    return list(t.split(max(1, segment_bytes // t.element_size())))


def pipelined_ring(chunks: list[torch.Tensor], rank: int, n: int, right: int, left: int,
                   segment_bytes: int, isend, wait, exchange) -> None:
    """all_reduce's ring on `chunks` (views of one flat tensor), bit for bit, faster for
    large tensors: (1) each reduce-scatter step posts all the segments of its chunk at
    once and adds each one as it lands, while later ones still arrive; (2) the first
    all-gather step rides on the last reduce-scatter step: each segment of chunk r goes
    on to the right as soon as its addition is done, not after the whole phase.

    Correctness rests on message order: on a link, receives match sends in posting
    order. In the last step every rank posts the reduce-scatter receives before the
    all-gather ones, and its neighbour posts the matching sends in the same order.
    """
    r = rank
    for k in range(n - 1):
        step = f"reduce-scatter step {k + 1}/{n - 1}"
        send, acc = chunks[(r - k - 1) % n], chunks[(r - k - 2) % n]
        bufs = _segments(_scratch_like(acc), segment_bytes)
        recvs = [dist.irecv(b, left) for b in bufs]
        sends = [isend(s, right) for s in _segments(send, segment_bytes)]
        last = k == n - 2  # acc is chunk r: after this step it is final
        if last:
            step += f" + all-gather step 1/{n - 1}"
            ag_recvs = [dist.irecv(s, left) for s in _segments(chunks[(r - 1) % n], segment_bytes)]
        for w, b, a in zip(recvs, bufs, _segments(acc, segment_bytes)):
            wait(w, "receive from", left, step)
            a.add_(b)
            if last:
                sends.append(isend(a, right))  # this segment of chunk r is final
        for w in ag_recvs if last else []:
            wait(w, "receive from", left, step)
        for w in sends:
            wait(w, "send to", right, step)
    for k in range(1, n - 1):  # the remaining all-gather steps, as in comm's _ring_all_gather
        exchange(chunks[(r - k) % n], right, chunks[(r - k - 1) % n], left,
                 f"all-gather step {k + 1}/{n - 1}")
