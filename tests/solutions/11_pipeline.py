"""Exercise 11 solved the way chapter 11 teaches, written apart from minidist's module
(tests/test_exercises.py grades it: full marks)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _send(run, t, peer) -> None:
    if peer is not None:
        dist.send(t, peer, group=run.group)


def _recv(run, peer):
    """A fresh buffer per message: a received activation is kept until its backward."""
    if peer is None:
        return None
    buf = torch.empty(run.shape)
    dist.recv(buf, peer, group=run.group)
    return buf


def one_f_one_b(run, m: int) -> None:
    """1F1B of micro-batches 0 to m - 1 on stage run.stage of run.stages: the gradients of
    one process, 1F1B's order of forwards and backwards, and no deadlock for any m."""
    # The two messages that cross on a link (an activation down, a gradient up) are posted
    # in the same order by both ends: on every link the even stage sends first and the odd
    # one receives first, so each send meets its receive.
    even = run.stage % 2 == 0
    warmup = min(run.stages - run.stage - 1, m)
    for i in range(warmup):                       # warm-up: fill the stages below
        _send(run, run.forward(i, _recv(run, run.prev)), run.next)
    x = _recv(run, run.prev) if warmup < m else None
    for j in range(m - warmup):                   # steady: forward i, backward j (the oldest)
        i = warmup + j
        out = run.forward(i, x)
        if even:                                  # the pair on the link below
            _send(run, out, run.next)
            grad = _recv(run, run.next)
        else:
            grad = _recv(run, run.next)
            _send(run, out, run.next)
        g = run.backward(j, grad)
        more = i + 1 < m                          # the pair on the link above
        if even:
            _send(run, g, run.prev)
            x = _recv(run, run.prev) if more else None
        else:
            x = _recv(run, run.prev) if more else None
            _send(run, g, run.prev)
    for j in range(m - warmup, m):                # cool-down: the backwards left
        _send(run, run.backward(j, _recv(run, run.next)), run.prev)


def draft_gpipe(run, m: int) -> None:
    """FIND THE BUG. GPipe, as a colleague wrote it: every forward, then every backward,
    each message one blocking call. It finishes at every m, but its gradients are not
    always one process's. Fix it in place."""
    grad = torch.empty(run.shape) if run.next is not None else None  # used at once: one will do
    for i in range(m):
        x = None
        if run.prev is not None:  # a buffer per micro-batch: its forward saved it for backward
            x = torch.empty(run.shape)
            dist.recv(x, run.prev, group=run.group)
        out = run.forward(i, x)
        if run.next is not None:
            dist.send(out, run.next, group=run.group)
    for i in range(m):
        if run.next is not None:
            dist.recv(grad, run.next, group=run.group)
        g = run.backward(i, grad)
        if run.prev is not None:
            dist.send(g, run.prev, group=run.group)


# Where minidist implements each (adapters in the grader running minidist.pipeline's
# one_f_one_b and gpipe on this run); `--reference` grades these. Leave it as it is.
REFERENCE = {
    "one_f_one_b": "exercises.grader.checks_11:reference_one_f_one_b",
    "draft_gpipe": "exercises.grader.checks_11:reference_draft_gpipe",
}
